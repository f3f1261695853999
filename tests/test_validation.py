"""Invalid specs are refused when they are built: a `TypeError` or `ValueError` naming the
field, never a silent clip, a NaN or a negative latency later (issue 24's examples, then a
hypothesis fuzz of invalid values across the public constructors)."""

import dataclasses
import math

import equinox as eqx
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import perfmodel as pm
import perfmodel.serving
import perfmodel.sweep

DATASHEET = dict(bf16_tflops=1000, hbm_gb=80, hbm_tb_s=3.0, scaleup_gb_s=450, tdp_w=700)


def _precision():
    return pm.precision(pm.get_chip("h100"), pm.get_model("llama-3.1-8b"))


def _design(**overrides):
    chip, model = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
    fields = dict(concurrency=8, layout=pm.Layout(tp=1), precision=pm.precision(chip, model))
    return pm.Design(**{**fields, **overrides})


# (what is built, the words its error names); each returned a result before.
EXAMPLES = [
    (lambda: pm.Workload(8192, 1024, request_rate=-5), "Workload.request_rate"),
    (lambda: pm.Workload(0.5, 1024), "Workload.input_len"),
    (lambda: pm.Workload("8192", 1024), "Workload.input_len"),
    (lambda: pm.Workload(None, 1024), "Workload.input_len"),
    (lambda: pm.Workload(8192, 1024, input_range_ratio=1.5), "Workload.input_range_ratio"),
    (lambda: pm.Runtime(request_overhead=-1), "Runtime.request_overhead"),
    (lambda: pm.Runtime(admission_steps=-10), "Runtime.admission_steps"),
    (lambda: pm.Runtime(max_running=0), "Runtime.max_running"),
    (lambda: pm.Runtime(memory_fraction=1.5), "Runtime.memory_fraction"),
    (lambda: pm.Runtime(activation_reserve=-1e9), "Runtime.activation_reserve"),
    (lambda: pm.Runtime(step_overhead=-1e-3), "Runtime.step_overhead"),
    (lambda: pm.SpecDecode(draft_tokens=2, acceptance=math.nan), "SpecDecode.acceptance"),
    (lambda: pm.SpecDecode(draft_tokens=-1), "SpecDecode.draft_tokens"),
    (lambda: pm.SpecDecode(draft_tokens=2, draft_layers=-1), "SpecDecode.draft_layers"),
    (lambda: pm.Switch(bandwidth=0.0, latency=1e-6), "Switch.bandwidth"),
    (lambda: pm.Ring(bandwidth=1e11, latency=-1e-6), "Ring.latency"),
    (lambda: pm.Torus(bandwidth=1e11, latency=1e-6, dims=(0, 0)), "Torus.dims"),
    (lambda: pm.from_datasheet("x", **DATASHEET, idle_w=math.nan), "Chip.idle_power"),
    (lambda: pm.from_datasheet("x", **DATASHEET, idle_w=800), "idle_power"),
    (lambda: pm.from_datasheet("x", **{**DATASHEET, "tdp_w": 0}), "tdp_w"),
    (lambda: pm.from_datasheet("x", **DATASHEET, num_slices=0), "Chip.num_slices"),
    (lambda: pm.from_datasheet("x", **DATASHEET, domain_size=2.7), "domain_size"),
    (lambda: pm.Efficiency(compute_max=0.0, bandwidth_max=0.0, attention_max=0.0),
     "Efficiency.compute_max"),
    (lambda: pm.Efficiency(memory_latency=-1e-6), "Efficiency.memory_latency"),
    (lambda: pm.EnergyCoefficients(per_hbm_byte=-1e-12), "EnergyCoefficients.per_hbm_byte"),
    (lambda: _design(layout="tp8"), "Design.layout"),
    (lambda: _design(precision=None), "Design.precision"),
    (lambda: _design(runtime=None), "Design.runtime"),
    (lambda: _design(concurrency=-1), "Design.concurrency"),
    (lambda: pm.Layout(tp=True), "Layout.tp"),
    (lambda: pm.precision(pm.get_chip("h100"), pm.get_model("llama-3.1-8b"), weights=8),
     "weights"),
    (lambda: pm.precision(pm.get_chip("h100"), pm.get_model("llama-3.1-8b"),
                          attention="fp3"), "attention"),
    # Formats the chip does not compute, unless emulated (weight-only quantization).
    (lambda: pm.precision(pm.get_chip("a100"), pm.get_model("llama-3.1-8b"), "fp8"),
     "emulate=True"),
    (lambda: pm.precision(pm.get_chip("h100"), pm.get_model("gpt-oss-120b"), "nvfp4"),
     "does not compute nvfp4"),
    (lambda: pm.precision(pm.get_chip("a100"), pm.get_model("llama-3.1-8b"),
                          attention="fp8"), "emulate=True"),
    (lambda: dataclasses.replace(_precision(), weight_bytes=-1.0), "Precision.weight_bytes"),
    (lambda: dataclasses.replace(_precision(), weight_compute=[0.5, 0.2, 0.0, 0.0]),
     "Precision.weight_compute must be probabilities"),
    (lambda: pm.SliceMapping(kv=[0.2, 0.2, 0.2]), "SliceMapping.kv must be probabilities"),
]


