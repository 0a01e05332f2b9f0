// Tree speculative sampling (target-only verification): walk the draft tree, accept a path, then
// sample the correction / bonus token from the residual at the last accepted node.
//
// Launch: grid (bs, C), THREADS threads. Block (b, c) walks request b's tree (every block of the
// request walks it redundantly: metadata and the gathered child probabilities come from L2), then
// sums its share of the final residual row's pieces of 32 * G 16-byte units (one round of G batches
// of loads per warp; a multiple of that when a row would need more than MAX_PIECES pieces).
// With C > 1, either the C blocks form a thread-block cluster (sm_90 and later) and send their
// piece sums to the shared memory of rank 0, which finishes, or the sums go to global scratch and
// the last block of the request to arrive (a counter in the per-stream scratch) finishes. With C == 1 the block finishes
// alone. The finisher's warp 0 scans the piece sums and finds the piece that holds u = coin * sum(r);
// the whole block rescans that piece only (sampling.cuh's search, in float32 as the reference;
// two barriers per 256 units) and writes every output of the request.
//
// Semantics are those of cupy_spec/reference/tree_speculative_sampling_target_only.py, including the rules for malformed input: links
// outside [0, n) mean "none", a revisited node or an out-of-range token id / retrive_index ends the
// walk, and NaN / inf / negative / subnormal probabilities count as 0.
#pragma once
#include "sampling.cuh"

namespace cupy_spec {

// The parameter struct TreeSpeculativeSamplingTargetOnlyParams and the constants (THREADS,
// MAX_PIECES_PER_THREAD, BATCHES_*, BLOCKS_PER_SM, SMEM_PER_NODE) are generated from the argument
// table in cupy_spec/tree_speculative_sampling_target_only.py, so host and kernel share them.
using TreeSpecParams = TreeSpeculativeSamplingTargetOnlyParams;

// Shared-memory layout, carved from dynamic shared memory: SMEM_PER_NODE * n + 4 * pieces bytes.
struct Smem {
  TreeNode* node;  // [n]
  float* coin;     // [n] clamped coins
  float* prob;     // [n] target prob of node i in the row of its (guessed) parent, raw
  int* parent;     // [n] guessed parent (max over child lists naming the node)
  int* seen;       // [n] visited flags
  int* path;       // [n] accepted nodes, root first
  int* ev_node;    // [n] rejection events: node whose row was written
  int* ev_token;   // [n]
  float* ev_val;   // [n]
  float* psum;     // [pieces]
};

static_assert(sizeof(TreeNode) + 8 * sizeof(int) == TreeSpecParams::SMEM_PER_NODE, "Smem layout and host size differ");

__device__ __forceinline__ Smem carve_smem(unsigned char* base, int n) {
  Smem s;
  s.node = reinterpret_cast<TreeNode*>(base);
  float* f = reinterpret_cast<float*>(s.node + n);
  s.coin = f;
  s.prob = f + n;
  int* i = reinterpret_cast<int*>(f + 2 * n);
  s.parent = i;
  s.seen = i + n;
  s.path = i + 2 * n;
  s.ev_node = i + 3 * n;
  s.ev_token = i + 4 * n;
  s.ev_val = reinterpret_cast<float*>(i + 5 * n);
  s.psum = s.ev_val + n;
  return s;
}

// Result of the walk, shared by the whole block.
struct Walk {
  int count;      // accepted draft tokens
  int final_node; // node the final token is sampled at
  int nev;        // rejection events
  int rej_begin;  // events from here on are rejections at the final node
  int rej_lo, rej_hi;  // token range of those rejections
  int root_ok;
  int root_index;   // retrive_index[b, 0] as written to accept_index[b, 0] (read in load_tree)
  float final_coin; // clamped final coin (read in load_tree, off the finisher's critical path)
  int is_finisher;
};


// Loads request b's tree into shared memory and gathers, for every node, its probability in the
// row of its parent (one round of parallel loads, so the walk itself reads only shared memory).
// The final coin and the root's index are read here too, so no later phase waits on a load for them.
__device__ __forceinline__ void load_tree(const TreeSpecParams& p, const Smem& s, long long b, Walk* w) {
  const int n = load_tree_nodes(p, s.node, s.coin, s.parent, s.seen, b, w);
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    const int par = s.parent[c], tok = s.node[c].token;
    s.prob[c] = (par >= 0 && tok >= 0) ? __ldg(p.target_probs + ((b * p.n + par) * p.V + tok)) : 0.0f;
  }
  __syncthreads();
}

