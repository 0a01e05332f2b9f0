"""The public op: argument validation, torch custom op, and (on a GPU) kernel vs reference."""

from __future__ import annotations

import itertools
import importlib
import os

import pytest
import torch

import cupy_spec
from cupy_spec import _launch
from cases import ARG_ORDER, POISON, as_args, at_offset, captured, clone_to, compare, make_case

# the package attribute of this name is the op function, so import the module itself
mod = importlib.import_module("cupy_spec.tree_speculative_sampling_target_only")

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
op = cupy_spec.tree_speculative_sampling_target_only
THRESHOLDS = [(1.0, 1.0), (0.0, 0.0), (0.9, 0.7), (0.3, 1.0)]


def small_case(device="cpu", **kw):
    return clone_to(make_case(2, 8, 11, torch.Generator().manual_seed(0), **kw), device)


# Validation has a fast path for CUDA tensors; every validation test runs on both devices.
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if HAS_CUDA else [])
on_devices = pytest.mark.parametrize("device", DEVICES)


# ---- validation (CPU) ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ARG_ORDER)
@on_devices
def test_wrong_dtype_names_argument(name, device):
    case = small_case(device)
    case[name] = case[name].double() if case[name].dtype != torch.float64 else case[name].float()
    with pytest.raises(TypeError, match=name):
        op(*as_args(case))


@pytest.mark.parametrize("name", ARG_ORDER)
@on_devices
def test_wrong_rank_names_argument(name, device):
    case = small_case(device)
    case[name] = case[name].unsqueeze(-1)
    with pytest.raises(ValueError, match=name):
        op(*as_args(case))


@pytest.mark.parametrize(
    "name, dim",
    [("retrive_index", "n"), ("retrive_next_token", "n"), ("retrive_next_sibling", "n"),
     ("uniform_samples", "n"), ("uniform_samples_for_final_sampling", "bs"), ("target_probs", "n"),
     ("draft_probs", "V"), ("accept_token_num", "bs")],
)
@on_devices
def test_shared_dimension_mismatch_names_argument(name, dim, device):
    case = small_case(device)
    t = case[name]
    axis = {"bs": 0, "n": 1, "V": 2}[dim]
    case[name] = torch.cat([t, t.narrow(axis, 0, 1)], dim=axis)
    with pytest.raises(ValueError, match=f"{name} must have shape .*{dim} is"):
        op(*as_args(case))


@pytest.mark.parametrize("name", ARG_ORDER)
@on_devices
def test_not_a_tensor_names_argument(name, device):
    case = small_case(device)
    case[name] = case[name].tolist()
    with pytest.raises(TypeError, match=name):
        op(*as_args(case))


@pytest.mark.parametrize("name", ["candidates", "target_probs", "draft_probs", "accept_index"])
@on_devices
def test_non_contiguous_rejected(name, device):
    case = small_case(device)
    t = case[name]
    case[name] = t.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match=f"{name} must be contiguous"):
        op(*as_args(case))


def test_mixed_devices_rejected():
    case = small_case()
    case["target_probs"] = case["target_probs"].to("meta")
    with pytest.raises(ValueError, match="target_probs is on meta"):
        op(*as_args(case))


@pytest.mark.parametrize("kw", ["threshold_single", "threshold_acc"])
@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
@on_devices
def test_threshold_range(kw, value, device):
    with pytest.raises(ValueError, match=kw):
        op(*as_args(small_case(device)), **{kw: value})


@on_devices
def test_numpy_scalars_are_taken_as_the_python_values_they_hold(device):
    np = pytest.importorskip("numpy")
    a, b = small_case(device), small_case(device)
    op(*as_args(a), np.float32(0.5), np.float64(0.75), np.bool_(True))
    op(*as_args(b), 0.5, 0.75, True)
    for k in ARG_ORDER:
        assert torch.equal(a[k], b[k]), k
    with pytest.raises(TypeError, match="deterministic must be a bool, got int 1"):
        op(*as_args(small_case(device)), np.float32(0.5), 0.75, np.int64(1))


