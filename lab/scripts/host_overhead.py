"""Host (Python + launch) time of one eager ``decode_attention`` call and of one decode-step
rotation, without syncing inside the timed loop. Run on the GPU machine; point ``PYTHONPATH`` at
another tree's ``src`` to compare versions in one call:

    python lab/scripts/host_overhead.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
import oscarkv.kernels.triton.decode_attention as tda
from gpu_check import SINK_RECENT, bench_graph, make_pools

from oscarkv.quant import RowFormat


def host_us(fn: Callable[[], object], n: int = 300) -> float:
    """Mean host µs per call of ``fn`` over ``n`` calls after 20 warm-ups."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * dt / n


def main() -> None:
    d, hq, hkv = 128, 32, 8
    fmt = RowFormat(d, 2, d)
    print("oscarkv from", tda.__file__)
    for b, length in ((1, 4096), (16, 32768)):
        lq = length - SINK_RECENT
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        pools = make_pools(b, lq, SINK_RECENT, hkv, d, fmt)
        line = f"batch {b} / {length}: decode_attention {host_us(lambda: tda.decode_attention(q, *pools, d**-0.5, fmt, fmt, lens_hint=(lq, SINK_RECENT))):.1f} us"  # noqa: B023
        r = torch.eye(d, device="cuda")
        line += f"; PyTorch fp32 rotation {host_us(lambda: (q.float() @ r).to(q.dtype)):.1f} us"  # noqa: B023
        try:
            from oscarkv.kernels.triton.rotate import rotate_heads
        except ImportError:  # trees before the fused rotations
            pass
        else:
            line += f"; rotate_heads {host_us(lambda: rotate_heads(q, r)):.1f} us"  # noqa: B023
            line += f" (device {1e3 * bench_graph(lambda: rotate_heads(q, r, True)):.1f} us"  # noqa: B023
            line += f", PyTorch {1e3 * bench_graph(lambda: (q.float() @ r.T).to(q.dtype)):.1f} us)"  # noqa: B023
        print(line, flush=True)


if __name__ == "__main__":
    main()
