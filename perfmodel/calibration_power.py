"""Power calibration: idle power and energy per FLOP, per HBM byte and per link byte.

Measured GPU board power while serving (ML.ENERGY Benchmark v2/v3, InferenceX power runs;
`calibration/power/power_measurements.csv`) is reproduced by the serving model
(`perfmodel.serving.predict`) with the power model of `perfmodel.power`:

    P = P_idle + (sum_c e_c FLOP_c + e_hbm bytes_HBM + e_link bytes_link
                  + P_active t_busy) / t,

capped at TDP (t_busy: the time kernels run; host overheads are idle time). Dynamic energy
is linear in the coefficients, so one evaluation of the serving model per measured row and
coefficient gives its *energy features* x_i = d P / d e_i (W per J/unit, with the cap off);
the fit then only needs

    P = P_idle + sum_i e_i x_i / s,   s = smooth_max(1, sum_i e_i x_i / (TDP - P_idle)),

where s is the throttle of the TDP cap (the same term `power.apply_power_cap` adds to the
roofline). Coefficients are fitted in log space with a robust (Huber) loss on log power and
log J per output token by optax; one set per chip family (ampere, hopper, blackwell) pulled
towards a shared *generic* set expressed in units of each chip's own peak rates:

    e_flop,c = a_c TDP / peak_flops_c,  e_hbm = a_hbm TDP / hbm_bandwidth,
    e_link = a_link TDP / scale_up_bandwidth,  P_active = a_active TDP,  P_idle = a_idle TDP,

the fraction of TDP each unit would draw running alone at its peak. Chips never measured
(Jalapeno, TPUs, AMD) and held-out chips take the generic set.

The same fit sets the serving engines' time terms that only these measurements see (per
runtime: host time per step and per running sequence, the expert kernels' efficiency and
the pipeline overlap of `design.Runtime`; per runtime and chip family: its kernels'
efficiency): J per token is power times time, so a
throughput the model gets wrong is a J/token it gets wrong.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import fitted as fitted_params
from .architecture import Model
from .design import Design, Layout, Runtime, precision
from .formats import COMPUTE_CLASSES
from .hardware import Chip
from .kvcache import profile_activation_bytes
from .presets import find_model, get_chip
from .serving import predict, predict_jit
from .smooth import smooth_max
from .workload import Workload

#: Input length (tokens) assumed for data sets whose prompts are real text of unpublished
#: length (ML.ENERGY). ShareGPT and LM Arena prompts: about 250 tokens (vLLM's ShareGPT
#: benchmark set averages ~220 input tokens); GPQA Diamond questions with the chat template:
#: about 250; v2 code completion (HumanEval-style prompts): about 150; Sourcegraph
#: fill-in-the-middle requests carry surrounding code: about 1,000. Assumptions, not data.
ASSUMED_ISL = {"lm-arena-chat": 256.0, "chat": 256.0, "gpqa": 256.0, "code completion": 150.0,
               "sourcegraph-fim": 1024.0, "MLPerf": 1024.0}
DEFAULT_ISL = 256.0

#: vLLM per-step host overhead prior (s): vLLM 0.11 V1 engine, CUDA graphs on.
VLLM_STEP_OVERHEAD = 1.0e-3

#: Energy-coefficient order used by the fit: four FLOP classes, HBM byte, link byte.
COEFFICIENTS = (*(f"flop_{c}" for c in COMPUTE_CLASSES), "hbm_byte", "link_byte",
                "active_power")

# ---------------------------------------------------------------------------------------
# Rows of the measurement file -> model inputs.


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """One measured row as model inputs (static parts) and its measured values."""

    index: int
    model: Model
    chip_name: str
    layout: Layout
    weights: str | None
    isl: float
    isl_assumed: bool
    osl: float
    concurrency: float
    max_running: float
    framework: str
    measured: dict

    @property
    def group(self):
        return (self.model.name, self.chip_name, self.layout, self.weights, self.framework)


def _float(row: dict, key: str):
    value = (row.get(key) or "").strip()
    try:
        return float(value)
    except ValueError:
        return None


def resolve_model(name: str) -> Model | None:
    """A model by Hugging Face id: a preset, else a shipped HF config
    (`presets.find_model`), else None.

    Example:
        >>> resolve_model("openai/gpt-oss-120b").name, resolve_model("acme/unknown-7b")
        ('gpt-oss-120b', None)
    """
    try:
        return find_model(name, label=True)
    except ValueError:
        return None


def _layout(model: Model, parallelism: str, num_gpus: int) -> Layout:
    values = {k: int(v) for k, v in re.findall(r"(TP|EP|DP|PP)(\d+)", parallelism or "")}
    pp = values.get("PP", 1)
    chips = max(num_gpus // pp, 1)
    ep = values.get("EP", 1) if model.is_moe else 1
    ep = math.gcd(math.gcd(ep, chips), model.num_experts or 1) if model.is_moe else 1
    dp = values.get("DP", 1)
    return Layout(tp=chips, ep=max(ep, 1), pp=pp, dp_attention=bool(model.is_moe and dp > 1))


def _weights(text: str) -> str | None:
    text = (text or "").lower()
    if "mxfp4" in text or text.startswith("fp4"):
        return "fp4"
    if text.startswith("fp8"):
        return "fp8"
    if text.startswith("bfloat16") or text.startswith("bf16"):
        return "bf16"
    return None


def assumed_isl(workload: str) -> float:
    """Input length assumed for a data set named in `workload` (see `ASSUMED_ISL`)."""
    for key, value in ASSUMED_ISL.items():
        if workload.lower().startswith(key.lower()):
            return value
    return DEFAULT_ISL


def runtime_key(framework: str) -> str:
    """Which fitted runtime a framework label uses: "vllm-2024" (ML.ENERGY v2 era, version
    unrecorded), "vllm" (any other vLLM) or "other" (prior `Runtime`)."""
    text = framework.lower()
    if "vllm" not in text:
        return "other"
    return "vllm-2024" if "2024" in text or "v2 benchmark" in text else "vllm"


def row_spec(row: dict, index: int = 0) -> tuple[RowSpec | None, str]:
    """Model inputs of a measurement row (columns of `power_measurements.csv`).

    Returns:
        (spec, "") or (None, reason) when the model or chip is unknown or a column missing.
    """
    model = resolve_model(row.get("model", ""))
    if model is None:
        return None, f"unknown model {row.get('model')!r} (no preset, no shipped HF config)"
    try:
        chip = get_chip(row.get("hardware", ""), calibrated=False, label=True)
    except ValueError:
        return None, f"unknown hardware {row.get('hardware')!r}"
    num_gpus = int(_float(row, "num_gpus") or 1)
    batch = _float(row, "avg_batch_size") or _float(row, "max_batch_size") \
        or _float(row, "concurrency")
    osl = _float(row, "osl")
    if batch is None or osl is None:
        return None, "needs avg_batch_size, max_batch_size or concurrency, and osl"
    isl = _float(row, "isl")
    assumed = isl is None
    if assumed:
        isl = assumed_isl(row.get("workload", ""))
    framework = runtime_key(row.get("framework") or "")
    measured = {k: _float(row, k) for k in ("avg_power_w_per_gpu", "energy_j_per_output_token",
                                            "output_tokens_per_s_per_gpu", "median_itl_ms",
                                            "system_wall_power_w")}
    max_running = _float(row, "max_batch_size") or math.inf
    return RowSpec(index=index, model=model, chip_name=chip.name,
                   layout=_layout(model, row.get("parallelism", ""), num_gpus),
                   weights=_weights(row.get("precision", "")), isl=isl, isl_assumed=assumed,
                   osl=osl, concurrency=batch, max_running=max(max_running, batch),
                   framework=framework, measured=measured), ""


# ---------------------------------------------------------------------------------------
# Serving-model evaluation of a group of rows (same model, chip, layout, formats).


def _runtime(spec: RowSpec, fitted: dict, max_running, zero_overhead: bool = False,
             family: str = "") -> Runtime:
    # The measured harness's engine terms, resolved like any framework's
    # (`perfmodel.fitted.POWER_FRAMEWORKS`); "other" keeps the priors.
    name = f"mlenergy-{spec.framework}"
    entry = (fitted_params.runtime_terms(name, family, power=fitted)
             if name in fitted_params.POWER_FRAMEWORKS else {})
    ones = jnp.ones_like(max_running)
    kw = {k: v * ones for k, v in entry.items()}
    if zero_overhead:
        kw.update(step_overhead=0.0 * ones, seq_overhead=0.0 * ones)
    kw.setdefault("kernel_efficiency", ones)
    return Runtime(max_running=max_running, framework=spec.framework, **kw)


def _inputs(specs: list[RowSpec], chip: Chip, fitted: dict, zero_overhead: bool = False,
            overlap: float | None = None):
    """Design and workload of a group of rows. `overlap` given: the feature evaluation's
    reference engine (all kernels at full speed, that pipeline overlap), from which the
    fit's reduced model adds the fitted engine terms back."""
    first = specs[0]
    conc = jnp.asarray([s.concurrency for s in specs], dtype=float)
    running = jnp.asarray([s.max_running for s in specs], dtype=float)
    # vLLM keeps the KV cache in the model's dtype unless told otherwise.
    kv = "bf16" if first.framework.startswith("vllm") else None
    prec = precision(chip, first.model, first.weights, kv=kv, emulate=True)   # what ran
    runtime = _runtime(first, fitted, running, zero_overhead, chip.family)
    if first.framework.startswith("vllm"):
        # vLLM keeps its profiled activation peak out of the KV cache, not a flat reserve;
        # rows without max_num_seqs ran vLLM's default of 256 (vllm EngineArgs).
        seqs = jnp.where(jnp.isfinite(running), running, 256.0)
        reserve = profile_activation_bytes(first.model, first.layout, prec,
                                           runtime.max_batched_tokens, seqs)
        runtime = eqx.tree_at(lambda r: r.activation_reserve, runtime, reserve)
    if overlap is not None:
        runtime = eqx.tree_at(
            lambda r: (r.expert_efficiency, r.kernel_efficiency, r.pipeline_overlap), runtime,
            (jnp.ones_like(running), jnp.ones_like(running), overlap * jnp.ones_like(running)))
    design = Design(concurrency=conc, layout=first.layout, precision=prec, runtime=runtime)
    ratio = jnp.asarray([1.0 if s.isl_assumed else 0.8 for s in specs], dtype=float)
    workload = Workload(input_len=jnp.asarray([s.isl for s in specs], dtype=float),
                        output_len=jnp.asarray([s.osl for s in specs], dtype=float),
                        input_range_ratio=ratio, output_range_ratio=ratio,
                        first_wave_fraction=jnp.zeros_like(ratio))
    return design, workload


