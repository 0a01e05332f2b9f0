// Draft tree from an EAGLE drafter's choices: parents, "retrive" links, positions, attention mask.
//
// Launch: grid (bs, C), BLOCK threads per block (a multiple of 32, >= MIN_THREADS), MODE =
// tree_mask_mode as a template argument. The C blocks of request b (C > 1 only in FULL_MASK, see the
// plan in cupy_spec/build_tree_kernel_efficient.py) each rebuild b's tree and fill an interleaved
// share of the region's runs that hold draft columns; block (b, 0) alone writes positions and the
// retrive_* links. Trees of n <= 32 nodes are built by warp 0 in registers (one node per lane),
// trees of 33 to 64 nodes by warps 0 and 1 (one node per thread, with a barrier of their own), while,
// in FULL_MASK, the other warps write the verified-prefix runs, which need no tree: of their own
// region, or, where one region dominates the batch, of an even share of the whole mask (prefix_runs);
// larger trees are built by the whole block in shared memory, which then writes its region's prefix
// runs. After one barrier the block writes the rest of the mask. DIRECT
// (FULL_MASK, n <= DIRECT_TREE, the plan's choice): no block barrier; warp 0 (n <= 32) or warps 0 and
// 1 (n <= 64) of block (b, 0) alone build the tree and write every byte that holds a draft column from
// their threads' rows (direct_small, direct_pair), the other blocks' tree warps idle.
// Dynamic shared memory: n * (8 + 4 + 4 * ceil(n / 32)) bytes (selected indices or children sets,
// parents, one bitset row per node: its children, then its mask row); static: the first
// PARENT_CACHE entries of the request's parent_list, and tree_pair's children sets, paths and
// first node of each key.
//
// Semantics are those of cupy_spec/reference/build_tree_kernel_efficient.py (rules 1-6 of its
// docstring), bit for bit: orphans, out-of-range indices, verified_seq_len clamped into
// [0, 2^31 - 1], and a request whose whole mask region does not fit in tree_mask writes no mask
// entry. Offsets into the outputs are 64-bit; the host guarantees bs * n < 2^31 (positions' size),
// which bounds every mask offset below 2^63. Within a mask row, rows and columns are 32-bit (a row
// has at most 2^31 - 1 + n columns).
#pragma once
#include "common.cuh"

