"""``tree_speculative_sampling``: unit tests of the reference and statistical proof of losslessness.

Unit tests pin the semantics stated in :mod:`cupy_spec.reference.tree_speculative_sampling`
(hand-computed thresholds in both modes, duplicates, q(x) = 0, all-zero residuals, the depth
limit, malformed trees, outputs off the path untouched, draft rows never written) and compare the
vectorised reference with a per-request transcription of its docstring on random and hostile
inputs.

Statistical tests (the model pair and machinery of ``test_chain_speculative_sampling`` and
``test_lossless``). Every one of N requests gets its own draft tree of a fixed shape: the children
of node i are drawn from the draft row of node i's prefix, i.i.d. (``replacement=True``, so
siblings repeat tokens) or without replacement in sibling order (``replacement=False``); every node
gets the target and draft rows of its prefix. Then, for both modes and two shapes:

(a) the first emitted token is distributed as the target row of the empty prefix;
(b) the first two emitted tokens follow p(t1) p(t2 | t1) (t2 drawn exactly from p(. | t1) where
    the op emitted one token);
(c) the mean accept length matches its exact value, computed in float64 by enumerating every
    sibling draw under the rule (so the op is lossless *and* accepts as the rule says).

Power: the same statistics must exceed the critical values ``POWER_FACTOR`` times when the rule
does not fit the drafts: the with-replacement rule on drafts drawn without replacement, the
without-replacement rule on i.i.d. drafts, and q ignored (zero draft rows).

The statistical tests call :func:`op`: the public ``cupy_spec.tree_speculative_sampling`` once the
package exports it, the reference until then; they are parametrised over :data:`DEVICES`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy_spec
from cupy_spec import tree as spec_tree
from cupy_spec.reference import COIN_MAX, FLT_MIN, sample_residual
from cupy_spec.reference.tree_speculative_sampling import tree_speculative_sampling as reference_tree
from cases import POISON, captured, no_hang, random_rows, random_tree
from test_chain_speculative_sampling import DEVICES, N, Model, draw, joint_stat, first_stat, mean_z, second_tokens
from test_lossless import ALPHA, POWER_FACTOR, chi2_isf, chi2_sf, normal_isf_two_sided


def op(*args, **kwargs):
    """The op under test: ``cupy_spec.tree_speculative_sampling`` if the package exports it, else
    the reference (same arguments)."""
    return getattr(cupy_spec, "tree_speculative_sampling", reference_tree)(*args, **kwargs)


def _f32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def make_args(parents, tokens, target, draft, coins, final_coin, S=None):
    """Op arguments (one request) for a tree given by its parent list; outputs poisoned."""
    t = spec_tree.from_parents([parents])
    n = len(parents)
    S = t.S if S is None else S
    return dict(
        predicts=torch.full((n,), POISON, dtype=torch.int32),
        accept_index=torch.full((1, S), POISON, dtype=torch.int32),
        accept_token_num=torch.full((1,), POISON, dtype=torch.int32),
        candidates=torch.tensor([tokens]),
        retrive_index=t.retrive_index.clone(),
        retrive_next_token=t.retrive_next_token.clone(),
        retrive_next_sibling=t.retrive_next_sibling.clone(),
        uniform_samples=_f32([coins]),
        uniform_samples_for_final_sampling=_f32([final_coin]),
        target_probs=_f32(target)[None] if not torch.is_tensor(target) else target,
        draft_probs=_f32(draft)[None] if not torch.is_tensor(draft) else draft,
    )


ORDER = ["predicts", "accept_index", "accept_token_num", "candidates", "retrive_index", "retrive_next_token",
         "retrive_next_sibling", "uniform_samples", "uniform_samples_for_final_sampling", "target_probs",
         "draft_probs"]


def run_ref(args, replacement, **kw):
    return reference_tree(*(args[k] for k in ORDER), replacement, **kw)


def emitted(args):
    """Emitted tokens of request 0: predicts along the accepted path."""
    c = int(args["accept_token_num"][0])
    return args["predicts"][args["accept_index"][0, : c + 1].long()].tolist()


# --------------------------------------------------------------------------------------------
# Hand-computed cases
# --------------------------------------------------------------------------------------------

# Root with two children over V = 3: p = [.2, .5, .3], q = [.5, .3, .2]; tokens 0 then 2.
# Child 1 (x = 0): accepted iff u * 0.5 < 0.2, i.e. u < 0.4 (u = 0.4 gives 0.2f == p: rejected).
# Rejected: R = max(p - q, 0) = [0, .2, .1], N = 0.3.
#   with replacement:    c = 0.3, child 2 (x = 2) accepted iff u * .2 * .3 < .1: always.
#   without replacement: Q = [0, .3, .2], S = 0.5, c = 0.6: accepted iff u * .2 * .6 < .1, u < 0.8333;
#                        rejected: R = max([0, .2, .1] - .6 * [0, .3, .2], 0) = [0, .02, 0] -> token 1.
HAND_P = [[0.2, 0.5, 0.3], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
HAND_Q = [[0.5, 0.3, 0.2]] * 3


def _hand(u1, u2, replacement, final=0.5):
    args = make_args([-1, 0, 0], [0, 0, 2], HAND_P, HAND_Q, [0.0, u1, u2], final)
    r, _ = run_ref(args, replacement, return_residual=True)
    return args, r


@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.parametrize("u1, accepted", [(0.0, True), (0.39, True), (0.3999999, True), (0.4, False), (0.9, False)])
def test_first_child_threshold(u1, accepted, replacement):
    args, _ = _hand(u1, COIN_MAX, replacement)
    if accepted:  # bonus from node 1's row [1, 0, 0]
        assert emitted(args) == [0, 0] and args["accept_index"].tolist() == [[0, 1]]
    elif replacement:  # child 2 always accepted (see above), bonus from its row [0, 0, 1]
        assert emitted(args) == [2, 2] and args["accept_index"].tolist() == [[0, 2]]
    else:  # child 2 rejected at u = COIN_MAX > 0.8333: token from R = [0, .02, 0]
        assert emitted(args) == [1] and args["accept_index"].tolist() == [[0, POISON]]


@pytest.mark.parametrize("u2", [0.0, 0.8, 0.833, 0.834, 0.9, COIN_MAX])
def test_second_child_with_replacement_always_accepted(u2):
    args, _ = _hand(0.9, u2, True)
    assert emitted(args) == [2, 2] and args["accept_index"].tolist() == [[0, 2]]
    assert args["predicts"].tolist() == [2, POISON, 2]


@pytest.mark.parametrize("u2, accepted", [(0.0, True), (0.8, True), (0.833, True), (0.834, False), (COIN_MAX, False)])
def test_second_child_without_replacement_threshold(u2, accepted):
    args, r = _hand(0.9, u2, False)
    if accepted:
        assert emitted(args) == [2, 2]
    else:
        assert emitted(args) == [1] and args["accept_token_num"].tolist() == [0]
        assert args["accept_index"].tolist() == [[0, POISON]]
        assert r[0, 0].item() == 0 and r[0, 2].item() == 0 and r[0, 1].item() == pytest.approx(0.02, abs=1e-6)


def test_all_children_rejected_samples_from_residual_by_coin():
    # with replacement: R = [0, .2, .1] after child 1 (N = c = .3); child 2 = token 0 again: R[0] = 0,
    # rejected, R = max(R - .3 * q, 0) = [0, .11, .04]; final: token 1 for coin < .11 / .15, else 2
    for coin, token in [(0.0, 1), (0.6, 1), (0.73, 1), (0.74, 2), (COIN_MAX, 2)]:
        args = make_args([-1, 0, 0], [0, 0, 0], HAND_P, HAND_Q, [0.0, 0.9, 0.0], coin)
        run_ref(args, True)
        assert emitted(args) == [token], coin


def test_repeated_token_after_rejection_is_never_accepted_with_replacement():
    # after x is rejected, r(x) < q(x), so max(r - q, 0)(x) = 0: a repeat of x cannot pass
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        V = 5
        p = torch.softmax(2 * torch.randn(V, generator=g), 0)
        q = torch.softmax(2 * torch.randn(V, generator=g), 0)
        x = int(torch.multinomial(q, 1, generator=g))
        coins = [0.0, float(torch.rand(1, generator=g)), 0.0, 0.0]
        args = make_args([-1, 0, 0, 0], [0, x, x, x], torch.stack([p] * 4)[None], torch.stack([q] * 4)[None],
                         coins, 0.5)
        run_ref(args, True)
        node = args["accept_index"][0, 1].item() if args["accept_token_num"].item() else 0
        assert node in (0, 1), "a repeat of a rejected token was accepted"


def test_modes_agree_when_every_node_has_one_child():
    g = torch.Generator().manual_seed(1)
    parents = [-1, 0, 1, 2]
    for _ in range(100):
        target = torch.softmax(2 * torch.randn(1, 4, 5, generator=g), -1)
        draft = torch.softmax(2 * torch.randn(1, 4, 5, generator=g), -1)
        tokens = [0] + torch.randint(0, 5, (3,), generator=g).tolist()
        coins = torch.rand(4, generator=g).tolist()
        a = make_args(parents, tokens, target, draft, coins, 0.3)
        b = make_args(parents, tokens, target, draft, coins, 0.3)
        run_ref(a, True)
        run_ref(b, False)
        for k in ("predicts", "accept_index", "accept_token_num"):
            assert torch.equal(a[k], b[k])


# --------------------------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replacement", [True, False])
def test_q_zero_accepted_iff_residual_positive(replacement):
    target = [[0.5, 0.5, 0.0], [1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]]
    draft = [[0.0, 0.0, 1.0]] * 4
    for tok, accepted in [(0, True), (1, True)]:
        args = make_args([-1, 0], [0, tok], target[:2], draft[:2], [0.0, COIN_MAX], 0.5)
        run_ref(args, replacement)
        assert args["accept_token_num"].tolist() == [int(accepted)]
    args = make_args([-1, 0], [0, 2], target[:2], draft[:2], [0.0, 0.0], 0.5)  # p(2) = 0: never accepted
    run_ref(args, replacement)
    assert args["accept_token_num"].tolist() == [0]


@pytest.mark.parametrize("replacement", [True, False])
def test_repeat_of_rejected_sibling(replacement):
    # p = [.3, .7], q = [.6, .4], tokens 0, 0; child 1 rejected for u >= .5: R = [0, .3].
    # Child 2 (token 0) has R[0] = 0: rejected in both modes.
    args = make_args([-1, 0, 0], [0, 0, 0], [[0.3, 0.7], [1, 0], [1, 0]], [[0.6, 0.4]] * 3, [0.0, 0.5, 0.0], 0.0)
    r, _ = run_ref(args, replacement, return_residual=True)
    assert args["accept_token_num"].tolist() == [0]
    if replacement:  # R = max([0, .3] - .3 * [.6, .4], 0) = [0, .18]
        assert emitted(args) == [1] and r[0].tolist() == pytest.approx([0.0, 0.18], abs=1e-6)
    else:  # Q = [0, .4], c = N / .4: R = max([0, N] - c * [0, .4], 0) = [0, 0] in float32 (a draw of
        # probability 0: q(0) = 0 once 0 is removed), so the final row falls back to p, coin 0 -> 0
        assert emitted(args) == [0] and r[0].tolist() == pytest.approx([0.3, 0.7])


@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.parametrize("coin, token", [(0.0, 0), (0.49, 0), (0.51, 1), (COIN_MAX, 1)])
def test_all_zero_residual_falls_back_to_target_row(replacement, coin, token):
    # p == q and the child's token has p = q = 0: rejected, R = max(p - q, 0) = 0 -> sample from p
    row = [0.5, 0.5, 0.0]
    args = make_args([-1, 0], [0, 2], [row, row], [row, row], [0.0, 0.3], coin)
    run_ref(args, replacement)
    assert emitted(args) == [token]


def test_no_draft_mass_left_means_q_zero():
    # without replacement, q = [1, 0, 0]: after rejecting token 0 nothing is left (S = 0, c = 0):
    # the next child is accepted iff R[x] > 0 and R no longer changes
    target = [[0.2, 0.5, 0.3], [1, 0, 0], [0, 1, 0], [0, 0, 1]]
    draft = [[1.0, 0.0, 0.0]] * 4
    args = make_args([-1, 0, 0, 0], [0, 0, 0, 1], target, draft, [0.0, 0.5, 0.0, COIN_MAX], 0.0)
    run_ref(args, False)  # child 1: .5 * 1 >= .2: rejected, R = [0, .5, .3]; child 2: Q[0] = 0, R[0] = 0;
    # child 3 (token 1): 0 < R[1] = .5: accepted whatever the coin; bonus from node 3's row [0, 0, 1]
    assert args["accept_index"].tolist() == [[0, 3]] and emitted(args) == [1, 2]


@pytest.mark.parametrize("replacement", [True, False])
def test_depth_limit_takes_bonus_token(replacement):
    parents = [-1, 0, 1]
    target = [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    draft = [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1 / 3] * 3]
    args = make_args(parents, [0, 1, 2], target, draft, [0.9, 0.9, 0.9], 0.5, S=2)
    run_ref(args, replacement)
    assert emitted(args) == [1, 2] and args["accept_index"].tolist() == [[0, 1]]
    args = make_args(parents, [0, 1, 2], target, draft, [0.9, 0.9, 0.9], 0.5, S=1)
    run_ref(args, replacement)
    assert emitted(args) == [1] and args["predicts"].tolist() == [1, POISON, POISON]


@pytest.mark.parametrize("replacement", [True, False])
def test_malformed_child_ends_walk_with_current_residual(replacement):
    # child 1 rejected (R = [0, .2, .1]); child 2 has token 7 >= V: the walk ends there and the final
    # token is drawn from R as it stands (coin 0.9 -> token 2), child 3 is never tried
    for bad in ({"tok": 7}, {"tok": -1}, {"ri": 99}, {"ri": -5}):
        args = make_args([-1, 0, 0, 0], [0, 0, bad.get("tok", 1), 1], HAND_P + [[0, 1.0, 0]], HAND_Q + [HAND_Q[0]],
                         [0.0, 0.9, 0.0, 0.0], 0.9)
        if "ri" in bad:
            args["retrive_index"][0, 2] = bad["ri"]
        run_ref(args, replacement)
        assert emitted(args) == [2], bad


def test_cycles_and_bad_links_end_the_walk():
    V = 3
    target = torch.full((1, 3, V), 1 / 3)
    draft = torch.full((1, 3, V), 1 / 3)
    for nt, ns in [([1, 0, -1], [-1, -1, -1]),  # node 1's first child is the root
                   ([1, 1, -1], [-1, -1, -1]),  # node 1 is its own child
                   ([1, -1, -1], [-1, 1, -1]),  # sibling loop
                   ([5, -1, -1], [-1, -1, -1]),  # link out of range: no child
                   ([-9, -1, -1], [-1, 9, -1])]:
        args = make_args([-1, 0, 1], [0, 1, 2], target, draft, [0.0, 0.0, 0.0], 0.5)
        args["retrive_next_token"] = torch.tensor([nt])
        args["retrive_next_sibling"] = torch.tensor([ns])
        with no_hang(5):
            run_ref(args, True)
        assert 0 <= args["accept_token_num"].item() <= 2
        assert all(0 <= t < V for t in emitted(args))


def test_root_index_out_of_range_writes_only_accept_index_and_count():
    args = make_args([-1, 0], [0, 1], [[0.5, 0.5]] * 2, [[0.5, 0.5]] * 2, [0.0, 0.0], 0.5)
    args["retrive_index"][0, 0] = 10
    run_ref(args, False)
    assert args["predicts"].tolist() == [POISON, POISON]
    assert args["accept_index"].tolist() == [[10, POISON]] and args["accept_token_num"].tolist() == [0]


def test_empty_batch_is_a_no_op():
    z = torch.zeros(0, 3, dtype=torch.long)
    assert reference_tree(torch.zeros(0, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32),
                          torch.zeros(0, dtype=torch.int32), z, z, z, z, torch.zeros(0, 3), torch.zeros(0),
                          torch.zeros(0, 3, 4), torch.zeros(0, 3, 4), True) is None


# --------------------------------------------------------------------------------------------
# The reference against a per-request transcription of its docstring (random and hostile input)
# --------------------------------------------------------------------------------------------


def _E(x):
    return torch.where(torch.isfinite(x) & (x >= FLT_MIN), x, torch.zeros_like(x))


def _flush(x):
    return torch.where(x.abs() < FLT_MIN, torch.zeros_like(x), x)


def _sum32(x):
    return _flush(x.double().sum().float())


def spec_tree_op(a, replacement):
    """Request by request, step by step, exactly as the reference's docstring says."""
    bs, n = a["candidates"].shape
    V = a["target_probs"].shape[2]
    P = a["predicts"].shape[0]
    S = a["accept_index"].shape[1]
    coin = torch.where(a["uniform_samples"] >= FLT_MIN, a["uniform_samples"].clamp(max=COIN_MAX), torch.zeros(()))
    fcoin = a["uniform_samples_for_final_sampling"]
    fcoin = torch.where(fcoin >= FLT_MIN, fcoin.clamp(max=COIN_MAX), torch.zeros(()))

    def link(v):
        return int(v) if 0 <= int(v) < n else -1

    for b in range(bs):
        ri = a["retrive_index"][b].tolist()
        a["accept_index"][b, 0] = ri[0]
        if not 0 <= ri[0] < P:
            a["accept_token_num"][b] = 0
            continue
        cur, count, last, seen = 0, 0, ri[0], {0}
        R, c, X = _E(a["target_probs"][b, 0]), torch.tensor(1.0), set()
        ch = link(a["retrive_next_token"][b, 0]) if S > 1 else -1
        while ch != -1 and ch not in seen:
            seen.add(ch)
            x = int(a["candidates"][b, ch])
            if not (0 <= x < V and 0 <= ri[ch] < P):
                break
            Q = _E(a["draft_probs"][b, cur])
            Q[sorted(X)] = 0.0
            if _flush(_flush(coin[b, ch] * Q[x]) * c) < R[x]:
                a["predicts"][last] = x
                count += 1
                a["accept_index"][b, count] = ri[ch]
                last, cur = ri[ch], ch
                R, c, X = _E(a["target_probs"][b, ch]), torch.tensor(1.0), set()
                ch = link(a["retrive_next_token"][b, ch]) if count < S - 1 else -1
            else:
                R = _E(R - _flush(c * Q))
                if not replacement:
                    X.add(x)
                    Q[x] = 0.0
                Nsum = _sum32(R)
                Ssum = torch.tensor(1.0) if replacement else _sum32(Q)
                c = _flush(Nsum / Ssum) if Ssum > 0 else torch.tensor(0.0)
                ch = link(a["retrive_next_sibling"][b, ch])
        a["accept_token_num"][b] = count
        r = R if bool((R > 0).any()) else _E(a["target_probs"][b, cur])
        a["predicts"][last] = int(sample_residual(r[None], fcoin[b : b + 1])[0])


