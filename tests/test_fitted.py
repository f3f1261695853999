"""The one home of fitted parameters: resolution along the fallback chain, the power rule
for unmeasured chips, framework terms, and one chip model whatever command asks."""

import json

import pytest

from perfmodel import fitted
from perfmodel.design import Runtime
from perfmodel.presets import get_chip

LATENCY = {"families": {"blackwell": {"efficiency": {"compute_max": 0.6},
                                      "scale_up": {"efficiency": 0.7}}},
           "family_fallback": {"rubin": "blackwell"},
           "frameworks": {"vllm": {"step_overhead": 2e-3}, "trt": {"step_overhead": 1e-3}},
           "framework_fallback": {"dynamo-vllm": "vllm"}}
POWER = {"families": {"blackwell": {"energy": {"per_flop": [4e-13, 2e-13, 2e-13, 1e-13],
                                               "per_hbm_byte": 5e-11, "per_link_byte": 3e-11,
                                               "active_power": 300.0},
                                    "idle_fraction": 0.2}},
         "generic": {"flop": [1.0] * 4, "hbm": 0.4, "link": 0.03, "active": 0.3,
                     "idle": 0.18},
         "runtimes": {"vllm": {"step_overhead": 1e-3, "seq_overhead": 2e-5,
                               "expert_efficiency": 0.7, "pipeline_overlap": 0.9,
                               "kernel_efficiency": {"hopper": 0.9, "blackwell": 0.5}}}}


def test_latency_terms_follow_the_fallback_chain():
    rubin = fitted.resolve_family("rubin", latency=LATENCY, power=POWER)
    assert rubin.latency_basis == "blackwell"
    assert rubin.efficiency["compute_max"] == 0.6
    # Energy does not follow the latency chain: unmeasured families take the generic rule.
    assert rubin.power_basis == "generic" and rubin.energy == {}
    assert rubin.idle_fraction == pytest.approx(0.18)
    assert fitted.resolve_family("cdna3", latency=LATENCY, power={}).latency_basis == ""


def test_apply_measured_family_and_holdout():
    chip = fitted.apply(get_chip("b200", calibrated=False), latency=LATENCY, power=POWER)
    assert float(chip.efficiency.compute_max) == pytest.approx(0.6)
    assert float(chip.scale_up.efficiency) == pytest.approx(0.7)
    assert float(chip.energy.per_hbm_byte) == pytest.approx(5e-11)
    assert float(chip.idle_power) == pytest.approx(0.2 * float(chip.tdp))
    held = fitted.apply(get_chip("b200", calibrated=False), latency=LATENCY, power=POWER,
                        holdout="blackwell")
    assert float(held.idle_power) == pytest.approx(0.18 * float(chip.tdp))
    assert float(held.energy.per_hbm_byte) == pytest.approx(
        0.4 * float(chip.tdp) / float(chip.hbm_bandwidth))


def test_generic_rule_scales_with_the_chip_datasheet():
    chip = fitted.apply(get_chip("jalapeno", calibrated=False), latency=LATENCY, power=POWER)
    tdp = float(chip.tdp)
    assert float(chip.idle_power) == pytest.approx(0.18 * tdp)
    for i in range(4):
        assert float(chip.energy.per_flop[i]) == pytest.approx(
            tdp / float(chip.peak_flops[i]))
    assert float(chip.energy.active_power) == pytest.approx(0.3 * tdp)


def test_shipped_files_give_unmeasured_chips_the_generic_rule():
    """Jalapeno has no power measurement: its energy per FLOP follows its own TDP and
    peaks, not Blackwell's measured joules (the two differ by about 2x)."""
    power = fitted.read(fitted.POWER_FILE)
    chip = get_chip("jalapeno")
    generic = power["generic"]
    assert float(chip.idle_power) == pytest.approx(generic["idle"] * float(chip.tdp))
    assert float(chip.energy.per_flop[3]) == pytest.approx(
        generic["flop"][3] * float(chip.tdp) / float(chip.peak_flops[3]))
    assert fitted.resolve_family("jalapeno").latency_basis == "blackwell"
    b200 = get_chip("b200")
    assert float(b200.energy.per_hbm_byte) == pytest.approx(
        power["families"]["blackwell"]["energy"]["per_hbm_byte"])


