"""Bench of the small tree ops (``verify_tree_greedy``, ``build_tree_kernel_efficient``) and the host
cost of every op against a torch ``mul_`` (one eager call at bs=16, n=8, V=32000, outputs and coins
given): part of ``python -m cupy_spec bench``.

Shapes are sglang's: n in {4, 8, 16, 32, 64} draft tokens, topk in {1, 4, 8}, bs in {1, 4, 16, 64,
256}, verified prefixes of 100 to 1999 tokens; build_tree also with one request's prefix of
LONG_PREFIX tokens (topk 4). Every point is first checked against the reference on the same GPU
(exact: integer outputs).
"""

from __future__ import annotations

import torch

from . import reference, tree
from . import bench, bench_from_logits, bench_sampling
from .bench import graph_time_us, host_us_each

NS = [4, 8, 16, 32, 64]
TOPKS = [1, 4, 8]
BATCHES = [1, 4, 16, 64, 256]
LONG_PREFIX = 32000  # build_tree also on batches where one request has a prefix this long


def _depth(n: int, topk: int) -> int:
    """Fewest drafter steps that draft at least n - 1 tokens (topk at the first step, topk**2 after)."""
    d, total = 1, topk
    while total < n - 1:
        d, total = d + 1, total + topk * topk
    return d


def greedy_inputs(bs: int, n: int, topk: int, seed: int = 0) -> dict:
    """An EAGLE tree; the target's token after a node is its first child's token 70% of the time."""
    g = torch.Generator().manual_seed(seed)
    depth = min(_depth(n, topk), n - 1) if n > 1 else 1
    t = tree.eagle_tree(bs, n, depth, topk, generator=g)
    cand = torch.randint(0, 32000, (bs, n), generator=g)
    first = t.retrive_next_token.clamp(min=0)
    hit = (t.retrive_next_token >= 0) & (torch.rand(bs, n, generator=g) < 0.7)
    want = torch.where(hit, cand.gather(1, first), torch.randint(0, 32000, (bs, n), generator=g))
    d = dict(predicts=torch.full((bs * n,), -1, dtype=torch.int32), accept_index=torch.full((bs, t.S), -1, dtype=torch.int32),
             accept_token_num=torch.zeros(bs, dtype=torch.int32), candidates=cand, retrive_index=t.retrive_index,
             retrive_next_token=t.retrive_next_token, retrive_next_sibling=t.retrive_next_sibling, target_predict=want)
    return {k: v.cuda() for k, v in d.items()}


