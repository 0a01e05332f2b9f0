"""Hostile inputs: malformed trees, out-of-range ids and indices, bad probabilities and coins.

The op must never hang, never write outside its outputs, and write only what docs/contract.md §1 allows
(see the hostile-input rules in :mod:`cupy_spec.reference`). ``hostile_cases`` is one hypothesis
strategy used by both the CPU tests (the reference) and the GPU tests (the kernel through the
public op, compared with the reference). Outputs and ``draft_probs`` are passed as views into
larger canary-filled buffers, and the canaries are checked after every call.

Checks (``check_outputs``) follow the walk of ``walk`` below, a scalar restatement of the rules:
accept outputs exactly, ``draft_probs`` changed exactly at the rejected (request, node, token)
positions (to the raw target value), ``predicts`` changed only at ``retrive_index`` values of the
accepted path plus the final position, every written token in [0, V), the final token a valid draw
from the residual (up to float32 rounding ties).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import cupy_spec
from cases import POISON, as_args, clone_to, compare, make_case, no_hang
from cupy_spec import reference
from cupy_spec.check import check_inputs

HAS_CUDA = torch.cuda.is_available()

NAN, INF = float("nan"), float("inf")
FLT_MIN = reference.FLT_MIN
COIN_MAX = reference.COIN_MAX
CANARY_INT = -123456789
CANARY_FLOAT = -1234.5
OUTPUTS = ("predicts", "accept_index", "accept_token_num", "draft_probs")
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


def examples(n: int) -> int:
    """Example count of a GPU fuzz test: n, scaled by CUPY_SPEC_FUZZ_SCALE (e.g. 0.1 under
    compute-sanitizer, where every launch is instrumented)."""
    return max(1, round(n * float(os.environ.get("CUPY_SPEC_FUZZ_SCALE", "1"))))


VOCABS = [1, 2, 3, 7, 16, 31, 257, 1031, 4099]
PROB_VALUES = [NAN, INF, -INF, -0.5, -0.0, 0.0, 1e-40, -1e-40, FLT_MIN, 1.0, 0.5, 2.0, 1e-30, 1e30]
HUGE_VALUES = [1e38, 3.4e38]  # rows whose float32 sums overflow (only with overflow=True)
COIN_VALUES = [-0.5, -0.0, 0.0, 1.0, 1.5, NAN, INF, -INF, 1e-40, COIN_MAX, 0.5, 1 - 2**-26]
THRESHOLDS = [1.0, 0.0, 0.5, 0.9, 1e-3]
MUTATIONS = (
    "next_token", "next_token", "next_sibling", "next_sibling", "first_child_next_token",
    "first_child_next_sibling", "candidate", "first_child_candidate", "root_coin", "index", "root_index",
    "target", "target", "target_of_candidate", "target_of_candidate", "target_row", "draft", "draft_row",
    "coin", "final_coin",
)


class Hostile(NamedTuple):
    case: dict  # op arguments (CPU tensors), outputs poisoned
    ts: float  # threshold_single
    ta: float  # threshold_acc
    pad: int  # canary elements on each side of every output buffer
    mutations: list  # what was done to the valid case (for failure reports)


# ---- the generator -----------------------------------------------------------------------------


def apply_mutation(case: dict, m: tuple) -> None:
    """One hostile edit ``(kind, b, i, value[, token])`` of a case, in place."""
    kind, b, i, v = m[:4]
    if kind.startswith("first_child_"):  # a link of the root's first child (always visited)
        n = case["candidates"].shape[1]
        i = int(case["retrive_next_token"][b, 0])
        if not 0 <= i < n:
            return
        kind = kind[len("first_child_"):]
        v = i if v == "self" else v
    if kind in ("next_token", "next_sibling"):
        case[f"retrive_{kind}"][b, i] = v
    elif kind == "candidate":
        case["candidates"][b, i] = v
    elif kind in ("index", "root_index"):
        case["retrive_index"][b, i] = v
    elif kind == "target":
        case["target_probs"][b, i, m[4]] = v
    elif kind == "target_of_candidate":  # the entry the walk reads when node m[4]'s parent is i
        V = case["target_probs"].shape[2]
        case["target_probs"][b, i, int(case["candidates"][b, m[4]]) % V] = v
    elif kind == "target_row":
        case["target_probs"][b, i] = v
    elif kind == "draft" and case["draft_probs"] is not None:
        case["draft_probs"][b, i, m[4]] = v
    elif kind == "draft_row" and case["draft_probs"] is not None:
        case["draft_probs"][b, i] = v
    elif kind == "coin":
        case["uniform_samples"][b, i] = v
    elif kind == "final_coin":
        case["uniform_samples_for_final_sampling"][b] = v


def _mutation(draw, kind, bs, n, V, P, shared_index, overflow):
    b, i = draw(st.integers(0, bs - 1)), draw(st.integers(0, n - 1))
    probs = PROB_VALUES + (HUGE_VALUES if overflow else [])
    if kind in ("next_token", "next_sibling"):
        v = draw(st.one_of(st.integers(0, n - 1), st.sampled_from([i, 0, -1, -5, n, n + 3, 2**40, -(2**40)])))
    elif kind == "first_child_candidate":
        v = draw(st.sampled_from([V, -1, -(2**40)]))
    elif kind.startswith("first_child_"):
        v = draw(st.one_of(st.sampled_from(["self", 0, -5, n]), st.integers(0, n - 1)))
    elif kind == "candidate":
        v = draw(st.one_of(st.integers(0, V - 1), st.sampled_from([V, V + 1, -1, -5, 2**31, 2**40, -(2**40)])))
    elif kind in ("index", "root_index"):
        i = 0 if kind == "root_index" else i
        bad = [-1, -5, P, P + 3, 2**33, -(2**33), 2**40 + b * n]
        b2 = draw(st.integers(0, bs - 1)) if shared_index else b
        other = b2 * n + draw(st.integers(0, n - 1))  # usually another node's index: a duplicate
        v = draw(st.sampled_from(bad + [other] * 3))
        if not shared_index and 0 <= v < P and not b * n <= v < (b + 1) * n:
            v = -1  # keep indices of different requests apart (kernel order of writes is free there)
    elif kind in ("target", "draft"):
        return (kind, b, i, draw(st.sampled_from(probs)), draw(st.integers(0, V - 1)))
    elif kind == "target_of_candidate":
        return (kind, b, i, draw(st.sampled_from(probs)), draw(st.integers(0, n - 1)))
    elif kind in ("target_row", "draft_row"):
        v = draw(st.sampled_from([0.0, NAN, 1e-40, -1.0, INF, 1.0 / V] + (HUGE_VALUES if overflow else [])))
    else:
        kind, i = ("coin", 0) if kind == "root_coin" else (kind, i)
        v = draw(st.sampled_from(COIN_VALUES))
    return (kind, b, i, v)


@st.composite
def hostile_cases(draw, shared_index=True, overflow=False, vocabs=VOCABS, max_bs=4, max_n=10, max_mutations=8):
    """Strategy: a random valid case (``cases.make_case``) with hostile edits; yields ``Hostile``.

    shared_index: allow ``retrive_index`` values shared between requests (their ``predicts`` writes
    then race on the GPU). overflow: allow finite probabilities whose float32 sums overflow to inf.
    """
    bs, n = draw(st.integers(1, max_bs)), draw(st.integers(1, max_n))
    V = draw(st.sampled_from(vocabs))
    S = draw(st.one_of(st.none(), st.integers(1, n)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    case = make_case(bs, n, V, g, style=draw(st.sampled_from(["peaked", "flat", "sparse", "onehot"])), S=S,
                     draft=draw(st.booleans()), dup=draw(st.booleans()), coin_edges=draw(st.booleans()))
    P = max(0, bs * n + draw(st.sampled_from([0, 0, 0, 1, 3, -1, -3])))
    case["predicts"] = torch.full((P,), POISON, dtype=torch.int32)
    muts = [_mutation(draw, k, bs, n, V, P, shared_index, overflow)
            for k in draw(st.lists(st.sampled_from(MUTATIONS), max_size=max_mutations))]
    for m in muts:
        apply_mutation(case, m)
    ts = draw(st.one_of(st.sampled_from(THRESHOLDS), st.floats(0.0, 1.0)))
    ta = draw(st.one_of(st.sampled_from(THRESHOLDS), st.floats(0.0, 1.0)))
    return Hostile(case, ts, ta, draw(st.integers(1, 9)), muts)


# ---- canaries ----------------------------------------------------------------------------------


def wrap(case: dict, pad: int, device) -> tuple[dict, dict]:
    """The case on ``device`` with every output (and draft_probs) a contiguous view into a buffer
    with ``pad`` canary elements on each side. Returns (case, buffers)."""
    out = clone_to(case, device)
    bufs = {}
    for name in OUTPUTS:
        t = out[name]
        if t is None:
            continue
        canary = CANARY_FLOAT if t.is_floating_point() else CANARY_INT
        flat = torch.full((t.numel() + 2 * pad,), canary, dtype=t.dtype, device=device)
        flat[pad : pad + t.numel()] = t.flatten()
        out[name] = flat[pad : pad + t.numel()].view(t.shape)
        assert out[name].is_contiguous() and (t.numel() == 0 or out[name].data_ptr() == flat[pad:].data_ptr())
        bufs[name] = flat
    return out, bufs


def assert_canaries(bufs: dict, pad: int) -> None:
    for name, flat in bufs.items():
        flat = flat.cpu()
        canary = torch.full((pad,), CANARY_FLOAT if flat.is_floating_point() else CANARY_INT, dtype=flat.dtype)
        bits = (lambda x: x.view(torch.int32)) if flat.is_floating_point() else (lambda x: x)
        assert torch.equal(bits(flat[:pad]), bits(canary)), f"{name}: canary before the buffer overwritten"
        assert torch.equal(bits(flat[-pad:]), bits(canary)), f"{name}: canary after the buffer overwritten"


# ---- expected behaviour ------------------------------------------------------------------------


class Walk(NamedTuple):
    root_ok: bool
    path: list  # accepted nodes, root first
    rejects: list  # (node whose row is written, token), in walk order
    stop: str = "end"  # why the walk ended: "end" (no child left / depth S), "seen", "bad" child


def _eff(x) -> np.float32:
    x = np.float32(x)
    return x if (math.isfinite(x) and x >= FLT_MIN) else np.float32(0)


def _coin(x) -> np.float32:
    x = np.float32(x)
    return min(x, np.float32(COIN_MAX)) if x >= FLT_MIN else np.float32(0)  # NaN, negative, subnormal: 0


def walk(case: dict, ts: float, ta: float) -> list:
    """The walk of every request, restated from the contract and the hostile-input rules (scalar)."""
    bs, n = case["candidates"].shape
    S, V, P = case["accept_index"].shape[1], case["target_probs"].shape[2], case["predicts"].shape[0]
    cand, ri = case["candidates"].tolist(), case["retrive_index"].tolist()
    nt, ns = case["retrive_next_token"].tolist(), case["retrive_next_sibling"].tolist()
    tp, us = case["target_probs"].numpy(), case["uniform_samples"].numpy()
    thr_s, thr_a = np.float32(ts), np.float32(max(ta, 1e-9))
    with np.errstate(all="ignore"):  # float32 overflow to inf is part of the rules
        return [_walk_one(b, n, S, V, P, cand, ri, nt, ns, tp, us, thr_s, thr_a) for b in range(bs)]


def _walk_one(b, n, S, V, P, cand, ri, nt, ns, tp, us, thr_s, thr_a) -> Walk:
    """Request b's walk (see ``walk``)."""
    link = lambda x: x if 0 <= x < n else -1  # noqa: E731
    root_ok = 0 <= ri[b][0] < P
    path, rejects, seen = [0], [], {0}
    cur, coin, acc = 0, _coin(us[b, 0]), np.float32(0)
    c = link(nt[b][0]) if root_ok and S > 1 else -1
    stop = "end" if root_ok else "bad"
    while c >= 0:
        if c in seen:
            stop = "seen"
            break
        seen.add(c)
        t = cand[b][c]
        if not (0 <= t < V and 0 <= ri[b][c] < P):
            stop = "bad"
            break
        p = _eff(tp[b, cur, t])
        acc = np.float32(acc + p)
        if p > 0 and (coin < np.float32(acc / thr_a) or p >= thr_s):
            path.append(c)
            cur, coin, acc = c, _coin(us[b, c]), np.float32(0)
            c = link(nt[b][c]) if len(path) < S else -1
        else:
            rejects.append((cur, t))
            c = link(ns[b][c])
    return Walk(root_ok, path, rejects, stop)