// The walk (one thread): the reference semantics, on shared memory. Fills *w and the path/event arrays.
__device__ __forceinline__ void walk_tree(const TreeSpecParams& p, const Smem& s, long long b, Walk* w) {
  const int S = static_cast<int>(p.S);
  const float thr_single = static_cast<float>(p.threshold_single);
  const float thr_acc = fmaxf(static_cast<float>(p.threshold_acc), 1e-9f);
  int cur = 0, count = 0, nev = 0, rej_begin = 0;
  float coin = s.coin[0], acc = 0.0f;
  s.seen[0] = 1;
  s.path[0] = 0;
  const int root_ok = s.node[0].index >= 0;
  int c = (root_ok && S > 1) ? s.node[0].child : -1;
  while (c >= 0 && !s.seen[c]) {
    s.seen[c] = 1;
    const TreeNode nd = s.node[c];
    if (nd.token < 0 || nd.index < 0) break;  // malformed child ends the walk
    const float raw = s.parent[c] == cur ? s.prob[c] : __ldg(p.target_probs + ((b * p.n + cur) * p.V + nd.token));
    const float q = effective_prob(raw);
    acc = acc + q;
    if (q > 0.0f && (coin < __fdiv_rn(acc, thr_acc) || q >= thr_single)) {
      s.path[++count] = c;
      cur = c;
      coin = s.coin[c];
      acc = 0.0f;
      rej_begin = nev;
      c = count < S - 1 ? nd.child : -1;
    } else {
      s.ev_node[nev] = cur;
      s.ev_token[nev] = nd.token;
      s.ev_val[nev] = raw;
      ++nev;
      c = nd.sibling;
    }
  }
  int lo = kIntMax, hi = -1;
  for (int e = rej_begin; e < nev; ++e) {
    lo = min(lo, s.ev_token[e]);
    hi = max(hi, s.ev_token[e]);
  }
  w->count = count;
  w->final_node = cur;
  w->nev = nev;
  w->rej_begin = rej_begin;
  w->rej_lo = lo;
  w->rej_hi = hi;
  w->root_ok = root_ok;
}

// Raw target (and draft) values of unit k: loads only, so callers can put several in flight.
template <bool HAS_DRAFT>
__device__ __forceinline__ int load_residual_inputs(const float* row, const float* drow, const RowUnits& u, int k,
                                                    bool dvec, float t[4], float d[4]) {
  const int start = load_unit<true>(row, u, k, true, t);
  if (HAS_DRAFT && drow != nullptr) load_unit<false>(drow, u, k, dvec, d);
  return start;
}

// Residual values of one unit from its loaded target (and draft) values, before masking.
template <bool HAS_DRAFT>
__device__ __forceinline__ void residual_values(const float t[4], const float d[4], bool has_draft_row, float r[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) r[j] = effective_prob(t[j]);
  if (HAS_DRAFT && has_draft_row) {
#pragma unroll
    for (int j = 0; j < 4; ++j) r[j] = effective_prob(r[j] - flush_subnormal(d[j]));
  }
}