@pytest.mark.parametrize("build, field", EXAMPLES, ids=[f for _, f in EXAMPLES])
def test_invalid_specs_are_refused_naming_the_field(build, field):
    with pytest.raises((TypeError, ValueError)) as info:
        build()
    assert field in str(info.value)


#: Per constructor: (build from keyword overrides, {field: (valid range test, invalid
#: values strategy)}).
def _numbers_outside(low, high, low_open, high_open):
    below = st.floats(max_value=low, exclude_max=not low_open, allow_nan=False) \
        if low > -math.inf else st.nothing()
    above = st.floats(min_value=high, exclude_min=not high_open, allow_nan=False) \
        if high < math.inf else st.nothing()
    return st.one_of(below, above, st.just(math.nan), st.just(-math.inf),
                     st.sampled_from(["1", "x", None, b"2", True]))


FIELDS = {
    "Workload": (lambda **k: pm.Workload(**{"input_len": 1024, "output_len": 256, **k}), {
        "input_len": (1, math.inf, False, False), "output_len": (1, math.inf, True, False),
        "input_range_ratio": (0, 1, True, False), "output_range_ratio": (0, 1, True, False),
        "first_wave_fraction": (0, 1, False, False), "request_rate": (0, math.inf, True, False),
    }),
    "Runtime": (lambda **k: pm.Runtime(**k), {
        "step_overhead": (0, math.inf, False, False), "seq_overhead": (0, math.inf, False, False),
        "request_overhead": (0, math.inf, False, False),
        "admission_steps": (0, math.inf, False, False),
        "dp_admission_steps": (0, math.inf, False, False),
        "dp_sync_time": (0, math.inf, False, False),
        "poll_steps": (1, math.inf, False, False), "stream_time": (0, math.inf, False, False),
        "activation_reserve": (0, math.inf, False, False),
        "max_batched_tokens": (1, math.inf, False, False),
        "memory_fraction": (0, 1, True, False), "expert_efficiency": (0, 1, True, False),
        "kernel_efficiency": (0, 1, True, False), "pipeline_overlap": (0, 1, False, False),
    }),
    "SpecDecode": (lambda **k: pm.SpecDecode(**k), {
        "draft_tokens": (0, math.inf, False, False), "draft_layers": (0, math.inf, False, False),
        "acceptance": (0, 1, False, True),
    }),
    "Efficiency": (lambda **k: pm.Efficiency(**k), {
        "compute_max": (0, 1, True, False), "compute_rows_half": (0, math.inf, True, False),
        "bandwidth_max": (0, 1, True, False), "memory_latency": (0, math.inf, False, False),
        "kernel_overhead": (0, math.inf, False, False), "attention_max": (0, 1, True, False),
    }),
    "Switch": (lambda **k: pm.Switch(**{"bandwidth": 1e11, "latency": 1e-6, **k}), {
        "bandwidth": (0, math.inf, True, False), "latency": (0, math.inf, False, False),
        "efficiency": (0, 1, True, False), "base_latency": (0, math.inf, False, False),
    }),
    "Ring": (lambda **k: pm.Ring(**{"bandwidth": 1e11, "latency": 1e-6, **k}), {
        "bandwidth": (0, math.inf, True, False), "latency": (0, math.inf, False, False),
        "efficiency": (0, 1, True, False), "base_latency": (0, math.inf, False, False),
    }),
    "EnergyCoefficients": (lambda **k: pm.EnergyCoefficients(**k), {
        "per_flop": (0, math.inf, False, False), "per_hbm_byte": (0, math.inf, False, False),
        "per_link_byte": (0, math.inf, False, False),
        "active_power": (0, math.inf, False, False),
    }),
    "Design": (lambda **k: _design(**k), {"concurrency": (0, math.inf, True, False)}),
    "Precision": (lambda **k: dataclasses.replace(_precision(), **k), {
        "weight_bytes": (0, math.inf, True, False), "expert_bytes": (0, math.inf, True, False),
        "kv_bytes": (0, math.inf, True, False),
        "activation_bytes": (0, math.inf, False, False),
    }),
    "from_datasheet": (lambda **k: pm.from_datasheet("x", **{**DATASHEET, **k}), {
        "tdp_w": (0, math.inf, True, False), "hbm_tb_s": (0, math.inf, True, False),
        "hbm_gb": (0, math.inf, True, False), "bf16_tflops": (0, math.inf, True, False),
        "idle_w": (0, 700, False, True),
    }),
}