def random_case(g, bs, n, V, hostile):
    """Op arguments for random trees (children drawn from the draft rows, some repeats); with
    ``hostile``: garbage probabilities and coins, broken links, tokens and indices, random S."""
    nt, ns, parents, depth = random_tree(bs, n, g, max_children=3)
    target = random_rows(bs, n, V, g, "sparse" if V > 4 else "flat")
    draft = random_rows(bs, n, V, g, "peaked")
    ar = torch.arange(bs)
    cand = torch.zeros(bs, n, dtype=torch.long)
    for i in range(1, n):
        cand[:, i] = torch.multinomial(draft[ar, parents[:, i]], 1, generator=g).squeeze(1)
    S = int(depth.max()) + 1
    coins = torch.rand(bs, n, generator=g)
    final = torch.rand(bs, generator=g)
    ri = ar[:, None] * n + torch.arange(n)
    if hostile:
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.5, 1e-40, 0.0, 3e38])
        for t in (target, draft):
            m = torch.rand(t.shape, generator=g) < 0.1
            t[m] = specials[torch.randint(0, len(specials), (int(m.sum()),), generator=g)]
        for t in (nt, ns, cand):
            m = torch.rand(t.shape, generator=g) < 0.08
            t[m] = torch.randint(-3, max(V, n) + 3, (int(m.sum()),), generator=g)
        # indices: out of range, or another node's index of the same request (an index shared
        # between requests leaves open which request's write wins, as for the target-only op)
        m = torch.rand(ri.shape, generator=g) < 0.08
        own = ar[:, None] * n + torch.randint(0, n, (bs, n), generator=g)
        wild = torch.where(torch.rand(bs, n, generator=g) < 0.5, -1 - own, own + bs * n)
        ri = torch.where(m, torch.where(torch.rand(bs, n, generator=g) < 0.5, own, wild), ri)
        coins[torch.rand(bs, n, generator=g) < 0.1] = float("nan")
        coins[torch.rand(bs, n, generator=g) < 0.1] = 1.0
        S = int(torch.randint(1, S + 2, (1,), generator=g))
    return dict(
        predicts=torch.full((bs * n,), POISON, dtype=torch.int32),
        accept_index=torch.full((bs, S), POISON, dtype=torch.int32),
        accept_token_num=torch.full((bs,), POISON, dtype=torch.int32),
        candidates=cand, retrive_index=ri, retrive_next_token=nt, retrive_next_sibling=ns,
        uniform_samples=coins, uniform_samples_for_final_sampling=final, target_probs=target, draft_probs=draft)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 12), V=st.integers(1, 9), hostile=st.booleans(),
       replacement=st.booleans())
