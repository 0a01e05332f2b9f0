"""The GPU launch path shared by every op: device facts, launch records, per-stream scratch and
the driver launch.

Kernels receive raw device pointers packed into one parameter struct (generated from the op's
table, see :meth:`cupy_spec._core.Op.cpp_prelude`) and are launched on the caller's stream with
``cuLaunchKernel`` (through CuPy) or, for thread-block clusters and programmatic dependent launch,
``cuLaunchKernelEx`` (through ctypes). A launch record holds everything a launch needs besides the
tensors, per op, planned shape, variant, device and stream; the generated fast path of each op reads
it directly.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

import torch

from . import _loader
from ._core import Arg, Scalar

# Launch the blocks of a request as one thread-block cluster where the GPU has clusters (compute
# capability 9.0 and later) and the op's plan says it pays. False: never (takes effect for shapes
# not launched before).
CLUSTERS = True
MAX_CLUSTER = 8  # largest portable thread-block cluster
# Largest cluster a plan may ask for on GPUs with clusters. Sizes above MAX_CLUSTER are
# "non-portable": the record opts the kernel in and keeps them only where the driver says that
# every cluster of the grid can be resident at once, as it does for any size where the plan asks
# for one wave (Launch.one_wave); else it plans again, told which kernel build and size were
# refused (DeviceInfo.refused), and the plan picks a smaller size of that build or another build.
# A GPU's clusters of 8 can fall short of SMs / 8: its SMs are split unevenly among the GPCs that
# hold a cluster. Where the driver cannot tell, the record keeps sizes up to MAX_CLUSTER and no
# larger ones; so does a record first made while the stream is capturing a CUDA graph, unless a
# call of the same shape on another stream already had the driver's answer (no driver query during
# a capture).
LARGEST_CLUSTER = 16
# Launch with programmatic dependent launch where the GPU has it (compute capability 9.0 and later,
# a driver of CUDA 12.3 or later, which also captures it in CUDA graphs): a kernel's blocks may start
# while the kernel before it on the stream finishes, and wait for it before touching memory, so
# back-to-back launches overlap their launch latency. False: never (takes effect for shapes not
# launched before).
PDL = True
PARAMS_BYTES = 1024  # the largest parameter struct of any op


class DeviceInfo(NamedTuple):
    index: int
    sms: int  # multiprocessors
    clusters: bool  # thread-block clusters usable (and CLUSTERS on)
    max_cluster: int = MAX_CLUSTER  # largest cluster a plan may use (when clusters is True)
    refused: frozenset = frozenset()  # (kernel, cluster) of this shape found not all resident at once

    def largest(self, kernel: tuple) -> int:
        """The largest cluster a plan may use with the kernel build ``kernel`` (a plan's ``kernel``):
        below every size refused for it."""
        return min([self.max_cluster] + [c - 1 for k, c in self.refused if k == kernel])


class _Buffers(threading.local):
    """Per-thread parameter buffer and the one-entry argument array pointing at it."""

    def __init__(self):
        self.params = ctypes.create_string_buffer(PARAMS_BYTES)
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        self.keep, self.argv = argv, ctypes.addressof(argv)


class _TLS(threading.local):
    def __init__(self):
        self.buf = _Buffers()


tls = _TLS()


class _State:
    """multi: more than one GPU is visible, so the fast paths compare every tensor's device and the
    current device (set with the first launch record; True until then, the safe answer)."""

    multi = True


state = _State()
driver_launch = None  # cupy.cuda.driver.launchKernel, bound with the first launch record
_devices: dict = {}


def device_info(device: int) -> DeviceInfo:
    facts = _devices.get(device)
    if facts is None:
        p = torch.cuda.get_device_properties(device)
        # clusters need sm_90 code: NVRTC older than 11.8 cannot build it, and kernels built for an
        # older architecture compile their cluster barriers to nothing
        sm90 = p.major >= 9 and _launch_ex() is not None and _loader.nvrtc_version() >= (11, 8)
        facts = _devices[device] = (p.multi_processor_count, sm90, sm90 and _driver_version() >= 12030)
    return DeviceInfo(device, facts[0], facts[1] and CLUSTERS, LARGEST_CLUSTER)


def _driver_version() -> int:
    """The driver's CUDA version as 1000 * major + 10 * minor (0 where it cannot be read)."""
    from cupy_backends.cuda.api import runtime

    try:
        return runtime.driverGetVersion()
    except runtime.CUDARuntimeError:
        return 0


def pdl(device: int) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch (see PDL)."""
    device_info(device)
    return PDL and _devices[device][2]


def run(op, values: tuple, dims, device: int, variant: tuple, stream: int | None) -> None:
    """Launches ``op`` for checked CUDA arguments ``values`` (signature order). ``stream`` is a
    raw cudaStream_t; None means torch's current stream of ``device``."""
    for d, limit in op.limits.items():
        value = getattr(dims, d)
        if limit is not None and value > limit:
            users = [a.name for a in op.tensors if d in a.dims]
            raise ValueError(f"dimension {d} = {value} (of {', '.join(users)}) exceeds the GPU kernel's limit of {limit}")
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(device)
    if torch._C._cuda_getDevice() != device:  # the record's driver queries and the launch run on ``device``
        with torch.cuda.device(device):
            _run_here(op, values, dims, device, variant, stream)
    else:
        _run_here(op, values, dims, device, variant, stream)


def record_key(op, dims, variant: tuple, device: int, stream: int) -> tuple:
    """The launch record's key (the generated fast path builds the same tuple inline)."""
    return op.plan_key(*dims) + variant + (device, _lane(stream))


def _run_here(op, values: tuple, dims, device: int, variant: tuple, stream: int) -> None:
    key = record_key(op, dims, variant, device, stream)
    rec = op.records.get(key) or _record(op, key, dims, variant, device, stream)
    *_, fields, scratch = rec
    ptrs = [0 if v is None else v.data_ptr() for v, e in zip(values, op.table) if isinstance(e, Arg)]
    scalars = [float(v) if e.kind == "float" else int(v) for v, e in zip(values, op.table)
               if isinstance(e, Scalar) and e.kernel]
    buf = tls.buf
    op.struct.pack_into(buf.params, 0, *ptrs, *scratch, *dims, *fields, *scalars)
    _submit(rec, stream, buf)


def _submit(rec: tuple, stream: int, buf) -> None:
    fptr, gx, gy, block, smem, cfg = rec[:6]
    if cfg:
        launch_with_config(cfg, fptr, buf.argv)
    else:
        driver_launch(fptr, gx, gy, 1, block, 1, 1, smem, stream, buf.argv, 0)


def _record(op, key: tuple, dims, variant: tuple, device: int, stream: int) -> tuple:
    """Plans the launch of one shape, variant, device and stream, and keeps the record (with
    ``device`` current)."""
    global driver_launch
    from cupy.cuda import driver

    driver_launch = driver.launchKernel
    state.multi = torch.cuda.device_count() > 1
    info = device_info(device)
    plan = op.plan(dims, variant, info)
    f = _loader.get_function(op, op.kernel_name(variant, plan.kernel), device)
    while plan.cluster > 1 and not _clusters_kept(f, plan, device, stream):
        info = info._replace(refused=info.refused | {(plan.kernel, plan.cluster)})
        plan = op.plan(dims, variant, info)
        if plan.cluster > info.largest(plan.kernel):
            raise RuntimeError(f"{op.name}'s plan ignores DeviceInfo.refused")
        f = _loader.get_function(op, op.kernel_name(variant, plan.kernel), device)
    limit = f.max_dynamic_shared_size_bytes
    if plan.smem > limit:
        hint = op.too_large(dims, limit, plan) if op.too_large else "use a smaller shape"
        raise ValueError(f"{op.name} needs {plan.smem} bytes of shared memory per block for this shape, more than "
                         f"the {limit} this GPU allows: {hint}")
    scratch = Scratch.pointers(op, device, stream) if plan.scratch else (0,) * len(op.scratch)
    gx, gy = (tuple(plan.grid) + (1,))[:2]
    dependent = pdl(device)
    cfg = _kept_config(gx, gy, plan, stream, dependent) if plan.cluster > 1 or dependent else 0
    rec = op.records[key] = (f.kernel.ptr, gx, gy, plan.block, plan.smem, cfg, tuple(plan.fields), scratch)
    return rec


# ---- per-stream scratch --------------------------------------------------------------------------

PER_THREAD_STREAM = 2  # cudaStreamPerThread: one handle, a different stream in every thread


def _lane(stream: int):
    """What owns a record and a scratch slot: the stream, or for the per-thread default stream
    (CuPy's with CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1) the stream of this thread. (A thread that
    starts after another ended may get its id, and so its slot: a thread should synchronise its
    stream before it ends.)"""
    return (stream, threading.get_ident()) if stream == PER_THREAD_STREAM else stream


_SIZES = {"float": 4, "int": 4, "unsigned int": 4, "long long": 8, "unsigned long long": 8}


class Scratch:
    """Scratch memory of the ops, one slot per (device, stream).

    A slot holds every op's scratch arrays (:class:`cupy_spec._core.ScratchField`) at their upper
    bound for the device. Slots are raw device allocations (never from torch's or CuPy's memory
    pools, so they cannot alias a CUDA graph's memory), zero-filled when allocated (the device is
    synchronised before any stream can use them) and never freed. They are allocated outside any
    stream capture, a few at a time, and outside a capture at least one slot is always kept spare:
    a stream first used inside a capture takes it (``warmup`` makes the first ones). Launches on
    one stream run in order and share its slot; graphs captured on one stream share it too, so
    they must not be replayed concurrently on different streams. Counters must be zero between
    launches: :func:`check` verifies it.
    """

    lock = threading.Lock()
    slots: dict = {}  # device -> [base pointer of each slot]
    assigned: dict = {}  # (device, stream or _lane of it) -> slot number
    layout: dict = {}  # device -> ({(op, field): (offset, bytes, zero between launches)}, slot bytes)
    GROW = 4

    @classmethod
    def pointers(cls, op, device: int, stream: int) -> tuple:
        with cls.lock:
            slot = cls._slot(device, stream)
            offsets = cls.layout[device][0]
            return tuple(slot + offsets[(op.name, f.name)][0] for f in op.scratch)

    @classmethod
    def prepare(cls, device: int, stream: int) -> None:
        """Gives ``stream`` its slot now (and, as every use outside a capture, leaves a spare)."""
        with cls.lock:
            cls._slot(device, stream)

    @classmethod
    def _slot(cls, device: int, stream: int) -> int:
        """``stream``'s slot, assigned on first use; outside a capture a spare slot is then left for
        a stream first used inside one (a capture may have taken the last)."""
        lane = _lane(stream)
        n = cls.assigned.get((device, lane))
        used = sum(1 for (d, _) in cls.assigned if d == device)
        if n is None:
            if used >= len(cls.slots.get(device, ())):
                cls._grow(device, stream)
            n = cls.assigned[(device, lane)] = used
            used += 1
        if used >= len(cls.slots[device]) and not _capturing(device, stream):
            cls._grow(device, stream)
        return cls.slots[device][n]

    @classmethod
    def _grow(cls, device: int, stream: int) -> None:
        if _capturing(device, stream):
            raise RuntimeError(
                "cupy_spec needs scratch memory for a stream first used inside a CUDA graph capture, and "
                "none is spare; call cupy_spec.warmup() (or cupy_spec.warmup(stream=...)) before capturing")
        from cupy_backends.cuda.api import runtime

        if device not in cls.layout:
            cls.layout[device] = _layout(device_info(device).sms)
        size = cls.layout[device][1]
        with torch.cuda.device(device):
            for _ in range(cls.GROW):
                ptr = runtime.malloc(size)
                runtime.memset(ptr, 0, size)
                cls.slots.setdefault(device, []).append(ptr)
            # cudaMemset runs on the legacy default stream, which torch's non-blocking streams do
            # not wait for: finish it before any stream can launch on these slots
            runtime.deviceSynchronize()

    @classmethod
    def check(cls, device: int, reset: bool = False) -> list:
        """Synchronises ``device`` and returns ``[(stream, op, field, index, value)]`` for every
        counter that is not zero (a launch that lost an arrival); with ``reset``, zeroes them."""
        from cupy_backends.cuda.api import runtime

        torch.cuda.synchronize(device)
        bad = []
        with cls.lock, torch.cuda.device(device):
            offsets = cls.layout.get(device, ({}, 0))[0]
            for (d, lane), n in cls.assigned.items():
                if d != device:
                    continue
                stream = lane[0] if isinstance(lane, tuple) else lane
                base = cls.slots[device][n]
                for (op, field), (off, nbytes, zero) in offsets.items():
                    if not zero:
                        continue
                    host = (ctypes.c_uint32 * (nbytes // 4))()
                    runtime.memcpy(ctypes.addressof(host), base + off, nbytes, runtime.memcpyDeviceToHost)
                    for i, v in enumerate(host):
                        if v:
                            bad.append((stream, op, field, i, v))
                    if reset and any(host):
                        runtime.memset(base + off, 0, nbytes)
            if reset and bad:
                runtime.deviceSynchronize()
        return bad


def _layout(sms: int) -> tuple:
    """Offsets of every op's scratch arrays within a slot (256-byte aligned), and the slot size."""
    from ._core import OPS

    offsets, end = {}, 0
    for op in OPS.values():
        for f in op.scratch:
            nbytes = _SIZES[f.ctype] * int(f.count(sms))
            offsets[(op.name, f.name)] = (end, nbytes, f.zero_between_launches)
            end += -(-nbytes // 256) * 256
    return offsets, max(end, 256)


def _capturing(device: int, stream: int) -> bool:
    if stream == 0:
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
    from cupy_backends.cuda.api import runtime

    return runtime.streamIsCapturing(stream) != 0


# ---- cluster launches through the driver's cuLaunchKernelEx (cuda.h, CUDA 12.0 and later) -------


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_launch_ex_fn: list = []
_configs: list = []  # launch configs, alive as long as the records that point to them
_driver_fns: dict = {}


def _driver_fn(name: str, argtypes: list):
    """Entry point ``name`` of the driver library, returning a CUresult (None where the library or
    the entry point is missing); looked up once."""
    if name not in _driver_fns:
        try:
            fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _driver_fns[name] = fn
    return _driver_fns[name]


def _launch_ex():
    """The driver's cuLaunchKernelEx (None where the driver library or the entry point is missing)."""
    if not _launch_ex_fn:
        _launch_ex_fn.append(_driver_fn("cuLaunchKernelEx", [ctypes.c_void_p] * 4))
    return _launch_ex_fn[0]


_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED


_residency: dict = {}  # (kernel, grid, cluster, block, shared memory) -> all clusters resident at once


def _clusters_kept(f, plan, device: int, stream: int) -> bool:
    """Whether the record keeps the clusters of ``plan`` (see LARGEST_CLUSTER)."""
    if plan.cluster <= MAX_CLUSTER and not plan.one_wave:
        return True
    resident = _resident(f, plan, device, stream)
    return plan.cluster <= MAX_CLUSTER if resident is None else resident


def _resident(f, plan, device: int, stream: int) -> bool | None:
    """Whether every cluster of ``plan`` can be resident at once: the driver's answer for this
    kernel and launch shape, asked once on any stream (it does not depend on the stream). A stream
    that is capturing a graph does not ask: there the answer comes from an earlier call of the same
    shape on any stream, else it is None (unknown, as where the driver cannot tell)."""
    key = (f.kernel.ptr, tuple(plan.grid), plan.cluster, plan.block, plan.smem)
    if key not in _residency:
        if _capturing(device, stream):
            return None
        _residency[key] = _clusters_resident(f, plan, stream)
    return _residency[key]


def _clusters_resident(f, plan, stream: int) -> bool | None:
    """Whether all the clusters of ``plan`` can be resident at once (cuOccupancyMaxActiveClusters;
    None where the driver cannot tell). A non-portable size first opts kernel ``f`` in (no, where
    the driver refuses: the size cannot run)."""
    from cupy.cuda import driver

    occupancy = _driver_fn("cuOccupancyMaxActiveClusters", [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                            ctypes.c_void_p])
    if occupancy is None:
        return None
    if plan.cluster > MAX_CLUSTER:
        try:
            driver.funcSetAttribute(f.kernel.ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        except driver.CUDADriverError:
            return False
    gx, gy = (tuple(plan.grid) + (1,))[:2]
    cfg, _attr = _config(gx, gy, plan, stream)  # _attr: kept alive while cfg points to it
    count = ctypes.c_int(0)
    if occupancy(ctypes.byref(count), f.kernel.ptr, ctypes.addressof(cfg)) != 0:
        return None
    return count.value * plan.cluster >= gx * gy


def launch_with_config(config: int, fptr: int, argv: int) -> None:
    """cuLaunchKernelEx with a config made by ``_kept_config`` (clusters and programmatic dependent
    launch are used only where the entry point was found, so ``_launch_ex_fn`` holds it by then;
    the generated fast path makes the same call inline)."""
    failed(_launch_ex_fn[0](config, fptr, argv, None))


def failed(status: int) -> None:
    """Raises the driver's error for a CUresult other than CUDA_SUCCESS (0)."""
    if status != 0:
        from cupy.cuda import driver

        raise driver.CUDADriverError(status)


def _config(gx: int, gy: int, plan, stream: int, dependent: bool = False) -> tuple:
    """A launch config of grid (gx, gy), in clusters of ``plan.cluster`` blocks along y where that is
    above 1, with programmatic dependent launch where ``dependent``; and the attributes it points to
    (both must stay alive while the config is used)."""
    attrs = (_LaunchAttribute * 2)()
    count = 0
    if plan.cluster > 1:
        attrs[count].id = _CLUSTER_DIMENSION
        attrs[count].value[0], attrs[count].value[1], attrs[count].value[2] = 1, plan.cluster, 1
        count += 1
    if dependent:
        attrs[count].id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[count].value[0] = 1
        count += 1
    cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(gx, gy, 1), block=(ctypes.c_uint * 3)(plan.block, 1, 1),
                        shared_mem_bytes=plan.smem, stream=stream or None,
                        attrs=ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute)), num_attrs=count)
    return cfg, attrs


def launch_features(rec: tuple) -> tuple:
    """(cluster size, programmatic dependent launch) of a launch record (1, False: a plain launch)."""
    for cfg, attrs in _configs:
        if rec[5] and ctypes.addressof(cfg) == rec[5]:
            ids = {attrs[i].id: attrs[i].value[1] for i in range(cfg.num_attrs)}
            return ids.get(_CLUSTER_DIMENSION, 1), _PROGRAMMATIC_STREAM_SERIALIZATION in ids
    return 1, False


def _kept_config(gx: int, gy: int, plan, stream: int, dependent: bool) -> int:
    """Address of a launch config of ``_config``, kept for the life of the process."""
    kept = _config(gx, gy, plan, stream, dependent)
    _configs.append(kept)
    return ctypes.addressof(kept[0])


def warmup(device: int, stream: int) -> None:
    """Compiles and loads every kernel of every op for ``device`` and gives ``stream`` its scratch
    (plus spare slots for streams first used inside a capture)."""
    from ._core import OPS

    for op in OPS.values():
        for name in op.kernel_names():
            _loader.get_function(op, name, device)
    Scratch.prepare(device, stream)
