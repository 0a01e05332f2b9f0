// Tree speculative sampling (target-only verification): walk the draft tree, accept a path, then
// sample the correction / bonus token from the residual at the last accepted node.
//
// Launch: grid (bs, C), THREADS threads. Block (b, c) walks request b's tree (every block of the
// request walks it redundantly: metadata and the gathered child probabilities come from L2), then
// sums chunk c of the final residual row in pieces of 32 units (128 floats). With C > 1 the pieces'
// sums go to global scratch and the last block of the request to arrive (a counter) finishes; with
// C == 1 the block finishes alone. The finisher scans the piece sums, finds the piece that holds
// u = coin * sum(r), rescans that piece only, and writes every output of the request.
//
// Semantics are those of cupy_spec/reference.py, including the rules for malformed input: links
// outside [0, n) mean "none", a revisited node or an out-of-range token id / retrive_index ends the
// walk, and NaN / inf / negative / subnormal probabilities count as 0.
#pragma once
#include "common.cuh"

namespace cupy_spec {

struct TreeSpecParams {
  const long long* candidates;            // [bs, n]
  const long long* retrive_index;         // [bs, n]
  const long long* retrive_next_token;    // [bs, n]
  const long long* retrive_next_sibling;  // [bs, n]
  const float* uniform_samples;           // [bs, n]
  const float* final_coins;               // [bs]
  const float* target_probs;              // [bs, n, V]
  float* draft_probs;                     // [bs, n, V] or null
  int* predicts;                          // [P]
  int* accept_index;                      // [bs, S]
  int* accept_token_num;                  // [bs]
  float* piece_sums;                      // scratch [bs, pieces] (C > 1)
  int* piece_last;                        // scratch [bs, pieces] (C > 1)
  unsigned int* counters;                 // scratch [bs], zero between launches (C > 1)
  long long bs, n, S, V, P;
  long long chunks;                       // C: blocks per request
  long long piece_units;                  // units per piece: 32 * G
  long long pieces;                       // max pieces per row: ceil((V / 4 + 2) / piece_units)
  double threshold_single, threshold_acc;
};

// Per-node data in shared memory: token (or -1 if outside [0, V)), retrive_index (or -1 if outside
// [0, P)), first child and next sibling (or -1 if outside [0, n)).
struct Node {
  int token, index, child, sibling;
};

// Shared-memory layout, carved from dynamic shared memory: 48 * n + 8 * pieces bytes.
struct Smem {
  Node* node;      // [n]
  float* coin;     // [n] clamped coins
  float* prob;     // [n] target prob of node i in the row of its (guessed) parent, raw
  int* parent;     // [n] guessed parent (max over child lists naming the node)
  int* seen;       // [n] visited flags
  int* path;       // [n] accepted nodes, root first
  int* ev_node;    // [n] rejection events: node whose row was written
  int* ev_token;   // [n]
  float* ev_val;   // [n]
  float* psum;     // [pieces]
  int* plast;      // [pieces]
};

__device__ __forceinline__ Smem carve_smem(unsigned char* base, int n, int pieces) {
  Smem s;
  s.node = reinterpret_cast<Node*>(base);
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
  s.plast = reinterpret_cast<int*>(s.psum + pieces);
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
  int is_finisher;
  float u;
  int piece;      // piece holding u (or -1)
  float base;     // prefix sum before that piece
};

__device__ __forceinline__ int link(long long x, long long n) { return (x >= 0 && x < n) ? static_cast<int>(x) : -1; }

// Loads request b's tree into shared memory and gathers, for every node, its probability in the
// row of its parent (one round of parallel loads, so the walk itself reads only shared memory).
__device__ __forceinline__ void load_tree(const TreeSpecParams& p, const Smem& s, long long b) {
  const int n = static_cast<int>(p.n);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long g = b * p.n + i;
    const long long t = p.candidates[g], r = p.retrive_index[g];
    s.node[i] = Node{(t >= 0 && t < p.V) ? static_cast<int>(t) : -1, (r >= 0 && r < p.P) ? static_cast<int>(r) : -1,
                     link(p.retrive_next_token[g], p.n), link(p.retrive_next_sibling[g], p.n)};
    s.coin[i] = clamp_coin(p.uniform_samples[g]);
    s.parent[i] = -1;
    s.seen[i] = 0;
  }
  __syncthreads();
  // Thread i follows node i's child list (at most n steps, so cycles end) and claims its children.
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    int c = s.node[i].child;
    for (int steps = 0; c >= 0 && steps < n; ++steps) {
      atomicMax(&s.parent[c], i);
      c = s.node[c].sibling;
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    const int par = s.parent[c], tok = s.node[c].token;
    s.prob[c] = (par >= 0 && tok >= 0) ? __ldg(p.target_probs + ((b * p.n + par) * p.V + tok)) : 0.0f;
  }
  __syncthreads();
}

