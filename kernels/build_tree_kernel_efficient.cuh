// Draft tree from an EAGLE drafter's choices: parents, "retrive" links, positions, attention mask.
//
// Launch: grid (bs, C), BLOCK threads per block (a multiple of 32), MODE = tree_mask_mode as a
// template argument. The C blocks of request b (C > 1 only in FULL_MASK, see the plan in
// cupy_spec/build_tree_kernel_efficient.py) each rebuild b's tree in shared memory and fill an
// interleaved share of the mask region; block (b, 0) alone writes positions and the retrive_* links.
// Dynamic shared memory: n * (8 + 4 + 4 * ceil(n / 32)) bytes (selected indices, parents, one bitset
// row per node: its children, then its mask row); static: the first PARENT_CACHE entries of the
// request's parent_list.
//
// Semantics are those of cupy_spec/reference/build_tree_kernel_efficient.py (rules 1-6 of its
// docstring), bit for bit: orphans, out-of-range indices, verified_seq_len clamped into
// [0, 2^31 - 1], and a request whose whole mask region does not fit in tree_mask writes no mask
// entry. Offsets into the outputs are 64-bit; the host guarantees bs * n < 2^31 (positions' size),
// which bounds every mask offset below 2^63 (see step 5). Within a mask row, rows and columns are
// 32-bit (a row has at most 2^31 - 1 + n columns).
#pragma once
#include "common.cuh"

