"""The command line (``python -m cupy_spec``): failures a user can act on end with one line on stderr
and a non-zero exit status, never a traceback.

"No GPU" is simulated with ``CUDA_VISIBLE_DEVICES=""`` (so these tests hold on GPU machines too);
"no CuPy" with an import hook that makes ``cupy`` and ``cupy_backends`` unimportable.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cupy_spec import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]

# Runs ``python -m cupy_spec ARGS`` with cupy and cupy_backends unimportable.
NO_CUPY = r"""
import runpy, sys

class NoCupy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupy_backends"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoCupy())
runpy.run_module("cupy_spec", run_name="__main__", alter_sys=True)
"""


def run_cli(*args: str, no_gpu: bool = True, no_cupy: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if no_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-c", NO_CUPY, *args] if no_cupy else [sys.executable, "-m", "cupy_spec", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, status: int, *phrases: str) -> str:
    where = f"\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == status, f"exit status {proc.returncode}, expected {status}{where}"
    assert "Traceback" not in proc.stderr, where
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr{where}"
    for phrase in phrases:
        assert phrase in lines[0], f"{phrase!r} not in {lines[0]!r}"
    return lines[0]


def _has_nvrtc() -> bool:
    try:
        return importlib.util.find_spec("cupy_backends.cuda.libs.nvrtc") is not None
    except ImportError:
        return False


# ---- subprocesses: the real entry point ----------------------------------------------------------


def test_warmup_without_gpu():
    proc = run_cli("warmup")
    assert_one_line_error(proc, 1, "warmup needs a CUDA GPU")
    assert proc.stdout == ""


def test_bench_without_gpu():
    assert_one_line_error(run_cli("bench", "--quick"), 1, "bench needs a CUDA GPU")


def test_compile_without_cupy():
    line = assert_one_line_error(run_cli("compile", "--arch", "sm_90", no_cupy=True), 1,
                                 "compile needs CuPy with NVRTC", "cupy")
    assert "cuda12" in line  # says what to install


def test_compile_rejects_malformed_arch_before_compiling():
    # Without CuPy, so the arch is checked before anything is imported or compiled.
    line = assert_one_line_error(run_cli("compile", "--arch", "bogus", no_cupy=True), 2, "'bogus'", "sm_<digits>")
    assert "sm_90" in line


def test_info_notes_a_torch_cuda_build_that_nvrtc_does_not_match(monkeypatch, capsys):
    pytest.importorskip("cupy")
    import torch

    from cupy_spec import __main__ as cli, _loader

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_loader, "nvrtc_version", lambda: (12, 9))
    assert cli._info(None) == 0
    out = capsys.readouterr().out
    assert "(CUDA 13.0)" in out and "note: torch is built for CUDA 13.0 and NVRTC is 12.x" in out
    monkeypatch.setattr(_loader, "nvrtc_version", lambda: (13, 0))
    cli._info(None)
    assert "note:" not in capsys.readouterr().out


def test_info_without_cupy_or_gpu():
    proc = run_cli("info", no_cupy=True)
    assert proc.returncode == 0, proc.stderr
    assert "cupy / NVRTC unavailable" in proc.stdout and "GPU: none" in proc.stdout


@pytest.mark.skipif(not _has_nvrtc(), reason="needs CuPy with NVRTC")
def test_compile_arch_unknown_to_nvrtc():
    line = assert_one_line_error(run_cli("compile", "--arch", "sm_80,sm_1"), 2, "cannot target sm_1", "supports")
    assert "sm_80" in line.split("supports", 1)[1]


# ---- in process ------------------------------------------------------------------------------


@pytest.mark.parametrize("text,archs", [
    ("sm_90", ["sm_90"]),
    ("sm_80,sm_90", ["sm_80", "sm_90"]),
    (" sm_80 , sm_120 ", ["sm_80", "sm_120"]),
])
def test_parse_archs_accepts(text, archs):
    assert cli.parse_archs(text) == archs


@pytest.mark.parametrize("text", ["bogus", "sm90", "sm_", "90", "compute_90", "SM_90", "sm_80,", "sm_80;sm_90",
                                  "sm_9x", "", "sm_090", "sm_0"])
def test_parse_archs_rejects(text):
    with pytest.raises(cli.CommandError) as e:
        cli.parse_archs(text)
    assert e.value.status == 2
    msg = str(e.value)
    assert "sm_<digits>" in msg and "sm_80,sm_90" in msg and "\n" not in msg


def test_main_prints_command_errors_as_one_line(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["warmup"]) == 1
    assert cli.main(["compile", "--arch", "sm-90"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "warmup needs a CUDA GPU" in lines[0] and "'sm-90'" in lines[1]


def test_warmup_runtime_error_is_one_line(monkeypatch, capsys):
    import torch

    import cupy_spec

    def fail(device=None, stream=None):
        raise RuntimeError("no usable CUDA driver\nsecond line")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cupy_spec, "warmup", fail)
    assert cli.main(["warmup"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "warmup failed: no usable CUDA driver"


def test_warmup_missing_cupy_is_one_line(monkeypatch, capsys):
    import torch

    import cupy_spec

    def fail(device=None, stream=None):
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cupy_spec, "warmup", fail)
    assert cli.main(["warmup"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("warmup needs CuPy with NVRTC") and "cuda12" in err


def test_bench_output_folder_checked_first(tmp_path, capsys):
    missing = tmp_path / "missing" / "bench.json"
    assert cli.main(["bench", "--json", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not exist" in err


@pytest.mark.parametrize("path, why", [("", "the path is empty"), ("DIR", "is a directory")])
def test_bench_output_path_must_name_a_file(tmp_path, capsys, path, why):
    assert cli.main(["bench", "--json", str(tmp_path) if path == "DIR" else path]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and why in err


def test_warmup_cache_error_is_one_line(monkeypatch, capsys):
    import torch

    import cupy_spec

    def fail(device=None, stream=None):
        raise PermissionError(13, "Permission denied", "/cache/x.cubin")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cupy_spec, "warmup", fail)
    assert cli.main(["warmup"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("warmup failed:") and "Permission denied" in err


def test_missing_kernel_sources_are_one_line(monkeypatch, capsys):
    from cupy_spec import _loader

    def missing():
        raise FileNotFoundError("cupy_spec kernel sources not found next to /x")

    monkeypatch.setattr(_loader, "kernel_dir", missing)
    assert cli.main(["info"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "kernel sources not found" in err and "reinstall" in err


def test_bench_help_cites_the_contract(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "docs/contract.md" in out and "SPEC" not in out
    assert (ROOT / "docs" / "contract.md").is_file()


def test_top_level_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("info", "warmup", "compile", "bench"):
        assert command in out
    assert "SPEC" not in out


def test_from_logits_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from cupy_spec import bench_from_logits

    rows = [dict(V=V, n=n, bs=bs, op_us=10.0 * bs, torch_us=100.0 * bs, floor_all_us=0.1 * bs * n, floor_row_us=0.1 * bs)
            for V in (32000, 151936) for n in (8, 64) for bs in (1, 16, 256)]
    path = tmp_path / "fl.png"
    bench_from_logits.plot(rows, str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_from_logits_bench_goes_on_where_the_torch_pipeline_runs_out_of_memory(monkeypatch, tmp_path):
    """A GPU too small for the torch pipeline's sorts at the largest point (an 80 GB card at
    V=151936, n=64, bs=256): that point reports no torch time, the rest of the grid runs, the plot
    skips the missing value."""
    from cupy_spec import bench_from_logits as bfl

    def graph_us(fn):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(bfl, "graph_us", graph_us)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert bfl._torch_us({}) is None
    if importlib.util.find_spec("matplotlib") is not None:
        rows = [dict(V=32000, n=8, bs=bs, op_us=10.0, torch_us=None if bs == 256 else 50.0, floor_all_us=1.0,
                     floor_row_us=0.5) for bs in (1, 16, 256)]
        bfl.plot(rows, str(tmp_path / "fl.png"), "title")
        assert (tmp_path / "fl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chain_floor_counts_the_rows_the_op_must_read():
    """The chain bench's bytes floor: one row for a request that accepted every draft (the bonus
    row), two after a rejection with a valid draft id (target and draft row), one after a rejection
    whose draft id lies outside [0, V) (nothing is subtracted)."""
    from cupy_spec import bench_sampling as bs

    k, V = bs.K, 10
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, -1, 3, 4], [1, 2, V, 4], [0, 0, 0, 0]])
    d = dict(draft_token_ids=ids, target_probs=torch.zeros(5, k + 1, V))
    emitted = torch.tensor([k, 0, 1, 2, 3], dtype=torch.int32)  # bonus, valid, -1, V, valid
    assert bs.rows_read(d, emitted) == 1 + 2 + 1 + 1 + 2
    assert bs.rows_read(d, torch.full((5,), k, dtype=torch.int32)) == 5
