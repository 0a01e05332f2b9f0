"""Timing of ``tree_speculative_sampling_from_logits`` against the torch pipeline it replaces: part of
``python -m cupy_spec bench`` (bfloat16 logits), and on its own:

    python examples/bench_from_logits.py            # full grid, bfloat16 logits (~30 s of timing on an H200)
    python examples/bench_from_logits.py --quick    # 4 points
    python examples/bench_from_logits.py --dtype float32
    python examples/bench_from_logits.py --json fl.json --plot fl.png

Grid: V in {32000, 128256, 151936}, n in {8, 64} (EAGLE-like trees, S = 4 / 7), bs in {1, 4, 16, 64,
256}; every request samples with T = 0.7, top_k = 50, top_p = 0.9. Inputs: logits ``randn * 2`` with
one hot token per row (+10), candidates drawn from their parent's tempered row.

* ``op``: ``tree_speculative_sampling_from_logits`` on the logits.
* ``torch``: ``softmax(logits / T)``, top-k renormalisation (``torch.topk``), top-p renormalisation
  (full-row ``torch.sort`` and ``cumsum``, keeping the token that crosses top_p), all on full
  [bs, n, V] float32 rows, then ``tree_speculative_sampling_target_only`` on the result.

Timing: each variant is captured into a CUDA graph (10 back-to-back calls when one call is short, so
that the host's replay cost is not what is measured, else 1), replayed between two CUDA events; the
median over 21 such timings, per call, in µs. Floors assume 4.0e12 bytes/s of read bandwidth:
``floor all`` reads the whole [bs, n, V] logits tensor once (what any pipeline that filters every
row must read), ``floor 1 row`` one row per request (the least the op reads: the root's row).

The plot adds, at V = 151936 and n = 8, the pipeline serving engines run today (FlashInfer's softmax
with temperature, its top-k and top-p renormalisation kernels, then sgl-kernel's tree op), measured
on an H200 outside this bench (``PIPELINE_H200_US``), and a tenth of it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import cupy_spec

from . import tree
from .bench import plot_panels, replay_median_us, walk_inputs
from .tree_speculative_sampling_from_logits import tree_speculative_sampling_from_logits

VOCABS = [32000, 128256, 151936]
NS = [8, 64]
BATCHES = [1, 4, 16, 64, 256]
TREES = {8: (4, 2), 64: (7, 4)}  # n -> (S, topk of the EAGLE tree), as cupy_spec.bench
TEMPERATURE, TOP_K, TOP_P = 0.7, 50, 0.9
READ_BANDWIDTH = 4.0e12  # bytes/s
REPEATS = 21
#: µs per step of FlashInfer's softmax + top-k + top-p renormalisation and sgl-kernel's tree op,
#: CUDA-graph replay on one H200, V = 151936, n = 8, per batch size (not measured by this bench).
PIPELINE_H200_US = {1: 192.0, 4: 262.0, 16: 730.0, 64: 2330.0, 256: 8977.0}


def make_inputs(bs: int, n: int, V: int, dtype: torch.dtype, seed: int = 0) -> dict:
    S, topk = TREES[n]
    t = tree.eagle_tree(bs, n, S - 1, topk, generator=torch.Generator().manual_seed(seed), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(bs, n, V, device="cuda", generator=g).mul_(2.0)
    hot = torch.randint(0, V, (bs, n, 1), device="cuda", generator=g)
    logits.scatter_add_(2, hot, torch.full((bs, n, 1), 10.0, device="cuda"))
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    cand = tree.sample_candidates(t, probs, generator=g)
    del probs
    return dict(
        **walk_inputs(t, cand, g),
        target_logits=logits.to(dtype),
        temperatures=torch.full((bs,), TEMPERATURE, device="cuda"),
        top_ks=torch.full((bs,), TOP_K, dtype=torch.int32, device="cuda"),
        top_ps=torch.full((bs,), TOP_P, device="cuda"),
    )


def walk_args(d: dict) -> tuple:
    return (d["predicts"], d["accept_index"], d["accept_token_num"], d["candidates"], d["retrive_index"],
            d["retrive_next_token"], d["retrive_next_sibling"], d["uniform_samples"],
            d["uniform_samples_for_final_sampling"])


def run_op(d: dict) -> None:
    tree_speculative_sampling_from_logits(*walk_args(d), d["target_logits"], d["temperatures"],
                                          top_ks=d["top_ks"], top_ps=d["top_ps"])


def run_torch(d: dict) -> None:
    """The unfused pipeline on materialised float32 rows (the temperatures, k and p of the inputs;
    one k for the whole batch, as torch.topk needs)."""
    x = d["target_logits"].float() / d["temperatures"][:, None, None]
    probs = torch.softmax(x, dim=-1)
    del x
    kth = torch.topk(probs, TOP_K, dim=-1).values[..., -1:]
    probs = torch.where(probs >= kth, probs, torch.zeros((), device=probs.device))
    probs = probs / probs.sum(dim=-1, keepdim=True)
    srt, idx = torch.sort(probs, dim=-1, descending=True)
    before = srt.cumsum(dim=-1) - srt  # mass of the tokens ranked above
    srt = srt.masked_fill(before > d["top_ps"][:, None, None], 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, idx, srt)
    del srt, idx, before
    probs = probs / probs.sum(dim=-1, keepdim=True)
    cupy_spec.tree_speculative_sampling_target_only(*walk_args(d), probs, None)


_streams: list = []


def _capture_stream() -> torch.cuda.Stream:
    """One stream for every warm-up and capture: its per-stream scratch (used by the target-only op
    of the torch pipeline) is assigned by an eager call, never first inside a capture."""
    if not _streams:
        _streams.append(torch.cuda.Stream())
    return _streams[0]


def graph_us(fn) -> float:
    """Median µs per call over REPEATS timings of CUDA-graph replays (see the module docstring)."""
    side = _capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = 10 if time.perf_counter() - t0 < 1e-3 else 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    replays = max(1, min(20, int(2e-3 / max(one, 1e-6))))  # about 2 ms or more per timing
    return replay_median_us(graph, calls, replays, REPEATS)


def _torch_us(d: dict):
    """The torch pipeline's time, or None where its full-row sort does not fit in GPU memory (it
    needs several [bs * n, V] float32 tensors: 24 GiB each at V = 151936, n = 64, bs = 256)."""
    try:
        return graph_us(lambda: run_torch(d))
    except torch.cuda.OutOfMemoryError:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return None


def run(quick: bool = False, dtype: torch.dtype = torch.bfloat16, out=sys.stdout) -> list[dict]:
    """Times every grid point; prints one table row per point as it goes and returns the rows."""
    cupy_spec.warmup()
    points = ([(32000, 8, 1), (32000, 8, 64), (151936, 8, 16), (151936, 64, 256)] if quick else
              [(V, n, bs) for V in VOCABS for n in NS for bs in BATCHES])
    es = torch.tensor([], dtype=dtype).element_size()
    header = (f"{'V':>7} {'n':>3} {'bs':>4} | {'op us':>9} {'torch us':>10} {'torch/op':>8} | "
              f"{'floor all':>9} {'floor 1 row':>11} {'op/1 row':>8}")
    print(f"tree_speculative_sampling_from_logits, {str(dtype).replace('torch.', '')} logits, T={TEMPERATURE}, "
          f"top_k={TOP_K}, top_p={TOP_P}; floors at {READ_BANDWIDTH:.1e} B/s read", file=out)
    print(header, file=out)
    print("-" * len(header), file=out, flush=True)
    rows, start = [], time.perf_counter()
    for V, n, bs in points:
        d = make_inputs(bs, n, V, dtype, seed=V + n + bs)
        op_us = graph_us(lambda: run_op(d))
        assert bool(((d["accept_token_num"] >= 0) & (d["accept_token_num"] < d["accept_index"].shape[1])).all())
        torch_us = _torch_us(d)
        floor_all = bs * n * V * es / READ_BANDWIDTH * 1e6
        floor_row = bs * V * es / READ_BANDWIDTH * 1e6
        rows.append(dict(V=V, n=n, bs=bs, op_us=op_us, torch_us=torch_us, floor_all_us=floor_all,
                         floor_row_us=floor_row))
        vs_torch = (f"{'no memory':>10} {'-':>8}" if torch_us is None else
                    f"{torch_us:>10.1f} {torch_us / op_us:>7.1f}x")
        print(f"{V:>7} {n:>3} {bs:>4} | {op_us:>9.1f} {vs_torch} | "
              f"{floor_all:>9.1f} {floor_row:>11.2f} {op_us / floor_row:>7.1f}x", file=out, flush=True)
        del d
        torch.cuda.empty_cache()
    print(f"({time.perf_counter() - start:.0f} s)", file=out)
    return rows


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """One panel per vocabulary size: the op and the torch pipeline per batch size (n = 8 solid,
    n = 64 dashed), the bytes floor of reading all logits once, and the serving pipeline's figures
    where known. Needs matplotlib."""

    def pipeline(ax, V):
        if V == 151936:
            bs = sorted(PIPELINE_H200_US)
            ax.plot(bs, [PIPELINE_H200_US[b] for b in bs], "x-", color="C3", label="FlashInfer + sgl-kernel n=8")
            ax.plot(bs, [PIPELINE_H200_US[b] / 10 for b in bs], ":", color="C3", label="a tenth of it")

    series = [("op_us", "o", "C0", "fused op"), ("torch_us", "s", "C1", "torch pipeline"),
              ("floor_all_us", "", "grey", "read all logits once")]
    plot_panels(rows, series, path, title, "µs per step (graph replay)", pipeline)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Timing of tree_speculative_sampling_from_logits against "
                                 "the torch pipeline it replaces.")
    ap.add_argument("--quick", action="store_true", help="four points instead of the 30-point grid")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib: the plot extra)")
    args = ap.parse_args(argv)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            ap.error(f"{option} {path}: folder {os.path.dirname(os.path.abspath(path))} does not exist")
    if not torch.cuda.is_available():
        if args.json or args.plot:
            print("error: no CUDA GPU here, so nothing was timed and no --json / --plot file was written",
                  file=sys.stderr)
            return 1
        print("OK: no CUDA GPU here, nothing timed (the benchmark needs one)")
        return 0
    rows = run(args.quick, getattr(torch, args.dtype))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot, f"{torch.cuda.get_device_name()}, {args.dtype} logits, T={TEMPERATURE}, "
             f"top_k={TOP_K}, top_p={TOP_P}")
    print(f"OK: {len(rows)} points timed; the op is faster than the torch pipeline at "
          f"{sum(r['torch_us'] is not None and r['torch_us'] > r['op_us'] for r in rows)} of them"
          f"{'' if all(r['torch_us'] is not None for r in rows) else ' (the torch pipeline did not fit at some)'}")
    return 0
