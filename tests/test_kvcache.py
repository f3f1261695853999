"""KV cache: bytes per token against hand computations (GQA, MLA, sliding windows), the
scaling book's figures, linearity in context, and the batch that fits."""

from __future__ import annotations

import equinox as eqx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import perfmodel as pm
from perfmodel.kvcache import kv_fraction_per_chip, kv_transfer_fraction, weight_bytes_per_chip


def test_gqa_llama_3_70b():
    """GQA caches 2 K H values per token and layer: Llama-3.1-70B has K = 8 KV heads of
    H = 128 over L = 80 layers (HF config)."""
    model = pm.get_model("llama-3.1-70b")
    assert float(pm.kv_bytes_per_token_layer(model, 2.0)) == 2 * 8 * 128 * 2
    per_token = float(pm.kv_bytes_per_request(model, 1.0, 2.0))
    assert per_token == 2 * 8 * 128 * 80 * 2 == 327_680   # 320 KiB in bf16
    # The scaling book, "Serving LLaMA 3-70B" (applied-inference.md): "KV cache size per
    # token in int8 = 2 * K * H * L = 2 * 8 * 128 * 80 = 160kiB", and at 32k tokens
    # "162e3 * 32,768 = 5.3GB / sequence".
    assert float(pm.kv_bytes_per_request(model, 1.0, 1.0)) == 160 * 1024
    np.testing.assert_allclose(float(pm.kv_bytes_per_request(model, 32768.0, 1.0)) / 1e9,
                               5.3, rtol=2e-2)   # 5.37 GB: the book rounds 163,840 to 162e3


def test_mla_deepseek_r1():
    """MLA caches the compressed latent and the decoupled RoPE key: kv_lora_rank 512 +
    qk_rope_head_dim 64 = 576 values per token and layer (DeepSeek-V3, arXiv 2412.19437,
    sec. 2.1.1; config.json), over 61 layers."""
    model = pm.get_model("deepseek-r1")
    assert (model.kv_lora_rank, model.qk_rope_head_dim, model.num_layers) == (512, 64, 61)
    assert float(pm.kv_bytes_per_token_layer(model, 1.0)) == 576
    # FP8 cache at 8192 tokens: 576 x 61 x 8192 bytes = 287.8 MB per request.
    assert float(pm.kv_bytes_per_request(model, 8192.0, 1.0)) == 576 * 61 * 8192
    # The same heads under MHA would cache 2 x 128 heads x 128 dims: 56.9x more.
    mha = 2 * model.num_heads * model.v_head_dim
    np.testing.assert_allclose(mha / 576, 56.89, rtol=1e-3)


def test_sliding_window_gpt_oss():
    """gpt-oss-120b alternates 18 full and 18 sliding (128-token) layers of 8 KV heads x 64."""
    model = pm.get_model("gpt-oss-120b")
    per = 2 * 8 * 64
    for context in (64.0, 128.0, 8192.0):
        want = per * (18 * context + 18 * min(context, 128.0))
        assert float(pm.kv_bytes_per_request(model, context, 1.0)) == want


FULL = [n for n in pm.model_names() if pm.get_model(n).num_sliding_layers == 0]
SLIDING = [n for n in pm.model_names() if pm.get_model(n).num_sliding_layers > 0]


def test_both_kinds_of_model_exist():
    assert len(FULL) >= 5 and set(SLIDING) >= {"gpt-oss-120b", "llama-4-scout"}


@given(name=st.sampled_from(FULL), context=st.floats(1.0, 1e6),
       more=st.floats(1.0, 1e6), scale=st.floats(0.01, 100.0),
       kv_bytes=st.sampled_from([0.5625, 1.0, 2.0]))
def test_kv_linear_in_context_for_full_attention(name, context, more, scale, kv_bytes):
    model = pm.get_model(name)
    kv = lambda c: float(pm.kv_bytes_per_request(model, c, kv_bytes))  # noqa: E731
    np.testing.assert_allclose(kv(context + more), kv(context) + kv(more), rtol=1e-12)
    np.testing.assert_allclose(kv(scale * context), scale * kv(context), rtol=1e-12)
    per_token = model.kv_values_per_token_layer * model.num_layers * kv_bytes
    np.testing.assert_allclose(kv(context), per_token * context, rtol=1e-12)