namespace cupy_spec {

// BuildTreeKernelEfficientParams and its constants are generated from the argument table in
// cupy_spec/build_tree_kernel_efficient.py.
using BuildTreeParams = BuildTreeKernelEfficientParams;

// verified_seq_len as the op reads it: clamped into [0, 2^31 - 1].
__device__ __forceinline__ long long clamp_seq_len(long long s) {
  return s < 0 ? 0 : (s > kIntMax ? static_cast<long long>(kIntMax) : s);
}

__device__ __forceinline__ long long warp_sum_ll(long long x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}

// Byte k of a bool mask region of n rows of `width` = `prefix` + n entries: 1 in the first `prefix`
// entries of a row (the verified tokens), then the row's n draft columns (bit c of its bitset).
__device__ __forceinline__ unsigned char region_byte(const unsigned* rows, int words, long long width,
                                                     long long prefix, long long k) {
  const long long r = k / width, c = k - r * width;
  if (c < prefix) return 1;
  const long long d = c - prefix;
  return static_cast<unsigned char>((rows[r * words + (d >> 5)] >> (d & 31)) & 1u);
}

// 32 draft columns of row r from column c0 on (bit j = column c0 + j; 0 past the row's words).
__device__ __forceinline__ unsigned row_bits(const unsigned* rows, unsigned words, unsigned r, unsigned c0) {
  const unsigned* row = rows + r * words;
  const unsigned w = c0 >> 5;
  const unsigned lo = w < words ? row[w] : 0u, hi = w + 1 < words ? row[w + 1] : 0u;
  return __funnelshift_r(lo, hi, c0 & 31);
}

// The 16 mask bytes from (row r, column c) on as 16 bits (bit j = byte j), rows of `width` columns;
// every value fits in 32 bits (width <= 2^31 - 1 + n).
__device__ __forceinline__ unsigned run_bits(const unsigned* rows, unsigned words, unsigned width, unsigned prefix,
                                             unsigned r, unsigned c) {
  unsigned bits = 0;
  for (unsigned j = 0; j < 16; c = 0, ++r) {  // one row's share of the run per step
    const unsigned len = min(16u - j, width - c);
    const unsigned ones = c < prefix ? min(len, prefix - c) : 0u;  // verified-prefix columns
    const unsigned drafts = len - ones;
    bits |= ((1u << ones) - 1u) << j;
    if (drafts) bits |= (row_bits(rows, words, r, c + ones - prefix) & ((1u << drafts) - 1u)) << (j + ones);
    j += len;
  }
  return bits;
}

// 16 bytes, byte j = bit j of `bits`: x * 0x00204081 puts bits 0..3 of x at bits 0, 8, 16, 24.
__device__ __forceinline__ uint4 spread16(unsigned bits) {
  uint4 v;
  v.x = ((bits & 15u) * 0x00204081u) & 0x01010101u;
  v.y = (((bits >> 4) & 15u) * 0x00204081u) & 0x01010101u;
  v.z = (((bits >> 8) & 15u) * 0x00204081u) & 0x01010101u;
  v.w = (((bits >> 12) & 15u) * 0x00204081u) & 0x01010101u;
  return v;
}

// Fills a bool region R[0, Z) (Z = width * n bytes) with the request's C * BLOCK threads: the bytes
// before the first 16-byte boundary and after the last one singly, the aligned middle in 16-byte
// stores. Thread t (0 <= t < lanes) takes the 16-byte runs t, t + lanes, ...; it finds the (row,
// column) of its first byte with one 32-bit division (its offset is below 16 * (lanes + 1)) and
// steps by lanes * 16 bytes = (drow rows, dcol columns) after that.
__device__ __forceinline__ void fill_bool_region(unsigned char* R, long long Z, long long width, long long prefix,
                                                 const unsigned* rows, int words, long long t, long long lanes) {
  const unsigned misalign = static_cast<unsigned>(reinterpret_cast<unsigned long long>(R) & 15ull);
  const long long head = min(Z, static_cast<long long>((16u - misalign) & 15u));
  const long long runs = (Z - head) >> 4;
  const long long tail = head + (runs << 4);  // Z - tail < 16, head < 16 <= lanes
  if (t < head) R[t] = region_byte(rows, words, width, prefix, t);
  if (tail + t < Z) R[tail + t] = region_byte(rows, words, width, prefix, tail + t);
  if (t >= runs) return;
  const unsigned W = static_cast<unsigned>(width), pre = static_cast<unsigned>(prefix);
  const unsigned first = static_cast<unsigned>(head + 16 * t), step = static_cast<unsigned>(16 * lanes);
  unsigned r = first / W, c = first - r * W;
  const unsigned drow = step / W, dcol = step - drow * W;
  const uint4 ones = spread16(0xffffu);
  for (long long q = t; q < runs; q += lanes) {
    const uint4 v = c + 16 <= pre ? ones : spread16(run_bits(rows, words, W, pre, r, c));
    *reinterpret_cast<uint4*>(R + head + 16 * q) = v;
    r += drow;  // next run: lanes * 16 bytes further
    c += dcol;
    if (c >= W) {  // dcol < W, so one wrap at most
      c -= W;
      ++r;
    }
  }
}

// x / k for x >= 0, k >= 1, in 32 bits when both fit.
__device__ __forceinline__ long long div_nonneg(long long x, long long k) {
  return ((x | k) >> 32) == 0 ? static_cast<long long>(static_cast<unsigned>(x) / static_cast<unsigned>(k)) : x / k;
}

// Smallest j < hi with key[j] == value, -1 if none; `sorted`: key[0, hi) is non-decreasing.
__device__ __forceinline__ int first_equal(const long long* key, long long value, int hi, bool sorted) {
  if (sorted) {  // lower bound: the first j with key[j] >= value
    int lo = 0, len = hi;
    while (len > 0) {
      const int half = len >> 1;
      if (key[lo + half] < value) {
        lo += half + 1;
        len -= half + 1;
      } else {
        len = half;
      }
    }
    return lo < hi && key[lo] == value ? lo : -1;
  }
  for (int j = 0; j < hi; ++j) {
    if (key[j] == value) return j;
  }
  return -1;
}

// First set bit at index >= from of a bitset of `words` words, -1 if none.
__device__ __forceinline__ int first_bit(const unsigned* set, int words, int from) {
  for (int w = from >> 5; w < words; ++w) {
    const unsigned x = set[w] & (w == (from >> 5) ? ~0u << (from & 31) : ~0u);
    if (x) return (w << 5) + __ffs(x) - 1;
  }
  return -1;
}

// Ancestor sets of trees of n <= 64 nodes by pointer doubling in one warp (node i = lane + 32 s in
// slot s). Invariant: A(i) = the path from i up to, not including, J(i), the next node to add (-1 when
// the walk has ended: before the root, after an orphan); each round A(i) |= A(J(i)), J(i) = J(J(i)),
// so after ceil(log2 n) rounds A(i) = path(i). Writes the mask bitset rows ({0} + path(i)) and returns
// in d[s] the depth |path(i)| of the warp's nodes.
__device__ __forceinline__ void paths_small(const int* parent, unsigned* rows, int n, int words, int d[2]) {
  const int lane = threadIdx.x & 31;
  unsigned long long A[2];
  int J[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int i = lane + 32 * s;
    const bool node = i > 0 && i < n;
    A[s] = node ? 1ull << i : 0ull;
    J[s] = node && parent[i] > 0 ? parent[i] : -1;
  }
  if (n <= 32) {  // one node per lane: 32-bit sets, slot 1 empty
    unsigned a = static_cast<unsigned>(A[0]);
    for (int span = 1; span < n; span <<= 1) {
      const unsigned up = __shfl_sync(kFullMask, a, J[0] & 31);
      const int jj = __shfl_sync(kFullMask, J[0], J[0] & 31);
      if (J[0] >= 0) {
        a |= up;
        J[0] = jj;
      }
    }
    A[0] = a;
  }
  for (int span = 1; n > 32 && span < n; span <<= 1) {
    unsigned long long a[2][2];
    int j[2][2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {  // read every node's (A, J) before any lane updates its own
      const int src = J[s] & 31;
      a[s][0] = __shfl_sync(kFullMask, A[0], src);
      a[s][1] = __shfl_sync(kFullMask, A[1], src);
      j[s][0] = __shfl_sync(kFullMask, J[0], src);
      j[s][1] = __shfl_sync(kFullMask, J[1], src);
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (J[s] >= 0) {
        const bool hi = J[s] >= 32;
        A[s] |= hi ? a[s][1] : a[s][0];
        J[s] = hi ? j[s][1] : j[s][0];
      }
    }
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int i = lane + 32 * s;
    if (i < n) {
      rows[i * words] = static_cast<unsigned>(A[s]) | 1u;  // the root column
      if (words > 1) rows[i * words + 1] = static_cast<unsigned>(A[s] >> 32);
    }
    d[s] = __popcll(A[s]);
  }
}

// The same for any n, one thread per node walking up.
__device__ __forceinline__ int path_walk(const int* parent, unsigned* rows, int words, int i) {
  unsigned* row = rows + static_cast<long long>(i) * words;
  for (int w = 0; w < words; ++w) row[w] = 0u;
  row[0] = 1u;
  int d = 0;
  for (int c = i; c > 0;) {  // stop before the root or after an orphan
    row[c >> 5] |= 1u << (c & 31);
    ++d;
    const int up = parent[c];
    if (up < 0) break;
    c = up;
  }
  return d;
}

template <int MODE>
__global__ void __launch_bounds__(BuildTreeParams::MAX_THREADS)
    build_tree_kernel_efficient_kernel(const BuildTreeParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ long long s_before_shared;  // FULL_MASK: sum of s_j over j < b
  __shared__ long long plist[BuildTreeParams::PARENT_CACHE];  // parent_list[b, 0 .. PARENT_CACHE)
  const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31, warp = tid >> 5, warps = T >> 5;
  const long long b = blockIdx.x;
  const int n = static_cast<int>(p.n);
  const int words = (n + 31) >> 5;
  long long* sel = reinterpret_cast<long long*>(smem_raw);  // [n] selected flat indices of request b
  int* parent = reinterpret_cast<int*>(sel + n);            // [n] parent node, -1 for the root and orphans
  unsigned* rows = reinterpret_cast<unsigned*>(parent + n);  // [n][words] children sets, then mask rows

  // ---- 1. selected indices and the start of parent_list into shared memory (one round of loads);
  //         whether sel is sorted; s_b ---------------------------------------------------------
  const long long m = p.n - 1, P = p.P;
  const int cached = static_cast<int>(min(P, static_cast<long long>(BuildTreeParams::PARENT_CACHE)));
  bool sorted = true;
  for (int j = tid; j < m; j += T) {
    const long long x = p.selected_index[b * m + j];
    sel[j] = x;
    if (j + 1 < m) sorted &= x <= p.selected_index[b * m + j + 1];
  }
  for (int q = tid; q < cached; q += T) plist[q] = p.parent_list[b * P + q];
  for (int k = tid; k < n * words; k += T) rows[k] = 0u;
  const long long s = clamp_seq_len(p.verified_seq_len[b]);
  sorted = __syncthreads_and(sorted);
  if (MODE == 0 && warp == warps - 1) {  // s_before, in the last warp while the first ones find the parents
    long long acc = 0;
    for (long long j = lane; j < b; j += 32) acc += clamp_seq_len(p.verified_seq_len[j]);
    acc = warp_sum_ll(acc);
    if (lane == 0) s_before_shared = acc;
  }

  // ---- 2. parents (rule 2), one thread per node: node i >= 1 is flat index x = sel[i-1], q = x / topk;
  //         for q >= 1 the parent is the earliest earlier node whose flat index is parent_list[b, q]
  for (int i = tid; i < n; i += T) {
    int par = -1;
    if (i > 0) {
      const long long x = sel[i - 1];
      if (x >= 0) {
        const long long q = div_nonneg(x, p.topk);
        if (q == 0) {
          par = 0;
        } else if (q < P) {
          const long long want = q < cached ? plist[q] : p.parent_list[b * P + q];
          const int j = first_equal(sel, want, i - 1, sorted);
          par = j < 0 ? -1 : j + 1;
        }
      }
    }
    parent[i] = par;  // always < i, so every walk up ends within i steps
    if (par >= 0) atomicOr(rows + par * words + (i >> 5), 1u << (i & 31));  // children set of par
  }
  __syncthreads();

  // ---- 3. links from the children sets (children in increasing id): first child, next sibling ----
  const long long base = b * p.n;  // node i of request b is entry base + i of the flat outputs
  const bool lead = blockIdx.y == 0;
  if (lead) {
    for (int i = tid; i < n; i += T) {
      const int pi = parent[i];
      p.retrive_next_token[base + i] = first_bit(rows + i * words, words, 0);
      p.retrive_next_sibling[base + i] = pi < 0 || i + 1 >= n ? -1 : first_bit(rows + pi * words, words, i + 1);
      p.retrive_index[base + i] = base + i;
    }
  }
  __syncthreads();

  // ---- 4. per node: mask row bitset = {0} + path(i), positions s + |path(i)| ---------------------
  if (n <= 64) {
    if (warp == 0) {
      int d[2];
      paths_small(parent, rows, n, words, d);
      if (lead) {
        if (lane < n) p.positions[base + lane] = s + d[0];
        if (lane + 32 < n) p.positions[base + lane + 32] = s + d[1];
      }
    }
  } else {
    for (int i = tid; i < n; i += T) {
      const int d = path_walk(parent, rows, words, i);
      if (lead) p.positions[base + i] = s + d;
    }
  }
  __syncthreads();

  // ---- 5. the mask region of request b, written whole or not at all ---------------------------
  const long long t = static_cast<long long>(blockIdx.y) * T + tid;  // thread of the request
  const long long lanes = static_cast<long long>(gridDim.y) * T;
  unsigned char* mask = static_cast<unsigned char*>(p.tree_mask);
  if (MODE == 2) {
    // word b*n + i of W bytes holds the bits of row i (n <= 32: one bitset word, bits >= n clear)
    const long long W = p.n <= 8 ? 1 : (p.n <= 16 ? 2 : 4);
    const long long Z = p.n * W, off = b * Z;  // bytes; (b + 1) * n * W <= 4 * bs * n < 2^33
    if (off + Z > p.L * p.mask_elem_bytes) return;
    for (long long k = t; k < Z; k += lanes) {
      const long long i = k / W;
      mask[off + k] = static_cast<unsigned char>(rows[i * words] >> (8 * (k - i * W)));
    }
    return;
  }
  // FULL_MASK: rows of s_b + n entries, region at sum_{j<b} (s_j + n) * n = (s_before + b*n) * n.
  // QLEN_ONLY: rows of the n draft columns, region at b * n * n.
  // Bounds: s_j < 2^31 and bs * n < 2^31, so off + Z <= bs*n * (2^31 + n) < 2^63.
  const long long prefix = MODE == 0 ? s : 0;
  const long long width = prefix + p.n, Z = width * p.n;
  const long long off = MODE == 0 ? (s_before_shared + b * p.n) * p.n : b * p.n * p.n;
  if (off + Z > p.L) return;  // rule 6: regions are consecutive, so no later one fits either
  fill_bool_region(mask + off, Z, width, prefix, rows, words, t, lanes);
}

}  // namespace cupy_spec
