"""Pure-torch reference of ``build_tree_kernel_efficient``.

The op turns an EAGLE drafter's per-step top-k choices into a draft tree: the "retrive" links
used by the verification ops, the position of every node and the attention mask of the verify
pass. This module states its semantics; the CUDA kernel must match it exactly (all outputs are
integers or booleans, so bit for bit). It is also the CPU backend and runs on any torch device.

Notation, per request ``b``: ``n = draft_token_num``, ``K = topk``, ``P = parent_list.shape[1]``,
``sel[j] = selected_index[b, j]`` for ``j`` in ``[0, n-1)``. The drafter scores tokens in one
flat index space (step 0: ``[0, K)``, step ``s >= 1``: ``K + (s-1)*K*K`` onwards, ``K*K`` per
step); ``sel`` holds the flat indices of the chosen tokens in increasing order, and
``parent_list[b, q]`` for ``q >= 1`` is the flat index of the token that the tokens with
``flat // K == q`` were drafted from (``q == 0``: drafted from the root).

1. **Nodes.** Node 0 is the root (the last verified token); node ``i >= 1`` is the token at flat
   index ``sel[i-1]``.
2. **Parent** of node ``i >= 1``, with ``x = sel[i-1]`` and ``q = x // K``:

   * ``x < 0``: none;
   * ``q == 0``: the root (0);
   * ``1 <= q < P``: ``t = parent_list[b, q]``; the parent is ``j + 1`` for the smallest
     ``j < i - 1`` with ``sel[j] == t``; none if there is no such ``j``;
   * ``q >= P``: none.

   A node without a parent is an *orphan*: the drafter chose it but not its parent (sglang's
   op prints "invalid eagle tree" and skips it; it happens with NaN scores) or the input is
   malformed. An orphan is linked to nothing, so it and every node below it are unreachable
   from the root. Only earlier nodes can be parents (drafted parents have smaller flat indices,
   so on drafter output this loses nothing), hence the parent graph is a forest and every walk
   up from a node ends within ``n`` steps.
3. **Links.** Children are linked in increasing node id (what pushing each node at the front of
   its parent's child list, for ``i`` from ``n-1`` down to 1, gives):

   * ``retrive_next_token[b, p]``: the smallest ``i`` with ``parent(i) == p``, else -1;
   * ``retrive_next_sibling[b, i]``: the smallest ``j > i`` with ``parent(j) == parent(i)``,
     else -1 (always -1 for the root and for orphans);
   * ``retrive_index[b, i] = b * n + i``.
4. **Paths and positions.** ``path(i)`` is the set of nodes met walking up from ``i`` through
   parents, ``i`` included, stopping before the root or after an orphan; ``path(0)`` is empty.
   ``d(i) = |path(i)|`` is the depth of a reachable node (a node below an orphan gets the depth
   it would have if the orphan hung from the root). With
   ``s_b = clamp(verified_seq_len[b], 0, SEQ_LEN_MAX)``:
   ``positions[b * n + i] = s_b + d(i)``.
5. **Mask.** Node ``i`` attends to the root and to ``path(i)``: draft column ``c`` is set iff
   ``c == 0`` or ``c in path(i)``.

   * ``FULL_MASK`` (0), bool: per request ``n`` rows of ``s_b + n`` entries, row ``i`` =
     ``s_b`` times True (the verified prefix) then the ``n`` draft columns; request ``b``'s
     region starts at ``sum_{j<b} (s_j + n) * n``.
   * ``QLEN_ONLY`` (1), bool: the draft columns only, row ``i`` of request ``b`` at
     ``(b * n + i) * n``.
   * ``QLEN_ONLY_BITPACKING`` (2): one little-endian word of ``W`` bytes per node (``W`` = 1, 2
     or 4 for ``n`` <= 8, <= 16, <= 32), word ``b * n + i``; bit ``c`` is draft column ``c``,
     bits ``>= n`` are 0. Its bytes are written whatever ``tree_mask``'s dtype (this reference
     takes any; the public op accepts bool and the integer dtypes of its table, bool only in
     modes 0 and 1, and raises TypeError for others).
6. **What is written.** All of ``positions`` and of the three ``retrive_*`` tensors, and each
   request's mask region whole (prefix columns and whole words included), nothing else. A
   request whose region does not lie entirely inside ``tree_mask`` (counted in elements, or in
   bytes for mode 2) writes no mask entry; regions are consecutive, so these are the requests
   from the first that overflows on. sglang's op writes only the draft columns, the bits it
   sets and the links it makes, relying on the buffers it allocates (mask True, packed words 0,
   ``retrive_*`` -1); with those the results are the same.

Arguments outside these rules raise ValueError before anything is written (the public op raises
TypeError for a wrong type or dtype): ``topk >= 1``,
``draft_token_num >= 1``, ``tree_mask_mode`` in {0, 1, 2}, ``draft_token_num <= 32`` in mode 2,
shapes as documented in :func:`build_tree_kernel_efficient`. ``depth`` is accepted for
compatibility and not used: the row width ``P`` is taken from ``parent_list`` (sglang builds
``P = topk * (depth - 1) + 1``, or an empty ``[bs, 0]`` tensor for depth 1).
"""

