"""Speculative decoding end to end with toy n-gram models, an EAGLE-style tree drafter and
cupy_spec's ``tree_speculative_sampling_from_logits`` as the verifier (target-only verification
from the target's logits, with temperature, top-k, top-p and min-p); then the same at
temperature 0 with ``build_tree_kernel_efficient`` and ``verify_tree_greedy``.

* Target model: a random trigram model (the next token depends on the last two tokens) over a
  small vocabulary. Like sglang, its rows are softmax(logits) followed by top-k truncation and
  renormalisation, so they contain exact zeros. The verifier reads the same rows as logits: the
  tokens outside that top-k set are masked with -inf (as a grammar mask would).
* Draft model: a cheaper, imperfect copy of the target: the same logits plus noise, at a higher
  temperature, without the top-k cut (so it sometimes drafts tokens the target rules out).
* Drafter (EAGLE-2 style): from the last verified token the draft proposes its top-k next tokens;
  at each further level the k best frontier nodes (by cumulative draft log-probability) get their
  own top-k children; finally the ``nodes - 1`` best drafted nodes by cumulative score form the
  tree (an ancestor always scores at least as high as its descendants, so the set is a tree).
* Verification: one call of the op per step for the whole batch, on the target's logits after
  every tree node, with per-request ``--temperature``, ``--top-k``, ``--top-p`` and ``--min-p``
  and thresholds 1.0/1.0 (the lossless setting). The op's target rows are
  filter(softmax(logits / T)) (top-k, then top-p, then min-p, renormalised), and its walk is
  ``tree_speculative_sampling_target_only`` with ``draft_probs=None`` on them; each sequence
  appends the accepted draft tokens plus the correction / bonus token. The defaults (T = 1, no
  filter) verify against the target's rows as they are; ``--temperature 0`` makes every request
  greedy, and the text is then the target's greedy continuation (checked and printed).
* Greedy: the drafter's outputs in sglang's EAGLE format go through ``build_tree_kernel_efficient``
  (tree links and positions), the target's argmax after each node through ``verify_tree_greedy``;
  the text must equal the target's greedy continuation token for token.

Because verification is lossless, the text is distributed exactly as plain autoregressive
sampling from the filtered target (the rows above, computed by the op's reference
``filtered_probs`` for every context). The script checks that: it samples the same number of
tokens per sequence autoregressively from those rows, compares bigram and unigram frequencies
(total-variation distance to each other and to the exact expected frequencies, computed by
propagating the trigram chain), and runs a permutation test that swaps whole sequences between
the two groups (sequences are independent, so under "same distribution" the groups are
exchangeable). A lossy control run with ``threshold_acc=0.5`` shows what a detectable difference
looks like (skipped for greedy requests: one-hot rows leave nothing for a threshold to change).

Run it after ``pip install .`` (or ``pip install ".[cuda12]"`` for the GPU backend); no PYTHONPATH needed:
    python examples/speculative_decoding.py [--device auto|cpu|cuda] [--batch B] [--steps N] [--seed S]
        [--temperature T] [--top-k K] [--top-p P] [--min-p M]
From a checkout without installing, put the repository root on the import path first:
    PYTHONPATH=<repository root> python examples/speculative_decoding.py
``--help`` lists every option; sizes must be positive and the tree must fit its depth and top-k;
sampling parameters must lie in their ranges (temperature >= 0, top-k >= 0, top-p in (0, 1],
min-p in [0, 1)).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import NamedTuple

import torch

from cupy_spec import build_tree_kernel_efficient, tree_speculative_sampling_from_logits, verify_tree_greedy
from cupy_spec import tree as spec_tree
from cupy_spec.reference.tree_speculative_sampling_from_logits import filtered_probs, greedy_requests


# --------------------------------------------------------------------------------------------
# Toy models
# --------------------------------------------------------------------------------------------


class TrigramModels:
    """Target and draft next-token tables, float32 [V, V, V]: row [a, b] = p(next | a, b).

    ``target_logits`` (float32 [V, V, V]) holds the target's logits with the tokens outside its
    top-``keep`` set masked with -inf, so softmax(target_logits[a, b]) = target[a, b] up to rounding.
    """

    def __init__(self, vocab: int, keep: int, noise: float, draft_temp: float, gen: torch.Generator, device):
        logits = 2.5 * torch.randn(vocab, vocab, vocab, generator=gen)
        target = torch.softmax(logits, dim=-1)
        kept = torch.ones_like(target, dtype=torch.bool)
        if keep < vocab:  # top-k truncation, as in sglang's sampling pipeline
            kth = target.topk(keep, dim=-1).values[..., -1:]
            kept = target >= kth
            target = torch.where(kept, target, torch.zeros_like(target))
        self.target = (target / target.sum(-1, keepdim=True)).to(device)
        # exp(-inf) = 0: the masked tokens get exactly the zeros of the truncated rows.
        self.target_logits = torch.where(kept, logits, torch.full_like(logits, float("-inf"))).to(device)
        noisy = logits + noise * torch.randn(vocab, vocab, vocab, generator=gen)
        self.draft = torch.softmax(noisy / draft_temp, dim=-1).to(device)
        self.vocab = vocab


# --------------------------------------------------------------------------------------------
# Sampling parameters
# --------------------------------------------------------------------------------------------


class SamplingParams(NamedTuple):
    """Sampling parameters shared by every request of the batch (the op takes them per request).

    The target row after a context is softmax(logits / temperature), then top-k (the ``top_k``
    largest logits; 0 or >= V: off), then top-p (the most likely tokens whose mass reaches
    ``top_p``; 1: off), then min-p (tokens with p >= min_p * max p; 0: off), renormalised.
    A temperature below 1e-6 (0 included) makes the request greedy: one-hot at the argmax.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def tensors(self, batch: int, device):
        """The op's per-request arguments: (temperatures float32 [batch], top_ks int32 [batch],
        top_ps float32 [batch], min_ps float32 [batch])."""
        def full(value, dtype):
            return torch.full((batch,), value, dtype=dtype, device=device)

        return (full(self.temperature, torch.float32), full(self.top_k, torch.int32),
                full(self.top_p, torch.float32), full(self.min_p, torch.float32))

    @property
    def greedy(self) -> bool:
        """Whether the op decodes these requests greedily (its rule: not (T >= 1e-6) in float32)."""
        return bool(greedy_requests(torch.tensor([self.temperature], dtype=torch.float32))[0])

    def describe(self) -> str:
        """One line for the report, e.g. ``temperature 0.7, top-k 5, top-p 0.9, min-p off``."""
        if self.greedy:
            return f"temperature {self.temperature:g} (greedy)"
        return (f"temperature {self.temperature:g}, top-k {self.top_k or 'off'}, "
                f"top-p {'off' if self.top_p >= 1 else f'{self.top_p:g}'}, "
                f"min-p {f'{self.min_p:g}' if self.min_p > 0 else 'off'}")


