"""Pure-torch references of the ops: the readable statement of each op's semantics.

Each op's reference lives in ``cupy_spec/reference/<op>.py``, takes the op's arguments and writes
the same outputs in place (``chain_speculative_sampling``'s takes its coins as ``uniform_samples``
and returns its outputs, as the public op does). The CUDA kernels must match them (final sampled
tokens may differ only at float32 rounding ties, measured by :func:`final_token_slack`). They also
serve as the CPU backend: CPU tensors run them, vectorised over the batch, on any torch device.
"""

from ._common import (
    COIN_MAX,
    FLT_MIN,
    clamp_coins,
    effective_probs,
    final_token_slack,
    flush_subnormal,
    residual,
    sample_residual,
)
from .build_tree_kernel_efficient import build_tree_kernel_efficient
from .chain_speculative_sampling import chain_speculative_sampling
from .tree_speculative_sampling import tree_speculative_sampling
from .tree_speculative_sampling_from_logits import tree_speculative_sampling_from_logits
from .tree_speculative_sampling_target_only import tree_speculative_sampling_target_only
from .uniform_coins import uniform_coins
from .verify_tree_greedy import verify_tree_greedy

__all__ = [
    "tree_speculative_sampling_target_only",
    "verify_tree_greedy",
    "build_tree_kernel_efficient",
    "chain_speculative_sampling",
    "tree_speculative_sampling",
    "tree_speculative_sampling_from_logits",
    "uniform_coins",
    "effective_probs",
    "flush_subnormal",
    "clamp_coins",
    "residual",
    "sample_residual",
    "final_token_slack",
    "FLT_MIN",
    "COIN_MAX",
]