def test_reference_matches_per_request_transcription(seed, n, V, hostile, replacement):
    case = random_case(torch.Generator().manual_seed(seed), 6, n, V, hostile)
    got = {k: v.clone() for k, v in case.items()}
    want = {k: v.clone() for k, v in case.items()}
    with no_hang(10):
        run_ref(got, replacement)
        spec_tree_op(want, replacement)
    for k in ORDER:
        assert torch.equal(got[k].view(torch.int32) if got[k].is_floating_point() else got[k],
                           want[k].view(torch.int32) if want[k].is_floating_point() else want[k]), k
    for k in ORDER[3:]:  # inputs, draft rows included, are never written
        x, y = got[k], case[k]
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)) if x.is_floating_point() else torch.equal(x, y)
    written = got["predicts"][got["predicts"] != POISON]
    assert bool(((written >= 0) & (written < V)).all()), "a token outside [0, V)"


# --------------------------------------------------------------------------------------------
# Statistical tests
# --------------------------------------------------------------------------------------------

SHAPES = {
    "wide": [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3],  # root with 3 children, each with 2
    "mixed": [-1, 0, 0, 1, 1, 1, 3, 3, 2],  # depth 3: 2, then 3 and 1, then 2 children
}
TREE_MODEL_SEED = 99


def tree_model(shape: str) -> Model:
    depth = max(len(_path(SHAPES[shape], i)) for i in range(len(SHAPES[shape]))) + 1
    return Model(6, depth, TREE_MODEL_SEED + len(shape), sharp=2.0, noise=0.8)


