"""The one place that touches NVRTC: builds the CUDA sources in ``kernels/`` at run time.

Each op's kernel header is compiled in a small translation unit: a hash of every file under
``kernels/``, taken when the unit is made (so CuPy's on-disk cache, which does not hash included
headers, sees a new key whenever any kernel source changes, also while a process runs), the op's
generated parameter struct and constants (one source for host and kernel), then an ``#include`` of
the op's header by its absolute path (so no file of that name in the working directory can stand in
for it; its own includes are found next to it). Modules are built once per device, under a lock,
and kept for the life of the process.
"""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path
from typing import NamedTuple

__all__ = ["kernel_dir", "source_hash", "KernelCompileError", "get_function", "compile_for_arch", "Built", "unit"]

# flush-to-zero is what CuPy's RawModule uses; fused multiply-add is off so that every rounding
# step is the one the reference makes.
_OPTIONS = ("-std=c++17", "-ftz=true", "--fmad=false")


class KernelCompileError(RuntimeError):
    """NVRTC could not compile a kernel source; the message carries the file name and the log."""


class Kernel(NamedTuple):
    """A kernel loaded on one device: ``kernel`` is its CuPy Function there (``kernel.ptr``: the
    CUfunction), ``max_dynamic_shared_size_bytes`` the dynamic shared memory it may use there."""

    kernel: object
    max_dynamic_shared_size_bytes: int


def kernel_dir() -> Path:
    """Directory of the CUDA sources: inside the installed package, or ``kernels/`` of a checkout."""
    here = Path(__file__).resolve().parent
    for d in (here / "kernels", here.parent / "kernels"):
        if (d / "common.cuh").is_file():
            return d
    raise FileNotFoundError(f"cupy_spec kernel sources not found next to {here}")


def source_hash() -> str:
    """sha256 over the names and contents of every file under kernels/, as they are now."""
    d = kernel_dir()
    h = hashlib.sha256()
    for f in sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in (".cuh", ".cu", ".h")):
        h.update(f.relative_to(d).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def unit(op) -> str:
    """The translation unit of ``op``: source hash, generated parameter struct, the op's header."""
    header = (kernel_dir() / op.header).as_posix()
    if '"' in header:
        raise FileNotFoundError(f"cupy_spec kernel sources cannot be included from a path with a quote: {header}")
    return f"// cupy_spec kernels sha256 {source_hash()}\n{op.cpp_prelude()}#include \"{header}\"\n"


def _options() -> tuple:
    return _OPTIONS + (f"-I{kernel_dir()}",)


_lock = threading.Lock()
_functions: dict = {}  # (device, name_expression) -> Kernel


def get_function(op, name_expression: str, device: int) -> Kernel:
    """The kernel ``name_expression`` of ``op`` loaded on ``device`` (compiling its module on first
    use), whatever the current device is."""
    key = (device, name_expression)
    f = _functions.get(key)
    if f is None:
        with _lock:
            f = _functions.get(key)
            if f is None:
                _load(op, device)
                f = _functions[key]
    return f


def _load(op, device: int) -> None:
    import cupy

    names = op.kernel_names()
    with cupy.cuda.Device(device):
        smem_optin = cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"]
        try:
            module = cupy.RawModule(code=unit(op), options=_options(), name_expressions=names)
            for name in names:  # (CuPy's kernel objects resolve to the current device: ``device`` here)
                f = module.get_function(name)
                f.max_dynamic_shared_size_bytes = smem_optin - f.shared_size_bytes
                _functions[(device, name)] = Kernel(f.kernel, f.max_dynamic_shared_size_bytes)
        except cupy.cuda.compiler.CompileException as e:
            raise KernelCompileError(f"NVRTC failed to compile kernels/{op.header}:\n{e.get_message()}") from None
        except OSError as e:  # CuPy's on-disk kernel cache could not be created or written
            raise RuntimeError(f"cupy_spec could not store the compiled kernels/{op.header} in CuPy's kernel cache "
                               f"({type(e).__name__}: {e}); set CUPY_CACHE_DIR to a writable directory, or "
                               f"CUPY_CACHE_IN_MEMORY=1") from None


class Built(NamedTuple):
    """One kernel variant compiled for an architecture without a GPU: its lowered (mangled) name,
    the module's cubin, and what ptxas reported for it: registers per thread and bytes of spill
    stores (None where the log did not say)."""

    lowered: str
    cubin: bytes
    registers: int | None
    spill_bytes: int | None


def compile_for_arch(arch: str, ops=None) -> dict:
    """Compiles every kernel variant of ``ops`` (default: all) to a cubin for ``arch`` (e.g. "sm_90")
    without a GPU.

    Returns {name_expression: Built}. Raises KernelCompileError with the NVRTC log if a source
    fails to compile or a name expression does not lower.
    """
    from cupy_backends.cuda.libs import nvrtc

    from ._core import OPS

    out = {}
    for op in (OPS.values() if ops is None else ops):
        names = op.kernel_names()
        prog = nvrtc.createProgram(unit(op), op.header.replace(".cuh", ".cu"), [], [])
        try:
            for name in names:
                nvrtc.addNameExpression(prog, name)
            try:
                nvrtc.compileProgram(prog, list(_options()) + [f"-arch={arch}", "--ptxas-options=-v"])
            except nvrtc.NVRTCError:
                raise KernelCompileError(
                    f"NVRTC failed to compile kernels/{op.header} for {arch}:\n{nvrtc.getProgramLog(prog)}"
                ) from None
            cubin, resources = nvrtc.getCUBIN(prog), ptxas_resources(nvrtc.getProgramLog(prog))
            for name in names:
                lowered = nvrtc.getLoweredName(prog, name)
                if not lowered:
                    raise KernelCompileError(f"kernels/{op.header}: name expression {name} did not lower")
                out[name] = Built(lowered, cubin, *resources.get(lowered, (None, None)))
        finally:
            nvrtc.destroyProgram(prog)
    return out


def ptxas_resources(log: str) -> dict:
    """{lowered name: (registers, spill store bytes)} from a ptxas log made with ``-v``."""
    out = {}
    for part in log.split("Compiling entry function '")[1:]:
        name = part.split("'", 1)[0]
        registers = re.search(r"Used (\d+) registers", part)
        spills = re.search(r"(\d+) bytes spill stores", part)
        out[name] = (int(registers[1]) if registers else None, int(spills[1]) if spills else None)
    return out


def nvrtc_version() -> tuple:
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc.getVersion()