def filtered_target(models, sampling: SamplingParams) -> torch.Tensor:
    """The target rows the verifier samples from, for every context: float64 [V, V, V], row [a, b] =
    filter(softmax(target_logits[a, b] / T)) as the op's reference ``filtered_probs`` states it (the
    V * V contexts are the nodes of one request)."""
    V = models.vocab
    logits = models.target_logits.reshape(1, V * V, V)
    return filtered_probs(logits, *sampling.tensors(1, logits.device)).reshape(V, V, V)


# --------------------------------------------------------------------------------------------
# EAGLE-style tree drafter
# --------------------------------------------------------------------------------------------


def draft_trees(draft: torch.Tensor, prev: torch.Tensor, last: torch.Tensor, topk: int, depth: int, nodes: int):
    """Draft one tree per sequence from context (prev, last).

    Returns (tree, candidates int64 [B, nodes], ctx_prev int64 [B, nodes]) where ctx_prev[b, i] is
    the token before node i's token (its parent's token; ``prev`` for the root), so the target row
    at node i is ``target[ctx_prev[b, i], candidates[b, i]]``.
    """
    B = prev.shape[0]
    dev = prev.device
    # Level 1: the root's top-k. Candidate 0 is the root itself.
    logp, tok = draft[prev, last].log().topk(topk, dim=-1)  # [B, k]
    toks = [last[:, None], tok]
    pars = [torch.full((B, 1), -1, device=dev), torch.zeros(B, topk, dtype=torch.long, device=dev)]
    scores = [torch.zeros(B, 1, device=dev), logp]
    ctx = [prev[:, None], last[:, None].expand(B, topk)]
    f_id = torch.arange(1, topk + 1, device=dev).expand(B, topk)  # frontier candidate ids
    f_tok, f_prev, f_score, next_id = tok, last[:, None].expand(B, topk), logp, topk + 1
    for _ in range(depth - 1):
        # Every frontier node proposes its top-k children: k*k candidates per sequence.
        logp, tok = draft[f_prev, f_tok].log().topk(topk, dim=-1)  # [B, k, k]
        cand_score = (f_score[:, :, None] + logp).reshape(B, -1)
        cand_tok = tok.reshape(B, -1)
        cand_par = f_id[:, :, None].expand(B, topk, topk).reshape(B, -1)
        cand_prev = f_tok[:, :, None].expand(B, topk, topk).reshape(B, -1)
        toks.append(cand_tok)
        pars.append(cand_par)
        scores.append(cand_score)
        ctx.append(cand_prev)
        ids = next_id + torch.arange(topk * topk, device=dev).expand(B, -1)
        next_id += topk * topk
        # The k best candidates (by cumulative draft log-prob) form the next frontier.
        best = cand_score.topk(topk, dim=-1).indices
        f_id, f_tok, f_prev, f_score = (x.gather(1, best) for x in (ids, cand_tok, cand_prev, cand_score))
    toks, pars, scores, ctx = (torch.cat(x, dim=1) for x in (toks, pars, scores, ctx))
    # Keep the `nodes` best candidates (the root scores 0, the maximum). A stable sort keeps the
    # shallower of equal scores first, so every kept node's parent is kept too.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :nodes]
    keep = order.sort(dim=1).values  # candidate ids ascend level by level: parents come first
    node_of = torch.full_like(toks, -1)
    node_of.scatter_(1, keep, torch.arange(nodes, device=dev).expand(B, nodes))
    parent_cand = pars.gather(1, keep)
    parents = torch.where(parent_cand >= 0, node_of.gather(1, parent_cand.clamp(min=0)), parent_cand)
    assert bool((parents[:, 1:] >= 0).all()), "kept node set is not closed under parents"
    tree = spec_tree.from_parents(parents.cpu().tolist(), device=dev)
    return tree, toks.gather(1, keep), ctx.gather(1, keep)


