// Tree speculative sampling with draft probabilities: walk the draft tree, testing each child
// against the node's residual, which changes with every rejected sibling; then sample the
// correction / bonus token from the residual at the last accepted node.
//
// Semantics: cupy_spec/reference/tree_speculative_sampling.py. At a node with target row p and
// draft row q the walk keeps R (unnormalised residual), c (scale) and, without replacement, the
// set X of rejected tokens. After j rejections (tokens x_0..x_{j-1}, scales c_0 = 1, c_1, ..):
//
//   R_0[v] = E(p[v]),   R_{m+1}[v] = E(R_m[v] - flush(c_m * Q_m[v])),
//   Q_m[v] = 0 if (without replacement) v is one of x_0..x_{m-1}, else E(q[v]),
//   c_m = flush(N_m / S_m) (0 if S_m = 0),  N_m = flush(f32(sum R_m)),  S_m = flush(f32(sum Q_m))
//   (S_m = 1 with replacement).
//
// R_j is never stored: any element is recomputed from p[v], q[v], the scales and the rejected
// tokens by that chain of j steps (the reference's operations, in its order). A test needs R_j at
// one token (thread 0, from gathered values); a scale c_j needs a pass over the node's two rows
// (N_j and S_j, float64 sums rounded once: sampling.cuh); the final sample is one more pass plus a
// rescan of one piece. Cost per node with J rejections followed by another sibling: J passes of
// O(V j) operations, bounded by O(n^2 V) per request; rows are re-read from L2.
//
// Launch: grid (bs, C), THREADS threads (a template argument). One block per request, or a
// thread-block cluster of C blocks (sm_90 and later): every block of the cluster walks the tree
// itself (same data, same operations, so the same decisions), each pass is split over the C
// blocks, whose partial sums every block adds in rank order (so every block gets the same bits).
// The final sample's piece sums go to rank 0, which finishes and writes the outputs.
//
// Malformed input as in the target-only op: links outside [0, n) mean "none"; a revisited node or
// a child whose token is outside [0, V) or whose retrive_index is outside [0, P) ends the walk.
#pragma once
#include "sampling.cuh"

namespace cupy_spec {

// TreeSpeculativeSamplingParams and its constants (BATCHES, SMEM_PER_NODE) are generated
// from the argument table in cupy_spec/tree_speculative_sampling.py.
using TreeDraftParams = TreeSpeculativeSamplingParams;

// Dynamic shared memory: 8 * pieces + SMEM_PER_NODE * n bytes (psum first, for alignment).
struct DSmem {
  double* psum;  // [pieces] piece sums of the final sample
  TreeNode* node;   // [n]
  float* coin;   // [n] clamped coins
  float* gp;     // [n] raw target prob of node i's token in its (guessed) parent's row
  float* gq;     // [n] raw draft prob of the same
  float* scl;    // [n] scales c_0..c_j at the current node
  int* parent;   // [n] guessed parent (max over the child lists naming the node)
  int* seen;     // [n] visited flags
  int* path;     // [n] accepted nodes, root first
  int* xs;       // [n] tokens rejected at the current node, in order
};

static_assert(sizeof(TreeNode) + 4 * sizeof(float) + 4 * sizeof(int) == TreeDraftParams::SMEM_PER_NODE,
              "shared layout and host size differ");

__device__ __forceinline__ DSmem carve_dsmem(unsigned char* base, int n, int pieces) {
  DSmem s;
  s.psum = reinterpret_cast<double*>(base);
  s.node = reinterpret_cast<TreeNode*>(s.psum + pieces);
  float* f = reinterpret_cast<float*>(s.node + n);
  s.coin = f;
  s.gp = f + n;
  s.gq = f + 2 * n;
  s.scl = f + 3 * n;
  int* i = reinterpret_cast<int*>(f + 4 * n);
  s.parent = i;
  s.seen = i + n;
  s.path = i + 2 * n;
  s.xs = i + 3 * n;
  return s;
}

// The walk's state, shared by the block (written by thread 0 between barriers).
struct DWalk {
  int cur;         // current node
  int child;       // next child to try (-1: none)
  int count;       // accepted draft tokens
  int j;           // rejections at the current node
  int have_scale;  // scl[j] is known
  int done;
  int root_ok;
  int root_index;  // retrive_index[b, 0] as written to accept_index[b, 0]
  int lo, hi;      // span of xs[0..j-1] (lo > hi: empty)
  int passes;      // passes so far (parity of the cluster's exchange slots)
  float final_coin;
};

// Residual R_j and draft mass Q_j of a node's row after j rejections. With no rejection (j = 0)
// R_0 is the target row itself and Q is not needed: d is null and the draft row is not read.
template <bool REPLACEMENT>
struct TreeRow {
  static constexpr bool kInteriorLoads = true;
  const float* t;
  const float* d;  // null when j == 0
  RowUnits u;
  bool dvec;
  int j;
  const float* scl;
  const int* xs;
  int lo, hi;

