"""MLPerf Server/Interactive through the serving simulator: `python calibration/mlperf_serving.py`.

For each MLPerf v4.1/v5.1 Server or Interactive row of `data/benchmarks_mlperf.csv` whose
model and accelerator are presets (the rows `mlperf_check.load_rows` keeps), it simulates
LoadGen's Poisson arrivals at the row's `target_qps` over the system's accelerators with
`perfmodel.simulate` and compares p50/p99 TTFT and TPOT with the measured ones. Also the
TensorRT-LLM online QPS sweep of `data/benchmarks_trtllm.csv` (`--sweep`, on by default).
Nothing is fitted and no measured latency is read before the comparison: the engine, its
layout and its batch limits come from rules fixed in advance:

- Engine: TensorRT-LLM's fitted runtime terms (`runtime_for("trt")`) and its scheduler
  (`sim.Policy.trtllm`: GUARANTEED_NO_EVICT admission, no chunked prefill, 32-token blocks,
  the engine's defaults) for TensorRT software, else vLLM's terms and vLLM v1's scheduler
  (`--trt-scheduler vllm` runs TensorRT rows on vLLM's scheduler, as before 2026-12-03).
- Layout: `mlperf_check.layout_for` (the smallest power-of-two tensor-parallel group whose
  weights take at most 60 % of usable HBM). It gives what NVIDIA's v4.1 Llama-2-70B Server
  configuration uses (H100 TP2, H200 TP1: mlcommons/inference_results_v4.1@a2f5d66
  closed/NVIDIA/configs/llama2-70b/Server/__init__.py). The system's accelerators hold
  R = accelerators / tp replicas behind a round-robin router; one replica is simulated with
  every R-th arrival of the Poisson stream (Erlang-R gaps at rate qps / R), which is exactly
  what round robin hands each replica.
- Precision: the row's weight type; rows that log fp16 for TensorRT on an FP8 chip run FP8
  weights (the same NVIDIA configuration: `use_fp8 = True`; mlperf_check calls this
  UNVERIFIED), and the KV cache is FP8 where the chip runs FP8 (UNVERIFIED for each
  submitter).
- Lengths: outputs at the data set's reference mean tokens per sample
  (`data/mlperf_dataset_lengths.csv`, from the MLPerf reference READMEs and submitted logs,
  cited there), except DeepSeek-R1, drawn from the output percentiles NVIDIA's v6.1
  report.txt gives (piecewise linear between them); inputs at the mean tokens of
  `perfmodel/data/mlperf_lengths.csv` (`perfmodel.mlperf.dataset_lengths`: derived from the
  data sets' own per-sample token counts, each with its basis and source; DeepSeek-R1's
  ASSUMED there), the lengths `perfmodel predict` uses for MLPerf rows.
  `--assumed-inputs` runs the earlier ASSUMED means (`mlperf_check.ASSUMED_INPUT`).
- Scheduler: MLPerf submitters raise the batch until the latency limits bind. Rule: the
  token budget is 8,192 (TensorRT-LLM's `max_num_tokens` default) and `max_num_seqs` is the
  largest of 16, 32, ..., 2,048 whose simulated p99 TPOT meets the row's TPOT limit
  (bisection; the limit is the only number of the row it reads besides the load); if none
  does, the tried one with the lowest p99 TPOT. When the largest misses the TTFT limit the
  replica is saturated and a smaller limit only lengthens its queue: the largest is kept. A
  simulation stops after 20,000 engine steps (45,000 for DeepSeek-R1's 20,000-token
  outputs); scored requests unfinished by then count as infinitely late.
- Steady state: each replica gets enough requests to span about four bounds of the E2E
  latency (TTFT limit + mean output x TPOT limit), 300 to 1,200, and latencies are taken
  over requests arriving between 30 % and 70 % of the arrival span (no start-up ramp, no
  drain).

A diagnostic beside the errors (`by_offline_capacity` in the JSON, `capacity_bins`): each
row's p99 ratios (predicted / measured) grouped by how far the model's Offline throughput
of the same system (model, chip, submitter, round, accelerators, software, weights) is
from that system's measured Offline result (`mlperf_check.json`, written by
`calibration/mlperf_check.py`; rows of systems without an Offline result are left out),
with their Spearman rank correlation: a model that over-predicts a system's capacity runs
its Server rate at a lower load than the submitter did.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mlperf_check import ASSUMED_INPUT, OUTPUT_MEAN, layout_for, load_rows  # noqa: E402

from perfmodel import fitted  # noqa: E402
from perfmodel import simulate as sim  # noqa: E402
from perfmodel.design import Design, Layout, precision  # noqa: E402
from perfmodel.mlperf import dataset_lengths  # noqa: E402
from perfmodel.presets import get_chip, get_model  # noqa: E402

DATA = HERE / "data"
ROOT = HERE.parent
#: DeepSeek-R1 output tokens at these quantiles: NVIDIA VR-NVL72 v6.1 Server/Offline
#: report.txt as quoted in `mlperf_dataset_lengths.csv` (min 125, p1 330, p10 601, p25 949,
#: p50 2108, p75 4903, p90 9500, p99 20000, max 20000 (the cap)).
DEEPSEEK_OUTPUT = ((0.0, 125.0), (0.01, 330.0), (0.10, 601.0), (0.25, 949.0), (0.50, 2108.0),
                   (0.75, 4903.0), (0.90, 9500.0), (0.99, 20000.0), (1.0, 20000.0))
#: Candidate `max_num_seqs` (the submitter's batch limit), smallest first.
SEQS = (16, 32, 64, 128, 256, 512, 1024, 2048)
TOKEN_BUDGET = 8192.0
MIN_REQUESTS, MAX_REQUESTS = 300, 1200
WINDOW = 2048
MAX_STEPS = 20_000
#: DeepSeek-R1's outputs reach 20,000 tokens (one engine step each).
MAX_STEPS_LONG = 45_000
METRICS = ("ttft50", "ttft99", "tpot50", "tpot99")


def derived_inputs() -> dict[str, float]:
    """Mean input tokens per model preset from `perfmodel/data/mlperf_lengths.csv` (models
    without a statistic there keep `mlperf_check.ASSUMED_INPUT`)."""
    out = dict(ASSUMED_INPUT)
    for row in dataset_lengths().values():
        if row["input_tokens_mean"]:
            out[row["model"]] = float(row["input_tokens_mean"])
    return out


#: Mean input tokens per model (`--input` overrides one for a sensitivity run).
INPUT = derived_inputs()
#: Scheduler of TensorRT rows: "trtllm" (`sim.Policy.trtllm`) or "vllm" (`--trt-scheduler`).
TRT_SCHEDULER = {"name": "trtllm"}


def policy_for(framework: str, seqs: float, budget: float, prompt: float = 0.0):
    """The engine's scheduler with its batch limit (requests) and token budget (tokens).
    TensorRT-LLM schedules a prompt whole unless chunked prefill is on: it is turned on
    when `prompt` (tokens) exceeds the budget, which a submitter must do to run them."""
    if framework == "trt" and TRT_SCHEDULER["name"] == "trtllm":
        return sim.Policy.trtllm(max_batch_size=float(seqs), max_num_tokens=float(budget),
                                 enable_chunked_prefill=bool(prompt > budget))
    return sim.Policy(max_num_seqs=float(seqs), max_num_batched_tokens=float(budget))


def output_lengths(model: str, num: int, rng: np.random.Generator) -> np.ndarray:
    """Output tokens per request: the data set's distribution where documented, else its
    reference mean (rounded)."""
    if model == "deepseek-r1":
        q, v = np.array(DEEPSEEK_OUTPUT).T
        return np.round(np.interp(rng.uniform(size=num), q, v))
    return np.full(num, float(round(OUTPUT_MEAN[model])))


def engine(row: dict):
    """(model, chip, design, framework, replicas) of a row by the rules of the docstring."""
    model, chip = get_model(row["model"]), get_chip(row["chip"])
    framework = "trt" if "tensorrt" in row["software"].lower() else "vllm"
    weights = row["weights"]
    fp8 = "fp8" in chip.native_classes
    if framework == "trt" and weights == "bf16" and fp8:
        weights = "fp8"
    prec = precision(chip, model, weights, kv="fp8" if fp8 else None)
    layout = layout_for(model, chip, prec, row["per_node"], row["accelerators"])
    design = Design(concurrency=1.0, layout=Layout(tp=layout.tp), precision=prec,
                    runtime=fitted.runtime_for(framework))
    return model, chip, design, framework, layout.replicas


def constraints(row: dict) -> tuple[float, float]:
    """The row's (TTFT, TPOT) p99 limits (s)."""
    return row["ttft_limit"], row["tpot_limit"]


