"""``tree_speculative_sampling_from_logits``: the reference (CPU) and, where the op exists and a GPU
is present, the kernel against it.

CPU parts check the reference module
``cupy_spec/reference/tree_speculative_sampling_from_logits.py``:

* its filtered rows against :func:`naive_filtered_row`, an independent scalar statement of the
  plain composition (softmax of logits / T, then top-k, top-p and min-p on probabilities, each
  keeping ties and renormalising), and the op against the target-only reference on those rows;
* ties at the top-k / top-p / min-p boundaries kept, the filter order, the "off" values;
* greedy requests (T = 0, negative, NaN, below 1e-6) against :func:`greedy_oracle`, a local
  statement of greedy tree verification (accept the child equal to the argmax of the node's row;
  the correction / bonus token is that argmax), alone and in mixed batches;
* hostile inputs (NaN and +-inf logits, rows all -inf, hostile temperatures and parameters,
  malformed trees) never raising, never hanging, never writing a token outside [0, V);
* :func:`check_outputs`, the tolerance-aware comparison the GPU tests use, accepting the
  reference's own outputs and rejecting outputs of wrong semantics;
* losslessness: the first emitted token (and the token after node 1) follows the filtered target
  row (Pearson chi-square at ALPHA), and ignoring any one of temperature, top-k, top-p or min-p is
  detected at POWER_FACTOR times the critical value.

GPU parts (``@pytest.mark.gpu``) call the public op ``cupy_spec.tree_speculative_sampling_from_logits``
(skipped while it does not exist) and accept its outputs when :func:`check_outputs` does: exact
walk structure and greedy results, accept decisions and the final token equal to the reference's
except at the ties the reference module documents (``REL_TOL``).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import cupy_spec
from cases import POISON, captured, duplicate_siblings, no_hang, random_tree, tree_arrays
from cupy_spec.reference import clamp_coins, final_token_slack, tree_speculative_sampling_target_only
from test_lossless import chi2_isf, chi2_sf, pearson

R = importlib.import_module("cupy_spec.reference.tree_speculative_sampling_from_logits")

OP = getattr(cupy_spec, "tree_speculative_sampling_from_logits", None)
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_op = pytest.mark.skipif(OP is None, reason="cupy_spec.tree_speculative_sampling_from_logits does not exist yet")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUTPUTS = ("predicts", "accept_index", "accept_token_num")
INPUTS = ("candidates", "retrive_index", "retrive_next_token", "retrive_next_sibling", "uniform_samples",
          "uniform_samples_for_final_sampling", "target_logits", "temperatures")
OPTIONAL = ("top_ks", "top_ps", "min_ps")


# --------------------------------------------------------------------------------------------
# Independent statements: the plain composition per row, and greedy tree verification
# --------------------------------------------------------------------------------------------


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def naive_filtered_row(logits_row, T: float, top_k: int | None, top_p: float | None, min_p: float | None):
    """One row of the composition, written with Python floats and no shared code: a list of V
    float64 probabilities. Filters act on probabilities as the composition is usually stated
    (agreeing with the reference's logit thresholds wherever distinct logits give distinct
    probabilities, which the tests using it ensure)."""
    x = [(-INF if math.isnan(v) else v) for v in logits_row.float().tolist()]
    V = len(x)
    if not (_f32(T) >= _f32(1e-6)):  # greedy (also NaN)
        best = 0
        for i, v in enumerate(x):
            if v > x[best]:
                best = i
        return [1.0 if i == best else 0.0 for i in range(V)]
    if any(v == INF for v in x):
        c = sum(v == INF for v in x)
        p = [1.0 / c if v == INF else 0.0 for v in x]
    else:
        m = max(x)
        if m == -INF:
            return [0.0] * V
        e = [0.0 if v == -INF else math.exp((v - m) / T) for v in x]
        z = sum(e)
        p = [v / z for v in e]

    def renorm(q):
        s = sum(q)
        return [v / s for v in q]

    if top_k is not None and 0 < top_k < V:
        kth = sorted(p, reverse=True)[top_k - 1]
        p = renorm([v if v >= kth else 0.0 for v in p])
    if top_p is not None and top_p < 1:
        for tau in sorted({v for v in p if v > 0}, reverse=True):
            if sum(v for v in p if v >= tau) >= top_p:
                break
        p = renorm([v if v >= tau else 0.0 for v in p])
    if min_p is not None and min_p > 0:
        cut = min(min_p, 1.0) * max(p)
        p = renorm([v if v >= cut else 0.0 for v in p])
    return p


def greedy_oracle(case: dict):
    """Greedy tree verification on valid trees, from scratch: ``target_predict[b, i]`` is the first
    maximal index of row (b, i) (NaN counting as -inf); at each node the first child in sibling
    order whose token equals the node's target_predict is accepted; the last accepted node's
    target_predict is the final token. Returns (predicts, accept_index, accept_token_num)."""
    logits = case["target_logits"].float()
    bs, n, V = logits.shape
    S = case["accept_index"].shape[1]
    predicts = case["predicts"].clone()
    accept_index = case["accept_index"].clone()
    accept_token_num = case["accept_token_num"].clone()
    for b in range(bs):
        tp = []
        for i in range(n):
            row = [(-INF if math.isnan(v) else v) for v in logits[b, i].tolist()]
            best = 0
            for j, v in enumerate(row):
                if v > row[best]:
                    best = j
            tp.append(best)
        nt, ns = case["retrive_next_token"][b].tolist(), case["retrive_next_sibling"][b].tolist()
        cand, ri = case["candidates"][b].tolist(), case["retrive_index"][b].tolist()
        cur, last, count = 0, ri[0], 0
        accept_index[b, 0] = ri[0]
        while count < S - 1:
            c = nt[cur]
            while c != -1 and cand[c] != tp[cur]:
                c = ns[c]
            if c == -1:
                break
            predicts[last] = cand[c]
            count += 1
            accept_index[b, count] = ri[c]
            last, cur = ri[c], c
        predicts[last] = tp[cur]
        accept_token_num[b] = count
    return predicts, accept_index, accept_token_num


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def _params(bs, V, g, style):
    """temperatures, top_ks, top_ps, min_ps for a batch: 'mixed' (a quarter greedy, every filter
    on and off), 'sampling' (moderate values, no greedy) or 'hostile' (every special value)."""
    pick = lambda vals: torch.tensor([vals[int(i)] for i in torch.randint(len(vals), (bs,), generator=g)])
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(bs, generator=g)
    if style == "hostile":
        T = pick([0.0, -1.0, NAN, 1e-7, 1e-6, 0.7, 1.0, 1e30, INF, 3.0]).float()
        k = pick([-3, 0, 1, 2, V - 1, V, V + 100, 2**31 - 1, 5]).int()
        p = pick([NAN, -0.5, 0.0, 1e-9, 0.5, 0.9, 1.0, 1.5]).float()
        mp = pick([NAN, -1.0, 0.0, 1e-30, 0.05, 0.5, 1.0, 2.0]).float()
        return T, k, p, mp
    T = u(0.3, 1.6).float()
    if style == "mixed":
        T = torch.where(torch.rand(bs, generator=g) < 0.25, torch.zeros_like(T), T)
    k = torch.where(torch.rand(bs, generator=g) < 0.5, torch.randint(1, max(2, V // 2), (bs,), generator=g),
                    torch.zeros(bs, dtype=torch.long)).int()
    p = torch.where(torch.rand(bs, generator=g) < 0.5, u(0.3, 0.99), torch.ones(bs)).float()
    mp = torch.where(torch.rand(bs, generator=g) < 0.4, u(0.001, 0.3), torch.zeros(bs)).float()
    return T, k, p, mp


def _logits(bs, n, V, g, hostile: bool):
    """Peaked random logits (a hot token per row, some exact duplicates); hostile: NaN, +-inf tokens,
    rows all -inf or all NaN, rows with +inf."""
    x = torch.randn(bs, n, V, generator=g) * 2.5
    hot = torch.randint(0, V, (bs, n, 1), generator=g)
    x.scatter_add_(2, hot, torch.full((bs, n, 1), 6.0))
    dup = torch.rand(bs, n, V, generator=g) < 0.1  # exact ties with the neighbour
    x = torch.where(dup, x.roll(1, dims=2), x)
    if hostile:
        r = torch.rand(bs, n, V, generator=g)
        x = torch.where(r < 0.05, torch.full_like(x, NAN), x)
        x = torch.where((r >= 0.05) & (r < 0.15), torch.full_like(x, -INF), x)
        x = torch.where((r >= 0.15) & (r < 0.16), torch.full_like(x, INF), x)
        row = torch.rand(bs, n, 1, generator=g)
        x = torch.where(row < 0.1, torch.full_like(x, -INF), x)
        x = torch.where((row >= 0.1) & (row < 0.15), torch.full_like(x, NAN), x)
        x = torch.where((row >= 0.15) & (row < 0.2), x.clamp(max=3e38) * 1e37, x)  # huge finite logits
    return x


def make_logits_case(bs, n, V, g, dtype=torch.float32, style="mixed", hostile_logits=False, dup=False,
                     optional=True, S=None):
    """A dict of op arguments (CPU tensors, valid trees); children's tokens drawn from the parent's
    filtered row (so acceptance is frequent), some uniformly; outputs poisoned."""
    nt, ns, parents, depth = random_tree(bs, n, g, max_children=None if n < 4 else 3)
    if S is None:
        S = int(depth.max()) + 1
    logits = _logits(bs, n, V, g, hostile_logits).to(dtype)
    T, k, p, mp = _params(bs, V, g, "hostile" if style == "hostile" else style)
    rows = R.filtered_probs(logits, T, k, p, mp)
    ar = torch.arange(bs)
    cand = torch.randint(0, V, (bs, n), generator=g)
    for i in range(1, n):
        w = rows[ar, parents[:, i]] + 1e-3
        drawn = torch.multinomial(w, 1, generator=g).squeeze(1)
        cand[:, i] = torch.where(torch.rand(bs, generator=g) < 0.85, drawn, cand[:, i])
    if dup and n > 2:  # a sibling repeats its previous sibling's token
        duplicate_siblings(cand, ns, g)
    case = dict(
        **tree_arrays(S, cand, nt, ns),
        uniform_samples=torch.rand(bs, n, generator=g),
        uniform_samples_for_final_sampling=torch.rand(bs, generator=g),
        target_logits=logits,
        temperatures=T,
        top_ks=k if optional else None,
        top_ps=p if optional else None,
        min_ps=mp if optional else None,
    )
    return case


def clone_case(case: dict, device="cpu") -> dict:
    return {key: (None if v is None else v.clone().to(device)) for key, v in case.items()}


def run_reference(case: dict, ts=1.0, ta=1.0, **override) -> dict:
    """Reference outputs on a copy of the case (CPU); keyword overrides replace inputs."""
    c = clone_case(case)
    c.update(override)
    R.tree_speculative_sampling_from_logits(
        *(c[key] for key in OUTPUTS + INPUTS), c["top_ks"], c["top_ps"], c["min_ps"], ts, ta)
    return {key: c[key] for key in OUTPUTS}


def run_op(case: dict, device: str, ts=1.0, ta=1.0) -> dict:
    """The public op on `device` (the reference on the CPU while the op does not exist)."""
    if device == "cpu" and OP is None:
        return run_reference(case, ts, ta)
    c = clone_case(case, device)
    OP(*(c[key] for key in OUTPUTS + INPUTS), top_ks=c["top_ks"], top_ps=c["top_ps"], min_ps=c["min_ps"],
       threshold_single=ts, threshold_acc=ta)
    return {key: c[key].cpu() for key in OUTPUTS}


# --------------------------------------------------------------------------------------------
# The tolerance-aware comparison (what the GPU tests accept)
# --------------------------------------------------------------------------------------------


def _near(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b)) + R.TINY_PROB


def _kept_masses(x: torch.Tensor, w: torch.Tensor, k: int) -> list[float]:
    """Top-p masses M_j at the end of every tie group of the top-k distribution (float64 row)."""
    V = x.numel()
    xs, order = torch.sort(x, descending=True, stable=True)
    ws = w[order]
    if 0 < k < V:
        ws = torch.where(xs >= xs[k - 1], ws, torch.zeros_like(ws))
    cum = torch.cumsum(ws, 0)
    if cum[-1] <= 0:
        return []
    ends = torch.ones(V, dtype=torch.bool)
    ends[:-1] = xs[:-1] != xs[1:]
    return (cum[ends] / cum[-1]).tolist()


def row_alternatives(x: torch.Tensor, greedy: bool, T: float, k: int, tp: float, mp: float, tol: float):
    """The float64 rows a kernel may use for one logits row (x: cleaned float64 [V]): the exact one,
    plus those whose top-p or min-p boundary moves within ``tol`` (module docstring of the
    reference). Usually one row."""
    V = x.numel()
    if greedy:
        return [torch.zeros(V, dtype=torch.float64).scatter_(0, x.argmax().view(1), 1.0)]
    Tt = torch.tensor([T], dtype=torch.float64)
    kt = torch.tensor([k], dtype=torch.int64)
    w, _ = R.filter_rows(x[None], Tt, kt, torch.tensor([1.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    tps = [tp]
    if tp < 1:
        tps += [tp - tol, tp + tol] + [M for M in _kept_masses(x, w[0], k) if abs(M - tp) <= tol]
    mps = [mp]
    if mp > 0:
        band = w[0][(w[0] - mp).abs() <= tol * mp].unique().tolist()
        mps += [mp * (1 - tol), mp * (1 + tol)] + band + [math.nextafter(v, INF) for v in band]
    rows, seen = [], set()
    for a in tps:
        for b in mps:
            _, kept = R.filter_rows(x[None], Tt, kt, torch.tensor([a], dtype=torch.float64),
                                    torch.tensor([b], dtype=torch.float64))
            key = bytes(kept[0].numpy())
            if key in seen:
                continue
            seen.add(key)
            p = torch.where(kept[0], w[0], torch.zeros_like(w[0]))
            z = p.sum()
            rows.append(p / z if z > 0 else p)
    return rows


def check_outputs(case: dict, got: dict, ts: float = 1.0, ta: float = 1.0, tol: float = R.REL_TOL) -> int:
    """Asserts that ``got`` (the op's outputs, valid trees only) is a correct result for ``case``:
    the walk's structure and every greedy result exactly; each accept decision equal to the exact
    one (float64) unless it is a documented tie for some admissible row; the final token inside
    its prefix interval of the residual up to ``tol``; nothing written off the path. Returns the
    number of decisions that differed from the exact ones at ties."""
    got = {key: v.cpu() for key, v in got.items()}
    logits = R.clean_logits(case["target_logits"])
    bs, n, V = logits.shape
    S = case["accept_index"].shape[1]
    P = case["predicts"].shape[0]
    greedy = R.greedy_requests(case["temperatures"]).tolist()
    T, kk, tp, mp = R._row_params(bs, 1, "cpu", case["temperatures"], case["top_ks"], case["top_ps"], case["min_ps"])
    coins = clamp_coins(case["uniform_samples"]).double()
    final_coins = clamp_coins(case["uniform_samples_for_final_sampling"])
    ta_eff = max(float(torch.tensor(ta, dtype=torch.float32)), 1e-9)
    ts = float(torch.tensor(ts, dtype=torch.float32))
    written = torch.zeros(P, dtype=torch.bool)
    ties = 0
    for b in range(bs):
        cnt = int(got["accept_token_num"][b])
        ai = got["accept_index"][b].tolist()
        ri = case["retrive_index"][b].tolist()
        cand = case["candidates"][b].tolist()
        nt, ns = case["retrive_next_token"][b].tolist(), case["retrive_next_sibling"][b].tolist()
        where = f"request {b}"
        assert 0 <= cnt < S, f"{where}: accept_token_num {cnt} outside [0, {S})"
        assert ai[0] == ri[0], f"{where}: accept_index[b, 0] {ai[0]} != retrive_index[b, 0] {ri[0]}"
        assert all(v == POISON for v in ai[cnt + 1:]), f"{where}: accept_index written past accept_token_num"
        node_of = {v: i for i, v in enumerate(ri)}
        path_nodes = [node_of.get(v, -1) for v in ai[: cnt + 1]]
        assert all(c >= 0 for c in path_nodes), f"{where}: accept_index {ai[: cnt + 1]} not nodes of the request"
        cache = {}

        def alts(i):
            if i not in cache:
                cache[i] = row_alternatives(logits[b, i], greedy[b], float(T[b]), int(kk[b]), float(tp[b]),
                                            float(mp[b]), tol)
            return cache[i]

        cur, count, visited = 0, 0, {0}
        c = nt[0] if S > 1 else -1
        while True:
            rows = alts(cur)
            valid, acc = [True] * len(rows), [0.0] * len(rows)
            want = path_nodes[count + 1] if count < cnt else None
            coin = float(coins[b, cur])
            rejected, accepted, ended = [], None, False
            while c >= 0:
                if c in visited:
                    ended = True
                    break
                visited.add(c)
                t = cand[c]
                if not (0 <= t < V and 0 <= ri[c] < P):
                    ended = True
                    break
                takes = c == want
                for j, row in enumerate(rows):
                    p = float(row[t])
                    acc[j] += p
                    exact = p > 0 and (coin * ta_eff < acc[j] or p >= ts)
                    tie = not greedy[b] and (0 < p < R.TINY_PROB or _near(coin * ta_eff, acc[j], tol)
                                             or (p > 0 and _near(p, ts, tol)))
                    if takes != exact:
                        if tie:
                            ties += 1
                        else:
                            valid[j] = False
                if takes:
                    accepted = c
                    break
                rejected.append(t)
                c = ns[c]
            assert any(valid), (
                f"{where}: decisions at node {cur} (coin {coin}) contradict every admissible row: "
                f"kernel path {path_nodes}, children tried {rejected}, accepted {accepted}")
            if accepted is None:
                assert want is None, f"{where}: node {want} accepted but the walk cannot reach it from node {cur}"
                break
            assert not ended
            count += 1
            cur = accepted
            c = nt[cur] if count < S - 1 else -1
        assert count == cnt
        # Written tokens: the accepted path, then the final token at the last node.
        pred = got["predicts"]
        for j in range(cnt):
            pos = ri[path_nodes[j]]
            assert int(pred[pos]) == cand[path_nodes[j + 1]], f"{where}: predicts[{pos}] is not the accepted token"
            written[pos] = True
        pos = ri[cur]
        written[pos] = True
        tok = int(pred[pos])
        assert 0 <= tok < V, f"{where}: final token {tok} outside [0, {V})"
        ok = False
        for j, row in enumerate(rows):
            if not valid[j]:
                continue
            r = row.clone()
            if rejected:
                r[torch.tensor(rejected)] = 0.0
            if float(r.max()) < R.TINY_PROB:
                ok |= tok == V - 1 or float(r[tok]) > 0
                continue
            slack = float(final_token_slack(r[None], final_coins[b : b + 1], torch.tensor([tok]))[0])
            ok |= slack <= (0.0 if greedy[b] else tol)
        assert ok, f"{where}: final token {tok} at node {cur} is not a draw from the residual (coin {float(final_coins[b])})"
    untouched = ~written
    assert torch.equal(got["predicts"][untouched], case["predicts"][untouched]), "predicts written off the accepted paths"
    return ties


def assert_exact(case, got, ts=1.0, ta=1.0, ref=None):
    ref = ref if ref is not None else run_reference(case, ts, ta)
    for key in OUTPUTS:
        assert torch.equal(got[key].cpu(), ref[key]), f"{key} differs from the reference"


# --------------------------------------------------------------------------------------------
# The composition (CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_filtered_rows_match_naive_composition(dtype):
    g = torch.Generator().manual_seed(1 + DTYPES.index(dtype))
    bs, n, V = 24, 3, 37
    case = make_logits_case(bs, n, V, g, dtype, style="mixed")
    rows = R.filtered_probs(case["target_logits"], case["temperatures"], case["top_ks"], case["top_ps"], case["min_ps"])
    for b in range(bs):
        args = (float(case["temperatures"][b]), int(case["top_ks"][b]), float(case["top_ps"][b]), float(case["min_ps"][b]))
        for i in range(n):
            want = torch.tensor(naive_filtered_row(case["target_logits"][b, i], *args), dtype=torch.float64)
            got = rows[b, i]
            assert torch.equal(got > 0, want > 0), f"kept set differs at ({b}, {i}) with T, k, p, min_p = {args}"
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-300)


def test_op_is_target_only_on_the_filtered_rows():
    g = torch.Generator().manual_seed(7)
    for dtype in DTYPES:
        case = make_logits_case(64, 8, 29, g, dtype, style="mixed", dup=True)
        for ts, ta in [(1.0, 1.0), (0.5, 0.7), (0.0, 0.0)]:
            rows = torch.stack([
                torch.tensor([naive_filtered_row(case["target_logits"][b, i], float(case["temperatures"][b]),
                                                 int(case["top_ks"][b]), float(case["top_ps"][b]), float(case["min_ps"][b]))
                              for i in range(8)], dtype=torch.float64)
                for b in range(64)]).float()
            c = clone_case(case)
            tree_speculative_sampling_target_only(
                c["predicts"], c["accept_index"], c["accept_token_num"], c["candidates"], c["retrive_index"],
                c["retrive_next_token"], c["retrive_next_sibling"], c["uniform_samples"],
                c["uniform_samples_for_final_sampling"], rows, None, ts, ta)
            assert_exact(case, c, ts, ta)


def test_return_details():
    g = torch.Generator().manual_seed(8)
    case = make_logits_case(5, 6, 17, g, style="mixed")
    c = clone_case(case)
    d = R.tree_speculative_sampling_from_logits(*(c[key] for key in OUTPUTS + INPUTS), c["top_ks"], c["top_ps"],
                                                c["min_ps"], return_details=True)
    assert d["rows"].dtype == torch.float32 and d["rows"].shape == (5, 6, 17)
    assert torch.equal(d["greedy"], ~(case["temperatures"] >= 1e-6))
    assert d["residual"].shape == (5, 17) and d["final_coin"].shape == (5,)
    sums = d["rows"].double().sum(-1)
    assert bool(((sums - 1).abs() < 1e-6).all())


def _row(values, T=1.0, k=None, p=None, mp=None, dtype=torch.float32):
    x = torch.tensor(values, dtype=torch.float32).to(dtype)[None, None]
    opt = lambda v, dt: None if v is None else torch.tensor([v], dtype=dt)
    return R.filtered_probs(x, torch.tensor([T]), opt(k, torch.int32), opt(p, torch.float32), opt(mp, torch.float32))[0, 0]


def test_top_k_keeps_ties():
    q = _row([5.0, 4.0, 4.0, 1.0, 4.0, 0.0], k=2)
    assert (q > 0).tolist() == [True, True, True, False, True, False]
    assert q[1] == q[2] == q[4]
    assert (_row([3.0, 3.0, 3.0, 1.0], k=1) > 0).tolist() == [True, True, True, False]


def test_top_p_keeps_ties():
    x = [2.0, 1.0, 1.0, 1.0, 0.0, -1.0]
    e = [math.exp(v - 2.0) for v in x]
    m1 = e[0] / sum(e)  # mass of the first level
    q = _row(x, p=m1 + 1e-3)  # crossing inside the tie group: the whole group stays
    assert (q > 0).tolist() == [True, True, True, True, False, False]
    at = torch.tensor(m1, dtype=torch.float32)
    if float(at) > m1:  # the float32 top_p at or just below the exact mass of the first level
        at = torch.nextafter(at, torch.tensor(-1.0))
    q = _row(x, p=float(at))  # the first level's mass reaches it: that level alone
    assert (q > 0).tolist() == [True, False, False, False, False, False]
    assert (_row(x, p=0.0) > 0).tolist() == [True] + [False] * 5  # top_p <= 0: the maximal level
    assert (_row([1.0, 1.0, 0.0], p=-3.0) > 0).tolist() == [True, True, False]


def test_top_p_reached_exactly_stops_there():
    """The kept set ends at the first level whose mass reaches top_p, equality included. With T = inf
    every token weighs 1, so the masses at the level ends are exactly 1/4, 1/2, 3/4, 1."""
    x = [3.0, 2.0, 1.0, 0.0]
    assert (_row(x, T=float("inf"), p=0.5) > 0).tolist() == [True, True, False, False]
    assert (_row(x, T=float("inf"), p=0.75) > 0).tolist() == [True, True, True, False]
    assert (_row(x, T=float("inf"), p=0.5000001) > 0).tolist() == [True, True, True, False]


def test_min_p_is_relative_to_the_max_and_keeps_ties():
    x = [0.0, math.log(0.25), math.log(0.25), math.log(0.1)]
    q = _row(x, mp=0.2)
    assert (q > 0).tolist() == [True, True, True, False]
    assert (_row(x, mp=1.0) > 0).tolist() == [True, False, False, False]
    assert torch.equal(_row(x, mp=5.0), _row(x, mp=1.0))  # above 1 counts as 1


def test_filter_order_top_p_sees_the_top_k_distribution():
    x = [math.log(v) for v in (0.4, 0.3, 0.2, 0.1)]
    # top-k 2 renormalises to (4/7, 3/7); top-p 0.5 on that keeps one token (on the full row: two).
    assert (_row(x, k=2, p=0.5) > 0).tolist() == [True, False, False, False]
    assert (_row(x, p=0.5) > 0).tolist() == [True, True, False, False]
    # min-p after top-p: the ratio to the max does not change with renormalisation.
    assert (_row(x, p=0.95, mp=0.6) > 0).tolist() == [True, True, False, False]


def test_off_values_are_off():
    g = torch.Generator().manual_seed(3)
    bs, n, V = 8, 2, 19
    x = _logits(bs, n, V, g, False)
    T = torch.full((bs,), 0.9)
    base = R.filtered_probs(x, T)
    full = lambda v, dt: torch.full((bs,), v, dtype=dt)
    for k in (0, -1, V, V + 7, 2**31 - 1):
        assert torch.equal(R.filtered_probs(x, T, top_ks=full(k, torch.int32)), base), k
    for p in (1.0, 1.5, NAN, INF):
        assert torch.equal(R.filtered_probs(x, T, top_ps=full(p, torch.float32)), base), p
    for mp in (0.0, -1.0, NAN, -INF):
        assert torch.equal(R.filtered_probs(x, T, min_ps=full(mp, torch.float32)), base), mp


def test_hostile_rows():
    assert _row([NAN, 1.0, NAN]).tolist() == [0.0, 1.0, 0.0]  # NaN counts as -inf
    assert _row([INF, 5.0, INF, NAN], k=1).tolist() == [0.5, 0.0, 0.5, 0.0]  # +inf share all mass
    assert _row([-INF, -INF, NAN]).tolist() == [0.0, 0.0, 0.0]  # nothing to sample: all zero
    assert _row([-INF, -INF, NAN], T=0.0).tolist() == [1.0, 0.0, 0.0]  # greedy: argmax 0
    assert _row([1.0, NAN, 3.0, 3.0], T=0.0).tolist() == [0.0, 0.0, 1.0, 0.0]  # first maximal index
    assert _row([3e38, -3e38, 0.0]).tolist() == [1.0, 0.0, 0.0]  # huge finite logits, no overflow
    for dtype in DTYPES:
        q = _row([1.0, -INF, NAN, 0.0, INF], dtype=dtype)
        assert q.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_special_temperatures():
    x = [2.0, 2.0, 1.0, -INF, NAN, 0.5]
    for T in (0.0, -1.0, NAN, -INF, 9.9e-7):
        assert _row(x, T=T).tolist() == [1.0, 0, 0, 0, 0, 0], T
    q = _row(x, T=1e-6)  # the smallest sampling temperature: exact ties at the max share the mass
    assert q.tolist() == [0.5, 0.5, 0, 0, 0, 0]
    assert _row(x, T=INF).tolist() == [0.25, 0.25, 0.25, 0.0, 0.0, 0.25]  # uniform over finite tokens
    torch.testing.assert_close(_row(x, T=1e30), _row(x, T=INF), rtol=1e-12, atol=0)
    assert (_row(x, T=1e30, k=2) > 0).tolist() == [True, True, False, False, False, False]  # top-k on logits


# --------------------------------------------------------------------------------------------
# Greedy requests and mixed batches (CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_requests_are_greedy_tree_verification(dtype):
    g = torch.Generator().manual_seed(11)
    for n, V in [(8, 13), (16, 5), (3, 2)]:
        case = make_logits_case(40, n, V, g, dtype, style="mixed", hostile_logits=True, dup=True)
        case["temperatures"] = torch.tensor([[0.0, -1.0, NAN, 1e-7, -INF][i % 5] for i in range(40)])
        for ts, ta in [(1.0, 1.0), (0.0, 0.0), (0.3, 0.9)]:
            got = run_reference(case, ts, ta)
            pred, ai, atn = greedy_oracle(case)
            assert torch.equal(got["accept_token_num"], atn)
            assert torch.equal(got["accept_index"], ai)
            assert torch.equal(got["predicts"], pred)


def test_mixed_batch_equals_requests_alone():
    g = torch.Generator().manual_seed(12)
    bs, n, V = 12, 8, 23
    case = make_logits_case(bs, n, V, g, style="mixed", hostile_logits=True)
    case["temperatures"][::3] = 0.0
    whole = run_reference(case)
    pred, ai, atn = greedy_oracle(case)
    for b in range(bs):
        one = {key: (v[b : b + 1].clone() if key not in ("predicts",) and v is not None else v) for key, v in case.items()}
        one["predicts"] = case["predicts"].clone()
        got = run_reference(one)
        assert torch.equal(got["accept_token_num"][0], whole["accept_token_num"][b])
        assert torch.equal(got["accept_index"][0], whole["accept_index"][b])
        mine = torch.arange(b * n, (b + 1) * n)
        assert torch.equal(got["predicts"][mine], whole["predicts"][mine])
        if b % 3 == 0:  # greedy members of the mixed batch
            assert torch.equal(whole["accept_index"][b], ai[b])
            assert torch.equal(whole["predicts"][mine], pred[mine])


# --------------------------------------------------------------------------------------------
# Hostile inputs (CPU): never raise, never hang, tokens in range
# --------------------------------------------------------------------------------------------


def _malformed(case, g):
    """Hostile tree links, tokens and coins (walk rules of the target-only op)."""
    bs, n = case["candidates"].shape
    V = case["target_logits"].shape[2]
    def mutate(key, values):
        t = case[key]
        mask = torch.rand(t.shape, generator=g) < 0.15
        vals = torch.tensor(values, dtype=t.dtype)[torch.randint(len(values), t.shape, generator=g)]
        case[key] = torch.where(mask, vals, t)
    mutate("retrive_next_token", [-5, 0, 1, n - 1, n, 10**12])
    mutate("retrive_next_sibling", [-5, 0, 1, n - 1, n, -(10**12)])
    mutate("candidates", [-1, V, 0, V - 1, 2**40])
    mutate("uniform_samples", [NAN, INF, -INF, -0.5, 1.0, 2.0, 0.0])
    mutate("uniform_samples_for_final_sampling", [NAN, INF, -1.0, 1.0, 0.0])
    return case


def _check_sane(case, got):
    bs, n, V = case["target_logits"].shape
    S = case["accept_index"].shape[1]
    atn = got["accept_token_num"]
    assert bool(((atn >= 0) & (atn < S)).all())
    changed = got["predicts"] != case["predicts"]
    assert bool(((got["predicts"][changed] >= 0) & (got["predicts"][changed] < V)).all()), "token outside [0, V)"
    # every request writes its final token somewhere on its path
    assert int(changed.sum()) <= int(atn.sum()) + bs


@pytest.mark.parametrize("seed", range(6))
def test_hostile_inputs_never_fail(seed):
    g = torch.Generator().manual_seed(100 + seed)
    dtype = DTYPES[seed % 3]
    for n, V in [(8, 9), (5, 1), (12, 31)]:
        case = make_logits_case(32, n, V, g, dtype, style="hostile", hostile_logits=True, dup=True)
        for ts, ta in [(1.0, 1.0), (0.0, 0.0), (1e-3, 0.5)]:
            with no_hang():
                got = run_reference(case, ts, ta)
            _check_sane(case, got)
            check_outputs(case, got, ts, ta)  # the reference is consistent with its own tolerance rules
        bad = _malformed(clone_case(case), g)
        with no_hang():
            got = run_reference(bad)
        _check_sane(bad, got)


def test_empty_batch_and_all_optional_none():
    g = torch.Generator().manual_seed(5)
    case = make_logits_case(6, 4, 11, g, style="sampling", optional=False)
    got = run_reference(case)
    check_outputs(case, got)
    empty = make_logits_case(1, 4, 11, g)
    empty = {key: (None if v is None else (v[:0] if key not in ("predicts",) else v)) for key, v in empty.items()}
    assert R.tree_speculative_sampling_from_logits(*(empty[key] for key in OUTPUTS + INPUTS)) is None


@pytest.mark.parametrize("bs, V, clusters, want", [
    (1, 151936, True, 8), (16, 151936, True, 8), (17, 151936, True, 4), (66, 151936, True, 4),
    (67, 151936, True, 2), (132, 151936, True, 2), (133, 151936, True, 1), (1, 32000, True, 4),
    (64, 32000, True, 4), (1, 8000, True, 1), (64, 151936, False, 1)])
def test_launch_plan(bs, V, clusters, want):
    """Clusters of 8 while the grid has one block per SM, of 4 or 2 while it fits the kernel's two
    resident blocks per SM, every block keeping MIN_CHUNK entries of a row (an H200's 132 SMs)."""
    from cupy_spec import _launch

    mod = importlib.import_module("cupy_spec.tree_speculative_sampling_from_logits")
    dims = mod.OP.Dims(P=bs * 8, bs=bs, S=4, n=8, V=V)
    p = mod.plan(dims, (torch.bfloat16,), _launch.DeviceInfo(0, 132, clusters))
    assert p.grid == (bs, want) and p.cluster == want and p.block == mod.THREADS
    (chunk,) = p.fields
    assert chunk * want >= V and chunk % 16 == 0 and (want == 1 or chunk >= mod.MIN_CHUNK)


# --------------------------------------------------------------------------------------------
# The comparison itself: accepts the reference, rejects wrong semantics
# --------------------------------------------------------------------------------------------


def test_check_outputs_accepts_reference():
    g = torch.Generator().manual_seed(21)
    for dtype in DTYPES:
        case = make_logits_case(64, 8, 41, g, dtype, style="mixed", dup=True)
        for ts, ta in [(1.0, 1.0), (0.6, 0.8)]:
            check_outputs(case, run_reference(case, ts, ta), ts, ta)


@pytest.mark.parametrize("wrong", ["no_top_p", "no_top_k", "no_min_p", "temperature", "greedy_as_sampling", "last_token"])
def test_check_outputs_rejects_wrong_semantics(wrong):
    g = torch.Generator().manual_seed(22)
    case = make_logits_case(256, 8, 41, g, style="sampling")
    case["top_ks"] = torch.full((256,), 6, dtype=torch.int32)
    case["top_ps"] = torch.full((256,), 0.95 if wrong == "no_min_p" else 0.6)  # min-p must bind to matter
    case["min_ps"] = torch.full((256,), 0.5 if wrong == "no_min_p" else 0.2)
    if wrong == "greedy_as_sampling":
        case["temperatures"][:] = 0.0
        got = run_reference(case, temperatures=torch.full((256,), 1e-6))
    elif wrong == "last_token":
        got = run_reference(case)
        got["predicts"][got["predicts"] != POISON] = 40
    else:
        override = {"no_top_p": {"top_ps": None}, "no_top_k": {"top_ks": None}, "no_min_p": {"min_ps": None},
                    "temperature": {"temperatures": case["temperatures"] * 1.5}}[wrong]
        got = run_reference(case, **override)
    with pytest.raises(AssertionError):
        check_outputs(case, got)


def _float32_rows(case):
    """The composition evaluated in float32 throughout (exp, sums, top-p masses, min-p test), as a
    kernel would: probabilities a few ulp away from the reference's float64 ones."""
    bs, n, V = case["target_logits"].shape
    x = R.clean_logits(case["target_logits"]).float().reshape(bs * n, V)
    T, k, tp, mp = R._row_params(bs, n, "cpu", case["temperatures"], case["top_ks"], case["top_ps"], case["min_ps"])
    greedy = R.greedy_requests(case["temperatures"])[:, None].expand(bs, n).reshape(-1)
    T = torch.where(greedy, torch.ones_like(T), T).float()
    w, kept = R.filter_rows(x, T, k, tp.float(), mp.float())
    p = torch.where(kept, w, torch.zeros_like(w))
    z = p.sum(dim=1, keepdim=True)
    p = torch.where(z > 0, p / torch.where(z > 0, z, torch.ones_like(z)), torch.zeros_like(p))
    onehot = torch.zeros_like(p).scatter_(1, x.argmax(dim=1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, p).view(bs, n, V)


def test_check_outputs_accepts_a_float32_implementation():
    g = torch.Generator().manual_seed(23)
    differ = 0
    for dtype in DTYPES:
        case = make_logits_case(256, 8, 61, g, dtype, style="mixed", dup=True)
        rows = _float32_rows(case)
        assert not torch.equal(rows, R.filtered_probs(case["target_logits"], case["temperatures"], case["top_ks"],
                                                      case["top_ps"], case["min_ps"]).float())
        c = clone_case(case)
        tree_speculative_sampling_target_only(
            c["predicts"], c["accept_index"], c["accept_token_num"], c["candidates"], c["retrive_index"],
            c["retrive_next_token"], c["retrive_next_sibling"], c["uniform_samples"],
            c["uniform_samples_for_final_sampling"], rows, None)
        got = {key: c[key] for key in OUTPUTS}
        check_outputs(case, got)
        ref = run_reference(case)
        differ += sum(not torch.equal(got[key], ref[key]) for key in OUTPUTS)
    assert differ <= 1  # rounding reaches an output only at ties, which are rare


def test_check_outputs_tolerates_only_ties():
    # A row whose top-p boundary is within REL_TOL: both kept sets are admissible.
    x = [2.0, 1.0, 0.0, -1.0]
    e = [math.exp(v - 2.0) for v in x]
    m1 = e[0] / sum(e)
    xt = R.clean_logits(torch.tensor(x))
    alts = row_alternatives(xt, False, 1.0, 0, m1 * (1 + 1e-7), 0.0, R.REL_TOL)
    assert len(alts) == 2
    assert len(row_alternatives(xt, False, 1.0, 0, m1 * 1.01, 0.0, R.REL_TOL)) == 1
    # min-p boundary within tolerance: two alternatives; far from it: one.
    assert len(row_alternatives(xt, False, 1.0, 0, 1.0, math.exp(-1.0) * (1 - 1e-7), R.REL_TOL)) == 2
    assert len(row_alternatives(xt, False, 1.0, 0, 1.0, 0.2, R.REL_TOL)) == 1


# --------------------------------------------------------------------------------------------
# Losslessness: the first emitted token follows the filtered row (CPU; CUDA with the op)
# --------------------------------------------------------------------------------------------

N = 40_000
ALPHA = 1e-4
POWER_FACTOR = 10.0
PARENTS = [-1, 0, 0, 0, 1, 1]  # root with three children, node 1 with two
LOSSLESS = {
    # name: (dtype, T, top_k, top_p, min_p). The kept set is the tightest of three prefixes, so
    # top-p and min-p cannot both bind strictly on one row: "all_filters" binds top-p (and top-k
    # through top-p's normalisation), "min_p_binds" binds min-p.
    "all_filters": (torch.float32, 0.8, 12, 0.8, 0.03),
    "min_p_binds": (torch.float32, 0.8, 10, 0.9, 0.15),
    "bf16_ties": (torch.bfloat16, 1.3, 9, 0.7, 0.0),
    "top_p_only": (torch.float16, 1.0, 0, 0.6, 0.0),
}
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda, needs_op])]