  template <bool INTERIOR = false>
  __device__ __forceinline__ int load(int k, Unit& x) const {
    const int s = load_unit<true, INTERIOR>(t, u, k, true, x.t);
    if (d != nullptr) {
      load_unit<true, INTERIOR>(d, u, k, dvec, x.d);
    } else {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) x.d[jj] = 0.0f;
    }
    return s;
  }
  __device__ __forceinline__ void values(const Unit& x, int start, float r[4], float q[4]) const {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int v = start + jj;
      int first = kIntMax;  // first rejection of v (Q_m[v] = 0 for m > first)
      if (!REPLACEMENT && v >= lo && v <= hi) {
        for (int m = 0; m < j; ++m) {
          if (xs[m] == v) {
            first = m;
            break;
          }
        }
      }
      const float qv = effective_prob(x.d[jj]);
      float R = effective_prob(x.t[jj]);
      for (int m = 0; m < j && R > 0.0f; ++m)  // R == 0 stays 0 (E of a value <= 0 or NaN)
        R = positive_normal(R - flush_subnormal(scl[m] * (m > first ? 0.0f : qv)));
      r[jj] = R;
      q[jj] = first < j ? 0.0f : qv;
    }
  }
};

template <bool REPLACEMENT>
__device__ __forceinline__ TreeRow<REPLACEMENT> tree_row(const TreeDraftParams& p, const DSmem& s, long long b,
                                                         int node, int j, int lo, int hi) {
  TreeRow<REPLACEMENT> row;
  const long long off = (b * p.n + node) * p.V;
  row.t = p.target_probs + off;
  const float* d = p.draft_probs + off;
  row.d = j == 0 ? nullptr : d;
  row.u = row_units(row.t, static_cast<int>(p.V));
  row.dvec = ((reinterpret_cast<unsigned long long>(row.t) ^ reinterpret_cast<unsigned long long>(d)) & 15ull) == 0;
  row.j = j;
  row.scl = s.scl;
  row.xs = s.xs;
  row.lo = lo;
  row.hi = hi;
  return row;
}

// Loads request b's tree into shared memory and gathers, for every node, the target and draft
// probabilities of its token in its parent's row (one round of parallel loads, so the walk's
// tests read shared memory only).
__device__ __forceinline__ void load_draft_tree(const TreeDraftParams& p, const DSmem& s, long long b, DWalk* w) {
  const int n = load_tree_nodes(p, s.node, s.coin, s.parent, s.seen, b, w);
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    const int par = s.parent[c], tok = s.node[c].token;
    const long long off = (b * p.n + par) * p.V + tok;
    const bool ok = par >= 0 && tok >= 0;
    s.gp[c] = ok ? __ldg(p.target_probs + off) : 0.0f;
    s.gq[c] = ok ? __ldg(p.draft_probs + off) : 0.0f;
  }
  __syncthreads();
}