def requests_for(row: dict, replicas: int, seed: int = 0):
    """One replica's share of the row's Poisson stream, padded to `MAX_REQUESTS`, and the
    mask of the requests that are scored."""
    rng = np.random.default_rng(seed)
    rate = row["qps"] / replicas
    ttft_limit, tpot_limit = constraints(row)
    e2e_bound = ttft_limit + OUTPUT_MEAN[row["model"]] * tpot_limit
    num = int(np.clip(np.ceil(4.0 * rate * e2e_bound), MIN_REQUESTS, MAX_REQUESTS))
    gaps = rng.gamma(float(replicas), 1.0 / (replicas * rate), size=num - 1)
    arrival = np.concatenate([[0.0], np.cumsum(gaps)])
    inputs = np.full(num, round(INPUT[row["model"]]))   # whole tokens: the mean, rounded
    outputs = output_lengths(row["model"], num, rng)
    scored = (arrival >= 0.3 * arrival[-1]) & (arrival <= 0.7 * arrival[-1])
    return sim.trace(arrival, inputs, outputs, size=MAX_REQUESTS), np.concatenate(
        [scored, np.zeros(MAX_REQUESTS - num, bool)])


def run_policy(model, chip, design, requests, scored, seqs: int, framework: str) -> dict:
    prompt = float(np.max(np.asarray(requests.input_len)[np.asarray(requests.valid)]))
    policy = policy_for(framework, seqs, TOKEN_BUDGET, prompt)
    steps = MAX_STEPS_LONG if model.name.startswith("deepseek") else MAX_STEPS
    result = sim.simulate_jit(model, chip, design, policy, requests, max_steps=steps,
                              window=WINDOW)
    ttft, tpot = np.asarray(result.ttft), np.asarray(result.tpot)
    done = np.asarray(result.finished) & scored
    out = {"seqs": seqs, "scored": int(scored.sum()),
           "unfinished": int((scored & ~done).sum()),
           "preemptions": int(np.asarray(result.preemptions)[scored].sum()),
           "window_overflow": bool(result.window_overflow)}
    for name, x in (("ttft", ttft), ("tpot", tpot)):
        # An unfinished scored request counts as an infinite latency (it did not meet any
        # limit), so a saturated replica shows as such in its p99.
        values = np.where(done, x, np.inf)[scored]
        values = values[~np.isnan(values)]
        for q in (50, 99):
            # LoadGen's percentile: the sample at rank ceil(q n) (no interpolation).
            out[f"{name}{q}"] = float(np.percentile(values, q, method="inverted_cdf")) \
                if len(values) else np.inf
    return out