def test_a_fallback_across_serving_modes_does_not_lend_the_mode_terms():
    """A disaggregated framework without a fit takes its engine's fitted terms except the
    host time per prompt, whose meaning differs between an aggregated engine and a
    prefill instance (`fitted.MODE_TERMS`); a fallback within a mode lends everything,
    and a fitted framework keeps its own."""
    latency = {"frameworks": {"vllm": {"step_overhead": 2e-3, "prefill_request_time": 0.02},
                              "trt": {"prefill_request_time": 0.03}},
               "framework_fallback": {"dynamo-vllm": "vllm", "trtllm-bench": "trt"}}
    for label in ("dynamo-vllm", "Dynamo-VLLM-0.9"):
        assert fitted.runtime_terms(label, latency=latency) == {"step_overhead": 2e-3}
    assert fitted.runtime_terms("vllm", latency=latency)["prefill_request_time"] == 0.02
    assert fitted.runtime_terms("trtllm-bench", latency=latency) == {"prefill_request_time": 0.03}
    assert fitted.MODE_TERMS == ("prefill_request_time",)


def test_framework_terms():
    assert fitted.framework_key("Dynamo-VLLM-0.9", latency=LATENCY) == "vllm"
    assert fitted.framework_key("dynamo-trt", latency=LATENCY) == "trt"
    assert fitted.framework_key("nonesuch", latency=LATENCY) == ""
    assert fitted.runtime_terms("dynamo-vllm", latency=LATENCY) == {"step_overhead": 2e-3}
    engine = fitted.runtime_terms("mlenergy-vllm", "blackwell", latency=LATENCY, power=POWER)
    assert engine["kernel_efficiency"] == 0.5 and engine["seq_overhead"] == 2e-5
    assert fitted.runtime_terms("mlenergy-vllm", "cdna3", power=POWER)[
        "kernel_efficiency"] == 1.0
    runtime = fitted.runtime_for("mlenergy-vllm", "hopper", max_running=64.0)
    assert float(runtime.max_running) == 64.0 and 0 < float(runtime.kernel_efficiency) <= 1
    with pytest.raises(ValueError, match="unknown Runtime field.*step_overhead"):
        fitted.runtime_for("vllm", step_overheads=1.0)



def test_each_engine_sizes_its_kv_cache_by_its_own_rules():
    """The shipped file carries each engine's documented memory rules with its fitted
    terms: TensorRT-LLM's KV fraction is of the free memory and its default admission
    reserves the whole output; vLLM's and SGLang's are neither (`Runtime.fraction_of_free`,
    `Runtime.reserve_output`)."""
    for name in ("trt", "dynamo-trt", "trtllm-bench"):
        rt = fitted.runtime_for(name)
        assert float(rt.fraction_of_free) == 1.0 and float(rt.reserve_output) == 1.0, name
    for name in ("vllm", "sglang", "dynamo-sglang", "atom"):
        rt = fitted.runtime_for(name)
        assert float(rt.fraction_of_free) == 0.0 and float(rt.reserve_output) == 0.0, name

def test_write_read_round_trip(tmp_path):
    import numpy as np
    path = tmp_path / "fit.json"
    fitted.write({"a": np.float64(1.5), "b": np.arange(3.0), "c": {"d": (1, 2)}}, path)
    assert json.loads(path.read_text()) == {"a": 1.5, "b": [0.0, 1.0, 2.0], "c": {"d": [1, 2]}}


def test_follow_stops_on_cycles():
    assert fitted.follow("a", {"z"}, {"a": "b", "b": "a"}) == ""
    assert fitted.follow("", {"z"}, {}) == ""


@pytest.mark.parametrize("field", ["prefill_request_time", "stream_time",
                                   "dp_admission_steps", "dp_sync_time"])
def test_a_file_fitted_without_a_later_framework_term_predicts_without_it(field):
    """Both readers of a latency file written before `prefill_request_time`,
    `stream_time`, `dp_admission_steps` or `dp_sync_time` were fitted (the shipped file of
    an earlier fit, `tests/data/reference_fit`) give the term as it was fitted, zero:
    `runtime_for` through `Runtime`'s default, `params.from_json` through
    `fitted.with_framework_terms`."""
    from perfmodel.calibration.params import from_json

    old = {"frameworks": {"vllm": {"step_overhead": 2e-3, "request_overhead": 0.01}}}
    terms = fitted.runtime_terms("vllm", latency=old)
    assert float(getattr(Runtime(**terms), field)) == 0.0
    values = from_json(old).values()["frameworks"]["vllm"]
    assert values[field] < 1e-20 and values["step_overhead"] == pytest.approx(2e-3)
    new = {"frameworks": {"vllm": {field: 3e-6}}}
    assert from_json(new).values()["frameworks"]["vllm"][field] == pytest.approx(3e-6)
