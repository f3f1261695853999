"""Gradient design optimization vs exhaustive enumeration of the same grid, and the command
line's cold and warm-cache wall time.

Grid mode (default): runs `perfmodel.search.optimize` (its default schedule unless
`--steps`/`--blocks`) and `perfmodel.search.exhaustive` on DeepSeek-R1 served by 8 Jalapeno
chips (ISL 8192, OSL 1024, TPOT <= 10 ms, power <= 550 W per chip), on grids whose
concurrency and power-cap axes are refined until each holds at least the requested number
of designs, and prints times: cold (the first call for that grid in this process, with no
persistent compilation cache: tracing and compilation included; wall and CPU seconds) and
warm (best wall time of `--repeats` calls in a row with compiled kernels), and the
objective each finds.

CLI mode (`--cli`): times `perfmodel optimize` on the README example (13 layouts, 758k
designs) in fresh processes, first with an empty persistent compilation cache (cold), then
with the cache that run filled (warm cache), with and without `--check-exhaustive`; wall
and CPU seconds (user + system: what a busy host stretches least).

`--compile-options default` compiles both kernels with XLA's default options, and
`--compile-options O1` the search kernel with `perfmodel.search.compile.SEARCH_OPTIONS` at
LLVM -O1 instead of -O0: the figures that justify those options.

    python benchmarks/bench_optimize.py [--min-points 100000 1000000] [--layouts 2]
        [--steps 24 --blocks 4] [--keep-layouts 1|all] [--compile-options default]
    python benchmarks/bench_optimize.py --cli [--repeats 3]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

#: The README example.
CLI = ["-m", "perfmodel.cli", "optimize", "--model", "deepseek-r1", "--chip", "jalapeno",
       "--chips", "8", "--isl", "8192", "--osl", "1024", "--max-tpot-ms", "10",
       "--max-power-w", "550", "--objective", "tok_s_per_kw", "--format", "json"]


def cli(repeats: int, env_extra: dict) -> list[dict]:
    """Wall times of the README example in fresh processes: cold cache, then warm."""
    rows = []
    for extra in ([], ["--check-exhaustive"]):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, PERFMODEL_CACHE_DIR=cache, **env_extra)
            times, cpu, out = [], [], None
            for _ in range(1 + repeats):
                used = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.perf_counter()
                done = subprocess.run([sys.executable, *CLI, *extra], env=env, check=True,
                                      capture_output=True, text=True)
                times.append(time.perf_counter() - start)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu.append(after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime)
                out = json.loads(done.stdout)
        row = {"command": "perfmodel optimize (README example)" + (
                   " --check-exhaustive" if extra else ""),
               "cold_s": times[0], "warm_cache_s": min(times[1:]),
               "cold_cpu_s": cpu[0], "warm_cache_cpu_s": min(cpu[1:]),
               "objective_value": out["objective_value"], "grid_points": out["grid_points"]}
        if extra:
            row["exhaustive_objective_value"] = out["exhaustive"]["objective_value"]
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--min-points", type=int, nargs="+", default=[100_000])
    parser.add_argument("--layouts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None,
                        help="Adam steps (default: optimize's)")
    parser.add_argument("--blocks", type=int, default=None,
                        help="augmented-Lagrangian blocks (default: optimize's)")
    parser.add_argument("--keep-layouts", default=None, metavar="N|all",
                        help="layouts hardened after the screen (default: optimize's)")
    parser.add_argument("--compile-options", choices=("search", "O1", "default"),
                        default="search",
                        help="perfmodel.search.compile's XLA:CPU options, those with the "
                             "search kernel at LLVM -O1, or XLA's defaults")
    parser.add_argument("--cli", action="store_true",
                        help="time the command line on the README example instead")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    env_extra = {"PERFMODEL_COMPILE_OPTIONS": "default"} \
        if args.compile_options == "default" else {}
    os.environ.update(env_extra)
    if args.cli:
        rows = cli(args.repeats, env_extra)
        for row in rows:
            print(json.dumps(row) if args.json else
                  f"{row['command']}: {row['cold_s']:.1f} s cold, {row['warm_cache_s']:.1f} s "
                  f"with a warm cache (CPU {row['cold_cpu_s']:.1f} s / "
                  f"{row['warm_cache_cpu_s']:.1f} s; {row['grid_points']:,} designs, "
                  f"objective {row['objective_value']:.2f})", flush=True)
        return
    rows = grids(args)
    if args.json:
        print(json.dumps(rows, indent=1))


def _space(ps, model, chip, workload, layouts, conc_steps, caps):
    concurrency = sorted({round(2 ** (k / conc_steps), 2) for k in range(11 * conc_steps + 1)})
    layouts = ps.candidate_layouts(model, chip, 8, workload, "mxfp4")[:layouts]
    return ps.design_space(model, chip, 8, layouts=layouts, concurrency=concurrency,
                           power_caps=[0.5 + 0.5 * k / (caps - 1) for k in range(caps)])


def grid(model, chip, workload, layouts, min_points):
    """The benchmark's grid of at least `min_points` designs over `layouts` layouts."""
    from perfmodel import search as ps

    steps, caps = 1, 2
    space = _space(ps, model, chip, workload, layouts, steps, caps)
    while space.size < min_points:
        steps, caps = steps * 2, caps * 2 - 1
        space = _space(ps, model, chip, workload, layouts, steps, caps)
    return space