TOY = dict(name="toy", num_layers=4, hidden=256, num_heads=8, num_kv_heads=2, head_dim=32,
           dense_ffn=512, vocab=1000)


def _counts_outside(low):
    """Invalid values of an integer field whose valid values are integers >= `low`."""
    return st.one_of(st.integers(max_value=low - 1), st.floats(allow_nan=True),
                     st.sampled_from(["4", "x", None, b"2", True, False]))


#: Integer fields: (build from keyword overrides, {field: lowest valid value}).
COUNTS = {
    "Model": (lambda **k: pm.Model(**{**TOY, **k}), {
        "num_layers": 1, "hidden": 1, "num_heads": 1, "num_kv_heads": 1, "head_dim": 1,
        "vocab": 1, "dense_ffn": 0, "num_experts": 0, "moe_ffn": 0, "sliding_window": 0,
        "max_context": 0, "num_shared_experts": 0, "first_dense_layers": 0,
        "moe_layer_step": 1, "mtp_layers": 0, "kv_lora_rank": 0}),
    "Layout": (lambda **k: pm.Layout(**k), {"tp": 1, "ep": 1, "pp": 1, "replicas": 1}),
}


#: Fields where None is valid: no open-loop rate, the default idle power.
NONE_MEANS_DEFAULT = {"request_rate", "idle_w"}


@st.composite
def invalid(draw):
    name = draw(st.sampled_from(sorted(FIELDS) + sorted(COUNTS)))
    if name in COUNTS:
        build, fields = COUNTS[name]
        field = draw(st.sampled_from(sorted(fields)))
        value = draw(_counts_outside(fields[field]).filter(
            lambda v: not (isinstance(v, float) and v.is_integer() and v >= fields[field])))
        return name, build, field, value
    build, fields = FIELDS[name]
    field = draw(st.sampled_from(sorted(fields)))
    value = draw(_numbers_outside(*fields[field]).filter(
        lambda v: v is not None or field not in NONE_MEANS_DEFAULT))
    return name, build, field, value


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, derandomize=True)
@given(invalid())
def test_fuzz_invalid_values_are_refused(case):
    name, build, field, value = case
    with pytest.raises((TypeError, ValueError)) as info:
        build(**{field: value})
    text = str(info.value)
    # from_datasheet names its own argument, or the Chip field it fills.
    chip_field = {"tdp_w": "tdp", "hbm_tb_s": "hbm_bandwidth", "hbm_gb": "hbm_capacity",
                  "bf16_tflops": "peak_flops", "idle_w": "idle_power"}.get(field, field)
    assert field in text or chip_field in text, (name, field, value, text)


