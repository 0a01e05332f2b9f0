"""Pure-torch reference of ``chain_speculative_sampling`` (API of FlashInfer's
``flashinfer.sampling.chain_speculative_sampling``, with explicit coins).

This module states the semantics of the op; the CUDA kernel must match it bit for bit (the final
token may differ only where the sampling coin lies within float32 rounding of a prefix-sum
boundary, which :func:`cupy_spec.reference.final_token_slack` measures on the rows that
``return_residual=True`` returns). It runs on any torch device, vectorised over the batch.
The rule and why it is lossless: ``docs/draft_probability_sampling.md``.

Per request ``b`` with k draft tokens (``p_i = target_probs[b, i]``, ``q_i = draft_probs[b, i]``,
``x_i = draft_token_ids[b, i]``, ``u_i = uniform_samples[b, i]``); arithmetic is IEEE float32
with subnormal results flushed to zero (the kernels are built with ``-ftz=true --fmad=false``):

* Probabilities (target and draft alike) are read through :func:`effective_probs`: NaN, +-inf,
  negative and subnormal values count as 0. Coins are clamped into [0, 1) by :func:`clamp_coins`.
* Position i *passes* iff ``0 <= x_i < V`` and ``flush(u_i * q_i[x_i]) < p_i[x_i]`` (one float32
  multiply, no division). Hence a token with ``p_i[x_i] = 0`` never passes; a token with
  ``q_i[x_i] = 0 < p_i[x_i]`` always passes; ``p_i[x_i] >= q_i[x_i] > 0`` always passes (u < 1).
  A draft id outside [0, V) never passes and is never used as an index.
* ``e`` (emitted) = number of leading positions that pass; ``a`` (accepted) = number of all
  positions that pass, each tested with its own coin whether or not an earlier one failed.
* The token after the e accepted drafts is drawn with coin ``u_k = uniform_samples[b, k]`` by
  :func:`sample_residual` (prefix sums in float64 rounded to float32, ``u = u_k * total``, the
  first index with prefix > u and r > 0) from the row r:

  - e == k (every draft accepted): ``r = p_k`` (the bonus row);
  - x_e outside [0, V): ``r = p_e`` (no draft was tested, so nothing is subtracted);
  - otherwise ``r[v] = effective(p_e[v] - q_e[v])`` elementwise in float32, i.e. ``max(p - q, 0)``
    with subnormal differences counted as 0; if that row is all zero (possible only for inputs
    that are not distributions, e.g. p = q and a drafted token both give probability 0), ``r = p_e``.

  A row that is still all zero gives token ``V - 1`` (the rule of :func:`sample_residual`).
* ``output_token_ids[b] = [x_0, ..., x_{e-1}, token, -1, ..., -1]`` (int32, length k + 1).
* ``e`` and ``a`` are **added** into the caller's int32 counters when given (else into zeros).
"""

from __future__ import annotations

import torch

from ._common import clamp_coins, effective_probs, flush_subnormal, sample_residual

__all__ = ["chain_speculative_sampling"]


def _gather(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``effective(rows[b, i, ids[b, i]])`` for float32 rows [bs, k, V] and in-range ids [bs, k]."""
    return effective_probs(rows.gather(2, ids.unsqueeze(2)).squeeze(2))


def _passes(draft_probs, ids, target_probs, coins):
    """Per-position test, bool [bs, k]: id in [0, V) and ``flush(u * q[x]) < p[x]``."""
    k, V = ids.shape[1], target_probs.shape[2]
    valid = (ids >= 0) & (ids < V)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    p = _gather(target_probs[:, :k], safe)
    q = _gather(draft_probs, safe)
    return valid & (flush_subnormal(coins[:, :k] * q) < p)


def _final_rows(draft_probs, ids, target_probs, emitted):
    """Rows [bs, V] the final token is drawn from (see the module docstring)."""
    bs, k = ids.shape
    V = target_probs.shape[2]
    ar = torch.arange(bs, device=ids.device)
    p = effective_probs(target_probs[ar, emitted])
    if k == 0:
        return p
    at = emitted.clamp(max=k - 1)
    x = ids[ar, at]
    subtract = (emitted < k) & (x >= 0) & (x < V)
    r = effective_probs(p - effective_probs(draft_probs[ar, at]))
    r = torch.where(subtract[:, None], r, p)
    return torch.where((r > 0).any(dim=1, keepdim=True), r, p)


def _counter(given, values: torch.Tensor) -> torch.Tensor:
    """Adds ``values`` into the caller's counter (int32 [bs], mutated) or returns them as a new one."""
    if given is None:
        return values.to(torch.int32)
    given.add_(values.to(given.dtype))
    return given


def chain_speculative_sampling(
    draft_probs,
    draft_token_ids,
    target_probs,
    maybe_output_accepted_token_num=None,
    maybe_output_emitted_draft_token_num=None,
    deterministic=True,
    *,
    uniform_samples,
    return_residual=False,
):
    """Reference implementation; same arguments and results as the public op, coins explicit.

    Args (bs requests, k draft tokens each, vocabulary V >= 1):
        draft_probs: float32 [bs, k, V]: row i = draft distribution x_i was drawn from.
        draft_token_ids: int32 [bs, k] (any integer dtype is read): the draft tokens.
        target_probs: float32 [bs, k + 1, V]: row i = target distribution at position i
            (row k for the bonus token).
        maybe_output_accepted_token_num: int32 [bs] or None; **mutated**: the number of positions
            that pass their test on their own is added into it.
        maybe_output_emitted_draft_token_num: int32 [bs] or None; **mutated**: the number of
            accepted (emitted) draft tokens is added into it.
        deterministic: accepted for API compatibility; the reference is always deterministic.
        uniform_samples: float32 [bs, k + 1]: coins ``[:, :k]`` for the k tests, ``[:, k]`` for
            the final sample (the public op draws them with its generator).
        return_residual: also return ``(r, coin)``: the float32 [bs, V] rows the final token was
            drawn from and the clamped final coins, for :func:`final_token_slack`.

    Returns ``(output_token_ids int32 [bs, k + 1], accepted int32 [bs], emitted int32 [bs])``;
    the counters are the caller's tensors when given. Inputs are not modified.
    """
    bs, k = draft_token_ids.shape
    dev = draft_token_ids.device
    ids = draft_token_ids.long()
    coins = clamp_coins(uniform_samples.float())
    passed = _passes(draft_probs.float(), ids, target_probs.float(), coins)
    emitted = passed.long().cumprod(dim=1).sum(dim=1)
    accepted = passed.long().sum(dim=1)

    r = _final_rows(draft_probs.float(), ids, target_probs.float(), emitted)
    token = sample_residual(r, coins[:, k])
    col = torch.arange(k + 1, device=dev)[None, :]
    padded = torch.cat([ids, torch.zeros(bs, 1, dtype=ids.dtype, device=dev)], dim=1)
    out = torch.where(col < emitted[:, None], padded, torch.full_like(padded, -1))
    out = torch.where(col == emitted[:, None], token[:, None], out).to(torch.int32)

    acc = _counter(maybe_output_accepted_token_num, accepted)
    emi = _counter(maybe_output_emitted_draft_token_num, emitted)
    if return_residual:
        return out, acc, emi, r, coins[:, k]
    return out, acc, emi
