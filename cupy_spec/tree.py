"""Draft-tree utilities (pure torch): build trees, draw draft tokens, read back results.

The op ``tree_speculative_sampling_target_only`` takes a draft tree in the "retrive" layout of
sglang (see docs/contract.md §1): per request ``b`` and node ``i``

* ``retrive_index[b, i]``        global index of the node (``b * n + i`` here), indexes ``predicts``;
* ``retrive_next_token[b, i]``   first child of node ``i``, -1 if none;
* ``retrive_next_sibling[b, i]`` next sibling of node ``i``, -1 if none.

Node 0 is the root (the last verified token). The helpers here build that layout from parent
lists (:func:`from_parents`, :func:`chain`, :func:`eagle_tree`), draw draft tokens for the nodes
(:func:`sample_candidates`) and turn the op's outputs into token / node lists
(:func:`emitted_tokens`, :func:`path_nodes`).

The op ``build_tree_kernel_efficient`` builds that layout (plus positions and the attention mask
of the verify pass) from an EAGLE drafter's per-step top-k choices: :func:`eagle_inputs` turns the
drafter's outputs (:class:`EagleDraft`, e.g. from :func:`random_eagle_draft`) into its inputs and
:func:`alloc_tree_outputs` allocates its outputs.
"""

from __future__ import annotations

import math
import numbers
import operator
from enum import IntEnum
from typing import NamedTuple, Sequence

import torch

from ._core import check_generator, torch_view

__all__ = [
    "Tree",
    "from_parents",
    "chain",
    "eagle_tree",
    "eagle_max_nodes",
    "sample_candidates",
    "sibling_rank",
    "emitted_tokens",
    "path_nodes",
    "TreeMaskMode",
    "EagleDraft",
    "EagleInputs",
    "TreeOutputs",
    "random_eagle_draft",
    "eagle_inputs",
    "packed_mask_dtype",
    "tree_mask_numel",
    "alloc_tree_outputs",
]


class Tree(NamedTuple):
    """A batch of draft trees with ``n`` nodes each (node 0 = root), all tensors on one device.

    retrive_index, retrive_next_token, retrive_next_sibling: int64 [bs, n] (the op's layout;
    ``retrive_index[b, i] = b * n + i``). S: max depth over the batch + 1, the width of the op's
    ``accept_index`` (1 for an empty batch). parents: int64 [bs, n], -1 for the root.
    depth: int64 [bs, n], 0 for the root.
    """

    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor
    S: int
    parents: torch.Tensor
    depth: torch.Tensor


# --------------------------------------------------------------------------------------------
# Argument checks: TypeError for a wrong type / dtype, ValueError for a wrong value / shape
# --------------------------------------------------------------------------------------------

_INTS = (torch.int32, torch.int64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _int_arg(name: str, value, lo: int = 0, hi: int | None = None) -> int:
    """``value`` as a Python int in [lo, hi]: ints and objects with ``__index__`` (NumPy integers,
    IntEnum members), never bool or float."""
    want = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
    try:
        v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = None
    if v is None or isinstance(v, bool):
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name} must be {want}, got {v}")
    return v


def _tensor_arg(name: str, t, dims: str, dtypes: tuple) -> torch.Tensor:
    """``t`` as a torch tensor (arrays with ``__dlpack__``, e.g. NumPy or CuPy, viewed without a
    copy) with ``len(dims)`` dimensions (dims: "bs, S") and a dtype in ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        t = torch_view(name, t, positional=False)
    if t.dtype not in dtypes:
        names = [str(d).replace("torch.", "") for d in dtypes]
        want = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise TypeError(f"{name} must be a{'n' if want[0] in 'aeiou' else ''} {want} tensor, "
                        f"got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != len(dims.split(",")):
        raise ValueError(f"{name} must be [{dims}] ({len(dims.split(','))}-D), got shape {list(t.shape)}")
    return t


def _tree_arg(tree) -> Tree:
    """A :class:`Tree` whose tensors are int64 (or int32) [bs, n] (one shape)."""
    if not isinstance(tree, Tree):
        raise TypeError(f"tree must be a cupy_spec.tree.Tree, got {type(tree).__name__}")
    ts = {f: _tensor_arg(f"tree.{f}", getattr(tree, f), "bs, n", _INTS) for f in Tree._fields if f != "S"}
    for f, t in ts.items():
        if t.shape != ts["retrive_index"].shape:
            raise ValueError(f"tree.{f} has shape {list(t.shape)}, tree.retrive_index {list(ts['retrive_index'].shape)}")
    return tree._replace(**ts)


def _device_arg(device):
    """None or a torch.device that this torch can allocate on (CUDA only where it is available)."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"device must be a torch.device, a str such as 'cpu' or 'cuda:0', an int (CUDA index) "
                        f"or None; got {type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} cannot be used here ({e})") from None
    if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        raise ValueError(f"device {device!r} is not available: torch {torch.__version__} sees "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA device(s)")
    return dev


# --------------------------------------------------------------------------------------------
# Building trees
# --------------------------------------------------------------------------------------------


def _int_rows(rows, name: str) -> torch.Tensor:
    """A list of equal-length integer lists (or an int tensor / array) as int64 [bs, n]."""
    if isinstance(rows, torch.Tensor):
        rows = rows.tolist()
    elif hasattr(rows, "tolist") and not isinstance(rows, (list, tuple)):
        rows = rows.tolist()  # numpy arrays
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"{name} must be a list (one entry per request) of lists of node ids")
    rows = [r.tolist() if hasattr(r, "tolist") and not isinstance(r, (list, tuple)) else r for r in rows]
    for b, r in enumerate(rows):
        if not isinstance(r, (list, tuple)):
            raise ValueError(f"{name}[{b}] must be a list of node ids, got {type(r).__name__}")
    lengths = {len(r) for r in rows}
    if len(lengths) > 1:
        raise ValueError(f"{name}: all requests need the same number of nodes, got lengths {sorted(lengths)}")
    for b, r in enumerate(rows):
        for i, v in enumerate(r):
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise ValueError(f"{name}[{b}][{i}] must be an integer, got {v!r}")
            if not -2**63 <= int(v) < 2**63:
                raise ValueError(f"{name}[{b}][{i}] = {int(v)} is not a node id (outside int64)")
    n = lengths.pop() if lengths else 0
    return torch.tensor([[int(v) for v in r] for r in rows], dtype=torch.int64).reshape(len(rows), n)


