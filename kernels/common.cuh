// Small device helpers shared by the cupy_spec kernels: row loads in 16-byte units with a scalar
// head and tail, and warp reductions and scans. No system headers: NVRTC compiles this alone.
#pragma once

namespace cupy_spec {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kIntMax = 0x7fffffff;
constexpr float kFltMin = 1.17549435e-38f;  // smallest normal float32
constexpr float kFltMax = 3.40282347e+38f;
constexpr float kCoinMax = 0.99999994f;     // largest float32 below 1

__device__ __forceinline__ float flt_inf() { return __int_as_float(0x7f800000); }

// A probability as the op reads it: NaN, +-inf, negatives and subnormals count as 0.
__device__ __forceinline__ float effective_prob(float x) {
  return (x >= kFltMin && x <= kFltMax) ? x : 0.0f;
}

// effective_prob of an x that is never above FLT_MAX (a residual: an effective probability minus a value
// >= 0 or NaN), by one comparison: NaN, -inf, negatives and subnormals -> 0.
__device__ __forceinline__ float positive_normal(float x) { return x >= kFltMin ? x : 0.0f; }

// Subnormals become 0 (flush-to-zero); NaN and +-inf are kept.
__device__ __forceinline__ float flush_subnormal(float x) {
  return fabsf(x) < kFltMin ? 0.0f : x;
}

// A coin clamped into [0, kCoinMax]; NaN, negative and subnormal coins become 0 (explicitly, so
// that the rule does not depend on flush-to-zero).
__device__ __forceinline__ float clamp_coin(float c) {
  return c >= kFltMin ? fminf(c, kCoinMax) : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Counter-based coins (the uniform_coins op; cupy_spec/reference/uniform_coins.py states the bits).
// ---------------------------------------------------------------------------------------------
// The splitmix64 output function (a bijection of 64-bit words).
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Step `step` of the stream keyed by (seed, request b) as a float32 in [0, 1 - 2^-24]: the top 24
// bits of mix(mix(seed ^ mix(b)) + step * GOLDEN), all arithmetic mod 2^64.
__device__ __forceinline__ float counter_coin(unsigned long long seed, unsigned long long b, unsigned long long step) {
  constexpr unsigned long long kGolden = 0x9E3779B97F4A7C15ull;
  const unsigned long long key = mix64(seed ^ mix64(b));
  return static_cast<float>(mix64(key + step * kGolden) >> 40) * 0x1p-24f;
}

// A tree link as the walks read it: anything outside [0, n) means "none" (-1).
__device__ __forceinline__ int link(long long x, long long n) { return (x >= 0 && x < n) ? static_cast<int>(x) : -1; }

// ---------------------------------------------------------------------------------------------
// Draft trees in shared memory (the sampling ops' walks).
// ---------------------------------------------------------------------------------------------

// Per-node data: token (-1 if outside [0, V)), retrive_index (-1 if outside [0, P)), first child
// and next sibling (-1 if outside [0, n)).
struct TreeNode {
  int token, index, child, sibling;
};

// Loads request b's nodes and clamped coins into shared memory, clears the parent guesses and
// visited flags, and guesses every node's parent: the largest node whose child list names it (each
// thread follows one node's list for at most n steps, so cycles end). The final coin and the root's
// retrive_index go to *w. Ends with a barrier; returns n. `Params` is an op's parameter struct with the tree
// layout's fields; `W` any struct with final_coin and root_index.
template <class Params, class W>
__device__ __forceinline__ int load_tree_nodes(const Params& p, TreeNode* node, float* coin, int* parent, int* seen,
                                                long long b, W* w) {
  const int n = static_cast<int>(p.n);
  if (threadIdx.x == 0) w->final_coin = clamp_coin(p.uniform_samples_for_final_sampling[b]);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long g = b * p.n + i;
    const long long t = p.candidates[g], r = p.retrive_index[g];
    if (i == 0) w->root_index = static_cast<int>(r);
    node[i] = TreeNode{(t >= 0 && t < p.V) ? static_cast<int>(t) : -1, (r >= 0 && r < p.P) ? static_cast<int>(r) : -1,
                       link(p.retrive_next_token[g], p.n), link(p.retrive_next_sibling[g], p.n)};
    coin[i] = clamp_coin(p.uniform_samples[g]);
    parent[i] = -1;
    seen[i] = 0;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    int c = node[i].child;
    for (int steps = 0; c >= 0 && steps < n; ++steps) {
      atomicMax(&parent[c], i);
      c = node[c].sibling;
    }
  }
  __syncthreads();
  return n;
}

// Writes every output of request b (one thread), in the order the references write them:
// accept_index[b, 0]; then, unless the root's retrive_index is out of range (w.root_ok false: the
// count is 0 and nothing else is written), accept_index[b, 1..count] along the accepted path
// s.path[1..count] with each accepted node's token at its parent's retrive_index in predicts, then
// `extra()` (an op's own writes), the count, and `token` at the last accepted node's retrive_index.
template <class Params, class S, class W, class Extra>
__device__ __forceinline__ void write_tree_outputs(const Params& p, const S& s, const W& w, long long b, int token,
                                                   Extra&& extra) {
  const long long stride = p.S;
  p.accept_index[b * stride] = w.root_index;
  if (!w.root_ok) {
    p.accept_token_num[b] = 0;
    return;
  }
  int last = s.node[0].index;
  for (int j = 1; j <= w.count; ++j) {
    const TreeNode nd = s.node[s.path[j]];
    p.accept_index[b * stride + j] = nd.index;
    p.predicts[last] = nd.token;
    last = nd.index;
  }
  extra();
  p.accept_token_num[b] = w.count;
  p.predicts[last] = token;
}

// ---------------------------------------------------------------------------------------------
// Row units. A row of V floats is cut at 16-byte boundaries: unit 0 is the scalar head before the
// first boundary (0..3 elements), units 1..nq are aligned float4 quads, unit nq+1 is the scalar
// tail (0..3 elements). Every unit is loaded as 4 values; slots past the unit's end read as 0.
// ---------------------------------------------------------------------------------------------
struct RowUnits {
  int head;  // elements before the first 16-byte boundary
  int nq;    // aligned quads
  int V;
  __device__ __forceinline__ int count() const { return nq + 2; }
  __device__ __forceinline__ int start(int k) const {
    return k == 0 ? 0 : (k <= nq ? head + 4 * (k - 1) : head + 4 * nq);
  }
};

__device__ __forceinline__ RowUnits row_units(const float* row, int V) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(row);
  int head = static_cast<int>(((16ull - (a & 15ull)) & 15ull) >> 2);
  head = head < V ? head : V;
  return RowUnits{head, (V - head) >> 2, V};
}