@eqx.filter_jit
def _features(model, chip, design, workload):
    """Dynamic J per output token per unit of each energy coefficient (cap off), with the
    zero-overhead throughput and step of each row and the routed experts' share of the step
    (`-d step / d expert_efficiency` at efficiency 1: the step is linear in its inverse)."""
    # Cap off, no idle power and no energy: the throughput and the features must not
    # depend on a previous power fit.
    zero = type(chip.energy)(per_flop=jnp.zeros(len(COMPUTE_CLASSES)),
                             per_hbm_byte=jnp.zeros(()), per_link_byte=jnp.zeros(()),
                             active_power=jnp.zeros(()))
    free = eqx.tree_at(lambda c: (c.tdp, c.idle_power, c.energy), chip,
                       (jnp.asarray(1e12), jnp.asarray(0.0), zero))

    def joules(unit):
        # With the cap off and no idle power, J per token is linear in the coefficients and
        # zero without them: one coefficient at a small value, divided by it, is its feature
        # exactly (forward-mode derivatives gave NaN on some rows under jit).
        energy = type(chip.energy)(per_flop=unit[:n_flop] * 1e-15,
                                   per_hbm_byte=unit[n_flop] * 1e-15,
                                   per_link_byte=unit[n_flop + 1] * 1e-15,
                                   active_power=unit[n_flop + 2] * 1e-3)
        m = predict(model, eqx.tree_at(lambda c: c.energy, free, energy), workload, design,
                    hard=True, check=False, unfit="value")
        return m.j_per_output_token

    n_flop = len(COMPUTE_CLASSES)
    scale = jnp.asarray([1e-15] * (n_flop + 2) + [1e-3])
    features = jax.vmap(joules)(jnp.eye(n_flop + 3)).T / scale[None, :]
    m = predict(model, free, workload, design, hard=True, check=False, unfit="value")

    def step(efficiency):
        d = eqx.tree_at(lambda x: x.runtime.expert_efficiency, design, efficiency)
        return predict(model, free, workload, d, hard=True, check=False, unfit="value").decode_step

    ones = design.runtime.expert_efficiency
    _, slope = jax.jvp(step, (ones,), (jnp.ones_like(ones),))
    return features, m.output_throughput_per_chip, m.decode_step, m.running_batch, m.fits, \
        -slope


