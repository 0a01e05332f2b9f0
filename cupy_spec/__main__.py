"""Command line: ``python -m cupy_spec {info,warmup,compile,bench}``.

A failure the user can act on (no GPU, no CuPy, a malformed argument) ends with one line on stderr
and a non-zero exit status (2 for a malformed argument, 1 otherwise), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

#: What to install for the GPU backend (CuPy and NVRTC).
CUDA_HINT = 'install CuPy and NVRTC with the cuda12 or cuda13 extra, e.g. pip install ".[cuda12]" in the repository root'
#: The form of one --arch entry.
ARCH_RE = re.compile(r"sm_[1-9][0-9]*")


class CommandError(Exception):
    """A failure with a message for the user; ``main`` prints it to stderr and exits with ``status``."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _is_missing_cupy(e: BaseException) -> bool:
    name = getattr(e, "name", None) or ""
    return isinstance(e, ImportError) and name.split(".")[0] in ("cupy", "cupy_backends")


def _require_gpu(command: str) -> None:
    """Raises CommandError unless torch sees a CUDA GPU."""
    import torch

    if torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    else:
        why = "torch sees no CUDA device (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)"
    raise CommandError(f"{command} needs a CUDA GPU: {why}; CPU tensors run the torch reference without one")


def _info(_args) -> int:
    import platform

    import torch

    from . import __version__, _loader

    torch_cuda = torch.version.cuda
    print(f"cupy_spec {__version__}  python {platform.python_version()}  torch {torch.__version__} "
          f"({'CUDA ' + torch_cuda if torch_cuda else 'CPU build'})")
    try:
        import cupy

        nvrtc = _loader.nvrtc_version()
        print(f"cupy {cupy.__version__}  NVRTC {'.'.join(map(str, nvrtc))}")
        print(f"CuPy kernel cache: {_cupy_cache_dir()}")
        if torch_cuda and int(torch_cuda.split(".")[0]) != nvrtc[0]:
            print(f"note: torch is built for CUDA {torch_cuda} and NVRTC is {nvrtc[0]}.x: install the cupy_spec "
                  f"extra of torch's CUDA major (cuda{torch_cuda.split('.')[0]}), or the torch build for your driver")
    except Exception as e:  # cupy missing or no NVRTC: the CPU backend still works
        print(f"cupy / NVRTC unavailable ({type(e).__name__}: {e}); CUDA tensors cannot be used")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs{_launch_features(i)})")
    else:
        print("GPU: none (CPU tensors run the torch reference)")
    try:
        print(f"kernel sources: {_loader.kernel_dir()}  (sha256 {_loader.source_hash()[:16]})")
    except FileNotFoundError as e:
        raise CommandError(f"info: {e}; reinstall cupy_spec (its wheel carries them)") from None
    return 0


def _launch_features(device: int) -> str:
    """The launch features cupy_spec uses on ``device`` (thread-block clusters, programmatic
    dependent launch), as a suffix; empty where it cannot tell (no CuPy)."""
    try:
        from . import _launch

        info = _launch.device_info(device)
        used = [name for name, on in (("clusters", info.clusters), ("dependent launch", _launch.pdl(device))) if on]
    except Exception:
        return ""
    return f"; {', '.join(used)}" if used else ""


def _cupy_cache_dir() -> str:
    try:  # CuPy's reading of the variable: the integer 1
        in_memory = int(os.environ.get("CUPY_CACHE_IN_MEMORY") or 0) == 1
    except ValueError:
        in_memory = False
    if in_memory:
        return "in memory only (CUPY_CACHE_IN_MEMORY)"
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


def _warmup(_args) -> int:
    import time

    _require_gpu("warmup")
    from . import _loader, warmup

    t = time.perf_counter()
    try:
        warmup()
    except _loader.KernelCompileError as e:  # the NVRTC log is the useful part: keep all of it
        raise CommandError(f"warmup: {e}") from None
    except ImportError as e:
        if _is_missing_cupy(e):
            raise CommandError(f"warmup needs CuPy with NVRTC ({_first_line(e)}); {CUDA_HINT}") from None
        raise CommandError(f"warmup failed: {_first_line(e)}") from None
    except (RuntimeError, OSError) as e:
        raise CommandError(f"warmup failed: {_first_line(e)}") from None
    print(f"compiled and loaded every kernel variant in {time.perf_counter() - t:.2f} s")
    return 0


def parse_archs(text: str) -> list[str]:
    """``"sm_80,sm_90"`` -> ``["sm_80", "sm_90"]``; raises CommandError (status 2) on any other form."""
    archs = [a.strip() for a in text.split(",")]
    bad = [a for a in archs if not ARCH_RE.fullmatch(a)]
    if bad:
        shown = ", ".join(repr(a) for a in bad)
        raise CommandError(
            f"compile: --arch {text!r}: {shown} is not a GPU architecture; expected sm_<digits> such as sm_90, "
            f"or a comma-separated list such as sm_80,sm_90",
            status=2,
        )
    return archs


