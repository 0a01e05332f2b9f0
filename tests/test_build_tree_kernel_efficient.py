"""Tests of ``build_tree_kernel_efficient``: the reference, the drafter helpers in
:mod:`cupy_spec.tree`, and the op (:mod:`cupy_spec.build_tree_kernel_efficient`).

* a case with known outputs of sglang's op of the same name (EAGLE drafter outputs for 2
  requests, topk 4, depth 4, 8 draft tokens) reproduced exactly in all three mask modes, with the
  masks written out as data;
* random drafter outputs and hostile inputs checked against ``oracle``, a scalar per-request
  restatement of the rules written independently of the reference (links by pushing each node at
  the front of its parent's child list, paths by walking up);
* hostile inputs (indices out of range or negative, parents that were not selected, cycles,
  negative or huge ``verified_seq_len``, tiny buffers) never raise and never write outside the
  outputs: outputs are views into larger canary-filled buffers, bool masks are run twice (prefilled
  True and False) so that every entry not written is seen to keep its value;
* round trip: trees from random drafter outputs are proper trees in the layout of
  :mod:`cupy_spec.tree` and drive the verification op;
* the op: argument errors name the argument (CPU), CPU tensors run the reference, the launch plan;
  on a GPU (tests marked ``gpu``) the kernel equals the reference byte for byte on every output
  buffer, canaries and poisoned entries included, for drafter outputs and hostile inputs, inside a
  CUDA graph and on CuPy arrays.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cases import captured
from cupy_spec.reference import tree_speculative_sampling_target_only as verify_op
from cupy_spec.reference.build_tree_kernel_efficient import SEQ_LEN_MAX, build_tree_kernel_efficient
from cupy_spec.tree import (
    TreeMaskMode,
    alloc_tree_outputs,
    eagle_inputs,
    from_parents,
    packed_mask_dtype,
    path_nodes,
    random_eagle_draft,
    tree_mask_numel,
)

FULL, QLEN, PACKED = 0, 1, 2
CANARY = -777
MASK_CANARY_BYTE = 0xA5

# ----------------------------------------------------------------------------------------------
# known outputs of sglang's op of the same name: drafter outputs and expectations
# ----------------------------------------------------------------------------------------------

SG_VERIFIED_ID = [29974, 13]
SG_SCORES = [
    [[[7.1127e-01, 2.8292e-01, 2.2995e-03, 1.7357e-03]],
     [[9.7476e-01, 2.2219e-02, 6.5031e-04, 1.3212e-04]]],
    [[[6.9142e-01, 1.2863e-02, 1.6873e-03, 1.1871e-03],
      [2.4787e-01, 1.8818e-02, 1.4204e-02, 9.2235e-04],
      [2.2971e-03, 1.6700e-06, 1.8737e-07, 8.3146e-08],
      [1.2771e-03, 2.4374e-04, 1.7832e-04, 1.1947e-05]],
     [[8.4832e-02, 6.6068e-02, 5.8304e-02, 5.7851e-02],
      [2.3616e-03, 1.1243e-03, 5.4368e-04, 2.7768e-04],
      [2.5286e-04, 1.5578e-04, 2.8817e-05, 1.2888e-05],
      [1.2834e-04, 2.5417e-06, 1.1279e-06, 1.6088e-08]]],
    [[[6.6438e-01, 2.6997e-02, 2.4236e-05, 4.0821e-06],
      [2.4402e-01, 2.8409e-03, 5.0935e-04, 2.9022e-04],
      [1.6178e-02, 2.0567e-03, 4.5892e-04, 3.0034e-05],
      [1.3023e-02, 5.0497e-04, 3.6371e-04, 8.7750e-05]],
     [[2.3263e-02, 2.0054e-02, 9.3990e-03, 2.7783e-03],
      [6.4156e-02, 5.5506e-04, 1.0429e-04, 9.7211e-05],
      [4.9950e-02, 5.0630e-03, 9.0068e-04, 3.3656e-04],
      [7.5817e-03, 8.5731e-04, 6.9972e-04, 6.0793e-04]]],
    [[[6.6420e-01, 1.0525e-04, 6.5864e-05, 1.2253e-06],
      [1.3019e-01, 1.0461e-01, 5.2083e-03, 1.6777e-03],
      [2.0103e-02, 6.7335e-03, 1.2625e-04, 1.0364e-05],
      [1.5142e-02, 7.0819e-04, 9.6595e-05, 8.7951e-05]],
     [[5.8608e-02, 1.8840e-03, 7.8535e-04, 4.4400e-04],
      [1.2185e-02, 2.0684e-03, 1.7418e-03, 1.4327e-03],
      [6.2455e-03, 6.1487e-03, 2.6862e-03, 1.8034e-03],
      [1.8590e-03, 1.6151e-03, 1.2481e-03, 3.6038e-04]]],
]
SG_TOKENS = [
    [[29896, 29906, 29900, 29945], [13, 2, 29871, 28956]],
    [[29889, 29974, 29945, 29900, 29974, 29922, 29930, 29958, 29889, 29974, 29930, 29945, 29974, 29922, 29930, 29958],
     [22550, 4136, 16492, 8439, 29871, 2, 3001, 13, 2, 13, 29906, 29946, 2, 13, 29871, 259]],
    [[29946, 29945, 29953, 29906, 29896, 29945, 29900, 29906, 29896, 29945, 29906, 29953, 29896, 29945, 29906, 29946],
     [29871, 2, 29901, 29889, 29871, 2, 395, 259, 29901, 29871, 2, 29889, 3001, 1234, 7146, 2186]],
    [[29946, 29974, 29945, 29930, 29889, 29922, 29974, 29930, 29974, 29946, 29930, 29922, 29889, 29974, 29945, 29922],
     [29941, 29906, 2, 29946, 29871, 450, 319, 14990, 29946, 29941, 2, 29906, 29871, 2, 3001, 13]],
]
SG_PARENTS = [
    [[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]],
    [[4, 8, 9, 10], [4, 5, 6, 7]],
    [[20, 24, 21, 28], [24, 28, 20, 21]],
    [[36, 40, 41, 44], [36, 40, 44, 45]],
]
SG_SEQ_LENS = [5, 10]
SG_TOPK, SG_DEPTH, SG_N = 4, 4, 8

SG_POSITIONS = [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
SG_RETRIVE_INDEX = [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
SG_NEXT_TOKEN = [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]
SG_NEXT_SIBLING = [[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]]
SG_DRAFT_TOKENS = [29974, 29896, 29906, 29889, 29974, 29946, 29896, 29946,
                   13, 13, 22550, 4136, 16492, 8439, 29871, 29941]
SG_SELECTED = [[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]]

# Draft columns of every mask row (node i attends to the root and to its ancestors and itself).
SG_DRAFT_MASK = [
    [[1, 0, 0, 0, 0, 0, 0, 0],
     [1, 1, 0, 0, 0, 0, 0, 0],
     [1, 0, 1, 0, 0, 0, 0, 0],
     [1, 1, 0, 1, 0, 0, 0, 0],
     [1, 0, 1, 0, 1, 0, 0, 0],
     [1, 1, 0, 1, 0, 1, 0, 0],
     [1, 0, 1, 0, 1, 0, 1, 0],
     [1, 1, 0, 1, 0, 1, 0, 1]],
    [[1, 0, 0, 0, 0, 0, 0, 0],
     [1, 1, 0, 0, 0, 0, 0, 0],
     [1, 1, 1, 0, 0, 0, 0, 0],
     [1, 1, 0, 1, 0, 0, 0, 0],
     [1, 1, 0, 0, 1, 0, 0, 0],
     [1, 1, 0, 0, 0, 1, 0, 0],
     [1, 1, 0, 1, 0, 0, 1, 0],
     [1, 1, 0, 1, 0, 0, 1, 1]],
]
SG_PACKED_WORDS = [[1, 3, 5, 11, 21, 43, 85, 171], [1, 3, 7, 11, 19, 35, 75, 203]]


def sglang_draft():
    """sglang's drafter outputs as tensors (verified_id, score_list, token_list, parents_list)."""
    return (
        torch.tensor(SG_VERIFIED_ID, dtype=torch.int32),
        [torch.tensor(s, dtype=torch.float32) for s in SG_SCORES],
        [torch.tensor(t, dtype=torch.int64) for t in SG_TOKENS],
        [torch.tensor(p, dtype=torch.int64) for p in SG_PARENTS],
    )


def run_op(inputs, seq_lens, topk, depth, n, mode, seq_lens_sum=None):
    """Allocate the outputs as sglang does and run the reference; returns the outputs."""
    bs = len(seq_lens)
    total = sum(seq_lens) if seq_lens_sum is None else seq_lens_sum
    out = alloc_tree_outputs(bs, n, mode, seq_lens_sum=total)
    build_tree_kernel_efficient(inputs.parent_list, inputs.selected_index, torch.tensor(seq_lens, dtype=torch.int64),
                                *out, topk, depth, n, mode)
    return out