// Thread 0: the walk from its current state until it ends (done = 1) or a test needs the scale of
// a node after a rejection that no pass has computed yet (returns with done = 0, have_scale = 0).
template <bool REPLACEMENT>
__device__ __forceinline__ void walk_steps(const TreeDraftParams& p, const DSmem& s, long long b, DWalk* w) {
  const int S = static_cast<int>(p.S);
  while (true) {
    const int c = w->child;
    if (c < 0 || s.seen[c]) break;
    const TreeNode nd = s.node[c];
    if (nd.token < 0 || nd.index < 0) break;  // malformed child ends the walk (its coin unused)
    if (!w->have_scale) return;               // a pass computes scl[j] first
    s.seen[c] = 1;
    const int cur = w->cur, j = w->j, x = nd.token;
    float pr, qr;
    if (s.parent[c] == cur) {
      pr = s.gp[c];
      qr = s.gq[c];
    } else {  // the child is in another node's list too (malformed tree): read the current row
      const long long off = (b * p.n + cur) * p.V + x;
      pr = __ldg(p.target_probs + off);
      qr = __ldg(p.draft_probs + off);
    }
    int first = kIntMax;
    if (!REPLACEMENT) {
      for (int m = 0; m < j; ++m) {
        if (s.xs[m] == x) {
          first = m;
          break;
        }
      }
    }
    const float qv = effective_prob(qr);
    float R = effective_prob(pr);
    for (int m = 0; m < j && R > 0.0f; ++m) R = positive_normal(R - flush_subnormal(s.scl[m] * (m > first ? 0.0f : qv)));
    const float Qj = first < j ? 0.0f : qv;
    const float lhs = flush_subnormal(flush_subnormal(s.coin[c] * Qj) * s.scl[j]);
    if (lhs < R) {
      ++w->count;
      s.path[w->count] = c;
      w->cur = c;
      w->j = 0;
      s.scl[0] = 1.0f;
      w->have_scale = 1;
      w->lo = kIntMax;
      w->hi = -1;
      w->child = w->count < S - 1 ? nd.child : -1;
    } else {
      s.xs[j] = x;
      w->j = j + 1;
      w->have_scale = 0;
      w->lo = min(w->lo, x);
      w->hi = max(w->hi, x);
      w->child = nd.sibling;
    }
  }
  w->done = 1;
}

