"""Invalid specs always raise the documented error (STYLE.md "Errors"):

1. structural misuse raises `ValueError` before anything is traced, naming the field;
2. invalid traced values are caught by `eqx.error_if` in `predict`, which raises
   `equinox.EquinoxRuntimeError` (a `RuntimeError`) both eagerly and under jit.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_cases import arr, case

import perfmodel as pm
from perfmodel.design import SliceMapping


def _model(**overrides):
    spec = dict(name="toy", num_layers=4, hidden=256, num_heads=8, num_kv_heads=2,
                head_dim=32, dense_ffn=512, vocab=1000)
    spec.update(overrides)
    return pm.Model(**spec)


@pytest.mark.parametrize("build, field", [
    (lambda: pm.Layout(tp=0), "tp"),
    (lambda: pm.Layout(tp=8, pp=-1), "pp"),
    (lambda: pm.Layout(tp=2, replicas=0), "replicas"),
    (lambda: pm.Layout(tp=6, ep=4), "ep"),
    (lambda: pm.Layout(tp=2.0), "tp"),
    (lambda: pm.precision(pm.get_chip("h100"), pm.get_model("llama-3.1-8b"), "fp5"),
     "format"),
    (lambda: pm.precision(pm.get_chip("h100"), pm.get_model("llama-3.1-8b"), kv="int3"),
     "format"),
    (lambda: pm.Precision(weight_bytes=1.0, expert_bytes=1.0, kv_bytes=1.0,
                          activation_bytes=2.0, weight_compute=[1.0, 0.0, 0.0],
                          expert_compute=[1.0, 0.0, 0.0, 0.0],
                          attention_compute=[1.0, 0.0, 0.0, 0.0]), "weight_compute"),
    (lambda: pm.mapping(weights="striped"), "weights"),
    (lambda: SliceMapping(weights=[1.0, 0.0]), "weights"),
    (lambda: _model(num_kv_heads=3), "num_kv_heads"),
    (lambda: _model(num_layers=0), "num_layers"),
    (lambda: _model(attention="mqa"), "attention"),
    (lambda: _model(attention="mla"), "MLA"),
    (lambda: _model(num_experts=8, experts_per_token=9, moe_ffn=64), "experts_per_token"),
    (lambda: _model(num_sliding_layers=2), "sliding_window"),
    (lambda: _model(num_sliding_layers=5, sliding_window=64), "num_sliding_layers"),
    (lambda: pm.from_hf_config({"model_type": "llama", "num_hidden_layers": 2}),
     "hidden_size"),
    (lambda: pm.from_datasheet("x", bf16_tflops=100, hbm_gb=80, hbm_tb_s=0.0,
                               scaleup_gb_s=100, tdp_w=300), "hbm_tb_s"),
    (lambda: pm.from_datasheet("x", bf16_tflops=100, hbm_gb=80, hbm_tb_s=1.0,
                               scaleup_gb_s=100, tdp_w=300, scaleup_topology="mesh"),
     "topology"),
    (lambda: pm.from_datasheet("x", bf16_tflops=100, hbm_gb=80, hbm_tb_s=1.0,
                               scaleup_gb_s=100, tdp_w=300, fp4_flavor="fp4e3"), "fp4_flavor"),
    (lambda: pm.Switch(bandwidth=1e9, latency=1e-6).time("gather", 1.0, 4), "collective"),
    (lambda: pm.get_chip("tpu-v99"), "valid chips"),
    (lambda: pm.get_model("gpt-5"), "valid models"),
])
def test_structural_misuse_raises_value_error(build, field):
    with pytest.raises(ValueError, match=field):
        build()


@pytest.mark.parametrize("fn", [pm.predict, pm.predict_jit])
def test_predict_structural_errors_raise_before_tracing(fn):
    moe_model, moe_chip, moe_workload, moe_design = case("moe")
    with pytest.raises(ValueError, match="ep=3"):   # 256 experts do not split 3 ways
        fn(moe_model, moe_chip, moe_workload,
           eqx.tree_at(lambda d: d.layout, moe_design, pm.Layout(tp=3, ep=3)))
    model, chip, workload, design = case("dense")
    with pytest.raises(ValueError, match="pp=81"):
        fn(model, chip, workload, eqx.tree_at(lambda d: d.layout, design, pm.Layout(pp=81)))
    with pytest.raises(ValueError, match="model must be"):
        fn("llama-3.1-70b", chip, workload, design)
    with pytest.raises(ValueError, match="chip must be"):
        fn(model, "h200", workload, design)


# Each invalid traced value: (where in (model, chip, workload, design), message fragment).
INVALID = {
    "concurrency": (lambda a: a[3].concurrency, "design.concurrency"),
    "input_len": (lambda a: a[2].input_len, "workload.input_len"),
    "output_len": (lambda a: a[2].output_len, "workload.output_len"),
    "hbm_bandwidth": (lambda a: a[1].hbm_bandwidth, "chip.hbm_bandwidth"),
    "input_range_ratio": (lambda a: a[2].input_range_ratio, "range ratios"),
    # (The experts' efficiency only enters a MoE model's step: see KIND.)
    "expert_efficiency": (lambda a: a[3].runtime.expert_efficiency,
                          "runtime.expert_efficiency"),
    "kernel_efficiency": (lambda a: a[3].runtime.kernel_efficiency,
                          "runtime.kernel_efficiency"),
    "pipeline_overlap": (lambda a: a[3].runtime.pipeline_overlap, "runtime.pipeline_overlap"),
}
#: The case each field is checked on (default "dense").
KIND = {"expert_efficiency": "moe"}
bad_values = {
    "concurrency": st.one_of(st.floats(-1e6, 0.0), st.just(float("nan")),
                             st.just(float("inf"))),
    "input_len": st.one_of(st.floats(-1e6, 0.0), st.just(float("nan"))),
    "output_len": st.one_of(st.floats(-1e6, 1.0), st.just(float("nan"))),
    "hbm_bandwidth": st.one_of(st.floats(-1e12, 0.0), st.just(float("nan"))),
    "input_range_ratio": st.one_of(st.floats(-2.0, 0.0), st.just(float("nan")),
                                   st.floats(1.0, 10.0, exclude_min=True)),
    "expert_efficiency": st.one_of(st.floats(-2.0, 0.0), st.just(float("nan")),
                                   st.floats(1.0, 10.0, exclude_min=True)),
    "kernel_efficiency": st.one_of(st.floats(-2.0, 0.0), st.just(float("nan")),
                                   st.floats(1.0, 10.0, exclude_min=True)),
    "pipeline_overlap": st.one_of(st.floats(-2.0, 0.0, exclude_max=True),
                                  st.just(float("nan")),
                                  st.floats(1.0, 10.0, exclude_min=True)),
}


@pytest.mark.slow
@settings(max_examples=15)
@given(data=st.data(), field=st.sampled_from(sorted(INVALID)), jitted=st.booleans())
def test_invalid_values_raise_equinox_runtime_error(data, field, jitted):
    value = data.draw(bad_values[field])
    where, message = INVALID[field]
    args = eqx.tree_at(where, case(KIND.get(field, "dense")), arr(value))
    fn = pm.predict_jit if jitted else pm.predict
    with pytest.raises(eqx.EquinoxRuntimeError, match=message):
        fn(*args)


@pytest.mark.parametrize("jitted", [False, True])
def test_nonpositive_peak_flops_raises(jitted):
    model, chip, workload, design = case("dense")
    chip = eqx.tree_at(lambda c: c.peak_flops, chip, chip.peak_flops.at[2].set(0.0))
    fn = pm.predict_jit if jitted else pm.predict
    with pytest.raises(eqx.EquinoxRuntimeError, match="peak_flops"):
        fn(model, chip, workload, design)


def test_equinox_runtime_error_is_a_runtime_error():
    assert issubclass(eqx.EquinoxRuntimeError, RuntimeError)


def test_valid_boundary_values_do_not_raise():
    """The checks are not over-eager: the smallest valid values pass (and stay finite)."""
    model, chip, workload, design = case("dense")
    workload = eqx.tree_at(lambda w: (w.input_len, w.output_len, w.input_range_ratio),
                           workload, (arr(1.0), arr(1.5), arr(1.0)))
    design = eqx.tree_at(lambda d: d.concurrency, design, arr(1e-3))
    m = pm.predict_jit(model, chip, workload, design)
    assert np.isfinite(float(m.tpot)) and np.isfinite(float(m.ttft))
    assert bool(jnp.all(jnp.isfinite(m.throughput_per_chip)))


@pytest.mark.parametrize("value, shown", [(-1.0, "got -1.0"), (float("nan"), "got nan"),
                                          (float("inf"), "got inf")])
def test_eager_errors_point_at_the_call_and_name_the_value(value, shown):
    """Eagerly, a failed run-time check is raised by the call that failed (after a valid
    one), with the offending value and none of equinox's "stack inside of JIT" text."""
    import traceback

    model, chip, workload, design = case("dense")
    pm.predict(model, chip, workload, design)   # a valid call first
    bad = eqx.tree_at(lambda c: c.hbm_bandwidth, chip, arr(value))
    with pytest.raises(eqx.EquinoxRuntimeError) as info:
        pm.predict(model, bad, workload, design)
    text = str(info.value)
    assert text.startswith("chip.hbm_bandwidth must be > 0, and finite") and shown in text
    assert "inside of JIT" not in text and "EQX_ON_ERROR" not in text
    frames = [f for f in traceback.extract_tb(info.tb) if f.filename == __file__]
    assert frames and frames[-1].line == "pm.predict(model, bad, workload, design)"


def test_traced_errors_say_nan_and_infinity_fail():
    model, chip, workload, design = case("dense")
    bad = eqx.tree_at(lambda c: c.hbm_bandwidth, chip, arr(float("nan")))
    with pytest.raises(eqx.EquinoxRuntimeError, match="> 0, and finite"):
        pm.predict_jit(model, bad, workload, design)


def test_under_jax_jit_the_message_still_names_the_field():
    """Under plain `jax.jit` (not `eqx.filter_jit`) JAX wraps a failed check in its own
    callback error; the README says so, and the field's message is still in it."""
    import jax

    model, chip, workload, design = case("dense")
    f = jax.jit(lambda bw: pm.predict(model, eqx.tree_at(lambda c: c.hbm_bandwidth, chip, bw),
                                      workload, design).tpot)
    with pytest.raises(RuntimeError, match="chip.hbm_bandwidth must be > 0, and finite"):
        f(arr(-1.0))
