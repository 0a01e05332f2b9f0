"""The examples run: every ``examples/*.py`` as a subprocess, and the notebook headless.

Convention: every example script ends by printing a line that starts with ``OK``. Scripts that
take command-line arguments get small ones from ``SMALL_ARGS`` so the suite stays fast; any other
script in ``examples/`` is run without arguments. Scripts and the notebook run from the repository
root with ``PYTHONPATH`` set to it (no installation needed) and ``MPLBACKEND=Agg``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))

SMALL_ARGS = {
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
        pytest.skip(f"executing notebooks needs {', '.join(missing)} (pip install nbclient ipykernel)")
    import nbformat
    from nbclient import NotebookClient

    return nbformat, NotebookClient


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_stored_without_outputs(path):
    import json

    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"cell {i} has stored output"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    nbformat, NotebookClient = _notebook_tools()
    for key, value in _env().items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)  # the kernel inherits this environment
    nb = nbformat.read(str(path), as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code_cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    expected = NOTEBOOK_FINAL_OUTPUT.get(path.name)
    if expected is not None:
        text = "".join(o.get("text", "") for o in code_cells[-1].outputs if o.output_type == "stream")
        assert expected in text, f"last cell printed {text!r}"
