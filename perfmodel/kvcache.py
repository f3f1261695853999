"""KV cache: bytes per token, growth through a request, capacity and the batch that fits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .architecture import Model
from .design import Layout, LayoutNumbers, Precision, SliceMapping
from .static import branch, is_static, maximum, minimum


def _number(x):
    # Host numbers stay on the host (outside a kernel, a jax.numpy operation is a compiled
    # program of its own); anything else becomes a float array.
    return float(x) if is_static(x) else jnp.asarray(x, dtype=float)


def kv_bytes_per_token_layer(model: Model, kv_bytes):
    """KV-cache bytes one token adds in one full-attention layer.

    GQA/MHA: 2 K H values (keys and values of each KV head); MLA: the compressed latent and
    the decoupled RoPE key, kv_lora_rank + qk_rope_head_dim values (DeepSeek-V3, arXiv
    2412.19437, sec. 2.1.1).

    Example:
        >>> from perfmodel.presets import get_model
        >>> float(kv_bytes_per_token_layer(get_model("deepseek-r1"), 1.0))
        576.0
    """
    return model.kv_values_per_token_layer * _number(kv_bytes)


def kv_bytes_per_request(model: Model, context, kv_bytes):
    """KV-cache bytes of one request holding `context` tokens, over all layers.

    Sliding-window layers keep only the last `sliding_window` tokens.

    Args:
        context: tokens in the cache (float).
        kv_bytes: bytes per cached value.

    Example:
        >>> from perfmodel.presets import get_model
        >>> m = get_model("llama-3.1-8b")   # 32 layers, 8 KV heads of 128: 128 KiB/token
        >>> int(kv_bytes_per_request(m, 1024.0, 2.0)) == 32 * 2 * 8 * 128 * 2 * 1024
        True
    """
    context = _number(context)
    per_token = kv_bytes_per_token_layer(model, kv_bytes)
    full = model.num_full_layers * context
    local = model.num_sliding_layers * minimum(context, float(model.sliding_window or 1))
    return per_token * (full + local)


def kv_growth(model: Model, input_len, output_len, kv_bytes, steps: int = 64):
    """KV bytes of one request at evenly spaced points of its output (for plots).

    Returns:
        (tokens generated, KV bytes) arrays of length `steps`.
    """
    generated = jnp.linspace(0.0, 1.0, steps) * jnp.asarray(output_len, dtype=float)
    return generated, kv_bytes_per_request(model, input_len + generated, kv_bytes)


def kv_fraction_per_chip(model: Model, layout: Layout | LayoutNumbers):
    """Share of a request's KV cache one chip of its instance holds (a float for a static
    `Layout`, an array for `LayoutNumbers`).

    Tensor-parallel GQA splits KV heads over min(tp, K) chips (replicated past K); MLA's latent
    has no head axis, so TP replicates it on every chip; DP attention keeps each request on one
    chip. Pipeline stages split the layers.
    """
    if model.attention == "mla":
        share = 1.0
    else:
        share = branch(layout.dp_attention, lambda: 1.0,
                       lambda: 1.0 / minimum(layout.tp, model.num_kv_heads))
    return share / layout.pp


def kv_transfer_fraction(model: Model, prefill: Layout | LayoutNumbers,
                         decode: Layout | LayoutNumbers):
    """Share of a request's KV cache that the busiest chip sends or receives when the
    request moves from a prefill instance to a decode instance (disaggregated serving).

    A prefill chip sends its stage's share (pipeline stages split the layers); under
    tensor-parallel attention all tp chips of a stage send, splitting the KV heads, or
    sharing out what they hold replicated (MLA's latent, GQA heads past K); under DP
    attention the request sits on one chip. A decode chip receives its own share
    (`kv_fraction_per_chip`: all of MLA's latent under TP).

    Example:
        >>> from perfmodel import get_model
        >>> r1 = get_model("deepseek-r1")
        >>> kv_transfer_fraction(r1, Layout(tp=8), Layout(tp=8, ep=8, dp_attention=True))
        1.0
        >>> kv_transfer_fraction(get_model("llama-3.1-8b"), Layout(tp=4, pp=2), Layout(tp=8))
        0.125
    """
    senders = branch(prefill.dp_attention, lambda: 1.0, lambda: prefill.tp)
    return maximum(1.0 / (prefill.pp * senders), kv_fraction_per_chip(model, decode))


def weight_bytes_per_chip(model: Model, layout: Layout | LayoutNumbers, precision: Precision,
                          mapping: SliceMapping | None = None, num_slices=1.0):
    """Weight bytes resident on one chip (a replicated class is held by every slice).

    Non-expert weights are split over tp (attention replicated under DP attention), routed
    experts over all tp chips (ep experts x tp/ep shards), layers over pp.
    """
    # Floats: a Python int past 2**31 meeting a traced array overflows without x64.
    attention = float(model.num_layers * model.attention_params_per_layer)
    other = float(model.non_expert_params) - attention
    attn_share = branch(layout.dp_attention, lambda: 1.0, lambda: 1.0 / layout.tp)
    parts = {"attention": attention * attn_share * precision.weight_bytes,
             "dense": other / layout.tp * precision.weight_bytes,
             "experts": float(model.expert_params_total) / layout.tp * precision.expert_bytes}
    if mapping is not None:
        extra = jnp.asarray(num_slices) - 1.0
        parts = {k: v * (1.0 + extra * getattr(mapping, k)[..., 2]) for k, v in parts.items()}
    return (parts["attention"] + parts["dense"] + parts["experts"]) / layout.pp


def profile_activation_bytes(model: Model, layout: Layout | LayoutNumbers,
                             precision: Precision, tokens,
                             seqs, logit_bytes=4.0):
    """Peak activation bytes per chip of vLLM's memory-profiling forward pass: the HBM it
    keeps out of the KV cache besides the weights (`Runtime.activation_reserve`).

    vLLM sizes its KV cache as `total HBM x gpu_memory_utilization - peak`, where `peak` is
    the weights plus the peak of one dummy forward pass over `max_num_batched_tokens` tokens
    and the sampler over `max_num_seqs` sequences' logits (vLLM V0
    `vllm/worker/worker.py:Worker.determine_num_available_blocks`; V1
    `vllm/v1/worker/gpu_worker.py:Worker.determine_available_memory`, which runs
    `GPUModelRunner.profile_run`). The peak is set by the model's widths, so it scales with
    the hidden size, the MLP or expert width and the vocabulary rather than being a flat
    figure. Estimated with T `tokens`, S `seqs`, b `precision.activation_bytes`:

    - inside a layer: the residual stream and normalised input (2 T D b) plus the larger of
      the attention tensors (q, k, v and the attention output: T (2 N + 2 K) H / tp b) and
      the MLP's (gate and up projections and the activated product, T (2 + 1) F / tp b for a
      gated MLP, 2 T F / tp b otherwise; routed experts: vLLM's fused-MoE caches of every
      token's `experts_per_token` copies, T k (2 + 1) F_e ep / tp b, plus the shared
      experts' MLP);
    - after the last layer: the hidden states (T D b) and S rows of vocabulary logits and
      sampler probabilities in float32 (2 S V `logit_bytes`).

    The peak is the larger of the two. CUDA graphs are captured after the KV cache is
    allocated and live in the `1 - gpu_memory_utilization` slack (not counted here).

    Args:
        tokens: tokens of the profiling pass (vLLM `max_num_batched_tokens`) (tokens).
        seqs: sequences whose logits the sampler profiles (vLLM `max_num_seqs`, at most
            `tokens`) (sequences).
        logit_bytes: bytes per logit (float32: 4).

    Returns:
        Bytes per chip (a NumPy array when `tokens`, `seqs` and the precision's activation
        bytes are NumPy arrays or Python numbers).

    Example:
        >>> from perfmodel.presets import get_model
        >>> from perfmodel.design import Layout, Precision
        >>> m = get_model("llama-3.1-8b")   # D 4096, F 14336, V 128256
        >>> p = Precision(weight_bytes=2.0, expert_bytes=2.0, kv_bytes=2.0,
        ...               activation_bytes=2.0, weight_compute=[0., 0., 1., 0.],
        ...               expert_compute=[0., 0., 1., 0.], attention_compute=[0., 0., 1., 0.])
        >>> round(float(profile_activation_bytes(m, Layout(tp=1), p, 8192, 256)) / 1e9, 2)
        0.84
    """
    # NumPy on host values (a group of measurement rows before its kernel), where each
    # jax.numpy operation would compile a program of its own; jax.numpy otherwise.
    xp = np if all(isinstance(x, (np.ndarray, np.generic, int, float))
                   for x in (tokens, seqs, precision.activation_bytes)) else jnp
    tokens = xp.asarray(tokens, dtype=float)
    seqs = xp.minimum(xp.asarray(seqs, dtype=float), tokens)
    b = xp.asarray(precision.activation_bytes, dtype=float)
    D, H = model.hidden, model.head_dim
    tp = layout.tp
    attention = (2 * model.num_heads + 2 * model.num_kv_heads) * H / tp
    live = 3 if model.gated_mlp else 2
    mlp = live * model.dense_ffn / tp if model.num_dense_layers else 0.0
    if model.is_moe:
        expert_tp = tp / maximum(layout.ep, 1)
        experts = model.experts_per_token * live * model.moe_ffn / expert_tp \
            + model.num_shared_experts * live * model.moe_ffn / tp
        mlp = maximum(mlp, experts)
    layer = tokens * b * (2 * D + maximum(attention, mlp))
    head = tokens * b * D + 2.0 * seqs * model.vocab * logit_bytes
    return xp.maximum(layer, head)


def kv_capacity_per_chip(chip_capacity, weight_bytes, memory_fraction, activation_reserve,
                         fraction_of_free=0.0):
    """HBM bytes left for KV cache on a chip (may be negative: the model does not fit):
    `memory_fraction` of the whole memory less the weights and the reserve, or, with
    `fraction_of_free` 1, of what they leave (`design.Runtime.fraction_of_free`).

    Example:
        >>> kv_capacity_per_chip(80e9, 60e9, 0.9, 4e9) / 1e9        # vLLM: 72 - 64
        8.0
        >>> kv_capacity_per_chip(80e9, 60e9, 0.9, 4e9, 1.0) / 1e9   # TensorRT-LLM: 0.9 x 16
        14.4
    """
    of_total = chip_capacity * memory_fraction - weight_bytes - activation_reserve
    of_free = (chip_capacity - weight_bytes - activation_reserve) * memory_fraction
    return of_total + fraction_of_free * (of_free - of_total)


def max_batch(model: Model, layout: Layout | LayoutNumbers, precision: Precision,
              chip_capacity, context,
              memory_fraction=0.9, activation_reserve=4e9, mapping: SliceMapping | None = None,
              num_slices=1.0, fraction_of_free=0.0):
    """Largest number of running sequences per instance whose KV cache fits (float).

    Sequences are counted at `context` tokens each. Non-positive when the weights alone do
    not fit.
    """
    weights = weight_bytes_per_chip(model, layout, precision, mapping, num_slices)
    free = kv_capacity_per_chip(chip_capacity, weights, memory_fraction, activation_reserve,
                                fraction_of_free)
    per_seq = kv_bytes_per_request(model, context, precision.kv_bytes) \
        * kv_fraction_per_chip(model, layout)
    if mapping is not None:
        per_seq = per_seq * (1.0 + (jnp.asarray(num_slices) - 1.0) * mapping.kv[..., 2])
    # Sequences per chip that fit; DP attention spreads sequences over the tp chips.
    return free / per_seq * layout.attention_ranks
