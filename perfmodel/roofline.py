"""Per-operator roofline of one engine step on one chip.

An engine step runs `decode_seqs` sequences one token each (more with speculative
verification) plus an optional prefill chunk. For every operator (QKV/attention/output
projections, attention over the KV cache, router, routed experts, shared experts, dense FFN,
LM head, and the collectives between chips) we count FLOPs and bytes on one chip of the
instance and take

    time = smooth_max(compute time, memory time, slice-fabric time) + kernel overhead,

so a step's time is the sum over operators (operators within a step run back to back).
Formulas: the scaling book ("How to Scale Your Model", inference chapter) for dense layers;
DeepSeek-V3 (arXiv 2412.19437) for MLA, with weight absorption at decode.
"""

from __future__ import annotations

import functools
import operator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .architecture import Model
from .design import Design, Layout, LayoutNumbers
from .hardware import FRACTION_FLOOR, Chip
from .interconnect import collective_time
from .moe import expert_load, ranks_per_token
from .smooth import DEFAULT_SHARPNESS, smooth_max, smooth_min
from .static import (
    add_if,
    branch,
    column,
    concrete,
    known,
    logical_and,
    logical_not,
    minimum,
    weighted,
)

OPERATOR_NAMES = ("qkv_proj", "attention", "prefill_attention", "out_proj", "router",
                  "experts", "shared_experts", "dense_ffn", "lm_head", "draft")

#: Operators whose FLOPs run at an attention kernel's own ceiling, not a matmul's row ramp:
#: 1 decode attention (`Efficiency.attention_max`), 2 prompt attention
#: (`Efficiency.prefill_attention_max`); 0 for every other operator.
ATTENTION_KIND = {"attention": 1, "prefill_attention": 2}


class Operator(eqx.Module):
    """One operator's work on one chip for a whole step (summed over its layers)."""

    name: str = eqx.field(static=True)
    flops: jnp.ndarray
    """FLOPs on one chip (FLOP)."""
    weight_bytes: jnp.ndarray
    """Weight bytes read from HBM (bytes)."""
    kv_bytes: jnp.ndarray
    """KV-cache bytes read and written (bytes)."""
    activation_bytes: jnp.ndarray
    """Activation bytes read and written (bytes)."""
    rows: jnp.ndarray
    """Rows (tokens) of its matmuls: decides the reachable fraction of peak (tokens)."""
    compute_mix: jnp.ndarray
    """Weights over compute classes (sums to 1)."""
    kernels: jnp.ndarray
    """Kernel launches (count)."""
    fabric_rows: jnp.ndarray
    """Rows whose partial sums a partitioned weight placement reduces across slices."""

    @property
    def hbm_bytes(self):
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def intensity(self):
        """Arithmetic intensity (FLOP/byte)."""
        return self.flops / jnp.maximum(self.hbm_bytes, 1e-30)


class StepCost(eqx.Module):
    """Time and work of one engine step on one chip."""

    time: jnp.ndarray
    """Seconds of the step (compute, memory, fabric, collectives and overheads)."""
    flops: jnp.ndarray
    hbm_bytes: jnp.ndarray
    link_bytes: jnp.ndarray
    """Bytes this chip sends over the network in the step."""
    compute_energy: jnp.ndarray
    """Dynamic energy of the step's FLOPs, each at its compute class's J/FLOP (J)."""
    collective_time: jnp.ndarray
    operator_times: tuple
    busy_time: jnp.ndarray
    """Seconds the chip runs kernels: operators and collectives, not host overheads (s)."""