@on_devices
def test_numpy_scalars_inside_torch_compile(device):
    """A call with NumPy scalars runs outside the compiled graph, as the eager call does."""
    np = pytest.importorskip("numpy")
    a, b = small_case(device), small_case(device)
    op(*as_args(a), 0.5, 0.75, True)
    torch._dynamo.reset()
    torch.compile(lambda *args: op(*args))(*as_args(b), np.float32(0.5), np.float64(0.75), np.bool_(True))
    for k in ARG_ORDER:
        assert torch.equal(a[k], b[k]), k
    torch._dynamo.reset()
    with pytest.raises(Exception, match="_numpy_scalars_run_eagerly"):
        torch.compile(lambda *args: op(*args), fullgraph=True)(*as_args(small_case(device)), np.float32(0.5))


@on_devices
def test_wrong_dtype_of_an_output_says_allocate_it(device):
    case = small_case(device)
    case["accept_index"] = case["accept_index"].long()
    with pytest.raises(TypeError, match=r"accept_index must have dtype int32, got int64 \(it is written in place: "
                                        r"allocate it as torch.int32\)"):
        op(*as_args(case))


def test_numpy_scalar_in_a_tensor_slot_is_named_as_a_number():
    np = pytest.importorskip("numpy")
    args = list(as_args(small_case()))
    with pytest.raises(TypeError, match=r"draft_probs must be a torch.Tensor.*got float64 np.float64\(0.9\); pass later arguments"):
        op(*args[:10], np.float64(0.9))


def test_check_inputs_takes_numpy_thresholds_and_no_draft_probs():
    np = pytest.importorskip("numpy")
    args = _sglang_target_only_case("cpu")
    cupy_spec.check.check_inputs(*args, threshold_single=np.float32(0.5), threshold_acc=np.float64(0.9))


@pytest.mark.parametrize("value", [0, 1, "no", None])
@on_devices
def test_validate_must_be_a_bool(value, device):
    with pytest.raises(TypeError, match=f"validate must be a bool, got {type(value).__name__}"):
        op(*as_args(small_case(device)), validate=value)


@on_devices
def test_non_contiguous_output_message_says_allocate_it(device):
    case = small_case(device)
    case["accept_index"] = torch.zeros(case["accept_index"].shape[::-1], dtype=torch.int32, device=device).t()
    with pytest.raises(ValueError, match="accept_index must be contiguous.*written in place, so allocate it contiguous"):
        op(*as_args(case))


@pytest.mark.parametrize("kw", ["threshold_single", "threshold_acc"])
@on_devices
def test_threshold_type(kw, device):
    with pytest.raises(TypeError, match=kw):
        op(*as_args(small_case(device)), **{kw: "1.0"})


@on_devices
@pytest.mark.parametrize("draft", [True, False])
def test_accept_index_wider_than_the_tree(device, draft):
    """sglang sizes accept_index by its draft steps, which may exceed the tree's nodes (S > n): the
    walk ends within n - 1 levels, so no bonus token, and the columns past it stay untouched."""
    rows = torch.nn.functional.one_hot(torch.tensor([[3, 4, 7]]), 8).float()
    args = [torch.full((3,), POISON, dtype=torch.int32), torch.full((1, 6), POISON, dtype=torch.int32),
            torch.full((1,), POISON, dtype=torch.int32), torch.tensor([[0, 3, 4]]), torch.tensor([[0, 1, 2]]),
            torch.tensor([[1, 2, -1]]), torch.tensor([[-1, -1, -1]]), torch.full((1, 3), 0.5), torch.full((1,), 0.5),
            rows, torch.zeros(1, 3, 8) if draft else None]
    args = [None if t is None else t.to(device) for t in args]
    op(*args)
    assert args[0].tolist() == [3, 4, 7]
    assert args[1].tolist() == [[0, 1, 2] + [POISON] * 3]
    assert args[2].tolist() == [2]


def test_bs_zero_returns_without_touching():
    case = make_case(0, 4, 5, torch.Generator().manual_seed(0), S=2)
    assert op(*as_args(case)) is None


def test_keyword_names_and_defaults_match_upstream():
    import inspect

    params = list(inspect.signature(op).parameters.values())
    names = [p.name for p in params if p.kind is not p.KEYWORD_ONLY]
    assert names == list(ARG_ORDER) + ["threshold_single", "threshold_acc", "deterministic"]
    assert [p.default for p in params[10:14]] == [None, 1.0, 1.0, True]