def _nvrtc_archs(nvrtc) -> tuple | None:
    """Compute capabilities this NVRTC can target (e.g. 90 for sm_90), or None if it cannot say."""
    try:
        return tuple(int(a) for a in nvrtc.getSupportedArchs())
    except Exception:
        return None


def _compile(args) -> int:
    import time

    archs = parse_archs(args.arch)
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise CommandError(f"compile needs CuPy with NVRTC ({_first_line(e)}); {CUDA_HINT}") from None
    from . import _loader

    supported = _nvrtc_archs(nvrtc)
    unknown = [a for a in archs if supported is not None and int(a[3:]) not in supported]
    if unknown:
        version = ".".join(map(str, nvrtc.getVersion()))
        raise CommandError(
            f"compile: NVRTC {version} cannot target {', '.join(unknown)}; it supports "
            f"{', '.join(f'sm_{a}' for a in supported)}",
            status=2,
        )
    failed = 0
    for arch in archs:
        t = time.perf_counter()
        try:
            built = _loader.compile_for_arch(arch)
        except _loader.KernelCompileError as e:
            print(f"{arch}: FAILED\n{e}", file=sys.stderr)
            failed += 1
            continue
        except FileNotFoundError as e:  # the kernel sources themselves
            raise CommandError(f"compile: {_first_line(e)}; reinstall cupy_spec (its wheel carries them)") from None
        except (ImportError, RuntimeError, OSError) as e:  # NVRTC library missing or unusable
            raise CommandError(f"compile for {arch} failed: {_first_line(e)}; {CUDA_HINT}") from None
        for name, b in built.items():
            print(f"{arch}: {name} -> {b.lowered} (module {len(b.cubin)} bytes; {_resources(b)})")
        print(f"{arch}: {len(built)} variants in {time.perf_counter() - t:.2f} s")
    return 1 if failed else 0


def _resources(b) -> str:
    """What ptxas reported for one kernel variant."""
    if b.registers is None:
        return "registers not reported"
    return f"{b.registers} registers, {b.spill_bytes} bytes of spill stores"


def _check_output_path(option: str, path: str | None) -> None:
    if path is None:
        return
    if not path.strip():
        raise CommandError(f"bench {option}: the path is empty", status=2)
    if os.path.isdir(path):
        raise CommandError(f"bench {option} {path}: is a directory; give a file name", status=2)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CommandError(f"bench {option} {path}: folder {folder} does not exist", status=2)
    if not os.access(folder, os.W_OK):
        raise CommandError(f"bench {option} {path}: folder {folder} is not writable", status=2)


def _bench(args) -> int:
    _check_output_path("--json", args.json)
    _check_output_path("--plot", args.plot)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CommandError('bench --plot needs matplotlib: pip install matplotlib (or the "plot" extra)') from None
    _require_gpu("bench")
    from . import _loader, bench

    try:
        return bench.main(quick=args.quick, json_path=args.json, plot_path=args.plot)
    except _loader.KernelCompileError as e:
        raise CommandError(f"bench: {e}") from None
    except ImportError as e:
        if _is_missing_cupy(e):
            raise CommandError(f"bench needs CuPy with NVRTC ({_first_line(e)}); {CUDA_HINT}") from None
        raise


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name == "cupy-spec" else "python -m cupy_spec"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_prog(), description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPUs, kernel and cache directories").set_defaults(fn=_info)
    sub.add_parser("warmup", help="compile and load every kernel for the current GPU").set_defaults(fn=_warmup)
    c = sub.add_parser("compile", help="compile every kernel variant with NVRTC (no GPU needed)")
    c.add_argument("--arch", default="sm_80,sm_90",
                   help="comma-separated targets of the form sm_<digits> (default sm_80,sm_90)")
    c.set_defaults(fn=_compile)
    b = sub.add_parser(
        "bench",
        help="check against the reference, then CUDA-graph timings on the grid of docs/contract.md section 3",
        description="Checks the kernel against the torch reference at every grid point, then times it with "
                    "CUDA-graph replay and compares with the anchor numbers and bytes floors described in "
                    "docs/contract.md, section 3. Needs a CUDA GPU.",
    )
    b.add_argument("--quick", action="store_true", help="a few grid points only")
    b.add_argument("--json", metavar="PATH", help="write all numbers as JSON")
    b.add_argument("--plot", metavar="PATH", help="write PNG plots to PATH and, for the from-logits op, "
                   "PATH with _from_logits before the extension (needs matplotlib: the plot extra)")
    b.set_defaults(fn=_bench)
    return parser


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CommandError as e:
        print(e, file=sys.stderr)
        return e.status


if __name__ == "__main__":
    sys.exit(main())
