"""The serving simulator against the InferenceMAX DeepSeek-R1 B200 SGLang rows, whose recipe
sets SGLang's `--scheduler-recv-interval` (10 below 16 requests, 30 from 16; the rows'
`poll_steps` column, `calibration/README.md`): `python calibration/sglang_polling_check.py`.

Each distinct layout and concurrency of the 8K/1K rows runs as the benchmark ran it: a
closed loop of `conc` clients, 10 requests each (`--num-prompts $((CONC * 10))`), prompt
and output lengths uniform in [0.8, 1] x ISL / OSL (RANDOM_RANGE_RATIO 0.8), SGLang's
scheduler with the recipe's `--chunked-prefill-size 16384`, `--max-running-requests 256`
and the row's recv interval (`simulate.Policy.sglang`), the chip's and SGLang's fitted
terms, the recipe's FP8 KV cache. Nothing is fitted to these runs here; the latency fit
has seen 80 % of them (its steady state, `perfmodel predict`, is the last column). Prints
a Markdown table: median TTFT and TPOT measured (mean over the row's repeated runs), the
simulator at the recipe's interval and at 1 (every step), and the steady state.
"""

from __future__ import annotations

import collections
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import perfmodel as pm  # noqa: E402
from perfmodel import simulate as sim  # noqa: E402
from perfmodel.calibration import predict_rows  # noqa: E402
from perfmodel.datasets import load_benchmarks  # noqa: E402
from perfmodel.fitted import runtime_for  # noqa: E402

#: The recipe's settings (SemiAnalysisAI/InferenceX benchmarks/dsr1_fp4_b200.sh at 1fc5d73c).
CHUNKED_PREFILL = 16384
MAX_RUNNING = 256
PROMPTS_PER_CLIENT = 10


def _simulate(chip, model, tp, ep, conc, isl, osl, interval, seed=0):
    design = pm.Design(concurrency=float(conc), layout=pm.Layout(tp=tp, ep=ep),
                       precision=pm.precision(chip, model, "fp4", kv="fp8"),
                       runtime=runtime_for("sglang", chip.family))
    total = conc * PROMPTS_PER_CLIENT
    rng = np.random.default_rng(seed)
    requests = sim.closed_loop(
        conc, total, jnp.asarray(rng.integers(int(0.8 * isl), isl + 1, total), float),
        jnp.asarray(rng.integers(int(0.8 * osl), osl + 1, total), float))
    policy = sim.Policy.sglang(float(chip.hbm_capacity), chunked_prefill_size=CHUNKED_PREFILL,
                               max_running_requests=MAX_RUNNING,
                               scheduler_recv_interval=interval)
    result = sim.simulate(model, chip, design, policy, requests, max_steps=200_000)
    if not bool(jnp.all(result.finished)):
        raise RuntimeError(f"tp{tp} ep{ep} conc {conc}: unfinished requests")
    # The benchmark's medians over all its requests (the first wave included).
    return float(np.median(result.ttft)), float(np.median(result.tpot))


def main() -> int:
    rows = [r for r in load_benchmarks(HERE / "data" / "benchmarks_inferencemax.csv")
            if r.hardware == "b200" and r.framework == "sglang" and r.isl == 8192
            and r.osl == 1024]
    predicted = predict_rows(tuple(rows))
    groups = collections.defaultdict(list)
    for row, pred in zip(rows, predicted, strict=True):
        groups[(row.layout.tp, row.layout.ep, int(row.conc), int(row.poll_steps))].append(
            (row.measured, pred))
    chip, model = pm.get_chip("b200"), pm.get_model("deepseek-r1")
    print("| tp / ep | requests | interval | TTFT measured | simulated | simulated, interval 1 "
          "| steady state | TPOT measured | simulated | steady state |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    errors = collections.defaultdict(list)
    for (tp, ep, conc, interval), runs in sorted(groups.items()):
        ttft = np.mean([m["median_ttft_s"] for m, _ in runs])
        tpot = np.mean([m["median_tpot_s"] for m, _ in runs])
        ss_ttft = np.mean([p["pred_ttft_s"] for _, p in runs])
        ss_tpot = np.mean([p["pred_tpot_s"] for _, p in runs])
        sim_ttft, sim_tpot = _simulate(chip, model, tp, ep, conc, 8192, 1024, interval)
        every, _ = _simulate(chip, model, tp, ep, conc, 8192, 1024, 1)
        for key, value, truth in (("simulated TTFT", sim_ttft, ttft),
                                  ("simulated TTFT, interval 1", every, ttft),
                                  ("steady-state TTFT", ss_ttft, ttft),
                                  ("simulated TPOT", sim_tpot, tpot),
                                  ("steady-state TPOT", ss_tpot, tpot)):
            errors[key].append(abs(value / truth - 1.0))
        print(f"| {tp} / {ep} | {conc} | {interval} | {ttft:.3f} | {sim_ttft:.3f} | "
              f"{every:.3f} | {ss_ttft:.3f} | {1e3 * tpot:.1f} ms | {1e3 * sim_tpot:.1f} ms | "
              f"{1e3 * ss_tpot:.1f} ms |", flush=True)
    print()
    print("Median absolute error over the configurations: " + "; ".join(
        f"{k} {100 * np.median(v):.1f} %" for k, v in errors.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
