"""Content checks of the op's inputs (``check_inputs``): the tree, the indices, tokens, probabilities, coins.

The op itself never fails on bad content: it follows fixed rules for malformed input (see
:mod:`cupy_spec.reference`) so that it cannot hang or touch memory out of bounds. Those rules
produce *some* output, not a meaningful one. :func:`check_inputs` is what a caller runs (or what
``tree_speculative_sampling_target_only(..., validate=True)`` runs) to be told instead, with a
ValueError naming the argument, the request ``b`` and the node ``i``, what was wrong and how to fix
it.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ._core import torch_view
from .reference._common import FLT_MIN  # smallest normal float32: smaller probabilities count as 0

__all__ = ["check_inputs", "verify_tree_greedy", "tree_speculative_sampling", "chain_speculative_sampling", "reachable"]

#: Largest accepted |sum(row) - 1| of a probability row.
SUM_TOL = 1e-3


def _takes_arrays(check):
    """The check takes what its op takes: foreign arrays (NumPy, CuPy, any DLPack producer) are
    viewed as torch tensors without a copy first."""
    signature = inspect.signature(check)

    @functools.wraps(check)
    def viewed(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        for name, v in bound.arguments.items():
            if not isinstance(v, torch.Tensor) and (hasattr(v, "__dlpack__") or hasattr(v, "__cuda_array_interface__")):
                bound.arguments[name] = torch_view(name, v)
        return check(*bound.args, **bound.kwargs)

    return viewed


@_takes_arrays
def check_inputs(
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
    draft_probs=None,
    threshold_single=1.0,
    threshold_acc=1.0,
    deterministic=True,
) -> None:
    """Checks every argument of ``tree_speculative_sampling_target_only``; raises on the first problem.

    ``tree_speculative_sampling_target_only(..., validate=True)`` calls this before running. Same
    arguments as the op (``deterministic`` is ignored). First the op's shape-level checks (types,
    dtypes, shapes, devices, contiguity, thresholds in [0, 1]) and that no written tensor shares
    memory with another argument, then these content checks, in this order over the whole batch;
    within a check the first problem in row-major (b, i) order is reported:

    1. ``retrive_next_token`` and ``retrive_next_sibling`` lie in [-1, n) (-1 = none);
    2. the links form a tree: walking from the root through first-child and next-sibling links
       reaches no node twice (no cycle, no self-loop, no shared child, the root is nobody's child;
       the root's own next-sibling link is never followed, by the op or by this check);
    3. ``candidates`` of the nodes reachable from the root (the root's own token is not used) lie
       in [0, V);
    4. ``retrive_index`` lies in [0, len(predicts)) for every node (``predicts`` long enough);
    5. ``retrive_index`` values are distinct across the whole batch;
    6. ``target_probs`` rows of reachable nodes are finite, non-negative and sum to 1 (within 1e-3);
    7. ``draft_probs`` rows of reachable nodes (if given) are finite and non-negative;
    8. ``uniform_samples`` of reachable nodes lie in [0, 1) (NaN is not);
    9. ``uniform_samples_for_final_sampling`` lies in [0, 1);
    10. the siblings of a node carry distinct tokens (duplicates are accepted by the op, but each
        occurrence adds its probability again, so sampling is no longer lossless).

    Data of nodes that the root cannot reach is never read by the op and is not checked (their
    links and ``retrive_index`` are). The outputs' contents are not read.

    This reads tensor contents, so for CUDA tensors it synchronises with the device (a few small
    reductions plus one pass over ``target_probs`` / ``draft_probs``); do not call it inside CUDA
    graph capture. Works for CPU and CUDA tensors.

    Raises TypeError / ValueError (shape level, from the op's argument table) and ValueError (content).
    """
    from .tree_speculative_sampling_target_only import OP

    dims, _, _ = OP.check((predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                           draft_probs, threshold_single, threshold_acc, deterministic), overlap=True)
    if dims.bs == 0:
        return
    reach = _check_sampling_tree(dims, candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_probs)
    if draft_probs is not None:
        _check_draft_rows(draft_probs, reach)
    _check_coins("uniform_samples", uniform_samples, reach)
    _check_final_coins(uniform_samples_for_final_sampling)
    _check_sibling_tokens(candidates, _parents(retrive_next_token, retrive_next_sibling, reach), dims.V)


@_takes_arrays
def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                       retrive_next_sibling, target_predict) -> None:
    """Checks every argument of ``verify_tree_greedy``; raises on the first problem.

    ``verify_tree_greedy(..., validate=True)`` calls this before running. First the op's shape-level
    checks and that no written tensor shares memory with another argument, then these content checks,
    in this order over the whole batch (within a check, the first problem in row-major (b, i) order
    is reported):

    1. ``retrive_next_token`` and ``retrive_next_sibling`` lie in [-1, n) (-1 = none);
    2. the links form a tree (walking from the root reaches no node twice);
    3. ``retrive_index`` lies in [0, len(predicts)) and in [0, bs * n) (it indexes ``target_predict``
       as a flat array) for every node;
    4. ``retrive_index`` values are distinct across the whole batch;
    5. ``target_predict`` holds token ids in [0, 2**31) (they are stored into int32 ``predicts``).

    Reads tensor contents: for CUDA tensors it synchronises; do not call it inside graph capture.
    """
    from .verify_tree_greedy import OP

    dims, _, _ = OP.check((predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict), overlap=True)
    if dims.bs == 0:
        return
    _check_layout(retrive_next_token, retrive_next_sibling)
    _check_retrive_index(retrive_index, min(dims.P, dims.bs * dims.n), flat_target=dims.P > dims.bs * dims.n)
    _check_unique_index(retrive_index)
    hit = _first((target_predict < 0) | (target_predict > 2**31 - 1))
    if hit is not None:
        b, i = hit
        raise ValueError(f"{_at('target_predict', b, i)} = {int(target_predict[b, i])} is not a token id in "
                         f"[0, 2**31); it must hold the target's argmax token after each node")



@_takes_arrays
def tree_speculative_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index,
                              retrive_next_token, retrive_next_sibling, uniform_samples,
                              uniform_samples_for_final_sampling, target_probs, draft_probs, replacement,
                              deterministic=True) -> None:
    """Checks every argument of ``tree_speculative_sampling``; raises on the first problem.

    ``tree_speculative_sampling(..., validate=True)`` calls this before running. First the op's
    shape-level checks and that no written tensor shares memory with another argument, then these
    content checks, in this order over the whole batch (within a check, the first problem in
    row-major (b, i) order is reported):

    1-5. the tree checks of :func:`check_inputs` (links, a tree, candidates of reachable nodes in
       [0, V), ``retrive_index`` in range and distinct);
    6. ``target_probs`` rows of reachable nodes are distributions (finite, >= 0, sum 1 within 1e-3);
    7. ``draft_probs`` rows of reachable nodes that have children are distributions too (the row
       node i's children were drawn from);
    8. every reachable child x of node i has ``draft_probs[b, i, x] >= FLT_MIN``: it was drawn from
       that row, so a zero means misaligned rows (for example each node's own row passed instead of
       its parent's);
    9. ``uniform_samples`` of reachable nodes and ``uniform_samples_for_final_sampling`` lie in [0, 1);
    10. with ``replacement=False``, siblings carry distinct tokens (children drawn without
        replacement cannot repeat; repeats mean they were drawn i.i.d.: pass ``replacement=True``).

    Reads tensor contents: for CUDA tensors it synchronises; do not call it inside graph capture.
    """
    from .tree_speculative_sampling import OP

    dims, _, _ = OP.check((predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                           draft_probs, replacement, deterministic), overlap=True)
    if dims.bs == 0:
        return
    reach = _check_sampling_tree(dims, candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_probs)
    par = _parents(retrive_next_token, retrive_next_sibling, reach)
    n = reach.shape[1]
    has_child = torch.zeros(dims.bs, n + 1, dtype=torch.bool, device=reach.device)
    has_child.scatter_(1, torch.where(par >= 0, par, torch.full_like(par, n)), True)  # column n: a dump
    parents = has_child[:, :n]
    _check_distributions("draft_probs", draft_probs, parents, "draft_probs[b, i] must be the distribution node i's "
                         "children were drawn from")
    _check_drawn_children(candidates, draft_probs, par)
    _check_coins("uniform_samples", uniform_samples, reach)
    _check_final_coins(uniform_samples_for_final_sampling)
    if not replacement:
        _check_sibling_tokens(candidates, par, dims.V,
                              "children drawn without replacement cannot repeat a token; if they were drawn "
                              "i.i.d., pass replacement=True")


@_takes_arrays
def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, uniform_samples, output_token_ids,
                               output_accepted_token_num, output_emitted_draft_token_num, seed=None,
                               offset=None, accumulate=True, seeded=False, seed_word=0, offset_word=0) -> None:
    """Checks every argument of ``chain_speculative_sampling``; raises on the first problem.

    ``chain_speculative_sampling(..., validate=True)`` calls this with the coins it uses (given, or
    drawn from the generator). First the shape-level checks and that no written tensor shares memory
    with another argument, then, in this order (within a check the first problem in row-major (b, i)
    order is reported):

    1. ``draft_token_ids`` lie in [0, V) (the op rejects others, which ends the chain there);
    2. ``target_probs`` rows are distributions (finite, >= 0, summing to 1 within 1e-3);
    3. ``draft_probs`` rows are distributions;
    4. every draft token has ``draft_probs[b, i, x_i] >= FLT_MIN``: x_i was drawn from that row, so a
       zero means misaligned rows or ids;
    5. ``uniform_samples`` lie in [0, 1) (coins drawn from seed and offset, ``seeded``, always do).

    Reads tensor contents: for CUDA tensors it synchronises; do not call it inside graph capture.
    """
    from .chain_speculative_sampling import OP

    dims, _, _ = OP.check((draft_probs, draft_token_ids, target_probs, uniform_samples, output_token_ids,
                           output_accepted_token_num, output_emitted_draft_token_num, seed, offset, accumulate,
                           seeded, seed_word, offset_word), overlap=True)
    if dims.bs == 0:
        return
    hit = _first((draft_token_ids < 0) | (draft_token_ids >= dims.V))
    if hit is not None:
        b, i = hit
        raise ValueError(f"{_at('draft_token_ids', b, i)} = {int(draft_token_ids[b, i])} is not a token id in "
                         f"[0, V={dims.V}); draft ids must index the vocabulary of the probability rows")
    every = torch.ones(dims.bs, dims.k1, dtype=torch.bool, device=target_probs.device)
    _check_distributions("target_probs", target_probs, every, "target rows must be probability distributions, "
                         "e.g. softmax of finite logits")
    _check_distributions("draft_probs", draft_probs, every[:, : dims.k], "draft_probs[b, i] must be the "
                         "distribution draft token i was drawn from")
    q = draft_probs.gather(2, draft_token_ids.long()[:, :, None])[:, :, 0]
    hit = _first(~(q >= FLT_MIN))
    if hit is not None:
        b, i = hit
        raise ValueError(f"{_at('draft_token_ids', b, i)} = {int(draft_token_ids[b, i])} has draft probability "
                         f"{float(q[b, i])!r} in draft_probs[{b}, {i}]: a token drawn from that row has a positive "
                         f"probability there, so the rows or the ids are misaligned")
    hit = None if uniform_samples is None else _first(~((uniform_samples >= 0) & (uniform_samples < 1)))
    if hit is not None:
        b, i = hit
        raise ValueError(f"uniform_samples[{b}, {i}] = {float(uniform_samples[b, i])!r} is not in [0, 1); "
                         f"{_coin_fix('uniform_samples')}")

# ---- helpers ---------------------------------------------------------------------------------


def _check_sampling_tree(dims, candidates, retrive_index, next_token, next_sibling, target_probs) -> torch.Tensor:
    """Checks 1-6 of :func:`check_inputs`, shared by the sampling ops; returns the reachable nodes."""
    reach = _check_layout(next_token, next_sibling)
    _check_candidates(candidates, reach, dims.V)
    _check_retrive_index(retrive_index, dims.P)
    _check_unique_index(retrive_index)
    _check_target_rows(target_probs, reach)
    return reach


def _at(name: str, b: int, i: int | None = None) -> str:
    """``name[b, i] (request b, node i)``."""
    if i is None:
        return f"{name}[{b}] (request {b})"
    return f"{name}[{b}, {i}] (request {b}, node {i})"


def _first(mask: torch.Tensor):
    """Index tuple of the first True entry of ``mask`` in row-major order, or None (synchronises)."""
    hits = mask.nonzero()
    if hits.shape[0] == 0:
        return None
    return tuple(int(x) for x in hits[0].tolist())


def _followed_siblings(next_sibling: torch.Tensor) -> torch.Tensor:
    """The sibling links that walks follow: the root's own (column 0) is never followed (the walks
    start at its first child), so it reads as -1."""
    out = next_sibling.clone()
    if out.shape[1]:
        out[:, 0] = -1
    return out


def _links_or_none(links: torch.Tensor, n: int) -> torch.Tensor:
    """Links with -1 ("none") replaced by n, a dump column for scatters."""
    return torch.where(links >= 0, links, torch.full_like(links, n))


def reachable(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """bool [bs, n]: nodes reachable from the root through links in [0, n) (others mean none). The
    root's own next-sibling link is not followed: the walks start at its first child.

    next_token, next_sibling: int32 or int64 [bs, n] (the op's retrive_next_token / _sibling)."""
    for name, links in (("next_token", next_token), ("next_sibling", next_sibling)):
        if not isinstance(links, torch.Tensor) or links.dtype not in (torch.int32, torch.int64):
            what = str(links.dtype).replace("torch.", "") if isinstance(links, torch.Tensor) else type(links).__name__
            raise TypeError(f"{name} must be an int32 or int64 tensor, got {what}")
    if next_token.dim() != 2 or next_sibling.shape != next_token.shape:
        raise ValueError(f"next_token and next_sibling must have one shape [bs, n], got "
                         f"{tuple(next_token.shape)} and {tuple(next_sibling.shape)}")
    bs, n = next_token.shape
    next_sibling = _followed_siblings(next_sibling)
    nt = torch.where((next_token >= 0) & (next_token < n), next_token, torch.full_like(next_token, n))
    ns = torch.where((next_sibling >= 0) & (next_sibling < n), next_sibling, torch.full_like(next_sibling, n))
    reach = torch.zeros(bs, n + 1, dtype=torch.bool, device=next_token.device)
    reach[:, 0] = True
    for _ in range(n):
        new = reach.clone()
        src = reach[:, :n]
        new.scatter_(1, torch.where(src, nt, torch.full_like(nt, n)), True)
        new.scatter_(1, torch.where(src, ns, torch.full_like(ns, n)), True)
        new[:, n] = False
        if torch.equal(new, reach):
            break
        reach = new
    return reach[:, :n]


def _check_layout(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Links in [-1, n) that form a tree; returns the reachable nodes, bool [bs, n]."""
    n = next_token.shape[1]
    _check_links("retrive_next_token", next_token, n)
    _check_links("retrive_next_sibling", next_sibling, n)
    reach = reachable(next_token, next_sibling)
    _check_tree(next_token, next_sibling, reach)
    return reach


# ---- the checks, in order ----------------------------------------------------------------------


def _check_links(name: str, links: torch.Tensor, n: int) -> None:
    hit = _first((links < -1) | (links >= n))
    if hit is not None:
        b, i = hit
        raise ValueError(
            f"{_at(name, b, i)} = {int(links[b, i])} is outside [-1, n={n}): a link must be a node "
            f"index in [0, {n}) or -1 for none (use -1, not other negative values)"
        )


def _check_tree(next_token: torch.Tensor, next_sibling: torch.Tensor, reach: torch.Tensor) -> None:
    """Every reachable node must have exactly one incoming link from a reachable node (the root none)."""
    bs, n = next_token.shape
    next_sibling = _followed_siblings(next_sibling)
    indeg = torch.zeros(bs, n + 1, dtype=torch.long, device=next_token.device)
    one = torch.ones_like(next_token)
    for links in (next_token, next_sibling):
        indeg.scatter_add_(1, torch.where(reach, _links_or_none(links, n), torch.full_like(links, n)), one)
    indeg = indeg[:, :n]
    bad = reach & (indeg > 1)
    bad[:, 0] |= indeg[:, 0] > 0
    hit = _first(bad)
    if hit is None:
        return
    b, i = hit
    sources = [
        f"{name}[{b}, {u}]"
        for name, links in (("retrive_next_token", next_token), ("retrive_next_sibling", next_sibling))
        for u in (reach[b] & (links[b] == i)).nonzero().flatten().tolist()
    ]
    what = "the root is listed as a child" if i == 0 else "it is reached twice (a cycle, self-loop or shared child)"
    verb = "point" if len(sources) > 1 else "points"
    raise ValueError(
        f"retrive_next_token / retrive_next_sibling of request {b} do not form a tree at node {i}: {what}; "
        f"{' and '.join(sources)} {verb} to node {i}. Walking from the root must visit each node at most "
        f"once: give every non-root node exactly one parent and one place in its parent's sibling list"
    )


def _check_candidates(candidates: torch.Tensor, reach: torch.Tensor, V: int, rows: str = "target_probs") -> None:
    """Reachable non-root candidates lie in [0, V), V being the last dimension of ``rows``."""
    used = reach.clone()
    used[:, 0] = False  # the root's token is never read
    hit = _first(used & ((candidates < 0) | (candidates >= V)))
    if hit is not None:
        b, i = hit
        raise ValueError(
            f"{_at('candidates', b, i)} = {int(candidates[b, i])} is not a token id in [0, V={V}) "
            f"(V = {rows}.shape[2]); draft tokens must index the vocabulary of {rows}"
        )


def _check_retrive_index(retrive_index: torch.Tensor, P: int, flat_target: bool = False) -> None:
    """Indices in [0, P). ``flat_target``: the bound is the size of target_predict, not predicts."""
    hit = _first((retrive_index < 0) | (retrive_index >= P))
    if hit is None:
        return
    b, i = hit
    v = int(retrive_index[b, i])
    if flat_target and v >= 0:
        raise ValueError(
            f"{_at('retrive_index', b, i)} = {v} is outside [0, bs * n = {P}): it indexes target_predict "
            f"as a flat array (normally b * n + i)"
        )
    if v < 0:
        where = "predicts and target_predict, in [0, bs * n" if flat_target else "predicts, in [0, len(predicts)"
        raise ValueError(
            f"{_at('retrive_index', b, i)} = {v} is negative; it must be a position in {where}={P}) "
            f"(normally b * n + i)"
        )
    need = int(retrive_index.max()) + 1
    raise ValueError(
        f"{_at('retrive_index', b, i)} = {v} is outside [0, len(predicts)={P}): predicts is too short "
        f"(it needs max(retrive_index) + 1 = {need} entries, usually bs * n) or retrive_index is wrong "
        f"(normally b * n + i)"
    )


def _repeats(keys: torch.Tensor) -> torch.Tensor:
    """bool, same shape as ``keys`` [rows, m]: entries equal to an earlier entry of the same row."""
    vals, order = torch.sort(keys, dim=1, stable=True)
    rep = torch.zeros_like(keys, dtype=torch.bool)
    rep.scatter_(1, order[:, 1:], vals[:, 1:] == vals[:, :-1])  # stable: the first occurrence stays False
    return rep


def _check_unique_index(retrive_index: torch.Tensor) -> None:
    n = retrive_index.shape[1]
    flat = retrive_index.reshape(1, -1)
    hit = _first(_repeats(flat)[0])
    if hit is None:
        return
    (k,) = hit
    v = int(flat[0, k])
    j = int((flat[0] == v).nonzero()[0])
    raise ValueError(
        f"{_at('retrive_index', k // n, k % n)} = {v} repeats retrive_index[{j // n}, {j % n}] "
        f"(request {j // n}, node {j % n}); retrive_index values must be distinct across the batch "
        f"(normally b * n + i), or outputs written to predicts overwrite each other"
    )


def _row_problem(rows: torch.Tensor, b: int, i: int) -> str:
    """What is wrong with row (b, i) of a [bs, n, V] tensor: the first bad value."""
    row = rows[b, i]
    for bad, what in ((torch.isnan(row), "NaN"), (torch.isinf(row), "inf"), (row < 0, "a negative value")):
        t = _first(bad)
        if t is not None:
            return f"holds {what} ({float(row[t[0]])!r}) at token {t[0]}"
    return "is bad"


def _check_target_rows(target_probs: torch.Tensor, reach: torch.Tensor) -> None:
    _check_distributions("target_probs", target_probs, reach, "target rows must be probability distributions "
                         "(finite, >= 0, summing to 1), e.g. softmax of finite logits")


def _check_distributions(name: str, rows: torch.Tensor, mask: torch.Tensor, fix: str) -> None:
    """Rows (b, i) of ``rows`` [bs, m, V] where ``mask`` is True are finite, >= 0 and sum to 1."""
    lo, hi, total = rows.amin(dim=2), rows.amax(dim=2), rows.sum(dim=2)
    hit = _first(mask & (torch.isnan(lo) | (lo < 0) | torch.isinf(hi)))
    if hit is not None:
        b, i = hit
        raise ValueError(f"{_at(name, b, i)} row {_row_problem(rows, b, i)}; {fix}")
    hit = _first(mask & ((total - 1.0).abs() > SUM_TOL))
    if hit is not None:
        b, i = hit
        raise ValueError(
            f"{_at(name, b, i)} row sums to {float(total[b, i])!r}, not 1 (tolerance {SUM_TOL}); {fix} "
            f"(renormalise after top-k / top-p masking)"
        )


def _check_drawn_children(candidates: torch.Tensor, draft_probs: torch.Tensor, par: torch.Tensor) -> None:
    """Every reachable child (par >= 0) has a draft probability >= FLT_MIN in its parent's row."""
    bs = candidates.shape[0]
    b_idx = torch.arange(bs, device=candidates.device)[:, None]
    q = draft_probs[b_idx, par.clamp(min=0), candidates.clamp(0, draft_probs.shape[2] - 1)]
    hit = _first((par >= 0) & ~(q >= FLT_MIN))
    if hit is not None:
        b, i = hit
        p = int(par[b, i])
        raise ValueError(
            f"{_at('candidates', b, i)} = {int(candidates[b, i])} has draft probability {float(q[b, i])!r} in "
            f"draft_probs[{b}, {p}], the row of its parent node {p}: a child drawn from that row has a positive "
            f"probability there, so the rows are misaligned (draft_probs[b, i] is the distribution node i's "
            f"children were drawn from)"
        )


def _check_draft_rows(draft_probs: torch.Tensor, reach: torch.Tensor) -> None:
    lo, hi = draft_probs.amin(dim=2), draft_probs.amax(dim=2)
    hit = _first(reach & (torch.isnan(lo) | (lo < 0) | torch.isinf(hi)))
    if hit is not None:
        b, i = hit
        raise ValueError(
            f"{_at('draft_probs', b, i)} row {_row_problem(draft_probs, b, i)}; draft_probs must be "
            f"finite and >= 0 (sglang passes zeros, or pass None)"
        )


def _coin_fix(name: str) -> str:
    return f"{name} must lie in [0, 1) (e.g. torch.rand; clamp to 1 - 2**-24 to exclude 1.0)"


def _check_coins(name: str, coins: torch.Tensor, reach: torch.Tensor) -> None:
    hit = _first(reach & ~((coins >= 0) & (coins < 1)))
    if hit is not None:
        b, i = hit
        raise ValueError(f"{_at(name, b, i)} = {float(coins[b, i])!r} is not in [0, 1); {_coin_fix(name)}")


def _check_final_coins(coins: torch.Tensor) -> None:
    name = "uniform_samples_for_final_sampling"
    hit = _first(~((coins >= 0) & (coins < 1)))
    if hit is not None:
        (b,) = hit
        raise ValueError(f"{_at(name, b)} = {float(coins[b])!r} is not in [0, 1); {_coin_fix(name)}")


def _parents(next_token: torch.Tensor, next_sibling: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    """int64 [bs, n]: parent of every reachable non-root node, -1 elsewhere (links must form a tree)."""
    bs, n = next_token.shape
    next_sibling = _followed_siblings(next_sibling)
    nt = torch.where(reach, _links_or_none(next_token, n), torch.full_like(next_token, n))
    ns = torch.where(reach, _links_or_none(next_sibling, n), torch.full_like(next_sibling, n))
    par = torch.full((bs, n + 1), -1, dtype=torch.long, device=next_token.device)
    par.scatter_(1, nt, torch.arange(n, device=nt.device).expand(bs, n).clone())
    for _ in range(n):  # a sibling inherits the parent of its predecessor
        new = par.clone()
        new.scatter_(1, ns, par[:, :n])
        new[:, n] = -1
        if torch.equal(new, par):
            break
        par = new
    return par[:, :n]


def _check_sibling_tokens(candidates, par, V: int,
                          fix: str = "the op accepts this (each copy adds its probability again), but "
                          "sampling is then no longer lossless: merge duplicate draft tokens") -> None:
    """No two children of one node (``par``: parents from :func:`_parents`) carry the same token."""
    bs, n = candidates.shape
    # Key (parent, token) for reachable non-root nodes; distinct negative keys elsewhere.
    filler = -1 - torch.arange(n, device=candidates.device).expand(bs, n)
    keys = torch.where(par >= 0, par * V + candidates, filler)
    hit = _first(_repeats(keys))
    if hit is None:
        return
    b, i = hit
    j = int((keys[b] == keys[b, i]).nonzero()[0])
    raise ValueError(
        f"{_at('candidates', b, i)} = {int(candidates[b, i])} repeats the token of its sibling node {j} "
        f"(both children of node {int(par[b, i])}); {fix}"
    )
