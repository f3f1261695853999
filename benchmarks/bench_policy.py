"""Batch-policy tuning against a grid search, both verified in the simulator.

Per scenario (model, chips, lengths, MLPerf-style p99 SLOs, a load): the gradient-tuned
policy (`policy.tune`: surrogate gradient per layout option, rounded, simulated, backed off)
and the best point of a grid of the same space (`policy.grid_search`: every point
simulated on the same requests). Prints each one's simulated goodput per chip, their
ratio and both wall times (compilation included: each scenario's kernels are new), and
writes the rows to a JSON file next to this script.

The load of a scenario is a fraction of the surrogate's capacity of vLLM's default policy
(2048 tokens, 256 sequences) on the largest-tp option, so the loads are near where the
policy matters. SLOs are MLPerf's llama2-70b ones (Server p99 TTFT 2 s / TPOT 200 ms,
Interactive 450 / 40 ms; MLPerf Inference v5.0 rules, "llama2-70b-interactive").

    python benchmarks/bench_policy.py [--requests 500] [--json OUT] [--only N]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax

jax.config.update("jax_enable_x64", True)

import perfmodel as pm  # noqa: E402
from perfmodel import policy, surrogate  # noqa: E402
from perfmodel import simulate as sim  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
SERVER, INTERACTIVE = (2.0, 0.2), (0.45, 0.04)
#: (model, chip, chips, input tokens, output tokens, (TTFT, TPOT) SLOs (s), load, cv).
SCENARIOS = (
    ("llama-3.1-8b", "h100", 1, 1024, 256, SERVER, 0.9, 1.0),
    ("llama-3.1-8b", "h100", 1, 1024, 256, INTERACTIVE, 0.7, 1.0),
    ("llama-3.1-8b", "h100", 1, 2048, 128, INTERACTIVE, 0.9, 1.0),
    ("llama-3.1-8b", "h100", 1, 1024, 256, SERVER, 0.8, 2.0),
    ("llama-3.1-8b", "rtx-pro-6000", 1, 1024, 256, SERVER, 0.9, 1.0),
    ("llama-3.1-8b", "rtx-pro-6000", 1, 1024, 256, INTERACTIVE, 0.7, 1.0),
    ("qwen3-32b", "h100", 2, 1024, 256, SERVER, 0.9, 1.0),
    ("qwen3-32b", "h100", 2, 1024, 256, INTERACTIVE, 0.7, 1.0),
    ("llama-3.1-70b", "h200", 4, 1024, 256, SERVER, 0.9, 1.0),
    ("llama-3.1-70b", "h200", 4, 1024, 256, INTERACTIVE, 0.7, 1.0),
    ("llama-3.1-8b", "h100", 1, 2048, 128, INTERACTIVE, 0.6, 1.0),
    ("llama-3.1-8b", "h100", 1, 512, 512, SERVER, 0.95, 1.0),
)
#: A smaller grid than `policy.grid_search`'s default keeps the benchmark within minutes
#: on 2 CPU cores: 4 budgets x 4 sequence caps x 2 chunk caps per layout option.
BUDGETS, SEATS = (1024, 2048, 4096, 8192), (32, 64, 128, 256)


def scenario_rate(model, chip, chips, isl, osl, cv, load):
    """`load` x the surrogate's capacity of vLLM's default policy on the largest-tp
    option (requests/s of the whole pool)."""
    option = policy.options(model, chip, chips, isl, osl)[-1]
    at = surrogate.Load(rate=1.0, input_len=isl, output_len=osl, cv=cv)
    return load * option.replicas * float(surrogate.capacity(model, chip, option.design,
                                                             sim.Policy(), at))


def markdown(rows) -> str:
    """The rows as the README's table."""
    def pol(d):
        chunk = d["long_prefill_token_threshold"]
        return (f"{d['max_num_batched_tokens']}/{d['max_num_seqs']}/"
                f"{'-' if chunk is None else chunk}")

    lines = ["| scenario | SLO TTFT/TPOT | rate | tuned (budget/seqs/chunk, layout) | "
             "tuned goodput/chip | grid best | grid goodput/chip | ratio | tuned s | grid s "
             "(points) |", "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        met = {True: "", False: " (SLO missed)"}
        lines.append(
            f"| {r['model']}, {r['chips']}x {r['chip']}, {r['isl']}/{r['osl']}"
            f"{', cv ' + format(r['cv'], 'g') if r['cv'] != 1 else ''} | "
            f"{r['ttft_slo_s'] * 1e3:.0f}/{r['tpot_slo_s'] * 1e3:.0f} ms | {r['rate']:.2f}/s | "
            f"{pol(r['tuned_policy'])}, {r['tuned_layout']} | "
            f"{r['tuned_goodput_per_chip']:.2f}{met[r['tuned_slo_met']]} | "
            f"{pol(r['grid_policy'])}, {r['grid_layout']} | "
            f"{r['grid_goodput_per_chip']:.2f}{met[r['grid_slo_met']]} | {r['ratio']:.3f} | "
            f"{r['tuned_wall_s']:.1f} | {r['grid_wall_s']:.0f} ({r['grid_points']}) |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--json", default=str(HERE / "bench_policy.json"))
    parser.add_argument("--only", type=int, default=None, help="run the first N scenarios")
    parser.add_argument("--markdown", action="store_true",
                        help="print the rows of --json as a Markdown table and exit")
    parser.add_argument("--pick", default=None,
                        help="comma-separated scenario indices to rerun, merged into --json")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(pathlib.Path(args.json).read_text())["rows"]))
        return
    rows, picked = [], list(enumerate(SCENARIOS))[:args.only]
    if args.pick:
        keep = {int(i) for i in args.pick.split(",")}
        picked = [(i, spec) for i, spec in picked if i in keep]
        old = json.loads(pathlib.Path(args.json).read_text())["rows"]
        rows = [dict(r, index=r.get("index", i)) for i, r in enumerate(old)]
        rows = [r for r in rows if r["index"] not in keep]
    for index, spec in picked:
        name, chip_name, chips, isl, osl, (ttft, tpot), load, cv = spec
        model, chip = pm.get_model(name), pm.get_chip(chip_name)
        rate = scenario_rate(model, chip, chips, isl, osl, cv, load)
        p = policy.problem(model, chip, chips, surrogate.Load(rate=rate, input_len=isl,
                                                              output_len=osl, cv=cv),
                           ttft, tpot, num_requests=args.requests)
        start = time.perf_counter()
        tuned = policy.tune(p, progress=False)
        tuned_wall = time.perf_counter() - start
        grid = policy.grid_search(p, budgets=BUDGETS, seats=SEATS, progress=False)
        row = dict(index=index, model=name, chip=chip_name, chips=chips, isl=isl, osl=osl,
                   ttft_slo_s=ttft, tpot_slo_s=tpot, cv=cv, rate=rate, load=load,
                   tuned_policy=policy.as_dict(tuned.policy),
                   tuned_layout=tuned.option.describe(),
                   tuned_goodput_per_chip=float(tuned.summary.goodput_per_chip),
                   tuned_slo_met=tuned.slo_met, tuned_backoffs=tuned.backoffs,
                   tuned_wall_s=tuned_wall,
                   grid_policy=policy.as_dict(grid.policy), grid_layout=grid.option.describe(),
                   grid_goodput_per_chip=float(grid.summary.goodput_per_chip),
                   grid_slo_met=grid.slo_met, grid_points=grid.points, grid_wall_s=grid.wall_s)
        row["ratio"] = row["tuned_goodput_per_chip"] / max(row["grid_goodput_per_chip"], 1e-12)
        rows.append(row)
        rows.sort(key=lambda r: r["index"])
        print(f"{name} {chips}x{chip_name} {isl}/{osl} SLO {ttft * 1e3:.0f}/{tpot * 1e3:.0f} ms "
              f"cv {cv:g} at {rate:.2f}/s: tuned {row['tuned_goodput_per_chip']:.3f} "
              f"({'met' if tuned.slo_met else 'MISSED'}, {tuned_wall:.1f} s) grid "
              f"{row['grid_goodput_per_chip']:.3f} ({'met' if grid.slo_met else 'MISSED'}, "
              f"{grid.points} pts, {grid.wall_s:.1f} s) ratio {row['ratio']:.3f}", flush=True)
        pathlib.Path(args.json).write_text(json.dumps(
            dict(command=f"python benchmarks/bench_policy.py --requests {args.requests}",
                 requests=args.requests, rows=rows), indent=1))
    within = sum(r["ratio"] >= 0.97 for r in rows)
    print(f"{within} of {len(rows)} scenarios within 3 % of the grid's best")


if __name__ == "__main__":
    main()
