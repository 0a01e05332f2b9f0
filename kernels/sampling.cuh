// Inverse-CDF sampling from a residual row: streaming piece sums in float64 for the ops that verify
// drafts against draft probabilities (chain_speculative_sampling, tree_speculative_sampling), and
// the final search (locate the piece, rescan it) for those and, with float32 sums, for
// tree_speculative_sampling_target_only.
//
// The draft-probability ops' references state row sums and prefix sums as exact sums rounded once to float32 (computed
// there in float64). Every value summed here is a float32, so a float64 accumulation of up to 2^18
// of them is within ~2^-35 (relative, worst case; typically ~1e-13) of the exact sum, and rounding
// it to float32 gives the reference's value unless the exact sum lies that close to a float32
// rounding boundary (at most ~1e-6 of the sums). A sum one ulp off then changes an acceptance or
// the final token only if a coin also lies within an ulp of the boundary. (A float32 accumulation,
// as in the target-only kernel, is off by several ulps on long rows.)
//
// A row is described by a small policy struct (duck-typed template argument `Row`):
//   RowUnits u;                                          units of the row (common.cuh)
//   int load(int k, Unit& x) const;                      raw loads of unit k; returns u.start(k)
//                                                        (for lane_sums a template on bool INTERIOR,
//                                                        true where k is known to be an aligned quad)
//   static constexpr bool kInteriorLoads;                for lane_sums: whether it takes that path
//   void values(const Unit& x, int start, float r[4], float q[4]) const;
//                                                        residual r (and draft mass q) of the unit
//                                                        whose first element is `start`
// Loads and arithmetic are split so that a lane can issue the loads of G units before any use.
#pragma once
#include "common.cuh"

namespace cupy_spec {

// Raw values of one unit: target and draft slots (slots past the unit's end are 0).
struct Unit {
  float t[4];
  float d[4];
};

// The reference's flush(float32(sum)) of a float64 sum of float32 values.
__device__ __forceinline__ float sum_to_float(double s) { return flush_subnormal(__double2float_rn(s)); }

// ---- streaming sums ------------------------------------------------------------------------------

// Lane partial sums (float64) of r and q over units [k0, k1) of `row`, lane l taking units
// k0 + l, k0 + l + 32, ...; G units' loads in flight before any arithmetic. Fixed order, so the
// result is bitwise reproducible. INTERIOR: every unit in range is an aligned quad.
template <int G, bool INTERIOR, class Row>
__device__ __forceinline__ void lane_sums_of(const Row& row, int k0, int k1, double& rs, double& qs) {
  const int lane = threadIdx.x & 31;
  for (int kb = k0; kb < k1; kb += 32 * G) {
    Unit x[G];
    int start[G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const int k = kb + 32 * i + lane;
      if (k < k1) {
        start[i] = row.template load<INTERIOR>(k, x[i]);
      } else {
        start[i] = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) x[i].t[j] = x[i].d[j] = 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (kb + 32 * i + lane < k1) {
        float r[4], q[4];
        row.values(x[i], start[i], r, q);
        rs += (static_cast<double>(r[0]) + static_cast<double>(r[1])) +
              (static_cast<double>(r[2]) + static_cast<double>(r[3]));
        qs += (static_cast<double>(q[0]) + static_cast<double>(q[1])) +
              (static_cast<double>(q[2]) + static_cast<double>(q[3]));
      }
    }
  }
}

// The same sums; where the row allows, ranges of aligned quads alone (every piece but a row's first
// and last) skip the per-unit head / tail / alignment branches of the loads.
template <int G, class Row>
__device__ __forceinline__ void lane_sums(const Row& row, int k0, int k1, double& rs, double& qs) {
  if (Row::kInteriorLoads && k0 >= 1 && k1 <= row.u.nq + 1) lane_sums_of<G, Row::kInteriorLoads>(row, k0, k1, rs, qs);
  else lane_sums_of<G, false>(row, k0, k1, rs, qs);
}

// Pieces of `piece_units` units each; the row's last piece may be shorter.
template <class Row>
__device__ __forceinline__ int piece_count(const Row& row, int piece_units) {
  return (row.u.count() + piece_units - 1) / piece_units;
}

// Sum of r over piece pc, computed by one warp (every lane returns it).
template <int G, class Row>
__device__ __forceinline__ double piece_sum(const Row& row, int pc, int piece_units) {
  const int k0 = pc * piece_units, k1 = min(k0 + piece_units, row.u.count());
  double rs = 0.0, qs = 0.0;
  lane_sums<G>(row, k0, k1, rs, qs);
  return warp_sum(rs);
}

// Piece sums of the whole row by this block alone (psum[pc] for every piece); ends with a barrier.
template <int WARPS, int G, class Row>
__device__ __forceinline__ void block_piece_sums(const Row& row, double* psum, int piece_units) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int pieces = piece_count(row, piece_units);
  for (int pc = warp; pc < pieces; pc += WARPS) {
    const double s = piece_sum<G>(row, pc, piece_units);
    if (lane == 0) psum[pc] = s;
  }
  __syncthreads();
}