def _path(parents, i):
    out = []
    while parents[i] >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def _kids(parents):
    return [[c for c in range(len(parents)) if parents[c] == i] for i in range(len(parents))]


def draw_tree(model: Model, parents, replacement: bool, g):
    """Per-request tokens int64 [N, n] and prefix codes int64 [N, n] (node order = BFS ids)."""
    n = len(parents)
    tok = torch.zeros(N, n, dtype=torch.long)
    code = torch.zeros(N, n, dtype=torch.long)
    for i, kids in enumerate(_kids(parents)):
        w = model.q64[code[:, i]].clone()
        for c in kids:
            tok[:, c] = draw(w, g)
            code[:, c] = model.child(code[:, i], tok[:, c])
            if not replacement:
                w[torch.arange(N), tok[:, c]] = 0.0
    return tok, code


def exact_mean_accepts(model: Model, parents, replacement: bool) -> float:
    """E[accept_token_num] (float64) under the rule, by enumerating every sibling draw."""
    kids = _kids(parents)

    @functools.lru_cache(maxsize=None)
    def node_value(code, node):
        if not kids[node]:
            return 0.0
        return siblings(code, node, 0, model.p64[code], model.q64[code])

    def siblings(code, node, j, r, q):
        if j == len(kids[node]):
            return 0.0
        rest = torch.clamp(r - q, min=0.0)
        z = float(rest.sum())
        total = 0.0
        for x in range(model.V):
            if q[x] <= 0:
                continue
            a = min(1.0, float(r[x] / q[x]))
            val = a * (1.0 + node_value(model.child(code, x), kids[node][j]))
            if a < 1.0 and z > 0:
                q2 = q
                if not replacement:
                    q2 = q.clone()
                    q2[x] = 0.0
                    q2 = q2 / q2.sum() if q2.sum() > 0 else q2
                val += (1.0 - a) * siblings(code, node, j + 1, rest / z, q2)
            total += float(q[x]) * val
        return total

    return node_value(0, 0)