def group_features(specs: list[RowSpec]) -> dict:
    """Energy features of rows sharing `RowSpec.group`, with the latency fit applied,
    every host overhead set to zero and the expert kernels at full efficiency (the fit adds
    them back analytically).

    Returns:
        dict of numpy arrays over the rows: `features` (n, 6) dynamic J per output token per
        unit of each coefficient of `COEFFICIENTS`; `tok_s` output tokens/s per chip and
        `step` mean engine step (s) without host overhead; `experts` the routed experts'
        seconds in that step; `micro` sequences per step; `fits`; `units` (n, 6) the chip's
        TDP over its peak rate of each unit (J per unit at a fraction 1); `tdp` (W); `pp`.
        Each of features, tok_s, step, experts and micro also as `<name>_serial`: the same
        with one micro-batch in flight (`Runtime.pipeline_overlap` 0; equal without a
        pipeline), where the rest hold all stages busy (overlap 1).
    """
    first = specs[0]
    chip = get_chip(first.chip_name)
    out = {}
    for suffix, overlap in (("", 1.0), ("_serial", 0.0)):
        if suffix and first.layout.pp == 1:
            out.update({f"{k}_serial": out[k] for k in
                        ("features", "tok_s", "step", "experts", "micro")})
            break
        design, workload = _inputs(specs, chip, {}, zero_overhead=True, overlap=overlap)
        features, tok_s, step, running, fits, experts = _features(first.model, chip, design,
                                                                  workload)
        in_flight = 1.0 + overlap * (first.layout.pp - 1)
        out.update({f"features{suffix}": np.asarray(features),
                    f"tok_s{suffix}": np.asarray(tok_s), f"step{suffix}": np.asarray(step),
                    f"experts{suffix}": np.asarray(experts),
                    f"micro{suffix}": np.asarray(running) / in_flight})
        if not suffix:
            out["fits"] = np.asarray(fits)
    out.update(units=np.tile(_units(chip), (len(specs), 1)),
               tdp=np.full(len(specs), float(chip.tdp)),
               pp=np.full(len(specs), float(first.layout.pp)))
    return out