def operators(model: Model, chip: Chip, design: Design, layout: Layout | LayoutNumbers,
              decode_seqs,
              decode_context, prefill_tokens=0.0, prefill_context=0.0,
              prefill_seqs=0.0) -> tuple[Operator, ...]:
    """Operators of one step on one chip of an instance.

    Args:
        model, chip, design: specs; `layout` is the pool this step runs on (static, or as
            numbers: `design.LayoutNumbers`).
        decode_seqs: sequences decoding in the step, per instance.
        decode_context: mean tokens in their KV cache.
        prefill_tokens: prompt tokens processed in the step, per instance.
        prefill_context: mean context those tokens attend to (about half the prompt).
        prefill_seqs: requests whose prompts are in the chunk (their last token hits the LM
            head).

    Returns:
        A tuple of `Operator`, named as `OPERATOR_NAMES`.
    """
    prec = design.precision
    D, N, K, H = model.hidden, model.num_heads, model.num_kv_heads, model.head_dim
    tp, ep = layout.tp, layout.ep
    spec = design.speculative
    verify = 1.0 + spec.draft_tokens
    decode_seqs = jnp.asarray(decode_seqs, dtype=float)
    decode_tokens = decode_seqs * verify
    prefill_tokens = jnp.asarray(prefill_tokens, dtype=float)
    tokens = decode_tokens + prefill_tokens
    a = prec.activation_bytes
    L = float(model.num_layers)

    # Attention runs on its own share of tokens and heads.
    attn_tokens, heads, attn_weight_share, kv_share, attn_decode_seqs, attn_prefill = branch(
        layout.dp_attention,
        lambda: (tokens / tp, N, 1.0, 1.0, decode_seqs / tp, prefill_tokens / tp),
        lambda: (tokens, N / tp, 1.0 / tp,
                 1.0 if model.attention == "mla" else 1.0 / minimum(tp, K),
                 decode_seqs, prefill_tokens))

    # Effective attended context per layer kind (sliding layers see at most the window).
    window = float(model.sliding_window or 1)
    n_full, n_slide = float(model.num_full_layers), float(model.num_sliding_layers)

    def attended(ctx):
        return n_full * ctx + n_slide * jnp.minimum(ctx, window)

    decode_ctx_layers = attended(jnp.asarray(decode_context, dtype=float))
    prefill_ctx_layers = attended(jnp.asarray(prefill_context, dtype=float))
    kv_token_values = model.kv_values_per_token_layer

    if model.attention == "mla":
        r, qr = model.kv_lora_rank, model.qk_rope_head_dim
        nope, vd, ql = model.qk_nope_head_dim, model.v_head_dim, model.q_lora_rank
        q_in = ql if ql else D
        proj_params = (D * ql if ql else 0) + q_in * N * (nope + qr) + D * (r + qr)
        absorb_params = r * N * (nope + vd)
        # Decode (absorbed): q_nope -> latent and latent -> v per head; attention over the
        # 576-wide latent for scores and the 512-wide latent for values.
        qkv_flops = 2.0 * attn_tokens * (proj_params * heads / N + absorb_params * heads / N)
        attn_flops = 2.0 * attn_decode_seqs * verify * heads * decode_ctx_layers * (2 * r + qr)
        # Prompt attention is not absorbed: keys of nope + rope and values of vd per head.
        prefill_attn_flops = 2.0 * attn_prefill * heads * prefill_ctx_layers * (nope + qr + vd)
        out_params = N * vd * D
        # Kernels per layer: the down-projection (q_a and kv_a fused), the q and kv
        # RMSNorms, q_b and the batched q_nope x W_UK product before attention, the batched
        # W_UV product before o_proj (DeepSeek-V2, arXiv 2405.04434, sec. 2.1.2 "absorb";
        # each its own kernel in TensorRT-LLM, its tech blog 3 on DeepSeek-R1 throughput,
        # and in SGLang's `forward_absorb`; calibration/README.md, "Kernel launches of the
        # absorbed MLA").
        qkv_kernels, out_kernels = (5 if ql else 4) * L, 2 * L
    else:
        proj_params = D * (N + 2 * K) * H
        qkv_flops = 2.0 * attn_tokens * proj_params * heads / N
        attn_flops = 4.0 * attn_decode_seqs * verify * decode_ctx_layers * heads * H
        prefill_attn_flops = 4.0 * attn_prefill * prefill_ctx_layers * heads * H
        out_params = N * H * D
        absorb_params = 0
        # Kernels per layer: the projection and its RoPE; o_proj.
        qkv_kernels, out_kernels = 2 * L, L
    qkv_weights = L * (proj_params + absorb_params) * attn_weight_share * prec.weight_bytes
    kv_read = attn_decode_seqs * decode_ctx_layers * kv_token_values * kv_share * prec.kv_bytes
    kv_write = (attn_decode_seqs * verify + attn_prefill) * L * kv_token_values * kv_share \
        * prec.kv_bytes
    # Chunked prefill re-reads the cached prefix of each request once per chunk.
    kv_prefix = prefill_seqs / layout.attention_ranks * prefill_ctx_layers \
        * kv_token_values * kv_share * prec.kv_bytes
    ops = []

    def op(name, flops, weight_bytes, rows, mix, kernels, kv=0.0, act_features=0.0,
           fabric_rows=0.0, act_values=None):
        # Activation bytes: rows x features, or the values moved when given as such.
        act = (rows * act_features if act_values is None else act_values) * a
        ops.append(Operator(name=name, flops=jnp.asarray(flops, dtype=float),
                            weight_bytes=jnp.asarray(weight_bytes, dtype=float),
                            kv_bytes=jnp.asarray(kv, dtype=float),
                            activation_bytes=jnp.asarray(act, dtype=float),
                            rows=jnp.asarray(rows, dtype=float), compute_mix=mix,
                            kernels=jnp.asarray(kernels, dtype=float),
                            fabric_rows=jnp.asarray(fabric_rows, dtype=float)))

    op("qkv_proj", L * qkv_flops, qkv_weights, attn_tokens, prec.weight_compute, qkv_kernels,
       act_features=L * (D + (N + 2 * K) * H * heads / N), fabric_rows=L * attn_tokens)
    # Decode and prompt attention are different kernels with their own ceilings
    # (`attention_kernels`); the cache traffic and the per-layer launches stay with
    # "attention", so a step without a prompt chunk costs what it did as one operator.
    op("attention", attn_flops, 0.0, attn_tokens, prec.attention_compute, L,
       kv=kv_read + kv_write + kv_prefix)
    op("prefill_attention", prefill_attn_flops, 0.0, attn_prefill, prec.attention_compute,
       0.0)
    op("out_proj", L * 2.0 * attn_tokens * out_params * heads / N,
       L * out_params * attn_weight_share * prec.weight_bytes, attn_tokens,
       prec.weight_compute, out_kernels, act_features=L * 2 * D, fabric_rows=L * attn_tokens)

    # Feed-forward: routed experts, shared experts and dense layers.
    n_moe, n_dense = float(model.num_moe_layers), float(model.num_dense_layers)
    if model.is_moe:
        touched, assignments, expert_rows = expert_load(model, tokens, ep)
        expert_params = model.expert_params / layout.moe_tp
        op("router", n_moe * 2.0 * tokens * model.router_params,
           n_moe * model.router_params * prec.weight_bytes, tokens, prec.weight_compute,
           n_moe, act_features=n_moe * D)
        op("experts", n_moe * 2.0 * assignments * expert_params,
           n_moe * touched * expert_params * prec.expert_bytes, expert_rows,
           prec.expert_compute, 3 * n_moe,
           # Every token-expert assignment moves its input, output and intermediate
           # values (as rows x features, the rows cancel: no division).
           act_values=n_moe * (2 * D + model.moe_ffn * 2 / layout.moe_tp)
           * jnp.maximum(assignments, 0.0),
           fabric_rows=n_moe * assignments)
        shared = model.num_shared_experts * model.expert_params / tp
        op("shared_experts", n_moe * 2.0 * tokens * shared,
           n_moe * shared * prec.weight_bytes, tokens, prec.weight_compute,
           3 * n_moe * (model.num_shared_experts > 0), act_features=n_moe * 2 * D,
           fabric_rows=n_moe * tokens * (model.num_shared_experts > 0))
    dense = model.dense_ffn_params / tp if n_dense else 0.0
    op("dense_ffn", n_dense * 2.0 * tokens * dense, n_dense * dense * prec.weight_bytes,
       tokens, prec.weight_compute, 3 * n_dense, act_features=n_dense * 2 * D,
       fabric_rows=n_dense * tokens)
    head_rows = decode_tokens + jnp.asarray(prefill_seqs, dtype=float)
    head = model.vocab * D / tp
    op("lm_head", 2.0 * head_rows * head, head * prec.weight_bytes, head_rows,
       prec.weight_compute, 1.0, act_features=D + model.vocab / tp, fabric_rows=head_rows)
    # Draft module (MTP / EAGLE): k passes of about one layer plus the LM head, batch decode.
    k = spec.draft_tokens
    if model.is_moe:
        ffn_params = (model.experts_per_token + model.num_shared_experts) \
            * model.expert_params / tp
    else:
        ffn_params = dense
    layer_params = model.attention_params_per_layer * attn_weight_share + ffn_params
    draft_passes = k * spec.draft_layers
    op("draft", draft_passes * 2.0 * decode_seqs * (layer_params + head),
       draft_passes * (layer_params + head) * prec.weight_bytes,
       decode_seqs, prec.weight_compute, draft_passes * 8.0,
       kv=draft_passes * attn_decode_seqs * kv_token_values * kv_share * prec.kv_bytes
       * jnp.asarray(decode_context, dtype=float))
    return tuple(ops)