@given(name=st.sampled_from(SLIDING), context=st.floats(1.0, 1e6), more=st.floats(0.0, 1e6))
def test_kv_capped_for_sliding_layers(name, context, more):
    """Sliding layers hold at most `sliding_window` tokens: the cache grows by the full
    layers' rate only, and the sliding part never exceeds its cap."""
    model = pm.get_model(name)
    per_layer = model.kv_values_per_token_layer
    full_rate = per_layer * model.num_full_layers
    cap = per_layer * model.num_sliding_layers * model.sliding_window
    kv = lambda c: float(pm.kv_bytes_per_request(model, c, 1.0))  # noqa: E731
    sliding_part = kv(context) - full_rate * context
    assert -1e-6 * kv(context) <= sliding_part <= cap * (1 + 1e-12)
    assert kv(context + more) >= kv(context)
    if context >= model.sliding_window:
        np.testing.assert_allclose(sliding_part, cap, rtol=1e-9)
        np.testing.assert_allclose(kv(context + more) - kv(context), full_rate * more,
                                   rtol=1e-9, atol=1e-6 * kv(context))


def test_max_batch_by_hand():
    """Llama-3.1-8B in BF16 on one H200: (0.9 x 141 GiB - weights - 4 GB reserve) over
    128 KiB x context per sequence; TP2 halves both weights and KV per chip."""
    model, chip = pm.get_model("llama-3.1-8b"), pm.get_chip("h200")
    prec = pm.precision(chip, model, "bf16", kv="bf16")
    context = 4096.0
    per_seq = 2 * 8 * 128 * 32 * 2 * context
    for tp in (1, 2):
        layout = pm.Layout(tp=tp)
        weights = model.total_params * 2 / tp
        np.testing.assert_allclose(float(weight_bytes_per_chip(model, layout, prec)), weights,
                                   rtol=1e-12)
        want = (0.9 * 141 * 2**30 - weights - 4e9) / (per_seq / tp)
        got = float(pm.max_batch(model, layout, prec, chip.hbm_capacity, context))
        np.testing.assert_allclose(got, want, rtol=1e-12)



def test_tensorrt_llm_memory_rules_by_hand():
    """TensorRT-LLM: 0.9 of the memory the weights and activations leave (not of the whole)
    goes to KV, and each request reserves its whole output at admission. Llama-3.1-70B in
    FP16 on two A100 80GB (TP2, the v0.17 trtllm-bench rows): 70.6 GB of weights per chip
    leave vLLM's rule 2.8 GB of KV, TensorRT-LLM's 10.1 GB."""
    model, chip = pm.get_model("llama-3.1-70b"), pm.get_chip("a100-80gb")
    prec = pm.precision(chip, model, "fp16")
    layout = pm.Layout(tp=2)
    capacity, weights = float(chip.hbm_capacity), model.total_params * 2 / 2
    per_token = 2 * 80 * 8 * 128 * 2 / 2   # K and V, 80 layers, 8 KV heads of 128, TP2
    workload = pm.Workload(128, 2048, 1.0, 1.0)
    vllm, trt = pm.Runtime(), pm.Runtime(fraction_of_free=1.0, reserve_output=1.0)
    assert float(vllm.kv_context(workload)) == 128 + 1024
    assert float(trt.kv_context(workload)) == 128 + 2048
    for rt, kv in ((vllm, 0.9 * capacity - weights - 4e9), (trt, 0.9 * (capacity - weights - 4e9))):
        want = kv / (per_token * float(rt.kv_context(workload)))
        got = float(pm.max_batch(model, layout, prec, capacity, rt.kv_context(workload),
                                 rt.memory_fraction, rt.activation_reserve,
                                 fraction_of_free=rt.fraction_of_free))
        np.testing.assert_allclose(got, want, rtol=1e-12)
    # predict sizes the batch with the same rules, and says where one sequence stops fitting.
    for rt in (vllm, trt):
        design = pm.Design(concurrency=512.0, layout=layout, precision=prec, runtime=rt)
        m = pm.predict(model, chip, workload, design, check=False)
        want = pm.max_batch(model, layout, prec, capacity, rt.kv_context(workload),
                            rt.memory_fraction, rt.activation_reserve,
                            fraction_of_free=rt.fraction_of_free)
        assert float(m.max_batch) == pytest.approx(float(want), rel=1e-9)
    # A reserve that leaves vLLM's rule 1,400 tokens of KV: one 1,500-token sequence does
    # not fit; from the free memory it does.
    tight = pm.Runtime(activation_reserve=capacity * 0.9 - weights - per_token * 1400)
    free = eqx.tree_at(lambda r: r.fraction_of_free, tight, 1.0)
    for rt, fits in ((tight, False), (free, True)):
        design = pm.Design(concurrency=1.0, layout=layout, precision=prec, runtime=rt)
        m = pm.predict(model, chip, pm.Workload(1000, 1000, 1.0, 1.0), design, check=False)
        assert (float(m.memory_excess) <= 0.0) == fits