def _units(chip: Chip) -> np.ndarray:
    tdp = float(chip.tdp)
    peaks = np.asarray(chip.peak_flops, dtype=float)
    return np.concatenate([tdp / peaks, [tdp / float(chip.hbm_bandwidth),
                                         tdp / float(chip.scale_up.bandwidth), tdp]])


# ---------------------------------------------------------------------------------------
# The fit.

FAMILIES = ("ampere", "hopper", "blackwell")
RUNTIMES = ("vllm", "vllm-2024")
#: Priors as fractions of TDP (`hardware.EnergyCoefficients` priors on an H100: 0.5 pJ/FLOP
#: x 989 TFLOP/s / 700 W = 0.71; 60 pJ/B x 3.35 TB/s / 700 W = 0.29; 40 pJ/B x 450 GB/s /
#: 700 W = 0.026; active power while kernels run 0.1; idle 0.15), host overheads (1 ms per
#: step, 20 us per sequence), and the engine's expert-kernel efficiency and pipeline overlap
#: (0.9 each: close to the latency fit's engines, which run at 1; weak priors, the data
#: decide).
PRIOR = {"flop": 0.71, "hbm": 0.29, "link": 0.026, "active": 0.1, "idle": 0.15,
         "step_overhead": 1e-3, "seq_overhead": 2e-5, "expert_efficiency": 0.9,
         "pipeline_overlap": 0.9, "kernel_efficiency": 0.9}


