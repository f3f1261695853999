"""A vmapped fuzz of the valid domain: random workloads, loads and chip scalings through every
layout representation (`Layout`, `Layout.numbers()`, `Disaggregated`), values and forward
derivatives, checked for NaN, infinity and impossible values.

Run by `test_domain_fuzz.py` in process (float64, the suite's setting) and as a script in a
fresh process with float32 (`python tests/domain_fuzz.py --points N --x32`), since the
suite's configuration fixes x64 for the whole process.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

#: name: (chip, model, weight format, layout, keyword arguments of Design).
CASES = {
    "dense-layout": ("h200", "llama-3.1-70b", "fp8", lambda pm: pm.Layout(tp=4, replicas=2),
                     {}),
    "moe-numbers": ("b200", "gpt-oss-120b", "nvfp4",
                    lambda pm: pm.Layout(tp=4, ep=4, dp_attention=True).numbers(), {}),
    "mla-mtp-pipeline": ("gb200", "deepseek-r1", "nvfp4",
                         lambda pm: pm.Layout(tp=8, ep=8, pp=2).numbers(),
                         {"speculative": "mtp"}),
    "disaggregated": ("h100", "llama-3.1-8b", "fp8",
                      lambda pm: pm.Disaggregated(prefill=pm.Layout(tp=1, replicas=2),
                                                  decode=pm.Layout(tp=2)), {}),
    "sram-slices": ("jalapeno", "gpt-oss-120b", "mxfp4",
                    lambda pm: pm.Layout(tp=8, ep=8, dp_attention=True),
                    {"mapping": "partitioned"}),
}

#: Drawn per point: (name, low, high); log-uniform between the bounds.
DRAWS = (("concurrency", 1.0, 4096.0), ("input_len", 16.0, 131072.0),
         ("output_len", 2.0, 32768.0), ("bandwidth", 0.25, 4.0), ("flops", 0.25, 4.0),
         ("capacity", 0.5, 4.0), ("tdp", 0.3, 3.0), ("step_overhead", 1e-5, 1e-2))


@functools.cache
def _specs(name):
    import perfmodel as pm

    chip_name, model_name, fmt, layout, kw = CASES[name]
    chip, model = pm.get_chip(chip_name), pm.get_model(model_name)
    extra = {}
    if kw.get("speculative") == "mtp":
        extra["speculative"] = pm.SpecDecode(draft_tokens=2.0, acceptance=0.7)
    if kw.get("mapping") == "partitioned":
        extra["mapping"] = pm.mapping("partitioned", "partitioned")
    design = pm.Design(concurrency=1.0, layout=layout(pm),
                       precision=pm.precision(chip, model, fmt), **extra)
    return model, chip, pm.Workload(1024.0, 1024.0), design


def _build(name, x):
    """(chip, workload, design) at one point `x` (a dict of scalars)."""
    _, chip, workload, design = _specs(name)
    f = jnp.asarray(1.0)
    chip = eqx.tree_at(lambda c: (c.hbm_bandwidth, c.peak_flops, c.hbm_capacity, c.tdp,
                                  c.idle_power),
                       chip, (chip.hbm_bandwidth * x["bandwidth"], chip.peak_flops * x["flops"],
                              chip.hbm_capacity * x["capacity"], chip.tdp * x["tdp"],
                              chip.idle_power * x["tdp"]))
    workload = eqx.tree_at(lambda w: (w.input_len, w.output_len), workload,
                           (x["input_len"] * f, x["output_len"] * f))
    design = eqx.tree_at(lambda d: (d.concurrency, d.runtime.step_overhead), design,
                         (x["concurrency"] * f, x["step_overhead"] * f))
    return chip, workload, design


@functools.cache
def _kernel(name):
    import perfmodel as pm

    model = _specs(name)[0]

    def metrics(x):
        chip, workload, design = _build(name, x)
        m = pm.predict(model, chip, workload, design, unfit="value")   # finite everywhere
        return m, chip.tdp

    def one(x, direction):
        (m, tdp), (dm, _) = jax.jvp(metrics, (x,), (direction,))
        return m, tdp, dm

    return jax.jit(jax.vmap(one))


def draw(points, seed):
    rng = np.random.default_rng(seed)
    dtype = jnp.result_type(float)
    x = {k: jnp.asarray(np.exp(rng.uniform(np.log(lo), np.log(hi), points)), dtype=dtype)
         for k, lo, hi in DRAWS}
    direction = {k: jnp.asarray(v * rng.standard_normal(points), dtype=dtype)
                 for k, v in x.items()}
    return x, direction


def problems(name, points, seed=0):
    """Descriptions of every point where a metric or derivative is NaN or infinite, or a
    value is impossible; empty when the fuzz finds nothing."""
    x, direction = draw(points, seed)
    m, tdp, dm = _kernel(name)(x, direction)
    out = []
    rows, drows = m.to_row(), dm.to_row()
    for key in rows:
        for what, values in (("value", rows[key]), ("derivative", drows[key])):
            values = np.asarray(values)
            if not np.issubdtype(values.dtype, np.floating):
                continue   # a boolean field's tangent (float0)
            bad = ~np.isfinite(values)
            if bad.any():
                out.append(f"{name}: {what} of {key} not finite at {int(bad.sum())} points")
    slack = 1e-3 if jnp.result_type(float) == jnp.float32 else 1e-9
    ttft, tpot, e2e = (np.asarray(v) for v in (m.ttft, m.tpot, m.e2e))
    power, cap = np.asarray(m.power_per_chip), np.asarray(tdp)
    checks = {
        "ttft > 0": ttft > 0, "tpot > 0": tpot > 0,
        "e2e >= ttft": e2e >= ttft * (1 - slack),
        "p99 ttft >= ttft": np.asarray(m.p99_ttft) >= ttft * (1 - slack),
        "p99 tpot >= tpot": np.asarray(m.p99_tpot) >= tpot * (1 - slack),
        "throughput > 0": np.asarray(m.throughput_per_chip) > 0,
        "0 < power <= TDP": (power > 0) & (power <= cap * (1 + slack)),
    }
    for what, ok in checks.items():
        if not ok.all():
            out.append(f"{name}: {what} fails at {int((~ok).sum())} points")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=2000, help="points in all, over CASES")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--x32", action="store_true", help="float32 (x64 off)")
    parser.add_argument("--cases", nargs="+", choices=tuple(CASES), default=tuple(CASES))
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", not args.x32)
    found = []
    for k, name in enumerate(args.cases):
        found += problems(name, -(-args.points // len(args.cases)), args.seed + k)
    print("\n".join(found) or f"no problem in {args.points} points")
    return 1 if found else 0


if __name__ == "__main__":
    os.environ.setdefault("PERFMODEL_CACHE_DIR", "off")
    sys.exit(main())
