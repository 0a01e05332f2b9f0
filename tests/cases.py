"""Random op inputs for kernel-vs-reference tests (valid trees, optionally hostile ones), and a
stubbed loader for launch-record tests without a GPU."""

from __future__ import annotations

import contextlib
import signal
import types

import torch

from cupy_spec.tree_speculative_sampling_target_only import OP

ARG_ORDER = tuple(a.name for a in OP.tensors)  # the op's tensor arguments, in order

POISON = -7


def random_tree(bs: int, n: int, g: torch.Generator, max_children: int | None = None):
    """Random trees with parents[i] < i; children linked in index order. Returns (next_token,
    next_sibling, parents, depth) as int64 [bs, n]."""
    ar = torch.arange(bs)
    parents = torch.full((bs, n), -1, dtype=torch.long)
    for i in range(1, n):
        hi = i if max_children is None else i
        parents[:, i] = torch.randint(0, hi, (bs,), generator=g)
        if max_children is not None:  # bias towards recent nodes: deeper, narrower trees
            parents[:, i] = torch.clamp(i - 1 - torch.randint(0, max_children, (bs,), generator=g), min=0)
    nt = torch.full((bs, n), -1, dtype=torch.long)
    ns = torch.full((bs, n), -1, dtype=torch.long)
    for i in range(n - 1, 0, -1):
        p = parents[:, i]
        ns[:, i] = nt[ar, p]
        nt[ar, p] = i
    depth = torch.zeros((bs, n), dtype=torch.long)
    for i in range(1, n):
        depth[:, i] = depth[ar, parents[:, i]] + 1
    return nt, ns, parents, depth


