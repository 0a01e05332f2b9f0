"""The shared launch path under real usage patterns: CUDA graphs sharing a memory pool, scratch
first needed inside a capture, lost hand-offs, per-call size limits, two streams, several threads,
huge shapes, arrays on another GPU. Kernel results are always compared with the reference."""

from __future__ import annotations

import threading
import types

import pytest
import torch

import cupy_spec
from cupy_spec import _launch
from cupy_spec.check import _parents, reachable
from cases import ARG_ORDER, POISON, as_args, captured, clone_to, compare, make_case

op = cupy_spec.tree_speculative_sampling_target_only
gpu = pytest.mark.gpu
V_BIG = 151936  # split rows at small batch: the counter path (or a cluster)


def _fresh(case: dict, static: dict) -> None:
    for k in ARG_ORDER:
        if static[k] is not None:
            static[k].copy_(case[k])


def _poison(static: dict) -> None:
    for k in ("predicts", "accept_index", "accept_token_num"):
        static[k].fill_(POISON)


@pytest.fixture
def counter_path(monkeypatch):
    """Split rows join through the scratch counter (no clusters), records planned afresh."""
    monkeypatch.setattr(_launch, "CLUSTERS", False)
    op_ = cupy_spec.tree_speculative_sampling_target_only
    from cupy_spec.tree_speculative_sampling_target_only import OP

    OP.records.clear()
    yield op_
    OP.records.clear()


# ---- CPU: the plan never needs the scratch where its bound would not hold -------------------------


def test_scratch_layout_covers_every_op():
    layout, size = _launch._layout(132)
    for o in cupy_spec._core.OPS.values():
        for f in o.scratch:
            off, nbytes, _ = layout[(o.name, f.name)]
            assert off % 256 == 0 and off + nbytes <= size


# ---- graphs --------------------------------------------------------------------------------------


@gpu
def test_graphs_sharing_a_pool(counter_path):
    """Capture a graph that allocates and frees intermediates in a shared pool, then op graphs at
    bs=4 and bs=8 (V=151936, rows split over blocks joined by a counter) on the same pool; replay in
    several orders, each time with new inputs, and compare with the reference."""
    g = torch.Generator().manual_seed(21)
    cupy_spec.warmup()
    pool = torch.cuda.graph_pool_handle()
    x = torch.randn(1 << 20, device="cuda")
    other = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            (x * 2).sum()  # warm the allocator on this stream
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(other, pool=pool):
        # small-pool blocks (< 1 MiB) filled with 3s, freed back to the pool: where a
        # scratch buffer allocated in a later capture would land
        tmp = [torch.full((1 << 17,), 3, dtype=torch.int32, device="cuda") for _ in range(8)]
        y = sum(t.float().sum() for t in tmp) + x.sum()
        del tmp
    statics, graphs = {}, {}
    for bs in (4, 8):
        statics[bs] = clone_to(make_case(bs, 8, V_BIG, g, S=4), "cuda")
        graphs[bs] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[bs], pool=pool):
            counter_path(*as_args(statics[bs]))
    for order in ([4, 8], [8, 4], ["o", 4, "o", 8], [8, "o", 8, 4, "o"]):
        for step in order:
            if step == "o":
                other.replay()
                continue
            case = make_case(step, 8, V_BIG, g, S=4)
            _fresh(case, statics[step])
            _poison(statics[step])
            graphs[step].replay()
            torch.cuda.synchronize()
            compare(case, statics[step], 1.0, 1.0)
    assert cupy_spec.check_scratch() == 0
    del y


@gpu
def test_scratch_first_needed_in_capture_is_a_clear_error(counter_path, monkeypatch):
    """A stream first used inside a capture takes a spare scratch slot; with none spare the op
    raises (it never allocates during a capture) and warmup() fixes it."""
    monkeypatch.setattr(_launch.Scratch, "slots", {})
    monkeypatch.setattr(_launch.Scratch, "assigned", {})
    static = clone_to(make_case(4, 8, V_BIG, torch.Generator().manual_seed(3), S=4), "cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warmup"):
        with torch.cuda.graph(graph):
            counter_path(*as_args(static))
    cupy_spec.warmup()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        counter_path(*as_args(static))
    graph.replay()
    torch.cuda.synchronize()
    compare(make_case(4, 8, V_BIG, torch.Generator().manual_seed(3), S=4), static, 1.0, 1.0)