def _depths(par: torch.Tensor) -> torch.Tensor:
    """Depth of every node by walking up (vectorised); raises ValueError on cycles.

    par: int64 [bs, n] with entries in [0, n) except par[:, 0] == -1.
    """
    bs, n = par.shape
    up = par.clamp(min=0)
    cur = torch.arange(n).expand(bs, n).clone()
    depth = torch.zeros(bs, n, dtype=torch.int64)
    for _ in range(n):
        live = cur != 0
        if not bool(live.any()):
            break
        depth += live
        cur = torch.where(live, up.gather(1, cur), cur)
    bad = (cur != 0).nonzero()
    if bad.numel():
        b, i = (int(x) for x in bad[0])
        raise ValueError(f"parents[{b}] is not a tree: node {i} does not lead to the root (cycle)")
    return depth


def _rank_from_order(sibling_order, bs: int, n: int) -> torch.Tensor:
    """Per-node sort key from ``sibling_order`` (position of the node id in the list)."""
    if isinstance(sibling_order, torch.Tensor) or (
        hasattr(sibling_order, "tolist") and not isinstance(sibling_order, (list, tuple))
    ):
        sibling_order = sibling_order.tolist()
    if not isinstance(sibling_order, (list, tuple)) or len(sibling_order) != bs:
        raise ValueError(f"sibling_order must be a list with one entry per request ({bs})")
    rank = torch.empty(bs, n, dtype=torch.int64)
    for b, order in enumerate(sibling_order):
        if hasattr(order, "tolist") and not isinstance(order, (list, tuple)):
            order = order.tolist()
        if not isinstance(order, (list, tuple)):
            raise ValueError(f"sibling_order[{b}] must be a list of node ids")
        for v in order:
            if isinstance(v, bool) or not hasattr(v, "__index__") or not 0 <= int(v) < n:
                raise ValueError(f"sibling_order[{b}] holds {v!r}, not a node id in [0, {n})")
        ids = [int(v) for v in order]
        if len(set(ids)) != len(ids):
            raise ValueError(f"sibling_order[{b}] lists a node id twice")
        missing = set(range(1, n)) - set(ids)
        if missing:
            raise ValueError(f"sibling_order[{b}] misses node ids {sorted(missing)}")
        if 0 not in ids:
            ids = [0] + ids
        rank[b, torch.tensor(ids, dtype=torch.int64)] = torch.arange(n)
    return rank


def _link(par: torch.Tensor, rank: torch.Tensor, depth: torch.Tensor, device) -> Tree:
    """Build the retrive layout from validated parents; children ordered by ``rank``."""
    bs, n = par.shape
    key = torch.where(par >= 0, par * n + rank, torch.full_like(par, -1))  # root sorts first
    order = torch.argsort(key, dim=1, stable=True)
    spar = par.gather(1, order)  # parents in sorted order: grouped by parent, siblings in order
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64)
    next_token = torch.full((bs, n), -1, dtype=torch.int64)
    if n > 1:
        same = spar[:, 1:] == spar[:, :-1]
        next_sibling.scatter_(1, order[:, :-1], torch.where(same, order[:, 1:], torch.full_like(same, -1, dtype=torch.int64)))
        first = torch.ones(bs, n, dtype=torch.bool)
        first[:, 1:] = ~same
        first[:, 0] = False  # the root is nobody's child
        b, k = first.nonzero(as_tuple=True)
        next_token[b, spar[b, k]] = order[b, k]
    index = torch.arange(bs * n, dtype=torch.int64).reshape(bs, n)
    S = int(depth.max()) + 1 if depth.numel() else 1
    to = (lambda t: t.to(device)) if device is not None else (lambda t: t)
    return Tree(to(index), to(next_token), to(next_sibling), S, to(par), to(depth))


