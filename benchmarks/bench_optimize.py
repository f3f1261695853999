"""Gradient design optimization vs exhaustive enumeration of the same grid.

Runs `perfmodel.optimize.optimize` (its default schedule unless `--steps`/`--blocks`) and
`perfmodel.optimize.exhaustive` on DeepSeek-R1 served by 8 Jalapeno chips (ISL 8192, OSL
1024, TPOT <= 10 ms, power <= 550 W per chip), on grids whose concurrency and power-cap axes
are refined until each holds at least the requested number of designs, and prints wall
times: cold (first call, compilation included), warm (best of `--repeats` calls in a row
with compiled kernels, as a sweep of searches runs) and alternating (best of `--repeats`
rounds that call each method once in turn, so each call follows the other's: a single
call after other work, with colder caches), and the objective each finds. Both run on one
stream of kernels on the default JAX device.

    python benchmarks/bench_optimize.py [--min-points 100000 1000000] [--layouts 2]
        [--steps 24 --blocks 4] [--keep-layouts 1|all] [--split]
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import jax

jax.config.update("jax_enable_x64", True)

import perfmodel as pm  # noqa: E402
from perfmodel import optimize as po  # noqa: E402


def _space(model, chip, workload, layouts, conc_steps, caps):
    concurrency = sorted({round(2 ** (k / conc_steps), 2) for k in range(11 * conc_steps + 1)})
    layouts = po.candidate_layouts(model, chip, 8, workload, "mxfp4")[:layouts]
    return po.design_space(model, chip, 8, layouts=layouts, concurrency=concurrency,
                           power_caps=[0.5 + 0.5 * k / (caps - 1) for k in range(caps)])


def grid(model, chip, workload, layouts, min_points):
    steps, caps = 1, 2
    space = _space(model, chip, workload, layouts, steps, caps)
    while space.size < min_points:
        steps, caps = steps * 2, caps * 2 - 1
        space = _space(model, chip, workload, layouts, steps, caps)
    return space


def timed(run, repeats):
    start = time.perf_counter()
    result = run()
    cold = time.perf_counter() - start
    warm = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        warm.append(time.perf_counter() - start)
    return result, cold, min(warm)


def alternating(runs: dict, repeats) -> dict:
    """Best wall time of each compiled run over `repeats` rounds that call every run once
    in turn: each call then follows the other method's, as a single call follows other
    work, rather than an identical call that left the caches warm for it."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


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
                        help="layouts searched past the layout screen (default: optimize's)")
    parser.add_argument("--split", action="store_true",
                        help="also time one Adam step per block (one more compile per "
                             "grid): the fixed cost (rounding, local search, host work) and "
                             "the cost of each further Adam step")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model, chip = pm.get_model("deepseek-r1"), pm.get_chip("jalapeno")
    workload = pm.Workload(8192, 1024)
    tgt = po.targets(max_tpot_ms=10, max_power_w=550)
    defaults = inspect.signature(po.optimize).parameters
    args.steps = args.steps or defaults["steps"].default
    args.blocks = args.blocks or defaults["blocks"].default
    keep = (defaults["keep_layouts"].default if args.keep_layouts is None
            else None if args.keep_layouts == "all" else int(args.keep_layouts))
    rows = []
    for min_points in args.min_points:
        space = grid(model, chip, workload, args.layouts, min_points)
        row = {"grid_points": space.size, "layouts": [x.describe() for x in space.layouts],
               "concurrency_values": len(space.concurrency),
               "power_caps": len(space.power_caps), "device": jax.default_backend()}
        row["keep_layouts"] = keep
        runs = {"gradient": lambda s=space: po.optimize(
                    model, chip, workload, s, tgt, steps=args.steps, blocks=args.blocks,
                    keep_layouts=keep),
                "exhaustive": lambda s=space: po.exhaustive(model, chip, workload, s, tgt)}
        for name, run in runs.items():
            result, cold, warm = timed(run, args.repeats)
            row[name] = {"cold_s": cold, "warm_s": warm,
                         "objective_value": result.objective_value,
                         "evaluations": getattr(result, "evaluations", None)
                         or getattr(result, "points", None)}
        if args.split and args.steps > args.blocks:
            _, _, fixed = timed(lambda s=space: po.optimize(
                model, chip, workload, s, tgt, steps=args.blocks, blocks=args.blocks,
                keep_layouts=keep), args.repeats)
            row["gradient"]["fixed_warm_s"] = fixed
            row["gradient"]["per_step_warm_s"] = (row["gradient"]["warm_s"] - fixed) / (
                args.steps - args.blocks)
        row["speedup_cold"] = row["exhaustive"]["cold_s"] / row["gradient"]["cold_s"]
        row["speedup_warm"] = row["exhaustive"]["warm_s"] / row["gradient"]["warm_s"]
        for name, best in alternating(runs, args.repeats).items():
            row[name]["alternating_s"] = best
        row["speedup_alternating"] = (row["exhaustive"]["alternating_s"]
                                      / row["gradient"]["alternating_s"])
        # Enumeration costs about the same per design on every grid and the gradient search
        # about the same per layout: the grid size at which the warm speed-up would reach 10x.
        row["designs_for_10x_warm"] = 10 * space.size / row["speedup_warm"]
        rows.append(row)
        if not args.json:
            g, e = row["gradient"], row["exhaustive"]
            print(f"{space.size:>9,} designs, {len(space.layouts)} layouts: gradient "
                  f"{g['cold_s']:.1f} s cold / {1e3 * g['warm_s']:.1f} ms warm "
                  f"(objective {g['objective_value']:.1f}, {g['evaluations']} exact "
                  f"evaluations); exhaustive {e['cold_s']:.1f} s / {1e3 * e['warm_s']:.1f} ms "
                  f"(objective {e['objective_value']:.1f}); warm speed-up "
                  f"{row['speedup_warm']:.1f}x (10x from about "
                  f"{row['designs_for_10x_warm']:,.0f} designs); alternating calls "
                  f"{1e3 * g['alternating_s']:.1f} / {1e3 * e['alternating_s']:.1f} ms, "
                  f"{row['speedup_alternating']:.1f}x", flush=True)
            if "per_step_warm_s" in g:
                print(f"  gradient: {1e3 * g['fixed_warm_s']:.2f} ms fixed (one Adam step "
                      f"per block, rounding, local search, host work) + "
                      f"{1e6 * g['per_step_warm_s']:.0f} us per further Adam step "
                      f"(all layouts)", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
