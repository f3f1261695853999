"""Layouts as numbers: `Layout.numbers()` (array degrees, possibly traced or vmapped) gives
the same metrics and gradients as the static `Layout`, so one kernel can serve many layouts.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perfmodel as pm
from perfmodel.search import candidate_layouts

CONCURRENCY = np.array([1.0, 37.0, 512.0])


def _signature(layout):
    return (layout.tp > 1, layout.ep > 1, layout.pp > 1, layout.dp_attention,
            layout.replicas > 1)


@functools.cache
def _case(name):
    """(model, chip, workload, design without its layout, layouts): the optimizer's
    candidates, one per combination of features (tp, ep, pp, DP attention, replicas), plus
    hand-built layouts the candidates lack (pipelines, experts tensor-parallel inside,
    groups past the scale-up domain)."""
    chip_name, model_name, chips, fmt, workload, extra, kw = {
        "llama-8b-h200": ("h200", "llama-3.1-8b", 8, "fp8", pm.Workload(1024, 256),
                          [pm.Layout(tp=2, pp=2, replicas=2)], {}),
        "r1-jalapeno": ("jalapeno", "deepseek-r1", 8, "mxfp4", pm.Workload(8192, 1024), [],
                        dict(kv="fp8", mapping=pm.mapping("partitioned", "partitioned",
                                                          dense="replicated"),
                             speculative=pm.SpecDecode(draft_tokens=2.0))),
        "gptoss-b200": ("b200", "gpt-oss-120b", 8, "nvfp4", pm.Workload(1024, 1024),
                        [pm.Layout(tp=8, ep=4, dp_attention=True),
                         pm.Layout(tp=4, ep=2, replicas=2)], {}),
        # 16 chips on 8-chip NVLink domains: tp16 and tp8-pp2 cross InfiniBand.
        "llama-70b-h100": ("h100", "llama-3.1-70b", 16, "fp8", pm.Workload(2048, 512),
                           [pm.Layout(tp=16), pm.Layout(tp=8, pp=2),
                            pm.Layout(tp=4, pp=2, replicas=2)], {}),
        # A 16x16 torus: tp32 spans two axes.
        "llama-8b-tpu": ("tpu-v5e", "llama-3.1-8b", 32, "bf16", pm.Workload(1024, 256),
                         [pm.Layout(tp=32), pm.Layout(tp=4, pp=2, replicas=4)], {}),
    }[name]
    chip, model = pm.get_chip(chip_name), pm.get_model(model_name)
    kv = kw.pop("kv", None)
    seen, layouts = set(), []
    for layout in candidate_layouts(model, chip, chips, workload, fmt):
        if _signature(layout) not in seen:
            seen.add(_signature(layout))
            layouts.append(layout)
    layouts += extra
    design = pm.Design(concurrency=CONCURRENCY, layout=pm.Layout(),
                       precision=pm.precision(chip, model, fmt, kv=kv), **kw)
    return model, chip, workload, design, tuple(layouts)


CASES = ("llama-8b-h200", "r1-jalapeno", "gptoss-b200", "llama-70b-h100", "llama-8b-tpu")
#: Cases whose many layouts take 10-20 s to compile: with the slow tests (`.ci/run` runs
#: them); the others cover the same branches by default.
_WIDE = ("gptoss-b200", "r1-jalapeno", "llama-70b-h100")


def _with(design, layout):
    return eqx.tree_at(lambda d: d.layout, design, layout)


def _stack(layouts):
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *[x.numbers() for x in layouts])


def test_cases_cover_the_layout_features():
    """The cases reach every branch of the layout: ep > 1 with and without DP attention,
    experts tensor-parallel inside (moe_tp > 1), pipelines, replicas, groups past the
    scale-up domain."""
    layouts = [(name, x) for name in CASES for x in _case(name)[4]]
    moe = [x for name, x in layouts if _case(name)[0].is_moe]
    assert any(x.ep > 1 and x.dp_attention for x in moe)
    assert any(x.ep > 1 and not x.dp_attention for x in moe)
    assert any(x.ep == 1 and x.dp_attention and x.tp > 1 for x in moe)
    assert any(x.ep > 1 and x.moe_tp > 1 and x.dp_attention for x in moe)
    assert any(x.pp > 1 for _, x in layouts)
    assert any(x.replicas > 1 for _, x in layouts)
    assert any(x.tp > _case(name)[1].domain_size for name, x in layouts)


@pytest.mark.parametrize("name, hard, vectorize", [
    # The smooth, per-operator evaluation of every case runs by default; the exact and
    # vectorized variants compile again for each case, so they run with the slow tests.
    # llama-8b-tpu (10 s) too: llama-8b-h200 covers its branches, and its gradients below.
    pytest.param(n, h, v, marks=() if not (h or v or n in _WIDE + ("llama-8b-tpu",))
                 else pytest.mark.slow)
    for n in CASES for h in (False, True) for v in (False, True)])
def test_numbers_predict_as_the_static_layout(name, hard, vectorize):
    """Every metric agrees between `Layout` and `Layout.numbers()`, eagerly, and under
    `jax.jit` of a `jax.vmap` over the stacked numbers of all the case's layouts (one
    kernel for all of them)."""
    model, chip, workload, design, layouts = _case(name)

    def predict(layout):
        return pm.predict(model, chip, workload, _with(design, layout), hard=hard,
                          vectorize=vectorize)

    batched = jax.jit(jax.vmap(lambda n: predict(n).to_row()))(_stack(layouts))
    for i, layout in enumerate(layouts):
        static = predict(layout).to_row()
        numbers = predict(layout.numbers()).to_row()
        for key, value in static.items():
            err = f"{layout.describe()} {key}"
            assert np.all(np.isfinite(value)), err
            np.testing.assert_allclose(numbers[key], value, rtol=1e-12, err_msg=err)
            # Compiled code orders float operations its own way. p99 TPOT's spread is
            # sqrt(f (1 - f)) of the chunk frequency f, whose slope is infinite at f = 1:
            # where every step carries a chunk (f = demand / chunk with chunk = demand) one
            # ulp of f moves p99 TPOT by up to about sqrt(1e-16) = 1e-8 of TPOT.
            rtol = 1e-7 if key == "p99_tpot_s" else 1e-12
            np.testing.assert_allclose(batched[key][i], value, rtol=rtol, err_msg=err)


# llama-8b-tpu (8-14 s) with the slow tests too: the search's gradient test
# (`test_optimize.py`) differentiates through `LayoutNumbers` by default.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in ("r1-jalapeno", "llama-8b-h200", "llama-8b-tpu")
                                  + _WIDE else n
                                  for n in CASES])
def test_numbers_gradients_match_and_are_finite(name):
    """d TPOT / d concurrency and d TPOT / d scale-up bandwidth agree between the two forms
    and are finite: the collectives a layout does not run (groups of one chip, no pipeline)
    are masked with `jnp.where` on safe inputs, so they leak no NaN into the gradient.
    Eager, on a third of the case's layouts and its last (hand-built) one: a compiled
    gradient costs more than the eager ones."""
    model, chip, workload, design, layouts = _case(name)

    def tpot(concurrency, bandwidth, layout):
        c = eqx.tree_at(lambda c: c.scale_up.bandwidth, chip, bandwidth)
        d = eqx.tree_at(lambda d: (d.concurrency, d.layout), design, (concurrency, layout))
        return jnp.sum(pm.predict(model, c, workload, d).tpot)

    grad = jax.grad(tpot, argnums=(0, 1))
    for layout in layouts[::3] + layouts[-1:]:
        static = grad(design.concurrency, chip.scale_up.bandwidth, layout)
        numbers = grad(design.concurrency, chip.scale_up.bandwidth, layout.numbers())
        for k, what in enumerate(("concurrency", "bandwidth")):
            err = f"{layout.describe()} d/d{what}"
            assert np.all(np.isfinite(numbers[k])), err
            np.testing.assert_allclose(numbers[k], static[k], rtol=1e-12, atol=1e-30,
                                       err_msg=err)
        if layout.tp == 1 and layout.pp == 1:
            assert float(numbers[1]) == 0.0   # no collectives: the link does not matter


@pytest.mark.slow   # compiles for 10 s or more (CI's slow stage runs it)
def test_numbers_compile_once_for_all_layouts():
    """A jitted predict traces once for every `LayoutNumbers` (the degrees are data) and
    once per static `Layout`."""
    model, chip, workload, design, layouts = _case("gptoss-b200")

    traces = []

    @eqx.filter_jit
    def tpot(design):
        traces.append(design.layout)
        return pm.predict(model, chip, workload, design).tpot

    for layout in layouts[:3]:
        tpot(_with(design, layout.numbers()))
    assert len(traces) == 1
    for layout in layouts[:3]:
        tpot(_with(design, layout))
    assert len(traces) == 4


def test_layout_numbers_properties():
    """`LayoutNumbers` properties mirror `Layout`'s."""
    for layout in (pm.Layout(tp=8, ep=4, pp=2, replicas=3, dp_attention=True), pm.Layout()):
        n = layout.numbers()
        assert float(n.chips) == layout.chips
        assert float(n.chips_per_instance) == layout.chips_per_instance
        assert float(n.moe_tp) == layout.moe_tp
        assert bool(n.dp_attention) == layout.dp_attention
        assert n.tp.dtype == jnp.float64 and n.dp_attention.dtype == jnp.bool_