def _communication(model: Model, chip: Chip, design: Design, layout: Layout | LayoutNumbers,
                   tokens):
    """Seconds and bytes sent per chip for the collectives of one step.

    Each collective applies where its condition on the layout holds: pruned in Python for a
    static `Layout`, selected with `jnp.where` for `LayoutNumbers` (where a group of one chip
    costs nothing, so masked-off collectives stay finite)."""
    a = design.precision.activation_bytes
    D, tp, ep = model.hidden, layout.tp, layout.ep
    L = model.num_layers
    n_moe, n_dense = model.num_moe_layers, model.num_dense_layers
    message = tokens * D * a

    def coll(kind, msg, n):
        return collective_time(kind, msg, n, chip.scale_up, chip.scale_out, chip.domain_size)

    time = jnp.zeros_like(message)
    sent = jnp.zeros_like(message)
    pp, moe_tp = layout.pp, layout.moe_tp
    split = tp > 1
    frac = 2.0 * (tp - 1) / tp
    # Attention is local under DP attention; dense layers gather tokens and scatter results
    # (= one all-reduce of the instance's tokens); MoE layers dispatch and combine.
    dpa = logical_and(split, layout.dp_attention)
    time = add_if(dpa, time, lambda: n_dense * coll("all_reduce", message, tp))
    sent = add_if(dpa, sent, lambda: n_dense * frac * message)
    if model.is_moe:
        dispatch = logical_and(dpa, ep > 1)

        def per_chip():
            # Copies of each token the dispatch sends: one per routed expert, or by
            # TensorRT-LLM's rule (`Runtime.dispatch_per_rank`): every rank's tokens
            # gathered on every rank up to ep = k, one per rank holding any of its
            # experts above.
            k = model.experts_per_token
            share = design.runtime.dispatch_per_rank
            if known(share, 0.0):   # one copy per expert, known while tracing: no terms
                return message / tp * k
            by_rank = branch(ep > k, lambda: ranks_per_token(model.num_experts, k, ep),
                             lambda: jnp.asarray(ep, dtype=float))
            return message / tp * (k + share * (by_rank - k))

        time = add_if(dispatch, time,
                      lambda: n_moe * 2.0 * coll("all_to_all", per_chip(), ep))
        sent = add_if(dispatch, sent, lambda: n_moe * 2.0 * per_chip() * (ep - 1) / ep)
        # Each expert's tp/ep shards reduce their partial outputs of the chip's tokens.
        sharded = logical_and(dispatch, moe_tp > 1)
        time = add_if(sharded, time,
                      lambda: n_moe * coll("all_reduce", message / tp, moe_tp))
        sent = add_if(sharded, sent,
                      lambda: n_moe * 2.0 * (moe_tp - 1) / moe_tp * message / tp)
        gathered = logical_and(dpa, logical_not(ep > 1))
        time = add_if(gathered, time, lambda: n_moe * coll("all_reduce", message, tp))
        sent = add_if(gathered, sent, lambda: n_moe * frac * message)
    # Megatron-style: one all-reduce after attention, one after the FFN or MoE.
    megatron = logical_and(split, logical_not(layout.dp_attention))
    time = add_if(megatron, time, lambda: 2.0 * L * coll("all_reduce", message, tp))
    sent = add_if(megatron, sent, lambda: 2.0 * L * frac * message)
    time = add_if(pp > 1, time, lambda: (pp - 1) * coll("p2p", message, 2))
    sent = add_if(pp > 1, sent, lambda: (pp - 1) / pp * message)
    return time, sent


