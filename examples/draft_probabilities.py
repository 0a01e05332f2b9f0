"""What verifying with the drafter's real probabilities buys: a sampling drafter on the toy trigram
models of ``speculative_decoding.py``, verified with q (the draft distribution) and without it.

A drafter that *samples* its tokens (instead of taking its top-k) draws x ~ q. The target-only rule
(``tree_speculative_sampling_target_only`` with ``draft_probs=None``) treats every draft as fixed and
accepts x with probability p(x), so a position passes with probability sum_x q(x) p(x). Knowing q,
``chain_speculative_sampling`` and ``tree_speculative_sampling`` accept x with probability
min(1, p(x) / q(x)) and sample a rejection from the residual max(p - q, 0): a position passes with
probability sum_x min(p(x), q(x)) = 1 - TV(p, q), which is larger, and the output is still
distributed exactly as samples from the target (lossless; docs/draft_probability_sampling.md).

* Chains: k tokens sampled one after another from the draft model. The same drafts are verified
  by ``chain_speculative_sampling`` and by the target-only rule on a chain tree, with the same
  coins, so q-aware acceptance is never shorter (u q(x) <= u < p(x) whenever u < p(x)).
* Trees: random EAGLE-like shapes (``cupy_spec.tree.eagle_tree``); children drawn from their
  parent's draft row either i.i.d. (``replacement=True``) or without replacement (Gumbel top-k,
  ``replacement=False``), verified by ``tree_speculative_sampling`` and by the target-only rule.
  The target-only rule needs distinct siblings (it adds p(x) once per copy of x), so repeated
  siblings and their subtrees are unlinked for it; the q-aware rule never accepts a repeat anyway.

Each step decodes a whole batch; sequences continue with the q-aware result (both rules are
lossless, so contexts are distributed alike either way). Reported: the mean number of accepted
draft tokens per step and sequence (tokens per step = that + 1).

    python examples/draft_probabilities.py [--device auto|cpu|cuda] [--batch B] [--steps N] [--plot PATH]
From a checkout without installing: ``PYTHONPATH=<repository root> python examples/draft_probabilities.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

import cupy_spec
from cupy_spec import tree as spec_tree

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the toy models live in the sibling example
    sys.path.insert(0, _HERE)
from speculative_decoding import MAX_VOCAB, TrigramModels, _device, _int_in  # noqa: E402


def draw_tokens(draft: torch.Tensor, tree: spec_tree.Tree, prev, last, replacement: bool, gen):
    """Sample the tree's draft tokens level by level from the draft model.

    Node 0 is ``last``; a node's token is drawn from its parent's draft row, siblings i.i.d.
    (``replacement``) or without replacement in sibling order (Gumbel top-k: the child of sibling
    rank r takes the r-th largest ``log q + Gumbel`` key of its parent). Randomness comes from the
    CPU generator ``gen``. Returns (tokens, ctx) int64 [B, n], ctx = the token before each node.
    """
    B, n = tree.parents.shape
    V, dev = draft.shape[-1], draft.device
    rank = spec_tree.sibling_rank(tree)
    tokens, ctx = last[:, None].repeat(1, n), prev[:, None].repeat(1, n)
    if not replacement:  # one Gumbel key vector per node, shared by its children
        gumbel = -(-torch.rand(B, n, V, generator=gen).clamp(min=1e-30).log()).log()
    for d in range(1, tree.S):
        b, i = (tree.depth == d).nonzero(as_tuple=True)  # the nodes of level d
        p = tree.parents[b, i]
        ctx[b, i] = tokens[b, p]
        rows = draft[ctx[b, p], tokens[b, p]]  # [m, V]: the parent's draft row
        if replacement:  # inverse CDF, one draw per node
            cdf = rows.cumsum(-1)
            u = torch.rand(len(b), 1, generator=gen).to(dev) * cdf[:, -1:]
            tokens[b, i] = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=V - 1)
        else:
            keys = rows.log() + gumbel[b.cpu(), p.cpu()].to(dev)
            top = keys.topk(int(rank[b, i].max()) + 1, dim=-1).indices
            tokens[b, i] = top.gather(1, rank[b, i, None]).squeeze(1)
    return tokens, ctx


def unlink_repeats(tree: spec_tree.Tree, tokens: torch.Tensor):
    """(next_token, next_sibling) of ``tree`` with every repeated sibling skipped (a repeat and its
    subtree become unreachable), so the target-only rule sees distinct siblings only."""
    par, rank = tree.parents, spec_tree.sibling_rank(tree)
    repeat = ((par[:, :, None] == par[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])
              & (rank[:, None, :] < rank[:, :, None])).any(-1)  # fmt: skip
    repeat[:, 0] = False
    orig = tree.retrive_next_sibling
    ns = orig.clone()
    for _ in range(ns.shape[1]):
        skip = (ns >= 0) & repeat.gather(1, ns.clamp(min=0))
        if not bool(skip.any()):
            break
        ns = torch.where(skip, orig.gather(1, ns.clamp(min=0)), ns)
    return tree.retrive_next_token, ns


def _outputs(B: int, n: int, S: int, dev):
    return (torch.full((B * n,), -1, dtype=torch.int32, device=dev),
            torch.full((B, S), -1, dtype=torch.int32, device=dev), torch.zeros(B, dtype=torch.int32, device=dev))


def run_setting(models, prompts, tree, replacement, chain_op: bool, steps: int, gen):
    """``steps`` steps of one setting. Returns float64 (accepted with q, accepted target-only), each
    [steps * B]: accepted draft tokens per step and sequence."""
    dev = models.target.device
    prev, last = prompts[:, 0].to(dev), prompts[:, 1].to(dev)
    B, n = tree.parents.shape
    with_q, target_only = [], []
    for _ in range(steps):
        tokens, ctx = draw_tokens(models.draft, tree, prev, last, replacement, gen)
        target_probs, draft_probs = models.target[ctx, tokens], models.draft[ctx, tokens]  # rows after each node
        coins = torch.rand(B, n, generator=gen).to(dev)
        final = torch.rand(B, generator=gen).to(dev)
        if chain_op:  # coin [:, i] tests draft i + 1 here and in the target-only walk (node i's children)
            out, _, num_q = cupy_spec.chain_speculative_sampling(
                draft_probs[:, :-1].contiguous(), tokens[:, 1:].contiguous(), target_probs,
                uniform_samples=torch.cat([coins[:, :-1], final[:, None]], dim=1))  # fmt: skip
            emitted = [row[: e + 1] for row, e in zip(out.tolist(), num_q.tolist())]
        else:
            predicts, accept_index, num_q = _outputs(B, n, tree.S, dev)
            cupy_spec.tree_speculative_sampling(
                predicts, accept_index, num_q, tokens, tree.retrive_index, tree.retrive_next_token,
                tree.retrive_next_sibling, coins, final, target_probs, draft_probs, replacement)  # fmt: skip
            emitted = spec_tree.emitted_tokens(predicts, accept_index, num_q)
        next_token, next_sibling = unlink_repeats(tree, tokens)
        predicts_t, accept_t, num_t = _outputs(B, n, tree.S, dev)
        cupy_spec.tree_speculative_sampling_target_only(
            predicts_t, accept_t, num_t, tokens, tree.retrive_index, next_token, next_sibling,
            coins, final, target_probs, None, threshold_single=1.0, threshold_acc=1.0)  # fmt: skip
        with_q.append(num_q.cpu().double())
        target_only.append(num_t.cpu().double())
        tails = [([p, l] + e)[-2:] for p, l, e in zip(prev.tolist(), last.tolist(), emitted)]
        prev, last = torch.tensor(tails, device=dev).unbind(1)
    return torch.cat(with_q), torch.cat(target_only)


def _plot(path: str, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 3.6))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="with q (min(1, p/q))")
    ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label="target-only (p)")
    ax.set_xticks(x, [r[0].replace(", ", "\n", 1) for r in rows], fontsize=8)
    ax.set_ylabel("accepted draft tokens / step")
    ax.set_title("Sampling drafter: verification with and without draft probabilities")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    """Parse ``argv``, run every setting, print the table. Returns [(setting, with q, target-only)]."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--batch", type=_int_in(1), default=256, help="sequences decoded together (>= 1)")
    ap.add_argument("--steps", type=_int_in(1), default=64, help="verification steps per setting (>= 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=_int_in(2, MAX_VOCAB), default=32, help=f"vocabulary size, 2 .. {MAX_VOCAB}")
    ap.add_argument("--ks", type=_int_in(1, 64), nargs="+", default=[2, 4, 6], help="chain lengths, 1 .. 64")
    ap.add_argument("--nodes", type=_int_in(2), default=16, help="tree size incl. the root (>= 2)")
    ap.add_argument("--depth", type=_int_in(1), default=5, help="tree depth (>= 1)")
    ap.add_argument("--topk", type=_int_in(1), default=4, help="most children per tree node (1 .. vocab)")
    ap.add_argument("--plot", metavar="PATH", help="also save a bar chart there (needs matplotlib)")
    args = ap.parse_args(argv)
    args.device = _device(ap, args.device)
    if args.topk > args.vocab:
        ap.error(f"--topk {args.topk} exceeds --vocab {args.vocab}: children drawn without replacement "
                 f"cannot be more than the tokens")  # fmt: skip
    if not args.depth + 1 <= args.nodes <= spec_tree.eagle_max_nodes(args.depth, args.topk):
        ap.error(f"--nodes {args.nodes} must be in [depth + 1, 1 + topk + (depth - 1) * topk**2] = "
                 f"[{args.depth + 1}, {spec_tree.eagle_max_nodes(args.depth, args.topk)}] for --depth {args.depth} "
                 f"and --topk {args.topk}")  # fmt: skip
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            ap.error("--plot needs matplotlib (pip install matplotlib)")
        if Path(args.plot).is_dir():
            ap.error(f"--plot {args.plot} is a directory; give a file name such as {Path(args.plot) / 'bars.png'}")
        if not Path(args.plot).resolve().parent.is_dir():
            ap.error(f"--plot {args.plot}: directory {Path(args.plot).resolve().parent} does not exist")
    dev = torch.device(args.device)
    t_start = time.perf_counter()

    gen = torch.Generator().manual_seed(args.seed)
    models = TrigramModels(args.vocab, keep=args.vocab // 2, noise=1.5, draft_temp=1.3, gen=gen, device=dev)
    prompts = torch.randint(args.vocab, (args.batch, 2), generator=gen)
    shapes = spec_tree.eagle_tree(args.batch, args.nodes, args.depth, args.topk, generator=gen, device=dev)
    backend = f"CUDA kernels ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "CPU reference"
    print(f"device: {dev.type} [{backend}]; batch {args.batch}, {args.steps} steps per setting, vocab {args.vocab}; "
          f"trees: {args.nodes} nodes, depth {args.depth}, <= {args.topk} children per node")  # fmt: skip

    settings = [(f"chain, k = {k}", spec_tree.chain(args.batch, k, device=dev), True, True) for k in args.ks]
    settings += [(f"tree ({args.nodes} nodes), i.i.d. children", shapes, True, False),
                 (f"tree ({args.nodes} nodes), children without replacement", shapes, False, False)]  # fmt: skip
    rows = []
    for label, tree, replacement, chain_op in settings:
        t0 = time.perf_counter()
        q, t = run_setting(models, prompts, tree, replacement, chain_op, args.steps, gen)
        rows.append((label, q.mean().item(), t.mean().item()))
        print(f"  {label}: {time.perf_counter() - t0:.1f} s")

    print("\n| setting | mean accepted length with q | target-only | gain |")
    print("|---|---:|---:|---:|")
    for label, q, t in rows:
        rel = f" ({100 * (q / t - 1):+.0f}%)" if t > 0 else ""
        print(f"| {label} | {q:.3f} | {t:.3f} | {q - t:+.3f}{rel} |")
    if args.plot is not None:
        _plot(args.plot, rows)
        print(f"\nbar chart saved to {args.plot}")
    better = sum(q > t for _, q, t in rows)
    print(f"\nOK: q-aware verification accepted more draft tokens in {better} of {len(rows)} settings "
          f"({time.perf_counter() - t_start:.1f} s total)")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