class PowerParams(eqx.Module):
    """Fitted power parameters in log/logit space (the optimizer's variables)."""

    log_fraction: jnp.ndarray
    """Generic log TDP fractions of FLOP, HBM and link energy and of the active power,
    shape (4,)."""
    logit_idle: jnp.ndarray
    """Generic logit of the idle fraction of TDP."""
    family_delta: jnp.ndarray
    """Per-family offsets of the five values above, shape (len(FAMILIES), 5)."""
    log_overheads: jnp.ndarray
    """log (step, per-sequence) host overhead (s) per runtime, shape (len(RUNTIMES), 2)."""
    logit_engine: jnp.ndarray
    """logit (expert-kernel efficiency, pipeline overlap) per runtime (`design.Runtime`),
    shape (len(RUNTIMES), 2)."""
    logit_kernel: jnp.ndarray
    """logit of the kernel efficiency (`design.Runtime.kernel_efficiency`) per runtime and
    chip family, shape (len(RUNTIMES), len(FAMILIES)); other families run the latency
    fit's kernels (1)."""

    @staticmethod
    def prior() -> PowerParams:
        base = jnp.log(jnp.asarray([PRIOR["flop"], PRIOR["hbm"], PRIOR["link"],
                                    PRIOR["active"]]))
        idle = jnp.log(PRIOR["idle"] / (1.0 - PRIOR["idle"]))
        over = jnp.log(jnp.asarray([[PRIOR["step_overhead"], PRIOR["seq_overhead"]]] *
                                   len(RUNTIMES)))
        engine = jnp.asarray([[PRIOR["expert_efficiency"], PRIOR["pipeline_overlap"]]]
                             * len(RUNTIMES))
        kernel = PRIOR["kernel_efficiency"]
        return PowerParams(log_fraction=base, logit_idle=jnp.asarray(idle),
                           family_delta=jnp.zeros((len(FAMILIES), 5)), log_overheads=over,
                           logit_engine=jnp.log(engine / (1.0 - engine)),
                           logit_kernel=jnp.full((len(RUNTIMES), len(FAMILIES)),
                                                 math.log(kernel / (1.0 - kernel))))


class Batch(eqx.Module):
    """Feature arrays of fitted rows (see `group_features`), with indices."""

    features: jnp.ndarray
    units: jnp.ndarray
    tok_s: jnp.ndarray
    step: jnp.ndarray
    experts: jnp.ndarray
    micro: jnp.ndarray
    serial: tuple
    """(features, tok_s, step, experts, micro) with one micro-batch in flight."""
    pp: jnp.ndarray
    tdp: jnp.ndarray
    family: jnp.ndarray
    """Index into FAMILIES, or -1 for the generic set."""
    runtime: jnp.ndarray
    """Index into RUNTIMES, or -1 for no host overhead change."""
    power: jnp.ndarray
    joules: jnp.ndarray


def reduced_predict(params: PowerParams, batch: Batch, sharpness=24.0, hard: bool = False):
    """Power per GPU (W), J per output token and output tokens/s per GPU of each row from
    its features: the serving model's power and throughput, with the coefficients,
    idle fraction, host overheads, expert-kernel efficiency and pipeline overlap of `params`.

    The engine stretches the zero-overhead step `t0` to `(t0 + t_e (1 / eta - 1)) / kappa +
    s0 + s1 B` (`t_e` the routed experts' time, `eta` their efficiency, `kappa` the kernel
    efficiency of the runtime on the row's chip family); the TDP cap
    (`power.apply_power_cap`) stretches it further by `max(1, P_dyn / (TDP - P_idle))`. With
    pipeline stages every row quantity is interpolated between one micro-batch in flight
    and all stages busy, linearly in the micro-batch size `B / (1 + overlap (pp - 1))`.
    """
    fam = jnp.clip(batch.family, 0, len(FAMILIES) - 1)
    delta = jnp.where((batch.family >= 0)[:, None], params.family_delta[fam], 0.0)
    log_frac = params.log_fraction[None, :] + delta[:, :4]
    idle = jax.nn.sigmoid(params.logit_idle + delta[:, 4])
    frac = jnp.exp(jnp.concatenate([jnp.repeat(log_frac[:, :1], len(COMPUTE_CLASSES), 1),
                                    log_frac[:, 1:]], axis=1))
    run = jnp.clip(batch.runtime, 0, len(RUNTIMES) - 1)
    known = batch.runtime >= 0
    over = jnp.where(known[:, None], jnp.exp(params.log_overheads[run]), 0.0)
    engine = jnp.where(known[:, None], jax.nn.sigmoid(params.logit_engine[run]), 1.0)
    kernel = jnp.where(known & (batch.family >= 0),
                       jax.nn.sigmoid(params.logit_kernel[run, fam]), 1.0)
    # Pipeline: weight of the one-in-flight end, linear in the micro-batch size.
    in_flight = 1.0 + engine[:, 1] * (batch.pp - 1.0)
    w = jnp.where(batch.pp > 1, (1.0 / in_flight - 1.0 / batch.pp)
                  / (1.0 - 1.0 / jnp.maximum(batch.pp, 2.0)), 0.0)

    def lerp(a, b):
        return a + (w.reshape(w.shape + (1,) * (a.ndim - 1))) * (b - a)

    s_features, s_tok_s, s_step, s_experts, s_micro = batch.serial
    features = lerp(batch.features, s_features)
    step0 = lerp(batch.step, s_step)
    tokens = lerp(batch.tok_s * batch.step, s_tok_s * s_step)
    busy = (step0 + lerp(batch.experts, s_experts) * (1.0 / engine[:, 0] - 1.0)) / kernel
    # The active-power column (J per token per W = busy seconds per token) stretches with
    # the kernels' time; the work columns do not.
    stretch = jnp.concatenate([jnp.ones_like(features[:, :-1]), (busy / step0)[:, None]], 1)
    joules_dyn = jnp.sum(features * batch.units * frac * stretch, axis=1)
    step = busy + over[:, 0] + over[:, 1] * lerp(batch.micro, s_micro)
    tok_s = tokens / step
    dyn = joules_dyn * tok_s
    headroom = batch.tdp * (1.0 - idle)
    throttle = smooth_max(jnp.ones_like(dyn), dyn / headroom, sharpness=sharpness, hard=hard)
    tok_s = tok_s / throttle
    power = batch.tdp * idle + dyn / throttle
    return power, power / tok_s, tok_s