def test_called_without_draft_probs_as_newer_sgl_kernel_does():
    """sgl_kernel versions without a draft_probs argument are called by keyword without it (the same
    as draft_probs=None); their positional thresholds land on draft_probs and are refused by name."""
    case = small_case()
    a, b = clone_to(case, "cpu"), clone_to(case, "cpu")
    b["draft_probs"] = None
    kw = {k: a[k] for k in ARG_ORDER if k != "draft_probs"}
    op(**kw, threshold_single=0.9, threshold_acc=0.7, deterministic=True)
    op(*as_args(b), 0.9, 0.7)
    for k in ("predicts", "accept_index", "accept_token_num"):
        assert torch.equal(a[k], b[k]), k
    torch.ops.cupy_spec.tree_speculative_sampling_target_only(**kw)  # the custom op's schema has the default
    with pytest.raises(TypeError, match=r"draft_probs must be a torch.Tensor.*got float 0.9; pass later arguments by keyword"):
        op(*(a[k] for k in ARG_ORDER[:10]), 0.9, 0.7)


def _sglang_target_only_case(device):
    """The hard-coded case of sglang's target-only test: two requests of six nodes, V = 20, target
    rows softmax(logits / 0.01) with one logit of 10 among ones (so every probability is 1 or 0)."""
    cand = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    index = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    next_token = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    next_sibling = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    logits = torch.ones(2, 6, 20)
    for b, i, t in ((0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)):
        logits[b, i, t] = 10
    logits[..., 18] = torch.where(logits.amax(-1) < 10, 10.0, 1.0)
    probs = torch.softmax(logits / 0.01, dim=-1)
    coins = torch.rand(2, 6, generator=torch.Generator().manual_seed(0)), torch.rand(2)
    outs = torch.full((12,), -1, dtype=torch.int32), torch.full((2, 4), -1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    return [t.to(device) for t in (*outs, cand, index, next_token, next_sibling, *coins, probs)]


@pytest.mark.parametrize("thresholds", [(1, 1), (0, 0)])
@on_devices
def test_sglang_hard_coded_case(thresholds, device):
    """With thresholds 1/1 the outputs are sglang's expected ones. With 0/0 sglang's precompiled op
    accepts request 0's first child, whose target probability is 0, and its test expects that
    ([1, 2, 18, ...], [[0, 1, 2, -1], ...], [2, 2]); this op never accepts a zero-probability child
    (README: difference from sgl_kernel's precompiled op), so request 0 goes on through node 3."""
    args = _sglang_target_only_case(device)
    op(*args, draft_probs=torch.zeros_like(args[-1]), threshold_single=thresholds[0], threshold_acc=thresholds[1])
    assert args[0].tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert args[1].tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert args[2].tolist() == [3, 2]


# ---- CPU backend and torch integration ---------------------------------------------------------


def test_cpu_backend_is_reference():
    case = small_case()
    a, b = clone_to(case, "cpu"), clone_to(case, "cpu")
    op(*as_args(a), 0.9, 0.7)
    cupy_spec.reference.tree_speculative_sampling_target_only(*as_args(b), 0.9, 0.7)
    for k in ARG_ORDER:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("how", ["requires_grad", "inference_tensors"])
def test_cpu_backend_writes_like_the_kernel(how):
    """The CPU backend stores into its outputs as the kernel does, outside autograd: outputs that
    require grad, or were made under torch.inference_mode, are written without error, and no
    autograd history is attached to them."""
    case = small_case()
    expected = clone_to(case, "cpu")
    cupy_spec.reference.tree_speculative_sampling_target_only(*as_args(expected), 0.9, 0.7)
    got = clone_to(case, "cpu")
    if how == "requires_grad":
        got["draft_probs"].requires_grad_(True)
        got["target_probs"].requires_grad_(True)
    else:
        with torch.inference_mode():
            for k in ("predicts", "accept_index", "accept_token_num", "draft_probs"):
                got[k] = got[k].clone()
    op(*as_args(got), 0.9, 0.7)
    for k in ARG_ORDER:
        assert torch.equal(got[k].detach(), expected[k]), k
    assert got["draft_probs"].grad_fn is None


def test_numpy_arrays_written_in_place():
    """NumPy arrays are viewed without a copy and run the CPU backend, which writes into their
    memory; a read-only array is accepted as an input and refused as an output."""
    case = small_case()
    expected = clone_to(case, "cpu")
    cupy_spec.reference.tree_speculative_sampling_target_only(*as_args(expected), 0.9, 0.7)
    arrays = {k: (None if v is None else v.numpy().copy()) for k, v in case.items()}
    arrays["target_probs"].flags.writeable = False  # read, never written
    op(*as_args(arrays), 0.9, 0.7)
    for k in ARG_ORDER:
        assert torch.equal(torch.from_numpy(arrays[k].copy()), expected[k]), k
    arrays["predicts"].flags.writeable = False
    with pytest.raises(TypeError, match="^predicts is written by tree_speculative_sampling_target_only, but this "
                                        "ndarray is read-only"):
        op(*as_args(arrays), 0.9, 0.7)


def test_reversed_numpy_view_is_refused_cleanly():
    """A NumPy view with negative strides is refused before torch views it (which would abort)."""
    arrays = {k: (None if v is None else v.numpy().copy()) for k, v in small_case().items()}
    arrays["target_probs"] = arrays["target_probs"][::-1]
    with pytest.raises(ValueError, match=r"^target_probs must be contiguous, got a ndarray with negative strides"):
        op(*as_args(arrays))


@pytest.mark.parametrize("make, exc, match", [
    (lambda t: t.to("meta"), ValueError, r"^target_probs is on meta: the ops run on CUDA devices .* and on the CPU"),
    (lambda t: t.to_sparse(), TypeError, r"^target_probs must be a dense tensor, got layout sparse_coo"),
    (lambda t: t.to_mkldnn(), TypeError, r"^target_probs must be a dense tensor, got layout _mkldnn"),
])
def test_tensors_that_are_not_dense_cpu_or_cuda_are_named(make, exc, match):
    case = small_case()
    case["target_probs"] = make(case["target_probs"])
    with pytest.raises(exc, match=match):
        op(*as_args(case))


def test_custom_op_declares_mutations():
    schema = torch.ops.cupy_spec.tree_speculative_sampling_target_only.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["predicts", "accept_index", "accept_token_num", "draft_probs"]


def _compiled_matches_eager(device):
    case = make_case(3, 8, 33, torch.Generator().manual_seed(1))
    eager, comp = clone_to(case, device), clone_to(case, device)

    def f(*args):
        op(*args)
        return args[0] + 0

    op(*as_args(eager))
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True)(*as_args(comp))
    for k in ARG_ORDER:
        assert torch.equal(eager[k], comp[k]), k