// The aligned quad row[s .. s + 3] (row + s 16-byte aligned) in one 16-byte load.
template <bool READ_ONLY>
__device__ __forceinline__ void load_quad(const float* row, int s, float v[4]) {
  const float4* q = reinterpret_cast<const float4*>(row + s);
  const float4 x = READ_ONLY ? __ldg(q) : *q;
  v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
}

// Loads unit k of `row` into v[0..3]; returns the row index of v[0]. READ_ONLY uses the
// read-only data path; VEC says whether this row shares the 16-byte phase the units were cut for.
// INTERIOR: the caller knows that k is a quad (1 <= k <= nq), so no unit-kind branches.
template <bool READ_ONLY, bool INTERIOR = false>
__device__ __forceinline__ int load_unit(const float* row, const RowUnits& u, int k, bool vec, float v[4]) {
  if (INTERIOR) {
    const int s = u.head + 4 * (k - 1);
    if (vec) {
      load_quad<READ_ONLY>(row, s, v);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = READ_ONLY ? __ldg(row + s + j) : row[s + j];
    }
    return s;
  }
  const int s = u.start(k);
  if (k >= 1 && k <= u.nq && vec) {
    load_quad<READ_ONLY>(row, s, v);
    return s;
  }
  const int cnt = (k == 0) ? u.head : (k <= u.nq ? 4 : u.V - s);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = j < cnt ? (READ_ONLY ? __ldg(row + s + j) : row[s + j]) : 0.0f;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90 and later; elsewhere, and for a launch without the
// attribute, a no-op). Every kernel calls this first, before any access to global memory: wait until
// the grid before it on the stream has finished and its writes are visible, then allow the grid after
// it to start its blocks early (they wait in turn, so only the launch latency overlaps).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void follow_previous_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// Thread-block clusters (sm_90 and later; elsewhere every block is a cluster of one and these are
// never called with a larger one). Every thread of every block of the cluster must call arrive
// then wait, in pairs.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned cluster_blocks() {
#if __CUDA_ARCH__ >= 900
  return __clusterSizeInBlocks();
#else
  return 1;
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
#if __CUDA_ARCH__ >= 900
  return __clusterRelativeBlockRank();
#else
  return 0;
#endif
}

// Arrive without ordering memory (used where only "every block has started" matters).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
  __cluster_barrier_arrive_relaxed();
#endif
}

// Arrive with release semantics: this thread's earlier writes, shared memory of other blocks
// included, are visible to every thread of the cluster once its wait returns.
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
  __cluster_barrier_arrive();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
  __cluster_barrier_wait();
#endif
}

// The address of `local` (a shared-memory location of this block) in block `rank` of the cluster.
template <typename T>
__device__ __forceinline__ T* in_cluster_block(T* local, unsigned rank) {
#if __CUDA_ARCH__ >= 900
  return static_cast<T*>(__cluster_map_shared_rank(static_cast<void*>(local), rank));
#else
  return local;
#endif
}

// ---------------------------------------------------------------------------------------------
// Warp collectives over float, double or 64-bit integer lane values (fixed association orders, so
// results are bitwise reproducible; sums and maxima are butterflies: every lane gets the same bits).
// ---------------------------------------------------------------------------------------------
template <class T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}

__device__ __forceinline__ int warp_max(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

__device__ __forceinline__ int warp_min(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = min(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// Inclusive prefix sum over the lanes of a warp.
template <class T>
__device__ __forceinline__ T warp_inclusive_scan(T x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// Exclusive prefix of lane values from their inclusive prefix `incl` (lane 0 gets 0).
template <class T>
__device__ __forceinline__ T warp_exclusive_from(T incl) {
  const T prev = __shfl_up_sync(kFullMask, incl, 1);
  return (threadIdx.x & 31) == 0 ? T(0) : prev;
}

}  // namespace cupy_spec
