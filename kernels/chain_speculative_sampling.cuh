// Chain speculative sampling (FlashInfer's chain_speculative_sampling): test k draft tokens, then
// sample the token after the accepted prefix from the residual max(p - q, 0) (or the bonus row when
// every draft passed).
//
// Launch: grid (bs, C), THREADS threads, one request per block or per thread-block cluster of C
// blocks (sm_90 and later, cluster rank = blockIdx.y). Every block of a request runs the k tests
// itself (one round of parallel gathers of q_i(x_i), p_i(x_i) and the coins; k is small), so all
// agree on the row to sample. Then each block sums its share of the row's pieces (float64, see
// sampling.cuh) into rank 0's shared memory; after a cluster barrier rank 0 locates the piece
// holding u = coin * total, rescans that piece, and writes every output of the request. A residual
// that is all zero falls back to the target row: rank 0 alone re-sums the row (degenerate input).
//
// Semantics are those of cupy_spec/reference/chain_speculative_sampling.py: probabilities are read
// as effective values (NaN / inf / negative / subnormal -> 0), coins are clamped into [0, 1), ids
// outside [0, V) never pass and are never used as an index, and the counters are *added* into the
// caller's int32 tensors (written instead when p.accumulate is 0). Coins: uniform_samples[b, j], or
// with SEEDED the counter-based coin of step offset_b + j keyed by (seed_b, b), exactly as the
// uniform_coins op draws it (seed_b from the seed tensor, or p.seed_word where it is absent; offset_b
// alike).
#pragma once
#include "sampling.cuh"

namespace cupy_spec {

// ChainSpeculativeSamplingParams and its constant BATCHES are generated from the argument table in
// cupy_spec/chain_speculative_sampling.py.
using ChainParams = ChainSpeculativeSamplingParams;

// The final row: the target row p_e, or with a draft row max(E(p_e) - E(q_e), 0). lane_sums takes
// its branch-free path for aligned quads (kInteriorLoads).
struct ChainRow {
  static constexpr bool kInteriorLoads = true;
  const float* t;
  const float* d;  // nullptr: nothing subtracted
  RowUnits u;
  bool dvec;  // the draft row shares the target row's 16-byte phase

  template <bool INTERIOR = false>
  __device__ __forceinline__ int load(int k, Unit& x) const {
    const int s = load_unit<true, INTERIOR>(t, u, k, true, x.t);
    if (d != nullptr) load_unit<true, INTERIOR>(d, u, k, dvec, x.d);
    return s;
  }
  __device__ __forceinline__ void values(const Unit& x, int /*start*/, float r[4], float q[4]) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      r[j] = effective_prob(x.t[j]);
      if (d != nullptr) r[j] = positive_normal(r[j] - effective_prob(x.d[j]));
      q[j] = 0.0f;
    }
  }
};

__device__ __forceinline__ ChainRow chain_row(const float* t, const float* d, int V) {
  ChainRow row;
  row.t = t;
  row.d = d;
  row.u = row_units(t, V);
  row.dvec = d == nullptr ||
             ((reinterpret_cast<unsigned long long>(t) ^ reinterpret_cast<unsigned long long>(d)) & 15ull) == 0;
  return row;
}

// Coin j of request b, clamped into [0, 1).
template <bool SEEDED>
__device__ __forceinline__ float chain_coin(const ChainParams& p, long long b, long long j) {
  if (SEEDED) {
    const auto seed = static_cast<unsigned long long>(p.ns < 0 ? p.seed_word : p.seed[p.ns == 1 ? 0 : b]);
    const auto offset = static_cast<unsigned long long>(p.no < 0 ? p.offset_word : p.offset[p.no == 1 ? 0 : b]);
    return clamp_coin(counter_coin(seed, static_cast<unsigned long long>(b), offset + static_cast<unsigned long long>(j)));
  }
  return clamp_coin(p.uniform_samples[b * p.k1 + j]);
}