def test_kv_sharding_rules():
    """GQA heads split over min(tp, K) chips; MLA's latent has no head axis (replicated under
    TP); DP attention keeps each request on one chip; pipeline stages split layers."""
    llama, ds = pm.get_model("llama-3.1-70b"), pm.get_model("deepseek-r1")
    assert kv_fraction_per_chip(llama, pm.Layout(tp=4)) == 1 / 4
    assert kv_fraction_per_chip(llama, pm.Layout(tp=16)) == 1 / 8   # only 8 KV heads
    assert kv_fraction_per_chip(llama, pm.Layout(tp=4, pp=2)) == 1 / 8
    assert kv_fraction_per_chip(ds, pm.Layout(tp=8)) == 1.0
    assert kv_fraction_per_chip(ds, pm.Layout(tp=8, ep=8, dp_attention=True)) == 1.0
    # DP attention: 8 chips each hold their own requests' latents, so 8x the sequences of
    # one chip's free memory (weights differ: attention is replicated under DP attention).
    chip = pm.get_chip("gb200")
    prec = pm.precision(chip, ds, "fp4")
    dpa = pm.Layout(tp=8, ep=8, dp_attention=True)
    free = 0.9 * float(chip.hbm_capacity) - float(weight_bytes_per_chip(ds, dpa, prec)) - 4e9
    want = free / float(pm.kv_bytes_per_request(ds, 8192.0, prec.kv_bytes)) * 8
    got = float(pm.max_batch(ds, dpa, prec, chip.hbm_capacity, 8192.0))
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("name", ["deepseek-r1", "llama-3.1-405b", "gpt-oss-120b"])
def test_weights_per_chip_sum_to_the_model(name):
    """Summed over the chips of an instance, sharded weights make the whole model once
    (replicated attention under DP attention counts tp times)."""
    model, chip = pm.get_model(name), pm.get_chip("b200")
    prec = pm.precision(chip, model, "bf16", experts="bf16")
    layout = pm.Layout(tp=8, ep=8 if model.is_moe else 1, pp=2)
    total = float(weight_bytes_per_chip(model, layout, prec)) * layout.chips_per_instance
    np.testing.assert_allclose(total, model.total_params * 2.0, rtol=1e-12)


@pytest.mark.parametrize("model_name, prefill, decode, share", [
    # GQA (K = 8): tp8 sends an eighth per chip; tp2 decode receives half.
    ("llama-3.1-8b", pm.Layout(tp=8), pm.Layout(tp=8), 1 / 8),
    ("llama-3.1-8b", pm.Layout(tp=8), pm.Layout(tp=2), 1 / 2),
    # Pipeline stages split the layers on both sides.
    ("llama-3.1-8b", pm.Layout(tp=4, pp=2), pm.Layout(tp=4, pp=2), 1 / 8),
    ("llama-3.1-8b", pm.Layout(tp=1, pp=4), pm.Layout(tp=8), 1 / 4),
    # MLA: DP attention keeps the request on one chip; under TP every decode chip needs the
    # whole latent, while the tp prefill chips split the sending.
    ("deepseek-r1", pm.Layout(tp=8, ep=8, dp_attention=True),
     pm.Layout(tp=8, ep=8, dp_attention=True), 1.0),
    ("deepseek-r1", pm.Layout(tp=8), pm.Layout(tp=8), 1.0),
    ("deepseek-r1", pm.Layout(tp=8, ep=8, dp_attention=True, pp=2),
     pm.Layout(tp=8, ep=8, dp_attention=True, pp=4), 1 / 2),
])
def test_kv_transfer_is_the_busiest_chips_share(model_name, prefill, decode, share):
    """Disaggregated serving moves a request's KV cache at the pace of the chip that sends
    or receives most of it (it used to be the cache over the prefill tp, whatever the
    pipeline stages, DP attention or MLA)."""
    model = pm.get_model(model_name)
    assert kv_transfer_fraction(model, prefill, decode) == pytest.approx(share, rel=1e-12)