def predict_row(row: dict) -> dict:
    """Simulated p50/p99 TTFT and TPOT of a row at its target QPS, with the batch limit the
    rule chooses (docstring)."""
    model, chip, design, framework, replicas = engine(row)
    requests, scored = requests_for(row, replicas)
    _, tpot_limit = constraints(row)
    tried = {}

    def trial(i):
        if i not in tried:
            tried[i] = run_policy(model, chip, design, requests, scored, SEQS[i], framework)
        return tried[i]

    def meets(i):
        return trial(i)["tpot99"] <= tpot_limit

    # The largest candidate meeting the TPOT limit (p99 TPOT grows with the batch limit):
    # bisection with a virtual candidate -1 that meets it.
    lo, hi = -1, len(SEQS) - 1
    ttft_limit, _ = constraints(row)
    if meets(hi) or trial(hi)["ttft99"] > ttft_limit:
        # Meets it, or misses the TTFT limit: saturated, where a smaller limit only
        # lengthens the queue.
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    # None meets it: the tried candidate with the lowest p99 TPOT (the row is predicted
    # infeasible at its target QPS, `meets_limits` False).
    best = lo if lo >= 0 else min(tried, key=lambda i: tried[i]["tpot99"])
    chosen = trial(best)
    return {"tp": design.layout.tp, "replicas": replicas, "framework": framework,
            "precision": list(design.precision.names), **chosen,
            "meets_limits": bool(chosen["tpot99"] <= tpot_limit
                                 and chosen["ttft99"] <= ttft_limit),
            "policies_tried": len(tried)}


