"""``build_tree_kernel_efficient`` (the API of sgl_kernel's op of the same name): turn an EAGLE
drafter's top-k choices into draft trees, their positions and the verify pass's attention mask.

Launch plan. One block per request (grid x = bs) rebuilds the request's tree. Trees of n <= 32 nodes are
built by one warp in registers, one node per lane: parents by a binary search of the selected indices
held in the lanes (a scan when they are not sorted), sibling groups by a warp match for the links,
ancestor sets by pointer doubling for positions and mask rows. Trees of 33 to 64 nodes are built the
same way by two warps, one node per thread, exchanging through shared memory at barriers of their own;
where their keys are sorted and below 1024, a node finds its parent by one lookup in a shared table of
each key's first node. Larger trees are built by the whole block in shared memory (one thread per node,
children sets as bitsets, ancestors by walking up). The mask is the only output that can be large: in
FULL_MASK each request's region is (s_b + n) * n bytes, mostly the verified prefix, whose 16-byte runs
(all ones) need no tree. For trees of up to 64 nodes the warps that do not build a tree write them while
the trees are built: each request's blocks its own region's, or, where one region dominates the batch
(at most 256 requests, the longest region over SPLIT_SKEW times the mean, e.g. one long context among
short ones, over SPLIT_RUNS runs for each writing thread of its own blocks and over 1 / SPLIT_SHARE of
the mask for each of them), each block those of an even share of the whole mask (cut at 16-byte
boundaries), so the long region's work is spread over the grid; larger trees write their own region's
runs. For trees of n <= DIRECT_TREE nodes (FULL_MASK; an instantiation of the kernel of their own) the
warp (n <= 32) or the two warps (n <= 64) that built the tree in the request's first block then write
every byte that holds a draft column from their threads' rows, with no block barrier: with >= 16
verified tokens a 16-byte run touches one row's draft columns at most; a region of shorter rows is
written whole by those warps (one warp: each 16-byte run from the (at most two) rows it spans, fetched
from their lanes by shuffles, or byte by byte where rows are shorter than 16 bytes; two warps: from the
rows in shared memory after a barrier of their own). Larger trees, and the other
modes, put the rows in shared memory, and after one barrier the block writes the 16-byte runs that hold
draft columns, found row by row. With few requests each request has C = min(8, 2 * SMs // bs) blocks
(grid y), or up to SMs // bs where the mask holds over CHUNK_BYTES per block (the plan sees the mask's
length, to a power of two, not the prefixes: a long region among short ones is the split's case
above), each rebuilding the (small) tree (in the direct instantiation only the first builds it) and
writing an interleaved share of the runs that hold draft columns; the other modes write at most n * n
bytes per request and use C = 1. The FULL_MASK region starts at sum_{j<b} (s_j + n) * n: the blocks scan
verified_seq_len themselves (no host round trip, no second kernel; a warp reads them 256 at a time while
the tree is built), so that work grows as bs**2: hidden behind the tree building for serving batches,
but a call with tens of thousands of requests spends most of its time there. 256 threads per block (up
to 1024 for n > 256). ``draft_token_num`` and ``tree_mask_mode`` are variant scalars: the mode selects
the kernel instantiation; a draft_token_num other than the trees' n, a mask dtype other than bool in
modes 0 and 1, and n > 32 in mode 2 are rejected on every call that is not served from a launch record
(whose key holds those values, so a record implies they passed).
"""

from __future__ import annotations

import torch

from ._core import Arg, Constraint, Launch, Op, Scalar
from .reference import build_tree_kernel_efficient as _reference
from .reference.build_tree_kernel_efficient import FULL_MASK, PACKED_MAX_TOKENS, QLEN_ONLY, QLEN_ONLY_BITPACKING

I64 = torch.int64
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64)
THREADS, MAX_THREADS, MAX_CHUNKS = 256, 1024, 8
CHUNK_BYTES = 1 << 14  # FULL_MASK: mask bytes per block above which a request gets more than MAX_CHUNKS blocks
PARENT_CACHE = 256  # parent_list entries per request staged in shared memory with the selected indices
DIRECT_TREE = 64  # FULL_MASK trees of at most this many nodes take the kernel's direct instantiation
# FULL_MASK, n <= 64: a region over SPLIT_SKEW times the mean spreads the prefix runs over the grid if it also
# holds over SPLIT_RUNS 16-byte runs for each thread of its own blocks that would write them and gives each of
# those blocks over 1 / SPLIT_SHARE of the whole mask (thresholds measured on an H100)
SPLIT_SKEW, SPLIT_RUNS, SPLIT_SHARE = 3, 48, 48

