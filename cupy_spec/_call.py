"""How a call of an op is served: the generated public function, the detailed path, foreign arrays,
and the torch custom op.

The public function of every op is generated from its table (:func:`bind`). Its body is the fast
path for the common case (valid contiguous CUDA tensors on one device, an existing launch record):
straight-line dtype, contiguity, device and shape checks, the constraints and size limits, then the
parameter packing and the driver launch, with no loops and no further Python calls. Anything else
(CPU tensors, foreign arrays, an empty batch, tracing by torch.compile, the first call of a shape,
any error) goes to :func:`call`, which checks against the table with detailed errors and accepts
exactly the inputs the fast path accepts and gives the detailed errors. ``op.fast_source`` holds
the generated code.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from . import _launch
from ._core import REQUIRED, Arg, Op, not_a_tensor, torch_view


def call(op: Op, values: tuple, validate: bool = False):
    """Serves one call with all arguments in signature order (the detailed path). Under
    torch.compile the call becomes the custom op (with ``validate``), whose fake implementation
    checks the arguments while tracing."""
    if isinstance(validate, np.generic):
        validate = validate.item()
    if type(validate) is not bool:
        raise TypeError(f"validate must be a bool, got {type(validate).__name__} {validate!r}")
    if torch.compiler.is_compiling():
        if any(isinstance(v, (np.generic, np.ndarray)) for v in values):
            return _outside_the_graph()(op, values, validate)
        getattr(torch.ops.cupy_spec, op.name)(*values, validate=validate)
        return None
    values = _plain_scalars(op, values)
    stream = None
    if any(not (values[i] is None or isinstance(values[i], torch.Tensor)) for i in _tensor_positions(op)):
        values, stream = _from_foreign(op, values)
    return _serve(op, values, validate, stream)


def _serve(op: Op, values: tuple, validate: bool, stream: int | None) -> None:
    """Checks torch tensors against the table, then runs the content checks (``validate``) and the
    kernel on ``stream`` (None: torch's current one), or the reference for CPU tensors."""
    dims, device, variant = op.check(values)
    if getattr(dims, op.batch) == 0:
        return None
    if validate:  # an op's content checks begin with the overlap check (Op.check(..., overlap=True))
        if op.check_inputs is not None:
            op.check_inputs(*values)
        else:
            op.check_overlap(values)
    if device >= 0:
        _launch.run(op, values, dims, device, variant, stream)
    else:
        _reference(op, values)
    return None


def _reference(op: Op, values: tuple) -> None:
    """The CPU backend. Its writes are plain stores into the outputs, as the kernel's are: outside
    autograd (an output may require grad, and no graph is recorded) and allowed on tensors made
    under ``torch.inference_mode``."""
    with torch.inference_mode():
        op.reference(*values)


def _plain_scalars(op: Op, values: tuple) -> tuple:
    """NumPy scalars given for scalar arguments as the Python values they hold (np.int64(2) -> 2,
    np.float32(0.5) -> 0.5, np.bool_(True) -> True); the checks then apply as to Python values."""
    if not any(isinstance(v, np.generic) for v in values):
        return values
    return tuple(v.item() if isinstance(v, np.generic) and not isinstance(e, Arg) else v
                 for v, e in zip(values, op.table))


def _numpy_scalars_run_eagerly(op: Op, values: tuple, validate: bool):
    """torch.compile traces a NumPy scalar as an array whose value the op's schema (float, int,
    bool) cannot take: such a call runs outside the graph (a graph break; fullgraph=True refuses
    it, so pass Python numbers there)."""
    return call(op, values, validate)


_WHY_EAGER = "a cupy_spec op called with NumPy values runs eagerly; pass Python numbers and torch tensors"
_disabled: list = []  # the compiler-disabled _numpy_scalars_run_eagerly, made on first use


def _outside_the_graph():
    """_numpy_scalars_run_eagerly behind torch.compiler.disable, made when torch.compile first needs
    it (torch.compiler.disable imports torch._dynamo, about a second, which an import of cupy_spec
    should not pay). Made during a trace, it works as a graph break, but fullgraph=True then
    reports torch's own message about the call instead of _WHY_EAGER."""
    if not _disabled:
        try:  # torch >= 2.7 shows the reason in fullgraph's error
            _disabled.append(torch.compiler.disable(_numpy_scalars_run_eagerly, reason=_WHY_EAGER))
        except TypeError:
            _disabled.append(torch.compiler.disable(_numpy_scalars_run_eagerly))
    return _disabled[0]


# torch._dynamo loaded before cupy_spec: make it now, outside any trace (fullgraph shows _WHY_EAGER)
if "torch._dynamo" in sys.modules:
    _outside_the_graph()


def _tensor_positions(op: Op) -> list:
    return [i for i, e in enumerate(op.table) if isinstance(e, Arg)]


def _from_foreign(op: Op, values: tuple) -> tuple:
    """Zero-copy torch views of foreign arrays (anything with ``__dlpack__``, e.g. CuPy or NumPy
    arrays, or a ``__cuda_array_interface__``), and the stream to launch on: CuPy's current stream
    of the arrays' device for CuPy arrays, else None (torch's current stream)."""
    out, cupy_device = list(values), None
    for i in _tensor_positions(op):
        a, name = values[i], op.table[i].name
        if a is None or isinstance(a, torch.Tensor):
            continue
        if isinstance(a, (bool, int, float, np.generic)):
            raise not_a_tensor(name, a)
        if op.table[i].written and getattr(getattr(a, "flags", None), "writeable", True) is False:
            raise TypeError(f"{name} is written by {op.name}, but this {type(a).__name__} is read-only")
        out[i] = t = torch_view(name, a)
        if type(a).__module__.split(".")[0] == "cupy" and t.is_cuda:
            cupy_device = t.device.index
    stream = None
    if cupy_device is not None:
        import cupy

        stream = cupy.cuda.get_current_stream(cupy_device).ptr
    return tuple(out), stream


# ---- the generated public function -------------------------------------------------------------


class _Fallback(Exception):
    """Raised inside the generated fast path: serve this call by the detailed path."""


def bind(op: Op):
    """Generates the op's public function (exact signature, docstring from the table) and
    registers the torch custom op."""
    ns = {"_op": op, "_slow": call, "_Tensor": torch.Tensor, "_L": _launch, "_records": op.records,
          "_launch_ex": _launch._launch_ex_fn,  # cuLaunchKernelEx, found before any record has a config
          "_pack": op.struct.pack_into,
          # (absent from CPU builds of torch, where no tensor reaches the launch)
          "_stream": getattr(torch._C, "_cuda_getCurrentRawStream", None),
          "_getdev": getattr(torch._C, "_cuda_getDevice", None), "_Fallback": _Fallback,
          "_compiling": torch.compiler.is_compiling, "_state": _launch.state}
    for k, a in enumerate(op.tensors):
        ns[f"_dt{k}"] = a.dtype
    for s in op.scalars:
        if s.default is not REQUIRED:
            ns[f"_def_{s.name}"] = s.default
    for a in op.tensors:
        if a.default is not REQUIRED:
            ns[f"_def_{a.name}"] = a.default
    op.fast_source = _source(op)
    exec(compile(op.fast_source, f"<cupy_spec.{op.name}>", "exec"), ns)
    fn = ns[op.name]
    fn.__doc__ = op.docstring()
    fn.__module__ = f"cupy_spec.{op.name}"
    _register_custom_op(op)
    return fn


def _source(op: Op) -> str:
    """The fast path: per tensor its dtype, contiguity, device and shape (compared as a whole with
    the named dimensions seen so far), then scalars, constraints and limits, then the record."""
    names = [e.name for e in op.table]
    sig = ", ".join(n if e.default is REQUIRED else f"{n}=_def_{n}" for n, e in zip(names, op.table))
    everything = f"({', '.join(names)},)"
    slow = "raise _Fallback"
    first = op.tensors[0]
    assert not first.optional, "an op's first tensor must be required"
    body = ["try:", f"    if validate is not False or type({first.name}) is not _Tensor or _compiling():",
            f"        {slow}",
            f"    _d = {first.name}.get_device()", "    _m = _state.multi"]
    seen: set = set()
    checks = []  # (the first tensor is a CUDA tensor, so _d >= 0)
    variant = []
    for k, a in enumerate(op.tensors):
        dtype_ok = f"{a.name}.dtype {'not in' if isinstance(a.dtype, tuple) else 'is not'} _dt{k}"
        if a.any_dtype_if_empty:
            dtype_ok = f"({dtype_ok} and {a.name}.numel() != 0)"
        # one visible GPU: every CUDA tensor is on device 0 (is_cuda is cheaper than get_device())
        device = f" or not {a.name}.is_cuda" if k == 0 else (
            f" or ({a.name}.get_device() != _d if _m else not {a.name}.is_cuda)")
        bad = f"{dtype_ok} or not {a.name}.is_contiguous(){device}"
        new_dims = [d for d in a.dims if d not in seen]
        if new_dims and a.optional:  # dimensions of its own (checked by Op): -1 when absent
            variant.append(f"{a.name} is not None")
            body += [f"    if {a.name} is not None:", f"        if {bad}:", f"            {slow}",
                     f"        {''.join(f'd_{d}, ' for d in a.dims)}= {a.name}.shape", "    else:",
                     f"        {', '.join(f'd_{d}' for d in a.dims)} = {', '.join(['-1'] * len(a.dims))}"]
            seen.update(a.dims)
            continue
        if new_dims:
            targets = [f"d_{d}" if d not in seen else f"_x{k}_{j}" for j, d in enumerate(a.dims)]
            shape = [f"    {', '.join(targets)}, = {a.name}.shape"]
            same = [f"_x{k}_{j} == d_{d}" for j, d in enumerate(a.dims) if d in seen]
            seen.update(a.dims)
        else:
            shape, same = [], [f"{a.name}.shape == ({''.join(f'd_{d}, ' for d in a.dims)})"]
        if a.optional:
            variant.append(f"{a.name} is not None")
            body += [f"    if {a.name} is not None:", f"        if {bad}:", f"            {slow}"]
            checks.append(f"({a.name} is None or {' and '.join(same)})")
        else:
            body += [f"    if {bad}:", f"        {slow}"] + shape
            checks += same
        if isinstance(a.dtype, tuple):
            variant.append(f"(None if {a.name} is None else {a.name}.dtype)" if a.optional else f"{a.name}.dtype")
    for s in op.scalars:
        py = {"float": "float", "int": "int", "bool": "bool"}[s.kind]
        checks.append(f"type({s.name}) is {py}")
        lo = "" if s.lo == -math.inf else f"{s.lo!r} <= "
        hi = "" if s.hi == math.inf else f" <= {s.hi!r}"
        if lo or hi:
            checks.append(f"{lo}{s.name}{hi}")
        if s.variant:
            variant.append(s.name)
    checks.append(f"d_{op.batch} > 0")
    checks += [f"({_dimexpr(c.expr, op)})" for c in op.constraints]
    checks += [f"d_{d} <= {lim}" for d, lim in op.limits.items() if lim is not None and lim != math.inf]
    body += ["    if not (" + "\n            and ".join(checks) + "):", f"        {slow}"]
    key = [_dimexpr(d, op) for d in op.plan_dims] + variant + ["_d", "_s"]
    body += ["    _s = _stream(_d)", f"    _rec = _records.get(({', '.join(key)},))",
             "    if _rec is None or (_m and _getdev() != _d):", f"        {slow}",
             "except (_Fallback, AttributeError, TypeError, ValueError, RuntimeError):",
             f"    return _slow(_op, {everything}, validate)",
             "_fptr, _gx, _gy, _blk, _smem, _cfg, _fields, _scratch = _rec", "_buf = _L.tls.buf"]
    ptrs = [f"{a.name}.data_ptr()" if not a.optional else f"(0 if {a.name} is None else {a.name}.data_ptr())"
            for a in op.tensors]
    scalars = [s.name for s in op.scalars if s.kernel]
    packed = ptrs + ["*_scratch"] + [f"d_{d}" for d in op.dims] + ["*_fields"] + scalars
    body += [f"_pack(_buf.params, 0, {', '.join(packed)})", "if _cfg:",
             "    _st = _launch_ex[0](_cfg, _fptr, _buf.argv, None)", "    if _st:", "        _L.failed(_st)",
             "else:", "    _L.driver_launch(_fptr, _gx, _gy, 1, _blk, 1, 1, _smem, _s, _buf.argv, 0)", "return None"]
    return f"def {op.name}({sig}, *, validate=False):\n" + "".join(f"    {line}\n" for line in body)


def _dimexpr(expr: str, op: Op) -> str:
    """A constraint expression with dimension names as the generated code's variables."""
    import re

    return re.sub(r"\b[A-Za-z_]\w*\b", lambda m: f"d_{m.group(0)}" if m.group(0) in op.dims else m.group(0), expr)


# ---- torch custom op -----------------------------------------------------------------------------

_lib = torch.library.Library("cupy_spec", "DEF")


def schema(op: Op) -> str:
    """The custom op's schema: written tensors carry alias annotations (mutation); the keyword
    ``validate`` runs the op's content checks when the op runs (also inside compiled code)."""
    parts, alias = [], iter("abcdefghijklmnopqrstuvwxyz")
    for e in op.table:
        if isinstance(e, Arg):
            ann = f"({next(alias)}!)" if e.written else ""
            default = "=None" if e.default is None else ""
            parts.append(f"Tensor{ann}{'?' if e.optional else ''} {e.name}{default}")
        else:
            default = "" if e.default is REQUIRED else f"={e.default!r}"
            parts.append(f"{e.kind} {e.name}{default}")
    return f"{op.name}({', '.join(parts)}, *, bool validate=False) -> ()"


def _register_custom_op(op: Op) -> None:
    names = [e.name for e in op.table]

    def full(values: tuple, kwargs: dict) -> tuple:
        """The dispatcher may pass trailing arguments by name or leave defaults out."""
        given = dict(zip(names, values)) | kwargs
        return tuple(given[n] if n in given else e.default for n, e in zip(names, op.table))

    def impl(*values, validate=False, **kwargs):
        return _serve(op, full(values, kwargs), validate, None)

    _lib.define(schema(op))
    _lib.impl(op.name, impl, "CPU")
    _lib.impl(op.name, impl, "CUDA")

    def meta(*values, validate=False, **kwargs):  # the shape-level checks while tracing
        op.check(full(values, kwargs), meta=True)

    _lib.impl(op.name, meta, "Meta")
