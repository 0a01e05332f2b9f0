// Greedy tree verification: accept, level by level, the first child whose token equals the
// target's argmax after the current node, then write that argmax after the last accepted node.
//
// Launch: grid ceil(bs / W), W warps per block, one warp per request. The warp loads its request's
// tree in one round of parallel loads (the target's token after every node is loaded in the same
// round where retrive_index is the usual b * n + i, else gathered in a second). A chain of up to 64
// nodes in the usual layout is accepted up to its first mismatch, found by one ballot. Other trees
// of up to 64 nodes with at most 8 levels to accept are first walked from registers, exactly as the
// reference walks, the walk fetching each visited node's fields from its lane by shuffles; a walk not
// over after 16 steps, and every other tree, go on from shared memory: when no node has two
// incoming links (a clean tree), the walk reduces to following each node's accepted child: for
// trees of up to 64 nodes the warp finds them by pointer jumping over the sibling lists (no list is
// walked one node after another) and, where retrive_index is the usual one, the nodes of the
// accepted path find their depth the same way and write their own outputs; otherwise each lane
// scans the child lists of its nodes and lane 0 follows the accepted children. Other trees: lane 0
// walks exactly as the reference does.
//
// Semantics are those of cupy_spec/reference/verify_tree_greedy.py, including the rules for
// malformed input: links outside [0, n) mean "none"; a revisited node or a node whose retrive_index
// lies outside [0, min(P, bs * n)) ends the walk.
#pragma once
#include "common.cuh"