@gpu
def test_lost_arrival_is_detected_and_repaired(counter_path):
    """A counter left non-zero (as after a lost arrival) is reported by check_scratch(); reset=True
    zeroes it and the next launch is correct again."""
    case = make_case(4, 8, V_BIG, torch.Generator().manual_seed(4), S=4)
    got = clone_to(case, "cuda")
    counter_path(*as_args(got))
    assert cupy_spec.check_scratch() == 0
    stream = torch.cuda.current_stream().cuda_stream
    slot = _launch.Scratch.slots[0][_launch.Scratch.assigned[(0, stream)]]
    off = _launch.Scratch.layout[0][0][("tree_speculative_sampling_target_only", "counters")][0]
    from cupy_backends.cuda.api import runtime

    runtime.memset(slot + off, 1, 1)  # counter 0 := 1
    with pytest.raises(RuntimeError, match="not zero"):
        cupy_spec.check_scratch()
    assert cupy_spec.check_scratch(reset=True) == 1
    assert cupy_spec.check_scratch() == 0
    got = clone_to(case, "cuda")
    counter_path(*as_args(got))
    torch.cuda.synchronize()
    compare(case, got, 1.0, 1.0)


# ---- per-call limits ------------------------------------------------------------------------------


@gpu
def test_size_limit_checked_on_every_call():
    """The fast path reuses a launch record per shape; a predicts longer than 2**31 - 1 of the same
    shape must still be refused (the kernel indexes it with int32 arithmetic)."""
    case = clone_to(make_case(2, 8, 64, torch.Generator().manual_seed(5)), "cuda")
    op(*as_args(case))  # creates the record of this shape
    huge = torch.empty(2**31, dtype=torch.int32, device="cuda")
    case["predicts"] = huge
    with pytest.raises(ValueError, match="P = 2147483648"):
        op(*as_args(case))
    del huge


# ---- draft_probs None and zeros -------------------------------------------------------------------


@gpu
def test_draft_none_and_zeros_agree_up_to_rounding_ties():
    """None and zero draft rows sum in different piece sizes, so their final tokens may differ at
    rounding ties only: both match the reference under the tie check, the walk outputs exactly."""
    g = torch.Generator().manual_seed(6)
    for style in ("flat", "peaked"):
        case = make_case(64, 4, V_BIG, g, style=style)
        zeros = clone_to(case, "cuda")
        op(*as_args(zeros))
        none_case = dict(case, draft_probs=None)
        none = clone_to(none_case, "cuda")
        op(*as_args(none))
        compare(case, zeros, 1.0, 1.0)
        compare(none_case, none, 1.0, 1.0)
        for k in ("accept_index", "accept_token_num"):
            assert torch.equal(zeros[k], none[k]), k


# ---- streams and threads --------------------------------------------------------------------------


@gpu
def test_two_streams_on_the_counter_path(counter_path):
    g = torch.Generator().manual_seed(7)
    cases = [make_case(4, 8, V_BIG, g, S=4) for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in cases]
    gots = [clone_to(c, "cuda") for c in cases]
    torch.cuda.synchronize()
    for _ in range(20):
        for s, got in zip(streams, gots):
            with torch.cuda.stream(s):
                _poison(got)
                counter_path(*as_args(got))
    torch.cuda.synchronize()
    for c, got in zip(cases, gots):
        compare(c, got, 1.0, 1.0)
    assert cupy_spec.check_scratch() == 0


@gpu
def test_launches_from_several_threads():
    g = torch.Generator().manual_seed(8)
    cases = [make_case(bs, 8, V, g) for bs, V in ((1, V_BIG), (4, V_BIG), (16, 32000), (64, 1000))]
    results, errors = [None] * len(cases), []

    def work(i):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(10):
                    got = clone_to(cases[i], "cuda")
                    op(*as_args(got))
                s.synchronize()
            results[i] = got
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for c, got in zip(cases, results):
        compare(c, got, 1.0, 1.0)


# ---- big shapes -----------------------------------------------------------------------------------


def _sparse_case_on_gpu(bs, n, V, g, hot=16):
    """A valid case built on the GPU: each row has ``hot`` random positive entries (cheap at any V)."""
    case = make_case(bs, n, 2, g, draft=False)  # tree, coins and outputs; rows replaced below
    idx = torch.randint(0, V, (bs, n, hot), generator=g)
    val = torch.rand(bs, n, hot, generator=g) + 0.01
    rows = torch.zeros(bs, n, V, device="cuda")
    rows.scatter_(2, idx.cuda(), val.cuda())
    rows /= rows.sum(-1, keepdim=True)
    # a child's token is its parent row's first hot token (4 in 5), so walks go deep
    nt, ns = case["retrive_next_token"], case["retrive_next_sibling"]
    par = _parents(nt, ns, reachable(nt, ns)).clamp(min=0)
    hot_of_parent = idx[:, :, 0].gather(1, par)
    case["candidates"] = torch.where(torch.rand(bs, n, generator=g) < 0.8, hot_of_parent,
                                     torch.randint(0, V, (bs, n), generator=g))
    case = {k: (None if v is None else v.cuda()) for k, v in case.items()}
    case["target_probs"] = rows
    return case