def from_parents(parents: Sequence[Sequence[int]], sibling_order=None, device=None) -> Tree:
    """Tree from parent lists.

    parents: one list per request, all of the same length n >= 1; ``parents[b][0] == -1`` (root)
    and every other entry a node id in [0, n) such that each node leads to the root.
    sibling_order: optional, one list of node ids per request; children of a node are linked in
    the order their ids appear there (must list every non-root node once; the root may be listed).
    Default: increasing node id. device: where the tensors go (default CPU).
    Raises ValueError for ragged input, a bad root, parents out of range, or cycles, and for a
    device this torch cannot use.
    """
    device = _device_arg(device)
    par = _int_rows(parents, "parents")
    bs, n = par.shape
    if bs and n == 0:
        raise ValueError("parents: every request needs at least the root node")
    if bs:
        bad_root = (par[:, 0] != -1).nonzero()
        if bad_root.numel():
            b = int(bad_root[0])
            raise ValueError(f"parents[{b}][0] must be -1 (node 0 is the root), got {int(par[b, 0])}")
        bad = ((par[:, 1:] < 0) | (par[:, 1:] >= n)).nonzero()
        if bad.numel():
            b, i = int(bad[0, 0]), int(bad[0, 1]) + 1
            raise ValueError(f"parents[{b}][{i}] = {int(par[b, i])} is not a node id in [0, {n})")
    depth = _depths(par)
    rank = torch.arange(n).expand(bs, n) if sibling_order is None else _rank_from_order(sibling_order, bs, n)
    return _link(par, rank, depth, device)


def chain(bs: int, depth: int, device=None) -> Tree:
    """``bs`` identical chains of ``depth + 1`` nodes (node i's parent is i - 1); S = depth + 1
    (1 when bs = 0). Needs ints bs >= 0 and depth >= 0."""
    bs, depth, device = _int_arg("bs", bs), _int_arg("depth", depth), _device_arg(device)
    par = torch.arange(-1, depth, dtype=torch.int64).expand(bs, depth + 1).clone()
    dep = torch.arange(depth + 1, dtype=torch.int64).expand(bs, depth + 1).clone()
    return _link(par, torch.arange(depth + 1).expand(bs, depth + 1), dep, device)


def eagle_max_nodes(depth: int, topk: int) -> int:
    """Most nodes an EAGLE-like tree can have: 1 + topk + (depth - 1) * topk**2 (1 for depth 0).
    Needs ints depth >= 0 and topk >= 1."""
    depth, topk = _int_arg("depth", depth), _int_arg("topk", topk, 1)
    return 1 if depth == 0 else 1 + topk + (depth - 1) * topk * topk


def _randint(low: int, high: int, generator) -> int:
    """Uniform integer in [low, high] (inclusive)."""
    return low + int(torch.randint(high - low + 1, (1,), generator=generator))


def _level_sizes(n: int, depth: int, topk: int, generator) -> list[int]:
    """Random node counts per level 0..depth summing to n, each level reachable from the last."""
    if depth == 0:
        return [1]
    sizes = [1, min(topk, n - depth)] + [1] * (depth - 1)
    for _ in range(n - sum(sizes)):
        open_levels = [j for j in range(2, depth + 1) if sizes[j] < topk * min(topk, sizes[j - 1])]
        sizes[open_levels[_randint(0, len(open_levels) - 1, generator)]] += 1
    return sizes


def _split(total: int, parts: int, cap: int, generator) -> list[int]:
    """Random split of ``total`` into ``parts`` counts, each in [1, cap]."""
    counts = [1] * parts
    for _ in range(total - parts):
        room = [k for k in range(parts) if counts[k] < cap]
        counts[room[_randint(0, len(room) - 1, generator)]] += 1
    return counts


def _eagle_parents(n: int, depth: int, topk: int, generator) -> list[int]:
    """Parent list of one random EAGLE-like tree with BFS node ids."""
    sizes = _level_sizes(n, depth, topk, generator)
    parents, prev, next_id = [-1], [0], 1
    for s in sizes[1:]:
        k = _randint(math.ceil(s / topk), min(topk, len(prev), s), generator)
        pick = torch.randperm(len(prev), generator=generator)[:k].tolist()
        chosen = sorted(prev[i] for i in pick)
        level = []
        for p, c in zip(chosen, _split(s, k, topk, generator)):
            parents += [p] * c
            level += range(next_id, next_id + c)
            next_id += c
        prev = level
    return parents


