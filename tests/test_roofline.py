"""The per-operator roofline: FLOP and byte counts against the scaling book's arithmetic
intensities, and how operator times combine into a step."""

from __future__ import annotations

import dataclasses
import pathlib

import equinox as eqx
import numpy as np
import pytest

import perfmodel as pm
from perfmodel import roofline
from perfmodel.formats import COMPUTE_CLASSES
from perfmodel.roofline import OPERATOR_NAMES, operator_time

WEIGHT_OPS = ("qkv_proj", "out_proj", "dense_ffn", "lm_head")


def _dense_design(fmt, kv="bf16"):
    chip, model = pm.get_chip("b200"), pm.get_model("llama-3.1-8b")   # B200 runs NVFP4
    return model, chip, pm.Design(concurrency=1.0, layout=pm.Layout(tp=1),
                                  precision=pm.precision(chip, model, fmt, kv=kv))


@pytest.mark.parametrize("fmt, bytes_per_weight", [("bf16", 2.0), ("fp8", 1.0),
                                                   ("nvfp4", 0.5625)])
@pytest.mark.parametrize("batch", [1.0, 4.0])
def test_dense_decode_intensity_is_2b_over_bytes(fmt, bytes_per_weight, batch):
    """A decode matmul reads each weight once and does 2 FLOPs per weight per sequence: its
    arithmetic intensity is about 2 B / b FLOP/byte for b bytes per weight ("How to Scale
    Your Model", inference chapter: 2BDF / (2BD + 2DF + 2BF) ~ B for bf16, B << D, F).
    Activation traffic is < 0.3 % of the weight bytes here, hence 1 %."""
    model, chip, design = _dense_design(fmt)
    assert float(design.precision.weight_bytes) == bytes_per_weight
    ops = {op.name: op for op in pm.operators(model, chip, design, design.layout, batch,
                                              2048.0)}
    for name in WEIGHT_OPS:
        np.testing.assert_allclose(float(ops[name].intensity), 2 * batch / bytes_per_weight,
                                   rtol=1e-2, err_msg=name)
    weights = sum(float(ops[n].weight_bytes) for n in WEIGHT_OPS)
    # Every non-embedding weight is read once per step.
    np.testing.assert_allclose(weights, model.active_params * bytes_per_weight, rtol=1e-12)


@pytest.mark.parametrize("batch", [1.0, 16.0, 256.0])
def test_decode_attention_intensity_is_constant(batch):
    """Attention at decode reads each sequence's own KV cache: its intensity does not grow
    with batch. With Q/KV head ratio N/K it is 2 N / (K b) FLOP/byte (MHA in bf16: 1, the
    book's "S >> T = 1 implies ST / (S + T) ~ 1")."""
    model, chip, design = _dense_design("bf16")
    op = pm.operators(model, chip, design, design.layout, batch, 8192.0)[1]
    assert op.name == "attention"
    ratio = model.num_heads / model.num_kv_heads
    # The new token's KV write adds 1 / 8192 of the read.
    np.testing.assert_allclose(float(op.intensity), 2 * ratio / 2.0, rtol=1e-3)


def test_mla_decode_attention_flops():
    """Absorbed MLA at decode: scores over the 576-wide latent and values over the 512-wide
    latent for each of N = 128 heads: 2 N (2 r + r_rope) FLOPs per cached token and layer."""
    chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
    design = pm.Design(concurrency=1.0, layout=pm.Layout(tp=8, ep=8, dp_attention=True),
                       precision=pm.precision(chip, model, "fp4"))
    batch, context = 64.0, 4096.0
    op = pm.operators(model, chip, design, design.layout, batch, context)[1]
    per_chip_batch = batch / 8   # DP attention: each chip runs its own sequences
    want = 2 * per_chip_batch * 128 * context * 61 * (2 * 512 + 64)
    np.testing.assert_allclose(float(op.flops), want, rtol=1e-12)
    # BF16 latent cache (the engines' default): 576 values x 2 bytes per token and layer,
    # read once (+ the new token).
    kv = per_chip_batch * 61 * 576 * 2 * (context + 1)
    np.testing.assert_allclose(float(op.kv_bytes), kv, rtol=1e-12)


@pytest.mark.parametrize("batch", [32.0, 4096.0])   # memory-bound, then compute-bound
def test_operator_time_is_its_roofline(batch):
    """hard=True: max(compute, memory, fabric) + kernels x overhead, exactly."""
    model, chip, design = _dense_design("fp8")
    eff = chip.efficiency
    bound = []
    for op in pm.operators(model, chip, design, design.layout, batch, 2048.0):
        t, _ = operator_time(op, chip, design, batch, hard=True)
        peaks = np.asarray(chip.peak_flops)   # each class under the format ceiling
        peaks = peaks * (1.0 + 1.0 / float(eff.format_ceiling)) / (
            1.0 + peaks / (float(eff.format_ceiling) * peaks[0]))
        peak = float(np.sum(np.asarray(op.compute_mix) * peaks))
        frac = float(eff.attention_max) if op.name == "attention" else \
            float(eff.compute_fraction(op.rows))
        compute = float(op.flops) / (peak * max(frac, 1e-6))
        memory = float(op.hbm_bytes) / float(chip.hbm_bandwidth * eff.bandwidth_max) \
            + float(eff.memory_latency) * (float(op.hbm_bytes) > 0)
        want = max(compute, memory) + float(eff.kernel_overhead) * float(op.kernels)
        np.testing.assert_allclose(float(t), want, rtol=1e-12, err_msg=op.name)
        bound.append(compute > memory)
    assert any(bound) == (batch > 1000.0)