// The walk (one thread): SPEC semantics on shared memory. Fills *w and the path/event arrays.
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
    const Node nd = s.node[c];
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

// Residual of the unit starting at `start` from its loaded values (slots outside the row are 0).
template <bool HAS_DRAFT>
__device__ __forceinline__ void residual_from(const float t[4], const float d[4], bool has_draft_row, int start,
                                              const Smem& s, const Walk& w, float r[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) r[j] = effective_prob(t[j]);
  if (HAS_DRAFT && has_draft_row) {
#pragma unroll
    for (int j = 0; j < 4; ++j) r[j] = effective_prob(r[j] - flush_subnormal(d[j]));
  }
  if (w.rej_hi >= start && w.rej_lo <= start + 3) {  // rejected children of the final node -> 0
    for (int e = w.rej_begin; e < w.nev; ++e) {
      const int j = s.ev_token[e] - start;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        if (j == jj) r[jj] = 0.0f;
    }
  }
}

// Residual values of one unit (4 slots; slots outside the row are 0).
template <bool HAS_DRAFT>
__device__ __forceinline__ void residual_unit(const float* row, const float* drow, const RowUnits& u, int k,
                                              bool dvec, const Smem& s, const Walk& w, float r[4], int* first) {
  float t[4], d[4];
  *first = load_residual_inputs<HAS_DRAFT>(row, drow, u, k, dvec, t, d);
  residual_from<HAS_DRAFT>(t, d, drow != nullptr, *first, s, w, r);
}