WRONG = {  # name: (drafts drawn with replacement?, op's replacement flag, draft rows zeroed?)
    "replacement_rule_on_distinct_drafts": (False, True, False),
    "distinct_rule_on_iid_drafts": (True, False, False),
    "q_ignored": (False, False, True),
}


@functools.lru_cache(maxsize=None)
def run_tree(shape: str, drafted_with_replacement: bool, device: str, flag: bool | None = None, zero_q=False):
    """One call of :func:`op` on N requests, each with its own drafted tree; CPU results."""
    flag = drafted_with_replacement if flag is None else flag
    parents = SHAPES[shape]
    model = tree_model(shape)
    g = torch.Generator().manual_seed(4242 + len(shape) + 2 * drafted_with_replacement)
    n, V = len(parents), model.V
    tok, code = draw_tree(model, parents, drafted_with_replacement, g)
    t = spec_tree.from_parents([parents])
    offs = (torch.arange(N) * n)[:, None]
    target = model.p[code]
    draft = torch.zeros_like(target) if zero_q else model.q[code]
    coins = torch.rand(N, n, generator=g)
    final = torch.rand(N, generator=g)
    dev = torch.device(device)
    predicts = torch.full((N * n,), POISON, dtype=torch.int32, device=dev)
    accept_index = torch.full((N, t.S), POISON, dtype=torch.int32, device=dev)
    num = torch.full((N,), POISON, dtype=torch.int32, device=dev)
    op(predicts, accept_index, num, tok.to(dev), (t.retrive_index + offs).to(dev),
       t.retrive_next_token.expand(N, n).contiguous().to(dev), t.retrive_next_sibling.expand(N, n).contiguous().to(dev),
       coins.to(dev), final.to(dev), target.to(dev), draft.to(dev), flag)
    predicts, accept_index, num = predicts.cpu().long(), accept_index.cpu().long(), num.cpu().long()

    # consistency: a root path, emitted drafts are the path's tokens, tokens in range
    assert bool(((num >= 0) & (num < t.S)).all())
    col = torch.arange(t.S)[None, :]
    on = col <= num[:, None]
    node = torch.where(on, accept_index - offs, torch.zeros_like(accept_index))
    par = torch.tensor(parents)
    assert bool((node[:, 0] == 0).all()) and bool((par[node[:, 1:]] == node[:, :-1])[on[:, 1:]].all())
    out = predicts[torch.where(on, accept_index, torch.zeros_like(accept_index))]
    assert bool(((out >= 0) & (out < V))[on].all())
    assert bool((out[:, :-1] == tok.gather(1, node[:, 1:]))[on[:, 1:]].all())

    t1 = out[:, 0]
    t2 = second_tokens(t1, out[:, 1], num >= 1, model, g)
    dup = torch.zeros(N, dtype=torch.bool)
    for kids in _kids(parents):
        for a_ in range(len(kids)):
            for b_ in range(a_ + 1, len(kids)):
                dup |= tok[:, kids[a_]] == tok[:, kids[b_]]
    return {"model": model, "t1": t1, "t2": t2, "num": num, "emi": num, "dup": dup.double().mean().item()}


MODES = [pytest.param(True, id="replacement"), pytest.param(False, id="distinct")]


def _report(msg):
    print(f"\n    {msg}", end="")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replacement", MODES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_first_token_follows_target(shape, replacement, device):
    res = run_tree(shape, replacement, device)
    stat, dof = first_stat(res)
    crit = chi2_isf(ALPHA, dof)
    _report(f"(a) tree {shape}/{'repl' if replacement else 'distinct'}/{device}: chi2={stat:.2f} dof={dof} "
            f"crit={crit:.2f} p={chi2_sf(stat, dof):.3g}; siblings repeat a token in {res['dup']:.1%}")
    assert dof > 0 and stat < crit
    if replacement:
        assert res["dup"] > 0.2, "the i.i.d. case must exercise repeated sibling tokens"
    else:
        assert res["dup"] == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replacement", MODES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_first_two_tokens_follow_target(shape, replacement, device):
    res = run_tree(shape, replacement, device)
    stat, dof = joint_stat(res)
    crit = chi2_isf(ALPHA, dof)
    share = (res["num"] >= 1).double().mean().item()
    _report(f"(b) tree {shape}/{'repl' if replacement else 'distinct'}/{device}: chi2={stat:.2f} dof={dof} "
            f"crit={crit:.2f} p={chi2_sf(stat, dof):.3g}; second token from the op in {share:.1%}")
    assert dof > 0 and stat < crit
    assert share > 0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replacement", MODES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mean_accept_length_matches_exact(shape, replacement, device):
    res = run_tree(shape, replacement, device)
    exact = exact_mean_accepts(res["model"], SHAPES[shape], replacement)
    z = mean_z(res["num"], exact)
    zcrit = normal_isf_two_sided(ALPHA)
    _report(f"(c) tree {shape}/{'repl' if replacement else 'distinct'}/{device}: mean={res['num'].double().mean():.4f} "
            f"exact={exact:.4f} z={z:+.2f} (|z|crit={zcrit:.2f})")
    assert abs(z) < zcrit


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("wrong", list(WRONG))
def test_wrong_rule_is_detected(wrong, shape):
    drafted, flag, zero_q = WRONG[wrong]
    res = run_tree(shape, drafted, "cpu", flag, zero_q)
    s1, d1 = first_stat(res)
    s2, d2 = joint_stat(res)
    r1, r2 = s1 / chi2_isf(ALPHA, d1), s2 / chi2_isf(ALPHA, d2)
    _report(f"power tree {shape} {wrong}: (a) chi2/crit={r1:.1f} (b) chi2/crit={r2:.1f}")
    assert r1 > POWER_FACTOR and r2 > POWER_FACTOR


# --------------------------------------------------------------------------------------------
# The public op: signature, argument checks, CPU backend, and (on a GPU) kernel vs reference
# --------------------------------------------------------------------------------------------

import importlib  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402

from cases import at_offset, check_final_tokens, random_rows as _rows, stub_loader  # noqa: E402

tree_mod = importlib.import_module("cupy_spec.tree_speculative_sampling")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
public_tree = cupy_spec.tree_speculative_sampling


