"""Every op's generated fast path, run without a GPU: CPU tensors stand in for CUDA ones (the generated
code's ``is_cuda`` read as ``is_cpu``), and the driver launch is recorded instead of made.

The contract between the fast path and the detailed path (``_call.call``): where the fast path launches,
the detailed path would have served the same arguments from the same launch record and packed the same
parameter bytes; wherever the detailed path refuses the arguments, launches nothing, or needs another
record, the fast path hands the call over to it. Checked on valid arguments of every op and on every
single change of one argument (dtype, layout, device, each size, rank, a missing tensor, each scalar's
type and range), with one launch record in place: the one of the valid arguments.
"""

from __future__ import annotations

import ctypes
import math
import types

import pytest
import torch

from cupy_spec import _launch
from cupy_spec._core import OPS, Arg
from test_torch_compile import CORE_ARGS

STREAM = 7  # the stand-in for torch's current stream
FPTR, GX, GY, BLOCK, SMEM = 0x1234, 3, 2, 256, 48


class StandIn:
    """The op's fast path with the stand-ins above; ``records`` plays the op's launch records."""

    def __init__(self, op, multi: bool = False, current: int = -1):
        self.op, self.records, self.launches, self.handed_over = op, {}, [], []
        src = op.fast_source.replace(".is_cuda", ".is_cpu")
        assert src != op.fast_source
        ns = dict(op.function.__globals__)  # the names bind() gave the generated code
        ns.update(_slow=self._detailed, _records=self.records, _stream=lambda device: STREAM,
                  _getdev=lambda: current, _state=types.SimpleNamespace(multi=multi), _launch_ex=[self._launch_ex],
                  _L=types.SimpleNamespace(tls=_launch.tls, driver_launch=self._launch, failed=None))
        exec(compile(src, f"<stand-in {op.name}>", "exec"), ns)
        self.fn = ns[op.name]

    def _detailed(self, op, values, validate):
        self.handed_over.append(values)

    def _launch(self, *args):
        self.launches.append(("launch",) + args)

    def _launch_ex(self, cfg, fptr, argv, extra):
        self.launches.append(("launch_ex", cfg, fptr, argv, extra))
        return 0

    def __call__(self, values: tuple, validate: bool = False) -> bytes | None:
        """The parameter bytes the call packed, or None where it handed the call over (the buffer is
        poisoned first, so bytes left unwritten show)."""
        self.launches.clear()
        self.handed_over.clear()
        buf = _launch.tls.buf
        ctypes.memset(buf.params, 0xA5, self.op.struct.size)
        self.fn(*values, validate=validate)
        assert len(self.launches) + len(self.handed_over) == 1
        return buf.params.raw[:self.op.struct.size] if self.launches else None


def record(op, cfg: int) -> tuple:
    """A launch record with a distinct value in every field."""
    return (FPTR, GX, GY, BLOCK, SMEM, cfg, tuple(301 + i for i in range(len(op.launch_fields))),
            tuple(0x5000 + 8 * i for i in range(len(op.scratch))))


def served(op, values: tuple):
    """The detailed path's record key for ``values``, None where it refuses them or launches nothing."""
    try:
        dims, device, variant = op.check(values)
    except (TypeError, ValueError):
        return None
    if getattr(dims, op.batch) == 0:
        return None
    return _launch.record_key(op, dims, variant, device, STREAM)


def detailed_bytes(op, values: tuple, rec: tuple, monkeypatch) -> bytes:
    """The parameter bytes the detailed path packs for ``values`` from record ``rec``."""
    dims, device, variant = op.check(values)
    monkeypatch.setitem(op.records, _launch.record_key(op, dims, variant, device, STREAM), rec)
    got = []
    monkeypatch.setattr(_launch, "_submit", lambda rec_, stream, buf: got.append(buf.params.raw[:op.struct.size]))
    _launch._run_here(op, values, dims, device, variant, STREAM)
    return got[0]


def valid_calls(name: str) -> list:
    """Valid arguments of op ``name``: the custom-op tests' ones, and the chain op's with coins drawn
    from seed and offset tensors."""
    op = OPS[name]
    given = CORE_ARGS[name](3)
    calls = [tuple(given) + tuple(e.default for e in op.table[len(given):])]
    if name == "chain_speculative_sampling":
        v = list(calls[0])
        v[3], v[7], v[8], v[10] = None, torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), True
        calls.append(tuple(v))
    return calls