# ----------------------------------------------------------------------------------------------
# the oracle: a scalar, per-request restatement of the rules
# ----------------------------------------------------------------------------------------------


def oracle_parents(parent_row: list[int], sel_row: list[int], topk: int, n: int) -> list[int]:
    """Parent of every node (-1: root or orphan) by direct search over the earlier nodes."""
    par = [-1] * n
    for i in range(1, n):
        x = sel_row[i - 1]
        if x < 0:
            continue
        q = x // topk
        if q == 0:
            par[i] = 0
        elif q < len(parent_row):
            t = parent_row[q]
            earlier = sel_row[: i - 1]
            if t in earlier:
                par[i] = earlier.index(t) + 1
    return par


def oracle_links(par: list[int]) -> tuple[list[int], list[int]]:
    """next_token / next_sibling by pushing each node at the front of its parent's child list."""
    n = len(par)
    nt, ns = [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):
        p = par[i]
        if p >= 0:
            ns[i] = nt[p]
            nt[p] = i
    return nt, ns


def oracle_path(par: list[int], i: int) -> list[int]:
    """Nodes met walking up from i (i included) until the root (excluded) or an orphan (included)."""
    path = []
    while i != 0:
        path.append(i)
        if par[i] < 0:
            break
        i = par[i]
    return path


def word_bytes(n: int) -> int:
    return 1 if n <= 8 else 2 if n <= 16 else 4


def clamp_seq(s: int) -> int:
    return min(max(s, 0), SEQ_LEN_MAX)


def oracle(parent_list, sel, seq_lens, topk, n, mode, mask_units):
    """Expected outputs. parent_list, sel: lists of rows; seq_lens: list of ints; mask_units:
    length of the mask buffer in elements (bytes for mode 2). Returns (positions, retrive_index,
    next_token, next_sibling, writes) with writes = {mask element (byte) index: value}."""
    bs = len(seq_lens)
    positions, ri, nt_all, ns_all, writes = [], [], [], [], {}
    off = 0
    overflowed = False
    for b in range(bs):
        par = oracle_parents(parent_list[b], sel[b], topk, n)
        nt, ns = oracle_links(par)
        nt_all.append(nt)
        ns_all.append(ns)
        ri.append([b * n + i for i in range(n)])
        s = clamp_seq(seq_lens[b])
        rows = []
        for i in range(n):
            path = oracle_path(par, i)
            positions.append(s + len(path))
            rows.append([c == 0 or c in path for c in range(n)])
        if mode == FULL:
            size = (s + n) * n
            overflowed = overflowed or off + size > mask_units
            if not overflowed:
                for i in range(n):
                    row = [True] * s + rows[i]
                    for k, v in enumerate(row):
                        writes[off + i * (s + n) + k] = v
            off += size
        elif mode == QLEN:
            if (b + 1) * n * n <= mask_units:
                for i in range(n):
                    for c in range(n):
                        writes[(b * n + i) * n + c] = rows[i][c]
        else:
            W = word_bytes(n)
            if (b + 1) * n * W <= mask_units:
                for i in range(n):
                    word = sum(1 << c for c in range(n) if rows[i][c])
                    for k in range(W):
                        writes[(b * n + i) * W + k] = (word >> (8 * k)) & 0xFF
    return positions, ri, nt_all, ns_all, writes


# ----------------------------------------------------------------------------------------------
# running with canaries
# ----------------------------------------------------------------------------------------------


def embed(numel: int, dtype, fill, pad: int = 5):
    """A buffer of numel + 2 * pad elements filled with ``fill`` and its middle view."""
    big = torch.full((numel + 2 * pad,), fill, dtype=dtype)
    return big, big[pad : pad + numel]


def run_with_canaries(parent_list, sel, seq_lens, topk, depth, n, mode, mask_len, mask_dtype, mask_fill):
    """Run the reference on outputs embedded in canary buffers; check the canaries and that the
    inputs are unchanged. Returns (positions, ri, nt, ns, mask_bytes_or_elements view, mask_big)."""
    bs = len(seq_lens)
    pl = torch.tensor(parent_list, dtype=torch.int64).reshape(bs, len(parent_list[0]))
    si = torch.tensor(sel, dtype=torch.int64).reshape(bs, n - 1)
    vs = torch.tensor(seq_lens, dtype=torch.int64)
    originals = (pl.clone(), si.clone(), vs.clone())
    pos_big, pos = embed(bs * n, torch.int64, CANARY)
    ri_big, ri = embed(bs * n, torch.int64, CANARY)
    nt_big, nt = embed(bs * n, torch.int64, CANARY)
    ns_big, ns = embed(bs * n, torch.int64, CANARY)
    mask_big, mask = embed(mask_len, mask_dtype, mask_fill)
    mask_before = mask_big.clone()
    build_tree_kernel_efficient(pl, si, vs, mask, pos, ri.view(bs, n), nt.view(bs, n), ns.view(bs, n),
                                topk, depth, n, mode)
    for big in (pos_big, ri_big, nt_big, ns_big):
        assert (big[:5] == CANARY).all() and (big[5 + bs * n :] == CANARY).all(), "wrote outside an output"
    assert torch.equal(mask_big[:5], mask_before[:5]) and torch.equal(mask_big[5 + mask_len :], mask_before[5 + mask_len :]), \
        "wrote outside tree_mask"
    for before, after in zip(originals, (pl, si, vs)):
        assert torch.equal(before, after), "an input was modified"
    return pos, ri, nt, ns, mask, mask_before[5 : 5 + mask_len]


def check_case(parent_list, sel, seq_lens, topk, depth, n, mode, mask_len, mask_dtype=None):
    """Run (twice for bool masks, with different prefills) and compare with the oracle."""
    bs = len(seq_lens)
    if mask_dtype is None:
        mask_dtype = torch.bool if mode != PACKED else torch.uint8
    fills = [True, False] if mask_dtype == torch.bool else [MASK_CANARY_BYTE if mask_dtype == torch.uint8 else 0x5A5A]
    rows_pl = [list(parent_list[b]) for b in range(bs)]
    rows_sel = [list(sel[b]) for b in range(bs)]
    units = mask_len * (torch.empty(0, dtype=mask_dtype).element_size() if mode == PACKED else 1)
    exp_pos, exp_ri, exp_nt, exp_ns, writes = oracle(rows_pl, rows_sel, seq_lens, topk, n, mode, units)
    for fill in fills:
        pos, ri, nt, ns, mask, before = run_with_canaries(parent_list, sel, seq_lens, topk, depth, n, mode,
                                                          mask_len, mask_dtype, fill)
        assert pos.tolist() == exp_pos
        assert ri.view(bs, n).tolist() == exp_ri
        assert nt.view(bs, n).tolist() == exp_nt
        assert ns.view(bs, n).tolist() == exp_ns
        got = (mask.view(torch.uint8) if mode == PACKED else mask).tolist()
        prev = (before.view(torch.uint8) if mode == PACKED else before).tolist()
        wrong = [k for k in range(len(got)) if got[k] != writes.get(k, prev[k])]
        assert not wrong, f"mask entries {wrong[:8]} differ (mode {mode})"
    return writes


def full_mask_len(seq_lens, n):
    return (sum(clamp_seq(s) for s in seq_lens) + len(seq_lens) * n) * n


def needed_units(seq_lens, n, mode):
    """Mask length that fits every request: elements (modes 0, 1) or bytes (mode 2)."""
    bs = len(seq_lens)
    return full_mask_len(seq_lens, n) if mode == FULL else bs * n * n if mode == QLEN else bs * n * word_bytes(n)


# ----------------------------------------------------------------------------------------------
# the known case
# ----------------------------------------------------------------------------------------------


def test_sglang_inputs():
    inputs = eagle_inputs(*sglang_draft(), SG_N)
    assert inputs.selected_index.tolist() == SG_SELECTED
    assert inputs.draft_tokens.tolist() == SG_DRAFT_TOKENS
    assert inputs.parent_list.shape == (2, SG_TOPK * (SG_DEPTH - 1) + 1)
    # The selection does not depend on how ties are broken: it equals plain torch.topk's.
    flat = torch.cat([torch.tensor(s).reshape(2, -1) for s in SG_SCORES], dim=1)
    assert torch.sort(torch.topk(flat, SG_N - 1).indices).values.tolist() == SG_SELECTED