def kernel_case(bs, n, V, g, kind, replacement):
    """Op arguments (CPU) of one kind: "random" / "hostile" (:func:`random_case`), "star" (every
    node a child of the root: up to n - 2 rejections at one node, tokens drawn from the root's draft
    row as ``replacement`` says), "degenerate" (target rows equal to the draft rows and tokens of
    probability 0: all-zero residuals)."""
    if kind in ("random", "hostile"):
        return random_case(g, bs, n, V, kind == "hostile")  # S may exceed n
    case = random_case(g, bs, n, V, False)
    if kind == "star":
        nt = torch.full((bs, n), -1, dtype=torch.long)
        ns = torch.full((bs, n), -1, dtype=torch.long)
        if n > 1:
            nt[:, 0] = 1
            ns[:, 1:-1] = torch.arange(2, n)
        draft = _rows(bs, n, V, g, "peaked" if replacement else "flat")
        w = draft[:, 0].double() + 1e-12
        cand = torch.zeros(bs, n, dtype=torch.long)
        for i in range(1, n):
            cand[:, i] = torch.multinomial(w, 1, generator=g).squeeze(1)
            if not replacement and (w > 0).sum(1).min() > 1:
                w[torch.arange(bs), cand[:, i]] = 0.0
        case.update(retrive_next_token=nt, retrive_next_sibling=ns, candidates=cand, draft_probs=draft,
                    target_probs=_rows(bs, n, V, g, "flat" if V < 1000 else "sparse"),
                    accept_index=torch.full((bs, min(n, 2)), POISON, dtype=torch.int32))
    elif kind == "degenerate":
        nt, ns, parents, depth = random_tree(bs, n, g, max_children=3)
        rows = _rows(bs, n, V, g, "sparse")
        ar = torch.arange(bs)
        cand = torch.zeros(bs, n, dtype=torch.long)
        for i in range(1, n):
            prow = rows[ar, parents[:, i]]
            drawn = torch.multinomial(prow.double() + 1e-300, 1, generator=g).squeeze(1)
            zero = torch.multinomial((prow == 0).double() + 1e-300, 1, generator=g).squeeze(1)
            use_zero = (torch.rand(bs, generator=g) < 0.6) & (prow == 0).any(1)
            cand[:, i] = torch.where(use_zero, zero, drawn)
        case.update(retrive_next_token=nt, retrive_next_sibling=ns, candidates=cand, target_probs=rows,
                    draft_probs=rows.clone(),
                    accept_index=torch.full((bs, int(depth.max()) + 1), POISON, dtype=torch.int32))
    return case


def check_tree(case, got, replacement, slack_tol=2e-6) -> int:
    """Asserts the op's outputs in ``got`` (any device) match the reference run on ``case`` exactly,
    except final tokens at float32 rounding ties of the prefix sums; inputs are never written.
    Returns the tie count."""
    ref = {k: v.clone() for k, v in case.items()}
    r, coin = run_ref(ref, replacement, return_residual=True)
    got = {k: torch.as_tensor(v).cpu() for k, v in got.items()}
    assert torch.equal(got["accept_token_num"], ref["accept_token_num"]), "accept_token_num differs"
    assert torch.equal(got["accept_index"], ref["accept_index"]), "accept_index differs"
    for k in ORDER[3:]:
        x, y = got[k], case[k]
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)) if x.is_floating_point() else torch.equal(x, y), k
    return check_final_tokens(case["retrive_index"], ref, got, r, coin, slack_tol)


def test_public_signature():
    params = list(inspect.signature(public_tree).parameters.values())
    names = [p.name for p in params if p.kind is not p.KEYWORD_ONLY]
    assert names == ORDER + ["replacement", "deterministic"]
    assert params[11].default is inspect.Parameter.empty and params[12].default is True


def test_custom_op_declares_mutations():
    schema = torch.ops.cupy_spec.tree_speculative_sampling.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["predicts", "accept_index", "accept_token_num"]


@pytest.mark.parametrize("replacement", [True, False])
def test_cpu_public_op_is_the_reference(replacement):
    case = kernel_case(7, 9, 11, torch.Generator().manual_seed(2), "hostile", replacement)
    got = {k: v.clone() for k, v in case.items()}
    assert public_tree(*(got[k] for k in ORDER), replacement) is None
    assert check_tree(case, got, replacement) == 0


@pytest.mark.parametrize("bad, match, exc", [
    (dict(draft_probs=None), "draft_probs", TypeError),
    (dict(replacement=1), "replacement", TypeError),
    (dict(target_probs=lambda c: c["target_probs"].double()), "target_probs", TypeError),
    (dict(draft_probs=lambda c: c["draft_probs"][:, :, :-1].contiguous()), "draft_probs", ValueError),
    (dict(candidates=lambda c: c["candidates"].int()), "candidates", TypeError),
    (dict(accept_index=lambda c: torch.zeros(2, 0, dtype=torch.int32)), "S >= 1", ValueError),
])
def test_argument_errors_name_the_argument(bad, match, exc):
    case = kernel_case(2, 8, 5, torch.Generator().manual_seed(3), "random", True)
    replacement = True
    for k, v in bad.items():
        if k == "replacement":
            replacement = v
        else:
            case[k] = v(case) if callable(v) else v
    with pytest.raises(exc, match=match):
        public_tree(*(case[k] for k in ORDER), replacement)


@pytest.mark.parametrize("bs, V, clusters, largest, want, threads", [
    (1, 151936, True, 8, 8, 512), (1, 151936, True, 16, 16, 512), (8, 128256, True, 16, 16, 512),
    (9, 128256, True, 16, 8, 512), (16, 151936, True, 16, 8, 512), (1, 32000, True, 16, 4, 512),
    (16, 128256, True, 16, 8, 512), (17, 128256, True, 16, 8, 256), (33, 151936, True, 16, 8, 256),
    (24, 32000, True, 16, 4, 512),
    (34, 151936, True, 16, 8, 256), (66, 32000, True, 16, 8, 256),
    (100, 151936, True, 16, 8, 256), (132, 151936, True, 16, 8, 256), (133, 151936, True, 16, 8, 256),
    (256, 151936, True, 16, 8, 256), (256, 257, True, 16, 1, 512), (4096, 32000, True, 16, 8, 256),
    (64, 151936, False, 16, 1, 512), (1, 6, True, 16, 1, 512)])
