"""``chain_speculative_sampling``: unit tests of the reference and statistical proof of losslessness.

Unit tests pin the semantics stated in :mod:`cupy_spec.reference.chain_speculative_sampling`
(hand-computed cases, coin boundaries, counters added in place, -1 padding, malformed inputs) and
compare the vectorised reference with a per-request transcription of its docstring.

Statistical tests. A toy model pair (:class:`Model`) gives a target row and a draft row for
every prefix of up to ``depth`` tokens over a small vocabulary. Every one of N requests samples its
own k draft tokens from the draft rows (x_i ~ q(. | x_0..x_{i-1})), the rows of its prefixes are
passed to the op with independent coins, and the emitted tokens are compared with exact
probabilities computed from the tables in float64:

(a) the first emitted token is distributed as the target row of the empty prefix;
(b) the first two emitted tokens (t1, t2) are distributed as p(t1) p(t2 | t1); when the op emits
    only t1 (the first draft was rejected), t2 is drawn exactly from p(. | t1), standing for the
    next step of any lossless sampler;
(c) the mean numbers of emitted and of independently passing drafts match their exact values
    (``E[emitted] = sum_i P(x_0..x_{i-1} all pass)`` with ``P(x passes and is drawn) =
    min(p(x), q(x))``), so the op is lossless *and* accepts as often as the rule should;
(d) every emitted position j = 0..k (the bonus token at j = k) follows p(. | its j-token prefix),
    over the prefixes enough requests reach.

(a), (b) and (d) are Pearson chi-square tests and (c) z-tests, each at level ``ALPHA`` (the
machinery of ``test_lossless``). Power: the same statistics on runs that feed the op wrong draft
rows (q ignored: zeros, so every token with p > 0 passes; q tempered: the rows of another
temperature), or a wrong bonus row for (d), must exceed the critical values ``POWER_FACTOR`` times.

The statistical tests call :func:`op`, which is the public ``cupy_spec.chain_speculative_sampling``
once it exists and the reference until then; they are parametrised over :data:`DEVICES` (CUDA
entries are marked ``gpu`` and skip without one).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy_spec
from cupy_spec.reference import COIN_MAX, FLT_MIN, sample_residual
from cupy_spec.reference.chain_speculative_sampling import chain_speculative_sampling as reference_chain
from cupy_spec.reference.tree_speculative_sampling import tree_speculative_sampling as reference_tree
from cupy_spec import tree as spec_tree
from test_lossless import ALPHA, POWER_FACTOR, chi2_isf, chi2_sf, normal_isf_two_sided, pearson

N = 100_000  # requests per statistical run
HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]


def op(*args, **kwargs):
    """The op under test: ``cupy_spec.chain_speculative_sampling`` if the package exports it, else
    the reference (same call: coins as the keyword ``uniform_samples``)."""
    return getattr(cupy_spec, "chain_speculative_sampling", reference_chain)(*args, **kwargs)


def _f32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _run(draft, ids, target, coins, acc=None, emi=None):
    return reference_chain(draft, torch.tensor(ids, dtype=torch.int32) if not torch.is_tensor(ids) else ids,
                           target, acc, emi, uniform_samples=coins)


# --------------------------------------------------------------------------------------------
# Hand-computed cases
# --------------------------------------------------------------------------------------------

# Two drafts over V = 4: x_0 = 2 has p = 0.6 >= q = 0.3 (always passes); x_1 = 1 has p = 0 (never).
DOC_DRAFT = _f32([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]])
DOC_TARGET = _f32([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]])


@pytest.mark.parametrize("coins", [[0.0, 0.0, 0.0], [0.99, 0.5, 0.3], [COIN_MAX, COIN_MAX, COIN_MAX]])
def test_first_accepted_second_rejected_residual_is_one_hot(coins):
    out, acc, emi = _run(DOC_DRAFT, [[2, 1]], DOC_TARGET, _f32([coins]))
    # residual max([1,0,0,0] - [.2,.3,.4,.1], 0) = [.8, 0, 0, 0] -> token 0 whatever the coin
    assert out.tolist() == [[2, 0, -1]]
    assert out.dtype == torch.int32 and acc.dtype == torch.int32 and emi.dtype == torch.int32
    assert acc.tolist() == [1] and emi.tolist() == [1]


def test_accept_boundary_is_strict_and_division_free():
    # p = 0.2, q = 0.4: passes iff u * 0.4 < 0.2 (u * 0.4 is exact for u = 0.5: 0.2f == p)
    draft = _f32([[[0.4, 0.6]]])
    target = _f32([[[0.2, 0.8], [0.5, 0.5]]])
    for u, ok in [(0.0, True), (0.49, True), (0.4999999, True), (0.5, False), (0.7, False)]:
        out, acc, emi = _run(draft, [[0]], target, _f32([[u, 0.25]]))
        assert emi.tolist() == [int(ok)] and acc.tolist() == [int(ok)], u
        # accepted: bonus from [.5, .5] with coin .25 -> 0; rejected: residual [0, .2] -> 1
        assert out.tolist() == ([[0, 0]] if ok else [[1, -1]]), u


def test_residual_inverse_cdf_picks_tokens_by_coin():
    # p - q = [0.4, -0.2, 0.2, -0.4] -> r = [0.4, 0, 0.2, 0], total 0.6
    draft = _f32([[[0.1, 0.3, 0.2, 0.4]]])
    target = _f32([[[0.5, 0.1, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    for coin, token in [(0.0, 0), (0.5, 0), (0.66, 0), (0.7, 2), (COIN_MAX, 2)]:
        out, _, _ = _run(draft, [[3]], target, _f32([[0.3, coin]]))  # x = 3: p = 0 -> rejected
        assert out.tolist() == [[token, -1]], coin


def test_all_accepted_samples_bonus_from_last_target_row():
    draft = _f32([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    target = _f32([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]]])  # p == q: always pass
    out, acc, emi = _run(draft, [[1, 2]], target, _f32([[0.9, COIN_MAX, 0.1]]))
    assert out.tolist() == [[1, 2, 2]] and acc.tolist() == [2] and emi.tolist() == [2]


def test_accepted_counts_positions_passing_independently():
    # position 0 fails (p = 0), positions 1 and 2 pass, position 3 fails
    V = 3
    draft = torch.full((1, 4, V), 1.0 / 3)
    target = torch.full((1, 5, V), 1.0 / 3)
    target[0, 0] = _f32([0.0, 0.5, 0.5])
    target[0, 3] = _f32([0.5, 0.5, 0.0])
    ids = [[0, 1, 2, 2]]
    out, acc, emi = _run(draft, ids, target, _f32([[0.5, 0.5, 0.5, 0.5, 0.0]]))
    assert emi.tolist() == [0] and acc.tolist() == [2]
    assert out[0, 1:].tolist() == [-1, -1, -1, -1]
    # the correction comes from max(p_0 - q_0, 0) = [0, 1/6, 1/6] (coin 0 -> token 1)
    assert out[0, 0].item() == 1


def test_counters_are_added_into_given_tensors_and_returned():
    acc0 = torch.tensor([5, -2], dtype=torch.int32)
    emi0 = torch.tensor([7, 100], dtype=torch.int32)
    draft = DOC_DRAFT.expand(2, 2, 4).contiguous()
    target = DOC_TARGET.expand(2, 3, 4).contiguous()
    out, acc, emi = _run(draft, [[2, 1], [1, 2]], target, torch.zeros(2, 3), acc0, emi0)
    assert acc is acc0 and emi is emi0
    # request 1: x_0 = 1 (p = 0.1 < q = 0.2: passes iff u < 0.5, u = 0 passes); x_1 = 2: p = 0 fails
    assert acc.tolist() == [6, -1] and emi.tolist() == [8, 101]
    out2, acc2, emi2 = _run(draft, [[2, 1], [1, 2]], target, torch.zeros(2, 3))
    assert acc2.tolist() == [1, 1] and emi2.tolist() == [1, 1] and torch.equal(out, out2)


def test_padding_shape_and_inputs_untouched():
    g = torch.Generator().manual_seed(3)
    bs, k, V = 64, 5, 7
    draft = torch.softmax(torch.randn(bs, k, V, generator=g), -1)
    target = torch.softmax(torch.randn(bs, k + 1, V, generator=g), -1)
    ids = torch.randint(0, V, (bs, k), generator=g, dtype=torch.int32)
    coins = torch.rand(bs, k + 1, generator=g)
    before = [t.clone() for t in (draft, target, ids, coins)]
    out, acc, emi = _run(draft, ids, target, coins)
    assert out.shape == (bs, k + 1) and out.dtype == torch.int32
    for b in range(bs):
        e = emi[b].item()
        assert out[b, :e].tolist() == ids[b, :e].tolist()
        assert 0 <= out[b, e].item() < V
        assert (out[b, e + 1:] == -1).all()
        assert acc[b].item() >= e
    for t, t0 in zip((draft, target, ids, coins), before):
        assert torch.equal(t, t0)


def test_zero_drafts_gives_bonus_from_row_zero():
    target = _f32([[[0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0]]])
    out, acc, emi = _run(torch.zeros(2, 0, 3), torch.zeros(2, 0, dtype=torch.int32), target, torch.rand(2, 1))
    assert out.tolist() == [[2], [0]] and acc.tolist() == [0, 0] and emi.tolist() == [0, 0]


def test_empty_batch():
    out, acc, emi = _run(torch.zeros(0, 2, 3), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 3, 3),
                         torch.zeros(0, 3))
    assert out.shape == (0, 3) and acc.shape == (0,) and emi.shape == (0,)


# --------------------------------------------------------------------------------------------
# Edge cases: q(x) = 0, p(x) = 0, all-zero residual, invalid draft ids, garbage values, coins
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("u", [0.0, 0.5, COIN_MAX, 1.0, 7.0, float("nan"), -1.0])
def test_q_zero_passes_iff_p_positive(u):
    draft = _f32([[[0.0, 1.0, 0.0]]])
    target = _f32([[[0.3, 0.7, 0.0], [0.0, 1.0, 0.0]]])
    _, acc, emi = _run(draft, [[0]], target, _f32([[u, 0.5]]))  # q(0) = 0 < p(0)
    assert acc.tolist() == [1] and emi.tolist() == [1]
    out, acc, emi = _run(draft, [[2]], target, _f32([[u, 0.5]]))  # q(2) = 0 = p(2)
    assert acc.tolist() == [0] and emi.tolist() == [0]
    assert out.tolist() == [[0, -1]]  # residual max(p - q, 0) = [.3, 0, 0]


@pytest.mark.parametrize("u", [0.0, 0.3, COIN_MAX])
def test_p_zero_never_passes(u):
    draft = _f32([[[0.9, 0.1]]])
    target = _f32([[[0.0, 1.0], [0.5, 0.5]]])
    out, acc, emi = _run(draft, [[0]], target, _f32([[u, 0.9]]))
    assert acc.tolist() == [0] and emi.tolist() == [0] and out.tolist() == [[1, -1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coin", [1e-39, -1e-39, 1e-45])
def test_subnormal_coin_counts_as_zero(device, coin):
    # u * q = 1e-39 * 1e30 = 1e-9 would reject p = 1e-20; a subnormal coin is 0 and 0 < p accepts
    draft = _f32([[[1e30, 0.0]]]).to(device)
    target = _f32([[[1e-20, 0.0], [0.0, 1.0]]]).to(device)
    ids = torch.tensor([[0]], dtype=torch.int32, device=device)
    out, acc, emi = op(draft, ids, target, uniform_samples=_f32([[coin, 0.5]]).to(device))
    assert out.tolist() == [[0, 1]] and acc.tolist() == [1] and emi.tolist() == [1]


@pytest.mark.parametrize("coin, token", [(0.0, 0), (0.3, 0), (0.6, 1), (COIN_MAX, 1)])
def test_all_zero_residual_falls_back_to_target_row(coin, token):
    # p == q and the drafted token has p = q = 0: rejected, max(p - q, 0) == 0 -> sample from p
    row = _f32([0.5, 0.5, 0.0, 0.0])
    out, acc, emi = _run(row.expand(1, 1, 4).contiguous(), [[3]], row.expand(1, 2, 4).contiguous(),
                         _f32([[0.1, coin]]))
    assert out.tolist() == [[token, -1]] and emi.tolist() == [0]


def test_all_zero_target_row_gives_last_token():
    out, _, _ = _run(torch.zeros(1, 1, 5), [[2]], torch.zeros(1, 2, 5), _f32([[0.1, 0.5]]))
    assert out.tolist() == [[4, -1]]


@pytest.mark.parametrize("bad", [-1, -2**31, 5, 6, 2**31 - 1])
def test_invalid_draft_id_ends_chain_and_samples_target_row(bad):
    # ids outside [0, V) never pass, are never used as an index, and nothing is subtracted
    V = 5
    draft = torch.full((1, 3, V), 0.2)
    target = torch.full((1, 4, V), 0.2)
    target[0, 1] = _f32([0.0, 0.0, 0.0, 1.0, 0.0])
    out, acc, emi = _run(draft, [[1, bad, 2]], target, _f32([[0.0, 0.0, 0.0, 0.99]]))
    assert emi.tolist() == [1] and acc.tolist() == [2]  # position 2 still passes on its own
    assert out.tolist() == [[1, 3, -1, -1]]


def test_int64_ids_beyond_int32_are_invalid():
    out, acc, emi = reference_chain(torch.full((1, 1, 3), 1 / 3), torch.tensor([[2**40]]),
                                    torch.full((1, 2, 3), 1 / 3), uniform_samples=torch.zeros(1, 2))
    assert emi.tolist() == [0] and acc.tolist() == [0] and 0 <= out[0, 0].item() < 3


def test_garbage_probabilities_count_as_zero():
    nan, inf = float("nan"), float("inf")
    # q(0) = NaN -> 0 < p(0): passes. p(1) = inf -> 0: never passes. Residual ignores -inf, NaN, 1e-40.
    draft = _f32([[[nan, 0.5, 0.5, 0.0], [-inf, 0.0, -1.0, 1e-40]]])
    target = _f32([[[0.5, inf, 0.5, 0.0], [1e-40, inf, nan, 0.25], [0.0, 0.0, 0.0, 0.0]]])
    out, acc, emi = _run(draft, [[0, 1]], target, _f32([[COIN_MAX, 0.0, 0.7]]))
    assert emi.tolist() == [1] and acc.tolist() == [1]
    assert out.tolist() == [[0, 3, -1]]  # effective p_1 = [0, 0, 0, .25]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [4, 4096])
@pytest.mark.parametrize("target, draft, coin, token", [
    # E(p) - E(q) = [1e-39, 1.5e-38, 1e-39, -1]: the subnormal differences and the negative one are 0
    ([2.0e-38, 1.5e-38, 1.3e-38, 0.0], [1.9e-38, -1.0, 1.2e-38, 1.0], 0.01, 1),
    # every difference subnormal (1.1e-38 each): the residual is all zero, so the target row is sampled;
    # counted, the two differences would sum to a normal 2.2e-38 and give token 0 at coin 0.35
    ([2.4e-38, 5.0e-38, 0.0, 0.0], [1.3e-38, 3.9e-38, 0.0, 1.0], 0.2, 0),
    ([2.4e-38, 5.0e-38, 0.0, 0.0], [1.3e-38, 3.9e-38, 0.0, 1.0], 0.35, 1),
])
def test_subnormal_residual_counts_as_zero(device, V, target, draft, coin, token):
    # draft token 3 has p = 0 < q: rejected at position 0, the residual's four entries sit at an aligned
    # position (the middle of a long row, or the whole of a short one) among zeros
    base = (V // 2) & ~3
    t = torch.zeros(1, 2, V)
    d = torch.zeros(1, 1, V)
    t[0, 0, base:base + 4], d[0, 0, base:base + 4] = _f32(target), _f32(draft)
    ids = torch.tensor([[base + 3]], dtype=torch.int32)
    coins = _f32([[0.5, coin]])
    want = _run(d, ids, t, coins)
    assert want[0].tolist() == [[base + token, -1]] and want[2].tolist() == [0]
    got = op(d.to(device), ids.to(device), t.to(device), uniform_samples=coins.to(device))
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


def test_coins_are_clamped():
    g = torch.Generator().manual_seed(5)
    bs, k, V = 200, 3, 6
    draft = torch.softmax(2 * torch.randn(bs, k, V, generator=g), -1)
    target = torch.softmax(2 * torch.randn(bs, k + 1, V, generator=g), -1)
    ids = torch.randint(0, V, (bs, k), generator=g, dtype=torch.int32)
    pick = torch.randint(0, 4, (bs, k + 1), generator=g)
    raw = torch.where(pick == 0, float("nan"), torch.where(pick == 1, -3.0, torch.where(pick == 2, 1.0, 9.0)))
    clamped = torch.where(pick <= 1, 0.0, COIN_MAX)
    a = _run(draft, ids, target, raw)
    b = _run(draft, ids, target, clamped)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _spec_chain(draft, ids, target, coins):
    """Per-request transcription of the reference's docstring (float32 scalar arithmetic)."""

    def E(x):
        return torch.where(torch.isfinite(x) & (x >= FLT_MIN), x, torch.zeros_like(x))

    def flush(x):
        return torch.where(x.abs() < FLT_MIN, torch.zeros_like(x), x)

    bs, k, V = draft.shape
    out = torch.full((bs, k + 1), -1, dtype=torch.int32)
    acc = torch.zeros(bs, dtype=torch.int32)
    emi = torch.zeros(bs, dtype=torch.int32)
    u = torch.where(coins >= FLT_MIN, coins.clamp(max=COIN_MAX), torch.zeros_like(coins))
    for b in range(bs):
        passes = []
        for i in range(k):
            x = int(ids[b, i])
            ok = 0 <= x < V and bool(flush(u[b, i] * E(draft[b, i, x])) < E(target[b, i, x]))
            passes.append(ok)
        e = next((i for i, ok in enumerate(passes) if not ok), k)
        acc[b], emi[b] = sum(passes), e
        p = E(target[b, e])
        r = p
        if e < k and 0 <= int(ids[b, e]) < V:
            r = E(p - E(draft[b, e]))
            r = r if bool((r > 0).any()) else p
        out[b, :e] = ids[b, :e].to(torch.int32)
        out[b, e] = int(sample_residual(r[None], u[b, k : k + 1])[0])
    return out, acc, emi


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(0, 5), V=st.integers(1, 9), garbage=st.booleans())
def test_reference_matches_per_request_transcription(seed, k, V, garbage):
    g = torch.Generator().manual_seed(seed)
    bs = 12
    draft = torch.softmax(3 * torch.randn(bs, k, V, generator=g), -1)
    target = torch.softmax(3 * torch.randn(bs, k + 1, V, generator=g), -1)
    if garbage:
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.5, 1e-40, 0.0, 3e38])
        for t in (draft, target):
            mask = torch.rand(t.shape, generator=g) < 0.2
            t[mask] = specials[torch.randint(0, len(specials), (int(mask.sum()),), generator=g)]
    ids = torch.randint(-2, V + 2, (bs, k), generator=g)
    # mostly valid, likely tokens: redraw half of them from the draft rows
    likely = torch.multinomial(torch.nan_to_num(draft.reshape(-1, V), 0.0).clamp(0, 1) + 1e-3, 1,
                               generator=g).reshape(bs, k) if k else ids
    ids = torch.where(torch.rand(bs, k, generator=g) < 0.5, likely, ids).to(torch.int32)
    coins = torch.rand(bs, k + 1, generator=g)
    got = _run(draft, ids, target, coins)
    want = _spec_chain(draft, ids, target, coins)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    out, _, emi = got
    for b in range(bs):
        assert 0 <= out[b, emi[b]].item() < V