def _loss(params: PowerParams, batch: Batch, weights):
    power, joules, _ = reduced_predict(params, batch)
    r_power = jnp.log(power / batch.power)
    r_joules = jnp.log(joules / batch.joules)
    data = jnp.sum(weights * (optax.huber_loss(r_power, delta=0.1)
                              + optax.huber_loss(r_joules, delta=0.1))) / jnp.sum(weights)
    prior = PowerParams.prior()
    reg = (jnp.sum(params.family_delta ** 2) * 0.05
           + 1e-3 * jnp.sum((params.log_fraction - prior.log_fraction) ** 2)
           + 1e-3 * (params.logit_idle - prior.logit_idle) ** 2
           + 1e-3 * jnp.sum((params.log_overheads - prior.log_overheads) ** 2)
           # Each engine term is seen by few rows (17 pipelined ones): a prior as weak as
           # their share of the mean data loss lets them speak.
           + 1e-5 * jnp.sum((params.logit_engine - prior.logit_engine) ** 2)
           # Kernel efficiencies: weak priors (each seen by tens to hundreds of rows).
           + 1e-4 * jnp.sum((params.logit_kernel - prior.logit_kernel) ** 2))
    return data + reg


class FitResult(eqx.Module):
    params: PowerParams
    loss: jnp.ndarray
    result: int = eqx.field(static=True)
    """0: converged (loss change under 1e-9 over the last 100 steps); 1: step limit hit;
    2: non-finite loss."""


def fit_power(batch: Batch, weights=None, steps: int = 6000, learning_rate: float = 0.03,
              seed: int = 0, throw: bool = False) -> FitResult:
    """Fit `PowerParams` to a `Batch` (Adam on log/logit parameters, Huber loss).

    Args:
        batch: features and measurements.
        weights: per-row weights (default 1).
        steps: Adam steps; learning_rate: Adam step size.
        seed: seeds the small jitter of the start (reproducible).
        throw: raise `RuntimeError` when the fit does not converge.

    Returns:
        `FitResult` with a result code (0 converged, 1 step limit, 2 non-finite).
    """
    weights = jnp.ones_like(batch.power) if weights is None else jnp.asarray(weights, float)
    start = PowerParams.prior()
    key = jax.random.PRNGKey(seed)
    start = eqx.tree_at(lambda p: p.log_fraction, start,
                        start.log_fraction + 0.01 * jax.random.normal(key, (4,)))
    # Step size decays a hundredfold over the run, so Adam settles instead of dithering
    # around the optimum at its constant-step noise floor.
    optimizer = optax.adam(optax.cosine_decay_schedule(learning_rate, steps, alpha=0.01))

    @eqx.filter_jit
    def run(params):
        state = optimizer.init(params)

        def body(carry, _):
            params, state = carry
            loss, grads = eqx.filter_value_and_grad(_loss)(params, batch, weights)
            updates, state = optimizer.update(grads, state, params)
            return (eqx.apply_updates(params, updates), state), loss

        (params, _), losses = jax.lax.scan(body, (params, state), None, length=steps)
        return params, losses

    params, losses = run(start)
    losses = np.asarray(losses)
    final = float(losses[-1])
    if not np.isfinite(final):
        code = 2
    elif abs(losses[-100] - final) < 1e-9 * max(1.0, abs(final)) or \
            abs(losses[-100] - final) < 1e-7:
        code = 0
    else:
        code = 1
    if throw and code:
        raise RuntimeError(f"power fit did not converge (result {code}, loss {final:.4g})")
    return FitResult(params=params, loss=jnp.asarray(final), result=code)


