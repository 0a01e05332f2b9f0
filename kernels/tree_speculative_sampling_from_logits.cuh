// Tree speculative sampling from logits: target-only tree verification where the target rows are
// filter(softmax(logits / T)) (temperature, top-k, top-p on the top-k distribution, min-p), computed
// per visited row inside the kernel. No probability row is ever written.
//
// Launch: grid (bs, C), THREADS threads per block. The C blocks of request b (a thread-block cluster
// when C > 1, sm_90 only) split every row the walk visits into contiguous chunks of `chunk` entries;
// block rank c owns [c * chunk, min(V, (c + 1) * chunk)). Every block loads the tree and walks it
// redundantly (thread 0), so all blocks take the same decisions from the same cluster-wide values:
// partial results are exchanged through each block's own shared memory (double-buffered slots, read
// by the others through distributed shared memory after a cluster barrier) and always combined in
// rank order, so every block holds bit-identical results.
//
// Per visited row (all blocks together):
//   pass 1: max of the order-preserving keys of the logits with the first maximal index (the greedy
//           answer and the row max m), fused with the first top-k digit histogram;
//   top-k:  radix select of the k-th largest key, 8-bit digits, counts only (exact, ties kept);
//   top-p:  radix descent on the same keys with per-digit masses (weights in 64-bit fixed point,
//           integer atomics: order-independent), restricted to the top-k set; the crossing level is
//           a whole tie group;
//   min-p:  analytic (w >= min_p);
//   Z:      sum of the kept weights (double per thread, fixed reduction order).
// Weights are w = expf(float((double(x) - m) / T)) (subtract first, in double: no overflow, no loss).
// As soon as the cluster-wide count of tokens that can still be kept is at most LIST_CAP, every
// block compacts its chunk's candidates (index, key) into shared memory, sorts them by index, and
// all later passes over this row (remaining digits, Z, the final sample) run on that list.
// The final sample: per block segment sums of the residual (kept weights, rejected children of the
// final node removed) in index order, block totals exchanged in rank order, then the block holding
// u = coin * total finds the segment and the token (double precision prefix sums).
//
// Semantics: cupy_spec/reference/tree_speculative_sampling_from_logits.py (module docstring),
// walk rules of cupy_spec/reference/tree_speculative_sampling_target_only.py: links outside [0, n)
// mean none, a revisited node or a child whose token is outside [0, V) or whose retrive_index is
// outside [0, P) ends the walk; a root whose retrive_index is outside [0, P) writes only
// accept_index[b, 0] and accept_token_num[b] = 0.
#pragma once
#include "common.cuh"

