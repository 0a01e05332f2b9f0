"""The op family's shared core: an op is a kernel, a reference, one argument table and a plan.

From an op's table (:class:`Arg` and :class:`Scalar` rows, in signature order) this module derives,
once for every op:

* the public function with the op's exact signature and a docstring listing every argument's shape,
  dtype and whether it is written;
* the argument checks: a straight-line fast path generated from the table for valid CUDA tensors
  (a few attribute reads per tensor, then packing and the launch), and the detailed table walk that
  names the argument, the expectation and what was given;
* the torch custom op ``torch.ops.cupy_spec.<op>`` with its mutation annotations;
* the CuPy / DLPack input path;
* the kernel's parameter struct and constants (C++ generated into the NVRTC unit, so host and
  kernel agree on every field and constant), and the matching ``struct`` packing on the host.

The launch itself (records, scratch, clusters, the driver call) lives in :mod:`cupy_spec._launch`.
"""

from __future__ import annotations

import inspect
import math
import struct
from typing import Callable, NamedTuple

import numpy as np
import torch

#: C++ type of each tensor dtype in the generated parameter struct.
_CTYPES = {
    torch.int32: "int", torch.int64: "long long", torch.float32: "float", torch.bool: "bool",
    torch.uint8: "unsigned char", torch.int16: "short", torch.uint16: "unsigned short",
    torch.bfloat16: "__nv_bfloat16", torch.float16: "__half",
}
_INT32_MAX = 2**31 - 1
OPS: dict = {}  # name -> Op, every op defined so far
REQUIRED = inspect.Parameter.empty  # default of an argument that has none


class Arg(NamedTuple):
    """A tensor argument: its dtype (or a tuple of allowed dtypes), named dimensions (the same name
    must have the same size in every argument), whether the op writes into it and whether it may be
    None. An optional tensor may have dimensions of its own, which no other tensor has; when it is
    None they are -1 (in constraints and in the kernel's parameters). ``any_dtype_if_empty``: an
    empty tensor of any dtype is accepted (the op reads nothing of it; some callers build such a
    tensor without a dtype)."""

    name: str
    dtype: object
    dims: tuple
    doc: str
    written: bool = False
    optional: bool = False
    default: object = REQUIRED
    any_dtype_if_empty: bool = False


class Scalar(NamedTuple):
    """A non-tensor argument: ``kind`` is "float", "int" or "bool"; values must lie in [lo, hi].
    ``kernel``: packed into the kernel's parameters (float as double, int and bool as long long)."""

    name: str
    kind: str
    doc: str
    default: object = REQUIRED
    lo: float = -math.inf
    hi: float = math.inf
    kernel: bool = True
    variant: bool = False  # selects the kernel instantiation (with the optional / multi-dtype tensors)


class Constraint(NamedTuple):
    """A relation between dimensions, checked when the batch is not empty. ``expr`` is a Python
    expression over dimension names; ``message`` is formatted with the dimensions and ``shapes``."""

    expr: str
    message: str


class Launch(NamedTuple):
    """An op's launch plan for one shape: grid (x, y), threads per block, dynamic shared memory,
    blocks per thread-block cluster along y (1: none), values of the op's launch fields, whether
    the kernel uses the per-stream scratch, the template arguments the plan picks (appended
    to the variant's; one of the op's ``plan_variants``), and whether every cluster of the grid
    must be resident at once (``one_wave``: else the launch record plans again with the refused
    build and size in ``DeviceInfo.refused``; clusters above the portable 8 must always be)."""

    grid: tuple
    block: int
    smem: int = 0
    cluster: int = 1
    fields: tuple = ()
    scratch: bool = False
    kernel: tuple = ()
    one_wave: bool = False


class ScratchField(NamedTuple):
    """A per-stream scratch array of the op: C++ element type, element count on a GPU with
    ``sms`` multiprocessors (an upper bound over all shapes), and whether it must hold zeros
    between launches (counters; checked by :func:`cupy_spec.check_scratch`)."""

    name: str
    ctype: str
    count: Callable
    zero_between_launches: bool = False


def _camel(name: str) -> str:
    return "".join(w.capitalize() for w in name.split("_"))


def _dtypes(a: Arg) -> tuple:
    return a.dtype if isinstance(a.dtype, tuple) else (a.dtype,)


