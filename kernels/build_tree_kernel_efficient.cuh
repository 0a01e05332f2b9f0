// Draft tree from an EAGLE drafter's choices: parents, "retrive" links, positions, attention mask.
//
// Launch: grid (bs, C), BLOCK threads per block (a multiple of 32), MODE = tree_mask_mode as a
// template argument. The C blocks of request b (C > 1 only in FULL_MASK, see the plan in
// cupy_spec/build_tree_kernel_efficient.py) each rebuild b's tree in shared memory and fill an
// interleaved share of the mask region; block (b, 0) alone writes positions and the retrive_* links.
// Dynamic shared memory: n * (8 + 4 + 4 + 4 * ceil(n / 32)) bytes (selected indices, parents, first
// children, one bitset row per node); static: the first PARENT_CACHE entries of the request's parent_list.
//
// Semantics are those of cupy_spec/reference/build_tree_kernel_efficient.py (rules 1-6 of its
// docstring), bit for bit: orphans, out-of-range indices, verified_seq_len clamped into
// [0, 2^31 - 1], and a request whose whole mask region does not fit in tree_mask writes no mask
// entry. All index arithmetic is in 64 bits; the host guarantees bs * n < 2^31 (positions' size),
// which bounds every mask offset below 2^63 (see step 4).
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

// Draft column c of node r's mask row: bit c of the row's bitset (bit 0, the root, is always set).
__device__ __forceinline__ unsigned draft_bit(const unsigned* rows, int words, long long r, long long c) {
  return (rows[r * words + (c >> 5)] >> (c & 31)) & 1u;
}

// Byte k of a bool mask region of n rows of `width` = `prefix` + n entries: 1 in the first `prefix`
// entries of a row (the verified tokens), then the row's n draft columns.
__device__ __forceinline__ unsigned char region_byte(const unsigned* rows, int words, long long width,
                                                     long long prefix, long long k) {
  const long long r = k / width, c = k - r * width;
  return c < prefix ? 1 : static_cast<unsigned char>(draft_bit(rows, words, r, c - prefix));
}

// Fills a bool region R[0, Z) (Z = width * n bytes) with the request's C * BLOCK threads: the bytes
// before the first 16-byte boundary and after the last one singly, the aligned middle in 16-byte
// stores. Thread t (0 <= t < lanes) takes the 16-byte runs t, t + lanes, ...; it finds the (row,
// column) of its first byte with one division and steps by lanes * 16 bytes = (drow rows, dcol
// columns) after that.
__device__ __forceinline__ void fill_bool_region(unsigned char* R, long long Z, long long width, long long prefix,
                                                 const unsigned* rows, int words, long long t, long long lanes) {
  const unsigned misalign = static_cast<unsigned>(reinterpret_cast<unsigned long long>(R) & 15ull);
  const long long head = min(Z, static_cast<long long>((16u - misalign) & 15u));
  const long long runs = (Z - head) >> 4;
  const long long tail = head + (runs << 4);  // Z - tail < 16, head < 16 <= lanes
  if (t < head) R[t] = region_byte(rows, words, width, prefix, t);
  if (tail + t < Z) R[tail + t] = region_byte(rows, words, width, prefix, tail + t);
  if (t >= runs) return;
  const long long first = head + 16 * t;
  long long r = first / width, c = first - r * width;
  const long long step = 16 * lanes, drow = step / width, dcol = step - drow * width;
  for (long long q = t; q < runs; q += lanes) {
    uint4 v;
    if (c + 16 <= prefix) {  // all 16 bytes inside one row's verified prefix
      v.x = v.y = v.z = v.w = 0x01010101u;
    } else {
      unsigned w[4] = {0u, 0u, 0u, 0u};
      long long rr = r, cc = c;
#pragma unroll
      for (int j = 0; j < 16; ++j) {  // byte j of the run is bits 8*(j%4).. of word j/4 (little-endian)
        const unsigned byte = cc < prefix ? 1u : draft_bit(rows, words, rr, cc - prefix);
        w[j >> 2] |= byte << (8 * (j & 3));
        if (++cc == width) {
          cc = 0;
          ++rr;
        }
      }
      v.x = w[0]; v.y = w[1]; v.z = w[2]; v.w = w[3];
    }
    *reinterpret_cast<uint4*>(R + head + 16 * q) = v;
    r += drow;  // next run: lanes * 16 bytes further
    c += dcol;
    if (c >= width) {  // dcol < width, so one wrap at most
      c -= width;
      ++r;
    }
  }
}

// First index j in [lo, hi) with key[j] == value, scanned by the calling warp 32 at a time (every
// lane gets the answer); -1 if none.
template <typename T>
__device__ __forceinline__ int warp_find(const T* key, T value, int lo, int hi) {
  const int lane = threadIdx.x & 31;
  for (int base = lo; base < hi; base += 32) {
    const int j = base + lane;
    const unsigned hit = __ballot_sync(kFullMask, j < hi && key[j] == value);
    if (hit) return base + __ffs(hit) - 1;
  }
  return -1;
}