@gpu
@pytest.mark.parametrize("bs, n, V", [(130, 64, 262144), (300, 4, 262144), (257, 8, 151936)])
def test_big_shapes_match_reference(bs, n, V):
    """bs * n * V beyond 2**31 elements (64-bit offsets), Gemma-3's vocabulary, bs > 256."""
    if torch.cuda.get_device_properties(0).total_memory < 3 * 4 * bs * n * V:
        pytest.skip("not enough GPU memory")
    g = torch.Generator().manual_seed(bs + n)
    case = _sparse_case_on_gpu(bs, n, V, g)
    got = {k: (None if v is None else v.clone()) for k, v in case.items()}
    op(*as_args(got))
    torch.cuda.synchronize()
    compare(case, got, 1.0, 1.0, ref_device="cuda")


# ---- arrays on another GPU ------------------------------------------------------------------------


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cupy_arrays_on_the_second_gpu_are_not_copied():
    cupy = pytest.importorskip("cupy")
    case = make_case(5, 8, 32000, torch.Generator().manual_seed(9))
    with cupy.cuda.Device(1):
        arrays = {k: cupy.asarray(v.numpy()) for k, v in case.items()}
    ptrs = {k: a.data.ptr for k, a in arrays.items()}
    torch.cuda.set_device(0)
    op(*(arrays[k] for k in ARG_ORDER))
    with cupy.cuda.Device(1):
        cupy.cuda.get_current_stream().synchronize()
        got = {k: torch.from_numpy(cupy.asnumpy(a)) for k, a in arrays.items()}
    assert all(arrays[k].data.ptr == ptrs[k] for k in arrays)
    compare(case, got, 1.0, 1.0)
    tensors = clone_to(case, "cuda:1")
    op(*as_args(tensors))
    torch.cuda.synchronize(1)
    compare(case, tensors, 1.0, 1.0)


# ---- clusters only with sm_90 code ---------------------------------------------------------------