@pytest.mark.parametrize("batch", [1.0, 64.0, 2048.0])
def test_step_is_sum_of_operators_and_smooth_bound(batch):
    """A step is the sum of its operators, collectives and host overhead; the smooth max
    lies between the hard max and 3^(1/24) times it (three roofline terms, p = 24)."""
    chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-70b")
    zero = {f.name: 0.0 for f in dataclasses.fields(pm.Runtime)
            if "overhead" in f.name and f.name != "step_overhead"}
    design = pm.Design(concurrency=1.0, layout=pm.Layout(tp=8),
                       precision=pm.precision(chip, model, "fp8"),
                       runtime=pm.Runtime(step_overhead=1e-3, **zero))
    hard = pm.step_cost(model, chip, design, design.layout, batch, 4096.0, 1024.0, 512.0,
                        1.0, hard=True)
    names = [op.name for op in pm.operators(model, chip, design, design.layout, batch, 4096.0)]
    assert len(hard.operator_times) == len(names) and set(names) <= set(OPERATOR_NAMES)
    np.testing.assert_allclose(float(hard.time), float(sum(hard.operator_times))
                               + float(hard.collective_time) + 1e-3, rtol=1e-12)
    assert float(hard.collective_time) > 0   # TP8 all-reduces
    smooth = pm.step_cost(model, chip, design, design.layout, batch, 4096.0, 1024.0, 512.0,
                          1.0)
    assert float(hard.time) <= float(smooth.time) <= 3 ** (1 / 24) * float(hard.time)
    np.testing.assert_allclose(float(smooth.flops), float(hard.flops), rtol=1e-12)


def test_prefill_is_compute_bound_and_decode_memory_bound():
    """The book's two regimes: an 8k-token prefill chunk is compute-bound in every matmul,
    a batch-1 decode step is memory-bound in every operator."""
    model, chip, design = _dense_design("fp8")
    peak = chip.peak_flops[1]
    bandwidth = chip.hbm_bandwidth
    decode = pm.operators(model, chip, design, design.layout, 1.0, 2048.0)
    prefill = pm.operators(model, chip, design, design.layout, 0.0, 0.0, 8192.0, 4096.0, 1.0)
    for op in decode:
        if float(op.flops) > 0:
            assert float(op.flops / peak) < float(op.hbm_bytes / bandwidth), op.name
    for op in prefill:
        if op.name in ("qkv_proj", "out_proj", "dense_ffn"):
            assert float(op.flops / peak) > 2 * float(op.hbm_bytes / bandwidth), op.name



def test_each_model_runs_its_own_attention_kernels():
    """Full GQA attention (Llama) runs at FlashAttention's `full_attention_max` in both
    phases; MLA (DeepSeek-R1) at the fitted `prefill_attention_max` over the prompt and
    windowed attention (gpt-oss) at `window_prefill_attention_max`, both at `attention_max`
    in decode. Each phase's attention time follows its own field and ignores the other
    three, and compute-bound full attention takes FLOPs / (peak x full_attention_max)."""
    import equinox as eqx

    chip = pm.get_chip("h100")
    fields = ("attention_max", "prefill_attention_max", "window_prefill_attention_max",
              "full_attention_max")

    def attention_time(name, phase, **efficiency):
        model = pm.get_model(name)
        c = eqx.tree_at(lambda x: tuple(getattr(x.efficiency, k) for k in efficiency), chip,
                        tuple(efficiency.values()))
        # A prompt step (8192 tokens, no decode) or a decode step (256 sequences, 8k deep;
        # DP attention, so that all 128 MLA heads read each chip's latent cache: compute-bound).
        layout = pm.Layout(tp=8, dp_attention=phase == "decode")
        design = pm.Design(concurrency=1.0, layout=layout, precision=pm.precision(c, model))
        step = (0.0, 0.0, 8192.0, 4096.0, 1.0) if phase == "prefill" else \
            (256.0, 8192.0, 0.0, 0.0, 0.0)
        cost = pm.step_cost(model, c, design, design.layout, *step, hard=True)
        ops = pm.operators(model, c, design, design.layout, *step)
        i = OPERATOR_NAMES.index("prefill_attention" if phase == "prefill" else "attention")
        return float(cost.operator_times[i]), ops[i], c

    # (GQA decode is memory-bound at any of these efficiencies.)
    for name, phase, own in (("llama-3.1-70b", "prefill", "full_attention_max"),
                             ("deepseek-r1", "prefill", "prefill_attention_max"),
                             ("deepseek-r1", "decode", "attention_max"),
                             ("gpt-oss-120b", "prefill", "window_prefill_attention_max")):
        others = [f for f in fields if f != own]
        half = dict.fromkeys(fields, 0.5)
        base = attention_time(name, phase, **half)[0]
        assert attention_time(name, phase, **{**half, own: 0.25})[0] > 1.5 * base, \
            (name, phase)
        assert attention_time(name, phase, **{**half, **dict.fromkeys(others, 0.05)})[0] \
            == pytest.approx(base, rel=1e-12), (name, phase)
    t, op, c = attention_time("llama-3.1-70b", "prefill", full_attention_max=0.5)
    peak = float(c.efficiency.class_peaks(c.peak_flops)[COMPUTE_CLASSES.index("bf16")])
    assert t >= float(op.flops) / (peak * 0.5) * (1.0 - 1e-12)   # to rounding
    assert t == pytest.approx(float(op.flops) / (peak * 0.5), rel=0.05)


@pytest.mark.parametrize("name", ["deepseek-r1", "gpt-oss-120b", "llama-3.1-70b"])
def test_blackwell_ultra_prompt_attention_runs_its_documented_speedup(name):
    """GB300's softmax unit (`Chip.prompt_attention_speedup`, 1.35: NVIDIA's measurement)
    shortens its compute-bound prompt attention by that factor against the same chip without
    it, and leaves decode attention as fitted; GB200 and B200, the chips the Blackwell fit
    was made on, keep 1."""
    model = pm.get_model(name)
    gb300 = pm.get_chip("gb300")
    plain = eqx.tree_at(lambda c: c.prompt_attention_speedup, gb300, 1.0)
    assert float(gb300.prompt_attention_speedup) == pytest.approx(1.35)
    assert [float(pm.get_chip(c).prompt_attention_speedup) for c in ("gb200", "b200")] == \
        [1.0, 1.0]

    def attention(chip, phase):
        layout = pm.Layout(tp=8, dp_attention=phase == "decode")
        design = pm.Design(concurrency=1.0, layout=layout, precision=pm.precision(chip, model))
        step = (0.0, 0.0, 8192.0, 4096.0, 1.0) if phase == "prefill" else \
            (256.0, 8192.0, 0.0, 0.0, 0.0)
        cost = pm.step_cost(model, chip, design, layout, *step, hard=True)
        i = OPERATOR_NAMES.index("prefill_attention" if phase == "prefill" else "attention")
        return float(cost.operator_times[i])

    assert attention(plain, "prefill") / attention(gb300, "prefill") == \
        pytest.approx(1.35, rel=1e-3)
    assert attention(gb300, "decode") == pytest.approx(attention(plain, "decode"), rel=1e-12)
    with pytest.raises(ValueError, match="prompt_attention_speedup"):
        pm.from_datasheet("toy", bf16_tflops=1000, hbm_gb=80, hbm_tb_s=3.0, scaleup_gb_s=450,
                          tdp_w=700, prompt_attention_speedup=0.0)