// THREADS, MIN_BLOCKS: the build the plan picks (block size, blocks per SM whose registers it budgets
// for): 512 threads and one block per SM, or 384 and two (both fit the branch-free loads without
// spills). SEEDED: the coins come from seed and offset (chain_coin).
template <typename IdT, int THREADS, int MIN_BLOCKS, bool SEEDED = false>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) chain_speculative_sampling_kernel(const ChainParams p) {
  follow_previous_grid();  // first: before any global memory access
  constexpr int WARPS = THREADS / 32;
  constexpr int G = ChainParams::BATCHES;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int s_emitted, s_accepted;
  __shared__ SearchSlots<double> slots;
  double* psum = reinterpret_cast<double*>(smem_raw);  // [pieces]

  const Split sp = request_split();
  if (!sp.clustered && blockIdx.y != 0) return;  // the plan never launches this; stay single-writer
  // Blocks of a cluster write rank 0's shared memory, which first needs every block started: this
  // arrive pairs with the wait before the piece sums.
  if (sp.clustered) cluster_arrive_relaxed();

  const long long b = blockIdx.x;
  const int k = static_cast<int>(p.k), V = static_cast<int>(p.V);
  const long long K1 = p.k1;
  const IdT* ids = static_cast<const IdT*>(p.draft_token_ids) + b * p.k;
  // The final sample's coin, loaded now with the tests' inputs: the sample needs it as soon as the
  // piece sums are in, where a load would add a trip to memory.
  const float final_coin = chain_coin<SEEDED>(p, b, k);
  // The counters' values to add into, loaded now for the same reason (by the thread that writes them).
  constexpr int kRestFirst = MIN_BLOCKS == 1 ? 32 : 0;
  const bool adds = threadIdx.x == kRestFirst && p.accumulate;
  const unsigned a0 = adds ? static_cast<unsigned>(p.output_accepted_token_num[b]) : 0u;
  const unsigned e0 = adds ? static_cast<unsigned>(p.output_emitted_draft_token_num[b]) : 0u;

  // The k tests, in parallel: e = first failing position (k if none), a = number passing.
  if (threadIdx.x == 0) {
    s_emitted = k;
    s_accepted = 0;
  }
  __syncthreads();
  for (long long i = threadIdx.x; i < p.k; i += THREADS) {
    const long long x = static_cast<long long>(ids[i]);
    bool pass = false;
    if (x >= 0 && x < p.V) {
      const float q = effective_prob(__ldg(p.draft_probs + ((b * p.k + i) * p.V + x)));
      const float t = effective_prob(__ldg(p.target_probs + ((b * K1 + i) * p.V + x)));
      const float u = chain_coin<SEEDED>(p, b, i);
      pass = flush_subnormal(u * q) < t;
    }
    if (pass) atomicAdd(&s_accepted, 1);
    else atomicMin(&s_emitted, static_cast<int>(i));
  }
  __syncthreads();
  const int e = s_emitted, accepted = s_accepted;
  bool subtract = false;
  if (e < k) {
    const long long x = static_cast<long long>(ids[e]);
    subtract = x >= 0 && x < p.V;
  }
  const float* trow = p.target_probs + (b * K1 + e) * p.V;
  const float* drow = subtract ? p.draft_probs + (b * p.k + e) * p.V : nullptr;
  const auto row = chain_row(trow, drow, V);
  const int piece_units = static_cast<int>(p.piece_units);

  if (sp.clustered) cluster_wait();
  split_piece_sums<WARPS, G>(row, psum, piece_units, sp);
  if (!hand_over_piece_sums(sp)) return;

  // Rank 0 (or the only block) finishes the request. write_rest(first): every output but the sampled
  // token (the accepted drafts, the -1 padding after it, the counters), by threads `first` and up. The
  // one-block-per-SM build writes them while warp 0 locates the sample's piece; the two-blocks build
  // (where this measured slower in its earlier 512-thread form) after the sample. Thread 0 writes
  // the token last.
  int* out = p.output_token_ids + b * K1;
  const auto write_rest = [&](int first) {
    if (static_cast<int>(threadIdx.x) < first) return;
    for (long long i = threadIdx.x - first; i < K1; i += THREADS - first) {
      if (i != e) out[i] = i < e ? static_cast<int>(ids[i]) : -1;
    }
    if (static_cast<int>(threadIdx.x) == first) {  // added into (int32 counters wrap like torch's add_) or written
      p.output_accepted_token_num[b] = static_cast<int>(a0 + static_cast<unsigned>(accepted));
      p.output_emitted_draft_token_num[b] = static_cast<int>(e0 + static_cast<unsigned>(e));
    }
  };
  if (MIN_BLOCKS == 1) write_rest(kRestFirst);
  int token = sample_row<THREADS>(row, psum, piece_units, final_coin, &slots);
  if (token < 0 && drow != nullptr) {  // residual all zero: sample the target row instead
    __syncthreads();  // every warp has read psum
    const auto plain = chain_row(trow, nullptr, V);
    block_piece_sums<WARPS, G>(plain, psum, piece_units);
    token = sample_row<THREADS>(plain, psum, piece_units, final_coin, &slots);
  }
  if (MIN_BLOCKS != 1) write_rest(kRestFirst);
  if (threadIdx.x == 0) out[e] = token < 0 ? V - 1 : token;
}

}  // namespace cupy_spec
