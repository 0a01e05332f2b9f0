// Counter-based uniform coins: out[b, j] = top 24 bits of splitmix64 step (offset_b + j) of the
// stream keyed by (seed_b, b), as a float32 in [0, 1 - 2^-24].
//
//   key_b     = mix(seed_b ^ mix(b))
//   out[b, j] = (mix(key_b + (offset_b + j) * GOLDEN) >> 40) * 2^-24      (all arithmetic mod 2^64)
//
// seed_b = seed[b] when seed has bs entries, seed[0] when it has one (offset alike). Launch: one
// thread per coin, grid ceil(bs * m / THREADS). Semantics: cupy_spec/reference/uniform_coins.py.
#pragma once
#include "common.cuh"

namespace cupy_spec {

// UniformCoinsParams and THREADS are generated from the argument table in cupy_spec/uniform_coins.py.

__global__ void __launch_bounds__(UniformCoinsParams::THREADS) uniform_coins_kernel(const UniformCoinsParams p) {
  follow_previous_grid();  // first: before any global memory access
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.bs * p.m) return;
  const long long b = t / p.m, j = t - b * p.m;
  const auto seed = static_cast<unsigned long long>(p.seed[p.ns == 1 ? 0 : b]);
  const auto offset = static_cast<unsigned long long>(p.offset[p.no == 1 ? 0 : b]);
  p.out[t] = counter_coin(seed, static_cast<unsigned long long>(b), offset + static_cast<unsigned long long>(j));
}

}  // namespace cupy_spec
