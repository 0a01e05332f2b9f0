"""Statistical tests: with thresholds 1.0/1.0 the op is lossless.

Speculative sampling is *lossless* when the tokens a verification step emits are distributed
exactly as if they had been sampled one by one from the target model. For the op (docs/contract.md §1) that
means, for one request with draft tree T and target rows q_i (row i = distribution after node i):

(a) the first emitted token (``predicts[retrive_index[b, 0]]``) is distributed as q_0;
(b) given that node c is on the accepted path, the token emitted after c
    (``predicts[retrive_index[b, c]]``) is distributed as q_c (whether it is a child token, and
    the walk goes on, or the correction / bonus token);
(c) the number of accepted draft tokens has an exact distribution that follows from T and the
    rows alone. With thresholds 1/1 and duplicate-free siblings the children of node i share one
    coin u: child number j (token t_j, p_j = q_i[t_j]) is accepted iff
    ``p_j > 0 and acc_{j-1} <= u < acc_j`` with ``acc_j = p_1 + ... + p_j``, so the walk moves from
    i to child c with probability exactly q_i[t_c] (up to float32 rounding of the partial sums,
    ~1e-7, far below the statistical resolution here). Hence node c is on the accepted path with
    probability ``reach(c) = prod of q_parent[t_child] over the edges root -> c``, and
    ``P(accept_token_num >= d) = sum of reach(c) over the nodes c at depth d``, from which the exact
    mean and variance follow (computed in float64 by enumerating the tree).

Every run batches N = 100 000 copies of one tree with the same target rows and independent coins
(fixed seed) into ONE call of the public op, then checks (a) and (b) with Pearson chi-square
goodness-of-fit tests and (c) with a z-test of the mean (exact variance) plus a chi-square test of
the accept-length histogram. Each test runs at significance ``ALPHA = 1e-4``; the per-node tests of
(b) share that level by Bonferroni (alpha / number of nodes tested). Cells with expected count
below 5 are pooled into one cell; tokens of probability 0 must never be emitted (checked exactly).

The chi-square tail is computed here without scipy: ``chi2_sf(x, k)`` is the regularised upper
incomplete gamma function Q(k/2, x/2), evaluated by its power series for x/2 < k/2 + 1 and by its
continued fraction (modified Lentz) otherwise, both to ~1e-14 relative accuracy; it is checked
against closed forms for k = 1, 2, 4 below. Critical values come from bisection on it.

Power: the same statistics computed on runs with ``threshold_single = 0.05`` (a child with
p >= 0.05 is accepted whenever the walk reaches it) or ``threshold_acc = 0.5`` (acceptance
probabilities doubled) must lie far beyond the critical values (at least ``POWER_FACTOR`` times).

Each case also checks the outputs for consistency: accepted nodes form a root path of the tree,
the token emitted after an accepted node is the next accepted node's draft token, and
``accept_index`` / ``predicts`` entries off the path are untouched.

GPU variants (``@pytest.mark.gpu``) repeat the lossless checks with CUDA tensors when available.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cupy_spec import tree_speculative_sampling_target_only
from cupy_spec import tree as spec_tree

N = 100_000  # requests per call
ALPHA = 1e-4  # significance level of every test
POWER_FACTOR = 10.0  # biased runs must exceed the critical value this many times
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are pooled
MIN_NODE_VISITS = 1_000  # (b) tests nodes reached at least this often in expectation

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]


# --------------------------------------------------------------------------------------------
# Chi-square and normal tails (no scipy)
# --------------------------------------------------------------------------------------------


def _gamma_q(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) = Gamma(a, x) / Gamma(a) for a > 0, x >= 0."""
    if x <= 0.0:
        return 1.0
    log_pre = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        # P(a, x) = x^a e^-x / Gamma(a + 1) * sum_k x^k / ((a + 1) ... (a + k))
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_pre))
    # Continued fraction for Q(a, x) (modified Lentz).
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(log_pre) * h