def test_chain_equals_tree_op_on_a_chain_tree():
    """The chain is the tree op on a chain (one child per node), in both modes, with the same
    coins: chain coin i is the coin of node i + 1, the final coin is the last one."""
    g = torch.Generator().manual_seed(11)
    bs, k, V = 300, 4, 6
    draft = torch.softmax(2 * torch.randn(bs, k, V, generator=g), -1)
    target = torch.softmax(2 * torch.randn(bs, k + 1, V, generator=g), -1)
    target[target < 0.05] = 0.0
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(bs, k)
    ids[torch.rand(bs, k, generator=g) < 0.05] = V + 1
    ids[torch.rand(bs, k, generator=g) < 0.05] = -1
    coins = torch.rand(bs, k + 1, generator=g)
    out, _, emi = _run(draft, ids.to(torch.int32), target, coins)

    t = spec_tree.chain(bs, k)
    n = k + 1
    for replacement in (True, False):
        predicts = torch.full((bs * n,), -7, dtype=torch.int32)
        accept_index = torch.full((bs, n), -7, dtype=torch.int32)
        accept_num = torch.full((bs,), -7, dtype=torch.int32)
        candidates = torch.cat([torch.zeros(bs, 1, dtype=torch.long), ids], dim=1)
        tree_coins = torch.cat([torch.zeros(bs, 1), coins[:, :k]], dim=1)
        tree_draft = torch.cat([draft, torch.zeros(bs, 1, V)], dim=1)
        reference_tree(predicts, accept_index, accept_num, candidates, t.retrive_index, t.retrive_next_token,
                       t.retrive_next_sibling, tree_coins, coins[:, k].contiguous(), target, tree_draft, replacement)
        assert torch.equal(accept_num, emi)
        for b in range(bs):
            e = emi[b].item()
            assert predicts[accept_index[b, : e + 1].long()].tolist() == out[b, : e + 1].tolist()


# --------------------------------------------------------------------------------------------
# Statistical tests
# --------------------------------------------------------------------------------------------


