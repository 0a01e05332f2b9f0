"""Pure-torch reference of ``tree_speculative_sampling_from_logits``: target-only tree verification
that starts from the target model's logits and applies temperature, top-k, top-p and min-p itself.

The op is the plain composition

    rows = filter(softmax(logits / T))            per request: temperature, top-k, top-p, min-p
    tree_speculative_sampling_target_only(..., target_probs=rows, draft_probs=None, thresholds)

and this module states it. :func:`filtered_probs` gives the rows (float64, the exact values up to
float64 rounding); the op rounds them to float32 and runs
:func:`cupy_spec.reference.tree_speculative_sampling_target_only` on them, so every rule of that op
(coins, thresholds, malformed trees, the final inverse-CDF sample, the all-zero row giving
``V - 1``) carries over unchanged. It is also the CPU backend and runs on any torch device.

Arguments: ``target_logits`` [bs, n, V] float32, bfloat16 or float16 (after the caller's penalties
and grammar masks; masked tokens are -inf); ``temperatures`` [bs] float32; ``top_ks`` [bs] int32,
``top_ps`` [bs] float32 and ``min_ps`` [bs] float32, each optional (None: off for every request).
The other arguments and the in-place outputs are those of the target-only op.

Semantics of one row (request ``b``, node ``i``), in exact real arithmetic
------------------------------------------------------------------------------------------------

1. **Reading.** ``x = float32(logit)`` (exact for all three dtypes); NaN counts as -inf.
2. **Greedy requests.** A request is greedy iff ``not (T >= 1e-6)`` compared in float32 (T = 0,
   negative, NaN or below 1e-6: :data:`GREEDY_TEMPERATURE`). Its rows are one-hot at
   ``argmax(x)``, the first maximal index as ``torch.argmax`` (so a row that is all -inf gives
   token 0). top-k/top-p/min-p do not apply. Through the target-only walk this is exactly greedy
   tree verification: the accepted child at each node is the first child (in sibling order) whose
   token is the row's argmax (probability 1 is accepted whatever the coin and thresholds in
   [0, 1]); every other child has probability 0 and is rejected; the correction or bonus token is
   the argmax of the final node's row. Mixed batches need no second call.
3. **Weights** (sampling requests, ``T >= 1e-6``, ``T = +inf`` allowed):
   ``m = max(x)``. If some ``x`` is +inf, ``w = 1`` on the +inf tokens and 0 elsewhere (they share
   all the mass: the limit of the softmax). Otherwise ``w = exp((x - m) / T)`` for finite ``x`` and
   ``w = 0`` for ``x = -inf`` (with ``T = +inf``: ``w = 1`` on every finite token, the uniform
   limit). A row that is all -inf has ``w = 0`` everywhere. ``w <= 1`` and the max token has
   ``w = 1``. Probabilities are ``w / Z`` with ``Z`` the sum of ``w`` over the kept tokens.
4. **Filters**, in this order, each keeping every token tied with its boundary (ties are between
   equal logits; exp is strictly increasing, so in exact arithmetic ordering tokens by logit and by
   probability is the same thing, and the kept sets are prefixes of the tokens sorted by ``x``):

   * top-k (active iff ``0 < top_k < V``): keep ``x >= x_(k)``, the k-th largest logit counted
     with multiplicity. This is an exact comparison of logits: no rounding is involved.
   * top-p on the top-k distribution (active iff ``top_p < 1``; NaN or ``>= 1``: off): with
     ``Z1`` the mass kept by top-k and ``v_1 > v_2 > ...`` its distinct logits,
     ``M_j = (sum of w over x >= v_j) / Z1``; keep ``x >= v_J`` for the first ``J`` with
     ``M_j >= top_p`` (the largest threshold whose kept mass reaches ``top_p``; ``top_p <= 0``
     keeps the maximal level only).
   * min-p on the top-p distribution (active iff ``min_p > 0``; NaN or ``<= 0``: off; values
     above 1 count as 1): keep ``p(x) >= min_p * max p``. The max token survives top-k and top-p,
     so ``p(x) / max p = w(x)`` and the test is ``w >= min_p``, i.e.
     ``(x - m) / T >= ln(min_p)``; renormalisation does not change it.

   The kept set always holds the maximal level, so a row with ``Z > 0`` never empties. The
   result is one logit threshold: keep ``x >= max(x_(k), v_J, min-p level)`` and ``w > 0``.
5. **Rows for the walk**: ``float32(w / Z)`` on kept tokens, 0 elsewhere (0 everywhere if
   ``Z = 0``). The walk reads them as the target-only op does, so values below FLT_MIN count as 0.

What a GPU kernel must reproduce, exactly or within :data:`REL_TOL`
------------------------------------------------------------------------------------------------

A kernel computes exp and the row sums in float32 in its own order, so its probabilities differ
from these by a few units of 1e-7 relative; bit equality is neither possible nor required.
**Exact** (no tolerance): reading (NaN, +-inf), the greedy rule and argmax with its tie-break, the
top-k threshold and every tie rule (comparisons of logits), the tree walk's structure (which
children are visited, malformed trees), which output entries are written, all-zero rows
(``V - 1``), tokens in ``[0, V)``. **Within tolerance** (decisions may differ only at documented
ties, and then the rest of the walk follows the kernel's decision):

* an accept test ``coin < acc / thr_acc`` whose two sides differ by at most ``REL_TOL`` relative
  (``|coin * thr_acc - acc| <= REL_TOL * max(coin * thr_acc, acc) + TINY_PROB``), and
  ``p >= threshold_single`` with ``p`` within ``REL_TOL`` relative of the threshold;
* the top-p boundary: a level ``j`` may be chosen as ``J`` when some ``M`` perturbed by at most
  ``REL_TOL`` (absolute; ``M`` is in [0, 1]) makes it the first crossing;
* the min-p boundary: tokens with ``|w - min_p| <= REL_TOL * min_p`` may fall either side;
* probabilities below :data:`TINY_PROB` may be 0 or not (float32 underflow and the FLT_MIN flush);
* the final token: ``u = coin * sum(r)`` may miss the token's prefix interval of the residual
  ``r`` by at most ``REL_TOL`` of ``sum(r)`` (:func:`cupy_spec.reference.final_token_slack`).

``REL_TOL = 1e-5`` is what a float32 kernel can guarantee and what the tests allow: relative error
of ``w`` at most ``|a| * 2^-23 + 2 ulp`` for ``a = (x - m) / T`` (subtract first, then scale: the
difference is exact for bf16/fp16 logits and close ones in float32, and scaling ``x / T`` before
subtracting would lose ``|x / T| * 2^-24`` absolutely, up to 1% for T = 0.01 and logits of 1000),
plus the sum's error, about (serial chain length + tree depth) * 2^-24 (keep serial chains under
~64 terms: 4e-6); min-p compared as ``a >= ln(min_p)`` loses only ``|ln min_p| * 2^-23``. The
accept decisions of two implementations then agree except on a set of coins of measure about
``REL_TOL`` per decision.

Where this differs from FlashInfer's renormalisation kernels
------------------------------------------------------------------------------------------------

The usual pipeline is ``softmax`` then ``top_k_renorm_probs`` then ``top_p_renorm_probs`` on
materialised float32 rows. Same filter order and the same tie rule (FlashInfer keeps every element
tied with the pivot: its ternary pivot search stops when one distinct value is left above the low
pivot and keeps ``p > low``; its radix top-k keeps ``p >= pivot``), but:

* its thresholds compare rounded float32 probabilities, so distinct logits whose probabilities
  round to the same float (high temperature) or underflow to 0 become ties; here ties are equal
  logits, and the top-k threshold is exact;
* its top-p test compares float32 block-reduced masses of a row already renormalised once (and
  renormalises by an approximate reciprocal of ``max(sum, 1e-8)``); here the mass is exact and a
  kernel's rounding is bounded by ``REL_TOL`` and tolerated only at that boundary;
* it documents ``top_p`` in (0, 1) and ``top_k`` in (0, V); here every value has a meaning
  (``top_k <= 0`` or ``>= V``, ``top_p >= 1`` or NaN, ``min_p <= 0`` or NaN: off);
* its min-p sampling compares ``p >= float32(max p * min_p)`` on probabilities; here
  ``(x - m) / T >= ln(min_p)``, independent of the probabilities' rounding;
* ``-inf`` and NaN logits give probability 0, +inf logits share the mass; a softmax of a row with
  +inf gives NaN there.
The reason is the same throughout: the kernel never writes a probability row, so the semantics is
stated on the logits, where thresholds are exact, and the rounding a kernel cannot avoid is
bounded and confined to measured ties.
"""