_FIELDS = ("flops", "weight_bytes", "kv_bytes", "activation_bytes", "rows", "compute_mix",
           "kernels", "fabric_rows")


def stack_operators(ops) -> Operator:
    """`ops` as one `Operator` whose fields carry a leading operator axis (each field
    broadcast across the operators first), to run them through `jax.vmap`."""
    fields = {name: jnp.stack(jnp.broadcast_arrays(
        *[jnp.asarray(getattr(op, name), dtype=float) for op in ops])) for name in _FIELDS}
    return Operator(name="+".join(op.name for op in ops), **fields)


def _mix(mix, per_class, unrolled: bool = True):
    """`sum(mix * per_class, axis=-1)` over the compute classes. `unrolled` (static) writes
    it out as a chain of adds in the order of XLA's reduction (the same numbers): under a wide
    `vmap` XLA:CPU fuses the adds into the formulas that use them, where a reduction is a
    kernel of its own (YNNPACK's, 0.2 to 0.7 ms per 100,000 float64 configurations each on
    2 cores; see docs/history.md, "Speed"). The stacked order (`step_cost(..., vectorize=True)`:
    gradient steps and fits, one small stack of operators, no wide `vmap`) keeps the
    reduction it was measured and compiled with."""
    if not unrolled:
        return jnp.sum(mix * per_class, axis=-1)
    weights = concrete(mix)
    if weights is not None:
        # A mix known while tracing (a closed-over precision): a class of weight 0
        # leaves no term and one of weight 1 no product (the same sums, whichever the
        # order: x + 0 * y is x for a finite y), so a one-class mix is its class's column
        # (eagerly, a slice and a squeeze where the sum over four classes was 23
        # operations).
        terms = [weighted(column(weights, i), column(per_class, i))
                 for i in range(weights.shape[-1]) if np.any(weights[..., i] != 0.0)]
        if terms:
            return functools.reduce(operator.add, terms)
    mix, per_class = jnp.broadcast_arrays(mix, per_class)
    terms = [lax.index_in_dim(mix, i, axis=-1, keepdims=False)
             * lax.index_in_dim(per_class, i, axis=-1, keepdims=False)
             for i in range(mix.shape[-1])]
    return functools.reduce(operator.add, terms)