def _lossless_case(name: str):
    dtype, T, k, p, mp = LOSSLESS[name]
    n, V = len(PARENTS), 32
    logits = (torch.randn(n, V, generator=torch.Generator().manual_seed(1169)) * 1.5).to(dtype)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "bf16_ties":
        logits = (logits.float() * 2).round().div(2).to(dtype)  # many exact ties
    rows = torch.tensor([naive_filtered_row(logits[i], T, k, p, mp) for i in range(n)], dtype=torch.float64)
    tok = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        kids = [c for c in range(1, n) if PARENTS[c] == i]
        if kids:  # distinct likely tokens, the last one of probability 0 when the row has such tokens
            tok[kids] = torch.multinomial(rows[i] + 1e-12, len(kids), replacement=False, generator=g)
            zero = (rows[i] == 0).nonzero().flatten()
            if len(zero):
                tok[kids[-1]] = zero[0]
    return logits, tok, rows


def _lossless_run(name: str, device: str, **override):
    logits, tok, rows = _lossless_case(name)
    dtype, T, k, p, mp = LOSSLESS[name]
    n, V = logits.shape
    from cupy_spec import tree as spec_tree

    t1 = spec_tree.from_parents([PARENTS])
    g = torch.Generator().manual_seed(777 + sum(map(ord, name)))
    offs = (torch.arange(N) * n)[:, None]
    case = dict(
        predicts=torch.full((N * n,), POISON, dtype=torch.int32),
        accept_index=torch.full((N, t1.S), POISON, dtype=torch.int32),
        accept_token_num=torch.full((N,), POISON, dtype=torch.int32),
        candidates=tok.expand(N, n).contiguous(),
        retrive_index=(t1.retrive_index + offs).contiguous(),
        retrive_next_token=t1.retrive_next_token.expand(N, n).contiguous(),
        retrive_next_sibling=t1.retrive_next_sibling.expand(N, n).contiguous(),
        uniform_samples=torch.rand(N, n, generator=g),
        uniform_samples_for_final_sampling=torch.rand(N, generator=g),
        target_logits=logits.expand(N, n, V).contiguous(),
        temperatures=torch.full((N,), T),
        top_ks=torch.full((N,), k, dtype=torch.int32),
        top_ps=torch.full((N,), p),
        min_ps=torch.full((N,), mp),
    )
    case.update(override)
    got = run_op(case, device)
    first = got["predicts"][case["retrive_index"][:, 0]].long()
    # token after node 1, for requests that accepted node 1
    on1 = (got["accept_token_num"] >= 1) & (got["accept_index"][:, 1].long() == case["retrive_index"][:, 1])
    after1 = got["predicts"][case["retrive_index"][on1, 1]].long()
    return first, after1, rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(LOSSLESS))
