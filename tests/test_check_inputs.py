"""``cupy_spec.check.check_inputs``: valid inputs pass; each class of bad content raises a ValueError
that names the argument, the request and the node (where there is one)."""

from __future__ import annotations

import re

import pytest
import torch

import cupy_spec
from cases import as_args, make_case
from cupy_spec.check import check_inputs

BS, N, V = 3, 8, 37
NAN, INF = float("nan"), float("inf")

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def children(case, b, u):
    """Child list of node u of request b (assumes a valid tree)."""
    nt, ns = case["retrive_next_token"][b].tolist(), case["retrive_next_sibling"][b].tolist()
    out, c = [], nt[u]
    while c >= 0:
        out.append(c)
        c = ns[c]
    return out


def dedup_siblings(case):
    """make_case draws sibling tokens independently (peaked rows often repeat one); make them distinct."""
    bs, n = case["candidates"].shape
    V_ = case["target_probs"].shape[2]
    for b in range(bs):
        for u in range(n):
            used = set()
            for c in children(case, b, u):
                t = int(case["candidates"][b, c])
                while t in used:
                    t = (t + 1) % V_
                used.add(t)
                case["candidates"][b, c] = t
    return case


# docs/contract.md §1 example tree (n = 8, S = 4): children 0: [1, 2], 1: [3, 4], 2: [5], 3: [7], 5: [6].
CONTRACT_NT = [1, 3, 5, 7, -1, 6, -1, -1]
CONTRACT_NS = [-1, 2, -1, 4, -1, -1, -1, -1]


def valid_case(seed=0, bs=BS, n=N, V_=V, device="cpu", spec_tree=False, **kw):
    """A check-clean case from make_case (optionally with the contract example tree in every request)."""
    case = make_case(bs, n, V_, torch.Generator().manual_seed(seed), style="peaked", dup=False, **kw)
    if spec_tree:
        assert n == 8
        case["retrive_next_token"][:] = torch.tensor(CONTRACT_NT)
        case["retrive_next_sibling"][:] = torch.tensor(CONTRACT_NS)
    case = dedup_siblings(case)
    return {k: (None if v is None else v.to(device)) for k, v in case.items()}


def leaf(case, b):
    """A leaf node of request b (not the root)."""
    nt = case["retrive_next_token"][b].tolist()
    return max(i for i in range(1, len(nt)) if nt[i] < 0)


def with_children(case, b, k=1):
    """A node of request b with at least k children."""
    return next(u for u in range(len(case["candidates"][b])) if len(children(case, b, u)) >= k)


def raises(case, name, b, i=None, what=None):
    """check_inputs(case) must raise a ValueError naming name, request b, node i (and matching what)."""
    with pytest.raises(ValueError) as info:
        check_inputs(*as_args(case))
    msg = str(info.value)
    assert name in msg, msg
    assert f"request {b}" in msg, msg
    if i is not None:
        assert f"node {i}" in msg, msg
    if what is not None:
        assert re.search(what, msg), msg
    return msg