def _numeric_fields():
    """(spec, field) for every field converted by `checks.as_number`: a spec that adds a
    number field without a range rule fails here."""
    import dataclasses

    from perfmodel.checks import as_number

    chip = pm.get_chip("h100")
    specs = [pm.Workload(1024, 256), pm.Runtime(), pm.SpecDecode(), pm.Efficiency(),
             pm.EnergyCoefficients(), chip, chip.scale_up, pm.Ring(1e11, 1e-6),
             pm.Torus(1e11, 1e-6), _design(), _precision()]
    return [pytest.param(spec, f.name, id=f"{type(spec).__name__}.{f.name}")
            for spec in specs for f in dataclasses.fields(spec)
            if f.metadata.get("converter") is as_number]


@pytest.mark.parametrize("spec, field", _numeric_fields())
def test_every_number_field_is_checked(spec, field):
    import dataclasses

    with pytest.raises(TypeError, match=f"{type(spec).__name__}.{field} must be a number"):
        dataclasses.replace(spec, **{field: "x"})


def _predict(model_name, layout, chips=None):
    chip, model = pm.get_chip("h200"), pm.get_model(model_name)
    design = pm.Design(concurrency=8, layout=layout, precision=pm.precision(chip, model))
    return pm.predict(model, chip, pm.Workload(1024, 256), design)


@pytest.mark.parametrize("model_name, layout, words", [
    ("llama-3.1-70b", pm.Layout(tp=3), "tp=3 does not divide"),       # 64 heads, 8 KV
    ("llama-4-scout", pm.Layout(tp=16), "40 attention heads"),
    ("mixtral-8x22b", pm.Layout(tp=32), "48 attention heads"),
    ("qwen3-32b", pm.Layout(tp=96), "does not split them evenly"),
])
def test_layouts_that_cannot_split_the_heads_are_refused(model_name, layout, words):
    with pytest.raises(ValueError, match=words):
        _predict(model_name, layout)


@pytest.mark.parametrize("model_name, layout", [
    ("llama-3.1-70b", pm.Layout(tp=16)),    # KV heads replicated past 8
    ("llama-3.1-70b", pm.Layout(tp=128)),   # past the heads: each head split in two
    ("llama-4-maverick", pm.Layout(tp=16, ep=16, dp_attention=True)),  # DP attention
    ("deepseek-r1", pm.Layout(tp=32)),      # MLA: no KV-head constraint
])
def test_layouts_that_split_the_heads_are_accepted(model_name, layout):
    assert pm.get_model(model_name).split_problem(layout.tp, layout.dp_attention) is None
    assert bool(jnp.isfinite(_predict(model_name, layout).tpot))


def test_traced_layout_degrees_are_checked_for_heads():
    with pytest.raises(eqx.EquinoxRuntimeError, match="must split"):
        _predict("llama-4-scout", pm.Layout(tp=16).numbers())
    assert bool(jnp.isfinite(_predict("llama-4-scout", pm.Layout(tp=8).numbers()).tpot))


def test_candidate_layouts_skip_degrees_that_cannot_split_the_heads():
    tps = {layout.tp for layout in pm.sweep.candidate_layouts("llama-4-scout", "h100", 32)}
    assert 8 in tps and 16 not in tps and 32 not in tps


def _unfit_case():
    chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-405b")   # 405B on one H200
    design = pm.Design(concurrency=8, layout=pm.Layout(tp=1),
                       precision=pm.precision(chip, model, "bf16"))
    return model, chip, pm.Workload(1024, 256), design