def test_old_fitted_files_price_prompt_attention_as_before():
    """A fitted file written before `prefill_attention_max` existed prices all prompt
    attention at its `attention_max`, one written before `window_prefill_attention_max`
    prices windowed models' prompt attention at its `prefill_attention_max`, as they were
    fitted (`fitted.with_prefill_attention`); a file that has the fields keeps its own
    values."""
    from perfmodel.fitted import apply

    oldest = {"families": {"hopper": {"efficiency": {"attention_max": 0.07}}}}
    old = {"families": {"hopper": {"efficiency": {"attention_max": 0.07,
                                                  "prefill_attention_max": 0.3}}}}
    new = {"families": {"hopper": {"efficiency": {"attention_max": 0.07,
                                                  "prefill_attention_max": 0.3,
                                                  "window_prefill_attention_max": 0.1}}}}
    raw = pm.get_chip("h100", calibrated=False)
    e_oldest, e_old, e_new = (apply(raw, latency=v, power={}).efficiency
                              for v in (oldest, old, new))
    assert float(e_oldest.prefill_attention_max) == pytest.approx(0.07)
    assert float(e_oldest.window_prefill_attention_max) == pytest.approx(0.07)
    assert float(e_old.prefill_attention_max) == pytest.approx(0.3)
    assert float(e_old.window_prefill_attention_max) == pytest.approx(0.3)
    assert float(e_new.prefill_attention_max) == pytest.approx(0.3)
    assert float(e_new.window_prefill_attention_max) == pytest.approx(0.1)
    assert float(e_new.attention_max) == pytest.approx(0.07)


@pytest.mark.parametrize("tp, ep", [(8, 4), (8, 8), (8, 1), (4, 2)])
def test_link_bytes_count_every_collective(tp, ep):
    """DP attention on DeepSeek-R1: the bytes a chip sends in a step are the ring volumes
    of every collective its time counts (all-reduce 2 (n - 1) / n M, all-to-all (n - 1) / n
    of what it scatters): the dense layers' all-reduce over tp, each MoE layer's dispatch
    and combine over ep, and, with tp / ep > 1, the expert shards' all-reduce of the chip's
    tokens (missing from the bytes until it was counted here); without expert parallelism,
    an all-reduce over tp per MoE layer."""
    chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
    layout = pm.Layout(tp=tp, ep=ep, dp_attention=True)
    design = pm.Design(concurrency=64.0, layout=layout,
                       precision=pm.precision(chip, model, "nvfp4", kv="fp8"))
    seqs = 64.0
    cost = pm.step_cost(model, chip, design, layout, seqs, 4096.0)
    message = seqs * model.hidden * float(design.precision.activation_bytes)
    k, moe_tp = model.experts_per_token, tp // ep
    want = model.num_dense_layers * 2 * (tp - 1) / tp * message
    if ep > 1:
        want += model.num_moe_layers * 2 * message / tp * k * (ep - 1) / ep
        want += model.num_moe_layers * 2 * (moe_tp - 1) / moe_tp * message / tp
    else:
        want += model.num_moe_layers * 2 * (tp - 1) / tp * message
    np.testing.assert_allclose(float(cost.link_bytes), want, rtol=1e-12)


@pytest.mark.parametrize("experts, k, ep", [(256, 8, 8), (256, 8, 32), (128, 4, 2),
                                             (128, 4, 4), (256, 8, 1), (8, 8, 8)])
