"""Tests of cupy_spec.tree (CPU only)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cupy_spec
from cupy_spec.reference import tree_speculative_sampling_target_only as reference_op
from cupy_spec.tree import (
    Tree,
    TreeMaskMode,
    alloc_tree_outputs,
    chain,
    eagle_inputs,
    eagle_max_nodes,
    eagle_tree,
    emitted_tokens,
    from_parents,
    packed_mask_dtype,
    path_nodes,
    random_eagle_draft,
    sample_candidates,
    sibling_rank,
    tree_mask_numel,
)

# docs/contract.md §1 example (topk=2, depth 3, n=8).
CONTRACT_PARENTS = [-1, 0, 0, 1, 1, 2, 5, 3]
CONTRACT_NEXT_TOKEN = [1, 3, 5, 7, -1, 6, -1, -1]
CONTRACT_NEXT_SIBLING = [-1, 2, -1, 4, -1, -1, -1, -1]
CONTRACT_DEPTH = [0, 1, 1, 2, 2, 2, 3, 3]


# ----------------------------------------------------------------------------------------------
# helpers: an independent walk over the links
# ----------------------------------------------------------------------------------------------


def walk(tree: Tree, b: int):
    """(parents, children-in-link-order) of request b, by following next_token / next_sibling."""
    nt = tree.retrive_next_token[b].tolist()
    ns = tree.retrive_next_sibling[b].tolist()
    n = len(nt)
    parents = [None] * n
    parents[0] = -1
    children = {}
    stack = [0]
    seen = {0}
    while stack:
        p = stack.pop()
        kids = []
        c = nt[p]
        while c != -1:
            assert c not in seen, "a node is reached twice"
            seen.add(c)
            kids.append(c)
            parents[c] = p
            stack.append(c)
            c = ns[c]
        children[p] = kids
    assert len(seen) == n, "some node is unreachable"
    return parents, children


def depth_of(parents):
    d = []
    for i in range(len(parents)):
        k, j = 0, i
        while parents[j] != -1:
            j = parents[j]
            k += 1
        d.append(k)
    return d


# ----------------------------------------------------------------------------------------------
# from_parents
# ----------------------------------------------------------------------------------------------


def test_spec_example_layout():
    t = from_parents([CONTRACT_PARENTS, CONTRACT_PARENTS])
    assert t.retrive_index.tolist() == [list(range(8)), list(range(8, 16))]
    assert t.retrive_next_token.tolist() == [CONTRACT_NEXT_TOKEN] * 2
    assert t.retrive_next_sibling.tolist() == [CONTRACT_NEXT_SIBLING] * 2
    assert t.depth.tolist() == [CONTRACT_DEPTH] * 2
    assert t.parents.tolist() == [CONTRACT_PARENTS] * 2
    assert t.S == 4
    for x in (t.retrive_index, t.retrive_next_token, t.retrive_next_sibling, t.parents, t.depth):
        assert x.dtype == torch.int64 and x.shape == (2, 8)


@pytest.mark.parametrize(
    "parents",
    [
        [[-1]],
        [[-1, 0, 0, 0, 0]],
        [[-1, 0, 1, 2, 3, 4]],
        [[-1, 2, 0, 2, 1, 1, 3], [-1, 0, 0, 1, 2, 4, 4]],  # a child id smaller than its parent's
        [[-1, 4, 4, 4, 0, 2, 2, 6]],
    ],
)
def test_from_parents_round_trip(parents):
    t = from_parents(parents)
    for b, par in enumerate(parents):
        got, children = walk(t, b)
        assert got == par
        for kids in children.values():
            assert kids == sorted(kids)  # default: increasing node id
        assert t.depth[b].tolist() == depth_of(par)
    assert t.S == max(max(depth_of(p)) for p in parents) + 1


def test_from_parents_sibling_order():
    par = [-1, 0, 0, 0, 1, 1, 2]
    order = [6, 3, 1, 5, 2, 4]  # root left out
    t = from_parents([par, par], sibling_order=[order, [0, 1, 2, 3, 4, 5, 6]])
    got, children = walk(t, 0)
    assert got == par
    assert children[0] == [3, 1, 2]
    assert children[1] == [5, 4]
    assert children[2] == [6]
    assert t.retrive_next_token[0].tolist() == [3, 5, 6, -1, -1, -1, -1]
    assert t.retrive_next_sibling[0].tolist() == [-1, 2, -1, 1, -1, 4, -1]
    _, children1 = walk(t, 1)
    assert children1[0] == [1, 2, 3] and children1[1] == [4, 5]


def test_from_parents_accepts_tensor_and_device():
    t = from_parents(torch.tensor([CONTRACT_PARENTS]), device="cpu")
    assert t.retrive_next_token[0].tolist() == CONTRACT_NEXT_TOKEN


def test_from_parents_empty_batch():
    t = from_parents([])
    assert t.retrive_index.shape == (0, 0) and t.S == 1


@pytest.mark.parametrize(
    "parents, match",
    [
        ([[0, 0, 0]], "root"),
        ([[3, -1, 0]], "root"),
        ([[-1, 0, 5]], "not a node id"),
        ([[-1, 0, -1]], "not a node id"),
        ([[-1, 0, 0], [-1, 0]], "same number"),
        ([[-1, 2, 1]], "cycle"),
        ([[-1, 1]], "cycle"),
        ([[-1, 0, 1], [-1, 0, 0], [-1, 3, 0, 1]], "same number"),
        ([[-1, 0.5]], "integer"),
        ([[-1, True]], "integer"),
        ([[-1, 2**70]], r"parents\[0\]\[1\] .* not a node id"),
        ([[]], "at least the root"),
        ("abc", "list"),
    ],
)
def test_from_parents_errors(parents, match):
    with pytest.raises(ValueError, match=match):
        from_parents(parents)


def test_from_parents_cycle_names_request():
    with pytest.raises(ValueError, match=r"parents\[1\]"):
        from_parents([[-1, 0, 1, 2], [-1, 3, 1, 2]])


@pytest.mark.parametrize(
    "order, match",
    [
        ([[1, 2]], "misses"),
        ([[1, 2, 3, 3]], "twice"),
        ([[1, 2, 4]], "not a node id"),
        ([[1, 2, 3], [1, 2, 3]], "one entry per request"),
    ],
)
def test_sibling_order_errors(order, match):
    with pytest.raises(ValueError, match=match):
        from_parents([[-1, 0, 0, 1]], sibling_order=order)


# ----------------------------------------------------------------------------------------------
# chain
# ----------------------------------------------------------------------------------------------


def test_chain():
    t = chain(3, 4)
    assert t.S == 5
    assert t.retrive_index.tolist() == [list(range(5 * b, 5 * b + 5)) for b in range(3)]
    assert t.retrive_next_token.tolist() == [[1, 2, 3, 4, -1]] * 3
    assert t.retrive_next_sibling.tolist() == [[-1] * 5] * 3
    assert t.parents.tolist() == [[-1, 0, 1, 2, 3]] * 3
    assert t.depth.tolist() == [[0, 1, 2, 3, 4]] * 3


def test_chain_root_only_and_errors():
    t = chain(2, 0)
    assert t.S == 1 and t.retrive_next_token.tolist() == [[-1], [-1]]
    assert chain(0, 3).retrive_index.shape == (0, 4)
    with pytest.raises(ValueError):
        chain(2, -1)
    with pytest.raises(ValueError):
        chain(-1, 2)


# ----------------------------------------------------------------------------------------------
# eagle_tree
# ----------------------------------------------------------------------------------------------


def check_eagle(t: Tree, bs: int, n: int, depth: int, topk: int):
    assert t.retrive_index.shape == (bs, n)
    assert t.S == depth + 1
    assert t.retrive_index.tolist() == [list(range(b * n, b * n + n)) for b in range(bs)]
    for b in range(bs):
        par, children = walk(t, b)
        assert par == t.parents[b].tolist()
        d = depth_of(par)
        assert d == t.depth[b].tolist()
        assert max(d) == depth
        # BFS ids: parents and depths never decrease with the node id, parents have smaller ids.
        assert all(par[i] <= par[i + 1] for i in range(1, n - 1))
        assert all(d[i] <= d[i + 1] for i in range(n - 1))
        assert all(par[i] < i for i in range(1, n))
        assert all(len(k) <= topk for k in children.values())
        assert all(k == sorted(k) for k in children.values())
        if depth >= 1:
            assert len(children[0]) == min(topk, n - depth)
        for j in range(2, depth + 1):
            level_parents = {par[i] for i in range(n) if d[i] == j}
            assert 1 <= len(level_parents) <= topk


@pytest.mark.parametrize(
    "bs, n, depth, topk",
    [(4, 8, 3, 2), (3, 16, 4, 4), (2, 64, 6, 8), (2, 4, 3, 1), (1, 1, 0, 3), (3, 5, 3, 4), (2, 10, 3, 2)],
)
def test_eagle_tree_invariants(bs, n, depth, topk):
    t = eagle_tree(bs, n, depth, topk, generator=torch.Generator().manual_seed(123))
    check_eagle(t, bs, n, depth, topk)


def test_eagle_tree_full_root_when_room():
    t = eagle_tree(8, 16, 4, 3, generator=torch.Generator().manual_seed(0))
    assert (t.retrive_next_token[:, 0] == 1).all()
    assert t.retrive_next_sibling[:, 1:4].tolist() == [[2, 3, -1]] * 8  # root has exactly 3 children
    assert (t.parents[:, 4] != 0).all()


def test_eagle_tree_max_nodes_is_full():
    n = eagle_max_nodes(3, 2)
    assert n == 1 + 2 + 2 * 4
    t = eagle_tree(4, n, 3, 2, generator=torch.Generator().manual_seed(1))
    assert (torch.stack([(t.depth == j).sum(1) for j in range(4)], 1) == torch.tensor([1, 2, 4, 4])).all()
    assert t.parents[:, :7].tolist() == [[-1, 0, 0, 1, 1, 2, 2]] * 4
    assert all(len(set(r[7:])) == 2 and r[7] == r[8] and r[9] == r[10] for r in t.parents.tolist())
    with pytest.raises(ValueError, match="do not fit"):
        eagle_tree(1, n + 1, 3, 2)
    # level-3 parents are a random pick of 2 of the 4 level-2 nodes, not always the first two
    t = eagle_tree(30, n, 3, 2, generator=torch.Generator().manual_seed(2))
    picks = {(r[7], r[9]) for r in t.parents.tolist()}
    assert len(picks) >= 3 and all(3 <= a < c <= 6 for a, c in picks)


def test_eagle_tree_deterministic_and_varied():
    a = eagle_tree(6, 24, 5, 4, generator=torch.Generator().manual_seed(7))
    b = eagle_tree(6, 24, 5, 4, generator=torch.Generator().manual_seed(7))
    c = eagle_tree(6, 24, 5, 4, generator=torch.Generator().manual_seed(8))
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y
    assert not torch.equal(a.parents, c.parents)
    rows = {tuple(r) for r in a.parents.tolist()}
    assert len(rows) > 1  # requests get different trees


def test_eagle_tree_device_arg():
    t = eagle_tree(2, 8, 3, 2, generator=torch.Generator().manual_seed(0), device=torch.device("cpu"))
    assert t.retrive_index.device.type == "cpu"


@pytest.mark.parametrize(
    "args",
    [(1, 3, 3, 2), (1, 12, 3, 2), (1, 6, 4, 1), (1, 2, 0, 2), (1, 4, 2, 0), (-1, 4, 2, 2), (1, 0, 0, 2)],
)
def test_eagle_tree_errors(args):
    with pytest.raises(ValueError):
        eagle_tree(*args)


@st.composite
def eagle_args(draw):
    topk = draw(st.integers(1, 5))
    depth = draw(st.integers(0, 7))
    n = draw(st.integers(depth + 1, min(eagle_max_nodes(depth, topk), 80)))
    return draw(st.integers(1, 3)), n, depth, topk, draw(st.integers(0, 2**31))


@settings(max_examples=150, deadline=None)
@given(eagle_args())
def test_eagle_tree_hypothesis(args):
    bs, n, depth, topk, seed = args
    t = eagle_tree(bs, n, depth, topk, generator=torch.Generator().manual_seed(seed))
    check_eagle(t, bs, n, depth, topk)
    again = eagle_tree(bs, n, depth, topk, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(t.parents, again.parents)


# ----------------------------------------------------------------------------------------------
# sample_candidates
# ----------------------------------------------------------------------------------------------


def test_sibling_rank():
    t = from_parents([CONTRACT_PARENTS])
    assert sibling_rank(t).tolist() == [[-1, 0, 1, 0, 1, 0, 0, 0]]


def test_sample_candidates_distinct_siblings_positive_prob():
    g = torch.Generator().manual_seed(3)
    bs, n, V = 6, 32, 40
    t = eagle_tree(bs, n, 5, 6, generator=g)
    probs = torch.softmax(torch.randn(bs, n, V, generator=g) * 2, dim=-1)
    probs[torch.rand(bs, n, V, generator=g) < 0.5] = 0.0  # sparse rows, >= 6 positives kept below
    probs[:, :, :6] += 0.01
    cand = sample_candidates(t, probs, generator=g)
    assert cand.dtype == torch.int64 and cand.shape == (bs, n)
    assert ((cand >= 0) & (cand < V)).all()
    for b in range(bs):
        par, children = walk(t, b)
        assert probs[b, 0, cand[b, 0]] > 0
        for p, kids in children.items():
            toks = [int(cand[b, k]) for k in kids]
            assert len(set(toks)) == len(toks)
            assert all(probs[b, p, tok] > 0 for tok in toks)


def test_sample_candidates_few_positive_entries():
    # Root has 3 children but its row has 2 positive entries: the first two are distinct, the third
    # repeats one of them; an all-zero row draws from [0, V).
    t = from_parents([[-1, 0, 0, 0, 1]] * 50)
    V = 9
    probs = torch.zeros(50, 5, V)
    probs[:, 0, 2] = 0.3
    probs[:, 0, 7] = 0.7
    probs[:, 2:, 4] = 1.0
    cand = sample_candidates(t, probs, generator=torch.Generator().manual_seed(0))
    assert sorted(cand[:, 1:3].tolist()[0]) == [2, 7]
    assert all(sorted(r) == [2, 7] for r in cand[:, 1:3].tolist())
    assert set(cand[:, 3].tolist()) <= {2, 7}
    assert set(cand[:, 0].tolist()) <= {2, 7}
    assert ((cand[:, 4] >= 0) & (cand[:, 4] < V)).all()  # node 1's row is all zero
    assert len(set(cand[:, 4].tolist())) > 1  # ... and it is drawn uniformly, not a constant


def test_sample_candidates_first_child_distribution():
    # In a chain every node is a first child: its token is an ordinary draw from the parent row.
    bs, V = 4000, 5
    t = chain(bs, 1)
    row = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    probs = torch.stack([row, row]).expand(bs, 2, V).contiguous()
    cand = sample_candidates(t, probs, generator=torch.Generator().manual_seed(11))
    freq = torch.bincount(cand[:, 1], minlength=V).float() / bs
    assert freq[1] == 0
    assert torch.allclose(freq, row, atol=0.03), freq


def test_sample_candidates_second_child_is_without_replacement():
    # Two children, row (0.9, 0.1): the second child is token 1 whenever the first is token 0.
    bs = 2000
    t = from_parents([[-1, 0, 0]] * bs)
    probs = torch.zeros(bs, 3, 2)
    probs[:, 0] = torch.tensor([0.9, 0.1])
    cand = sample_candidates(t, probs, generator=torch.Generator().manual_seed(5))
    assert (cand[:, 1] != cand[:, 2]).all()
    assert abs((cand[:, 1] == 0).float().mean().item() - 0.9) < 0.03


def test_sample_candidates_deterministic_and_shape_error():
    t = eagle_tree(3, 8, 3, 2, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(torch.randn(3, 8, 17, generator=torch.Generator().manual_seed(1)), -1)
    a = sample_candidates(t, probs, generator=torch.Generator().manual_seed(2))
    b = sample_candidates(t, probs, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        sample_candidates(t, probs[:, :7], generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("parent", [8, -2])
def test_sample_candidates_names_a_parent_out_of_range(parent):
    t = eagle_tree(3, 8, 3, 2, generator=torch.Generator().manual_seed(0))
    parents = t.parents.clone()
    parents[1, 5] = parent
    with pytest.raises(ValueError, match=rf"^tree.parents\[1, 5\] = {parent} is outside \[-1, n=8\)"):
        sample_candidates(t._replace(parents=parents), torch.full((3, 8, 5), 0.2))


# ----------------------------------------------------------------------------------------------
# emitted_tokens / path_nodes through the reference op
# ----------------------------------------------------------------------------------------------


def run_spec_example(draft_probs: bool):
    """docs/contract.md §1 tree for 2 requests, one-hot target rows so the outcome is known by hand."""
    bs, n, V = 2, 8, 10
    t = from_parents([CONTRACT_PARENTS] * bs)
    #                 node:  0  1  2  3  4  5  6  7
    cand = torch.tensor([[9, 1, 2, 3, 4, 5, 6, 7], [0, 3, 4, 5, 6, 7, 8, 9]], dtype=torch.int64)
    target = torch.zeros(bs, n, V)
    # request 0: root row picks token 2 (node 2, after rejecting node 1), node 2 -> token 5
    # (node 5), node 5 -> token 6 (node 6); depth 3 reached: bonus from node 6's row -> 8.
    target[0, 0, 2] = target[0, 2, 5] = target[0, 5, 6] = target[0, 6, 8] = 1.0
    # request 1: root row picks token 3 (node 1); node 1's row wants token 1, which neither child
    # (tokens 5, 6) has: both rejected, correction token 1.
    target[1, 0, 3] = target[1, 1, 1] = 1.0
    target[target.sum(-1) == 0] = 1.0 / V  # other rows uniform (never read)
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, t.S), -5, dtype=torch.int32)
    accept_token_num = torch.full((bs,), -3, dtype=torch.int32)
    reference_op(
        predicts, accept_index, accept_token_num, cand,
        t.retrive_index, t.retrive_next_token, t.retrive_next_sibling,
        torch.full((bs, n), 0.5), torch.full((bs,), 0.5), target,
        torch.zeros_like(target) if draft_probs else None,
    )  # fmt: skip
    return t, predicts, accept_index, accept_token_num


@pytest.mark.parametrize("draft_probs", [True, False])
def test_emitted_tokens_and_path_on_spec_example(draft_probs):
    t, predicts, accept_index, accept_token_num = run_spec_example(draft_probs)
    assert accept_token_num.tolist() == [3, 1]
    assert accept_index.tolist() == [[0, 2, 5, 6], [8, 9, -5, -5]]
    expected_predicts = [-7] * 16
    expected_predicts[0], expected_predicts[2], expected_predicts[5], expected_predicts[6] = 2, 5, 6, 8
    expected_predicts[8], expected_predicts[9] = 3, 1
    assert predicts.tolist() == expected_predicts
    assert emitted_tokens(predicts, accept_index, accept_token_num) == [[2, 5, 6, 8], [3, 1]]
    assert path_nodes(t, accept_index, accept_token_num) == [[0, 2, 5, 6], [0, 1]]


def test_emitted_tokens_hand_made():
    predicts = torch.tensor([10, 11, 12, 13, 14, 15], dtype=torch.int32)
    accept_index = torch.tensor([[0, 2, 99], [3, -1, 12345], [4, 5, 1]], dtype=torch.int32)
    num = torch.tensor([1, 0, 2], dtype=torch.int32)
    assert emitted_tokens(predicts, accept_index, num) == [[10, 12], [13], [14, 15, 11]]
    assert emitted_tokens(predicts, accept_index[:0], num[:0]) == []


def test_emitted_tokens_errors():
    predicts = torch.arange(6, dtype=torch.int32)
    ai = torch.tensor([[0, 9]], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside predicts"):
        emitted_tokens(predicts, ai, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="accept_token_num"):
        emitted_tokens(predicts, ai, torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="accept_token_num"):
        emitted_tokens(predicts, ai, torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(ValueError):
        emitted_tokens(predicts, ai[0], torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="predicts must be"):
        emitted_tokens(predicts[None], ai, torch.tensor([0], dtype=torch.int32))


def test_path_nodes_uses_retrive_index_values():
    t = from_parents([CONTRACT_PARENTS, CONTRACT_PARENTS])
    ri = torch.tensor([[70, 71, 72, 73, 74, 75, 76, 77], [7, 6, 5, 4, 3, 2, 1, 0]])
    t2 = t._replace(retrive_index=ri)
    ai = torch.tensor([[70, 72, 75, 76], [7, 6, 3, 0]], dtype=torch.int32)
    num = torch.tensor([3, 2], dtype=torch.int32)
    assert path_nodes(t2, ai, num) == [[0, 2, 5, 6], [0, 1, 4]]
    with pytest.raises(ValueError, match=r"accept_index\[1, 1\]"):
        path_nodes(t2, torch.tensor([[70, 71, 0, 0], [7, 70, 0, 0]], dtype=torch.int32), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="requests"):
        path_nodes(t2, ai[:1], num[:1])


def test_end_to_end_eagle_reference_consistency():
    # Random trees through the reference: the path is a root-to-node chain of the tree, the
    # emitted tokens are the path's candidates plus one final token, and it is reproducible.
    g = torch.Generator().manual_seed(42)
    bs, n, depth, topk, V = 5, 16, 4, 3, 12
    t = eagle_tree(bs, n, depth, topk, generator=g)
    target = torch.softmax(3 * torch.randn(bs, n, V, generator=g), -1)
    cand = sample_candidates(t, torch.softmax(3 * torch.randn(bs, n, V, generator=g), -1) * 0.5 + target * 0.5, g)
    coins = torch.rand(bs, n, generator=g)
    final = torch.rand(bs, generator=g)
    results = []
    for _ in range(2):
        predicts = torch.full((bs * n,), -1, dtype=torch.int32)
        ai = torch.full((bs, t.S), -1, dtype=torch.int32)
        num = torch.zeros(bs, dtype=torch.int32)
        reference_op(predicts, ai, num, cand, t.retrive_index, t.retrive_next_token, t.retrive_next_sibling,
                     coins, final, target, torch.zeros_like(target))  # fmt: skip
        results.append((emitted_tokens(predicts, ai, num), path_nodes(t, ai, num)))
    assert results[0] == results[1]
    toks, paths = results[0]
    for b in range(bs):
        path = paths[b]
        assert path[0] == 0 and len(toks[b]) == len(path)
        for a, c in zip(path, path[1:]):
            assert int(t.parents[b, c]) == a
        assert toks[b][:-1] == [int(cand[b, c]) for c in path[1:]]
        assert 0 <= toks[b][-1] < V
        assert not math.isnan(float(target[b, path[-1], toks[b][-1]]))
        assert target[b, path[-1], toks[b][-1]] > 0


# ----------------------------------------------------------------------------------------------
# argument checks of the public helpers
# ----------------------------------------------------------------------------------------------

_T = chain(2, 3)  # 2 requests of 4 nodes
_PROBS = torch.full((2, 4, 5), 0.2)
_DRAFT = random_eagle_draft(2, 2, 3, 8, generator=torch.Generator().manual_seed(0))  # topk 2, depth 3
_VID, _SC, _TOK, _PAR = _DRAFT
_PRED = torch.arange(8, dtype=torch.int32)
_AI = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
_NUM = torch.tensor([3, 1], dtype=torch.int32)
_NO_CUDA = not torch.cuda.is_available()

BAD_ARGUMENTS = [
    # chain / eagle_tree / eagle_max_nodes: ints are real ints
    (lambda: chain(2.0, 3), TypeError, r"bs must be an int >= 0, got float 2\.0"),
    (lambda: chain(None, 3), TypeError, r"bs must be an int >= 0, got NoneType None"),
    (lambda: chain(2, True), TypeError, r"depth must be an int >= 0, got bool True"),
    (lambda: chain(2, "3"), TypeError, r"depth must be an int"),
    (lambda: chain(-1, 3), ValueError, r"bs must be an int >= 0, got -1"),
    (lambda: chain(2, 3, device=2.5), TypeError, r"device must be a torch.device.*got float 2\.5"),
    (lambda: chain(2, 3, device="nope"), ValueError, r"device 'nope'"),
    (lambda: eagle_tree(1, 4, 2, True), TypeError, r"topk must be an int >= 1, got bool True"),
    (lambda: eagle_tree(1, 4.0, 2, 2), TypeError, r"n must be an int >= 1, got float 4\.0"),
    (lambda: eagle_tree(1, 4, -1, 2), ValueError, r"depth must be an int >= 0, got -1"),
    (lambda: eagle_tree(1, 4, 2, 2, generator=3), TypeError, r"generator must be a torch.Generator or None, got int 3"),
    (lambda: eagle_max_nodes(-1, 2), ValueError, r"depth must be an int >= 0, got -1"),
    (lambda: eagle_max_nodes(2, 0), ValueError, r"topk must be an int >= 1, got 0"),
    (lambda: eagle_max_nodes(2.0, 2), TypeError, r"depth must be an int >= 0, got float"),
    # from_parents: the device
    (lambda: from_parents([[-1, 0]], device=1.0), TypeError, r"device must be a torch.device"),
    (lambda: from_parents([[-1, 0]], device=True), TypeError, r"device must be a torch.device"),
    pytest.param(lambda: from_parents([[-1, 0]], device="cuda"), ValueError, r"device 'cuda' is not available",
                 marks=pytest.mark.skipif(not _NO_CUDA, reason="CUDA is available")),
    # sample_candidates / sibling_rank
    (lambda: sample_candidates(_T, _PROBS, generator=5), TypeError, r"generator must be a torch.Generator or None, got int 5"),
    (lambda: sample_candidates(_T, [[0.5]]), TypeError, r"probs must be a torch.Tensor.*got list"),
    (lambda: sample_candidates(None, _PROBS), TypeError, r"tree must be a cupy_spec.tree.Tree, got NoneType"),
    (lambda: sample_candidates(_T, torch.ones(2, 4, 5, dtype=torch.int64)), TypeError,
     r"probs must be a float16, bfloat16, float32 or float64 tensor, got int64"),
    (lambda: sample_candidates(_T, _PROBS[0]), ValueError, r"probs must be \[bs, n, V\] \(3-D\), got shape \[4, 5\]"),
    (lambda: sibling_rank(_T._replace(retrive_next_token=_T.retrive_next_token.float())), TypeError,
     r"tree.retrive_next_token must be an int32 or int64 tensor, got float32"),
    (lambda: sibling_rank(_T._replace(parents=_T.parents[:1])), ValueError, r"tree.parents has shape \[1, 4\]"),
    (lambda: sibling_rank(tuple(_T)), TypeError, r"tree must be a cupy_spec.tree.Tree, got tuple"),
    # eagle_inputs / random_eagle_draft
    (lambda: eagle_inputs(_VID[:, None], _SC, _TOK, _PAR, 4), ValueError, r"verified_id must be \[bs\] \(1-D\), got shape \[2, 1\]"),
    (lambda: eagle_inputs(_VID, _SC, _TOK, _PAR, 6.0), TypeError, r"num_verify_tokens must be an int >= 1, got float 6\.0"),
    (lambda: eagle_inputs(_VID, _SC, _TOK, _PAR, 0), ValueError, r"num_verify_tokens must be an int >= 1, got 0"),
    (lambda: eagle_inputs([1, 2], _SC, _TOK, _PAR, 4), TypeError, r"verified_id must be a torch.Tensor.*got list"),
    (lambda: eagle_inputs(_VID.float(), _SC, _TOK, _PAR, 4), TypeError, r"verified_id must be an int32 or int64 tensor, got float32"),
    (lambda: eagle_inputs(_VID, _SC[0], _TOK, _PAR, 4), TypeError, r"score_list must be a list of tensors.*got Tensor"),
    (lambda: eagle_inputs(_VID, [_SC[0].long(), *_SC[1:]], _TOK, _PAR, 4), TypeError,
     r"score_list\[0\] must be a float16, bfloat16, float32 or float64 tensor, got int64"),
    (lambda: eagle_inputs(_VID, _SC, [_TOK[0], _TOK[1].float(), _TOK[2]], _PAR, 4), TypeError,
     r"token_list\[1\] must be an int32 or int64 tensor, got float32"),
    (lambda: eagle_inputs(_VID, _SC, _TOK, [_PAR[0][:, :2], *_PAR[1:]], 4), ValueError,
     r"parents_list\[0\] must be \[bs, topk \+ 1\] = \[2, 3\].*got \[2, 2\]"),
    (lambda: eagle_inputs(_VID, [_SC[0], _SC[1][:, :1], _SC[2]], _TOK, _PAR, 4), ValueError,
     r"score_list\[1\] must be \[bs, topk, topk\] = \[2, 2, 2\]"),
    (lambda: eagle_inputs(_VID, _SC, _TOK, _PAR, 12), ValueError, r"num_verify_tokens must lie in \[1, 11\]"),
    (lambda: random_eagle_draft(1, 2, 2, 8, generator=1), TypeError, r"generator must be a torch.Generator"),
    (lambda: random_eagle_draft(1, 2, 2, 8, spread="3"), TypeError, r"spread must be a real number, got str"),
    (lambda: random_eagle_draft(1, 2, 2, 8, spread=math.inf), ValueError, r"spread must be finite"),
    (lambda: random_eagle_draft(1, 2, 0, 8), ValueError, r"depth must be an int >= 1, got 0"),
    (lambda: random_eagle_draft(1, 3, 2, 2), ValueError, r"vocab must be >= topk = 3, got 2"),
    # mask sizes and output buffers
    (lambda: alloc_tree_outputs(-2, 4, 1), ValueError, r"bs must be an int >= 0, got -2"),
    (lambda: alloc_tree_outputs(2, 0, 1), ValueError, r"num_verify_tokens must be an int >= 1, got 0"),
    (lambda: alloc_tree_outputs(2, 4, 1.0), TypeError, r"tree_mask_mode must be an int in \[0, 2\], got float 1\.0"),
    (lambda: alloc_tree_outputs(2, 4, 3), ValueError, r"tree_mask_mode must be an int in \[0, 2\], got 3"),
    (lambda: alloc_tree_outputs(2, 4, 0, seq_lens_sum=-1), ValueError, r"seq_lens_sum must be an int >= 0, got -1"),
    (lambda: alloc_tree_outputs(2, 4, 1, device=[0]), TypeError, r"device must be a torch.device"),
    (lambda: tree_mask_numel(-2, 4, 0), ValueError, r"bs must be an int >= 0, got -2"),
    (lambda: tree_mask_numel(2, 4, True), TypeError, r"tree_mask_mode must be an int in \[0, 2\], got bool True"),
    (lambda: tree_mask_numel(2, 4, 0, seq_lens_sum=1.5), TypeError, r"seq_lens_sum must be an int >= 0, got float"),
    (lambda: packed_mask_dtype(8.0), TypeError, r"num_verify_tokens must be an int >= 1, got float 8\.0"),
    (lambda: packed_mask_dtype(0), ValueError, r"num_verify_tokens must be an int >= 1, got 0"),
    # emitted_tokens / path_nodes: int32 / int64 tensors only, no silent truncation
    (lambda: emitted_tokens(_PRED.float(), _AI, _NUM), TypeError, r"predicts must be an int32 or int64 tensor, got float32"),
    (lambda: emitted_tokens(_PRED, _AI.double(), _NUM), TypeError, r"accept_index must be an int32 or int64 tensor, got float64"),
    (lambda: emitted_tokens(_PRED, _AI, _NUM.bool()), TypeError, r"accept_token_num must be an int32 or int64 tensor, got bool"),
    (lambda: emitted_tokens(_PRED.tolist(), _AI, _NUM), TypeError, r"predicts must be a torch.Tensor.*got list"),
    (lambda: emitted_tokens(_PRED, 3, _NUM), TypeError, r"accept_index must be a torch.Tensor.*got int 3"),
    (lambda: emitted_tokens(_PRED, _AI, _NUM[:1]), ValueError, r"accept_token_num must be \[bs=2\] like accept_index, got \[1\]"),
    (lambda: path_nodes(_T, _AI.float(), _NUM), TypeError, r"accept_index must be an int32 or int64 tensor, got float32"),
    (lambda: path_nodes(_T, _AI, _NUM[:, None]), ValueError, r"accept_token_num must be \[bs\] \(1-D\), got shape \[2, 1\]"),
    (lambda: path_nodes(_T.retrive_index, _AI, _NUM), TypeError, r"tree must be a cupy_spec.tree.Tree, got Tensor"),
]


@pytest.mark.parametrize("call, error, match", BAD_ARGUMENTS)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert type(info.value) is error  # not a subclass such as torch's errors


def test_int32_trees_are_read_as_int64_ones():
    t = from_parents([[-1, 0, 0, 1]] * 2)
    t32 = t._replace(**{f: getattr(t, f).int() for f in t._fields if f != "S"})
    assert torch.equal(sibling_rank(t32), sibling_rank(t))
    probs = torch.softmax(torch.randn(2, 4, 5), -1)
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    assert torch.equal(sample_candidates(t32, probs, g()), sample_candidates(t, probs, g()))


def test_int_like_arguments_and_numpy_arrays():
    """Objects with __index__ (NumPy integers, TreeMaskMode) count as ints; NumPy arrays are read
    through a zero-copy view."""
    t = chain(np.int64(2), np.int32(3))
    assert t.S == 4 and t.retrive_index.shape == (2, 4) and type(t.S) is int
    assert eagle_max_nodes(np.int64(3), np.int8(2)) == eagle_max_nodes(3, 2) == 11
    assert tree_mask_numel(np.int64(2), 4, TreeMaskMode.QLEN_ONLY) == tree_mask_numel(2, 4, 1) == 32
    assert alloc_tree_outputs(np.int32(2), np.int64(4), np.int64(2)).tree_mask.dtype == packed_mask_dtype(np.int16(4))
    assert eagle_tree(np.int64(1), 4, 2, np.int64(2)).retrive_index.shape == (1, 4)
    a = eagle_inputs(_VID, _SC, _TOK, _PAR, 4)
    b = eagle_inputs(_VID.numpy(), tuple(x.numpy() for x in _SC), [x.int() for x in _TOK], _PAR, np.int64(4))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert emitted_tokens(_PRED.numpy(), _AI.numpy(), _NUM.numpy()) == emitted_tokens(_PRED, _AI, _NUM)
    assert emitted_tokens(_PRED.numpy(), _AI.numpy(), _NUM.numpy()) == [[0, 1, 2, 3], [4, 5]]
    assert path_nodes(_T, _AI.numpy(), _NUM.long()) == [[0, 1, 2, 3], [0, 1]]
    assert sample_candidates(_T, _PROBS.numpy(), torch.Generator().manual_seed(0)).shape == (2, 4)


def test_arrays_torch_cannot_view_are_named():
    """A NumPy array of a dtype DLPack does not carry: a TypeError naming the argument, in the tree
    helpers and in an op alike (one conversion path)."""
    words = np.array([["a", "b"]] * 2)
    with pytest.raises(TypeError, match=r"^probs: torch.from_dlpack could not view this ndarray without a copy "
                                        r"\(BufferError"):
        sample_candidates(_T, words, None)
    with pytest.raises(TypeError, match=r"^verified_id: torch.from_dlpack could not view this ndarray"):
        eagle_inputs(words[0], _SC, _TOK, _PAR, 4)
    with pytest.raises(TypeError, match=r"^target_predict: torch.from_dlpack could not view this ndarray"):
        cupy_spec.verify_tree_greedy(*(torch.zeros(2, 2, dtype=torch.int64),) * 7, words)
    with pytest.raises(TypeError, match=r"^probs must be a torch.Tensor or an array with __dlpack__.*got list"):
        sample_candidates(_T, [[0.5]], None)


def test_empty_chain_has_S_1():
    assert chain(0, 3).S == 1 and chain(0, 3).retrive_index.shape == (0, 4)
    assert "1 when bs = 0" in chain.__doc__
