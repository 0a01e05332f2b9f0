"""Pure-torch reference of ``verify_tree_greedy`` (greedy verification, temperature 0).

The CUDA kernel must match it exactly: every output is an integer. It is also the CPU backend and
runs on any torch device, vectorised over the batch.

Per request ``b``, with ``n`` nodes, ``S = accept_index.shape[1]`` and ``T = bs * n``:

* ``target_predict`` is read as one flat array of ``T`` entries: the token the target model
  predicts after node ``i`` of request ``b`` is ``want(b, i) = target_predict.flatten()[retrive_index[b, i]]``
  (the global index of the node, as sglang's op reads it; normally ``b * n + i``).
* A node's index is *valid* when ``0 <= retrive_index[b, i] < min(len(predicts), T)``.
* ``accept_index[b, 0] = retrive_index[b, 0]``. If the root's index is not valid, only that and
  ``accept_token_num[b] = 0`` are written.
* The walk starts at the root. At each level it tries the children of the current node ``cur`` in
  sibling order and accepts the first child ``c`` with ``candidates[b, c] == want(b, cur)``: then
  ``predicts[retrive_index[b, cur]] = candidates[b, c]``, ``c`` is appended to ``accept_index`` and
  becomes ``cur``. The walk stops when no child matches, after ``S - 1`` accepted nodes, or at a
  malformed node: a link outside ``[0, n)`` means "none"; a node seen before (cycles, the root as a
  child) or a child whose index is not valid ends the walk.
* ``accept_token_num[b]`` = accepted nodes; ``predicts[retrive_index[b, cur]] = want(b, cur)`` at
  the last accepted node ``cur`` (the correction token, or the bonus token after ``S - 1`` accepts).
* Nothing else is written: ``accept_index`` entries after the path and ``predicts`` entries of
  nodes off the path keep their contents. Tokens are stored as int32 (two's-complement truncation).
"""

from __future__ import annotations

import torch

from ._common import walk_trees

__all__ = ["verify_tree_greedy"]


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                       retrive_next_sibling, target_predict):
    """Reference implementation; same arguments and in-place outputs as the public op.

    Inputs are assumed validated (see :func:`cupy_spec.check.verify_tree_greedy` for a full check)."""
    bs, n = candidates.shape
    if bs == 0:
        return
    index_ok = (retrive_index >= 0) & (retrive_index < min(predicts.shape[0], bs * n))
    want = target_predict.reshape(-1)[torch.where(index_ok, retrive_index, 0)]  # [bs, n]; used where valid
    root_ok = index_ok[:, 0]

    def test(b, parent, c):  # the first child whose token is the target's argmax after the parent
        return candidates[b, c] == want[b, parent]

    cur, count, last = walk_trees(accept_index, predicts, candidates, retrive_index, retrive_next_token,
                                  retrive_next_sibling, index_ok, root_ok, test)
    accept_token_num.copy_(count.to(torch.int32))
    fin = root_ok.nonzero()[:, 0]
    predicts[last[fin]] = want[fin, cur[fin]].to(torch.int32)