# --------------------------------------------------------------------------------------------
# Decoding loops
# --------------------------------------------------------------------------------------------


def speculative_generate(models, prompts, steps, topk, depth, nodes, gen, threshold_acc=1.0, sampling=None):
    """`steps` verification steps on a batch; returns (list of token lists, accept lengths, S).

    The target rows are ``sampling`` (a :class:`SamplingParams`; None: temperature 1, no filter)
    applied to ``models.target_logits`` inside ``tree_speculative_sampling_from_logits``.
    """
    dev = models.target.device
    seqs = [list(p) for p in prompts.tolist()]
    params = (sampling or SamplingParams()).tensors(len(seqs), dev)  # temperatures, top_ks, top_ps, min_ps
    accept_lengths = []
    S_max = 1
    for _ in range(steps):
        prev = torch.tensor([s[-2] for s in seqs], device=dev)
        last = torch.tensor([s[-1] for s in seqs], device=dev)
        tree, candidates, ctx_prev = draft_trees(models.draft, prev, last, topk, depth, nodes)
        B, n = candidates.shape
        target_logits = models.target_logits[ctx_prev, candidates]  # [B, n, V]: the logits after each node
        coins = torch.rand(B, n, generator=gen).to(dev)
        final_coins = torch.rand(B, generator=gen).to(dev)
        predicts = torch.full((B * n,), -1, dtype=torch.int32, device=dev)
        accept_index = torch.full((B, tree.S), -1, dtype=torch.int32, device=dev)
        accept_token_num = torch.zeros(B, dtype=torch.int32, device=dev)
        # Rows filter(softmax(logits / T)), then the target-only walk with draft_probs=None.
        tree_speculative_sampling_from_logits(
            predicts, accept_index, accept_token_num,
            candidates, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling,
            coins, final_coins, target_logits, *params,
            threshold_single=1.0, threshold_acc=threshold_acc,
        )
        for s, new in zip(seqs, spec_tree.emitted_tokens(predicts, accept_index, accept_token_num)):
            s.extend(new)
        accept_lengths.append(accept_token_num.cpu().long())
        S_max = max(S_max, tree.S)
    return seqs, torch.cat(accept_lengths), S_max


