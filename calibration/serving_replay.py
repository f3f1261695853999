"""Replay the measured vLLM runs through the serving simulator and compare latencies.

For each run of `calibration/data/serving/vllm_requests/` it takes the requests' arrival
times and lengths (`requests.jsonl`: only `arrival_time`, `input_toks`, `output_toks` are
read for the prediction) and the engine configuration of `meta.json` (model, tensor
parallelism, `max_num_seqs`, `max_num_batched_tokens`, `long_prefill_token_threshold`,
KV blocks and prefix caching when recorded, `gpu_memory_utilization`), simulates them with
vLLM's fitted runtime terms (`perfmodel.fitted.runtime_for("vllm")`) and prints median
and p99 of TTFT, TPOT and E2E, predicted against measured (TTFT = first_token_ts -
queued_ts, TPOT = (last_token_ts - first_token_ts) / (output_toks - 1), E2E =
last_token_ts - queued_ts). Nothing is tuned to these runs.

    python calibration/serving_replay.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

from perfmodel import simulate as sim  # noqa: E402
from perfmodel.traces import load_trace, vllm_engine  # noqa: E402

RUNS = pathlib.Path(__file__).resolve().parent / "data" / "serving" / "vllm_requests"
#: Run directory prefix -> chip preset.
CHIPS = {"RTX4090": "rtx-4090", "RTXPRO6000": "rtx-pro-6000"}


def engine(run: pathlib.Path):
    """(model, chip, design, policy) of a run from its meta.json (`traces.vllm_engine`)."""
    return vllm_engine(run / "meta.json", CHIPS[run.name.split("_")[0]])


def measured(run: pathlib.Path) -> dict:
    rows = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()
            if line.strip()]
    get = {k: np.asarray([r[k] for r in rows], dtype=float) for k in
           ("queued_ts", "first_token_ts", "last_token_ts", "output_toks")}
    return {"ttft": get["first_token_ts"] - get["queued_ts"],
            "tpot": (get["last_token_ts"] - get["first_token_ts"])
            / np.maximum(get["output_toks"] - 1.0, 1.0),
            "e2e": get["last_token_ts"] - get["queued_ts"]}


def replay(run: pathlib.Path) -> dict:
    model, chip, design, policy = engine(run)
    requests = load_trace(run / "requests.jsonl")
    start = time.perf_counter()
    result = sim.simulate_jit(model, chip, design, policy, requests, max_steps=200_000)
    summary = sim.summarize(result)
    wall = time.perf_counter() - start
    predicted = {"ttft": np.asarray(result.ttft), "tpot": np.asarray(result.tpot),
                 "e2e": np.asarray(result.e2e)}
    truth = measured(run)
    out = {"run": run.name, "requests": int(summary.requests),
           "unfinished": int(summary.unfinished), "preemptions": int(summary.preemptions),
           "kv_blocks": float(np.where(np.isinf(policy.kv_blocks),
                                       sim.engine_kv_blocks(model, chip, design),
                                       policy.kv_blocks)),
           "steps": int(result.steps), "wall_s": wall}
    for name in ("ttft", "tpot", "e2e"):
        for q in (50, 99):
            p = float(np.nanpercentile(predicted[name], q))
            m = float(np.percentile(truth[name], q))
            out[f"{name}_p{q}"] = {"predicted": p, "measured": m, "error": p / m - 1.0}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the numbers to this file")
    args = parser.parse_args()
    results = [replay(run) for run in sorted(p for p in RUNS.iterdir() if p.is_dir())]
    for r in results:
        print(f"\n{r['run']}: {r['requests']} requests, {r['unfinished']} unfinished, "
              f"{r['preemptions']} preemptions, {r['kv_blocks']:.0f} KV blocks, "
              f"{r['steps']} steps, {r['wall_s']:.1f} s")
        print(f"  {'metric':<9}{'measured':>11}{'predicted':>11}{'error':>9}")
        for name in ("ttft", "tpot", "e2e"):
            for q in (50, 99):
                v = r[f"{name}_p{q}"]
                print(f"  {name + ' p' + str(q):<9}{v['measured']:>11.4f}"
                      f"{v['predicted']:>11.4f}{100 * v['error']:>8.1f}%")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