# ---- valid inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_valid_case_passes(seed, device):
    check_inputs(*as_args(valid_case(seed, n=[1, 2, 5, 8, 16, 33][seed], device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_valid_variants_pass(device):
    check_inputs(*as_args(valid_case(1, draft=False, device=device)))  # draft_probs None
    check_inputs(*as_args(valid_case(2, V_=1, n=1, device=device)))  # V = 1, root only
    check_inputs(*as_args(valid_case(3, S=1, device=device)))  # S = 1
    empty = {k: (None if v is None else v[:0]) for k, v in valid_case(4, device=device).items()}
    empty["predicts"] = empty["predicts"][:0]
    check_inputs(*as_args(empty))  # empty batch
    c = valid_case(5, device=device, coin_edges=True)  # coins 0 and 1 - 2**-24 are fine
    check_inputs(*as_args(c), threshold_single=0.5, threshold_acc=0.0)


def test_numpy_arrays_are_checked_as_the_op_takes_them():
    """check_inputs takes what the op takes: NumPy arrays, viewed without a copy."""
    arrays = {k: (None if v is None else v.numpy()) for k, v in valid_case(1).items()}
    check_inputs(*as_args(arrays))
    arrays["uniform_samples"][0, 1] = 1.5
    with pytest.raises(ValueError, match=r"^uniform_samples\[0, 1\]"):
        check_inputs(*as_args(arrays))


def test_make_case_can_repeat_sibling_tokens():
    # Documents why valid_case dedups: make_case(dup=False) with peaked rows repeats sibling tokens.
    bad = 0
    for seed in range(20):
        try:
            check_inputs(*as_args(make_case(BS, N, V, torch.Generator().manual_seed(seed), style="peaked")))
        except ValueError as e:
            assert "sibling" in str(e)
            bad += 1
    assert bad > 0


def test_subnormal_and_zero_probabilities_pass():
    c = valid_case(0)
    c["target_probs"][1, 2] = 0.0
    c["target_probs"][1, 2, 3] = 1.0
    c["target_probs"][1, 2, 4] = 1e-40
    check_inputs(*as_args(c))


def detach_leaf(c, b):
    """Unlinks a leaf of request b from its parent's child list (no walk reaches it); returns it."""
    x = leaf(c, b)
    nt, ns = c["retrive_next_token"][b], c["retrive_next_sibling"][b]
    for u in range(N):
        if nt[u] == x:
            nt[u] = ns[x]
        if ns[u] == x:
            ns[u] = ns[x]
    return x


def test_unreachable_nodes_data_not_checked():
    c = valid_case(0)
    b = 1
    x = detach_leaf(c, b)
    c["candidates"][b, x] = V + 5
    c["target_probs"][b, x] = NAN
    c["draft_probs"][b, x] = -1.0
    c["uniform_samples"][b, x] = 2.0
    check_inputs(*as_args(c))


@pytest.mark.parametrize("target", ["detached", "self", "reachable"])
def test_root_sibling_link_not_followed(target):
    """The walks start at the root's first child, so the root's own retrive_next_sibling is never read:
    the check neither follows it nor counts it as a second way to reach a node."""
    c = valid_case(0)
    b = 1
    if target == "detached":  # a node no walk reaches, with data the op would reject if it read it
        x = detach_leaf(c, b)
        c["candidates"][b, x] = V + 5
        c["target_probs"][b, x] = NAN
    else:
        x = 0 if target == "self" else int(c["retrive_next_token"][b, 0])
    c["retrive_next_sibling"][b, 0] = x
    check_inputs(*as_args(c))
    ns_none = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    ns_none["retrive_next_sibling"][b, 0] = -1
    cupy_spec.tree_speculative_sampling_target_only(*as_args(c), validate=True)
    cupy_spec.tree_speculative_sampling_target_only(*as_args(ns_none))
    for name in ("predicts", "accept_index", "accept_token_num"):
        assert torch.equal(c[name], ns_none[name]), name


def test_root_token_not_checked():
    c = valid_case(0)
    c["candidates"][:, 0] = -1
    check_inputs(*as_args(c))


def test_shape_errors_come_first():
    c = valid_case(0)
    c["retrive_next_token"][0, 0] = 99
    c["candidates"] = c["candidates"].int()
    with pytest.raises(TypeError, match="candidates"):
        check_inputs(*as_args(c))
    c = valid_case(0)
    with pytest.raises(ValueError, match="threshold_acc"):
        check_inputs(*as_args(c), threshold_acc=1.5)


def test_op_validate_flag_calls_check_inputs():
    c = valid_case(0)
    cupy_spec.tree_speculative_sampling_target_only(*as_args(c), validate=True)
    c = valid_case(0)
    c["uniform_samples"][2, 4] = NAN
    with pytest.raises(ValueError, match=r"uniform_samples\[2, 4\]"):
        cupy_spec.tree_speculative_sampling_target_only(*as_args(c), validate=True)
    cupy_spec.tree_speculative_sampling_target_only(*as_args(c))  # no check without validate


# ---- one test per problem class ----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["retrive_next_token", "retrive_next_sibling"])
@pytest.mark.parametrize("value", [N, N + 7, -2, -5])
def test_link_out_of_range(name, value, device):
    c = valid_case(0, device=device)
    c[name][2, 5] = value
    raises(c, name, 2, 5, rf"= {value} is outside \[-1, n={N}\)")


def _self_loop(c, b):
    x = leaf(c, b)
    c["retrive_next_token"][b, x] = x
    return x, "retrive_next_token"


def _root_as_child(c, b):
    c["retrive_next_token"][b, leaf(c, b)] = 0
    return 0, "root is listed as a child"


def _sibling_cycle(c, b):
    u = with_children(c, b, 2)
    kids = children(c, b, u)
    c["retrive_next_sibling"][b, kids[-1]] = kids[0]
    return kids[0], "retrive_next_sibling"


def _child_cycle(c, b):
    x = leaf(c, b)  # the leaf's first child becomes its highest non-root ancestor
    anc = next(u for u in range(1, x) if x in _descendants(c, b, u))
    c["retrive_next_token"][b, x] = anc
    return anc, "retrive_next_token"


def _shared_child(c, b):
    x = leaf(c, b)
    other = next(u for u in range(1, N) if x not in _descendants(c, b, u) and c["retrive_next_token"][b, u] >= 0)
    # x adopts `other`'s first child, which then has two parents.
    c["retrive_next_token"][b, x] = int(c["retrive_next_token"][b, other])
    return int(c["retrive_next_token"][b, other]), "retrive_next_token"


def _descendants(c, b, u):
    out, todo = set(), [u]
    while todo:
        v = todo.pop()
        if v not in out:
            out.add(v)
            todo.extend(children(c, b, v))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [_self_loop, _root_as_child, _sibling_cycle, _child_cycle, _shared_child])
def test_node_reached_twice(make, device):
    c = valid_case(0, spec_tree=True)
    node, what = make(c, 1)
    c = {k: (None if v is None else v.to(device)) for k, v in c.items()}
    msg = raises(c, "retrive_next_token / retrive_next_sibling", 1, node, what)
    assert "tree" in msg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [V, V + 100, -1, -3])
def test_candidate_out_of_vocabulary(value, device):
    c = valid_case(0, device=device)
    c["candidates"][1, 3] = value
    c["candidates"][2, 1] = value  # a later problem of the same class is not the one reported
    raises(c, "candidates", 1, 3, rf"= {value} is not a token id in \[0, V={V}\)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [-1, -100])
def test_retrive_index_negative(value, device):
    c = valid_case(0, device=device)
    c["retrive_index"][1, 4] = value
    raises(c, "retrive_index", 1, 4, "negative")


@pytest.mark.parametrize("device", DEVICES)
def test_retrive_index_beyond_predicts(device):
    c = valid_case(0, device=device)
    c["retrive_index"][0, 6] = 10**6
    raises(c, "retrive_index", 0, 6, r"outside \[0, len\(predicts\)=24\)")


@pytest.mark.parametrize("device", DEVICES)
def test_retrive_index_duplicate_across_batch(device):
    c = valid_case(0, device=device)
    c["retrive_index"][2, 5] = c["retrive_index"][0, 3]
    msg = raises(c, "retrive_index", 2, 5, r"repeats retrive_index\[0, 3\]")
    assert "distinct" in msg


@pytest.mark.parametrize("device", DEVICES)
def test_predicts_too_short(device):
    c = valid_case(0, device=device)
    c["predicts"] = c["predicts"][: BS * N - 2]
    raises(c, "predicts", BS - 1, N - 2, rf"needs max\(retrive_index\) \+ 1 = {BS * N} entries")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value, what", [(NAN, "NaN"), (INF, "inf"), (-INF, "inf"), (-0.25, "negative value")])
def test_target_row_bad_value(value, what, device):
    c = valid_case(0, device=device)
    c["target_probs"][1, 2, 5] = value
    raises(c, "target_probs", 1, 2, f"holds .*{what}.* at token 5")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.01, 0.5, 0.0])