def test_first_token_follows_filtered_row(name, device):
    first, after1, rows = _lossless_run(name, device)
    V = rows.shape[1]
    stat, dof = pearson(torch.bincount(first, minlength=V), rows[0], "first token")
    crit = chi2_isf(ALPHA / 2, dof)
    assert dof > 0 and stat < crit, f"first token: chi2={stat:.1f} > {crit:.1f} (p={chi2_sf(stat, dof):.2g})"
    assert after1.numel() > 1000
    stat, dof = pearson(torch.bincount(after1, minlength=V), rows[1], "token after node 1")
    crit = chi2_isf(ALPHA / 2, dof)
    assert dof > 0 and stat < crit, f"token after node 1: chi2={stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("ignored, name", [("top_p", "all_filters"), ("top_k", "all_filters"),
                                           ("min_p", "min_p_binds"), ("temperature", "all_filters")])
def test_ignoring_a_filter_is_detected(ignored, name):
    override = {"top_p": {"top_ps": None}, "top_k": {"top_ks": None}, "min_p": {"min_ps": None},
                "temperature": {"temperatures": torch.full((N,), 1.0)}}[ignored]
    first, _, rows = _lossless_run(name, "cpu", **override)
    counts = torch.bincount(first, minlength=rows.shape[1]).double()
    # pearson() refuses samples on probability-0 cells (which is itself a detection); measure the
    # statistic on the support, and count the samples off it.
    off = float(counts[rows[0] == 0].sum())
    stat, dof = pearson(torch.where(rows[0] > 0, counts, torch.zeros_like(counts)), rows[0], "first token")
    crit = chi2_isf(ALPHA, dof)
    assert off > 0 or stat > POWER_FACTOR * crit, f"ignoring {ignored}: off-support {off}, chi2={stat:.0f} crit={crit:.1f}"