from __future__ import annotations

import torch

from .tree_speculative_sampling_target_only import tree_speculative_sampling_target_only

__all__ = [
    "tree_speculative_sampling_from_logits",
    "filtered_probs",
    "filter_rows",
    "clean_logits",
    "greedy_requests",
    "GREEDY_TEMPERATURE",
    "REL_TOL",
    "TINY_PROB",
]

#: Requests with ``not (T >= GREEDY_TEMPERATURE)`` (float32 comparison) are greedy.
GREEDY_TEMPERATURE = 1e-6
#: Relative tolerance of a float32 kernel's probabilities, sums and accept tests (module docstring).
REL_TOL = 1e-5
#: Probabilities below this may be taken as 0 by a kernel (float32 underflow, the FLT_MIN flush).
TINY_PROB = 1e-30

_ROW_CHUNK_ELEMENTS = 1 << 22  # rows are filtered in chunks of about this many elements


def clean_logits(target_logits: torch.Tensor) -> torch.Tensor:
    """Logits as the op reads them, in float64 (exact): NaN becomes -inf."""
    x = target_logits.float().double()
    return torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)


def greedy_requests(temperatures: torch.Tensor) -> torch.Tensor:
    """bool [bs]: requests decoded greedily (``not (T >= 1e-6)`` in float32: 0, negative, NaN, tiny)."""
    t = temperatures.float()
    return ~(t >= torch.tensor(GREEDY_TEMPERATURE, dtype=torch.float32, device=t.device))