def test_target_row_not_normalised(scale, device):
    c = valid_case(0, device=device)
    c["target_probs"][2, 6] *= scale
    raises(c, "target_probs", 2, 6, "sums to .* not 1")


def test_target_row_normalised_within_tolerance():
    c = valid_case(0)
    c["target_probs"][2, 6] *= 1.0005
    check_inputs(*as_args(c))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value, what", [(NAN, "NaN"), (INF, "inf"), (-1e-3, "negative value")])
def test_draft_row_bad_value(value, what, device):
    c = valid_case(0, device=device)
    c["draft_probs"][0, 7, 36] = value
    raises(c, "draft_probs", 0, 7, f"holds .*{what}.* at token 36")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [1.0, 1.5, -0.1, NAN, INF, -INF])
def test_uniform_samples_out_of_range(value, device):
    c = valid_case(0, device=device)
    c["uniform_samples"][1, 3] = value
    raises(c, "uniform_samples", 1, 3, r"not in \[0, 1\)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [1.0, -1e-8, NAN])
def test_final_coin_out_of_range(value, device):
    c = valid_case(0, device=device)
    c["uniform_samples_for_final_sampling"][2] = value
    msg = raises(c, "uniform_samples_for_final_sampling", 2, None, r"not in \[0, 1\)")
    assert "node" not in msg


@pytest.mark.parametrize("device", DEVICES)
def test_duplicate_sibling_tokens(device):
    c = valid_case(0, spec_tree=True)
    u = with_children(c, 1, 2)
    a, b2 = children(c, 1, u)[:2]
    c["candidates"][1, b2] = c["candidates"][1, a]
    c = {k: (None if v is None else v.to(device)) for k, v in c.items()}
    msg = raises(c, "candidates", 1, b2, f"sibling node {a}")
    assert "lossless" in msg


@pytest.mark.parametrize("device", DEVICES)
def test_duplicate_sibling_tokens_found_past_root_sibling_link(device):
    """The root's own sibling link, pointing at a grandchild, does not hide who its parent is."""
    c = valid_case(0, spec_tree=True)
    c["candidates"][1, 4] = c["candidates"][1, 3]  # node 1's children 3 and 4 (contract example tree)
    c["retrive_next_sibling"][1, 0] = 3
    c = {k: (None if v is None else v.to(device)) for k, v in c.items()}
    raises(c, "candidates", 1, 4, "sibling node 3")


def test_duplicate_tokens_of_non_siblings_pass():
    c = valid_case(0, spec_tree=True)
    u = with_children(c, 1, 1)
    kid = children(c, 1, u)[0]
    c["candidates"][1, u] = c["candidates"][1, kid]  # parent and child share a token: fine
    check_inputs(*as_args(dedup_siblings(c)))


def test_first_problem_in_check_order():
    c = valid_case(0)
    c["uniform_samples"][0, 0] = NAN  # coins come after probabilities
    c["target_probs"][2, 1, 0] = NAN
    raises(c, "target_probs", 2, 1)
    c["candidates"][2, 7] = -1  # candidates come before probabilities
    raises(c, "candidates", 2, 7)
    c["retrive_next_sibling"][2, 7] = -9  # links come first
    raises(c, "retrive_next_sibling", 2, 7)


@pytest.mark.parametrize("nt, ns, exc, match", [
    (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), TypeError, "next_token must be an int32 or int64 tensor, got float32"),
    (torch.zeros(2, 3, dtype=torch.long), [[0]], TypeError, "next_sibling must be an int32 or int64 tensor, got list"),
    (torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), ValueError, r"one shape \[bs, n\], got \(3,\)"),
    (torch.zeros(3, dtype=torch.long), [[0]], TypeError, "next_sibling must be an int32 or int64 tensor, got list"),
    (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), ValueError, r"got \(2, 3\) and \(2, 4\)"),
])
def test_reachable_checks_its_arguments(nt, ns, exc, match):
    with pytest.raises(exc, match=match):
        cupy_spec.check.reachable(nt, ns)


def test_reachable_of_empty_trees():
    assert cupy_spec.check.reachable(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0, dtype=torch.long)).shape == (3, 0)


def test_check_inputs_is_exported():
    import cupy_spec
    from cupy_spec.check import check_inputs

    assert cupy_spec.check_inputs is check_inputs