def chi2_sf(x: float, k: int) -> float:
    """P(X > x) for X ~ chi-square with k degrees of freedom."""
    return _gamma_q(k / 2.0, x / 2.0)


def chi2_isf(alpha: float, k: int) -> float:
    """Critical value c with chi2_sf(c, k) = alpha (bisection)."""
    lo, hi = 0.0, float(k) + 10.0
    while chi2_sf(hi, k) > alpha:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if chi2_sf(mid, k) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def normal_isf_two_sided(alpha: float) -> float:
    """z with P(|Z| > z) = alpha (bisection on erfc)."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if math.erfc(mid / math.sqrt(2.0)) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def test_chi2_sf_matches_closed_forms():
    for x in [0.0, 0.1, 1.0, 3.0, 7.5, 20.0, 60.0, 150.0]:
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10, abs=1e-300)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9, abs=1e-300)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-9, abs=1e-300)
    # Textbook critical values.
    assert chi2_isf(0.05, 1) == pytest.approx(3.841459, rel=1e-6)
    assert chi2_isf(0.01, 10) == pytest.approx(23.209251, rel=1e-6)
    assert chi2_isf(1e-4, 30) == pytest.approx(67.633, rel=1e-3)
    assert normal_isf_two_sided(0.05) == pytest.approx(1.959964, rel=1e-6)
    # Wilson-Hilferty agrees in the bulk for large k (independent sanity check of the tail).
    k, x = 200, 260.0
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    assert chi2_sf(x, k) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), rel=2e-2)


def pearson(observed: torch.Tensor, probs: torch.Tensor, what: str) -> tuple[float, int]:
    """Pearson chi-square of counts against probabilities (float64 [K], summing to ~1).

    Probability-0 cells must be empty (asserted). Cells with expected count < MIN_EXPECTED are
    pooled into one; if that pool is still below MIN_EXPECTED the smallest other cell joins it.
    Returns (statistic, degrees of freedom); dof 0 means nothing to test (e.g. no samples).
    """
    obs = observed.double()
    p = probs.double() / probs.double().sum()
    zero = p <= 0
    bad = obs[zero].sum().item()
    assert bad == 0, f"{what}: {int(bad)} samples fell on probability-0 cells {zero.nonzero().flatten().tolist()}"
    obs, p = obs[~zero], p[~zero]
    total = obs.sum().item()
    if total == 0:
        return 0.0, 0
    exp = p * total
    small = exp < MIN_EXPECTED
    cells_o = obs[~small].tolist()
    cells_e = exp[~small].tolist()
    pool_o, pool_e = obs[small].sum().item(), exp[small].sum().item()
    if small.any() and pool_e < MIN_EXPECTED and cells_e:
        j = min(range(len(cells_e)), key=cells_e.__getitem__)
        pool_o += cells_o.pop(j)
        pool_e += cells_e.pop(j)
    if small.any():
        cells_o.append(pool_o)
        cells_e.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e))
    return stat, len(cells_e) - 1


# --------------------------------------------------------------------------------------------
# Test cases: a tree, its draft tokens and the target rows (float32, exact zeros allowed)
# --------------------------------------------------------------------------------------------


def _rows(n: int, V: int, scale: float, keep: int | None, gen: torch.Generator) -> torch.Tensor:
    """n rows softmax(scale * randn), optionally only the top `keep` entries kept, float32."""
    r = torch.softmax(scale * torch.randn(n, V, generator=gen, dtype=torch.float64), dim=1)
    if keep is not None and keep < V:
        kth = r.topk(keep, dim=1).values[:, -1:]
        r = torch.where(r >= kth, r, torch.zeros_like(r))
    r = r.float()
    return r / r.sum(dim=1, keepdim=True)


def _tokens(parents: list[int], rows: torch.Tensor, zero_weight: float, gen: torch.Generator) -> torch.Tensor:
    """Draft tokens: children of node i are distinct draws from rows[i] (plus `zero_weight` on
    every token, so probability-0 tokens get drafted too); the root token is arbitrary."""
    n, V = rows.shape
    tok = torch.zeros(n, dtype=torch.int64)
    tok[0] = int(torch.randint(V, (1,), generator=gen))
    for i in range(n):
        kids = [c for c in range(1, n) if parents[c] == i]
        if kids:
            w = rows[i].double() + zero_weight
            tok[kids] = torch.multinomial(w, len(kids), replacement=False, generator=gen)
    return tok


def _case(name: str):
    """(parents, candidates [n], rows float32 [n, V]) of a named test case (deterministic)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "chain":  # a single path, depth 5, peaked top-12 rows
        parents = [-1, 0, 1, 2, 3, 4]
        rows = _rows(len(parents), 64, 2.5, 12, gen)
        tok = _tokens(parents, rows ** 4, 0.0, gen)  # likely tokens: deep paths get reached
    elif name == "star8":  # root with 8 leaf children, one of them a probability-0 token
        parents = [-1] + [0] * 8
        rows = _rows(len(parents), 40, 1.5, 30, gen)
        tok = _tokens(parents, rows, 0.0, gen)
        zero_tok = int((rows[0] == 0).nonzero()[0])
        tok[8] = zero_tok
    elif name == "deep_unbalanced":  # one branch of depth 6, a bushy one, a leaf
        parents = [-1, 0, 0, 0, 1, 4, 5, 6, 7, 2, 2, 9, 10, 10]
        rows = _rows(len(parents), 32, 2.0, None, gen)
        tok = _tokens(parents, rows ** 2, 0.0, gen)
    elif name == "zeros_onehot":  # contract example tree, top-3 rows, one-hot (greedy) rows, p=0 drafts
        parents = [-1, 0, 0, 1, 1, 2, 5, 3]
        rows = _rows(len(parents), 8, 1.0, 3, gen)
        rows[1] = 0.0
        rows[1, 5] = 1.0
        rows[6] = 0.0
        rows[6, 2] = 1.0
        tok = _tokens(parents, rows, 0.05, gen)
        tok[3] = 5  # node 1's first child: the one-hot token (always accepted)
        tok[4] = 6  # its sibling: probability 0
    elif name == "eagle":  # a random EAGLE-like tree from cupy_spec.tree, up to 3 children/node
        t = spec_tree.eagle_tree(1, 16, 4, 3, generator=gen)
        parents = t.parents[0].tolist()
        rows = _rows(len(parents), 24, 2.0, 20, gen)
        tok = _tokens(parents, rows, 0.01, gen)
    else:
        raise KeyError(name)
    return parents, tok, rows