namespace cupy_spec {

// VerifyTreeGreedyParams and its constants (SMEM_PER_NODE, MAX_WARPS) are generated from the
// argument table in cupy_spec/verify_tree_greedy.py.
using GreedyParams = VerifyTreeGreedyParams;

struct GreedyNode {
  long long token;  // candidates[b, i]
  long long want;   // target_predict at the node's retrive_index (0 if the index is not valid)
  long long index;  // retrive_index[b, i], as given
  int child, sibling;  // links, -1 if outside [0, n)
};

static_assert(sizeof(GreedyNode) + sizeof(int) == GreedyParams::SMEM_PER_NODE, "shared layout and host size differ");

// ---- the walk of the reference --------------------------------------------------------------
// Exact for any input: from the root, test the current node's children in sibling order; a child
// whose token equals the current node's `want` is accepted and becomes the current node; a revisited
// node, a link outside [0, n) or a child with an invalid retrive_index ends the walk. `Nodes` gives
// node c's fields (`at(c)`) and keeps the visited set (`visit(c)`: false if c was visited before).
// `writer` is the thread that writes; with a `budget`, returns false when the walk is not over after
// that many steps (what it wrote by then, a later full walk writes with the same values).
template <typename Nodes>
__device__ __forceinline__ bool walk_reference(const GreedyParams& p, Nodes& nodes, long long b, long long limit,
                                               bool writer, int budget) {
  int* accept = p.accept_index + b * p.S;
  GreedyNode cur = nodes.at(0);
  if (writer) accept[0] = static_cast<int>(cur.index);
  if (cur.index < 0 || cur.index >= limit) {
    if (writer) p.accept_token_num[b] = 0;
    return true;
  }
  int count = 0;
  nodes.visit(0);
  int c = p.S > 1 ? cur.child : -1;
  for (int step = 0; c >= 0 && nodes.visit(c); ++step) {
    if (step == budget) return false;
    const GreedyNode nd = nodes.at(c);
    if (nd.index < 0 || nd.index >= limit) break;  // malformed child ends the walk
    if (nd.token == cur.want) {
      ++count;
      if (writer) {
        p.predicts[cur.index] = static_cast<int>(nd.token);
        accept[count] = static_cast<int>(nd.index);
      }
      cur = nd;
      c = count < p.S - 1 ? nd.child : -1;
    } else {
      c = nd.sibling;
    }
  }
  if (writer) {
    p.accept_token_num[b] = count;
    p.predicts[cur.index] = static_cast<int>(cur.want);
  }
  return true;
}

// Nodes in shared memory, the visited set as flags (one thread).
struct SharedNodes {
  const GreedyNode* node;
  int* seen;
  __device__ __forceinline__ GreedyNode at(int c) const { return node[c]; }
  __device__ __forceinline__ bool visit(int c) {
    const bool fresh = !seen[c];
    seen[c] = 1;
    return fresh;
  }
};

// ---- short walks, from registers -------------------------------------------------------------
// Most walks visit a handful of nodes. For trees of n <= 64 nodes and at most kWalkLevels levels to
// accept (S - 1), the warp first walks from registers, node fields fetched by shuffles (one step per
// visited node, ~130 cycles), and keeps the algorithms below, which cost ~0.6-0.9 µs more on short
// walks, for longer accepted chains and for walks not over after kWalkBudget steps.
constexpr int kWalkLevels = 8;
constexpr int kWalkBudget = 16;

// The fields of the warp's up to 64 nodes (slot t of lane l: node l + 32 t), the visited set as a
// 64-bit mask; every lane calls at() and visit() in step (shuffles), so all values are broadcasts.
struct RegisterNodes {
  long long token[2], want[2], index[2];
  int links[2];  // (child + 1) | (sibling + 1) << 8, links outside [0, n) as -1
  unsigned long long seen;
  __device__ __forceinline__ GreedyNode at(int c) const {
    const int src = c & 31, t = c >> 5;
    const int l = __shfl_sync(kFullMask, t ? links[1] : links[0], src);
    return GreedyNode{__shfl_sync(kFullMask, t ? token[1] : token[0], src),
                      __shfl_sync(kFullMask, t ? want[1] : want[0], src),
                      __shfl_sync(kFullMask, t ? index[1] : index[0], src), (l & 255) - 1, (l >> 8) - 1};
  }
  __device__ __forceinline__ bool visit(int c) {
    const bool fresh = !((seen >> c) & 1ull);
    seen |= 1ull << c;
    return fresh;
  }
};

// ---- chains -----------------------------------------------------------------------------------
// A chain in the usual layout (n <= 64; node i's child is i + 1 and the last node's none, no
// siblings, retrive_index b * n + i) has one way to go: the walk accepts nodes 1, 2, ... up to the
// first whose index is invalid or whose token differs from its parent's `want`, and at most S - 1
// of them. One ballot finds that node. The walk writes predicts[index(j - 1)] = token(j), which
// equals want(j - 1), for every accepted node j, and want(count) after the last, so accepted node j
// writes accept_index[j] and predicts[index(j)] = want(j) itself (the root too, unless its index is
// invalid: then the walk writes accept_index[0] alone). Returns false, writing nothing, for any other
// tree; all lanes call it.
__device__ __forceinline__ bool chain_ballot(const GreedyParams& p, const RegisterNodes& x, bool usual, long long b,
                                             int n, long long limit, int lane) {
  bool chain = usual;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int j = lane + 32 * s, child = (x.links[s] & 255) - 1, sibling = (x.links[s] >> 8) - 1;
    if (j < n) chain &= sibling < 0 && child == (j + 1 < n ? j + 1 : -1);
  }
  if (!__all_sync(kFullMask, chain)) return false;
  const long long w0 = __shfl_sync(kFullMask, x.want[0], (lane + 31) & 31);  // node lane - 1 (lane 0: node 31)
  const long long w1 = __shfl_sync(kFullMask, x.want[1], (lane + 31) & 31);  // node lane + 31 (lane 0: node 63)
  bool fail[2];  // node j is not accepted from its parent: invalid index or another token
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int j = lane + 32 * s;
    const long long parent_want = s == 1 && lane > 0 ? w1 : w0;
    fail[s] = j >= 1 && j < n && (x.index[s] >= limit || x.token[s] != parent_want);
  }
  const unsigned long long stop = __ballot_sync(kFullMask, fail[0]) |
                                  static_cast<unsigned long long>(__ballot_sync(kFullMask, fail[1])) << 32;
  const int first = stop ? __ffsll(static_cast<long long>(stop)) - 1 : n;  // the first node not accepted
  const long long count = min(static_cast<long long>(first) - 1, p.S - 1);
  const bool root_valid = b * p.n < limit;  // else node 1 fails too, and count is 0
  int* accept = p.accept_index + b * p.S;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int j = lane + 32 * s;
    if (j < n && j <= count) {
      accept[j] = static_cast<int>(x.index[s]);
      if (root_valid) p.predicts[x.index[s]] = static_cast<int>(x.want[s]);
    }
  }
  if (lane == 0) p.accept_token_num[b] = static_cast<int>(count);
  return true;
}