def eagle_tree(bs: int, n: int, depth: int, topk: int, generator: torch.Generator | None = None, device=None) -> Tree:
    """``bs`` random EAGLE-like top-k trees of exactly ``n`` nodes and max depth exactly ``depth``.

    Level 1 holds min(topk, n - depth) nodes (= min(topk, n - 1) unless n is too small to give
    the root topk children and still reach ``depth``); every later level picks up to ``topk``
    nodes of the previous level as parents and gives each 1..topk children. Node ids are in BFS
    order (level by level, children of a smaller id first), so parents have smaller ids and
    siblings are linked in id order. Draws come from ``generator`` (a CPU generator; default the
    global one), so a seeded generator gives the same batch; each request is drawn separately.
    Needs ints bs >= 0, depth >= 0, topk >= 1 and depth + 1 <= n <= :func:`eagle_max_nodes`
    (depth, topk), else TypeError (not an int) / ValueError.
    """
    bs, n, depth, topk = _int_arg("bs", bs), _int_arg("n", n, 1), _int_arg("depth", depth), _int_arg("topk", topk, 1)
    device = _device_arg(device)
    check_generator(generator, torch.device("cpu"))
    if n < depth + 1:
        raise ValueError(f"a tree of depth {depth} needs n >= {depth + 1} nodes, got n={n}")
    if n > eagle_max_nodes(depth, topk):
        raise ValueError(f"n={n} nodes do not fit a depth-{depth}, topk-{topk} tree (max {eagle_max_nodes(depth, topk)})")
    rows = [_eagle_parents(n, depth, topk, generator) for _ in range(bs)]
    par = torch.tensor(rows, dtype=torch.int64).reshape(bs, n)
    return _link(par, torch.arange(n).expand(bs, n), _depths(par), device)


# --------------------------------------------------------------------------------------------
# Draft tokens
# --------------------------------------------------------------------------------------------


def sibling_rank(tree: Tree) -> torch.Tensor:
    """Position of every node among its siblings (0 = first child) from the links; -1 for the root.

    Returns int64 [bs, n] on the tree's device.
    """
    tree = _tree_arg(tree)
    nt, ns = tree.retrive_next_token, tree.retrive_next_sibling
    bs, n = nt.shape
    rank = torch.full((bs, n), -1, dtype=torch.int64, device=nt.device)
    cur = nt.clone()  # first child of every node
    for r in range(n):
        live = (cur >= 0) & (cur < n)
        if not bool(live.any()):
            break
        b, i = live.nonzero(as_tuple=True)
        rank[b, cur[b, i]] = r
        cur = torch.where(live, ns.gather(1, cur.clamp(0, n - 1)), torch.full_like(cur, -1))
    return rank