CASES = ["chain", "star8", "deep_unbalanced", "zeros_onehot", "eagle"]


class Exact:
    """Exact (float64) quantities of one case under the lossless thresholds."""

    def __init__(self, parents, tok, rows):
        n, V = rows.shape
        q = rows.double()
        q = torch.where(q >= 1.1754943508222875e-38, q, torch.zeros_like(q))
        self.n, self.V = n, V
        self.rows = q / q.sum(dim=1, keepdim=True)
        self.parents = parents
        self.children = [[c for c in range(1, n) if parents[c] == i] for i in range(n)]
        depth = [0] * n
        reach = [1.0] * n
        for c in range(1, n):  # parents come before children in every case
            assert parents[c] < c
            depth[c] = depth[parents[c]] + 1
            reach[c] = reach[parents[c]] * float(q[parents[c], int(tok[c])])
        self.depth, self.reach = depth, reach
        self.S = max(depth) + 1
        # P(count >= d) for d = 0..S-1, then P(count = d), mean, variance.
        tail = [sum(r for r, dd in zip(reach, depth) if dd == d) for d in range(self.S)]
        self.length_probs = [tail[d] - (tail[d + 1] if d + 1 < self.S else 0.0) for d in range(self.S)]
        self.mean = sum(d * p for d, p in enumerate(self.length_probs))
        self.var = sum(d * d * p for d, p in enumerate(self.length_probs)) - self.mean**2


