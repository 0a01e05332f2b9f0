"""Pure-torch reference of ``tree_speculative_sampling``: lossless verification of a draft tree
whose tokens were sampled from the draft model's distributions.

Same tree layout and outputs as ``tree_speculative_sampling_target_only``, plus the draft rows
``draft_probs[b, i]`` (the distribution node i's children were drawn from; read, never written)
and the flag ``replacement`` saying how the children of one node were drawn:

* ``replacement=True``: i.i.d. from the node's draft row (siblings may repeat a token). Rule of
  SpecInfer's multi-step speculative sampling.
* ``replacement=False``: without replacement, in sibling order (child j is a draw from the row
  with the tokens of children 0..j-1 removed and renormalised; a Gumbel top-k sorted by key is
  such an order). Rule of Recursive Speculative Decoding (Jeon et al., 2024): the draft
  distribution also loses each rejected token.

Derivation and proof sketch: ``docs/draft_probability_sampling.md``. The CUDA kernel must match
this module bit for bit, except that the float32 values of row sums (below: ``N``, ``S`` and the
prefix sums of the final sample) are the exact sums rounded to float32, which a kernel that
accumulates in another order can miss by one ulp at a rounding tie; the final token then differs
only where :func:`cupy_spec.reference.final_token_slack` is tiny.

Per request ``b``; all arithmetic IEEE float32 with subnormal results flushed to zero
(``flush``), as the kernels are built (``-ftz=true --fmad=false``):

* Probabilities (target and draft alike) are read through :func:`effective_probs` (``E``): NaN,
  +-inf, negative and subnormal values count as 0. Coins are clamped into [0, 1) (NaN and subnormal coins -> 0).
* At each node ``i`` the walk keeps an unnormalised residual ``R`` (float32 [V]), a scale ``c``
  and, without replacement, the set ``X`` of rejected sibling tokens. On arrival:
  ``R = E(target_probs[b, i])``, ``c = 1``, ``X = {}``. Let ``q = E(draft_probs[b, i])`` and
  ``Q[v] = 0 if v in X else q[v]`` (with replacement ``Q = q``: X stays empty).
* The children are tried in sibling order. Child ``ch`` with token ``x`` uses the coin
  ``u = uniform_samples[b, ch]`` and is accepted iff ``flush(flush(u * Q[x]) * c) < R[x]``.
  (In exact arithmetic: ``u < r(x) / q'(x)`` for the normalised residual ``r = R / sum(R)`` and
  draft ``q' = Q / sum(Q)``; at the first child ``c = 1`` and the rows are taken as given.)
* Accepted: the walk moves to ``ch`` (outputs as in the target-only op) and arrives there afresh.
* Rejected, in this order:
  1. ``R[v] = E(R[v] - flush(c * Q[v]))`` for every v (the residual loses the draft
     distribution x was drawn from, *before* x is removed from it);
  2. without replacement: ``X = X + {x}`` (so Q[x] = 0 from now on);
  3. ``N = flush(float32(sum R))``; ``S = 1`` with replacement, else ``flush(float32(sum Q))``
     (sums exact, here in float64, rounded once to float32);
  4. ``c = flush(N / S)`` (IEEE division) if ``S > 0``, else ``c = 0`` (no draft mass left:
     q counts as 0, so the next test accepts iff ``R[x] > 0`` and R no longer changes).
  Then the next sibling is tried. A token with ``Q[x] = 0`` (not in the draft's support, or a
  repeat of a rejected sibling without replacement) is accepted iff ``R[x] > 0`` while ``c`` is
  finite (a residual whose float32 sum overflows gives ``c = inf``, and the test ``0 * inf =
  NaN < R[x]`` rejects it); a token with ``R[x] = 0`` is never accepted.
* The walk stops at a node with no (more) children, after ``S_out - 1`` accepted tokens
  (``S_out = accept_index.shape[1]``), or at a malformed child (below). The final token is
  drawn with ``uniform_samples_for_final_sampling[b]`` by :func:`sample_residual` from the node's
  current ``R`` (its target row if no child was rejected there), or from ``E(target row)`` if
  ``R`` is all zero; a row that is still all zero gives ``V - 1``.
* Malformed trees, as in the target-only op: a link outside ``[0, n)`` means "none"; a node seen
  before (cycles, the root as a child) or a child whose token is outside ``[0, V)`` or whose
  ``retrive_index`` is outside ``[0, len(predicts))`` ends the walk (before its test; its coin is
  unused). A root whose ``retrive_index`` is out of range writes only ``accept_index[b, 0]`` and
  ``accept_token_num[b] = 0``. ``uniform_samples[b, 0]`` (the root's coin) is never used.
  Global indices are expected to be distinct across requests; where two requests share one, the
  op stays in bounds but which request's token that ``predicts`` entry holds is not specified.

Cost of the rule on a GPU: a test needs ``R[x]`` of one token only, which is a chain of at most j
(number of rejected siblings so far) float32 subtract-and-clamp steps from ``target[x]``,
``q[x]`` and the stored scales, so the walk reads no row. Only ``N`` and ``S`` after a rejection
followed by another sibling need a pass over the node's two rows (recomputing ``R[v]`` by the
same chain per element; nothing V-long is materialised), plus the final pass of the sample. The
scales depend on the rows and the tokens only, never on the coins, so they can also be computed
for every node ahead of the walk.
"""

from __future__ import annotations

import torch

from ._common import clamp_coins, effective_probs, flush_subnormal, sample_residual, walk_trees

__all__ = ["tree_speculative_sampling"]


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """float32 [m] sums of float32 rows [m, V]: float64 sum rounded to float32, subnormal -> 0."""
    return flush_subnormal(x.double().sum(dim=1).float())


