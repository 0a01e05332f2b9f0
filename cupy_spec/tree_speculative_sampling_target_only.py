"""Public op ``tree_speculative_sampling_target_only`` (API-compatible with sgl_kernel's op).

CPU tensors run the torch reference; CUDA tensors run the NVRTC-compiled kernel on torch's current
stream; CuPy arrays (or any DLPack / ``__cuda_array_interface__`` producer) run the kernel on
CuPy's current stream, writing into the caller's memory. The op is also registered as the torch
custom op ``torch.ops.cupy_spec.tree_speculative_sampling_target_only`` so that ``torch.compile``
sees it as one opaque node that mutates its outputs (and ``draft_probs``).
"""

from __future__ import annotations

import torch

from . import _cuda, _validate, reference

__all__ = ["tree_speculative_sampling_target_only"]


def tree_speculative_sampling_target_only(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single=1.0,
    threshold_acc=1.0,
    deterministic=True,
    *,
    validate=False,
):
    """Verify a batch of draft trees against the target model and sample one more token.

    Walks each request's tree from the root, accepting at each level the first child (in sibling
    order) whose running probability mass passes the coin, then samples the correction token (or
    the bonus token when all S-1 levels were accepted) from the residual distribution. Semantics:
    SPEC §1, stated exactly by :mod:`cupy_spec.reference`. With thresholds 1.0/1.0 the emitted
    tokens are distributed as samples from the target model.

    Args (bs requests, n tree nodes each, vocabulary V, S = max depth + 1, P >= max index + 1):
        predicts: int32 [P], **written**: ``predicts[g]`` = token after the node with global index g
            on the accepted path (other entries untouched).
        accept_index: int32 [bs, S], **written**: global indices of the accepted path, root first;
            entries past the path are untouched.
        accept_token_num: int32 [bs], **written**: accepted draft tokens per request (0..S-1).
        candidates: int64 [bs, n]: token of each node (node 0 is the root).
        retrive_index: int64 [bs, n]: global index of each node (usually ``b * n + i``).
        retrive_next_token: int64 [bs, n]: first child of each node, -1 if none.
        retrive_next_sibling: int64 [bs, n]: next sibling of each node, -1 if none.
        uniform_samples: float32 [bs, n]: coin used when choosing among node i's children.
        uniform_samples_for_final_sampling: float32 [bs]: coin of the final sample.
        target_probs: float32 [bs, n, V]: target distribution over the children of node i.
        draft_probs: float32 [bs, n, V] or None. When given (sglang passes zeros) it is
            subtracted from the final node's row and **written**: every rejected child's target
            probability is stored at ``draft_probs[b, node, token]``. None means zeros and is
            faster: the row is never read and nothing is written.
        threshold_single: float in [0, 1]: accept any child whose probability is at least this.
        threshold_acc: float in [0, 1]: the coin is compared with ``acc / max(threshold_acc, 1e-9)``.
        deterministic: accepted for compatibility; results are always bitwise reproducible.
        validate: also run :func:`cupy_spec.check_inputs` (synchronises with the device).

    Returns None; outputs are written in place, with no copies of any argument.
    """
    args = (
        predicts,
        accept_index,
        accept_token_num,
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        uniform_samples,
        uniform_samples_for_final_sampling,
        target_probs,
        draft_probs,
    )
    stream = None
    if not isinstance(target_probs, torch.Tensor):
        args, stream = _from_foreign(args)
    dims = _validate.check_args(args, threshold_single, threshold_acc)
    if dims.bs == 0:
        return None
    if validate:
        from .check import check_inputs

        check_inputs(*args, threshold_single=threshold_single, threshold_acc=threshold_acc)
    if torch.compiler.is_compiling():
        torch.ops.cupy_spec.tree_speculative_sampling_target_only(
            *args, float(threshold_single), float(threshold_acc), bool(deterministic)
        )
    elif dims.cuda >= 0:
        _cuda.launch(args, dims, threshold_single, threshold_acc, stream)
    else:
        reference.tree_speculative_sampling_target_only(*args, threshold_single, threshold_acc, deterministic)
    return None


def _from_foreign(args: tuple) -> tuple:
    """Zero-copy torch views of DLPack / CUDA-array-interface arrays, and the stream to use
    (CuPy's current stream for CuPy arrays, else None for torch's current stream)."""
    out = []
    stream = None
    for name, a in zip(_validate.ARG_NAMES, args):
        if a is None or isinstance(a, torch.Tensor):
            out.append(a)
        elif hasattr(a, "__dlpack__"):
            out.append(torch.from_dlpack(a))
        elif hasattr(a, "__cuda_array_interface__"):
            out.append(torch.as_tensor(a, device="cuda"))
        else:
            raise TypeError(f"{name} must be a torch.Tensor or a DLPack array, got {type(a).__name__}")
        if type(a).__module__.startswith("cupy"):
            import cupy

            stream = cupy.cuda.get_current_stream().ptr
    return tuple(out), stream


# ---- torch custom op -------------------------------------------------------------------------

_SCHEMA = (
    "tree_speculative_sampling_target_only(Tensor(a!) predicts, Tensor(b!) accept_index, "
    "Tensor(c!) accept_token_num, Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, "
    "Tensor retrive_next_sibling, Tensor uniform_samples, Tensor uniform_samples_for_final_sampling, "
    "Tensor target_probs, Tensor(d!)? draft_probs, float threshold_single=1.0, float threshold_acc=1.0, "
    "bool deterministic=True) -> ()"
)


def _impl(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
          retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
          threshold_single=1.0, threshold_acc=1.0, deterministic=True):
    """Kernel of the torch custom op (CPU and CUDA dispatch keys)."""
    tensors = (predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
               retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs)
    dims = _validate.check_args(tensors, threshold_single, threshold_acc)
    if dims.bs == 0:
        return None
    if dims.cuda >= 0:
        _cuda.launch(tensors, dims, threshold_single, threshold_acc)
    else:
        reference.tree_speculative_sampling_target_only(*tensors, threshold_single, threshold_acc, deterministic)
    return None


def _fake(*args, **kwargs):
    return None


_lib = torch.library.Library("cupy_spec", "DEF")
_lib.define(_SCHEMA)
_lib.impl("tree_speculative_sampling_target_only", _impl, "CPU")
_lib.impl("tree_speculative_sampling_target_only", _impl, "CUDA")
_lib.impl("tree_speculative_sampling_target_only", _fake, "Meta")
