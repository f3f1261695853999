"""Calibration: parameter spaces, data validation, Jacobians, the optimistix fit (result
codes, throw, synthetic recovery, determinism) and the shipped fit."""

import csv
import json
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perfmodel as pm
from perfmodel import calibration as cal
from perfmodel import datasets, fitted
from perfmodel.formats import COMPUTE_CLASSES
from perfmodel.interconnect import collective_time
from perfmodel.presets import get_chip
from perfmodel.solvers import RESULTS, succeeded

ROOT = pathlib.Path(__file__).resolve().parents[1]

HEADER = ("model,hardware,framework,precision,spec_decoding,disagg,isl,osl,conc,tp,ep,"
          "dp_attention,tput_per_gpu,median_tpot_s,median_ttft_s\n")
GOOD = "gpt-oss-120b,b200,vllm,fp4,none,False,1024,1024,8,1,1,False,2000,0.004,0.03\n"


def _write(tmp_path, text, name="bench.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


# --- data validation -------------------------------------------------------------------

def test_corrupt_value_names_file_line_column(tmp_path):
    bad = GOOD.replace(",1024,1024,8,", ",1024,abc,8,")
    path = _write(tmp_path, HEADER + GOOD + bad)
    with pytest.raises(datasets.DataError, match=r"bench\.csv, line 3, column 'osl'.*abc"):
        datasets.load_benchmarks(path)


def test_missing_column_is_named(tmp_path):
    path = _write(tmp_path, HEADER.replace("conc,", "") + GOOD.replace(",8,1,1,", ",1,1,"))
    with pytest.raises(datasets.DataError, match=r"line 1: missing column.*'conc'"):
        datasets.load_benchmarks(path)


def test_truncated_row_is_named(tmp_path):
    path = _write(tmp_path, HEADER + GOOD + GOOD[:30] + "\n")
    with pytest.raises(datasets.DataError, match=r"line 3: .*truncated"):
        datasets.load_benchmarks(path)


def test_missing_measurement_rejected_only_when_required(tmp_path):
    row = GOOD.replace(",2000,", ",,")
    path = _write(tmp_path, HEADER + row)
    assert "tput_per_gpu" not in datasets.load_benchmarks(path)[0].measured
    with pytest.raises(datasets.DataError, match=r"column 'tput_per_gpu'.*empty"):
        datasets.load_benchmarks(path, require_measured=True)


def test_nonpositive_and_nonfinite_rejected(tmp_path):
    for text, column in ((GOOD.replace(",8,1,1,", ",-8,1,1,"), "conc"),
                         (GOOD.replace(",1024,1024,", ",nan,1024,"), "isl")):
        path = _write(tmp_path, HEADER + text)
        with pytest.raises(datasets.DataError, match=f"column '{column}'"):
            datasets.load_benchmarks(path)


def test_gemm_and_nccl_loaders_check_names(tmp_path):
    path = _write(tmp_path, "system,dtype,m,n,k,latency_ms\nh100_sxm,int3,1,2,3,0.1\n",
                  "gemm.csv")
    with pytest.raises(datasets.DataError, match="column 'dtype'.*int3"):
        datasets.load_gemm(path)
    path = _write(tmp_path, "system,op_name,num_gpus,message_bytes_derived,latency_us\n"
                            "tpu,all_reduce,2,100,5\n", "nccl.csv")
    with pytest.raises(datasets.DataError, match="column 'system'.*tpu"):
        datasets.load_nccl(path)


def test_kv_cache_dtype_column_sets_the_row_kv_format(tmp_path):
    """The optional `kv_cache_dtype` column: the engines' FP8 names read as fp8 (one byte
    per value in the row's precision), "auto" or an empty cell as the BF16 default, and a
    name that is no format is an error naming the column."""
    header, row = HEADER.rstrip("\n") + ",kv_cache_dtype\n", GOOD.rstrip("\n")
    rows = datasets.load_benchmarks(_write(tmp_path, header + row + ",fp8_e4m3\n"
                                           + row + ",auto\n" + row + ",\n"))
    assert [r.kv for r in rows] == ["fp8", None, None]
    groups, errors = cal.data.build_groups(rows)   # FP8-KV rows are a structure of their own
    assert not errors and sorted(float(g.design.precision.kv_bytes) for g in groups) == \
        [1.0, 2.0]
    with pytest.raises(datasets.DataError, match="kv_cache_dtype"):
        datasets.load_benchmarks(_write(tmp_path, header + row + ",fp9\n"))


def test_shipped_rows_carry_the_kv_formats_of_the_recipe_table():
    """Every shipped InferenceMAX row's `kv_cache_dtype` is the one calibration/README.md's
    table of InferenceX recipes gives its group (model, chip, framework, weight format), and
    every row has a group there: the data and its documented source cannot drift apart."""
    text = (ROOT / "calibration" / "README.md").read_text()
    table = text[text.index("| group | script (commit) | setting | `kv_cache_dtype` |"):]
    expected = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        model, chip, framework, *formats = cells[0].split()
        # A group without a weight format (gpt-oss-120b: MXFP4 only) covers all its rows.
        for fmt in [f for f in formats if f != "and"] or [None]:
            key = (model.lower(), chip.lower(), framework.lower(), fmt and fmt.lower())
            expected[key] = cells[-1].strip("`")
    assert len(expected) == 16
    with open(ROOT / "calibration" / "data" / "benchmarks_inferencemax.csv") as f:
        rows = list(csv.DictReader(f))
    seen = set()
    for r in rows:
        model = "deepseek-r1" if r["model"].lower().startswith("deepseek-r1") else \
            r["model"].lower()
        key = (model, r["hardware"], r["framework"], r["precision"])
        if key not in expected:
            key = key[:3] + (None,)
        assert key in expected, key
        assert r["kv_cache_dtype"] == expected[key], (key, r["kv_cache_dtype"])
        seen.add(key)
    assert seen == set(expected)


def test_poll_steps_column_sets_the_row_scheduler_polling(tmp_path):
    """The optional `poll_steps` column: a number of decode steps (>= 1) per row, empty or
    missing as 1 (the engines' default), anything below 1 an error naming the column; the
    fit's per-row inputs carry it."""
    header, row = HEADER.rstrip("\n") + ",poll_steps\n", GOOD.rstrip("\n")
    rows = datasets.load_benchmarks(_write(tmp_path, header + row + ",30\n" + row + ",\n"))
    assert [r.poll_steps for r in rows] == [30.0, 1.0]
    assert list(cal.row_inputs(rows)["poll"]) == [30.0, 1.0]
    assert datasets.load_benchmarks(_write(tmp_path, HEADER + GOOD))[0].poll_steps == 1.0
    with pytest.raises(datasets.DataError, match="poll_steps"):
        datasets.load_benchmarks(_write(tmp_path, header + row + ",0.5\n"))


def test_shipped_rows_carry_the_scheduler_polling_of_their_recipes():
    """The recipe of the B200 SGLang rows (InferenceX `benchmarks/dsr1_fp4_b200.sh`,
    calibration/README.md) sets `--scheduler-recv-interval` 10 below a concurrency of 16
    and 30 from 16 on; every other shipped row runs the engines' default, 1."""
    with open(ROOT / "calibration" / "data" / "benchmarks_inferencemax.csv") as f:
        for r in csv.DictReader(f):
            if (r["hardware"], r["framework"]) == ("b200", "sglang"):
                assert r["poll_steps"] == ("10" if float(r["conc"]) < 16 else "30"), r
            else:
                assert r["poll_steps"] == "", r


def test_mtp_draft_tokens_column_sets_the_row_draft_length(tmp_path):
    """The optional `mtp_draft_tokens` column: a positive integer on an MTP row, empty as
    `MTP_DRAFT_TOKENS`; a row without MTP drafts nothing and may not set it; the fit's
    per-row inputs carry it."""
    header = HEADER.rstrip("\n") + ",mtp_draft_tokens\n"
    mtp = GOOD.replace(",none,", ",mtp,").rstrip("\n")
    rows = datasets.load_benchmarks(_write(tmp_path, header + mtp + ",3\n" + mtp + ",\n"
                                           + GOOD.rstrip("\n") + ",\n"))
    assert [r.draft_tokens for r in rows] == [3.0, datasets.MTP_DRAFT_TOKENS, 0.0]
    assert list(cal.row_inputs(rows)["draft"]) == [3.0, datasets.MTP_DRAFT_TOKENS, 0.0]
    for bad in (GOOD.rstrip("\n") + ",1\n", mtp + ",1.5\n", mtp + ",0\n"):
        with pytest.raises(datasets.DataError, match="mtp_draft_tokens"):
            datasets.load_benchmarks(_write(tmp_path, header + bad))


def test_shipped_rows_carry_the_draft_lengths_of_their_recipes():
    """The GB200 Dynamo-TRT DeepSeek-R1 MTP rows carry their recipe's `DECODE_MTP_SIZE`
    (InferenceMAX `.github/configs/nvidia-master.yaml`, calibration/README.md): 3 on the
    TEP decode workers and the 32-GPU DEP ones, 1 on the 8-GPU DEP worker, 2 or 1 on the
    16-GPU one by sweep; every other row leaves the column empty."""
    with open(ROOT / "calibration" / "data" / "benchmarks_inferencemax.csv") as f:
        for r in csv.DictReader(f):
            if (r["hardware"], r["framework"], r["spec_decoding"]) != (
                    "gb200", "dynamo-trt", "mtp"):
                assert r["mtp_draft_tokens"] == "", r
                continue
            width = int(float(r["decode_tp"])) if r["decode_dp_attention"] == "True" else 0
            expected = {0: "3", 32: "3", 8: "1"}.get(width)
            if width == 16:
                expected = "2" if r["isl"] == "8192" else (
                    "1" if r["prefill_num_workers"] == "2.0" else "3")
            assert r["mtp_draft_tokens"] == expected, r


def test_disaggregated_worker_size_from_gpu_counts(tmp_path):
    header = HEADER.strip() + (",prefill_tp,prefill_ep,prefill_dp_attention,"
                               "prefill_num_workers,decode_tp,decode_ep,decode_dp_attention,"
                               "decode_num_workers,num_prefill_gpu,num_decode_gpu\n")
    row = ("deepseek-r1,gb200,dynamo-sglang,fp4,none,True,8192,1024,512,,,,1,0.02,1.0,"
           "1,1,True,4,1,1,True,1,16,48\n")
    r = datasets.load_benchmarks(_write(tmp_path, header + row))[0]
    assert (r.prefill.tp, r.prefill.ep, r.prefill.replicas) == (4, 4, 4)
    assert (r.decode.tp, r.decode.ep, r.decode.replicas) == (48, 48, 1)


# --- parameters --------------------------------------------------------------------------

def test_params_roundtrip_and_physical_ranges():
    p = cal.Params.prior(("hopper", "blackwell"), ("vllm", "trt"))
    theta = jax.random.normal(jax.random.PRNGKey(0), p.flat.shape) * 3.0
    q = p.with_flat(theta)
    values = q.values()
    for fam in values["families"].values():
        for name, space, _, _ in cal.FAMILY_FIELDS:
            if space == "logit":
                assert 0.0 < fam[name] <= 1.0
            else:
                assert fam[name] > 0.0
    back = cal.from_json(json.loads(json.dumps(cal.to_json(q))))
    np.testing.assert_allclose(back.flat, q.flat, rtol=1e-9, atol=1e-9)


def test_framework_rows_lend_fallback_terms_within_a_serving_mode():
    """A row of a framework without a fit takes its fallback's fitted values, except
    `fitted.MODE_TERMS` when the two run in different serving modes (a disaggregated
    prefill instance's host time per prompt is not an aggregated engine's): those keep the
    prior, as every value of a framework with no fallback does."""
    params = cal.Params.prior(("blackwell",), ("sglang",))
    params = params.with_flat(params.flat + 0.5)
    rows = [datasets.BenchRow(i, i + 2, "deepseek-r1", "mi355x", fw, "fp8", 1024., 1024.,
                              8., False, datasets.PoolLayout(8, 1, False), None, None, {})
            for i, fw in enumerate(("sglang", "sglang-disagg", "dynamo-sglang", "nonesuch"))]
    out = cal.framework_rows(rows, params)
    own, prior = np.asarray(params.framework_raw)[0], cal.prior_row(cal.FRAMEWORK_FIELDS)
    mode = [cal.FRAMEWORK_NAMES.index(n) for n in fitted.MODE_TERMS]
    rest = [k for k in range(len(own)) if k not in mode]
    np.testing.assert_array_equal(out[0], own)
    for k in (1, 2):
        np.testing.assert_array_equal(out[k, rest], own[rest])
        np.testing.assert_array_equal(out[k, mode], prior[mode])
    np.testing.assert_array_equal(out[3], prior)


def test_params_shape_is_checked():
    with pytest.raises(ValueError, match="family_raw has shape"):
        cal.Params(family_raw=jnp.zeros((2, 3)), framework_raw=jnp.zeros(1),
                   families=("a", "b"), frameworks=("x",))


def test_with_family_sets_fields_jit_and_eager_agree():
    chip = get_chip("h100", calibrated=False)
    raw = cal.Params.prior(("hopper",), ()).family_raw[0] + 0.3
    eager = cal.with_family(chip, raw)
    jitted = eqx.filter_jit(cal.with_family)(chip, raw)
    assert float(eager.efficiency.compute_max) == pytest.approx(
        float(jax.nn.sigmoid(raw[0])), rel=1e-12)
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_every_fitted_family_field_reaches_the_chip_and_the_file():
    """Each family field of the fit is applied to the chip it prices (`with_family`) and
    written to the fitted file (`to_json`), by name: a field list cut at a fixed length
    once dropped the last one (`format_ceiling`) when a field was added before it."""
    chip = get_chip("h100", calibrated=False)
    params = cal.Params.prior(("hopper",), ())
    values = params.values()["families"]["hopper"]
    moved = cal.with_family(chip, params.family_raw[0] + 0.3)
    written = cal.to_json(params)["families"]["hopper"]
    collective = {"collective_efficiency": "efficiency", "collective_latency": "latency",
                  "collective_base_latency": "base_latency"}
    for name in cal.FAMILY_NAMES:
        if name in collective:
            field = collective[name]
            assert written["scale_up"][field] == pytest.approx(values[name])
            before, after = getattr(chip.scale_up, field), getattr(moved.scale_up, field)
        else:
            assert written["efficiency"][name] == pytest.approx(values[name])
            before, after = getattr(chip.efficiency, name), getattr(moved.efficiency, name)
        assert float(after) != pytest.approx(float(before), rel=1e-3), name


def _central_differences(f, x, seeds=(0, 1), h=1e-5):
    """(J v, central difference of f along v) for random unit directions v."""
    jac = jax.jacfwd(f)(x)
    for seed in seeds:
        v = jax.random.normal(jax.random.PRNGKey(seed), x.shape)
        v = v / jnp.linalg.norm(v)
        yield jac @ v, (f(x + h * v) - f(x - h * v)) / (2 * h)


def test_gemm_time_gradient_matches_finite_differences():
    chip = get_chip("b200", calibrated=False)
    m = jnp.asarray([1.0, 64.0, 4096.0])
    n = k = jnp.full(3, 8192.0)

    def f(raw):
        return jnp.log(cal.gemm_time(cal.with_family(chip, raw), m, n, k, "fp8"))

    raw = cal.Params.prior(("blackwell",), ()).family_raw[0]
    for jv, fd in _central_differences(f, raw):
        np.testing.assert_allclose(jv, fd, rtol=1e-6, atol=1e-9)


def test_huber_residuals_square_to_twice_the_loss():
    r = jnp.asarray([0.0, 0.1, -0.2, -1.0, 3.0])
    np.testing.assert_allclose(jnp.sum(cal.huber_residuals(r, 0.2) ** 2),
                               2.0 * cal.huber_loss(r, 0.2), rtol=1e-12)
    assert float(cal.huber_loss(r, 0.2)) == pytest.approx(
        0.5 * 0.01 + 0.5 * 0.04 + 0.2 * (1.0 - 0.1) + 0.2 * (3.0 - 0.1))
    # Continuous derivative at the threshold, finite everywhere (no NaN inside delta).
    grad = jax.vmap(jax.grad(lambda x: cal.huber_residuals(x, 0.2)))
    g = grad(jnp.asarray([0.0, 0.05, 0.2 - 1e-9, 0.2 + 1e-9, 5.0]))
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g[:4], 1.0, rtol=1e-6)
    assert 0.0 < float(g[4]) < 1.0