def test_ranks_per_token_is_the_hypergeometric_mean(experts, k, ep):
    """`moe.ranks_per_token` against the count written out by enumeration of the number of
    ranks: a rank of E / ep experts misses all k of a token's distinct experts with
    probability C(E - E/ep, k) / C(E, k) (math.comb, exact integers)."""
    import math

    from perfmodel.moe import ranks_per_token
    miss = math.comb(experts - experts // ep, k) / math.comb(experts, k)
    want = ep * (1.0 - miss)
    assert float(ranks_per_token(experts, k, float(ep))) == pytest.approx(want, rel=1e-12)
    assert 1.0 <= want <= min(k, ep) + 1e-12


@pytest.mark.parametrize("tp, ep", [(8, 8), (32, 32), (16, 16), (8, 4), (64, 16)])
def test_dispatch_per_rank_follows_trtllm_rule(tp, ep):
    """With `Runtime.dispatch_per_rank` 1 the MoE dispatch and combine carry each token as
    TensorRT-LLM does: gathered on every EP rank up to ep = k (ep copies: 4 at EP 4, the
    same 8 as one per expert at EP 8), once to each rank holding its experts above
    (`moe.ranks_per_token`: 6.5 at EP 16, 7.3 at EP 32, of DeepSeek-R1's k = 8). The link
    bytes move by exactly that many copies of the dispatch, and 0.5 lies halfway."""
    from perfmodel.moe import ranks_per_token
    chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
    layout = pm.Layout(tp=tp, ep=ep, dp_attention=True)
    prec = pm.precision(chip, model, "nvfp4", kv="fp8")

    def cost(share):
        design = pm.Design(concurrency=256.0, layout=layout, precision=prec,
                           runtime=pm.Runtime(dispatch_per_rank=share))
        return pm.step_cost(model, chip, design, layout, 256.0, 4096.0)

    per_expert, half, rule = cost(0.0), cost(0.5), cost(1.0)
    k = model.experts_per_token
    copies = ep if ep <= k else float(ranks_per_token(model.num_experts, k, float(ep)))
    message = 256.0 * model.hidden * float(prec.activation_bytes)
    dispatch = model.num_moe_layers * 2 * message / tp * (ep - 1) / ep
    np.testing.assert_allclose(float(per_expert.link_bytes - rule.link_bytes),
                               dispatch * (k - copies), rtol=1e-9, atol=1e-6)
    np.testing.assert_allclose(float(half.link_bytes),
                               0.5 * float(per_expert.link_bytes + rule.link_bytes),
                               rtol=1e-10)
    if ep != k:
        assert float(rule.collective_time) < float(per_expert.collective_time)
    else:
        assert float(rule.collective_time) == float(per_expert.collective_time)


def _vectorize_cases():
    """(model, chip, workload, design): dense and MoE, MLA, speculative decoding, slices
    placed by software, disaggregated pools, and a batch of concurrencies as an array."""
    h200, b200, jal = pm.get_chip("h200"), pm.get_chip("b200"), pm.get_chip("jalapeno")
    llama, r1 = pm.get_model("llama-3.1-8b"), pm.get_model("deepseek-r1")
    gptoss = pm.get_model("gpt-oss-120b")
    wl = pm.Workload(8192, 1024)
    return [
        (llama, h200, pm.Workload(1024, 256),
         pm.Design(concurrency=np.array([1.0, 7.0, 64.0, 300.0]), layout=pm.Layout(tp=1),
                   precision=pm.precision(h200, llama, "fp8"))),
        (gptoss, b200, pm.Workload(1024, 1024),
         pm.Design(concurrency=48.0, layout=pm.Layout(tp=2, ep=2),
                   precision=pm.precision(b200, gptoss, "nvfp4"))),
        (r1, jal, wl,
         pm.Design(concurrency=96.0, layout=pm.Layout(tp=8, ep=8, dp_attention=True),
                   precision=pm.precision(jal, r1, "mxfp4", kv="fp8"),
                   mapping=pm.mapping("partitioned", "partitioned", dense="replicated"),
                   speculative=pm.SpecDecode(draft_tokens=2.0))),
        (r1, b200, wl,
         pm.Design(concurrency=256.0,
                   layout=pm.Disaggregated(prefill=pm.Layout(tp=8), decode=pm.Layout(
                       tp=8, ep=8, dp_attention=True, replicas=2)),
                   precision=pm.precision(b200, r1, "nvfp4", kv="fp8"))),
    ]


@pytest.mark.parametrize("case, hard", [
    pytest.param(c, h, marks=() if (c, h) == (0, False) else pytest.mark.slow)
    for c in range(4) for h in (False, True)])
def test_vectorized_operators_match_the_loop(case, hard):
    """`vectorize=True` (operators and engine steps along an array axis, the optimizer's
    fast path) computes the same metrics as the per-operator loop, and the same
    derivatives."""
    import jax

    model, chip, workload, design = _vectorize_cases()[case]
    # Compiled: eagerly, each of the thousands of operations is a program of its own.
    loop, vec = (pm.predict_jit(model, chip, workload, design, hard=hard, vectorize=v)
                 for v in (False, True))
    for key, value in loop.to_row().items():
        np.testing.assert_allclose(vec.to_row()[key], value, rtol=1e-12, err_msg=key)
    if hard:
        return

    def tpot(bandwidth, vectorize):
        c = dataclasses.replace(chip, hbm_bandwidth=bandwidth)
        return jax.numpy.sum(pm.predict(model, c, workload, design,
                                        vectorize=vectorize).tpot)

    grads = [jax.jit(jax.grad(tpot), static_argnums=1)(chip.hbm_bandwidth, v)
             for v in (False, True)]
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-10)
    assert float(grads[0]) < 0          # more bandwidth, shorter steps


def test_format_ceiling_bounds_narrow_formats():
    """`Efficiency.class_peaks`: each class runs at P_c / (1 + P_c / (ceiling x P_bf16)),
    relative to BF16's (which keeps its peak), so the narrower the format (the larger its
    peak), the smaller the fraction of its peak; an infinite ceiling leaves every peak."""
    import equinox as eqx
    import jax.numpy as jnp

    chip = pm.get_chip("b200")
    peaks = np.asarray(chip.peak_flops)
    rho = float(chip.efficiency.format_ceiling)
    got = np.asarray(chip.efficiency.class_peaks(chip.peak_flops))
    ceiling = peaks / (1.0 + peaks / (rho * peaks[0]))
    np.testing.assert_allclose(got, ceiling * peaks[0] / ceiling[0], rtol=1e-12)
    assert got[0] == pytest.approx(peaks[0], rel=1e-14)   # BF16 keeps its peak (to rounding)
    fraction = dict(zip(COMPUTE_CLASSES, got / peaks, strict=True))
    assert fraction["bf16"] > fraction["fp8"] > fraction["fp4"]
    none = eqx.tree_at(lambda e: e.format_ceiling, chip.efficiency, jnp.asarray(jnp.inf))
    np.testing.assert_array_equal(np.asarray(none.class_peaks(chip.peak_flops)), peaks)


def _gemm_ratios(chip, dtype):
    """(measured, predicted) time of `dtype` over BF16 at the large GEMM shapes of
    aiconfigurator's table (`calibration.format_ratio`)."""
    from perfmodel import datasets
    from perfmodel.calibration import format_ratio

    samples = datasets.load_gemm(pathlib.Path(__file__).parents[1] / "calibration" / "data"
                                 / "benchmarks_aic_gemm.csv")
    return format_ratio(chip, samples, dtype)


@pytest.mark.parametrize("name, dtype", [("b200", "nvfp4"), ("b300", "nvfp4"),
                                         ("gb300", "nvfp4"), ("b200", "fp8"), ("h200", "fp8")])