@pytest.mark.parametrize("fields, match", [
    (dict(tp=8.0, ep=3.0), "ep must be a positive integer dividing"),
    (dict(tp=8.0, ep=8.0, pp=0.0), "pp must be"),
    (dict(tp=2.5), "tp must be a positive integer"),
    (dict(replicas=0.0), "replicas must be"),
])
def test_invalid_numbers_raise(fields, match):
    """Degrees a `Layout` would reject raise from `predict`'s checks, eager and jitted."""
    chip, model = pm.get_chip("b200"), pm.get_model("gpt-oss-120b")
    base = dict(tp=1.0, ep=1.0, pp=1.0, replicas=1.0, dp_attention=False)
    design = pm.Design(concurrency=8.0, layout=pm.LayoutNumbers(**{**base, **fields}),
                       precision=pm.precision(chip, model, "nvfp4"))
    for run in (pm.predict, pm.predict_jit):
        with pytest.raises(RuntimeError, match=match):
            run(model, chip, pm.Workload(1024, 1024), design)


def test_numbers_check_experts_divide():
    """ep must divide the model's experts, as `predict` asks of a static layout."""
    chip, model = pm.get_chip("b200"), pm.get_model("gpt-oss-120b")   # 128 experts
    layout = pm.LayoutNumbers(tp=6.0, ep=6.0, pp=1.0, replicas=1.0, dp_attention=True)
    design = pm.Design(concurrency=8.0, layout=layout,
                       precision=pm.precision(chip, model, "nvfp4"))
    with pytest.raises(RuntimeError, match="128 experts"):
        pm.predict(model, chip, pm.Workload(1024, 1024), design)


