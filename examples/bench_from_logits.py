"""Timing of ``tree_speculative_sampling_from_logits`` against the softmax + top-k + top-p pipeline
in torch followed by the target-only op (the bench of :mod:`cupy_spec.bench_from_logits`).

    python examples/bench_from_logits.py            # full grid, bfloat16 logits
    python examples/bench_from_logits.py --quick    # 4 points
    python examples/bench_from_logits.py --dtype float32
"""

import sys

from cupy_spec.bench_from_logits import main

if __name__ == "__main__":
    sys.exit(main())
