"""Arguments that share memory: every op's ``validate=True`` (and its public content check) refuses a
written tensor that overlaps another tensor argument, naming both, and accepts tensors that merely
lie next to each other in one allocation.

Every op's core arguments come from ``test_torch_compile.CORE_ARGS``; a pair is placed in one byte
buffer, either overlapping by part of an element or touching without overlap."""

from __future__ import annotations

import pytest
import torch

import cupy_spec
from cupy_spec._core import OPS, Arg
from test_torch_compile import CORE_ARGS

gpu = pytest.mark.gpu


def _placed(first: torch.Tensor, second: torch.Tensor, overlap: bool) -> tuple:
    """Copies of ``first`` and ``second`` in one allocation: ``second`` starts inside ``first``'s last
    element (``overlap``) or at the first suitably aligned byte after ``first``'s end."""
    size = second.element_size()
    end = first.nbytes
    start = (end - 1) // size * size if overlap else -(-end // size) * size
    buf = torch.zeros(start + second.nbytes + 16, dtype=torch.uint8, device=first.device)
    a = buf[:end].view(first.dtype).view(first.shape)
    b = buf[start:start + second.nbytes].view(second.dtype).view(second.shape)
    a.copy_(first)
    b.copy_(second)
    return a, b


def _pairs(name: str):
    """(index of a written tensor, index of another non-empty tensor) over the op's core arguments."""
    op, args = OPS[name], CORE_ARGS[name](3)
    tensors = [i for i, (e, v) in enumerate(zip(op.table, args)) if isinstance(e, Arg) and v is not None
               and v.numel() > 0]
    return [(i, j) for i in tensors for j in tensors if i != j and op.table[i].written
            and (j > i or not op.table[j].written)]


def _with_pair(name: str, i: int, j: int, overlap: bool, device: str) -> tuple:
    """The op's core arguments (every one, defaults included) with tensors i and j placed together."""
    table, given = OPS[name].table, CORE_ARGS[name](3)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in given]
    args += [e.default for e in table[len(given):]]
    args[i], args[j] = _placed(args[i], args[j], overlap)
    return tuple(args)


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_written_pairs(name):
    assert _pairs(name), f"{name}: no written tensor to test"


@pytest.mark.parametrize("name", sorted(OPS))
def test_check_names_both_overlapping_arguments(name):
    op = OPS[name]
    for i, j in _pairs(name):
        args = _with_pair(name, i, j, True, "cpu")
        op.check(args)  # the shape checks alone do not look
        w, o = op.table[i].name, op.table[j].name
        with pytest.raises(ValueError, match=f"^{w} and {o} share memory: {name} writes {w} while {o} is "):
            op.check(args, overlap=True)


@pytest.mark.parametrize("name", sorted(OPS))
def test_adjacent_arguments_pass(name):
    op = OPS[name]
    for i, j in _pairs(name):
        op.check(_with_pair(name, i, j, False, "cpu"), overlap=True)


def _validated_call_refuses(name: str, device: str) -> None:
    """validate=True on the op's own function raises before anything runs: no argument changes."""
    op = OPS[name]
    i, j = _pairs(name)[0]
    args = _with_pair(name, i, j, True, device)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError, match=f"{op.table[i].name} and {op.table[j].name} share memory"):
        op.function(*args, validate=True)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), "a refused call wrote an argument"
    op.function(*args)  # without validate the call runs (its results are undefined)


@pytest.mark.parametrize("name", sorted(OPS))
def test_validate_refuses_overlap_on_cpu(name):
    _validated_call_refuses(name, "cpu")


@gpu
@pytest.mark.parametrize("name", sorted(OPS))
def test_validate_refuses_overlap_on_gpu(name):
    _validated_call_refuses(name, "cuda")
    torch.cuda.synchronize()


def test_public_content_check_refuses_overlap():
    name = "verify_tree_greedy"
    op = OPS[name]
    predicts, accept_index = (op.table[k].name for k in (0, 1))
    args = _with_pair(name, 0, 1, True, "cpu")
    with pytest.raises(ValueError, match=f"{predicts} and {accept_index} share memory"):
        cupy_spec.check.verify_tree_greedy(*args)