namespace cupy_spec {

// TreeSpeculativeSamplingFromLogitsParams (pointers, dims, chunk, thresholds) and its constants
// (THREADS, LIST_CAP, SMEM_PER_NODE) are generated from cupy_spec/tree_speculative_sampling_from_logits.py.
using FromLogitsParams = TreeSpeculativeSamplingFromLogitsParams;

namespace from_logits {

typedef unsigned long long ull;

constexpr int THREADS = static_cast<int>(FromLogitsParams::THREADS);
constexpr int WARPS = THREADS / 32;
constexpr int CAP = static_cast<int>(FromLogitsParams::LIST_CAP);
constexpr int MAXSEG = THREADS;  // segments of a block's sequence in the final sample
constexpr unsigned KEY_NINF = 0x007fffffu;  // key of -inf (the smallest key of a cleaned logit)
constexpr unsigned KEY_PINF = 0xff800000u;  // key of +inf (the largest)
constexpr float FIX_SCALE = 549755813888.0f;  // 2^39: fixed-point weights; host limit V <= 2^23 (sums < 2^63, error V * 2^-40 < 1e-5)
constexpr int MODE_NORMAL = 0;  // finite max: w = exp((x - m) / T)
constexpr int MODE_INF = 1;     // some +inf logit: the +inf tokens share the mass
constexpr int MODE_ZERO = 2;    // every logit -inf (or NaN): all probabilities 0

static_assert(THREADS % 32 == 0 && THREADS >= 256, "the histograms take one bin per thread");
static_assert((CAP & (CAP - 1)) == 0, "the candidate list is sorted by a bitonic network");

// ---------------------------------------------------------------------------------------------
// Keys. A logit x (NaN -> -inf, -0 -> +0) maps to a uint32 key whose unsigned order is the order of
// x; every comparison of logits is a comparison of keys, never of (flushed) floats.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned key_of_bits(unsigned u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) u = 0xff800000u;  // NaN -> -inf
  if (u == 0x80000000u) u = 0u;                           // -0 -> +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float x_of_key(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// float32 bits of a raw element: DT 0 float32, 1 bfloat16, 2 float16 (exact conversions).
template <int DT>
__device__ __forceinline__ unsigned bits_of_raw(unsigned raw) {
  if constexpr (DT == 0) {
    return raw;
  } else if constexpr (DT == 1) {
    return raw << 16;
  } else {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
    const unsigned short h = static_cast<unsigned short>(raw);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return __float_as_uint(f);
#else  // the same conversion in integer arithmetic (for host builds of this header)
    const unsigned sign = (raw & 0x8000u) << 16, e = (raw >> 10) & 0x1fu;
    unsigned m = raw & 0x3ffu;
    if (e == 0x1fu) return sign | 0x7f800000u | (m << 13);
    if (e != 0u) return sign | ((e + 112u) << 23) | (m << 13);
    if (m == 0u) return sign;
    unsigned be = 113u;
    while (!(m & 0x400u)) {
      m <<= 1;
      --be;
    }
    return sign | (be << 23) | ((m & 0x3ffu) << 13);
#endif
  }
}

template <int DT>
__device__ __forceinline__ unsigned load_key(const void* row, int i) {
  if constexpr (DT == 0) {
    return key_of_bits(__ldg(static_cast<const unsigned*>(row) + i));
  } else {
    return key_of_bits(bits_of_raw<DT>(__ldg(static_cast<const unsigned short*>(row) + i)));
  }
}

// Keys of float16 / bfloat16 logits have their low 8 / 16 bits fixed by the sign: the radix
// descents stop at this shift.
template <int DT>
__device__ constexpr int last_shift() {
  return DT == 0 ? 0 : (DT == 1 ? 16 : 8);
}

// ---------------------------------------------------------------------------------------------
// Shared state
// ---------------------------------------------------------------------------------------------
struct Xchg {  // what a block publishes to its cluster (double-buffered)
  ull mass[256];
  unsigned cnt[256];
  ull u;
  double f;
};

struct Sel {  // a digit chosen by select_bucket
  int found, d;
  ull above_p, above_c;    // primary value and count of the bins above d (this round)
  ull bucket_p, bucket_c;  // of bin d
  ull tau;                 // the target used
};

struct Block {
  Xchg xg[2];
  ull cmass[256];  // combined histograms
  unsigned ccnt[256];
  double seg[MAXSEG];   // final sample: segment sums
  double sinc[MAXSEG];  // and their inclusive prefix
  ull wu[WARPS];
  double wd[WARPS];
  int wi[WARPS];
  Sel sel;
  int list_count;
  int cur, count, done, nrej, root_ok, root_index;
};

static_assert(sizeof(TreeNode) + 7 * sizeof(int) == FromLogitsParams::SMEM_PER_NODE,
              "Smem layout and host size differ");

struct Smem {  // dynamic shared memory: LIST_CAP * 8 + SMEM_PER_NODE * n bytes
  int* lidx;        // [CAP] candidate list: vocabulary index (sorted)
  unsigned* lkey;   // [CAP] and key
  TreeNode* node;   // [n]
  float* coin;      // [n] clamped coins
  unsigned* gkey;   // [n] key of node i's token in its guessed parent's row
  int* parent;      // [n] guessed parent
  int* seen;        // [n]
  int* path;        // [n] accepted nodes, root first
  int* rej;         // [n] tokens rejected at the current node
  int* rsort;       // [n] the same, sorted
};

__device__ __forceinline__ Smem carve(unsigned char* base, int n) {
  Smem s;
  s.lidx = reinterpret_cast<int*>(base);
  s.lkey = reinterpret_cast<unsigned*>(s.lidx + CAP);
  s.node = reinterpret_cast<TreeNode*>(s.lkey + CAP);
  s.coin = reinterpret_cast<float*>(s.node + n);
  s.gkey = reinterpret_cast<unsigned*>(s.coin + n);
  s.parent = reinterpret_cast<int*>(s.gkey + n);
  s.seen = s.parent + n;
  s.path = s.seen + n;
  s.rej = s.path + n;
  s.rsort = s.rej + n;
  return s;
}

// Per-request filter parameters, with off values mapped.
struct Req {
  int greedy;
  int topk_on, topp_on;
  ull k;
  float tp;     // top_p (when on)
  float minp;   // min(min_p, 1) when on, else 0
  double invT;  // 1 / T (0 for T = +inf)
};

// The state of the row being visited; every thread holds the same copy.
struct Row {
  const void* ptr;
  int lo, hi;  // this block's chunk
  int use_list, list_n;
  int mode;
  double m, invT;
  unsigned lam;  // kept: key >= lam
  float minp;    // and w >= minp (and w > 0)
  double Z;      // sum of the kept weights
  unsigned amax_key;
  int amax_idx;
};

// Weight of a token relative to the row max: 1 at the max, 0 for -inf.
__device__ __forceinline__ float weight(const Row& r, unsigned key) {
  if (r.mode == MODE_INF) return key == KEY_PINF ? 1.0f : 0.0f;
  if (key <= KEY_NINF) return 0.0f;
  const double d = static_cast<double>(x_of_key(key)) - r.m;
  return expf(static_cast<float>(d * r.invT));
}

__device__ __forceinline__ bool kept_weight(const Row& r, float w) { return w > 0.0f && w >= r.minp; }

__device__ __forceinline__ ull fixed_weight(float w) { return __float2ull_rn(w * FIX_SCALE); }

// ---------------------------------------------------------------------------------------------
// Iteration over a block's part of the row. The functor f(ok, idx, key) is called by every thread
// the same number of times (warp collectives inside are allowed); ok says whether (idx, key) is an
// element. The row is read with 16-byte loads, U of them in flight per thread.
// ---------------------------------------------------------------------------------------------
template <int DT, class F>
__device__ __forceinline__ void for_each_row(const void* row, int lo, int hi, F&& f) {
  constexpr int ES = DT == 0 ? 4 : 2;
  constexpr int VW = 16 / ES;
  constexpr int U = DT == 0 ? 4 : 2;
  const int len = hi - lo;
  if (len <= 0) return;
  const int tid = static_cast<int>(threadIdx.x);
  const unsigned long long a = reinterpret_cast<unsigned long long>(row) + static_cast<unsigned long long>(lo) * ES;
  int head = (a & (ES - 1)) ? len : static_cast<int>(((16ull - (a & 15ull)) & 15ull) / ES);
  head = head < len ? head : len;
  const int nv = (len - head) / VW;
  const int tail = len - head - nv * VW;
  const int scalars = head + tail;  // < 2 * VW unless the row is misaligned
  for (int j0 = 0; j0 < scalars; j0 += THREADS) {
    const int j = j0 + tid;
    const bool ok = j < scalars;
    const int idx = lo + (j < head ? j : head + nv * VW + (j - head));
    f(ok, idx, ok ? load_key<DT>(row, idx) : 0u);
  }
  const uint4* vp =
      reinterpret_cast<const uint4*>(static_cast<const char*>(row) + static_cast<long long>(lo + head) * ES);
  for (int v0 = 0; v0 < nv; v0 += THREADS * U) {
    uint4 q[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * THREADS + tid;
      q[u] = v < nv ? __ldg(vp + v) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * THREADS + tid;
      const bool ok = v < nv;
      const int idx0 = lo + head + v * VW;
      const unsigned w4[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
#pragma unroll
      for (int e = 0; e < VW; ++e) {
        const unsigned raw = DT == 0 ? w4[e] : ((w4[e >> 1] >> (16 * (e & 1))) & 0xffffu);
        f(ok, idx0 + e, key_of_bits(bits_of_raw<DT>(raw)));
      }
    }
  }
}

template <class F>
__device__ __forceinline__ void for_each_list(const int* lidx, const unsigned* lkey, int n, F&& f) {
  for (int j0 = 0; j0 < n; j0 += THREADS) {
    const int j = j0 + static_cast<int>(threadIdx.x);
    const bool ok = j < n;
    f(ok, ok ? lidx[j] : 0, ok ? lkey[j] : 0u);
  }
}

template <int DT, class F>
__device__ __forceinline__ void for_each(const Row& r, const Smem& s, F&& f) {
  if (r.use_list) {
    for_each_list(s.lidx, s.lkey, r.list_n, f);
  } else {
    for_each_row<DT>(r.ptr, r.lo, r.hi, f);
  }
}

// ---------------------------------------------------------------------------------------------
// Warp and block collectives (fixed association orders: bitwise reproducible)
// ---------------------------------------------------------------------------------------------
// Histogram insert by a whole warp: lanes with `part` add 1 to cnt[digit] and `mass` to ms[digit];
// lanes sharing a digit are combined first (a loop over the distinct digits of the warp), so one
// atomic per distinct digit.
__device__ __forceinline__ void hist_insert(bool part, unsigned digit, ull mass, unsigned* cnt, ull* ms) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  unsigned pending = __ballot_sync(kFullMask, part);
  while (pending) {
    const int leader = __ffs(pending) - 1;
    const unsigned d = __shfl_sync(kFullMask, digit, leader);
    const unsigned grp = __ballot_sync(kFullMask, part && digit == d);
    if (grp == (1u << leader)) {
      if (lane == leader) atomicAdd(ms + d, mass);
    } else {
      const ull sum = warp_sum(((grp >> lane) & 1u) ? mass : 0ull);
      if (lane == leader) atomicAdd(ms + d, sum);
    }
    if (lane == leader) atomicAdd(cnt + d, static_cast<unsigned>(__popc(grp)));
    pending &= ~grp;
  }
}

// Count-only histogram insert by a whole warp: one match groups the lanes by digit, the lowest
// lane of each group adds the group's size.
__device__ __forceinline__ void hist_count(bool part, unsigned digit, unsigned* cnt) {
  if (__ballot_sync(kFullMask, part) == 0u) return;
  const unsigned grp = __match_any_sync(kFullMask, part ? digit : 0xffffffffu);
  if (part && static_cast<int>(threadIdx.x & 31) == __ffs(grp) - 1) {
    atomicAdd(cnt + digit, static_cast<unsigned>(__popc(grp)));
  }
}

__device__ __forceinline__ ull block_max_u64(ull v, Block& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const ull y = __shfl_xor_sync(kFullMask, v, o);
    v = y > v ? y : v;
  }
  if (lane == 0) sh.wu[warp] = v;
  __syncthreads();
  ull r = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) r = sh.wu[w] > r ? sh.wu[w] : r;
  __syncthreads();
  return r;
}

