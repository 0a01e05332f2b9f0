"""What the project ships: the wheel carries LICENSE, the kernel sources and the contract; the
metadata names the license; docs/contract.md agrees with the benchmark's numbers.

The wheel is built offline with ``pip wheel --no-deps --no-build-isolation``, which needs the build
backend (hatchling, in the test extra) installed; without it those tests skip.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "docs" / "contract.md"
MIN_HATCHLING = (1, 27)  # first release with license-files (PEP 639)


def _hatchling_version():
    try:
        version = importlib.metadata.version("hatchling")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    version = _hatchling_version()
    if version is None or version < MIN_HATCHLING:
        pytest.skip(f"building the wheel offline needs hatchling >= {'.'.join(map(str, MIN_HATCHLING))} "
                    f"installed (found {version}); it is in the test extra: pip install \".[test]\"")
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("cupy_spec-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as z:
        yield z


def _dist_info(z: zipfile.ZipFile) -> str:
    (d,) = {n.split("/")[0] for n in z.namelist() if n.split("/")[0].endswith(".dist-info")}
    return d


def test_license_file():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("Copyright 2026 The cupy_spec authors\n")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_wheel_carries_license(wheel):
    name = f"{_dist_info(wheel)}/licenses/LICENSE"
    assert name in wheel.namelist(), sorted(wheel.namelist())
    assert wheel.read(name) == (ROOT / "LICENSE").read_bytes()


def test_wheel_metadata(wheel):
    meta = wheel.read(f"{_dist_info(wheel)}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "License-File: LICENSE" in meta
    assert "Author: The cupy_spec authors" in meta
    assert "Requires-Python: >=3.10" in meta
    for classifier in ("License :: OSI Approved :: Apache Software License", "Environment :: GPU :: NVIDIA CUDA",
                       "Programming Language :: Python :: 3.10",
                       "Topic :: Scientific/Engineering :: Artificial Intelligence"):
        assert f"Classifier: {classifier}" in meta
    assert "Provides-Extra: plot" in meta and "Provides-Extra: cuda12" in meta
    entry_points = wheel.read(f"{_dist_info(wheel)}/entry_points.txt").decode()
    assert "cupy-spec = cupy_spec.__main__:main" in entry_points


def test_wheel_carries_kernel_sources(wheel):
    sources = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cuh", ".cu", ".h"))
    assert "common.cuh" in sources
    for name in sources:
        arcname = f"cupy_spec/kernels/{name}"
        assert arcname in wheel.namelist(), f"{arcname} missing from the wheel"
        assert wheel.read(arcname) == (ROOT / "kernels" / name).read_bytes()


def test_wheel_carries_the_contract(wheel):
    assert wheel.read("cupy_spec/docs/contract.md") == CONTRACT.read_bytes()


# ---- docs/contract.md ------------------------------------------------------------------------


def test_contract_sections():
    text = CONTRACT.read_text()
    for heading in ("## 1. `tree_speculative_sampling_target_only`", "## 2. Further ops",
                    "## 3. Performance comparison figures", "## 4. Glossary"):
        assert heading in text
    for op in ("verify_tree_greedy", "build_tree_kernel_efficient", "chain_speculative_sampling",
               "tree_speculative_sampling", "tree_speculative_sampling_from_logits"):
        assert re.search(rf"^### 2\.\d `{op}`$", text, re.M), f"no section for {op}"
    glossary = text.split("## 4. Glossary", 1)[1]
    for word in ("retrive", "coin", "bonus token", "correction token", "residual", "anchor", "floor", "EAGLE",
                 "thread-block cluster"):
        assert f"**{word}" in glossary, f"{word} is not defined in the glossary"


def test_contract_anchor_table_matches_bench():
    bench = pytest.importorskip("cupy_spec.bench")
    if not hasattr(bench, "ANCHOR"):
        pytest.skip("cupy_spec.bench has no ANCHOR table")
    text = CONTRACT.read_text().split("### 3.3 The anchor", 1)[1].split("### 3.4", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (\d+), \d+ \|((?: [\d.]+ \|)+)$", text, re.M)
    table = {(int(v), int(n)): [float(x) for x in cells.split("|") if x.strip()] for v, n, cells in rows}
    assert table == {k: list(v) for k, v in bench.ANCHOR.items()}
    assert f"{bench.FLOOR_BANDWIDTH / 1e12:.2f} TB/s" in CONTRACT.read_text()
