"""KV cache: bytes per token, growth through a request, capacity and the batch that fits."""

from __future__ import annotations

import jax.numpy as jnp

from .architecture import Model
from .design import Layout, Precision, SliceMapping


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
    return model.kv_values_per_token_layer * jnp.asarray(kv_bytes, dtype=float)


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
    context = jnp.asarray(context, dtype=float)
    per_token = kv_bytes_per_token_layer(model, kv_bytes)
    full = model.num_full_layers * context
    local = model.num_sliding_layers * jnp.minimum(context, float(model.sliding_window or 1))
    return per_token * (full + local)


def kv_growth(model: Model, input_len, output_len, kv_bytes, steps: int = 64):
    """KV bytes of one request at evenly spaced points of its output (for plots).

    Returns:
        (tokens generated, KV bytes) arrays of length `steps`.
    """
    generated = jnp.linspace(0.0, 1.0, steps) * jnp.asarray(output_len, dtype=float)
    return generated, kv_bytes_per_request(model, input_len + generated, kv_bytes)


def kv_fraction_per_chip(model: Model, layout: Layout) -> float:
    """Share of a request's KV cache one chip of its instance holds (static).

    Tensor-parallel GQA splits KV heads over min(tp, K) chips (replicated past K); MLA's latent
    has no head axis, so TP replicates it on every chip; DP attention keeps each request on one
    chip. Pipeline stages split the layers.
    """
    if layout.dp_attention:
        share = 1.0
    elif model.attention == "mla":
        share = 1.0
    else:
        share = 1.0 / min(layout.tp, model.num_kv_heads)
    return share / layout.pp


def weight_bytes_per_chip(model: Model, layout: Layout, precision: Precision,
                          mapping: SliceMapping | None = None, num_slices=1.0):
    """Weight bytes resident on one chip (a replicated class is held by every slice).

    Non-expert weights are split over tp (attention replicated under DP attention), routed
    experts over all tp chips (ep experts x tp/ep shards), layers over pp.
    """
    attention = model.num_layers * model.attention_params_per_layer
    other = model.non_expert_params - attention
    attn_share = 1.0 if layout.dp_attention else 1.0 / layout.tp
    parts = {"attention": attention * attn_share * precision.weight_bytes,
             "dense": other / layout.tp * precision.weight_bytes,
             "experts": model.expert_params_total / layout.tp * precision.expert_bytes}
    if mapping is not None:
        extra = jnp.asarray(num_slices) - 1.0
        parts = {k: v * (1.0 + extra * getattr(mapping, k)[..., 2]) for k, v in parts.items()}
    return (parts["attention"] + parts["dense"] + parts["experts"]) / layout.pp


def kv_capacity_per_chip(chip_capacity, weight_bytes, memory_fraction, activation_reserve):
    """HBM bytes left for KV cache on a chip (may be negative: the model does not fit)."""
    return chip_capacity * memory_fraction - weight_bytes - activation_reserve


def max_batch(model: Model, layout: Layout, precision: Precision, chip_capacity, context,
              memory_fraction=0.9, activation_reserve=4e9, mapping: SliceMapping | None = None,
              num_slices=1.0):
    """Largest number of running sequences per instance whose KV cache fits (float).

    Sequences are counted at `context` tokens each. Non-positive when the weights alone do
    not fit.
    """
    weights = weight_bytes_per_chip(model, layout, precision, mapping, num_slices)
    free = kv_capacity_per_chip(chip_capacity, weights, memory_fraction, activation_reserve)
    per_seq = kv_bytes_per_request(model, context, precision.kv_bytes) \
        * kv_fraction_per_chip(model, layout)
    if mapping is not None:
        per_seq = per_seq * (1.0 + (jnp.asarray(num_slices) - 1.0) * mapping.kv[..., 2])
    # Sequences per chip that fit; DP attention spreads sequences over the tp chips.
    spread = layout.tp if layout.dp_attention else 1
    return free / per_seq * spread