__device__ __forceinline__ double block_sum_f64(double v, Block& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(kFullMask, v, o);
  if (lane == 0) sh.wd[warp] = v;
  __syncthreads();
  double r = 0.0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) r += sh.wd[w];
  __syncthreads();
  return r;
}

// Block-wide prefix sums of one value per thread (thread order): returns the inclusive sum and
// stores the exclusive one in *excl (computed the same way, so excl of thread t+1 == incl of t).
__device__ __forceinline__ double block_scan_f64(double v, double* excl, Block& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += y;
  }
  const double prev = __shfl_up_sync(kFullMask, v, 1);
  if (lane == 31) sh.wd[warp] = v;
  __syncthreads();
  double pre = 0.0;
  for (int w = 0; w < warp; ++w) pre += sh.wd[w];
  __syncthreads();
  *excl = lane == 0 ? pre : pre + prev;
  return pre + v;
}

__device__ __forceinline__ int block_min_int(int v, Block& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_min(v);
  if (lane == 0) sh.wi[warp] = v;
  __syncthreads();
  int r = kIntMax;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) r = min(r, sh.wi[w]);
  __syncthreads();
  return r;
}

__device__ __forceinline__ int block_max_int(int v, Block& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  if (lane == 0) sh.wi[warp] = v;
  __syncthreads();
  int r = -1;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) r = max(r, sh.wi[w]);
  __syncthreads();
  return r;
}