def test_rowwise_jacobian_matches_plain_autodiff_in_parameters_and_data():
    def f(x, row, shared):
        return jnp.stack([jnp.sin(x[0]) * row["a"], x[1] * jnp.exp(shared * x[0])])

    F = cal.rowwise_jacobian(f)
    plain = jax.vmap(f, in_axes=(0, 0, None))
    x = jnp.asarray([[0.1, 0.2], [0.3, -0.4], [1.0, 2.0]])
    rows = {"a": jnp.asarray([1.0, 2.0, 3.0])}
    np.testing.assert_allclose(F(x, rows, 0.5), plain(x, rows, 0.5), rtol=1e-14)
    np.testing.assert_allclose(jax.jacfwd(F)(x, rows, 0.5), jax.jacfwd(plain)(x, rows, 0.5),
                               rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(jax.jacrev(F)(x, rows, 0.5), jax.jacrev(plain)(x, rows, 0.5),
                               rtol=1e-12, atol=1e-14)
    # Tangents of the data take the plain JVP.
    np.testing.assert_allclose(jax.jacfwd(F, 1)(x, rows, 0.5)["a"],
                               jax.jacfwd(plain, 1)(x, rows, 0.5)["a"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(jax.jacfwd(F, 2)(x, rows, 0.5), jax.jacfwd(plain, 2)(x, rows, 0.5),
                               rtol=1e-12, atol=1e-14)


# --- solver --------------------------------------------------------------------------------

def _synthetic(truth):
    """Op-level samples generated by the model itself with known hopper parameters."""
    chip = get_chip("h100", calibrated=False)
    tuned = cal.with_family(chip, truth.family_raw[0])
    gemm, nccl = [], []
    for dtype in ("bfloat16", "fp8"):
        m = jnp.asarray([1.0, 8, 32, 128, 512, 2048, 8192, 16384])
        for nk in (4096.0, 16384.0):
            t = cal.gemm_time(tuned, m, jnp.full(8, nk), jnp.full(8, nk), dtype)
            gemm += [dict(chip="h100", dtype=dtype, m=float(a), n=nk, k=nk, seconds=float(b))
                     for a, b in zip(m, t, strict=True)]
    sizes = jnp.asarray([1e3, 1e4, 1e5, 1e6, 1e7, 1e8])
    for op in ("all_reduce", "all_gather"):
        for n in (2, 8):
            t = collective_time(op, sizes, n, tuned.scale_up, tuned.scale_out, 8)
            nccl += [dict(chip="h100", op=op, n=n, bytes=float(a), seconds=float(b))
                     for a, b in zip(sizes, t, strict=True)]
    return gemm, nccl


#: Unconstrained shifts of the hopper prior by field (`FAMILY_FIELDS`; the others, which no
#: sample here sees, unshifted).
SHIFT = jnp.asarray([{"compute_max": 0.6, "compute_rows_half": -0.5, "bandwidth_max": -0.4,
                      "memory_latency": 0.5, "format_ceiling": -0.4,
                      "collective_efficiency": -0.7,
                      "collective_latency": 0.8, "collective_base_latency": -0.3}.get(f[0], 0.0)
                     for f in cal.FAMILY_FIELDS])


def test_fit_recovers_known_parameters():
    prior = cal.Params.prior(("hopper",), ())
    truth = prior.with_flat(prior.flat + SHIFT)
    gemm, nccl = _synthetic(truth)
    blocks = [cal.OpTimings.gemm(gemm), cal.OpTimings.nccl(nccl)]
    result = cal.fit(prior, blocks, max_steps=100, rtol=1e-10, atol=1e-12)
    assert succeeded(result.result)
    assert float(result.loss) < 1e-12
    got, want = result.params.values()["families"]["hopper"], \
        truth.values()["families"]["hopper"]
    # BF16 and FP8 GEMMs together identify the format ceiling.
    for name in ("compute_max", "compute_rows_half", "bandwidth_max", "format_ceiling",
                 "collective_efficiency", "collective_latency", "collective_base_latency"):
        assert got[name] == pytest.approx(want[name], rel=0.02), name
    # GEMM timings only see the sum of memory latency and kernel overhead.
    assert got["memory_latency"] + got["kernel_overhead"] == pytest.approx(
        want["memory_latency"] + want["kernel_overhead"], rel=0.02)


def test_fit_result_codes_and_throw():
    prior = cal.Params.prior(("hopper",), ())
    gemm, _ = _synthetic(prior.with_flat(prior.flat + 0.5))
    block = cal.OpTimings.gemm(gemm)
    out = cal.fit(prior, [block], max_steps=1, throw=False)
    assert out.result == RESULTS.nonlinear_max_steps_reached
    assert isinstance(out.result, RESULTS)
    with pytest.raises(RuntimeError, match="calibrate: The maximum number of steps"):
        cal.fit(prior, [block], max_steps=1)
    with pytest.raises(ValueError, match="at least one residual block"):
        cal.fit(prior, [])


class _NotANumber(cal.AbstractBlock):
    def __call__(self, params):
        return jnp.full(3, jnp.nan) * jnp.sum(params.flat), None


def test_fit_reports_nonfinite():
    p = cal.Params.prior(("hopper",), ())
    out = cal.fit(p, [_NotANumber()], throw=False)
    assert out.result == RESULTS.nonfinite
    with pytest.raises(RuntimeError, match="calibrate: Nonfinite"):
        cal.fit(p, [_NotANumber()])


class _DoubleWell(cal.AbstractBlock):
    """Residuals (x^2 - 1, 0.3 (x - 1)) of the first unconstrained value x: minima near
    x = 1 (loss 0) and x = -1 (a residual of 0.6: Huber loss 0.2 x (0.6 - 0.1) = 0.1 at
    `cal.DELTA` 0.2), a ridge at x = 0 between them."""

    def __call__(self, params):
        x = params.flat[0]
        return jnp.stack([x ** 2 - 1.0, 0.3 * (x - 1.0)]), None


def test_hop_leaves_a_local_minimum_the_solve_stays_in():
    p = cal.Params.prior(("hopper",), ())
    start = p.with_flat(p.flat.at[0].set(-1.2))
    plain = cal.fit(start, [_DoubleWell()], max_steps=50)
    assert float(plain.params.flat[0]) == pytest.approx(-1.0, abs=0.1)
    assert float(plain.loss) == pytest.approx(0.1, abs=0.01)
    # Every value moves, by 1.5 widths: a hop crosses the ridge with a chance of 1 in 4.
    kw = dict(max_steps=50, fraction=1.0, scale=1.5)
    hopped = cal.hop(start, [_DoubleWell()], hops=8, seed=0, **kw)
    assert succeeded(hopped.result)
    assert float(hopped.params.flat[0]) == pytest.approx(1.0, abs=1e-3)
    assert float(hopped.loss) < 1e-6
    # A function of the seed; no hops is the plain solve; a hop never returns a higher loss.
    again = cal.hop(start, [_DoubleWell()], hops=8, seed=0, **kw)
    np.testing.assert_array_equal(again.params.flat, hopped.params.flat)
    # The move that found it is reported, and that many moves find it again: the moves are
    # drawn in order, so a shorter run is the longer one's beginning (what lets the slow
    # refit test stop at the shipped fit's `hop_best` instead of running every hop). The
    # longer run has moves past the best one (its loss, 0, cannot be beaten), so this
    # compares two different runs, not one run with itself.
    assert 1 <= hopped.hop <= 8
    longer = cal.hop(start, [_DoubleWell()], hops=hopped.hop + 4, seed=0, **kw)
    shorter = cal.hop(start, [_DoubleWell()], hops=longer.hop, seed=0, **kw)
    np.testing.assert_array_equal(shorter.params.flat, longer.params.flat)
    assert shorter.hop == hopped.hop
    if hopped.hop > 1:
        before = cal.hop(start, [_DoubleWell()], hops=hopped.hop - 1, seed=0, **kw)
        assert float(before.loss) > float(hopped.loss)
    none = cal.hop(start, [_DoubleWell()], hops=0, max_steps=50)
    np.testing.assert_array_equal(none.params.flat, plain.params.flat)
    assert none.hop == 0
    for seed in range(3):
        out = cal.hop(start, [_DoubleWell()], hops=2, seed=seed, **kw)
        assert float(out.loss) <= float(plain.loss)
    with pytest.raises(ValueError, match="hops >= 0"):
        cal.hop(start, [_DoubleWell()], hops=-1)
    with pytest.raises(ValueError, match="0 < fraction <= 1"):
        cal.hop(start, [_DoubleWell()], hops=1, fraction=0.0)


# --- shipped parameter files ----------------------------------------------------------------

def test_shipped_fit_is_physical():
    data = fitted.read(fitted.LATENCY_FILE)
    assert data, "perfmodel/data/fitted_params.json is missing or empty"
    assert data["version"] == 2
    for key in ("date", "fitted_on", "seed", "result", "inferencemax_rows_fitted"):
        assert key in data, key
    for fam, groups in data["families"].items():
        for name, value in groups["efficiency"].items():
            assert value > 0, (fam, name)
            if name.endswith("_max"):
                assert value <= 1.0, (fam, name)
        assert 0 < groups["scale_up"]["efficiency"] <= 1.0
    for fw in data["frameworks"].values():
        for name in cal.FRAMEWORK_NAMES:
            assert fw[name] > 0, name


# --- end-to-end rows --------------------------------------------------------------------------

def _rows(tmp_path):
    text = HEADER + GOOD + GOOD.replace(",1024,1024,8,", ",8192,1024,64,") \
        + GOOD.replace(",vllm,", ",trt,").replace(",8,1,1,", ",128,2,1,") \
        + GOOD.replace(",1024,1024,8,", ",1024,8192,16,")
    return datasets.load_benchmarks(_write(tmp_path, text), require_measured=True)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Four B200 rows (tp1 and tp2, vLLM and TRT-LLM) and their compiled problem."""
    rows = _rows(tmp_path_factory.mktemp("calibrate"))
    return rows, cal.Calibration(rows)


def test_batches_merge_aggregated_layouts(small):
    rows, problem = small
    assert problem.batches == 1             # tp1 and tp2 rows share one vmapped function
    assert len(cal.build_groups(rows)[0]) == 2


def test_compiled_predictions_match_eager(small):
    rows, problem = small
    p = cal.Params.prior(problem.families, problem.frameworks)
    p = p.with_flat(p.flat + 0.1 * jnp.arange(p.flat.size) / p.flat.size)
    jitted = problem.predict(p)
    eager = cal.predict_rows(rows, p, power={})     # the fit's chips: prior energies
    for k in range(len(rows)):
        # The fit's outputs use the measured columns' names; predictions `Metrics.to_row`'s.
        for key, column in (("tput_per_gpu", "pred_tput_per_chip_total"),
                            ("median_ttft_s", "pred_ttft_s"), ("median_tpot_s", "pred_tpot_s")):
            assert jitted[key][k] == pytest.approx(eager[k][column], rel=1e-9), key
    assert jitted["basis"] == ["fitted:blackwell"] * len(rows)
    assert problem.fits().all()


def test_residual_jacobian_matches_central_differences(small):
    _, problem = small
    p = cal.Params.prior(problem.families, problem.frameworks)
    theta = p.flat + 0.05

    @jax.jit
    def f(theta):
        return problem.end_to_end(p.with_flat(theta))[0]

    # JAX's default float64 tolerance for derivative checks is about 1e-5 relative; a central
    # difference of step 1e-5 on these O(1) log residuals is accurate to about 1e-9.
    for jv, fd in _central_differences(f, theta):
        np.testing.assert_allclose(jv, fd, rtol=1e-5, atol=1e-7)


@pytest.mark.slow   # compiles for 10 s or more (CI's slow stage runs it)
def test_small_fit_converges_reproducibly_and_masks_rows(small):
    rows, problem = small
    result, families, frameworks = problem.fit()
    assert succeeded(result.result) and int(result.steps) < 100
    assert families == ("blackwell",) and frameworks == ("trt", "vllm")
    # The reported loss is the objective at the returned parameters.
    blocks = [problem.end_to_end, cal.Prior.build(result.params)]
    r = jnp.concatenate([cal.huber_residuals(b(result.params)[0], cal.DELTA) for b in blocks])
    assert float(result.loss) == pytest.approx(0.5 * float(jnp.sum(r ** 2)), rel=1e-9)
    again, _, _ = problem.fit()
    np.testing.assert_array_equal(again.params.flat, result.params.flat)
    # A subset is a mask: the TRT-LLM row out, its framework then has no data.
    masked, _, frameworks = problem.fit([r for r in rows if r.framework == "vllm"])
    assert frameworks == ("vllm",)
    trt = masked.params.frameworks.index("trt")
    np.testing.assert_allclose(masked.params.framework_raw[trt],
                               cal.prior_row(cal.FRAMEWORK_FIELDS), atol=1e-6)
    with pytest.raises(RuntimeError, match="calibrate: The maximum number of steps"):
        problem.fit(max_steps=2)


def test_row_predictions_are_the_package_model():
    """`perfmodel predict` on a benchmark row gives what `perfmodel.predict` gives on the
    fitted chip (`get_chip`) and framework (`runtime_for`): power from the power fit."""
    row = datasets.BenchRow(0, 2, "gpt-oss-120b", "b200", "vllm", "fp4", 1024., 1024., 64.,
                            False, datasets.PoolLayout(1, 1, False), None, None, {})
    got = cal.predict_rows([row])[0]
    model, chip = pm.get_model("gpt-oss-120b"), pm.get_chip("b200")
    design = pm.Design(concurrency=64.0, layout=pm.Layout(),
                       precision=pm.precision(chip, model, "fp4"),
                       runtime=fitted.runtime_for("vllm"))
    want = pm.predict(model, chip, pm.Workload(1024., 1024.), design, check=False)
    for key, field in (("pred_tput_per_chip_total", "throughput_per_chip"),
                       ("pred_ttft_s", "ttft"), ("pred_power_w_modelled", "power_per_chip")):
        assert got[key] == pytest.approx(float(getattr(want, field)), rel=1e-9), key
    prior = cal.predict_rows([row], power={})[0]
    assert abs(prior["pred_power_w_modelled"] / got["pred_power_w_modelled"] - 1) > 0.01


def test_layout_that_does_not_fit_is_reported(tmp_path):
    # DeepSeek-R1 in FP8 on 2 GB200s with DP attention: ~340 GB of weights per GPU.
    row = "deepseek-r1,gb200,sglang,fp8,none,False,8192,1024,64,2,2,True,1,0.02,1.0\n"
    rows = datasets.load_benchmarks(_write(tmp_path, HEADER + row))
    pred = cal.predict_rows(rows, cal.Params.prior((), ()))[0]
    # No numbers for a deployment that cannot hold one request (it had a throughput of
    # "almost nothing ran" before), and the reason.
    assert all(pred[key] is None for key in cal.PREDICTION_KEYS)
    assert "does not fit" in pred["pred_error"] and "HBM" in pred["pred_error"]
    assert (pred["pred_model"], pred["pred_chip"]) == ("deepseek-r1", "gb200")


@pytest.mark.slow
def test_refit_reproduces_shipped_parameters():
    """The full fit (`calibration/fit.py`'s data, split, pooling and basin hopping;
    minutes on 2 cores) gives the shipped file's loss and parameters.

    It runs the hops up to the one that found the shipped minimum (the file's `hop_best`),
    not all `fitting.HOPS`: the moves are drawn in order from the seed, so those are the
    same solves (`test_hop_leaves_a_local_minimum_the_solve_stays_in`), and the later ones,
    which found nothing lower, only cost CI minutes."""
    sys.path.insert(0, str(ROOT / "calibration"))
    import fit as fitting
    shipped = fitted.read(fitted.LATENCY_FILE)
    assert (shipped["hops"], shipped["hop_seed"]) == (fitting.HOPS, fitting.HOP_SEED)
    assert 0 <= shipped["hop_best"] <= shipped["hops"]
    rows, gemm, nccl = fitting.load_all()
    train, _ = fitting.split(rows)
    problem = cal.Calibration(rows, gemm, nccl)
    result, families, frameworks = problem.fit(train, max_steps=fitting.MAX_STEPS,
                                               pooling=fitting.POOLING,
                                               hops=shipped["hop_best"],
                                               seed=fitting.HOP_SEED)
    assert succeeded(result.result)
    assert result.hop == shipped["hop_best"]
    assert float(result.loss) == pytest.approx(shipped["loss"], rel=1e-6)
    want = cal.from_json(shipped)
    got = result.params.subset(families, frameworks)
    assert (got.families, got.frameworks) == (want.families, want.frameworks)
    # The fit's own tolerance: it stops once a step moves the unconstrained parameters by
    # less than atol + rtol x their max norm (1e-4 each: 1.5e-3 here, 0.15 % of a log).
    tolerance = 1e-4 + 1e-4 * float(jnp.max(jnp.abs(want.flat)))
    np.testing.assert_allclose(got.flat, want.flat, rtol=0, atol=tolerance)


def test_a_stalled_run_fits_its_medians_not_its_throughput(tmp_path):
    """p99 TTFT 40 s over a 30 ms median is a stall (`BenchRow.stalled`); 25 s, or 40 s
    over a 3 s median, is not. Only the stalled row's throughput weight is zero."""
    header = HEADER.rstrip("\n") + ",p99_ttft_s\n"
    body = "gpt-oss-120b,b200,vllm,fp4,none,False,1024,1024,{c},1,1,False,2000,0.004,{m},{p}\n"
    text = header + "".join(body.format(c=c, m=m, p=p) for c, m, p in
                            ((4, 0.03, 40.0), (8, 0.03, 25.0), (16, 3.0, 40.0)))
    rows = datasets.load_benchmarks(_write(tmp_path, text), require_measured=True)
    assert [r.stalled for r in rows] == [True, False, False]
    block, _ = cal.EndToEnd.build(rows)
    weights = np.asarray(block.weights)[[block.indices.index(r.index) for r in rows]]
    tput = cal.E2E_KEYS.index("tput_per_gpu")
    assert weights[0, tput] == 0.0 and np.all(np.delete(weights[0], tput) > 0.0)
    assert np.all(weights[1:] > 0.0)


# --- the fit sharded over devices ------------------------------------------------------------

def _sharding_rows(tmp_path):
    """Nine B200 rows of one batch (vLLM tp1 and TRT-LLM tp2 at five concurrencies): over
    four devices the batch is padded to twelve rows."""
    lines = []
    for k, conc in enumerate((4, 8, 16, 32, 64)):
        for fw, tp in (("vllm", 1), ("trt", 2)):
            lines.append(f"gpt-oss-120b,b200,{fw},fp4,none,False,1024,1024,{conc},{tp},1,"
                         f"False,{2000 * (1 + 0.1 * k) / tp},{0.004 * (1 + 0.05 * k)},"
                         f"{0.03 * (1 + 0.2 * k)}\n")
    return _write(tmp_path, HEADER + "".join(lines[:-1]))


def test_devices_are_checked_and_one_device_is_the_default_program(tmp_path):
    assert cal.devices_placement(None) is None and cal.devices_placement(1) is None
    assert (cal.devices_placement("all") is None) == (len(jax.local_devices()) == 1)
    for bad in (0, True, "two", 2.0, len(jax.local_devices()) + 1):
        with pytest.raises(ValueError, match="devices"):
            cal.devices_placement(bad)
    rows = datasets.load_benchmarks(_sharding_rows(tmp_path), require_measured=True)
    block, _ = cal.EndToEnd.build(rows)
    (batch,) = block.batches
    padded = batch.padded(4)
    assert (batch.size, batch.length, padded.size, padded.length) == (9, 9, 9, 12)
    assert padded.frameworks[9:] == (batch.frameworks[-1],) * 3
    np.testing.assert_array_equal(padded.inputs["conc"][8:], batch.inputs["conc"][8])
    assert batch.padded(3).length == 9


SHARDED_FIT = """
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
import equinox as eqx
import numpy as np
from perfmodel import calibration as cal, datasets
assert len(jax.local_devices()) == 4
rows = datasets.load_benchmarks({csv!r}, require_measured=True)
out = {{}}
for devices in (None, 4):
    problem = cal.Calibration(rows, devices=devices)
    p = cal.Params.prior(problem.families, problem.frameworks)
    p = p.with_flat(p.flat + 0.05)
    block = problem.end_to_end
    r = eqx.filter_jit(lambda p, b: b(p)[0])(p, block)
    jac = eqx.filter_jit(lambda p, b: jax.jacfwd(lambda t: b(p.with_flat(t))[0])(p.flat))(
        p, block)
    fit, families, frameworks = problem.fit(max_steps=40)
    predicted = problem.predict(fit.params)
    out[str(devices)] = dict(
        tput=predicted["tput_per_gpu"].tolist(), fits=problem.fits(fit).tolist(),
        length=[b.length for b in block.batches], r=np.asarray(r).tolist(),
        jac=np.asarray(jac).tolist(), params=np.asarray(fit.params.flat).tolist(),
        aux=np.asarray(fit.aux[0]).tolist(), loss=float(fit.loss), steps=int(fit.steps),
        families=families, frameworks=frameworks)
print(json.dumps(out))
"""


@pytest.mark.slow   # two fits compiled in a subprocess: about 35 s on 2 cores
def test_fit_sharded_over_four_devices_gives_the_same_parameters(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-c", SHARDED_FIT.format(
        csv=str(_sharding_rows(tmp_path)))], check=True, env=env, timeout=600,
        capture_output=True, text=True)
    out = json.loads(done.stdout.splitlines()[-1])
    one, four = out["None"], out["4"]
    assert (one["length"], four["length"]) == ([9], [12])      # three padding rows
    # Each row's residuals are computed by the same code on any device: equal. Its Jacobian
    # too, to 1e-13 relative: the tangents run through fusions that XLA:CPU forms differently
    # for a batch of 9 rows and one of 3 per device (1.1e-14 in 1 of 567 entries since the host
    # time per prompt joined the step time, `Runtime.prefill_request_time`).
    assert four["r"] == one["r"]
    np.testing.assert_allclose(four["jac"], one["jac"], rtol=1e-13, atol=1e-300)
    assert (four["steps"], four["families"], four["frameworks"]) == \
        (one["steps"], one["families"], one["frameworks"])
    # The solve's programs differ (one device, four), and XLA's fusion with them: the
    # iterates agree to a few ulps per step (8e-14 relative measured after 14 steps).
    np.testing.assert_allclose(four["params"], one["params"], rtol=1e-12, atol=0)
    np.testing.assert_allclose(four["aux"], one["aux"], rtol=1e-12, atol=1e-14)
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-12)
    # Predictions of a sharded problem: every row, none of the padding.
    assert len(four["tput"]) == 9 and four["fits"] == one["fits"]
    np.testing.assert_allclose(four["tput"], one["tput"], rtol=1e-12, atol=0)


def test_shipped_rows_are_read_with_the_attention_math_their_kernels_run():
    """The fit reads each row's attention math by `design.attention_class`: the Blackwell
    DeepSeek-R1 rows with their recipes' FP8 cache (B200 SGLang, GB200 Dynamo) run FP8
    MLA kernels, every other group BF16 math (the same rule the GPU baseline of
    `perfmodel compare` runs its recipe with)."""
    rows = datasets.load_benchmarks(ROOT / "calibration" / "data" / "benchmarks_inferencemax.csv")
    groups, errors = cal.build_groups(rows)
    assert not errors
    fp8 = COMPUTE_CLASSES.index("fp8")
    seen = {}
    for g in groups:
        key = (g.model.name, g.rows[0].hardware, g.rows[0].framework)
        math = np.asarray(g.design.precision.attention_compute)
        seen.setdefault(key, set()).add(bool(math[fp8]))
    fp8_groups = {k for k, v in seen.items() if v == {True}}
    assert fp8_groups == {("deepseek-r1", "b200", "sglang"),
                          ("deepseek-r1", "gb200", "dynamo-sglang"),
                          ("deepseek-r1", "gb200", "dynamo-trt")}, seen
    assert all(len(v) == 1 for v in seen.values()), seen