def to_fitted(params: PowerParams, chips: dict[str, Chip], holdout: str | None = None) -> dict:
    """The `fitted_power.json` content of fitted parameters.

    Args:
        params: fitted parameters.
        chips: one representative chip per family, for the physical per-family coefficients.
        holdout: a family left out of the fit (not written).
    """
    frac = np.exp(np.asarray(params.log_fraction))
    idle = float(jax.nn.sigmoid(params.logit_idle))
    generic = {"flop": [float(frac[0])] * len(COMPUTE_CLASSES), "hbm": float(frac[1]),
               "link": float(frac[2]), "active": float(frac[3]), "idle": idle}
    families = {}
    for i, family in enumerate(FAMILIES):
        if family == holdout or family not in chips:
            continue
        d = np.asarray(params.family_delta[i])
        fam = {"flop": [float(frac[0] * np.exp(d[0]))] * len(COMPUTE_CLASSES),
               "hbm": float(frac[1] * np.exp(d[1])), "link": float(frac[2] * np.exp(d[2])),
               "active": float(frac[3] * np.exp(d[3])),
               "idle": float(jax.nn.sigmoid(params.logit_idle + d[4]))}
        energy = fitted_params.generic_energy(chips[family], fam)
        families[family] = {"energy": energy, "idle_fraction": fam["idle"], "tdp_fractions": fam,
                            "reference_chip": chips[family].name}
    over = np.exp(np.asarray(params.log_overheads))
    engine = np.asarray(jax.nn.sigmoid(params.logit_engine))
    kernel = np.asarray(jax.nn.sigmoid(params.logit_kernel))
    runtimes = {name: {"step_overhead": float(over[i, 0]), "seq_overhead": float(over[i, 1]),
                       "expert_efficiency": float(engine[i, 0]),
                       "pipeline_overlap": float(engine[i, 1]),
                       "kernel_efficiency": {fam: float(kernel[i, j])
                                             for j, fam in enumerate(FAMILIES)
                                             if fam != holdout and fam in chips}}
                for i, name in enumerate(RUNTIMES)}
    return {"version": 1, "families": families, "generic": generic, "runtimes": runtimes}


# ---------------------------------------------------------------------------------------
# Data set, evaluation and the predict-command hook.


def specs_of(rows: list[dict]) -> tuple[list[RowSpec], list[tuple[int, str]]]:
    """Row specs of the rows the model can evaluate, and (index, reason) for the others."""
    specs, skipped = [], []
    for i, row in enumerate(rows):
        spec, why = row_spec(row, i)
        if spec is None:
            skipped.append((i, why))
        else:
            specs.append(spec)
    return specs, skipped


def features_of(specs: list[RowSpec]) -> dict[int, dict]:
    """Per-row features (see `group_features`), keyed by `RowSpec.index`."""
    groups: dict = {}
    for spec in specs:
        groups.setdefault(spec.group, []).append(spec)
    out = {}
    for members in groups.values():
        arrays = group_features(members)
        for j, spec in enumerate(members):
            out[spec.index] = {k: v[j] for k, v in arrays.items()}
            out[spec.index]["spec"] = spec
    return out


def make_batch(features: dict[int, dict], indices, holdout: str | None = None) -> Batch:
    """A `Batch` of the given rows (those with measured power and J/token); rows of the
    `holdout` family use the generic set."""
    rows = [features[i] for i in indices]

    def family(spec):
        fam = get_chip(spec.chip_name, calibrated=False).family
        return FAMILIES.index(fam) if fam in FAMILIES and fam != holdout else -1

    def stack(key):
        return jnp.asarray(np.stack([r[key] for r in rows]), dtype=float)

    return Batch(features=stack("features"), units=stack("units"), tok_s=stack("tok_s"),
                 step=stack("step"), experts=stack("experts"), micro=stack("micro"),
                 serial=tuple(stack(f"{k}_serial") for k in
                              ("features", "tok_s", "step", "experts", "micro")),
                 pp=stack("pp"), tdp=stack("tdp"),
                 family=jnp.asarray([family(r["spec"]) for r in rows]),
                 runtime=jnp.asarray([RUNTIMES.index(r["spec"].framework)
                                      if r["spec"].framework in RUNTIMES else -1
                                      for r in rows]),
                 power=jnp.asarray([r["spec"].measured["avg_power_w_per_gpu"] for r in rows]),
                 joules=jnp.asarray([r["spec"].measured["energy_j_per_output_token"]
                                     for r in rows]))