// ---------------------------------------------------------------------------------------------
// Cluster exchange. A block writes only its own slot xg[par]; after the barrier every block reads
// the slots of all ranks, in rank order. The next write to xg[par] comes two barriers later, after
// every reader has passed the barrier in between: double buffering needs no further barrier.
// ---------------------------------------------------------------------------------------------
struct Cluster {
  int C, rank;
  bool on;  // launched as a cluster of C > 1 blocks
};

__device__ __forceinline__ void cluster_sync(const Cluster& cl) {
  if (cl.on) {
    cluster_arrive();
    cluster_wait();
  } else {
    __syncthreads();
  }
}

__device__ __forceinline__ const Xchg* slot_of(Block& sh, int par, int r, const Cluster& cl) {
  Xchg* local = &sh.xg[par];
  return cl.on ? in_cluster_block(local, static_cast<unsigned>(r)) : local;
}

__device__ __forceinline__ void zero_hist(Xchg& x, bool with_mass) {
  for (int t = threadIdx.x; t < 256; t += THREADS) {
    x.cnt[t] = 0u;
    if (with_mass) x.mass[t] = 0ull;
  }
  __syncthreads();
}

// Sums the histograms of slot `par` over the cluster into sh.ccnt / sh.cmass.
__device__ __forceinline__ void combine_hist(Block& sh, int par, const Cluster& cl, bool with_mass) {
  cluster_sync(cl);
  for (int t = threadIdx.x; t < 256; t += THREADS) {
    unsigned c = 0u;
    ull m = 0ull;
    for (int r = 0; r < cl.C; ++r) {
      const Xchg* x = slot_of(sh, par, r, cl);
      c += x->cnt[t];
      if (with_mass) m += x->mass[t];
    }
    sh.ccnt[t] = c;
    sh.cmass[t] = m;
  }
  __syncthreads();
}

// Warp 0: walking the 256 combined bins from the top digit down, the first nonzero bin d where
// A + (primary mass of bins >= d) reaches tau. With from_total, tau = ceil(frac * total) (frac <= 0:
// 0, i.e. the top nonzero bin), clamped to the total. Writes sh.sel.
__device__ __forceinline__ void select_bucket(Block& sh, bool mass_primary, ull A, ull tau, bool from_total,
                                              float frac) {
  const int lane = threadIdx.x & 31;
  ull vp[8], vc[8];
  ull sp = 0ull, sc = 0ull;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = 255 - 8 * lane - i;
    vc[i] = sh.ccnt[d];
    vp[i] = mass_primary ? sh.cmass[d] : vc[i];
    sp += vp[i];
    sc += vc[i];
  }
  ull ip = sp, ic = sc;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const ull y = __shfl_up_sync(kFullMask, ip, o), z = __shfl_up_sync(kFullMask, ic, o);
    if (lane >= o) {
      ip += y;
      ic += z;
    }
  }
  const ull total = __shfl_sync(kFullMask, ip, 31);
  if (from_total) {
    tau = 0ull;
    if (frac > 0.0f) {
      const double t = ceil(static_cast<double>(frac) * static_cast<double>(total));
      tau = t >= static_cast<double>(total) ? total : static_cast<ull>(t);
    }
  }
  if (lane == 0) {
    sh.sel.found = 0;
    sh.sel.tau = tau;
  }
  __syncwarp();
  const bool cross = sp > 0ull && A + ip >= tau;
  const unsigned m = __ballot_sync(kFullMask, cross);
  if (m == 0u) return;
  const int L = __ffs(m) - 1;
  if (lane == L) {
    ull run = ip - sp, runc = ic - sc;
    int d = -1;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (d < 0 && vp[i] > 0ull && A + run + vp[i] >= tau) {
        d = 255 - 8 * L - i;
        sh.sel.above_p = run;
        sh.sel.above_c = runc;
        sh.sel.bucket_p = vp[i];
        sh.sel.bucket_c = vc[i];
      }
      run += vp[i];
      runc += vc[i];
    }
    sh.sel.d = d;
    sh.sel.found = d >= 0;
  }
}