def _peak(op: Operator, chip: Chip, unrolled: bool = True, class_peaks=None):
    """Peak FLOP/s of the operator's compute mix on `chip` (`_mix`), each class's peak
    under the chip's format ceiling (`Efficiency.class_peaks`; `class_peaks`, when given,
    is that, computed once for a step's operators)."""
    if class_peaks is None:
        class_peaks = chip.efficiency.class_peaks(chip.peak_flops)
    return _mix(op.compute_mix, class_peaks, unrolled)


def _inverse_peak(op: Operator, chip: Chip, class_peaks, inverse_class_peaks):
    """1 / `_peak` (s/FLOP): for a compute mix of one class known when tracing (a concrete
    one-hot `compute_mix`), that class's column of `inverse_class_peaks`
    (`Efficiency.inverse_class_peaks`), else the inverse of the mixed peak."""
    weights = concrete(op.compute_mix)
    if weights is not None and weights.ndim == 1:
        if np.count_nonzero(weights) == 1 and weights.max() == 1.0:
            return lax.index_in_dim(inverse_class_peaks, int(np.argmax(weights)), axis=-1,
                                    keepdims=False)
    return 1.0 / _peak(op, chip, class_peaks=class_peaks)


def _energy_per_flop(op: Operator, chip: Chip, unrolled: bool = True):
    """Dynamic energy per FLOP (J) of the operator's compute mix on `chip` (`_mix`)."""
    return _mix(op.compute_mix, chip.energy.per_flop, unrolled)


