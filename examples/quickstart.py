"""Quickstart: verify a small batch of EAGLE-like draft trees with one call.

Run it after ``pip install .`` (CPU backend) or ``pip install ".[cuda12]"`` (GPU backend):
    python examples/quickstart.py
From a checkout without installing: ``PYTHONPATH=<repository root> python examples/quickstart.py``.
Uses the CUDA kernel when a GPU is available, otherwise the pure-torch reference on the CPU; both
give the same result. The op's semantics are stated in docs/contract.md.
"""

import torch

from cupy_spec import tree_speculative_sampling_target_only
from cupy_spec.tree import eagle_tree, emitted_tokens, path_nodes, sample_candidates

BS, N, DEPTH, TOPK, V = 3, 8, 3, 2, 12


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"backend: {'CUDA kernel on ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU reference'}")

    # Everything random is drawn on the CPU from one seeded generator, then moved to the device,
    # so both backends see the same inputs.
    g = torch.Generator().manual_seed(0)
    tree = eagle_tree(BS, N, DEPTH, TOPK, generator=g)
    target_probs = torch.softmax(2.0 * torch.randn(BS, N, V, generator=g), dim=-1)  # target model
    noise = torch.softmax(2.0 * torch.randn(BS, N, V, generator=g), dim=-1)
    draft_model = 0.6 * target_probs + 0.4 * noise  # a drafter that roughly agrees with the target
    candidates = sample_candidates(tree, draft_model, generator=g)
    coins = torch.rand(BS, N, generator=g)
    final_coins = torch.rand(BS, generator=g)

    def dev(t):
        return t.to(device)

    predicts = torch.full((BS * N,), -1, dtype=torch.int32, device=device)
    accept_index = torch.full((BS, tree.S), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(BS, dtype=torch.int32, device=device)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num,
        dev(candidates), dev(tree.retrive_index), dev(tree.retrive_next_token), dev(tree.retrive_next_sibling),
        dev(coins), dev(final_coins), dev(target_probs), None,  # draft_probs=None: no residual row
        threshold_single=1.0, threshold_acc=1.0,
    )  # fmt: skip

    tokens = emitted_tokens(predicts, accept_index, accept_token_num)
    paths = path_nodes(tree, accept_index, accept_token_num)
    for b in range(BS):
        print(f"\nrequest {b}")
        print(f"  parents : {tree.parents[b].tolist()}")
        print(f"  depth   : {tree.depth[b].tolist()}")
        print(f"  tokens  : {candidates[b].tolist()}")
        print(f"  accepted path (node ids): {paths[b]}  ({len(paths[b]) - 1} draft tokens accepted)")
        print(f"  emitted tokens          : {tokens[b]}")

    total = sum(len(t) for t in tokens)
    print(f"\nOK: {BS} requests verified on {device.type}, {total} tokens emitted in one step.")


if __name__ == "__main__":
    main()
