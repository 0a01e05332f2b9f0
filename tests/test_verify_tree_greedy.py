"""verify_tree_greedy: upstream vectors, reference rules, equivalence with the sampling op on
one-hot rows, content checks, and (on a GPU) kernel vs reference, graphs and CuPy arrays."""

from __future__ import annotations

import importlib

import pytest
import torch

import cupy_spec
from cases import POISON, captured, make_case, no_hang, random_tree

mod = importlib.import_module("cupy_spec.verify_tree_greedy")
OUTS = ("predicts", "accept_index", "accept_token_num")
ORDER = tuple(a.name for a in mod.OP.tensors)
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


def upstream_case(device="cpu") -> dict:
    """sgl-kernel's own test of verify_tree_greedy: two requests of six nodes, S = 4."""
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    predict = torch.full((2, 6), 18, dtype=torch.int64)  # argmax of logits that are 1 except a few 10s
    predict[0, 0], predict[0, 3], predict[0, 4], predict[1, 0], predict[1, 4] = 3, 4, 5, 11, 12
    return dict(
        predicts=torch.full((12,), -1, dtype=torch.int32, device=device),
        accept_index=torch.full((2, 4), -1, dtype=torch.int32, device=device),
        accept_token_num=torch.zeros(2, dtype=torch.int32, device=device),
        candidates=t([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]),
        retrive_index=t([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
        retrive_next_token=t([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
        retrive_next_sibling=t([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]),
        target_predict=predict.to(device),
    )


def run(case: dict, fn=cupy_spec.verify_tree_greedy) -> dict:
    fn(*(case[k] for k in ORDER))
    return case


def _case(nt, ns, cand, want, S, ri=None, P=None) -> dict:
    """A case with poisoned outputs; retrive_index b * n + i and P = bs * n unless given."""
    bs, n = cand.shape
    ri = (torch.arange(bs)[:, None] * n + torch.arange(n)).long() if ri is None else ri
    P = bs * n if P is None else P
    return dict(predicts=torch.full((P,), POISON, dtype=torch.int32),
                accept_index=torch.full((bs, S), POISON, dtype=torch.int32),
                accept_token_num=torch.full((bs,), POISON, dtype=torch.int32),
                candidates=cand, retrive_index=ri, retrive_next_token=nt, retrive_next_sibling=ns, target_predict=want)


def random_case(bs, n, S, g, hit=0.6, hostile=False, device="cpu") -> dict:
    """Random trees whose target tokens match one child with probability ``hit``; ``hostile``:
    "links" random links and indices, including out-of-range ones; "indices" only the indices."""
    nt, ns, parents, _ = random_tree(bs, n, g)
    V = 6
    cand = torch.randint(0, V, (bs, n), generator=g)
    want = torch.randint(0, V, (bs, n), generator=g)
    # make a matching child likely: copy a random child's token into its parent's target
    pick = torch.rand(bs, n, generator=g) < hit
    ar = torch.arange(bs)
    for i in range(1, n):
        p = parents[:, i]
        take = pick[ar, p] & (torch.rand(bs, generator=g) < 0.5)
        want[ar[take], p[take]] = cand[ar[take], i]
    ri = (torch.arange(bs)[:, None] * n + torch.arange(n)).long()
    P = bs * n
    if hostile:
        if hostile != "indices":  # "indices": a clean tree whose indices are partly out of range
            nt = torch.randint(-3, n + 3, (bs, n), generator=g)
            ns = torch.randint(-3, n + 3, (bs, n), generator=g)
        bad = torch.rand(bs, n, generator=g) < 0.1
        ri = torch.where(bad, torch.randint(-5, P + 5, (bs, n), generator=g), ri)
        P = P + int(torch.randint(-2, 3, (1,), generator=g))
    case = _case(nt, ns, cand, want, S, ri=ri, P=max(P, 1))
    return {k: v.to(device) for k, v in case.items()}


def clone(case: dict, device=None) -> dict:
    return {k: v.clone() if device is None else v.to(device) for k, v in case.items()}


def assert_same(a: dict, b: dict) -> None:
    for k in OUTS:
        assert torch.equal(a[k].cpu(), b[k].cpu()), (k, a[k], b[k])


# ---- the reference ---------------------------------------------------------------------------------


def test_upstream_vectors():
    case = run(upstream_case())
    assert case["predicts"].tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert case["accept_index"].tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert case["accept_token_num"].tolist() == [3, 2]


def test_depth_limit_and_no_match():
    case = upstream_case()
    case["accept_index"] = torch.full((2, 2), -1, dtype=torch.int32)  # S = 2: one accept at most
    run(case)
    assert case["accept_token_num"].tolist() == [1, 1]
    assert case["accept_index"].tolist() == [[0, 3], [6, 10]]
    assert case["predicts"].tolist() == [3, -1, -1, 4, -1, -1, 11, -1, -1, -1, 12, -1]
    case = upstream_case()
    case["target_predict"][:, 0] = 99  # no child of either root matches
    run(case)
    assert case["accept_token_num"].tolist() == [0, 0]
    assert case["predicts"].tolist() == [99, -1, -1, -1, -1, -1, 99, -1, -1, -1, -1, -1]


def test_malformed_inputs_follow_the_rules():
    case = upstream_case()
    case["retrive_next_token"][0, 4] = 0  # node 4's child is the root: the walk ends at node 4
    case["retrive_index"][1, 0] = 12  # outside [0, min(P, bs*n)): request 1 writes only accept_index[1, 0]
    run(case)
    assert case["accept_token_num"].tolist() == [2, 0]
    assert case["accept_index"].tolist() == [[0, 3, 4, -1], [12, -1, -1, -1]]
    assert case["predicts"].tolist() == [3, -1, -1, 4, 5, -1, -1, -1, -1, -1, -1, -1]


def test_index_valid_for_predicts_but_not_target_predict_ends_the_walk():
    """A node's index must lie in [0, min(len(predicts), bs * n)): with a longer predicts, an index in
    [bs * n, len(predicts)) would address target_predict out of range, so that child ends the walk."""
    case = upstream_case()
    _longer_predicts_index(case, 12)  # node 4, the child the walk would accept after node 3
    run(case)
    assert case["accept_token_num"].tolist() == [1, 2]
    assert case["accept_index"].tolist() == [[0, 3, -1, -1], [6, 10, 11, -1]]
    assert case["predicts"].tolist() == [3, -1, -1, 4, -1, -1, 11, -1, -1, -1, 12, 18, -1, -1, -1, -1]


@pytest.mark.parametrize("seed", range(20))
def test_greedy_is_the_sampling_op_on_one_hot_rows(seed):
    """With one-hot target rows the sampling op accepts exactly the argmax child and samples the
    argmax: the greedy op must agree on every output."""
    g = torch.Generator().manual_seed(seed)
    bs, n, V = 3, 9, 5
    base = make_case(bs, n, V, g, style="onehot", draft=False)
    greedy = dict(predicts=base["predicts"].clone(), accept_index=base["accept_index"].clone(),
                  accept_token_num=base["accept_token_num"].clone(), candidates=base["candidates"],
                  retrive_index=base["retrive_index"], retrive_next_token=base["retrive_next_token"],
                  retrive_next_sibling=base["retrive_next_sibling"],
                  target_predict=base["target_probs"].argmax(-1).reshape(-1)[base["retrive_index"]])
    run(greedy)
    cupy_spec.tree_speculative_sampling_target_only(*(base[k] for k in (
        "predicts", "accept_index", "accept_token_num", "candidates", "retrive_index", "retrive_next_token",
        "retrive_next_sibling", "uniform_samples", "uniform_samples_for_final_sampling", "target_probs")), None)
    assert_same(greedy, base)


def test_untouched_entries_stay():
    g = torch.Generator().manual_seed(1)
    case = run(random_case(4, 8, 5, g))
    for b in range(4):
        k = int(case["accept_token_num"][b])
        assert (case["accept_index"][b, k + 1:] == POISON).all()
        assert (case["accept_index"][b, : k + 1] >= 0).all()
    written = (case["predicts"] != POISON).sum()
    assert written == int(case["accept_token_num"].sum()) + 4


# ---- argument and content checks -------------------------------------------------------------------


def test_shape_and_dtype_errors_name_the_argument():
    case = upstream_case()
    bad = clone(case)
    bad["target_predict"] = bad["target_predict"].int()
    with pytest.raises(TypeError, match="target_predict must have dtype int64"):
        run(bad)
    bad = clone(case)
    bad["target_predict"] = bad["target_predict"][:1]
    with pytest.raises(ValueError, match="target_predict must have shape"):
        run(bad)


def _longer_predicts_index(case, index):
    """predicts longer than bs * n, and node 4 of request 0 at ``index``."""
    case["predicts"] = torch.full((16,), -1, dtype=torch.int32)
    case["retrive_index"][0, 4] = index


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["retrive_next_token"].__setitem__((0, 2), 6), r"retrive_next_token\[0, 2\]"),
    (lambda c: c["retrive_next_sibling"].__setitem__((1, 3), 4), "do not form a tree"),
    (lambda c: c["retrive_index"].__setitem__((1, 5), 12), "outside"),
    (lambda c: c["retrive_index"].__setitem__((1, 5), 3), "repeats"),
    (lambda c: c["target_predict"].__setitem__((0, 1), -2), r"target_predict\[0, 1\]"),
    (lambda c: c["target_predict"].__setitem__((0, 1), 2**31), r"target_predict\[0, 1\]"),
    (lambda c: _longer_predicts_index(c, 12), r"retrive_index\[0, 4\]"),
    (lambda c: _longer_predicts_index(c, -1), r"retrive_index\[0, 4\] .* = -1 is negative; it must be a position "
                                              r"in predicts and target_predict, in \[0, bs \* n=12\)"),
])
def test_content_checks(edit, match):
    case = upstream_case()
    cupy_spec.check.verify_tree_greedy(*(case[k] for k in ORDER))
    edit(case)
    with pytest.raises(ValueError, match=match):
        cupy_spec.check.verify_tree_greedy(*(case[k] for k in ORDER))
    with pytest.raises(ValueError, match=match):
        cupy_spec.verify_tree_greedy(*(case[k] for k in ORDER), validate=True)


def test_custom_op_and_empty_batch():
    case = upstream_case()
    torch.ops.cupy_spec.verify_tree_greedy(*(case[k] for k in ORDER))
    assert case["accept_token_num"].tolist() == [3, 2]
    empty = {k: v[:0] if v.dim() > 1 or k == "accept_token_num" else v for k, v in upstream_case().items()}
    run(empty)  # bs = 0: nothing to do


# ---- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_torch_compile_fullgraph(device):
    """Inside torch.compile(fullgraph=True) the op is the custom op: same outputs as eager."""
    case = random_case(5, 8, 4, torch.Generator().manual_seed(8), device=device)
    want = run(clone(case, "cpu"))
    torch._dynamo.reset()
    f = torch.compile(lambda *a: cupy_spec.verify_tree_greedy(*a), fullgraph=True)
    f(*(case[k] for k in ORDER))
    assert_same(case, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_accept_index_wider_than_the_tree(device):
    """sglang sizes accept_index by its draft steps, which may exceed the tree's nodes (S > n): the
    walk ends within n - 1 levels and the columns past it stay untouched."""
    t = lambda x: torch.tensor(x, device=device)  # noqa: E731
    case = {k: v.to(device) for k, v in _case(t([[1, 2, -1]]), t([[-1, -1, -1]]), t([[0, 3, 4]]), t([[3, 4, 7]]),
                                              S=6).items()}
    run(case)
    assert case["predicts"].tolist() == [3, 4, 7]
    assert case["accept_index"].tolist() == [[0, 1, 2] + [POISON] * 3]
    assert case["accept_token_num"].tolist() == [2]


@gpu
def test_gpu_upstream_vectors():
    case = run(upstream_case("cuda"))
    assert case["predicts"].tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert case["accept_index"].tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert case["accept_token_num"].tolist() == [3, 2]


@gpu
@pytest.mark.parametrize("bs, n, S", [(1, 1, 1), (3, 8, 4), (7, 33, 9), (300, 8, 5), (200, 64, 6), (600, 64, 12),
                                      (2, 1500, 40), (4, 3, 6), (5, 8, 12), (3, 70, 80)])
@pytest.mark.parametrize("hostile", [False, "links", "indices"])
def test_gpu_matches_reference(bs, n, S, hostile):
    g = torch.Generator().manual_seed(bs * 131 + n + len(str(hostile)))
    for _ in range(3):
        case = random_case(bs, n, S, g, hostile=hostile)
        want = run(clone(case), fn=cupy_spec.reference.verify_tree_greedy)
        with no_hang():
            got = run(clone(case, "cuda"))
            torch.cuda.synchronize()
        assert_same(got, want)


def clean_tree_cases() -> list:
    """Clean trees that reach every way the kernel follows them: long accepted chains, long sibling
    lists matched at any position (or cut by an invalid index), deep random trees that accept a lot,
    indices that are valid but not b * n + i, and nodes on cycles that the root cannot reach."""
    g = torch.Generator().manual_seed(11)

    def chain(n, S):  # every draft accepted
        nt = torch.arange(1, n + 1).where(torch.arange(n) < n - 1, torch.tensor(-1)).repeat(3, 1)
        cand = torch.randint(0, 1000, (3, n), generator=g)
        want = torch.cat([cand[:, 1:], torch.randint(0, 1000, (3, 1), generator=g)], 1)
        return _case(nt, torch.full((3, n), -1), cand, want, S)

    cases = [chain(n, S) for n, S in ((64, 64), (64, 10), (33, 33), (2, 2))]
    n = 64  # stars: the root's 63 children, the match at child 1, 31, 32, 33, 63 or none
    nt = torch.full((6, n), -1)
    nt[:, 0] = 1
    ns = torch.arange(1, n + 1).where(torch.arange(n) < n - 1, torch.tensor(-1)).repeat(6, 1)
    ns[:, 0] = -1
    cand = torch.arange(n).repeat(6, 1)
    want = torch.full((6, n), -7)
    want[:, 0] = torch.tensor([1, 31, 32, 33, 63, -3])
    cases.append(_case(nt, ns, cand, want, 2))
    ri = (torch.arange(6)[:, None] * n + torch.arange(n)).long()
    ri[:, 20] = 6 * n + 5  # an invalid index before the match ends the walk in requests 1..4
    cases.append(_case(nt, ns, cand, want, 2, ri=ri))
    for n, width in ((16, None), (48, None), (64, None), (64, 2), (100, 2)):  # high acceptance, deep trees
        nt, ns, parents, _ = random_tree(40, n, g, max_children=width)
        cand = torch.randint(0, 50, (40, n), generator=g)
        want = torch.randint(0, 50, (40, n), generator=g)
        for i in range(n - 1, 0, -1):  # mostly a child's token
            want[torch.arange(40), parents[:, i]] = torch.where(torch.rand(40, generator=g) < 0.97, cand[:, i],
                                                               want[torch.arange(40), parents[:, i]])
        cases.append(_case(nt, ns, cand, want, n))
        perm = torch.randperm(40 * n, generator=g).reshape(40, n)  # valid and distinct, not b * n + i
        flat = torch.randint(0, 50, (40 * n,), generator=g)
        flat[perm.flatten()] = want.flatten()  # want(b, i) read at the node's index
        cases.append(_case(nt, ns, cand, flat.reshape(40, n), n, ri=perm))
    cases += [chain(64, 9), chain(20, 9), chain(9, 9)]  # at most 8 levels: walked from registers
    cases += [chain(5, 8), chain(64, 70), chain(100, 120)]  # S > n: every draft accepted, n - 1 of them
    nt = torch.tensor([[1, -1, -1, -1, -1, 6, 5, 7]])  # nodes 5, 6 and 7 lie on cycles the root cannot reach
    ns = torch.tensor([[-1, 2, 3, -1, -1, -1, -1, -1]])
    cand = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    for w in ([2, 0, 0, 0, 0, 6, 5, 7], [9, 0, 0, 0, 0, 6, 5, 7], [3, 0, 0, 0, 0, 6, 5, 7]):
        cases.append(_case(nt, ns, cand, torch.tensor([w]), 4))
    return cases


def test_clean_tree_cases_follow_the_rules():
    """The reference on the hand-made clean trees: exact values, so that the GPU comparison below
    compares against the stated rules."""
    ref = cupy_spec.reference.verify_tree_greedy
    cases = clean_tree_cases()
    for case in cases[:4]:  # chains: every draft accepted, up to S - 1
        out = run(clone(case), fn=ref)
        assert (out["accept_token_num"] == case["accept_index"].shape[1] - 1).all()
    star, cut = run(clone(cases[4]), fn=ref), run(clone(cases[5]), fn=ref)
    assert star["accept_token_num"].tolist() == [1, 1, 1, 1, 1, 0]
    assert star["accept_index"][:5, 1].tolist() == [1, 64 + 31, 128 + 32, 192 + 33, 256 + 63]
    assert cut["accept_token_num"].tolist() == [1, 0, 0, 0, 0, 0]  # child 20's invalid index comes first
    for case in cases[-6:-3]:  # chains with S > n
        out = run(clone(case), fn=ref)
        assert (out["accept_token_num"] == case["candidates"].shape[1] - 1).all()
        assert (out["accept_index"][:, case["candidates"].shape[1]:] == POISON).all()
    for case, path in zip(cases[-3:], ([0, 2], [0], [0, 3])):  # nodes 5, 6, 7 on unreachable cycles
        out = run(clone(case), fn=ref)
        assert out["accept_token_num"].item() == len(path) - 1
        assert out["accept_index"][0, :len(path)].tolist() == path


@gpu
def test_gpu_clean_tree_paths():
    for i, case in enumerate(clean_tree_cases()):
        want = run(clone(case), fn=cupy_spec.reference.verify_tree_greedy)
        with no_hang():
            got = run(clone(case, "cuda"))
            torch.cuda.synchronize()
        assert_same(got, want)
        if i < 4:  # the chains accept every draft
            assert torch.equal(want["accept_token_num"], torch.full_like(want["accept_token_num"], case["accept_index"].shape[1] - 1))


def chain_cases() -> list:
    """Chains (node i's child i + 1) whose drafts match up to a random first mismatch m (or none),
    with S below, at and above n; P cut short so that the last requests' indices (in some, the
    root's) are invalid; and near-chains that are not in the usual layout (the last link out of
    range, a link cut in the middle, a sibling, permuted indices). Returns (case, m, P) triples."""
    g = torch.Generator().manual_seed(23)
    out = []
    for bs, n, S in ((1, 1, 1), (3, 2, 2), (9, 8, 8), (40, 8, 5), (40, 31, 31), (40, 32, 40), (40, 33, 9),
                     (70, 63, 63), (70, 64, 64), (70, 64, 12), (5, 64, 100), (3, 65, 65)):
        nt = torch.arange(1, n + 1).where(torch.arange(n) < n - 1, torch.tensor(-1)).repeat(bs, 1)
        cand = torch.randint(0, 1000, (bs, n), generator=g)
        want = torch.randint(1000, 2000, (bs, n), generator=g)  # never a draft token
        m = torch.randint(1, n + 1, (bs,), generator=g)  # node m is the first mismatch (n: none)
        m[0] = n
        for b in range(bs):
            want[b, :m[b] - 1] = cand[b, 1:m[b]]
        P = bs * n - int(torch.randint(0, 2 * n + 1, (1,), generator=g)) if bs > 2 else bs * n
        out.append((_case(nt, torch.full((bs, n), -1), cand, want, S, P=max(P, 1)), m, max(P, 1)))
    base = out[8][0]  # n = 64, S = 64
    for edit in range(4):
        case = clone(base)
        if edit == 0:
            case["retrive_next_token"][:, -1] = 64  # out of range: no child, still the usual chain
        elif edit == 1:
            case["retrive_next_token"][::2, 40] = -1  # the walk ends at node 40
        elif edit == 2:
            case["retrive_next_sibling"][::3, 20] = 22  # node 22 hangs under node 19 too
        else:
            case["retrive_index"][1::2] = case["retrive_index"][1::2].flip(1)  # valid, not b * n + i
        out.append((case, None, None))
    return out


def test_chain_cases_follow_the_rules():
    """The reference on the chains: every node before the first mismatch is accepted, up to S - 1,
    unless an invalid index comes first; near-chains as the walk rules say."""
    for case, m, P in chain_cases()[:-4]:
        out = run(clone(case), fn=cupy_spec.reference.verify_tree_greedy)
        bs, n = case["candidates"].shape
        S = case["accept_index"].shape[1]
        for b in range(bs):
            valid = max(0, min(n, P - b * n))  # nodes with a valid index
            count = min(int(m[b]), valid, S) - 1 if valid else 0
            assert out["accept_token_num"][b] == count, (n, S, b)
            assert out["accept_index"][b, :count + 1].tolist() == list(range(b * n, b * n + count + 1))
            assert (out["accept_index"][b, count + 1:] == POISON).all()
    cut = run(clone(chain_cases()[-3][0]), fn=cupy_spec.reference.verify_tree_greedy)
    assert (cut["accept_token_num"][::2] <= 40).all() and (cut["accept_token_num"][::2] == 40).any()


def test_plan_takes_the_chain_instantiation_where_S_reaches_n():
    from cupy_spec._launch import DeviceInfo

    Dims = mod.OP.Dims
    for bs, n, S, chains in [(1, 8, 8, True), (4, 8, 4, False), (200, 64, 70, True), (3, 1, 1, True), (2, 9, 8, False)]:
        launch = mod.plan(Dims(P=bs * n, bs=bs, S=S, n=n), (), DeviceInfo(0, 132, True))
        assert launch.kernel == (chains,)
        assert mod.OP.kernel_name((), launch.kernel).endswith(f"<{'true' if chains else 'false'}>")


@gpu
def test_gpu_chains():
    for case, _, _ in chain_cases():
        want = run(clone(case), fn=cupy_spec.reference.verify_tree_greedy)
        with no_hang():
            got = run(clone(case, "cuda"))
            torch.cuda.synchronize()
        assert_same(got, want)


@gpu
def test_gpu_graph_replay_and_cupy():
    cupy = pytest.importorskip("cupy")
    g = torch.Generator().manual_seed(5)
    cases = [random_case(16, 8, 5, g) for _ in range(3)]
    wants = [run(clone(c), fn=cupy_spec.reference.verify_tree_greedy) for c in cases]
    static = clone(cases[0], "cuda")
    graph, _ = captured(lambda: run(static))
    for c, w in zip(cases, wants):
        for k, v in c.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(static, w)
    arrays = {k: cupy.asarray(v.numpy()) for k, v in cases[1].items()}
    cupy_spec.verify_tree_greedy(*(arrays[k] for k in ORDER))
    cupy.cuda.get_current_stream().synchronize()
    assert_same({k: torch.from_numpy(cupy.asnumpy(v)) for k, v in arrays.items()}, wants[1])


@gpu
def test_gpu_too_many_nodes_is_a_clear_error():
    g = torch.Generator().manual_seed(0)
    case = random_case(1, 8000, 4, g, device="cuda")
    with pytest.raises(ValueError, match="supports at most n="):
        run(case)
