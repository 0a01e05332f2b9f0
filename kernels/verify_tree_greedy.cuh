// Greedy tree verification: accept, level by level, the first child whose token equals the
// target's argmax after the current node, then write that argmax after the last accepted node.
//
// Launch: grid ceil(bs / W), W warps per block, one warp per request. The warp loads its request's
// tree into shared memory in one round of parallel loads (the target's token after every node is
// loaded in the same round where retrive_index is the usual b * n + i, else gathered in a second),
// so the walk reads shared memory only. When no node has two incoming
// links, every lane finds the accepted child of its nodes and lane 0 only follows them; otherwise
// lane 0 walks exactly as the reference does.
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

// The walk of the reference (lane 0), exact for any input: marks visited nodes, ends at a revisit.
__device__ __forceinline__ int walk_exact(const GreedyParams& p, const GreedyNode* node, int* seen, int* accept,
                                          long long limit, int* last) {
  int cur = 0, count = 0;
  seen[0] = 1;
  int c = p.S > 1 ? node[0].child : -1;
  while (c >= 0 && !seen[c]) {
    seen[c] = 1;
    const GreedyNode nd = node[c];
    if (nd.index < 0 || nd.index >= limit) break;  // malformed child ends the walk
    if (nd.token == node[cur].want) {
      p.predicts[node[cur].index] = static_cast<int>(nd.token);
      accept[++count] = static_cast<int>(nd.index);
      cur = c;
      c = count < p.S - 1 ? nd.child : -1;
    } else {
      c = nd.sibling;
    }
  }
  *last = cur;
  return count;
}

__global__ void __launch_bounds__(32 * GreedyParams::MAX_WARPS) verify_tree_greedy_kernel(const GreedyParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long b = static_cast<long long>(blockIdx.x) * warps + warp;
  if (b >= p.bs) return;
  const int n = static_cast<int>(p.n);
  GreedyNode* node = reinterpret_cast<GreedyNode*>(smem_raw) + static_cast<long long>(warp) * n;
  // seen[] of the exact walk; before it, the in-degree count and then the accepted child of each node
  int* aux = reinterpret_cast<int*>(reinterpret_cast<GreedyNode*>(smem_raw) + static_cast<long long>(warps) * n) +
             static_cast<long long>(warp) * n;
  const long long limit = min(p.P, p.bs * p.n);  // valid retrive_index values: [0, limit)

  // LOAD_UNROLL nodes per lane at a time: all their loads are issued before the first is used, so a
  // tree of up to 32 * LOAD_UNROLL nodes costs one trip to memory when retrive_index is the usual
  // b * n + i (target_predict at that index is loaded with the links, speculatively) and two
  // otherwise (the indices, then the gather).
  constexpr int U = GreedyParams::LOAD_UNROLL;
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
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + 32 * u;
      if (i < n) {
        node[i] = GreedyNode{tok[u], want[u], r[u], link(nt[u], p.n), link(ns[u], p.n)};
        aux[i] = 0;
      }
    }
  }
  __syncwarp();
  // In-degree over all links: if no node has two incoming links and the root none, no walk can meet
  // a node twice, and the walk reduces to following each node's accepted child (found in parallel).
  for (int i = lane; i < n; i += 32) {
    if (node[i].child >= 0) atomicAdd(aux + node[i].child, 1);
    if (node[i].sibling >= 0) atomicAdd(aux + node[i].sibling, 1);
  }
  __syncwarp();
  bool clean = true;
  for (int i = lane; i < n; i += 32) clean &= aux[i] <= (i == 0 ? 0 : 1);
  clean = __all_sync(kFullMask, clean);
  __syncwarp();

  int* accept = p.accept_index + b * p.S;
  const long long root = node[0].index;
  const bool root_ok = root >= 0 && root < limit;
  if (clean) {
    // aux[i]: the first child c of node i (sibling order) with token == want(i), or -1 if the list
    // ends first or reaches a child with an invalid index (where the walk ends). Two nodes per lane
    // at a time, so that their shared-memory reads overlap.
    for (int i = lane; i < n; i += 64) {
      const int k = i + 32 < n ? i + 32 : i;
      int c[2] = {node[i].child, node[k].child}, found[2] = {-1, -1};
      const long long want[2] = {node[i].want, node[k].want};
      for (int steps = 0; (c[0] >= 0 || c[1] >= 0) && steps < n; ++steps) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (c[h] < 0) continue;
          const GreedyNode& nd = node[c[h]];
          if (nd.index < 0 || nd.index >= limit) {
            c[h] = -1;
          } else if (nd.token == want[h]) {
            found[h] = c[h];
            c[h] = -1;
          } else {
            c[h] = nd.sibling;
          }
        }
      }
      aux[i] = found[0];
      aux[k] = found[1];  // k == i: the same value
    }
    __syncwarp();
  }
  if (lane != 0) return;
  accept[0] = static_cast<int>(root);
  if (!root_ok) {
    p.accept_token_num[b] = 0;
    return;
  }
  int cur = 0, count = 0;
  if (clean) {
    for (int c = aux[0]; c >= 0 && count < p.S - 1; c = aux[c]) {
      p.predicts[node[cur].index] = static_cast<int>(node[c].token);
      accept[++count] = static_cast<int>(node[c].index);
      cur = c;
    }
  } else {
    for (int i = 0; i < n; ++i) aux[i] = 0;
    count = walk_exact(p, node, aux, accept, limit, &cur);
  }
  p.accept_token_num[b] = count;
  p.predicts[node[cur].index] = static_cast<int>(node[cur].want);
}

}  // namespace cupy_spec
