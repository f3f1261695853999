"""MLPerf Inference LLM rows: each scenario predicted as MLPerf defines it.

A row of `benchmarks_mlperf.csv` names a benchmark (its data set), a system (accelerator,
count, nodes), the submitter's software and weight format, and a scenario:

- **Offline**: the best sustainable throughput, over the run LoadGen times. Every serving
  configuration a submitter could choose is evaluated (`configurations`: the parallel
  layouts of `sweep.candidate_layouts` - tensor, expert and pipeline parallelism, DP
  attention - times the speculative decoding the round's rules allow, over a concurrency
  grid up to the batch that fits in memory); each one's highest steady output tokens/s
  per accelerator is scaled by `run_efficiency` (the run ends when its longest request
  does: heavy-tailed outputs leave one request decoding alone at the end), and the best
  is the prediction.
- **Server / Interactive**: the highest Poisson rate whose p99 TTFT and p99 TPOT meet the
  row's limits, over the same configurations. Steady-state approximation (flagged in
  `pred_basis`): a closed-loop point of concurrency c serves rate c / E2E(c), which is the
  open-loop fixed point of that rate (Little's law, `serving` open-loop definition), so the
  capacity is the largest such rate whose p99 latencies meet the limits (interpolated
  between grid points). It has no Poisson queueing beyond the batch that fits, so at high
  utilisation p99 TTFT is optimistic. The serving simulator (`perfmodel.simulate`) is too
  slow for a rate search per row on CPU. The row's `target_qps` is read only for the
  latencies reported at it, never for the capacity.

Nothing here reads a measured column. Lengths are the data sets' mean input and output
tokens (`data/mlperf_lengths.csv`, each with its source; fixed at the mean, so p99 TTFT
does not see the longest prompts). The engine is TensorRT-LLM's fitted runtime for
TensorRT software, SGLang's for SGLang, else vLLM's. Rows that log FP16 weights for
TensorRT on an FP8 chip run FP8 (NVIDIA's MLPerf recipes quantize; UNVERIFIED per
submitter); the KV cache is FP8 where the chip computes FP8.

Example:
    >>> row = {"model": "llama3.1-8b", "scenario": "Offline", "accelerator": "NVIDIA H100",
    ...        "total_accelerators": "1", "accel_per_node": "1", "weight_data_types": "fp8",
    ...        "software": "vLLM 0.10.0", "mlperf_version": "v5.1"}
    >>> spec = interpret(row)
    >>> spec.model, spec.chip, spec.framework, spec.input_len
    ('llama-3.1-8b', 'h100', 'vllm', 870.73)
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import re
import statistics
from importlib import resources

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import fitted
from .design import Design, LayoutNumbers, SliceMapping, SpecDecode, precision
from .presets import chip_key, get_chip, get_model
from .serving import predict
from .sweep import batch_that_fits, candidate_layouts
from .workload import Workload

LENGTHS_FILE = "mlperf_lengths.csv"
#: Scenarios and what their prediction is.
SCENARIOS = ("Offline", "Server", "Interactive")
#: Per-replica concurrencies tried (requests): four points per octave from 1 to 16,384,
#: plus the batch that fits.
GRID = tuple(2.0 ** (k / 4.0) for k in range(57))
#: Weight types of the results tables -> format names of `design.precision`.
WEIGHTS = {"fp16": "bf16", "bf16": "bf16", "fp8": "fp8", "fp4": "fp4", "mxfp4": "mxfp4",
           "nvfp4": "nvfp4", "int8": "int8", "int4": "int4"}
#: Accelerator descriptions that are not the preset chip (other memory, power or form
#: factor, virtualised, mixed systems).
VARIANT = re.compile(r"NVL-|PCIe|\(x|Virtualized|GH200|-CTS", re.I)
#: Speculative decoding a round's rules allow: (benchmark, scenario) -> first version.
#: MLPerf v6.0 introduced it for DeepSeek-R1 Interactive (the MTP head, EAGLE-style;
#: mlcommons.org/2026/03/mlperf-inference-gpt-oss); the earlier rounds' closed division
#: has none.
SPECULATIVE_RULES = {("deepseek-r1", "Interactive"): (6, 0)}
#: Draft lengths tried where allowed, and the per-token acceptance assumed: DeepSeek-V3
#: reports 85-90 % acceptance of its MTP module's token (arXiv 2412.19437, sec. 5.4.3),
#: taken as i.i.d. per draft token (ASSUMED beyond the first).
DRAFT_TOKENS = (1.0, 2.0, 3.0)
MTP_ACCEPTANCE = 0.85
#: Output columns (`predict_rows`).
COLUMNS = ("pred_result_per_accelerator", "pred_p50_ttft_ms", "pred_p99_ttft_ms",
           "pred_p50_tpot_ms", "pred_p99_tpot_ms", "pred_config", "pred_target_saturated",
           "pred_run_efficiency", "pred_basis", "pred_error")


@functools.cache
def dataset_lengths() -> dict[str, dict]:
    """{benchmark: row of `data/mlperf_lengths.csv`} (mean input/output tokens, bases,
    sources). A blank `input_tokens_mean` means no statistic was found."""
    path = resources.files("perfmodel").joinpath("data", LENGTHS_FILE)
    with path.open(newline="") as handle:
        return {row["benchmark"]: row for row in csv.DictReader(handle)}


def benchmark_of(name: str) -> str:
    """The data set a results-table model name runs: "llama2-70b-99.9" -> "llama2-70b".

    Raises:
        ValueError: a benchmark without a `data/mlperf_lengths.csv` row.
    """
    text = name.strip().lower()
    text = re.sub(r"-(99(\.9)?|interactive|edge)$", "", text)
    text = re.sub(r"-(99(\.9)?|interactive|edge)$", "", text)
    if text not in dataset_lengths():
        raise ValueError(f"MLPerf benchmark {name!r} has no data-set lengths; known: "
                         f"{', '.join(dataset_lengths())}")
    return text


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """What a results row asks for, in the model's terms.

    Attributes:
        benchmark: data set key of `data/mlperf_lengths.csv`.
        model, chip: preset keys.
        scenario: "Offline", "Server" or "Interactive".
        weights: weight format name (`design.precision`).
        framework: fitted runtime name ("trt", "vllm", "sglang").
        accelerators: accelerators of the system (count).
        domain: chips the layout search may span (count): the system, up to the scale-up
            domain.
        input_len, output_len: mean tokens per sample.
        output_cv2: squared coefficient of variation of the outputs (`Workload.output_cv2`;
            dimensionless), 0 where the data set's spread is not known.
        ttft_limit, tpot_limit: the scenario's p99 limits (s); inf for Offline.
        speculative: whether the round's rules allow speculative decoding.
        notes: assumptions this row added (for `pred_basis`).
        power_limit: the accelerators' power limit (W) where the submitter set one below
            the preset's TDP (a MaxQ system); None runs the preset's TDP.
        output_max: the data set's output cap (tokens; `output_tokens_max`).
        min_samples: the Offline run's least sample count (LoadGen's `min_query_count`).
    """

    benchmark: str
    model: str
    chip: str
    scenario: str
    weights: str
    framework: str
    accelerators: int
    domain: int
    input_len: float
    output_len: float
    ttft_limit: float
    tpot_limit: float
    speculative: bool
    notes: tuple[str, ...] = ()
    power_limit: float | None = None
    output_cv2: float = 0.0
    output_max: float = math.inf
    min_samples: int = 1

    def structure(self) -> tuple:
        """Rows with equal structure share one evaluation of every configuration."""
        return (self.model, self.chip, self.weights, self.framework, self.domain,
                self.input_len, self.output_len, self.speculative, self.power_limit,
                self.output_cv2)


def _version(text: str) -> tuple[int, int]:
    found = re.findall(r"\d+", text or "")
    return (int(found[0]), int(found[1]) if len(found) > 1 else 0) if found else (0, 0)


def _number(raw: dict, key: str) -> float:
    try:
        value = float(raw.get(key) or "nan")
    except ValueError:
        value = math.nan
    return value


def interpret(raw: dict) -> RowSpec:
    """The `RowSpec` of a results row (columns of `benchmarks_mlperf.csv`; measured columns
    are not read).

    Raises:
        ValueError: a row the model cannot predict, saying why (unknown benchmark, model or
            accelerator, a variant of a preset chip, an unknown weight type, no input-length
            statistic for the data set, no latency limits for a Server row).
    """
    scenario = (raw.get("scenario") or "").strip()
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario {scenario!r} is not one of {', '.join(SCENARIOS)}")
    benchmark = benchmark_of(raw.get("model") or "")
    lengths = dataset_lengths()[benchmark]
    if not lengths["input_tokens_mean"]:
        raise ValueError(f"no input-length statistic for the {benchmark} data set "
                         f"({lengths['input_basis']})")
    accelerator = raw.get("accelerator") or ""
    chip = chip_key(accelerator, label=True)
    if VARIANT.search(accelerator):
        raise ValueError(f"accelerator {accelerator!r} is a variant of the {chip} preset "
                         "(other memory, power or form factor, or a mixed system)")
    weight_type = (raw.get("weight_data_types") or "").strip().lower()
    if weight_type not in WEIGHTS:
        raise ValueError(f"weight type {raw.get('weight_data_types')!r} is not one of "
                         f"{', '.join(WEIGHTS)}")
    weights, notes = WEIGHTS[weight_type], []
    software = (raw.get("software") or "").lower()
    framework = ("trt" if "tensorrt" in software else "sglang" if "sglang" in software
                 else "vllm")
    if framework != "trt" and "vllm" not in software and "sglang" not in software:
        notes.append("engine not vLLM/SGLang/TensorRT: vLLM's fitted runtime")
    model = get_model(lengths["model"])
    chip_spec = get_chip(chip)
    if framework == "trt" and weights == "bf16" and "fp8" in chip_spec.native_classes:
        weights = "fp8"
        notes.append("FP16 logged for TensorRT: FP8 weights (TensorRT-LLM MLPerf recipes; "
                     "UNVERIFIED)")
    accelerators = int(_number(raw, "total_accelerators"))
    if accelerators < 1:
        raise ValueError(f"total_accelerators {raw.get('total_accelerators')!r} is not a "
                         "positive count")
    per_node = max(int(_number(raw, "accel_per_node") or 1), 1)
    # NVLink racks (GB200/GB300 NVL72) span nodes; elsewhere the scale-up domain is a node.
    span = accelerators if chip_spec.domain_size > per_node else per_node
    domain = max(min(span, accelerators, int(chip_spec.domain_size)), 1)
    ttft, tpot = math.inf, math.inf
    if scenario != "Offline":
        ttft, tpot = (_number(raw, "ttft_constraint_ms") / 1e3,
                      _number(raw, "tpot_constraint_ms") / 1e3)
        if not (math.isfinite(ttft) and math.isfinite(tpot)):
            raise ValueError(f"{scenario} row without ttft_constraint_ms/tpot_constraint_ms")
    first = SPECULATIVE_RULES.get((benchmark, scenario))
    speculative = (first is not None and _version(raw.get("mlperf_version", "")) >= first
                   and model.mtp_layers > 0)
    return RowSpec(benchmark=benchmark, model=model.name, chip=chip, scenario=scenario,
                   weights=weights, framework=framework, accelerators=accelerators,
                   domain=domain, input_len=float(lengths["input_tokens_mean"]),
                   output_len=float(lengths["output_tokens_mean"]), ttft_limit=ttft,
                   tpot_limit=tpot, speculative=speculative, notes=tuple(notes),
                   output_cv2=float(lengths.get("output_cv2") or 0.0),
                   output_max=float(lengths.get("output_tokens_max") or math.inf),
                   min_samples=int(lengths.get("min_query_count") or 1))


@dataclasses.dataclass(frozen=True)
class Configurations:
    """Every configuration of a structure over the concurrency grid.

    Attributes:
        labels: one description per configuration ("tp4-ep4-dpa", "tp8+mtp2").
        chips: chips of one instance of each configuration (count).
        concurrency: per-instance concurrency of each point (requests), [configs, grid].
        values: per-point arrays [configs, grid]: `output_tput_per_chip` (tokens/s),
            `rate` (requests/s per instance), `ttft`, `p99_ttft`, `tpot`, `p99_tpot` (s);
            NaN where the point does not fit in memory.
    """

    labels: tuple[str, ...]
    chips: np.ndarray
    concurrency: np.ndarray
    values: dict


def fixed_lengths(input_len: float, output_len: float, output_cv2: float = 0.0) -> Workload:
    """Every request `input_len` / `output_len` tokens (a data set's means, or a synthetic
    data set's only lengths), the running batch's context length-biased by `output_cv2`
    where the data set's outputs spread (`Workload.output_cv2`); Poisson and Offline loads
    have no opening burst."""
    return Workload(input_len, output_len, input_range_ratio=1.0, output_range_ratio=1.0,
                    first_wave_fraction=1e-6, output_cv2=output_cv2)


#: Layouts of one structure evaluated together are padded to a multiple of this many.
LAYOUT_ROWS = 16


def batch_grid(fit: float) -> np.ndarray:
    """Per-instance concurrencies to evaluate: `GRID` up to the batch that fits, which is
    always the last point (at least 1)."""
    top = max(math.floor(fit), 1.0)
    grid = np.minimum(np.asarray(GRID), top)
    grid[-1] = top
    return grid


def over_concurrency(model, chip, workload, design, concurrency):
    """`serving.predict` (hard roofline, no input checks, unfit points as values) of
    `design` at each per-instance concurrency of the 1-D array `concurrency`: the
    `Metrics`, each field broadcast against `concurrency` (a field that does not depend on
    it may stay a scalar). The array goes through the formulas as it is (elementwise, the
    numbers of one call per concurrency): evaluated eagerly, a `vmap` would cost several
    dispatches per operation."""
    d = eqx.tree_at(lambda x: x.concurrency, design, jnp.asarray(concurrency, dtype=float))
    return predict(model, chip, workload, d, hard=True, check=False, unfit="value")


def configurations(spec: RowSpec) -> Configurations:
    """Evaluate every configuration a submitter could run for `spec`'s structure (cached
    per `RowSpec.structure`).

    Layouts: `sweep.candidate_layouts` of `spec.domain` chips (tp in powers of two up to
    the domain, ep in {1, tp} and DP attention for MoE models, the smallest pipeline that
    holds the weights); speculative decoding off, and with `DRAFT_TOKENS` where
    `spec.speculative`. Each over `GRID` per instance, capped at the batch that fits.

    Raises:
        ValueError: no layout of `spec.domain` chips holds the model.
    """
    return _configurations(spec.structure())


@functools.lru_cache(maxsize=64)
def _configurations(structure: tuple) -> Configurations:
    (name, chip_name, weights, framework, domain, input_len, output_len, speculative,
     power_limit, output_cv2) = structure
    spec = RowSpec(benchmark="", model=name, chip=chip_name, scenario="Offline",
                   weights=weights, framework=framework, accelerators=domain, domain=domain,
                   input_len=input_len, output_len=output_len, ttft_limit=math.inf,
                   tpot_limit=math.inf, speculative=speculative, output_cv2=output_cv2)
    model, chip = get_model(spec.model), get_chip(spec.chip)
    if power_limit is not None:
        chip = eqx.tree_at(lambda c: c.tdp, chip, jnp.asarray(float(power_limit)))
    kv = "fp8" if "fp8" in chip.native_classes else None
    prec = precision(chip, model, spec.weights, kv=kv)
    # The capacity policy is the submitter's choice too: MLPerf's outputs vary in length,
    # where TensorRT-LLM's default (GUARANTEED_NO_EVICT) would reserve every request's
    # longest output, so a throughput run packs the batch by what requests hold
    # (MAX_UTILIZATION, TensorRT-LLM's "Useful Runtime Options"; vLLM and SGLang do so).
    runtime = fitted.runtime_for(spec.framework, reserve_output=0.0)
    workload = fixed_lengths(spec.input_len, spec.output_len, spec.output_cv2)
    specs = [SpecDecode()] + ([SpecDecode(draft_tokens=k, acceptance=MTP_ACCEPTANCE)
                               for k in DRAFT_TOKENS] if spec.speculative else [])
    layouts = candidate_layouts(model, chip, spec.domain, workload, prec, runtime)
    singles = [dataclasses.replace(layout, replicas=1) for layout in layouts]
    fit = np.asarray([batch_that_fits(model, chip, prec, runtime, layout,
                                      float(runtime.kv_context(workload)))
                      for layout in layouts])
    grids = np.stack([batch_grid(f) for f in fit]) if layouts else np.zeros((0, len(GRID)))
    # Every layout at once: the layouts as numbers, one per row of `grids` (eagerly, one
    # evaluation per speculative setting instead of one per layout; the same numbers),
    # padded with copies of the last to a multiple of `LAYOUT_ROWS` rows (each eager
    # operation compiles once per shape).
    pad = [len(layouts) - 1] * (-len(layouts) % LAYOUT_ROWS)
    rows = list(range(len(layouts))) + pad
    numbers = jax.tree_util.tree_map(lambda v: v[:, None],
                                     LayoutNumbers.stack([singles[i] for i in rows]))
    results = {}
    for j, sd in enumerate(specs if layouts else ()):
        design = Design(concurrency=1.0, layout=numbers, precision=prec, runtime=runtime,
                        mapping=SliceMapping(), speculative=sd)
        m = over_concurrency(model, chip, workload, design, grids[rows])
        m = jax.tree_util.tree_map(lambda v: np.asarray(v)[:len(layouts)]
                                   if np.ndim(v) else np.asarray(v), m)
        out = np.broadcast_to(np.asarray(m.output_throughput_per_chip), grids.shape)
        values = {"output_tput_per_chip": out,
                  "rate": out * np.asarray([x.chips for x in singles])[:, None]
                  / spec.output_len,
                  "ttft": np.asarray(m.ttft), "p99_ttft": np.asarray(m.p99_ttft),
                  "tpot": np.asarray(m.tpot), "p99_tpot": np.asarray(m.p99_tpot)}
        fits = np.asarray(m.fits) & (grids <= fit[:, None] * (1.0 + 1e-9))
        results[j] = {k: np.where(fits, np.broadcast_to(v, grids.shape), np.nan)
                      for k, v in values.items()}
    labels, chips, conc, parts = [], [], [], []
    for i, (layout, single) in enumerate(zip(layouts, singles, strict=True)):
        for j, sd in enumerate(specs):
            parts.append({k: v[i] for k, v in results[j].items()})
            draft = float(sd.draft_tokens)
            labels.append(layout.describe() + (f"+mtp{draft:g}" if draft else ""))
            chips.append(single.chips)
            conc.append(grids[i])
    if not parts:
        raise ValueError(f"{spec.model} ({spec.weights}) does not fit in {spec.domain} "
                         f"{spec.chip} chip(s) at {spec.input_len:g} input tokens")
    return Configurations(labels=tuple(labels), chips=np.asarray(chips),
                          concurrency=np.stack(conc),
                          values={k: np.stack([p[k] for p in parts]) for k in parts[0]})


def _crossing(ok: np.ndarray, slack: np.ndarray) -> tuple[int, float]:
    """(k, a): the last feasible grid point k of a row of points and the fraction a of the
    way to the next one where the constraint slack crosses zero (0 when it does not)."""
    feasible = np.flatnonzero(ok)
    if not len(feasible):
        return -1, 0.0
    k = int(feasible[-1])
    if k + 1 < len(slack) and np.isfinite(slack[k + 1]) and slack[k + 1] < 0 <= slack[k]:
        return k, float(slack[k] / (slack[k] - slack[k + 1]))
    return k, 0.0


def _at(x: np.ndarray, k: int, a: float) -> float:
    return float(x[k] + a * (x[k + 1] - x[k])) if a > 0 else float(x[k])


#: LoadGen's Offline sample count: `kSlack` x `min_duration` x `offline_expected_qps`, at
#: least `min_query_count` (mlcommons/inference loadgen/test_settings_internal.cc, kSlack
#: 1.1; loadgen/mlperf.conf, *.Offline.min_duration = 600000 ms).
OFFLINE_SLACK, OFFLINE_MIN_DURATION = 1.1, 600.0


@functools.lru_cache(maxsize=32)
def censored_lognormal(mean: float, cv2: float, cap: float, points: int = 4096) -> np.ndarray:
    """`points` equally likely lengths (tokens) of a lognormal censored at `cap` whose
    mean and Var/mean^2 are `mean` and `cv2` (bisection on the log-scale sigma, the
    location set for the mean at each; `cv2` beyond what the cap allows takes the
    largest)."""
    normal = statistics.NormalDist()
    z = np.asarray([normal.inv_cdf((k + 0.5) / points) for k in range(points)])

    def draw(sigma):
        lo, hi = math.log(mean) - 8.0 * sigma - 10.0, math.log(mean) + 1.0
        for _ in range(80):   # the censored mean rises with the location
            mu = 0.5 * (lo + hi)
            lo, hi = (mu, hi) if np.minimum(np.exp(mu + sigma * z), cap).mean() < mean \
                else (lo, mu)
        return np.minimum(np.exp(0.5 * (lo + hi) + sigma * z), cap)

    lo, hi = 1e-6, 4.0
    for _ in range(60):
        sigma = 0.5 * (lo + hi)
        x = draw(sigma)
        lo, hi = (sigma, hi) if x.var() / x.mean() ** 2 < cv2 else (lo, sigma)
    return draw(0.5 * (lo + hi))


def residual_tail(output_len: float, output_cv2: float, output_max: float,
                  running: float) -> tuple[float, float]:
    """(mean, longest) output tokens still to come of the `running` requests in flight when
    an Offline run's queue empties (tokens).

    A request stays in the batch for as long as it decodes, so the batch holds lengths
    length-biased and each part-way through: the remainder has the survival function
    P(R > s) = E[(L - s)+] / E[L], mean E[L^2] / (2 E[L]) = (1 + cv2) E[L] / 2 (renewal
    theory). The longest of `running` is where running x P(R > s) = 1. Outputs: a
    lognormal of the data set's mean and Var/mean^2 `output_cv2`, censored at
    `output_max` (ASSUMED shape; DeepSeek-R1's reported median 2,108 and p99 at the
    20,000 cap fit it, `data/mlperf_lengths.csv`); at `output_cv2` 0 every output is the
    mean.
    """
    if output_cv2 <= 0:
        return 0.5 * output_len, output_len * max(1.0 - 1.0 / max(running, 1.0), 0.5)
    mean, s, survival = _remainders(output_len, output_cv2, output_max)
    return mean, float(np.interp(-1.0 / max(running, 1.0), -survival, s))


@functools.lru_cache(maxsize=32)
def _remainders(output_len: float, output_cv2: float, output_max: float):
    """(mean remainder, remainders s, P(R > s)) of a request in flight, for the output
    distribution of `censored_lognormal` (once per data set: every configuration of its
    rows reads the same curve)."""
    lengths = censored_lognormal(output_len, output_cv2, output_max)
    mean, second = lengths.mean(), (lengths**2).mean()
    s = np.linspace(0.0, lengths.max(), 2049)
    survival = np.maximum(lengths[None, :] - s[:, None], 0.0).mean(axis=1) / mean
    return float(second / (2.0 * mean)), s, survival


def run_efficiency(spec: RowSpec, rate: float, running: float, tail_tpot: float) -> float:
    """Steady-state share of an Offline run's time: LoadGen's result is the samples over
    the whole run, which ends when the last request does, not at the steady rate.

    The run issues N = max(`min_samples`, 1.1 x 600 s x expected rate) samples at once
    (LoadGen; the expected rate the submitter sets is taken as the model's steady `rate`,
    requests/s), so its steady part lasts T = N / rate. When the queue empties, the
    `running` requests in flight finish at a falling batch: with a step time linear in the
    batch, t(B) = t0 + b B, draining them takes the tokens they hold at the steady rate
    plus t0 for every step the longest has left beyond the mean remainder, so the run
    lasts T + t0 (longest - mean) (`residual_tail`), t0 taken as the time per output token
    at one request per instance (`tail_tpot`, s). Heavy-tailed outputs make it count:
    DeepSeek-R1's (p99 at the 20,000-token cap) leave some 15,000 tokens of one request
    after the rest have finished; Llama-2-70B's bounded ones a few hundred.
    """
    if not (rate > 0 and np.isfinite(tail_tpot)):
        return 1.0
    steady = max(spec.min_samples / rate, OFFLINE_SLACK * OFFLINE_MIN_DURATION)
    mean, longest = residual_tail(spec.output_len, spec.output_cv2, spec.output_max,
                                  running)
    return steady / (steady + tail_tpot * max(longest - mean, 0.0))


def capacity(spec: RowSpec) -> dict:
    """The scenario's capacity: Offline, the best output tokens/s per accelerator over the
    whole run LoadGen times (the steady rate x `run_efficiency`); Server
    and Interactive, the output tokens/s per accelerator at the highest rate whose p99
    TTFT and TPOT meet `spec`'s limits (steady-state approximation). With the chosen
    configuration's label, its instance chips, (k, a) grid position and `run_efficiency`
    (1 for Server and Interactive, whose result is the rate, not a run's length).

    Raises:
        ValueError: no configuration fits, or none meets the limits at any load.
    """
    configs = configurations(spec)
    v = configs.values
    best = None
    for i in range(len(configs.labels)):
        out = v["output_tput_per_chip"][i]
        drain = 1.0
        if spec.scenario == "Offline":
            if not np.isfinite(out).any():
                continue
            k, a = int(np.nanargmax(out)), 0.0
            replicas = max(spec.accelerators // int(configs.chips[i]), 1)
            drain = run_efficiency(spec, replicas * v["rate"][i][k],
                                   replicas * configs.concurrency[i][k], v["tpot"][i][0])
        else:
            # Dimensionless slack of the binding limit: >= 0 meets both.
            slack = np.minimum(1.0 - v["p99_ttft"][i] / spec.ttft_limit,
                               1.0 - v["p99_tpot"][i] / spec.tpot_limit)
            slack = np.where(np.isfinite(out), slack, np.nan)
            k, a = _crossing(np.nan_to_num(slack, nan=-1.0) >= 0, slack)
            if k < 0:
                continue
        value = _at(out, k, a) * drain
        if best is None or value > best["result"]:
            best = {"result": value, "index": i, "k": k, "a": a, "run_efficiency": drain}
    if best is None:
        if spec.scenario == "Offline":
            raise ValueError("no configuration fits in memory")
        raise ValueError(f"no configuration meets p99 TTFT {spec.ttft_limit * 1e3:g} ms and "
                         f"p99 TPOT {spec.tpot_limit * 1e3:g} ms at any load")
    best["label"] = configs.labels[best["index"]]
    best["chips"] = int(configs.chips[best["index"]])
    return best


def at_rate(spec: RowSpec, index: int, qps: float) -> dict:
    """p50/p99 TTFT and TPOT (s) of configuration `index` when the system's `qps`
    (requests/s) is split evenly over its instances: the grid point whose steady rate
    equals each instance's share (interpolated); `saturated` when the share exceeds
    the configuration's largest steady rate (its figures are then those at that rate)."""
    configs = configurations(spec)
    v = {k: x[index] for k, x in configs.values.items()}
    replicas = max(spec.accelerators // int(configs.chips[index]), 1)
    share = qps / replicas
    rate = v["rate"]
    finite = np.flatnonzero(np.isfinite(rate))
    rate, keep = rate[finite], finite
    above = np.flatnonzero(rate >= share)
    saturated = not len(above)
    if saturated:
        k, a = int(np.argmax(rate)), 0.0
    else:
        j = int(above[0])
        k, a = (j - 1, float((share - rate[j - 1]) / (rate[j] - rate[j - 1]))) if j > 0 \
            else (0, 0.0)
    out = {key: _at(v[key][keep], k, a) for key in ("ttft", "p99_ttft", "tpot", "p99_tpot")}
    out["saturated"] = saturated
    return out


def predict_row(raw: dict) -> dict:
    """`COLUMNS` for one results row (floats in ms and tokens/s, or "" with `pred_error`).

    `pred_result_per_accelerator` is always a capacity (Offline's best throughput over the
    run, its steady rate x `pred_run_efficiency`; Server/Interactive's highest rate meeting
    the limits); `pred_target_saturated` says
    whether a Server/Interactive row's `target_qps` exceeds the predicted steady rate of the
    chosen configuration ("yes": its latencies are those at saturation; "" for Offline).
    """
    empty = {key: "" for key in COLUMNS}
    try:
        spec = interpret(raw)
        cap = capacity(spec)
    except ValueError as error:
        return empty | {"pred_error": str(error)}
    basis = [f"fitted runtime {spec.framework}", f"{spec.weights} weights",
             f"lengths {spec.input_len:g}/{spec.output_len:g} (data-set means, "
             "mlperf_lengths.csv)" + (f", output Var/mean^2 {spec.output_cv2:g} (length-"
                                       "biased batch context)" if spec.output_cv2 else ""),
             f"configuration searched over {spec.domain} chips: {cap['label']}"]
    if spec.scenario == "Offline":
        basis.append("Offline: best throughput over configurations and batches that fit, "
                     f"x {cap['run_efficiency']:.3f} for the run's drain (LoadGen's samples "
                     "over the whole run; outputs a censored lognormal, ASSUMED shape)")
    else:
        basis.append("steady-state approximation of Poisson capacity (no simulator; p99 "
                     "TTFT without queueing beyond the batch)")
    basis += list(spec.notes)
    out = empty | {"pred_result_per_accelerator": f"{cap['result']:.6g}",
                   "pred_config": cap["label"]}
    if spec.scenario == "Offline":
        out["pred_run_efficiency"] = f"{cap['run_efficiency']:.4g}"
    qps = _number(raw, "target_qps")
    if spec.scenario != "Offline" and math.isfinite(qps) and qps > 0:
        lat = at_rate(spec, cap["index"], qps)
        out.update({"pred_p50_ttft_ms": f"{lat['ttft'] * 1e3:.6g}",
                    "pred_p99_ttft_ms": f"{lat['p99_ttft'] * 1e3:.6g}",
                    "pred_p50_tpot_ms": f"{lat['tpot'] * 1e3:.6g}",
                    "pred_p99_tpot_ms": f"{lat['p99_tpot'] * 1e3:.6g}"})
        out["pred_target_saturated"] = "yes" if lat["saturated"] else "no"
        if lat["saturated"]:
            basis.append("target_qps above the predicted steady rate: latencies at saturation")
    out["pred_basis"] = "; ".join(basis)
    return out


def predict_rows(rows, progress=None) -> list[dict]:
    """`predict_row` of every row, in order; rows of one structure share one evaluation.
    `progress(i, n)` is called after each row when given."""
    out = []
    for i, raw in enumerate(rows):
        out.append(predict_row(raw))
        if progress is not None:
            progress(i + 1, len(rows))
    return out


def is_mlperf_table(columns) -> bool:
    """Whether a CSV header is that of `benchmarks_mlperf.csv` (the columns read here)."""
    return {"scenario", "accelerator", "total_accelerators", "weight_data_types"} <= set(
        columns)
