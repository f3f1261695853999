"""Where the time of `bench_vmap.py` goes: per-call overhead against per-configuration cost.

    python benchmarks/profile_vmap.py [--sizes 1 1000 10000 100000 1000000]

Times the jitted, vmapped kernel after compilation at several batch sizes (the intercept of
time against size is the host-side cost of a call: argument flattening, dispatch, the wait
for the result; the slope is the kernel's cost per configuration), and prints XLA's own
estimate of the kernel's FLOPs and bytes per configuration (`cost_analysis`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vmap  # noqa: E402  (float64 before any array exists)
import numpy as np  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 1000, 10_000, 100_000,
                                                                   1_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    batched, _, _, _ = bench_vmap.build()
    rows = []
    for n in args.sizes:
        cfg = bench_vmap.configurations(n)
        _, run_s, _ = bench_vmap.timed(batched, cfg, repeats=args.repeats)
        rows.append(dict(n=n, run_s=run_s, us_per_config=run_s / n * 1e6))
    sizes = np.array([r["n"] for r in rows], float)
    times = np.array([r["run_s"] for r in rows])
    slope, intercept = np.polyfit(sizes, times, 1)
    cfg = bench_vmap.configurations(100_000)
    lowered = batched.lower(cfg).compile()
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    result = dict(rows=rows, per_call_s=float(intercept), per_config_s=float(slope),
                  kernel_share_at_1e5=float(slope * 1e5 / (slope * 1e5 + max(intercept, 0))),
                  xla_flops_per_config=float(cost.get("flops", float("nan"))) / 1e5,
                  xla_bytes_per_config=float(cost.get("bytes accessed", float("nan"))) / 1e5)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