def test_launch_plan(bs, V, clusters, largest, want, threads):
    """Clusters up to ``largest`` blocks of 512 threads (16 where the GPU allows non-portable sizes)
    while the grid stays within one block per SM and every warp gets a piece; where that gives a
    request at most 2 blocks (or 4 held there by the one-block-per-SM rule, not by the pieces),
    portable clusters of 8 (or 4) of the 256-thread build, in as many
    waves as the grid needs; one block per request where neither has enough pieces."""
    from cupy_spec import _launch

    dims = tree_mod.OP.Dims(P=bs * 8, bs=bs, S=4, n=8, V=V)
    p = tree_mod.plan(dims, (True,), _launch.DeviceInfo(0, 132, clusters, largest))
    piece_units, pieces = p.fields
    assert p.grid == (bs, want) and p.cluster == want and not p.scratch
    assert p.block == threads and p.kernel == (threads, dict(tree_mod.BUILDS)[threads])
    assert tree_mod.OP.kernel_name((True,), p.kernel) in tree_mod.OP.kernel_names()
    assert pieces <= tree_mod.MAX_PIECES and pieces * piece_units >= V // 4 + 2
    assert p.smem == 8 * pieces + tree_mod.SMEM_PER_NODE * 8


@pytest.mark.parametrize("bs, want, asked", [(16, 8, []), (1, 8, [16])])
def test_launch_record_asks_residency_only_above_the_portable_size(monkeypatch, bs, want, asked):
    """The tree op's plan does not ask for one wave: its portable clusters are kept whatever the
    driver says (a second wave of one cluster costs less than fewer blocks per pass, kernels/NOTES.md
    tree v10), and only a non-portable 16 needs every cluster resident (here none is: it falls back
    to 8). No GPU: loader, capture state and the driver's answer are stubbed."""
    from cupy_spec import _launch

    probed = []

    def clusters_resident(f, plan, stream):
        probed.append(plan.cluster)
        return False

    stub_loader(monkeypatch, clusters=True)
    monkeypatch.setattr(_launch, "_residency", {})
    monkeypatch.setattr(_launch, "_clusters_resident", clusters_resident)
    monkeypatch.setattr(_launch, "_capturing", lambda device, stream: False)
    key = ("test record", "tree residency", bs)
    monkeypatch.setitem(tree_mod.OP.records, key, None)
    dims = tree_mod.OP.Dims(P=bs * 8, bs=bs, S=4, n=8, V=128256)
    rec = _launch._record(tree_mod.OP, key, dims, (True,), 0, 0)
    assert probed == asked and rec[1:4] == (bs, want, 512)  # grid x / y, block


# ---- GPU: kernel vs reference ----------------------------------------------------------------

_GPU_SHAPES = [(bs, n, V) for bs, n, V in itertools.product([1, 3, 17, 64], [1, 2, 8, 64],
                                                           [1, 7, 31, 257, 32000, 151936])
               if bs * n * V <= 2**25]
_KINDS = ["random", "hostile", "star", "degenerate"]


def _to(case, device):
    return {k: v.clone().to(device) for k, v in case.items()}


@gpu
@needs_cuda
@pytest.mark.parametrize("replacement", MODES)
@pytest.mark.parametrize("shape", _GPU_SHAPES, ids=lambda s: "bs%d-n%d-V%d" % s)
def test_kernel_matches_reference(shape, replacement, record_property):
    """Random, hostile, star-shaped (many rejections at one node) and degenerate (all-zero
    residual) cases per shape; outputs poisoned, inputs checked unchanged."""
    bs, n, V = shape
    g = torch.Generator().manual_seed(hash((shape, replacement)) % 2**31)
    ties = cases = 0
    for rep in range(8 if bs * n * V <= 2**22 else 4):
        case = kernel_case(bs, n, V, g, _KINDS[rep % 4], replacement)
        got = _to(case, "cuda")
        public_tree(*(got[k] for k in ORDER), replacement)
        ties += check_tree(case, got, replacement)
        cases += 1
    record_property("cases", cases)
    record_property("ties", ties)
    assert ties <= 1, f"{ties} final-token ties in {cases} cases"  # float64 sums: ties need a coin within an ulp


@gpu
@needs_cuda
@pytest.mark.parametrize("t_off, d_off", [(1, 1), (0, 3), (2, 1), (3, 0)])
def test_kernel_rows_at_any_alignment(t_off, d_off):
    g = torch.Generator().manual_seed(30 + 4 * t_off + d_off)
    for V, replacement in ((257, True), (32000, False)):
        case = kernel_case(5, 8, V, g, "star", replacement)
        got = _to(case, "cuda")
        got["target_probs"] = at_offset(got["target_probs"], t_off)
        got["draft_probs"] = at_offset(got["draft_probs"], d_off)
        public_tree(*(got[k] for k in ORDER), replacement)
        check_tree(case, got, replacement)


@gpu
@needs_cuda
@pytest.mark.parametrize("bs, n, V", [(1, 64, 151936), (3, 16, 32000), (16, 8, 151936), (24, 8, 128256),
                                      (40, 8, 32000), (300, 8, 32000)])
def test_cluster_and_single_block_paths_agree(bs, n, V, monkeypatch):
    """Every block of a cluster walks the tree with the same scales (partial sums added in rank
    order): outputs equal those of one block per request, and the reference."""
    from cupy_spec import _launch

    g = torch.Generator().manual_seed(bs * 5 + n)
    for replacement in (True, False):
        case = kernel_case(bs, n, V, g, "star", replacement)
        outs = []
        try:
            for clusters in (True, False):
                monkeypatch.setattr(_launch, "CLUSTERS", clusters)
                tree_mod.OP.records.clear()
                got = _to(case, "cuda")
                public_tree(*(got[k] for k in ORDER), replacement)
                outs.append(got)
        finally:
            tree_mod.OP.records.clear()
        check_tree(case, outs[0], replacement)
        for k in ORDER[:3]:
            assert torch.equal(outs[0][k], outs[1][k]), k


@gpu
@needs_cuda
def test_kernel_bitwise_repeatable():
    case = kernel_case(17, 64, 32000, torch.Generator().manual_seed(5), "star", True)
    first = _to(case, "cuda")
    public_tree(*(first[k] for k in ORDER), True)
    for _ in range(3):
        again = _to(case, "cuda")
        public_tree(*(again[k] for k in ORDER), True)
        for k in ORDER[:3]:
            assert torch.equal(first[k], again[k]), k