def test_fit_orders_the_formats_as_the_gemm_timings_do(name, dtype):
    """The shipped fit against measured large GEMMs (aiconfigurator, TensorRT-LLM 1.3): a
    narrow format's time over BF16's at the same shape is never below the pure GEMMs' and
    at most 1.3x it (the fit, from end-to-end rows too, puts narrow formats 10-23 % slower
    than the GEMM timings alone). Every class at its full peak (no format ceiling) misses
    NVFP4 by more than 30 %, too fast: B300's FP4 peak is 6.2x its BF16 one, but its NVFP4
    GEMMs run under 3x as fast as BF16 ones."""
    import equinox as eqx
    import jax.numpy as jnp

    chip = pm.get_chip(name)
    measured, predicted = _gemm_ratios(chip, dtype)
    assert measured <= predicted <= 1.3 * measured
    if dtype == "nvfp4":
        full = eqx.tree_at(lambda c: c.efficiency.format_ceiling, chip, jnp.asarray(jnp.inf))
        assert _gemm_ratios(full, dtype)[1] < 0.7 * measured


def test_prefill_request_time_is_paid_per_prompt_and_caps_a_prefill_pool():
    """`Runtime.prefill_request_time` adds its seconds once per prompt of a step, and a
    disaggregated pool whose prefill instances saturate serves fewer requests per second,
    each with a longer TTFT; a decode-only step does not pay it."""
    chip, model = pm.get_chip("gb200"), pm.get_model("gpt-oss-120b")
    # One prefill GPU for four decode instances (an InferenceMAX GB200 Dynamo-TRT layout).
    layout = pm.Disaggregated(prefill=pm.Layout(), decode=pm.Layout(tp=2, ep=2,
                                                                    dp_attention=True,
                                                                    replicas=4))
    base = pm.Design(concurrency=2560.0, layout=layout,
                     precision=pm.precision(chip, model, "fp4"))
    slow = eqx.tree_at(lambda d: d.runtime.prefill_request_time, base, 20e-3)
    step = [roofline.step_cost(model, chip, d, pm.Layout(), 0.0, 0.0, prefill_tokens=8192.0,
                               prefill_context=512.0, prefill_seqs=8.0, hard=True).time
            for d in (base, slow)]
    assert float(step[1] - step[0]) == pytest.approx(8 * 20e-3, rel=1e-9)
    decode = [roofline.step_cost(model, chip, d, pm.Layout(), 64.0, 1024.0, hard=True).time
              for d in (base, slow)]
    assert float(decode[0]) == float(decode[1])
    w = pm.Workload(1024.0, 1024.0)
    fast_m, slow_m = (pm.predict(model, chip, w, d, hard=True) for d in (base, slow))
    assert float(slow_m.throughput_per_chip) < 0.5 * float(fast_m.throughput_per_chip)
    assert float(slow_m.ttft) > float(fast_m.ttft)


@pytest.mark.parametrize("dp_attention", [False, True])
def test_stream_time_bounds_the_step_from_below(dp_attention):
    """`Runtime.stream_time` (the instance's streaming process, beside the GPU) leaves a
    step that is longer than its work unchanged and sets the length of one that is
    shorter, for every decoding sequence of the instance, DP attention or not; a
    prefill-only step does not see it."""
    chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
    layout = pm.Layout(tp=8, ep=8, dp_attention=dp_attention)
    base = pm.Design(concurrency=800.0, layout=layout,
                     precision=pm.precision(chip, model, "fp4", kv="fp8"))

    def step(stream_time, decode_seqs=800.0, **kw):
        d = eqx.tree_at(lambda x: x.runtime.stream_time, base, stream_time)
        return float(roofline.step_cost(model, chip, d, layout, decode_seqs, 2048.0, hard=True,
                                        **kw).time)

    gpu = step(0.0)
    assert step(0.5 * gpu / 800) == gpu
    assert step(2.0 * gpu / 800) == pytest.approx(2.0 * gpu, rel=1e-12)
    assert step(1e-3, decode_seqs=0.0, prefill_tokens=8192.0, prefill_context=512.0,
                prefill_seqs=8.0) == step(0.0, decode_seqs=0.0, prefill_tokens=8192.0,
                                          prefill_context=512.0, prefill_seqs=8.0)


def test_poll_steps_add_half_the_missed_decode_steps_to_ttft():
    """`Runtime.poll_steps` N (SGLang's `--scheduler-recv-interval`): a new request waits
    (N - 1) / 2 decode steps on average for the scheduler to look, nearly linear in N at a
    light load (where hardly another request arrives between looks), about one decode step
    (TPOT at a light load) per two of N; p99 TTFT grows more than the mean; TPOT does not
    change."""
    chip, model = pm.get_chip("b200"), pm.get_model("deepseek-r1")
    workload = pm.Workload(1024, 1024)
    base = pm.Design(concurrency=4.0, layout=pm.Layout(tp=8, ep=8),
                     precision=pm.precision(chip, model, "fp4", kv="fp8"))

    def run(n):
        d = eqx.tree_at(lambda x: x.runtime.poll_steps, base, n)
        return pm.predict(model, chip, workload, d, hard=True)

    one, eleven, twentyone = run(1.0), run(11.0), run(21.0)
    gap = float(eleven.ttft - one.ttft)
    assert float(twentyone.ttft - one.ttft) == pytest.approx(2.0 * gap, rel=0.01)
    assert 4.5 * float(one.tpot) < gap <= 5.1 * float(one.tpot)
    assert float(eleven.p99_ttft - one.p99_ttft) > gap
    assert float(eleven.tpot) == pytest.approx(float(one.tpot), rel=1e-12)


def test_requests_gathered_between_looks_queue_behind_each_others_prompts():
    """With `Runtime.poll_steps` N, each look admits the requests that arrived since the
    last one, and their prompts run one after another: at 8K-token prompts the TTFT that
    polling adds beyond the (N - 1) / 2 decode steps of waiting for the look (priced here
    at TPOT, a little above a decode step's time) grows with the arrival rate (the
    concurrency), from under 1 % of that wait at 4 requests to over a tenth of it at 128
    (the simulator puts the prompts' queue near 0.3 s there on B200,
    `calibration/sglang_polling_check.py`). A prompt's share of a step comes from the mixed
    step, where the prompt's work partly hides behind the decode batch's memory time: 0.13
    of the wait at 128 requests (over a fifth when a prompt-only step priced it, at
    `17b092a`)."""
    chip, model = pm.get_chip("b200"), pm.get_model("deepseek-r1")
    workload = pm.Workload(8192, 1024)

    def excess(concurrency):
        base = pm.Design(concurrency=concurrency, layout=pm.Layout(tp=4, ep=4),
                         precision=pm.precision(chip, model, "fp4", kv="fp8"))
        polled = eqx.tree_at(lambda x: x.runtime.poll_steps, base, 30.0)
        m1, m30 = (pm.predict(model, chip, workload, d, hard=True) for d in (base, polled))
        look = 0.5 * 29.0 * float(m1.tpot)   # the look's wait, about; TPOT ~ a decode step
        return (float(m30.ttft - m1.ttft) - look) / look

    light, heavy = excess(4.0), excess(128.0)
    assert abs(light) < 0.01
    assert heavy > 0.1
    assert excess(16.0) < excess(64.0) < heavy


