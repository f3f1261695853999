"""What a TPOT difference costs an agent task, with and without prefix caching.

H100 + Llama-3.1-8B under vLLM's scheduler and fitted runtime, `--sessions` agent
sessions of `--calls` serial calls each (`simulate.agent_sessions`: a system prompt, the
user's turn, then per call `--output` generated tokens and a `--tool-result`-token tool
result appended to the history, `--tool-latency` s of tool time between calls). The
slower engine is the same one with `--extra-tpot` s more host overhead per step
(`Runtime.step_overhead`), so its TPOT is that much higher and nothing else differs
(its prefill steps pay it too). Each of the four runs (two engines, cache on/off) is
one simulation; task time is a session's first arrival to its last finish.

    python benchmarks/bench_agents.py [--sessions 8] [--calls 50] [--extra-tpot 0.010] [--json FILE]

Prints, per engine and cache setting, mean TTFT and TPOT over calls and the p50/p99 task
time over sessions, then what the extra TPOT adds to the p50 task.
"""

from __future__ import annotations

import argparse
import json

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import perfmodel as pm  # noqa: E402
from perfmodel import simulate as sim  # noqa: E402
from perfmodel.fitted import runtime_for  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--system-prompt", type=int, default=2000)
    parser.add_argument("--user-turn", type=int, default=200)
    parser.add_argument("--tool-result", type=int, default=500)
    parser.add_argument("--output", type=int, default=150)
    parser.add_argument("--tool-latency", type=float, default=1.0)
    parser.add_argument("--extra-tpot", type=float, default=0.010)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    base = runtime_for("vllm", chip.family)

    def design(extra):
        runtime = runtime_for("vllm", chip.family,
                              step_overhead=float(base.step_overhead) + extra)
        return pm.Design(concurrency=1.0, layout=pm.Layout(tp=1),
                         precision=pm.precision(chip, model), runtime=runtime)

    rows = []
    for cache in (True, False):
        requests = sim.agent_sessions(args.sessions, args.calls, args.system_prompt,
                                      args.user_turn, args.tool_result, args.output,
                                      args.tool_latency, prefix_cache=cache)
        for name, extra in (("base", 0.0), (f"+{args.extra_tpot * 1e3:g} ms", args.extra_tpot)):
            r = sim.simulate_jit(model, chip, design(extra), sim.Policy(), requests,
                                 max_steps=400_000)
            s = sim.summarize(r)
            task = sim.session_stats(r, args.sessions)
            rows.append({"engine": name, "prefix_cache": cache,
                         "unfinished": int(s.unfinished),
                         "ttft_mean_s": float(s.ttft.mean), "tpot_mean_s": float(s.tpot.mean),
                         "task_p50_s": float(task.p50), "task_p99_s": float(task.p99)})
    print(f"{'engine':>8} {'cache':>5} {'TTFT ms':>8} {'TPOT ms':>8} {'task p50 s':>10} "
          f"{'task p99 s':>10} {'unfinished':>10}")
    for row in rows:
        print(f"{row['engine']:>8} {str(row['prefix_cache']):>5} {row['ttft_mean_s'] * 1e3:8.1f} "
              f"{row['tpot_mean_s'] * 1e3:8.2f} {row['task_p50_s']:10.1f} "
              f"{row['task_p99_s']:10.1f} {row['unfinished']:10d}")
    for cache in (True, False):
        a, b = [row for row in rows if row["prefix_cache"] == cache]
        print(f"prefix cache {'on ' if cache else 'off'}: TPOT +"
              f"{(b['tpot_mean_s'] - a['tpot_mean_s']) * 1e3:.2f} ms -> task p50 +"
              f"{b['task_p50_s'] - a['task_p50_s']:.1f} s "
              f"({100 * (b['task_p50_s'] / a['task_p50_s'] - 1):.0f} %), p99 +"
              f"{b['task_p99_s'] - a['task_p99_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return np.asarray([row["task_p50_s"] for row in rows])


if __name__ == "__main__":
    main()