@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED])
def test_sglang_case(mode):
    inputs = eagle_inputs(*sglang_draft(), SG_N)
    out = run_op(inputs, SG_SEQ_LENS, SG_TOPK, SG_DEPTH, SG_N, mode)
    assert out.positions.tolist() == SG_POSITIONS
    assert out.retrive_index.tolist() == SG_RETRIVE_INDEX
    assert out.retrive_next_token.tolist() == SG_NEXT_TOKEN
    assert out.retrive_next_sibling.tolist() == SG_NEXT_SIBLING
    n = SG_N
    if mode == FULL:
        off = 0
        for b, s in enumerate(SG_SEQ_LENS):
            rows = out.tree_mask[off : off + (s + n) * n].view(n, s + n)
            assert rows[:, :s].all(), "the verified prefix is visible to every node"
            assert rows[:, s:].int().tolist() == SG_DRAFT_MASK[b]
            off += (s + n) * n
        assert off == out.tree_mask.numel()
    elif mode == QLEN:
        assert out.tree_mask.view(2, n, n).int().tolist() == SG_DRAFT_MASK
    else:
        assert out.tree_mask.dtype == torch.uint8
        assert out.tree_mask.view(2, n).tolist() == SG_PACKED_WORDS


def test_sglang_mask_matches_expected_links():
    """The mask data above agrees with the ancestors read off sglang's expected links."""
    for b in range(2):
        parents = {}
        for p in range(SG_N):
            c = SG_NEXT_TOKEN[b][p]
            while c != -1:
                parents[c] = p
                c = SG_NEXT_SIBLING[b][c]
        for i in range(SG_N):
            anc, j = {0}, i
            while j != 0:
                anc.add(j)
                j = parents[j]
            assert [int(c in anc) for c in range(SG_N)] == SG_DRAFT_MASK[b][i]
            assert SG_POSITIONS[b * SG_N + i] == SG_SEQ_LENS[b] + len(anc) - 1
            assert SG_PACKED_WORDS[b][i] == sum(1 << c for c in anc)


@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED])
def test_sglang_case_against_oracle_with_canaries(mode):
    inputs = eagle_inputs(*sglang_draft(), SG_N)
    check_case(inputs.parent_list.tolist(), inputs.selected_index.tolist(), SG_SEQ_LENS, SG_TOPK, SG_DEPTH, SG_N,
               mode, needed_units(SG_SEQ_LENS, SG_N, mode))


# A larger tree: one request, topk 10, 64 draft tokens, 47 verified tokens, depth 6.
BIG_INDEX = [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 30, 110, 130, 150, 160, 210, 211, 212, 213, 214, 215, 216, 217,
             218, 219, 220, 230, 310, 311, 312, 313, 314, 315, 316, 317, 320, 321, 322, 330, 360, 380, 390, 410, 411,
             412, 413, 414, 415, 416, 417, 418, 419, 420, 421, 422, 423, 430, 431, 440, 441, 460, 470]
BIG_PARENTS = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 30, 21, 13, 22, 40, 23, 110, 130, 160, 150, 190, 120,
               111, 121, 200, 180, 210, 211, 212, 213, 214, 215, 216, 220, 230, 217, 310, 311, 312, 313, 320, 314, 321,
               315, 316, 317]


@pytest.mark.parametrize("mode", [FULL, QLEN])
def test_64_token_tree(mode):
    n = 64
    assert len(BIG_INDEX) == n - 1 and len(BIG_PARENTS) == 10 * 5 + 1
    writes = check_case([BIG_PARENTS], [BIG_INDEX], [47], 10, 5, n, mode, needed_units([47], n, mode))
    par = oracle_parents(BIG_PARENTS, BIG_INDEX, 10, n)
    assert -1 not in par[1:], "every selected token has its parent selected"
    assert max(len(oracle_path(par, i)) for i in range(n)) == 6
    assert len(writes) == needed_units([47], n, mode)


# ----------------------------------------------------------------------------------------------
# hand-made cases
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8, 9, 16, 17, 32])
def test_star_packed_word_sizes(n):
    """All draft tokens hang from the root: word i = 1 | 1 << i, W bytes little-endian."""
    topk = 32
    sel = [list(range(n - 1))]
    out = alloc_tree_outputs(1, n, TreeMaskMode.QLEN_ONLY_BITPACKING)
    assert out.tree_mask.dtype == packed_mask_dtype(n) and out.tree_mask.element_size() == word_bytes(n)
    build_tree_kernel_efficient(torch.empty(1, 0, dtype=torch.int64), torch.tensor(sel, dtype=torch.int64).view(1, n - 1),
                                torch.tensor([3]), *out, topk, 1, n, PACKED)
    raw = out.tree_mask.view(torch.uint8).tolist()
    W = word_bytes(n)
    words = [sum(raw[i * W + k] << (8 * k) for k in range(W)) for i in range(n)]
    assert words == [1] + [1 | (1 << i) for i in range(1, n)]
    assert out.positions.tolist() == [3] + [4] * (n - 1)
    assert out.retrive_next_token.tolist() == [[1 if n > 1 else -1] + [-1] * (n - 1)]
    assert out.retrive_next_sibling.tolist() == [([-1] + list(range(2, n)) + [-1]) if n > 1 else [-1]]


def test_orphan_from_nan_scores():
    """A child whose score is NaN is chosen without its parent: it is an orphan (unreachable),
    its mask row holds the root and itself, its position is seq_len + 1, and its own child is
    linked below it."""
    nan = float("nan")
    verified_id = torch.tensor([7])
    score_list = [torch.tensor([[[0.6, 0.4]]]),
                  torch.tensor([[[0.3, 0.1], [nan, 0.2]]]),
                  torch.tensor([[[0.9, 0.04], [0.05, 0.01]]])]
    token_list = [torch.tensor([[10, 11]]), torch.tensor([[20, 21, 22, 23]]), torch.tensor([[30, 31, 32, 33]])]
    # Step 1 keeps the beams at flat 4 (NaN, drafted from token flat 1) and 2; step 2 row 0 holds
    # the children of flat 4 (flat 6, 7).
    parents_list = [torch.tensor([[-1, 0, 1]]), torch.tensor([[4, 2]]), torch.tensor([[6, 8]])]
    inputs = eagle_inputs(verified_id, score_list, token_list, parents_list, 4)
    # flat scores: [.6 .4 | .3 .1 nan .2 | .9 .04 .05 .01] -> nan (4), .9 (6), .6 (0)
    assert inputs.selected_index.tolist() == [[0, 4, 6]]
    assert inputs.parent_list.tolist() == [[-1, 0, 1, 4, 2]]
    assert inputs.draft_tokens.tolist() == [7, 10, 22, 30]
    out = run_op(inputs, [6], 2, 3, 4, QLEN)
    # node 1 (flat 0): root child; node 2 (flat 4): q = 2 -> parent token flat 1, not chosen ->
    # orphan; node 3 (flat 6): q = 3 -> parent token flat 4 -> node 2.
    assert out.retrive_next_token.tolist() == [[1, -1, 3, -1]]
    assert out.retrive_next_sibling.tolist() == [[-1, -1, -1, -1]]
    assert out.positions.tolist() == [6, 7, 7, 8]
    assert out.tree_mask.view(4, 4).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]


def test_parent_list_wider_than_depth_and_empty():
    """The row width of parent_list is its own shape; depth is not used; P = 0 is read safely."""
    pl = torch.tensor([[0, 0, 2, 1, 7]])
    sel = torch.tensor([[0, 2, 1, 7]])
    for depth in (1, 2, 9):
        out = alloc_tree_outputs(1, 5, FULL, seq_lens_sum=5)
        build_tree_kernel_efficient(pl, sel, torch.tensor([5]), *out, 2, depth, 5, FULL)
        assert out.positions.tolist() == [5, 6, 7, 6, 7]
        assert out.tree_mask.view(5, 10)[:, 5:].int().tolist() == [
            [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]
        assert out.retrive_next_token.tolist() == [[1, 2, -1, 4, -1]]
        assert out.retrive_next_sibling.tolist() == [[-1, 3, -1, -1, -1]]
    out = alloc_tree_outputs(1, 5, QLEN)
    build_tree_kernel_efficient(torch.empty(1, 0), sel, torch.tensor([5]), *out, 2, 1, 5, QLEN)
    assert out.retrive_next_token.tolist() == [[1, -1, -1, -1, -1]]  # only flat 0 and 1 hang from the root
    assert out.retrive_next_sibling.tolist() == [[-1, 3, -1, -1, -1]]
    assert out.positions.tolist() == [5, 6, 6, 6, 6]


def test_self_and_cyclic_parents_are_orphans():
    """parent_list pointing at the node itself or at a later node links nothing (no cycles)."""
    topk = 2
    # node 1: flat 2 (q 1 -> parent_list[1] = 2: itself); node 2: flat 4 (q 2 -> 6: node 3, later);
    # node 3: flat 6 (q 3 -> 4: node 2, earlier).
    pl = [[-1, 2, 6, 4]]
    sel = [[2, 4, 6]]
    check_case(pl, sel, [3], topk, 3, 4, QLEN, 16)
    par = oracle_parents(pl[0], sel[0], topk, 4)
    assert par == [-1, -1, -1, 2]


def test_duplicate_selected_index_links_to_first():
    pl = [[-1, 0, 0]]
    sel = [[0, 0, 2, 3]]  # nodes 1 and 2 share flat 0; nodes 3, 4 have parent token flat 0
    check_case(pl, sel, [0], 2, 2, 5, FULL, needed_units([0], 5, FULL))
    assert oracle_parents(pl[0], sel[0], 2, 5) == [-1, 0, 0, 1, 1]


@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED])
def test_empty_batch_and_single_node(mode):
    out = alloc_tree_outputs(0, 4, mode)
    build_tree_kernel_efficient(torch.empty(0, 3, dtype=torch.int64), torch.empty(0, 3, dtype=torch.int64),
                                torch.empty(0, dtype=torch.int64), *out, 2, 2, 4, mode)
    check_case([[-1], [-1]], [[], []], [2, 0], 3, 1, 1, mode, needed_units([2, 0], 1, mode))


