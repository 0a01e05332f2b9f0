"""cupy_spec: runtime-compiled GPU kernels for speculative decoding.

Where a serving engine has an op of the same name (sglang, FlashInfer), the op takes its arguments;
the ops write their outputs into the caller's tensors (``chain_speculative_sampling`` allocates and
returns them, as FlashInfer's does). CUDA tensors run an NVRTC-compiled kernel on the caller's stream; CPU
tensors run the pure-torch reference in :mod:`cupy_spec.reference`, which states the semantics.
"""

from . import reference, tree
from .build_tree_kernel_efficient import build_tree_kernel_efficient
from .chain_speculative_sampling import chain_speculative_sampling
from .check import check_inputs
from .tree_speculative_sampling import tree_speculative_sampling
from .tree_speculative_sampling_from_logits import tree_speculative_sampling_from_logits
from .tree_speculative_sampling_target_only import tree_speculative_sampling_target_only
from .uniform_coins import uniform_coins
from .verify_tree_greedy import verify_tree_greedy

__version__ = "0.1.0"
__all__ = ["tree_speculative_sampling_target_only", "verify_tree_greedy", "build_tree_kernel_efficient",
           "chain_speculative_sampling", "tree_speculative_sampling",
           "tree_speculative_sampling_from_logits", "uniform_coins", "check_inputs", "warmup", "check_scratch",
           "reference", "tree", "__version__"]


def warmup(device=None, stream=None) -> None:
    """Compiles and loads every kernel for ``device`` (default: the device of ``stream`` where it
    is a torch or CuPy stream, else torch's current CUDA device) and prepares the scratch memory of
    ``stream`` (a ``torch.cuda.Stream``, a CuPy stream or a raw ``cudaStream_t``; default: torch's
    current stream of the device), plus spare scratch for streams first used inside a CUDA graph
    capture. Call it before capturing graphs: afterwards no call compiles or allocates. Raises
    RuntimeError when no usable CUDA GPU is present, ValueError when ``stream`` is on another
    device than ``device``."""
    import torch

    from . import _launch

    index = _device_index(device)
    if stream is None:
        raw = torch._C._cuda_getCurrentRawStream(index)
    else:
        raw = int(getattr(stream, "cuda_stream", getattr(stream, "ptr", stream)))
        on = _stream_device(stream)
        if on is not None and device is None:
            index = on
        elif on is not None and on != index:
            raise ValueError(f"stream is a stream of cuda:{on}, but device is cuda:{index}")
    _launch.warmup(index, raw)


def _stream_device(stream):
    """The CUDA device index of a torch or CuPy stream (None for a raw handle)."""
    device = getattr(stream, "device", None)  # torch.cuda.Stream
    if device is not None and getattr(device, "index", None) is not None:
        return device.index
    index = getattr(stream, "device_id", None)  # cupy.cuda.Stream
    return index if isinstance(index, int) and index >= 0 else None


def check_scratch(device=None, reset: bool = False) -> int:
    """Debug check of the scratch that the blocks of a split request use to hand over work:
    synchronises ``device`` and verifies that every hand-off counter is zero, as it is after any
    complete launch. A non-zero counter means a launch lost an arrival (for example two CUDA graphs
    captured on one stream replayed concurrently on two streams). Raises RuntimeError naming the
    stream and op, or with ``reset=True`` zeroes them and returns how many were not zero."""
    from . import _launch

    bad = _launch.Scratch.check(_device_index(device), reset=reset)
    if bad and not reset:
        stream, op, field, i, v = bad[0]
        raise RuntimeError(f"{len(bad)} scratch counter(s) not zero; first: {op}.{field}[{i}] = {v} on stream "
                           f"{stream:#x}. Concurrent replays of graphs captured on one stream? "
                           f"check_scratch(reset=True) repairs them")
    return len(bad)


def _device_index(device) -> int:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("cupy_spec needs a usable CUDA GPU here (torch.cuda.is_available() is False: no GPU, "
                           "no driver, or a CPU build of torch); CPU tensors run the reference without one")
    if device is None:
        return torch.cuda.current_device()
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {d}")
    return d.index if d.index is not None else torch.cuda.current_device()