// ---- clean trees ------------------------------------------------------------------------------
// A tree is clean when no node has two incoming links and the root none. Then no walk can meet a
// node twice, and the walk reduces to following each node's accepted child: the first child c (in
// sibling order) with token == want(parent), unless a child with an invalid index comes first,
// where the walk ends. aux[i] holds node i's accepted child (or -1) for the walks below.

// Pointer jumping state of a node: the link it points along (-1: it has reached the end), the
// links counted so far and the top (a value carried from the end).
struct Jump {
  int ptr, dist, top;
};

// A node's state in one int, 8 bits a field (n <= 64; dist saturates, for nodes on cycles).
__device__ __forceinline__ int pack(const Jump& x) { return (x.ptr + 1) | (min(x.dist, 255) << 8) | ((x.top + 1) << 16); }

// Pointer jumping over the up to 64 nodes held by the warp (slot 0 of lane l: node l; slot 1: node
// l + 32, present when `two`): on return ptr is -1, dist the number of links to the end and top the
// end's top, for every node whose links reach an end within 63 steps (other nodes lie on cycles or
// lead into one, and keep ptr >= 0).
__device__ __forceinline__ void jump_to_end(Jump (&x)[2], bool two) {
  for (int round = 0; round < 7 && __any_sync(kFullMask, x[0].ptr >= 0 || x[1].ptr >= 0); ++round) {
    const int v0 = pack(x[0]), v1 = pack(x[1]);
    int y[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int q = x[s].ptr;
      const int a = __shfl_sync(kFullMask, v0, q & 31);
      const int c = two ? __shfl_sync(kFullMask, v1, q & 31) : 0;
      y[s] = q < 32 ? a : c;
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (x[s].ptr >= 0) x[s] = Jump{(y[s] & 255) - 1, x[s].dist + ((y[s] >> 8) & 255), (y[s] >> 16) - 1};
    }
  }
}

// Clean trees of n <= 64 nodes, all lanes: the accepted children without walking sibling lists.
// from[i] (in aux) is 2 * j for the node j whose child link is i, 2 * j + 1 for a sibling link,
// -1 for none. Each node finds its list's parent and its rank in the list by pointer jumping; the
// first node of each list that matches or is invalid wins by an atomicMin of (rank, invalid, node).
// On return aux[i] is node i's accepted child (-1 if none) and, for node j = lane + 32 s, up[s] is
// the parent that accepted j (-1 if none) and leaf[s] tells that j accepted no child.
__device__ __forceinline__ void accepted_children_parallel(const GreedyNode* node, int* aux, int n, long long limit,
                                                           int lane, int (&up)[2], bool (&leaf)[2]) {
  Jump x[2];  // along the list to its first child, whose parent becomes the top
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int j = lane + 32 * s, f = j < n ? aux[j] : -1;
    const int before = (f >= 0 && (f & 1)) ? f >> 1 : -1;  // the sibling before j
    x[s] = Jump{before, before >= 0 ? 1 : 0, (f >= 0 && !(f & 1)) ? f >> 1 : -1};
  }
  jump_to_end(x, n > 32);
  __syncwarp();
  int key[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int j = lane + 32 * s;
    key[s] = kIntMax;
    if (j < n && x[s].ptr < 0 && x[s].top >= 0) {
      const GreedyNode& nd = node[j];
      const bool invalid = nd.index < 0 || nd.index >= limit;
      if (invalid || nd.token == node[x[s].top].want) key[s] = (x[s].dist << 8) | (invalid << 7) | j;
    }
    if (j < n) aux[j] = kIntMax;
  }
  __syncwarp();
#pragma unroll
  for (int s = 0; s < 2; ++s)
    if (key[s] != kIntMax) atomicMin(aux + x[s].top, key[s]);
  __syncwarp();
  int child[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int j = lane + 32 * s, best = j < n ? aux[j] : kIntMax;
    up[s] = key[s] != kIntMax && !(key[s] & 128) && aux[x[s].top] == key[s] ? x[s].top : -1;
    child[s] = (best == kIntMax || (best & 128)) ? -1 : (best & 127);
    leaf[s] = child[s] < 0;
  }
  __syncwarp();