def test_bad_arguments_raise_before_writing():
    out = alloc_tree_outputs(1, 3, FULL, seq_lens_sum=2)
    args = [torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1]]), torch.tensor([2]), *out]
    before = [t.clone() for t in out]
    bad = [
        dict(topk=0), dict(topk=1.5), dict(draft_token_num=0), dict(draft_token_num=4), dict(tree_mask_mode=3),
        dict(tree_mask_mode=-1), dict(topk=True),
    ]
    for change in bad:
        kw = dict(topk=2, depth=2, draft_token_num=3, tree_mask_mode=FULL) | change
        with pytest.raises(ValueError):
            build_tree_kernel_efficient(*args, kw["topk"], kw["depth"], kw["draft_token_num"], kw["tree_mask_mode"])
    with pytest.raises(ValueError, match="selected_index"):
        build_tree_kernel_efficient(args[0], torch.tensor([[0, 1, 2]]), *args[2:], 2, 2, 3, FULL)
    with pytest.raises(ValueError, match="positions"):
        build_tree_kernel_efficient(*args[:4], torch.empty(2, dtype=torch.int64), *args[5:], 2, 2, 3, FULL)
    with pytest.raises(ValueError, match="at most 32"):
        o = alloc_tree_outputs(1, 33, QLEN)
        build_tree_kernel_efficient(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 32, dtype=torch.int64),
                                    torch.tensor([0]), *o, 2, 1, 33, PACKED)
    with pytest.raises(ValueError, match="contiguous"):
        m = torch.ones(40, dtype=torch.bool)[::2]
        build_tree_kernel_efficient(*args[:3], m, *args[4:], 2, 2, 3, FULL)
    for t, b in zip(out, before):
        assert torch.equal(t, b)


def test_tree_mask_mode_enum_and_numpy_ints():
    np = pytest.importorskip("numpy")
    inputs = eagle_inputs(*sglang_draft(), SG_N)
    out = alloc_tree_outputs(2, SG_N, TreeMaskMode.QLEN_ONLY)
    build_tree_kernel_efficient(inputs.parent_list, inputs.selected_index, torch.tensor(SG_SEQ_LENS), *out,
                                np.int64(SG_TOPK), SG_DEPTH, np.int32(SG_N), TreeMaskMode.QLEN_ONLY)
    assert out.retrive_next_token.tolist() == SG_NEXT_TOKEN


# ----------------------------------------------------------------------------------------------
# hostile inputs
# ----------------------------------------------------------------------------------------------

HUGE_SEQ = [-(2**63), -(2**31), -1, SEQ_LEN_MAX, 2**31, 2**40, 2**63 - 1]
HUGE_INDEX = [-(2**63), -(2**31) - 1, 2**31, 2**62, 2**63 - 1]


