"""GPU launch path: launch plan, scratch buffers and a raw-pointer kernel launch.

Nothing here converts tensors: kernels receive raw device pointers packed into one parameter
struct (``TreeSpecParams`` in kernels/tree_speculative_sampling_target_only.cuh) and are launched
on the caller's stream, with ``cuLaunchKernel`` or, for thread-block clusters, ``cuLaunchKernelEx``.
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
MAX_PIECES = THREADS * 8  # piece sums a finisher keeps in shared memory (kMaxPiecesPerThread = 8)
# 16-byte units per piece: one round of loads per warp (G batches of 32 units, G = 4 with a draft
# row, 8 without), and one warp reduction per piece.
PIECE_UNITS = {True: 128, False: 256}
BLOCKS_PER_SM = 4  # resident blocks per SM (__launch_bounds__(256, 4)): split rows into one wave
MAX_CLUSTER = 8  # largest portable thread-block cluster
# Launch the blocks of a request as one thread-block cluster where the GPU has clusters (compute
# capability 9.0 and later) and that pays (see plan). False: always join them with the counter.
CLUSTERS = True
_NAMES = {
    False: f"cupy_spec::tree_speculative_sampling_target_only_kernel<{THREADS}, false>",
    True: f"cupy_spec::tree_speculative_sampling_target_only_kernel<{THREADS}, true>",
}
# 13 pointers; bs, n, S, V, P, chunks, piece_units, pieces; threshold_single, threshold_acc.
_PARAMS = struct.Struct("<13Q8q2d")
_INT32_MAX = 2**31 - 1


class Plan(NamedTuple):
    chunks: int  # blocks per request
    cluster: int  # blocks per thread-block cluster: chunks, or 1 (no cluster)
    piece_units: int  # 16-byte units per piece
    pieces: int  # pieces per row (upper bound, also the scratch stride)
    smem: int  # dynamic shared memory bytes


def plan(bs: int, n: int, V: int, has_draft: bool, sms: int, clusters: bool) -> Plan:
    """Launch shape for a call on a GPU with ``sms`` SMs: split rows over as many blocks as fit
    at once (one wave), at least one piece per warp, and keep every request's piece sums within
    MAX_PIECES. With ``clusters`` (the GPU has them), the blocks of a request form one thread-block
    cluster where that pays (``_cluster_pays``)."""
    units = V // 4 + 2
    groups = -(-units // (PIECE_UNITS[has_draft] * MAX_PIECES))
    piece_units = PIECE_UNITS[has_draft] * groups
    pieces = -(-units // piece_units)
    chunks = max(1, min(BLOCKS_PER_SM * sms // bs, -(-pieces // WARPS), 65535))
    cluster = chunks if clusters and _cluster_pays(bs, chunks, sms) else 1
    return Plan(chunks, cluster, piece_units, pieces, 48 * n + 4 * pieces)


def _cluster_pays(bs: int, chunks: int, sms: int) -> bool:
    """Whether the blocks of a request go faster as one cluster. Measured on an H200 (132 SMs):
    clusters of 2 at bs=256 and of 8 at bs=1 gain 0.2-2 µs per call (no fence, atomic and reload of
    the piece sums); clusters of 8 at bs=64 (512 blocks) lose 5-8 µs, so clusters of 4 or 8 are
    used only while the grid has at most one block per SM. Other block counts use the counter."""
    if chunks == 2:
        return True
    return chunks in (4, MAX_CLUSTER) and bs * chunks <= sms


_devices: dict = {}


def _device_plan(dims, device: int, has_draft: bool) -> Plan:
    props = _devices.get(device)
    if props is None:
        p = torch.cuda.get_device_properties(device)
        props = _devices[device] = (p.multi_processor_count, p.major >= 9 and _launch_ex() is not None)
    sms, has_clusters = props
    return plan(dims.bs, dims.n, dims.V, has_draft, sms, has_clusters and CLUSTERS)


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
    p = _device_plan(dims, device, has_draft)
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
    fptr, chunks, config, piece_units, pieces, smem, sums, ctrs = rec
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
            _submit(fptr, dims.bs, chunks, config, smem, stream)
    elif not config:  # the common case, without a further Python call
        _driver_launch(fptr, dims.bs, chunks, 1, THREADS, 1, 1, smem, stream, _args.argv_ptr, 0)
    else:
        _launch_cluster(config, fptr)


def _submit(fptr: int, bs: int, chunks: int, config: int, smem: int, stream: int) -> None:
    """Driver launch of grid (bs, chunks); ``config`` is the address of a cluster launch config, or 0."""
    if not config:
        _driver_launch(fptr, bs, chunks, 1, THREADS, 1, 1, smem, stream, _args.argv_ptr, 0)
    else:
        _launch_cluster(config, fptr)


def _launch_cluster(config: int, fptr: int) -> None:
    """cuLaunchKernelEx with a launch config made by ``_cluster_config``; clusters are planned only
    where ``_launch_ex`` found the entry point, so it is loaded."""
    status = _launch_ex_fn[0](config, fptr, _args.argv_ptr, None)
    if status != 0:
        from cupy.cuda import driver

        raise driver.CUDADriverError(status)


# (bs, n, V, device, has_draft, stream)
#   -> (function, chunks, address of a cluster launch config or 0, piece_units, pieces, smem, sums, counters)
_records: dict = {}
_driver_launch = None


def _record(dims, has_draft: bool, stream: int) -> tuple:
    """Everything a launch needs besides the tensors, for one shape, variant and stream."""
    global _driver_launch
    from cupy.cuda import driver

    _driver_launch = driver.launchKernel
    device = dims.cuda
    p = check_limits(dims, device, has_draft)
    sums, ctrs = _Scratch.get(device, stream, dims.bs, p.pieces) if p.chunks > 1 and p.cluster == 1 else (0, 0)
    fptr = _loader.get_function(_NAMES[has_draft], device).kernel.ptr
    config = _cluster_config(dims.bs, p, stream) if p.cluster > 1 else 0
    rec = _records[(dims.bs, dims.n, dims.V, device, has_draft, stream)] = (
        fptr, p.chunks, config, p.piece_units, p.pieces, p.smem, sums, ctrs)
    return rec


# ---- cluster launches through the driver's cuLaunchKernelEx (cuda.h, CUDA 12.0 and later) -----


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_launch_ex_fn: list = []


def _launch_ex():
    """The driver's cuLaunchKernelEx (None where the driver library or the entry point is missing)."""
    if not _launch_ex_fn:
        fn = None
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _launch_ex_fn.append(fn)
    return _launch_ex_fn[0]


_configs: list = []  # cluster launch configs, alive as long as the records that point to them


def _cluster_config(bs: int, p: Plan, stream: int) -> int:
    """Address of a launch config of grid (bs, chunks) with one cluster of ``p.cluster`` blocks
    per request."""
    attr = _LaunchAttribute(id=_CLUSTER_DIMENSION)
    attr.value[0], attr.value[1], attr.value[2] = 1, p.cluster, 1
    cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(bs, p.chunks, 1), block=(ctypes.c_uint * 3)(THREADS, 1, 1),
                        shared_mem_bytes=p.smem, stream=stream or None, attrs=ctypes.pointer(attr), num_attrs=1)
    _configs.append((cfg, attr))
    return ctypes.addressof(cfg)


def warmup(device: int | None = None) -> None:
    """Compiles and loads every kernel variant for ``device`` (default: the current one)."""
    if device is None:
        device = torch.cuda.current_device()
    for name in _NAMES.values():
        _loader.get_function(name, device)