from __future__ import annotations

import operator

import torch

__all__ = [
    "build_tree_kernel_efficient",
    "tree_parents",
    "packed_word_bytes",
    "FULL_MASK",
    "QLEN_ONLY",
    "QLEN_ONLY_BITPACKING",
    "SEQ_LEN_MAX",
    "PACKED_MAX_TOKENS",
]

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2
#: verified_seq_len is clamped into [0, SEQ_LEN_MAX] (sglang's op reads it as a 32-bit int).
SEQ_LEN_MAX = 2**31 - 1
#: Most draft tokens the bit-packed mask can hold (one 32-bit word per node).
PACKED_MAX_TOKENS = 32


def packed_word_bytes(draft_token_num: int) -> int:
    """Bytes per node of the bit-packed mask: 1, 2 or 4 for n <= 8, <= 16, else (n <= 32)."""
    return 1 if draft_token_num <= 8 else 2 if draft_token_num <= 16 else 4


# --------------------------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------------------------


def _first_where(hit: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dimension, -1 where there is none (int64)."""
    idx = hit.int().argmax(dim=-1).long()
    return torch.where(hit.any(dim=-1), idx, torch.full_like(idx, -1))


def tree_parents(parent_list: torch.Tensor, selected_index: torch.Tensor, topk: int) -> torch.Tensor:
    """Parent of every node (rule 2 of the module docstring).

    parent_list: integer [bs, P] (P may be 0); selected_index: integer [bs, n-1]; topk >= 1.
    Returns int64 [bs, n] on selected_index's device: -1 for the root (column 0) and for orphans,
    else the parent's node id, always smaller than the node's own id. Reads nothing out of range.
    """
    bs, m = selected_index.shape  # m = n - 1 selected draft tokens
    dev = selected_index.device
    parent = torch.full((bs, m + 1), -1, dtype=torch.int64, device=dev)
    if m == 0:
        return parent
    sel = selected_index.long()
    P = parent_list.shape[1]
    q = torch.where(sel >= 0, torch.div(sel, topk, rounding_mode="floor"), torch.full_like(sel, -1))
    from_root = q == 0
    looked_up = (q >= 1) & (q < P)
    if P > 0:
        # t[b, k] = flat index of the parent token of selected token k (where looked_up).
        t = parent_list.long().gather(1, q.clamp(0, P - 1))
    else:
        t = torch.zeros_like(sel)
    # match[b, k, j]: selected token j (node j+1) is the parent token of k (node k+1), j < k.
    earlier = torch.ones(m, m, dtype=torch.bool, device=dev).tril(-1)
    match = (sel[:, None, :] == t[:, :, None]) & earlier
    first = _first_where(match)  # smallest such j, -1 if none
    none = torch.full_like(sel, -1)
    parent[:, 1:] = torch.where(from_root, torch.zeros_like(sel), torch.where(looked_up & (first >= 0), first + 1, none))
    return parent


def _links(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next_token, next_sibling), int64 [bs, n], children in increasing id (rule 3)."""
    bs, n = parent.shape
    ids = torch.arange(n, device=parent.device)
    # child_of[b, p, i]: node i is a child of node p.
    child_of = parent[:, None, :] == ids[None, :, None]
    next_token = _first_where(child_of)
    # later_sibling[b, i, j]: j > i and both hang from the same (existing) parent.
    later = ids[None, :] > ids[:, None]
    same = (parent[:, :, None] == parent[:, None, :]) & (parent[:, :, None] >= 0)
    next_sibling = _first_where(same & later)
    return next_token, next_sibling


def _paths(parent: torch.Tensor) -> torch.Tensor:
    """on_path[b, i, c]: node c lies on path(i) (rule 4), bool [bs, n, n]."""
    bs, n = parent.shape
    dev = parent.device
    on_path = torch.zeros(bs, n, n, dtype=torch.bool, device=dev)
    cur = torch.arange(n, device=dev).expand(bs, n).clone()  # node 0 starts (and stays) stopped
    rows = torch.arange(n, device=dev).expand(bs, n)
    batch = torch.arange(bs, device=dev)[:, None].expand(bs, n)
    for _ in range(n):  # parents precede children: at most n - 1 steps
        live = cur > 0  # 0: reached the root; -1: stepped past an orphan
        if not bool(live.any()):
            break
        on_path[batch[live], rows[live], cur[live]] = True
        cur = torch.where(live, parent.gather(1, cur.clamp(min=0)), cur)
    return on_path


def _draft_columns(on_path: torch.Tensor) -> torch.Tensor:
    """The n draft columns of every mask row: root column and path(i), bool [bs, n, n]."""
    cols = on_path.clone()
    cols[:, :, 0] = True
    return cols


# --------------------------------------------------------------------------------------------
# Writing the mask
# --------------------------------------------------------------------------------------------


def _write_full(mask: torch.Tensor, cols: torch.Tensor, seq: list[int]) -> None:
    """FULL_MASK: request b's region is its n rows of [s_b prefix Trues | n draft columns]."""
    n = cols.shape[1]
    L = mask.numel()
    off = 0
    for b, s in enumerate(seq):
        size = (s + n) * n
        if off + size > L:
            return  # this request and all later ones do not fit
        rows = torch.ones(n, s + n, dtype=torch.bool, device=cols.device)
        rows[:, s:] = cols[b]
        mask[off : off + size] = rows.reshape(-1).to(mask.dtype)
        off += size


def _write_qlen(mask: torch.Tensor, cols: torch.Tensor) -> None:
    """QLEN_ONLY: request b's n*n draft columns at b*n*n, for the requests that fit whole."""
    bs, n, _ = cols.shape
    fit = min(bs, mask.numel() // (n * n))
    mask[: fit * n * n] = cols[:fit].reshape(-1).to(mask.dtype)


def _write_packed(mask: torch.Tensor, cols: torch.Tensor) -> None:
    """QLEN_ONLY_BITPACKING: word (b*n + i) = sum of 2**c over set columns, W bytes, LSB first."""
    bs, n, _ = cols.shape
    W = packed_word_bytes(n)
    raw = mask.view(torch.uint8)  # the words' bytes, in memory order
    fit = min(bs, raw.numel() // (n * W))
    weights = torch.tensor([1 << c for c in range(n)], dtype=torch.int64, device=cols.device)
    words = (cols[:fit].long() * weights).sum(dim=2)  # int64 [fit, n], < 2**32
    shifts = torch.arange(W, device=cols.device) * 8
    data = ((words[:, :, None] >> shifts) & 0xFF).to(torch.uint8)  # [fit, n, W], little-endian
    raw[: fit * n * W] = data.reshape(-1)


# --------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------


def _as_int(name: str, value) -> int:
    """An integer scalar (int, IntEnum, numpy integer), else ValueError."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return operator.index(value)


def _check(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
           retrive_next_token, retrive_next_sibling, topk, draft_token_num, tree_mask_mode) -> None:
    """Argument checks of the reference (shapes and scalars; values are never rejected)."""
    n = draft_token_num
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if n < 1:
        raise ValueError(f"draft_token_num must be >= 1, got {n}")
    if tree_mask_mode not in (FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING):
        raise ValueError(f"tree_mask_mode must be 0 (FULL_MASK), 1 (QLEN_ONLY) or 2 (QLEN_ONLY_BITPACKING), got {tree_mask_mode!r}")
    if tree_mask_mode == QLEN_ONLY_BITPACKING and n > PACKED_MAX_TOKENS:
        raise ValueError(f"QLEN_ONLY_BITPACKING holds at most {PACKED_MAX_TOKENS} draft tokens, got {n}")
    if parent_list.dim() != 2:
        raise ValueError(f"parent_list must be [bs, P], got {tuple(parent_list.shape)}")
    bs = parent_list.shape[0]
    want = {
        "selected_index": (selected_index, (bs, n - 1)),
        "verified_seq_len": (verified_seq_len, (bs,)),
        "positions": (positions, (bs * n,)),
        "retrive_index": (retrive_index, (bs, n)),
        "retrive_next_token": (retrive_next_token, (bs, n)),
        "retrive_next_sibling": (retrive_next_sibling, (bs, n)),
    }
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (bs={bs}, n={n}), got {list(t.shape)}")
    if not tree_mask.is_contiguous():
        raise ValueError(f"tree_mask must be contiguous (it is written as a flat buffer), got strides {tree_mask.stride()}")


def build_tree_kernel_efficient(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode=FULL_MASK,
):
    """Reference implementation; same arguments as sglang's op of the same name.

    Args (bs requests, n = draft_token_num nodes each):
        parent_list: int64 [bs, P], P = topk * (depth - 1) + 1 as the drafter builds it (any P,
            also 0, is read safely).
        selected_index: int64 [bs, n-1]: flat indices of the chosen draft tokens, sorted.
        verified_seq_len: int64 [bs]: tokens before the root per request (the root's position).
        tree_mask: **written**: mode 0: bool [>= sum(s_b) * n + bs * n * n]; mode 1: bool
            [>= bs * n * n]; mode 2: >= bs * n * W bytes, any dtype (sglang uses uint8 / uint16 /
            uint32 words of W bytes). Must be contiguous (it is viewed flat).
        positions: int64 [bs * n], **written**.
        retrive_index, retrive_next_token, retrive_next_sibling: int64 [bs, n], **written**.
        topk, depth, draft_token_num, tree_mask_mode: ints (depth unused, see module docstring).

    Returns None; every output is written in place (see the module docstring for exactly which
    entries). Raises ValueError for bad scalars or shapes, before writing anything.
    """
    topk = _as_int("topk", topk)
    draft_token_num = _as_int("draft_token_num", draft_token_num)
    tree_mask_mode = _as_int("tree_mask_mode", tree_mask_mode)
    _check(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
           retrive_next_token, retrive_next_sibling, topk, draft_token_num, tree_mask_mode)
    bs, n = retrive_index.shape
    if bs == 0:
        return None
    dev = retrive_index.device

    parent = tree_parents(parent_list.to(dev), selected_index.to(dev), topk)
    next_token, next_sibling = _links(parent)
    on_path = _paths(parent)
    depth_of = on_path.sum(dim=2)  # d(i) = |path(i)|
    seq = verified_seq_len.to(dev).long().clamp(0, SEQ_LEN_MAX)

    retrive_index.copy_(torch.arange(bs * n, dtype=torch.int64, device=dev).reshape(bs, n))
    retrive_next_token.copy_(next_token)
    retrive_next_sibling.copy_(next_sibling)
    positions.copy_((seq[:, None] + depth_of).reshape(-1))

    mask = tree_mask.view(-1)
    cols = _draft_columns(on_path).to(mask.device)
    if tree_mask_mode == FULL_MASK:
        _write_full(mask, cols, seq.tolist())
    elif tree_mask_mode == QLEN_ONLY:
        _write_qlen(mask, cols)
    else:
        _write_packed(mask, cols)
    return None
