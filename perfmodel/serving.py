"""Serving metrics of a deployment in steady state (InferenceX definitions).

Aggregated serving (one pool, chunked prefill): each running request emits tau tokens per
step (tau > 1 with speculative decoding), so the batch must take in b * tau * I_c / O prompt
tokens per step to stay full, I_c = (1 - h) I the prompt tokens a request computes when a
share h of its prompt is a prefix-cache hit (`Workload.cached_fraction`; they attend to
the cached h I and, causally, half of the rest; the KV cache and the decode context keep
the whole prompt). Those prompt tokens ride in chunks of
c = smooth_max(that demand, min(I_c, max_batched_tokens)) tokens, carried by a fraction
f = demand / c of the steps. A step costs T0 without a chunk and Tc with one, so

    mean step  = T0 + f (Tc - T0),    TPOT = mean step / tau,
    TTFT       = request overhead (HTTP, tokenization) + admission wait (a fraction of a
                 step, or several steps where the scheduler favours running decodes)
                 + own prefill
                 + queueing when concurrency exceeds the batch that fits in memory,
    E2E        = TTFT + (O - 1) TPOT,  throughput = concurrency / E2E (Little's law).

Prefill work therefore costs both TTFT and TPOT, and TTFT grows with concurrency and input
length, as InferenceMAX measures. Disaggregated serving runs prefill and decode on separate
pools and moves each request's KV cache between them:

    TTFT       = request overhead + queue at the prefill instance + one prompt's prefill
                 + KV transfer + admission wait in decode steps (the decode instance joins
                 the request to its batch and streams the first token)
                 + queueing once a pool saturates,

the prefill queue from the Pollaczek-Khinchine mean wait of deterministic service (M/D/1)
at the utilisation the demand gives, rho / (2 (1 - rho)) one-prompt prefills; the closed
loop's rate is the smooth minimum of that demand, the prefill pool's batched capacity and the
decode pool's slots over a request's decode time.

Pipeline stages (`Layout.pp`): the running batch is split into micro-batches, of which
`1 + overlap (pp - 1)` are in flight (`Runtime.pipeline_overlap`); a step moves one
micro-batch through every stage, and each stage's chip does that share of the work.

Percentiles: p99 TPOT adds the binomial spread of how many chunk-carrying steps a request
meets in its O / tau steps; p99 TTFT takes the longest prompt and, for a benchmark that
starts all clients at once (InferenceMAX sends 10 prompts per client), the first wave's queue.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optimistix as optx

from .architecture import Model
from .checks import error_if
from .design import Design, Disaggregated, Layout, LayoutNumbers
from .hardware import Chip
from .kvcache import (
    kv_bytes_per_request,
    kv_capacity_per_chip,
    kv_transfer_fraction,
    max_batch,
    weight_bytes_per_chip,
)
from .power import apply_power_cap, average_power, dynamic_energy
from .roofline import step_cost
from .smooth import DEFAULT_SHARPNESS, safe_sqrt, smooth_max, smooth_min, soft_penalty
from .static import branch, known
from .workload import Workload

#: Each `Metrics` field's column name in rows, tables and CSV files (`Metrics.to_row`); a
#: suffix gives the unit where the field has one.
COLUMNS = {
    "concurrency": "concurrency", "throughput_per_chip": "tput_per_chip_total",
    "interactivity": "interactivity", "ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s",
    "power_per_chip": "power_w_modelled", "tok_s_per_kw_tdp": "tok_s_per_kw_tdp",
    "j_per_output_token": "j_per_output_token",
    "input_throughput_per_chip": "input_tput_per_chip",
    "output_throughput_per_chip": "output_tput_per_chip",
    "tok_s_per_mw_allin": "tok_s_per_mw_allin", "p99_ttft": "p99_ttft_s",
    "p99_tpot": "p99_tpot_s", "running_batch": "running_batch", "max_batch": "max_batch",
    "memory_excess": "memory_excess", "memory_penalty": "memory_penalty", "fits": "fits",
    "decode_step": "decode_step_s", "prefill_fraction": "prefill_fraction",
    "throttle": "throttle", "steady": "steady"}

#: The headline columns (a subset of `COLUMNS`' names).
METRIC_KEYS = ("concurrency", "tput_per_chip_total", "interactivity", "ttft_s", "tpot_s", "e2e_s",
               "power_w_modelled", "tok_s_per_kw_tdp", "j_per_output_token")


class Metrics(eqx.Module):
    """Predicted serving metrics; every field an array (broadcast over sweeps)."""

    concurrency: jnp.ndarray
    ttft: jnp.ndarray
    """Median time to first token (s)."""
    tpot: jnp.ndarray
    """Median time per output token after the first (s)."""
    interactivity: jnp.ndarray
    """Tokens/s/user = 1 / TPOT."""
    e2e: jnp.ndarray
    """Median end-to-end request latency (s)."""
    p99_ttft: jnp.ndarray
    p99_tpot: jnp.ndarray
    throughput_per_chip: jnp.ndarray
    """(Input + output) tokens/s per chip."""
    input_throughput_per_chip: jnp.ndarray
    output_throughput_per_chip: jnp.ndarray
    tok_s_per_kw_tdp: jnp.ndarray
    """Total tokens/s per kW of rated TDP."""
    tok_s_per_mw_allin: jnp.ndarray
    """Total tokens/s per MW of all-in power (chip, host, network, facility share)."""
    power_per_chip: jnp.ndarray
    """Average chip power while serving (W)."""
    j_per_output_token: jnp.ndarray
    """Chip energy per output token, prefill included (J)."""
    running_batch: jnp.ndarray
    """Sequences decoding per instance (the decode pool's when disaggregated)."""
    max_batch: jnp.ndarray
    """Sequences per instance whose KV cache fits."""
    memory_excess: jnp.ndarray
    """(weights + reserve + one sequence of KV) / usable HBM - 1: > 0 means it does not fit."""
    memory_penalty: jnp.ndarray
    """Smooth hinge of `memory_excess` (0 when it fits), for optimizers."""
    fits: jnp.ndarray
    """True when the weights and at least one full sequence fit on every chip."""
    decode_step: jnp.ndarray
    """Mean engine step time (s)."""
    prefill_fraction: jnp.ndarray
    """Fraction of steps that carry a prefill chunk (aggregated) or prefill-pool
    utilisation (disaggregated)."""
    throttle: jnp.ndarray
    """Step-time stretch from the power cap (1 when it does not bind)."""
    steady: jnp.ndarray
    """True when the operating point is a steady state: always in closed loop; under an
    open-loop `request_rate`, whether the fixed point c = rate x E2E(c) was found (False:
    arrivals exceed what the design serves, and the queue grows)."""

    def to_row(self, prefix: str = "") -> dict:
        """Every field under its column name (`COLUMNS`), each name preceded by `prefix`;
        values as they are, so a kernel can return the dict. The one vocabulary of every
        command's rows, tables and CSV files."""
        return {prefix + key: getattr(self, name) for name, key in COLUMNS.items()}


class _Phase(eqx.Module):
    """What one serving arrangement (aggregated or disaggregated) predicts, before the
    per-chip normalisation of `predict`: the fields are `Metrics`' (same units)."""

    requests_per_s: jnp.ndarray
    """Completed requests per second over the deployment (1/s)."""
    ttft: jnp.ndarray
    tpot: jnp.ndarray
    e2e: jnp.ndarray
    p99_ttft: jnp.ndarray
    p99_tpot: jnp.ndarray
    power: jnp.ndarray
    """Average power per chip (W)."""
    running: jnp.ndarray
    fit: jnp.ndarray
    excess: jnp.ndarray
    penalty: jnp.ndarray
    step: jnp.ndarray
    prefill: jnp.ndarray
    throttle: jnp.ndarray


class _Pool(eqx.Module):
    time: jnp.ndarray
    power: jnp.ndarray
    energy: jnp.ndarray
    throttle: jnp.ndarray


def _capped_step(model, chip, design, layout, kw, sharpness, hard, vectorize=False):
    cost = step_cost(model, chip, design, layout, sharpness=sharpness, hard=hard,
                     vectorize=vectorize, **kw)
    # A step carries one micro-batch through all pipeline stages; each stage's chip works
    # on in_flight / pp of it (all of it without a pipeline).
    share = _in_flight(layout, design.runtime) / layout.pp
    result = apply_power_cap(chip, cost.time, share * dynamic_energy(chip, cost), sharpness,
                             hard)
    return cost, result


_STEP_ARGS = ("decode_seqs", "decode_context", "prefill_tokens", "prefill_context",
              "prefill_seqs")


def _capped_steps(model, chip, design, layout, kws, sharpness, hard, vectorize):
    """`_capped_step` of several steps of one layout (one dict of `step_cost` arguments
    each); with `vectorize`, as one `vmap` over the steps (see `step_cost`)."""
    if not vectorize:
        return [_capped_step(model, chip, design, layout, kw, sharpness, hard)[1]
                for kw in kws]
    stacked = {key: jnp.stack(jnp.broadcast_arrays(
        *[jnp.asarray(kw.get(key, 0.0), dtype=float) for kw in kws])) for key in _STEP_ARGS}
    _, results = jax.vmap(lambda kw: _capped_step(model, chip, design, layout, kw, sharpness,
                                                  hard, vectorize))(stacked)
    return [jax.tree_util.tree_map(lambda x, i=i: x[i], results) for i in range(len(kws))]


def _in_flight(layout, runtime):
    """Micro-batches in flight through a pipeline of `layout.pp` stages: `1 + overlap
    (pp - 1)` (`Runtime.pipeline_overlap`); 1 without a pipeline."""
    return 1.0 + runtime.pipeline_overlap * (layout.pp - 1)


def _memory(model, chip, design, layout, context, sharpness):
    rt = design.runtime
    fit = max_batch(model, layout, design.precision, chip.hbm_capacity, context,
                    rt.memory_fraction, rt.activation_reserve, design.mapping, chip.num_slices,
                    rt.fraction_of_free)
    weights = weight_bytes_per_chip(model, layout, design.precision, design.mapping,
                                    chip.num_slices)
    usable = chip.hbm_capacity * rt.memory_fraction
    one_seq = kv_bytes_per_request(model, context, design.precision.kv_bytes) / layout.pp
    # One sequence's KV beyond what the KV cache gets, over the usable memory: with the
    # whole-memory rule, (weights + reserve + one sequence) / usable - 1.
    kv = kv_capacity_per_chip(chip.hbm_capacity, weights, rt.memory_fraction,
                              rt.activation_reserve, rt.fraction_of_free)
    excess = (one_seq - kv) / usable
    return fit, excess, soft_penalty(excess, sharpness)


def _aggregated(model, chip, workload, design, layout, concurrency, sharpness, hard,
                vectorize=False):
    rt, spec = design.runtime, design.speculative
    O = workload.mean_output_len
    # Prompt tokens computed per request (a cached prefix is reused) and what they attend to.
    Ic, prompt_ctx = workload.computed_input_len, workload.prefill_context
    tau = spec.tokens_per_step
    per_instance = concurrency / layout.replicas
    context = workload.decode_context
    fit, excess, penalty = _memory(model, chip, design, layout, rt.kv_context(workload),
                                   sharpness)
    running = smooth_min(per_instance, jnp.maximum(fit, 1e-3), rt.max_running,
                         sharpness=sharpness, hard=hard)
    micro = running / _in_flight(layout, rt)
    demand = micro * tau * Ic / O
    chunk = smooth_max(demand, jnp.minimum(Ic, rt.max_batched_tokens), sharpness=sharpness,
                       hard=hard)
    frequency = jnp.minimum(demand / chunk, 1.0)
    # Three steps of the same engine: decode only, decode with a prefill chunk (the mix
    # sets TPOT and TTFT), and a burst of prompts alone (the p99 TTFT of a first wave).
    plain, mixed, burst = _capped_steps(model, chip, design, layout, (
        dict(decode_seqs=micro, decode_context=context),
        dict(decode_seqs=micro, decode_context=context, prefill_tokens=chunk,
             prefill_context=prompt_ctx, prefill_seqs=chunk / Ic),
        dict(decode_seqs=jnp.zeros_like(micro), decode_context=context,
             prefill_tokens=rt.max_batched_tokens, prefill_context=prompt_ctx,
             prefill_seqs=rt.max_batched_tokens / Ic)), sharpness, hard, vectorize)
    step = plain.time + frequency * (mixed.time - plain.time)
    energy = plain.dynamic_energy + frequency * (mixed.dynamic_energy - plain.dynamic_energy)
    power = average_power(chip.idle_power, energy, step)
    tpot = step / tau
    own_prefill = smooth_max(Ic / chunk, 1.0, sharpness=sharpness, hard=hard) * mixed.time
    # The scheduler looks for new requests every `poll_steps` decode steps: a request
    # arriving at a random phase waits (N - 1) / 2 of them on average, (N - 1) at most.
    # Exactly zero when the scheduler is known to look every step (XLA keeps 0 x t, and
    # 0 x load / (1 - load) below was a kernel of its own under a wide vmap).
    every_step = known(rt.poll_steps, 1.0)
    poll_wait = jnp.zeros_like(plain.time) if every_step \
        else (rt.poll_steps - 1.0) * plain.time
    ttft_base = rt.request_overhead + rt.admission_steps * step + 0.5 * poll_wait \
        + own_prefill + branch(layout.dp_attention, lambda: rt.dp_admission_steps * step,
                               lambda: jnp.zeros_like(step))
    # The requests that gathered between two looks are admitted together and queue behind
    # each other's prompts, `max_batched_tokens` a step: k = rate x (wait + k p) of them per
    # look (rate from the closed loop without this term), p one prompt's share of a
    # prompt-only step of the budget plus a decode step. The prompt's part is what its
    # chunk adds to the mixed step (mixed - plain), so a kernel of mean metrics needs no
    # third step; where the decode batch is memory-bound part of the chunk hides behind it,
    # so this is below a prompt-only step's share at high load (`calibration/README.md`,
    # "Scheduler polling"). A request arriving at a random phase finds k / 2 of them ahead
    # on average, k at most. Zero when the scheduler looks every step.
    e2e_base = ttft_base + (O - 1.0) * tpot
    share = Ic / chunk * (mixed.time - plain.time) + Ic / rt.max_batched_tokens * plain.time
    load = jnp.minimum(running / e2e_base * share, 0.95)
    group_wait = poll_wait if every_step else poll_wait * load / (1.0 - load)
    ttft_base = ttft_base + 0.5 * group_wait
    e2e_base = e2e_base + 0.5 * group_wait
    e2e = e2e_base * per_instance / running
    ttft = e2e - (O - 1.0) * tpot
    requests_per_s = concurrency / e2e
    # Percentiles.
    steps = O / tau
    # safe_sqrt: every step carries a chunk (frequency = 1) at high load, where a plain sqrt
    # has an infinite derivative and the gradient turns NaN.
    spread = safe_sqrt(frequency * (1.0 - frequency) / jnp.maximum(steps, 1.0))
    p99_tpot = tpot + 2.326 * spread * (mixed.time - plain.time) / tau
    longest = workload.input_len * (1.0 - workload.cached_fraction)
    p99_own = smooth_max(longest / chunk, 1.0, sharpness=sharpness, hard=hard) * mixed.time
    wave = workload.first_wave_fraction
    rank = jnp.clip(1.0 - 0.01 / jnp.maximum(wave, 1e-6), 0.0, 1.0)
    burst_wait = rank * running * Ic / rt.max_batched_tokens * burst.time
    p99_ttft = smooth_max(ttft - own_prefill + p99_own + 0.49 * (poll_wait + group_wait),
                          burst_wait + p99_own,
                          sharpness=sharpness, hard=hard)
    return _Phase(requests_per_s=requests_per_s, ttft=ttft, tpot=tpot, e2e=e2e,
                  p99_ttft=p99_ttft, p99_tpot=p99_tpot, power=power, running=running,
                  fit=fit, excess=excess, penalty=penalty, step=step, prefill=frequency,
                  throttle=plain.throttle + frequency * (mixed.throttle - plain.throttle))


def kv_transfer_time(model: Model, chip: Chip, design: Design, layout: Disaggregated,
                     context):
    """Time to move a request's KV cache of `context` tokens (any shape) from a prefill to
    a decode instance (s): the busiest chip's share (`kvcache.kv_transfer_fraction`) sent
    point to point over the scale-up network when both pools fit in one domain, else over
    the scale-out one (`AbstractInterconnect.time`)."""
    pre, dec = layout.prefill, layout.decode
    shard = kv_bytes_per_request(model, context, design.precision.kv_bytes) \
        * kv_transfer_fraction(model, pre, dec)
    return branch(pre.chips + dec.chips <= chip.domain_size,
                  lambda: chip.scale_up.time("p2p", shard, 2),
                  lambda: chip.scale_out.time("p2p", shard, 2))


def _disaggregated(model, chip, workload, design, layout: Disaggregated, concurrency,
                   sharpness, hard, vectorize=False):
    rt, spec = design.runtime, design.speculative
    I, O = workload.mean_input_len, workload.mean_output_len
    tau = spec.tokens_per_step
    dec, pre = layout.decode, layout.prefill
    context = workload.decode_context
    fit, excess, penalty = _memory(model, chip, design, dec, rt.kv_context(workload),
                                   sharpness)
    _, _, pre_penalty = _memory(model, chip, design, pre, I, sharpness)
    per_instance = concurrency / dec.replicas
    # The decode pool's slots per instance (memory and engine caps); the p-norm minimum is
    # associative, so the batch is the same three-way minimum as the aggregated path's.
    slots = smooth_min(jnp.maximum(fit, 1e-3), rt.max_running, sharpness=sharpness, hard=hard)
    running = smooth_min(per_instance, slots, sharpness=sharpness, hard=hard)
    _, plain = _capped_step(model, chip, design, dec,
                            dict(decode_seqs=running / _in_flight(dec, rt),
                                 decode_context=context),
                            sharpness, hard, vectorize)
    tpot = plain.time / tau
    # Prefill pool: prompts (their computed tokens: a cached prefix is reused) batched into
    # chunks of max(Ic, max_batched_tokens).
    Ic, prompt_ctx = workload.computed_input_len, workload.prefill_context
    chunk = smooth_max(Ic, rt.max_batched_tokens, sharpness=sharpness, hard=hard)
    zero = jnp.zeros_like(running)
    batch, single = _capped_steps(model, chip, design, pre, (
        dict(decode_seqs=zero, decode_context=zero, prefill_tokens=chunk,
             prefill_context=prompt_ctx, prefill_seqs=chunk / Ic),
        dict(decode_seqs=zero, decode_context=zero, prefill_tokens=Ic,
             prefill_context=prompt_ctx, prefill_seqs=jnp.ones_like(Ic))), sharpness, hard,
        vectorize)
    prefill_capacity = pre.replicas * _in_flight(pre, rt) * chunk / Ic / batch.time
    transfer = kv_transfer_time(model, chip, design, layout, I)
    ttft_base = rt.request_overhead + rt.admission_steps * plain.time + single.time + transfer
    e2e_base = ttft_base + (O - 1.0) * tpot
    # The decode pool's capacity is what its slots hold, not the requests now in flight:
    # with `running` (<= per_instance) here the capacity sits within ttft / e2e of the
    # demand whenever everything fits, and the smooth minimum below then takes a few per
    # cent off the rate, which the TTFT (e2e less the decode time) receives whole: seconds
    # at 8K-token outputs.
    decode_capacity = dec.replicas * slots / ((O - 1.0) * tpot + tpot)
    # Below saturation a prompt also queues at its prefill instance: Pollaczek-Khinchine for
    # deterministic service (M/D/1), rho / (2 (1 - rho)) prompts ahead, each one prompt's
    # prefill, at the utilisation the demand alone would give (rho held below 0.95; past
    # the knee the closed loop's rate is the capacity and the smooth minimum takes over).
    rho = smooth_min(concurrency / e2e_base / prefill_capacity, 0.95, sharpness=sharpness,
                     hard=hard)
    queue = rho / (2.0 * (1.0 - rho)) * single.time
    demand = concurrency / (e2e_base + queue)
    requests_per_s = smooth_min(demand, prefill_capacity, decode_capacity,
                                sharpness=sharpness, hard=hard)
    e2e = concurrency / requests_per_s
    ttft = e2e - (O - 1.0) * tpot
    utilization = jnp.minimum(requests_per_s / prefill_capacity, 1.0)
    pre_power = average_power(chip.idle_power, batch.dynamic_energy, batch.time, utilization)
    power = (pre.chips * pre_power + dec.chips * plain.power) / layout.chips
    p99_ttft = ttft + (workload.input_len - I) / I * single.time
    return _Phase(requests_per_s=requests_per_s, ttft=ttft, tpot=tpot, e2e=e2e,
                  p99_ttft=p99_ttft, p99_tpot=tpot, power=power, running=running, fit=fit,
                  excess=excess, penalty=penalty + pre_penalty, step=plain.time,
                  prefill=utilization, throttle=plain.throttle)


def _validate(model: Model, chip: Chip, workload: Workload, design: Design):
    if not isinstance(model, Model):
        raise ValueError("model must be a perfmodel Model (see perfmodel.get_model)")
    if not isinstance(chip, Chip):
        raise ValueError("chip must be a perfmodel Chip (see perfmodel.get_chip)")
    if not isinstance(workload, Workload):
        raise ValueError("workload must be a perfmodel Workload")
    if not isinstance(design, Design):
        raise ValueError("design must be a perfmodel Design")
    layout = design.layout
    pools = {"prefill": layout.prefill, "decode": layout.decode} \
        if isinstance(layout, Disaggregated) else {"": layout}
    for name, pool in pools.items():
        if isinstance(pool, LayoutNumbers):
            # Its degrees may be traced: `_check_layout_numbers` checks them (when `check`).
            shapes = {key: getattr(pool, key).shape for key in
                      ("tp", "ep", "pp", "replicas", "dp_attention")}
            if len(set(shapes.values())) > 1:
                where = f"design.layout.{name}" if name else "design.layout"
                raise ValueError(f"{where} (LayoutNumbers) fields must share one shape, got "
                                 f"{shapes}; stack whole layouts (Layout.numbers()) to batch "
                                 "them")
        else:
            check_layout(model, pool)


def check_layout(model: Model, layout: Layout | Disaggregated) -> None:
    """Raise ValueError unless a static layout can hold `model`: ep divides its experts, tp
    splits its heads (`Model.split_problem`), pp is at most its layers (`LayoutNumbers`
    are checked at run time instead, by `predict`)."""
    layouts = [layout] if isinstance(layout, Layout) else [layout.prefill, layout.decode]
    for layout in layouts:
        if isinstance(layout, LayoutNumbers):
            continue
        if model.is_moe and model.num_experts % layout.ep:
            raise ValueError(f"layout ep={layout.ep} must divide the model's "
                             f"{model.num_experts} experts")
        problem = model.split_problem(layout.tp, layout.dp_attention)
        if problem:
            raise ValueError(f"design.layout {layout.describe()}: {problem}")
        if layout.pp > model.num_layers:
            raise ValueError(f"layout pp={layout.pp} exceeds the model's {model.num_layers} "
                             "layers")


#: Run-time checks of traced values: (what it reads, the test it must pass, the message).
#: Each checked value replaces the original in the specs (`_checked`): an unused
#: `eqx.error_if` result is dead code under jit, and its check would silently vanish.
_CHECKS = (
    (lambda w, d, c: w.input_len, lambda x: x > 0, "workload.input_len must be > 0 tokens"),
    (lambda w, d, c: w.output_len, lambda x: x > 1, "workload.output_len must be > 1 token"),
    (lambda w, d, c: w.input_range_ratio, lambda r: (r > 0) & (r <= 1),
     "workload range ratios must lie in (0, 1]"),
    (lambda w, d, c: w.output_range_ratio, lambda r: (r > 0) & (r <= 1),
     "workload range ratios must lie in (0, 1]"),
    (lambda w, d, c: w.output_cv2, lambda x: x >= 0,
     "workload.output_cv2 must be >= 0 (0: outputs at their mean)"),
    (lambda w, d, c: w.cached_fraction, lambda x: (x >= 0) & (x < 1),
     "workload.cached_fraction must lie in [0, 1) (the share of each prompt cached)"),
    (lambda w, d, c: d.concurrency, lambda x: x > 0, "design.concurrency must be > 0"),
    (lambda w, d, c: d.runtime.expert_efficiency, lambda x: (x > 0) & (x <= 1),
     "design.runtime.expert_efficiency must lie in (0, 1]"),
    (lambda w, d, c: d.runtime.kernel_efficiency, lambda x: (x > 0) & (x <= 1),
     "design.runtime.kernel_efficiency must lie in (0, 1]"),
    (lambda w, d, c: d.runtime.pipeline_overlap, lambda x: (x >= 0) & (x <= 1),
     "design.runtime.pipeline_overlap must lie in [0, 1]"),
    (lambda w, d, c: c.hbm_bandwidth, lambda x: x > 0, "chip.hbm_bandwidth must be > 0"),
    (lambda w, d, c: c.peak_flops, lambda x: x > 0, "chip.peak_flops must be > 0"),
)


def _checked(workload: Workload, design: Design, chip: Chip):
    """(workload, design, chip) with every `_CHECKS` value passed through `eqx.error_if`
    (a NaN or infinite value fails its check too)."""
    specs = (workload, design, chip)
    for read, test, message in _CHECKS:
        value = read(*specs)
        checked = error_if(value, ~(test(value) & jnp.isfinite(value)), f"{message}, and finite")
        specs = eqx.tree_at(lambda t, r=read: r(*t), specs, checked)
    return specs


def _split_bad(model: Model, tp):
    """`Model.split_problem` on a possibly traced tp: True where it finds a problem."""
    N, K = model.num_heads, model.num_kv_heads
    ratio = jnp.maximum(jnp.round(tp / N), 1.0)
    bad = jnp.where(tp <= N, jnp.mod(N, tp) != 0,
                    (jnp.mod(tp, N) != 0) | (jnp.mod(model.head_dim, ratio) != 0))
    if model.attention != "mla":
        bad = bad | jnp.where(tp <= K, jnp.mod(K, tp) != 0, jnp.mod(tp, K) != 0)
    return bad & (tp > 1)


def _check_layout_numbers(model: Model, layout: LayoutNumbers,
                          pool: str = "") -> LayoutNumbers:
    """`layout` with its degrees checked by `eqx.error_if` (the checks `Layout` and
    `_validate` make on a static layout, for degrees that may be traced). `pool`
    ("prefill.", "decode." or empty) names the layout in the messages."""
    tp, ep, pp, replicas = layout.tp, layout.ep, layout.pp, layout.replicas

    def count(x):
        return (x >= 1) & (x == jnp.round(x)) & jnp.isfinite(x)

    tp = error_if(tp, ~count(tp), f"design.layout.{pool}tp must be a positive integer")
    ep = error_if(ep, ~count(ep) | (jnp.mod(tp, ep) != 0),
                      f"design.layout.{pool}ep must be a positive integer dividing "
                      f"design.layout.{pool}tp")
    if model.is_moe:
        ep = error_if(ep, jnp.mod(model.num_experts, ep) != 0,
                          f"design.layout.{pool}ep must divide the model's {model.num_experts} "
                          "experts")
    tp = error_if(tp, _split_bad(model, tp) & ~layout.dp_attention,
                      f"design.layout.{pool}tp must split {model.name}'s {model.num_heads} "
                      f"attention and {model.num_kv_heads} KV heads (see Model.split_problem)")
    pp = error_if(pp, ~count(pp) | (pp > model.num_layers),
                      f"design.layout.{pool}pp must be a positive integer at most the model's "
                      f"{model.num_layers} layers")
    replicas = error_if(replicas, ~count(replicas),
                            f"design.layout.{pool}replicas must be a positive integer")
    return LayoutNumbers(tp=tp, ep=ep, pp=pp, replicas=replicas,
                         dp_attention=layout.dp_attention)


#: `predict(unfit=...)` choices: what a design that does not fit in memory returns.
UNFIT_MODES = ("nan", "raise", "value")

#: Metrics that stay numbers when a design does not fit (they say how far it is from fitting).
FIT_FIELDS = ("concurrency", "max_batch", "memory_excess", "memory_penalty", "fits", "steady")


def _unfit(metrics: Metrics, mode: str) -> Metrics:
    """`metrics` under the does-not-fit contract of `predict` (`UNFIT_MODES`)."""
    if mode == "value":
        return metrics
    if mode == "raise":
        fits = error_if(metrics.fits, ~metrics.fits,
                            "the design does not fit in memory: weights, reserve and one "
                            "sequence of KV exceed memory_fraction x capacity per chip "
                            "(see Metrics.memory_excess); use more chips, a deeper pipeline "
                            "or a narrower format")
        return eqx.tree_at(lambda m: m.fits, metrics, fits)
    fields = {}
    for key in COLUMNS:
        value = getattr(metrics, key)
        fields[key] = value if key in FIT_FIELDS else jnp.where(metrics.fits, value, jnp.nan)
    return Metrics(**fields)


def predict(model: Model, chip: Chip, workload: Workload, design: Design, *,
            sharpness=DEFAULT_SHARPNESS, hard: bool = False, check: bool = True,
            vectorize: bool = False, unfit: str = "nan") -> Metrics:
    """Predict steady-state serving metrics of a design.

    Pure JAX: jit, vmap and grad through chip, workload and design leaves.

    Does not fit: a design whose weights, activation reserve and one sequence of KV cache
    exceed the usable memory of a chip (`Metrics.fits` False) has no latency. By default
    (`unfit="nan"`) its latency, throughput and power metrics are NaN, while `fits`,
    `memory_excess`, `memory_penalty`, `max_batch`, `concurrency` and `steady` stay numbers;
    `unfit="raise"` raises instead (`eqx.error_if`; eager and jitted alike); `unfit="value"`
    returns the smooth continuation past the memory limit, which optimizers and fits need
    for their gradients (read `memory_penalty` with it, never the latencies alone).

    Args:
        model: architecture (static).
        chip: accelerator spec.
        workload: request lengths (and optional open-loop rate).
        design: layout, precisions, mapping, speculative decoding, runtime, concurrency.
            An aggregated layout may be static (`Layout`: one compile per layout) or numbers
            (`LayoutNumbers`: traced degrees, one compile for all; vmap over a stack of
            them); both give the same metrics.
        sharpness: p of the smooth max (traced); ignored when `hard`.
        hard: static; exact max/min for reports.
        check: static; raise on invalid traced values (`eqx.error_if`). Sweeps that prefer
            to see flags may turn it off.
        vectorize: static; evaluate each step's operators, and the engine steps of a
            phase, along an array axis (`roofline.step_cost`): the same numbers, faster for a
            single design on CPU (the optimizer's gradient steps), slower under a wide vmap.
        unfit: static; "nan", "raise" or "value" (`UNFIT_MODES`): what a design that does
            not fit returns (above).

    Returns:
        `Metrics`.

    Raises:
        ValueError: structural misuse (before tracing).
        equinox.EquinoxRuntimeError: invalid traced values (a `RuntimeError`, from
            `eqx.error_if`, eager and jitted alike), including `LayoutNumbers` degrees that
            a `Layout` would reject, when `check`.

    Example:
        >>> import perfmodel as pm
        >>> chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-8b")
        >>> design = pm.Design(concurrency=8, layout=pm.Layout(tp=1),
        ...                    precision=pm.precision(chip, model, "fp8"))
        >>> m = pm.predict(model, chip, pm.Workload(1024, 1024), design)
        >>> bool(m.fits) and 50 < float(m.interactivity) < 500
        True
    """
    if unfit not in UNFIT_MODES:
        raise ValueError(f"unfit must be one of {UNFIT_MODES}, got {unfit!r}")
    _validate(model, chip, workload, design)
    if check:
        workload, design, chip = _checked(workload, design, chip)
        if isinstance(design.layout, LayoutNumbers):
            design = eqx.tree_at(lambda d: d.layout, design,
                                 _check_layout_numbers(model, design.layout))
        elif design.disaggregated and not design.layout.static:
            design = eqx.tree_at(lambda d: (d.layout.prefill, d.layout.decode), design, (
                _check_layout_numbers(model, design.layout.prefill, "prefill."),
                _check_layout_numbers(model, design.layout.decode, "decode.")))
    concurrency, steady = design.concurrency, jnp.asarray(True)
    if workload.request_rate is not None:
        concurrency, steady = _open_loop_concurrency(model, chip, workload, design, sharpness,
                                                     hard, vectorize)
    run = _disaggregated if design.disaggregated else _aggregated
    out = run(model, chip, workload, design, design.layout, concurrency, sharpness, hard,
              vectorize)
    chips = design.chips
    I, O = workload.mean_input_len, workload.mean_output_len
    rps = out.requests_per_s
    total = rps * (I + O) / chips
    power = out.power
    return _unfit(Metrics(
        concurrency=concurrency, ttft=out.ttft, tpot=out.tpot,
        interactivity=1.0 / out.tpot, e2e=out.e2e, p99_ttft=out.p99_ttft,
        p99_tpot=out.p99_tpot, throughput_per_chip=total,
        input_throughput_per_chip=rps * I / chips, output_throughput_per_chip=rps * O / chips,
        tok_s_per_kw_tdp=total / (chip.tdp / 1e3),
        tok_s_per_mw_allin=total / (chip.allin_power / 1e6), power_per_chip=power,
        j_per_output_token=power * chips / (rps * O), running_batch=out.running,
        max_batch=out.fit, memory_excess=out.excess, memory_penalty=out.penalty,
        fits=(out.excess <= 0) & (out.fit >= 1.0), decode_step=out.step,
        prefill_fraction=out.prefill, throttle=out.throttle,
        steady=jnp.broadcast_to(steady, jnp.shape(out.e2e))), unfit)


#: Open-loop operating point: relative and absolute tolerance of the fixed point
#: (requests), the most damped iterations tried, and the queue reported when there is no
#: steady state: this many seconds of arrivals in flight (s).
OPEN_LOOP_RTOL, OPEN_LOOP_ATOL, OPEN_LOOP_MAX_STEPS = 1e-7, 1e-9, 512
SATURATED_QUEUE_S = 1e4


def _open_loop_concurrency(model, chip, workload, design, sharpness, hard, vectorize):
    """In-flight requests under Poisson arrivals: the fixed point c = rate * E2E(c)
    (Little's law), by damped iteration (`optimistix.fixed_point`, with its convergence
    test; gradients by the implicit function theorem at the fixed point).

    Past saturation there is no such fixed point (E2E grows faster than c): the iterate is
    held at `SATURATED_QUEUE_S` seconds of arrivals, a queue that says the design does not
    keep up, and `steady` is False.

    Returns:
        (concurrency, steady), elementwise.
    """
    rate = workload.request_rate
    run = _disaggregated if design.disaggregated else _aggregated
    closed = eqx.tree_at(lambda w: w.request_rate, workload, None,
                         is_leaf=lambda x: x is None)
    queue = rate * SATURATED_QUEUE_S

    def little(c):
        return rate * run(model, chip, closed, design, design.layout, c, sharpness, hard,
                          vectorize).e2e

    def damped(c, _):
        return jnp.minimum(0.5 * c + 0.5 * little(c), queue)

    start = jnp.maximum(rate * 1e-3, 1e-3) * jnp.ones_like(design.concurrency)
    solver = optx.FixedPointIteration(rtol=OPEN_LOOP_RTOL, atol=OPEN_LOOP_ATOL)
    c = optx.fixed_point(damped, solver, start, max_steps=OPEN_LOOP_MAX_STEPS,
                         throw=False).value
    # Judged per element (a vector of designs is solved at once): Little's law holds.
    steady = jnp.abs(little(c) / c - 1.0) < 1e-4
    return c, steady


predict_jit = eqx.filter_jit(predict)
