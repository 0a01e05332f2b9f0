"""cupy_spec: runtime-compiled GPU kernels for speculative decoding.

``tree_speculative_sampling_target_only`` verifies draft trees against the target model (API of
sgl_kernel's op of the same name). CUDA tensors run an NVRTC-compiled kernel; CPU tensors run the
pure-torch reference in :mod:`cupy_spec.reference`.
"""

from . import reference, tree
from .check import check_inputs
from .tree_speculative_sampling_target_only import tree_speculative_sampling_target_only

__version__ = "0.1.0"
__all__ = ["tree_speculative_sampling_target_only", "check_inputs", "warmup", "reference", "tree", "__version__"]


def warmup(device=None) -> None:
    """Compiles and loads every kernel variant for ``device`` (default: torch's current CUDA
    device), so that later calls, including CUDA-graph capture, never compile."""
    from . import _cuda

    _cuda.warmup(device if device is None else _device_index(device))


def _device_index(device) -> int:
    import torch

    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {d}")
    return d.index if d.index is not None else torch.cuda.current_device()
