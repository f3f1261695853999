"""Where the time of `bench_vmap.py` goes: per-call overhead against per-configuration cost.

    python benchmarks/profile_vmap.py [--sizes 1 1000 10000 100000 1000000] [--trace]
    python benchmarks/profile_vmap.py --grads [5000 10000 20000]

Times the jitted, vmapped kernel after compilation at several batch sizes (the intercept of
time against size is the host-side cost of a call: argument flattening, dispatch, the wait
for the result; the slope is the kernel's cost per configuration) with the process's CPU
time per wall second over each size's timed calls (above 1: XLA:CPU runs independent
fusions of the kernel on both cores), and prints XLA's own estimate of the kernel's FLOPs
and bytes per configuration (`cost_analysis`) and the kernel's fusions. `--trace` also
records 10 calls of 100,000 configurations with `jax.profiler` and lists the kernel's
fusions by their total time per call (summed over the threads that ran them).
`--grads [N ...]` reports the per-configuration gradient kernel instead, at each N per call.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vmap  # noqa: E402  (float64 before any array exists)
import jax  # noqa: E402
import numpy as np  # noqa: E402


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def trace(batched, cfg, calls: int = 10, top: int = 12) -> list[dict]:
    """The kernel's thunks (fusions) by total time per call over `calls` traced calls."""
    jax.block_until_ready(batched(cfg))
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(calls):
                jax.block_until_ready(batched(cfg))
        path = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
        total, count = collections.Counter(), collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_XLA"):
                    continue
                for event in line.events:
                    if event.name.startswith("ThunkExecutor") or "Await" in event.name:
                        continue
                    total[event.name] += event.duration_ns
                    count[event.name] += 1
    return [dict(thunk=name, ms_per_call=ns / 1e6 / calls, runs=count[name])
            for name, ns in total.most_common(top)]


def structure(batched, cfg, *specs) -> dict:
    """What XLA compiles `batched` into for the configurations `cfg` (and any further
    arguments `specs`): its own estimate of FLOPs and bytes of memory traffic per
    configuration (`cost_analysis`), its fusions, how many of them are YNNPACK's, its
    power operations (an exp of a log on XLA:CPU, about four times a square root) and its
    divisions (elementwise, each an operation over the batch; on XLA:CPU a float64 division
    costs several times a multiplication, and they are most of the step fusions' cycles)
    (`tests/test_kernel_structure.py` bounds these)."""
    n = len(next(iter(cfg.values())))
    compiled = batched.lower(cfg, *specs).compile()
    # equinox's `filter_jit` wraps jax's compiled object
    compiled = getattr(compiled, "compiled", compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    return dict(xla_flops_per_config=float(cost.get("flops", float("nan"))) / n,
                xla_bytes_per_config=float(cost.get("bytes accessed", float("nan"))) / n,
                fusions=text.count(" fusion("), ynn_fusions=text.count("__ynn_fusion"),
                powers=text.count(" power("), divisions=text.count(" divide("))


def grads(n: int, repeats: int) -> dict:
    """The per-configuration gradient kernel of `bench_vmap.build_grads` at `n`
    configurations a call: XLA's FLOPs and bytes per configuration, its fusions, and the
    median gradients per second (`bench_vmap.timed`)."""
    batched, chip, design = bench_vmap.build_grads()
    cfg = bench_vmap.configurations(n)
    _, run_s, _ = bench_vmap.timed(batched, cfg, chip, design, repeats=repeats)
    return dict(n=n, grads_per_s=n / run_s, **structure(batched, cfg, chip, design))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 1000, 10_000, 100_000,
                                                                   1_000_000])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--trace", action="store_true", help="list the fusions by time")
    parser.add_argument("--grads", type=int, nargs="*", metavar="N",
                        help="instead: the gradient kernel of `bench_vmap.py --grads` at each "
                             "N configurations per call (default 5,000 10,000 20,000): its "
                             "structure (`structure`) and gradients per second")
    args = parser.parse_args(argv)
    if args.grads is not None:
        result = dict(grads=[grads(n, args.repeats) for n in args.grads or (5000, 10000, 20000)])
        print(json.dumps(result, indent=1))
        return result
    batched, _, _, _ = bench_vmap.build()
    rows = []
    for n in args.sizes:
        cfg = bench_vmap.configurations(n)
        _, run_s, _ = bench_vmap.timed(batched, cfg, repeats=args.repeats)
        cpu, wall = _cpu_s(), time.perf_counter()
        for _ in range(args.repeats):
            jax.block_until_ready(batched(cfg))
        cpu, wall = _cpu_s() - cpu, time.perf_counter() - wall
        rows.append(dict(n=n, run_s=run_s, us_per_config=run_s / n * 1e6,
                         cpu_per_wall_s=cpu / wall))
    sizes = np.array([r["n"] for r in rows], float)
    times = np.array([r["run_s"] for r in rows])
    slope, intercept = np.polyfit(sizes, times, 1)
    cfg = bench_vmap.configurations(100_000)
    result = dict(rows=rows, per_call_s=float(intercept), per_config_s=float(slope),
                  kernel_share_at_1e5=float(slope * 1e5 / (slope * 1e5 + max(intercept, 0))),
                  **structure(batched, cfg))
    if args.trace:
        result["thunks"] = trace(batched, cfg)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