def eagle_draft(draft: torch.Tensor, prev: torch.Tensor, last: torch.Tensor, topk: int, depth: int):
    """The drafter's outputs in sglang's EAGLE format (see ``cupy_spec.tree.EagleDraft``): ``depth``
    steps of top-k from the draft model, keeping the k best beams by cumulative probability.
    Also returns ctx int64 [B, drafted]: the token before each drafted token (for the trigram)."""
    B, K = prev.shape[0], topk
    dev = prev.device
    p, tok = draft[prev, last].topk(K, dim=-1)  # [B, K]
    scores, beam_tok, beam_prev = p, tok, last[:, None].expand(B, K)
    score_list, token_list = [p[:, None, :]], [tok]
    parents_list = [torch.arange(-1, K, device=dev).expand(B, K + 1)]
    ctx = [beam_prev]
    for s in range(1, depth):
        p, tok = draft[beam_prev, beam_tok].topk(K, dim=-1)  # [B, K beams, K children]
        expand = scores[:, :, None] * p
        scores, keep = expand.reshape(B, -1).topk(K, dim=-1)
        score_list.append(expand)
        token_list.append(tok.reshape(B, -1))
        parents_list.append(keep + (K + (s - 1) * K * K))
        child_prev = beam_tok[:, :, None].expand(B, K, K).reshape(B, -1)
        ctx.append(child_prev)
        beam_tok, beam_prev = tok.reshape(B, -1).gather(1, keep), child_prev.gather(1, keep)
    return spec_tree.EagleDraft(last, score_list, token_list, parents_list), torch.cat(ctx, dim=1)


def greedy_speculative_generate(models, prompts, steps, topk, depth, nodes):
    """Greedy speculative decoding: EAGLE drafts, ``build_tree_kernel_efficient`` builds the tree,
    ``verify_tree_greedy`` verifies it against the target's argmax. Returns (token lists, accept lengths)."""
    dev = models.target.device
    seqs = [list(p) for p in prompts.tolist()]
    accept_lengths = []
    for _ in range(steps):
        prev = torch.tensor([s[-2] for s in seqs], device=dev)
        last = torch.tensor([s[-1] for s in seqs], device=dev)
        draft, ctx = eagle_draft(models.draft, prev, last, topk, depth)
        inputs = spec_tree.eagle_inputs(*draft, nodes)
        B = prev.shape[0]
        out = spec_tree.alloc_tree_outputs(B, nodes, spec_tree.TreeMaskMode.QLEN_ONLY, device=dev)
        build_tree_kernel_efficient(inputs.parent_list, inputs.selected_index, torch.zeros(B, dtype=torch.long, device=dev),
                                    *out, topk, depth, nodes, int(spec_tree.TreeMaskMode.QLEN_ONLY))
        candidates = inputs.draft_tokens.view(B, nodes)
        ctx_prev = torch.cat([prev[:, None], ctx.gather(1, inputs.selected_index)], dim=1)
        target_predict = models.target[ctx_prev, candidates].argmax(-1)  # the target's token after each node
        predicts = torch.full((B * nodes,), -1, dtype=torch.int32, device=dev)
        accept_index = torch.full((B, min(depth + 1, nodes)), -1, dtype=torch.int32, device=dev)
        accept_token_num = torch.zeros(B, dtype=torch.int32, device=dev)
        verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, out.retrive_index,
                           out.retrive_next_token, out.retrive_next_sibling, target_predict)
        for s, new in zip(seqs, spec_tree.emitted_tokens(predicts, accept_index, accept_token_num)):
            s.extend(new)
        accept_lengths.append(accept_token_num.cpu().long())
    return seqs, torch.cat(accept_lengths)


def greedy_generate(models, prompts, length):
    """The target's greedy continuation (first maximal token, as torch.argmax): int64 [B, 2 + length]."""
    x = prompts.clone().to(models.target.device)
    for _ in range(length):
        x = torch.cat([x, models.target[x[:, -2], x[:, -1]].argmax(-1, keepdim=True)], dim=1)
    return x.cpu()


