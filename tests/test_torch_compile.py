"""Every op under torch.compile and torch's custom-op checks.

torch.compile(fullgraph=True) as the batch size changes between calls: torch recompiles with a
symbolic batch size after the first change (or from the start with dynamic=True), and the ops'
argument checks then see symbolic sizes; outputs must equal the eager call's on copies of the same
inputs. ``torch.library.opcheck`` on every registered op: its schema's mutation annotations, its
fake implementation, its autograd registration and AOT dispatch with dynamic shapes."""

from __future__ import annotations

import pytest
import torch

import cupy_spec
import test_build_tree_kernel_efficient as B
import test_chain_speculative_sampling as C
import test_tree_speculative_sampling as T
import test_tree_speculative_sampling_from_logits as FL
import test_verify_tree_greedy as G
from cases import as_args, make_case
from cupy_spec._core import OPS
from cupy_spec.tree import alloc_tree_outputs, eagle_inputs, random_eagle_draft

gpu = pytest.mark.gpu
BATCHES = (3, 5, 6)  # 5: the recompile with a symbolic batch size; 6: served by that graph


def _gen(bs: int) -> torch.Generator:
    return torch.Generator().manual_seed(bs)


def _from_logits_args(bs):
    c = FL.make_logits_case(bs, 8, 40, _gen(bs))
    return tuple(c[k] for k in FL.OUTPUTS + FL.INPUTS) + (c["top_ks"], c["top_ps"], c["min_ps"])


def _build_tree_args(bs):
    inputs = eagle_inputs(*random_eagle_draft(bs, 4, 3, vocab=16, generator=_gen(bs)), 8)
    seq = torch.arange(bs, dtype=torch.int64) + 3
    return (inputs.parent_list, inputs.selected_index, seq) + tuple(alloc_tree_outputs(bs, 8, 0, int(seq.sum())))


def _chain_args(bs):
    c = C.chain_case(bs, 3, 7, _gen(bs))
    return c["draft"], c["ids"], c["target"], c["coins"]


# name -> (the call, its arguments at batch size bs)
CALLS = {
    "tree_speculative_sampling_target_only": (
        cupy_spec.tree_speculative_sampling_target_only, lambda bs: as_args(make_case(bs, 8, 33, _gen(bs)))),
    "verify_tree_greedy": (
        cupy_spec.verify_tree_greedy, lambda bs: tuple(G.random_case(bs, 8, 4, _gen(bs))[k] for k in G.ORDER)),
    "build_tree_kernel_efficient": (
        lambda *a: cupy_spec.build_tree_kernel_efficient(*a, 4, 3, 8, B.FULL), _build_tree_args),
    "chain_speculative_sampling": (
        lambda d, i, t, c: cupy_spec.chain_speculative_sampling(d, i, t, uniform_samples=c), _chain_args),
    "chain_speculative_sampling (seed, offset)": (
        lambda d, i, t, s: cupy_spec.chain_speculative_sampling(d, i, t, seed=s, offset=3),
        lambda bs: _chain_args(bs)[:3] + (torch.tensor([bs]),)),
    "tree_speculative_sampling": (
        lambda *a: cupy_spec.tree_speculative_sampling(*a, False),
        lambda bs: tuple(T.kernel_case(bs, 8, 9, _gen(bs), "random", False)[k] for k in T.ORDER)),
    "tree_speculative_sampling_from_logits": (
        lambda *a: cupy_spec.tree_speculative_sampling_from_logits(*a[:-3], top_ks=a[-3], top_ps=a[-2], min_ps=a[-1]),
        _from_logits_args),
    "uniform_coins": (
        cupy_spec.uniform_coins,
        lambda bs: (torch.tensor([bs]), torch.tensor([7]), torch.full((bs, 4), -1.0))),
}


def _copy(args: tuple, device: str) -> tuple:
    return tuple(a.clone().to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _tensors(args: tuple, result) -> list:
    out = [a for a in args if isinstance(a, torch.Tensor)]
    if isinstance(result, tuple):
        out += [r for r in result if isinstance(r, torch.Tensor)]
    return [t.cpu() for t in out]


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_changing_batch_size_under_torch_compile(name, dynamic, device):
    fn, make = CALLS[name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(*a), fullgraph=True, dynamic=dynamic)
    for bs in BATCHES:
        args = make(bs)
        eager, traced = _copy(args, device), _copy(args, device)
        want = _tensors(eager, fn(*eager))
        got = _tensors(traced, compiled(*traced))
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"bs={bs}: tensor {i} differs from the eager call"


def _chain_core_args(bs):
    d, i, t, c = _chain_args(bs)
    outputs = (torch.full((bs, i.shape[1] + 1), -7, dtype=torch.int32),) + tuple(torch.zeros(bs, dtype=torch.int32)
                                                                                for _ in range(2))
    return (d, i, t, c) + outputs + (None, None, True, False, 0, 0)


# every custom op (the in-place core op where the public function allocates) -> its arguments
CORE_ARGS = {
    "tree_speculative_sampling_target_only": CALLS["tree_speculative_sampling_target_only"][1],
    "verify_tree_greedy": CALLS["verify_tree_greedy"][1],
    "build_tree_kernel_efficient": lambda bs: _build_tree_args(bs) + (4, 3, 8, B.FULL),
    "chain_speculative_sampling": _chain_core_args,
    "tree_speculative_sampling": lambda bs: CALLS["tree_speculative_sampling"][1](bs) + (True,),
    "tree_speculative_sampling_from_logits": _from_logits_args,
    "uniform_coins": CALLS["uniform_coins"][1],
}


def test_every_custom_op_is_covered():
    assert set(CORE_ARGS) == set(OPS)


@pytest.mark.parametrize("name", list(CORE_ARGS))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_torch_library_opcheck(name, device):
    """torch's own checks of a custom op: schema and mutations, fake tensors, autograd registration,
    AOT dispatch with dynamic shapes."""
    result = torch.library.opcheck(getattr(torch.ops.cupy_spec, name), _copy(CORE_ARGS[name](3), device))
    assert set(result.values()) == {"SUCCESS"}, result


def test_import_does_not_load_the_compiler():
    """torch._dynamo (about a second to import) is loaded by torch.compile, not by cupy_spec."""
    import subprocess
    import sys

    code = "import sys, cupy_spec; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_shape_disagreement_is_named_while_tracing(dynamic):
    """With symbolic sizes the shape check still names the argument (inside torch's error; with
    dynamic=True the sizes it prints are torch's symbols)."""
    case = make_case(3, 4, 33, _gen(1))
    case["target_probs"] = make_case(4, 4, 33, _gen(1))["target_probs"]  # bs 4 where the rest say 3
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: cupy_spec.tree_speculative_sampling_target_only(*a), fullgraph=True,
                             dynamic=dynamic)
    with pytest.raises(Exception, match=r"target_probs must have shape \[bs=\w+, n=\w+, V=\w+\], got"):
        compiled(*as_args(case))