def test_a_scheduler_known_to_look_every_step_prices_no_queue_between_looks():
    """With `Runtime.poll_steps` 1 known while tracing (the design closed over by jit), the
    wait for the look and the queue of the requests gathered between looks are exactly
    zero and not computed (their `load` clamp at 0.95 leaves the program); with the design
    traced they are computed, and come to zero. Same metrics either way."""
    import jax

    chip, model = pm.get_chip("b200"), pm.get_model("deepseek-r1")
    workload = pm.Workload(8192, 1024)
    design = pm.Design(concurrency=64.0, layout=pm.Layout(tp=4, ep=4),
                       precision=pm.precision(chip, model, "fp4", kv="fp8"))

    def ttft(design, concurrency):
        d = eqx.tree_at(lambda x: x.concurrency, design, concurrency)
        return pm.predict(model, chip, workload, d, hard=True, check=False).ttft

    closed = jax.jit(lambda c: ttft(design, c))
    traced = eqx.filter_jit(ttft)
    c = np.asarray(64.0)
    np.testing.assert_allclose(float(closed(c)), float(traced(design, c)), rtol=1e-13)
    assert "0.95" not in closed.lower(c).compile().as_text()
    assert "0.95" in traced.lower(design, c).compile().compiled.as_text()


def _split_gpt_oss(concurrency, admission_steps=None):
    """gpt-oss-120b on GB200: one prefill GPU, one two-GPU decode instance."""
    chip, model = pm.get_chip("gb200"), pm.get_model("gpt-oss-120b")
    layout = pm.Disaggregated(prefill=pm.Layout(), decode=pm.Layout(tp=2, ep=2,
                                                                    dp_attention=True))
    design = pm.Design(concurrency=concurrency, layout=layout,
                       precision=pm.precision(chip, model, "fp4"))
    if admission_steps is not None:
        design = eqx.tree_at(lambda d: d.runtime.admission_steps, design, admission_steps)
    return model, chip, design


def test_disaggregated_ttft_does_not_grow_with_the_output_when_the_decode_pool_has_room():
    """With room for every request in the decode pool, a longer output leaves the TTFT about
    where it is (the KV context grows the decode step a little). A decode capacity counted
    from the requests in flight sat within TTFT / E2E of the demand, and the smooth minimum
    moved a few per cent of the E2E into the TTFT: 2-3 s at 8K-token outputs."""
    model, chip, design = _split_gpt_oss(16.0)
    short, long = (pm.predict(model, chip, pm.Workload(1024.0, o), design)
                   for o in (1024.0, 8192.0))
    assert float(long.ttft) < 1.5 * float(short.ttft)


def test_disaggregated_admission_wait_is_counted_in_decode_steps():
    """`Runtime.admission_steps` of a disaggregated deployment is the wait, in decode steps,
    to join the decode batch: at one request in flight (no queue) two more steps add two
    TPOTs (no speculative decoding: a step is a token) to the TTFT."""
    w = pm.Workload(1024.0, 1024.0)
    model, chip, none = _split_gpt_oss(1.0, 0.0)
    _, _, two = _split_gpt_oss(1.0, 2.0)
    a, b = (pm.predict(model, chip, w, d, hard=True) for d in (none, two))
    assert float(b.ttft - a.ttft) == pytest.approx(2.0 * float(a.tpot), rel=0.01)


def test_disaggregated_prompts_queue_at_the_prefill_instance_below_saturation():
    """Below saturation (the rate still follows the concurrency) the TTFT grows with the load
    by the prefill instance's queue alone (no admission wait, so the decode step does not
    enter), where min(demand, capacities) alone would keep it flat."""
    w = pm.Workload(8192.0, 1024.0)
    out = []
    for c in (2.0, 24.0, 32.0):
        model, chip, design = _split_gpt_oss(c, 0.0)
        out.append(pm.predict(model, chip, w, design, hard=True))
    # Still rising with the concurrency at the top (a saturated pool's rate is flat; this one
    # grows sub-linearly only because the decode batch's TPOT grows with it).
    assert float(out[2].throughput_per_chip) > 1.15 * float(out[1].throughput_per_chip)
    assert float(out[2].throughput_per_chip) > 6.0 * float(out[0].throughput_per_chip)
    assert float(out[2].ttft) > 1.05 * float(out[0].ttft)


def test_inverse_class_peaks_invert_the_class_peaks():
    """`Efficiency.inverse_class_peaks` is 1 / `class_peaks`, with an infinite format ceiling
    too (where it is 1 / the datasheet peak)."""
    import jax.numpy as jnp

    for name in ("b200", "h200", "mi355x", "jalapeno"):
        chip = pm.get_chip(name)
        for eff in (chip.efficiency,
                    eqx.tree_at(lambda e: e.format_ceiling, chip.efficiency, jnp.asarray(jnp.inf))):
            inverse = np.asarray(eff.inverse_class_peaks(chip.peak_flops))
            np.testing.assert_allclose(inverse * np.asarray(eff.class_peaks(chip.peak_flops)),
                                       1.0, rtol=1e-14)


