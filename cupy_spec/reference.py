"""Pure-torch reference of ``tree_speculative_sampling_target_only``.

This module states the semantics of the op; the CUDA kernel must match it bit for bit (the final
token may differ only where the sampling coin lies within float32 rounding of a prefix-sum
boundary, which :func:`final_token_slack` measures). It is also the CPU backend and runs on any
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

__all__ = [
    "tree_speculative_sampling_target_only",
    "effective_probs",
    "clamp_coins",
    "residual",
    "sample_residual",
    "final_token_slack",
    "FLT_MIN",
    "COIN_MAX",
]

#: Smallest normal float32; anything below it (subnormals) counts as zero.
FLT_MIN = 1.1754943508222875e-38
#: Largest float32 below 1; coins are clamped to it.
COIN_MAX = 1.0 - 2.0**-24
_FLT_MIN_GUARD = 1e-9  # lower clamp of threshold_acc


def effective_probs(x: torch.Tensor) -> torch.Tensor:
    """Probabilities as the op reads them: NaN, +-inf, negative and subnormal values become 0."""
    return torch.where(torch.isfinite(x) & (x >= FLT_MIN), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _flush_subnormal(x: torch.Tensor) -> torch.Tensor:
    """Subnormal values become 0 (as with flush-to-zero); NaN and +-inf stay."""
    return torch.where(x.abs() < FLT_MIN, torch.zeros((), dtype=x.dtype, device=x.device), x)


def clamp_coins(c: torch.Tensor) -> torch.Tensor:
    """Coins clamped into [0, COIN_MAX]; NaN and negative coins become 0."""
    return torch.where(c >= 0, c.clamp(max=COIN_MAX), torch.zeros((), dtype=c.dtype, device=c.device))


def residual(target_rows: torch.Tensor, draft_rows: torch.Tensor | None) -> torch.Tensor:
    """``max(effective(target) - flush(draft), 0)`` in float32, with non-finite results counted as 0.

    target_rows, draft_rows: float32 [m, V] (draft_rows None means zeros). Returns float32 [m, V].
    """
    t = effective_probs(target_rows)
    if draft_rows is None:
        return t
    return effective_probs(t - _flush_subnormal(draft_rows))


def sample_residual(r: torch.Tensor, coin: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from residual rows.

    r: float32 [m, V], entries >= 0. coin: float32 [m], already clamped. Returns int64 [m].
    Prefix sums ``P`` are exact sums rounded to float32; ``u = coin * P[V-1]`` (float32). The token
    is the first index with ``P > u`` and ``r > 0``; if none, the last index with ``r > 0``; if the
    row is all zero, ``V - 1``.
    """
    m, V = r.shape
    prefix = torch.cumsum(r.double(), dim=1).float()
    u = coin * prefix[:, -1]
    positive = r > 0
    hit = (prefix > u[:, None]) & positive
    first_hit = hit.int().argmax(dim=1)
    last_positive = (V - 1) - positive.flip(1).int().argmax(dim=1)
    fallback = torch.where(positive.any(dim=1), last_positive, torch.full_like(last_positive, V - 1))
    return torch.where(hit.any(dim=1), first_hit, fallback)


def final_token_slack(r: torch.Tensor, coin: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """How far ``u`` lies outside ``token``'s prefix-sum interval, relative to the row total.

    Computed in float64: ``u = coin * sum(r)`` and the interval of token k is
    ``[P[k] - r[k], P[k]]``. Returns float64 [m]: 0 when the token is exactly right, a tiny value
    (~1e-7) for a genuine rounding tie, ``inf`` for a token with zero residual (unless the whole row
    is zero and the token is V-1, which gives 0). r: float32 [m, V]; coin: [m]; token: int [m].
    """
    r64 = r.double()
    prefix = torch.cumsum(r64, dim=1)
    total = prefix[:, -1]
    u = coin.double() * total
    k = token.long().clamp(0, r.shape[1] - 1).unsqueeze(1)
    hi = prefix.gather(1, k).squeeze(1)
    lo = hi - r64.gather(1, k).squeeze(1)
    scale = torch.where(total > 0, total, torch.ones_like(total))
    slack = (torch.relu(lo - u) + torch.relu(u - hi)) / scale
    rk = r64.gather(1, k).squeeze(1)
    all_zero = total <= 0
    ok_zero = all_zero & (token.long() == r.shape[1] - 1)
    bad = ((rk <= 0) & ~ok_zero) | (token.long() < 0) | (token.long() >= r.shape[1])
    slack = torch.where(ok_zero, torch.zeros_like(slack), slack)
    return torch.where(bad, torch.full_like(slack, float("inf")), slack)


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
