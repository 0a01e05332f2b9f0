"""``chain_speculative_sampling`` (the API of FlashInfer's ``flashinfer.sampling.chain_speculative_sampling``):
verify k draft tokens per request against the target model using the draft probabilities, then
sample the token after the accepted prefix.

Two layers:

* :data:`OP`, the in-place core op of the shared table (``torch.ops.cupy_spec.chain_speculative_sampling``):
  coins given as a tensor, outputs written into given tensors, counters added into. Its generated
  function is kept private (``_core``) because the public function allocates its outputs;
* :func:`chain_speculative_sampling`, the public function with FlashInfer's signature (plus the
  keyword ``uniform_samples``): allocates the outputs, draws the coins with the generator when none
  are given, and calls the core once.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from . import _call, check, reference
from ._core import Arg, Constraint, Launch, Op, Scalar, check_generator, torch_view
from .reference.uniform_coins import int64_word
from .tree_speculative_sampling_target_only import vocabulary

I32, I64, F32 = torch.int32, torch.int64, torch.float32
_T = torch.Tensor
#: The kernel's builds, (threads per block, blocks per SM its registers are budgeted for): ONE_BLOCK
#: (512, 1) for batches that leave an SM to each block, TWO_BLOCKS (384, 2) for the larger clusters of
#: TWO_BLOCKS_RANGE below and for batches with more requests than SMs (a second resident block hides
#: memory latency; 384 threads keep the branch-free loads within 80 registers, kernels/NOTES.md v21).
ONE_BLOCK, TWO_BLOCKS = BUILDS = ((512, 1), (384, 2))
BATCHES = 4  # 16-byte units a lane loads per row before any arithmetic
MAX_PIECES = 2048  # piece sums (float64) kept in shared memory
#: Batches of SMs / 4 < bs < SMs requests (TWO_BLOCKS_RANGE, as shares of the SMs) where ONE_BLOCK
#: gives a request at most 2 blocks and a row has at least LONG_ROW pieces (V >= ~64K): TWO_BLOCKS, in
#: clusters of at least twice the size, its grid filling at most TWO_BLOCKS_FILL of the SMs' two
#: slots (kernels/NOTES.md, chain v19 to v21).
TWO_BLOCKS_RANGE, TWO_BLOCKS_FILL, LONG_ROW = (0.25, 1.0), 0.875, 128


def _reference(draft_probs, draft_token_ids, target_probs, uniform_samples, output_token_ids,
               output_accepted_token_num, output_emitted_draft_token_num, seed=None, offset=None, accumulate=True,
               seeded=False, seed_word=0, offset_word=0):
    """The core op's CPU backend: the reference, writing into the given outputs (the coins drawn
    from seed and offset, or their words, as :func:`cupy_spec.uniform_coins` draws them when none
    are given; the counters zeroed first unless ``accumulate``)."""
    if not accumulate:
        output_accepted_token_num.zero_()
        output_emitted_draft_token_num.zero_()
    if uniform_samples is None:
        uniform_samples = target_probs.new_empty(target_probs.shape[:2])
        seed = torch.tensor([seed_word]) if seed is None else seed
        offset = torch.tensor([offset_word]) if offset is None else offset
        reference.uniform_coins(seed, offset, uniform_samples)
    out, _, _ = reference.chain_speculative_sampling(
        draft_probs, draft_token_ids, target_probs, output_accepted_token_num, output_emitted_draft_token_num,
        uniform_samples=uniform_samples)
    output_token_ids.copy_(out)


TABLE = (
    Arg("draft_probs", F32, ("bs", "k", "V"), "row i: the draft distribution x_i was drawn from"),
    Arg("draft_token_ids", (I32, I64), ("bs", "k"), "the draft tokens x_i; ids outside [0, V) never pass"),
    Arg("target_probs", F32, ("bs", "k1", "V"), "row i: the target distribution at position i (row k: bonus)"),
    Arg("uniform_samples", F32, ("bs", "k1"), "coins: [:, i] tests x_i, [:, k] samples the final token "
        "(None: drawn from seed and offset)", optional=True),
    Arg("output_token_ids", I32, ("bs", "k1"), "the accepted drafts, the final token, then -1", written=True),
    Arg("output_accepted_token_num", I32, ("bs",), "**added to**: positions that pass their own test",
        written=True),
    Arg("output_emitted_draft_token_num", I32, ("bs",), "**added to**: accepted (emitted) draft tokens",
        written=True),
    Arg("seed", I64, ("ns",), "with offset, instead of uniform_samples: coin j of request b is step offset_b + j "
        "of uniform_coins' stream keyed by (seed_b, b); 1 or bs entries", optional=True, default=None),
    Arg("offset", I64, ("no",), "the first step drawn per request; 1 or bs entries", optional=True, default=None),
    Scalar("accumulate", "bool", "add a and e into the counters (True) or write them (False)", True),
    Scalar("seeded", "bool", "draw the coins from seed and offset (uniform_samples None), each a tensor or, where "
           "None, its word", False, kernel=False, variant=True),
    Scalar("seed_word", "int", "with seeded: the seed of every request where seed is None (an int64 word: the bits "
           "of a seed in [0, 2**64))", 0, lo=-2**63, hi=2**63 - 1),
    Scalar("offset_word", "int", "with seeded: the offset of every request where offset is None (an int64 word)", 0,
           lo=-2**63, hi=2**63 - 1),
)


def _one_source_of_coins(dims, variant) -> None:
    """uniform_samples, or seeded with seed and offset (tensors or their words): exactly one."""
    _, coins, seed, offset, seeded = variant
    if (seed or offset) and not seeded:
        raise ValueError(f"{'seed' if seed else 'offset'} is given without seeded=True")
    if coins == seeded:
        raise ValueError("give the coins as uniform_samples, or seeded=True with seed and offset (tensors, or the "
                         f"words seed_word / offset_word where None): got {'both' if coins else 'neither'}")


def pieces_for(V: int, batches: int, max_pieces: int) -> tuple:
    """(piece_units, pieces): pieces of whole rounds of 32 * batches 16-byte units covering any
    row of V floats (at most V // 4 + 2 units at any alignment), at most ``max_pieces`` of them."""
    units = V // 4 + 2
    per_round = 32 * batches
    piece_units = per_round * -(-units // (per_round * max_pieces))
    return piece_units, -(-units // piece_units)


def cluster_size(bs: int, pieces: int, dev, warps: int, largest: int, one_wave: bool = True,
                 sizes: tuple | range = (16, 8, 4, 2)) -> int:
    """Blocks per request: the first of ``sizes`` up to ``largest`` where the GPU has clusters,
    every block (of ``warps`` warps) gets a piece and, with ``one_wave``, the grid stays within one
    block per SM; else 1."""
    if dev.clusters:
        for c in sizes:
            if c <= largest and (not one_wave or bs * c <= dev.sms) and (c - 1) * warps < pieces:
                return c
    return 1


def _fewest_trips(bs: int, pieces: int, dev, build: tuple, fill: float = 1.0) -> int:
    """A warp sums one piece per trip to memory, so the row pass takes ceil(pieces / (warps * C))
    trips: the smallest C with as few trips as the largest size that a grid of at most ``fill`` of
    the build's blocks per SM allows and the device allows for that build (up to dev.largest)."""
    (threads, blocks), top = build, dev.largest(build)
    warps, room = threads // 32, dev._replace(sms=int(blocks * dev.sms * fill))
    largest = cluster_size(bs, pieces, room, warps, top, sizes=range(top, 1, -1))
    trips = -(-pieces // (warps * largest))
    return min(largest, -(-pieces // (warps * trips)))


def plan(dims, variant, dev) -> Launch:
    """One block per request, or one cluster of C blocks sharing the final row's pieces, all
    clusters resident at once (the launch record asks the driver which sizes are), C chosen by
    :func:`_fewest_trips` with ONE_BLOCK. Batches in TWO_BLOCKS_RANGE where that gives a request at
    most 2 blocks, with long rows: TWO_BLOCKS, whose larger clusters fill the SMs, if its C (at most
    TWO_BLOCKS_FILL of two blocks per SM) is at least twice as large (clusters of 3 in place of 2, or
    grids of 240 blocks and more on 132 SMs, were no faster). TWO_BLOCKS also when there are more
    requests than SMs."""
    piece_units, pieces = pieces_for(dims.V, BATCHES, MAX_PIECES)
    c = _fewest_trips(dims.bs, pieces, dev, ONE_BLOCK)
    build = TWO_BLOCKS if c == 1 and dims.bs > dev.sms else ONE_BLOCK
    lo, hi = TWO_BLOCKS_RANGE
    if c <= 2 and lo * dev.sms < dims.bs < hi * dev.sms and pieces >= LONG_ROW:
        c2 = _fewest_trips(dims.bs, pieces, dev, TWO_BLOCKS, TWO_BLOCKS_FILL)
        if c2 >= 2 * c:
            c, build = c2, TWO_BLOCKS
    return Launch((dims.bs, c), build[0], 8 * pieces, c, (piece_units, pieces), kernel=build, one_wave=True)


OP = Op(
    "chain_speculative_sampling",
    """Chain speculative sampling, in place (the core of :func:`cupy_spec.chain_speculative_sampling`).

Per request b, draft x_i passes iff it lies in [0, V) and ``flush(u_i * q_i(x_i)) < p_i(x_i)``;
e = the number of leading passes, a = the number of all passes. ``output_token_ids[b]`` gets
``x_0 .. x_{e-1}``, then the token sampled with coin ``u_k`` from ``max(p_e - q_e, 0)`` (from
``p_k`` if e == k; from ``p_e`` if x_e is out of range or the residual is all zero), then -1.
a and e are added into the counters (written instead with ``accumulate=False``). The coins u are
``uniform_samples``, or, with ``seeded=True`` instead, steps ``offset_b .. offset_b + k`` of
:func:`cupy_spec.uniform_coins`' stream keyed by ``(seed_b, b)``, drawn inside the kernel: seed and
offset are tensors (read when the kernel runs, so a captured graph sees the caller's updates) or,
where None, ``seed_word`` / ``offset_word`` for every request (fixed in a captured graph).
:mod:`cupy_spec.reference.chain_speculative_sampling` states the semantics exactly.""",
    TABLE,
    reference=_reference,
    plan=plan,
    template=lambda ids_dtype, coins, seed, offset, seeded, threads, blocks: (
        f"{'int' if ids_dtype == I32 else 'long long'}, {threads}, {blocks}" + (", true" if seeded else "")),
    variants=tuple((ids, not seeded, seeded, seeded, seeded) for seeded in (False, True) for ids in (I32, I64)),
    variant_check=_one_source_of_coins,
    plan_variants=BUILDS,
    plan_dims=("bs", "k", "V"),
    check_inputs=check.chain_speculative_sampling,
    constraints=(
        Constraint("k1 == k + 1", "target_probs must have one row more than the k={k} drafts (k + 1 rows), got "
                   "target_probs {shapes[target_probs]} and draft_probs {shapes[draft_probs]}"),
        vocabulary("draft_probs"),
        Constraint("ns in (-1, 1, bs)", "seed must have 1 or bs={bs} entries, got {shapes[seed]}"),
        Constraint("no in (-1, 1, bs)", "offset must have 1 or bs={bs} entries, got {shapes[offset]}"),
    ),
    constants=dict(BATCHES=BATCHES),
    launch_fields=("piece_units", "pieces"),
)
_core = OP.function


def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num=None,
                               maybe_output_emitted_draft_token_num=None, deterministic=True, generator=None, seed=None,
                               offset=None, *, uniform_samples=None, validate=False):
    """Chain speculative sampling: verify k draft tokens per request with the draft probabilities
    and sample one more token (FlashInfer's ``chain_speculative_sampling``).

    Per request b and position i < k: draft ``x_i`` passes iff ``0 <= x_i < V`` and
    ``u_i * q_i(x_i) < p_i(x_i)`` (float32, one multiply). ``e`` = number of leading passes (the
    emitted drafts), ``a`` = number of positions passing on their own. The token after the e
    drafts is sampled with coin ``u_k`` from ``max(p_e - q_e, 0)`` (the residual), or from the
    bonus row ``p_k`` when e == k. Emitted tokens are distributed as samples from the target model.
    :mod:`cupy_spec.reference.chain_speculative_sampling` states the semantics exactly (garbage
    probabilities, coins outside [0, 1), ids outside [0, V), all-zero residuals).

    Args (bs requests, k >= 0 draft tokens each, vocabulary V >= 1; contiguous, one device):
        draft_probs: float32 [bs, k, V]: row i = draft distribution ``x_i`` was drawn from.
        draft_token_ids: int32 or int64 [bs, k]: the draft tokens.
        target_probs: float32 [bs, k + 1, V]: row i = target distribution at position i (row k
            for the bonus token).
        maybe_output_accepted_token_num: int32 [bs] or None; **mutated** when given: ``a`` is added
            into it (it is returned). None: a new tensor holding ``a`` is returned.
        maybe_output_emitted_draft_token_num: int32 [bs] or None; **mutated** when given: ``e`` is
            added into it (it is returned). None: a new tensor holding ``e`` is returned.
        deterministic: bool, accepted for compatibility; results are always bitwise reproducible.
        generator: torch.Generator of the inputs' device, or None (torch's default generator):
            draws the coins ``torch.rand(bs, k + 1)`` when ``uniform_samples`` is None. Drawing
            inside a CUDA graph capture is replay-safe as for any torch RNG op (register a
            non-default generator with the graph).
        seed, offset: both None, or both given (then neither generator nor uniform_samples): the
            coins are :func:`cupy_spec.uniform_coins` ``(seed, offset)``, steps ``offset_b ..
            offset_b + k`` of a counter-based stream keyed by ``(seed_b, b)``, the same bits on
            every device, drawn inside the op's kernel. Each is an int in [0, 2**64) or an int64 or
            uint64 tensor [1] or [bs] on the inputs' device (the same 64-bit words either way).
            Tensors are read when the kernel runs, so a captured CUDA graph draws fresh coins after
            ``offset.add_(k + 1)`` (for a uint64 tensor, which torch cannot add to, on its view
            ``offset.view(torch.int64)``); ints are kernel parameters (no allocation), fixed at
            capture.
        uniform_samples: float32 [bs, k + 1] or None (keyword only): explicit coins, ``[:, i]``
            for the test of ``x_i`` and ``[:, k]`` for the final sample (clamped into [0, 1); NaN and
            subnormal coins count as 0). Not written.
        validate: also run the content checks of :func:`cupy_spec.check.chain_speculative_sampling`
            (ids in range, rows that are distributions, drafts with positive draft probability,
            coins in [0, 1)); errors name the argument. Synchronises with the device. Without it
            every content is given a defined meaning and nothing is checked.

    Returns ``(output_token_ids int32 [bs, k + 1], output_accepted_token_num int32 [bs],
    output_emitted_draft_token_num int32 [bs])``: row b of output_token_ids is
    ``[x_0, .., x_{e-1}, token, -1, .., -1]``. Inputs other than the counters are not modified.
    Without counters given, the three results are views of one new int32 allocation (each
    contiguous), written whole by the kernel: one allocation and no fill per call.

    CPU tensors run the reference; CUDA tensors run the kernel on torch's current stream (outputs
    and coins are allocated and drawn there). CuPy arrays (or other DLPack producers) are viewed
    without a copy; for CuPy arrays everything runs on CuPy's current stream and the outputs are
    CuPy arrays (NumPy inputs give NumPy outputs); given counters are returned as passed. Raises
    TypeError / ValueError naming the argument.
    """
    if type(deterministic) is not bool and isinstance(deterministic, np.generic):
        deterministic = deterministic.item()
    if type(deterministic) is not bool:
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} {deterministic!r}")
    if (seed is None) != (offset is None):
        raise ValueError(f"seed and offset go together: got {'seed' if offset is None else 'offset'} alone")
    if seed is not None and (generator is not None or uniform_samples is not None):
        other = "generator" if generator is not None else "uniform_samples"
        raise ValueError(f"give one source of coins: seed and offset, or {other}")
    seeds = None if seed is None else (seed, offset)
    try:
        if ((draft_probs is None or isinstance(draft_probs, _T))
                and (draft_token_ids is None or isinstance(draft_token_ids, _T))
                and (target_probs is None or isinstance(target_probs, _T))
                and (uniform_samples is None or isinstance(uniform_samples, _T))
                and (maybe_output_accepted_token_num is None or isinstance(maybe_output_accepted_token_num, _T))
                and (maybe_output_emitted_draft_token_num is None
                     or isinstance(maybe_output_emitted_draft_token_num, _T))):
            return _run(draft_probs, draft_token_ids, target_probs, uniform_samples, maybe_output_accepted_token_num,
                        maybe_output_emitted_draft_token_num, generator, seeds,
                        validate)  # a missing tensor: the core names it
        return _run_foreign((draft_probs, draft_token_ids, target_probs, uniform_samples,
                             maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num), generator, seeds,
                            validate)
    except (TypeError, ValueError) as e:  # name the counters as the caller passed them
        if isinstance(e, ValueError):
            e = _disagreement(draft_probs, draft_token_ids, target_probs, uniform_samples,
                              maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num) or e
        raise type(e)(_PUBLIC_NAMES.sub(r"maybe_\1", str(e))) from None


def _disagreement(draft_probs, draft_token_ids, target_probs, uniform_samples, acc, emi) -> ValueError | None:
    """The shape disagreement among the caller's own arrays, if any (sizes, then the constraints
    between them). The arrays allocated here take their sizes from draft_token_ids, so they must
    not outvote the caller's in the error."""
    given = dict(draft_probs=draft_probs, draft_token_ids=draft_token_ids, target_probs=target_probs,
                 uniform_samples=uniform_samples, output_token_ids=None, output_accepted_token_num=acc,
                 output_emitted_draft_token_num=emi, seed=None, offset=None)
    ranks = {a.name: len(a.dims) for a in OP.tensors}
    if not all(v is None or (isinstance(getattr(v, "shape", None), tuple) and len(v.shape) == ranks[k])
               for k, v in given.items()):
        return None  # a wrong rank: the core's error says so
    try:
        sizes = OP._sizes(given)
    except ValueError as e:
        return e
    if draft_probs is None or draft_token_ids is None or target_probs is None:
        return None  # a missing array: the core's error names it
    return OP.broken_constraint(sizes, given)


# the core op's names of the counters, which the public signature calls maybe_output_*
_PUBLIC_NAMES = re.compile(r"(?<!maybe_)\b(output_accepted_token_num|output_emitted_draft_token_num)\b")


def _run(draft_probs, draft_token_ids, target_probs, uniform_samples, acc, emi, generator, seeds, validate):
    """Torch tensors on torch's current stream: allocate, draw, launch."""
    ids_shape = draft_token_ids.shape if isinstance(draft_token_ids, _T) else ()
    bs, k = ids_shape if len(ids_shape) == 2 else (ids_shape[0] if ids_shape else 0, 0)
    # outputs on the inputs' device (Tensor.new_* costs about half of torch.empty(device=...) per call)
    like = target_probs if isinstance(target_probs, _T) else (
        draft_token_ids if isinstance(draft_token_ids, _T) else torch.empty(0))
    seed = offset = None
    seed_word = offset_word = 0
    if seeds is not None:
        (seed, seed_word), (offset, offset_word) = _word(seeds[0], "seed", like), _word(seeds[1], "offset", like)
    elif uniform_samples is None:
        check_generator(generator, like.device)
        uniform_samples = torch.rand((bs, k + 1), generator=generator, device=like.device, dtype=F32)
    out, acc, emi, accumulate = _outputs(like, bs, k, acc, emi)
    _core(draft_probs, draft_token_ids, target_probs, uniform_samples, out, acc, emi, seed, offset, accumulate,
          seeds is not None, seed_word, offset_word, validate=validate)
    return out, acc, emi


def _outputs(like: torch.Tensor, bs: int, k: int, acc, emi) -> tuple:
    """The token output, the counters and whether the kernel adds into them, on ``like``'s device.
    Without counters (the common call) all three are views of one int32 allocation, which the
    kernel writes whole (accumulate False): one allocation and no fill. A counter given alone gets
    a zeroed partner, added into."""
    if acc is None and emi is None:
        # (split_with_sizes: the native op; Tensor.split's Python wrapper costs twice as much)
        out, acc, emi = like.new_empty(bs * (k + 3), dtype=I32).split_with_sizes((bs * (k + 1), bs, bs))
        return out.view(bs, k + 1), acc, emi, False
    out = like.new_empty((bs, k + 1), dtype=I32)
    if acc is None:
        acc = like.new_zeros(bs, dtype=I32)
    if emi is None:
        emi = like.new_zeros(bs, dtype=I32)
    return out, acc, emi, True


def _word(x, name: str, like: torch.Tensor) -> tuple:
    """A seed or offset as the core op takes it, ``(tensor, 0)`` or ``(None, word)``: an int in
    [0, 2**64) becomes the int64 word holding its bits (a kernel parameter: no allocation); tensors
    (torch or DLPack arrays) are used as given, uint64 ones viewed as int64."""
    if isinstance(x, np.integer):
        x = int(x)
    if type(x) is int:
        if not 0 <= x < 2**64:
            raise ValueError(f"{name} must lie in [0, 2**64), got {x}")
        return None, int64_word(x)
    if not isinstance(x, _T) and (hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")):
        x = torch_view(name, x)
    if not isinstance(x, _T):
        raise TypeError(f"{name} must be an int, an int64 or uint64 tensor or None, got {type(x).__name__} {x!r}")
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device}, but the inputs are on {like.device}")
    if x.dtype == torch.uint64:
        x = x.view(I64)  # the same 64-bit words, without a copy (a graph still sees the caller's updates)
    return x, 0


def _run_foreign(given: tuple, generator, seeds, validate):
    """CuPy / NumPy / other DLPack inputs: zero-copy torch views, the work on CuPy's current stream
    where CuPy arrays are given, outputs handed back as arrays of the inputs' kind."""
    values = given[:4] + (None,) + given[4:] + (None, None)  # seed and offset: see _word
    views, stream = _call._from_foreign(OP, values)
    draft_probs, draft_token_ids, target_probs, uniform_samples, _, acc, emi, _, _ = views
    kinds = {type(x).__module__.split(".")[0] for x in given if x is not None and not isinstance(x, torch.Tensor)}

    def back(t, original):
        if original is not None:
            return original  # the caller's counter, written in place
        if "cupy" in kinds and t.is_cuda:
            import cupy

            return cupy.from_dlpack(t)  # on CuPy's current stream, which is torch's current one here
        if "numpy" in kinds and not t.is_cuda:
            return t.numpy()
        return t

    if stream is None:
        out, acc_t, emi_t = _run(draft_probs, draft_token_ids, target_probs, uniform_samples, acc, emi, generator,
                                 seeds, validate)
        return back(out, None), back(acc_t, given[4]), back(emi_t, given[5])
    dev = next(v.device for v in views if isinstance(v, torch.Tensor) and v.is_cuda)
    with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.ExternalStream(stream, device=dev)):
        out, acc_t, emi_t = _run(draft_probs, draft_token_ids, target_probs, uniform_samples, acc, emi, generator,
                                 seeds, validate)
        return back(out, None), back(acc_t, given[4]), back(emi_t, given[5])