// ---------------------------------------------------------------------------------------------
// Candidate list: the block's chunk entries with key >= B, sorted by index.
// ---------------------------------------------------------------------------------------------
template <int DT>
__device__ void compact(Row& r, const Smem& s, Block& sh, unsigned B) {
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) sh.list_count = 0;
  __syncthreads();
  for_each_row<DT>(r.ptr, r.lo, r.hi, [&](bool ok, int idx, unsigned key) {
    const bool take = ok && key >= B;
    const unsigned m = __ballot_sync(kFullMask, take);
    if (m != 0u) {
      int base = 0;
      if (lane == 0) base = atomicAdd(&sh.list_count, __popc(m));
      base = __shfl_sync(kFullMask, base, 0);
      if (take) {
        const int pos = base + __popc(m & ((1u << lane) - 1u));
        if (pos < CAP) {
          s.lidx[pos] = idx;
          s.lkey[pos] = key;
        }
      }
    }
  });
  __syncthreads();
  const int n = min(sh.list_count, CAP);
  int N = 1;
  while (N < n) N <<= 1;
  for (int i = n + static_cast<int>(threadIdx.x); i < N; i += THREADS) {
    s.lidx[i] = kIntMax;
    s.lkey[i] = 0u;
  }
  __syncthreads();
  // Bitonic sort of N entries by index (indices are distinct: the order is unique).
  for (int k = 2; k <= N; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < N; i += THREADS) {
        const int o = i ^ j;
        if (o > i) {
          const int a = s.lidx[i], b = s.lidx[o];
          const bool up = (i & k) == 0;
          if ((a > b) == up) {
            s.lidx[i] = b;
            s.lidx[o] = a;
            const unsigned t = s.lkey[i];
            s.lkey[i] = s.lkey[o];
            s.lkey[o] = t;
          }
        }
      }
      __syncthreads();
    }
  }
  r.use_list = 1;
  r.list_n = n;
}

