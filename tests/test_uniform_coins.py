"""uniform_coins: the reference against a plain-integer statement of the hash, the kernel against
the reference bit for bit, the statistics of the coins, argument errors, CUDA graphs."""

from __future__ import annotations

import math

import pytest
import torch

import cupy_spec
from cases import captured

gpu = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
MASK = (1 << 64) - 1


def mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def coin(seed: int, offset: int, b: int, j: int) -> float:
    """The hash with Python integers (unbounded, masked to 64 bits)."""
    key = mix((seed & MASK) ^ mix(b))
    return (mix((key + ((offset + j) & MASK) * 0x9E3779B97F4A7C15) & MASK) >> 40) / 2**24


def words(*xs: int) -> torch.Tensor:
    """64-bit words as an int64 tensor (bit patterns, so values >= 2**63 become negative)."""
    return torch.tensor([x - (1 << 64) if x >= 1 << 63 else x for x in xs], dtype=torch.int64)


def draw(seed, offset, bs, m, device):
    out = torch.full((bs, m), -1.0, device=device)  # poisoned: unwritten entries show
    cupy_spec.uniform_coins(seed.to(device), offset.to(device), out)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed, offset", [([0], [0]), ([1, 2, 3], [0]), ([2**64 - 1], [2**63, 5, 2**64 - 3]),
                                          ([12345, 2**63, 7], [2**40, 0, 2**64 - 1])])
def test_matches_the_integer_statement(device, seed, offset):
    """Every bit, including words above 2**63 and offsets that wrap around 2**64."""
    bs, m = 3, 6
    got = draw(words(*seed), words(*offset), bs, m, device).cpu()
    want = [[coin(seed[b if len(seed) > 1 else 0], offset[b if len(offset) > 1 else 0], b, j) for j in range(m)]
            for b in range(bs)]
    assert got.tolist() == want


@gpu
@pytest.mark.parametrize("bs, m", [(1, 1), (5, 4), (64, 9), (257, 33), (3, 1000)])
def test_kernel_matches_reference_bitwise(bs, m):
    g = torch.Generator().manual_seed(bs * m)
    seed = torch.randint(-2**63, 2**63 - 1, (bs,), generator=g, dtype=torch.int64)
    offset = torch.randint(-2**63, 2**63 - 1, (1,), generator=g, dtype=torch.int64)
    want = draw(seed, offset, bs, m, "cpu")
    assert torch.equal(draw(seed, offset, bs, m, "cuda").cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_offset_steps_through_one_stream(device):
    """Column j at offset o is column 0 at offset o + j: advancing the offset by m gives the next m."""
    seed = words(99, 2**63 + 5)
    wide = draw(seed, words(10), 2, 8, device)
    for o in range(8):
        assert torch.equal(draw(seed, words(10 + o), 2, 1, device)[:, 0], wide[:, o])


def test_coins_look_uniform_and_independent():
    """Chi-square over 64 bins for 2**18 coins, the same for pairs of neighbouring columns (8x8
    bins), and no correlation between requests sharing a seed: fails for a constant, a biased or
    a per-column-repeating stream."""
    out = draw(words(2024), words(0), 512, 512, "cpu")
    assert out.min() >= 0 and out.max() <= 1 - 2**-24

    def chi2(x, bins):
        counts = torch.bincount(x.flatten(), minlength=bins).double()
        e = x.numel() / bins
        return float(((counts - e) ** 2 / e).sum())

    # 99.99% points of chi-square with 63 degrees of freedom: ~117
    assert chi2((out * 64).long(), 64) < 117
    pairs = (out[:, :-1] * 8).long() * 8 + (out[:, 1:] * 8).long()
    assert chi2(pairs, 64) < 117
    r = torch.corrcoef(out[:8].double())
    assert (r - torch.eye(8, dtype=torch.float64)).abs().max() < 5 / math.sqrt(512)


def test_errors_name_the_argument():
    out = torch.empty(4, 3)
    with pytest.raises(ValueError, match=r"seed must have 1 or bs=4 entries, got \(2,\)"):
        cupy_spec.uniform_coins(words(1, 2), words(0), out)
    with pytest.raises(ValueError, match=r"offset must have 1 or bs=4 entries"):
        cupy_spec.uniform_coins(words(1), words(0, 1, 2), out)
    with pytest.raises(TypeError, match=r"seed must have dtype int64, got int32"):
        cupy_spec.uniform_coins(torch.tensor([1], dtype=torch.int32), words(0), out)
    with pytest.raises(TypeError, match=r"out must have dtype float32"):
        cupy_spec.uniform_coins(words(1), words(0), torch.empty(4, 3, dtype=torch.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_outputs(device):
    cupy_spec.uniform_coins(words(1).to(device), words(0).to(device), torch.empty(0, 3, device=device))
    cupy_spec.uniform_coins(words(1).to(device), words(0).to(device), torch.empty(2, 0, device=device))


@gpu
def test_graph_replay_reads_the_offset_when_it_runs():
    """A captured draw gives the coins of the offset tensor's value at each replay."""
    seed, offset = words(5).cuda(), words(0).cuda()
    out = torch.empty(16, 5, device="cuda")
    graph, _ = captured(lambda: cupy_spec.uniform_coins(seed, offset, out))
    for o in (0, 5, 10):
        offset.fill_(o)
        graph.replay()
        assert torch.equal(out.cpu(), draw(words(5), words(o), 16, 5, "cpu"))
