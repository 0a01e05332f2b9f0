"""Every kernel variant compiles with NVRTC for sm_80 and sm_90 (no GPU needed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_spec import _loader

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="cupy with NVRTC is needed to compile kernels")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_variant_compiles_and_lowers(arch):
    built = _loader.compile_for_arch(arch)
    expected = [name for names in _loader.MODULES.values() for name in names]
    assert sorted(built) == sorted(expected)
    for name, (lowered, cubin) in built.items():
        assert lowered.startswith("_Z") and "tree_speculative_sampling_target_only_kernel" in lowered
        assert cubin[:4] == b"\x7fELF"


@pytest.fixture
def kernel_copy(tmp_path, monkeypatch):
    d = tmp_path / "kernels"
    shutil.copytree(_loader.kernel_dir(), d)
    monkeypatch.setattr(_loader, "kernel_dir", lambda: d)
    _loader._hash_cache.clear()
    yield d
    _loader._hash_cache.clear()


def test_source_hash_covers_headers(kernel_copy: Path):
    before = _loader.source_hash()
    common = kernel_copy / "common.cuh"
    common.write_text(common.read_text() + "\n// changed\n")
    _loader._hash_cache.clear()
    assert _loader.source_hash() != before
    assert _loader.source_hash() in _loader._unit("tree_speculative_sampling_target_only.cuh")


def test_compile_error_carries_log_and_file(kernel_copy: Path):
    header = kernel_copy / "tree_speculative_sampling_target_only.cuh"
    header.write_text(header.read_text() + "\nthis is not C++;\n")
    _loader._hash_cache.clear()
    with pytest.raises(_loader.KernelCompileError) as e:
        _loader.compile_for_arch("sm_90")
    msg = str(e.value)
    assert "kernels/tree_speculative_sampling_target_only.cuh" in msg
    assert "error" in msg and "this is not C++" in msg or "identifier" in msg


def test_cli_compile():
    out = subprocess.run([sys.executable, "-m", "cupy_spec", "compile", "--arch", "sm_90"], capture_output=True,
                         text=True, check=True).stdout
    assert "sm_90: 2 variants" in out