// ---------------------------------------------------------------------------------------------
// Row statistics: everything the walk and the final sample need about one row.
// ---------------------------------------------------------------------------------------------
template <int DT>
__device__ void row_stats(const Req& q, Row& r, const Smem& s, Block& sh, int& par, const Cluster& cl) {
  constexpr int LAST = last_shift<DT>();
  const int tid = threadIdx.x;
  r.use_list = 0;
  r.list_n = 0;
  r.mode = MODE_NORMAL;
  r.lam = 0u;
  r.minp = 0.0f;
  r.Z = 0.0;
  r.m = 0.0;
  r.invT = q.invT;

  // Pass 1: max key with its first index; the first top-k digit histogram.
  const bool hist1 = !q.greedy && q.topk_on;
  {
    Xchg& X = sh.xg[par];
    if (hist1) zero_hist(X, false);
    ull best = 0ull;
    for_each_row<DT>(r.ptr, r.lo, r.hi, [&](bool ok, int idx, unsigned key) {
      if (ok) {
        const ull pk = (static_cast<ull>(key) << 32) | static_cast<ull>(0xffffffffu - static_cast<unsigned>(idx));
        best = pk > best ? pk : best;
      }
      if (hist1) hist_count(ok, key >> 24, X.cnt);
    });
    best = block_max_u64(best, sh);
    if (tid == 0) X.u = best;
    if (hist1) {
      combine_hist(sh, par, cl, false);
    } else {
      cluster_sync(cl);
    }
    best = 0ull;
    for (int rk = 0; rk < cl.C; ++rk) {
      const ull v = slot_of(sh, par, rk, cl)->u;
      best = v > best ? v : best;
    }
    par ^= 1;
    r.amax_key = static_cast<unsigned>(best >> 32);
    r.amax_idx = static_cast<int>(0xffffffffu - static_cast<unsigned>(best & 0xffffffffull));
  }
  if (q.greedy) return;
  if (r.amax_key <= KEY_NINF) {
    r.mode = MODE_ZERO;
    return;
  }
  if (r.amax_key == KEY_PINF) {
    r.mode = MODE_INF;  // filters cannot remove a +inf token: the +inf tokens are the kept set
    r.lam = KEY_PINF;
  } else {
    r.m = static_cast<double>(x_of_key(r.amax_key));
    // Top-k: the k-th largest key (its bucket's lower bound once the bucket holds exactly the
    // missing ranks: the same kept set).
    unsigned lamk = 0u;
    if (q.topk_on) {
      ull A = 0ull;
      unsigned P = 0u;
      int shift = 24;
      while (true) {
        if (tid < 32) select_bucket(sh, false, A, q.k, false, 0.0f);
        __syncthreads();
        const Sel sel = sh.sel;
        if (!sel.found) break;  // (cannot happen: 0 < k < V)
        const unsigned P2 = (P << 8) | static_cast<unsigned>(sel.d);
        const unsigned B = P2 << shift;
        const ull ge = A + sel.above_c + sel.bucket_c;  // tokens with key >= B
        const bool resolved = ge == q.k || shift == LAST;
        if (!r.use_list && ge <= static_cast<ull>(CAP)) compact<DT>(r, s, sh, B);
        if (resolved) {
          lamk = B;
          break;
        }
        A += sel.above_c;
        P = P2;
        shift -= 8;
        Xchg& Y = sh.xg[par];
        zero_hist(Y, false);
        for_each<DT>(r, s, [&](bool ok, int idx, unsigned key) {
          hist_count(ok && (key >> (shift + 8)) == P, (key >> shift) & 255u, Y.cnt);
        });
        combine_hist(sh, par, cl, false);
        par ^= 1;
      }
    }
    // Top-p on the top-k distribution: the largest key level whose mass from the top reaches
    // top_p of the top-k mass.
    unsigned lamp = 0u;
    if (q.topp_on) {
      ull A = 0ull, Ac = 0ull, tau = 0ull;
      unsigned P = 0u;
      int shift = 24;
      while (true) {
        Xchg& Y = sh.xg[par];
        zero_hist(Y, true);
        for_each<DT>(r, s, [&](bool ok, int idx, unsigned key) {
          const bool part = ok && key >= lamk && (shift == 24 || (key >> (shift + 8)) == P);
          const ull mass = part ? fixed_weight(weight(r, key)) : 0ull;
          hist_insert(part, (key >> shift) & 255u, mass, Y.cnt, Y.mass);
        });
        combine_hist(sh, par, cl, true);
        par ^= 1;
        if (tid < 32) select_bucket(sh, true, A, tau, shift == 24, q.tp);
        __syncthreads();
        const Sel sel = sh.sel;
        if (shift == 24) tau = sel.tau;
        if (!sel.found) break;  // (cannot happen: tau <= the top-k mass)
        const unsigned P2 = (P << 8) | static_cast<unsigned>(sel.d);
        const unsigned B = P2 << shift;
        const ull ge = Ac + sel.above_c + sel.bucket_c;  // tokens of the top-k set with key >= B
        const bool done = shift == LAST || sel.bucket_c == 1ull;
        if (!r.use_list && ge <= static_cast<ull>(CAP)) compact<DT>(r, s, sh, B > lamk ? B : lamk);
        if (done) {
          lamp = B;
          break;
        }
        A += sel.above_p;
        Ac += sel.above_c;
        P = P2;
        shift -= 8;
      }
    }
    r.lam = lamk > lamp ? lamk : lamp;
    r.minp = q.minp;
  }

  // Z: the kept mass.
  double z = 0.0;
  for_each<DT>(r, s, [&](bool ok, int idx, unsigned key) {
    if (ok && key >= r.lam) {
      const float w = weight(r, key);
      if (kept_weight(r, w)) z += static_cast<double>(w);
    }
  });
  z = block_sum_f64(z, sh);
  if (tid == 0) sh.xg[par].f = z;
  cluster_sync(cl);
  double Z = 0.0;
  for (int rk = 0; rk < cl.C; ++rk) Z += slot_of(sh, par, rk, cl)->f;
  par ^= 1;
  r.Z = Z;
  if (!(Z > 0.0)) r.mode = MODE_ZERO;  // (cannot happen: the max token is kept with w = 1)
}

// Probability of a child's token in the current row, as the walk reads it.
__device__ __forceinline__ float child_prob(const Req& q, const Row& r, int token, unsigned key) {
  if (q.greedy) return token == r.amax_idx ? 1.0f : 0.0f;
  if (r.mode == MODE_ZERO || key < r.lam) return 0.0f;
  const float w = weight(r, key);
  if (!kept_weight(r, w)) return 0.0f;
  return effective_prob(static_cast<float>(static_cast<double>(w) / r.Z));
}

__device__ __forceinline__ bool in_sorted(const int* a, int n, int x) {
  if (n == 0 || x < a[0] || x > a[n - 1]) return false;
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo < n && a[lo] == x;
}

