"""Command line: ``python -m cupy_spec {info,warmup,compile,bench}``."""

from __future__ import annotations

import argparse
import sys


def _info(_args) -> int:
    import platform

    import torch

    from . import __version__, _loader

    print(f"cupy_spec {__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import cupy

        print(f"cupy {cupy.__version__}  NVRTC {'.'.join(map(str, _loader.nvrtc_version()))}")
        print(f"CuPy kernel cache: {_cupy_cache_dir()}")
    except Exception as e:  # cupy missing or no NVRTC: the CPU backend still works
        print(f"cupy / NVRTC unavailable ({type(e).__name__}: {e}); CUDA tensors cannot be used")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)")
    else:
        print("GPU: none (CPU tensors run the torch reference)")
    print(f"kernel sources: {_loader.kernel_dir()}  (sha256 {_loader.source_hash()[:16]})")
    return 0


def _cupy_cache_dir() -> str:
    import os

    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


def _warmup(_args) -> int:
    import time

    from . import warmup

    t = time.perf_counter()
    warmup()
    print(f"compiled and loaded every kernel variant in {time.perf_counter() - t:.2f} s")
    return 0


def _compile(args) -> int:
    import time

    from . import _loader

    failed = 0
    for arch in args.arch.split(","):
        t = time.perf_counter()
        try:
            built = _loader.compile_for_arch(arch.strip())
        except _loader.KernelCompileError as e:
            print(f"{arch}: FAILED\n{e}", file=sys.stderr)
            failed += 1
            continue
        for name, (lowered, cubin) in built.items():
            print(f"{arch}: {name} -> {lowered} ({len(cubin)} bytes)")
        print(f"{arch}: {len(built)} variants in {time.perf_counter() - t:.2f} s")
    return 1 if failed else 0


def _bench(args) -> int:
    from . import bench

    return bench.main(quick=args.quick, json_path=args.json, plot_path=args.plot)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPUs, kernel and cache directories").set_defaults(fn=_info)
    sub.add_parser("warmup", help="compile and load every kernel for the current GPU").set_defaults(fn=_warmup)
    c = sub.add_parser("compile", help="compile every kernel variant with NVRTC (no GPU needed)")
    c.add_argument("--arch", default="sm_80,sm_90", help="comma-separated targets (default sm_80,sm_90)")
    c.set_defaults(fn=_compile)
    b = sub.add_parser("bench", help="correctness check and CUDA-graph timings over the SPEC grid")
    b.add_argument("--quick", action="store_true", help="a few grid points only")
    b.add_argument("--json", metavar="PATH", help="write all numbers as JSON")
    b.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    b.set_defaults(fn=_bench)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