def test_one_class_operators_read_their_inverse_peak_column():
    """Under jit with the design closed over, a one-class compute mix is known while tracing
    and its operators read their class's column of the inverse peaks (`_inverse_peak`);
    with the design an argument (traced) they invert the mixed peak. Same step times."""
    import jax

    chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
    for fmt in ("fp4", "fp8", "bf16"):
        design = pm.Design(concurrency=64.0, layout=pm.Layout(tp=8, ep=8, dp_attention=True),
                           precision=pm.precision(chip, model, fmt))

        def step(design, chip):
            return roofline.step_cost(model, chip, design, design.layout, 64.0, 4096.0, 512.0,
                                      2048.0, 0.25, hard=True).time

        closed = jax.jit(lambda c, d=design: step(d, c))(chip)
        traced = eqx.filter_jit(step)(design, chip)
        np.testing.assert_allclose(float(closed), float(traced), rtol=1e-13)


def test_placement_columns_set_to_zero_leave_no_division():
    """A closed-over design whose KV is interleaved prices no partitioned-KV slowdown: its
    1 / busy slices (`static.weighted` on the `static.column` of the placement) leaves the
    program, which then divides once less than with the KV partitioned."""
    import jax

    chip, model = pm.get_chip("jalapeno"), pm.get_model("llama-3.1-70b")
    base = pm.Design(concurrency=8.0, layout=pm.Layout(tp=8),
                     precision=pm.precision(chip, model, "fp8"))

    def divisions(kv):
        design = eqx.tree_at(lambda d: d.mapping, base, pm.design.mapping(kv=kv))
        step = jax.jit(jax.vmap(lambda s: roofline.step_cost(
            model, chip, design, design.layout, s, 2048.0, hard=True).time))
        return step.lower(np.linspace(1.0, 64.0, 100)).compile().as_text().count(" divide(")

    assert divisions("interleaved") < divisions("partitioned")


def test_a_compute_mix_known_while_tracing_adds_only_its_classes():
    """`_mix` of a closed-over (concrete) compute mix: a one-class mix is that class's
    column (a slice, no products, no sums: eagerly 2 operations where the unrolled sum of
    the four classes was 23), a two-class mix two columns, two products and one add; the
    numbers equal the traced mix's."""
    import jax
    import jax.numpy as jnp

    per_class = jnp.asarray([[1.5, 2.5, 3.5, 4.5], [0.5, 0.25, 8.0, 16.0]])
    for weights, most in (([0.0, 0.0, 1.0, 0.0], 2), ([0.25, 0.0, 0.75, 0.0], 7)):
        mix = np.asarray(weights)
        jaxpr = jax.make_jaxpr(lambda p, mix=mix: roofline._mix(mix, p))(per_class)
        assert len(jaxpr.eqns) <= most, jaxpr
        traced = jax.jit(roofline._mix)(jnp.asarray(mix), per_class)
        np.testing.assert_array_equal(roofline._mix(mix, per_class), traced)


@pytest.mark.parametrize("top, half", [(0.7, 60.0), (1.0, 1e-9), (0.3, 4096.0), (5e-7, 60.0)])
def test_inverse_compute_fraction_is_the_floored_inverse_in_one_division(top, half):
    """`Efficiency.inverse_compute_fraction` is 1 / max(`compute_fraction`, floor) for every
    row count (none, below and above the floor's, a fraction that never reaches the floor),
    and its gradients in the rows and both parameters are finite and match the two-division
    form's (float64), zero where the floor holds."""
    import jax
    import jax.numpy as jnp

    floor = 1e-6

    def one(rows, top, half):
        return pm.Efficiency(compute_max=top, compute_rows_half=half).inverse_compute_fraction(
            rows, floor)

    def two(rows, top, half):
        eff = pm.Efficiency(compute_max=top, compute_rows_half=half)
        return 1.0 / jnp.maximum(eff.compute_fraction(rows), floor)

    start = floor * half / max(top - floor, floor)
    rows = np.array([0.0, 0.5 * start, 2.0 * start, 1.0, 17.0, 4096.0, 1e6])
    np.testing.assert_allclose(one(rows, top, half), two(rows, top, half), rtol=1e-14)
    assert float(jnp.max(one(rows, top, half))) <= 1.0 / floor
    for k in range(3):
        grad_one = jax.vmap(jax.grad(one, argnums=k), in_axes=(0, None, None))(rows, top, half)
        assert np.all(np.isfinite(grad_one))
        grad_two = jax.vmap(jax.grad(two, argnums=k), in_axes=(0, None, None))(rows[1:], top,
                                                                                half)
        np.testing.assert_allclose(grad_one[1:], grad_two, rtol=1e-12, atol=1e-12 * abs(
            float(np.max(np.abs(grad_two)))))


@pytest.mark.parametrize("decode_seqs", [0.0, 1.0, 64.0, 4096.0])
def test_expert_activations_are_moved_per_assignment(decode_seqs):
    """The routed experts move each token-expert assignment's input, output and
    intermediate values: activation bytes = MoE layers x (2 D + 2 F / moe_tp) x
    assignments per chip x activation bytes, with no division by the rows per expert (which
    cancelled, and whose division split the step's kernel: 20 fusions and 896 bytes per
    configuration against 16 and 720, `tests/test_kernel_structure.py`); zero without
    tokens, never NaN."""
    from perfmodel.moe import expert_load

    chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
    layout = pm.Layout(tp=8, ep=8, dp_attention=True)
    design = pm.Design(concurrency=64.0, layout=layout, precision=pm.precision(chip, model,
                                                                            "fp4"))
    ops = {op.name: op for op in roofline.operators(model, chip, design, layout, decode_seqs,
                                                    2048.0)}
    _, assignments, _ = expert_load(model, decode_seqs, layout.ep)
    want = (model.num_moe_layers * (2 * model.hidden + model.moe_ffn * 2 / layout.moe_tp)
            * float(assignments) * float(design.precision.activation_bytes))
    got = float(ops["experts"].activation_bytes)
    assert np.isfinite(got)
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0.0)
    assert (got == 0.0) == (decode_seqs == 0.0)