class Model:
    """Target and draft rows for every prefix of at most ``depth`` tokens over V tokens.

    Prefix codes: ``code(()) = 0``, ``code(prefix + (t,)) = code(prefix) * (V + 1) + t + 1``;
    ``p[code]`` / ``q[code]`` are float32 [V] rows (renormalised in float32), ``p64`` / ``q64``
    their float64 normalisations. Target rows have ``p_zeros`` exact zeros (never the top token);
    draft rows ``q_zeros`` zeros and are a sharpened, noisy copy of the target rows
    (``softmax(sharp * logits + noise * randn)``), so drafts are plausible but biased, and peaked
    enough that i.i.d. siblings repeat tokens.
    """

    def __init__(self, V, depth, seed, *, scale=1.5, sharp=1.6, noise=1.0, p_zeros=1, q_zeros=1):
        self.V, self.depth = V, depth
        M = (V + 1) ** depth
        g = torch.Generator().manual_seed(seed)
        logits = scale * torch.randn(M, V, generator=g, dtype=torch.float64)
        self.p = self._rows(logits, p_zeros, g)
        self.q = self._rows(sharp * logits + noise * torch.randn(M, V, generator=g, dtype=torch.float64), q_zeros, g)
        self.p64 = self.p.double() / self.p.double().sum(1, keepdim=True)
        self.q64 = self.q.double() / self.q.double().sum(1, keepdim=True)

    @staticmethod
    def _rows(logits, zeros, g):
        r = torch.softmax(logits, dim=1)
        M, V = r.shape
        if zeros:
            order = torch.rand(M, V, generator=g).argsort(dim=1)
            kill = order[:, :zeros]
            top = r.argmax(dim=1, keepdim=True)
            kill = torch.where(kill == top, order[:, zeros : zeros + 1].expand_as(kill), kill)
            r = r.scatter(1, kill, 0.0)
        r = r.float()
        return r / r.sum(dim=1, keepdim=True)

    def child(self, code, t):
        """Code of ``prefix + (t,)`` for codes and tokens (tensors or ints)."""
        return code * (self.V + 1) + t + 1

    def joint2(self) -> torch.Tensor:
        """float64 [V * V]: exact P(t1, t2) = p(t1) p(t2 | t1), flattened t1-major."""
        t = torch.arange(self.V)
        return (self.p64[0][:, None] * self.p64[self.child(0, t)]).reshape(-1)


def draw(rows: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One token per row of non-negative weights [m, V] (int64 [m])."""
    return torch.multinomial(rows.double(), 1, generator=g).squeeze(1)


def second_tokens(first, second, has_second, model, g):
    """The second emitted token, or an exact draw from p(. | first) where the op emitted one."""
    fill = draw(model.p64[model.child(0, first)], g)
    return torch.where(has_second, second, fill)


def chain_exact_means(model: Model, k: int) -> tuple[float, float]:
    """Exact E[emitted] and E[accepted] (float64) for k drafts from the empty prefix."""

    @functools.lru_cache(maxsize=None)
    def emitted(code, rem):
        if rem == 0:
            return 0.0
        m = torch.minimum(model.p64[code], model.q64[code])
        return sum(float(m[x]) * (1.0 + emitted(model.child(code, x), rem - 1)) for x in range(model.V) if m[x] > 0)

    @functools.lru_cache(maxsize=None)
    def accepted(code, rem):
        if rem == 0:
            return 0.0
        p, q = model.p64[code], model.q64[code]
        tail = sum(float(q[x]) * accepted(model.child(code, x), rem - 1) for x in range(model.V) if q[x] > 0)
        return float(torch.minimum(p, q).sum()) + tail

    return emitted(0, k), accepted(0, k)


CHAIN_MODEL_SEED = 2024
WRONG_DRAFTS = {
    "q_ignored": lambda q: torch.zeros_like(q),
    "q_tempered": lambda q: (q.double() ** 0.5 / (q.double() ** 0.5).sum(-1, keepdim=True)).float(),
}
# A wrong bonus row: the op handed the row of the last draft's position instead of the row after it
# (what a bonus drawn from the wrong row looks like).
WRONG_TARGETS = {"bonus_row_of_parent": lambda p: torch.cat([p[:, :-1], p[:, -2:-1]], dim=1)}


@functools.lru_cache(maxsize=None)
def run_chain(k: int, device: str, wrong: str | None = None):
    """One call of :func:`op` on N requests with their own drafts; CPU results for analysis."""
    model = Model(6, k + 1, CHAIN_MODEL_SEED + k)
    g = torch.Generator().manual_seed(777 + k)
    V = model.V
    code = torch.zeros(N, dtype=torch.long)
    ids = torch.zeros(N, k, dtype=torch.long)
    draft = torch.zeros(N, k, V)
    target = torch.zeros(N, k + 1, V)
    for i in range(k):
        draft[:, i] = model.q[code]
        target[:, i] = model.p[code]
        ids[:, i] = draw(model.q64[code], g)
        code = model.child(code, ids[:, i])
    target[:, k] = model.p[code]
    if wrong in WRONG_DRAFTS:
        draft = WRONG_DRAFTS[wrong](draft)
    elif wrong is not None:
        target = WRONG_TARGETS[wrong](target).contiguous()
    coins = torch.rand(N, k + 1, generator=g)
    dev = torch.device(device)
    out, acc, emi = op(draft.to(dev), ids.to(torch.int32).to(dev), target.to(dev),
                       uniform_samples=coins.to(dev))
    out, acc, emi = out.cpu().long(), acc.cpu().long(), emi.cpu().long()

    # consistency of the outputs (deterministic checks)
    assert bool(((emi >= 0) & (emi <= k) & (acc >= emi) & (acc <= k)).all())
    col = torch.arange(k + 1)[None, :]
    assert bool((out[col < emi[:, None]] == ids[(col < emi[:, None])[:, :k]]).all()), "emitted != drafts"
    last = out.gather(1, emi[:, None]).squeeze(1)
    assert bool(((last >= 0) & (last < V)).all())
    assert bool((out[col > emi[:, None]] == -1).all()), "no -1 padding"

    t1 = out[:, 0]
    t2 = second_tokens(t1, out[:, min(1, k)], emi >= 1, model, g)
    return {"model": model, "t1": t1, "t2": t2, "acc": acc, "emi": emi, "out": out}


def first_stat(res):
    V = res["model"].V
    return pearson(torch.bincount(res["t1"], minlength=V), res["model"].p64[0], "first token")


def joint_stat(res):
    V = res["model"].V
    pairs = torch.bincount(res["t1"] * V + res["t2"], minlength=V * V)
    return pearson(pairs, res["model"].joint2(), "first two tokens")


def position_stat(res, j: int, min_count: int = 50) -> tuple[float, int]:
    """Pearson chi-square of the j-th emitted token against p(. | the j tokens before it), summed
    over the prefixes that at least ``min_count`` requests emitted (independent statistics, so the
    sum has the summed degrees of freedom). Given its prefix, the token at j is a target sample
    whether it is an accepted draft, a residual sample or the bonus token."""
    model, out, emi = res["model"], res["out"], res["emi"]
    reached = emi >= j
    code = torch.zeros(int(reached.sum()), dtype=torch.long)
    for i in range(j):
        code = model.child(code, out[reached, i])
    tokens = out[reached, j]
    stat, dof = 0.0, 0
    for c in code.unique().tolist():
        mine = tokens[code == c]
        if len(mine) >= min_count:
            s, d = pearson(torch.bincount(mine, minlength=model.V), model.p64[c], f"token {j} after prefix {c}")
            stat, dof = stat + s, dof + d
    return stat, dof


def mean_z(values: torch.Tensor, exact: float) -> float:
    v = values.double()
    sd = v.std().item()
    return (v.mean().item() - exact) / (sd / math.sqrt(len(v))) if sd > 0 else 0.0


def _report(msg):
    print(f"\n    {msg}", end="")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3])
def test_first_token_follows_target(k, device):
    stat, dof = first_stat(run_chain(k, device))
    crit = chi2_isf(ALPHA, dof)
    _report(f"(a) chain k={k}/{device}: chi2={stat:.2f} dof={dof} crit={crit:.2f} p={chi2_sf(stat, dof):.3g}")
    assert dof > 0 and stat < crit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3])
def test_first_two_tokens_follow_target(k, device):
    res = run_chain(k, device)
    stat, dof = joint_stat(res)
    crit = chi2_isf(ALPHA, dof)
    share = (res["emi"] >= 1).double().mean().item()
    _report(f"(b) chain k={k}/{device}: chi2={stat:.2f} dof={dof} crit={crit:.2f} p={chi2_sf(stat, dof):.3g}; "
            f"second token from the op in {share:.1%}")
    assert dof > 0 and stat < crit
    assert share > 0.3, "too few second tokens come from the op to test it"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3])
def test_accept_counts_match_exact_means(k, device):
    res = run_chain(k, device)
    e_exact, a_exact = chain_exact_means(res["model"], k)
    ze, za = mean_z(res["emi"], e_exact), mean_z(res["acc"], a_exact)
    zcrit = normal_isf_two_sided(ALPHA / 2)
    _report(f"(c) chain k={k}/{device}: emitted {res['emi'].double().mean():.4f} vs {e_exact:.4f} (z={ze:+.2f}), "
            f"accepted {res['acc'].double().mean():.4f} vs {a_exact:.4f} (z={za:+.2f}), |z|crit={zcrit:.2f}")
    assert abs(ze) < zcrit and abs(za) < zcrit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3])
def test_every_position_follows_target_given_its_prefix(k, device):
    """(d) Each emitted position j = 0..k (the bonus token at j = k), given the tokens before it, is
    distributed as the target row of that prefix; the k + 1 tests share ALPHA."""
    res = run_chain(k, device)
    for j in range(k + 1):
        stat, dof = position_stat(res, j)
        crit = chi2_isf(ALPHA / (k + 1), dof)
        _report(f"(d) chain k={k}/{device} position {j}: chi2={stat:.2f} dof={dof} crit={crit:.2f} "
                f"p={chi2_sf(stat, dof):.3g}")
        assert dof > 0 and stat < crit, f"position {j}"


def test_wrong_bonus_row_is_detected():
    """Power of (d) at the bonus position, which (a) and (b) do not reach for k >= 2."""
    res = run_chain(3, "cpu", "bonus_row_of_parent")
    try:
        stat, dof = position_stat(res, 3)
    except AssertionError:  # a token the target row gives probability 0: detected outright
        return
    ratio = stat / chi2_isf(ALPHA / 4, dof)
    _report(f"power chain bonus_row_of_parent: (d) position 3 chi2/crit={ratio:.0f}")
    assert ratio > POWER_FACTOR


@pytest.mark.parametrize("wrong", list(WRONG_DRAFTS))
def test_wrong_draft_rows_are_detected(wrong):
    res = run_chain(3, "cpu", wrong)
    s1, d1 = first_stat(res)
    s2, d2 = joint_stat(res)
    r1, r2 = s1 / chi2_isf(ALPHA, d1), s2 / chi2_isf(ALPHA, d2)
    _report(f"power chain {wrong}: (a) chi2/crit={r1:.0f} (b) chi2/crit={r2:.0f}")
    assert r1 > POWER_FACTOR and r2 > POWER_FACTOR


# --------------------------------------------------------------------------------------------
# The public op: signature, argument checks, CPU backend, and (on a GPU) kernel vs reference
# --------------------------------------------------------------------------------------------

import importlib  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402

from cases import POISON, at_offset, captured, random_rows, stub_loader  # noqa: E402

chain_mod = importlib.import_module("cupy_spec.chain_speculative_sampling")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
public_chain = cupy_spec.chain_speculative_sampling


def chain_case(bs, k, V, g, style="peaked", hostile=False, degenerate=False, ids_dtype=torch.int32):
    """Random op inputs (CPU): drafts drawn from their draft rows; ``hostile``: garbage
    probabilities, ids outside [0, V), coins outside [0, 1) and NaN; ``degenerate``: target rows
    equal to the draft rows and drafts of probability 0 (all-zero residuals)."""
    draft = random_rows(bs, k, V, g, "sparse" if degenerate else "peaked" if style != "onehot" else "onehot")
    target = random_rows(bs, k + 1, V, g, style)
    ids = (torch.multinomial(draft.reshape(-1, V) + 1e-30, 1, generator=g).reshape(bs, k) if k and V
           else torch.zeros(bs, k, dtype=torch.long))
    coins = torch.rand(bs, k + 1, generator=g)
    if degenerate and k:
        target[:, :k] = draft
        zero = draft.reshape(-1, V) == 0
        if bool(zero.any()):
            pick = torch.multinomial(zero.double() + 1e-300, 1, generator=g).reshape(bs, k)
            ids = torch.where(torch.rand(bs, k, generator=g) < 0.5, pick, ids)
    if hostile:
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.5, 1e-40, 0.0, 3e38])
        for t in (draft, target):
            m = torch.rand(t.shape, generator=g) < 0.05
            t[m] = specials[torch.randint(0, len(specials), (int(m.sum()),), generator=g)]
        m = torch.rand(bs, k, generator=g) < 0.1
        ids = torch.where(m, torch.randint(-3, V + 3, (bs, k), generator=g), ids)
        coins[torch.rand(bs, k + 1, generator=g) < 0.05] = float("nan")
        coins[torch.rand(bs, k + 1, generator=g) < 0.05] = 1.0
        coins[torch.rand(bs, k + 1, generator=g) < 0.05] = -2.0
    return dict(draft=draft, ids=ids.to(ids_dtype), target=target, coins=coins)


def check_chain(case, got, acc0=None, emi0=None, slack_tol=2e-6) -> int:
    """Asserts the op's outputs ``got`` (out, accepted, emitted; any device) match the reference
    exactly, except final tokens at float32 rounding ties of the prefix sums. Returns the tie count."""
    from cupy_spec.reference import final_token_slack

    acc0 = None if acc0 is None else acc0.cpu().clone()
    emi0 = None if emi0 is None else emi0.cpu().clone()
    ref_out, ref_acc, ref_emi, r, coin = reference_chain(case["draft"], case["ids"], case["target"], acc0, emi0,
                                                         uniform_samples=case["coins"], return_residual=True)
    out, acc, emi = (torch.as_tensor(x).cpu() for x in got)
    assert torch.equal(acc, ref_acc), "accepted differs"
    assert torch.equal(emi, ref_emi), "emitted differs"
    bs, k1 = ref_out.shape
    e = (ref_emi - (0 if emi0 is None else emi0)).long()
    final = torch.arange(k1)[None, :] == e[:, None]
    assert torch.equal(out[~final], ref_out[~final]), "output_token_ids differ off the final tokens"
    gk, rk = out[final], ref_out[final]
    differ = gk != rk
    if not differ.any():
        return 0
    rows = torch.arange(bs)[differ]
    slack = final_token_slack(r[rows], coin[rows], gk[differ])
    bad = ~(slack <= slack_tol)
    assert not bad.any(), (f"final tokens differ beyond rounding ties: requests {rows[bad].tolist()}, kernel "
                           f"{gk[differ][bad].tolist()}, reference {rk[differ][bad].tolist()}, slack {slack[bad].tolist()}")
    return int(differ.sum())


def test_public_signature_matches_flashinfer():
    params = inspect.signature(public_chain).parameters
    names = [p.name for p in params.values() if p.kind is not p.KEYWORD_ONLY]
    assert names == ["draft_probs", "draft_token_ids", "target_probs", "maybe_output_accepted_token_num",
                     "maybe_output_emitted_draft_token_num", "deterministic", "generator", "seed", "offset"]
    assert [params[n].default for n in names[3:]] == [None, None, True, None, None, None]
    assert params["uniform_samples"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "mutated" in public_chain.__doc__ and "uniform_samples" in public_chain.__doc__


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows_are_refused_with_the_cast_to_make(dtype):
    """FlashInfer casts such rows to float32 itself; here no copy is made behind the caller's back."""
    ids = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"draft_probs must have dtype float32.*pass draft_probs.to\(torch.float32\)"):
        public_chain(torch.rand(1, 2, 4).to(dtype), ids, torch.rand(1, 3, 4))
    with pytest.raises(TypeError, match=r"target_probs must have dtype float32.*no cast is made"):
        public_chain(torch.rand(1, 2, 4), ids, torch.rand(1, 3, 4).to(dtype))