def residual_row(case: dict, b: int, w: Walk, S: int) -> torch.Tensor:
    """float32 [V]: the residual the final token of request b is drawn from."""
    cur = w.path[-1]
    r = reference.effective_probs(case["target_probs"][b, cur])
    dp = case["draft_probs"]
    if dp is not None and len(w.path) < S:
        d = dp[b, cur]
        r = reference.effective_probs(r - torch.where(d.abs() < FLT_MIN, torch.zeros_like(d), d))
    for u, t in w.rejects:
        if u == cur:
            r[t] = 0.0
    return r


def _i32(x: int) -> int:
    return int(np.array(x, dtype=np.int64).astype(np.int32))


def check_outputs(case: dict, got: dict, ts: float, ta: float, exact_final: bool = True) -> None:
    """Asserts the op's outputs ``got`` (after the call) are what the rules allow for ``case``
    (before the call). exact_final: the final token must be the inverse-CDF draw up to rounding
    ties (else only a token with positive residual, or V - 1 for an all-zero residual)."""
    got = {k: (None if v is None else v.cpu()) for k, v in got.items()}
    bs, n = case["candidates"].shape
    S = case["accept_index"].shape[1]
    ri, cand = case["retrive_index"].tolist(), case["candidates"].tolist()
    walks = walk(case, ts, ta)
    writes = {}  # predicts position -> {request: last value written (None = final token)}
    for b, w in enumerate(walks):
        cnt = len(w.path) - 1
        assert int(got["accept_token_num"][b]) == cnt and 0 <= cnt <= S - 1, f"accept_token_num[{b}]"
        want = [_i32(ri[b][0])] + [ri[b][c] for c in w.path[1:]] + [POISON] * (S - 1 - cnt)
        assert got["accept_index"][b].tolist() == want, f"accept_index[{b}]"
        if not w.root_ok:
            continue
        for j in range(cnt):
            writes.setdefault(ri[b][w.path[j]], {})[b] = cand[b][w.path[j + 1]]
        writes.setdefault(ri[b][w.path[-1]], {})[b] = None
    _check_draft(case, got, walks)
    _check_predicts(case, got, walks, writes, exact_final)


