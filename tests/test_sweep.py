"""Layout enumeration, chip counts, the Pareto front and elasticities (perfmodel.sweep)."""

import dataclasses
import time

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import perfmodel as pm
from perfmodel import sweep as sw
from perfmodel.kvcache import max_batch

W = pm.Workload(8192, 1024)


# Pareto front ---------------------------------------------------------------------------

finite = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)


@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=60))
def test_front_is_exactly_the_non_dominated_set(points):
    x, y = np.array(points).T
    front = sw.pareto_front(x, y)
    # Sorted by rising throughput and falling interactivity, strictly.
    assert np.all(np.diff(x[front]) > 0) and np.all(np.diff(y[front]) < 0)
    for i in front:   # nothing beats a front point on both axes
        assert not np.any((x >= x[i]) & (y >= y[i]) & ((x > x[i]) | (y > y[i])))
    for j in set(range(len(x))) - set(front.tolist()):   # every other point is matched or beaten
        assert np.any((x[front] >= x[j]) & (y[front] >= y[j]))


def test_front_ignores_non_finite_points_and_checks_shapes():
    front = sw.pareto_front([1.0, np.nan, 2.0, np.inf], [2.0, 9.0, 1.0, 5.0])
    assert front.tolist() == [0, 2]
    with pytest.raises(ValueError, match="interactivity has 2"):
        sw.pareto_front([1.0, 2.0, 3.0], [1.0, 2.0])


# Layouts and chip counts ------------------------------------------------------------------

@pytest.mark.parametrize("model_name, chip_name, chips", [
    ("deepseek-r1", "gb200", 8), ("gpt-oss-120b", "h100", 4), ("llama-3.1-70b", "tpu-v6e", 16),
    ("kimi-k2.5", "groq-lpu", 8192)])