// Sums and last positive indices of pieces [pc, pc + cnt), cnt <= ILP, computed by one warp. The
// loads of all cnt pieces are issued before any reduction so that ILP loads per lane are in flight.
template <bool HAS_DRAFT, int ILP>
__device__ __forceinline__ void sum_pieces(const float* row, const float* drow, const RowUnits& u, bool dvec,
                                           const Smem& s, const Walk& w, int pc, int cnt, int piece_units,
                                           float sum[ILP], int last[ILP]) {
  const int lane = threadIdx.x & 31, units = u.count();
  float acc[ILP];
  int lp[ILP];
#pragma unroll
  for (int i = 0; i < ILP; ++i) {
    acc[i] = 0.0f;
    lp[i] = -1;
  }
  for (int g = lane; g < piece_units; g += 32) {
    float t[ILP][4], d[ILP][4];
    int first[ILP];
    bool valid[ILP];
    // All loads first (out-of-range slots load unit 0, the head, and are discarded)...
#pragma unroll
    for (int i = 0; i < ILP; ++i) {
      const int k = (pc + i) * piece_units + g;
      valid[i] = i < cnt && k < units;
      first[i] = load_residual_inputs<HAS_DRAFT>(row, drow, u, valid[i] ? k : 0, dvec, t[i], d[i]);
    }
    // ...then the arithmetic.
#pragma unroll
    for (int i = 0; i < ILP; ++i) {
      float r[4];
      residual_from<HAS_DRAFT>(t[i], d[i], drow != nullptr, first[i], s, w, r);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float x = valid[i] ? r[j] : 0.0f;
        acc[i] += x;
        if (x > 0.0f) lp[i] = first[i] + j;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < ILP; ++i) {
    sum[i] = warp_sum(acc[i]);
    last[i] = warp_max(lp[i]);
  }
}

// First index in the piece whose prefix (base + in-piece prefix) exceeds u with r > 0, or -1.
template <bool HAS_DRAFT>
__device__ __forceinline__ int search_piece(const float* row, const float* drow, const RowUnits& u, bool dvec,
                                            const Smem& s, const Walk& w, int piece, int piece_units) {
  const int lane = threadIdx.x & 31;
  const int k0 = piece * piece_units, k1 = min(k0 + piece_units, u.count());
  float base = w.base;
  for (int kb = k0; kb < k1; kb += 32) {
    const int k = kb + lane;
    float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int first = 0;
    if (k < k1) residual_unit<HAS_DRAFT>(row, drow, u, k, dvec, s, w, r, &first);
    float local[4];
    local[0] = r[0];
    local[1] = local[0] + r[1];
    local[2] = local[1] + r[2];
    local[3] = local[2] + r[3];
    const float incl = warp_inclusive_scan(local[3]);
    const float prev = __shfl_up_sync(kFullMask, incl, 1);
    const float lane_base = base + (lane == 0 ? 0.0f : prev);
    int hit = kIntMax;
#pragma unroll
    for (int j = 3; j >= 0; --j)
      if (r[j] > 0.0f && lane_base + local[j] > w.u) hit = first + j;
    hit = warp_min(hit);
    if (hit != kIntMax) return hit;
    base = base + __shfl_sync(kFullMask, incl, 31);
  }
  return -1;
}

// Finisher step 1: scan the piece sums in shared memory, set w->u, w->piece, w->base; returns the
// last positive index of the whole row (-1 if none). Every thread of the block calls it.
template <int THREADS>
__device__ __forceinline__ int locate_piece(const Smem& s, int pieces, float coin, Walk* w, float* red, int* redi) {
  const int per = (pieces + THREADS - 1) / THREADS;
  const int j0 = min(static_cast<int>(threadIdx.x) * per, pieces), j1 = min(j0 + per, pieces);
  float mine = 0.0f;
  int lp = -1;
  for (int j = j0; j < j1; ++j) {
    mine += s.psum[j];
    lp = max(lp, s.plast[j]);
  }
  float total;
  const float excl = block_exclusive_scan<THREADS>(mine, red, &total);
  const float u = coin * total;
  float run = excl;
  int hit = kIntMax;
  float hit_base = 0.0f;
  for (int j = j0; j < j1; ++j) {
    const float next = run + s.psum[j];
    if (s.psum[j] > 0.0f && next > u) {
      hit = j;
      hit_base = run;
      break;
    }
    run = next;
  }
  const int piece = block_reduce_extreme<THREADS, false>(hit, redi);
  if (hit != kIntMax && hit == piece) {
    w->base = hit_base;
  }
  if (threadIdx.x == 0) {
    w->u = u;
    w->piece = piece == kIntMax ? -1 : piece;
  }
  const int last = block_reduce_extreme<THREADS, true>(lp, redi);
  __syncthreads();
  return last;
}

// Writes every output of request b (one thread), in the order the reference writes them.
__device__ __forceinline__ void write_outputs(const TreeSpecParams& p, const Smem& s, const Walk& w, long long b,
                                              int token) {
  const long long S = p.S;
  p.accept_index[b * S] = static_cast<int>(p.retrive_index[b * p.n]);
  if (!w.root_ok) {
    p.accept_token_num[b] = 0;
    return;
  }
  int last = s.node[0].index;
  for (int j = 1; j <= w.count; ++j) {
    const Node nd = s.node[s.path[j]];
    p.accept_index[b * S + j] = nd.index;
    p.predicts[last] = nd.token;
    last = nd.index;
  }
  if (p.draft_probs != nullptr)
    for (int e = 0; e < w.nev; ++e) p.draft_probs[(b * p.n + s.ev_node[e]) * p.V + s.ev_token[e]] = s.ev_val[e];
  p.accept_token_num[b] = w.count;
  p.predicts[last] = token;
}

template <int THREADS, bool HAS_DRAFT>
__global__ void __launch_bounds__(THREADS, 4) tree_speculative_sampling_target_only_kernel(const TreeSpecParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ Walk w;
  __shared__ float red[33];
  __shared__ int redi[32];
  constexpr int WARPS = THREADS / 32;
  const long long b = blockIdx.x;
  const int chunk = blockIdx.y, C = static_cast<int>(p.chunks);
  const int V = static_cast<int>(p.V);
  const int piece_units = static_cast<int>(p.piece_units);

  const int n = static_cast<int>(p.n);
  const int stride = static_cast<int>(p.pieces);
  const Smem s = carve_smem(smem_raw, n, stride);

  load_tree(p, s, b);
  if (threadIdx.x == 0) walk_tree(p, s, b, &w);
  __syncthreads();

  if (!w.root_ok) {
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

  // Phase 1: this block's pieces; each warp takes a contiguous run of them, ILP at a time.
  constexpr int ILP = HAS_DRAFT ? 2 : 4;  // 16-byte loads in flight per lane: 4 either way
  const int pc0 = static_cast<int>((static_cast<long long>(pieces) * chunk) / C);
  const int pc1 = static_cast<int>((static_cast<long long>(pieces) * (chunk + 1)) / C);
  const int per_warp = (pc1 - pc0 + WARPS - 1) / WARPS;
  const int wlo = min(pc0 + warp * per_warp, pc1), whi = min(wlo + per_warp, pc1);
  for (int pc = wlo; pc < whi; pc += ILP) {
    float sum[ILP];
    int last[ILP];
    const int cnt = min(ILP, whi - pc);
    sum_pieces<HAS_DRAFT, ILP>(row, drow, u, dvec, s, w, pc, cnt, piece_units, sum, last);
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < ILP; ++i) {
        if (i >= cnt) break;
        if (C == 1) {
          s.psum[pc + i] = sum[i];
          s.plast[pc + i] = last[i];
        } else {
          p.piece_sums[b * stride + pc + i] = sum[i];
          p.piece_last[b * stride + pc + i] = last[i];
        }
      }
    }
  }
  __syncthreads();

  // Phase 2: the last block of the request to arrive finishes it.
  if (C > 1) {
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned int done = atomicAdd(p.counters + b, 1u);
      w.is_finisher = done == static_cast<unsigned int>(C - 1);
    }
    __syncthreads();
    if (!w.is_finisher) return;
    __threadfence();
    for (int j = threadIdx.x; j < pieces; j += THREADS) {
      s.psum[j] = __ldcg(p.piece_sums + b * stride + j);
      s.plast[j] = __ldcg(p.piece_last + b * stride + j);
    }
    if (threadIdx.x == 0) p.counters[b] = 0u;
    __syncthreads();
  }

  const float coin = clamp_coin(p.final_coins[b]);
  const int last_positive = locate_piece<THREADS>(s, pieces, coin, &w, red, redi);
  if (warp == 0) {
    int token = -1;
    if (w.piece >= 0) {
      token = search_piece<HAS_DRAFT>(row, drow, u, dvec, s, w, w.piece, piece_units);
      if (token < 0) token = s.plast[w.piece];  // rounding: u passed within the piece's last element
    }
    if (token < 0) token = last_positive >= 0 ? last_positive : V - 1;
    if (lane == 0) write_outputs(p, s, w, b, token);
  }
}

}  // namespace cupy_spec