def _check_draft(case, got, walks) -> None:
    if case["draft_probs"] is None:
        assert got["draft_probs"] is None
        return
    want = case["draft_probs"].clone()
    for b, w in enumerate(walks):
        for u, t in w.rejects:
            want[b, u, t] = case["target_probs"][b, u, t]
    changed = (got["draft_probs"].view(torch.int32) != want.view(torch.int32)).nonzero().tolist()
    assert not changed, f"draft_probs differs from the rejected-children writes at (b, node, token) {changed[:5]}"


def _check_predicts(case, got, walks, writes, exact_final) -> None:
    pr = got["predicts"]
    P, V, S = pr.shape[0], case["target_probs"].shape[2], case["accept_index"].shape[1]
    untouched = torch.ones(P, dtype=torch.bool)
    untouched[list(writes)] = False
    assert (pr[untouched] == POISON).all(), "predicts written off the accepted paths"
    for pos, by in writes.items():
        tok = int(pr[pos])
        assert 0 <= tok < V, f"predicts[{pos}] = {tok} is not a token id"
        if len(by) > 1:  # indices shared between requests: any writer may win
            continue
        ((b, val),) = by.items()
        if val is not None:
            assert tok == val, f"predicts[{pos}] (request {b}): {tok}, want {val}"
            continue
        r = residual_row(case, b, walks[b], S)
        if not (r > 0).any():
            assert tok == V - 1, f"request {b}: all-zero residual must give V - 1, got {tok}"
            continue
        assert r[tok] > 0, f"request {b}: final token {tok} has zero residual"
        if exact_final:
            coin = reference.clamp_coins(case["uniform_samples_for_final_sampling"][b : b + 1])
            slack = reference.final_token_slack(r[None], coin, torch.tensor([tok]))
            assert float(slack) <= 2e-6, f"request {b}: final token {tok} off its interval by {float(slack)}"


