"""Pure-torch reference of ``tree_speculative_sampling_target_only``.

This module states the semantics of the op; the CUDA kernel must match it bit for bit (the final
token may differ only where the sampling coin lies within float32 rounding of a prefix-sum
boundary, which :func:`cupy_spec.reference.final_token_slack` measures). It is also the CPU backend and runs on any
torch device, vectorised over the batch.

Per request ``b`` (all arithmetic in float32, as on the GPU):

* Probabilities are read through :func:`effective_probs`: NaN, +-inf, negative and subnormal
  values count as 0. Coins are clamped into [0, 1) by :func:`clamp_coins` (NaN and subnormal coins -> 0).
* The walk starts at node 0 with ``coin = uniform_samples[b, 0]`` and ``acc = 0``. At each level
  it visits the children of the current node in sibling order; child ``c`` with token ``t`` and
  ``p = target_probs[b, cur, t]`` adds ``p`` to ``acc`` and is accepted iff
  ``p > 0 and (coin < acc / max(threshold_acc, 1e-9) or p >= threshold_single)``.
  A rejected child sets ``draft_probs[b, cur, t] = target_probs[b, cur, t]``.
* Malformed trees end the walk where they are found: a link outside ``[0, n)`` means "none", a
  node seen before (cycles, the root as a child) or a child whose token is outside ``[0, V)`` or
  whose ``retrive_index`` is outside ``[0, len(predicts))`` stops the request's walk. A root whose
  ``retrive_index`` is out of range writes only ``accept_index[b, 0]`` and ``accept_token_num[b] = 0``.
* The final token is drawn from the residual at the last accepted node (:func:`sample_residual`).
"""

from __future__ import annotations

import torch

from ._common import clamp_coins, effective_probs, residual, sample_residual, walk_trees

__all__ = ["tree_speculative_sampling_target_only"]

_FLT_MIN_GUARD = 1e-9  # lower clamp of threshold_acc


def tree_speculative_sampling_target_only(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single=1.0,
    threshold_acc=1.0,
    deterministic=True,
    *,
    return_residual=False,
):
    """Reference implementation; same arguments and in-place outputs as the public op.

    Inputs are assumed validated (see :func:`cupy_spec.check_inputs` for a full check).
    ``draft_probs`` may be None (zeros that are never written). With ``return_residual=True`` it
    returns ``(r, coin)``: the float32 [bs, V] residual rows the final token was drawn from and the
    clamped final coins, for :func:`final_token_slack` (rows of requests whose root index is out of
    range are meaningless); otherwise None.
    """
    bs, n = candidates.shape
    if bs == 0:
        return None
    V = target_probs.shape[2]
    P = predicts.shape[0]
    dev = candidates.device
    ar = torch.arange(bs, device=dev)

    index_ok = (retrive_index >= 0) & (retrive_index < P)
    child_ok = (candidates >= 0) & (candidates < V) & index_ok
    root_ok = index_ok[:, 0]
    coins = clamp_coins(uniform_samples)
    thr_single = torch.tensor(threshold_single, dtype=torch.float32, device=dev)
    thr_acc = torch.tensor(max(threshold_acc, _FLT_MIN_GUARD), dtype=torch.float32, device=dev)
    coin = coins[:, 0].clone()  # the coin of the current node tests its children
    acc = torch.zeros(bs, dtype=torch.float32, device=dev)  # probability of the children tried so far
    rej_b, rej_node, rej_tok = [], [], []

    def test(b, parent, c):
        p = effective_probs(target_probs[b, parent, candidates[b, c]])
        acc[b] += p
        return (p > 0) & ((coin[b] < acc[b] / thr_acc) | (p >= thr_single))

    def arrive(b, c):
        coin[b] = coins[b, c]
        acc[b] = 0

    def reject(b, parent, c):
        t = candidates[b, c]
        if draft_probs is not None:
            draft_probs[b, parent, t] = target_probs[b, parent, t]
        rej_b.append(b)
        rej_node.append(parent)
        rej_tok.append(t)

    cur, count, last = walk_trees(accept_index, predicts, candidates, retrive_index, retrive_next_token,
                                  retrive_next_sibling, child_ok, root_ok, test, arrive, reject)
    S = accept_index.shape[1]
    accept_token_num.copy_(count.to(torch.int32))
    fin = ar[root_ok]
    bonus = count == S - 1
    rows = target_probs[ar, cur]
    r = residual(rows, None if draft_probs is None else draft_probs[ar, cur])
    r = torch.where(bonus[:, None], effective_probs(rows), r)
    if rej_b:
        # Rejected children of the final node are excluded from its residual.
        br, pr, tr = torch.cat(rej_b), torch.cat(rej_node), torch.cat(rej_tok)
        at_final = pr == cur[br]
        r[br[at_final], tr[at_final]] = 0.0
    final_coin = clamp_coins(uniform_samples_for_final_sampling)
    tokens = sample_residual(r, final_coin)
    predicts[last[fin]] = tokens[fin].to(torch.int32)
    return (r, final_coin) if return_residual else None