#pragma unroll
  for (int s = 0; s < 2; ++s)
    if (lane + 32 * s < n) aux[lane + 32 * s] = child[s];
  __syncwarp();
}

// Clean trees of any size, all lanes: each lane scans the child lists of its nodes, two at a time;
// every step loads a child's fields before testing any, so a step costs one shared-memory trip.
__device__ __forceinline__ void accepted_children_scan(const GreedyNode* node, int* aux, int n, long long limit,
                                                       int lane) {
  for (int i = lane; i < n; i += 64) {
    const int k = i + 32 < n ? i + 32 : i;
    int c[2] = {node[i].child, node[k].child}, found[2] = {-1, -1};
    const long long want[2] = {node[i].want, node[k].want};
    for (int steps = 0; (c[0] >= 0 || c[1] >= 0) && steps < n; ++steps) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const GreedyNode& nd = node[c[h] >= 0 ? c[h] : 0];
        const long long index = nd.index, token = nd.token;
        const int sibling = nd.sibling;
        const bool hit = index >= 0 && index < limit && token == want[h];
        const bool stop = c[h] < 0 || hit || index < 0 || index >= limit;
        found[h] = c[h] >= 0 && hit ? c[h] : found[h];
        c[h] = stop ? -1 : sibling;
      }
    }
    aux[i] = found[0];
    aux[k] = found[1];  // k == i: the same value
  }
  __syncwarp();
}

// Lane 0 follows the accepted children from the root (clean trees).
__device__ __forceinline__ int walk_accepted(const GreedyParams& p, const GreedyNode* node, const int* aux,
                                             int* accept, int* last) {
  int cur = 0, count = 0;
  for (int c = aux[0]; c >= 0 && count < p.S - 1; c = aux[c]) {
    p.predicts[node[cur].index] = static_cast<int>(node[c].token);
    accept[++count] = static_cast<int>(node[c].index);
    cur = c;
  }
  *last = cur;
  return count;
}

// Clean trees of n <= 64 nodes whose retrive_index is b * n + i, all lanes: every node finds its
// depth on the accepted path by pointer jumping up the accepted links, and the nodes of the path
// write their own outputs (distinct entries, since the indices are distinct).
__device__ __forceinline__ void write_path_parallel(const GreedyParams& p, const GreedyNode* node, int* accept,
                                                    long long b, int n, int lane, const int (&up)[2],
                                                    const bool (&leaf)[2]) {
  Jump x[2];  // up the accepted links to the top of the chain: the root for the nodes of the path
#pragma unroll
  for (int s = 0; s < 2; ++s) x[s] = Jump{up[s], up[s] >= 0 ? 1 : 0, up[s] >= 0 ? -1 : lane + 32 * s};
  jump_to_end(x, n > 32);
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int j = lane + 32 * s, depth = x[s].dist;
    if (j >= n || x[s].ptr >= 0 || x[s].top != 0 || depth > p.S - 1) continue;  // not on the path
    const GreedyNode& nd = node[j];
    if (depth >= 1) {
      p.predicts[b * p.n + up[s]] = static_cast<int>(nd.token);
      accept[depth] = static_cast<int>(nd.index);
    }
    if (depth == p.S - 1 || leaf[s]) {  // the last accepted node
      p.accept_token_num[b] = depth;
      p.predicts[nd.index] = static_cast<int>(nd.want);
    }
  }
}

