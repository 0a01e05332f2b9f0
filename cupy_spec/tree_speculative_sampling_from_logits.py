"""``tree_speculative_sampling_from_logits``: target-only tree verification straight from the target
model's logits, with temperature, top-k, top-p and min-p applied inside the kernel (no [bs, n, V]
probability tensor is ever written).

Semantics: :mod:`cupy_spec.reference.tree_speculative_sampling_from_logits` (the plain composition
``filter(softmax(logits / T))`` followed by ``tree_speculative_sampling_target_only``, stated on the
logits, with the float32 tolerances a kernel needs). Kernel: ``kernels/tree_speculative_sampling_from_logits.cuh``;
design and status: ``kernels/tree_speculative_sampling_from_logits.md``.
"""

from __future__ import annotations

import torch

from . import check
from ._core import Arg, Launch, Op, Scalar
from .tree_speculative_sampling_target_only import TREE_ARGS, TREE_CONSTRAINTS, vocabulary
from .reference.tree_speculative_sampling_from_logits import (
    tree_speculative_sampling_from_logits as _reference,
)

I32, F32 = torch.int32, torch.float32
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: template argument of the kernel per logits dtype (the kernel reads raw bits; no fp16/bf16 headers)
DTYPE_TAG = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

THREADS = 512  # threads per block (one request per block, or per cluster of blocks)
BLOCKS_PER_SM = 2  # blocks per SM whose registers the kernel budgets for (its __launch_bounds__)
LIST_CAP = 4096  # candidate tokens a block keeps in shared memory once the filters bound them
SMEM_PER_NODE = 44  # bytes of dynamic shared memory per tree node (the kernel's layout)
LIST_BYTES = 8 * LIST_CAP  # (index, key) per candidate
MIN_CHUNK = 4096  # fewest vocabulary entries per block of a cluster
# Fixed-point masses (weight * 2^39, rounded per token) summed over a row stay below 2^63, and a top-p
# mass is off by at most V * 2^-40 <= 7.6e-6, inside the reference's REL_TOL (1e-5).
MAX_V = 1 << 23

TABLE = (
    *TREE_ARGS,
    Arg("uniform_samples", F32, ("bs", "n"), "coin used among node i's children"),
    Arg("uniform_samples_for_final_sampling", F32, ("bs",), "coin of the final sample"),
    Arg("target_logits", LOGIT_DTYPES, ("bs", "n", "V"), "target logits after node i (after penalties and "
        "grammar masks; -inf masks a token, NaN counts as -inf)"),
    Arg("temperatures", F32, ("bs",), "temperature per request; not (T >= 1e-6) means greedy"),
    Arg("top_ks", I32, ("bs",), "top-k per request (off unless 0 < k < V); None: off", optional=True, default=None),
    Arg("top_ps", F32, ("bs",), "top-p per request, on the top-k distribution (off unless < 1); None: off",
        optional=True, default=None),
    Arg("min_ps", F32, ("bs",), "min-p per request, relative to the max probability (off unless > 0); None: off",
        optional=True, default=None),
    Scalar("threshold_single", "float", "accept any child whose probability is at least this", 1.0, 0.0, 1.0),
    Scalar("threshold_acc", "float", "the coin is compared with acc / max(threshold_acc, 1e-9)", 1.0, 0.0, 1.0),
)


def cluster_size(bs: int, V: int, dev) -> int:
    """Blocks per request: a thread-block cluster (sm_90) of 8 blocks while the grid has at most one
    block per SM, else of 4 or 2 while it fits the BLOCKS_PER_SM resident blocks per SM, every block
    keeping at least MIN_CHUNK entries of a row; else one block. Each visited row is a chain of
    dependent passes, and more blocks per request shorten every pass (kernels/NOTES.md)."""
    if dev.clusters:
        for c in (8, 4, 2):
            if c * MIN_CHUNK <= V and c * bs <= (1 if c == 8 else BLOCKS_PER_SM) * dev.sms:
                return c
    return 1


def plan(dims, variant, dev) -> Launch:
    """Grid (bs, C): request b's row work is split over C blocks (a cluster when C > 1), each block
    taking a contiguous chunk of every row it visits."""
    c = cluster_size(dims.bs, dims.V, dev)
    chunk = -(-dims.V // c)
    chunk = -(-chunk // 16) * 16
    return Launch((dims.bs, c), THREADS, LIST_BYTES + SMEM_PER_NODE * dims.n, c, (chunk,))


def check_inputs(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                 retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_logits,
                 temperatures, top_ks=None, top_ps=None, min_ps=None, threshold_single=1.0,
                 threshold_acc=1.0) -> None:
    """Content checks of ``tree_speculative_sampling_from_logits`` (``validate=True``): no written
    tensor shares memory with another argument, the tree links form a tree, reachable draft tokens
    lie in [0, V), ``retrive_index`` is in range and distinct, coins lie in [0, 1). Logits,
    temperatures and filter values need no check: every value has a meaning (reference module
    docstring). Synchronises with the device."""
    dims, _, _ = OP.check((predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_logits,
                           temperatures, top_ks, top_ps, min_ps, threshold_single, threshold_acc), overlap=True)
    if dims.bs == 0:
        return
    reach = check._check_layout(retrive_next_token, retrive_next_sibling)
    check._check_candidates(candidates, reach, dims.V, "target_logits")
    check._check_retrive_index(retrive_index, dims.P)
    check._check_unique_index(retrive_index)
    check._check_coins("uniform_samples", uniform_samples, reach)
    check._check_final_coins(uniform_samples_for_final_sampling)


OP = Op(
    "tree_speculative_sampling_from_logits",
    """Verify a batch of draft trees against the target model's logits and sample one more token.

Per request, the target distribution after each visited node is ``softmax(logits / T)`` filtered by
top-k, then top-p (on the top-k distribution), then min-p, each keeping every token tied with its
boundary; requests with ``not (T >= 1e-6)`` are greedy (one-hot at the first maximal logit). The walk
and the final sample are those of ``tree_speculative_sampling_target_only`` with ``draft_probs=None``
on these rows, but the rows are never materialised: the kernel computes, for each row the walk
visits, the row's maximum, the filter thresholds (exact on the logits for top-k, within 1e-5 for
top-p and min-p), the normaliser and the probabilities of the children it tries.
:mod:`cupy_spec.reference.tree_speculative_sampling_from_logits` states the semantics and the
tolerances exactly.""",
    TABLE,
    reference=_reference,
    plan=plan,
    # One instantiation per logits dtype; the optional tensors are tested at run time.
    template=lambda dtype, *optional: str(DTYPE_TAG[dtype]),
    variants=tuple((d,) for d in LOGIT_DTYPES),
    plan_dims=("bs", "n", "V"),
    constraints=(*TREE_CONSTRAINTS, vocabulary("target_logits")),
    constants=dict(THREADS=THREADS, BLOCKS_PER_SM=BLOCKS_PER_SM, LIST_CAP=LIST_CAP, SMEM_PER_NODE=SMEM_PER_NODE),
    launch_fields=("chunk",),
    limits={"V": MAX_V},
    check_inputs=check_inputs,
    too_large=lambda dims, limit, launch: f"candidates has n={dims.n} nodes per tree; the kernel keeps a tree in "
    f"shared memory and supports at most n={(limit - LIST_BYTES) // SMEM_PER_NODE} on this device",
)
tree_speculative_sampling_from_logits = OP.function