// ---- the inverse-CDF sample ----------------------------------------------------------------------
// Generic over the accumulator Acc of the piece sums and prefixes: double here, float in the
// target-only op (whose reference sums in float32). Prefixes are compared with u after rounding to
// float32 (a no-op for float).

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(double x) { return __double2float_rn(x); }

// Where the sample lies among the pieces.
template <class Acc>
struct Located {
  float u;         // coin * float32(total)
  int piece;       // first piece with a positive sum whose end prefix, rounded to float32, exceeds u (-1: none)
  Acc base;        // prefix before that piece
  int last_piece;  // last piece with a positive sum (-1: the row is all zero)
};

// Computed by one warp on its own. Lane l takes a contiguous run of pieces, so the first lane whose
// run holds the crossing holds the first one. (The runs start `per` pieces apart, so the lanes' reads
// share shared-memory banks: one warp should do this, not every warp of a block.)
template <class Acc>
__device__ __forceinline__ Located<Acc> locate_piece(const Acc* psum, int pieces, float coin) {
  const int lane = threadIdx.x & 31;
  const int per = (pieces + 31) / 32;
  const int j0 = min(lane * per, pieces), j1 = min(j0 + per, pieces);
  Acc mine = 0;
  int lastp = -1;
  for (int j = j0; j < j1; ++j) {
    mine += psum[j];
    if (psum[j] > Acc(0)) lastp = j;
  }
  const Acc incl = warp_inclusive_scan(mine);
  Located<Acc> l;
  l.u = coin * to_float(__shfl_sync(kFullMask, incl, 31));
  Acc run = warp_exclusive_from(incl);
  int hit = -1;
  for (int j = j0; j < j1 && hit < 0; ++j) {
    const Acc next = run + psum[j];
    if (psum[j] > Acc(0) && to_float(next) > l.u) hit = j;
    else run = next;
  }
  const unsigned hits = __ballot_sync(kFullMask, hit >= 0);
  const int first = hits ? __ffs(hits) - 1 : 0;
  l.piece = hits ? __shfl_sync(kFullMask, hit, first) : -1;
  l.base = __shfl_sync(kFullMask, run, first);
  l.last_piece = warp_max(lastp);
  return l;
}

// Per-warp slots of the block-wide search, and warp 0's located piece.
template <class Acc>
struct SearchSlots {
  Acc sum[32];
  int hit[32];
  int last[32];
  Located<Acc> located;
};

// Whole block: the first index of units [k0, k1) whose prefix (base + in-range inclusive prefix,
// rounded to float32) exceeds `target` among indices with r > 0; if none, the last index in the
// range with r > 0 (-1 if none). One unit per thread per batch, two barriers per batch. Every
// thread returns the answer.
template <int THREADS, class Row, class Acc>
__device__ __forceinline__ int search_units(const Row& row, int k0, int k1, Acc base, float target,
                                            SearchSlots<Acc>* ws) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int lp = -1;
  for (int kb = k0; kb < k1; kb += THREADS) {
    const int k = kb + static_cast<int>(threadIdx.x);
    float r[4] = {0.0f, 0.0f, 0.0f, 0.0f}, q[4];
    int first = 0;
    if (k < k1) {
      Unit x;
      first = row.load(k, x);
      row.values(x, first, r, q);
    }
    Acc local[4];
    local[0] = r[0];
    local[1] = local[0] + r[1];
    local[2] = local[1] + r[2];
    local[3] = local[2] + r[3];
    const Acc incl = warp_inclusive_scan(local[3]);
    if (lane == 31) ws->sum[warp] = incl;
    __syncthreads();
    Acc before = base, total = base;  // prefix before this warp, and after the whole batch
#pragma unroll
    for (int v = 0; v < WARPS; ++v) {
      if (v < warp) before += ws->sum[v];
      total += ws->sum[v];
    }
    const Acc mine = before + warp_exclusive_from(incl);
    int hit = kIntMax;
#pragma unroll
    for (int j = 3; j >= 0; --j) {
      if (r[j] > 0.0f && to_float(mine + local[j]) > target) hit = first + j;
      if (r[j] > 0.0f) lp = max(lp, first + j);
    }
    hit = warp_min(hit);
    if (lane == 0) ws->hit[warp] = hit;
    __syncthreads();  // also: every thread has read ws->sum, so the next batch may rewrite it
#pragma unroll
    for (int v = 0; v < WARPS; ++v) hit = min(hit, ws->hit[v]);
    if (hit != kIntMax) return hit;
    base = total;
  }
  lp = warp_max(lp);
  if (lane == 0) ws->last[warp] = lp;
  __syncthreads();