// CHAINS (the plan's choice where S >= n, as for a chain of n nodes): chains in the usual layout take
// chain_ballot. Trees with fewer levels than nodes take the instantiation without it, which the test
// would slow by ~0.1 µs.
template <bool CHAINS>
__global__ void __launch_bounds__(32 * GreedyParams::MAX_WARPS) verify_tree_greedy_kernel(const GreedyParams p) {
  follow_previous_grid();  // first: before any global memory access
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long b = static_cast<long long>(blockIdx.x) * warps + warp;
  if (b >= p.bs) return;
  const int n = static_cast<int>(p.n);
  GreedyNode* node = reinterpret_cast<GreedyNode*>(smem_raw) + static_cast<long long>(warp) * n;
  // per node: the link into it, then its accepted child (clean trees), or the visited flag
  int* aux = reinterpret_cast<int*>(reinterpret_cast<GreedyNode*>(smem_raw) + static_cast<long long>(warps) * n) +
             static_cast<long long>(warp) * n;
  const long long limit = min(p.P, p.bs * p.n);  // valid retrive_index values: [0, limit)

  // LOAD_UNROLL nodes per lane at a time: all their loads are issued before the first is used, so a
  // tree of up to 32 * LOAD_UNROLL nodes costs one trip to memory when retrive_index is the usual
  // b * n + i (target_predict at that index is loaded with the links, speculatively) and two
  // otherwise (the indices, then the gather).
  constexpr int U = GreedyParams::LOAD_UNROLL;
  static_assert(U >= 2, "the first round of loads holds the 64 nodes of a short walk");
  bool usual = true;
  RegisterNodes x = {};
  for (int i0 = lane; i0 < n; i0 += 32 * U) {
    long long r[U], tok[U], nt[U], ns[U], want[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + 32 * u;
      const long long g = b * p.n + (i < n ? i : 0);
      r[u] = p.retrive_index[g];
      tok[u] = p.candidates[g];
      nt[u] = p.retrive_next_token[g];
      ns[u] = p.retrive_next_sibling[g];
      want[u] = g < limit ? p.target_predict[g] : 0;  // right when r[u] == g
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long g = b * p.n + (i0 + 32 * u < n ? i0 + 32 * u : 0);
      if (r[u] != g) want[u] = (r[u] >= 0 && r[u] < limit) ? p.target_predict[r[u]] : 0;
      usual &= r[u] == g;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + 32 * u;
      const int child = link(nt[u], p.n), sibling = link(ns[u], p.n);
      if (i < n) {
        node[i] = GreedyNode{tok[u], want[u], r[u], child, sibling};
        aux[i] = -1;
      }
      if (u < 2 && i0 == lane) {  // the first round: nodes lane and lane + 32
        x.token[u] = tok[u];
        x.want[u] = want[u];
        x.index[u] = r[u];
        x.links[u] = (child + 1) | ((sibling + 1) << 8);
      }
    }
  }
  if (CHAINS && n <= 64 && chain_ballot(p, x, usual, b, n, limit, lane)) return;
  if (n <= 64 && p.S <= kWalkLevels + 1 && walk_reference(p, x, b, limit, lane == 0, kWalkBudget)) return;
  __syncwarp();
  // The link into each node; a second link into a node, or any into the root, makes the tree unclean.
  bool twice = false;
  for (int i = lane; i < n; i += 32) {
    if (node[i].child >= 0) twice |= atomicExch(aux + node[i].child, 2 * i) != -1;
    if (node[i].sibling >= 0) twice |= atomicExch(aux + node[i].sibling, 2 * i + 1) != -1;
  }
  __syncwarp();
  const bool clean = !__any_sync(kFullMask, twice) && aux[0] == -1;
  usual = __all_sync(kFullMask, usual);
  __syncwarp();

  int* accept = p.accept_index + b * p.S;
  const long long root = node[0].index;
  if (root < 0 || root >= limit) {
    if (lane == 0) {
      accept[0] = static_cast<int>(root);
      p.accept_token_num[b] = 0;
    }
    return;
  }
  if (clean && n <= 64) {
    int up[2];
    bool leaf[2];
    accepted_children_parallel(node, aux, n, limit, lane, up, leaf);
    if (usual) {
      if (lane == 0) accept[0] = static_cast<int>(root);
      write_path_parallel(p, node, accept, b, n, lane, up, leaf);
      return;
    }
  } else if (clean) {
    accepted_children_scan(node, aux, n, limit, lane);
  }
  if (lane != 0) return;
  if (!clean) {
    for (int i = 0; i < n; ++i) aux[i] = 0;
    SharedNodes nodes{node, aux};
    walk_reference(p, nodes, b, limit, true, kIntMax);
    return;
  }
  accept[0] = static_cast<int>(root);
  int cur = 0;
  p.accept_token_num[b] = walk_accepted(p, node, aux, accept, &cur);
  p.predicts[node[cur].index] = static_cast<int>(node[cur].want);
}

}  // namespace cupy_spec
