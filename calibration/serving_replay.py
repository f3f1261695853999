"""Replay the measured vLLM runs through the serving simulator and compare latencies.

For each run of `calibration/data/serving/vllm_requests/` it takes the requests' arrival
times and lengths (`requests.jsonl`: only `arrival_time`, `input_toks`, `output_toks` are
read for the prediction) and the engine configuration of `meta.json` (model, tensor
parallelism, `max_num_seqs`, `max_num_batched_tokens`, `long_prefill_token_threshold`,
KV blocks and prefix caching when recorded, `gpu_memory_utilization`), simulates them with
vLLM's fitted runtime terms (`perfmodel.fitted.runtime_for("vllm")`) and prints median
and p99 of TTFT, TPOT and E2E, predicted against measured (TTFT = first_token_ts -
queued_ts, TPOT = (last_token_ts - first_token_ts) / (output_toks - 1), E2E =
last_token_ts - queued_ts), and the mean number of requests running (first scheduled to
last token, over the run). Nothing is tuned to these runs.

It then runs the simulator at a fixed concurrency against `predict`'s steady state
(`closed_loop`).

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
           ("queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts", "output_toks")}
    return {"ttft": get["first_token_ts"] - get["queued_ts"],
            "tpot": (get["last_token_ts"] - get["first_token_ts"])
            / np.maximum(get["output_toks"] - 1.0, 1.0),
            "e2e": get["last_token_ts"] - get["queued_ts"],
            "running": running(get["queued_ts"], get["scheduled_ts"], get["last_token_ts"])}


def running(arrival, scheduled, finish) -> float:
    """Mean number of requests running (first scheduled, not finished) over the run, from
    the first arrival to the last finish."""
    return float(np.sum(finish - scheduled) / (np.max(finish) - np.min(arrival)))


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
    valid = np.asarray(result.valid) & np.asarray(result.finished)
    out = {"run": run.name, "requests": int(summary.requests),
           "unfinished": int(summary.unfinished), "preemptions": int(summary.preemptions),
           "kv_blocks": float(np.where(np.isinf(policy.kv_blocks),
                                       sim.engine_kv_blocks(model, chip, design),
                                       policy.kv_blocks)),
           "steps": int(result.steps), "wall_s": wall,
           "running": {"predicted": running(*(np.asarray(x, dtype=float)[valid] for x in (
               result.arrival, result.scheduled, result.finish))),
                       "measured": truth["running"]}}
    for name in ("ttft", "tpot", "e2e"):
        for q in (50, 99):
            p = float(np.nanpercentile(predicted[name], q))
            m = float(np.percentile(truth[name], q))
            out[f"{name}_p{q}"] = {"predicted": p, "measured": m, "error": p / m - 1.0}
    return out


def closed_loop(clients: int = 16, isl: int = 1024, osl: int = 256,
                cached_fraction: float = 0.0) -> dict:
    """The simulator at a fixed concurrency against `predict`'s steady state (H100,
    Llama-3.1-8B, vLLM's fitted terms, a 2,048-token step budget): `clients` clients, 8
    requests each, lengths uniform in [0.8, 1] x ISL/OSL as `predict` assumes, measured
    over the middle half of the run (past the first wave, before clients run dry).
    Relative differences of throughput, mean TPOT and mean E2E (TTFT differs by
    construction: `predict`'s fitted admission wait stands in for the scheduling the
    simulator does step by step). The same case as
    `tests/test_simulate.py::test_closed_loop_reproduces_the_steady_state_model`.
    `cached_fraction`: that share of each prompt (whole KV blocks) is a prefix-cache hit at
    arrival (`Requests.cached_len`; the policy's prefix caching is on), against `predict` of
    `Workload(cached_fraction=...)`."""
    import equinox as eqx
    import jax.numpy as jnp

    import perfmodel as pm
    from perfmodel.fitted import runtime_for

    chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    design = pm.Design(concurrency=float(clients), layout=pm.Layout(tp=1),
                       precision=pm.precision(chip, model),
                       runtime=runtime_for("vllm", chip.family, max_batched_tokens=2048.0))
    metrics = pm.predict(model, chip, pm.Workload(isl, osl, cached_fraction=cached_fraction),
                         design, hard=True)
    num = clients * 8
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    inputs = jnp.round(jax.random.uniform(k1, (num,), minval=0.8 * isl, maxval=isl))
    outputs = jnp.round(jax.random.uniform(k2, (num,), minval=0.8 * osl, maxval=osl))
    think = float(design.runtime.request_overhead)
    requests = sim.closed_loop(clients, num, inputs, outputs, think_time=think)
    policy = sim.Policy(max_num_batched_tokens=2048)   # prefix caching on (vLLM v1)
    if cached_fraction > 0:
        block = float(policy.block_size)
        requests = eqx.tree_at(lambda r: r.cached_len, requests,
                               jnp.floor(cached_fraction * inputs / block) * block)
    design = eqx.tree_at(lambda d: d.concurrency, design, jnp.asarray(1.0))
    result = jax.tree_util.tree_map(np.asarray, sim.simulate_jit(
        model, chip, design, policy, requests, max_steps=50_000))
    end = float(result.end_time)
    inside = (result.arrival >= 0.25 * end) & (result.finish <= 0.75 * end)
    e2e = float(result.e2e[inside].mean())
    tokens = float(np.mean(requests.input_len + requests.output_len))
    throughput = clients * tokens / (e2e + think)   # one request per E2E + think per client
    return {"clients": clients, "isl": isl, "osl": osl, "cached_fraction": cached_fraction,
            "finished": bool(result.finished.all()),
            "throughput": throughput / float(metrics.throughput_per_chip) - 1.0,
            "tpot": float(result.tpot[inside].mean()) / float(metrics.tpot) - 1.0,
            "e2e": e2e / float(metrics.e2e) - 1.0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the numbers to this file")
    args = parser.parse_args()
    results = [replay(run) for run in sorted(p for p in RUNS.iterdir() if p.is_dir())]
    for r in results:
        print(f"\n{r['run']}: {r['requests']} requests, {r['unfinished']} unfinished, "
              f"{r['preemptions']} preemptions, {r['kv_blocks']:.0f} KV blocks, "
              f"{r['steps']} steps, {r['wall_s']:.1f} s; mean running "
              f"{r['running']['predicted']:.1f} predicted, {r['running']['measured']:.1f} "
              "measured")
        print(f"  {'metric':<9}{'measured':>11}{'predicted':>11}{'error':>9}")
        for name in ("ttft", "tpot", "e2e"):
            for q in (50, 99):
                v = r[f"{name}_p{q}"]
                print(f"  {name + ' p' + str(q):<9}{v['measured']:>11.4f}"
                      f"{v['predicted']:>11.4f}{100 * v['error']:>8.1f}%")
    closed = closed_loop()
    cached = [closed_loop(16, isl, osl, share) for isl, osl, share in (
        (1024, 256, 0.5), (4096, 128, 0.0), (4096, 128, 0.5), (4096, 128, 0.875))]
    print()
    for c in [closed, *cached]:
        print(f"closed loop ({c['clients']} clients, {c['isl']}/{c['osl']} tokens, "
              f"{100 * c['cached_fraction']:g} % of each prompt cached, H100, Llama-3.1-8B) "
              f"against predict's steady state: throughput {100 * c['throughput']:+.1f} %, "
              f"TPOT {100 * c['tpot']:+.1f} %, E2E {100 * c['e2e']:+.1f} %")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"runs": results, "closed_loop": closed, "closed_loop_cached": cached},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
