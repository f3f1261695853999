"""Calibration: parameter spaces, data validation, synthetic recovery, determinism."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from perfmodel import calibrate as cal
from perfmodel import datasets, fitted
from perfmodel.presets import get_chip

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


def test_gemm_time_gradient_matches_finite_differences():
    chip = get_chip("b200", calibrated=False)
    m = jnp.asarray([1.0, 64.0, 4096.0])
    n = k = jnp.full(3, 8192.0)

    def f(raw):
        return jnp.sum(jnp.log(cal._gemm_time(cal.with_family(chip, raw), m, n, k, "fp8")))

    raw = cal.Params.prior(("blackwell",), ()).family_raw[0]
    grad = jax.grad(f)(raw)
    for seed in range(3):
        v = jax.random.normal(jax.random.PRNGKey(seed), raw.shape)
        v = v / jnp.linalg.norm(v)
        h = 1e-5
        fd = (f(raw + h * v) - f(raw - h * v)) / (2 * h)
        np.testing.assert_allclose(jnp.dot(grad, v), fd, rtol=1e-6, atol=1e-9)


# --- solver --------------------------------------------------------------------------------

def _synthetic(truth, fams=("hopper",)):
    """Op-level samples generated by the model itself with known parameters."""
    chip = get_chip("h100", calibrated=False)
    tuned = cal.with_family(chip, truth.family_raw[0])
    gemm, nccl = [], []
    for dtype in ("bfloat16", "fp8"):
        m = jnp.asarray([1.0, 8, 32, 128, 512, 2048, 8192, 16384])
        for nk in (4096.0, 16384.0):
            t = cal._gemm_time(tuned, m, jnp.full(8, nk), jnp.full(8, nk), dtype)
            gemm += [dict(chip="h100", dtype=dtype, m=float(a), n=nk, k=nk, seconds=float(b))
                     for a, b in zip(m, t, strict=True)]
    sizes = jnp.asarray([1e3, 1e4, 1e5, 1e6, 1e7, 1e8])
    for op in ("all_reduce", "all_gather"):
        for n in (2, 8):
            t = cal.collective_time(op, sizes, n, tuned.scale_up, tuned.scale_out, 8)
            nccl += [dict(chip="h100", op=op, n=n, bytes=float(a), seconds=float(b))
                     for a, b in zip(sizes, t, strict=True)]
    return gemm, nccl


def test_fit_recovers_known_parameters():
    prior = cal.Params.prior(("hopper",), ())
    shift = jnp.asarray([0.6, -0.5, -0.4, 0.5, 0.0, 0.0, -0.7, 0.8, -0.3])
    truth = prior.with_flat(prior.flat + shift)
    gemm, nccl = _synthetic(truth)
    blocks = [cal.gemm_block(prior, gemm)[0], cal.nccl_block(prior, nccl)[0]]
    result = cal.fit(prior, blocks, max_steps=60, rtol=1e-14, progress=False)
    assert result.result == cal.SUCCESSFUL
    got, want = result.params.values()["families"]["hopper"], \
        truth.values()["families"]["hopper"]
    for name in ("compute_max", "compute_rows_half", "bandwidth_max",
                 "collective_efficiency", "collective_latency", "collective_base_latency"):
        assert got[name] == pytest.approx(want[name], rel=0.02), name
    # GEMM timings only see the sum of memory latency and kernel overhead.
    assert got["memory_latency"] + got["kernel_overhead"] == pytest.approx(
        want["memory_latency"] + want["kernel_overhead"], rel=0.02)


def test_fit_result_codes_and_throw():
    prior = cal.Params.prior(("hopper",), ())
    truth = prior.with_flat(prior.flat + 0.5)
    gemm, _ = _synthetic(truth)
    block = cal.gemm_block(prior, gemm)[0]
    out = cal.fit(prior, [block], max_steps=1, rtol=0.0, progress=False)
    assert out.result == cal.MAX_STEPS
    with pytest.raises(RuntimeError, match="did not converge"):
        cal.fit(prior, [block], max_steps=1, rtol=0.0, progress=False, throw=True)


def test_fit_reports_nonfinite():
    p = cal.Params.prior(("hopper",), ())

    def evaluate(theta, jacobian):
        r = np.full(3, np.nan)
        return r, (np.zeros((3, theta.size)) if jacobian else None)

    out = cal.fit(p, [cal.Block("nan", evaluate, 3)], progress=False)
    assert out.result == cal.NONFINITE


def test_huber_weights_and_loss():
    r = np.array([0.0, 0.1, -1.0])
    np.testing.assert_allclose(cal.huber_weights(r, 0.2), [1.0, 1.0, 0.2])
    assert cal.huber_loss(r, 0.2) == pytest.approx(0.5 * 0.01 + 0.2 * (1.0 - 0.1))


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


# --- compiled group functions ---------------------------------------------------------------

def _rows(tmp_path):
    text = HEADER + GOOD + GOOD.replace(",1024,1024,8,", ",8192,1024,64,") \
        + GOOD.replace(",vllm,", ",trt,").replace(",8,1,1,", ",128,1,1,")
    return datasets.load_benchmarks(_write(tmp_path, text), require_measured=True)


def test_group_function_matches_eager_and_never_retraces(tmp_path):
    rows = _rows(tmp_path)
    e2e = cal.EndToEnd(rows, progress=False)
    assert len(e2e.functions) == 1          # one static structure, two frameworks
    p = cal.Params.prior(e2e.families, e2e.frameworks)
    p = p.with_flat(p.flat + 0.1 * jnp.arange(p.flat.size) / p.flat.size)
    jitted = e2e.predict(p)
    eager = cal.predict_rows(rows, p)
    for k in range(len(rows)):
        assert jitted["tput_per_gpu"][k] == pytest.approx(eager[k]["pred_tput_per_gpu"],
                                                          rel=1e-9)
        assert jitted["median_ttft_s"][k] == pytest.approx(eager[k]["pred_median_ttft_s"],
                                                           rel=1e-9)
    # Masks and new parameter values reuse the one compiled function (assert_max_traces).
    for weights in (np.ones(3), np.array([1.0, 0.0, 1.0])):
        block = e2e.block(p, weights)
        r, J = block.evaluate(p.flat + 0.01, True)
        assert r.shape == (3 * int(weights.sum()),) and np.all(np.isfinite(J))


def test_block_jacobian_matches_central_differences(tmp_path):
    rows = _rows(tmp_path)
    e2e = cal.EndToEnd(rows, progress=False)
    p = cal.Params.prior(e2e.families, e2e.frameworks)
    block = e2e.block(p, np.ones(len(rows)))
    theta = np.asarray(p.flat) + 0.05
    _, J = block.evaluate(theta, True)
    # Forward differences at step 1e-6 in float64: about 1e-6 relative accuracy.
    for seed in range(2):
        v = np.random.default_rng(seed).normal(size=theta.size)
        h = 1e-4
        fd = (block.evaluate(theta + h * v, False)[0]
              - block.evaluate(theta - h * v, False)[0]) / (2 * h)
        np.testing.assert_allclose(J @ v, fd, rtol=1e-4, atol=1e-5)


def test_layout_that_does_not_fit_is_reported(tmp_path):
    # DeepSeek-R1 in FP8 on 2 GB200s with DP attention: ~340 GB of weights per GPU.
    row = "deepseek-r1,gb200,sglang,fp8,none,False,8192,1024,64,2,2,True,1,0.02,1.0\n"
    rows = datasets.load_benchmarks(_write(tmp_path, HEADER + row))
    pred = cal.predict_rows(rows, cal.Params.prior((), ()))[0]
    assert pred["pred_tput_per_gpu"] is not None
    assert "does not fit" in pred["pred_error"]