# --------------------------------------------------------------------------------------------
# GPU: the public op against the reference
# --------------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 8, 7), (16, 8, 1031), (64, 8, 4099), (8, 64, 257), (4, 16, 32000)]


@gpu
@needs_cuda
@needs_op
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("bs, n, V", GPU_SHAPES)
def test_kernel_matches_reference_within_tolerance(bs, n, V, dtype):
    g = torch.Generator().manual_seed(bs * 1000 + n * 10 + V)
    ties = 0
    for style in ("mixed", "sampling"):
        case = make_logits_case(bs, n, V, g, dtype, style=style, dup=True)
        for ts, ta in [(1.0, 1.0), (0.5, 0.7)]:
            ties += check_outputs(case, run_op(case, "cuda", ts, ta), ts, ta)
    assert ties <= max(1, bs // 16), f"{ties} decisions at ties: more than rounding explains"


@gpu
@needs_cuda
@needs_op
@pytest.mark.parametrize("seed", range(4))
def test_kernel_hostile_logits_and_parameters(seed):
    g = torch.Generator().manual_seed(300 + seed)
    for n, V in [(8, 9), (5, 1), (12, 1031)]:
        case = make_logits_case(48, n, V, g, DTYPES[seed % 3], style="hostile", hostile_logits=True, dup=True)
        for ts, ta in [(1.0, 1.0), (0.0, 0.0)]:
            got = run_op(case, "cuda", ts, ta)
            _check_sane(case, got)
            check_outputs(case, got, ts, ta)


@gpu
@needs_cuda
@needs_op
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
def test_kernel_greedy_is_exact_even_on_malformed_trees(dtype):
    g = torch.Generator().manual_seed(400)
    for n, V in [(8, 13), (16, 257), (64, 4099)]:
        case = make_logits_case(64, n, V, g, dtype, style="mixed", hostile_logits=True, dup=True)
        case["temperatures"] = torch.tensor([[0.0, -1.0, NAN, 1e-7][i % 4] for i in range(64)])
        assert_exact(case, run_op(case, "cuda"))
        bad = _malformed(clone_case(case), g)
        assert_exact(bad, run_op(bad, "cuda"))


@gpu
@needs_cuda
@needs_op
def test_kernel_is_deterministic():
    g = torch.Generator().manual_seed(500)
    case = make_logits_case(64, 8, 32000, g, torch.bfloat16, style="mixed")
    a, b = run_op(case, "cuda"), run_op(case, "cuda")
    for key in OUTPUTS:
        assert torch.equal(a[key], b[key])


@gpu
@needs_cuda
@needs_op
@pytest.mark.parametrize("V", [128256, 151936])
def test_kernel_large_vocabulary(V):
    g = torch.Generator().manual_seed(V)
    for dtype in (torch.bfloat16, torch.float32):
        case = make_logits_case(4, 8, V, g, dtype, style="mixed")
        check_outputs(case, run_op(case, "cuda"))


# --------------------------------------------------------------------------------------------
# The public op's argument handling (CPU; every device)
# --------------------------------------------------------------------------------------------


@needs_op
def test_public_op_checks_arguments_and_validates_content():
    g = torch.Generator().manual_seed(600)
    case = make_logits_case(4, 8, 19, g, style="mixed")
    c = clone_case(case)
    c["target_logits"] = c["target_logits"].double()
    with pytest.raises(TypeError, match="target_logits"):
        OP(*(c[key] for key in OUTPUTS + INPUTS))
    c = clone_case(case)
    with pytest.raises(TypeError, match="top_ks"):
        OP(*(c[key] for key in OUTPUTS + INPUTS), top_ks=c["top_ks"].long())
    with pytest.raises(ValueError, match="threshold_acc"):
        OP(*(c[key] for key in OUTPUTS + INPUTS), threshold_acc=1.5)
    OP(*(c[key] for key in OUTPUTS + INPUTS), top_ks=c["top_ks"], validate=True)  # a valid case passes
    c = clone_case(case)
    c["retrive_next_token"][1, 3] = 0  # the root as a child: not a tree
    with pytest.raises(ValueError, match="tree"):
        OP(*(c[key] for key in OUTPUTS + INPUTS), validate=True)
    c = clone_case(case)
    child = int(c["retrive_next_token"][2, 0])
    c["candidates"][2, child] = 19  # outside the vocabulary, which target_logits carries
    with pytest.raises(ValueError, match=r"not a token id in \[0, V=19\) \(V = target_logits.shape\[2\]\)"):
        OP(*(c[key] for key in OUTPUTS + INPUTS), validate=True)


# --------------------------------------------------------------------------------------------
# GPU: broad random coverage, paths, graphs, large shapes
# --------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@needs_op
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("seed", range(8))
def test_kernel_many_random_cases(seed, dtype):
    """About 3000 random requests in all: vocabularies from 2 to 50000, every parameter style,
    exact ties, thresholds below 1."""
    g = torch.Generator().manual_seed(700 + seed * 3 + DTYPES.index(dtype))
    V = [2, 97, 1031, 6007, 20011, 50000, 383, 4096][seed]
    n = [8, 12, 8, 16, 8, 8, 32, 8][seed]
    style = ["mixed", "sampling", "hostile"][seed % 3]
    case = make_logits_case(64, n, V, g, dtype, style=style, hostile_logits=seed % 4 == 3, dup=True)
    ties = 0
    for ts, ta in [(1.0, 1.0), (0.6, 0.8)]:
        got = run_op(case, "cuda", ts, ta)
        _check_sane(case, got)
        ties += check_outputs(case, got, ts, ta)
    assert ties <= 8


@gpu
@needs_cuda
@needs_op
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_kernel_qwen_vocabulary_bs64(dtype):
    """V = 151936 at bs = 64 (a four-block cluster per request on an H200, one block without clusters)."""
    g = torch.Generator().manual_seed(151936 + DTYPES.index(dtype))
    case = make_logits_case(64, 8, 151936, g, dtype, style="mixed")
    got = run_op(case, "cuda")
    _check_sane(case, got)
    assert check_outputs(case, got) <= 4


@gpu
@needs_cuda
@needs_op
@pytest.mark.parametrize("bs, n, V", [(3, 8, 40000), (2, 8, 151937), (5, 12, 9001)])
def test_kernel_without_clusters(bs, n, V, monkeypatch):
    """The one-block-per-request path at shapes that use clusters on sm_90 (shapes used by no other
    test: launch records are kept per shape)."""
    from cupy_spec import _launch

    monkeypatch.setattr(_launch, "CLUSTERS", False)
    g = torch.Generator().manual_seed(bs + n + V)
    for dtype in DTYPES:
        case = make_logits_case(bs, n, V, g, dtype, style="mixed", dup=True)
        check_outputs(case, run_op(case, "cuda"))


@gpu
@needs_cuda
@needs_op
def test_kernel_edge_paths_exact():
    """Paths with an exact answer: a root whose retrive_index is out of range (only accept_index[b, 0]
    and accept_token_num written); twelve tied maxima whose float32 probabilities sum below the
    largest coin, so every child is rejected and the residual is empty (token V - 1)."""
    g = torch.Generator().manual_seed(800)
    V, n, bs = 40, 13, 6
    case = make_logits_case(bs, n, V, g, style="sampling")
    case["retrive_index"][0, 0] = -3
    case["retrive_index"][1, 0] = 10**9
    x = torch.full((bs, n, V), float("-inf"))
    x[:, :, 3:15] = 2.5  # twelve tied maxima
    case["target_logits"] = x
    case["top_ks"] = torch.tensor([0, 5, 12, 0, 30, 0], dtype=torch.int32)  # ties kept: always all twelve
    case["top_ps"] = torch.tensor([1.0, 0.5, 1.0, 0.99, 1.0, 1.0])
    case["min_ps"] = torch.zeros(bs)
    case["retrive_next_token"][:] = -1
    case["retrive_next_sibling"][:] = -1
    case["retrive_next_token"][:, 0] = 1
    for i in range(1, 12):
        case["retrive_next_sibling"][:, i] = i + 1
    case["candidates"][:, 1:13] = torch.arange(3, 15)
    case["uniform_samples"][:] = 1.0  # clamped to the largest float32 below 1
    case["accept_index"] = torch.full((bs, 2), POISON, dtype=torch.int32)
    ref = run_reference(case)
    assert ref["accept_token_num"][2:].tolist() == [0] * (bs - 2)
    assert ref["predicts"][[2 * n, 3 * n, 4 * n, 5 * n]].tolist() == [V - 1] * 4
    assert_exact(case, run_op(case, "cuda"), ref=ref)


@gpu
@needs_cuda
@needs_op
def test_kernel_cuda_graph_replay():
    """Captured once per shape (one with clusters, one without), replayed on new inputs copied into
    the captured tensors: equal to eager calls, and correct."""
    for bs, n, V, dtype in [(4, 8, 32000, torch.bfloat16), (96, 8, 1031, torch.float32)]:
        g = torch.Generator().manual_seed(900 + bs)
        first = make_logits_case(bs, n, V, g, dtype, style="mixed", S=4)
        static = clone_case(first, "cuda")
        args = [static[key] for key in OUTPUTS + INPUTS]
        graph, _ = captured(lambda: OP(*args, top_ks=static["top_ks"], top_ps=static["top_ps"], min_ps=static["min_ps"]))
        for _ in range(3):
            case = make_logits_case(bs, n, V, g, dtype, style="mixed", dup=True, S=4)
            for key, v in case.items():
                static[key].copy_(v)
            graph.replay()
            torch.cuda.synchronize()
            got = {key: static[key].cpu() for key in OUTPUTS}
            eager = run_op(case, "cuda")
            for key in OUTPUTS:
                assert torch.equal(got[key], eager[key]), key
            check_outputs(case, got)


@gpu
@needs_cuda
@needs_op
def test_kernel_offsets_beyond_2_31():
    """bs * n * V = 2.5e9 bfloat16 logits: request 7's rows start past 2**31 elements and 2**32 bytes.
    Each request walks a chain 0 -> 1 -> 2 -> 3 whose tokens are the rows' (unique) maxima: greedy
    and top-k 1 sampling requests accept all three and emit the last row's maximum."""
    bs, n, V, S = 8, 2048, 151936, 4
    g = torch.Generator().manual_seed(2**31)
    logits = torch.zeros(bs, n, V, dtype=torch.bfloat16, device="cuda")
    hot = torch.randint(0, V, (bs, S), generator=g)
    for b in range(bs):
        for i in range(S):
            row = torch.randn(V, generator=g) * 2.0
            row[hot[b, i]] = 30.0
            logits[b, i] = row.to(torch.bfloat16).cuda()
    nt = torch.full((bs, n), -1, dtype=torch.long)
    nt[:, :S - 1] = torch.arange(1, S)
    cand = torch.randint(0, V, (bs, n), generator=g)
    cand[:, 1:S] = hot[:, : S - 1]
    for temps, k in [(torch.zeros(bs), None), (torch.full((bs,), 0.8), torch.ones(bs, dtype=torch.int32))]:
        case = dict(
            predicts=torch.full((bs * n,), POISON, dtype=torch.int32),
            accept_index=torch.full((bs, S), POISON, dtype=torch.int32),
            accept_token_num=torch.full((bs,), POISON, dtype=torch.int32),
            candidates=cand, retrive_index=torch.arange(bs * n).view(bs, n), retrive_next_token=nt,
            retrive_next_sibling=torch.full((bs, n), -1, dtype=torch.long),
            uniform_samples=torch.rand(bs, n, generator=g),
            uniform_samples_for_final_sampling=torch.rand(bs, generator=g),
            temperatures=temps, top_ks=k, top_ps=None, min_ps=None)
        c = clone_case({key: v for key, v in case.items()}, "cuda")
        OP(*(c[key] for key in OUTPUTS + INPUTS[:-2]), logits, c["temperatures"], top_ks=c["top_ks"])
        assert c["accept_token_num"].tolist() == [S - 1] * bs
        assert torch.equal(c["accept_index"].cpu(), case["retrive_index"][:, :S].int())
        pred = c["predicts"].cpu().view(bs, n)
        assert torch.equal(pred[:, :S], hot.int())  # accepted tokens (maxima of rows 0..2), then row 3's maximum
        assert bool((pred[:, S:] == POISON).all())


@gpu
@needs_cuda
@needs_op
def test_kernel_vocabulary_limit_is_a_clear_error():
    """V = 2**23 + 1 exceeds the kernel's limit (fixed-point top-p masses): a ValueError naming V,
    before anything is launched (the outputs stay poisoned)."""
    V = (1 << 23) + 1
    case = make_logits_case(1, 2, 5, torch.Generator().manual_seed(23))
    c = clone_case(case, "cuda")
    logits = torch.zeros(1, 2, V, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"dimension V = 8388609 .*limit of 8388608"):
        OP(*(c[key] for key in OUTPUTS + INPUTS[:-2]), logits, c["temperatures"])
    assert bool((c["predicts"] == POISON).all())