template <int MODE>
__global__ void __launch_bounds__(BuildTreeParams::MAX_THREADS)
    build_tree_kernel_efficient_kernel(const BuildTreeParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ long long warp_sums[BuildTreeParams::MAX_THREADS / 32];
  __shared__ long long plist[BuildTreeParams::PARENT_CACHE];  // parent_list[b, 0 .. PARENT_CACHE)
  const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31, warp = tid >> 5, warps = T >> 5;
  const long long b = blockIdx.x;
  const int n = static_cast<int>(p.n);
  const int words = (n + 31) >> 5;
  long long* sel = reinterpret_cast<long long*>(smem_raw);  // [n - 1] selected flat indices of request b
  int* parent = reinterpret_cast<int*>(sel + n);            // [n] parent node, -1 for the root and orphans
  int* first_child = parent + n;                             // [n] smallest child, n if none
  unsigned* rows = reinterpret_cast<unsigned*>(first_child + n);  // [n][words] draft columns of each mask row

  // ---- 1. selected indices and the start of parent_list into shared memory (one round of loads);
  //         s_b; FULL_MASK: sum of s_j over j < b -------------------------------------------------
  const long long m = p.n - 1, P = p.P;
  const int cached = static_cast<int>(min(P, static_cast<long long>(BuildTreeParams::PARENT_CACHE)));
  for (int j = tid; j < m; j += T) sel[j] = p.selected_index[b * m + j];
  for (int q = tid; q < cached; q += T) plist[q] = p.parent_list[b * P + q];
  for (int i = tid; i < n; i += T) first_child[i] = n;
  const long long s = clamp_seq_len(p.verified_seq_len[b]);
  long long s_before = 0;
  if (MODE == 0) {
    long long acc = 0;
    for (long long j = tid; j < b; j += T) acc += clamp_seq_len(p.verified_seq_len[j]);
    acc = warp_sum_ll(acc);
    if (lane == 0) warp_sums[warp] = acc;
  }
  __syncthreads();
  if (MODE == 0) {
    for (int w = 0; w < warps; ++w) s_before += warp_sums[w];
  }

  // ---- 2. parents (rule 2), one warp per node: node i >= 1 is flat index x = sel[i-1], q = x / topk;
  //         for q >= 1 the parent is the earliest earlier node whose flat index is parent_list[b, q]
  for (int i = warp; i < n; i += warps) {
    int par = -1;
    if (i > 0) {
      const long long x = sel[i - 1];
      if (x >= 0) {
        const long long q = x / p.topk;  // x >= 0 and topk >= 1: floor division
        if (q == 0) {
          par = 0;
        } else if (q < P) {
          const long long t = q < cached ? plist[q] : p.parent_list[b * P + q];
          const int j = warp_find(sel, t, 0, i - 1);
          par = j < 0 ? -1 : j + 1;
        }
      }
    }
    if (lane == 0) parent[i] = par;  // always < i, so every walk up ends within i steps
  }
  __syncthreads();
  for (int i = tid; i < n; i += T) {
    if (parent[i] >= 0) atomicMin(first_child + parent[i], i);  // children linked in increasing id
  }

  // ---- 3. per node (one thread): mask row bitset = {0} + path(i) and depth d(i) = |path(i)| ----
  const long long base = b * p.n;  // node i of request b is entry base + i of the flat outputs
  const bool lead = blockIdx.y == 0;
  for (int i = tid; i < n; i += T) {
    unsigned* row = rows + static_cast<long long>(i) * words;
    for (int w = 0; w < words; ++w) row[w] = 0u;
    row[0] = 1u;  // the root column
    int d = 0;
    for (int c = i; c > 0;) {  // walk up: stop before the root or after an orphan
      row[c >> 5] |= 1u << (c & 31);
      ++d;
      const int up = parent[c];
      if (up < 0) break;
      c = up;
    }
    if (lead) {
      p.positions[base + i] = s + d;
      p.retrive_index[base + i] = base + i;
    }
  }
  __syncthreads();
  // links, one warp per node: the first child, and the next node with the same parent
  if (lead) {
    for (int i = warp; i < n; i += warps) {
      const int pi = parent[i];
      const int sibling = pi < 0 ? -1 : warp_find(parent, pi, i + 1, n);
      if (lane == 0) {
        p.retrive_next_token[base + i] = first_child[i] < n ? first_child[i] : -1;
        p.retrive_next_sibling[base + i] = sibling;
      }
    }
  }

  // ---- 4. the mask region of request b, written whole or not at all ---------------------------
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
  const long long off = MODE == 0 ? (s_before + b * p.n) * p.n : b * p.n * p.n;
  if (off + Z > p.L) return;  // rule 6: regions are consecutive, so no later one fits either
  fill_bool_region(mask + off, Z, width, prefix, rows, words, t, lanes);
}

}  // namespace cupy_spec