# --------------------------------------------------------------------------------------------
# Running the op on N copies of a case
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def run_case(name: str, device: str, threshold_single: float = 1.0, threshold_acc: float = 1.0):
    """One call of the public op on N copies of the case; returns CPU results for analysis."""
    parents, tok, rows = _case(name)
    n, V = rows.shape
    t1 = spec_tree.from_parents([parents])
    assert t1.parents[0].tolist() == parents
    S = t1.S
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(12345 + sum(map(ord, name)))
    offs = (torch.arange(N, dtype=torch.int64) * n)[:, None]
    retrive_index = (t1.retrive_index + offs).to(dev)
    next_token = t1.retrive_next_token.expand(N, n).contiguous().to(dev)
    next_sibling = t1.retrive_next_sibling.expand(N, n).contiguous().to(dev)
    candidates = tok.expand(N, n).contiguous().to(dev)
    target = rows.to(dev).expand(N, n, V).contiguous()
    coins = torch.rand(N, n, generator=gen).to(dev)
    final_coins = torch.rand(N, generator=gen).to(dev)
    predicts = torch.full((N * n,), -7, dtype=torch.int32, device=dev)
    accept_index = torch.full((N, S), -7, dtype=torch.int32, device=dev)
    accept_token_num = torch.full((N,), -7, dtype=torch.int32, device=dev)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num,
        candidates, retrive_index, next_token, next_sibling,
        coins, final_coins, target, None,
        threshold_single=threshold_single, threshold_acc=threshold_acc,
    )
    del target
    predicts, accept_index, count = predicts.cpu().long(), accept_index.cpu().long(), accept_token_num.cpu().long()

    # Consistency of the outputs (deterministic checks, not statistics).
    assert bool(((count >= 0) & (count < S)).all())
    j = torch.arange(S)[None, :]
    on_path = j <= count[:, None]
    node = accept_index - offs  # node ids along the path
    assert bool((node[on_path] >= 0).all() and (node[on_path] < n).all()), "accept_index outside the request"
    assert bool((accept_index[~on_path] == -7).all()), "accept_index written past accept_token_num"
    node = torch.where(on_path, node, torch.zeros_like(node))
    par = torch.tensor(parents)
    assert bool((node[:, 0] == 0).all())
    assert bool((par[node[:, 1:]] == node[:, :-1])[on_path[:, 1:]].all()), "accepted nodes do not form a root path"
    emitted = predicts[torch.where(on_path, accept_index, torch.zeros_like(accept_index))]  # [N, S]
    assert bool(((emitted >= 0) & (emitted < V))[on_path].all())
    follow = on_path[:, 1:]
    assert bool((emitted[:, :-1] == tok[node[:, 1:]])[follow].all()), "emitted token != accepted draft token"
    written = torch.zeros(N * n, dtype=torch.bool)
    written[accept_index[on_path]] = True
    assert bool((predicts[~written] == -7).all()), "predicts written off the accepted path"
    return {"count": count, "node": node, "on_path": on_path, "emitted": emitted, "n": n, "V": V}


def _root_stat(res, ex):
    counts = torch.bincount(res["emitted"][:, 0], minlength=ex.V)
    return pearson(counts, ex.rows[0], "first token")


def _node_stats(res, ex):
    """[(node, expected visits, stat, dof)] for every non-root node visited often enough."""
    out = []
    for c in range(1, ex.n):
        if N * ex.reach[c] < MIN_NODE_VISITS:
            continue
        d = ex.depth[c]
        hit = res["on_path"][:, d] & (res["node"][:, d] == c)
        nxt = res["emitted"][hit, d]
        stat, dof = pearson(torch.bincount(nxt, minlength=ex.V), ex.rows[c], f"token after node {c}")
        if dof > 0:
            out.append((c, N * ex.reach[c], stat, dof))
    return out


def _length_stats(res, ex):
    count = res["count"].double()
    z = (count.mean().item() - ex.mean) / math.sqrt(ex.var / N) if ex.var > 0 else 0.0
    hist = torch.bincount(res["count"], minlength=ex.S)
    stat, dof = pearson(hist, torch.tensor(ex.length_probs), "accept length")
    return count.mean().item(), z, stat, dof