def test_core_custom_op_declares_mutations():
    schema = torch.ops.cupy_spec.chain_speculative_sampling.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["output_token_ids", "output_accepted_token_num", "output_emitted_draft_token_num"]


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_cpu_public_op_is_the_reference(ids_dtype):
    case = chain_case(9, 4, 13, torch.Generator().manual_seed(1), hostile=True, ids_dtype=ids_dtype)
    acc0 = torch.arange(9, dtype=torch.int32)
    emi0 = torch.full((9,), 3, dtype=torch.int32)
    acc, emi = acc0.clone(), emi0.clone()
    got = public_chain(case["draft"], case["ids"], case["target"], acc, emi, uniform_samples=case["coins"])
    assert got[1] is acc and got[2] is emi
    assert check_chain(case, got, acc0, emi0) == 0


def test_cpu_generator_draws_the_coins():
    case = chain_case(6, 3, 9, torch.Generator().manual_seed(2))
    got = public_chain(case["draft"], case["ids"], case["target"], generator=torch.Generator().manual_seed(7))
    coins = torch.rand(6, 4, generator=torch.Generator().manual_seed(7))
    want = reference_chain(case["draft"], case["ids"], case["target"], uniform_samples=coins)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_numpy_inputs_give_numpy_outputs():
    np = pytest.importorskip("numpy")
    case = chain_case(4, 2, 6, torch.Generator().manual_seed(3))
    acc = np.zeros(4, dtype=np.int32)
    got = public_chain(case["draft"].numpy(), case["ids"].numpy(), case["target"].numpy(), acc,
                       uniform_samples=case["coins"].numpy())
    assert isinstance(got[0], np.ndarray) and got[1] is acc and isinstance(got[2], np.ndarray)
    check_chain(case, tuple(torch.from_numpy(x) for x in got))
    acc.flags.writeable = False  # a counter the op would write into
    with pytest.raises(TypeError, match="^maybe_output_accepted_token_num is written by .* read-only"):
        public_chain(case["draft"].numpy(), case["ids"].numpy(), case["target"].numpy(), acc,
                     uniform_samples=case["coins"].numpy())
    assert (acc == got[1]).all()


@pytest.mark.parametrize("bad, match, exc", [
    (dict(ids=lambda c: c["ids"].float()), "draft_token_ids", TypeError),
    (dict(draft=lambda c: c["draft"].double()), "draft_probs", TypeError),
    (dict(target=lambda c: c["target"][:, :-1].contiguous()), "target_probs", ValueError),
    (dict(draft=lambda c: c["draft"][..., :-1].contiguous()), "draft_probs", ValueError),
    (dict(coins=lambda c: c["coins"][:, :-1].contiguous()), "uniform_samples", ValueError),
    (dict(target=lambda c: c["target"].transpose(0, 1).contiguous().transpose(0, 1)), "target_probs must be contiguous",
     ValueError),
    (dict(ids=lambda c: c["ids"].tolist()), "draft_token_ids", TypeError),
])
def test_argument_errors_name_the_argument(bad, match, exc):
    case = chain_case(3, 2, 5, torch.Generator().manual_seed(4))
    for key, f in bad.items():
        case[key] = f(case)
    with pytest.raises(exc, match=match):
        public_chain(case["draft"], case["ids"], case["target"], uniform_samples=case["coins"])


def test_counter_dtype_and_deterministic_type_checked():
    case = chain_case(3, 2, 5, torch.Generator().manual_seed(5))
    args = (case["draft"], case["ids"], case["target"])
    # the errors name the counters as the signature does (maybe_output_*)
    with pytest.raises(TypeError, match="^maybe_output_accepted_token_num must have dtype int32"):
        public_chain(*args, torch.zeros(3, dtype=torch.int64), uniform_samples=case["coins"])
    with pytest.raises(ValueError, match="^maybe_output_emitted_draft_token_num must have shape"):
        public_chain(*args, None, torch.zeros(4, dtype=torch.int32), uniform_samples=case["coins"])
    with pytest.raises(ValueError, match="^maybe_output_accepted_token_num must be contiguous"):
        public_chain(*args, torch.zeros(3, 2, dtype=torch.int32)[:, 0], uniform_samples=case["coins"])
    with pytest.raises(TypeError, match="deterministic"):
        public_chain(*args, deterministic=1, uniform_samples=case["coins"])