# ---- running ------------------------------------------------------------------------------------


def run(h: Hostile, device, fn) -> dict:
    """Runs ``fn`` on the wrapped case; checks canaries; returns the outputs (views)."""
    args, bufs = wrap(h.case, h.pad, device)
    fn(*as_args(args), h.ts, h.ta)
    if device != "cpu":
        torch.cuda.synchronize()
    assert_canaries(bufs, h.pad)
    return {k: args[k] for k in OUTPUTS}


def run_reference(h: Hostile) -> dict:
    with no_hang():
        return run(h, "cpu", reference.tree_speculative_sampling_target_only)


# ---- CPU: the reference ------------------------------------------------------------------------


@settings(max_examples=300, **SETTINGS)
@given(hostile_cases())
def test_reference_hostile(h):
    check_outputs(h.case, run_reference(h), h.ts, h.ta)
    for w in walk(h.case, h.ts, h.ta):  # coverage, shown by pytest --hypothesis-show-statistics
        event(f"walk stops: {w.stop}")
        event(f"accepted: {min(len(w.path) - 1, 2)}{'+' if len(w.path) > 2 else ''}")
        event(f"rejections: {'yes' if w.rejects else 'no'}")


@settings(max_examples=60, **SETTINGS)
@given(hostile_cases(overflow=True, vocabs=[1, 2, 7, 31]))
def test_reference_overflowing_rows(h):
    check_outputs(h.case, run_reference(h), h.ts, h.ta, exact_final=False)