def _report(msg):
    print(f"\n    {msg}", end="")


# --------------------------------------------------------------------------------------------
# Lossless tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_first_token_follows_root_row(name, device):
    ex = Exact(*_case(name))
    stat, dof = _root_stat(run_case(name, device), ex)
    crit = chi2_isf(ALPHA, dof)
    _report(f"(a) {name}/{device}: chi2={stat:.2f} dof={dof} crit={crit:.2f} p={chi2_sf(stat, dof):.3g}")
    assert dof > 0
    assert stat < crit, f"first token not distributed as the root row: chi2={stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_token_after_accepted_node_follows_its_row(name, device):
    ex = Exact(*_case(name))
    stats = _node_stats(run_case(name, device), ex)
    assert stats, "no node visited often enough"
    a = ALPHA / len(stats)
    worst = max(stats, key=lambda s: s[2] / chi2_isf(a, s[3]))
    c, visits, stat, dof = worst
    crit = chi2_isf(a, dof)
    _report(
        f"(b) {name}/{device}: {len(stats)} nodes tested (alpha {a:.1e} each); worst node {c} "
        f"(~{visits:.0f} visits): chi2={stat:.2f} dof={dof} crit={crit:.2f}"
    )
    for c, visits, stat, dof in stats:
        crit = chi2_isf(a, dof)
        assert stat < crit, f"token after node {c} not distributed as its row: chi2={stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_accept_length_matches_exact(name, device):
    ex = Exact(*_case(name))
    mean, z, stat, dof = _length_stats(run_case(name, device), ex)
    zcrit = normal_isf_two_sided(ALPHA / 2)  # two checks share ALPHA
    _report(
        f"(c) {name}/{device}: mean={mean:.4f} exact={ex.mean:.4f} z={z:+.2f} (|z|crit={zcrit:.2f}); "
        f"length hist chi2={stat:.2f} dof={dof} crit={chi2_isf(ALPHA / 2, max(dof, 1)):.2f}"
    )
    assert abs(z) < zcrit, f"mean accept length {mean:.4f} vs exact {ex.mean:.4f}: z={z:.1f}"
    if dof > 0:
        assert stat < chi2_isf(ALPHA / 2, dof)


# --------------------------------------------------------------------------------------------
# Power: biased thresholds must be detected by the same statistics
# --------------------------------------------------------------------------------------------

BIASED = [
    pytest.param({"threshold_single": 0.05}, id="single0.05"),
    pytest.param({"threshold_acc": 0.5}, id="acc0.5"),
]


@pytest.mark.parametrize("thresholds", BIASED)
@pytest.mark.parametrize("name", ["chain", "deep_unbalanced"])
def test_biased_thresholds_are_detected(name, thresholds):
    ex = Exact(*_case(name))
    res = run_case(name, "cpu", **thresholds)
    label = ",".join(f"{k}={v}" for k, v in thresholds.items())

    stat, dof = _root_stat(res, ex)
    crit = chi2_isf(ALPHA, dof)
    _report(f"power {name} {label}: (a) chi2={stat:.0f} crit={crit:.1f} ratio={stat / crit:.0f}")
    assert stat > POWER_FACTOR * crit

    stats = _node_stats(res, ex)
    a = ALPHA / len(stats)
    ratio = max(s[2] / chi2_isf(a, s[3]) for s in stats)
    _report(f"power {name} {label}: (b) max chi2/crit over {len(stats)} nodes = {ratio:.0f}")
    assert ratio > POWER_FACTOR

    mean, z, lstat, ldof = _length_stats(res, ex)
    zcrit = normal_isf_two_sided(ALPHA)
    _report(f"power {name} {label}: (c) mean={mean:.3f} exact={ex.mean:.3f} z={z:+.0f} (|z|crit={zcrit:.2f})")
    assert abs(z) > POWER_FACTOR * zcrit