def _fake_device(monkeypatch, major: int, nvrtc: tuple, driver: int) -> None:
    """Device 0 without a GPU: 132 SMs of compute capability ``major``, NVRTC ``nvrtc``, a driver of
    CUDA version ``driver`` with cuLaunchKernelEx, its facts not yet read."""
    props = types.SimpleNamespace(multi_processor_count=132, major=major)
    monkeypatch.setattr(_launch, "_devices", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(_launch, "_launch_ex", lambda: object())
    monkeypatch.setattr(_launch._loader, "nvrtc_version", lambda: nvrtc)
    monkeypatch.setattr(_launch, "_driver_version", lambda: driver)


@pytest.mark.parametrize("nvrtc, major, clusters", [((12, 4), 9, True), ((11, 8), 9, True), ((11, 7), 9, False),
                                                    ((12, 4), 8, False)])
def test_clusters_need_an_nvrtc_that_builds_sm_90(monkeypatch, nvrtc, major, clusters):
    """Kernels built for an older architecture compile their cluster barriers to nothing, so a GPU
    with clusters must not get cluster launches when NVRTC cannot build sm_90 code."""
    _fake_device(monkeypatch, major, nvrtc, 12040)
    assert _launch.device_info(0) == _launch.DeviceInfo(0, 132, clusters, _launch.LARGEST_CLUSTER)
    assert _launch.pdl(0) == clusters  # programmatic dependent launch needs the same sm_90 code


# ---- programmatic dependent launch ---------------------------------------------------------------


@pytest.mark.parametrize("major, driver, flag, expected", [(9, 12030, True, True), (10, 13000, True, True),
                                                           (9, 12020, True, False), (8, 13000, True, False),
                                                           (9, 13000, False, False)])
def test_dependent_launch_needs_sm_90_and_a_driver_that_graphs_it(monkeypatch, major, driver, flag, expected):
    _fake_device(monkeypatch, major, (12, 4), driver)
    monkeypatch.setattr(_launch, "PDL", flag)
    assert _launch.pdl(0) is expected


def test_an_unreadable_driver_version_means_no_dependent_launch(monkeypatch):
    from cupy_backends.cuda.api import runtime

    def fail():
        raise runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(runtime, "driverGetVersion", fail)
    assert _launch._driver_version() == 0


def test_a_launch_status_other_than_success_raises():
    """Every op's fast path checks cuLaunchKernelEx's status, and a failure raises the driver's
    error (a RuntimeError; without a driver library, CuPy's RuntimeError saying so)."""
    from cupy_spec._core import OPS

    _launch.failed(0)
    with pytest.raises(RuntimeError) as e:
        _launch.failed(701)  # CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
    if torch.cuda.is_available():
        from cupy.cuda import driver

        assert isinstance(e.value, driver.CUDADriverError)
    for op_ in OPS.values():
        assert "_L.failed(_st)" in op_.fast_source, op_.name


@gpu
@pytest.mark.parametrize("name", sorted(cupy_spec._core.OPS))
def test_a_failed_launch_on_the_fast_path_raises_the_drivers_error(name):
    """cuLaunchKernelEx answering CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (701) to an eager call that
    takes the fast path (the generated code's fallback to the checked path is watched: it must not
    run): the call raises the driver's error instead of returning as if it ran."""
    from cupy.cuda import driver
    from test_torch_compile import CORE_ARGS

    op_ = cupy_spec._core.OPS[name]
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in CORE_ARGS[name](3)]
    op_.function(*args)  # plans the launch record
    torch.cuda.synchronize()
    if not all(rec[5] for rec in op_.records.values()):
        pytest.skip("this GPU launches without a launch config (no clusters, no dependent launch)")
    seen = []

    def refuse(cfg, fptr, argv, extra):
        seen.append(fptr)
        return 701

    names = op_.function.__globals__  # the generated code's names: its fallback is _slow
    slow, fallbacks = names["_slow"], []

    def watched(*a):
        fallbacks.append(a)
        return slow(*a)

    kept = _launch._launch_ex_fn[0]
    _launch._launch_ex_fn[0] = refuse  # the list the generated code reads (not rebound)
    names["_slow"] = watched
    try:
        with pytest.raises(driver.CUDADriverError, match="OUT_OF_RESOURCES"):
            op_.function(*args)
    finally:
        _launch._launch_ex_fn[0] = kept
        names["_slow"] = slow
    assert not fallbacks, "the eager call left the fast path"
    assert len(seen) == 1, "the call did not reach the launch"


@pytest.mark.parametrize("cluster, dependent", [(1, True), (4, False), (4, True)])
def test_launch_config_attributes(cluster, dependent):
    """cuLaunchKernelEx's config: the cluster dimension (4) along y and programmatic stream
    serialization (6), each only where asked for."""
    from types import SimpleNamespace

    cfg, _attrs = _launch._config(5, 3 * cluster, SimpleNamespace(cluster=cluster, block=256, smem=1024), 0, dependent)
    got = [(cfg.attrs[i].id, tuple(cfg.attrs[i].value[:3])) for i in range(cfg.num_attrs)]
    want = ([(4, (1, cluster, 1))] if cluster > 1 else []) + ([(6, (1, 0, 0))] if dependent else [])
    assert got == want
    assert (tuple(cfg.grid), tuple(cfg.block), cfg.shared_mem_bytes) == ((5, 3 * cluster, 1), (256, 1, 1), 1024)


