"""``python -m cupy_spec bench``: correctness check, then CUDA-graph timings over the docs/contract.md §3 grid.

Inputs are realistic: EAGLE-like trees, peaked target rows (one of the first 64 tokens boosted by
+14 logits over randn * 2) and candidates drawn from their parent's row. Every grid point is first
checked against the torch reference run on the same GPU.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import torch

from . import _launch, reference, tree
from .tree_speculative_sampling_target_only import tree_speculative_sampling_target_only as op

# docs/contract.md §3 anchors (sgl-kernel AOT kernel, H200): smaller of the random-row and peaked-row tables.
ANCHOR = {
    (32000, 8): [9.6, 13.4, 16.1, 18.1, 43.3],
    (128256, 8): [25.4, 53.1, 58.5, 77.7, 152.7],
    (151936, 8): [30.5, 47.0, 68.2, 92.4, 192.2],
    (32000, 64): [11.6, 15.7, 19.1, 19.7, 49.7],
    (128256, 64): [51.7, 37.8, 56.4, 79.6, 175.5],
    (151936, 64): [50.9, 53.3, 65.8, 95.7, 207.4],
}
BATCHES = [1, 4, 16, 64, 256]
FLOOR_BANDWIDTH = 4.23e12  # docs/contract.md §3: copy bandwidth (read + write) of one H200, bytes/s
TREES = {8: (4, 2), 64: (7, 4)}  # n -> (S, topk)


def make_inputs(bs: int, n: int, V: int, seed: int = 0, draft: bool = True) -> dict:
    S, topk = TREES.get(n, (4, 2))
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = tree.eagle_tree(bs, n, S - 1, topk, generator=torch.Generator().manual_seed(seed), device="cuda")
    logits = torch.randn(bs, n, V, device="cuda", generator=g).mul_(2.0)
    hot = torch.randint(0, min(64, V), (bs, n, 1), device="cuda", generator=g)
    logits.scatter_add_(2, hot, torch.full((bs, n, 1), 14.0, device="cuda"))
    probs = torch.softmax(logits, dim=-1)
    del logits
    cand = tree.sample_candidates(t, probs, generator=g)
    return dict(**walk_inputs(t, cand, g), target_probs=probs, draft_probs=torch.zeros_like(probs) if draft else None)


def walk_inputs(t, cand: torch.Tensor, g: torch.Generator) -> dict:
    """The tree arguments that every verification op shares, in signature order, on the GPU:
    outputs (predicts [bs*n] and accept_index [bs, S] at -1, accept_token_num [bs] at 0), the
    candidates [bs, n] and trees ``t`` (a :class:`cupy_spec.tree.Tree`), coins drawn from ``g``."""
    bs, n = cand.shape
    return dict(
        predicts=torch.full((bs * n,), -1, dtype=torch.int32, device="cuda"),
        accept_index=torch.full((bs, t.S), -1, dtype=torch.int32, device="cuda"),
        accept_token_num=torch.zeros(bs, dtype=torch.int32, device="cuda"),
        candidates=cand,
        retrive_index=t.retrive_index,
        retrive_next_token=t.retrive_next_token,
        retrive_next_sibling=t.retrive_next_sibling,
        uniform_samples=torch.rand(bs, n, device="cuda", generator=g),
        uniform_samples_for_final_sampling=torch.rand(bs, device="cuda", generator=g),
    )


def _args(d: dict) -> tuple:
    return tuple(d.values())


def _fresh(d: dict) -> dict:
    return {k: (None if v is None else v.clone()) for k, v in d.items()}


def check(d: dict) -> int:
    """Kernel vs reference (both on the GPU): exact, except final tokens at rounding ties.
    Returns the number of ties; raises AssertionError on a mismatch."""
    got, ref = _fresh(d), _fresh(d)
    op(*_args(got))
    r, coin = reference.tree_speculative_sampling_target_only(*_args(ref), return_residual=True)
    for k in ("accept_index", "accept_token_num") + (("draft_probs",) if d["draft_probs"] is not None else ()):
        assert torch.equal(got[k], ref[k]), f"{k} differs from the reference"
    bs = d["accept_token_num"].shape[0]
    final = ref["accept_index"][torch.arange(bs, device="cuda"), ref["accept_token_num"].long()].long()
    mask = torch.ones_like(got["predicts"], dtype=torch.bool)
    mask[final] = False
    assert torch.equal(got["predicts"][mask], ref["predicts"][mask]), "predicts differ off the final tokens"
    gk, rk = got["predicts"][final], ref["predicts"][final]
    slack = reference.final_token_slack(r, coin, gk)
    assert bool((slack[gk != rk] <= 2e-6).all()), "final token differs beyond a rounding tie"
    return int((gk != rk).sum())


def captured(fn, calls: int = 1) -> tuple:
    """(a CUDA graph of ``calls`` back-to-back calls of ``fn``, what the last captured call returned).
    ``fn`` runs once on a side stream first, so that its kernels are compiled and its launches planned
    outside the capture, as serving code warms up."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            result = fn()
    return g, result