def filter_rows(x, T, top_k, top_p, min_p):
    """Weights and kept sets of sampling rows (rule 3 and 4 of the module docstring).

    x: cleaned float64 logits [R, V]; T: float64 [R] (> 0, +inf allowed); top_k: int64 [R];
    top_p, min_p: float64 [R] (already mapped: off values are 1 and 0). Returns ``(w, kept)``:
    float64 [R, V] weights (max token 1) and bool [R, V] kept tokens (all False where the row
    has no positive weight).
    """
    R, V = x.shape
    inf = float("inf")
    pinf = x == inf
    has_pinf = pinf.any(dim=1, keepdim=True)
    m = x.max(dim=1, keepdim=True).values
    live = (x > -inf) & torch.isfinite(m)
    d = torch.where(live, x - torch.where(torch.isfinite(m), m, torch.zeros_like(m)), torch.zeros_like(x))
    w = torch.where(live, torch.exp(d / T[:, None]), torch.zeros_like(x))
    w = torch.where(has_pinf, pinf.to(x.dtype), w)

    # Tokens sorted by logit, descending (ties adjacent); top-k threshold: the k-th largest logit.
    xs, order = torch.sort(x, dim=1, descending=True, stable=True)
    ws = w.gather(1, order)
    k_on = (top_k > 0) & (top_k < V)
    kth = xs.gather(1, (top_k - 1).clamp(0, V - 1)[:, None])
    lam_k = torch.where(k_on[:, None], kth, torch.full_like(kth, -inf))

    # Top-p on the top-k distribution: mass at the end of every tie group, first group reaching top_p.
    ws1 = torch.where(xs >= lam_k, ws, torch.zeros_like(ws))
    cum = torch.cumsum(ws1, dim=1)
    z1 = cum[:, -1:]
    pos = torch.arange(V, device=x.device).expand(R, V)
    boundary = torch.ones_like(xs, dtype=torch.bool)
    boundary[:, :-1] = xs[:, :-1] != xs[:, 1:]
    group_end = torch.where(boundary, pos, torch.full_like(pos, V)).flip(1).cummin(dim=1).values.flip(1)
    cum_end = cum.gather(1, group_end)
    p_on = (top_p < 1) & (z1[:, 0] > 0)
    mass = cum_end / torch.where(z1 > 0, z1, torch.ones_like(z1))
    reached = mass >= top_p[:, None]
    first = reached.int().argmax(dim=1, keepdim=True)
    lam_p = torch.where(p_on[:, None], xs.gather(1, first), torch.full_like(kth, -inf))

    # Min-p: w is p / max p.
    kept = (w > 0) & (x >= lam_k) & (x >= lam_p)
    mp_on = min_p > 0
    kept &= ~mp_on[:, None] | (w >= min_p.clamp(max=1.0)[:, None])
    return w, kept


