"""Model architecture: dense/MoE transformers with GQA, MLA and sliding-window attention.

A `Model` is fully static (integer shapes and names): it selects code paths and array
shapes, it is never differentiated. Parameter counts follow the Hugging Face implementations
(gated MLPs have three matrices; MLA's projections as in DeepSeek-V3, arXiv 2412.19437).
"""

from __future__ import annotations

import json
import numbers
import os

import equinox as eqx

ATTENTION_KINDS = ("gqa", "mla")


#: `Model` fields that count something (integers >= 0).
_COUNT_FIELDS = ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "vocab",
                 "dense_ffn", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "sliding_window", "max_context",
                 "num_sliding_layers", "num_experts", "experts_per_token", "moe_ffn",
                 "num_shared_experts", "first_dense_layers", "moe_layer_step", "mtp_layers")


class Model(eqx.Module):
    """A decoder-only transformer (static).

    Dimension letters follow the scaling book: D `hidden`, N `num_heads`, K `num_kv_heads`,
    H `head_dim`, F FFN width, E `num_experts`, L `num_layers`, V `vocab`.

    Example:
        >>> m = Model(name="toy", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
        ...           head_dim=16, dense_ffn=128, vocab=100)
        >>> m.num_moe_layers, m.kv_values_per_token_layer
        (0, 64)
    """

    name: str = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    hidden: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    vocab: int = eqx.field(static=True)
    dense_ffn: int = eqx.field(static=True, default=0)
    attention: str = eqx.field(static=True, default="gqa")
    kv_lora_rank: int = eqx.field(static=True, default=0)
    q_lora_rank: int = eqx.field(static=True, default=0)
    qk_rope_head_dim: int = eqx.field(static=True, default=0)
    qk_nope_head_dim: int = eqx.field(static=True, default=0)
    v_head_dim: int = eqx.field(static=True, default=0)
    sliding_window: int = eqx.field(static=True, default=0)
    """Window of local-attention layers (tokens); 0 = none."""
    max_context: int = eqx.field(static=True, default=0)
    """Longest sequence, prompt plus output (tokens), of the released configuration
    (`max_position_embeddings`); 0 = unknown. The command line refuses longer requests
    unless asked; the model itself does not limit them."""
    num_sliding_layers: int = eqx.field(static=True, default=0)
    num_experts: int = eqx.field(static=True, default=0)
    experts_per_token: int = eqx.field(static=True, default=0)
    moe_ffn: int = eqx.field(static=True, default=0)
    num_shared_experts: int = eqx.field(static=True, default=0)
    first_dense_layers: int = eqx.field(static=True, default=0)
    moe_layer_step: int = eqx.field(static=True, default=1)
    """After the first dense layers, every `moe_layer_step`-th layer is MoE (Llama 4
    Maverick: 2), the others dense."""
    gated_mlp: bool = eqx.field(static=True, default=True)
    tied_embeddings: bool = eqx.field(static=True, default=False)
    weight_format: str = eqx.field(static=True, default="bf16")
    """Format of the released non-expert weights."""
    expert_format: str = eqx.field(static=True, default="bf16")
    """Format of the released routed-expert weights."""
    mtp_layers: int = eqx.field(static=True, default=0)
    """Multi-token-prediction modules shipped with the model (DeepSeek-V3: 1)."""

    def __check_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Model.name must be a non-empty string, got {self.name!r}")
        for key in _COUNT_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Model {self.name!r}: {key} must be an integer, got "
                                f"{type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"Model {self.name!r}: {key} must be >= 0, got {value}")
        positive = ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "vocab",
                    "moe_layer_step")
        for key in positive:
            if getattr(self, key) <= 0:
                raise ValueError(f"Model {self.name!r}: {key} must be > 0, got "
                                 f"{getattr(self, key)}")
        for key in ("gated_mlp", "tied_embeddings"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"Model {self.name!r}: {key} must be True or False, got "
                                f"{getattr(self, key)!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"Model {self.name!r}: attention must be one of {ATTENTION_KINDS}, "
                             f"got {self.attention!r}")
        if self.attention == "mla" and (self.kv_lora_rank <= 0 or self.qk_rope_head_dim <= 0
                                        or self.v_head_dim <= 0 or self.qk_nope_head_dim <= 0):
            raise ValueError(f"Model {self.name!r}: MLA needs kv_lora_rank, qk_rope_head_dim, "
                             "qk_nope_head_dim and v_head_dim > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Model {self.name!r}: num_heads ({self.num_heads}) must be a "
                             f"multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts or self.moe_ffn <= 0:
                raise ValueError(f"Model {self.name!r}: MoE needs 0 < experts_per_token <= "
                                 "num_experts and moe_ffn > 0")
        if self.num_moe_layers < self.num_layers and self.dense_ffn <= 0:
            raise ValueError(f"Model {self.name!r}: dense layers need dense_ffn > 0")
        if not 0 <= self.num_sliding_layers <= self.num_layers:
            raise ValueError(f"Model {self.name!r}: num_sliding_layers must be in "
                             f"[0, num_layers]")
        if self.num_sliding_layers and self.sliding_window <= 0:
            raise ValueError(f"Model {self.name!r}: sliding layers need sliding_window > 0")

    def split_problem(self, tp: int, dp_attention: bool = False) -> str | None:
        """Why tensor-parallel attention over `tp` chips cannot split this model's heads, or
        None when it can (static degrees).

        Up to the query heads, `tp` must divide them (vLLM checks
        `num_attention_heads % tensor_parallel_size == 0`); past them it splits each head's
        dimensions, so it must be a multiple of the heads whose quotient divides `head_dim`
        (the fractional head count of `roofline.operators`). GQA KV heads split over
        `min(tp, K)` chips and are replicated past K, so either K divides tp or tp divides K
        (vLLM's rule for KV-head replication). MLA's latent and DP attention have no head
        constraint.
        """
        if dp_attention or tp == 1:
            return None
        N, K = self.num_heads, self.num_kv_heads
        if tp <= N and N % tp:
            return (f"tp={tp} does not divide {self.name}'s {N} attention heads; use a tp "
                    "that divides them")
        if tp > N and (tp % N or self.head_dim % (tp // N)):
            return (f"tp={tp} exceeds {self.name}'s {N} attention heads but does not split "
                    f"them evenly (a multiple of {N} whose quotient divides head_dim "
                    f"{self.head_dim} is needed)")
        if self.attention != "mla" and (K % tp if tp <= K else tp % K):
            return (f"tp={tp} cannot split {self.name}'s {K} KV heads (K must divide tp or "
                    "tp divide K)")
        return None

    # -- layer counts ------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        rest = self.num_layers - self.first_dense_layers
        return (rest + self.moe_layer_step - 1) // self.moe_layer_step

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    # -- attention shapes ----------------------------------------------------------------
    @property
    def kv_values_per_token_layer(self) -> int:
        """Cached values per token per layer: 2 K H for GQA, kv_lora_rank + rope for MLA."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        D, N, K, H = self.hidden, self.num_heads, self.num_kv_heads, self.head_dim
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (D * self.q_lora_rank + self.q_lora_rank * N * qk) if self.q_lora_rank \
                else D * N * qk
            kv = D * (self.kv_lora_rank + self.qk_rope_head_dim) \
                + self.kv_lora_rank * N * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + N * self.v_head_dim * D
        return D * (N + 2 * K) * H + N * H * D

    # -- FFN shapes ----------------------------------------------------------------------
    @property
    def _mats(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def dense_ffn_params(self) -> int:
        return self._mats * self.hidden * self.dense_ffn

    @property
    def expert_params(self) -> int:
        """Parameters of one routed (or shared) expert."""
        return self._mats * self.hidden * self.moe_ffn

    @property
    def router_params(self) -> int:
        return self.hidden * self.num_experts

    # -- totals --------------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def expert_params_total(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def non_expert_params(self) -> int:
        """Everything but routed experts: attention, dense FFN, shared experts, router,
        embeddings and LM head."""
        return (self.num_layers * self.attention_params_per_layer
                + self.num_dense_layers * self.dense_ffn_params
                + self.num_moe_layers * (self.num_shared_experts * self.expert_params
                                         + self.router_params)
                + self.embedding_params)

    @property
    def total_params(self) -> int:
        return self.non_expert_params + self.expert_params_total

    @property
    def active_params(self) -> int:
        """Parameters touched per token (embedding table excluded, LM head included)."""
        return (self.total_params - self.expert_params_total - self.vocab * self.hidden
                * (0 if self.tied_embeddings else 1)
                + self.num_moe_layers * self.experts_per_token * self.expert_params)


def _get(cfg: dict, *keys, default=None):
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    return default


_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "starcoder2",
                               "gpt_bigcode"})
"""Model types whose Hugging Face config class ties embeddings when the key is absent."""
_NON_GATED_MLP = frozenset({"starcoder2", "gpt_bigcode"})
"""Model types whose MLP is two matrices (c_fc, c_proj) with no gate."""
_UNIFORM_SLIDING = frozenset({"mistral", "starcoder2", "phi3"})
"""Model types that apply a non-null `sliding_window` to every layer."""


def from_hf_config(config: dict | str | os.PathLike, name: str | None = None) -> Model:
    """Build a `Model` from a Hugging Face ``config.json`` (a dict or a local path).

    Understands the Llama/Qwen/Mistral/Mixtral families, DeepSeek-V3/R1 and Kimi-K2 (MLA,
    shared experts, first dense layers), gpt-oss (alternating sliding windows), Llama 4
    (interleaved MoE, chunked local attention), Gemma 1/2/3 (tied embeddings; Gemma 2
    alternates local and global layers, Gemma 3 has one global layer in every
    `sliding_window_pattern`, or follows `layer_types`), Phi-3, StarCoder2 and GPT-BigCode
    (non-gated MLP; multi-query attention for GPT-BigCode). Mistral, Phi-3 and StarCoder2
    configs with a non-null `sliding_window` use it in every layer, as the Hugging Face
    implementations do. A missing `tie_word_embeddings` takes the Hugging Face default of
    the family (tied for Gemma, StarCoder2 and GPT-BigCode, untied otherwise). Multimodal
    configs use their `text_config`. No network access.

    Raises:
        ValueError: a missing field, naming it and the file.

    Example:
        >>> m = from_hf_config({"model_type": "llama", "num_hidden_layers": 32,
        ...     "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        ...     "intermediate_size": 14336, "vocab_size": 128256})
        >>> round(m.total_params / 1e9, 2)
        8.03
        >>> g = from_hf_config({"model_type": "gemma2", "num_hidden_layers": 26,
        ...     "hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4,
        ...     "head_dim": 256, "intermediate_size": 9216, "vocab_size": 256000,
        ...     "sliding_window": 4096})
        >>> g.tied_embeddings, g.num_sliding_layers, g.sliding_window
        (True, 13, 4096)
        >>> s = from_hf_config({"model_type": "starcoder2", "num_hidden_layers": 30,
        ...     "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 2,
        ...     "intermediate_size": 12288, "vocab_size": 49152, "sliding_window": 4096})
        >>> s.gated_mlp, s.num_sliding_layers, round(s.total_params / 1e9, 2)
        (False, 30, 3.03)
    """
    source = "dict"
    if not isinstance(config, dict):
        source = os.fspath(config)
        with open(source) as handle:
            config = json.load(handle)
    cfg = dict(config)
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        cfg = {**cfg, **cfg["text_config"]}
    model_type = str(cfg.get("model_type", "")).lower()

    def need(*keys):
        value = _get(cfg, *keys)
        if value is None:
            raise ValueError(f"config {source}: missing field {keys[0]!r} (model_type "
                             f"{model_type!r})")
        return value

    layers = int(need("num_hidden_layers", "n_layer", "num_layers"))
    hidden = int(need("hidden_size", "d_model", "n_embd"))
    heads = int(need("num_attention_heads", "n_head"))
    if model_type == "gpt_bigcode" and _get(cfg, "multi_query", default=True):
        kv_heads = 1                       # multi-query attention: one K/V head
    else:
        kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
    vocab = int(need("vocab_size"))
    kwargs: dict = dict(
        name=name or str(_get(cfg, "_name_or_path", default=model_type or "model")),
        num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab=vocab,
        max_context=int(_get(cfg, "max_position_embeddings", "n_positions", "max_seq_len",
                             default=0) or 0),
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings",
                                  default=model_type in _TIED_BY_DEFAULT)),
        gated_mlp=model_type not in _NON_GATED_MLP)
    experts = int(_get(cfg, "n_routed_experts", "num_local_experts", "num_experts",
                       default=0) or 0)
    dense_ffn = int(_get(cfg, "intermediate_size_mlp", "intermediate_size", default=0) or 0)
    if experts:
        kwargs.update(
            num_experts=experts,
            experts_per_token=int(need("num_experts_per_tok", "num_experts_per_token",
                                       "experts_per_token")),
            moe_ffn=int(_get(cfg, "moe_intermediate_size", "intermediate_size")),
            num_shared_experts=int(_get(cfg, "n_shared_experts", default=0) or 0),
            first_dense_layers=int(_get(cfg, "first_k_dense_replace", default=0) or 0),
            moe_layer_step=int(_get(cfg, "interleave_moe_layer_step", "moe_layer_freq",
                                    default=1) or 1))
        if model_type.startswith("llama4"):
            kwargs["num_shared_experts"] = 1  # Llama 4 adds a shared expert to each MoE layer
        needs_dense = kwargs["first_dense_layers"] > 0 or kwargs["moe_layer_step"] > 1
        kwargs["dense_ffn"] = dense_ffn if needs_dense else 0
    else:
        if model_type == "gpt_bigcode" and _get(cfg, "n_inner") is None:
            kwargs["dense_ffn"] = 4 * hidden   # GPTBigCodeConfig: n_inner None = 4 * n_embd
        else:
            kwargs["dense_ffn"] = int(need("intermediate_size", "ffn_dim", "n_inner"))
    if _get(cfg, "kv_lora_rank"):
        kwargs.update(
            attention="mla", kv_lora_rank=int(cfg["kv_lora_rank"]),
            q_lora_rank=int(_get(cfg, "q_lora_rank", default=0) or 0),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")), v_head_dim=int(need("v_head_dim")),
            head_dim=int(need("qk_nope_head_dim")) + int(need("qk_rope_head_dim")))
    layer_types = _get(cfg, "layer_types")
    if model_type in ("gpt_oss", "gemma2", "gemma3", "gemma3_text") or layer_types or (
            model_type in _UNIFORM_SLIDING and _get(cfg, "use_sliding_window", default=True)):
        window = int(_get(cfg, "sliding_window", default=0) or 0)
        if layer_types:
            sliding = sum(1 for t in layer_types if "sliding" in str(t))
        elif model_type == "gemma2":
            sliding = (layers + 1) // 2    # even layers 0, 2, ... are local (Gemma 2)
        elif model_type in ("gemma3", "gemma3_text"):
            # Gemma 3: layer i is global when (i + 1) % pattern == 0, else local.
            pattern = int(_get(cfg, "sliding_window_pattern", "_sliding_window_pattern",
                               default=6) or 6)
            sliding = layers - layers // pattern
        elif model_type in _UNIFORM_SLIDING:
            sliding = layers
        else:
            sliding = layers // 2
        kwargs.update(sliding_window=window if sliding else 0,
                      num_sliding_layers=sliding if window else 0)
    chunk = _get(cfg, "attention_chunk_size")
    if chunk and model_type.startswith("llama4"):
        # Llama 4: three of every four layers use chunked local attention (no_rope_layers).
        interval = int(_get(cfg, "nope_layer_interval", default=4) or 4)
        kwargs.update(sliding_window=int(chunk),
                      num_sliding_layers=layers - layers // interval)
    quant = _get(cfg, "quantization_config", default={}) or {}
    method = str(quant.get("quant_method", "")).lower()
    fmt = str(quant.get("fmt", "")).lower()
    if method == "mxfp4":
        kwargs.update(weight_format="bf16", expert_format="mxfp4")
    elif method == "fp8" or fmt.startswith("e4m3"):
        kwargs.update(weight_format="fp8", expert_format="fp8")
    elif method == "compressed-tensors":
        kwargs.update(weight_format="bf16", expert_format="int4")
    kwargs["mtp_layers"] = int(_get(cfg, "num_nextn_predict_layers", default=0) or 0)
    return Model(**kwargs)