@gpu
@needs_cuda
@pytest.mark.parametrize("V", [257, 151936])
def test_cuda_graph_replay(V):
    g = torch.Generator().manual_seed(7)
    static = _to(kernel_case(4, 8, V, g, "star", False), "cuda")
    graph, _ = captured(lambda: public_tree(*(static[k] for k in ORDER), False))
    for _ in range(3):
        fresh = kernel_case(4, 8, V, g, "star", False)
        for k in ORDER:
            static[k].copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        check_tree(fresh, static, False)


@gpu
@needs_cuda
def test_cupy_inputs_written_in_place():
    cupy = pytest.importorskip("cupy")
    case = kernel_case(5, 8, 300, torch.Generator().manual_seed(8), "random", True)
    arrays = {k: cupy.asarray(v.numpy()) for k, v in case.items()}
    ptrs = {k: a.data.ptr for k, a in arrays.items()}
    with cupy.cuda.Stream(non_blocking=True):
        public_tree(*(arrays[k] for k in ORDER), True)
        cupy.cuda.get_current_stream().synchronize()
    assert all(arrays[k].data.ptr == ptrs[k] for k in arrays)
    check_tree(case, {k: torch.from_numpy(cupy.asnumpy(a)) for k, a in arrays.items()}, True)


@gpu
@needs_cuda
def test_torch_compile_fullgraph_cuda():
    case = kernel_case(3, 8, 33, torch.Generator().manual_seed(9), "random", False)
    got = _to(case, "cuda")

    def f(*args):
        public_tree(*args, False)
        return args[0] + 0

    torch._dynamo.reset()
    torch.compile(f, fullgraph=True)(*(got[k] for k in ORDER))
    check_tree(case, got, False)


# ---- content checks (validate=True) --------------------------------------------------------------


def _checked_case(seed=5, bs=3, n=8, V=9, device="cpu"):
    """Valid inputs: children drawn from their parent's draft row (tokens may repeat)."""
    a = random_case(torch.Generator().manual_seed(seed), bs, n, V, hostile=False)
    return {k: v.to(device) for k, v in a.items()}


def _child_of_root(a) -> int:
    """A child of request 0's root (its first child)."""
    return int(a["retrive_next_token"][0, 0])


def _zero_q_of_child(a, q=0.0):
    """Child c of the root gets probability q (0, or a subnormal, which the op reads as 0) in the
    root's draft row (the row renormalised)."""
    c = _child_of_root(a)
    row = a["draft_probs"][0, 0]
    row[int(a["candidates"][0, c])] = 0.0
    row /= row.sum()
    row[int(a["candidates"][0, c])] = q


_EDITS = {
    "nan target": (lambda a: a["target_probs"][0, 0].__setitem__(0, float("nan")), r"target_probs\[0, 0\].*NaN"),
    "target sum": (lambda a: a["target_probs"][1, 0].mul_(2.0), r"target_probs\[1, 0\].*sums to"),
    "draft sum": (lambda a: a["draft_probs"][0, 0].mul_(3.0), r"draft_probs\[0, 0\].*sums to"),
    "negative draft": (lambda a: a["draft_probs"][0, 0].__setitem__(1, -0.25), r"draft_probs\[0, 0\].*negative"),
    "child not in parent row": (_zero_q_of_child, r"parent node 0.*misaligned"),
    "child subnormal in parent row": (lambda a: _zero_q_of_child(a, 1e-40), r"parent node 0.*misaligned"),
    "coin": (lambda a: a["uniform_samples"][0].__setitem__(_child_of_root(a), 1.0), r"uniform_samples\[0, \d+\]"),
    "final coin": (lambda a: a["uniform_samples_for_final_sampling"].__setitem__(2, -0.5),
                   r"uniform_samples_for_final_sampling\[2\]"),
    "candidate": (lambda a: a["candidates"][0].__setitem__(_child_of_root(a), 9), r"candidates\[0, \d+\]"),
    "link": (lambda a: a["retrive_next_token"][0].__setitem__(0, 8), r"retrive_next_token\[0, 0\]"),
}


def _validated(a, replacement):
    cupy_spec.tree_speculative_sampling(*(a[k] for k in ORDER), replacement, validate=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_content_checks_pass_valid_input_and_run(device):
    a = _checked_case(device=device)
    _validated(a, True)
    assert int(a["accept_token_num"].min()) >= 0 and int(a["predicts"][a["retrive_index"][:, 0]].min()) >= 0


@pytest.mark.parametrize("edit", list(_EDITS))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_content_checks_name_the_problem(edit, device):
    a = _checked_case(device=device)
    fn, match = _EDITS[edit]
    fn(a)
    before = a["predicts"].clone()
    with pytest.raises(ValueError, match=match):
        _validated(a, True)
    assert torch.equal(a["predicts"], before)  # nothing written
    a["accept_token_num"].fill_(POISON)
    cupy_spec.tree_speculative_sampling(*(a[k] for k in ORDER), True)  # without validate: runs, defined output
    assert int(a["accept_token_num"].min()) >= 0


def test_content_checks_see_past_the_root_sibling_link():
    """The root's own sibling link is never followed, also when it points at a node with a parent:
    that parent's draft row is still checked."""
    p, q = [[0.2, 0.5, 0.3]] * 4, [[0.5, 0.3, 0.2]] * 4
    a = make_args([-1, 0, 1, 1], [0, 1, 2, 0], p, q, [0.0, 0.9, 0.9, 0.9], 0.5)
    a["retrive_next_sibling"][0, 0] = 2
    _validated(a, True)
    a["draft_probs"][0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"draft_probs\[0, 1\]"):
        _validated(a, True)


def test_content_checks_repeated_siblings_depend_on_the_mode():
    """Repeats are what i.i.d. children give; without replacement they cannot happen."""
    p, q = [[0.2, 0.5, 0.3]] * 3, [[0.5, 0.3, 0.2]] * 3
    a = make_args([-1, 0, 0], [0, 1, 1], p, q, [0.0, 0.9, 0.9], 0.5)
    _validated(a, True)
    a = make_args([-1, 0, 0], [0, 1, 1], p, q, [0.0, 0.9, 0.9], 0.5)
    with pytest.raises(ValueError, match="replacement=True"):
        _validated(a, False)