#pragma unroll
  for (int v = 0; v < WARPS; ++v) lp = max(lp, ws->last[v]);
  return lp;
}

// Whole block: the token drawn with `coin` from `row` given its piece sums (shared memory, every
// piece of the row): the first index whose float32-rounded prefix exceeds u = coin * float32(total)
// among indices with r > 0; if rounding leaves none, the last index with r > 0; -1 if the row is
// all zero. Every thread returns the answer. (A caller that calls it again needs a barrier first:
// the all-zero answer is reached without a barrier after the located piece is read.)
template <int THREADS, class Row, class Acc>
__device__ __forceinline__ int sample_row(const Row& row, const Acc* psum, int piece_units, float coin,
                                          SearchSlots<Acc>* ws) {
  const int pieces = piece_count(row, piece_units);
  const int units = row.u.count();
  // Warp 0 locates the piece for the block: with every warp scanning the piece sums, their bank
  // conflicts serialised on shared memory (~5300 cycles at 251 pieces and 16 warps, kernels/NOTES.md).
  if (threadIdx.x < 32) {
    const Located<Acc> found = locate_piece(psum, pieces, coin);
    if (threadIdx.x == 0) ws->located = found;
  }
  __syncthreads();
  const Located<Acc> l = ws->located;
  if (l.piece >= 0) {
    const int k0 = l.piece * piece_units;
    return search_units<THREADS>(row, k0, min(k0 + piece_units, units), l.base, l.u, ws);
  }
  if (l.last_piece >= 0) {
    const int k0 = l.last_piece * piece_units;
    return search_units<THREADS>(row, k0, min(k0 + piece_units, units), Acc(0), flt_inf(), ws);
  }
  return -1;
}

// ---- work split over the blocks of a thread-block cluster ---------------------------------------

// A request's blocks: C blocks of one cluster (rank = chunk), or one block. Pieces are dealt in runs
// of WARPS, run after run to block after block: piece pc goes to block (pc / WARPS) % C, warp
// pc % WARPS.
struct Split {
  int C, chunk;
  bool clustered;
};

__device__ __forceinline__ Split request_split() {
  Split s;
  s.clustered = cluster_blocks() > 1;
  s.C = s.clustered ? static_cast<int>(cluster_blocks()) : 1;
  s.chunk = s.clustered ? static_cast<int>(cluster_rank()) : 0;
  return s;
}

template <int WARPS>
__device__ __forceinline__ int first_piece(const Split& sp) {
  return sp.chunk * WARPS + static_cast<int>(threadIdx.x >> 5);
}

// Piece sums of this block's pieces, stored in rank 0's psum (its own when not clustered). Rank 0
// reads them after hand_over_piece_sums.
template <int WARPS, int G, class Row>
__device__ __forceinline__ void split_piece_sums(const Row& row, double* psum, int piece_units, const Split& sp) {
  const int pieces = piece_count(row, piece_units);
  for (int pc = first_piece<WARPS>(sp); pc < pieces; pc += WARPS * sp.C) {
    const double s = piece_sum<G>(row, pc, piece_units);
    if ((threadIdx.x & 31) == 0) {
      if (sp.clustered) *in_cluster_block(psum + pc, 0) = s;
      else psum[pc] = s;
    }
  }
}

// The barrier after split_piece_sums: a cluster barrier (releasing the sums written into rank 0),
// or the block's own. Returns whether this block goes on to the final sample (rank 0 or the only
// block); the other ranks of a cluster are done.
__device__ __forceinline__ bool hand_over_piece_sums(const Split& sp) {
  if (sp.clustered) {
    cluster_arrive();
    cluster_wait();
    if (sp.chunk != 0) return false;
  } else {
    __syncthreads();
  }
  return true;
}

}  // namespace cupy_spec
