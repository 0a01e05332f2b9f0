"""``tree_speculative_sampling``: lossless verification of a batch of draft trees whose tokens were
sampled from the draft model's distributions (tree layout of ``tree_speculative_sampling_target_only``
plus the draft rows and the flag ``replacement``)."""

from __future__ import annotations

import torch

from . import _launch, check, reference
from ._core import Arg, Launch, Op, Scalar
from .chain_speculative_sampling import cluster_size, pieces_for
from .tree_speculative_sampling_target_only import TREE_ARGS, TREE_CONSTRAINTS, vocabulary

F32 = torch.float32
# Builds (threads per block, blocks per SM whose registers the build budgets for): the first by
# default, the second where the first gives a request a cluster of at most 2 blocks.
BUILDS = ((512, 1), (256, 4))
BATCHES = 4  # 16-byte units a lane loads per row before any arithmetic
MAX_PIECES = 2048  # piece sums (float64) of the final sample kept in shared memory
SMEM_PER_NODE = 48  # bytes of shared memory per tree node (the kernel's DSmem layout)

TABLE = (
    *TREE_ARGS,
    Arg("uniform_samples", F32, ("bs", "n"), "coin of node i's own acceptance test (the root's is unused)"),
    Arg("uniform_samples_for_final_sampling", F32, ("bs",), "coin of the final sample"),
    Arg("target_probs", F32, ("bs", "n", "V"), "target distribution after node i (over its children)"),
    Arg("draft_probs", F32, ("bs", "n", "V"), "draft distribution node i's children were drawn from (not written)"),
    Scalar("replacement", "bool", "children drawn i.i.d. from the draft row (True) or without replacement in "
           "sibling order (False)", kernel=False, variant=True),
    Scalar("deterministic", "bool", "accepted for compatibility; results are always bitwise reproducible", True,
           kernel=False),
)


def plan(dims, variant, dev) -> Launch:
    """One block per request, or one thread-block cluster of C blocks that walk together and split
    every pass over the rows (sm_90 and later). Clusters of the 512-thread build while the grid stays
    within one block per SM (up to 16 blocks where the launch record finds them resident); where
    that gives a request at most 2 blocks, or 4 where one block per SM is what holds it there,
    clusters of 8 (or 4) of the 256-thread build, however many waves the grid then takes: a
    request's passes are chains of dependent steps, and more blocks per pass shorten them more than
    waiting for free SMs costs (kernels/NOTES.md, tree v7 and v9)."""
    piece_units, pieces = pieces_for(dims.V, BATCHES, MAX_PIECES)
    (threads, blocks), (small, per_sm) = BUILDS
    largest = dev.largest((threads, blocks))
    c = cluster_size(dims.bs, pieces, dev, threads // 32, largest)
    held_by_sms = c < cluster_size(dims.bs, pieces, dev, threads // 32, largest, one_wave=False)
    if c <= 2 or (c <= 4 and held_by_sms):
        c_small = cluster_size(dims.bs, pieces, dev, small // 32, _launch.MAX_CLUSTER, one_wave=False)
        if c_small >= 4:
            c, threads, blocks = c_small, small, per_sm
    return Launch((dims.bs, c), threads, 8 * pieces + SMEM_PER_NODE * dims.n, c, (piece_units, pieces),
                  kernel=(threads, blocks))


OP = Op(
    "tree_speculative_sampling",
    """Verify a batch of draft trees with the draft probabilities and sample one more token.

Walks each request's tree from the root. At a node, the children are tried in sibling order; child
x (coin u) is accepted iff ``u * Q(x) * c < R(x)``, where R is the node's residual (its target row
at first), Q its draft row and c = sum(R) / sum(Q). A rejection updates ``R <- max(R - c Q, 0)``
and, with ``replacement=False``, removes x from Q. An accepted child becomes the current node; the
walk stops after S-1 accepted tokens or when a node has no child left, and samples the correction
/ bonus token from the current R. With draft trees drawn as ``replacement`` says (i.i.d. siblings,
or siblings without replacement in sibling order), the emitted tokens are distributed as samples
from the target model. :mod:`cupy_spec.reference.tree_speculative_sampling` states the semantics
exactly, in float32, including the rules for malformed input; ``docs/draft_probability_sampling.md``
derives them.""",
    TABLE,
    reference=reference.tree_speculative_sampling,
    plan=plan,
    template=lambda replacement, threads, blocks: f"{str(bool(replacement)).lower()}, {threads}, {blocks}",
    variants=((False,), (True,)),
    plan_variants=BUILDS,
    plan_dims=("bs", "n", "V"),
    check_inputs=check.tree_speculative_sampling,
    constraints=(*TREE_CONSTRAINTS, vocabulary("target_probs")),
    constants=dict(BATCHES=BATCHES, SMEM_PER_NODE=SMEM_PER_NODE),
    launch_fields=("piece_units", "pieces"),
    too_large=lambda dims, limit, launch: f"candidates has n={dims.n} nodes per tree; the kernel keeps a tree in "
    f"shared memory and supports at most n={(limit - 8 * launch.fields[1]) // SMEM_PER_NODE} on this device",
)
tree_speculative_sampling = OP.function