def graph_time_us(fn, calls: int = 10, replays: int = 20, repeats: int = 15) -> float:
    """Median µs per call: a CUDA graph of ``calls`` back-to-back calls of ``fn`` is replayed
    ``replays`` times between two events; the median is over ``repeats`` such timings."""
    g, _ = captured(fn, calls)
    g.replay()
    torch.cuda.synchronize()
    return replay_median_us(g, calls, replays, repeats)


def replay_median_us(g, calls: int, replays: int, repeats: int) -> float:
    """Median µs per call of graph ``g`` (``calls`` calls per replay): ``replays`` replays between
    two CUDA events, ``repeats`` times."""
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        times.append(1000.0 * a.elapsed_time(b) / (replays * calls))
    return statistics.median(times)


def host_us(fn, calls: int = 100, repeats: int = 5) -> float:
    """Host time per eager call, the best of ``repeats`` loops of ``calls`` calls (see host_us_each)."""
    return host_us_each({"fn": fn}, calls, repeats)["fn"]


def host_us_each(fns: dict, calls: int = 100, rounds: int = 5) -> dict:
    """Host time per eager call of each function, by name: the best of ``rounds`` loops of
    ``calls`` calls, one loop of every function per round, so that a slow stretch of the host
    weighs on all of them alike. Before each loop the GPU is kept busy (a sleep kernel longer than
    the loop) so that launches only queue up: otherwise a loop of calls measures the GPU time per
    call."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU clock cycles
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    torch.cuda.synchronize()
    return {name: 1e6 * t / calls for name, t in best.items()}


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    x = torch.ones(1 << 28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    us = graph_time_us(lambda: y.copy_(x), calls=2, replays=5, repeats=5)
    return 2 * 4 * x.numel() / (us * 1e-6)


def read_bandwidth() -> float:
    """Read bandwidth in bytes/s of torch's sum over 1 GiB: what a streaming reduction can reach."""
    x = torch.ones(1 << 28, dtype=torch.float32, device="cuda")
    us = graph_time_us(lambda: x.sum(), calls=2, replays=5, repeats=5)
    return 4 * x.numel() / (us * 1e-6)


def trivial_us() -> float:
    x = torch.zeros(1, device="cuda")
    return graph_time_us(lambda: x.add_(1))


def ref_us(d: dict) -> float:
    args = _args(_fresh(d))
    reference.tree_speculative_sampling_target_only(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        reference.tree_speculative_sampling_target_only(*args)
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / 3


def run(quick: bool = False) -> dict:
    torch.manual_seed(0)
    from . import warmup

    warmup()
    bw = copy_bandwidth()
    read_bw = read_bandwidth()
    floor_bw = max(bw, FLOOR_BANDWIDTH)
    rows = []
    grid = [(V, n) for (V, n) in ANCHOR]
    batches = BATCHES
    if quick:
        grid = [(32000, 8), (151936, 8), (151936, 64)]
        batches = [1, 16, 256]
    for V, n in grid:
        for bs in batches:
            d = make_inputs(bs, n, V, seed=bs + n)
            ties = check(d)
            dn = dict(d, draft_probs=None)
            ties += check(dn)
            args, args_none = _args(d), _args(dn)
            t_draft = graph_time_us(lambda: op(*args))
            t_none = graph_time_us(lambda: op(*args_none))
            acc = d["accept_token_num"].float().mean().item()
            bonus = (d["accept_token_num"] == d["accept_index"].shape[1] - 1).sum().item()
            read = bs * V * 4 * 2 - bonus * V * 4  # target row + draft row unless bonus
            read_none = bs * V * 4
            anchor = ANCHOR[(V, n)][BATCHES.index(bs)]
            rows.append(
                dict(V=V, n=n, S=d["accept_index"].shape[1], bs=bs, us_draft=t_draft, us_none=t_none, anchor=anchor,
                     speedup=anchor / t_draft, floor_draft=1e6 * read / floor_bw, floor_none=1e6 * read_none / floor_bw,
                     gbps_draft=read / t_draft / 1e3, gbps_none=read_none / t_none / 1e3,
                     host_us=host_us(lambda: op(*args_none)), ref_us=ref_us(d) if bs <= 64 or quick else None,
                     accept_len=acc, ties=ties)
            )
            del d, dn
            torch.cuda.empty_cache()
            print(_fmt_row(rows[-1]), flush=True)
    x = torch.ones(16, device="cuda")
    return dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), copy_tbps=bw / 1e12,
                read_tbps=read_bw / 1e12,
                floor_tbps=floor_bw / 1e12,
                trivial_graph_us=trivial_us(), mul_host_us=host_us(lambda: x.mul_(1.0)),
                dependent_launch=_launch.pdl(torch.cuda.current_device()), rows=rows)