@pytest.mark.parametrize("chip_name, model_name, kv, expected", [
    ("b200", "deepseek-r1", "fp8", "fp8"),     # MLA, FP8 cache, Blackwell: FP8 MLA kernels
    ("gb300", "kimi-k2.5", "fp8", "fp8"),
    ("b200", "deepseek-r1", "bf16", "bf16"),   # a BF16 cache keeps BF16 math
    ("h200", "deepseek-r1", "fp8", "bf16"),    # FlashMLA on Hopper dequantizes
    ("mi355x", "deepseek-r1", "fp8", "bf16"),  # CDNA4 left out (calibration/README.md)
    ("b200", "gpt-oss-120b", "fp8", "bf16"),   # GQA: FlashAttention-style kernels
    ("h100", "llama-3.1-8b", "fp8", "bf16"),
])
def test_attention_math_follows_the_engines_rule(chip_name, model_name, kv, expected):
    """`precision`'s default attention ("auto") is `attention_class`'s: FP8 math only for
    MLA with an FP8 cache on Blackwell; a named class overrides it; the optimizer's KV
    options carry the same rule (one rule for the fit, the baseline and the search)."""
    chip, model = pm.get_chip(chip_name), pm.get_model(model_name)
    hot = {c: np.eye(len(COMPUTE_CLASSES))[i] for i, c in enumerate(COMPUTE_CLASSES)}
    assert pm.design.attention_class(chip, model, kv) == expected
    prec = pm.precision(chip, model, kv=kv)
    np.testing.assert_array_equal(prec.attention_compute, hot[expected])
    for named in ("bf16", "fp8"):
        np.testing.assert_array_equal(
            pm.precision(chip, model, kv=kv, attention=named).attention_compute, hot[named])
    from perfmodel import search
    space = search.design_space(model, chip, 8, formats={"kv": ("bf16", "fp8")})
    table = np.asarray(search.tables(space, chip).attention_compute)
    for i, fmt in enumerate(space.kv):
        np.testing.assert_array_equal(
            table[i], pm.precision(chip, model, kv=fmt).attention_compute, err_msg=fmt)
    with pytest.raises(ValueError, match="auto"):
        pm.precision(chip, model, attention="fp4")


@pytest.mark.parametrize("dp_attention", [True, False])
def test_dp_admission_wait_applies_under_attention_dp_only(dp_attention):
    """`Runtime.dp_admission_steps` is an admission wait of the aggregated engine that only
    data-parallel attention pays: under DP attention two of its steps move the TTFT exactly as
    two more `admission_steps` do (and leave the TPOT); without DP attention it does nothing."""
    chip, model = pm.get_chip("b200"), pm.get_model("gpt-oss-120b")
    w = pm.Workload(1024.0, 1024.0)
    base = pm.Design(concurrency=8.0, layout=pm.Layout(tp=4, ep=4, dp_attention=dp_attention),
                     precision=pm.precision(chip, model, "fp4"))

    def run(**values):
        design = eqx.tree_at(lambda d: d.runtime, base, eqx.tree_at(
            lambda r: [getattr(r, n) for n in values], base.runtime, list(values.values())))
        return pm.predict(model, chip, w, design, hard=True)

    plain, dp = run(), run(dp_admission_steps=2.0)
    admit = run(admission_steps=float(base.runtime.admission_steps) + 2.0)
    assert float(dp.tpot) == pytest.approx(float(plain.tpot), rel=1e-9)
    if dp_attention:
        assert float(dp.ttft) > float(plain.ttft)
        assert float(dp.ttft) == pytest.approx(float(admit.ttft), rel=1e-9)
    else:
        assert float(dp.ttft) == pytest.approx(float(plain.ttft), rel=1e-12)


@pytest.mark.parametrize("tp, dp_attention", [(8, True), (2, True), (1, True), (8, False)])
def test_dp_sync_is_paid_per_other_attention_dp_rank(tp, dp_attention):
    """`Runtime.dp_sync_time` is host time of every engine step per other attention-DP rank
    (the per-step exchange of batch shapes): a step of a DP-attention layout of `tp` ranks
    lasts exactly (tp - 1) x dp_sync_time longer, in decode and in prefill steps alike, and
    the work (FLOP, bytes) is unchanged; without DP attention it costs nothing."""
    chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
    layout = pm.Layout(tp=tp, ep=tp, dp_attention=dp_attention)
    base = pm.Design(concurrency=64.0, layout=layout, precision=pm.precision(chip, model,
                                                                             "fp8"))
    synced = eqx.tree_at(lambda d: d.runtime.dp_sync_time, base, 1.5e-4)
    for step in (dict(decode_seqs=64.0 * tp, decode_context=2048.0),
                 dict(decode_seqs=0.0, decode_context=0.0, prefill_tokens=8192.0,
                      prefill_context=4096.0, prefill_seqs=2.0)):
        plain, slow = (roofline.step_cost(model, chip, d, layout, hard=True, **step)
                       for d in (base, synced))
        extra = 1.5e-4 * (tp - 1) if dp_attention else 0.0
        assert float(slow.time) - float(plain.time) == pytest.approx(extra, rel=1e-9, abs=1e-15)
        assert float(slow.flops) == float(plain.flops)
        assert float(slow.hbm_bytes) == float(plain.hbm_bytes)


@pytest.mark.parametrize("model_name, per_layer", [("deepseek-r1", 8), ("kimi-k2.5", 8),
                                                   ("llama-3.1-8b", 4),
                                                   ("gpt-oss-120b", 4)])
def test_absorbed_mla_launches_more_kernels_per_layer_than_gqa(model_name, per_layer):
    """Kernel launches of the attention side per layer: a GQA layer runs its projection,
    RoPE, attention and output projection (4); the absorbed MLA decode (DeepSeek-V2 sec.
    2.1.2) runs the fused q_a / kv_a down-projection, the q and kv RMSNorms, q_b and the
    batched W_UK product before attention and the batched W_UV product before o_proj (8).
    Counts, not flops: the work of each operator is unchanged."""
    chip, model = pm.get_chip("b200"), pm.get_model(model_name)
    layout = pm.Layout(tp=8)
    design = pm.Design(concurrency=1.0, layout=layout, precision=pm.precision(chip, model))
    ops = {op.name: op for op in roofline.operators(model, chip, design, layout, 1.0, 1024.0)}
    kernels = sum(float(ops[n].kernels) for n in ("qkv_proj", "attention", "out_proj"))
    assert kernels == per_layer * model.num_layers
