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