def _other_dtype(a: Arg) -> torch.dtype:
    dtypes = a.dtype if isinstance(a.dtype, tuple) else (a.dtype,)
    return next(d for d in (torch.float64, torch.int8, torch.complex64) if d not in dtypes)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous tensor of its shape (numel >= 2)."""
    s = torch.empty(t.shape + (2,), dtype=t.dtype)[..., 0]
    s.copy_(t)
    return s


def changes(op, values: tuple):
    """(what, values) for every single change of one argument."""
    for i, e in enumerate(op.table):
        v = values[i]
        if isinstance(e, Arg):
            yield f"{e.name} None", values[:i] + (None,) + values[i + 1:]
            if v is None:
                continue
            if v.numel() > 0:
                yield f"{e.name} dtype", values[:i] + (v.to(_other_dtype(e)),) + values[i + 1:]
            if v.numel() >= 2:
                yield f"{e.name} strided", values[:i] + (_strided(v),) + values[i + 1:]
            yield f"{e.name} on meta", values[:i] + (v.to("meta"),) + values[i + 1:]
            yield f"{e.name} rank", values[:i] + (v.unsqueeze(0),) + values[i + 1:]
            for axis in range(v.dim()):
                for size in (v.shape[axis] + 1, v.shape[axis] - 1, 0):
                    shape = v.shape[:axis] + (size,) + v.shape[axis + 1:]
                    if size >= 0:
                        yield f"{e.name} axis {axis} -> {size}", values[:i] + (
                            torch.zeros(shape, dtype=v.dtype),) + values[i + 1:]
        else:
            others = {"float": (1, True, None), "int": (1.0, True, None), "bool": (1, 1.0, None)}[e.kind]
            edges = [x for x in (e.lo - 1, e.hi + 1, e.lo, e.hi) if isinstance(x, (int, float)) and math.isfinite(x)]
            if e.kind == "float":
                edges = [float(x) for x in edges] + [math.nan]
            if e.kind == "bool":
                edges = [not v]
            for x in others + tuple(edges):
                yield f"{e.name} = {x!r}", values[:i] + (x,) + values[i + 1:]


OP_NAMES = sorted(OPS)


@pytest.mark.parametrize("cfg", [0, 77])
@pytest.mark.parametrize("name", OP_NAMES)
def test_valid_arguments_take_the_fast_path_and_pack_what_the_detailed_path_packs(name, cfg, monkeypatch):
    op = OPS[name]
    for values in valid_calls(name):
        si, rec = StandIn(op), record(op, cfg)
        si.records[served(op, values)] = rec
        got = si(values)
        assert got is not None, "handed over to the detailed path"
        assert got == detailed_bytes(op, values, rec, monkeypatch)
        argv = _launch.tls.buf.argv
        want = ("launch_ex", cfg, FPTR, argv, None) if cfg else ("launch", FPTR, GX, GY, 1, BLOCK, 1, 1, SMEM, STREAM,
                                                                   argv, 0)
        assert si.launches == [want]


@pytest.mark.parametrize("name", OP_NAMES)
def test_every_change_of_one_argument_is_served_alike(name, monkeypatch):
    """Where the fast path launches, the detailed path serves the call from the same record and packs
    the same bytes; everything else is handed over (a change the detailed path accepts but needs
    another record for, e.g. another size, must not reuse the record in place)."""
    op = OPS[name]
    for values in valid_calls(name):
        key, rec = served(op, values), record(op, 0)
        si = StandIn(op)
        si.records[key] = rec
        for what, changed in changes(op, values):
            got = si(changed)
            if served(op, changed) != key:
                assert got is None, f"{what}: launched, but the detailed path refuses it or needs another record"
            elif got is not None:
                assert got == detailed_bytes(op, changed, rec, monkeypatch), what
        assert si(values) is not None


@pytest.mark.parametrize("name", OP_NAMES)
def test_validate_and_an_empty_batch_are_handed_over(name):
    op = OPS[name]
    values = valid_calls(name)[0]
    si = StandIn(op)
    si.records[served(op, values)] = record(op, 0)
    assert si(values, validate=True) is None
    assert si(values) is not None


@pytest.mark.parametrize("name", OP_NAMES)
def test_with_several_gpus_the_current_device_must_be_the_tensors(name):
    """With more than one visible GPU the fast path compares every tensor's device, and the current
    device, with the first tensor's (-1 here: the stand-ins are CPU tensors)."""
    op = OPS[name]
    values = valid_calls(name)[0]
    for current, launches in ((-1, True), (0, False)):
        si = StandIn(op, multi=True, current=current)
        si.records[served(op, values)] = record(op, 0)
        assert (si(values) is not None) == launches


def test_build_tree_reuses_its_record_while_the_mask_length_keeps_its_power_of_two():
    """build_tree's key holds L.bit_length(): a longer mask of the same power of two is served from
    the record in place (its length packed as given), a mask past it needs another record."""
    op = OPS["build_tree_kernel_efficient"]
    values = valid_calls("build_tree_kernel_efficient")[0]
    L = values[3].numel()
    si = StandIn(op)
    si.records[served(op, values)] = record(op, 0)
    for length, launches in ((L + 1, True), ((1 << L.bit_length()) - 1, True), (1 << L.bit_length(), False),
                             ((1 << (L.bit_length() - 1)) - 1, False)):
        changed = values[:3] + (torch.zeros(length, dtype=torch.bool),) + values[4:]
        assert (si(changed) is not None) == launches, length