TABLE = (
    Arg("parent_list", I64, ("bs", "P"), "row q >= 1: flat index of the token that the tokens with flat // topk == q "
        "were drafted from (any P, also 0)", any_dtype_if_empty=True),
    Arg("selected_index", I64, ("bs", "m"), "flat indices of the m = n - 1 chosen draft tokens, sorted"),
    Arg("verified_seq_len", I64, ("bs",), "tokens before the root (clamped into [0, 2**31 - 1])"),
    Arg("tree_mask", MASK_DTYPES, ("L",), "laid out by tree_mask_mode (bool in modes 0 and 1; in mode 2 its bytes "
        "are written, n <= 8 / 16 / 32 packing each row into a 1-, 2- or 4-byte word); a request's region that does "
        "not fit whole is silently not written (cupy_spec.tree.alloc_tree_outputs sizes it)", written=True),
    Arg("positions", I64, ("N",), "position of every node, N = bs * n", written=True),
    Arg("retrive_index", I64, ("bs", "n"), "b * n + i", written=True),
    Arg("retrive_next_token", I64, ("bs", "n"), "first child of each node, -1 if none", written=True),
    Arg("retrive_next_sibling", I64, ("bs", "n"), "next sibling of each node, -1 if none", written=True),
    Scalar("topk", "int", "tokens drafted per beam and step", lo=1, hi=2**63 - 1),
    Scalar("depth", "int", "accepted for compatibility, not used (P is parent_list's width)", kernel=False),
    Scalar("draft_token_num", "int", "n, nodes per tree with the root", lo=1, hi=2**31 - 1, kernel=False, variant=True),
    Scalar("tree_mask_mode", "int", "0 FULL_MASK, 1 QLEN_ONLY, 2 QLEN_ONLY_BITPACKING (n <= 32)", FULL_MASK, 0, 2,
           kernel=False, variant=True),
)


def check_mode(n: int, dtype, draft_token_num: int, mode: int) -> None:
    """What the table cannot say: draft_token_num == n, n <= 32 for bit packing, bool in modes 0, 1."""
    if draft_token_num != n:
        raise ValueError(f"draft_token_num is {draft_token_num} but retrive_index has n={n} columns; need equal")
    if mode == QLEN_ONLY_BITPACKING and n > PACKED_MAX_TOKENS:
        raise ValueError(f"tree_mask_mode 2 (QLEN_ONLY_BITPACKING) holds at most {PACKED_MAX_TOKENS} draft tokens, "
                         f"got draft_token_num={n}")
    if mode != QLEN_ONLY_BITPACKING and dtype != torch.bool:
        raise TypeError(f"tree_mask must have dtype bool in tree_mask_mode {mode}, got {str(dtype)[6:]}")


def kernel_template(dtype, draft_token_num: int, mode: int) -> str:
    """The kernel's template arguments: the mode, and whether the direct instantiation runs."""
    direct = mode == FULL_MASK and draft_token_num <= DIRECT_TREE
    return f"{int(mode)}, {'true' if direct else 'false'}"


def smem_bytes(n: int) -> int:  # per block: selected index (8 B), parent (4 B), bitset row per node
    return n * (12 + 4 * -(-n // 32))


def _chunks(bs: int, mask_class: int, sms: int) -> int:
    """FULL_MASK: blocks per request, C = min(8, 2 * SMs // bs), or, where the mask (of fewer than
    2**mask_class entries) would hold over CHUNK_BYTES per block, up to SMs // bs blocks of at most
    that many bytes each (one block per SM: measured at two, a skewed batch lost the split of its
    long region, whose test counts the region's runs per thread of its own blocks)."""
    heavy = -(-(1 << mask_class) // (bs * CHUNK_BYTES))
    return max(1, min(2 * sms // bs, MAX_CHUNKS), min(sms // bs, heavy))


def plan(dims, variant, dev) -> Launch:
    dtype, _, mode = variant
    threads = min(MAX_THREADS, max(THREADS, 32 * -(-dims.n // 32)))
    chunks = _chunks(dims.bs, dims.L.bit_length(), dev.sms) if mode == FULL_MASK else 1
    return Launch((dims.bs, chunks), threads, smem_bytes(dims.n), fields=(dtype.itemsize,))


OP = Op(
    "build_tree_kernel_efficient",
    """Build the draft trees of an EAGLE drafter's top-k choices (sglang's tree building).

Node 0 of request b is the root, node i >= 1 the token at flat index selected_index[b, i-1]; its
parent is found through parent_list. Writes the links (children and siblings in increasing node
id), positions (verified_seq_len + depth) and the attention mask (root and ancestors-or-self of each
node) in the layout of tree_mask_mode. :mod:`cupy_spec.reference.build_tree_kernel_efficient` states
the semantics exactly, including orphans, out-of-range indices and masks too short for a request.""",
    TABLE,
    reference=_reference,
    plan=plan,
    plan_dims=("bs", "n", "L.bit_length()"),
    template=kernel_template,
    variants=((torch.bool, 1, FULL_MASK), (torch.bool, DIRECT_TREE + 1, FULL_MASK), (torch.bool, 1, QLEN_ONLY),
              (torch.uint8, 1, QLEN_ONLY_BITPACKING)),
    constraints=(
        Constraint("n >= 1", "retrive_index must have n >= 1 columns (the root), got shape {shapes[retrive_index]}"),
        Constraint("m == n - 1", "selected_index has m={m} columns but trees of n={n} nodes (retrive_index) need n-1"),
        Constraint("N == bs * n", "positions has N={N} entries but bs={bs} trees of n={n} nodes need bs * n"),
    ),
    constants=dict(MIN_THREADS=THREADS, MAX_THREADS=MAX_THREADS, PARENT_CACHE=PARENT_CACHE, DIRECT_TREE=DIRECT_TREE,
                   SPLIT_SKEW=SPLIT_SKEW, SPLIT_RUNS=SPLIT_RUNS, SPLIT_SHARE=SPLIT_SHARE),
    variant_check=lambda dims, variant: check_mode(dims.n, *variant),
    launch_fields=("mask_elem_bytes",),
    limits={"L": None},
    too_large=lambda dims, limit, launch: f"the trees have n={dims.n} nodes; the kernel keeps a tree in shared memory "
    f"and supports at most n={max(k for k in range(1, 4096) if smem_bytes(k) <= limit)} on this device",
)
build_tree_kernel_efficient = OP.function