def timed(run, repeats):
    """(result, cold wall s, cold CPU s, best warm wall s)."""
    start, cpu = time.perf_counter(), time.process_time()
    result = run()
    cold, cold_cpu = time.perf_counter() - start, time.process_time() - cpu
    warm = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        warm.append(time.perf_counter() - start)
    return result, cold, cold_cpu, min(warm)


def grids(args) -> list[dict]:
    import jax

    jax.config.update("jax_enable_x64", True)
    import perfmodel as pm
    from perfmodel import search as ps

    if args.compile_options == "O1":
        from perfmodel.search import compile as compilation

        compilation.SEARCH_OPTIONS = dict(compilation.SEARCH_OPTIONS,
                                          xla_backend_optimization_level=1)
    model, chip = pm.get_model("deepseek-r1"), pm.get_chip("jalapeno")
    workload = pm.Workload(8192, 1024)
    tgt = ps.targets(max_tpot_ms=10, max_power_w=550)
    defaults = inspect.signature(ps.optimize).parameters
    steps = args.steps or defaults["steps"].default
    blocks = args.blocks or defaults["blocks"].default
    keep = (defaults["keep_layouts"].default if args.keep_layouts is None
            else None if args.keep_layouts == "all" else int(args.keep_layouts))
    rows = []
    for min_points in args.min_points:
        space = grid(model, chip, workload, args.layouts, min_points)
        row = {"grid_points": space.size, "layouts": [x.describe() for x in space.layouts],
               "concurrency_values": len(space.concurrency),
               "power_caps": len(space.power_caps), "device": jax.default_backend(),
               "keep_layouts": keep, "compile_options": args.compile_options}
        runs = {"gradient": lambda s=space: ps.optimize(
                    model, chip, workload, s, tgt, steps=steps, blocks=blocks,
                    keep_layouts=keep, throw=False),
                "exhaustive": lambda s=space: ps.exhaustive(model, chip, workload, s, tgt)}
        for name, run in runs.items():
            result, cold, cold_cpu, warm = timed(run, args.repeats)
            row[name] = {"cold_s": cold, "cold_cpu_s": cold_cpu, "warm_s": warm,
                         "objective_value": result.objective_value,
                         "evaluations": getattr(result, "evaluations", None)
                         or getattr(result, "points", None)}
        row["speedup_cold"] = row["exhaustive"]["cold_s"] / row["gradient"]["cold_s"]
        row["speedup_warm"] = row["exhaustive"]["warm_s"] / row["gradient"]["warm_s"]
        rows.append(row)
        if not args.json:
            g, e = row["gradient"], row["exhaustive"]
            print(f"{space.size:>9,} designs, {len(space.layouts)} layouts: gradient "
                  f"{g['cold_s']:.1f} s cold ({g['cold_cpu_s']:.1f} s CPU) / "
                  f"{1e3 * g['warm_s']:.1f} ms warm (objective {g['objective_value']:.1f}, "
                  f"{g['evaluations']} exact evaluations); exhaustive {e['cold_s']:.1f} s "
                  f"({e['cold_cpu_s']:.1f} s CPU) / {1e3 * e['warm_s']:.1f} ms (objective "
                  f"{e['objective_value']:.1f}); speed-up cold {row['speedup_cold']:.2f}x, "
                  f"warm {row['speedup_warm']:.1f}x", flush=True)
    return rows


if __name__ == "__main__":
    main()