def attention_kernels(model: Model, chip: Chip) -> Chip:
    """`chip` with the attention efficiencies of `model`'s kernels: the fitted decode one
    for MLA and windowed attention (`Efficiency.attention_max`), the fitted prompt one of
    each (`Efficiency.prefill_attention_max`, `Efficiency.window_prefill_attention_max`),
    FlashAttention's for both phases of full GQA/MHA (`Efficiency.full_attention_max`);
    the prompt one times the chip's `prompt_attention_speedup` (at most the peak). The
    roofline reads `attention_max` and `prefill_attention_max` of the chip returned.

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> h100 = get_chip("h100")
        >>> full = attention_kernels(get_model("llama-3.1-8b"), h100).efficiency
        >>> mla = attention_kernels(get_model("deepseek-r1"), h100).efficiency
        >>> float(full.attention_max) == float(h100.efficiency.full_attention_max)
        True
        >>> float(mla.attention_max) == float(h100.efficiency.attention_max)
        True
        >>> windowed = attention_kernels(get_model("gpt-oss-120b"), h100).efficiency
        >>> float(windowed.prefill_attention_max) == float(
        ...     h100.efficiency.window_prefill_attention_max)
        True
    """
    eff = chip.efficiency
    if model.attention == "mla":
        decode, prompt = eff.attention_max, eff.prefill_attention_max
    elif model.num_sliding_layers:
        decode, prompt = eff.attention_max, eff.window_prefill_attention_max
    else:
        decode, prompt = eff.full_attention_max, eff.full_attention_max
    # A faster softmax than the family fit's chips (`Chip.prompt_attention_speedup`).
    prompt = jnp.minimum(prompt * chip.prompt_attention_speedup, 1.0)
    return eqx.tree_at(lambda c: (c.efficiency.attention_max,
                                  c.efficiency.prefill_attention_max), chip, (decode, prompt))


def _operator_time(op: Operator, attention, weight_map, chip: Chip, design: Design,
                   decode_seqs_per_chip, sharpness, hard, peak=None, inverse_peak=None):
    """`operator_time` with the operator's kind given as data, `attention` (an
    `ATTENTION_KIND` code: 0 none, 1 decode, 2 prompt attention) and the
    placement of its weights `weight_map`, so that `jax.vmap` can run a stack of operators
    through one copy of the formulas. `peak` (FLOP/s), when given, is the operator's peak
    for its `compute_mix` (`_peak`), reduced by the caller; `inverse_peak` (s/FLOP), when
    given instead, its inverse (`_inverse_peak`)."""
    eff = chip.efficiency
    if inverse_peak is None:
        inverse_peak = 1.0 / (_peak(op, chip) if peak is None else peak)
    # Attention kernels reach their own ceiling; matmuls a fraction set by their rows, its
    # inverse in one division (`Efficiency.inverse_compute_fraction`).
    inverse_fraction = jnp.where(
        attention == 1, 1.0 / jnp.maximum(eff.attention_max, FRACTION_FLOOR),
        jnp.where(attention == 2, 1.0 / jnp.maximum(eff.prefill_attention_max, FRACTION_FLOOR),
                  eff.inverse_compute_fraction(op.rows)))
    # The inverse peak is shared by the operators of one compute class (XLA computes it
    # once); the inverse fraction folds to a constant for attention kernels.
    compute = op.flops * inverse_peak * inverse_fraction
    # Slice mapping: interleaved reads cross the fabric; partitioned KV idles slices when
    # fewer sequences than slices run; partitioned weights reduce partial sums across slices.
    slices = chip.num_slices
    wmap, kmap = weight_map, design.mapping.kv
    busy = smooth_min(jnp.maximum(decode_seqs_per_chip, 1e-3), slices,
                      sharpness=sharpness, hard=hard) / slices
    # Placement columns (interleaved, partitioned, replicated; `static.column`): those a
    # closed-over design sets to 0 or 1 leave no dead term (`static.weighted`; the dead
    # 1 / busy of interleaved KV was a kernel of its own under a wide `vmap`).
    k_inter, k_part, k_repl = (column(kmap, i) for i in range(3))
    w_inter, w_part = (column(wmap, i) for i in range(2))
    # Multiplications by reciprocals the operators share (XLA computes each once): a
    # division per operator made the step's fusions division-bound on XLA:CPU, about 9 %
    # of a wide `vmap` (`benchmarks/bench_vmap.py`, alternating runs).
    kv_slowdown = k_inter + k_repl + weighted(k_part, 1.0 / busy)
    bandwidth = chip.hbm_bandwidth * eff.bandwidth_max
    moved = op.weight_bytes + op.activation_bytes + op.kv_bytes * kv_slowdown
    memory = moved * (1.0 / bandwidth) + eff.memory_latency * (op.hbm_bytes > 0)
    cross = (slices - 1.0) / slices
    fabric_bytes = (cross * (weighted(w_inter, op.weight_bytes) + weighted(k_inter, op.kv_bytes))
                    + weighted(w_part, cross * op.fabric_rows
                               * design.precision.activation_bytes * 2.0
                               * (op.weight_bytes > 0)))
    fabric = fabric_bytes * (1.0 / chip.slice_bandwidth)
    core = smooth_max(compute, memory, fabric, sharpness=sharpness, hard=hard)
    return core + eff.kernel_overhead * op.kernels, fabric_bytes