@gpu
def test_dependent_launches_wait_for_the_kernel_before():
    """build_tree then verify_tree_greedy in one CUDA graph, the tree's links poisoned by a fill just
    before: greedy reads the links build_tree writes, and with programmatic dependent launch its blocks
    may start while build_tree still runs (build_tree allows it at its start), so a kernel that read
    before waiting would see poisoned or partly written links. Every replay must match the reference."""
    from cupy_spec import bench_tree_ops as bt, reference

    b = bt.build_inputs(64, 32, 4, seed=3)
    g = bt.greedy_inputs(64, 32, 4, seed=3)
    links = ("retrive_index", "retrive_next_token", "retrive_next_sibling")
    g.update({k: b[k] for k in links})
    outs = ("predicts", "accept_index", "accept_token_num")

    def step():
        for k in links:
            b[k].fill_(-7)
        cupy_spec.build_tree_kernel_efficient(**b)
        cupy_spec.verify_tree_greedy(**g)

    def expected() -> dict:
        wb = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        reference.build_tree_kernel_efficient(**wb)
        wg = {k: v.clone() for k, v in g.items()}
        wg.update({k: wb[k] for k in links})
        for k in outs:
            wg[k].fill_(-5)
        reference.verify_tree_greedy(**wg)
        return wg

    graph, _ = captured(step, calls=4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(20):
        g["target_predict"].copy_(torch.randint(0, 32000, g["target_predict"].shape, device="cuda", generator=gen)
                                  .where(torch.rand(g["target_predict"].shape, device="cuda", generator=gen) < 0.3,
                                         g["target_predict"]))
        for k in outs:
            g[k].fill_(-5)
        graph.replay()
        want = expected()
        for k in outs:
            assert torch.equal(g[k], want[k]), k


# ---- scratch bookkeeping, with the CUDA runtime mocked ---------------------------------------------


@pytest.fixture
def fake_runtime(monkeypatch):
    """Scratch with a recording stand-in for CuPy's runtime calls; ``capturing`` holds the streams
    that are capturing a graph."""
    runtime = pytest.importorskip("cupy_backends.cuda.api.runtime")
    calls, capturing = [], set()
    addresses = iter(range(1 << 20, 1 << 40, 1 << 20))
    monkeypatch.setattr(runtime, "malloc", lambda size: (calls.append("malloc"), next(addresses))[1])
    monkeypatch.setattr(runtime, "memset", lambda ptr, value, size: calls.append("memset"))
    monkeypatch.setattr(runtime, "deviceSynchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(_launch, "_capturing", lambda device, stream: stream in capturing)
    monkeypatch.setattr(_launch.Scratch, "slots", {})
    monkeypatch.setattr(_launch.Scratch, "assigned", {})
    monkeypatch.setattr(_launch.Scratch, "layout", {0: ({}, 256)})
    return calls, capturing


def test_new_slots_are_zeroed_before_any_stream_uses_them(fake_runtime):
    calls, _ = fake_runtime
    _launch.Scratch.prepare(0, 11)
    assert calls[-1] == "sync" and calls.count("memset") == calls.count("malloc") > 0


@pytest.mark.parametrize("eager_streams", range(1, 2 * _launch.Scratch.GROW + 1))
def test_a_spare_slot_survives_eager_use_of_new_streams(fake_runtime, eager_streams):
    """After warmup, eager calls on any number of new streams still leave a slot for a stream
    first used inside a capture."""
    _, capturing = fake_runtime
    _launch.Scratch.prepare(0, 11)  # warmup
    for stream in range(12, 12 + eager_streams):
        _launch.Scratch._slot(0, stream)  # eager first use
    capturing.add(99)
    slot = _launch.Scratch._slot(0, 99)  # no allocation during the capture
    assert slot not in [_launch.Scratch.slots[0][n] for (d, s), n in _launch.Scratch.assigned.items() if s != 99]


def test_warmup_after_a_capture_took_the_spare_makes_a_new_one(fake_runtime):
    _, capturing = fake_runtime
    scratch = _launch.Scratch
    scratch.prepare(0, 11)  # warmup
    stream = 90
    while len(scratch.assigned) < len(scratch.slots[0]):  # captures on new streams take every spare
        capturing.add(stream)
        scratch._slot(0, stream)
        stream += 1
    scratch.prepare(0, 11)  # warmup again, outside any capture
    capturing.add(stream)
    scratch._slot(0, stream)  # no allocation needed during this capture


def test_threads_on_the_per_thread_default_stream_get_their_own_slots(fake_runtime):
    """CuPy's per-thread default stream is one handle but a different stream in every thread."""
    got, together = [], threading.Barrier(3)  # all alive at once (a finished thread's id may be reused)

    def take():
        with _launch.Scratch.lock:
            got.append(_launch.Scratch._slot(0, _launch.PER_THREAD_STREAM))
        together.wait()

    threads = [threading.Thread(target=take) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 3
    assert _launch.Scratch._slot(0, 11) == _launch.Scratch._slot(0, 11)  # other handles: one slot per stream


@gpu
def test_vocabulary_above_the_kernels_limit_is_refused():
    """The target-only kernel adds 3 to a row unit's first token in 32-bit arithmetic, so V stops
    at 2**31 - 5 (no memory is touched: the shape is refused before the launch)."""
    from cupy_spec.tree_speculative_sampling_target_only import MAX_V

    case = clone_to(make_case(1, 1, 4, torch.Generator().manual_seed(5)), "cuda")
    case["draft_probs"] = None
    case["target_probs"] = torch.empty(2**31 - 4, device="cuda").view(1, 1, -1)
    assert case["target_probs"].shape[2] == MAX_V + 1
    with pytest.raises(ValueError, match=f"V = {MAX_V + 1} .* limit of {MAX_V}"):
        op(*as_args(case))