def _fmt_dtype(a: Arg) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in _dtypes(a))


class Op:
    """One op of the family. See the module docstring; ``plan(dims, variant, device) -> Launch``
    where ``dims`` is a namedtuple of the named dimensions (the plan may depend only on ``plan_dims``:
    dimensions, or expressions of them such as ``"L.bit_length()"``, which with the variant and the
    stream key the launch record), ``variant`` the tuple of variant values
    (per optional tensor: given or not; per multi-dtype tensor: its dtype; per variant scalar: its
    value) and ``device`` a :class:`cupy_spec._launch.DeviceInfo`. ``template(*variant, *kernel)``
    gives the kernel's template arguments, ``kernel`` being the plan's pick among ``plan_variants``
    (every variant is compiled with each of them). ``variant_check(dims, variant)`` raises for
    combinations of variant values and dimensions that a :class:`Constraint` cannot state (a scalar
    that must equal a dimension, a dtype a mode requires); it runs in :meth:`check`, so on every
    detailed-path call (empty batches included) before any launch record is made."""

    def __init__(self, name: str, summary: str, table: tuple, *, reference: Callable, plan: Callable,
                 plan_dims: tuple, template: Callable | None = None, variants: tuple = ((),),
                 plan_variants: tuple = ((),), batch: str = "bs",
                 constraints: tuple = (), constants: dict | None = None, launch_fields: tuple = (),
                 scratch: tuple = (), limits: dict | None = None, check_inputs: Callable | None = None,
                 too_large: Callable | None = None, variant_check: Callable | None = None,
                 returns: str = "None; outputs are written in place."):
        self.name, self.summary, self.table = name, summary, table
        self.reference, self.plan, self.template, self.variants = reference, plan, template, variants
        self.plan_variants = plan_variants
        self.plan_dims, self.batch, self.constraints = plan_dims, batch, constraints
        self.constants = dict(constants or {})
        self.launch_fields, self.scratch, self.check_inputs = launch_fields, scratch, check_inputs
        self.too_large, self.returns, self.variant_check = too_large, returns, variant_check
        self.tensors = tuple(e for e in table if isinstance(e, Arg))
        self.scalars = tuple(e for e in table if isinstance(e, Scalar))
        self.dims = tuple(dict.fromkeys(d for a in self.tensors for d in a.dims))
        for i, a in enumerate(self.tensors):  # an optional tensor's own dimensions: no other tensor has them
            earlier = {d for x in self.tensors[:i] for d in x.dims}
            later = {d for x in self.tensors[i + 1:] for d in x.dims}
            own = [d for d in a.dims if d not in earlier]
            assert not (a.optional and own) or (own == list(a.dims) and not later & set(own)), (
                f"{a.name}: an optional tensor's own dimensions must be all of its dimensions, and no other tensor's")
        # Every dimension is an index into int32 arithmetic in the kernels unless the op says otherwise.
        self.limits = {d: _INT32_MAX for d in self.dims} | dict(limits or {})
        self._constraint_fns = [eval(f"lambda {', '.join(self.dims)}: {c.expr}") for c in constraints]
        # the launch record's key: dimensions, or expressions of them (a size class such as L.bit_length())
        self.plan_key = eval(f"lambda {', '.join(self.dims)}: ({''.join(f'{k}, ' for k in plan_dims)})")
        self.Dims = NamedTuple(f"{_camel(name)}Dims", [(d, int) for d in self.dims])
        self.header = f"{name}.cuh"
        self.struct = struct.Struct("<" + "Q" * (len(self.tensors) + len(scratch)) + "q" * (len(self.dims) + len(
            launch_fields)) + "".join("d" if s.kind == "float" else "q" for s in self.scalars if s.kernel))
        self.records: dict = {}  # launch records, see cupy_spec._launch
        OPS[name] = self
        from . import _call

        self.function = _call.bind(self)

    # ---- kernels --------------------------------------------------------------------------------

    def kernel_name(self, variant: tuple, kernel: tuple = ()) -> str:
        """The instantiation for a variant and the template arguments the plan picked."""
        base = f"cupy_spec::{self.name}_kernel"
        return base if self.template is None else f"{base}<{self.template(*variant, *kernel)}>"

    def kernel_names(self) -> tuple:
        return tuple(self.kernel_name(v, k) for v in self.variants for k in self.plan_variants)

    def cpp_prelude(self) -> str:
        """The generated C++ parameter struct (with the op's constants as static members)."""
        lines = [f"// Generated from the argument table of cupy_spec/{self.name}.py: one source for host and kernel.",
                 "namespace cupy_spec {", f"struct {_camel(self.name)}Params {{"]
        lines += [f"  static constexpr long long {k} = {int(v)};" for k, v in self.constants.items()]
        for a in self.tensors:
            ctype = _CTYPES[a.dtype] if not isinstance(a.dtype, tuple) else "void"
            const = "" if a.written else "const "
            lines.append(f"  {const}{ctype}* {a.name};  // {_fmt_dtype(a)} [{', '.join(a.dims)}]"
                         + (" or null" if a.optional else "") + (", written" if a.written else ""))
        lines += [f"  {f.ctype}* {f.name};  // per-stream scratch" for f in self.scratch]
        lines += [f"  long long {d};" for d in self.dims + self.launch_fields]
        lines += [f"  {'double' if s.kind == 'float' else 'long long'} {s.name};" for s in self.scalars if s.kernel]
        lines += ["};", f"static_assert(sizeof({_camel(self.name)}Params) == {self.struct.size}, "
                  f"\"parameter struct layout differs from the host's packing\");", "}  // namespace cupy_spec", ""]
        return "\n".join(lines)

    # ---- documentation --------------------------------------------------------------------------

    def docstring(self) -> str:
        dims = ", ".join(self.dims)
        lines = [self.summary.strip(), "", f"Args (named dimensions {dims}; every tensor contiguous, all on one device):"]
        for a in self.tensors:
            kind = f"{_fmt_dtype(a)} [{', '.join(a.dims)}]" + (" or None" if a.optional else "") + (
                " (any dtype when empty)" if a.any_dtype_if_empty else "")
            lines.append(f"    {a.name}: {kind}{', **written**' if a.written else ''}: {a.doc}")
        for s in self.scalars:
            default = "" if s.default is REQUIRED else f", default {s.default!r}"
            lines.append(f"    {s.name}: {s.kind}{default}: {s.doc}")
        if self.check_inputs is not None:
            lines.append("    validate: bool, also check that no written tensor shares memory with another argument "
                         "and run the op's content checks (synchronises with the device).")
        else:
            lines.append("    validate: bool, also check that no written tensor shares memory with another argument.")
        special = [f"{d} <= {lim}" for d, lim in self.limits.items() if lim not in (None, _INT32_MAX, math.inf)]
        free = [d for d, lim in self.limits.items() if lim is None]
        lines += ["", "On a GPU every dimension" + (f" but {', '.join(free)}" if free else "") + " must be below 2**31"
                  + (f", and {', '.join(special)}" if special else "") + "; the CPU backend has no such limit."]
        lines += ["", f"Returns {self.returns}", "",
                  "CPU tensors run the reference; CUDA tensors run the kernel on torch's current stream of "
                  "their device. Other arrays are viewed without a copy and written in place: CuPy arrays "
                  "run the kernel on CuPy's current stream, other CUDA DLPack arrays on torch's, CPU arrays "
                  "(NumPy) the reference. Raises TypeError / ValueError naming the argument."]
        return "\n".join(lines)

    # ---- checks (the detailed path) ---------------------------------------------------------------

    def check(self, values: tuple, meta: bool = False, overlap: bool = False):
        """Checks every argument (tensors and scalars, in signature order) against the table.

        Returns ``(dims, device, variant)``: the named dimensions, the CUDA device index (-1 on the
        CPU) and the variant tuple. Raises TypeError for a wrong type, dtype or layout (dense
        tensors only) and ValueError for a wrong rank, size, device or value, naming the argument.
        Tensors are on the CPU or a CUDA device, or with ``meta`` (shape checks while tracing) on
        the meta device. With ``overlap``, also :meth:`check_overlap` (the content checks' start)."""
        args = dict(zip((e.name for e in self.table), values))
        device = first = None
        for a in self.tensors:
            t = args[a.name]
            if t is None and a.optional:
                continue
            if not isinstance(t, torch.Tensor):
                raise not_a_tensor(a.name, t)
            if t.dtype not in _dtypes(a) and not (a.any_dtype_if_empty and t.numel() == 0):
                cast = "" if isinstance(a.dtype, tuple) else (
                    f" (it is written in place: allocate it as {a.dtype})" if a.written
                    else f" (no cast is made: pass {a.name}.to({a.dtype}))")
                raise TypeError(f"{a.name} must have dtype {_fmt_dtype(a)}, got {str(t.dtype).replace('torch.', '')}"
                                f"{cast}")
            if t.layout != torch.strided:
                raise TypeError(f"{a.name} must be a dense tensor, got layout {str(t.layout).replace('torch.', '')} "
                                f"(no conversion is made: pass {a.name}.to_dense())")
            if t.device.type not in _DEVICE_TYPES[meta]:
                raise ValueError(f"{a.name} is on {t.device}: the ops run on CUDA devices (the kernels) and on the "
                                 f"CPU (the reference)")
            if t.dim() != len(a.dims):
                raise ValueError(f"{a.name} must have shape [{', '.join(a.dims)}] ({len(a.dims)}-D), got {tuple(t.shape)}")
            if device is None:
                device, first = t.device, a.name
            elif t.device != device:
                raise ValueError(f"{a.name} is on {t.device} but {first} is on {device}; all tensors must share a device")
        sizes = self._sizes(args)
        for a in self.tensors:
            t = args[a.name]
            if t is not None and not t.is_contiguous():
                fix = ("it is written in place, so allocate it contiguous (results written into a .contiguous() "
                       "copy would not reach it)" if a.written else f"no copy is made: pass {a.name}.contiguous()")
                raise ValueError(f"{a.name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)}); {fix}")
        for s in self.scalars:
            _check_scalar(s, args[s.name])
        dims = self.Dims(**sizes)
        if sizes[self.batch] > 0:
            broken = self.broken_constraint(sizes, args)
            if broken is not None:
                raise broken
        variant = self.variant_of(args)
        if self.variant_check is not None:
            self.variant_check(dims, variant)
        if overlap:
            self.check_overlap(values)
        return dims, (device.index if device.type == "cuda" else -1), variant

    def check_overlap(self, values: tuple) -> None:
        """Raises ValueError where a written tensor shares memory with another tensor argument: the
        kernels read their inputs while other threads write the outputs, so an overlap gives undefined
        results. For checked arguments (contiguous, on one device): a tensor spans
        ``[data_ptr, data_ptr + nbytes)``; empty tensors span nothing."""
        spans = [(a, v.data_ptr(), v.data_ptr() + v.nbytes) for a, v in zip(self.table, values)
                 if isinstance(a, Arg) and v is not None and v.numel() > 0]
        for i, (a, start, end) in enumerate(spans):
            for b, start2, end2 in spans[i + 1:]:
                if (a.written or b.written) and start < end2 and start2 < end:
                    w, other = (a, b) if a.written else (b, a)
                    role = "also written" if other.written else "read"
                    raise ValueError(f"{w.name} and {other.name} share memory: {self.name} writes {w.name} while "
                                     f"{other.name} is {role}; pass tensors that do not overlap")

    def broken_constraint(self, sizes: dict, args: dict) -> ValueError | None:
        """The error of the first constraint between dimensions that ``sizes`` break, if any."""
        for c, holds in zip(self.constraints, self._constraint_fns):
            if not holds(**sizes):
                shapes = {a.name: tuple(args[a.name].shape) for a in self.tensors if args.get(a.name) is not None}
                return ValueError(c.message.format(**sizes, shapes=shapes))
        return None

    def variant_of(self, args: dict) -> tuple:
        v = []
        for a in self.tensors:
            if a.optional:
                v.append(args[a.name] is not None)
            if isinstance(a.dtype, tuple):
                v.append(None if args[a.name] is None else args[a.name].dtype)
        v += [args[s.name] for s in self.scalars if s.variant]
        return tuple(v)

    def _sizes(self, args: dict) -> dict:
        """Named dimension sizes; on a disagreement, names the argument that differs from the
        majority (and the arguments that agree)."""
        seen: dict = {}  # dim -> list of (size, arg name)
        for a in self.tensors:
            t = args[a.name]
            if t is not None:
                for d, s in zip(a.dims, t.shape):
                    seen.setdefault(d, []).append((s, a.name))
        for d, pairs in seen.items():
            values = [s for s, _ in pairs]
            if any(s != values[0] for s in values[1:]):  # (not a set: symbolic sizes under torch.compile do not hash)
                common = max(values, key=values.count)  # the first of the most frequent sizes
                odd = next(name for s, name in pairs if s != common)
                agree = [name for s, name in pairs if s == common]
                a = next(x for x in self.tensors if x.name == odd)
                want = ", ".join(f"{x}={seen[x][0][0] if x != d else common}" if x in seen else x for x in a.dims)
                raise ValueError(f"{odd} must have shape [{want}], got {tuple(args[odd].shape)}: "
                                 f"{d} is {common} in {', '.join(agree)}")
        return {d: seen[d][0][0] if d in seen else -1 for d in self.dims}


