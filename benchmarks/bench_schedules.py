"""How the Adam schedule of `perfmodel.search.optimize` trades time for convergence, on
the test suite's 22 scenarios (`tests/test_optimize.py`: Llama-3.1-8B on H200, DeepSeek-R1 on
8 Jalapeno, GPT-OSS-120B on B200; 2 of them infeasible).

For each schedule it reports: scenarios whose hardened design misses the exhaustive optimum
of the same grid by more than 2% or disagrees on feasibility (the acceptance bar: 0); exact
evaluations spent in hardening; of the feasible scenarios, how many relaxed solutions end
within 1% of every limit, the median and range of relaxed objective / grid optimum among
those, and the largest final relaxed violations; the warm wall time of all 22 optimizations.

    python benchmarks/bench_schedules.py [--schedules 24/4 240/6 ...] [--json]

A schedule is STEPS/BLOCKS (default learning rate and temperatures) or
STEPS/BLOCKS/LR/T_END.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

from perfmodel import search as ps  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from test_optimize import GROUPS, SCENARIOS  # noqa: E402


def _schedule(text: str) -> dict:
    parts = text.split("/")
    out = {"steps": int(parts[0]), "blocks": int(parts[1])}
    if len(parts) > 2:
        out["learning_rate"] = float(parts[2])
    if len(parts) > 3:
        out["temperature"] = (1.0, float(parts[3]))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schedules", nargs="+",
                        default=["24/4", "40/4", "120/4/0.1/0.02", "240/6/0.1/0.02"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    groups = {name: build() for name, build in GROUPS.items()}
    cases = []
    for name, objective, limits in SCENARIOS:
        model, chip, workload, space = groups[name]
        tgt = ps.targets(chips=space.layouts[0].chips, **limits)
        best = ps.exhaustive(model, chip, workload, space, tgt, objective)
        cases.append((model, chip, workload, space, tgt, objective, best))
    rows = []
    for text in args.schedules:
        kw = _schedule(text)
        misses, evaluations, wall, relaxed = 0, 0, 0.0, []
        for model, chip, workload, space, tgt, objective, best in cases:
            ps.optimize(model, chip, workload, space, tgt, objective, throw=False, **kw)  # compile
            start = time.perf_counter()
            r = ps.optimize(model, chip, workload, space, tgt, objective, throw=False, **kw)
            wall += time.perf_counter() - start
            ok = r.feasible == best.feasible and (
                not best.feasible or r.objective_value >= 0.98 * best.objective_value)
            misses += not ok
            evaluations += r.evaluations
            if best.feasible:
                relaxed.append((r.relaxed_objective_value / best.objective_value,
                                r.trajectory["max_violation"][-1]))
        within = [ratio for ratio, violation in relaxed if violation < 0.01]
        row = {"schedule": text, **kw, "misses": misses, "evaluations": evaluations,
               "relaxed_within_1pct": len(within), "feasible_scenarios": len(relaxed),
               "relaxed_over_grid_median": float(np.median(within)) if within else None,
               "relaxed_over_grid_range": [min(within), max(within)] if within else None,
               "largest_relaxed_violations": sorted(v for _, v in relaxed)[-3:],
               "warm_wall_s": wall}
        rows.append(row)
        if not args.json:
            print(f"{text:>14}: {misses} misses, {evaluations} exact evaluations, relaxed "
                  f"within 1% of every limit {len(within)}/{len(relaxed)} (relaxed / grid "
                  f"optimum median {row['relaxed_over_grid_median']:.3f}, range "
                  f"{min(within):.3f}-{max(within):.3f}; largest violations "
                  f"{', '.join(f'{v:.0%}' for v in row['largest_relaxed_violations'])}), "
                  f"warm {1e3 * wall:.0f} ms for 22", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