namespace cupy_spec {

// BuildTreeKernelEfficientParams and its constants are generated from the argument table in
// cupy_spec/build_tree_kernel_efficient.py.
using BuildTreeParams = BuildTreeKernelEfficientParams;
static_assert(BuildTreeParams::PARENT_CACHE <= BuildTreeParams::MIN_THREADS, "tree_block stages one entry per thread");

// verified_seq_len as the op reads it: clamped into [0, 2^31 - 1].
__device__ __forceinline__ long long clamp_seq_len(long long s) {
  return s < 0 ? 0 : (s > kIntMax ? static_cast<long long>(kIntMax) : s);
}

// x / k for x >= 0, k >= 1, in 32 bits when both fit.
__device__ __forceinline__ long long div_nonneg(long long x, long long k) {
  return ((x | k) >> 32) == 0 ? static_cast<long long>(static_cast<unsigned>(x) / static_cast<unsigned>(k)) : x / k;
}

// Byte k of a bool mask region of n rows of `width` = `prefix` + n entries: 1 in the first `prefix`
// entries of a row (the verified tokens), then the row's n draft columns (bit c of its bitset).
__device__ __forceinline__ unsigned char region_byte(const unsigned* rows, int words, long long width,
                                                     long long prefix, long long k) {
  const long long r = div_nonneg(k, width), c = k - r * width;
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

// A bool mask region R[0, Z) (Z = width * n bytes, rows of `width` = prefix + n entries) is written
// as the bytes before its first 16-byte boundary (head, < 16), 16-byte runs, and the bytes after
// the last boundary (tail, < 16). A run that lies inside one row's verified prefix is all ones and
// needs no tree ("prefix run"); every other run touches a draft column (a run that crosses from a
// row's end into the next row's prefix holds the row's last draft column).
struct Region {
  unsigned char* R;
  long long Z, width, prefix, head, runs;
  __device__ __forceinline__ Region(unsigned char* r, long long z, long long w, long long pre) : R(r), Z(z), width(w),
                                                                                              prefix(pre) {
    const unsigned misalign = static_cast<unsigned>(reinterpret_cast<unsigned long long>(r) & 15ull);
    head = min(z, static_cast<long long>((16u - misalign) & 15u));
    runs = (z - head) >> 4;
  }
};

// The runs by threads t = 0 .. lanes-1 (run q by thread q mod lanes): the prefix runs only, or
// (ALL) every run; with RANGE, runs q0 .. q1-1 (run q by thread q - q0 mod lanes). Thread t finds the
// (row, column) of its first run with one division (32 bits without RANGE: its offset is below 16 *
// (lanes + 1)) and steps by lanes * 16 bytes = (drow rows, dcol columns).
template <bool ALL, bool RANGE = false>
__device__ __forceinline__ void fill_runs(const Region& g, const unsigned* rows, int words, long long t,
                                          long long lanes, long long q0 = 0, long long q1 = 0) {
  const long long end = RANGE ? q1 : g.runs;
  if (q0 + t >= end || (!ALL && g.prefix < 16)) return;
  const unsigned W = static_cast<unsigned>(g.width), pre = static_cast<unsigned>(g.prefix);
  unsigned r, c;
  if (RANGE) {
    const long long first = g.head + 16 * (q0 + t), r0 = div_nonneg(first, g.width);
    r = static_cast<unsigned>(r0);
    c = static_cast<unsigned>(first - r0 * g.width);
  } else {
    const unsigned first = static_cast<unsigned>(g.head + 16 * t);
    r = first / W;
    c = first - r * W;
  }
  const unsigned step = static_cast<unsigned>(16 * lanes), drow = step / W, dcol = step - drow * W;
  const uint4 ones = spread16(0xffffu);
  for (long long q = q0 + t; q < end; q += lanes) {
    uint4* out = reinterpret_cast<uint4*>(g.R + g.head + 16 * q);
    if (c + 16 <= pre) {
      *out = ones;
    } else if (ALL) {
      *out = spread16(run_bits(rows, words, W, pre, r, c));
    }
    r += drow;  // next run: lanes * 16 bytes further
    c += dcol;
    if (c >= W) {  // dcol < W, so one wrap at most
      c -= W;
      ++r;
    }
  }
}

// The head and tail bytes (threads t < 16).
__device__ __forceinline__ void fill_ends(const Region& g, const unsigned* rows, int words, long long t) {
  const long long tail = g.head + (g.runs << 4);  // Z - tail < 16
  if (t < g.head) g.R[t] = region_byte(rows, words, g.width, g.prefix, t);
  if (tail + t < g.Z) g.R[tail + t] = region_byte(rows, words, g.width, g.prefix, tail + t);
}

// The runs that touch a draft column, found row by row (lanes >= 16 threads): row r's draft columns
// are bytes [r * width + prefix, + n), covered by at most n / 16 + 2 runs (per_row; 4 for n <= 32).
// A run shared by two rows is written by both, with the same bytes. For rows of >= 16 bytes of
// prefix, a run starts in its row; otherwise its row is found by a division.
__device__ __forceinline__ void fill_draft_runs(const Region& g, const unsigned* rows, int words, int n, long long t,
                                                long long lanes) {
  const unsigned W = static_cast<unsigned>(g.width), pre = static_cast<unsigned>(g.prefix);
  const unsigned per_row = n <= 32 ? 4 : n / 16 + 2, items = n * per_row;  // n is a few thousand at most
  for (long long item = t; item < items; item += lanes) {
    const unsigned r = static_cast<unsigned>(item) / per_row, k = static_cast<unsigned>(item) - r * per_row;
    const long long start = static_cast<long long>(r) * g.width + g.prefix;  // first draft byte of row r
    const long long first = start < g.head ? 0 : (start - g.head) >> 4;   // its run (or run 0)
    const long long last = (start + n - 1 - g.head) >> 4;                 // run of its last draft byte
    const long long q = first + k;
    if (start + n - 1 < g.head || q > last || q >= g.runs) continue;
    const long long B = g.head + 16 * q;  // the run's first byte
    long long c = B - static_cast<long long>(r) * g.width, rr = r;
    if (c < 0 || c >= g.width) {
      rr = div_nonneg(B, g.width);
      c = B - rr * g.width;
    }
    *reinterpret_cast<uint4*>(g.R + B) =
        spread16(run_bits(rows, words, W, pre, static_cast<unsigned>(rr), static_cast<unsigned>(c)));
  }
}

// ---- the draft columns written from the tree threads' rows (thread i: row i, n <= 64) ------------

// Regions whose rows have >= 16 prefix bytes: the prefix keeps a 16-byte run from touching two rows'
// draft columns, puts the head in row 0's prefix and the tail in row n - 1. The runs of row i that
// touch its draft columns, from its bits (bit c: draft column c); a run's bytes outside them are ones.
__device__ __forceinline__ void row_draft_runs(const Region& g, long long i, unsigned long long row, int n) {
  const unsigned long long drafts = n < 64 ? (1ull << n) - 1ull : ~0ull;
  const long long start = i * g.width + g.prefix;  // row i's first draft byte (>= 16 > head)
  for (long long q = (start - g.head) >> 4; q < g.runs && g.head + 16 * q < start + n; ++q) {
    const long long d = start - (g.head + 16 * q);  // byte of draft column 0 within the run (< 0: before it)
    const unsigned long long in = d >= 0 ? drafts << d : drafts >> -d;
    const unsigned long long bits = d >= 0 ? row << d : row >> -d;
    *reinterpret_cast<uint4*>(g.R + g.head + 16 * q) = spread16(static_cast<unsigned>((~in | bits) & 0xffffull));
  }
}

// One warp, lane i holding row i (n <= 32): the runs, and the head and tail bytes.
__device__ __forceinline__ void draft_runs_from_lanes(const Region& g, unsigned row, int n) {
  const int i = threadIdx.x & 31;
  const unsigned last = __shfl_sync(kFullMask, row, n - 1);
  const long long tail = g.head + (g.runs << 4);
  if (i < g.head) g.R[i] = 1;
  if (tail + i < g.Z) {
    const long long col = tail + i - ((n - 1) * g.width + g.prefix);  // < n
    g.R[tail + i] = col < 0 ? 1 : static_cast<unsigned char>((last >> col) & 1u);
  }
  if (i < n) row_draft_runs(g, i, row, n);
}

// Warps 0 and 1, thread i holding row i (32 < n <= 64): the runs, the head bytes, and the tail (< 16
// bytes, all among row n - 1's n > 16 draft columns) by thread n - 1.
__device__ __forceinline__ void draft_runs_from_pair(const Region& g, unsigned long long row, int n) {
  const int i = threadIdx.x;
  if (i < g.head) g.R[i] = 1;
  if (i >= n) return;
  row_draft_runs(g, i, row, n);
  if (i == n - 1) {
    const long long drafts = (n - 1) * g.width + g.prefix;  // row n - 1's first draft byte
    for (long long k = g.head + (g.runs << 4); k < g.Z; ++k) g.R[k] = static_cast<unsigned char>((row >> (k - drafts)) & 1u);
  }
}

// Regions whose rows have < 16 prefix bytes (so fewer than 16 + 32 bytes each): every byte. Rows of
// >= 16 bytes: run q by lane q mod 32, from the two rows it spans at most (two shuffles; row r's
// bytes as the bits of a 64-bit line: `prefix` ones, then its draft bits), then the head bytes (lanes
// 0-15) and the tail bytes (lanes 16-31). Shorter rows (a region of < 256 bytes): one byte per lane
// and step. Every lane takes part in every shuffle.
__device__ __forceinline__ unsigned long long row_line(unsigned row, unsigned pre) {
  return (static_cast<unsigned long long>(row) << pre) | ((1ull << pre) - 1ull);
}
__device__ __forceinline__ void region_from_lanes(const Region& g, unsigned row, int n) {
  const unsigned lane = threadIdx.x & 31, W = static_cast<unsigned>(g.width), pre = static_cast<unsigned>(g.prefix);
  const unsigned Z = static_cast<unsigned>(g.Z), last = static_cast<unsigned>(n) - 1u;  // Z < 1536
  if (W < 16) {
    for (unsigned k0 = 0; k0 < Z; k0 += 32) {
      const unsigned k = k0 + lane, r = min(k / W, last), c = k - r * W;
      const unsigned bits = __shfl_sync(kFullMask, row, static_cast<int>(r));
      if (k < Z) g.R[k] = c < pre ? 1 : static_cast<unsigned char>((bits >> (c - pre)) & 1u);
    }
    return;
  }
  const unsigned head = static_cast<unsigned>(g.head), runs = static_cast<unsigned>(g.runs);
  for (unsigned q0 = 0; q0 < runs; q0 += 32) {
    const unsigned B = head + 16 * min(q0 + lane, runs - 1);  // lanes past the last run repeat it
    const unsigned r = B / W, c = B - r * W;                  // row r holds the run's first W - c bytes
    const unsigned w0 = __shfl_sync(kFullMask, row, static_cast<int>(r));
    const unsigned w1 = __shfl_sync(kFullMask, row, static_cast<int>(min(r + 1, last)));
    const unsigned long long bits = (row_line(w0, pre) >> c) | (row_line(w1, pre) << (W - c));
    if (q0 + lane < runs) *reinterpret_cast<uint4*>(g.R + B) = spread16(static_cast<unsigned>(bits & 0xffffull));
  }
  const unsigned k = lane < 16 ? lane : head + 16 * runs + lane - 16;  // a head or a tail byte
  const unsigned r = min(k / W, last), c = k - r * W;
  const unsigned w = __shfl_sync(kFullMask, row, static_cast<int>(r));
  if (lane < 16 ? lane < head : k < Z) g.R[k] = c < pre ? 1 : static_cast<unsigned char>((w >> (c - pre)) & 1u);
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

// ---- trees of n <= 32 nodes: one warp, node i in lane i, in registers -------------------------
constexpr int SMALL_TREE = 32;
constexpr int PARENT_SLOTS = BuildTreeParams::PARENT_CACHE / 32;

// The whole tree of request b in warp 0: one trip to memory for the nodes' flat indices (keys) and
// the start of parent_list; parents (rule 2) by a binary search of the keys held in the lanes (a scan
// when they are not sorted); sibling groups by __match_any_sync for the links; ancestor sets by
// pointer doubling. Writes the mask rows (one word per node; ROWS) and, in the lead block, links and
// positions; returns lane i's row {0} + path(i) (bit c: draft column c; 0 in lanes i >= n).
template <bool ROWS>
__device__ __forceinline__ unsigned tree_small(const BuildTreeParams& p, long long b, int n, long long s,
                                               long long* plist, unsigned* kids, unsigned* rows, bool lead) {
  const int i = threadIdx.x & 31;  // node
  const long long m = p.n - 1, P = p.P, base = b * p.n;
  const int cached = static_cast<int>(min(P, static_cast<long long>(BuildTreeParams::PARENT_CACHE)));
  const long long key = i >= 1 && i < n ? p.selected_index[b * m + i - 1] : 0;
  long long pl[PARENT_SLOTS];  // every load issued before any is used
#pragma unroll
  for (int k = 0; k < PARENT_SLOTS; ++k) pl[k] = i + 32 * k < cached ? p.parent_list[b * P + i + 32 * k] : 0;
#pragma unroll
  for (int k = 0; k < PARENT_SLOTS; ++k)
    if (i + 32 * k < cached) plist[i + 32 * k] = pl[k];
  if (i < n) kids[i] = 0u;
  const long long next = __shfl_down_sync(kFullMask, key, 1);
  const bool sorted = __all_sync(kFullMask, i < 1 || i + 1 >= n || key <= next);  // keys of nodes 1..n-1
  __syncwarp();

  // rule 2: flat index x = key, q = x / topk; q == 0: the root's child; else the earliest node k in
  // [1, i) whose key is parent_list[b, q]
  int par = -1;
  long long want = -1;
  bool search = false;
  if (i >= 1 && i < n && key >= 0) {
    const long long q = div_nonneg(key, p.topk);
    if (q == 0) {
      par = 0;
    } else if (q < P) {
      want = q < cached ? plist[q] : p.parent_list[b * P + q];
      search = true;
    }
  }
  if (sorted) {  // pos = how many of nodes 1..i-1 have a key below want; node pos + 1 is the candidate
    int pos = 0;
    for (int step = n > 2 ? 1 << (31 - __clz(n - 2)) : 0; step > 0; step >>= 1) {
      const long long v = __shfl_sync(kFullMask, key, min(pos + step, 31));
      if (pos + step < i && v < want) pos += step;
    }
    const long long v = __shfl_sync(kFullMask, key, min(pos + 1, 31));
    if (search && pos + 1 < i && v == want) par = pos + 1;
  } else {
    for (int k = 1; k < n - 1; ++k) {
      const long long v = __shfl_sync(kFullMask, key, k);
      if (search && par < 0 && k < i && v == want) par = k;
    }
  }

  if (lead) {  // links: kids[k] = node k's children; the lowest lane of each sibling group writes it
    const unsigned group = __match_any_sync(kFullMask, par);
    if (par >= 0 && (group & ((1u << i) - 1u)) == 0) kids[par] = group;
    __syncwarp();
    if (i < n) {
      const unsigned later = par < 0 || i + 1 >= n ? 0u : kids[par] & (~0u << (i + 1));
      p.retrive_next_token[base + i] = __ffs(kids[i]) - 1;
      p.retrive_next_sibling[base + i] = __ffs(later) - 1;
      p.retrive_index[base + i] = base + i;
    }
  }
  // Ancestor sets by pointer doubling. Invariant: a = the path from i up to, not including, J, the
  // next node to add (-1 once the walk has ended: before the root, after an orphan); each round
  // a |= a(J), J = J(J), so after ceil(log2 n) rounds a = path(i).
  unsigned a = i >= 1 && i < n ? 1u << i : 0u;
  int J = par > 0 ? par : -1;
  for (int span = 1; span < n; span <<= 1) {
    const unsigned up = __shfl_sync(kFullMask, a, J & 31);
    const int jj = __shfl_sync(kFullMask, J, J & 31);
    if (J >= 0) {
      a |= up;
      J = jj;
    }
  }
  if (i < n) {
    if (ROWS) rows[i] = a | 1u;  // {0} + path(i)
    if (lead) p.positions[base + i] = s + __popc(a);
  }
  return i < n ? a | 1u : 0u;
}

// ---- trees of 33 to 64 nodes: warps 0 and 1, node i in thread i, with their own barrier --------
constexpr int PAIR_TREE = 64;
static_assert(BuildTreeParams::DIRECT_TREE <= PAIR_TREE, "the direct instantiation builds its tree in one or two warps");

// Barrier 1 of the two tree warps (barrier 0 is __syncthreads'), plain or with a vote of all 64.
__device__ __forceinline__ void pair_sync() { asm volatile("bar.sync 1, 64;" ::: "memory"); }
__device__ __forceinline__ bool pair_sync_and(bool x) {
  int r;
  asm volatile("{\n .reg .pred a, b;\n setp.ne.s32 a, %1, 0;\n bar.red.and.pred b, 1, 64, a;\n selp.s32 %0, 1, 0, b;\n}"
               : "=r"(r) : "r"(static_cast<int>(x)) : "memory");
  return r != 0;
}

// The whole tree of request b (32 < n <= 64) in warps 0 and 1, as tree_small with shared memory
// between the warps: one trip to memory for the keys and the start of parent_list; parents (rule 2)
// by one lookup where the keys are sorted and below KEY_SLOTS (below), else by a binary search of the
// keys (a scan when they are not sorted); sibling groups by
// __match_any_sync, whose lowest lane writes its warp's 32-bit half of the parent's children set
// (kids); ancestor sets by pointer doubling in each warp, by shuffles: a parent precedes its child
// (rule 2 searches nodes [1, i)), so warp 0's walks stay in warp 0, and a walk of warp 1 stops at its
// first node in warp 0, whose whole path warp 0 publishes (path0) before the one barrier after the
// search. The lookup: the first node of each run of equal sorted keys writes its id into node_of[key]
// (between two barriers of the two warps), and a node takes the entry of its parent's key if that
// entry names an earlier node with that key (the table is not cleared: an entry not written by this
// request names a node whose key differs). Shared: sel [n] keys; rows [n][2] mask rows. Returns thread i's
// row {0} + path(i) (bit c: draft column c; 0 in threads i >= n).
constexpr int KEY_SLOTS = 1024;
__device__ __forceinline__ unsigned long long tree_pair(const BuildTreeParams& p, long long b, int n, long long s,
                                                        long long* plist, long long* sel, unsigned* rows, bool lead) {
  __shared__ unsigned kids[PAIR_TREE][2];       // children set of node k, bit j: node 32 * w + j in word w
  __shared__ unsigned long long path0[32];      // path(i) of warp 0's nodes
  __shared__ unsigned char node_of[KEY_SLOTS];  // the first node whose key is x (sorted keys), or stale
  const int i = threadIdx.x, lane = i & 31, warp = i >> 5;  // node
  const long long m = p.n - 1, P = p.P, base = b * p.n;
  const int cached = static_cast<int>(min(P, static_cast<long long>(BuildTreeParams::PARENT_CACHE)));
  constexpr int SLOTS = BuildTreeParams::PARENT_CACHE / PAIR_TREE;
  const long long key = i >= 1 && i < n ? p.selected_index[b * m + i - 1] : 0;
  const long long over = lane == 31 && i + 1 < n ? p.selected_index[b * m + i] : 0;  // next warp's first key
  long long pl[SLOTS];  // every load issued before any is used
#pragma unroll
  for (int k = 0; k < SLOTS; ++k) pl[k] = i + PAIR_TREE * k < cached ? p.parent_list[b * P + i + PAIR_TREE * k] : 0;
#pragma unroll
  for (int k = 0; k < SLOTS; ++k)
    if (i + PAIR_TREE * k < cached) plist[i + PAIR_TREE * k] = pl[k];
  if (i >= 1 && i < n) sel[i - 1] = key;
  kids[i][0] = kids[i][1] = 0u;
  const long long down = __shfl_down_sync(kFullMask, key, 1);
  const long long next = lane == 31 ? over : down;
  const bool sorted = pair_sync_and(i < 1 || i + 1 >= n || key <= next);  // keys of nodes 1..n-1

  const long long up = __shfl_up_sync(kFullMask, key, 1);
  const long long prev = lane != 0 ? up : i >= 2 && i < n ? sel[i - 2] : 0;  // key of node i - 1 (sel: after the vote)
  if (sorted && i >= 1 && i < n && key >= 0 && key < KEY_SLOTS && (i == 1 || prev != key))
    node_of[key] = static_cast<unsigned char>(i);

  // rule 2: flat index x = key, q = x / topk; q == 0: the root's child; else the earliest node k in
  // [1, i) whose key is parent_list[b, q] (sel[k - 1])
  int par = -1;
  long long want = 0;
  bool search = false;
  if (i >= 1 && i < n && key >= 0) {
    const long long q = div_nonneg(key, p.topk);
    if (q == 0) {
      par = 0;
    } else if (q < P) {
      want = q < cached ? plist[q] : p.parent_list[b * P + q];
      search = true;
    }
  }
  pair_sync();  // node_of written
  if (search && sorted && want >= 0 && want < KEY_SLOTS) {  // the first node with key want, if any: a parent if < i
    const int j = node_of[want];
    par = j >= 1 && j < i && sel[j - 1] == want ? j : -1;
  } else if (search) {
    const int j = first_equal(sel, want, i - 1, sorted);
    par = j < 0 ? -1 : j + 1;
  }
  const unsigned group = __match_any_sync(kFullMask, par);  // siblings in this warp
  if (par >= 0 && (group & ((1u << lane) - 1u)) == 0) kids[par][warp] = group;

  // Ancestor sets. Invariant: a = the path from i up to, not including, J (-1 once the walk has
  // ended); a round a |= a(J), J = J(J) while J is in this warp (J >= 32 * warp; J < i always).
  unsigned long long a = i >= 1 && i < n ? 1ull << i : 0ull;
  int J = par > 0 ? par : -1;
  const int lo = 32 * warp;
  while (__any_sync(kFullMask, J >= lo)) {
    const unsigned long long up = __shfl_sync(kFullMask, a, J & 31);
    const int jj = __shfl_sync(kFullMask, J, J & 31);
    if (J >= lo) {
      a |= up;
      J = jj;
    }
  }
  if (warp == 0) path0[lane] = a;
  pair_sync();  // kids and path0 written
  if (warp == 1 && J > 0) a |= path0[J];  // the rest of the walk: path(J) of a node J in warp 0

  if (i < n) {
    rows[2 * i] = static_cast<unsigned>(a) | 1u;  // {0} + path(i)
    rows[2 * i + 1] = static_cast<unsigned>(a >> 32);
    if (lead) {  // links: first child, next sibling (children in increasing id); positions
      const auto kid_set = [](int k) { return kids[k][0] | static_cast<unsigned long long>(kids[k][1]) << 32; };
      const unsigned long long later = par < 0 || i + 1 >= n ? 0ull : kid_set(par) & (~0ull << (i + 1));
      p.retrive_next_token[base + i] = __ffsll(kid_set(i)) - 1;
      p.retrive_next_sibling[base + i] = __ffsll(later) - 1;
      p.retrive_index[base + i] = base + i;
      p.positions[base + i] = s + __popcll(a);
    }
  }
  return i < n ? a | 1ull : 0ull;
}

// Mask row {0} + path(i) of node i, one thread walking up; returns |path(i)|.
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

// FULL_MASK: sum of s_j over j < b (the start of request b's region is (sum + b * n) * n), by one
// warp with SUM_LOADS loads per lane in flight (one trip to memory per 256 earlier requests); every
// lane returns it.
constexpr int SUM_LOADS = 8;

// The loads of terms j0 + 32 u + lane < b (0 past b), all issued before any is used.
__device__ __forceinline__ void seq_len_loads(const BuildTreeParams& p, long long b, long long j0, long long lane,
                                              long long (&v)[SUM_LOADS]) {
#pragma unroll
  for (int u = 0; u < SUM_LOADS; ++u) {
    const long long j = j0 + 32 * u + lane;
    v[u] = j < b ? p.verified_seq_len[j] : 0;
  }
}

__device__ __forceinline__ long long sum_before(const BuildTreeParams& p, long long b) {
  const long long lane = threadIdx.x & 31;
  long long acc = 0;
  for (long long j0 = 0; j0 < b; j0 += 32 * SUM_LOADS) {
    long long v[SUM_LOADS];
    seq_len_loads(p, b, j0, lane, v);
#pragma unroll
    for (int u = 0; u < SUM_LOADS; ++u) acc += clamp_seq_len(v[u]);
  }
  return warp_sum(acc);
}

// The same sum in two parts, so that a warp with other loads to make can issue the first loads
// (seq_len_loads from 0) with them: then the sum given those first 32 * SUM_LOADS terms.
__device__ __forceinline__ long long sum_before_from(const BuildTreeParams& p, long long b,
                                                     const long long (&first)[SUM_LOADS]) {
  long long acc = 0;
#pragma unroll
  for (int u = 0; u < SUM_LOADS; ++u) acc += clamp_seq_len(first[u]);
  for (long long j0 = 32 * SUM_LOADS; j0 < b; j0 += 32 * SUM_LOADS) {
    long long v[SUM_LOADS];
    seq_len_loads(p, b, j0, threadIdx.x & 31, v);
#pragma unroll
    for (int u = 0; u < SUM_LOADS; ++u) acc += clamp_seq_len(v[u]);
  }
  return warp_sum(acc);
}

// ---- FULL_MASK: the prefix runs while the trees are built (trees of n <= 64) --------------------
// The warps that do not build a tree write the regions' prefix runs, which need no tree. Each
// request's C blocks share its own region, unless one region dominates the batch: bs <= SPLIT_BATCH
// and the longest region is over SPLIT_SKEW times the mean (e.g. one long context among short
// ones), holds over SPLIT_RUNS runs for each writing thread of its C blocks (below that the split's
// own cost, a reload and a scan, outweighs the work it spreads) and gives each of its blocks over
// 1 / SPLIT_SHARE of the whole mask (below that the mask's total bytes, written by the whole GPU,
// take longer than the long region does). Then the grid splits the bytes [0, E) of the regions
// that fit (E = min(L, sum_j (s_j + n) * n)) into G = bs * C shares at 16-byte aligned cuts (a run
// lies in one share), and block g = b * C + y writes the prefix runs of its share, so the long
// region's work is spread over every block. Both take one trip to memory for every s_j up to 256
// requests; the split then reloads them, SPLIT_LOADS consecutive ones per lane, for a warp scan of
// the regions' offsets. Each warp works alone (no barrier).
constexpr int SPLIT_LOADS = 8;
constexpr long long SPLIT_BATCH = 32 * SPLIT_LOADS;
static_assert(SPLIT_BATCH == 32 * SUM_LOADS, "one trip for every s_j of a batch that may split");

// Cut k of the split: 0, E, or the first 16-byte aligned address at or after byte ~k * E / G (any
// rule gives a split if it is non-decreasing in k and the same in every block).
__device__ __forceinline__ long long split_cut(const unsigned char* mask, long long E, long long G, long long k) {
  if (k <= 0) return 0;
  if (k >= G) return E;
  const long long x = __double2ll_rz(__dmul_rn(static_cast<double>(E), __ddiv_rn(static_cast<double>(k),
                                                                                 static_cast<double>(G))));
  const long long a = static_cast<long long>(reinterpret_cast<unsigned long long>(mask));
  return min(E, ((a + x + 15) & ~15ll) - a);
}

// The prefix runs of this block's share of the whole mask, by threads t of `lanes` (whole warps);
// total = sum_j s_j.
__device__ __forceinline__ void prefix_share(const BuildTreeParams& p, unsigned char* mask, long long total,
                                             long long t, long long lanes) {
  const int lane = threadIdx.x & 31;
  const long long n = p.n, G = static_cast<long long>(gridDim.x) * gridDim.y;
  unsigned s[SPLIT_LOADS];  // s_j of requests j = SPLIT_LOADS * lane + u (0 past bs)
  long long v[SPLIT_LOADS], run = 0;
#pragma unroll
  for (int u = 0; u < SPLIT_LOADS; ++u) {
    const long long j = SPLIT_LOADS * lane + u;
    v[u] = j < p.bs ? p.verified_seq_len[j] : 0;
  }
#pragma unroll
  for (int u = 0; u < SPLIT_LOADS; ++u) {
    s[u] = static_cast<unsigned>(clamp_seq_len(v[u]));
    run += s[u];
  }
  const long long E = min(p.L, (total + p.bs * n) * n);
  const long long g = static_cast<long long>(blockIdx.x) * gridDim.y + blockIdx.y;
  const long long lo = split_cut(mask, E, G, g), hi = split_cut(mask, E, G, g + 1);
  long long before = warp_inclusive_scan(run) - run;  // sum of s over the requests before SPLIT_LOADS * lane + u
#pragma unroll
  for (int u = 0; u < SPLIT_LOADS; ++u) {
    const long long j = SPLIT_LOADS * lane + u, off = (before + j * n) * n, Z = (s[u] + n) * n;  // region j
    before += s[u];
    const bool meets = j < p.bs && s[u] >= 16 && off < hi && off + Z > lo && off + Z <= p.L;
    unsigned meet = __ballot_sync(kFullMask, meets);
    while (meet) {  // the regions of this step that meet the share and fit (rule 6), one by one
      const int src = __ffs(meet) - 1;
      meet &= meet - 1;
      const long long o = __shfl_sync(kFullMask, off, src), sb = __shfl_sync(kFullMask, s[u], src);
      const Region r(mask + o, (sb + n) * n, sb + n, sb);
      const long long start = o + r.head;  // the region's run q starts at byte start + 16 q
      const long long q0 = lo > start ? (lo - start + 15) >> 4 : 0;
      const long long q1 = hi > start ? min(r.runs, (hi - start + 15) >> 4) : 0;
      fill_runs<false, true>(r, nullptr, 1, t, lanes, q0, q1);
    }
  }
}

// The prefix runs (see above) of request b (s = its clamped prefix) by the block's threads from warp
// tw on; the first of them stores sum_{j<b} s_j into *s_before where given, before any run.
__device__ __forceinline__ void prefix_runs(const BuildTreeParams& p, unsigned char* mask, long long b, long long s,
                                            int tw, long long* s_before) {
  const long long n = p.n, t = threadIdx.x - 32 * tw, lanes = blockDim.x - 32 * tw;
  long long before, total = -1;  // total: sum_j s_j where one region dominates, else -1
  if (p.bs <= SPLIT_BATCH) {  // one trip: the sums before b and of all, the longest prefix
    long long v[SUM_LOADS];
    seq_len_loads(p, p.bs, 0, threadIdx.x & 31, v);
    long long mine = 0, all = 0;
    int longest = 0;
#pragma unroll
    for (int u = 0; u < SUM_LOADS; ++u) {
      const long long x = clamp_seq_len(v[u]);
      mine += 32 * u + (threadIdx.x & 31) < b ? x : 0;
      all += x;
      longest = max(longest, static_cast<int>(x));
    }
    before = warp_sum(mine);
    all = warp_sum(all);
    const long long region = warp_max(longest) + n;  // the longest region's row width
    const bool skewed = region * p.bs > BuildTreeParams::SPLIT_SKEW * (all + p.bs * n);
    const bool heavy = region * n > 16 * BuildTreeParams::SPLIT_RUNS * gridDim.y * lanes;
    const bool sizable = region * BuildTreeParams::SPLIT_SHARE > gridDim.y * (all + p.bs * n);
    if (skewed && heavy && sizable) total = all;
  } else {
    before = sum_before(p, b);
  }
  if (s_before && t == 0) *s_before = before;
  if (total >= 0) {
    prefix_share(p, mask, total, t, lanes);
    return;
  }
  const long long off = (before + b * n) * n, Z = (s + n) * n;
  if (off + Z <= p.L)  // request b's region, shared by its C blocks
    fill_runs<false>(Region(mask + off, Z, s + n, s), nullptr, 1, blockIdx.y * lanes + t, gridDim.y * lanes);
}

// Trees of any size (used for n > 64), by the whole block in shared memory (sel: the selected
// indices, parent: each node's parent, rows: children sets, then mask rows). Writes `rows` and, in
// the lead block, links and positions. Ends with a block barrier.
__device__ __forceinline__ void tree_block(const BuildTreeParams& p, long long b, int n, int words, long long s,
                                           long long* plist, long long* sel, int* parent, unsigned* rows, bool lead,
                                           long long* s_before) {
  const int tid = threadIdx.x, T = blockDim.x;
  const long long m = p.n - 1, P = p.P, base = b * p.n;
  const int cached = static_cast<int>(min(P, static_cast<long long>(BuildTreeParams::PARENT_CACHE)));
  // 1. selected indices and the start of parent_list into shared memory; whether sel is sorted.
  //    T >= MIN_THREADS >= PARENT_CACHE: each thread stages at most one parent_list entry; its loads
  //    are issued before any store (one trip to memory while T >= m)
  const long long x0 = tid < m ? p.selected_index[b * m + tid] : 0;
  const long long x1 = tid + 1 < m ? p.selected_index[b * m + tid + 1] : 0;
  const long long pl = tid < cached ? p.parent_list[b * P + tid] : 0;
  bool sorted = tid + 1 >= m || x0 <= x1;
  if (tid < m) sel[tid] = x0;
  if (tid < cached) plist[tid] = pl;
  for (int j = tid + T; j < m; j += T) {
    const long long x = p.selected_index[b * m + j];
    sel[j] = x;
    if (j + 1 < m) sorted &= x <= p.selected_index[b * m + j + 1];
  }
  for (int k = tid; k < n * words; k += T) rows[k] = 0u;
  sorted = __syncthreads_and(sorted);
  if (s_before && (tid >> 5) == (T >> 5) - 1) {  // in the last warp, while the others find the parents
    const long long sum = sum_before(p, b);
    if ((tid & 31) == 0) *s_before = sum;
  }

  // 2. parents (rule 2), one thread per node: node i >= 1 is flat index x = sel[i-1], q = x / topk;
  //    for q >= 1 the parent is the earliest earlier node whose flat index is parent_list[b, q]
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

  // 3. links from the children sets (children in increasing id): first child, next sibling
  if (lead) {
    for (int i = tid; i < n; i += T) {
      const int pi = parent[i];
      p.retrive_next_token[base + i] = first_bit(rows + i * words, words, 0);
      p.retrive_next_sibling[base + i] = pi < 0 || i + 1 >= n ? -1 : first_bit(rows + pi * words, words, i + 1);
      p.retrive_index[base + i] = base + i;
    }
  }
  __syncthreads();

  // 4. per node: mask row bitset = {0} + path(i), positions s + |path(i)|
  for (int i = tid; i < n; i += T) {
    const int d = path_walk(parent, rows, words, i);
    if (lead) p.positions[base + i] = s + d;
  }
  __syncthreads();
}

// FULL_MASK trees of n <= 32 (the plan takes this instantiation for n <= DIRECT_TREE): warp 0 of the
// lead block builds the tree and writes every byte that holds a draft column, the region's offset
// loaded with the tree's inputs; the other warps of every block write the prefix runs of the block's
// share of the mask (prefix_runs), as the general path does while its tree is built. No barrier.
__device__ __forceinline__ void direct_small(const BuildTreeParams& p, long long b, int n, long long s,
                                             long long* plist, unsigned* kids, unsigned* rows, bool lead,
                                             unsigned char* mask) {
  const long long width = s + p.n, Z = width * p.n;
  if (threadIdx.x < 32) {
    if (!lead) return;
    long long first[SUM_LOADS];
    seq_len_loads(p, b, 0, threadIdx.x & 31, first);
    const unsigned row = tree_small<false>(p, b, n, s, plist, kids, rows, lead);
    const long long off = (sum_before_from(p, b, first) + b * p.n) * p.n;
    if (off + Z > p.L) return;
    const Region g(mask + off, Z, width, s);
    if (s >= 16) draft_runs_from_lanes(g, row, n);
    else region_from_lanes(g, row, n);
    return;
  }
  prefix_runs(p, mask, b, s, 1, nullptr);
}

// FULL_MASK trees of 33 to 64 nodes in the direct instantiation: as direct_small, with warps 0 and 1
// of the lead block (thread i: node i) in place of warp 0; where rows have fewer than 16 prefix bytes
// the two warps write the region from the rows in shared memory after a barrier of their own.
__device__ __forceinline__ void direct_pair(const BuildTreeParams& p, long long b, int n, long long s,
                                            long long* plist, long long* sel, unsigned* rows, bool lead,
                                            unsigned char* mask) {
  const long long width = s + p.n, Z = width * p.n;
  if (threadIdx.x < 2 * 32) {
    if (!lead) return;
    long long first[SUM_LOADS];
    seq_len_loads(p, b, 0, threadIdx.x & 31, first);
    const unsigned long long row = tree_pair(p, b, n, s, plist, sel, rows, lead);
    const long long off = (sum_before_from(p, b, first) + b * p.n) * p.n;
    if (off + Z > p.L) return;
    const Region g(mask + off, Z, width, s);
    if (s >= 16) {
      draft_runs_from_pair(g, row, n);
    } else {
      pair_sync();  // rows written
      fill_ends(g, rows, 2, threadIdx.x);
      fill_draft_runs(g, rows, 2, n, threadIdx.x, 2 * 32);
    }
    return;
  }
  prefix_runs(p, mask, b, s, 2, nullptr);
}

template <int MODE, bool DIRECT>
__global__ void __launch_bounds__(BuildTreeParams::MAX_THREADS)
    build_tree_kernel_efficient_kernel(const BuildTreeParams p) {
  follow_previous_grid();  // first: before any global memory access
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ long long s_before_shared;                        // FULL_MASK: sum of s_j over j < b
  __shared__ long long plist[BuildTreeParams::PARENT_CACHE];  // parent_list[b, 0 .. PARENT_CACHE)
  const int tid = threadIdx.x, T = blockDim.x, warp = tid >> 5;
  const long long b = blockIdx.x;
  const int n = static_cast<int>(p.n);
  const int words = (n + 31) >> 5;
  long long* sel = reinterpret_cast<long long*>(smem_raw);  // [n] selected flat indices (tree_block), or
  unsigned* kids = reinterpret_cast<unsigned*>(smem_raw);   // [n] children sets (tree_small)
  int* parent = reinterpret_cast<int*>(sel + n);             // [n] parent node, -1 for the root and orphans
  unsigned* rows = reinterpret_cast<unsigned*>(parent + n);  // [n][words] mask rows
  const long long s = clamp_seq_len(p.verified_seq_len[b]);
  const bool lead = blockIdx.y == 0;  // the block that writes links and positions
  const long long t = static_cast<long long>(blockIdx.y) * T + tid;  // thread of the request
  const long long lanes = static_cast<long long>(gridDim.y) * T;
  unsigned char* mask = static_cast<unsigned char*>(p.tree_mask);

  // Mask regions (bool modes). FULL_MASK: rows of s_b + n entries, region at sum_{j<b} (s_j + n) * n
  // = (s_before + b*n) * n. QLEN_ONLY: rows of the n draft columns, region at b * n * n. Bounds: s_j <
  // 2^31 and bs * n < 2^31, so off + Z <= bs*n * (2^31 + n) < 2^63. Rule 6: a region that does not
  // fit whole is not written (regions are consecutive, so no later one fits either).
  if (DIRECT) {  // MODE 0, n <= DIRECT_TREE (the plan's choice for trees of up to 64 nodes)
    if (n <= SMALL_TREE) direct_small(p, b, n, s, plist, kids, rows, lead, mask);
    else direct_pair(p, b, n, s, plist, sel, rows, lead, mask);
    return;
  }
  const long long prefix = MODE == 0 ? s : 0;
  const long long width = prefix + p.n, Z = width * p.n;
  if (n <= PAIR_TREE) {
    const int tw = n <= SMALL_TREE ? 1 : 2;  // tree warps
    if (warp < tw) {
      if (tw == 1) tree_small<true>(p, b, n, s, plist, kids, rows, lead);
      else tree_pair(p, b, n, s, plist, sel, rows, lead);
    } else if (MODE == 0) {  // meanwhile the other warps write the grid's share of verified-prefix runs
      prefix_runs(p, mask, b, s, tw, &s_before_shared);
    }
    __syncthreads();
  } else {
    tree_block(p, b, n, words, s, plist, sel, parent, rows, lead, MODE == 0 ? &s_before_shared : nullptr);
  }

  if (MODE == 2) {  // word b*n + i of 2^w bytes holds the bits of row i (n <= 32: one bitset word, bits >= n clear)
    const int w = p.n <= 8 ? 0 : (p.n <= 16 ? 1 : 2);
    const long long Zw = p.n << w, off = b * Zw;  // bytes; (b + 1) * n * 4 <= 4 * bs * n < 2^33
    if (off + Zw > p.L * p.mask_elem_bytes) return;
    for (long long k = t; k < Zw; k += lanes)
      mask[off + k] = static_cast<unsigned char>(rows[k >> w] >> (8 * (k & ((1 << w) - 1))));
    return;
  }
  const long long off = MODE == 0 ? (s_before_shared + b * p.n) * p.n : b * p.n * p.n;
  if (off + Z > p.L) return;
  const Region g(mask + off, Z, width, prefix);
  fill_ends(g, rows, words, t);
  if (MODE == 1) {  // no prefix: every run touches draft columns
    fill_runs<true>(g, rows, words, t, lanes);
    return;
  }
  if (n > PAIR_TREE) fill_runs<false>(g, rows, words, t, lanes);  // smaller trees: done before the barrier
  fill_draft_runs(g, rows, words, n, t, lanes);
}

}  // namespace cupy_spec
