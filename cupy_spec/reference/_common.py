"""Shared pieces of the reference ops: how probabilities and coins are read, the walk of a draft
tree, and the final inverse-CDF sample from a residual row (with the measure of a rounding tie)."""

from __future__ import annotations

import torch

__all__ = ["effective_probs", "flush_subnormal", "clamp_coins", "residual", "sample_residual", "final_token_slack",
           "walk_trees", "FLT_MIN", "COIN_MAX"]

#: Smallest normal float32; anything below it (subnormals) counts as zero.
FLT_MIN = 1.1754943508222875e-38
#: Largest float32 below 1; coins are clamped to it.
COIN_MAX = 1.0 - 2.0**-24


def effective_probs(x: torch.Tensor) -> torch.Tensor:
    """Probabilities as the op reads them: NaN, +-inf, negative and subnormal values become 0."""
    return torch.where(torch.isfinite(x) & (x >= FLT_MIN), x, torch.zeros((), dtype=x.dtype, device=x.device))


def flush_subnormal(x: torch.Tensor) -> torch.Tensor:
    """Subnormal values become 0 (as with flush-to-zero); NaN and +-inf stay."""
    return torch.where(x.abs() < FLT_MIN, torch.zeros((), dtype=x.dtype, device=x.device), x)


def clamp_coins(c: torch.Tensor) -> torch.Tensor:
    """Coins clamped into [0, COIN_MAX]; NaN, negative and subnormal coins become 0."""
    return torch.where(c >= FLT_MIN, c.clamp(max=COIN_MAX), torch.zeros((), dtype=c.dtype, device=c.device))


def residual(target_rows: torch.Tensor, draft_rows: torch.Tensor | None) -> torch.Tensor:
    """``max(effective(target) - flush(draft), 0)`` in float32, with non-finite results counted as 0.

    target_rows, draft_rows: float32 [m, V] (draft_rows None means zeros). Returns float32 [m, V].
    """
    t = effective_probs(target_rows)
    if draft_rows is None:
        return t
    return effective_probs(t - flush_subnormal(draft_rows))


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


def links(x: torch.Tensor, n: int) -> torch.Tensor:
    """Tree links with everything outside [0, n) mapped to -1 ("none")."""
    return torch.where((x >= 0) & (x < n), x, torch.full_like(x, -1))


def walk_trees(accept_index, predicts, candidates, retrive_index, retrive_next_token, retrive_next_sibling,
               child_ok, root_ok, test, arrive=None, reject=None):
    """The walk that every tree verification op makes, vectorised over the batch.

    From the root, the children of the current node ``cur`` are tried in sibling order (a link
    outside ``[0, n)`` means none). A child seen before (a cycle, the root as a child) or with
    ``child_ok[b, c]`` False ends the request's walk. ``test(b, parent, c)`` (int64 [m] each)
    returns a bool [m]: which children are accepted. An accepted child's token is written at
    ``predicts[retrive_index[b, cur]]``, its index is appended to ``accept_index`` and it becomes
    ``cur``, then ``arrive(b, c)`` runs; the walk stops after ``S - 1`` accepted tokens (S =
    ``accept_index.shape[1]``). A rejected child calls ``reject(b, parent, c)`` and its next sibling
    is tried. Requests whose root fails ``root_ok`` [bs] do not walk. Also writes
    ``accept_index[:, 0]`` (the root's index); nothing else.

    Returns int64 [bs] each: ``cur`` (the last accepted node), ``count`` (accepted draft tokens) and
    ``last = retrive_index[b, cur]``.
    """
    bs, n = candidates.shape
    S = accept_index.shape[1]
    dev = candidates.device
    ar = torch.arange(bs, device=dev)
    next_token, next_sibling = links(retrive_next_token, n), links(retrive_next_sibling, n)
    accept_index[:, 0] = retrive_index[:, 0].to(torch.int32)
    cur = torch.zeros(bs, dtype=torch.long, device=dev)
    count = torch.zeros(bs, dtype=torch.long, device=dev)
    last = retrive_index[:, 0].clone()
    visited = torch.zeros(bs, n, dtype=torch.bool, device=dev)
    visited[:, 0] = True
    child = torch.where(root_ok & (S > 1), next_token[:, 0], torch.full_like(cur, -1))
    while True:
        active = (child >= 0) & ~visited[ar, child.clamp(min=0)]
        b = ar[active]
        if b.numel() == 0:
            return cur, count, last
        c = child[active]
        visited[b, c] = True
        ok = child_ok[b, c]
        child[b[~ok]] = -1  # malformed child: the walk ends here
        b, c = b[ok], c[ok]
        parent = cur[b]
        accept = test(b, parent, c)

        ba, ca = b[accept], c[accept]
        predicts[last[ba]] = candidates[ba, ca].to(torch.int32)
        count[ba] += 1
        accept_index[ba, count[ba]] = retrive_index[ba, ca].to(torch.int32)
        last[ba] = retrive_index[ba, ca]
        cur[ba] = ca
        if arrive is not None:
            arrive(ba, ca)
        child[ba] = torch.where(count[ba] >= S - 1, torch.full_like(ca, -1), next_token[ba, ca])

        br, cr = b[~accept], c[~accept]
        if reject is not None:
            reject(br, parent[~accept], cr)
        child[br] = next_sibling[br, cr]