def _clean(rows: torch.Tensor) -> torch.Tensor:
    """Rows with NaN, +-inf and non-positive entries set to 0."""
    return torch.where(torch.isfinite(rows) & (rows > 0), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _draw_with_replacement(rows: torch.Tensor, k: int, generator) -> torch.Tensor:
    """k draws (with replacement) from each clean row [m, V]; all-zero rows draw uniformly."""
    scale = rows.amax(dim=1, keepdim=True)
    w = torch.where(scale > 0, rows / scale.clamp(min=torch.finfo(rows.dtype).tiny), torch.ones_like(rows))
    return torch.multinomial(w, k, replacement=True, generator=generator)


def _draw_distinct(rows: torch.Tensor, k: int, generator, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """k draws per clean row [m, V] without replacement (Gumbel top-k) while positive entries
    last; the remaining draws of a row come with replacement. Returns int64 [m, k]."""
    m, V = rows.shape
    out = torch.empty(m, k, dtype=torch.int64, device=rows.device)
    step = max(1, chunk_elems // max(V, 1))
    kk = min(k, V)
    tiny = torch.finfo(torch.float32).tiny
    for s in range(0, m, step):
        r = rows[s : s + step].float()
        u = torch.rand(r.shape, generator=generator, device=r.device).clamp_(min=tiny)
        key = torch.where(r > 0, r.log() - (-u.log()).log(), torch.full_like(r, -math.inf))
        top = key.topk(kk, dim=1)
        fallback = _draw_with_replacement(r, k, generator)
        fallback[:, :kk] = torch.where(top.values > -math.inf, top.indices, fallback[:, :kk])
        out[s : s + step] = fallback
    return out


def sample_candidates(tree: Tree, probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draft tokens for every node, as a top-k drafter would pick them.

    tree: a :class:`Tree`. probs: float (float16, bfloat16, float32 or float64) [bs, n, V], V >= 1,
    the draft distribution after each node (row i = over i's children). Each non-root node draws
    its token from its parent's row ``probs[b, parent]``; the children of one node are drawn
    without replacement (in sibling order, Plackett-Luce, so the first child is an ordinary draw
    from the row), hence distinct while the row has enough positive entries; the rest are drawn
    with replacement. The root draws from ``probs[b, 0]``. NaN / inf / negative entries count as
    0; an all-zero row draws uniformly from [0, V). ``generator``: None or a torch.Generator on
    ``probs.device``. Returns int64 [bs, n] on ``probs.device``.
    """
    tree = _tree_arg(tree)
    probs = _tensor_arg("probs", probs, "bs, n, V", _FLOATS)
    check_generator(generator, probs.device)
    bs, n = tree.parents.shape
    if probs.shape[0] != bs or probs.shape[1] != n or probs.shape[2] < 1:
        raise ValueError(f"probs must be [bs={bs}, n={n}, V>=1], got {list(probs.shape)}")
    bad = ((tree.parents < -1) | (tree.parents >= n)).nonzero()
    if len(bad):
        b, i = bad[0].tolist()
        raise ValueError(f"tree.parents[{b}, {i}] = {int(tree.parents[b, i])} is outside [-1, n={n}): a parent "
                         f"is a node index, or -1 for the root")
    dev = probs.device
    out = torch.zeros(bs, n, dtype=torch.int64, device=dev)
    if bs == 0:
        return out
    rows = _clean(probs.float())
    out[:, 0] = _draw_with_replacement(rows[:, 0], 1, generator)[:, 0]
    rank = sibling_rank(tree).to(dev)
    if n == 1 or int(rank.max()) < 0:
        return out
    k = int(rank.max()) + 1
    pb, pn = (tree.retrive_next_token.to(dev) >= 0).nonzero(as_tuple=True)
    table = torch.zeros(bs, n, k, dtype=torch.int64, device=dev)
    table[pb, pn] = _draw_distinct(rows[pb, pn], k, generator)
    b = torch.arange(bs, device=dev)[:, None].expand(bs, n - 1)
    par = tree.parents.to(dev)[:, 1:].clamp(min=0)
    out[:, 1:] = table[b, par, rank[:, 1:].clamp(min=0)]
    return out


# --------------------------------------------------------------------------------------------
# EAGLE drafter outputs -> build_tree_kernel_efficient
# --------------------------------------------------------------------------------------------


class TreeMaskMode(IntEnum):
    """Layouts of the tree mask written by ``build_tree_kernel_efficient`` (sglang's names)."""

    FULL_MASK = 0  # bool, per request n rows of [verified prefix | n draft columns]
    QLEN_ONLY = 1  # bool [bs * n * n], draft columns only
    QLEN_ONLY_BITPACKING = 2  # one little-endian word (uint8 / uint16 / uint32) per node


class EagleDraft(NamedTuple):
    """What an EAGLE drafter hands to tree building after ``depth`` steps of top-``topk``.

    verified_id: int64 (or int32) [bs], the last verified token (the root).
    score_list: ``depth`` float tensors (float32 in sglang) of cumulative scores (products of draft
    probabilities along the path): step 0 [bs, 1, topk], step s >= 1 [bs, topk, topk] (row = beam).
    token_list: ``depth`` int64 (or int32) tensors: step 0 [bs, topk], step s >= 1 [bs, topk * topk].
    parents_list: ``depth`` int64 (or int32) tensors: step 0 [bs, topk + 1] = [-1, 0, .., topk-1],
    step s >= 1 [bs, topk]: the flat indices (see :func:`eagle_inputs`) of the beams kept at step s.
    The lists may be lists or tuples; all tensors on one device.
    """

    verified_id: torch.Tensor
    score_list: list
    token_list: list
    parents_list: list


class EagleInputs(NamedTuple):
    """The inputs of ``build_tree_kernel_efficient`` made from an :class:`EagleDraft`.

    parent_list: int64 [bs, topk * (depth - 1) + 1] ([bs, 0] for depth 1).
    selected_index: int64 [bs, n - 1], the chosen flat indices in increasing order.
    draft_tokens: int64 [bs * n], per request the verified token then the chosen tokens (the
    ``candidates`` of the verification ops, flattened).
    """

    parent_list: torch.Tensor
    selected_index: torch.Tensor
    draft_tokens: torch.Tensor


class TreeOutputs(NamedTuple):
    """Output buffers of ``build_tree_kernel_efficient``, allocated as sglang does.

    tree_mask: see :func:`tree_mask_numel` / :func:`packed_mask_dtype`; FULL_MASK and QLEN_ONLY
    filled with True, QLEN_ONLY_BITPACKING with 0. positions: int64 [bs * n] (uninitialised).
    retrive_index, retrive_next_token, retrive_next_sibling: int64 [bs, n], filled with -1 (three
    views of one [3, bs, n] buffer).
    """

    tree_mask: torch.Tensor
    positions: torch.Tensor
    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor


def _top_sorted(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, values descending; ties go to the lower index (NaN ranks first)."""
    order = torch.sort(x, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


def random_eagle_draft(bs: int, topk: int, depth: int, vocab: int, generator: torch.Generator | None = None,
                       spread: float = 3.0) -> EagleDraft:
    """Drafter outputs as sglang's EAGLE drafter produces them, from random draft distributions.

    Step 0 takes the top-``topk`` tokens of one distribution per request; step s >= 1 draws a
    distribution after each of the ``topk`` beams, takes its top-``topk`` tokens, multiplies their
    probabilities into the beam's score (``score_list[s]``) and keeps the ``topk`` best of the
    ``topk * topk`` products as the next beams (``parents_list[s]``). Distributions are softmaxes
    of ``spread * N(0, 1)`` logits. Needs ints bs >= 0, topk >= 1, depth >= 1, vocab >= topk and a
    finite real ``spread``. CPU tensors; draws from ``generator`` (a CPU generator; default: the
    global one).
    """
    bs, topk, depth = _int_arg("bs", bs), _int_arg("topk", topk, 1), _int_arg("depth", depth, 1)
    vocab = _int_arg("vocab", vocab, 1)
    if isinstance(spread, bool) or not isinstance(spread, numbers.Real):
        raise TypeError(f"spread must be a real number, got {type(spread).__name__} {spread!r}")
    if not math.isfinite(spread):
        raise ValueError(f"spread must be finite, got {spread!r}")
    check_generator(generator, torch.device("cpu"))
    if vocab < topk:
        raise ValueError(f"vocab must be >= topk = {topk}, got {vocab}")
    K = topk

    def probs(*shape):
        return torch.softmax(spread * torch.randn(*shape, vocab, generator=generator), dim=-1)

    p0, tok0 = _top_sorted(probs(bs), K)
    scores = p0  # [bs, K]: cumulative score of each beam
    score_list, token_list = [p0[:, None, :]], [tok0]
    parents_list = [torch.arange(-1, K, dtype=torch.int64).expand(bs, K + 1).clone()]
    for s in range(1, depth):
        p, tok = _top_sorted(probs(bs, K), K)  # [bs, K beams, K children]
        expand = scores[:, :, None] * p  # score of a child = beam score * its probability
        scores, keep = _top_sorted(expand.reshape(bs, K * K), K)
        score_list.append(expand)
        token_list.append(tok.reshape(bs, K * K))
        parents_list.append(keep + (K + (s - 1) * K * K))  # flat index of the kept children
    verified_id = torch.randint(vocab, (bs,), generator=generator)
    return EagleDraft(verified_id, score_list, token_list, parents_list)


def _check_draft(verified_id, score_list, token_list, parents_list, num_verify_tokens):
    """Checked drafter outputs (see :class:`EagleDraft`), as (verified_id, [scores], [tokens],
    [parents], num_verify_tokens) with torch tensors and an int."""
    verified_id = _tensor_arg("verified_id", verified_id, "bs", _INTS)
    for name, lst in (("score_list", score_list), ("token_list", token_list), ("parents_list", parents_list)):
        if not isinstance(lst, (list, tuple)):
            raise TypeError(f"{name} must be a list of tensors (one per draft step), got {type(lst).__name__}")
    if not (len(score_list) == len(token_list) == len(parents_list) >= 1):
        raise ValueError("score_list, token_list and parents_list need one entry per draft step (at least one)")
    bs, dev = verified_id.shape[0], verified_id.device
    K = _tensor_arg("score_list[0]", score_list[0], "bs, 1, topk", _FLOATS).shape[2]
    if K < 1:
        raise ValueError(f"score_list[0] must be [bs, 1, topk] with topk >= 1, got shape {list(score_list[0].shape)}")
    checked = ([], [], [])
    for s in range(len(score_list)):
        r, kept = (1, K + 1) if s == 0 else (K, K)
        for name, lst, dims, dtypes, shape, dst in (
            ("score_list", score_list, "bs, 1, topk" if s == 0 else "bs, topk, topk", _FLOATS, (bs, r, K), checked[0]),
            ("token_list", token_list, "bs, topk" if s == 0 else "bs, topk * topk", _INTS, (bs, r * K), checked[1]),
            ("parents_list", parents_list, "bs, topk + 1" if s == 0 else "bs, topk", _INTS, (bs, kept), checked[2]),
        ):
            t = _tensor_arg(f"{name}[{s}]", lst[s], dims, dtypes)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}[{s}] must be [{dims}] = {list(shape)} (bs={bs} from verified_id, "
                                 f"topk={K} from score_list[0]), got {list(t.shape)}")
            if t.device != dev:
                raise ValueError(f"{name}[{s}] is on {t.device} but verified_id is on {dev}; all tensors must share a device")
            dst.append(t)
    total = K + (len(score_list) - 1) * K * K
    n = _int_arg("num_verify_tokens", num_verify_tokens, 1)
    if n > total + 1:
        raise ValueError(f"num_verify_tokens must lie in [1, {total + 1}] ({total} drafted tokens + the root), got {n}")
    return verified_id, *checked, n


def eagle_inputs(verified_id, score_list, token_list, parents_list, num_verify_tokens: int) -> EagleInputs:
    """Inputs of ``build_tree_kernel_efficient`` from drafter outputs (see :class:`EagleDraft`).

    The drafted tokens are numbered by one flat index over the steps: step 0 is [0, topk), step
    s >= 1 follows with its ``topk * topk`` entries row by row. ``selected_index`` holds the flat
    indices of the ``num_verify_tokens - 1`` highest cumulative scores, in increasing order (ties
    go to the lower flat index, so a parent, whose score is never lower than its child's, is
    chosen first; NaN scores rank highest, as in ``torch.topk``). ``parent_list`` concatenates
    ``parents_list`` without the last step (nothing is drafted from the last beams).
    ``draft_tokens`` puts ``verified_id`` before each request's chosen tokens. Same device as the
    inputs; raises TypeError for a wrong type or dtype and ValueError for shapes other than
    :class:`EagleDraft`'s, tensors on several devices or too many tokens.
    """
    verified_id, score_list, token_list, parents_list, num_verify_tokens = _check_draft(
        verified_id, score_list, token_list, parents_list, num_verify_tokens)
    bs = verified_id.shape[0]
    scores = torch.cat([s.reshape(bs, s.shape[1] * s.shape[2]) for s in score_list], dim=1)
    tokens = torch.cat(list(token_list), dim=1).long()
    _, chosen = _top_sorted(scores, num_verify_tokens - 1)
    selected_index = torch.sort(chosen, dim=1).values
    draft = torch.cat([verified_id.long()[:, None], tokens.gather(1, selected_index)], dim=1)
    if len(parents_list) > 1:
        parent_list = torch.cat([p.long() for p in parents_list[:-1]], dim=1)
    else:
        parent_list = torch.empty(bs, 0, dtype=torch.int64, device=scores.device)
    return EagleInputs(parent_list, selected_index, draft.reshape(-1))


def packed_mask_dtype(num_verify_tokens: int) -> torch.dtype:
    """Word type of the bit-packed mask: uint8 / uint16 / uint32 for n <= 8 / <= 16 / <= 32
    (n = num_verify_tokens, an int in [1, 32])."""
    num_verify_tokens = _int_arg("num_verify_tokens", num_verify_tokens, 1)
    if num_verify_tokens > 32:
        raise ValueError(f"the bit-packed mask holds 1..32 draft tokens, got {num_verify_tokens}")
    return torch.uint8 if num_verify_tokens <= 8 else torch.uint16 if num_verify_tokens <= 16 else torch.uint32


def tree_mask_numel(bs: int, num_verify_tokens: int, tree_mask_mode: int, seq_lens_sum: int = 0) -> int:
    """Elements of the tree mask: FULL_MASK (seq_lens_sum + bs * n) * n, QLEN_ONLY bs * n * n,
    QLEN_ONLY_BITPACKING bs * n words. ``seq_lens_sum`` = sum of verified_seq_len (FULL_MASK).
    Needs ints bs >= 0, num_verify_tokens >= 1, seq_lens_sum >= 0 and a :class:`TreeMaskMode`
    (or its int value 0..2)."""
    bs, n = _int_arg("bs", bs), _int_arg("num_verify_tokens", num_verify_tokens, 1)
    mode = TreeMaskMode(_int_arg("tree_mask_mode", tree_mask_mode, 0, 2))
    seq_lens_sum = _int_arg("seq_lens_sum", seq_lens_sum)
    if mode == TreeMaskMode.FULL_MASK:
        return (seq_lens_sum + bs * n) * n
    return bs * n * n if mode == TreeMaskMode.QLEN_ONLY else bs * n


def alloc_tree_outputs(bs: int, num_verify_tokens: int, tree_mask_mode: int = TreeMaskMode.FULL_MASK,
                       seq_lens_sum: int = 0, device=None) -> TreeOutputs:
    """Output buffers of ``build_tree_kernel_efficient`` for bs requests of n = num_verify_tokens
    nodes (see :class:`TreeOutputs`); ``seq_lens_sum`` sizes the FULL_MASK mask. Arguments as in
    :func:`tree_mask_numel`; ``device``: where the buffers go (default CPU)."""
    bs, n = _int_arg("bs", bs), _int_arg("num_verify_tokens", num_verify_tokens, 1)
    mode, device = TreeMaskMode(_int_arg("tree_mask_mode", tree_mask_mode, 0, 2)), _device_arg(device)
    size = tree_mask_numel(bs, n, mode, seq_lens_sum)
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        tree_mask = torch.zeros(size, dtype=packed_mask_dtype(n), device=device)
    else:
        tree_mask = torch.ones(size, dtype=torch.bool, device=device)
    positions = torch.empty(bs * n, dtype=torch.int64, device=device)
    retrive = torch.full((3, bs, n), -1, dtype=torch.int64, device=device)
    return TreeOutputs(tree_mask, positions, retrive[0], retrive[1], retrive[2])


# --------------------------------------------------------------------------------------------
# Reading results
# --------------------------------------------------------------------------------------------


def _check_outputs(accept_index, accept_token_num) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's accept_index (int [bs, S]) and accept_token_num (int [bs]) as torch tensors."""
    accept_index = _tensor_arg("accept_index", accept_index, "bs, S", _INTS)
    accept_token_num = _tensor_arg("accept_token_num", accept_token_num, "bs", _INTS)
    if accept_token_num.shape[0] != accept_index.shape[0]:
        raise ValueError(f"accept_token_num must be [bs={accept_index.shape[0]}] like accept_index, "
                         f"got {list(accept_token_num.shape)}")
    return accept_index, accept_token_num


def _counts(num: list[int], S: int) -> None:
    for b, c in enumerate(num):
        if not 0 <= c < S:
            raise ValueError(f"accept_token_num[{b}] = {c} is outside [0, {S - 1}]")


def emitted_tokens(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor) -> list[list[int]]:
    """Tokens the step emits per request: the accepted draft tokens, then the correction / bonus.

    predicts: int [P]; accept_index: int [bs, S]; accept_token_num: int [bs] (the op's outputs,
    any device; int32 or int64; torch tensors or arrays with ``__dlpack__`` such as NumPy / CuPy,
    viewed without a copy). Request b gives
    ``[predicts[accept_index[b, j]] for j in 0..accept_token_num[b]]`` (inclusive, so ``accept_token_num[b] + 1`` tokens). Entries of accept_index past the count
    are ignored. One device-to-host transfer.
    """
    predicts = _tensor_arg("predicts", predicts, "P", _INTS)
    accept_index, accept_token_num = _check_outputs(accept_index, accept_token_num)
    bs, S = accept_index.shape
    if bs == 0:
        return []
    P = predicts.shape[0]
    idx = accept_index.long()
    tok = predicts.long()[idx.clamp(0, max(P - 1, 0))] if P else torch.zeros_like(idx)
    in_range = (idx >= 0) & (idx < P)
    packed = torch.cat([tok, in_range.long(), accept_token_num.long().to(tok.device)[:, None]], dim=1).tolist()
    num = [row[-1] for row in packed]
    _counts(num, S)
    result = []
    for b, row in enumerate(packed):
        c = num[b]
        if not all(row[S : S + c + 1]):
            raise ValueError(f"accept_index[{b}, :{c + 1}] holds an index outside predicts [0, {P})")
        result.append(row[: c + 1])
    return result


def path_nodes(tree: Tree, accept_index: torch.Tensor, accept_token_num: torch.Tensor) -> list[list[int]]:
    """Accepted path per request as node ids (root first, ``accept_token_num[b] + 1`` of them).

    Maps each ``accept_index[b, j]`` back to the node i with ``tree.retrive_index[b, i]`` equal to
    it (ValueError if there is none). accept_index, accept_token_num: as in :func:`emitted_tokens`.
    One device-to-host transfer.
    """
    tree = _tree_arg(tree)
    accept_index, accept_token_num = _check_outputs(accept_index, accept_token_num)
    bs, S = accept_index.shape
    if bs != tree.retrive_index.shape[0]:
        raise ValueError(f"accept_index has {bs} requests, the tree {tree.retrive_index.shape[0]}")
    if bs == 0:
        return []
    ri = tree.retrive_index.to(accept_index.device)
    eq = accept_index.long()[:, :, None] == ri[:, None, :]  # [bs, S, n]
    node = torch.where(eq.any(dim=2), eq.int().argmax(dim=2), torch.full_like(accept_index, -1, dtype=torch.int64))
    packed = torch.cat([node, accept_token_num.long().to(node.device)[:, None]], dim=1).tolist()
    num = [row[-1] for row in packed]
    _counts(num, S)
    result = []
    for b, row in enumerate(packed):
        path = row[: num[b] + 1]
        if -1 in path:
            j = path.index(-1)
            raise ValueError(f"accept_index[{b}, {j}] is not a retrive_index of request {b}")
        result.append(path)
    return result
