"""Shared pieces of the reference ops: how probabilities and coins are read, and the final
inverse-CDF sample from a residual row (with the measure of a rounding tie)."""

from __future__ import annotations

import torch

__all__ = ["effective_probs", "flush_subnormal", "clamp_coins", "residual", "sample_residual", "final_token_slack",
           "FLT_MIN", "COIN_MAX"]

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
    """Coins clamped into [0, COIN_MAX]; NaN and negative coins become 0."""
    return torch.where(c >= 0, c.clamp(max=COIN_MAX), torch.zeros((), dtype=c.dtype, device=c.device))


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