def test_disaggregated_pools_are_one_kind():
    """Both pools static or both numbers; a numbers pair has no description (its degrees
    may be traced)."""
    with pytest.raises(ValueError, match="both be static Layouts or both LayoutNumbers"):
        pm.Disaggregated(prefill=pm.Layout(tp=8), decode=pm.Layout(tp=8).numbers())
    pair = pm.Disaggregated(prefill=pm.Layout(tp=4), decode=pm.Layout(tp=8)).numbers()
    assert float(pair.chips) == 12.0 and not pair.static
    with pytest.raises(ValueError, match="describe"):
        pair.describe()


#: Disaggregated pairs: DeepSeek-R1 on GB200 as the dynamo-trt recipe runs it (DP attention
#: in both pools, wide EP; and TP8 EP8 decode workers without it); Llama-3.1-70B on H100
#: with a pipelined prefill pool, once inside the 8-chip NVLink domain and once past it (KV
#: moved over InfiniBand).
_PAIRS = {
    ("gb200", "deepseek-r1", "nvfp4"): [
        pm.Disaggregated(prefill=pm.Layout(tp=4, ep=4, dp_attention=True, replicas=4),
                         decode=pm.Layout(tp=16, ep=16, dp_attention=True)),
        pm.Disaggregated(prefill=pm.Layout(tp=4, ep=4, dp_attention=True),
                         decode=pm.Layout(tp=8, ep=8, replicas=3))],
    ("h100", "llama-3.1-70b", "fp8"): [
        pm.Disaggregated(prefill=pm.Layout(tp=2, pp=2), decode=pm.Layout(tp=4)),
        pm.Disaggregated(prefill=pm.Layout(tp=4, pp=2), decode=pm.Layout(tp=8))],
}