def test_a_design_that_does_not_fit_has_no_latency():
    """The does-not-fit contract of `predict`: NaN latencies by default (never days of
    TTFT as if valid), an error with unfit="raise", the smooth continuation with "value"."""
    m = pm.predict(*_unfit_case())
    assert not bool(m.fits) and float(m.memory_excess) > 0
    for key in ("ttft", "tpot", "e2e", "throughput_per_chip", "power_per_chip"):
        assert math.isnan(float(getattr(m, key))), key
    for key in pm.serving.FIT_FIELDS:
        assert math.isfinite(float(getattr(m, key))), key
    with pytest.raises(eqx.EquinoxRuntimeError, match="does not fit"):
        pm.predict(*_unfit_case(), unfit="raise")
    with pytest.raises(eqx.EquinoxRuntimeError, match="does not fit"):
        pm.predict_jit(*_unfit_case(), unfit="raise")
    value = pm.predict(*_unfit_case(), unfit="value")
    assert float(value.ttft) > 0 and float(value.memory_penalty) > 0
    with pytest.raises(ValueError, match="unfit must be one of"):
        pm.predict(*_unfit_case(), unfit="clip")


def test_a_design_that_fits_is_the_same_in_every_mode():
    model, chip, workload, design = _unfit_case()
    design = eqx.tree_at(lambda d: d.layout, design, pm.Layout(tp=8))
    rows = [pm.predict(model, chip, workload, design, unfit=mode).to_row()
            for mode in pm.serving.UNFIT_MODES]
    assert bool(rows[0]["fits"]) and rows[0] == rows[1] == rows[2]


def test_emulated_formats_are_weight_only():
    chip, model = pm.get_chip("h100"), pm.get_model("gpt-oss-120b")
    emulated = pm.precision(chip, model, "mxfp4", emulate=True)
    assert emulated.names == ("bf16", "mxfp4", "bf16")
    assert float(emulated.expert_bytes) < 1 and emulated.expert_compute.tolist() == \
        pm.precision(chip, model, "bf16").expert_compute.tolist()
    released = pm.precision(chip, model)   # the checkpoint's own MXFP4 needs no flag
    assert released.names == emulated.names


def test_printed_formats_rebuild_the_precision():
    """With every class named, `precision` takes each exactly (what optimize prints)."""
    chip, model = pm.get_chip("b200"), pm.get_model("gpt-oss-120b")
    p = pm.precision(chip, model, "fp8", "nvfp4", "fp8")
    assert p.names == ("fp8", "nvfp4", "fp8")
    assert pm.precision(chip, model, "fp8").names == ("bf16", "fp8", "bf16")   # released wider


def test_mxfp4_experts_take_fp8_activations_on_nvfp4_chips():
    """gpt-oss's released MXFP4 experts run with MXFP8 activations on Blackwell (TensorRT-LLM's
    MoE support matrix; `formats.MIXED_INPUT_CLASS`): the FP8 class at the checkpoint's 4.25
    bits. Experts re-quantized to NVFP4 run at FP4; on MI355X, whose own FP4 is MXFP4, the
    released experts run at FP4."""
    model = pm.get_model("gpt-oss-120b")
    b200, mi355x = pm.get_chip("b200"), pm.get_chip("mi355x")
    hot = {c: [1.0 if k == c else 0.0 for k in pm.formats.COMPUTE_CLASSES]
           for c in pm.formats.COMPUTE_CLASSES}
    released = pm.precision(b200, model, "fp4")
    assert released.names == ("bf16", "mxfp4", "bf16")
    assert released.expert_compute.tolist() == hot["fp8"]
    assert float(released.expert_bytes) == pm.formats.FORMAT_BYTES["mxfp4"]
    assert pm.precision(b200, model, "nvfp4").expert_compute.tolist() == hot["fp4"]
    assert pm.precision(mi355x, model, "fp4").expert_compute.tolist() == hot["fp4"]
    # A model released wider: plain "fp4" is the chip's own FP4 (DeepSeek-R1 NVFP4 on B200).
    assert pm.precision(b200, pm.get_model("deepseek-r1"), "fp4").expert_compute.tolist() == \
        hot["fp4"]
    # The printed names rebuild the same precision (what `perfmodel optimize` relies on).
    rebuilt = pm.precision(b200, model, *released.names)
    assert rebuilt.expert_compute.tolist() == released.expert_compute.tolist()