def random_rows(bs, n, V, g, style: str) -> torch.Tensor:
    """float32 [bs, n, V] probability rows: 'flat', 'peaked', 'sparse' (exact zeros), 'onehot'."""
    if style == "onehot":
        rows = torch.zeros(bs, n, V)
        rows.scatter_(2, torch.randint(0, V, (bs, n, 1), generator=g), 1.0)
        return rows
    logits = torch.randn(bs, n, V, generator=g) * (3.0 if style != "flat" else 0.5)
    if style == "peaked":
        hot = torch.randint(0, V, (bs, n, 1), generator=g)
        logits.scatter_add_(2, hot, torch.full((bs, n, 1), 14.0))
    probs = torch.softmax(logits, dim=-1)
    if style == "sparse" and V > 1:
        k = max(1, V // 8)
        top = probs.topk(k, dim=-1)
        probs = torch.zeros_like(probs).scatter_(2, top.indices, top.values)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.float()


def make_case(bs, n, V, g, style="peaked", S=None, draft=True, dup=False, coin_edges=False):
    """A dict of op arguments (CPU tensors); outputs poisoned."""
    nt, ns, parents, depth = random_tree(bs, n, g, max_children=None if n < 4 else int(torch.randint(1, 5, (1,), generator=g)))
    if S is None:
        S = int(depth.max()) + 1
    rows = random_rows(bs, n, V, g, style)
    ar = torch.arange(bs)
    cand = torch.zeros(bs, n, dtype=torch.long)
    # Each child's token is drawn from its parent's row (so acceptance is frequent).
    for i in range(1, n):
        prow = rows[ar, parents[:, i]]
        cand[:, i] = torch.multinomial(prow.clamp(min=0) + 1e-30, 1, generator=g).squeeze(1)
    cand[:, 0] = torch.randint(0, V, (bs,), generator=g)
    if dup and n > 2:
        duplicate_siblings(cand, ns, g)
    us = torch.rand(bs, n, generator=g)
    usf = torch.rand(bs, generator=g)
    if coin_edges:
        pick = torch.rand(bs, n, generator=g)
        us = torch.where(pick < 0.15, torch.zeros_like(us), us)
        us = torch.where(pick > 0.85, torch.full_like(us, 1 - 2**-24), us)
        usf = torch.where(torch.rand(bs, generator=g) < 0.3, torch.full_like(usf, 1 - 2**-24), usf)
    return dict(**tree_arrays(S, cand, nt, ns), uniform_samples=us, uniform_samples_for_final_sampling=usf,
                target_probs=rows, draft_probs=torch.zeros(bs, n, V) if draft else None)


def duplicate_siblings(cand: torch.Tensor, ns: torch.Tensor, g) -> None:
    """Copies each node's token onto its next sibling with probability 1/2 (in place)."""
    has = ns >= 0
    src = torch.where(has, ns, torch.zeros_like(ns))
    take = has & (torch.rand(*ns.shape, generator=g) < 0.5)
    cand.scatter_(1, src, torch.where(take, cand, cand.gather(1, src)))


def tree_arrays(S: int, cand: torch.Tensor, nt: torch.Tensor, ns: torch.Tensor) -> dict:
    """The poisoned outputs and the tree of a case (retrive_index b * n + i), in argument order."""
    bs, n = cand.shape
    return dict(
        predicts=torch.full((bs * n,), POISON, dtype=torch.int32),
        accept_index=torch.full((bs, S), POISON, dtype=torch.int32),
        accept_token_num=torch.full((bs,), POISON, dtype=torch.int32),
        candidates=cand,
        retrive_index=(torch.arange(bs)[:, None] * n + torch.arange(n)).long(),
        retrive_next_token=nt,
        retrive_next_sibling=ns,
    )


def at_offset(x: torch.Tensor, offset: int) -> torch.Tensor:
    """A contiguous copy of x whose data starts ``offset`` elements past an allocation's start (NaN
    before it), so that rows begin off the 16-byte boundaries of vector loads."""
    buf = torch.full((x.numel() + offset,), float("nan"), dtype=x.dtype, device=x.device)
    view = buf[offset:].view_as(x)
    view.copy_(x)
    return view


def clone_to(case: dict, device) -> dict:
    return {k: (None if v is None else v.clone().to(device)) for k, v in case.items()}


def as_args(case: dict) -> tuple:
    return tuple(case[k] for k in ARG_ORDER)


def run_reference(case: dict, ts: float, ta: float, device="cpu"):
    """Runs the reference on copies on ``device``; returns (outputs dict, residual rows, final coins)."""
    from cupy_spec import reference

    ref = clone_to(case, device)
    r, coin = reference.tree_speculative_sampling_target_only(*as_args(ref), ts, ta, return_residual=True)
    return ref, r, coin


def compare(case: dict, got: dict, ts: float, ta: float, slack_tol: float = 2e-6, ref_device="cpu") -> int:
    """Asserts the op's outputs ``got`` match the reference (run on ``ref_device``) exactly, except
    final tokens at genuine rounding ties (u within slack_tol of the kernel token's prefix
    interval). Returns the tie count."""
    ref, r, coin = run_reference(case, ts, ta, ref_device)
    ref = {k: (None if v is None else v.cpu()) for k, v in ref.items()}
    r, coin = r.cpu(), coin.cpu()
    got = {k: (None if v is None else v.cpu()) for k, v in got.items()}
    assert torch.equal(got["accept_token_num"], ref["accept_token_num"]), "accept_token_num differs"
    assert torch.equal(got["accept_index"], ref["accept_index"]), "accept_index differs"
    if ref["draft_probs"] is not None:
        assert torch.equal(got["draft_probs"].view(torch.int32), ref["draft_probs"].view(torch.int32)), "draft_probs differs"
    return check_final_tokens(case["retrive_index"].cpu(), ref, got, r, coin, slack_tol)


def check_final_tokens(retrive_index, ref: dict, got: dict, r, coin, slack_tol: float) -> int:
    """Asserts ``got["predicts"]`` equals ``ref["predicts"]`` (CPU tensors) off each sampled
    request's final-token position and, at those positions, differs only at genuine rounding ties:
    coin ``coin[b]`` within ``slack_tol`` of the kernel token's interval of the prefix sums of the
    reference's final row ``r[b]``. Returns the tie count."""
    from cupy_spec.reference import final_token_slack

    P = ref["predicts"].shape[0]
    ri0 = retrive_index[:, 0]
    rows = torch.arange(ri0.shape[0])[(ri0 >= 0) & (ri0 < P)]
    pos = ref["accept_index"][rows, ref["accept_token_num"][rows].long()].long()
    mask = torch.ones(P, dtype=torch.bool)
    mask[pos] = False
    assert torch.equal(got["predicts"][mask], ref["predicts"][mask]), "predicts differ off the final tokens"
    gk, rk = got["predicts"][pos], ref["predicts"][pos]
    differ = gk != rk
    if not differ.any():
        return 0
    slack = final_token_slack(r[rows[differ]], coin[rows[differ]], gk[differ])
    bad = ~(slack <= slack_tol)
    assert not bad.any(), (
        f"final tokens differ beyond rounding ties: requests {rows[differ][bad].tolist()}, "
        f"kernel {gk[differ][bad].tolist()}, reference {rk[differ][bad].tolist()}, slack {slack[bad].tolist()}"
    )
    return int(differ.sum())


@contextlib.contextmanager
def no_hang(seconds: float = 20.0):
    """Turns a hang (e.g. a walk looping on a cyclic tree) into a test failure (CPU code only)."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fail(*_):
        raise TimeoutError(f"the op did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def captured(call, calls: int = 1):
    """(a CUDA graph of ``calls`` calls of ``call()``, what the last captured call returned), after
    ``cupy_spec.warmup()`` and one warm call on a side stream (:func:`cupy_spec.bench.captured`)."""
    import cupy_spec
    from cupy_spec.bench import captured as capture

    cupy_spec.warmup()
    return capture(call, calls)


def stub_loader(monkeypatch, clusters: bool, dependent: bool = False) -> list:
    """A 132-SM device without a GPU (with clusters, with programmatic dependent launch, as asked):
    the loader records the kernel names it is asked for (returned) and gives each kernel a pointer of
    its own, as the driver does."""
    from cupy_spec import _launch

    loaded, ptrs = [], {}

    def get_function(op, name, device):
        loaded.append(name)
        ptr = ptrs.setdefault(name, len(ptrs) + 1)
        return types.SimpleNamespace(max_dynamic_shared_size_bytes=1 << 20, kernel=types.SimpleNamespace(ptr=ptr))

    monkeypatch.setattr(_launch, "_devices", {0: (132, clusters, dependent)})
    monkeypatch.setattr(_launch, "CLUSTERS", True)
    monkeypatch.setattr(_launch._loader, "get_function", get_function)
    return loaded