@st.composite
def hostile_cases(draw):
    bs = draw(st.integers(0, 4))
    n = draw(st.integers(1, 10))
    topk = draw(st.integers(1, 4))
    P = draw(st.integers(0, 8))
    mode = draw(st.sampled_from([FULL, QLEN, PACKED]))
    hi = topk * max(P, 1) + 3
    value = st.one_of(st.integers(-3, hi), st.sampled_from(HUGE_INDEX))
    small = st.integers(-3, hi)
    sel = [draw(st.lists(st.one_of(small, small, value), min_size=n - 1, max_size=n - 1)) for _ in range(bs)]
    # parent_list entries mostly name selected tokens, so that links, self-references and cycles occur
    pl = [draw(st.lists(st.one_of(value, *[st.sampled_from(row)] * 3) if row else value, min_size=P, max_size=P))
          for row in sel]
    seq = draw(st.lists(st.one_of(st.integers(-5, 12), st.sampled_from(HUGE_SEQ)), min_size=bs, max_size=bs))
    dtype = torch.bool if mode != PACKED else draw(st.sampled_from([torch.uint8, packed_mask_dtype(n)]))
    unit = torch.empty(0, dtype=dtype).element_size() if mode == PACKED else 1
    need = -(-needed_units(seq, n, mode) // unit)
    length = draw(st.one_of(st.integers(0, min(need, 300) + 6), st.just(need if need <= 3000 else 0)))
    return pl, sel, seq, topk, n, mode, length, dtype


@settings(max_examples=300, deadline=None)
@given(hostile_cases())
def test_hostile_inputs_match_oracle_and_stay_in_bounds(case):
    pl, sel, seq, topk, n, mode, length, dtype = case
    bs = len(seq)
    if bs == 0:
        pl_t = torch.empty(0, 0, dtype=torch.int64)
        out = alloc_tree_outputs(0, n, mode)
        build_tree_kernel_efficient(pl_t, torch.empty(0, n - 1, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                                    *out, topk, 3, n, mode)
        return
    check_case(pl, sel, seq, topk, 3, n, mode, length, dtype)


@st.composite
def corrupted_drafts(draw):
    """Drafter output with a few entries of selected_index / parent_list overwritten."""
    topk = draw(st.integers(1, 3))
    depth = draw(st.integers(2, 4))
    bs = draw(st.integers(1, 3))
    mode = draw(st.sampled_from([FULL, QLEN, PACKED]))
    n = draw(st.integers(2, min(topk + (depth - 1) * topk * topk + 1, 20)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    inputs = eagle_inputs(*random_eagle_draft(bs, topk, depth, 16, generator=gen), n)
    sel, pl = inputs.selected_index.tolist(), inputs.parent_list.tolist()
    P = len(pl[0])
    for _ in range(draw(st.integers(1, 4))):
        b = draw(st.integers(0, bs - 1))
        anything = st.one_of(st.integers(-3, topk * P + 3), st.sampled_from(HUGE_INDEX), st.sampled_from(sel[b]))
        if draw(st.booleans()):
            sel[b][draw(st.integers(0, n - 2))] = draw(anything)
        else:
            pl[b][draw(st.integers(0, P - 1))] = draw(anything)
    seq = draw(st.lists(st.one_of(st.integers(-3, 9), st.sampled_from(HUGE_SEQ)), min_size=bs, max_size=bs))
    need = needed_units(seq, n, mode)
    length = draw(st.one_of(st.integers(0, min(need, 300) + 6), st.just(need if need <= 3000 else 0)))
    return pl, sel, seq, topk, n, mode, length


@settings(max_examples=200, deadline=None)
@given(corrupted_drafts())
def test_corrupted_drafts_match_oracle(case):
    pl, sel, seq, topk, n, mode, length = case
    check_case(pl, sel, seq, topk, 4, n, mode, length)


def test_hostile_huge_seq_len_writes_no_mask_but_positions():
    n = 3
    pl, sel = [[-1, 0, 1]] * 2, [[0, 2]] * 2
    writes = check_case(pl, sel, [2, 2**40], 2, 2, n, FULL, full_mask_len([2, 0], n) + 50)
    assert len(writes) == (2 + n) * n  # the first request fits, the second (clamped to 2**31-1) does not
    pos, *_ = oracle(pl, sel, [2, 2**40], 2, n, FULL, 0)
    assert pos[n:] == [SEQ_LEN_MAX, SEQ_LEN_MAX + 1, SEQ_LEN_MAX + 2]


def test_hostile_negative_seq_len_counts_as_zero():
    pl, sel = [[-1, 0, 1]] * 2, [[0, 2]] * 2
    writes = check_case(pl, sel, [-7, 1], 2, 2, 3, FULL, full_mask_len([0, 1], 3))
    assert len(writes) == full_mask_len([0, 1], 3)


@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED])
def test_hostile_tiny_buffers_write_whole_requests_only(mode):
    pl, sel, seq = [[-1, 0, 1]] * 3, [[0, 2]] * 3, [1, 2, 3]
    need = needed_units(seq, 3, mode)
    for length in range(0, need + 2):
        writes = check_case(pl, sel, seq, 2, 2, 3, mode, length)
        sizes = [(clamp_seq(s) + 3) * 3 for s in seq] if mode == FULL else [9 if mode == QLEN else 3] * 3
        fitting, total = 0, 0
        for size in sizes:
            if total + size > length:
                break
            total, fitting = total + size, fitting + 1
        assert len(writes) == total


# ----------------------------------------------------------------------------------------------
# random drafter outputs and the round trip into the verification layout
# ----------------------------------------------------------------------------------------------


@st.composite
def draft_cases(draw):
    topk = draw(st.integers(1, 4))
    depth = draw(st.integers(1, 5))
    bs = draw(st.integers(1, 3))
    total = topk + (depth - 1) * topk * topk
    mode = draw(st.sampled_from([FULL, QLEN, PACKED]))
    n = draw(st.integers(1, min(total + 1, 32 if mode == PACKED else 40)))
    seq = draw(st.lists(st.integers(0, 9), min_size=bs, max_size=bs))
    seed = draw(st.integers(0, 2**31 - 1))
    return bs, topk, depth, n, mode, seq, seed


def draft_tree(bs, topk, depth, n, mode, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    draft = random_eagle_draft(bs, topk, depth, vocab=max(topk, 16), generator=gen)
    inputs = eagle_inputs(*draft, n)
    out = run_op(inputs, seq, topk, depth, n, mode)
    return draft, inputs, out


@settings(max_examples=150, deadline=None)
@given(draft_cases())
def test_random_drafts_match_oracle(case):
    bs, topk, depth, n, mode, seq, seed = case
    _, inputs, _ = draft_tree(*case)
    check_case(inputs.parent_list.tolist(), inputs.selected_index.tolist(), seq, topk, depth, n, mode,
               needed_units(seq, n, mode))


def first_child_chain(nt: list[int]) -> list[int]:
    path = [0]
    while nt[path[-1]] != -1:
        path.append(nt[path[-1]])
    return path


@settings(max_examples=100, deadline=None)
@given(draft_cases())
def test_round_trip_into_verification_layout(case):
    bs, topk, depth, n, mode, seq, seed = case
    draft, inputs, out = draft_tree(*case)
    sel = inputs.selected_index.tolist()
    flat_tokens = torch.cat(draft.token_list, dim=1).tolist()
    parents = []
    for b in range(bs):
        par = oracle_parents(inputs.parent_list[b].tolist(), sel[b], topk, n)
        assert -1 not in par[1:], "drafter output has no orphans (finite scores, ties to the parent)"
        for i in range(1, n):
            x = sel[b][i - 1]
            assert par[i] < i
            # the parent of a step >= 1 token is the token its beam came from
            want = -1 if x < topk else inputs.parent_list[b, x // topk].item()
            assert (sel[b][par[i] - 1] if par[i] > 0 else -1) == want
            assert inputs.draft_tokens[b * n + i].item() == flat_tokens[b][x]
        assert inputs.draft_tokens[b * n].item() == draft.verified_id[b].item()
        parents.append(par)

    # The links are those of cupy_spec.tree's layout for the same parents (siblings by node id),
    # so every node is reached exactly once from the root; depths agree with positions.
    tree = from_parents(parents)
    assert torch.equal(out.retrive_index, tree.retrive_index)
    assert torch.equal(out.retrive_next_token, tree.retrive_next_token)
    assert torch.equal(out.retrive_next_sibling, tree.retrive_next_sibling)
    assert (out.positions.view(bs, n) - torch.tensor(seq)[:, None]).tolist() == tree.depth.tolist()
    assert tree.S <= depth + 1

    # Mask rows hold exactly the root and the ancestors-or-self of each node.
    for b in range(bs):
        for i in range(n):
            anc, j = {0}, i
            while j != 0:
                anc.add(j)
                j = parents[b][j]
            expect = [c in anc for c in range(n)]
            if mode == FULL:
                off = sum((s + n) * n for s in seq[:b]) + i * (seq[b] + n)
                row = out.tree_mask[off : off + seq[b] + n].tolist()
                assert row == [True] * seq[b] + expect
            elif mode == QLEN:
                assert out.tree_mask[(b * n + i) * n : (b * n + i + 1) * n].tolist() == expect
            else:
                W = word_bytes(n)
                raw = out.tree_mask.view(torch.uint8)[(b * n + i) * W : (b * n + i + 1) * W].tolist()
                assert sum(v << (8 * k) for k, v in enumerate(raw)) == sum(1 << c for c in anc)

    # The tree drives the verification op: a target that puts all its mass on each node's first
    # child's token accepts the first-child chain (up to S - 1 levels).
    V = max(topk, 16)
    cand = inputs.draft_tokens.view(bs, n)
    nt = out.retrive_next_token
    target = torch.zeros(bs, n, V)
    for b in range(bs):
        for i in range(n):
            c = nt[b, i].item()
            target[b, i, cand[b, c] if c >= 0 else 0] = 1.0
    S = tree.S
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, S), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    verify_op(predicts, accept_index, accept_num, cand, out.retrive_index, out.retrive_next_token,
              out.retrive_next_sibling, torch.full((bs, n), 0.5), torch.full((bs,), 0.5), target, None)
    for b, path in enumerate(path_nodes(tree, accept_index, accept_num)):
        assert path == first_child_chain(nt[b].tolist())[:S]


def test_eagle_inputs_shapes_and_errors():
    draft = random_eagle_draft(2, 3, 1, 10, generator=torch.Generator().manual_seed(1))
    inputs = eagle_inputs(*draft, 4)
    assert inputs.parent_list.shape == (2, 0) and inputs.parent_list.dtype == torch.int64
    assert inputs.selected_index.tolist() == [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(ValueError, match="num_verify_tokens"):
        eagle_inputs(*draft, 5)
    with pytest.raises(ValueError, match="one entry per draft step"):
        eagle_inputs(draft.verified_id, [], [], [], 1)
    with pytest.raises(ValueError, match="token_list"):
        eagle_inputs(draft.verified_id, draft.score_list, [draft.token_list[0][:, :2]], draft.parents_list, 2)


def test_eagle_inputs_empty_batch():
    inputs = eagle_inputs(*random_eagle_draft(0, 2, 3, 5), 4)
    assert inputs.parent_list.shape == (0, 5) and inputs.selected_index.shape == (0, 3)
    assert inputs.draft_tokens.shape == (0,)


@pytest.mark.parametrize("n,dtype", [(1, torch.uint8), (8, torch.uint8), (9, torch.uint16), (16, torch.uint16),
                                     (17, torch.uint32), (32, torch.uint32)])
def test_alloc_tree_outputs(n, dtype):
    assert packed_mask_dtype(n) == dtype
    out = alloc_tree_outputs(3, n, PACKED)
    assert out.tree_mask.dtype == dtype and out.tree_mask.shape == (3 * n,) and not out.tree_mask.view(torch.uint8).any()
    out = alloc_tree_outputs(3, n, FULL, seq_lens_sum=7)
    assert out.tree_mask.dtype == torch.bool and out.tree_mask.numel() == 7 * n + 3 * n * n and out.tree_mask.all()
    assert tree_mask_numel(3, n, QLEN) == 3 * n * n
    for t in out[2:]:
        assert t.shape == (3, n) and t.dtype == torch.int64 and (t == -1).all()
    assert out.positions.shape == (3 * n,) and out.positions.dtype == torch.int64
    with pytest.raises(ValueError):
        packed_mask_dtype(33)


# ----------------------------------------------------------------------------------------------
# the op: argument checks, CPU backend and launch plan
# ----------------------------------------------------------------------------------------------

op_mod = importlib.import_module("cupy_spec.build_tree_kernel_efficient")
op = op_mod.build_tree_kernel_efficient
gpu = pytest.mark.gpu
POISON = -7
MASK_POISON = 0xA5  # byte of every tree_mask entry before a call: entries not written keep it
PAD = 13  # canary elements either side of every output (odd: mask regions start unaligned)


def sglang_args(mode, device="cpu"):
    """The known case as the op's arguments, outputs allocated as sglang does."""
    inputs = eagle_inputs(*sglang_draft(), SG_N)
    out = alloc_tree_outputs(2, SG_N, mode, seq_lens_sum=sum(SG_SEQ_LENS), device=device)
    ins = [inputs.parent_list, inputs.selected_index, torch.tensor(SG_SEQ_LENS)]
    return [t.to(device) for t in ins] + list(out) + [SG_TOPK, SG_DEPTH, SG_N, mode]


def check_sglang_outputs(args, mode):
    mask, pos, ri, nt, ns = (t.cpu() for t in args[3:8])
    assert pos.tolist() == SG_POSITIONS and ri.tolist() == SG_RETRIVE_INDEX
    assert nt.tolist() == SG_NEXT_TOKEN and ns.tolist() == SG_NEXT_SIBLING
    if mode == PACKED:
        assert mask.view(2, SG_N).tolist() == SG_PACKED_WORDS
    elif mode == QLEN:
        assert mask.view(2, SG_N, SG_N).int().tolist() == SG_DRAFT_MASK
    else:
        a, b = SG_SEQ_LENS
        first, second = mask[: (a + SG_N) * SG_N].view(SG_N, -1), mask[(a + SG_N) * SG_N :].view(SG_N, -1)
        assert first[:, :a].all() and second[:, :b].all()
        assert [first[:, a:].int().tolist(), second[:, b:].int().tolist()] == SG_DRAFT_MASK


@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED])
def test_op_on_cpu_tensors_runs_the_reference(mode):
    args = sglang_args(mode)
    op(*args)
    check_sglang_outputs(args, mode)
    args = sglang_args(TreeMaskMode(mode))
    torch.ops.cupy_spec.build_tree_kernel_efficient(*args)
    check_sglang_outputs(args, mode)


def _bad(edit):
    def change(args):
        args = list(args)
        edit(args)
        return args
    return change


def _set(i, value):
    return _bad(lambda a: a.__setitem__(i, value(a) if callable(value) else value))


@pytest.mark.parametrize("change, error, match", [
    (_set(0, lambda a: a[0].int()), TypeError, "parent_list must have dtype int64"),
    (_set(1, lambda a: a[1][:, :-1].contiguous()), ValueError, "selected_index has m=6 columns"),
    (_set(2, lambda a: a[2][:1]), ValueError, "verified_seq_len must have shape"),
    (_set(2, lambda a: a[2].int()), TypeError, "verified_seq_len must have dtype int64"),
    (_set(3, lambda a: a[3].float()), TypeError, "tree_mask must have dtype"),
    (_set(3, lambda a: a[3].to(torch.uint8)), TypeError, "tree_mask must have dtype bool in tree_mask_mode 0"),
    (_set(3, lambda a: a[3].view(-1, 2)), ValueError, "tree_mask must have shape"),
    (_set(3, lambda a: torch.ones(2 * a[3].numel(), dtype=torch.bool)[::2]), ValueError, "tree_mask must be contiguous"),
    (_set(4, lambda a: a[4][:-1]), ValueError, "positions has N=15 entries"),
    (_set(7, lambda a: a[7][:, :-1]), ValueError, "retrive_next_sibling must have shape"),
    (_set(8, 0), ValueError, "topk must lie in"),
    (_set(8, 2.0), TypeError, "topk must be an int"),
    (_set(9, None), TypeError, "depth must be an int"),
    (_set(10, 7), ValueError, "draft_token_num is 7 but retrive_index has n=8"),
    (_set(10, True), TypeError, "draft_token_num must be an int"),
    (_set(11, 3), ValueError, "tree_mask_mode must lie in"),
])
def test_op_argument_errors_name_the_argument(change, error, match):
    args = sglang_args(FULL)
    before = [t.clone() for t in args[3:8]]
    with pytest.raises(error, match=match):
        op(*change(args))
    for t, b in zip(args[3:8], before):
        assert torch.equal(t, b), "an output was written before the error"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_op_accepts_an_empty_parent_list_of_any_dtype(device):
    """With one draft step sglang passes ``torch.empty(bs, 0)`` (float32) as parent_list; nothing of
    it is read, so any dtype is accepted while it is empty (never while it has entries)."""
    sel = torch.tensor([[0, 2, 1, 3], [3, 0, 1, 2]], device=device)
    seq = torch.tensor([5, 9], device=device)
    outs = []
    for dtype in (torch.int64, torch.float32, torch.int32):
        out = alloc_tree_outputs(2, 5, QLEN, device=device)
        op(torch.empty(2, 0, dtype=dtype, device=device), sel, seq, *out, 4, 1, 5, QLEN)
        outs.append([t.cpu() for t in out])
    assert outs[0][2].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert outs[0][3].tolist() == [[1, -1, -1, -1, -1]] * 2 and outs[0][4].tolist() == [[-1, 2, 3, 4, -1]] * 2
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
    out = alloc_tree_outputs(2, 5, QLEN, device=device)
    with pytest.raises(TypeError, match="parent_list must have dtype int64"):
        op(torch.zeros(2, 1, device=device), sel, seq, *out, 4, 1, 5, QLEN)


def test_op_bit_packing_limits_and_empty_batch():
    n = 33
    out = alloc_tree_outputs(1, n, QLEN)
    args = [torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, n - 1, dtype=torch.int64), torch.tensor([0]), *out]
    with pytest.raises(ValueError, match="at most 32 draft tokens"):
        op(*args, 2, 1, n, PACKED)
    op(*args, 2, 1, n, QLEN)  # n = 33 is fine without bit packing
    out = alloc_tree_outputs(0, 4, FULL)
    empty = (torch.empty(0, 3, dtype=torch.int64), torch.empty(0, 3, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    op(*empty, *out, 2, 2, 4, FULL)  # bs = 0: nothing to do
    # but the scalars and the mask dtype are still checked against the (empty) tensors
    with pytest.raises(ValueError, match="draft_token_num is 7 but retrive_index has n=4"):
        op(*empty, *out, 2, 2, 7, FULL)
    with pytest.raises(TypeError, match="tree_mask must have dtype bool in tree_mask_mode 0"):
        op(*empty, out.tree_mask.to(torch.uint8), *out[1:], 2, 2, 4, FULL)
    with pytest.raises(ValueError, match="at most 32 draft tokens"):
        op(empty[0], torch.empty(0, n - 1, dtype=torch.int64), empty[2], torch.empty(0, dtype=torch.uint32),
           *alloc_tree_outputs(0, n, QLEN)[1:], 2, 2, n, PACKED)


def test_plan():
    from cupy_spec._launch import DeviceInfo

    dev = DeviceInfo(0, 132, True)
    Dims = op_mod.OP.Dims
    for bs, n, mode, dtype in [(1, 8, FULL, torch.bool), (300, 64, FULL, torch.bool), (7, 1, QLEN, torch.bool),
                               (5, 32, PACKED, torch.int32), (2, 1001, QLEN, torch.bool)]:
        dims = Dims(bs=bs, P=3, m=n - 1, L=10, N=bs * n, n=n)
        launch = op_mod.plan(dims, (dtype, n, mode), dev)
        assert launch.block % 32 == 0 and 256 <= launch.block <= 1024 and launch.grid[0] == bs
        assert launch.grid[1] == (max(1, min(8, 264 // bs)) if mode == FULL else 1)
        assert launch.smem == n * (12 + 4 * ((n + 31) // 32)) and launch.fields == (dtype.itemsize,)
    # masks of over CHUNK_BYTES per block at 8 blocks per request (L rounded up to a power of two): more
    # blocks, up to one per SM in all
    chunk = op_mod.CHUNK_BYTES
    for bs, L, want in [(1, 8 * chunk - 1, 8), (1, 8 * chunk, 16), (1, 40 * chunk, 64), (1, 10**12, 132),
                        (3, 3 * 8 * chunk, 11), (3, 10**12, 44), (16, 10**12, 8), (33, 10**12, 8), (34, 10**12, 7),
                        (300, 10**12, 1)]:
        dims = Dims(bs=bs, P=3, m=63, L=L, N=bs * 64, n=64)
        assert op_mod.plan(dims, (torch.bool, 64, FULL), dev).grid == (bs, want), (bs, L)
        assert op_mod.plan(dims, (torch.bool, 64, QLEN), dev).grid == (bs, 1)
        same = op_mod.OP.plan_key(*dims._replace(L=1 << (L.bit_length() - 1)))  # the key: L's power of two
        assert op_mod.OP.plan_key(*dims) == same == (bs, 64, L.bit_length())
    dims = Dims(bs=2, P=3, m=7, L=10, N=16, n=8)
    with pytest.raises(ValueError, match="draft_token_num is 9"):
        op_mod.OP.variant_check(dims, (torch.bool, 9, FULL))
    with pytest.raises(TypeError, match="tree_mask must have dtype bool in tree_mask_mode 1"):
        op_mod.OP.variant_check(dims, (torch.int32, 8, QLEN))
    # FULL_MASK trees of n <= DIRECT_TREE run the direct instantiation; every name is among those compiled
    names = op_mod.OP.kernel_names()
    for n, mode, direct in [(1, FULL, True), (9, FULL, True), (32, FULL, True), (33, FULL, True), (64, FULL, True),
                            (65, FULL, False), (8, QLEN, False), (40, QLEN, False), (4, PACKED, False)]:
        name = op_mod.OP.kernel_name((torch.bool, n, mode))
        assert name.endswith(f"<{mode}, {'true' if direct else 'false'}>") and name in names
    assert op_mod.DIRECT_TREE == 64 and len(names) == 4
    limit = 227 * 1024
    hint = op_mod.OP.too_large(Dims(bs=1, P=1, m=4999, L=1, N=5000, n=5000), limit, None)
    most = int(hint.split("at most n=")[1].split()[0])
    assert op_mod.smem_bytes(most) <= limit < op_mod.smem_bytes(most + 1) and most > 1200


# ----------------------------------------------------------------------------------------------
# GPU: the kernel against the reference, byte for byte
# ----------------------------------------------------------------------------------------------

OUT_NAMES = ("tree_mask", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling")


def poisoned_outputs(bs, n, mask_len, mask_dtype, device, pad=PAD):
    """Whole buffers (outputs with ``pad`` canaries either side), poisoned, and the output views."""
    mask = torch.empty(mask_len + 2 * pad, dtype=mask_dtype, device=device)
    mask.view(torch.uint8).fill_(MASK_POISON)
    ints = [torch.full((bs * n + 2 * pad,), POISON, dtype=torch.int64, device=device) for _ in range(4)]
    views = [mask[pad : pad + mask_len], ints[0][pad : pad + bs * n]]
    views += [t[pad : pad + bs * n].view(bs, n) for t in ints[1:]]
    return [mask] + ints, views


def assert_same_buffers(got, want):
    for name, g, w in zip(OUT_NAMES, got, want):
        g, w = g.cpu(), w.cpu()
        if name == "tree_mask":
            g, w = g.view(torch.uint8), w.view(torch.uint8)
        if not torch.equal(g, w):
            bad = (g != w).nonzero().flatten()[:8].tolist()
            raise AssertionError(f"{name} differs at {bad}: got {g[bad].tolist()}, want {w[bad].tolist()}")


def kernel_vs_reference(pl, sel, seq, topk, depth, n, mode, mask_len, mask_dtype=None, pad=PAD):
    """Runs the reference (CPU) and the op (CUDA) on the same inputs and poisoned outputs and
    compares every byte of the output buffers; the inputs must be left as they were."""
    if mask_dtype is None:
        mask_dtype = packed_mask_dtype(n) if mode == PACKED else torch.bool
    bs = seq.shape[0]
    want, want_views = poisoned_outputs(bs, n, mask_len, mask_dtype, "cpu", pad)
    build_tree_kernel_efficient(pl, sel, seq, *want_views, topk, depth, n, mode)
    got, got_views = poisoned_outputs(bs, n, mask_len, mask_dtype, "cuda", pad)
    ins = [t.cuda() for t in (pl, sel, seq)]
    op(*ins, *got_views, topk, depth, n, mode)
    torch.cuda.synchronize()
    assert_same_buffers(got, want)
    for a, b in zip(ins, (pl, sel, seq)):
        assert torch.equal(a.cpu(), b), "an input was modified"
    return want_views


def as_tensors(pl, sel, seq, n):
    bs = len(seq)
    return (torch.tensor(pl, dtype=torch.int64).reshape(bs, len(pl[0]) if bs else 0),
            torch.tensor(sel, dtype=torch.int64).reshape(bs, n - 1), torch.tensor(seq, dtype=torch.int64))


def mask_len_for(seq, n, mode, dtype):
    unit = torch.empty(0, dtype=dtype).element_size() if mode == PACKED else 1
    return -(-needed_units(seq.tolist(), n, mode) // unit)


@pytest.mark.parametrize("mode", [FULL, PACKED])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_torch_compile_fullgraph(device, mode):
    """Inside torch.compile(fullgraph=True) the op is the custom op: sglang's case comes out right."""
    args = sglang_args(mode, device)
    torch._dynamo.reset()
    f = torch.compile(lambda *a: op(*a), fullgraph=True)
    f(*args)
    check_sglang_outputs(args, mode)


@gpu
@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED])
def test_gpu_sglang_case(mode):
    args = sglang_args(mode, "cuda")
    op(*args)
    check_sglang_outputs(args, mode)


@gpu
@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED])
@pytest.mark.parametrize("topk, depth, n, bs", [
    (1, 1, 1, 3), (1, 8, 9, 17), (2, 4, 15, 300), (4, 8, 32, 64), (8, 8, 64, 300), (8, 8, 331, 5), (4, 5, 61, 1),
    (8, 3, 25, 133), (1, 63, 64, 5), (2, 9, 33, 7), (4, 2, 8, 40), (2, 3, 5, 1), (8, 1, 8, 9), (3, 20, 50, 2),
])
def test_gpu_random_drafts_match_reference(mode, topk, depth, n, bs):
    n = min(n, 32) if mode == PACKED else n
    g = torch.Generator().manual_seed(1000 * topk + 10 * depth + n + bs)
    for trial in range(3):
        draft = random_eagle_draft(bs, topk, depth, vocab=max(16, 2 * topk), generator=g)
        inputs = eagle_inputs(*draft, n)
        hi = [3000, 40, 0][trial]  # long, short and empty verified prefixes
        seq = torch.randint(0, hi + 1, (bs,), generator=g)
        mask_dtype = packed_mask_dtype(n) if mode == PACKED else torch.bool
        need = mask_len_for(seq, n, mode, mask_dtype)
        for length in (need, int(torch.randint(0, need, (1,), generator=g)) if need else 0):
            for pad in (0, PAD):
                kernel_vs_reference(inputs.parent_list, inputs.selected_index, seq, topk, depth, n, mode, length,
                                    mask_dtype, pad)


@gpu
@pytest.mark.parametrize("n, bs, long", [(8, 1, 40000), (8, 5, 40000), (8, 16, 300000), (32, 3, 40000),
                                         (32, 40, 300000), (16, 64, 300000), (33, 6, 40000), (50, 5, 300000),
                                         (64, 9, 40000), (64, 70, 40000), (8, 256, 40000), (40, 257, 40000)])
def test_gpu_long_and_short_prefixes_in_one_batch(n, bs, long):
    """FULL_MASK with prefixes from 0 to 40000 tokens in one batch and one of `long` tokens, masks of
    the exact length, one byte short and cut halfway, aligned and not. Where the long region dominates
    the batch (bs <= 256, the thresholds of the op's launch plan), the grid's blocks split every
    region's prefix runs evenly, so a block writes parts of other requests' regions; else each
    request's blocks write their own. On a GPU of 132 SMs the cases (8, 16), (32, 40), (16, 64),
    (50, 5), (64, 70) and (8, 256) split, the others not (too short for their blocks, not dominant,
    or over 256 requests)."""
    g = torch.Generator().manual_seed(31 * n + bs)
    draft = random_eagle_draft(bs, 4, 6, vocab=16, generator=g)
    inputs = eagle_inputs(*draft, n)
    choices = torch.tensor([0, 1, 15, 16, 17, 300, 1000, 5000, 40000])
    seq = choices[torch.randint(0, len(choices), (bs,), generator=g)]
    seq[bs // 2] = long
    need = mask_len_for(seq, n, FULL, torch.bool)
    for length in (need, need - 1, need // 2):
        for pad in (0, PAD):
            kernel_vs_reference(inputs.parent_list, inputs.selected_index, seq, 4, 6, n, FULL, length, pad=pad)


@gpu
@pytest.mark.parametrize("n, bs, prefix", [(8, 1, 300000), (33, 1, 70000), (64, 2, 300000), (100, 1, 40000),
                                           (64, 3, 1000)])
def test_gpu_many_blocks_per_request(n, bs, prefix):
    """FULL_MASK masks of many bytes per request give a request more than 8 blocks (the launch plan
    sizes the grid by the mask's length): prefixes of `prefix` tokens and masks of the exact length,
    one byte short, cut halfway, and over-allocated (then most blocks find nothing to write; with
    short prefixes, (64, 3, 1000), only the over-allocated mask gets more blocks). Small trees, two-warp
    trees and block-built trees."""
    g = torch.Generator().manual_seed(7 * n + bs)
    draft = random_eagle_draft(bs, 4, 8, vocab=16, generator=g)  # up to 4 + 7 * 16 drafted tokens
    inputs = eagle_inputs(*draft, n)
    seq = torch.full((bs,), prefix) - torch.arange(bs) * 7
    need = mask_len_for(seq, n, FULL, torch.bool)
    for length in (need, need - 1, need // 2, 40 * need + 3):
        kernel_vs_reference(inputs.parent_list, inputs.selected_index, seq, 4, 6, n, FULL, length)


def junk_case(bs, n, topk, P, g):
    """Hostile inputs: selected indices mostly in [-3, topk * P + 3] (orphans, duplicates, parents
    not selected, roots past P) with some huge ones; parent_list entries mostly copied from the
    row's selected indices (links, self-references and cycles), else junk; verified_seq_len mixed
    with negative and huge values."""
    hi = topk * max(P, 1) + 3
    sel = torch.randint(-3, hi + 1, (bs, n - 1), generator=g)
    huge = torch.tensor(HUGE_INDEX)[torch.randint(0, len(HUGE_INDEX), (bs, max(n - 1, P)), generator=g)]
    sel = torch.where(torch.rand(bs, n - 1, generator=g) < 0.05, huge[:, : n - 1], sel)
    pl = torch.randint(-3, hi + 1, (bs, P), generator=g)
    if n > 1 and P:
        copied = sel.gather(1, torch.randint(0, n - 1, (bs, P), generator=g))
        pl = torch.where(torch.rand(bs, P, generator=g) < 0.7, copied, pl)
    if P:
        pl = torch.where(torch.rand(bs, P, generator=g) < 0.05, huge[:, :P], pl)
    seq = torch.randint(-5, 60, (bs,), generator=g)
    huge_seq = torch.tensor(HUGE_SEQ)[torch.randint(0, len(HUGE_SEQ), (bs,), generator=g)]
    seq = torch.where(torch.rand(bs, generator=g) < 0.1, huge_seq, seq)
    return pl, sel, seq


@gpu
@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED])
@pytest.mark.parametrize("bs, n, topk, P", [(1, 1, 1, 0), (4, 7, 1, 9), (300, 48, 3, 20), (40, 32, 4, 0),
                                           (3, 1001, 2, 700), (2, 40, 8, 1), (5, 30, 2, 600)])
def test_gpu_hostile_inputs_match_reference(mode, bs, n, topk, P):
    n = min(n, 32) if mode == PACKED else n
    g = torch.Generator().manual_seed(bs * 7919 + n * 31 + topk + P)
    for _ in range(3):
        pl, sel, seq = junk_case(bs, n, topk, P, g)
        clamped = seq.clamp(0, SEQ_LEN_MAX)
        mask_dtype = packed_mask_dtype(n) if mode == PACKED else torch.bool
        need = mask_len_for(clamped, n, mode, mask_dtype)
        fits = need if need <= 1 << 26 else 0  # a huge verified_seq_len: nothing from that request on fits
        for length in (fits, int(torch.randint(0, min(need, 1 << 20) + 1, (1,), generator=g))):
            kernel_vs_reference(pl, sel, seq, topk, 3, n, mode, length, mask_dtype)


@gpu
@pytest.mark.parametrize("n, topk, P", [(33, 3, 20), (48, 8, 120), (64, 4, 300), (64, 1, 63)])
def test_gpu_sorted_hostile_keys_match_reference(n, topk, P):
    """Trees of 33-64 nodes whose selected indices are sorted junk: duplicates, negatives first,
    huge ones last, parents named at, after or before the node, in many requests per SM, so that
    the two-warp path's table of each key's first node holds other requests' entries."""
    g = torch.Generator().manual_seed(n * 131 + topk * 7 + P)
    for _ in range(3):
        pl, sel, seq = junk_case(300, n, topk, P, g)
        sel = sel.sort(dim=1).values
        need = mask_len_for(seq.clamp(0, SEQ_LEN_MAX), n, QLEN, torch.bool)
        kernel_vs_reference(pl, sel, seq, topk, 3, n, QLEN, need)


@gpu
@pytest.mark.parametrize("mode", [FULL, QLEN])
def test_gpu_deep_chain(mode):
    """A chain of n - 1 nodes below the root (topk 1): walks of up to n - 1 steps, multi-word rows."""
    n, bs = 700, 2
    sel = torch.arange(n - 1).expand(bs, n - 1).contiguous()
    pl = (torch.arange(n) - 1).expand(bs, n).contiguous()  # tokens in group q were drafted from flat q - 1
    seq = torch.tensor([5, 9])
    views = kernel_vs_reference(pl, sel, seq, 1, n, n, mode, mask_len_for(seq, n, mode, torch.bool))
    assert views[1].view(bs, n)[:, -1].tolist() == [5 + n - 1, 9 + n - 1]


@gpu
@settings(max_examples=200, deadline=None)
@given(hostile_cases())
def test_gpu_hypothesis_hostile(case):
    pl, sel, seq, topk, n, mode, length, dtype = case
    if not seq:
        return
    kernel_vs_reference(*as_tensors(pl, sel, seq, n), topk, 3, n, mode, length, dtype)


@gpu
@settings(max_examples=100, deadline=None)
@given(corrupted_drafts())
def test_gpu_hypothesis_corrupted_drafts(case):
    pl, sel, seq, topk, n, mode, length = case
    kernel_vs_reference(*as_tensors(pl, sel, seq, n), topk, 4, n, mode, length, torch.uint8 if mode == PACKED else None)


@gpu
def test_gpu_huge_seq_len_writes_positions_but_no_mask():
    pl, sel, seq = as_tensors([[-1, 0, 1]] * 3, [[0, 2]] * 3, [2, 2**40, 1], 3)
    views = kernel_vs_reference(pl, sel, seq, 2, 2, 3, FULL, 500)
    assert views[1].tolist()[3:6] == [SEQ_LEN_MAX, SEQ_LEN_MAX + 1, SEQ_LEN_MAX + 2]
    assert (views[0][(2 + 3) * 3 :].view(torch.uint8) == MASK_POISON).all()


@gpu
@pytest.mark.parametrize("mode", [FULL, QLEN, PACKED])
def test_gpu_graph_replay(mode):
    bs, topk, depth, n = 12, 4, 5, 24
    g = torch.Generator().manual_seed(mode)
    cases = []
    for _ in range(3):
        inputs = eagle_inputs(*random_eagle_draft(bs, topk, depth, 16, generator=g), n)
        cases.append((inputs.parent_list, inputs.selected_index, torch.randint(0, 50, (bs,), generator=g)))
    mask_dtype = packed_mask_dtype(n) if mode == PACKED else torch.bool
    length = max(mask_len_for(c[2], n, mode, mask_dtype) for c in cases) - 5  # the last request may not fit
    static_in = [t.cuda() for t in cases[0]]
    bufs, views = poisoned_outputs(bs, n, length, mask_dtype, "cuda")
    graph, _ = captured(lambda: op(*static_in, *views, topk, depth, n, mode))
    for case in reversed(cases):
        for dst, src in zip(static_in, case):
            dst.copy_(src)
        bufs[0].view(torch.uint8).fill_(MASK_POISON)
        for t in bufs[1:]:
            t.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        want, want_views = poisoned_outputs(bs, n, length, mask_dtype, "cpu")
        build_tree_kernel_efficient(*case, *want_views, topk, depth, n, mode)
        assert_same_buffers(bufs, want)


@gpu
@pytest.mark.parametrize("mode", [FULL, PACKED])
def test_gpu_cupy_arrays_and_custom_op(mode):
    cupy = pytest.importorskip("cupy")
    bs, topk, depth, n = 5, 2, 4, 8
    inputs = eagle_inputs(*random_eagle_draft(bs, topk, depth, 16, generator=torch.Generator().manual_seed(3)), n)
    seq = torch.tensor([0, 7, 3, 100, 1])
    mask_dtype = torch.uint8 if mode == PACKED else torch.bool
    length = mask_len_for(seq, n, mode, mask_dtype)
    want, want_views = poisoned_outputs(bs, n, length, mask_dtype, "cpu")
    build_tree_kernel_efficient(inputs.parent_list, inputs.selected_index, seq, *want_views, topk, depth, n, mode)
    bufs, _ = poisoned_outputs(bs, n, length, mask_dtype, "cpu")
    arrays = [cupy.asarray(t.numpy()) for t in bufs]
    views = [arrays[0][PAD : PAD + length], arrays[1][PAD : PAD + bs * n]]
    views += [a[PAD : PAD + bs * n].reshape(bs, n) for a in arrays[2:]]
    ins = [cupy.asarray(t.numpy()) for t in (inputs.parent_list, inputs.selected_index, seq)]
    op(*ins, *views, topk, depth, n, mode)
    cupy.cuda.get_current_stream().synchronize()
    assert_same_buffers([torch.from_numpy(cupy.asnumpy(a)) for a in arrays], want)

    got, got_views = poisoned_outputs(bs, n, length, mask_dtype, "cuda")
    torch.ops.cupy_spec.build_tree_kernel_efficient(inputs.parent_list.cuda(), inputs.selected_index.cuda(),
                                                    seq.cuda(), *got_views, topk, depth, n, mode)
    torch.cuda.synchronize()
    assert_same_buffers(got, want)


@gpu
def test_gpu_argument_errors():
    args = sglang_args(FULL, "cuda")
    with pytest.raises(ValueError, match="draft_token_num is 9"):
        op(*args[:10], 9, FULL)
    with pytest.raises(TypeError, match="tree_mask must have dtype bool in tree_mask_mode 1"):
        op(*args[:3], torch.ones(2 * SG_N * SG_N, dtype=torch.uint8, device="cuda"), *args[4:11], QLEN)
    n = 33
    out = alloc_tree_outputs(1, n, QLEN, device="cuda")
    ins = [torch.zeros(1, 1, dtype=torch.int64, device="cuda"), torch.zeros(1, n - 1, dtype=torch.int64, device="cuda"),
           torch.zeros(1, dtype=torch.int64, device="cuda")]
    with pytest.raises(ValueError, match="at most 32 draft tokens"):
        op(*ins, *out, 2, 1, n, PACKED)
    n = 6000
    out = alloc_tree_outputs(1, n, QLEN, device="cuda")
    ins[1] = torch.zeros(1, n - 1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="supports at most n="):
        op(*ins, *out, 2, 1, n, QLEN)
