"""Gradient design optimization vs exhaustive enumeration of the same grid.

Runs `perfmodel.optimize.optimize` and `perfmodel.optimize.exhaustive` on DeepSeek-R1 served
by 8 Jalapeno chips (ISL 8192, OSL 1024, TPOT <= 10 ms, power <= 550 W per chip), on grids
whose concurrency and power-cap axes are refined until the grid holds at least
`--min-points` designs, and prints wall times: cold (first call, compilation included) and
warm (second call, compiled kernels reused), and the objective each finds.

    python benchmarks/bench_optimize.py [--min-points 100000] [--layouts 2]
"""

from __future__ import annotations

import argparse
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--min-points", type=int, default=100_000)
    parser.add_argument("--layouts", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model, chip = pm.get_model("deepseek-r1"), pm.get_chip("jalapeno")
    workload = pm.Workload(8192, 1024)
    tgt = po.targets(max_tpot_ms=10, max_power_w=550)
    steps, caps = 4, 3
    space = _space(model, chip, workload, args.layouts, steps, caps)
    while space.size < args.min_points:
        steps, caps = steps * 2, caps * 2 - 1
        space = _space(model, chip, workload, args.layouts, steps, caps)
    rows = {}
    for name, run in (("gradient", lambda: po.optimize(model, chip, workload, space, tgt)),
                      ("exhaustive", lambda: po.exhaustive(model, chip, workload, space, tgt))):
        times = []
        for _ in range(2):
            start = time.perf_counter()
            result = run()
            times.append(time.perf_counter() - start)
        rows[name] = {"cold_s": times[0], "warm_s": times[1],
                      "objective_value": result.objective_value,
                      "evaluations": getattr(result, "evaluations", None) or
                      getattr(result, "points", None)}
    out = {"grid_points": space.size, "layouts": [x.describe() for x in space.layouts],
           "concurrency_values": len(space.concurrency), "power_caps": len(space.power_caps),
           **rows,
           "speedup_cold": rows["exhaustive"]["cold_s"] / rows["gradient"]["cold_s"],
           "speedup_warm": rows["exhaustive"]["warm_s"] / rows["gradient"]["warm_s"],
           "device": jax.default_backend()}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
