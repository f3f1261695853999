"""Hypothesis properties of the serving model (STYLE.md "Tests"):

- more HBM bandwidth or FLOP/s never slows a step, nor raises TPOT;
- a step never gets faster with more sequences or more context, and TPOT never falls as
  concurrency grows, nor as the prompt grows while the batch fits in memory;
- no NaN or inf in any metric or gradient across the valid domain (including designs whose
  weights do not fit and power caps that bind).

Designs that do not fit are evaluated with `unfit="value"` (the smooth continuation that
optimizers and fits differentiate; by default `predict` makes their latencies NaN).

Numbers are passed as float64 arrays to the suite's shared jitted functions, so examples
reuse one compiled program per case instead of recompiling.

Why TPOT vs prompt length only while the batch fits: once the KV cache caps the running batch,
a longer prompt means fewer running sequences over the same full cache; each step then reads
about the same bytes but multiplies fewer rows, so TPOT may fall (and the wait moves into
TTFT, which rises). The step-level property (more context never speeds a step) holds
everywhere and is tested without that restriction.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from test_core_cases import (
    OUTPUTS,
    arr,
    case,
    from_theta,
    gradient,
    step_cost_jit,
    tangent,
    to_theta,
)

import perfmodel as pm

SLACK = 1e-12   # relative float64 noise allowed in "never" comparisons


def _step_time(name, chip, seqs, context, prefill):
    model, _, _, design = case(name)
    # Prefill chunks attend to half their prompt; one request per chunk of `prefill` tokens.
    return float(step_cost_jit(model, chip, design, design.layout, arr(seqs), arr(context),
                               arr(prefill), arr(prefill / 2), arr(prefill > 0)).time)


def _predict(name, chip=None, concurrency=None, input_len=None):
    model, chip0, workload, design = case(name)
    if concurrency is not None:
        design = eqx.tree_at(lambda d: d.concurrency, design, arr(concurrency))
    if input_len is not None:
        workload = eqx.tree_at(lambda w: w.input_len, workload, arr(input_len))
    return pm.predict_jit(model, chip if chip is not None else chip0, workload, design,
                          unfit="value")


def _scaled(chip, bandwidth=1.0, flops=1.0):
    return eqx.tree_at(lambda c: (c.hbm_bandwidth, c.peak_flops), chip,
                       (chip.hbm_bandwidth * bandwidth, chip.peak_flops * flops))


step_inputs = dict(seqs=st.floats(1.0, 2048.0), context=st.floats(16.0, 131072.0),
                   prefill=st.one_of(st.just(0.0), st.floats(1.0, 16384.0)))


@settings(max_examples=20)
@given(name=st.sampled_from(["dense", "moe"]), bandwidth=st.floats(1.0, 10.0),
       flops=st.floats(1.0, 10.0), **step_inputs)
def test_faster_chip_never_slows_a_step(name, bandwidth, flops, seqs, context, prefill):
    chip = case(name)[1]
    base = _step_time(name, chip, seqs, context, prefill)
    assert _step_time(name, _scaled(chip, bandwidth=bandwidth), seqs, context, prefill) \
        <= base * (1 + SLACK)
    assert _step_time(name, _scaled(chip, flops=flops), seqs, context, prefill) \
        <= base * (1 + SLACK)


@pytest.mark.slow   # compiles for 10 s or more (CI's slow stage runs it)
@settings(max_examples=15)
@given(name=st.sampled_from(["dense", "moe", "disagg"]), bandwidth=st.floats(1.0, 10.0),
       flops=st.floats(1.0, 10.0), concurrency=st.floats(1.0, 4096.0))
def test_faster_chip_never_raises_tpot(name, bandwidth, flops, concurrency):
    chip = case(name)[1]
    base = float(_predict(name, concurrency=concurrency).tpot)
    for faster in (_scaled(chip, bandwidth=bandwidth), _scaled(chip, flops=flops)):
        assert float(_predict(name, chip=faster, concurrency=concurrency).tpot) \
            <= base * (1 + SLACK)


@settings(max_examples=20)
@given(name=st.sampled_from(["dense", "moe"]), more=st.floats(1.0, 64.0), **step_inputs)
def test_more_sequences_or_context_never_speed_a_step(name, more, seqs, context, prefill):
    chip = case(name)[1]
    base = _step_time(name, chip, seqs, context, prefill)
    assert _step_time(name, chip, seqs * more, context, prefill) >= base * (1 - SLACK)
    assert _step_time(name, chip, seqs, context * more, prefill) >= base * (1 - SLACK)


@settings(max_examples=20)
@pytest.mark.slow
@given(name=st.sampled_from(["dense", "moe", "mtp", "pipeline", "disagg"]),
       low=st.floats(1.0, 8192.0), factor=st.floats(1.0, 8.0))
def test_tpot_never_falls_as_concurrency_grows(name, low, factor):
    """In every regime, memory-capped included (the running batch saturates, TPOT with it)."""
    assert float(_predict(name, concurrency=low * factor).tpot) \
        >= float(_predict(name, concurrency=low).tpot) * (1 - SLACK)


@pytest.mark.slow
@settings(max_examples=20)
@given(name=st.sampled_from(["dense", "moe", "mtp", "pipeline", "disagg"]),
       concurrency=st.floats(1.0, 128.0), short=st.floats(64.0, 8192.0),
       factor=st.floats(1.0, 4.0))
def test_tpot_never_falls_as_the_prompt_grows(name, concurrency, short, factor):
    longer = _predict(name, concurrency=concurrency, input_len=short * factor)
    # The regime of the property (module docstring): the running batch is not memory-capped.
    assume(float(longer.running_batch) < 0.5 * float(longer.max_batch))
    shorter = _predict(name, concurrency=concurrency, input_len=short)
    assert float(longer.tpot) >= float(shorter.tpot) * (1 - SLACK)
    assert float(longer.ttft) >= float(shorter.ttft) * (1 - SLACK)


# -- finiteness across the valid domain --------------------------------------------------------
valid_theta = dict(
    concurrency=st.floats(0.1, 1e5), input_len=st.floats(1.0, 262144.0),
    output_len=st.floats(2.0, 65536.0), bandwidth=st.floats(0.1, 10.0),
    flops=st.floats(0.1, 10.0), capacity=st.floats(0.05, 4.0), tdp=st.floats(0.2, 3.0),
    acceptance=st.floats(0.01, 0.99), step_overhead=st.floats(1e-7, 0.1),
    efficiency=st.floats(0.05, 1.0))


def _theta(name, concurrency, input_len, output_len, bandwidth, flops, capacity, tdp,
           acceptance, step_overhead, efficiency):
    theta = dict(to_theta(name))
    log = lambda x: arr(np.log(x))  # noqa: E731
    theta.update(concurrency=log(concurrency), input_len=log(input_len),
                 output_len=log(output_len), step_overhead=log(step_overhead),
                 acceptance=arr(np.log(acceptance) - np.log1p(-acceptance)),
                 compute_max=log(efficiency), bandwidth_max=log(efficiency))
    # Idle power scales with TDP, so it stays below it; a small TDP makes the power cap bind.
    for key, scale in (("hbm_bandwidth", bandwidth), ("peak_flops", flops),
                       ("hbm_capacity", capacity), ("tdp", tdp), ("idle_power", tdp)):
        theta[key] = theta[key] + np.log(scale)
    return theta


def _all_finite(tree):
    return all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree_util.tree_leaves(tree))


@pytest.mark.slow   # compiles for 10 s or more (CI's slow stage runs it)
@settings(max_examples=12)
@given(name=st.sampled_from(["dense", "moe", "mtp", "pipeline", "disagg"]),
       seed=st.integers(0, 2**31 - 1), **valid_theta)
# Regression: at high load every step carries a prefill chunk (frequency = 1), where the p99
# TPOT spread sqrt(f (1 - f)) had an infinite derivative and the gradient was NaN.
@example(name="dense", seed=0, concurrency=4096.0, input_len=1024.0, output_len=1024.0,
         bandwidth=1.0, flops=1.0, capacity=1.0, tdp=1.0, acceptance=0.7,
         step_overhead=1e-3, efficiency=0.75)
def test_no_nan_or_inf_in_values_or_gradients(name, seed, **draws):
    theta = _theta(name, **draws)
    chip, design, workload = from_theta(name, theta)
    assert float(chip.idle_power) < float(chip.tdp)
    metrics = pm.predict_jit(case(name)[0], chip, workload, design, unfit="value")
    assert _all_finite(metrics), metrics
    rng = np.random.default_rng(seed)
    if name in ("dense", "moe", "mtp"):   # reverse mode compiled for these (test_gradients)
        weights = arr(rng.standard_normal(len(OUTPUTS)))
        assert _all_finite(gradient(name, theta, weights))
    else:
        direction = {k: arr(rng.standard_normal(np.shape(v))) for k, v in theta.items()}
        assert _all_finite(tangent(name, theta, direction))