class _Walk:
    """Per-request state of the walk, vectorised over the batch (all tensors on one device)."""

    def __init__(self, target_probs, draft_probs, replacement: bool):
        bs, n, V = target_probs.shape
        dev = target_probs.device
        self.target, self.draft, self.replacement = target_probs, draft_probs, replacement
        self.R = effective_probs(target_probs[:, 0]).clone()  # float32 [bs, V]
        self.c = torch.ones(bs, dtype=torch.float32, device=dev)
        self.removed = torch.zeros(bs, V, dtype=torch.bool, device=dev)  # X, without replacement

    def draft_rows(self, b, node):
        """``Q`` rows float32 [m, V] of requests ``b`` at nodes ``node``."""
        q = effective_probs(self.draft[b, node])
        if self.replacement:
            return q
        return torch.where(self.removed[b], torch.zeros_like(q), q)

    def test(self, b, node, x, u):
        """bool [m]: ``flush(flush(u * Q[x]) * c) < R[x]`` for requests b at nodes, tokens x."""
        qx = effective_probs(self.draft[b, node, x])
        if not self.replacement:
            qx = torch.where(self.removed[b, x], torch.zeros_like(qx), qx)
        lhs = flush_subnormal(flush_subnormal(u * qx) * self.c[b])
        return lhs < self.R[b, x]

    def arrive(self, b, node):
        """Requests b move to nodes ``node``: fresh residual, scale 1, nothing removed."""
        self.R[b] = effective_probs(self.target[b, node])
        self.c[b] = 1.0
        self.removed[b] = False

    def reject(self, b, node, x):
        """Steps 1-4 of a rejection of token x at nodes ``node`` of requests b."""
        Q = self.draft_rows(b, node)
        R = effective_probs(self.R[b] - flush_subnormal(self.c[b, None] * Q))
        self.R[b] = R
        if self.replacement:
            S = torch.ones_like(self.c[b])
        else:
            self.removed[b, x] = True
            Q[torch.arange(len(b), device=Q.device), x] = 0.0
            S = _row_sum(Q)
        N = _row_sum(R)
        c = flush_subnormal(N / torch.where(S > 0, S, torch.ones_like(S)))
        self.c[b] = torch.where(S > 0, c, torch.zeros_like(c))

    def final_rows(self, cur):
        """float32 [bs, V]: current residuals, or the node's target row where R is all zero."""
        p = effective_probs(self.target[torch.arange(cur.shape[0], device=cur.device), cur])
        return torch.where((self.R > 0).any(dim=1, keepdim=True), self.R, p)


def tree_speculative_sampling(
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
    replacement,
    deterministic=True,
    *,
    return_residual=False,
):
    """Reference implementation; same arguments and in-place outputs as the public op.

    Args (bs requests, n tree nodes each, vocabulary V >= 1, S = accept_index.shape[1] >= 1):
        predicts: int32 [P], **written**: ``predicts[g]`` = token after the path node with global
            index g (other entries untouched).
        accept_index: int32 [bs, S], **written**: global indices of the accepted path, root first;
            entries past the path untouched.
        accept_token_num: int32 [bs], **written**: accepted draft tokens per request (0..S-1).
        candidates: int64 [bs, n]: token of each node (node 0, the root, is not tested).
        retrive_index: int64 [bs, n]: global index of each node (usually ``b * n + i``).
        retrive_next_token / retrive_next_sibling: int64 [bs, n]: first child / next sibling, -1
            if none.
        uniform_samples: float32 [bs, n]: ``[b, i]`` is the coin of node i's own acceptance test.
        uniform_samples_for_final_sampling: float32 [bs]: coin of the final sample.
        target_probs: float32 [bs, n, V]: target distribution after node i (over its children).
        draft_probs: float32 [bs, n, V], required, **not written**: draft distribution node i's
            children were drawn from.
        replacement: bool: children drawn i.i.d. (True) or without replacement (False).
        deterministic: accepted for API compatibility; the reference is always deterministic.
        return_residual: return ``(r, coin)``, the float32 [bs, V] rows the final token was drawn
            from and the clamped final coins (for :func:`final_token_slack`); otherwise None.

    Inputs are assumed to have the right shapes and dtypes.
    """
    bs, n = candidates.shape
    if bs == 0:
        return None
    V = target_probs.shape[2]
    P = predicts.shape[0]
    ar = torch.arange(bs, device=candidates.device)

    child_ok = (candidates >= 0) & (candidates < V) & (retrive_index >= 0) & (retrive_index < P)
    root_ok = (retrive_index[:, 0] >= 0) & (retrive_index[:, 0] < P)
    coins = clamp_coins(uniform_samples.float())
    walk = _Walk(target_probs.float(), draft_probs.float(), bool(replacement))

    cur, count, last = walk_trees(
        accept_index, predicts, candidates, retrive_index, retrive_next_token, retrive_next_sibling, child_ok, root_ok,
        test=lambda b, parent, c: walk.test(b, parent, candidates[b, c], coins[b, c]),
        arrive=walk.arrive,
        reject=lambda b, parent, c: walk.reject(b, parent, candidates[b, c]))

    # Requests whose root index is out of range never walked (child = -1 from the start).
    accept_token_num.copy_(count.to(torch.int32))
    r = walk.final_rows(cur)
    final_coin = clamp_coins(uniform_samples_for_final_sampling.float())
    tokens = sample_residual(r, final_coin)
    fin = ar[root_ok]
    predicts[last[fin]] = tokens[fin].to(torch.int32)
    return (r, final_coin) if return_residual else None