def operator_time(op: Operator, chip: Chip, design: Design, decode_seqs_per_chip,
                  sharpness=DEFAULT_SHARPNESS, hard: bool = False, peak=None,
                  inverse_peak=None):
    """Seconds of one operator on one chip: smooth max of compute, memory and slice-fabric
    time, plus per-kernel overhead. Returns (seconds, slice-fabric bytes). `peak` (FLOP/s),
    when given, is the operator's peak (`_peak`), computed by the caller; `inverse_peak`
    (s/FLOP) its inverse."""
    return _operator_time(op, ATTENTION_KIND.get(op.name, 0),
                          design.mapping.weight_class(op.name),
                          chip, design, decode_seqs_per_chip, sharpness, hard, peak,
                          inverse_peak)


def step_cost(model: Model, chip: Chip, design: Design, layout: Layout | LayoutNumbers,
              decode_seqs,
              decode_context, prefill_tokens=0.0, prefill_context=0.0, prefill_seqs=0.0,
              sharpness=DEFAULT_SHARPNESS, hard: bool = False,
              vectorize: bool = False) -> StepCost:
    """Time and work of one engine step on one chip (see `operators` for the arguments).

    `vectorize` (static) evaluates the operators as one stack (`stack_operators`) instead of
    one by one: the same formulas in a few dozen array operations instead of a few hundred
    scalar ones. That is faster where the call itself carries little data (a gradient step
    of the optimizer: XLA:CPU pays per operation) and slower under a wide `vmap` (sweeps,
    enumeration, fits: the stacking costs more than it saves there).

    The step also pays the runtime's `step_overhead` and the collectives between chips, and
    lasts at least the runtime's `stream_time` per decoding sequence; the routed experts run
    at the runtime's `expert_efficiency`, and all kernels (collectives included) at its
    `kernel_efficiency`.
    Pipeline stages (`layout.pp`) split layers: a micro-batch crosses every stage, so the step
    time is that of all layers on one chip's share of weights, plus the stage hand-offs.

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> from perfmodel.design import Design, Layout, precision
        >>> chip, model = get_chip("h100"), get_model("llama-3.1-70b")
        >>> d = Design(concurrency=1, layout=Layout(tp=8), precision=precision(chip, model))
        >>> c = step_cost(model, chip, d, d.layout, 1.0, 1024.0)
        >>> 0.004 < float(c.time) < 0.02
        True
    """
    ops = operators(model, chip, design, layout, decode_seqs, decode_context,
                    prefill_tokens, prefill_context, prefill_seqs)
    chip = attention_kernels(model, chip)
    # Attention-DP ranks: the chips that split the sequences (1 without DP attention).
    dp_ranks = jnp.asarray(layout.attention_ranks, dtype=float)
    seqs_per_chip = jnp.asarray(decode_seqs, dtype=float) / dp_ranks
    runtime = design.runtime
    # Each class's peak under the format ceiling, once for all of the step's operators.
    class_peaks = chip.efficiency.class_peaks(chip.peak_flops)
    # Routed experts run at the runtime's expert efficiency; every kernel (collectives
    # included) at its kernel efficiency. (Multiplying by their inverses, formed once,
    # takes a division per operator out of a kernel that gets the runtime as an argument,
    # but XLA:CPU then copies the chains before it into more of the gradient kernel's
    # fusions: 10,712 -> 17,754 FLOP and 34 -> 57 kB per configuration,
    # `benchmarks/profile_vmap.py --grads`, 15 % fewer gradients a second.)
    if vectorize:
        # Every operator through one copy of the formulas, vectorized over the operators.
        def one(op, attention, experts, weight_map, peak, per_flop):
            t, _ = _operator_time(op, attention, weight_map, chip, design, seqs_per_chip,
                                  sharpness, hard, peak)
            t = t / jnp.where(experts, runtime.expert_efficiency, 1.0) \
                / runtime.kernel_efficiency
            return t, op.flops * per_flop, op.flops, op.hbm_bytes

        kinds = np.asarray([(ATTENTION_KIND.get(op.name, 0), op.name == "experts")
                            for op in ops])
        # Each operator's peak FLOP/s and energy per FLOP are reduced over its compute mix
        # before stacking: a stacked (operators, ..., classes) mix would be an array of the
        # gradient step over XLA:CPU's 512-byte limit for running a loop body in order
        # (see `optimize._block`).
        weight_maps = jnp.stack(jnp.broadcast_arrays(
            *[design.mapping.weight_class(op.name) for op in ops]))
        peaks = jnp.stack(jnp.broadcast_arrays(*[_peak(op, chip, False, class_peaks)
                                                 for op in ops]))
        per_flop = jnp.stack(jnp.broadcast_arrays(
            *[_energy_per_flop(op, chip, False) for op in ops]))
        t, energy, flops, hbm_bytes = jax.vmap(one)(stack_operators(ops), kinds[:, 0],
                                                    kinds[:, 1], weight_maps, peaks, per_flop)
        times, operators_time = tuple(t), jnp.sum(t, axis=0)
        energy, flops, hbm_bytes = (jnp.sum(x, axis=0) for x in (energy, flops, hbm_bytes))
    else:
        inverse_class_peaks = chip.efficiency.inverse_class_peaks(chip.peak_flops)
        times = tuple(
            operator_time(op, chip, design, seqs_per_chip, sharpness, hard,
                          inverse_peak=_inverse_peak(op, chip, class_peaks,
                                                     inverse_class_peaks))[0]
            / (runtime.expert_efficiency if op.name == "experts" else 1.0)
            / runtime.kernel_efficiency for op in ops)
        operators_time = sum(times)
        energy = sum(op.flops * _energy_per_flop(op, chip) for op in ops)
        flops, hbm_bytes = sum(op.flops for op in ops), sum(op.hbm_bytes for op in ops)
    tokens = jnp.asarray(decode_seqs, dtype=float) * (1.0 + design.speculative.draft_tokens) \
        + jnp.asarray(prefill_tokens, dtype=float)
    comm, sent = _communication(model, chip, design, layout, tokens)
    comm = comm / runtime.kernel_efficiency
    busy = operators_time + comm
    serial = busy + runtime.step_overhead \
        + runtime.seq_overhead * jnp.asarray(decode_seqs, dtype=float) \
        + runtime.prefill_request_time * jnp.asarray(prefill_seqs, dtype=float) \
        + runtime.dp_sync_time * (dp_ranks - 1.0)
    # The streaming process (one per instance, DP attention or not) works beside the GPU:
    # it bounds the step, it does not add to it.
    total = smooth_max(serial, runtime.stream_time * jnp.asarray(decode_seqs, dtype=float),
                       sharpness=sharpness, hard=hard)
    return StepCost(time=total, flops=flops, hbm_bytes=hbm_bytes, link_bytes=sent,
                    compute_energy=energy, collective_time=comm, operator_times=times,
                    busy_time=busy)
