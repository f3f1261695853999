"""A cached prompt prefix (`Workload.cached_fraction`): the prefill computes only the rest,
the KV cache and the decode context keep the whole prompt."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perfmodel as pm

jax.config.update("jax_enable_x64", True)

CHIP = pm.get_chip("h100")
LLAMA = pm.get_model("llama-3.1-8b")


def _predict(cached, layout=None, model=LLAMA, chip=CHIP, isl=8192, osl=256, conc=16.0):
    layout = pm.Layout(tp=1) if layout is None else layout
    design = pm.Design(concurrency=conc, layout=layout, precision=pm.precision(chip, model))
    return pm.predict(model, chip, pm.Workload(isl, osl, cached_fraction=cached), design,
                      hard=True)


def test_workload_splits_the_prompt_into_cached_and_computed_tokens():
    w = pm.Workload(1000, 200, 1.0, 1.0, cached_fraction=0.75)
    assert float(w.computed_input_len) == 250.0
    # The computed tokens attend to the 750 cached ones and, causally, half of the 250.
    assert float(w.prefill_context) == 875.0
    # The running batch still holds the whole prompt.
    assert float(w.decode_context) == float(pm.Workload(1000, 200, 1.0, 1.0).decode_context)
    assert float(w.closed_loop(500, 100).cached_fraction) == 0.75


def test_a_cached_prefix_shortens_the_prefill_and_keeps_the_kv_cache():
    """8K prompts, three quarters cached: a quarter of the prompt is computed, each token
    attending to 7K of context (against 8K tokens over 4K), so TTFT falls to well under half;
    the memory fit (whole prompts' KV) is unchanged; fewer prompt tokens share the steps,
    so TPOT does not rise and throughput (input tokens counted whole) rises."""
    cold, warm = _predict(0.0), _predict(0.75)
    assert float(warm.ttft) < 0.5 * float(cold.ttft)
    assert float(warm.tpot) <= float(cold.tpot)
    assert float(warm.throughput_per_chip) > float(cold.throughput_per_chip)
    assert float(warm.max_batch) == float(cold.max_batch)


def test_nothing_cached_prices_the_prompt_as_before_the_field_existed():
    """At 0 the steady state is the one before `cached_fraction` existed: TTFT, TPOT and
    throughput of this case as `predict` gave them at `b2169c1` (the commit before the
    field), to the last bits. (A refit of the shipped latency fit moves them: re-record
    them from the parent of the refit's commit with the refit's `perfmodel/data/fitted_*`
    files; last re-recorded at `67b5c8d` for the refit without the stalled runs' throughput.)"""
    out = _predict(0.0)
    assert float(out.ttft) == pytest.approx(0.23240998716293948, rel=1e-12)
    assert float(out.tpot) == pytest.approx(0.026435320823337338, rel=1e-12)
    assert float(out.throughput_per_chip) == pytest.approx(19319.918318194443, rel=1e-12)


def test_a_disaggregated_prefill_pool_serves_more_prompts_when_they_are_cached():
    """A prefill-bound pair of pools (one TP2 prefill worker for a TP8 decode worker, 8K
    prompts): with half of each prompt cached the prefill pool admits more, so the rate
    rises and TTFT falls."""
    layout = pm.Disaggregated(prefill=pm.Layout(tp=2), decode=pm.Layout(tp=8))
    model = pm.get_model("llama-3.1-70b")
    cold, warm = (_predict(c, layout, model, conc=256.0, osl=512) for c in (0.0, 0.5))
    assert float(warm.ttft) < float(cold.ttft)
    assert float(warm.throughput_per_chip) > 1.2 * float(cold.throughput_per_chip)


def test_ttft_falls_with_the_cached_share_and_its_gradient_is_finite():
    def ttft(h):
        return _predict(h).ttft

    grad = jax.grad(ttft)(jnp.asarray(0.5))
    assert np.isfinite(float(grad)) and float(grad) < 0.0
    step = 1e-4
    fd = (float(ttft(0.5 + step)) - float(ttft(0.5 - step))) / (2 * step)
    assert float(grad) == pytest.approx(fd, rel=1e-4)


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5])
def test_a_cached_share_outside_zero_to_one_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="cached_fraction"):
        pm.Workload(1024, 128, cached_fraction=bad)