def mlperf_rows() -> tuple[list[dict], dict]:
    """`mlperf_check.load_rows` with each row's latency limits (s)."""
    rows, skipped = load_rows()
    limits = {}
    with open(DATA / "benchmarks_mlperf.csv", newline="") as handle:
        for line, raw in enumerate(csv.DictReader(handle), start=2):
            limits[line] = (float(raw["ttft_constraint_ms"]) / 1e3,
                            float(raw["tpot_constraint_ms"]) / 1e3)
    for row in rows:
        row["ttft_limit"], row["tpot_limit"] = limits[row["line"]]
    return rows, skipped


def dedupe_key(row: dict) -> tuple:
    """Rows that simulate identically (e.g. a -99 and a -99.9 submission of one system)."""
    return (row["model"], row["chip"], row["weights"], row["accelerators"], row["per_node"],
            "tensorrt" in row["software"].lower(), row["qps"], row["ttft_limit"],
            row["tpot_limit"])


def relative_errors(results: list[dict]) -> dict:
    return {k: [r[f"pred_{k}"] / r[k] - 1.0 for r in results] for k in METRICS}


def medians(results: list[dict]) -> dict:
    """Median |relative error| per metric, and the median ratio (predicted / measured) of
    the p99s."""
    errors = relative_errors(results)
    return {"n": len(results),
            **{k: float(np.median(np.abs(v))) if v else float("nan")
               for k, v in errors.items()},
            **{f"ratio_{k}": float(np.median(np.asarray(errors[k]) + 1.0)) if errors[k]
               else float("nan") for k in ("ttft99", "tpot99")}}


#: The systems' key shared by an Offline row and its Server/Interactive rows.
SYSTEM_KEY = ("model", "chip", "submitter", "version", "accelerators", "software", "weights")
#: Edges of the Offline capacity ratio (predicted / measured) in `capacity_bins`.
CAPACITY_EDGES = (0.9, 1.1, 1.25)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks of `x` (0-based), ties given their mean rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for value in np.unique(x):
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x, y) -> float:
    """Spearman's rank correlation of two equally long sequences, over the pairs without
    a NaN (infinities rank last); nan below 3 such pairs."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    kept = ~(np.isnan(x) | np.isnan(y))
    x, y = x[kept], y[kept]
    if len(x) < 3:
        return float("nan")
    return float(np.corrcoef(_ranks(x), _ranks(y))[0, 1])


def capacity_bins(results: list[dict], offline: list[dict]) -> dict:
    """The p99 ratios of the simulated rows by the Offline capacity ratio of their system.

    `offline`: rows with the `SYSTEM_KEY` columns, the measured Offline result `tput` and
    the model's `after` (`mlperf_check.json`'s `offline`); a system's ratio is the median
    over its rows. Returns the bins (`CAPACITY_EDGES`; each with its row count and the
    median predicted / measured p99 TTFT and TPOT), the rows matched, and the Spearman
    correlation of the capacity ratio with each p99 ratio.

    Example:
        >>> off = [dict(zip(SYSTEM_KEY, "abcdefg"), tput=100.0, after=150.0)]
        >>> row = dict(zip(SYSTEM_KEY, "abcdefg"), ttft99=2.0, pred_ttft99=1.0,
        ...            tpot99=0.2, pred_tpot99=0.1)
        >>> out = capacity_bins([row], off)
        >>> out["matched"], out["bins"][-1]["n"], out["bins"][-1]["ratio_ttft99"]
        (1, 1, 0.5)
    """
    ratios = {}
    for r in offline:
        predicted = r.get("after")
        if r.get("tput") and predicted is not None and np.isfinite(predicted):
            ratios.setdefault(tuple(r[k] for k in SYSTEM_KEY), []).append(predicted / r["tput"])
    capacity = {key: float(np.median(v)) for key, v in ratios.items()}
    matched = [(capacity[key], r) for r in results
               if (key := tuple(r[k] for k in SYSTEM_KEY)) in capacity]
    edges = (0.0, *CAPACITY_EDGES, np.inf)
    bins = []
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        rows = [r for c, r in matched if low < c <= high]
        bins.append({"capacity_low": low, "capacity_high": high, "n": len(rows),
                     **{f"ratio_{k}": float(np.median([r[f"pred_{k}"] / r[k] for r in rows]))
                        if rows else float("nan") for k in ("ttft99", "tpot99")}})
    c = [c for c, _ in matched]
    return {"bins": bins, "matched": len(matched),
            **{f"spearman_{k}": spearman(c, [r[f"pred_{k}"] / r[k] for _, r in matched])
               for k in ("ttft99", "tpot99")}}


def offline_rows_of_check(path=HERE / "mlperf_check.json") -> list[dict] | None:
    """`mlperf_check.json`'s Offline rows, or None where that file is missing."""
    path = pathlib.Path(path)
    return json.loads(path.read_text())["offline"] if path.exists() else None