def usable(features: dict[int, dict]) -> list[int]:
    """Indices of rows with measured power and J/token whose configuration fits in memory."""
    out = []
    for i, f in features.items():
        m = f["spec"].measured
        if m["avg_power_w_per_gpu"] and m["energy_j_per_output_token"] and bool(f["fits"]):
            out.append(i)
    return sorted(out)


def errors(params: PowerParams, batch: Batch) -> dict:
    """Median and 90th-percentile absolute relative errors of power, J/token and tok/s."""
    power, joules, _ = reduced_predict(params, batch, hard=True)
    out = {}
    for name, pred, meas in (("power", power, batch.power), ("j_per_token", joules,
                                                              batch.joules)):
        rel = np.abs(np.asarray(pred) / np.asarray(meas) - 1.0)
        out[name] = {"median_abs_pct": float(np.median(rel) * 100),
                     "p90_abs_pct": float(np.percentile(rel, 90) * 100), "n": int(rel.size)}
    return out


#: The prediction columns of measurement-style rows (`Metrics.to_row("pred_")` keys).
POWER_PREDICTION_KEYS = ("pred_power_w_modelled", "pred_j_per_output_token",
                         "pred_output_tput_per_chip")


def predict_power_rows(rows: list[dict], fitted: dict | None = None) -> list[dict]:
    """Predicted power, J per output token and output tokens/s per GPU for measurement-style
    rows (the columns of `power_measurements.csv`), for `perfmodel predict`.

    Each row needs model (preset name or Hugging Face id), hardware, num_gpus, parallelism
    (e.g. "TP2 EP1 DP1"), precision, avg_batch_size or max_batch_size (or concurrency) and
    osl; isl when known, else the input length of `ASSUMED_ISL` for its workload.

    Returns:
        One dict per row: the row plus `pred_power_w_modelled`,
        `pred_j_per_output_token`, `pred_output_tput_per_chip`, `pred_isl`,
        `pred_isl_assumed` and `pred_status` ("ok", "does not fit in memory" or why the row
        could not be evaluated: "unknown model ...").

    Example:
        >>> row = dict(model="meta-llama/Llama-3.1-8B-Instruct", hardware="H100",
        ...            num_gpus="1", parallelism="TP1", precision="bfloat16",
        ...            max_batch_size="64", osl="400", framework="vLLM 0.11.1")
        >>> out = predict_power_rows([row])[0]
        >>> out["pred_status"], 100 < out["pred_power_w_modelled"] <= 700
        ('ok', True)
    """
    fitted = fitted_params.read(fitted_params.POWER_FILE) if fitted is None else fitted
    specs, skipped = specs_of(rows)
    out = [dict(row) for row in rows]
    for i, why in skipped:
        out[i].update(pred_power_w_modelled=None, pred_j_per_output_token=None,
                      pred_output_tput_per_chip=None, pred_isl=None,
                      pred_isl_assumed=None, pred_status=why)
    groups: dict = {}
    for spec in specs:
        groups.setdefault(spec.group, []).append(spec)
    for members in groups.values():
        first = members[0]
        chip = fitted_params.apply(get_chip(first.chip_name, calibrated=False), power=fitted)
        design, workload = _inputs(members, chip, fitted)
        m = predict_jit(first.model, chip, workload, design, hard=True, check=False, unfit="value")
        row = {k: np.asarray(v) for k, v in m.to_row("pred_").items()}
        for j, spec in enumerate(members):
            fits = bool(row["pred_fits"][j])
            out[spec.index].update(
                {k: float(row[k][j]) for k in POWER_PREDICTION_KEYS},
                pred_isl=spec.isl, pred_isl_assumed=spec.isl_assumed,
                pred_status="ok" if fits else "does not fit in memory")
    return out


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Rows of a CSV file as dicts."""
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))