def _row_params(bs, n, device, temperatures, top_ks, top_ps, min_ps):
    """Per-row (request-broadcast) parameters with off values mapped: int64 k (0 = off), float64
    top_p (1 = off) and min_p (0 = off), float64 T."""
    def per_row(t, default, dtype):
        if t is None:
            return torch.full((bs * n,), default, dtype=dtype, device=device)
        return t.to(device=device).to(dtype)[:, None].expand(bs, n).reshape(-1)

    T = per_row(temperatures.float(), 1.0, torch.float64)
    k = per_row(top_ks, 0, torch.int64)
    tp = per_row(None if top_ps is None else top_ps.float(), 1.0, torch.float64)
    tp = torch.where(torch.isnan(tp), torch.ones_like(tp), tp)
    mp = per_row(None if min_ps is None else min_ps.float(), 0.0, torch.float64)
    mp = torch.where(torch.isnan(mp), torch.zeros_like(mp), mp)
    return T, k, tp, mp


def filtered_probs(target_logits, temperatures, top_ks=None, top_ps=None, min_ps=None) -> torch.Tensor:
    """The rows the walk uses, in float64 [bs, n, V]: one-hot argmax rows for greedy requests,
    ``w / Z`` on the kept tokens for the others (all zero where no token has positive weight)."""
    bs, n, V = target_logits.shape
    dev = target_logits.device
    out = torch.zeros(bs * n, V, dtype=torch.float64, device=dev)
    if bs * n == 0 or V == 0:
        return out.view(bs, n, V)
    flat = target_logits.reshape(bs * n, V)
    greedy = greedy_requests(temperatures).to(dev)[:, None].expand(bs, n).reshape(-1)
    T, k, tp, mp = _row_params(bs, n, dev, temperatures, top_ks, top_ps, min_ps)
    step = max(1, _ROW_CHUNK_ELEMENTS // V)
    for lo in range(0, bs * n, step):
        hi = min(lo + step, bs * n)
        x = clean_logits(flat[lo:hi])
        g = greedy[lo:hi]
        Ts = torch.where(g, torch.ones_like(T[lo:hi]), T[lo:hi])  # greedy rows: any positive T
        w, kept = filter_rows(x, Ts, k[lo:hi], tp[lo:hi], mp[lo:hi])
        p = torch.where(kept, w, torch.zeros_like(w))
        z = p.sum(dim=1, keepdim=True)
        p = torch.where(z > 0, p / torch.where(z > 0, z, torch.ones_like(z)), torch.zeros_like(p))
        onehot = torch.zeros_like(p)
        onehot.scatter_(1, x.argmax(dim=1, keepdim=True), 1.0)
        out[lo:hi] = torch.where(g[:, None], onehot, p)
    return out.view(bs, n, V)


def tree_speculative_sampling_from_logits(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_logits,
    temperatures,
    top_ks=None,
    top_ps=None,
    min_ps=None,
    threshold_single=1.0,
    threshold_acc=1.0,
    *,
    return_details=False,
):
    """Reference implementation; same in-place outputs as the target-only op.

    Inputs are assumed shape-valid; their values may be anything (hostile logits and parameters
    are defined by the module docstring). With ``return_details=True`` it returns a dict:
    ``rows`` (the float32 [bs, n, V] rows the walk used), ``greedy`` (bool [bs]), ``residual`` and
    ``final_coin`` (as the target-only reference's ``return_residual``); otherwise None.
    """
    bs = candidates.shape[0]
    if bs == 0:
        return None
    rows = filtered_probs(target_logits, temperatures, top_ks, top_ps, min_ps).float()
    res = tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num,
        candidates, retrive_index, retrive_next_token, retrive_next_sibling,
        uniform_samples, uniform_samples_for_final_sampling,
        rows, None, threshold_single, threshold_acc,
        return_residual=return_details,
    )
    if not return_details:
        return None
    r, coin = res
    return {"rows": rows, "greedy": greedy_requests(temperatures), "residual": r, "final_coin": coin}