def run_mlperf(limit: int | None = None, models=(), progress=print) -> dict:
    rows, skipped = mlperf_rows()
    if models:
        rows = [r for r in rows if r["model"] in models]
    if limit is not None:
        rows = rows[:limit]
    cache, results = {}, []
    start = time.time()
    for i, row in enumerate(rows):
        key = dedupe_key(row)
        if key not in cache:
            cache[key] = predict_row(row)
            p = cache[key]
            progress(f"[{i + 1}/{len(rows)} {time.time() - start:.0f}s] {row['model']} "
                     f"{row['chip']} x{row['accelerators']} {row['scenario']} qps "
                     f"{row['qps']}: tp{p['tp']} seqs {p['seqs']} TTFT p99 "
                     f"{p['ttft99']:.3f}/{row['ttft99']:.3f} s TPOT p99 "
                     f"{p['tpot99'] * 1e3:.1f}/{row['tpot99'] * 1e3:.1f} ms")
        results.append({**row, **{f"pred_{k}": v for k, v in cache[key].items()}})
    groups = {}
    for r in results:
        groups.setdefault((r["model"], r["chip"], r["scenario"]), []).append(r)
    summary = {"all": medians(results),
               "by_scenario": {s: medians([r for r in results if r["scenario"] == s])
                               for s in ("Server", "Interactive")},
               "by_model": {m: medians([r for r in results if r["model"] == m])
                            for m in dict.fromkeys(r["model"] for r in results)},
               "by_group": [{"model": m, "chip": c, "scenario": s, **medians(rs)}
                            for (m, c, s), rs in sorted(groups.items())]}
    offline = offline_rows_of_check()
    if offline is not None:
        summary["by_offline_capacity"] = capacity_bins(results, offline)
    return {"summary": summary, "rows": results, "skipped": skipped,
            "unique_simulated": len(cache), "wall_s": time.time() - start}


# ---------------------------------------------------------------------------------------
# TensorRT-LLM online QPS sweep.

SWEEP_MODELS = {"LLaMA 3.1 70B": "llama-3.1-70b", "LLaMA 3.1 8B": "llama-3.1-8b"}
SWEEP_CHIPS = {"H100 80GB HBM3": "h100", "H200 131GB HBM3": "h200"}
#: The engine limits of a table that states none: trtllm-build's `BuildConfig` defaults as
#: recalled (max_batch_size 2048, max_num_tokens 8192; UNVERIFIED against the v0.14 source).
#: The batch cap never binds at the table's 500 requests; the token budget does.
SWEEP_SEQS, SWEEP_BUDGET = 2048.0, 8192.0


def sweep_rows() -> list[dict]:
    out = []
    with open(DATA / "benchmarks_trtllm.csv", newline="") as handle:
        for raw in csv.DictReader(handle):
            if raw["table"] != "online_serving" or raw["metric"] != "total_tok_s":
                continue
            if raw["model"] not in SWEEP_MODELS or raw["hardware"] not in SWEEP_CHIPS:
                continue
            qps = raw["concurrency_or_qps"].split("=")[1]
            out.append(dict(model=SWEEP_MODELS[raw["model"]],
                            chip=SWEEP_CHIPS[raw["hardware"]], tp=int(raw["tp"]),
                            precision=raw["precision"].lower(), isl=float(raw["isl"]),
                            osl=float(raw["osl"]),
                            qps=float("inf") if qps == "INF" else float(qps),
                            ttft=float(raw["mean_ttft_ms"]) / 1e3,
                            itl=float(raw["mean_itl_ms"]) / 1e3,
                            output_tok_s=float(raw["output_tok_s"])))
    return out