def autoregressive_generate(models, prompts, length, gen, target=None):
    """Plain sampling from the target, one token per step; returns int64 [B, 2 + length].
    ``target``: the next-token table [V, V, V] to sample from (default ``models.target``)."""
    dev = models.target.device
    table = models.target if target is None else target.to(dev)
    x = prompts.clone().to(dev)
    for _ in range(length):
        rows = table[x[:, -2], x[:, -1]].cpu()
        nxt = torch.multinomial(rows, 1, generator=gen).to(dev)
        x = torch.cat([x, nxt], dim=1)
    return x.cpu()


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def bigram_counts(seqs: torch.Tensor, V: int) -> torch.Tensor:
    """Per-sequence bigram counts over the generated part: float64 [B, V*V] (pairs (x_{t-1}, x_t)
    for t = 2 .. end, i.e. each generated token with the token before it)."""
    pairs = seqs[:, 1:-1] * V + seqs[:, 2:]
    out = torch.zeros(seqs.shape[0], V * V, dtype=torch.float64)
    return out.scatter_add_(1, pairs, torch.ones_like(pairs, dtype=torch.float64))


def exact_bigram_freq(target: torch.Tensor, prompts: torch.Tensor, length: int) -> torch.Tensor:
    """Expected bigram frequency over generated positions 1..length, averaged over the prompts
    (float64 [V*V]): propagate the distribution of the last two tokens through the chain."""
    T = target.double().cpu()
    V = T.shape[0]
    pi = torch.zeros(V, V, dtype=torch.float64)
    pi.index_put_((prompts[:, 0], prompts[:, 1]), torch.ones(len(prompts), dtype=torch.float64), accumulate=True)
    pi /= len(prompts)
    total = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(length):
        pi = torch.einsum("ab,abc->bc", pi, T)  # (x_{t-1}, x_t) after one more token
        total += pi
    return (total / length).reshape(-1)


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def unigram(freq: torch.Tensor, V: int) -> torch.Tensor:
    return freq.reshape(V, V).sum(0)


def permutation_test(a: torch.Tensor, b: torch.Tensor, V: int, perms: int, gen: torch.Generator) -> tuple[float, float]:
    """TV distance between the bigram frequencies of two groups of sequences and its permutation
    p-value (whole sequences swapped between the groups). a, b: per-sequence counts [B, V*V]."""
    both = torch.cat([a, b])
    m = a.shape[0]
    observed = tv(a.sum(0) / a.sum(), b.sum(0) / b.sum())
    masks = torch.zeros(perms, both.shape[0], dtype=torch.float64)
    for i in range(perms):
        masks[i, torch.randperm(both.shape[0], generator=gen)[:m]] = 1.0
    in_a = masks @ both
    in_b = both.sum(0) - in_a
    stats = 0.5 * (in_a / in_a.sum(1, keepdim=True) - in_b / in_b.sum(1, keepdim=True)).abs().sum(1)
    p = (1 + int((stats >= observed - 1e-12).sum())) / (perms + 1)
    return observed, p


# --------------------------------------------------------------------------------------------

#: Largest --vocab: the target, target-logit and draft tables are [V, V, V] float32 (256**3 * 4 B =
#: 64 MiB each; the filtered target of the statistics is float64, 128 MiB).
MAX_VOCAB = 256


def _device(ap: argparse.ArgumentParser, choice: str) -> str:
    """``--device``: "auto" is cuda when a CUDA device is available, else cpu; cuda must exist."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but no CUDA device is available")
    return choice


def _int_in(low: int, high: int | None = None):
    """argparse type: an integer in [low, high] (no upper bound for None), with a clear error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            want = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {want}, got {value}")
        return value

    return parse