def test_torch_compile_fullgraph_cpu():
    _compiled_matches_eager("cpu")


@on_devices
def test_validate_runs_inside_torch_compile(device):
    """validate=True reaches the custom op, whose content checks run each time the compiled code runs."""
    args = _sglang_target_only_case(device)
    f = torch.compile(lambda *a: op(*a, validate=True), fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    f(*args)
    args[0].fill_(POISON)
    args[8][1] = 5.0  # a final coin outside [0, 1)
    with pytest.raises(ValueError, match=r"uniform_samples_for_final_sampling\[1\].*not in \[0, 1\)"):
        f(*args)
    assert (args[0] == POISON).all()  # nothing written


def test_deterministic_flag_accepted():
    case = small_case()
    op(*as_args(case), 1.0, 1.0, False)
    assert (case["accept_token_num"] != POISON).all()


# ---- GPU: kernel vs reference -----------------------------------------------------------------

_SHAPES = [
    (bs, n, V)
    for bs, n, V in itertools.product([1, 3, 17, 64], [1, 2, 8, 64], [1, 7, 31, 257, 32000, 128256, 151936])
    if bs * n * V <= 2**25
]
_STYLES = ["peaked", "flat", "sparse", "onehot"]


def _run_gpu(case, ts, ta):
    got = clone_to(case, "cuda")
    op(*as_args(got), ts, ta)
    return got


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "bs%d-n%d-V%d" % s)
def test_kernel_matches_reference(shape, record_property):
    """Random cases per shape over thresholds, row styles, draft/no-draft, duplicates, edge coins."""
    bs, n, V = shape
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    reps = max(1, int(os.environ.get("CUPY_SPEC_CASES_PER_SHAPE", "24")) // (1 + (bs * n * V > 2**22) * 3))
    ties = cases = 0
    for rep in range(reps):
        ts, ta = THRESHOLDS[rep % len(THRESHOLDS)]
        style = _STYLES[(rep // 4) % len(_STYLES)]
        case = make_case(bs, n, V, g, style=style, draft=rep % 2 == 0, dup=rep % 3 == 0, coin_edges=rep % 5 == 1,
                         S={0: max(1, n // 2), 3: n + 3}.get(rep % 7))  # S > n: accept_index wider than the tree
        ties += compare(case, _run_gpu(case, ts, ta), ts, ta)
        cases += 1
    record_property("cases", cases)
    record_property("ties", ties)
    # A tie needs u within float32 rounding (~1e-7 of the total) of a token boundary: rare, except
    # on flat rows over a large vocabulary, where every token is only ~1/V of the total wide.
    assert ties <= 2 + cases * bs // 10, f"{ties} ties in {cases} cases: too many to be rounding"


@gpu
@needs_cuda
@pytest.mark.parametrize("t_off,d_off", [(1, 1), (0, 3), (2, 1), (3, 0)])
def test_kernel_rows_at_any_alignment(t_off, d_off):
    """Rows starting off 16-byte boundaries, and draft rows aligned unlike the target rows, take
    the kernel's checked load path; results still match the reference, with a non-zero draft."""
    g = torch.Generator().manual_seed(11 + 4 * t_off + d_off)
    for V in (257, 32000):
        case = make_case(5, 8, V, g, style="flat")
        keep = torch.rand(case["target_probs"].shape, generator=g) < 0.3
        case["draft_probs"] = case["target_probs"] * keep * 0.7
        got = clone_to(case, "cuda")
        got["target_probs"] = at_offset(got["target_probs"], t_off)
        got["draft_probs"] = at_offset(got["draft_probs"], d_off)
        op(*as_args(got), 1.0, 1.0)
        compare(case, got, 1.0, 1.0)


@gpu
@needs_cuda
def test_kernel_bitwise_repeatable():
    case = make_case(17, 64, 128256, torch.Generator().manual_seed(5), style="flat")
    first = _run_gpu(case, 1.0, 1.0)
    for _ in range(5):
        again = _run_gpu(case, 1.0, 1.0)
        for k in ARG_ORDER:
            assert torch.equal(first[k], again[k]), k


@pytest.mark.parametrize(
    "bs, V, has_draft, clusters, chunks, cluster",
    [(1, 32000, True, True, 8, 8), (1, 32000, False, True, 4, 4), (16, 32000, True, True, 8, 8),
     (64, 32000, True, True, 8, 1), (256, 151936, True, True, 2, 2), (256, 151936, True, False, 2, 1),
     (100, 151936, True, True, 5, 1), (1, 151936, True, True, 38, 1), (600, 151936, False, True, 1, 1),
     (1, 7, True, True, 1, 1)],
)
def test_launch_plan(bs, V, has_draft, clusters, chunks, cluster):
    """One wave of blocks (4 per SM, here 132 SMs); a request's blocks form a cluster where the GPU
    has clusters and the grid is small enough for that to pay; the counter path uses the scratch."""
    dims = mod.OP.Dims(P=bs * 8, bs=bs, S=4, n=8, V=V)
    p = mod.plan(dims, (has_draft,), _launch.DeviceInfo(0, 132, clusters))
    got_chunks, piece_units, pieces = p.fields
    assert p.grid == (bs, got_chunks) and (got_chunks, p.cluster) == (chunks, cluster)
    assert p.scratch == (chunks > 1 and cluster == 1)
    warps = mod.THREADS // 32
    assert got_chunks * warps <= max(warps, pieces + warps - 1)
    assert pieces <= mod.MAX_PIECES and pieces * piece_units >= V // 4 + 2
    if p.scratch:  # the scratch bound holds for every shape that uses it
        assert bs * pieces <= mod.OP.scratch[0].count(132) and bs <= mod.OP.scratch[1].count(132)


@gpu
@needs_cuda
@pytest.mark.parametrize("bs, n, V", [(1, 8, 32000), (3, 64, 32000), (16, 8, 32000), (64, 8, 32000),
                                      (256, 8, 32000), (256, 16, 128256)])
def test_cluster_and_counter_paths_agree(bs, n, V, monkeypatch):
    """Piece sums do not depend on which block computes them, so a request split over a cluster
    (where the GPU has clusters) and over blocks joined by a counter give bitwise equal outputs,
    and both match the reference."""
    g = torch.Generator().manual_seed(bs * 7 + n)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    has_clusters = torch.cuda.get_device_capability()[0] >= 9 and _launch._launch_ex() is not None
    try:
        for draft in (True, False):
            case = make_case(bs, n, V, g, draft=draft)
            outs = []
            for clusters in (True, False):
                monkeypatch.setattr(_launch, "CLUSTERS", clusters)
                mod.OP.records.clear()
                outs.append(_run_gpu(case, 1.0, 1.0))
                (rec,) = mod.OP.records.values()
                dims = mod.OP.Dims(P=bs * n, bs=bs, S=case["accept_index"].shape[1], n=n, V=V)
                planned = mod.plan(dims, (draft,), _launch.DeviceInfo(0, sms, clusters and has_clusters))
                assert _launch.launch_features(rec)[0] == planned.cluster, "launch path not as planned"
            compare(case, outs[0], 1.0, 1.0)
            for k in ARG_ORDER:
                if outs[0][k] is not None:
                    assert torch.equal(outs[0][k], outs[1][k]), k
    finally:
        mod.OP.records.clear()  # no record planned without clusters outlives the test


@gpu
@needs_cuda
def test_torch_compile_fullgraph_cuda():
    _compiled_matches_eager("cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("V", [257, 32000, 151936])  # one block; a cluster (sm_90+); blocks and a counter
def test_cuda_graph_replay(V):
    g = torch.Generator().manual_seed(7)
    static = clone_to(make_case(4, 8, V, g, S=4), "cuda")
    graph, _ = captured(lambda: op(*as_args(static)))
    for _ in range(3):
        fresh = make_case(4, 8, V, g, S=4)
        for k in ARG_ORDER:
            static[k].copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        eager = _run_gpu(fresh, 1.0, 1.0)
        for k in ARG_ORDER:
            assert torch.equal(static[k], eager[k]), k


@gpu
@needs_cuda
def test_cupy_inputs_written_in_place():
    cupy = pytest.importorskip("cupy")
    case = make_case(5, 8, 300, torch.Generator().manual_seed(8))
    arrays = {k: cupy.asarray(v.numpy()) for k, v in case.items()}
    ptrs = {k: a.data.ptr for k, a in arrays.items()}
    with cupy.cuda.Stream(non_blocking=True):
        op(*(arrays[k] for k in ARG_ORDER))
        cupy.cuda.get_current_stream().synchronize()
    got = {k: torch.from_numpy(cupy.asnumpy(a)) for k, a in arrays.items()}
    assert all(arrays[k].data.ptr == ptrs[k] for k in arrays)
    compare(case, got, 1.0, 1.0)


@gpu
@needs_cuda
def test_side_stream_ordering():
    case = make_case(64, 8, 128256, torch.Generator().manual_seed(9))
    got = clone_to(case, "cuda")
    s = torch.cuda.Stream()
    target = got["target_probs"]
    real = target.clone()
    target.zero_()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # keep the stream busy so a wrong stream would race
        target.copy_(real)
        op(*as_args(got))
    torch.cuda.synchronize()
    compare(case, got, 1.0, 1.0)


@gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu():
    case = make_case(3, 8, 1000, torch.Generator().manual_seed(10))
    got = clone_to(case, "cuda:1")
    op(*as_args(got))
    compare(case, got, 1.0, 1.0)
