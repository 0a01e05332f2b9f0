"""The examples run: every ``examples/*.py`` as a subprocess, and the notebook headless.

Convention: every example script ends by printing a line that starts with ``OK``. Scripts that
take command-line arguments get small ones from ``SMALL_ARGS`` so the suite stays fast; any other
script in ``examples/`` is run without arguments. Scripts and the notebook run from the repository
root with ``PYTHONPATH`` set to it (no installation needed); scripts with ``MPLBACKEND=Agg``, the
notebook with the kernel's inline backend.

The notebook is stored executed (outputs and figures visible when browsing the repository); the
test executes a copy, so the stored file is never rewritten by the suite. Re-execute the stored
notebook in place with
``jupyter nbconvert --to notebook --execute --inplace examples/tree_speculative_sampling.ipynb``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))

SMALL_ARGS = {
    "bench_from_logits.py": ["--quick"],
    "speculative_decoding.py": ["--batch", "32", "--steps", "8", "--perms", "50", "--seed", "1"],
}

#: What the last executed code cell of each notebook prints (a recognizable end).
NOTEBOOK_FINAL_OUTPUT = {
    "tree_speculative_sampling.ipynb": "EAGLE-like",
}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["MPLBACKEND"] = "Agg"
    return env


def test_examples_exist():
    assert (EXAMPLES / "speculative_decoding.py").is_file()
    assert (EXAMPLES / "tree_speculative_sampling.ipynb").is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_example_script_runs(script):
    cmd = [sys.executable, str(script.relative_to(ROOT))] + SMALL_ARGS.get(script.name, [])
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    tail = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}{tail}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{script.name} printed nothing{tail}"
    assert lines[-1].startswith("OK"), f"{script.name}: last line does not start with 'OK': {lines[-1]!r}{tail}"


def test_bench_from_logits_without_a_gpu_writes_nothing_and_says_so(monkeypatch, tmp_path, capsys):
    """Asked for files it cannot make, the benchmark fails instead of printing OK; a folder that does
    not exist is an argument error."""
    from cupy_spec import bench_from_logits

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_from_logits.main(["--quick"]) == 0
    assert capsys.readouterr().out.startswith("OK: no CUDA GPU here")
    assert bench_from_logits.main(["--quick", "--json", str(tmp_path / "rows.json")]) == 1
    assert "no --json / --plot file was written" in capsys.readouterr().err and not (tmp_path / "rows.json").exists()
    with pytest.raises(SystemExit) as exit_info:
        bench_from_logits.main(["--plot", str(tmp_path / "missing" / "p.png")])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err


def _notebook_tools():
    missing = []
    for mod in ("nbformat", "nbclient", "ipykernel"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        pytest.skip(f"executing notebooks needs {', '.join(missing)} (the test extra: pip install \".[test]\")")
    import nbformat
    from nbclient import NotebookClient

    return nbformat, NotebookClient


#: Largest stored notebook: outputs keep small figures only.
MAX_NOTEBOOK_BYTES = 1_000_000


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_stored_with_outputs(path):
    """The committed notebook shows its results: every code cell was executed, in order, and has
    output; no cell stored an error; figures are stored; the file stays small."""
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{path.name} is {path.stat().st_size} bytes"
    nb = json.loads(path.read_text())
    code = [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    assert code
    for k, (i, cell) in enumerate(code, start=1):
        assert cell.get("outputs"), f"code cell {i} has no stored output (re-execute the notebook in place)"
        assert cell.get("execution_count") == k, f"code cell {i} has execution_count {cell.get('execution_count')}, not {k}"
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        assert not errors, f"code cell {i} stored an error: {errors[0].get('ename')}: {errors[0].get('evalue')}"
        streams = [o for o in cell["outputs"] if o["output_type"] == "stream"]
        assert all(o.get("name") != "stderr" for o in streams), f"code cell {i} stored stderr output"
    images = [o for _, c in code for o in c["outputs"] if "image/png" in o.get("data", {})]
    assert images, "no figure is stored"
    expected = NOTEBOOK_FINAL_OUTPUT.get(path.name)
    if expected is not None:
        text = "".join("".join(o.get("text", "")) for o in code[-1][1]["outputs"] if o["output_type"] == "stream")
        assert expected in text, f"last cell stored {text!r}"


def _output_kind(output) -> str:
    if output.get("output_type") == "stream":
        return "stream:" + output.get("name", "")
    return output.get("output_type", "") + ":" + ",".join(sorted(output.get("data", {})))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    nbformat, NotebookClient = _notebook_tools()
    env = _env()
    del env["MPLBACKEND"]  # the kernel's inline backend stores figures, as when the notebook is re-executed
    monkeypatch.delenv("MPLBACKEND", raising=False)
    for key, value in env.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)  # the kernel inherits this environment
    copy = tmp_path / path.name
    shutil.copyfile(path, copy)
    nb = nbformat.read(str(copy), as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell
    nbformat.write(nb, str(copy))
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code_cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    # The stored outputs have the same kinds as fresh ones (text where it prints, a figure where it draws).
    stored = [c for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code"]
    for i, (fresh, old) in enumerate(zip(code_cells, stored)):
        kinds = [_output_kind(o) for o in fresh.outputs]
        assert kinds == [_output_kind(o) for o in old.outputs], (
            f"code cell {i} now outputs {kinds}; re-execute the stored notebook in place"
        )
    expected = NOTEBOOK_FINAL_OUTPUT.get(path.name)
    if expected is not None:
        text = "".join(o.get("text", "") for o in code_cells[-1].outputs if o.output_type == "stream")
        assert expected in text, f"last cell printed {text!r}"


# ---- examples/speculative_decoding.py: argument validation ------------------------------------


def _speculative_decoding():
    spec = importlib.util.spec_from_file_location("speculative_decoding_example", EXAMPLES / "speculative_decoding.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args", [["--batch", "0"], ["--steps", "0"]], ids=["batch0", "steps0"])
def test_speculative_decoding_zero_sizes_are_argument_errors(args):
    """The real entry point: exit status 2 and argparse's message, no traceback."""
    cmd = [sys.executable, "examples/speculative_decoding.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"argument {args[0]}: must be >= 1, got 0" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args,message", [
    (["--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["--batch", "-3"], "argument --batch: must be >= 1, got -3"),
    (["--batch", "many"], "argument --batch: expected an integer, got 'many'"),
    (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--perms", "0"], "argument --perms: must be >= 1, got 0"),
    (["--topk", "0"], "argument --topk: must be >= 1, got 0"),
    (["--depth", "0"], "argument --depth: must be >= 1, got 0"),
    (["--nodes", "0"], "argument --nodes: must be >= 1, got 0"),
    (["--vocab", "1"], "argument --vocab: must be in [2, 256], got 1"),
    (["--vocab", "100000"], "argument --vocab: must be in [2, 256], got 100000"),
    (["--vocab", "8", "--topk", "9"], "--topk 9 exceeds --vocab 8"),
    (["--depth", "2", "--topk", "2", "--nodes", "8"], "--nodes 8 is more than a tree of depth 2 and topk 2 can hold"),
    (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
    (["--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
    (["--temperature", "nan"], "argument --temperature: expected a finite number, got 'nan'"),
    (["--temperature", "hot"], "argument --temperature: expected a number, got 'hot'"),
    (["--min-p", "1"], "argument --min-p: must be in [0, 1), got 1"),
    (["--min-p", "-0.1"], "argument --min-p: must be in [0, 1), got -0.1"),
    (["--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
])
def test_speculative_decoding_rejects_bad_arguments(args, message, capsys):
    module = _speculative_decoding()
    with pytest.raises(SystemExit) as e:
        module.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_speculative_decoding_smallest_run(capsys):
    """One sequence, one step, the smallest tree: runs and reports."""
    module = _speculative_decoding()
    module.main(["--device", "cpu", "--batch", "1", "--steps", "1", "--perms", "1", "--vocab", "2", "--topk", "1",
                 "--depth", "1", "--nodes", "2", "--no-control"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[-1].startswith("OK")


def test_speculative_decoding_docstring_needs_no_pythonpath_dot():
    doc = _speculative_decoding().__doc__
    assert "PYTHONPATH=." not in doc and "pip install ." in doc


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("vocab, topk, depth, nodes", [(16, 2, 3, 6), (32, 4, 5, 16), (8, 1, 4, 5), (64, 8, 4, 64)])
def test_greedy_round_trip_is_the_target_greedy_continuation(device, vocab, topk, depth, nodes):
    """Draft with top-k, build the tree with build_tree_kernel_efficient, verify with
    verify_tree_greedy: the text equals the target's greedy continuation token for token, and the
    draft is good enough that more than one token per step is emitted."""
    module = _speculative_decoding()
    gen = torch.Generator().manual_seed(vocab + nodes)
    models = module.TrigramModels(vocab, keep=vocab // 2, noise=1.0, draft_temp=1.0, gen=gen, device=device)
    prompts = torch.randint(vocab, (24, 2), generator=gen)
    seqs, acc = module.greedy_speculative_generate(models, prompts, 6, topk, depth, nodes)
    ref = module.greedy_generate(models, prompts, max(len(s) for s in seqs) - 2)
    for i, s in enumerate(seqs):
        assert s == ref[i, : len(s)].tolist(), f"sequence {i} differs from greedy decoding"
    assert acc.double().mean() > 0.3


# ---- examples/speculative_decoding.py: temperature, top-k, top-p, min-p -----------------------

#: A small filtered run: temperature 0.7, then top-5, then top-p 0.9 (main's seed fixes the models).
FILTERED = ["--batch", "256", "--steps", "16", "--perms", "200", "--seed", "2", "--vocab", "32",
            "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--no-control"]  # fmt: skip


def _models_of_main(module, seed: int, vocab: int, device):
    """The toy models main builds for ``--seed seed --vocab vocab`` (the same generator calls)."""
    gen = torch.Generator().manual_seed(seed)
    return module.TrigramModels(vocab, keep=vocab // 2, noise=1.5, draft_temp=1.3, gen=gen, device=device)


def _top_k_top_p_support(logits: torch.Tensor, T: float, k: int, p: float) -> torch.Tensor:
    """bool [..., V]: tokens kept by softmax(logits / T), then top-k, then top-p, written directly
    (random float logits have no ties): sorted by probability, a token of the top k is kept while
    the renormalised mass of the tokens before it is below p."""
    probs = torch.softmax(logits.double() / T, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    in_k = torch.arange(logits.shape[-1]) < k
    sorted_p = torch.where(in_k, sorted_p, torch.zeros_like(sorted_p))
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = in_k & (before < p)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_speculative_decoding_filtered_sampling(device, capsys):
    """With temperature / top-k / top-p the verifier's rows are the filtered target: every emitted
    token lies in the filtered support, the statistics agree with autoregressive sampling from the
    filtered rows, and the same check clearly rejects the unfiltered target."""
    module = _speculative_decoding()
    summary = module.main(["--device", device, *FILTERED])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert "sampling: temperature 0.7, top-k 5, top-p 0.9, min-p off" in lines
    assert lines[-1].startswith("OK") and "agree within noise" in lines[-1], lines[-1]
    assert summary["p_value"] >= 0.01

    V = 32
    models = _models_of_main(module, seed=2, vocab=V, device="cpu")
    support = _top_k_top_p_support(models.target_logits, 0.7, 5, 0.9)  # [V, V, V]
    assert bool((support.sum(-1) <= 5).all()) and bool((support.sum(-1) < V // 2).any())
    # The rows the statistics compare against have exactly that support.
    target = summary["target"]
    assert torch.equal(target > 0, support)
    assert torch.allclose(target.sum(-1), torch.ones(V, V, dtype=torch.float64))

    seqs = summary["seqs"]
    assert len(seqs) == 256 and all(len(s) >= 2 + 16 for s in seqs)
    outside = [(i, t) for i, s in enumerate(seqs) for t in range(2, len(s)) if not support[s[t - 2], s[t - 1], s[t]]]
    assert not outside, f"{len(outside)} emitted tokens outside the top-k/top-p support, e.g. {outside[:5]}"

    # Power: the same two-sample test against plain sampling from the unfiltered target fails.
    L = 16
    spec = torch.tensor([s[: 2 + L] for s in seqs])
    gen = torch.Generator().manual_seed(5)
    ar = module.autoregressive_generate(models, spec[:, :2], L, gen)
    _, p = module.permutation_test(module.bigram_counts(spec, V), module.bigram_counts(ar, V), V, 200, gen)
    assert p < 0.01, f"the unfiltered target was not told apart (p = {p:.3f})"


def test_speculative_decoding_temperature_zero_is_greedy(capsys):
    """Temperature 0 makes every request of the fused op greedy: the text is the target's greedy
    continuation token for token, whatever the filters."""
    module = _speculative_decoding()
    summary = module.main(["--device", "cpu", "--batch", "16", "--steps", "6", "--perms", "20", "--seed", "4",
                           "--temperature", "0", "--top-k", "3", "--top-p", "0.5"])  # fmt: skip
    out = capsys.readouterr().out
    assert "greedy requests: token for token equal to the target's greedy continuation: True" in out
    assert "control, threshold_acc=0.5: skipped" in out
    models = _models_of_main(module, seed=4, vocab=32, device="cpu")
    seqs = summary["seqs"]
    prompts = torch.tensor([s[:2] for s in seqs])
    ref = module.greedy_generate(models, prompts, max(len(s) for s in seqs) - 2)
    for i, s in enumerate(seqs):
        assert s == ref[i, : len(s)].tolist(), f"sequence {i} differs from greedy decoding"
    # One-hot rows at the argmax of every context.
    assert torch.equal(summary["target"], torch.nn.functional.one_hot(models.target.argmax(-1), 32).double())


def test_speculative_decoding_default_sampling_is_the_target():
    """Temperature 1 without filters: the verifier's rows are the target's rows as they are."""
    module = _speculative_decoding()
    models = _models_of_main(module, seed=0, vocab=24, device="cpu")
    rows = module.filtered_target(models, module.SamplingParams())
    assert torch.allclose(rows, models.target.double(), rtol=0, atol=1e-6)
    assert torch.equal(rows > 0, models.target > 0)