def predict_sweep_row(row: dict, num: int = 500) -> dict:
    """500 requests (the table's count) at the row's QPS (all at time 0 for INF), fixed
    lengths, BF16, TensorRT-LLM's runtime terms."""
    model, chip = get_model(row["model"]), get_chip(row["chip"])
    prec = precision(chip, model, row["precision"])
    design = Design(concurrency=1.0, layout=Layout(tp=row["tp"]), precision=prec,
                    runtime=fitted.runtime_for("trt"))
    rng = np.random.default_rng(0)
    if np.isinf(row["qps"]):
        arrival = np.zeros(num)
    else:
        arrival = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / row["qps"], num - 1))])
    requests = sim.trace(arrival, np.full(num, row["isl"]), np.full(num, row["osl"]))
    policy = policy_for("trt", SWEEP_SEQS, SWEEP_BUDGET, float(row["isl"]))
    result = sim.simulate_jit(model, chip, design, policy, requests, max_steps=MAX_STEPS)
    s = sim.summarize(result)
    done = np.asarray(result.finished)
    return {"pred_ttft": float(np.mean(np.asarray(result.ttft)[done])),
            "pred_itl": float(np.nanmean(np.asarray(result.tpot)[done])),
            "pred_output_tok_s": float(np.sum(np.asarray(result.output_len)[done])
                                       / float(s.duration)),
            "unfinished": int(s.unfinished)}


def run_sweep(progress=print) -> dict:
    rows = sweep_rows()
    results = []
    for i, row in enumerate(rows):
        p = predict_sweep_row(row)
        results.append({**row, **p})
        progress(f"[sweep {i + 1}/{len(rows)}] {row['model']} {row['chip']} tp{row['tp']} "
                 f"{row['isl']:.0f}/{row['osl']:.0f} qps {row['qps']}: TTFT "
                 f"{p['pred_ttft'] * 1e3:.0f}/{row['ttft'] * 1e3:.0f} ms ITL "
                 f"{p['pred_itl'] * 1e3:.1f}/{row['itl'] * 1e3:.1f} ms")
    err = {k: [r[f"pred_{k}"] / r[k] - 1.0 for r in results] for k in
           ("ttft", "itl", "output_tok_s")}
    finite = [r for r in results if np.isfinite(r["qps"])]
    err_finite = {k: [r[f"pred_{k}"] / r[k] - 1.0 for r in finite] for k in ("ttft", "itl")}
    return {"rows": results, "n": len(results),
            "median_abs_error": {k: float(np.median(np.abs(v))) for k, v in err.items()},
            "median_abs_error_finite_qps": {k: float(np.median(np.abs(v)))
                                            for k, v in err_finite.items()}}


# ---------------------------------------------------------------------------------------
# Report.


def plot(results: list[dict], path: pathlib.Path) -> None:
    from matplotlib.figure import Figure

    from perfmodel.plots import save

    figure = Figure(figsize=(11, 9), layout="constrained")
    axes = figure.subplots(2, 2)
    models = sorted({r["model"] for r in results})
    colors = dict(zip(models, ("C0", "C1", "C2", "C3", "C4", "C5", "C6"), strict=False))
    markers = {"Server": "o", "Interactive": "^"}
    for ax, key, label in zip(axes.ravel(), METRICS, ("p50 TTFT (s)", "p99 TTFT (s)",
                                                       "p50 TPOT (s)", "p99 TPOT (s)"),
                              strict=True):
        measured = np.array([r[key] for r in results])
        # Saturated rows (an infinite p99) are drawn at the top edge.
        predicted = np.minimum([r[f"pred_{key}"] for r in results], 30.0 * measured.max())
        for model in models:
            for scenario, marker in markers.items():
                pick = [i for i, r in enumerate(results)
                        if r["model"] == model and r["scenario"] == scenario]
                if pick:
                    ax.scatter(measured[pick], predicted[pick], s=14, marker=marker,
                               color=colors[model], alpha=0.7,
                               label=f"{model} {scenario}")
        low = 0.5 * min(measured.min(), predicted.min())
        high = 2.0 * max(measured.max(), predicted.max())
        ax.plot([low, high], [low, high], "k-", lw=0.8)
        for k in (0.8, 1.25):
            ax.plot([low, high], [k * low, k * high], "k:", lw=0.6)
        ax.set(xscale="log", yscale="log", xlabel=f"measured {label}",
               ylabel=f"simulated {label}", xlim=(low, high), ylim=(low, high))
        err = np.median(np.abs(np.array([r[f"pred_{key}"] for r in results]) / measured
                               - 1.0)) * 100
        ax.set_title(f"{label}: median error {err:.0f} %")
    axes[0, 0].legend(fontsize=6, loc="upper left")
    figure.suptitle("MLPerf Server/Interactive, simulated at the target QPS (perfmodel.simulate)")
    save(figure, str(path))


