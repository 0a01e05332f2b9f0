"""``uniform_coins``: counter-based uniform coins from seed and offset tensors, the same bits on
the CPU and the GPU. Inside a CUDA graph the seeds and offsets are read when the graph runs, so a
captured step draws fresh coins after the caller advances ``offset`` in place."""

from __future__ import annotations

import torch

from . import reference
from ._core import Arg, Constraint, Launch, Op

I64, F32 = torch.int64, torch.float32
THREADS = 256

TABLE = (
    Arg("seed", I64, ("ns",), "one seed for every request (ns = 1) or one per request (ns = bs)"),
    Arg("offset", I64, ("no",), "the first step of each stream drawn (no = 1 or bs)"),
    Arg("out", F32, ("bs", "m"), "the coins: step offset + j of request b's stream in column j", written=True),
)


def plan(dims, variant, dev) -> Launch:
    """One thread per coin."""
    return Launch((max(1, -(-dims.bs * dims.m // THREADS)), 1), THREADS)


OP = Op(
    "uniform_coins",
    """Counter-based uniform coins: ``out[b, j]`` is a float32 in [0, 1 - 2**-24] drawn from step
``offset_b + j`` of a splitmix64 stream keyed by ``(seed_b, b)``; equal seeds and offsets give equal
coins on every device, and advancing ``offset`` by m gives fresh ones. Seeds and offsets are 64-bit
words held in int64. :mod:`cupy_spec.reference.uniform_coins` states the bits exactly.""",
    TABLE,
    reference=reference.uniform_coins,
    plan=plan,
    plan_dims=("bs", "m"),
    constraints=(
        Constraint("ns in (1, bs)", "seed must have 1 or bs={bs} entries, got {shapes[seed]}"),
        Constraint("no in (1, bs)", "offset must have 1 or bs={bs} entries, got {shapes[offset]}"),
        Constraint("bs * m < 2**31", "out has bs * m = {bs} * {m} coins; at most 2**31 - 1 are supported"),
    ),
    constants=dict(THREADS=THREADS),
)
uniform_coins = OP.function
