"""Pure-torch reference of ``tree_speculative_sampling_target_only``.

This module states the semantics of the op; the CUDA kernel must match it bit for bit (the final
token may differ only where the sampling coin lies within float32 rounding of a prefix-sum
boundary, which :func:`cupy_spec.reference.final_token_slack` measures). It is also the CPU backend and runs on any
torch device, vectorised over the batch.

Per request ``b`` (all arithmetic in float32, as on the GPU):

* Probabilities are read through :func:`effective_probs`: NaN, +-inf, negative and subnormal
  values count as 0. Coins are clamped into [0, 1) by :func:`clamp_coins` (NaN -> 0).
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

from ._common import clamp_coins, effective_probs, residual, sample_residual

__all__ = ["tree_speculative_sampling_target_only"]

_FLT_MIN_GUARD = 1e-9  # lower clamp of threshold_acc


def _links(x: torch.Tensor, n: int) -> torch.Tensor:
    """Tree links with everything outside [0, n) mapped to -1 ("none")."""
    return torch.where((x >= 0) & (x < n), x, torch.full_like(x, -1))


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
    S = accept_index.shape[1]
    V = target_probs.shape[2]
    P = predicts.shape[0]
    dev = candidates.device
    ar = torch.arange(bs, device=dev)

    next_token = _links(retrive_next_token, n)
    next_sibling = _links(retrive_next_sibling, n)
    token_ok = (candidates >= 0) & (candidates < V)
    index_ok = (retrive_index >= 0) & (retrive_index < P)
    child_ok = token_ok & index_ok
    coins = clamp_coins(uniform_samples)
    thr_single = torch.tensor(threshold_single, dtype=torch.float32, device=dev)
    thr_acc = torch.tensor(max(threshold_acc, _FLT_MIN_GUARD), dtype=torch.float32, device=dev)

    root_ok = index_ok[:, 0]
    accept_index[:, 0] = retrive_index[:, 0].to(torch.int32)
    cur = torch.zeros(bs, dtype=torch.long, device=dev)
    count = torch.zeros(bs, dtype=torch.long, device=dev)
    last = retrive_index[:, 0].clone()
    coin = coins[:, 0].clone()
    acc = torch.zeros(bs, dtype=torch.float32, device=dev)
    visited = torch.zeros(bs, n, dtype=torch.bool, device=dev)
    visited[:, 0] = True
    child = torch.where(root_ok & (S > 1), next_token[:, 0], torch.full_like(cur, -1))
    rej_b, rej_node, rej_tok = [], [], []

    while True:
        safe = child.clamp(min=0)
        active = (child >= 0) & ~visited[ar, safe]
        b = ar[active]
        if b.numel() == 0:
            break
        c = child[active]
        visited[b, c] = True
        ok = child_ok[b, c]
        child[b[~ok]] = -1  # malformed child: the walk ends here
        b, c = b[ok], c[ok]
        t = candidates[b, c]
        parent = cur[b]
        raw = target_probs[b, parent, t]
        p = effective_probs(raw)
        acc_b = acc[b] + p
        acc[b] = acc_b
        accept = (p > 0) & ((coin[b] < acc_b / thr_acc) | (p >= thr_single))

        ba, ca = b[accept], c[accept]
        predicts[last[ba]] = t[accept].to(torch.int32)
        count[ba] += 1
        accept_index[ba, count[ba]] = retrive_index[ba, ca].to(torch.int32)
        last[ba] = retrive_index[ba, ca]
        cur[ba] = ca
        coin[ba] = coins[ba, ca]
        acc[ba] = 0
        child[ba] = torch.where(count[ba] >= S - 1, torch.full_like(ca, -1), next_token[ba, ca])

        reject = ~accept
        br, pr, tr = b[reject], parent[reject], t[reject]
        if draft_probs is not None:
            draft_probs[br, pr, tr] = raw[reject]
        rej_b.append(br)
        rej_node.append(pr)
        rej_tok.append(tr)
        child[br] = next_sibling[br, c[reject]]

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
