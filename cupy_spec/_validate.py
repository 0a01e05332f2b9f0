"""Shape-level argument checks, done once at the Python boundary.

The table below is the whole contract: every tensor argument with its dtype and its named
dimensions. Dimensions with the same name must agree across tensors. The checks touch only
metadata (no device synchronisation), so they run on every call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

ARG_NAMES = (
    "predicts",
    "accept_index",
    "accept_token_num",
    "candidates",
    "retrive_index",
    "retrive_next_token",
    "retrive_next_sibling",
    "uniform_samples",
    "uniform_samples_for_final_sampling",
    "target_probs",
    "draft_probs",
)

# (name, dtype, named dimensions); draft_probs may be None.
TENSORS = (
    ("predicts", torch.int32, ("P",)),
    ("accept_index", torch.int32, ("bs", "S")),
    ("accept_token_num", torch.int32, ("bs",)),
    ("candidates", torch.int64, ("bs", "n")),
    ("retrive_index", torch.int64, ("bs", "n")),
    ("retrive_next_token", torch.int64, ("bs", "n")),
    ("retrive_next_sibling", torch.int64, ("bs", "n")),
    ("uniform_samples", torch.float32, ("bs", "n")),
    ("uniform_samples_for_final_sampling", torch.float32, ("bs",)),
    ("target_probs", torch.float32, ("bs", "n", "V")),
    ("draft_probs", torch.float32, ("bs", "n", "V")),
)


class Dims(NamedTuple):
    bs: int
    n: int
    S: int
    V: int
    P: int
    cuda: int  # CUDA device index of the tensors, -1 on the CPU


def _fmt_shape(dims: tuple, sizes: dict) -> str:
    return "[" + ", ".join(f"{d}={sizes[d]}" if d in sizes else d for d in dims) + "]"


def check_threshold(name: str, value) -> None:
    """A threshold must be a real number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__} {value!r}")
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ValueError(f"{name} must lie in [0, 1] (1.0 is lossless), got {value!r}")


_I32, _I64, _F32 = torch.int32, torch.int64, torch.float32


def check_args(tensors: tuple, threshold_single, threshold_acc) -> Dims:
    """Checks the 11 tensor arguments (in signature order) and the thresholds; returns the dims.

    Raises TypeError for a wrong type or dtype and ValueError for a wrong rank, size, device,
    layout or threshold, naming the argument, what was expected and what was given.
    """
    dims = _check_cuda_fast(tensors, threshold_single, threshold_acc)
    return dims if dims is not None else _check_table(tensors, threshold_single, threshold_acc)


def _check_cuda_fast(t: tuple, ts, ta):
    """The table's checks, written out for the common case (valid CUDA tensors on one device), so
    the per-call cost stays at a few attribute reads. Returns None to defer to the table, which
    then accepts exactly the same inputs or raises the detailed error."""
    try:
        pr, ai, an, ca, ri, nt, ns, us, uf, tp, dp = t
        if not (type(ts) is float and type(ta) is float and 0.0 <= ts <= 1.0 and 0.0 <= ta <= 1.0):
            return None
        if not (tp.is_cuda and tp.dtype is _F32 and ca.dtype is _I64 and ri.dtype is _I64 and nt.dtype is _I64
                and ns.dtype is _I64 and us.dtype is _F32 and uf.dtype is _F32 and pr.dtype is _I32
                and ai.dtype is _I32 and an.dtype is _I32 and (dp is None or dp.dtype is _F32)):
            return None
        sh, tsh, ash = ca.shape, tp.shape, ai.shape
        bs, n = sh
        _, _, V = tsh
        _, S = ash
        (P,) = pr.shape
        if not (tsh[0] == bs and tsh[1] == n and ri.shape == sh and nt.shape == sh and ns.shape == sh
                and us.shape == sh and ash[0] == bs and an.shape == (bs,) and uf.shape == (bs,)
                and (dp is None or dp.shape == tsh) and (bs == 0 or 1 <= S <= n and V >= 1)):
            return None
        # get_device() is the CUDA index for CUDA tensors and -1 for CPU ones; tp.is_cuda holds.
        dev = tp.get_device()
        for x in (pr, ai, an, ca, ri, nt, ns, us, uf, tp):
            if not (x.get_device() == dev and x.is_contiguous()):
                return None
        if dp is not None and not (dp.get_device() == dev and dp.is_contiguous()):
            return None
        return Dims(bs, n, S, V, P, dev)
    except (AttributeError, TypeError, ValueError):
        return None


def _check_table(tensors: tuple, threshold_single, threshold_acc) -> Dims:
    """The declarative check over TENSORS, with detailed errors."""
    sizes: dict = {}
    device = None
    first = None
    for (name, dtype, dims), t in zip(TENSORS, tensors):
        if t is None and name == "draft_probs":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (or a DLPack array), got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
        shape = t.shape
        if len(shape) != len(dims):
            raise ValueError(f"{name} must have shape {_fmt_shape(dims, sizes)} ({len(dims)}-D), got {tuple(shape)}")
        for d, s in zip(dims, shape):
            want = sizes.setdefault(d, s)
            if want != s:
                raise ValueError(
                    f"{name} must have shape {_fmt_shape(dims, sizes)}, got {tuple(shape)} ({d} is {want} elsewhere)"
                )
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; all tensors must share a device")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(shape)}); no copy is made")
    check_threshold("threshold_single", threshold_single)
    check_threshold("threshold_acc", threshold_acc)
    cuda = device.index if device.type == "cuda" else -1  # a CUDA tensor's device always has an index
    d = Dims(sizes["bs"], sizes["n"], sizes["S"], sizes["V"], sizes["P"], cuda)
    if d.bs > 0:
        if d.n < 1:
            raise ValueError(f"candidates must have at least one node (n >= 1), got shape {tuple(tensors[3].shape)}")
        if d.S < 1:
            raise ValueError(f"accept_index must have S >= 1 columns, got shape {tuple(tensors[1].shape)}")
        if d.S > d.n:
            raise ValueError(f"accept_index has S={d.S} columns but a tree of n={d.n} nodes has depth < n; need S <= n")
        if d.V < 1:
            raise ValueError(f"target_probs must have a vocabulary of V >= 1, got shape {tuple(tensors[9].shape)}")
    return d