HEADER = ("| V | n,S | bs | µs draft | µs None | anchor | speedup | % floor (draft/None) | GB/s (draft/None) "
          "| host µs | torch ref µs | acc len |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def _fmt_row(r: dict) -> str:
    ref = f"{r['ref_us']:.0f}" if r["ref_us"] else "-"
    return (f"| {r['V']} | {r['n']},{r['S']} | {r['bs']} | {r['us_draft']:.1f} | {r['us_none']:.1f} | {r['anchor']} | "
            f"{r['speedup']:.1f}x | {100 * r['floor_draft'] / r['us_draft']:.0f}% / {100 * r['floor_none'] / r['us_none']:.0f}% | "
            f"{r['gbps_draft']:.0f} / {r['gbps_none']:.0f} | {r['host_us']:.1f} | {ref} | {r['accept_len']:.2f} |")


def table(result: dict) -> str:
    lines = [f"{result['gpu']}, {result['date']}: copy measured {result['copy_tbps']:.2f} TB/s, torch sum reads "
             f"{result['read_tbps']:.2f} TB/s, floors at "
             f"{result['floor_tbps']:.2f} TB/s, trivial graph kernel "
             f"{result['trivial_graph_us']:.2f} µs, torch mul_ host {result['mul_host_us']:.1f} µs/call, programmatic "
             f"dependent launch {'on' if result.get('dependent_launch') else 'off'}", "", HEADER]
    lines += [_fmt_row(r) for r in result["rows"]]
    return "\n".join(lines)


def plot_panels(rows: list, series: list, path: str, title: str, ylabel: str, extra=None) -> None:
    """Writes a PNG with one log-log panel per vocabulary size of ``rows`` (dicts with V, n, bs):
    per n (8 solid, 64 dashed) one line per ``series`` entry ``(key, marker, color, label)``, then
    ``extra(ax, V)`` for lines of its own; one legend under the panels. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Vs = sorted({r["V"] for r in rows})
    fig, axes = plt.subplots(1, len(Vs), figsize=(5 * len(Vs), 4.8), squeeze=False)
    for ax, V in zip(axes[0], Vs):
        for n, style in ((8, "-"), (64, "--")):
            rs = sorted((r for r in rows if r["V"] == V and r["n"] == n), key=lambda r: r["bs"])
            for key, marker, color, label in series if rs else ():
                ys = [math.nan if r[key] is None else r[key] for r in rs]  # None: not measured
                ax.plot([r["bs"] for r in rs], ys, marker + style, color=color, label=f"{label} n={n}")
        if extra is not None:
            extra(ax, V)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.set_title(f"V = {V}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(result: dict, path: str) -> None:
    series = [("us_draft", "o", "C0", "cupy_spec"), ("us_none", "s", "C2", "cupy_spec None"),
              ("anchor", "x", "C3", "sgl-kernel"), ("floor_draft", "", "grey", "bytes floor")]
    plot_panels(result["rows"], series, path, f"{result['gpu']} {result['date']}", "µs per call (graph replay)")


def main(quick: bool = False, json_path: str | None = None, plot_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 1
    from . import bench_from_logits, bench_sampling, bench_tree_ops

    result = run(quick)
    print(table(result))
    result["tree_ops"] = bench_tree_ops.run(quick)
    print()
    print(bench_tree_ops.table(result["tree_ops"]))
    result["sampling"] = bench_sampling.run(quick)
    print()
    print(bench_sampling.table(result["sampling"]))
    print()
    result["from_logits"] = bench_from_logits.run(quick)  # prints its table as it goes
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path:
        plot(result, plot_path)
        root, ext = os.path.splitext(plot_path)
        bench_from_logits.plot(result["from_logits"], f"{root}_from_logits{ext or '.png'}",
                               f"{result['gpu']} {result['date']}, tree_speculative_sampling_from_logits")
    return 0