def _float_in(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False):
    """argparse type: a finite number in the interval from low to high, closed at each end unless
    ``low_open`` / ``high_open`` (no upper bound for None), with a clear error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        above = value > low if low_open else value >= low
        below = high is None or (value < high if high_open else value <= high)
        if not (above and below):
            if high is None:
                want = f"{'>' if low_open else '>='} {low:g}"
            else:
                want = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"must be {want}, got {value:g}")
        return value

    return parse


def main(argv=None) -> dict:
    """Parse ``argv``, run every section and print the results. Returns a summary: ``seqs`` (the
    speculative token lists), ``target`` (the filtered target rows, float64 [V, V, V] on the CPU),
    ``p_value`` (of the permutation test) and ``tokens_per_step``."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--batch", type=_int_in(1), default=256, help="sequences decoded together (>= 1)")
    ap.add_argument("--steps", type=_int_in(1), default=48, help="speculative (verification) steps (>= 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=_int_in(2, MAX_VOCAB), default=32,
                    help=f"vocabulary size, 2 .. {MAX_VOCAB} (the toy models hold vocab**3 floats each)")
    ap.add_argument("--topk", type=_int_in(1), default=4, help="children per expanded draft node (1 .. vocab)")
    ap.add_argument("--depth", type=_int_in(1), default=5, help="draft levels (>= 1)")
    ap.add_argument("--nodes", type=_int_in(1), default=16, help="tree size incl. the root")
    ap.add_argument("--perms", type=_int_in(1), default=400, help="permutations of the two-sample test (>= 1)")
    ap.add_argument("--no-control", action="store_true", help="skip the lossy threshold_acc=0.5 control run")
    ap.add_argument("--temperature", type=_float_in(0.0), default=1.0, metavar="T",
                    help="sampling temperature T >= 0: target rows are softmax(logits / T); below 1e-6 (e.g. 0) "
                         "every request is greedy (default 1)")
    ap.add_argument("--top-k", type=_int_in(0), default=0, metavar="K",
                    help="keep the K largest logits of each target row (>= 0; 0 or >= vocab: off, the default); "
                         "the toy target already masks all but its vocab // 2 best tokens")
    ap.add_argument("--top-p", type=_float_in(0.0, 1.0, low_open=True), default=1.0, metavar="P",
                    help="then keep the most likely tokens whose probability mass reaches P, in (0, 1] "
                         "(1: off, the default)")
    ap.add_argument("--min-p", type=_float_in(0.0, 1.0, high_open=True), default=0.0, metavar="M",
                    help="then keep the tokens with probability >= M * the row's largest, in [0, 1) "
                         "(0: off, the default)")
    args = ap.parse_args(argv)
    args.device = _device(ap, args.device)
    if args.topk > args.vocab:
        ap.error(f"--topk {args.topk} exceeds --vocab {args.vocab}: a node cannot have more distinct children "
                 f"than there are tokens")
    max_nodes = spec_tree.eagle_max_nodes(args.depth, args.topk)
    if args.nodes > max_nodes:
        ap.error(f"--nodes {args.nodes} is more than a tree of depth {args.depth} and topk {args.topk} can hold "
                 f"(at most {max_nodes}: 1 + topk + (depth - 1) * topk**2)")
    dev = torch.device(args.device)
    t_start = time.perf_counter()

    gen = torch.Generator().manual_seed(args.seed)
    models = TrigramModels(args.vocab, keep=args.vocab // 2, noise=1.5, draft_temp=1.3, gen=gen, device=dev)
    V = args.vocab
    prompts = torch.randint(V, (args.batch, 2), generator=gen)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    backend = f"CUDA kernel ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "CPU reference"
    print(f"device: {dev.type} [{backend}]; batch {args.batch}, {args.steps} steps, vocab {V}, "
          f"tree: {args.nodes} nodes, topk {args.topk}, depth <= {args.depth}")
    print(f"sampling: {sampling.describe()}")

    # --- speculative decoding ---------------------------------------------------------------
    t0 = time.perf_counter()
    seqs, acc_len, S = speculative_generate(models, prompts, args.steps, args.topk, args.depth, args.nodes, gen,
                                            sampling=sampling)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t_spec = time.perf_counter() - t0
    new_tokens = sum(len(s) - 2 for s in seqs)
    per_step = (acc_len.double() + 1).mean().item()
    print(f"\nspeculative decoding: {new_tokens} tokens in {args.steps} steps x {args.batch} sequences "
          f"= {per_step:.3f} tokens per step per sequence ({t_spec:.2f} s)")
    print("accepted draft tokens per step (histogram):")
    hist = torch.bincount(acc_len, minlength=S)
    for k, c in enumerate(hist.tolist()):
        frac = c / len(acc_len)
        print(f"  {k:2d} | {'#' * round(50 * frac):<50s} {frac:6.3f}")
    if sampling.greedy:  # one-hot rows at the argmax, which no filter or temperature moves
        ref = greedy_generate(models, prompts, max(len(s) for s in seqs) - 2)
        same = all(s == ref[i, : len(s)].tolist() for i, s in enumerate(seqs))
        print(f"greedy requests: token for token equal to the target's greedy continuation: {same}")
        if not same:
            raise SystemExit("speculative decoding at temperature 0 differs from greedy decoding")

    # --- compare with autoregressive sampling from the (filtered) target ---------------------
    # Every step emits >= 1 token, so every sequence has >= `steps` new tokens; compare the
    # first L = steps of them (a fixed length, so no selection effect).
    L = args.steps
    spec = torch.tensor([s[: 2 + L] for s in seqs])
    target = filtered_target(models, sampling)  # the rows the verifier samples from
    t0 = time.perf_counter()
    ar = autoregressive_generate(models, prompts, L, gen, target=target)
    t_ar = time.perf_counter() - t0
    print(f"\nautoregressive sampling: {args.batch * L} tokens in {L} steps ({t_ar:.2f} s)")
    exact = exact_bigram_freq(target, prompts, L)
    c_spec, c_ar = bigram_counts(spec, V), bigram_counts(ar, V)
    f_spec, f_ar = c_spec.sum(0) / c_spec.sum(), c_ar.sum(0) / c_ar.sum()
    print(f"first {L} new tokens of each sequence ({args.batch * L} per method):")
    print(f"  bigram  TV(spec, exact) = {tv(f_spec, exact):.4f}   TV(AR, exact) = {tv(f_ar, exact):.4f}   "
          f"TV(spec, AR) = {tv(f_spec, f_ar):.4f}")
    print(f"  unigram TV(spec, exact) = {tv(unigram(f_spec, V), unigram(exact, V)):.4f}   "
          f"TV(AR, exact) = {tv(unigram(f_ar, V), unigram(exact, V)):.4f}")
    obs, p = permutation_test(c_spec, c_ar, V, args.perms, gen)
    verdict = "agree within noise" if p >= 0.01 else "DIFFER"
    print(f"  permutation test (bigram TV, {args.perms} permutations): TV = {obs:.4f}, p = {p:.3f} -> {verdict}")

    if sampling.greedy and not args.no_control:
        print("  control, threshold_acc=0.5: skipped (greedy rows are one-hot, so it is lossless too)")
    elif not args.no_control:
        lossy, lossy_len, _ = speculative_generate(
            models, prompts, args.steps, args.topk, args.depth, args.nodes, gen,
            threshold_acc=0.5, sampling=sampling,
        )
        c_lossy = bigram_counts(torch.tensor([s[: 2 + L] for s in lossy]), V)
        obs_l, p_l = permutation_test(c_lossy, c_ar, V, args.perms, gen)
        found = "detected" if p_l < 0.01 else "not detected"
        print(f"  control, threshold_acc=0.5 (lossy, {(lossy_len.double() + 1).mean():.3f} tokens/step): "
              f"TV(lossy, AR) = {obs_l:.4f}, p = {p_l:.3f} -> {found}")

    # --- greedy (temperature 0): must reproduce the target's greedy continuation exactly -----------
    t0 = time.perf_counter()
    g_seqs, g_len = greedy_speculative_generate(models, prompts, args.steps, args.topk, args.depth, args.nodes)
    g_ref = greedy_generate(models, prompts, max(len(s) for s in g_seqs) - 2)
    same = all(s == g_ref[i, : len(s)].tolist() for i, s in enumerate(g_seqs))
    print(f"\ngreedy speculative decoding (build_tree_kernel_efficient + verify_tree_greedy): "
          f"{(g_len.double() + 1).mean():.3f} tokens per step; token for token equal to the target's greedy "
          f"continuation: {same} ({time.perf_counter() - t0:.2f} s)")
    if not same:
        raise SystemExit("greedy speculative decoding differs from greedy decoding")

    print(f"\nOK: {per_step:.2f} tokens/step with speculative decoding vs 1 autoregressive; "
          f"text statistics {verdict} (p = {p:.3f}); {time.perf_counter() - t_start:.1f} s total")
    return {"seqs": seqs, "target": target.cpu(), "p_value": p, "tokens_per_step": per_step}


if __name__ == "__main__":
    main()