@pytest.mark.parametrize("key", list(_PAIRS))
def test_disaggregated_numbers_predict_as_static(key):
    """A disaggregated design gives the same metrics with its pools as numbers, eagerly
    and under one `jax.jit` of a `jax.vmap` over the stacked pairs (one kernel for all)."""
    chip_name, model_name, fmt = key
    chip, model = pm.get_chip(chip_name), pm.get_model(model_name)
    pairs = _PAIRS[key]
    assert any(p.chips > chip.domain_size for p in pairs) or model.is_moe
    design = pm.Design(concurrency=64.0, layout=pairs[0],
                       precision=pm.precision(chip, model, fmt, kv="fp8"))
    workload = pm.Workload(8192, 1024)

    def predict(layout):
        return pm.predict(model, chip, workload, _with(design, layout), hard=True).to_row()

    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *[p.numbers() for p in pairs])
    batched = jax.jit(jax.vmap(predict))(stacked)
    for i, pair in enumerate(pairs):
        static = predict(pair)
        numbers = predict(pair.numbers())
        for name, value in static.items():
            err = f"{pair.describe()} {name}"
            assert np.all(np.isfinite(value)), err
            np.testing.assert_allclose(numbers[name], value, rtol=1e-12, err_msg=err)
            np.testing.assert_allclose(batched[name][i], value, rtol=1e-12, err_msg=err)


def test_disaggregated_numbers_checked_per_pool():
    """A pool's degrees that a `Layout` would reject raise, naming the pool."""
    chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
    good = pm.Layout(tp=4, ep=4, dp_attention=True).numbers()
    bad = pm.LayoutNumbers(tp=8.0, ep=3.0, pp=1.0, replicas=1.0, dp_attention=True)
    design = pm.Design(concurrency=8.0, layout=pm.Disaggregated(prefill=good, decode=bad),
                       precision=pm.precision(chip, model, "nvfp4"))
    with pytest.raises(RuntimeError, match="design.layout.decode.ep must be a positive"):
        pm.predict(model, chip, pm.Workload(1024, 1024), design)


@pytest.mark.parametrize("up", [
    pm.Switch(bandwidth=450e9, latency=3e-6, base_latency=8e-6),
    pm.Ring(bandwidth=200e9, latency=2e-6),
    pm.Torus(bandwidth=200e9, latency=2e-6, dims=(4, 4, 4)),
])
@pytest.mark.parametrize("kind", pm.interconnect.COLLECTIVES)
def test_collective_time_of_array_groups(up, kind):
    """`collective_time` of a group size given as an array (inside and past the scale-up
    domain, one chip included) equals the static one, and its gradient is finite."""
    out = pm.Switch(bandwidth=50e9, latency=10e-6)
    sizes = [1, 2, 3, 4, 8, 16, 48, 64, 65, 200]
    if kind == "p2p":
        sizes = sizes[1:]   # a static p2p "group" of one is ill-defined on a torus
    static = np.array([float(pm.collective_time(kind, 1e6, n, up, out, 64)) for n in sizes])
    numbers = jax.jit(lambda n: pm.collective_time(kind, 1e6, n, up, out, 64))(
        jnp.asarray(sizes, dtype=float))
    np.testing.assert_allclose(numbers, static, rtol=1e-12)
    grads = jax.vmap(jax.grad(lambda m, n: pm.collective_time(kind, m, n, up, out, 64)),
                     in_axes=(None, 0))(1e6, jnp.asarray(sizes, dtype=float))
    assert np.all(np.isfinite(grads))


def test_conditions_known_while_tracing_take_one_branch():
    """`static.add_if` and `static.branch` on a concrete boolean array (layouts as numbers
    evaluated eagerly): nowhere true evaluates only the other branch, everywhere true only
    its own, both with the numbers of the elementwise select; a mixed or traced condition
    selects elementwise."""
    from perfmodel.static import add_if, branch

    def refuse():
        raise AssertionError("evaluated a branch no element takes")

    total = jnp.asarray([1.0, 2.0])
    assert add_if(np.asarray([False, False]), total, refuse) is total
    np.testing.assert_array_equal(add_if(np.asarray([True, True]), total, lambda: 0.5),
                                  [1.5, 2.5])
    np.testing.assert_array_equal(add_if(np.asarray([True, False]), total, lambda: 0.5),
                                  [1.5, 2.0])
    assert branch(jnp.asarray([True, True]), lambda: 3.0, refuse) == 3.0
    assert branch(jnp.asarray([False, False]), refuse, lambda: 4.0) == 4.0
    np.testing.assert_array_equal(branch(np.asarray([True, False]), lambda: 3.0, lambda: 4.0),
                                  [3.0, 4.0])
    traced = jax.jit(lambda c: add_if(c, total, lambda: 0.5))
    np.testing.assert_array_equal(traced(jnp.asarray([False, False])), total)
    np.testing.assert_array_equal(traced(jnp.asarray([True, True])), [1.5, 2.5])