// Residual of the unit starting at `start` from its loaded values (slots outside the row are 0),
// with the rejected children of the final node set to 0.
template <bool HAS_DRAFT>
__device__ __forceinline__ void residual_from(const float t[4], const float d[4], bool has_draft_row, int start,
                                              const Smem& s, const Walk& w, float r[4]) {
  residual_values<HAS_DRAFT>(t, d, has_draft_row, r);
  if (w.rej_hi >= start && w.rej_lo <= start + 3) {
    for (int e = w.rej_begin; e < w.nev; ++e) {
      const int j = s.ev_token[e] - start;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        if (j == jj) r[jj] = 0.0f;
    }
  }
}

// Whether the token of a rejected child of the final node lies in [lo, hi]. Only pieces that hold
// one need masking. There are few such children, so every one is checked: their span
// [rej_lo, rej_hi] alone can cover most of the row and would send most pieces down the masked path.
__device__ __forceinline__ bool rejection_in(const Smem& s, const Walk& w, int lo, int hi) {
  if (w.rej_hi < lo || w.rej_lo > hi) return false;
  for (int e = w.rej_begin; e < w.nev; ++e) {
    const int t = s.ev_token[e];
    if (t >= lo && t <= hi) return true;
  }
  return false;
}

// Lane sum over units [k0, k1) of an interior piece: every unit is an aligned quad of both rows
// (q, dq index the quads from unit 1), the piece is a whole number of G-batch rounds, and no
// rejected child lies in it, so no unit needs a bounds check or masking.
template <bool READ_DRAFT, int G>
__device__ __forceinline__ float sum_interior(const float4* q, const float4* dq, int k0, int k1) {
  float acc = 0.0f;
  for (int kb = k0 + (threadIdx.x & 31) - 1; kb < k1 - 1; kb += 32 * G) {
    float4 t[G], d[G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      t[i] = __ldg(q + kb + 32 * i);
      if (READ_DRAFT) d[i] = dq[kb + 32 * i];  // plain load: the kernel writes draft_probs
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const float tv[4] = {t[i].x, t[i].y, t[i].z, t[i].w};
      const float dv[4] = {READ_DRAFT ? d[i].x : 0.0f, READ_DRAFT ? d[i].y : 0.0f, READ_DRAFT ? d[i].z : 0.0f,
                           READ_DRAFT ? d[i].w : 0.0f};
      float r[4];
      residual_values<READ_DRAFT>(tv, dv, READ_DRAFT, r);
      acc += (r[0] + r[1]) + (r[2] + r[3]);
    }
  }
  return acc;
}

// Sum of piece pc's residual values, computed by one warp. A piece is a run of batches of 32 units
// (one unit per lane, so a batch is one coalesced 512-byte load per row); the loads of G batches
// are issued before any arithmetic, so G 16-byte loads per lane and row are in flight. Each lane
// sums its units in order, then the warp reduces once per piece.
template <bool HAS_DRAFT, int G>
__device__ __forceinline__ float sum_piece(const float* row, const float* drow, const RowUnits& u, bool dvec,
                                           const Smem& s, const Walk& w, int pc, int piece_units) {
  const int lane = threadIdx.x & 31;
  const int k0 = pc * piece_units, k1 = min(k0 + piece_units, u.count());
  if (k0 >= 1 && k1 <= u.nq + 1 && dvec && !rejection_in(s, w, u.start(k0), u.start(k1 - 1) + 3)) {
    const float4* q = reinterpret_cast<const float4*>(row + u.head);
    const float acc = (HAS_DRAFT && drow != nullptr)
                          ? sum_interior<true, G>(q, reinterpret_cast<const float4*>(drow + u.head), k0, k1)
                          : sum_interior<false, G>(q, nullptr, k0, k1);
    return warp_sum(acc);
  }
  // Edge pieces (row ends, rejected children, a draft row of another alignment): bounds-checked
  // and masked units, fewer batches at a time to keep registers for the interior path.
  constexpr int GE = G / 2;
  float acc = 0.0f;
  for (int kb = k0; kb < k1; kb += 32 * GE) {
    float t[GE][4], d[GE][4];
#pragma unroll
    for (int i = 0; i < GE; ++i) {  // units past the piece load unit 0 instead, and are discarded
      const int k = kb + 32 * i + lane;
      load_residual_inputs<HAS_DRAFT>(row, drow, u, k < k1 ? k : 0, dvec, t[i], d[i]);
    }
#pragma unroll
    for (int i = 0; i < GE; ++i) {
      const int k = kb + 32 * i + lane;
      if (k < k1) {
        float r[4];
        residual_from<HAS_DRAFT>(t[i], d[i], drow != nullptr, u.start(k), s, w, r);
        acc += (r[0] + r[1]) + (r[2] + r[3]);  // each lane adds its units in order, as sum_interior
      }
    }
  }
  return warp_sum(acc);
}