def test_candidate_layouts_fill_the_chips_and_use_the_fewest_stages(model_name, chip_name, chips):
    model, chip = pm.get_model(model_name), pm.get_chip(chip_name)
    prec = pm.precision(chip, model, sw.default_precision(chip, model))
    runtime = sw.default_runtime(chip)
    layouts = sw.candidate_layouts(model, chip, chips, W, prec)
    assert layouts
    context = float(W.mean_input_len + W.mean_output_len / 2)

    def fit(layout):
        return float(max_batch(model, layout, prec, chip.hbm_capacity, context,
                               runtime.memory_fraction, runtime.activation_reserve))

    for layout in layouts:
        assert layout.chips == chips
        assert layout.tp <= min(chips, chip.domain_size)
        assert layout.tp & (layout.tp - 1) == 0 and layout.pp & (layout.pp - 1) == 0
        assert layout.ep in (1, layout.tp)
        assert not model.is_moe or model.num_experts % layout.ep == 0
        assert model.is_moe or not layout.dp_attention
        assert fit(layout) >= 1.0
        if layout.pp > 1:   # pipeline stages only where the weights need them
            fewer = dataclasses.replace(layout, pp=layout.pp // 2)
            assert fit(fewer) < 1.0
    shapes = [(l.tp, l.ep, l.dp_attention) for l in layouts]
    assert len(set(shapes)) == len(shapes)


def test_auto_chips_is_the_smallest_count_with_a_useful_batch():
    model, chip = pm.get_model("deepseek-r1"), pm.get_chip("h200")
    n = sw.auto_chips(model, chip, "fp8", 8192, 1024)
    best = lambda k: max(
        (float(max_batch(model, l, pm.precision(chip, model, "fp8"), chip.hbm_capacity,
                         float(W.mean_input_len + W.mean_output_len / 2), 0.9, 4e9))
         for l in sw.candidate_layouts(model, chip, k, W, "fp8")), default=0.0)
    assert n > 1 and n & (n - 1) == 0
    assert best(n) >= 32.0 > best(n // 2)
    assert sw.auto_chips("llama-3.1-8b", "b200", "bf16", 1024, 128) == 1


@pytest.mark.parametrize("chip_name", ["groq-lpu", "tpu-v5e"])
def test_auto_chips_reaches_hundreds_of_small_chips_quickly(chip_name):
    start = time.perf_counter()
    n = sw.auto_chips("deepseek-r1", chip_name, None, 8192, 1024)
    assert n >= 64 and n & (n - 1) == 0
    assert time.perf_counter() - start < 20.0   # seconds; about 1 s on an idle core
    assert sw.candidate_layouts("deepseek-r1", chip_name, n, W)


def test_default_precision_is_native_or_bf16():
    model = pm.get_model("deepseek-r1")
    for name in pm.chip_names():
        chip = pm.get_chip(name)
        fmt = sw.default_precision(chip, model)
        assert fmt in chip.native_classes or fmt == "bf16"
        assert fmt == "fp4" if "fp4" in chip.native_classes else fmt != "fp4"


@pytest.mark.parametrize("kwargs, match", [
    (lambda: dict(chips=0), "positive integer"),
    (lambda: dict(chips=1), "does not fit in 1 h100.*smallest count that holds it is"),
    (lambda: dict(grid=(1.0, -2.0)), "positive finite"),
    # A workload this short is refused when it is built, before the sweep.
    (lambda: dict(workload=pm.Workload(0, 1024)), "Workload.input_len must be >= 1"),
    (lambda: dict(workload=pm.Workload(1024, 1)), "Workload.output_len must be > 1")])
def test_sweep_errors_name_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sw.sweep("deepseek-r1", "h100", **kwargs())


# The sweep --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    return sw.sweep("gpt-oss-120b", "h200", W, chips=4, grid=(1.0, 8.0, 64.0, 512.0, 4096.0))


@pytest.mark.slow   # compiles for 10 s or more (CI's slow stage runs it)
def test_sweep_keeps_only_points_that_fit(small):
    v = small.values
    replicas = np.array([small.layouts[i].replicas for i in small.layout_index])
    assert v["fits"].all()
    assert np.all(v["concurrency"] / replicas <= v["max_batch"] * (1 + 1e-9))
    for key in ("tput_per_chip_total", "interactivity", "ttft_s", "tpot_s", "power_w_modelled"):
        assert np.all(np.isfinite(v[key]) & (v[key] > 0))
    # The largest batch that fits is on the grid of each layout, so the front reaches it.
    for i, layout in enumerate(small.layouts):
        mine = small.layout_index == i
        top = np.max(v["concurrency"][mine]) / layout.replicas
        assert top == pytest.approx(min(np.floor(v["max_batch"][mine][0]), 4096.0))


@pytest.mark.slow
def test_front_rises_in_throughput_and_falls_in_interactivity(small):
    rows = small.rows()
    tput = [r["tput_per_chip_total"] for r in rows]
    inter = [r["interactivity"] for r in rows]
    assert len(rows) >= 3
    assert np.all(np.diff(tput) > 0) and np.all(np.diff(inter) < 0)
    assert {r["layout"] for r in rows} <= {l.describe() for l in small.layouts}
    assert len(small.rows("all")) == len(small.layout_index)
    with pytest.raises(ValueError, match="'front' or 'all'"):
        small.rows("best")


def test_replicas_are_evaluated_exactly(small):
    """A sweep point of R replicas equals `predict` of the full layout at R x concurrency."""
    index = next(i for i in range(len(small.layout_index))
                 if small.layouts[small.layout_index[i]].replicas > 1)
    layout = small.layouts[small.layout_index[index]]
    chip, model = pm.get_chip("h200"), pm.get_model("gpt-oss-120b")
    design = pm.Design(concurrency=small.values["concurrency"][index], layout=layout,
                       precision=pm.precision(chip, model, "fp8"),
                       runtime=sw.default_runtime(chip))
    m = pm.predict(model, chip, W, design, hard=True)
    for key, value in (("tput_per_chip_total", m.throughput_per_chip), ("ttft_s", m.ttft),
                       ("tpot_s", m.tpot), ("j_per_output_token", m.j_per_output_token),
                       ("power_w_modelled", m.power_per_chip)):
        assert small.values[key][index] == pytest.approx(float(value), rel=1e-9)


@pytest.mark.slow
def test_sweep_jit_and_eager_agree():
    kwargs = dict(chips=2, grid=(1.0, 16.0, 256.0))
    eager = sw.sweep("llama-3.1-8b", "h100", pm.Workload(1024, 256), **kwargs)
    jitted = sw.sweep("llama-3.1-8b", "h100", pm.Workload(1024, 256), jit=True, **kwargs)
    assert eager.front.tolist() == jitted.front.tolist()
    for key in ("tput_per_chip_total", "interactivity", "ttft_s", "power_w_modelled"):
        np.testing.assert_allclose(eager.values[key], jitted.values[key], rtol=1e-12)


def test_sweeps_from_threads_equal_serial_sweeps():
    # `perfmodel compare` runs its sweeps from one thread per core, compiling side by side.
    import concurrent.futures

    cases = [("llama-3.1-8b", "h100"), ("llama-3.1-8b", "b200"), ("qwen3-32b", "h100")]
    kwargs = dict(chips=1, grid=(1.0, 16.0))

    def run(case):
        return sw.sweep(*case, pm.Workload(1024, 256), jit=True, **kwargs)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        threaded = list(pool.map(run, cases))
    for case, got in zip(cases, threaded, strict=True):
        alone = run(case)
        assert got.front.tolist() == alone.front.tolist()
        for key in ("tput_per_chip_total", "interactivity", "ttft_s"):
            np.testing.assert_array_equal(got.values[key], alone.values[key])


# Elasticities -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def operating_point():
    chip, model = pm.get_chip("b200"), pm.get_model("gpt-oss-120b")
    design = pm.Design(concurrency=4.0, layout=pm.Layout(tp=1),
                       precision=pm.precision(chip, model, "fp4"))
    return model, chip, design


def test_elasticities_match_central_differences_in_log_space(operating_point):
    model, chip, design = operating_point
    specs = ("hbm_bandwidth", "peak_flops", "tdp")
    got = sw.elasticities(model, chip, W, design, "tok_s_per_kw_tdp", specs)

    def log_metric(path, step):
        scaled = eqx.tree_at(lambda c: sw._spec(c, path), chip,
                             sw._spec(chip, path) * jnp.exp(step))
        return float(jnp.log(pm.predict(model, scaled, W, design).tok_s_per_kw_tdp))

    h = 1e-5
    for path in specs:
        numeric = (log_metric(path, h) - log_metric(path, -h)) / (2 * h)
        # Central differences in float64 carry O(h^2) truncation and ~1e-11 rounding error.
        assert got[path] == pytest.approx(numeric, rel=1e-5, abs=1e-8)


def test_elasticities_obey_the_metric_definitions(operating_point):
    model, chip, design = operating_point
    specs = ("tdp", "hbm_capacity", "hbm_bandwidth")
    per_kw = sw.elasticities(model, chip, W, design, "tok_s_per_kw_tdp", specs)
    tput = sw.elasticities(model, chip, W, design, "throughput_per_chip", specs)
    # tokens/s per kW of TDP = throughput / TDP: the TDP elasticities differ by exactly -1.
    assert per_kw["tdp"] == pytest.approx(tput["tdp"] - 1.0, rel=1e-12)
    assert per_kw["hbm_bandwidth"] == pytest.approx(tput["hbm_bandwidth"], rel=1e-12)
    # Four requests are far from the batch that fits: capacity does not bind.
    assert abs(per_kw["hbm_capacity"]) < 1e-9
    assert 0.0 < tput["hbm_bandwidth"] < 1.0


def test_elasticities_reject_unknown_names(operating_point):
    model, chip, design = operating_point
    with pytest.raises(ValueError, match="unknown metric 'speed'"):
        sw.elasticities(model, chip, W, design, "speed")
    with pytest.raises(ValueError, match="unknown chip spec 'hbm_speed'"):
        sw.elasticities(model, chip, W, design, specs=("hbm_speed",))
