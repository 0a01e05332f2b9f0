"""Bench of the draft-probability ops: ``chain_speculative_sampling`` against the bytes it must read,
and ``tree_speculative_sampling`` against ``tree_speculative_sampling_target_only`` on the same trees.
Part of ``python -m cupy_spec bench``; every point is first checked against the reference."""

from __future__ import annotations

import importlib

import torch

from . import reference
from .bench import BATCHES, FLOOR_BANDWIDTH, graph_time_us, make_inputs

VOCABS = [32000, 128256, 151936]
K = 4  # draft tokens of the chain
# FlashInfer's chain_speculative_sampling measured on this kind of GPU at V=128256, k=4 (µs).
FLASHINFER_CHAIN = {1: 26.3, 16: 55.4, 64: 72.5}


def chain_inputs(bs: int, V: int, seed: int = 0) -> dict:
    """Peaked draft and target rows that agree often; drafts drawn from the draft rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(bs, K + 1, V, device="cuda", generator=g).mul_(2.0)
    hot = torch.randint(0, min(64, V), (bs, K + 1, 1), device="cuda", generator=g)
    logits.scatter_add_(2, hot, torch.full((bs, K + 1, 1), 12.0, device="cuda"))
    target = torch.softmax(logits, -1)
    draft = torch.softmax(logits[:, :K] + torch.randn(bs, K, V, device="cuda", generator=g), -1)
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(bs, K)
    return dict(draft_probs=draft, draft_token_ids=ids, target_probs=target,
                uniform_samples=torch.rand(bs, K + 1, device="cuda", generator=g))


def tree_inputs(bs: int, V: int, seed: int = 0) -> dict:
    """The target-only bench's trees (n = 8) and target rows, with draft rows ``softmax(randn)``
    drawn from their own generator (seeded from ``seed``, apart from the target's, so the walks
    depend on ``seed`` only, not on what the process drew before)."""
    t = make_inputs(bs, 8, V, seed=seed)
    g = torch.Generator(device="cuda").manual_seed((1 << 20) + seed)
    noise = torch.randn(t["target_probs"].shape, device="cuda", generator=g)
    return dict(t, draft_probs=torch.softmax(noise, -1))


def _check_chain(fn, d: dict) -> torch.Tensor:
    """Checks the op against the reference; returns the reference's emitted counts."""
    got = fn(d["draft_probs"], d["draft_token_ids"], d["target_probs"], uniform_samples=d["uniform_samples"])
    want = reference.chain_speculative_sampling(d["draft_probs"], d["draft_token_ids"], d["target_probs"],
                                                uniform_samples=d["uniform_samples"])
    for g, w in zip(got[1:], want[1:]):
        assert torch.equal(g, w), "chain counters differ from the reference"
    emitted = want[2]
    keep = torch.arange(K + 1, device="cuda")[None, :] < emitted[:, None]  # drafts; the final token may tie
    assert torch.equal(got[0][keep], want[0][keep]), "chain tokens differ from the reference"
    return emitted


def rows_read(d: dict, emitted: torch.Tensor) -> int:
    """Rows of V floats the chain op must read: per request rejected at position e < k, target and
    draft row e (the draft row only where x_e is a valid id, as it is subtracted only then); per
    request that accepted every draft, the bonus target row alone."""
    V = d["target_probs"].shape[-1]
    rejected = emitted < K
    x = d["draft_token_ids"].gather(1, emitted.clamp(max=K - 1).long()[:, None])[:, 0]
    subtract = rejected & (x >= 0) & (x < V)
    return int(emitted.numel() + subtract.sum())


def run(quick: bool = False) -> dict:
    import cupy_spec

    vocabs, batches = ([32000, 151936], [1, 16, 256]) if quick else (VOCABS, BATCHES)
    points = []
    for V in vocabs:
        for bs in batches:
            d = chain_inputs(bs, V, seed=bs)
            rows = rows_read(d, _check_chain(cupy_spec.chain_speculative_sampling, d))
            out = torch.empty(bs, K + 1, dtype=torch.int32, device="cuda")
            acc = torch.zeros(bs, dtype=torch.int32, device="cuda")
            emi = torch.zeros(bs, dtype=torch.int32, device="cuda")
            core = importlib.import_module("cupy_spec.chain_speculative_sampling")._core
            args = (d["draft_probs"], d["draft_token_ids"], d["target_probs"], d["uniform_samples"], out, acc, emi)
            chain = graph_time_us(lambda: core(*args))
            floor = 1e6 * rows * V * 4 / FLOOR_BANDWIDTH  # the rows that must be read
            t = tree_inputs(bs, V, seed=bs)
            targs = tuple(t.values())
            tree_r = graph_time_us(lambda: cupy_spec.tree_speculative_sampling(*targs[:11], True))
            tree_nr = graph_time_us(lambda: cupy_spec.tree_speculative_sampling(*targs[:11], False))
            target_only = graph_time_us(lambda: cupy_spec.tree_speculative_sampling_target_only(*targs))
            points.append(dict(V=V, bs=bs, chain_us=chain, chain_rows=rows, chain_floor_us=floor,
                               flashinfer_us=FLASHINFER_CHAIN.get(bs) if V == 128256 else None, tree_repl_us=tree_r,
                               tree_norepl_us=tree_nr, target_only_us=target_only))
            del d, t, targs
            torch.cuda.empty_cache()
    return dict(rows=points)


def table(result: dict) -> str:
    lines = [f"| V | bs | chain µs (k={K}) | rows read | bytes floor | FlashInfer | tree µs repl / no repl (n=8) | "
             "target-only µs | tree / target-only |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        fi = f"{r['flashinfer_us']} ({r['flashinfer_us'] / r['chain_us']:.1f}x)" if r["flashinfer_us"] else "-"
        ratio = max(r["tree_repl_us"], r["tree_norepl_us"]) / r["target_only_us"]
        lines.append(f"| {r['V']} | {r['bs']} | {r['chain_us']:.1f} | {r['chain_rows']} | {r['chain_floor_us']:.1f} | "
                     f"{fi} | {r['tree_repl_us']:.1f} / {r['tree_norepl_us']:.1f} | {r['target_only_us']:.1f} | "
                     f"{ratio:.2f}x |")
    return "\n".join(lines)