def test_torch_compile_fullgraph_cpu():
    case = chain_case(4, 3, 7, torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    f = torch.compile(lambda d, i, t, c: public_chain(d, i, t, uniform_samples=c), fullgraph=True)
    got = f(case["draft"], case["ids"], case["target"], case["coins"])
    check_chain(case, got)


@pytest.mark.parametrize("ids_shape, match", [
    ((2, 2), r"draft_token_ids must have shape \[bs=3, k=2\], got \(2, 2\): bs is 3 in draft_probs, target_probs$"),
    ((3, 1), r"draft_token_ids must have shape \[bs=3, k=2\], got \(3, 1\): k is 2 in draft_probs$"),
    ((3, 3), r"draft_token_ids must have shape \[bs=3, k=2\], got \(3, 3\): k is 2 in draft_probs$"),
])
def test_odd_draft_token_ids_shape_is_blamed(ids_shape, match):
    """The outputs and coins allocated from draft_token_ids' shape do not outvote the caller's arrays."""
    with pytest.raises(ValueError, match=match):
        public_chain(torch.rand(3, 2, 8), torch.zeros(ids_shape, dtype=torch.int64), torch.rand(3, 3, 8))


@pytest.mark.parametrize("coins", [{}, {"seed": 1, "offset": 0}])
def test_target_rows_not_k_plus_one_are_blamed_on_target_probs(coins):
    """Not on the token output or coins allocated here from draft_token_ids' k."""
    with pytest.raises(ValueError, match=r"^target_probs must have one row more than the k=3 drafts \(k \+ 1 rows\), "
                                         r"got target_probs \(2, 5, 5\) and draft_probs \(2, 3, 5\)$"):
        public_chain(torch.rand(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64), torch.rand(2, 5, 5), **coins)


@pytest.mark.parametrize("args, match", [
    ((torch.rand(2, 5), torch.zeros(2, 5, dtype=torch.int64), torch.rand(2, 6, 8)),
     r"draft_probs must have shape \[bs, k, V\] \(3-D\), got \(2, 5\)"),
    ((torch.rand(2, 5, 8), torch.zeros(2, 5, dtype=torch.int64), torch.rand(2, 6, 8), {"uniform_samples": torch.rand(6)}),
     r"uniform_samples must have shape \[bs, k1\] \(2-D\)"),
])
def test_a_wrong_rank_is_named_as_such(args, match):
    kw = args[3] if len(args) > 3 else {}
    with pytest.raises(ValueError, match=match):
        public_chain(*args[:3], **kw)


def test_numpy_bools_for_the_flags():
    np = pytest.importorskip("numpy")
    case = chain_case(4, 3, 7, torch.Generator().manual_seed(6))
    got = public_chain(case["draft"], case["ids"], case["target"], None, None, np.bool_(True),
                       uniform_samples=case["coins"], validate=np.bool_(True))
    check_chain(case, got)


def test_validate_runs_inside_torch_compile():
    case = chain_case(4, 3, 7, torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    f = torch.compile(lambda d, i, t, c: public_chain(d, i, t, uniform_samples=c, validate=True), fullgraph=True,
                      backend="aot_eager")
    check_chain(case, f(case["draft"], case["ids"], case["target"], case["coins"]))
    with pytest.raises(ValueError, match=r"target_probs\[1, 0\].*sums to"):
        f(case["draft"], case["ids"], case["target"] * torch.tensor([1.0, 2.0, 1.0, 1.0])[:, None, None],
          case["coins"])


# the variant of a call with explicit coins: int32 draft ids, uniform_samples given, no seed or offset, not seeded
_COINS_GIVEN = (torch.int32, True, False, False, False)


_ONE, _TWO = chain_mod.ONE_BLOCK, chain_mod.TWO_BLOCKS


@pytest.mark.parametrize("bs, V, clusters, largest, want, build", [
    (1, 151936, True, 8, 7, _ONE), (1, 32000, True, 8, 4, _ONE), (16, 151936, True, 8, 7, _ONE),
    (17, 128256, True, 8, 6, _ONE), (24, 128256, True, 8, 4, _ONE), (32, 128256, True, 3, 3, _ONE),
    (32, 32000, True, 3, 2, _ONE), (64, 151936, True, 8, 2, _ONE), (132, 151936, True, 8, 1, _ONE),
    (133, 151936, True, 8, 1, _TWO), (256, 7, False, 8, 1, _TWO), (1, 151936, False, 8, 1, _ONE),
    (1, 7, True, 8, 1, _ONE), (1, 151936, True, 16, 10, _ONE), (8, 128256, True, 16, 16, _ONE),
    (8, 128256, True, 15, 8, _ONE), (9, 128256, True, 16, 8, _ONE), (1, 32000, True, 16, 4, _ONE),
    (1, 120000, True, 16, 15, _ONE), (1, 151936, False, 16, 1, _ONE),
    # batches of 34-131 requests: the two-blocks build where it at least doubles a request's blocks
    (34, 128256, True, 16, 3, _ONE), (44, 151936, True, 16, 3, _ONE), (48, 128256, True, 16, 4, _TWO),
    (49, 151936, True, 16, 4, _TWO), (48, 128256, True, 2, 2, _ONE), (50, 128256, True, 16, 4, _TWO),
    (67, 128256, True, 16, 3, _TWO), (77, 151936, True, 8, 3, _TWO), (88, 151936, True, 8, 2, _TWO),
    (84, 128256, True, 2, 2, _TWO), (98, 65536, True, 8, 2, _TWO), (115, 128256, True, 8, 2, _TWO),
    (116, 128256, True, 8, 1, _ONE), (72, 32000, True, 16, 1, _ONE), (72, 128256, False, 16, 1, _ONE)])
def test_launch_plan(bs, V, clusters, largest, want, build):
    """One block of 512 threads per request, or a cluster of C blocks (up to the device's largest)
    while the grid stays within one block per SM (here 132 SMs) and every block gets a piece: the
    smallest C whose warps sum the row's pieces in as few trips as the largest such C; the piece sums
    fit the shared memory. Batches of 34-131 requests (here) where that gives a request at most 2
    blocks and the row has at least 128 pieces: the build of 384 threads for two resident blocks per
    SM, with the same rule for grids of at most 231 blocks (7/8 of two per SM), if that at least
    doubles the clusters. More requests than SMs: that build, one block per request."""
    from cupy_spec import _launch

    dims = chain_mod.OP.Dims(bs=bs, k=3, V=V, k1=4, ns=-1, no=-1)
    p = chain_mod.plan(dims, _COINS_GIVEN, _launch.DeviceInfo(0, 132, clusters, largest))
    piece_units, pieces = p.fields
    assert p.grid == (bs, want) and p.cluster == want and not p.scratch and p.kernel == build
    assert p.block == build[0] and p.one_wave and bs * want <= max(132 if build == _ONE else 231, bs)
    trips = lambda c: -(-pieces // (build[0] // 32 * c))  # noqa: E731
    assert want == 1 or trips(want - 1) > trips(want)
    assert chain_mod.OP.kernel_name(_COINS_GIVEN, p.kernel) in chain_mod.OP.kernel_names()
    assert pieces <= chain_mod.MAX_PIECES and pieces * piece_units >= V // 4 + 2
    assert piece_units % (32 * chain_mod.BATCHES) == 0 and p.smem == 8 * pieces


@pytest.mark.parametrize("bs, V, refused, want, build", [
    (56, 151936, {(_TWO, 4)}, 2, _ONE), (40, 128256, {(_ONE, 3)}, 5, _TWO), (44, 151936, {(_ONE, 3)}, 5, _TWO),
    (44, 151936, {(_ONE, 3), (_TWO, 5)}, 4, _TWO), (40, 128256, {(_ONE, 3), (_TWO, 4)}, 2, _ONE),
    (72, 128256, {(_TWO, 3)}, 2, _TWO), (72, 128256, {(_TWO, 2)}, 1, _ONE), (8, 128256, {(_ONE, 16)}, 8, _ONE)])
def test_launch_plan_after_refusals(bs, V, refused, want, build):
    """Sizes the launch record found not all resident (per build) are not planned again, nor larger
    ones of that build: the plan takes a smaller size or the other build."""
    from cupy_spec import _launch

    dims = chain_mod.OP.Dims(bs=bs, k=3, V=V, k1=4, ns=-1, no=-1)
    p = chain_mod.plan(dims, _COINS_GIVEN, _launch.DeviceInfo(0, 132, True, 16, frozenset(refused)))
    assert (p.cluster, p.kernel) == (want, build) and p.grid == (bs, want)


@pytest.mark.parametrize("bs, ids_dtype, seeded, want", [
    (8, torch.int32, False, "int, 512, 1"), (133, torch.int32, False, "int, 384, 2"),
    (133, torch.int64, False, "long long, 384, 2"), (8, torch.int64, True, "long long, 512, 1, true"),
    (133, torch.int32, True, "int, 384, 2, true")])
def test_launch_record_loads_the_planned_build(monkeypatch, bs, ids_dtype, seeded, want):
    """The launch record holds the kernel build the plan picked, with the coins drawn in the kernel
    from seed and offset where no uniform_samples are given (no GPU: the loader is stubbed)."""
    from cupy_spec import _launch

    loaded = stub_loader(monkeypatch, clusters=False)
    key = ("test record", bs, ids_dtype, seeded)
    monkeypatch.setitem(chain_mod.OP.records, key, None)
    dims = chain_mod.OP.Dims(bs=bs, k=3, V=1000, k1=4, ns=1 if seeded else -1, no=bs if seeded else -1)
    variant = (ids_dtype, not seeded, seeded, seeded, seeded)
    rec = _launch._record(chain_mod.OP, key, dims, variant, 0, 0)
    assert loaded == [f"cupy_spec::chain_speculative_sampling_kernel<{want}>"]
    assert loaded[0] in chain_mod.OP.kernel_names()
    pieces = chain_mod.plan(dims, variant, _launch.device_info(0)).fields[1]
    block = 512 if bs <= 132 else 384
    assert rec[:5] == (1, bs, 1, block, 8 * pieces)  # kernel, grid x / y, block, shared memory


@pytest.mark.parametrize("resident_up_to, capturing, want, probed", [
    (16, False, 10, [10]), (8, False, 7, [10, 7]), (4, False, 4, [10, 7, 5, 4]),
    (1, False, 1, [10, 7, 5, 4, 3, 2]), (16, True, 7, []), (1, True, 7, []), (None, False, 7, [10, 7])])
def test_launch_record_keeps_clusters_only_where_all_are_resident(monkeypatch, resident_up_to, capturing, want,
                                                                  probed):
    """The chain op's clusters are kept only where the driver reports every cluster of the grid
    resident at once, else the record plans again with smaller ones; the driver is never asked
    while the stream captures a graph, where sizes up to the portable 8 are kept, as where the driver
    cannot tell (no GPU: loader, capture state and probe stubbed; here sizes up to ``resident_up_to``
    are resident, None: the driver cannot tell)."""
    from cupy_spec import _launch

    asked = []

    def clusters_resident(f, plan, stream):
        asked.append(plan.cluster)
        return None if resident_up_to is None else plan.cluster <= resident_up_to

    stub_loader(monkeypatch, clusters=True)
    monkeypatch.setattr(_launch, "_residency", {})
    monkeypatch.setattr(_launch, "_clusters_resident", clusters_resident)
    monkeypatch.setattr(_launch, "_capturing", lambda device, stream: capturing)
    key = ("test record", "resident clusters", resident_up_to, capturing)
    monkeypatch.setitem(chain_mod.OP.records, key, None)
    dims = chain_mod.OP.Dims(bs=2, k=3, V=151936, k1=4, ns=-1, no=-1)
    rec = _launch._record(chain_mod.OP, key, dims, _COINS_GIVEN, 0, 0)
    assert asked == probed and rec[1:3] == (2, want) and (rec[5] != 0) == (want > 1)  # grid x / y, config
    assert _launch.launch_features(rec) == (want, False)


@pytest.mark.parametrize("bs, cluster", [(2, 10), (200, 1)])
def test_launch_record_asks_for_dependent_launch_where_the_device_has_it(monkeypatch, bs, cluster):
    """With programmatic dependent launch every launch goes through a config that carries it, with
    or without clusters (no GPU: loader stubbed, every cluster resident)."""
    from cupy_spec import _launch

    stub_loader(monkeypatch, clusters=True, dependent=True)
    monkeypatch.setattr(_launch, "_residency", {})
    monkeypatch.setattr(_launch, "_clusters_resident", lambda f, plan, stream: True)
    monkeypatch.setattr(_launch, "_capturing", lambda device, stream: False)
    key = ("test record", "dependent launch", bs)
    monkeypatch.setitem(chain_mod.OP.records, key, None)
    dims = chain_mod.OP.Dims(bs=bs, k=3, V=151936, k1=4, ns=-1, no=-1)
    rec = _launch._record(chain_mod.OP, key, dims, _COINS_GIVEN, 0, 0)
    assert rec[5] != 0 and rec[2] == cluster and _launch.launch_features(rec) == (cluster, True)
    monkeypatch.setattr(_launch, "PDL", False)
    monkeypatch.setitem(chain_mod.OP.records, key, None)
    rec = _launch._record(chain_mod.OP, key, dims, _COINS_GIVEN, 0, 0)
    assert _launch.launch_features(rec) == (cluster, False) and (rec[5] != 0) == (cluster > 1)


def test_launch_record_takes_the_other_build_after_refusals(monkeypatch):
    """bs = 44 at V = 151936: one block per SM plans clusters of 3, which this driver refuses (the H100
    and H200 measured hold 39 such clusters); planned again, the two-blocks build in clusters of 5,
    refused here too (sizes from 5 up), then of 4, kept, and that build loaded (no GPU: loader and
    probe stubbed)."""
    from cupy_spec import _launch

    asked, loaded = [], stub_loader(monkeypatch, clusters=True)

    def clusters_resident(f, plan, stream):
        asked.append((plan.kernel, plan.cluster))
        return plan.cluster < (3 if plan.kernel == _ONE else 5)

    monkeypatch.setattr(_launch, "_residency", {})
    monkeypatch.setattr(_launch, "_clusters_resident", clusters_resident)
    monkeypatch.setattr(_launch, "_capturing", lambda device, stream: False)
    key = ("test record", "other build")
    monkeypatch.setitem(chain_mod.OP.records, key, None)
    dims = chain_mod.OP.Dims(bs=44, k=3, V=151936, k1=4, ns=-1, no=-1)
    rec = _launch._record(chain_mod.OP, key, dims, _COINS_GIVEN, 0, 0)
    assert asked == [(_ONE, 3), (_TWO, 5), (_TWO, 4)] and rec[1:3] == (44, 4)
    assert loaded[-1] == "cupy_spec::chain_speculative_sampling_kernel<int, 384, 2>"


@pytest.mark.parametrize("resident", [True, False])
def test_a_capture_reuses_the_residency_answer_of_another_stream(monkeypatch, resident):
    """A record first made on a capturing stream takes the driver's answers given earlier for the
    same kernel and launch shapes on another stream (as a graph captured after a warm-up call on a
    side stream does), without asking the driver again."""
    from cupy_spec import _launch

    probed, capturing = [], {}

    def clusters_resident(f, plan, stream):
        probed.append(stream)
        return resident

    stub_loader(monkeypatch, clusters=True)
    monkeypatch.setattr(_launch, "_residency", {})
    monkeypatch.setattr(_launch, "_clusters_resident", clusters_resident)
    monkeypatch.setattr(_launch, "_capturing", lambda device, stream: capturing.get(stream, False))
    dims = chain_mod.OP.Dims(bs=2, k=3, V=151936, k1=4, ns=-1, no=-1)
    grids = []
    for stream in (11, 22):  # a warm-up stream, then a stream that captures
        capturing[stream] = stream == 22
        key = ("test record", "reused residency", resident, stream)
        monkeypatch.setitem(chain_mod.OP.records, key, None)
        grids.append(_launch._record(chain_mod.OP, key, dims, _COINS_GIVEN, 0, stream)[1:3])
    assert set(probed) == {11} and len(probed) == (1 if resident else 6)
    assert grids == [(2, 10 if resident else 1)] * 2


def test_a_plan_that_ignores_the_largest_cluster_is_refused(monkeypatch):
    """The record plans again, told the refused build and size; a plan that gives them again would loop."""
    from cupy_spec import _launch

    stub_loader(monkeypatch, clusters=True)
    monkeypatch.setattr(_launch, "_residency", {})
    monkeypatch.setattr(_launch, "_clusters_resident", lambda f, plan, stream: False)
    monkeypatch.setattr(_launch, "_capturing", lambda device, stream: False)
    monkeypatch.setattr(chain_mod.OP, "plan", lambda dims, variant, dev: chain_mod.Launch((2, 4), 512, 8, 4, (128, 1),
                                                                                         kernel=_ONE, one_wave=True))
    key = ("test record", "stubborn plan")
    monkeypatch.setitem(chain_mod.OP.records, key, None)
    dims = chain_mod.OP.Dims(bs=2, k=3, V=151936, k1=4, ns=-1, no=-1)
    with pytest.raises(RuntimeError, match="refused"):
        _launch._record(chain_mod.OP, key, dims, _COINS_GIVEN, 0, 0)


# ---- GPU: kernel vs reference ----------------------------------------------------------------

_GPU_SHAPES = [(bs, k, V) for bs, k, V in itertools.product([1, 3, 17, 64, 200], [0, 1, 4, 8],
                                                           [1, 7, 257, 32000, 151936])
               if bs * (k + 1) * V <= 2**25]
_GPU_SHAPES += [(48, 1, 151936), (72, 1, 151936), (72, 2, 65536)]  # the two-blocks build in clusters (132 SMs)
_STYLES = ["peaked", "flat", "sparse", "onehot"]


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", _GPU_SHAPES, ids=lambda s: "bs%d-k%d-V%d" % s)
def test_kernel_matches_reference(shape, record_property):
    """Random cases per shape: row styles, hostile values, degenerate residuals, int32 / int64
    ids, counters given (added into) or not; outputs poisoned through the in-place core."""
    bs, k, V = shape
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    ties = cases = 0
    for rep in range(12 if bs * (k + 1) * V <= 2**22 else 4):
        case = chain_case(bs, k, V, g, style=_STYLES[rep % 4], hostile=rep % 3 == 1, degenerate=rep % 3 == 2,
                          ids_dtype=torch.int64 if rep % 2 else torch.int32)
        dev = {key: v.cuda() for key, v in case.items()}
        if rep % 2:
            acc0 = torch.randint(-5, 5, (bs,), generator=g, dtype=torch.int32)
            emi0 = torch.randint(-5, 5, (bs,), generator=g, dtype=torch.int32)
            out = torch.full((bs, k + 1), POISON, dtype=torch.int32, device="cuda")
            acc, emi = acc0.cuda(), emi0.cuda()
            chain_mod._core(dev["draft"], dev["ids"], dev["target"], dev["coins"], out, acc, emi)
            got = (out, acc, emi)
        else:
            acc0 = emi0 = None
            got = public_chain(dev["draft"], dev["ids"], dev["target"], uniform_samples=dev["coins"])
        ties += check_chain(case, got, acc0, emi0)
        for key in case:  # inputs are never written
            assert torch.equal(dev[key].cpu().view(torch.int32) if dev[key].is_floating_point() else dev[key].cpu(),
                               case[key].view(torch.int32) if case[key].is_floating_point() else case[key]), key
        cases += 1
    record_property("cases", cases)
    record_property("ties", ties)
    # float64 prefix sums: a tie needs the coin within an ulp of a boundary, so any tie is suspicious
    assert ties <= 1, f"{ties} final-token ties in {cases} cases"


@gpu
@needs_cuda
@pytest.mark.parametrize("t_off, d_off", [(1, 1), (0, 3), (2, 1), (3, 0)])
def test_kernel_rows_at_any_alignment(t_off, d_off):
    g = torch.Generator().manual_seed(20 + 4 * t_off + d_off)
    for V in (257, 32000):
        case = chain_case(5, 3, V, g, style="flat")
        dev = {key: v.cuda() for key, v in case.items()}
        dev["target"] = at_offset(dev["target"], t_off)
        dev["draft"] = at_offset(dev["draft"], d_off)
        check_chain(case, public_chain(dev["draft"], dev["ids"], dev["target"], uniform_samples=dev["coins"]))


@gpu
@needs_cuda
@pytest.mark.parametrize("bs, V", [(1, 32000), (1, 151936), (16, 151936), (64, 32000)])
def test_cluster_and_single_block_paths_agree(bs, V, monkeypatch):
    """A request split over a thread-block cluster (sm_90 and later; at bs=1 V=151936 a
    non-portable cluster of 16 blocks) and done by one block give bitwise equal outputs (float64
    sums), both matching the reference."""
    from cupy_spec import _launch

    case = chain_case(bs, 4, V, torch.Generator().manual_seed(bs + V))
    dev = {key: v.cuda() for key, v in case.items()}
    outs, blocks = [], []
    try:
        for clusters in (True, False):
            monkeypatch.setattr(_launch, "CLUSTERS", clusters)
            chain_mod.OP.records.clear()
            outs.append(public_chain(dev["draft"], dev["ids"], dev["target"], uniform_samples=dev["coins"]))
            blocks.append({rec[2] for rec in chain_mod.OP.records.values()})  # grid y: blocks per request
    finally:
        chain_mod.OP.records.clear()
    if torch.cuda.get_device_capability()[0] >= 9:  # clusters (their size depends on the GPU's residency)
        assert min(blocks[0]) > 1 and blocks[1] == {1}, blocks
    check_chain(case, outs[0])
    for x, y in zip(*outs):
        assert torch.equal(x, y)


@gpu
@needs_cuda
@pytest.mark.parametrize("build", chain_mod.BUILDS)
def test_every_cluster_size_gives_the_single_block_outputs(monkeypatch, build):
    """Clusters of every size from 2 to 16 blocks, not only powers of two (the plan picks any size),
    of either build (512 threads and one block per SM, 384 and two), give the outputs of one block per
    request, bitwise."""
    from cupy_spec import _launch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need compute capability 9.0")
    case = chain_case(2, 4, 151936, torch.Generator().manual_seed(99), style="flat")
    dev = {key: v.cuda() for key, v in case.items()}
    plan = chain_mod.OP.plan
    try:
        monkeypatch.setattr(_launch, "CLUSTERS", False)
        chain_mod.OP.records.clear()
        single = public_chain(dev["draft"], dev["ids"], dev["target"], uniform_samples=dev["coins"])
        check_chain(case, single)
        monkeypatch.setattr(_launch, "CLUSTERS", True)
        for size in range(2, 17):
            def forced(dims, variant, info, size=size):
                c = min(size, info.largest(build))
                return plan(dims, variant, info)._replace(grid=(dims.bs, c), cluster=c, block=build[0], kernel=build)

            monkeypatch.setattr(chain_mod.OP, "plan", forced)
            chain_mod.OP.records.clear()
            got = public_chain(dev["draft"], dev["ids"], dev["target"], uniform_samples=dev["coins"])
            assert {rec[2] for rec in chain_mod.OP.records.values()} == {size}
            for x, y in zip(got, single):
                assert torch.equal(x, y), size
    finally:
        chain_mod.OP.records.clear()


def check_on_gpu(case, clusters, monkeypatch):
    """The public op on the GPU (fresh launch records; clusters allowed or not) against the reference."""
    from cupy_spec import _launch

    monkeypatch.setattr(_launch, "CLUSTERS", clusters)
    dev = {key: v.cuda() for key, v in case.items()}
    chain_mod.OP.records.clear()
    try:
        check_chain(case, public_chain(dev["draft"], dev["ids"], dev["target"], uniform_samples=dev["coins"]))
    finally:
        chain_mod.OP.records.clear()


@gpu
@needs_cuda
@pytest.mark.parametrize("clusters", [True, False])
def test_the_sample_lands_in_every_piece(clusters, monkeypatch):
    """Final coins spread over [0, 1) put the sample in pieces all along the row: the final search
    runs on pieces summed by every warp of every block of a request; one block per request or
    clusters."""
    for bs, V in ((64, 151936), (7, 32000), (1, 128256)):
        case = chain_case(bs, 2, V, torch.Generator().manual_seed(bs), style="flat")
        case["coins"][:, 0] = 1.0  # fails the first draft wherever q(x) > p(x): mostly the residual of row 0
        case["coins"][:, -1] = (torch.arange(bs) + 0.5) / bs
        check_on_gpu(case, clusters, monkeypatch)


@gpu
@needs_cuda
@pytest.mark.parametrize("clusters", [True, False])
def test_pieces_of_several_rounds(clusters, monkeypatch):
    """Past about 2**20 floats a row's pieces hold several rounds of loads each (more units than
    32 * BATCHES), in the piece sums and in the final search."""
    V = 1_200_000
    piece_units, _ = chain_mod.pieces_for(V, chain_mod.BATCHES, chain_mod.MAX_PIECES)
    assert piece_units > 32 * chain_mod.BATCHES
    g = torch.Generator().manual_seed(5)
    for style in ("flat", "peaked"):
        check_on_gpu(chain_case(2, 2, V, g, style=style), clusters, monkeypatch)


@gpu
@needs_cuda
def test_kernel_bitwise_repeatable():
    case = chain_case(17, 4, 128256, torch.Generator().manual_seed(8), style="flat")
    dev = {key: v.cuda() for key, v in case.items()}
    first = public_chain(dev["draft"], dev["ids"], dev["target"], uniform_samples=dev["coins"])
    for _ in range(5):
        again = public_chain(dev["draft"], dev["ids"], dev["target"], uniform_samples=dev["coins"])
        for x, y in zip(first, again):
            assert torch.equal(x, y)


@gpu
@needs_cuda
@pytest.mark.parametrize("which", ["default", "custom"])
@pytest.mark.parametrize("V", [257, 151936])
def test_cuda_graph_replay_with_generator(which, V):
    """Coins drawn inside the captured graph: every replay draws fresh coins (torch's philox
    offsets advance per replay), and each replay equals an eager call with the coins the generator
    gives from the state it had before that replay."""
    bs, k = 32, 3
    case = chain_case(bs, k, V, torch.Generator().manual_seed(9))
    dev = {key: v.cuda() for key, v in case.items()}
    if which == "default":
        gen, arg = torch.cuda.default_generators[torch.cuda.current_device()], None
    else:
        gen = arg = torch.Generator(device="cuda")
        gen.manual_seed(1234)
    cupy_spec.warmup()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        public_chain(dev["draft"], dev["ids"], dev["target"], generator=arg)  # plan the launch outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    if which == "custom":
        if not hasattr(graph, "register_generator_state"):
            pytest.skip("this torch cannot register a generator with a graph")
        graph.register_generator_state(gen)
    with torch.cuda.graph(graph):
        out, acc, emi = public_chain(dev["draft"], dev["ids"], dev["target"], generator=arg)
    seen = []
    for _ in range(3):
        state = gen.get_state()
        graph.replay()
        torch.cuda.synchronize()
        replay = torch.Generator(device="cuda")
        replay.set_state(state)
        coins = torch.rand((bs, k + 1), generator=replay, device="cuda")
        eager = public_chain(dev["draft"], dev["ids"], dev["target"], uniform_samples=coins)
        for x, y in zip((out, acc, emi), eager):
            assert torch.equal(x, y)
        seen.append(out.clone())
    assert not all(torch.equal(seen[0], x) for x in seen[1:]), "replays did not draw fresh coins"


@gpu
@needs_cuda
def test_cuda_graph_replay_with_static_coins():
    bs, k, V = 8, 4, 32000
    g = torch.Generator().manual_seed(10)
    static = {key: v.cuda() for key, v in chain_case(bs, k, V, g).items()}
    graph, got = captured(lambda: public_chain(static["draft"], static["ids"], static["target"],
                                               uniform_samples=static["coins"]))
    for _ in range(3):
        fresh = chain_case(bs, k, V, g)
        for key in fresh:
            static[key].copy_(fresh[key])
        graph.replay()
        torch.cuda.synchronize()
        check_chain(fresh, got)


@gpu
@needs_cuda
def test_cupy_inputs():
    cupy = pytest.importorskip("cupy")
    case = chain_case(5, 3, 300, torch.Generator().manual_seed(11), ids_dtype=torch.int64)
    arrays = {key: cupy.asarray(v.numpy()) for key, v in case.items()}
    acc0 = torch.arange(5, dtype=torch.int32)
    acc = cupy.asarray(acc0.numpy())
    with cupy.cuda.Stream(non_blocking=True):
        got = public_chain(arrays["draft"], arrays["ids"], arrays["target"], acc, uniform_samples=arrays["coins"])
        drawn = public_chain(arrays["draft"], arrays["ids"], arrays["target"])  # coins from torch's generator
        cupy.cuda.get_current_stream().synchronize()
    assert isinstance(got[0], cupy.ndarray) and got[1] is acc and isinstance(got[2], cupy.ndarray)
    check_chain(case, tuple(torch.from_numpy(cupy.asnumpy(x)) for x in got), acc0, None)
    out, a, e = (torch.from_numpy(cupy.asnumpy(x)).long() for x in drawn)
    assert bool(((e >= 0) & (e <= 3) & (a >= e)).all())
    assert bool(((out.gather(1, e[:, None]) >= 0) & (out.gather(1, e[:, None]) < 300)).all())


@gpu
@needs_cuda
def test_torch_compile_fullgraph_cuda():
    case = chain_case(4, 3, 1000, torch.Generator().manual_seed(12))
    dev = {key: v.cuda() for key, v in case.items()}
    torch._dynamo.reset()
    f = torch.compile(lambda d, i, t, c: public_chain(d, i, t, uniform_samples=c), fullgraph=True)
    check_chain(case, f(dev["draft"], dev["ids"], dev["target"], dev["coins"]))


# ---- content checks (validate=True) --------------------------------------------------------------


def _zero_q_of_draft(c):
    """Draft 1 of request 1 gets probability 0 in its own draft row (the row renormalised)."""
    row = c["draft"][1, 1]
    row[int(c["ids"][1, 1])] = 0.0
    row /= row.sum()


_CHAIN_EDITS = {
    "id out of range": (lambda c: c["ids"][1].__setitem__(2, 50), r"draft_token_ids\[1, 2\].*\[0, V=50\)"),
    "nan target": (lambda c: c["target"][0, 3].__setitem__(7, float("nan")), r"target_probs\[0, 3\].*NaN"),
    "target sum": (lambda c: c["target"][2, 1].mul_(0.5), r"target_probs\[2, 1\].*sums to"),
    "draft sum": (lambda c: c["draft"][0, 0].mul_(2.0), r"draft_probs\[0, 0\].*sums to"),
    "id not in its row": (_zero_q_of_draft, r"draft_token_ids\[1, 1\].*misaligned"),
    "coin": (lambda c: c["coins"][2].__setitem__(3, 1.0), r"uniform_samples\[2, 3\]"),
}


def _chain_validated(c, device="cpu"):
    d = {k: v.to(device) for k, v in c.items()}
    return public_chain(d["draft"], d["ids"], d["target"], uniform_samples=d["coins"], validate=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_content_checks_pass_valid_input(device):
    c = chain_case(3, 3, 50, torch.Generator().manual_seed(31))
    out, _, emitted = _chain_validated(c, device)
    assert int(emitted.min()) >= 0 and int(out[:, 0].min()) >= 0


@pytest.mark.parametrize("edit", list(_CHAIN_EDITS))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_content_checks_name_the_problem(edit, device):
    c = chain_case(3, 3, 50, torch.Generator().manual_seed(31))
    fn, match = _CHAIN_EDITS[edit]
    fn(c)
    with pytest.raises(ValueError, match=match):
        _chain_validated(c, device)
    d = {k: v.to(device) for k, v in c.items()}
    out, _, _ = public_chain(d["draft"], d["ids"], d["target"], uniform_samples=d["coins"])  # runs without validate
    assert out.shape == (3, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed, offset", [(7, 3), (2**64 - 1, 2**63), ("tensor1", "tensor1"), ("tensorbs", 11),
                                          ("uint64", "uint64")])
def test_seed_and_offset_draw_uniform_coins(device, seed, offset):
    """FlashInfer's seed/offset: the coins are uniform_coins(seed, offset), the same bits on every
    device; ints, one-entry and per-request int64 tensors, and uint64 tensors (as FlashInfer takes)."""
    case = chain_case(6, 3, 9, torch.Generator().manual_seed(2))
    words = {"tensor1": torch.tensor([12345]), "tensorbs": torch.arange(6) * 1000 - 3,
             "uint64": torch.tensor([2**64 - 5, 2**63 + 9, 3, 0, 2**63, 77], dtype=torch.uint64)}

    def word(x):
        if isinstance(x, str):
            return words[x].view(torch.int64)
        return torch.tensor([x - 2**64 if x >= 2**63 else x])

    coins = torch.empty(6, 4)
    cupy_spec.uniform_coins(word(seed), word(offset), coins)
    want = reference_chain(case["draft"], case["ids"], case["target"], uniform_samples=coins)
    args = [words[x].to(device) if isinstance(x, str) else x for x in (seed, offset)]
    got = public_chain(case["draft"].to(device), case["ids"].to(device), case["target"].to(device), seed=args[0],
                       offset=args[1])
    for x, y in zip(got, want):
        assert torch.equal(x.cpu(), y)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(seed=1), ValueError, "seed and offset go together: got seed alone"),
    (dict(offset=1), ValueError, "got offset alone"),
    (dict(seed=1, offset=0, generator=torch.Generator()), ValueError, "one source of coins.*generator"),
    (dict(seed=1, offset=0, uniform_samples=torch.rand(1, 3)), ValueError, "one source of coins.*uniform_samples"),
    (dict(seed=-1, offset=0), ValueError, r"seed must lie in \[0, 2\*\*64\), got -1"),
    (dict(seed=1, offset=2**64), ValueError, r"offset must lie in \[0, 2\*\*64\)"),
    (dict(seed=True, offset=0), TypeError, "seed must be an int, an int64 or uint64 tensor or None, got bool"),
    (dict(seed=1.5, offset=0), TypeError, "seed must be an int.*got float"),
    (dict(seed=torch.tensor([1, 2]), offset=0), ValueError, r"seed must have 1 or bs=1 entries"),
    (dict(seed=torch.tensor([1], dtype=torch.int32), offset=0), TypeError, "seed must have dtype int64"),
    (dict(seed=torch.tensor(1), offset=0), ValueError, r"seed must have shape \[ns\]"),
])
def test_seed_and_offset_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        public_chain(DOC_DRAFT, torch.tensor([[2, 1]]), DOC_TARGET, **kwargs)