// The final sample over the residual (kept weights, rejected children removed). Returns the token
// in the block that holds it (*writer = true there), -1 elsewhere. Every block of the cluster calls it.
template <int DT>
__device__ int final_sample(const Row& r, const Smem& s, Block& sh, int& par, const Cluster& cl, int nrej, float coin,
                            int V, bool* writer) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int* rs = s.rsort;
  auto resid = [&](int idx, unsigned key) -> float {
    if (key < r.lam) return 0.0f;
    const float w = weight(r, key);
    if (!kept_weight(r, w)) return 0.0f;
    return in_sorted(rs, nrej, idx) ? 0.0f : w;
  };
  auto seq = [&](int j, int* idx) -> unsigned {
    if (r.use_list) {
      *idx = s.lidx[j];
      return s.lkey[j];
    }
    *idx = r.lo + j;
    return load_key<DT>(r.ptr, *idx);
  };
  const int len = r.use_list ? r.list_n : (r.hi > r.lo ? r.hi - r.lo : 0);
  int seg_len = (len + MAXSEG - 1) / MAXSEG;
  seg_len = max(32, (seg_len + 31) & ~31);
  const int nseg = (len + seg_len - 1) / seg_len;

  // Segment sums: warp w sums segments w, w + WARPS, ... (lanes take consecutive entries).
  for (int sg = warp; sg < nseg; sg += WARPS) {
    double a = 0.0;
    for (int i = lane; i < seg_len; i += 32) {
      const int j = sg * seg_len + i;
      if (j < len) {
        int idx;
        const unsigned key = seq(j, &idx);
        a += static_cast<double>(resid(idx, key));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a += __shfl_down_sync(kFullMask, a, o);
    if (lane == 0) sh.seg[sg] = a;
  }
  __syncthreads();
  double ex;
  const double inc = block_scan_f64(tid < nseg ? sh.seg[tid] : 0.0, &ex, sh);
  if (tid < nseg) sh.sinc[tid] = inc;
  __syncthreads();
  const double mine = nseg > 0 ? sh.sinc[nseg - 1] : 0.0;
  if (tid == 0) sh.xg[par].f = mine;
  cluster_sync(cl);
  double total = 0.0;
  for (int rk = 0; rk < cl.C; ++rk) total += slot_of(sh, par, rk, cl)->f;
  const double u = static_cast<double>(coin) * total;
  int rt = -1, lastr = -1;
  double base = 0.0, base_last = 0.0, acc = 0.0;
  for (int rk = 0; rk < cl.C; ++rk) {
    const double R = slot_of(sh, par, rk, cl)->f;
    if (R > 0.0) {
      if (rt < 0 && acc + R > u) {
        rt = rk;
        base = acc;
      }
      lastr = rk;
      base_last = acc;
    }
    acc += R;
  }
  par ^= 1;
  if (!(total > 0.0)) {  // nothing left to sample: V - 1
    *writer = cl.rank == 0;
    return V - 1;
  }
  bool fallback = false;
  if (rt < 0) {  // (rounding only) the last positive entry
    rt = lastr;
    base = base_last;
    fallback = true;
  }
  *writer = cl.rank == rt;
  if (cl.rank != rt) return -1;

  // The segment holding u (first crossing), or the last positive segment.
  int sg;
  if (!fallback) {
    sg = block_min_int((tid < nseg && sh.seg[tid] > 0.0 && base + sh.sinc[tid] > u) ? tid : kIntMax, sh);
    if (sg == kIntMax) fallback = true;
  }
  if (fallback) sg = block_max_int((tid < nseg && sh.seg[tid] > 0.0) ? tid : -1, sh);
  if (sg < 0 || sg >= nseg) return V - 1;

  // Inside the segment: contiguous runs per thread, block prefix of the run sums, then each thread
  // finds the first crossing in its run.
  const int jb = sg * seg_len;
  const int je = min(len, jb + seg_len);
  const int L = (je - jb + THREADS - 1) / THREADS;
  const int j0 = min(je, jb + tid * L), j1 = min(je, j0 + L);
  double rsum = 0.0;
  for (int j = j0; j < j1; ++j) {
    int idx;
    const unsigned key = seq(j, &idx);
    rsum += static_cast<double>(resid(idx, key));
  }
  double rex;
  block_scan_f64(rsum, &rex, sh);
  double pos = base + (sg > 0 ? sh.sinc[sg - 1] : 0.0) + rex;
  int hit = kIntMax, lastp = -1;
  for (int j = j0; j < j1; ++j) {
    int idx;
    const unsigned key = seq(j, &idx);
    const float w = resid(idx, key);
    if (w > 0.0f) {
      lastp = idx;
      if (!fallback && hit == kIntMax && pos + static_cast<double>(w) > u) hit = idx;
      pos += static_cast<double>(w);
    }
  }
  hit = block_min_int(hit, sh);
  lastp = block_max_int(lastp, sh);
  if (hit != kIntMax) return hit;
  return lastp >= 0 ? lastp : V - 1;
}

}  // namespace from_logits

