"""The optimizer's layout screen (`optimize(..., keep_layouts=k)`) against exhaustive
enumeration, on grids over every candidate layout of a deployment
(`tests/test_optimize.py` `LAYOUT_SCENARIOS`: 20 scenarios, 3 to 13 layouts, DeepSeek-R1,
Kimi-K2.5, GPT-OSS-120B, Qwen3-235B, Mixtral-8x22B and Llama-3.1 on Jalapeno, GB300, B200,
H200 and MI355X).

For each `keep` (default 1, 2 and None = every layout hardened) it reports the
scenarios whose hardened design misses the exhaustive optimum by more than 2% or disagrees
on feasibility (the acceptance bar: 0), the worst objective ratio, and, from the screen
itself, how far down its order the first layout within 2% of the grid's optimum sits (0 =
first; `keep` must exceed it). Wall times are warm (compiled kernels), summed over the
scenarios.

    python benchmarks/bench_layouts.py [--keep 1 2 none] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

from perfmodel import search as ps  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from test_optimize import LAYOUT_SCENARIOS, layout_case  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", nargs="+", default=["1", "2", "none"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    keeps = [None if k == "none" else int(k) for k in args.keep]
    rows = []
    for row in LAYOUT_SCENARIOS:
        model, chip, workload, space, tgt, objective = layout_case(*row)
        best = ps.exhaustive(model, chip, workload, space, tgt, objective)
        layouts = best.per_layout
        out = {"scenario": f"{row[0]} on {row[2]} {row[1]}, ISL/OSL {row[3][0]}/{row[3][1]}, "
                           f"{row[4]}, {row[5]}",
               "layouts": len(space.layouts), "designs": space.size,
               "exhaustive": best.objective_value,
               "exhaustive_layout": best.design["layout"] if best.feasible else None}
        if best.feasible:
            good = {n for n, v in layouts.items() if v is not None
                    and v >= 0.98 * best.objective_value}
            order = ps.optimize(model, chip, workload, space, tgt, objective,
                                throw=False).screen_order
            out["first_good_in_screen"] = min(order.index(n) for n in good)
        for keep in keeps:
            ps.optimize(model, chip, workload, space, tgt, objective, keep_layouts=keep,
                        throw=False)
            start = time.perf_counter()
            result = ps.optimize(model, chip, workload, space, tgt, objective,
                                 keep_layouts=keep, throw=False)
            wall = time.perf_counter() - start
            ratio = (result.objective_value / best.objective_value
                     if best.feasible and result.feasible else None)
            ok = result.feasible == best.feasible and (ratio is None or ratio >= 0.98)
            out[f"keep={keep}"] = {"objective_value": result.objective_value,
                                   "layout": result.design["layout"] if result.feasible
                                   else None, "ratio": ratio, "ok": ok, "warm_s": wall}
        rows.append(out)
        if not args.json:
            print(json.dumps(out), flush=True)
    summary = {}
    for keep in keeps:
        cells = [r[f"keep={keep}"] for r in rows]
        ratios = [c["ratio"] for c in cells if c["ratio"] is not None]
        summary[f"keep={keep}"] = {"misses": sum(not c["ok"] for c in cells),
                                   "worst_ratio": min(ratios),
                                   "warm_s_total": sum(c["warm_s"] for c in cells)}
    positions = [r["first_good_in_screen"] for r in rows if "first_good_in_screen" in r]
    summary["first_good_in_screen"] = {str(k): positions.count(k) for k in sorted(set(positions))}
    summary["scenarios"] = len(rows)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    else:
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