def _core_outputs(bs, k, device):
    return (torch.full((bs, k + 1), -7, dtype=torch.int32, device=device),
            torch.zeros(bs, dtype=torch.int32, device=device), torch.zeros(bs, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs", [1, 16, 133])
def test_core_op_draws_the_coins_from_seed_and_offset(device, bs):
    """The in-place core op with seed and offset instead of uniform_samples (the kernel draws the
    coins itself) writes what it writes with the coins uniform_coins draws; one seed or one per
    request, offsets per request; bs = 133 takes the two-blocks-per-SM build on a 132-SM GPU."""
    k, V = 4, 1000
    c = {key: v.to(device) for key, v in chain_case(bs, k, V, torch.Generator().manual_seed(bs)).items()}
    for seed in (torch.tensor([2**62 + 5], device=device), torch.arange(bs, device=device) * 7 - 3):
        offset = torch.arange(bs, device=device) * 11 + 2**40
        coins = torch.empty(bs, k + 1, device=device)
        cupy_spec.uniform_coins(seed, offset, coins)
        want, got = _core_outputs(bs, k, device), _core_outputs(bs, k, device)
        chain_mod._core(c["draft"], c["ids"], c["target"], coins, *want)
        chain_mod._core(c["draft"], c["ids"], c["target"], None, *got, seed, offset, True, True)
        chain_mod._core(c["draft"], c["ids"], c["target"], None, *got, seed=seed, offset=offset,
                        seeded=True)  # counters add up
        chain_mod._core(c["draft"], c["ids"], c["target"], coins, *want)
        for x, y in zip(got, want):
            assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs", [1, 16, 133])
@pytest.mark.parametrize("seed_as, offset_as", [("word", "word"), ("word", "tensor"), ("tensor", "word")])
def test_core_op_takes_seed_and_offset_as_words(device, bs, seed_as, offset_as):
    """seeded=True with seed or offset None: the word stands for it in every request (high bits
    set, so the int64 words are negative); the coins are uniform_coins' for the same values."""
    k, V = 4, 1000
    c = {key: v.to(device) for key, v in chain_case(bs, k, V, torch.Generator().manual_seed(bs + 2)).items()}
    seed_word, offset_word = -(2**62) - 12345, -(2**63) + 2**40
    seed = torch.arange(bs, device=device) * 7 - 3 if seed_as == "tensor" else None
    offset = torch.arange(bs, device=device) * 11 + 2**40 if offset_as == "tensor" else None
    coins = torch.empty(bs, k + 1, device=device)
    cupy_spec.uniform_coins(torch.tensor([seed_word], device=device) if seed is None else seed,
                            torch.tensor([offset_word], device=device) if offset is None else offset, coins)
    want, got = _core_outputs(bs, k, device), _core_outputs(bs, k, device)
    chain_mod._core(c["draft"], c["ids"], c["target"], coins, *want)
    chain_mod._core(c["draft"], c["ids"], c["target"], None, *got, seed, offset, seeded=True, seed_word=seed_word,
                    offset_word=offset_word)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


@gpu
def test_int_seed_and_offset_allocate_only_the_outputs():
    """With ints for seed and offset the default call makes one allocation (the outputs' block):
    the ints travel as kernel parameters."""
    c = {key: v.cuda() for key, v in chain_case(8, 3, 500, torch.Generator().manual_seed(4)).items()}
    public_chain(c["draft"], c["ids"], c["target"], seed=3, offset=2**63 + 5)  # loads the kernel
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    got = public_chain(c["draft"], c["ids"], c["target"], seed=3, offset=2**63 + 5)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == 1
    coins = torch.empty(8, 4, device="cuda")
    cupy_spec.uniform_coins(torch.tensor([3], device="cuda"), torch.tensor([-(2**63) + 5], device="cuda"), coins)
    for x, y in zip(got, public_chain(c["draft"], c["ids"], c["target"], uniform_samples=coins)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs", [1, 16, 133])
def test_core_op_writes_the_counters_without_accumulate(device, bs):
    """accumulate=False writes a and e over whatever the counters held (poisoned here); the default
    adds them, including across the int32 wrap."""
    k, V = 4, 1000
    c = chain_case(bs, k, V, torch.Generator().manual_seed(bs + 1))
    c["target"][::2, :k] = c["draft"][::2]  # every draft of even requests passes
    c = {key: v.to(device) for key, v in c.items()}
    want = _core_outputs(bs, k, device)
    chain_mod._core(c["draft"], c["ids"], c["target"], c["coins"], *want)
    assert int(want[2].sum()) > 0 and int(want[1].sum()) > 0
    got = (want[0].clone().fill_(-7), torch.full((bs,), -12345, dtype=torch.int32, device=device),
           torch.full((bs,), 2**31 - 1, dtype=torch.int32, device=device))
    chain_mod._core(c["draft"], c["ids"], c["target"], c["coins"], *got, accumulate=False)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    wrapped = torch.full((bs,), 2**31 - 1, dtype=torch.int32, device=device)
    chain_mod._core(c["draft"], c["ids"], c["target"], c["coins"], got[0], got[1], wrapped, None, None, True)
    assert torch.equal(got[1], 2 * want[1])
    assert torch.equal(wrapped, (want[2].long() + 2**31 - 1 + 2**31).remainder(2**32).sub(2**31).int())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("given", ["none", "accepted", "emitted"])
def test_public_counters_start_from_zero_in_reused_memory(device, given):
    """Counters the caller does not give start from zero even where the allocator hands back
    memory that held other values (poisoned and freed just before); the outputs are contiguous
    and of their documented shapes."""
    bs, k, V = 37, 3, 500
    case = chain_case(bs, k, V, torch.Generator().manual_seed(9))
    case["target"][::2, :k] = case["draft"][::2]
    c = {key: v.to(device) for key, v in case.items()}
    for _ in range(3):
        junk = torch.full((bs * (k + 3) * 4,), -99, dtype=torch.int32, device=device)
        del junk
        acc = torch.full((bs,), 5, dtype=torch.int32, device=device) if given == "accepted" else None
        emi = torch.full((bs,), 6, dtype=torch.int32, device=device) if given == "emitted" else None
        got = public_chain(c["draft"], c["ids"], c["target"], acc, emi, uniform_samples=c["coins"])
        assert [tuple(t.shape) for t in got] == [(bs, k + 1), (bs,), (bs,)]
        assert all(t.is_contiguous() and t.dtype == torch.int32 for t in got)
        check_chain(case, got, *(torch.full((bs,), v, dtype=torch.int32) if given == name else None
                                 for v, name in ((5, "accepted"), (6, "emitted"))))
        assert int(got[2].sum()) >= 19 * k
        assert (got[1] is acc) == (given == "accepted") and (got[2] is emi) == (given == "emitted")


@pytest.mark.parametrize("edit, match", [
    (dict(seeded=True), r"uniform_samples, or seeded=True .*: got both"),
    (dict(uniform_samples=None), "got neither"),
    (dict(uniform_samples=None, seed="seed", offset="seed"), "seed is given without seeded=True"),
    (dict(offset="seed"), "offset is given without seeded=True"),
    (dict(uniform_samples=None, seeded=True, seed="empty"), r"seed must have 1 or bs=2 entries, got \(0,\)"),
    (dict(uniform_samples=None, seeded=True, offset="three"), r"offset must have 1 or bs=2 entries, got \(3,\)"),
])
def test_core_op_takes_one_source_of_coins(edit, match):
    """The core op (and its torch custom op) refuses both sources of coins, neither, seed or offset
    tensors without seeded, and seed/offset of a size other than 1 or bs, empty included."""
    c = chain_case(2, 3, 20, torch.Generator().manual_seed(5))
    named = {"coins": c["coins"], "seed": torch.tensor([1]), "empty": torch.zeros(0, dtype=torch.int64),
             "three": torch.zeros(3, dtype=torch.int64), None: None}
    kw = dict(uniform_samples="coins", seed=None, offset=None) | edit
    args = dict(draft_probs=c["draft"], draft_token_ids=c["ids"], target_probs=c["target"])
    args |= {key: named[v] if key in ("uniform_samples", "seed", "offset") else v for key, v in kw.items()}
    outs = dict(zip(("output_token_ids", "output_accepted_token_num", "output_emitted_draft_token_num"),
                    _core_outputs(2, 3, "cpu")))
    for fn in (chain_mod._core, torch.ops.cupy_spec.chain_speculative_sampling):
        with pytest.raises(ValueError, match=match):
            fn(**args, **outs)


@pytest.mark.parametrize("words, exc, match", [
    (dict(seed_word=2**63), ValueError, r"seed_word must lie in \[-9223372036854775808, 9223372036854775807\]"),
    (dict(offset_word=-(2**63) - 1), ValueError, "offset_word must lie in"),
    (dict(offset_word=1.0), TypeError, "offset_word must be an int, got float"),
    (dict(seed_word=True), TypeError, "seed_word must be an int, got bool"),
])
def test_core_op_words_are_int64(words, exc, match):
    c = chain_case(2, 3, 20, torch.Generator().manual_seed(5))
    with pytest.raises(exc, match=match):
        chain_mod._core(c["draft"], c["ids"], c["target"], None, *_core_outputs(2, 3, "cpu"), seeded=True, **words)


@pytest.mark.parametrize("device", DEVICES)
def test_seed_and_offset_inside_torch_compile(device):
    case = {k: v.to(device) for k, v in chain_case(4, 3, 20, torch.Generator().manual_seed(3)).items()}
    seed = torch.tensor([5, 6, 7, 8], device=device)
    want = public_chain(case["draft"], case["ids"], case["target"], seed=seed, offset=9)
    torch._dynamo.reset()
    f = torch.compile(lambda d, i, t, s: public_chain(d, i, t, seed=s, offset=9), fullgraph=True)
    for x, y in zip(f(case["draft"], case["ids"], case["target"], seed), want):
        assert torch.equal(x, y)


@gpu
def test_seed_tensor_on_another_device_is_refused():
    with pytest.raises(ValueError, match="seed is on cpu, but the inputs are on cuda"):
        public_chain(DOC_DRAFT.cuda(), torch.tensor([[2, 1]], device="cuda"), DOC_TARGET.cuda(),
                     seed=torch.tensor([1]), offset=0)


@gpu
def test_cuda_graph_replay_with_offset_tensor():
    """Seed and offset tensors are read when the graph runs: after offset.add_(k + 1) a replay uses
    the next coins of every stream, as an eager call with that offset does."""
    case = chain_case(8, 3, 50, torch.Generator().manual_seed(4))
    d = {k: v.cuda() for k, v in case.items()}
    seed, offset = torch.tensor([77], device="cuda"), torch.tensor([0], device="cuda")
    graph, static = captured(lambda: public_chain(d["draft"], d["ids"], d["target"], seed=seed, offset=offset))
    for step in range(3):
        offset.fill_(4 * step)
        graph.replay()
        torch.cuda.synchronize()
        want = public_chain(d["draft"], d["ids"], d["target"], seed=77, offset=4 * step)
        for x, y in zip(static, want):
            assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_generator_is_checked(device):
    draft, ids, target = DOC_DRAFT.to(device), torch.tensor([[2, 1]], device=device), DOC_TARGET.to(device)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        op(draft, ids, target, generator=1234)
    other = "cpu" if device == "cuda" else ("cuda" if HAS_CUDA else None)  # a generator of another device
    if other is not None:
        other = torch.Generator(device=other)
        with pytest.raises(ValueError, match="generator is a generator of"):
            op(draft, ids, target, generator=other)
    out, _, _ = op(draft, ids, target, generator=torch.Generator(device=device).manual_seed(0))
    assert out[0, 0].item() == 2  # x_0 always passes
