"""GPU launch path: launch plan, scratch buffers and a raw-pointer kernel launch.

Nothing here converts tensors: kernels receive raw device pointers packed into one parameter
struct (``TreeSpecParams`` in kernels/tree_speculative_sampling_target_only.cuh) and are launched
with ``cuLaunchKernel`` on the caller's stream.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import NamedTuple

import torch

from . import _loader

THREADS = 256
WARPS = THREADS // 32
MAX_PIECES = 2048  # piece sums a finisher keeps in shared memory
# 16-byte units per piece: one round of loads per warp (G batches of 32 units, G = 4 with a draft
# row, 8 without), and one warp reduction per piece.
PIECE_UNITS = {True: 128, False: 256}
BLOCKS_PER_SM = 4  # resident blocks per SM (__launch_bounds__(256, 4)): split rows into one wave
_NAMES = {
    False: f"cupy_spec::tree_speculative_sampling_target_only_kernel<{THREADS}, false>",
    True: f"cupy_spec::tree_speculative_sampling_target_only_kernel<{THREADS}, true>",
}
# 13 pointers; bs, n, S, V, P, chunks, piece_units, pieces; threshold_single, threshold_acc.
_PARAMS = struct.Struct("<13Q8q2d")
_INT32_MAX = 2**31 - 1


class Plan(NamedTuple):
    chunks: int  # blocks per request
    piece_units: int  # 16-byte units per piece
    pieces: int  # pieces per row (upper bound, also the scratch stride)
    smem: int  # dynamic shared memory bytes


_sm_counts: dict = {}


def plan(bs: int, n: int, V: int, device: int, has_draft: bool) -> Plan:
    """Launch shape for a call: split rows over as many blocks as fit on the GPU at once (one
    wave), at least one piece per warp, and keep every request's piece sums within MAX_PIECES.
    Computed once per launch record (see ``_record``), so it is not cached itself."""
    sms = _sm_counts.get(device)
    if sms is None:
        sms = _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    units = V // 4 + 2
    groups = -(-units // (PIECE_UNITS[has_draft] * MAX_PIECES))
    piece_units = PIECE_UNITS[has_draft] * groups
    pieces = -(-units // piece_units)
    chunks = max(1, min(BLOCKS_PER_SM * sms // bs, -(-pieces // WARPS), 65535))
    return Plan(chunks, piece_units, pieces, 48 * n + 4 * pieces)


class _Scratch:
    """Per (device, stream) scratch for split rows: piece sums and counters.

    Counters are zero between launches (the finishing block resets its own). Buffers are never
    freed, so CUDA graphs that captured them stay valid. Launches on one stream run in order and
    can share a buffer; graphs captured on the same stream share it too, so they must not be
    replayed concurrently on different streams.
    """

    _buffers: dict = {}
    _keep: list = []

    @classmethod
    def get(cls, device: int, stream: int, bs: int, pieces: int) -> tuple:
        key = (device, stream)
        buf = cls._buffers.get(key)
        need_parts, need_ctr = bs * pieces, bs
        if buf is None or buf[0] < need_parts or buf[1] < need_ctr:
            parts = max(need_parts, 2 * buf[0] if buf else 0, 1 << 16)
            ctrs = max(need_ctr, 2 * buf[1] if buf else 0, 1 << 12)
            mem = torch.zeros(parts + ctrs, dtype=torch.int32, device=f"cuda:{device}")
            if not torch.cuda.is_current_stream_capturing():
                # The zero-fill ran on torch's current stream; the kernel may run on another.
                torch.cuda.current_stream(device).synchronize()
            cls._keep.append(mem)
            base = mem.data_ptr()
            buf = cls._buffers[key] = (parts, ctrs, base, base + 4 * parts)
        return buf[2], buf[3]


class _ArgBuffer(threading.local):
    def __init__(self):
        self.params = ctypes.create_string_buffer(_PARAMS.size)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        self.argv_ptr = ctypes.addressof(self.argv)


_args = _ArgBuffer()


def check_limits(dims, device: int, has_draft: bool) -> Plan:
    """GPU-only size limits (int32 indices in the kernel, shared memory for the tree)."""
    for name, value in (("predicts length", dims.P), ("vocabulary V", dims.V), ("batch size", dims.bs)):
        if value > _INT32_MAX:
            raise ValueError(f"{name} {value} exceeds the GPU kernel's limit of {_INT32_MAX}")
    p = plan(dims.bs, dims.n, dims.V, device, has_draft)
    f = _loader.get_function(_NAMES[True], device)
    limit = f.max_dynamic_shared_size_bytes
    if p.smem > limit:
        raise ValueError(
            f"candidates has n={dims.n} nodes per tree; the GPU kernel keeps a tree in shared memory and "
            f"supports at most n={(limit - 4 * p.pieces) // 48} on this device"
        )
    return p


def launch(args: tuple, dims, threshold_single: float, threshold_acc: float, stream: int | None = None) -> None:
    """Launches the kernel for validated CUDA tensors ``args`` (the 11 tensors in signature order).

    ``stream`` is a raw cudaStream_t; None means torch's current stream of the tensors' device.
    """
    device = dims.cuda
    (predicts, accept_index, accept_num, cand, ri, nt, ns, us, usf, target, draft) = args
    has_draft = draft is not None
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(device)
    rec = _records.get((dims.bs, dims.n, dims.V, device, has_draft, stream)) or _record(dims, has_draft, stream)
    fptr, chunks, piece_units, pieces, smem, sums, ctrs = rec
    _PARAMS.pack_into(
        _args.params,
        0,
        cand.data_ptr(),
        ri.data_ptr(),
        nt.data_ptr(),
        ns.data_ptr(),
        us.data_ptr(),
        usf.data_ptr(),
        target.data_ptr(),
        draft.data_ptr() if has_draft else 0,
        predicts.data_ptr(),
        accept_index.data_ptr(),
        accept_num.data_ptr(),
        sums,
        ctrs,
        dims.bs,
        dims.n,
        dims.S,
        dims.V,
        dims.P,
        chunks,
        piece_units,
        pieces,
        threshold_single,
        threshold_acc,
    )
    if torch._C._cuda_getDevice() != device:
        with torch.cuda.device(device):
            _driver_launch(fptr, dims.bs, chunks, 1, THREADS, 1, 1, smem, stream, _args.argv_ptr, 0)
    else:
        _driver_launch(fptr, dims.bs, chunks, 1, THREADS, 1, 1, smem, stream, _args.argv_ptr, 0)


# (bs, n, V, device, has_draft, stream) -> (function, chunks, piece_units, pieces, smem, sums, counters)
_records: dict = {}
_driver_launch = None


def _record(dims, has_draft: bool, stream: int) -> tuple:
    """Everything a launch needs besides the tensors, for one shape, variant and stream."""
    global _driver_launch
    from cupy.cuda import driver

    _driver_launch = driver.launchKernel
    device = dims.cuda
    p = check_limits(dims, device, has_draft)
    sums, ctrs = _Scratch.get(device, stream, dims.bs, p.pieces) if p.chunks > 1 else (0, 0)
    fptr = _loader.get_function(_NAMES[has_draft], device).kernel.ptr
    rec = _records[(dims.bs, dims.n, dims.V, device, has_draft, stream)] = (
        fptr, p.chunks, p.piece_units, p.pieces, p.smem, sums, ctrs)
    return rec


def warmup(device: int | None = None) -> None:
    """Compiles and loads every kernel variant for ``device`` (default: the current one)."""
    if device is None:
        device = torch.cuda.current_device()
    for name in _NAMES.values():
        _loader.get_function(name, device)