// The final node's residual row, as sampling.cuh's search reads a row (its Row policy).
template <bool HAS_DRAFT>
struct FinalRow {
  const float* t;
  const float* d;  // nullptr: nothing subtracted
  RowUnits u;
  bool dvec;
  const Smem& s;
  const Walk& w;

  __device__ __forceinline__ int load(int k, Unit& x) const {
    return load_residual_inputs<HAS_DRAFT>(t, d, u, k, dvec, x.t, x.d);
  }
  __device__ __forceinline__ void values(const Unit& x, int start, float r[4], float* /*q: unused*/) const {
    residual_from<HAS_DRAFT>(x.t, x.d, d != nullptr, start, s, w, r);
  }
};

// Writes every output of request b (one thread); before the count, the raw target probability of
// every rejected child into draft_probs at its token, as sgl-kernel's op does.
__device__ __forceinline__ void write_outputs(const TreeSpecParams& p, const Smem& s, const Walk& w, long long b,
                                              int token) {
  write_tree_outputs(p, s, w, b, token, [&] {
    if (p.draft_probs != nullptr)
      for (int e = 0; e < w.nev; ++e) p.draft_probs[(b * p.n + s.ev_node[e]) * p.V + s.ev_token[e]] = s.ev_val[e];
  });
}

template <bool HAS_DRAFT>
__global__ void __launch_bounds__(TreeSpecParams::THREADS, TreeSpecParams::BLOCKS_PER_SM)
    tree_speculative_sampling_target_only_kernel(const TreeSpecParams p) {
  follow_previous_grid();  // first: before any global memory access
  constexpr int THREADS = TreeSpecParams::THREADS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ Walk w;
  __shared__ SearchSlots<float> slots;
  constexpr int WARPS = THREADS / 32;
  const long long b = blockIdx.x;
  const int chunk = blockIdx.y, C = static_cast<int>(p.chunks);
  const int V = static_cast<int>(p.V);
  const int piece_units = static_cast<int>(p.piece_units);

  const int n = static_cast<int>(p.n);
  const int stride = static_cast<int>(p.pieces);
  const Smem s = carve_smem(smem_raw, n);

  // A cluster launch groups the C blocks of a request into one cluster (rank = chunk). Its blocks
  // then send their piece sums to rank 0's shared memory, which first requires every block of the
  // cluster to have started: the arrive here pairs with the wait before phase 1.
  const bool clustered = cluster_blocks() > 1;
  if (clustered) cluster_arrive_relaxed();

  load_tree(p, s, b, &w);
  if (threadIdx.x == 0) walk_tree(p, s, b, &w);
  __syncthreads();

  if (!w.root_ok) {
    if (clustered) cluster_wait();
    if (chunk == 0 && threadIdx.x == 0) write_outputs(p, s, w, b, 0);
    return;
  }
  const bool bonus = w.count == p.S - 1;
  const float* row = p.target_probs + (b * p.n + w.final_node) * p.V;
  const float* drow = (HAS_DRAFT && !bonus) ? p.draft_probs + (b * p.n + w.final_node) * p.V : nullptr;
  const RowUnits u = row_units(row, V);
  const bool dvec = drow == nullptr ||
                    ((reinterpret_cast<unsigned long long>(row) ^ reinterpret_cast<unsigned long long>(drow)) & 15ull) == 0;
  const int pieces = (u.count() + piece_units - 1) / piece_units;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // Phase 1: the request's pieces are dealt out in runs of WARPS, run after run to block after
  // block: piece pc goes to block (pc / WARPS) % C, warp pc % WARPS. So all C * WARPS warps of the
  // request sweep its row together and share the work evenly (contiguous runs per warp left some
  // warps idle and let the blocks of a request drift apart). Batches in flight: 8 16-byte loads
  // per lane either way. The host sets piece_units to a multiple of 32 * G (its plan uses the same
  // constants).
  constexpr int G = HAS_DRAFT ? TreeSpecParams::BATCHES_DRAFT : TreeSpecParams::BATCHES_NONE;
  if (clustered) cluster_wait();
  for (int pc = chunk * WARPS + warp; pc < pieces; pc += WARPS * C) {
    const float sum = sum_piece<HAS_DRAFT, G>(row, drow, u, dvec, s, w, pc, piece_units);
    if (lane == 0) {
      if (C == 1) {
        s.psum[pc] = sum;
      } else if (clustered) {
        *in_cluster_block(s.psum + pc, 0) = sum;
      } else {
        p.piece_sums[b * stride + pc] = sum;
      }
    }
  }

  // Phase 2: one block finishes the request. In a cluster it is rank 0, which holds every piece sum
  // once the cluster barrier completes. Otherwise (C > 1) it is the last block to arrive, which
  // reloads the sums into shared memory in one round of loads (at most MAX_PIECES_PER_THREAD per
  // thread). Arrivals are counted modulo C: the block whose arrival brings the request's counter to
  // a multiple of C finishes and then takes C off again, so a counter is 0 between launches. If
  // launches sharing the scratch ever interleave (graphs captured on one stream replayed at once on
  // two streams, which is not supported), their outputs are wrong, but every C-th arrival still
  // finishes and subtracts C, so the counter returns to 0 and later launches are unaffected.
  if (clustered) {
    cluster_arrive();
    cluster_wait();
    if (cluster_rank() != 0) return;
  } else {
    __syncthreads();
  }
  if (C > 1 && !clustered) {
    if (threadIdx.x == 0) {
      unsigned int done;
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(done) : "l"(p.counters + b) : "memory");
      w.is_finisher = done % static_cast<unsigned int>(C) == static_cast<unsigned int>(C - 1);
    }
    __syncthreads();
    if (!w.is_finisher) return;
    const float* sums = p.piece_sums + b * stride;
    float v[TreeSpecParams::MAX_PIECES_PER_THREAD];
#pragma unroll
    for (int i = 0; i < TreeSpecParams::MAX_PIECES_PER_THREAD; ++i) {
      const int j = static_cast<int>(threadIdx.x) + THREADS * i;
      v[i] = j < pieces ? __ldcg(sums + j) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < TreeSpecParams::MAX_PIECES_PER_THREAD; ++i) {
      const int j = static_cast<int>(threadIdx.x) + THREADS * i;
      if (j < pieces) s.psum[j] = v[i];
    }
    if (threadIdx.x == 0) atomicSub(p.counters + b, static_cast<unsigned int>(C));
    __syncthreads();
  }

  // Phase 3: find the piece holding u, then the token inside it (float32 sums, as the reference).
  // If rounding leaves u past the piece's last positive element, that element; if u is past every
  // piece, the row's last positive element (in the last piece with a positive sum); if the residual
  // is all zero, V - 1.
  const FinalRow<HAS_DRAFT> frow{row, drow, u, dvec, s, w};
  const int token = sample_row<THREADS>(frow, s.psum, piece_units, w.final_coin, &slots);
  if (threadIdx.x == 0) write_outputs(p, s, w, b, token < 0 ? V - 1 : token);
}

}  // namespace cupy_spec
