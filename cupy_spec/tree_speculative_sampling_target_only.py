"""``tree_speculative_sampling_target_only`` (the API of sgl_kernel's op of the same name): walk
each request's draft tree accepting children by the target probabilities, then sample the
correction / bonus token from the residual at the last accepted node."""

from __future__ import annotations

import torch

from . import check, reference
from ._core import Arg, Constraint, Launch, Op, Scalar, ScratchField

I32, I64, F32 = torch.int32, torch.int64, torch.float32
THREADS = 256
# Piece sums a finisher keeps in shared memory (per thread, then per block).
MAX_PIECES_PER_THREAD = 8
MAX_PIECES = THREADS * MAX_PIECES_PER_THREAD
#: Largest vocabulary of the kernel: a row's last 16-byte unit starts at most at V - 1, and the
#: kernel's 32-bit token arithmetic adds 3 to that start.
MAX_V = 2**31 - 5
# A warp issues G batches of 32 16-byte units before any arithmetic: 4 with a draft row, 8 without.
BATCHES = {True: 4, False: 8}
BLOCKS_PER_SM = 4  # resident blocks per SM (__launch_bounds__): split rows into one wave
SMEM_PER_NODE = 48  # bytes of shared memory per tree node (the kernel's Smem layout)

# The tree layout and walk outputs, shared by every tree verification op (sglang's argument order).
TREE_ARGS = (
    Arg("predicts", I32, ("P",), "token after each node of the accepted path, at its retrive_index", written=True),
    Arg("accept_index", I32, ("bs", "S"), "retrive_index of the accepted path, root first", written=True),
    Arg("accept_token_num", I32, ("bs",), "accepted draft tokens per request (0..S-1)", written=True),
    Arg("candidates", I64, ("bs", "n"), "token of each tree node (node 0 = root)"),
    Arg("retrive_index", I64, ("bs", "n"), "global index of each node (usually b*n + i)"),
    Arg("retrive_next_token", I64, ("bs", "n"), "first child of each node, -1 if none"),
    Arg("retrive_next_sibling", I64, ("bs", "n"), "next sibling of each node, -1 if none"),
)
# What every tree verification op requires of the tree layout's dimensions.
TREE_CONSTRAINTS = (
    Constraint("n >= 1", "candidates must have at least one node (n >= 1), got shape {shapes[candidates]}"),
    Constraint("S >= 1", "accept_index must have S >= 1 columns, got shape {shapes[accept_index]}"),
)


def vocabulary(name: str) -> Constraint:
    """V >= 1, named after the tensor that carries V."""
    return Constraint("V >= 1", f"{name} must have a vocabulary of V >= 1, got shape {{shapes[{name}]}}")

TABLE = (
    *TREE_ARGS,
    Arg("uniform_samples", F32, ("bs", "n"), "coin used among node i's children"),
    Arg("uniform_samples_for_final_sampling", F32, ("bs",), "coin of the final sample"),
    Arg("target_probs", F32, ("bs", "n", "V"), "target distribution over the children of node i"),
    Arg("draft_probs", F32, ("bs", "n", "V"), "subtracted from the final row; rejected children's target "
        "probabilities are stored at [b, node, token]; None means zeros (faster: never read or written)",
        written=True, optional=True, default=None),
    Scalar("threshold_single", "float", "accept any child whose probability is at least this", 1.0, 0.0, 1.0),
    Scalar("threshold_acc", "float", "the coin is compared with acc / max(threshold_acc, 1e-9)", 1.0, 0.0, 1.0),
    Scalar("deterministic", "bool", "accepted for compatibility; results are always bitwise reproducible", True,
           kernel=False),
)


def plan(dims, variant, dev) -> Launch:
    """Split rows over as many blocks as fit at once (one wave), at least one piece per warp, every
    request's piece sums within MAX_PIECES; the blocks of a request form one thread-block cluster
    where that pays (:func:`cluster_pays`), else they join through a counter in the scratch."""
    (has_draft,) = variant
    units = dims.V // 4 + 2
    per_round = 32 * BATCHES[has_draft]
    piece_units = per_round * -(-units // (per_round * MAX_PIECES))
    pieces = -(-units // piece_units)
    chunks = max(1, min(BLOCKS_PER_SM * dev.sms // dims.bs, -(-pieces // (THREADS // 32)), 65535))
    cluster = chunks if dev.clusters and cluster_pays(dims.bs, chunks, dev.sms) else 1
    return Launch((dims.bs, chunks), THREADS, SMEM_PER_NODE * dims.n + 4 * pieces, cluster,
                  (chunks, piece_units, pieces), scratch=chunks > 1 and cluster == 1)


def cluster_pays(bs: int, chunks: int, sms: int) -> bool:
    """Measured on an H200 (132 SMs): clusters of 2 at bs=256 and of 8 at bs=1 gain 0.2-2 µs per
    call (no fence, atomic and reload of the piece sums); clusters of 8 at bs=64 (512 blocks) lose
    5-8 µs, so clusters of 4 or 8 are used only while the grid has at most one block per SM."""
    return chunks == 2 or (chunks in (4, 8) and bs * chunks <= sms)


OP = Op(
    "tree_speculative_sampling_target_only",
    """Verify a batch of draft trees against the target model and sample one more token.

Walks each request's tree from the root, accepting at each level the first child (in sibling order)
whose running target probability mass passes the request's coin, then samples the correction token
(or the bonus token when all S-1 levels were accepted) from the residual distribution at the last
accepted node. :mod:`cupy_spec.reference` states the semantics exactly, including the rules for
malformed input. With thresholds 1.0/1.0 the emitted tokens are distributed as samples from the
target model.""",
    TABLE,
    reference=reference.tree_speculative_sampling_target_only,
    plan=plan,
    template=lambda has_draft: str(has_draft).lower(),
    variants=((False,), (True,)),
    plan_dims=("bs", "n", "V"),
    constraints=(*TREE_CONSTRAINTS, vocabulary("target_probs")),
    constants=dict(THREADS=THREADS, MAX_PIECES_PER_THREAD=MAX_PIECES_PER_THREAD, BATCHES_DRAFT=BATCHES[True],
                   BATCHES_NONE=BATCHES[False], BLOCKS_PER_SM=BLOCKS_PER_SM, SMEM_PER_NODE=SMEM_PER_NODE),
    launch_fields=("chunks", "piece_units", "pieces"),
    limits={"V": MAX_V},
    scratch=(ScratchField("piece_sums", "float", lambda sms: 2 * sms * MAX_PIECES),
             ScratchField("counters", "unsigned int", lambda sms: 2 * sms, zero_between_launches=True)),
    check_inputs=check.check_inputs,
    too_large=lambda dims, limit, launch: f"candidates has n={dims.n} nodes per tree; the kernel keeps a tree in "
    f"shared memory and supports at most n={(limit - 4 * launch.fields[2]) // SMEM_PER_NODE} on this device",
)
tree_speculative_sampling_target_only = OP.function