_DEVICE_TYPES = {False: ("cpu", "cuda"), True: ("cpu", "cuda", "meta")}  # by Op.check's ``meta``


def not_a_tensor(name: str, value, positional: bool = True) -> TypeError:
    """The error for a tensor argument given something else (in an op, a number there is usually a
    later argument given by position)."""
    got = type(value).__name__
    if isinstance(value, (bool, int, float, np.generic)):
        got += f" {value!r}" + ("; pass later arguments by keyword" if positional else "")
    return TypeError(f"{name} must be a torch.Tensor or an array with __dlpack__ (CuPy, NumPy, ...), got {got}")


def torch_view(name: str, a, positional: bool = True) -> torch.Tensor:
    """A zero-copy torch view of a foreign array: anything with ``__dlpack__`` (CuPy, NumPy, ...)
    or a ``__cuda_array_interface__``; errors name the argument."""
    if isinstance(a, (bool, int, float, np.generic)):
        raise not_a_tensor(name, a, positional)
    strides = getattr(a, "strides", None)  # NumPy and CuPy: in bytes
    if isinstance(strides, tuple) and any(isinstance(x, int) and x < 0 for x in strides):
        # (torch.from_dlpack does not refuse negative strides cleanly)
        raise ValueError(f"{name} must be contiguous, got a {type(a).__name__} with negative strides {strides} "
                         f"(a reversed view); no copy is made: pass a contiguous copy")
    if hasattr(a, "__dlpack__"):
        try:
            return torch.from_dlpack(a)
        except Exception as e:  # e.g. an unsupported dtype or device
            raise TypeError(f"{name}: torch.from_dlpack could not view this {type(a).__name__} "
                            f"without a copy ({type(e).__name__}: {e})") from None
    if hasattr(a, "__cuda_array_interface__"):
        try:
            t = torch.as_tensor(a)  # a view on the array's own device (no device= argument: that copies)
        except Exception as e:  # e.g. a malformed interface
            raise TypeError(f"{name}: torch could not view this {type(a).__name__} through its "
                            f"__cuda_array_interface__ ({type(e).__name__}: {e})") from None
        if t.data_ptr() != a.__cuda_array_interface__["data"][0]:
            raise TypeError(f"{name}: the {type(a).__name__} could not be viewed without a copy")
        return t
    raise not_a_tensor(name, a, positional)


def check_generator(generator, device: torch.device) -> None:
    """``generator`` must be None or a torch.Generator of ``device`` (its index, where both say one)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__} {generator!r}")
    g = generator.device
    if g.type != device.type or (None not in (g.index, device.index) and g.index != device.index):
        raise ValueError(f"generator is a generator of {g}, but the inputs are on {device}")


def _check_scalar(s: Scalar, v) -> None:
    if isinstance(v, np.generic):  # a NumPy scalar is checked as the Python value it holds
        v = v.item()
    types = {"float": (int, float), "int": (int,), "bool": (bool,)}[s.kind]
    if (isinstance(v, bool) and s.kind != "bool") or not isinstance(v, types):
        raise TypeError(f"{s.name} must be a{'n' if s.kind == 'int' else ''} {s.kind}, got {type(v).__name__} {v!r}")
    if s.kind != "bool" and not (s.lo <= v <= s.hi):
        raise ValueError(f"{s.name} must lie in [{s.lo}, {s.hi}], got {v!r}")


