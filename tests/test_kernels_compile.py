"""Every kernel variant compiles with NVRTC for sm_80 and sm_90 (no GPU needed)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_spec import _loader
from cupy_spec._core import OPS

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="cupy with NVRTC is needed to compile kernels")


@functools.lru_cache(maxsize=None)
def every_variant(arch: str) -> dict:
    """Every op's variants compiled for arch from the package's own sources, once per run (the tests
    that edit the sources or the struct compile for themselves)."""
    return _loader.compile_for_arch(arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_variant_compiles_and_lowers(arch):
    built = every_variant(arch)
    expected = [name for op in OPS.values() for name in op.kernel_names()]
    assert sorted(built) == sorted(expected)
    for name, b in built.items():
        assert b.lowered.startswith("_Z") and name.split("<")[0].split("::")[1] in b.lowered
        assert b.cubin[:4] == b"\x7fELF"
        assert 0 < b.registers <= 255 and b.spill_bytes >= 0


#: Ops whose every kernel variant keeps its values in registers. Of the others, tree_speculative_sampling
#: and from_logits budget registers for more resident blocks per SM (the 256-thread build for four
#: blocks, the 512-thread build for two: 64 registers) and accept a few bytes of spills there;
#: build_tree_kernel_efficient's direct instantiation spills in its split path under the 64 registers
#: of the 1024-thread bound it shares with the others (kernels/NOTES.md).
NO_SPILLS = ("verify_tree_greedy", "tree_speculative_sampling_target_only", "chain_speculative_sampling",
             "uniform_coins")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_that_must_not_spill_do_not(arch):
    names = {name for op in NO_SPILLS for name in OPS[op].kernel_names()}
    built = {name: b for name, b in every_variant(arch).items() if name in names}
    assert {name: b.spill_bytes for name, b in built.items() if b.spill_bytes} == {}


def test_ptxas_resources_are_read_per_entry():
    log = ("ptxas info    : Compiling entry function '_Z1av' for 'sm_90'\n"
           "ptxas         .     40 bytes stack frame, 48 bytes spill stores, 48 bytes spill loads\n"
           "ptxas info    : Used 64 registers, used 2 barriers, 40 bytes cumulative stack size\n"
           "ptxas info    : Compiling entry function '_Z1bv' for 'sm_90'\n"
           "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 32 registers, used 1 barriers\n")
    assert _loader.ptxas_resources(log) == {"_Z1av": (64, 48), "_Z1bv": (32, 0)}
    assert _loader.ptxas_resources("") == {}


@pytest.mark.parametrize("name", sorted(OPS))
def test_parameter_struct_size_is_checked_at_compile_time(name, monkeypatch):
    """The generated struct carries a static_assert on the host's packed size: a host packing that
    disagrees with the struct (a field added on one side only) fails to compile."""
    import struct

    op = OPS[name]
    monkeypatch.setattr(op, "struct", struct.Struct(op.struct.format + "q"))
    with pytest.raises(_loader.KernelCompileError, match="parameter struct layout"):
        _loader.compile_for_arch("sm_90", ops=[op])


@pytest.fixture
def kernel_copy(tmp_path, monkeypatch):
    d = tmp_path / "kernels"
    shutil.copytree(_loader.kernel_dir(), d)
    monkeypatch.setattr(_loader, "kernel_dir", lambda: d)
    return d


def test_source_hash_covers_headers(kernel_copy: Path):
    """Also a header edited while the process runs: the next unit made carries the new hash."""
    before = _loader.source_hash()
    common = kernel_copy / "common.cuh"
    common.write_text(common.read_text() + "\n// changed\n")
    assert _loader.source_hash() != before
    assert _loader.source_hash() in _loader.unit(OPS["tree_speculative_sampling_target_only"])


def test_headers_in_the_working_directory_are_not_used(tmp_path, monkeypatch):
    """The unit includes the op's header by its absolute path, and the header's own includes are
    found next to it: files of the same names in the working directory are not compiled."""
    for name in ["common.cuh", "sampling.cuh"] + [op.header for op in OPS.values()]:
        (tmp_path / name).write_text("this is not C++;\n")
    monkeypatch.chdir(tmp_path)
    op = OPS["tree_speculative_sampling_target_only"]
    assert f'#include "{(_loader.kernel_dir() / op.header).as_posix()}"' in _loader.unit(op)
    assert _loader.compile_for_arch("sm_90", ops=[op])


def test_compile_error_carries_log_and_file(kernel_copy: Path):
    header = kernel_copy / "tree_speculative_sampling_target_only.cuh"
    header.write_text(header.read_text() + "\nthis is not C++;\n")
    with pytest.raises(_loader.KernelCompileError) as e:
        _loader.compile_for_arch("sm_90")
    msg = str(e.value)
    assert "kernels/tree_speculative_sampling_target_only.cuh" in msg
    assert "error" in msg and "this is not C++" in msg or "identifier" in msg


def test_cli_compile():
    out = subprocess.run([sys.executable, "-m", "cupy_spec", "compile", "--arch", "sm_90"], capture_output=True,
                         text=True, check=True).stdout
    assert f"sm_90: {sum(len(op.kernel_names()) for op in OPS.values())} variants" in out


@pytest.mark.gpu
def test_a_kernel_cache_that_cannot_be_written_is_named(monkeypatch):
    """CuPy stores every compiled module in its on-disk cache; where that fails the error says
    which setting to change."""
    import cupy

    def fail(**kwargs):
        raise PermissionError(13, "Permission denied", "/read-only/cache/x.cubin")

    monkeypatch.setattr(cupy, "RawModule", fail)
    with pytest.raises(RuntimeError, match=r"kernel cache \(PermissionError: .*\); set CUPY_CACHE_DIR"):
        _loader._load(OPS["uniform_coins"], 0)