template <int DT>
__global__ void __launch_bounds__(FromLogitsParams::THREADS, FromLogitsParams::BLOCKS_PER_SM)
    tree_speculative_sampling_from_logits_kernel(const FromLogitsParams p) {
  follow_previous_grid();  // first: before any global memory access
  using namespace from_logits;
  constexpr int ES = DT == 0 ? 4 : 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ Block sh;
  __shared__ Req req;
  const int tid = threadIdx.x;
  const long long b = blockIdx.x;
  const int n = static_cast<int>(p.n);
  const int V = static_cast<int>(p.V);
  const Smem s = carve(smem_raw, n);
  Cluster cl;
  cl.C = static_cast<int>(gridDim.y);
  cl.rank = static_cast<int>(blockIdx.y);
  cl.on = cl.C > 1;
  const int chunk = static_cast<int>(p.chunk);
  const int lo = min(V, cl.rank * chunk), hi = min(V, lo + chunk);
  const char* logits = static_cast<const char*>(p.target_logits);
  const long long row_bytes = p.V * ES;

  // ---- the tree, the request's parameters, and every node's token key in its parent's row
  if (tid == 0) {
    const float T = p.temperatures[b];
    req.greedy = !(T >= 1e-6f);
    const long long k = p.top_ks != nullptr ? static_cast<long long>(p.top_ks[b]) : 0ll;
    req.topk_on = k > 0 && k < p.V;
    req.k = req.topk_on ? static_cast<ull>(k) : 0ull;
    const float tp = p.top_ps != nullptr ? p.top_ps[b] : 1.0f;
    req.topp_on = tp < 1.0f;
    req.tp = tp;
    const float mp = p.min_ps != nullptr ? p.min_ps[b] : 0.0f;
    req.minp = mp > 0.0f ? fminf(mp, 1.0f) : 0.0f;
    req.invT = 1.0 / static_cast<double>(T);
    const long long r0 = p.retrive_index[b * p.n];
    sh.root_index = static_cast<int>(r0);
    sh.root_ok = r0 >= 0 && r0 < p.P;
  }
  for (int i = tid; i < n; i += THREADS) {
    const long long g = b * p.n + i;
    const long long t = p.candidates[g], ri = p.retrive_index[g];
    s.node[i] = TreeNode{(t >= 0 && t < p.V) ? static_cast<int>(t) : -1,
                         (ri >= 0 && ri < p.P) ? static_cast<int>(ri) : -1, link(p.retrive_next_token[g], p.n),
                         link(p.retrive_next_sibling[g], p.n)};
    s.coin[i] = clamp_coin(p.uniform_samples[g]);
    s.parent[i] = -1;
    s.seen[i] = 0;
  }
  __syncthreads();
  for (int i = tid; i < n; i += THREADS) {  // node i claims its children (at most n steps: cycles end)
    int c = s.node[i].child;
    for (int steps = 0; c >= 0 && steps < n; ++steps) {
      atomicMax(&s.parent[c], i);
      c = s.node[c].sibling;
    }
  }
  __syncthreads();
  for (int c = tid; c < n; c += THREADS) {
    const int par = s.parent[c], tok = s.node[c].token;
    s.gkey[c] = (par >= 0 && tok >= 0) ? load_key<DT>(logits + (b * p.n + par) * row_bytes, tok) : 0u;
  }
  __syncthreads();
  const Req q = req;

  int par = 0;
  int token = -1;
  bool writer = cl.rank == 0;
  if (sh.root_ok) {
    const float thr_single = static_cast<float>(p.threshold_single);
    const float thr_acc = fmaxf(static_cast<float>(p.threshold_acc), 1e-9f);
    if (tid == 0) {
      sh.cur = 0;
      sh.count = 0;
      sh.done = 0;
      sh.nrej = 0;
      s.seen[0] = 1;
      s.path[0] = 0;
    }
    __syncthreads();
    Row r;
    r.lo = lo;
    r.hi = hi;
    while (true) {
      const int cur = sh.cur;
      r.ptr = logits + (b * p.n + cur) * row_bytes;
      row_stats<DT>(q, r, s, sh, par, cl);
      // The walk among cur's children (thread 0 of every block, identical decisions).
      if (tid == 0) {
        int count = sh.count, nrej = 0, next = -1;
        const float coin = s.coin[cur];
        float acc = 0.0f;
        int c = count < p.S - 1 ? s.node[cur].child : -1;
        while (c >= 0 && !s.seen[c]) {
          s.seen[c] = 1;
          const TreeNode nd = s.node[c];
          if (nd.token < 0 || nd.index < 0) break;  // malformed child ends the walk
          const unsigned key = s.parent[c] == cur ? s.gkey[c] : load_key<DT>(r.ptr, nd.token);
          const float pr = child_prob(q, r, nd.token, key);
          acc = acc + pr;
          if (pr > 0.0f && (coin < __fdiv_rn(acc, thr_acc) || pr >= thr_single)) {
            next = c;
            break;
          }
          s.rej[nrej++] = nd.token;
          c = nd.sibling;
        }
        if (next >= 0) {
          s.path[++count] = next;
          sh.cur = next;
          sh.count = count;
        } else {
          sh.done = 1;
          sh.nrej = nrej;
        }
      }
      __syncthreads();
      if (sh.done) break;
    }
    // The final token at the last node.
    const int nrej = sh.nrej;
    if (q.greedy) {
      token = r.amax_idx;
    } else if (r.mode == MODE_ZERO) {
      token = V - 1;
    } else {
      for (int i = tid; i < nrej; i += THREADS) {  // rejected tokens sorted (rank of each; ties by position)
        const int t = s.rej[i];
        int rank = 0;
        for (int j = 0; j < nrej; ++j) {
          const int o = s.rej[j];
          rank += (o < t) || (o == t && j < i);
        }
        s.rsort[rank] = t;
      }
      __syncthreads();
      token = final_sample<DT>(r, s, sh, par, cl, nrej, clamp_coin(p.uniform_samples_for_final_sampling[b]), V,
                               &writer);
    }
  }

  // ---- outputs (one thread of one block), in the order the reference writes them
  if (writer && tid == 0) write_tree_outputs(p, s, sh, b, token, [] {});
  // No block leaves while another may still read its shared memory.
  if (cl.on) {
    cluster_arrive();
    cluster_wait();
  }
}

}  // namespace cupy_spec