@settings(max_examples=100, **SETTINGS)
@given(hostile_cases(vocabs=[1, 3, 31]))
def test_public_op_cpu_hostile(h):
    check_outputs(h.case, run(h, "cpu", cupy_spec.tree_speculative_sampling_target_only), h.ts, h.ta)


@settings(max_examples=150, **SETTINGS)
@given(hostile_cases(vocabs=[1, 3, 31]))
def test_check_inputs_hostile(h):
    """check_inputs never hangs or crashes: it passes or raises a ValueError naming an argument."""
    with no_hang():
        try:
            check_inputs(*as_args(h.case), threshold_single=h.ts, threshold_acc=h.ta)
        except ValueError as e:
            assert any(name in str(e) for name in ("retrive_", "candidates", "predicts", "target_probs",
                                                    "draft_probs", "uniform_samples")), str(e)
            return
    # Passed: then no walk meets a malformed tree, token or index.
    assert all(w.stop == "end" for w in walk(h.case, h.ts, h.ta))


def _base(bs=2, n=8, V=7, S=None, draft=True, seed=0) -> dict:
    return make_case(bs, n, V, torch.Generator().manual_seed(seed), style="peaked", S=S, draft=draft)


# Hand-picked hostile classes, each run through the same checks (CPU, and GPU below).
HAND = {
    "self_loop_root": [("next_token", 0, 0, 0)],
    "self_loop_child": [("next_token", 0, 1, 1), ("next_token", 1, 0, 1), ("next_token", 1, 1, 1)],
    "sibling_self_loop": [("next_sibling", 0, 1, 1), ("next_sibling", 1, 2, 2)],
    "sibling_cycle": [("next_sibling", 0, 1, 2), ("next_sibling", 0, 2, 1), ("next_token", 0, 0, 1)],
    "child_cycle": [("next_token", 0, 0, 1), ("next_token", 0, 1, 2), ("next_token", 0, 2, 1)],
    "root_as_child": [("next_token", 0, 1, 0), ("next_sibling", 1, 1, 0)],
    "dangling": [("next_token", 0, 0, 8), ("next_sibling", 1, 1, 100), ("next_token", 1, 2, 2**40)],
    "negative_links": [("next_token", 0, 0, -5), ("next_sibling", 1, 1, -(2**40))],
    "token_too_big": [("candidate", 0, 1, 7), ("candidate", 1, 2, 2**40)],
    "token_negative": [("candidate", 0, 1, -1), ("candidate", 1, 2, -5)],
    "index_negative": [("index", 0, 1, -1), ("index", 1, 2, -5)],
    "index_too_big": [("index", 0, 1, 16), ("index", 1, 2, 2**33)],
    "index_duplicate": [("index", 0, 1, 2), ("index", 1, 3, 8), ("index", 1, 2, 9)],  # within a request
    "root_index_out": [("root_index", 0, 0, -1), ("root_index", 1, 0, 2**33 + 3)],
    "nan_rows": [("target_row", 0, 0, NAN), ("target_row", 1, 1, NAN)],
    "inf_rows": [("target_row", 0, 0, INF), ("target_row", 1, 0, -INF)],
    "negative_rows": [("target_row", 0, 0, -1.0), ("draft_row", 1, 0, -1.0)],
    "subnormal_rows": [("target_row", 0, 0, 1e-40), ("draft_row", 1, 0, 1e-40)],
    "zero_rows": [("target_row", 0, 0, 0.0), ("target_row", 1, 0, 0.0), ("target_row", 1, 1, 0.0)],
    "nan_draft": [("draft_row", 0, 0, NAN), ("draft", 1, 0, INF, 3)],
    "coins_bad": [("coin", 0, 0, -0.5), ("coin", 1, 0, NAN), ("final_coin", 0, 0, 1.0), ("final_coin", 1, 0, NAN)],
    "coins_big": [("coin", 0, 0, 1.5), ("coin", 1, 0, INF), ("final_coin", 0, 0, INF), ("final_coin", 1, 0, -INF)],
    # Node 1 is the root's first child in make_case trees; coin == acc / thr_acc must reject.
    "coin_equals_acc": [("coin", 0, 0, 0.5), ("target_of_candidate", 0, 0, 0.5, 1),
                        ("coin", 1, 0, 0.25), ("target_of_candidate", 1, 0, 0.25, 1)],
    "coins_tiny": [("coin", 0, 0, 1e-40), ("final_coin", 0, 0, 1e-40), ("final_coin", 1, 0, -0.0)],
}