// THREADS and MIN_BLOCKS: the build (block size, blocks per SM whose registers it budgets for) that
// the plan picks: 512 threads and one block per SM, or, from the batch size where that build gives a
// request at most 2 blocks, 256 threads and four per SM in clusters of 8 (in as many waves as needed).
template <bool REPLACEMENT, int THREADS, int MIN_BLOCKS>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) tree_speculative_sampling_kernel(const TreeDraftParams p) {
  follow_previous_grid();  // first: before any global memory access
  constexpr int WARPS = THREADS / 32;
  constexpr int G = TreeDraftParams::BATCHES;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ DWalk w;
  __shared__ SearchSlots<double> slots;
  __shared__ double wpart[WARPS][2];   // per-warp partial N, S of a pass
  __shared__ double xpart[2][2];       // this block's partial N, S, by pass parity (read by the cluster)

  const Split sp = request_split();
  if (!sp.clustered && blockIdx.y != 0) return;  // the plan never launches this; stay single-writer
  // Blocks of a cluster read each other's shared memory, which first needs every block started:
  // this arrive pairs with the wait after the tree is loaded.
  if (sp.clustered) cluster_arrive_relaxed();

  const long long b = blockIdx.x;
  const int n = static_cast<int>(p.n), V = static_cast<int>(p.V);
  const int piece_units = static_cast<int>(p.piece_units);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const DSmem s = carve_dsmem(smem_raw, n, static_cast<int>(p.pieces));

  load_draft_tree(p, s, b, &w);
  if (threadIdx.x == 0) {
    w.cur = 0;
    w.count = 0;
    w.j = 0;
    w.have_scale = 1;
    s.scl[0] = 1.0f;
    w.lo = kIntMax;
    w.hi = -1;
    w.passes = 0;
    w.done = 0;
    w.root_ok = s.node[0].index >= 0;
    s.seen[0] = 1;
    s.path[0] = 0;
    w.child = (w.root_ok && p.S > 1) ? s.node[0].child : -1;
  }
  if (sp.clustered) cluster_wait();

  // The walk: thread 0 advances it; whenever a test needs a scale, the whole request makes a pass.
  while (true) {
    if (threadIdx.x == 0) walk_steps<REPLACEMENT>(p, s, b, &w);
    __syncthreads();
    if (w.done) break;
    const int j = w.j, parity = w.passes & 1;
    const TreeRow<REPLACEMENT> row = tree_row<REPLACEMENT>(p, s, b, w.cur, j, w.lo, w.hi);
    double rs = 0.0, qs = 0.0;
    const int pieces = piece_count(row, piece_units);
    for (int pc = first_piece<WARPS>(sp); pc < pieces; pc += WARPS * sp.C) {
      const int k0 = pc * piece_units;
      lane_sums<G>(row, k0, min(k0 + piece_units, row.u.count()), rs, qs);
    }
    rs = warp_sum(rs);
    qs = warp_sum(qs);
    if (lane == 0) {
      wpart[warp][0] = rs;
      wpart[warp][1] = qs;
    }
    __syncthreads();
    double N = 0.0, Q = 0.0;
    if (threadIdx.x == 0) {
      for (int v = 0; v < WARPS; ++v) {
        N += wpart[v][0];
        Q += wpart[v][1];
      }
      xpart[parity][0] = N;
      xpart[parity][1] = Q;
    }
    if (sp.clustered) {
      cluster_arrive();  // release: xpart
      cluster_wait();
    }
    if (threadIdx.x == 0) {
      if (sp.clustered) {  // every block adds the C partials in rank order: the same bits everywhere
        N = 0.0;
        Q = 0.0;
        for (int r = 0; r < sp.C; ++r) {
          const double* other = in_cluster_block(&xpart[parity][0], static_cast<unsigned>(r));
          N += other[0];
          Q += other[1];
        }
      }
      const float Nf = sum_to_float(N);
      const float Sf = REPLACEMENT ? 1.0f : sum_to_float(Q);
      s.scl[j] = Sf > 0.0f ? flush_subnormal(__fdiv_rn(Nf, Sf)) : 0.0f;
      w.have_scale = 1;
      ++w.passes;
    }
    __syncthreads();
  }

  if (!w.root_ok) {
    if (sp.chunk == 0 && threadIdx.x == 0) write_tree_outputs(p, s, w, b, 0, [] {});
    return;
  }

  // The final sample from R at the final node (its target row if nothing was rejected there).
  const int fnode = w.cur, fj = w.j;
  const TreeRow<REPLACEMENT> row = tree_row<REPLACEMENT>(p, s, b, fnode, fj, w.lo, w.hi);
  split_piece_sums<WARPS, G>(row, s.psum, piece_units, sp);
  if (!hand_over_piece_sums(sp)) return;
  int token = sample_row<THREADS>(row, s.psum, piece_units, w.final_coin, &slots);
  if (token < 0 && fj > 0) {  // R all zero: sample the node's target row instead
    __syncthreads();          // every warp has read psum
    const TreeRow<REPLACEMENT> plain = tree_row<REPLACEMENT>(p, s, b, fnode, 0, kIntMax, -1);
    block_piece_sums<WARPS, G>(plain, s.psum, piece_units);
    token = sample_row<THREADS>(plain, s.psum, piece_units, w.final_coin, &slots);
  }
  if (token < 0) token = V - 1;
  if (threadIdx.x == 0) write_tree_outputs(p, s, w, b, token, [] {});
}

}  // namespace cupy_spec
