"""``verify_tree_greedy`` (the API of sgl_kernel's op of the same name): greedy verification of a
batch of draft trees against the target model's argmax tokens."""

from __future__ import annotations

import torch

from . import check, reference
from ._core import Arg, Launch, Op
from .tree_speculative_sampling_target_only import TREE_ARGS, TREE_CONSTRAINTS

I32, I64 = torch.int32, torch.int64
SMEM_PER_NODE = 36  # bytes of shared memory per tree node (the kernel's GreedyNode + visited flag)
MAX_WARPS = 4  # requests (warps) per block
LOAD_UNROLL = 4  # nodes per lane whose loads are in flight together
SMALL_SMEM = 48 * 1024  # shared memory per block that needs no opt-in

TABLE = (
    Arg("predicts", I32, ("P",), "target token after each node of the accepted path, at its retrive_index",
        written=True),
    *TREE_ARGS[1:],
    Arg("target_predict", I64, ("bs", "n"), "the target's argmax token after each node, read as a flat "
        "array at the node's retrive_index"),
)


def plan(dims, variant, dev) -> Launch:
    """One warp per request; MAX_WARPS requests per block once the batch fills the GPU with
    single-warp blocks and the trees fit the default shared memory. Where S >= n (as for chains of n
    nodes) the instantiation that first tests for a chain."""
    warps = MAX_WARPS if dims.bs > dev.sms and MAX_WARPS * dims.n * SMEM_PER_NODE <= SMALL_SMEM else 1
    return Launch((-(-dims.bs // warps), 1), 32 * warps, warps * dims.n * SMEM_PER_NODE, kernel=(dims.S >= dims.n,))


OP = Op(
    "verify_tree_greedy",
    """Greedy verification of a batch of draft trees (temperature 0).

Walks each request's tree from the root, accepting at each level the first child (in sibling order)
whose token equals the target's argmax after the current node, up to S-1 levels, and writes the
target's token after the last accepted node (the correction token, or the bonus token after S-1
accepts). :mod:`cupy_spec.reference.verify_tree_greedy` states the semantics exactly, including the
rules for malformed input.""",
    TABLE,
    reference=reference.verify_tree_greedy,
    plan=plan,
    plan_dims=("bs", "n", "S"),
    template=lambda chains: "true" if chains else "false",
    plan_variants=((False,), (True,)),
    constraints=TREE_CONSTRAINTS,
    constants=dict(SMEM_PER_NODE=SMEM_PER_NODE, MAX_WARPS=MAX_WARPS, LOAD_UNROLL=LOAD_UNROLL),
    check_inputs=check.verify_tree_greedy,
    too_large=lambda dims, limit, launch: f"candidates has n={dims.n} nodes per tree; the kernel keeps a tree in "
    f"shared memory and supports at most n={limit // SMEM_PER_NODE} on this device",
)
verify_tree_greedy = OP.function