def _hand(name: str, **kw) -> list:
    out = []
    for ts, ta in ((1.0, 1.0), (0.0, 0.0), (0.5, 0.9), (1.0, 0.5)):
        case = _base(**kw)
        for m in HAND[name]:
            apply_mutation(case, m)
        out.append(Hostile(case, ts, ta, 3, HAND[name]))
    return out


@pytest.mark.parametrize("name", sorted(HAND))
def test_reference_hand_picked(name):
    for h in _hand(name) + _hand(name, draft=False, S=2):
        check_outputs(h.case, run_reference(h), h.ts, h.ta)


@pytest.mark.parametrize("V", [1, 2])
@pytest.mark.parametrize("n", [1, 2])
def test_reference_tiny(n, V):
    for seed in range(4):
        h = Hostile(_base(bs=3, n=n, V=V, seed=seed), 1.0, 1.0, 1, [])
        check_outputs(h.case, run_reference(h), h.ts, h.ta)


def test_reference_empty_batch():
    case = {k: (v if k == "predicts" else v[:0]) for k, v in _base(bs=1).items()}
    got = run_reference(Hostile(case, 1.0, 1.0, 2, []))
    assert (got["predicts"] == POISON).all()


def test_walk_oracle_sees_hostile_rules():
    # Sanity of the test's own oracle: a self-loop at the root stops the walk at once.
    case = _base()
    apply_mutation(case, ("next_token", 0, 0, 0))
    assert walk(case, 1.0, 1.0)[0] == Walk(True, [0], [], "seen")
    case = _base()
    apply_mutation(case, ("root_index", 1, 0, -1))
    assert walk(case, 1.0, 1.0)[1] == Walk(False, [0], [], "bad")


# ---- GPU: the kernel through the public op, compared with the reference ------------------------

op = cupy_spec.tree_speculative_sampling_target_only


def run_kernel(h: Hostile) -> dict:
    return run(h, "cuda", op)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@settings(max_examples=examples(350), **SETTINGS)
@given(hostile_cases(shared_index=False))
def test_kernel_hostile_matches_reference(h):
    got = run_kernel(h)
    compare(h.case, got, h.ts, h.ta)
    check_outputs(h.case, got, h.ts, h.ta)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@settings(max_examples=examples(100), **SETTINGS)
@given(hostile_cases(shared_index=True))
def test_kernel_hostile_shared_indices(h):
    # retrive_index shared between requests: which request's predicts write wins is free.
    check_outputs(h.case, run_kernel(h), h.ts, h.ta)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@settings(max_examples=examples(60), **SETTINGS)
@given(hostile_cases(shared_index=False, overflow=True))
def test_kernel_overflowing_rows(h):
    # Row sums overflow float32: the walk and draft writes must match; the final token only has to
    # be a token with positive residual (the reference's u = coin * inf is inf or NaN).
    got = run_kernel(h)
    ref = run_reference(h)
    for k in ("accept_index", "accept_token_num"):
        assert torch.equal(got[k].cpu(), ref[k]), k
    if ref["draft_probs"] is not None:
        assert torch.equal(got["draft_probs"].cpu().view(torch.int32), ref["draft_probs"].view(torch.int32))
    check_outputs(h.case, got, h.ts, h.ta, exact_final=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(HAND))
def test_kernel_hand_picked(name):
    for h in _hand(name) + _hand(name, draft=False, S=2) + _hand(name, V=4099):
        got = run_kernel(h)
        compare(h.case, got, h.ts, h.ta)
        check_outputs(h.case, got, h.ts, h.ta)