def table(summary: dict) -> str:
    lines = ["| model | chip | scenario | rows | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]

    def cells(m):
        return " | ".join(f"{100 * m[k]:.0f} %" for k in METRICS)

    for g in summary["by_group"]:
        lines.append(f"| {g['model']} | {g['chip']} | {g['scenario']} | {g['n']} | "
                     f"{cells(g)} |")
    for s, m in summary["by_scenario"].items():
        lines.append(f"| **{s}** | | | {m['n']} | {cells(m)} |")
    for name, m in summary["by_model"].items():
        lines.append(f"| **{name}** (median ratio p99 TTFT {m['ratio_ttft99']:.2f}, p99 TPOT "
                     f"{m['ratio_tpot99']:.2f}) | | | {m['n']} | {cells(m)} |")
    lines.append(f"| **all** | | | {summary['all']['n']} | {cells(summary['all'])} |")
    return "\n".join(lines)


def capacity_table(diagnostic: dict) -> str:
    """`capacity_bins`' output as a markdown table."""
    lines = ["| Offline capacity, predicted / measured | rows | TTFT p99 ratio | TPOT p99 ratio |",
             "| --- | ---: | ---: | ---: |"]
    for b in diagnostic["bins"]:
        low, high = b["capacity_low"], b["capacity_high"]
        span = f"<= {high:g}" if low == 0 else (f"> {low:g}" if np.isinf(high)
                                                  else f"{low:g}-{high:g}")
        lines.append(f"| {span} | {b['n']} | {b['ratio_ttft99']:.2f} | "
                     f"{b['ratio_tpot99']:.2f} |")
    lines.append(f"| Spearman with the capacity ratio | {diagnostic['matched']} | "
                 f"{diagnostic['spearman_ttft99']:.2f} | {diagnostic['spearman_tpot99']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(HERE / "mlperf_serving.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "mlperf_serving.png"))
    parser.add_argument("--limit", type=int, help="only the first N rows (a quick look)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the TRT-LLM sweep")
    parser.add_argument("--models", nargs="*", default=(), help="only these model presets")
    parser.add_argument("--input", action="append", default=[], metavar="MODEL=TOKENS",
                        help="override a model's mean input (a sensitivity run)")
    parser.add_argument("--assumed-inputs", action="store_true",
                        help="the earlier ASSUMED input means (mlperf_check.ASSUMED_INPUT)")
    parser.add_argument("--trt-scheduler", choices=("trtllm", "vllm"), default="trtllm",
                        help="scheduler of TensorRT rows (default: TensorRT-LLM's own)")
    args = parser.parse_args(argv)
    TRT_SCHEDULER["name"] = args.trt_scheduler
    if args.assumed_inputs:
        INPUT.update(ASSUMED_INPUT)
    for item in args.input:
        name, _, tokens = item.partition("=")
        if name not in INPUT:
            parser.error(f"--input: unknown model {name!r}; known: {', '.join(INPUT)}")
        INPUT[name] = float(tokens)
    out = run_mlperf(args.limit, args.models)
    out["input_means"] = dict(INPUT)
    out["trt_scheduler"] = TRT_SCHEDULER["name"]
    if not args.no_sweep:
        out["trtllm_sweep"] = run_sweep()
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=float) + "\n")
    plot(out["rows"], pathlib.Path(args.plot))
    print(table(out["summary"]))
    if "by_offline_capacity" in out["summary"]:
        print(capacity_table(out["summary"]["by_offline_capacity"]))
    if "trtllm_sweep" in out:
        print("TRT-LLM online sweep, median |error|:", out["trtllm_sweep"]["median_abs_error"],
              "finite QPS:", out["trtllm_sweep"]["median_abs_error_finite_qps"])
    print(f"{out['unique_simulated']} unique rows simulated in {out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