def build_inputs(bs: int, n: int, topk: int, mode: int = tree.TreeMaskMode.FULL_MASK, seed: int = 0,
                 long_prefix: int = 0) -> dict:
    """EAGLE drafts with verified prefixes of 100 to 1999 tokens; with ``long_prefix``, request bs // 2's
    prefix has that many tokens (one long context among short ones)."""
    g = torch.Generator().manual_seed(seed)
    draft = tree.random_eagle_draft(bs, topk, _depth(n, topk), 64, generator=g)
    inp = tree.eagle_inputs(*draft, n)
    seq = torch.randint(100, 2000, (bs,), generator=g)
    if long_prefix:
        seq[bs // 2] = long_prefix
    out = tree.alloc_tree_outputs(bs, n, mode, int(seq.sum()), device="cuda")
    return dict(parent_list=inp.parent_list.cuda(), selected_index=inp.selected_index.cuda(), verified_seq_len=seq.cuda(),
                tree_mask=out.tree_mask, positions=out.positions, retrive_index=out.retrive_index,
                retrive_next_token=out.retrive_next_token, retrive_next_sibling=out.retrive_next_sibling,
                topk=topk, depth=_depth(n, topk), draft_token_num=n, tree_mask_mode=int(mode))


def _fresh(d: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _check(fn, ref, d: dict) -> None:
    got, want = _fresh(d), _fresh(d)
    fn(**got)
    ref(**want)
    for k, v in got.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, want[k]), f"{k} differs from the reference"


def run(quick: bool = False) -> dict:
    import cupy_spec

    ns, topks, batches = ([8, 64], [4], [1, 64]) if quick else (NS, TOPKS, BATCHES)
    build, build_ref = cupy_spec.build_tree_kernel_efficient, reference.build_tree_kernel_efficient
    ops = {"verify_tree_greedy": (cupy_spec.verify_tree_greedy, reference.verify_tree_greedy, greedy_inputs, topks),
           "build_tree_kernel_efficient": (build, build_ref, build_inputs, topks),
           f"build_tree_kernel_efficient, one prefix of {LONG_PREFIX}": (
               build, build_ref, lambda *a, **k: build_inputs(*a, **k, long_prefix=LONG_PREFIX), [4])}
    rows = []
    # us: back to back (with programmatic dependent launch, a call's launch overlaps the call before);
    # us_after_torch: the time a call adds after a torch kernel, which does not let the next one start early
    y = torch.zeros(1, device="cuda")
    alone = graph_time_us(lambda: y.add_(1))
    for name, (fn, ref, make, op_topks) in ops.items():
        for n in ns:
            for topk in op_topks:
                for bs in batches:
                    d = make(bs, n, topk, seed=bs + n + topk)
                    _check(fn, ref, d)
                    rows.append(dict(op=name, n=n, topk=topk, bs=bs, us=graph_time_us(lambda: fn(**d)),
                                     us_after_torch=graph_time_us(lambda: (y.add_(1), fn(**d))) - alone))
    x = torch.ones(16, device="cuda")
    host = host_us_each({"mul_": lambda: x.mul_(1.0)} | host_calls(16, 8, 32000), rounds=7)
    return dict(rows=rows, mul_host_us=host.pop("mul_"), host_us=host)


def host_calls(bs: int, n: int, V: int) -> dict:
    """One eager call of every op, by name, on valid inputs that stay valid when the call repeats
    (the chain op allocates its token output, as its signature requires). Every call passes its
    tensors by position from a tuple made once (keyword-only arguments as literal keywords), so
    the figures hold the op's cost and not the cost of building its arguments."""
    import cupy_spec

    g = _in_order("verify_tree_greedy", greedy_inputs(bs, n, 4))
    b = _in_order("build_tree_kernel_efficient", build_inputs(bs, n, 4))
    t = _in_order("tree_speculative_sampling_target_only", bench.make_inputs(bs, n, V, draft=False))
    ts = _in_order("tree_speculative_sampling", bench_sampling.tree_inputs(bs, V)) + (True,)
    c = bench_sampling.chain_inputs(bs, V)
    acc, emi = (torch.zeros(bs, dtype=torch.int32, device="cuda") for _ in range(2))
    chain = (c["draft_probs"], c["draft_token_ids"], c["target_probs"], acc, emi)
    coins_given = c["uniform_samples"]
    f = bench_from_logits.make_inputs(bs, n, V, torch.bfloat16)
    walk = bench_from_logits.walk_args(f) + (f["target_logits"], f["temperatures"])
    top_ks, top_ps = f["top_ks"], f["top_ps"]
    seed, offset = (torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(2))
    coins = torch.empty(bs, c["draft_token_ids"].shape[1] + 1, dtype=torch.float32, device="cuda")
    return {
        "tree_speculative_sampling_target_only": lambda: cupy_spec.tree_speculative_sampling_target_only(*t),
        "verify_tree_greedy": lambda: cupy_spec.verify_tree_greedy(*g),
        "build_tree_kernel_efficient": lambda: cupy_spec.build_tree_kernel_efficient(*b),
        "chain_speculative_sampling": lambda: cupy_spec.chain_speculative_sampling(*chain, uniform_samples=coins_given),
        "chain_speculative_sampling (seed, offset tensors)": lambda: cupy_spec.chain_speculative_sampling(
            *chain, seed=seed, offset=offset),
        "uniform_coins": lambda: cupy_spec.uniform_coins(seed, offset, coins),
        "tree_speculative_sampling": lambda: cupy_spec.tree_speculative_sampling(*ts),
        "tree_speculative_sampling_from_logits": lambda: cupy_spec.tree_speculative_sampling_from_logits(
            *walk, top_ks=top_ks, top_ps=top_ps),
    }


def _in_order(name: str, d: dict) -> tuple:
    """The values of ``d`` (arguments of op ``name`` by name, every one up to the last given) in the
    op's signature order."""
    from ._core import OPS

    names = [e.name for e in OPS[name].table]
    assert set(d) == set(names[:len(d)]), f"{name}: not a leading run of its arguments: {sorted(d)}"
    return tuple(d[k] for k in names[:len(d)])


def table(result: dict) -> str:
    lines = ["| op | n | topk | " + " | ".join(f"bs={b}" for b in sorted({r['bs'] for r in result['rows']})) + " |"]
    lines.append("|---" * (3 + len({r['bs'] for r in result['rows']})) + "|")
    keys = sorted({(r["op"], r["n"], r["topk"]) for r in result["rows"]}, key=lambda k: (k[0] != "verify_tree_greedy",) + k)
    for op, n, topk in keys:
        us = [f"{r['us']:.2f} ({r['us_after_torch']:.2f})" for r in result["rows"]
              if (r["op"], r["n"], r["topk"]) == (op, n, topk)]
        lines.append(f"| {op} | {n} | {topk} | " + " | ".join(us) + " |")
    lines += ["", "(in brackets: the time a call adds after a torch kernel, which starts no dependent launch early)",
              "", f"host µs per eager call (bs=16, n=8, V=32000): torch mul_ {result['mul_host_us']:.1f}", "",
              "| op | host µs | / mul_ |", "|---|---|---|"]
    lines += [f"| {k} | {v:.1f} | {v / result['mul_host_us']:.2f}x |" for k, v in result["host_us"].items()]
    return "\n".join(lines)
