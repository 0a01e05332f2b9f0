"""Pure-torch reference of ``uniform_coins``: counter-based uniform coins from seeds and offsets.

The CUDA kernel must match it bitwise. All arithmetic is on 64-bit words modulo 2**64 (held in
int64 tensors; shifts are logical). With ``mix`` the splitmix64 output function and
``GOLDEN = 0x9E3779B97F4A7C15``, per request ``b`` and column ``j``:

* ``seed_b = seed[b]`` if ``seed`` has ``bs`` entries, ``seed[0]`` if it has one; ``offset_b`` alike;
* ``key_b = mix(seed_b ^ mix(b))``;
* ``out[b, j] = (mix(key_b + (offset_b + j) * GOLDEN) >> 40) * 2**-24``: the top 24 bits of step
  ``offset_b + j`` of the splitmix64 stream keyed by ``key_b``, a float32 in ``[0, 1 - 2**-24]``.

So a call with offset ``o`` draws steps ``o .. o + m - 1`` of each request's stream: advancing the
offset by ``m`` between calls gives fresh coins, equal seeds and offsets give equal coins.
"""

from __future__ import annotations

import torch

__all__ = ["uniform_coins", "GOLDEN", "int64_word"]

GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def int64_word(x: int) -> int:
    """A 64-bit word as the int64 value with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function; int64 multiplication wraps modulo 2**64."""
    z = (z ^ _shr(z, 30)) * int64_word(_M1)
    z = (z ^ _shr(z, 27)) * int64_word(_M2)
    return z ^ _shr(z, 31)


def uniform_coins(seed, offset, out):
    """Reference implementation; same arguments and in-place output as the public op."""
    bs, m = out.shape
    dev = out.device
    b = torch.arange(bs, dtype=torch.int64, device=dev)
    j = torch.arange(m, dtype=torch.int64, device=dev)
    s = seed.to(dev).expand(bs)[:, None]
    o = offset.to(dev).expand(bs)[:, None]
    key = _mix(s ^ _mix(b)[:, None])
    h = _mix(key + (o + j) * int64_word(GOLDEN))
    out.copy_(_shr(h, 40).to(torch.float32) * 2.0**-24)
