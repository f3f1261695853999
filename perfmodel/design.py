"""Design: what an operator chooses. Parallel layout (static, or as numbers), number formats
per tensor class, slice mapping, speculative decoding, serving-runtime settings and
concurrency."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .architecture import Model
from .checks import (
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    UNIT_INTERVAL,
    Range,
    as_number,
    check,
    distribution,
    instance,
)
from .formats import COMPUTE_CLASSES, FORMAT_BYTES, FORMAT_CLASS, compute_class, resolve_format
from .hardware import Chip

#: Where a class of state lives across a chip's slices.
PLACEMENTS = ("interleaved", "partitioned", "replicated")


def _array(x):
    return jnp.asarray(x, dtype=float)


class Layout(eqx.Module):
    """Parallel layout of one pool of chips (static).

    An *instance* (one model replica) spans `tp * pp` chips; the pool runs `replicas` of them.
    Attention is tensor-parallel over `tp` or, with `dp_attention`, data-parallel (each of the
    `tp` chips holds the full attention weights and its own share of the requests, as SGLang's
    DP attention). Routed experts are spread over `ep` chips and tensor-parallel over
    `tp // ep` inside each expert. Pipeline stages `pp` split the layers.

    Example:
        >>> Layout(tp=8, ep=8, dp_attention=True).chips
        8
    """

    tp: int = eqx.field(static=True, default=1)
    ep: int = eqx.field(static=True, default=1)
    pp: int = eqx.field(static=True, default=1)
    dp_attention: bool = eqx.field(static=True, default=False)
    replicas: int = eqx.field(static=True, default=1)

    def __check_init__(self):
        for key in ("tp", "ep", "pp", "replicas"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{key} must be a positive integer, got {value!r}")
        if self.tp % self.ep:
            raise ValueError(f"Layout.ep ({self.ep}) must divide Layout.tp ({self.tp}); "
                             "experts are spread over ep of the tp chips of an instance")

    @property
    def chips_per_instance(self) -> int:
        return self.tp * self.pp

    @property
    def chips(self) -> int:
        return self.tp * self.pp * self.replicas

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def attention_ranks(self) -> int:
        """Chips that split an instance's sequences: `tp` under attention DP (each rank
        runs its own requests' attention and holds their KV cache), else 1 (chips)."""
        return self.tp if self.dp_attention else 1

    def numbers(self) -> LayoutNumbers:
        """This layout as arrays (`LayoutNumbers`): the model then computes the same numbers
        with one kernel for every layout (jit does not specialise on the degrees, and
        `jax.vmap` runs a stack of layouts at once)."""
        return LayoutNumbers(tp=self.tp, ep=self.ep, pp=self.pp, replicas=self.replicas,
                             dp_attention=self.dp_attention)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """The layout `describe` writes as `text` ("2xtp4-ep4-dpa", "tp8-pp2").

        Raises:
            ValueError: a part that is not `Nx` (replicas), `tpN`, `epN`, `ppN` or `dpa`.

        Example:
            >>> Layout.parse("2xtp4-ep4-dpa") == Layout(tp=4, ep=4, dp_attention=True,
            ...                                         replicas=2)
            True
        """
        head, sep, rest = text.strip().partition("x")
        replicas, rest = (head, rest) if sep and head.isdigit() else ("1", text.strip())
        kw: dict = {"replicas": int(replicas), "dp_attention": False}
        for part in rest.split("-"):
            if part == "dpa":
                kw["dp_attention"] = True
            elif part[:2] in ("tp", "ep", "pp") and part[2:].isdigit() and part[:2] not in kw:
                kw[part[:2]] = int(part[2:])
            else:
                raise ValueError(f"layout {text!r}: cannot read {part!r}; write it as "
                                 "[Nx]tpN[-epN][-ppN][-dpa], as Layout.describe does")
        return cls(**kw)

    def describe(self) -> str:
        text = f"tp{self.tp}"
        if self.ep > 1:
            text += f"-ep{self.ep}"
        if self.pp > 1:
            text += f"-pp{self.pp}"
        if self.dp_attention:
            text += "-dpa"
        return f"{self.replicas}x{text}" if self.replicas > 1 else text


def _bool_array(x):
    return jnp.asarray(x, dtype=bool)


class LayoutNumbers(eqx.Module):
    """A parallel layout as arrays: the numeric counterpart of `Layout` (build one with
    `Layout.numbers()`).

    The model takes either form and computes the same numbers. A `Layout` is static: jit
    compiles one kernel per layout and prunes the branches it does not take. A
    `LayoutNumbers` is data: the degrees may be traced, and a stack of them (leaves with a
    leading axis) runs under `jax.vmap`, so one kernel serves many layouts. The degrees are
    counts and are meant to hold whole numbers with `ep` dividing `tp`, as in `Layout`;
    `serving.predict` checks that (with `eqx.error_if`) when `check`.

    Example:
        >>> n = Layout(tp=8, ep=4, pp=2, replicas=2).numbers()
        >>> float(n.chips), float(n.chips_per_instance), float(n.moe_tp)
        (32.0, 16.0, 2.0)
    """

    tp: jnp.ndarray = eqx.field(converter=_array)
    """Tensor-parallel degree: chips an instance's layers are split over (chips)."""
    ep: jnp.ndarray = eqx.field(converter=_array)
    """Expert-parallel degree: of the `tp` chips, those the routed experts are spread over
    (chips; divides `tp`)."""
    pp: jnp.ndarray = eqx.field(converter=_array)
    """Pipeline stages: groups of `tp` chips the layers are split over (chips per stage
    group, i.e. stages)."""
    replicas: jnp.ndarray = eqx.field(converter=_array)
    """Model instances in the pool (instances)."""
    dp_attention: jnp.ndarray = eqx.field(converter=_bool_array)
    """Data-parallel attention over the `tp` chips (bool)."""

    @classmethod
    def stack(cls, layouts) -> LayoutNumbers:
        """The static `layouts` as one `LayoutNumbers` whose leaves carry a leading axis,
        one row per layout (`Layout.numbers()` of each, stacked; built from NumPy, one array
        per field).

        Example:
            >>> n = LayoutNumbers.stack([Layout(tp=8, ep=8), Layout(tp=4, replicas=2)])
            >>> n.tp.tolist(), n.chips.tolist()
            ([8.0, 4.0], [8.0, 8.0])
        """
        return cls(**{key: np.asarray([getattr(x, key) for x in layouts])
                      for key in ("tp", "ep", "pp", "replicas", "dp_attention")})

    @property
    def chips_per_instance(self):
        """Chips of one instance, `tp * pp` (chips)."""
        return self.tp * self.pp

    @property
    def chips(self):
        """Chips of the pool, `tp * pp * replicas` (chips)."""
        return self.tp * self.pp * self.replicas

    @property
    def moe_tp(self):
        """Tensor-parallel degree inside each routed expert, `tp / ep` (chips)."""
        return self.tp / self.ep

    @property
    def attention_ranks(self):
        """Chips that split an instance's sequences: `tp` under attention DP, else 1
        (chips; `Layout.attention_ranks`)."""
        return jnp.where(self.dp_attention, self.tp, 1.0)


class Disaggregated(eqx.Module):
    """Prefill/decode disaggregation: two pools, KV moved from prefill to decode chips.

    Both pools are static `Layout`s (one compiled kernel per pair), or both `LayoutNumbers`
    (`numbers()`: one kernel for many pairs, stacked under `jax.vmap`); `serving.predict`
    computes the same numbers from either. The simulator takes static pools only.

    Example:
        >>> d = Disaggregated(prefill=Layout(tp=4, replicas=2), decode=Layout(tp=8))
        >>> d.chips, float(d.numbers().chips)
        (16, 16.0)
    """

    prefill: Layout | LayoutNumbers
    decode: Layout | LayoutNumbers

    def __check_init__(self):
        kinds = {type(self.prefill), type(self.decode)}
        if not (kinds == {Layout} or kinds == {LayoutNumbers}):
            raise ValueError(f"Disaggregated pools must both be static Layouts or both "
                             f"LayoutNumbers, got prefill {type(self.prefill).__name__} and "
                             f"decode {type(self.decode).__name__}; convert with "
                             "Layout.numbers() or Disaggregated.numbers()")

    @property
    def static(self) -> bool:
        """Whether the pools are static `Layout`s."""
        return isinstance(self.prefill, Layout)

    @property
    def chips(self):
        """Chips of both pools (an int, or an array for `LayoutNumbers` pools)."""
        return self.prefill.chips + self.decode.chips

    def numbers(self) -> Disaggregated:
        """Both pools as `LayoutNumbers` (unchanged when they already are)."""
        if not self.static:
            return self
        return Disaggregated(prefill=self.prefill.numbers(), decode=self.decode.numbers())

    def describe(self) -> str:
        if not self.static:
            raise ValueError("describe() needs static pools: LayoutNumbers may be traced")
        return f"P[{self.prefill.describe()}]+D[{self.decode.describe()}]"


class Precision(eqx.Module):
    """Number formats per tensor class, as numbers (so a relaxed choice can mix them).

    Build a concrete one with `precision(...)`. The `*_compute` vectors weight the chip's peak
    FLOP/s and energy per FLOP of each class of `formats.COMPUTE_CLASSES` (one-hot for a real
    design; a softmax in a relaxed search).
    """

    weight_bytes: jnp.ndarray = eqx.field(converter=as_number)
    """Bytes per non-expert weight (attention, dense FFN, shared experts, LM head)."""
    expert_bytes: jnp.ndarray = eqx.field(converter=as_number)
    """Bytes per routed-expert weight."""
    kv_bytes: jnp.ndarray = eqx.field(converter=as_number)
    """Bytes per cached KV value."""
    activation_bytes: jnp.ndarray = eqx.field(converter=as_number)
    """Bytes per activation value moved between chips or through HBM."""
    weight_compute: jnp.ndarray = eqx.field(converter=as_number)
    expert_compute: jnp.ndarray = eqx.field(converter=as_number)
    attention_compute: jnp.ndarray = eqx.field(converter=as_number)
    names: tuple[str, ...] = eqx.field(static=True, default=())
    """(weights, experts, kv) format names, for reports; empty when relaxed."""

    def __check_init__(self):
        check(self, {"weight_bytes": POSITIVE, "expert_bytes": POSITIVE, "kv_bytes": POSITIVE,
                     "activation_bytes": NON_NEGATIVE, "weight_compute": UNIT_INTERVAL,
                     "expert_compute": UNIT_INTERVAL, "attention_compute": UNIT_INTERVAL})
        n = len(COMPUTE_CLASSES)
        for key in ("weight_compute", "expert_compute", "attention_compute"):
            if getattr(self, key).shape[-1:] != (n,):
                raise ValueError(f"Precision.{key} needs {n} entries, one per compute class "
                                 f"{COMPUTE_CLASSES}; got shape {getattr(self, key).shape}")
        distribution(self, ("weight_compute", "expert_compute", "attention_compute"),
                     COMPUTE_CLASSES)


def _one_hot(cls: str):
    return jnp.asarray([1.0 if c == cls else 0.0 for c in COMPUTE_CLASSES])


_WIDTH_ORDER = ("int4", "mxfp4", "nvfp4", "int8", "fp8", "fp16", "bf16", "fp32")


def _generic_fp4(name: str | None) -> bool:
    """Whether a requested format is plain "fp4" (resolved per chip and model)."""
    return isinstance(name, str) and name.strip().lower() == "fp4"


#: Chip families whose engines run MLA attention in FP8 when the KV cache is FP8 (the
#: TensorRT-LLM-generated MLA kernels of Blackwell, which TensorRT-LLM and SGLang's
#: default Blackwell backend for DeepSeek models, `trtllm_mla`, both call): TensorRT-LLM
#: tech blog 3, "Optimizing DeepSeek R1 Throughput on NVIDIA Blackwell GPUs" ("FP8 KV
#: cache and FP8 attention, rather than BF16 precision"); SGLang's DeepSeek-V3/R1
#: cookbook, B200 (`--kv-cache-dtype fp8_e4m3`: "enables fp8 kv cache and fp8 attention
#: kernels"; the InferenceX B200 and Dynamo GB200 SGLang recipes set `--attention-backend
#: trtllm_mla` with that cache). Elsewhere an FP8 cache is dequantized for BF16 math
#: (FlashMLA on Hopper, FlashInfer and FlashAttention for GQA); CDNA4 was tried as a member
#: and left out (calibration/README.md, "Attention math of the InferenceMAX rows").
FP8_MLA_FAMILIES = ("blackwell",)


def attention_class(chip: Chip, model: Model, kv: str) -> str:
    """The compute class of attention math ("fp8" or "bf16") the engines run for `model`
    on `chip` with a KV cache in format `kv` (a `formats` name): FP8 for MLA with an FP8
    cache on a family of `FP8_MLA_FAMILIES` that computes FP8, else BF16. The one rule
    behind `precision(attention="auto")` and `perfmodel.search`'s KV options.

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> r1, b200 = get_model("deepseek-r1"), get_chip("b200")
        >>> attention_class(b200, r1, "fp8"), attention_class(get_chip("h200"), r1, "fp8")
        ('fp8', 'bf16')
        >>> oss = get_model("gpt-oss-120b")
        >>> attention_class(b200, r1, "bf16"), attention_class(b200, oss, "fp8")
        ('bf16', 'bf16')
    """
    fp8 = (model.attention == "mla" and FORMAT_CLASS.get(kv) == "fp8"
           and chip.family in FP8_MLA_FAMILIES and "fp8" in chip.native_classes)
    return "fp8" if fp8 else "bf16"


def precision(chip: Chip, model: Model, weights: str | None = None,
              experts: str | None = None, kv: str | None = None,
              activations: str = "bf16", attention: str = "auto", *,
              emulate: bool = False) -> Precision:
    """A concrete `Precision` for a chip and model.

    Args:
        chip: decides what "fp4" means and which classes run natively.
        model: its released formats are the defaults.
        weights: format of the routed experts of an MoE model and of all weights of a dense
            one (``"fp4"``, ``"fp8"``, ``"bf16"``, ...). Non-expert weights of an MoE model
            keep their released format when that is wider (gpt-oss: attention stays BF16 in
            its MXFP4 release), else take this one; with `experts` given too, `weights` is
            the non-expert format exactly (what `Precision.names` and `perfmodel optimize`
            print: `precision(chip, model, *names)` rebuilds the same precision).
        experts: override the routed-expert format.
        kv: KV-cache format; default BF16 (the engines' "auto").
        activations: format of activations moved between chips.
        attention: compute class of attention math: "bf16", "fp8" (FP8 attention
            kernels) or "auto" (default): what the engines run for this chip, model and
            KV cache (`attention_class`: FP8 for MLA with an FP8 cache on Blackwell).
        emulate: allow a requested weight or expert format, or FP8 attention, that the chip
            does not compute natively: the weights are stored in that format and
            dequantized for a BF16 matmul (weight-only quantization, as vLLM's Marlin
            kernels run MXFP4 or FP8 weights on chips without FP4 or FP8 units), and
            attention math runs in BF16. The model's released formats (the defaults) are
            always allowed: they are what the checkpoint holds.

    Raises:
        ValueError: unknown format names; a requested format the chip does not compute
            natively, without `emulate`.
        TypeError: a format that is not a name.

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> p = precision(get_chip("b200"), get_model("gpt-oss-120b"), "fp4")
        >>> p.names
        ('bf16', 'mxfp4', 'bf16')
    """
    given = {"weights": weights, "experts": experts, "kv": kv, "activations": activations,
             "attention": attention}
    for key, value in given.items():
        if value is not None and not isinstance(value, str):
            raise TypeError(f"precision: {key} must be a format name such as 'fp8', got "
                            f"{type(value).__name__} {value!r}")
    if attention.strip().lower() not in ("auto", "bf16", "fp8"):
        raise ValueError(f"precision: attention={attention!r}; attention math runs in 'bf16' "
                         "or 'fp8', or 'auto' for what the engines run (`attention_class`)")
    flavor = chip.fp4_flavor
    base = resolve_format(weights, flavor) if weights else None
    if model.is_moe:
        released_experts = resolve_format(model.expert_format, flavor)
        if FORMAT_CLASS[released_experts] == "fp4" and _generic_fp4(experts or weights):
            # Plain "fp4" of a model released with FP4 experts is its checkpoint (gpt-oss:
            # MXFP4, on every chip), not the chip's own FP4 flavour.
            expert_fmt = released_experts
        else:
            expert_fmt = resolve_format(experts, flavor) if experts else \
                (base or released_experts)
        released = resolve_format(model.weight_format, flavor)
        if base is None:
            weight_fmt = released
        elif experts:
            weight_fmt = base   # both given: each class exactly as named
        else:
            weight_fmt = max(base, released, key=_WIDTH_ORDER.index)
    else:
        weight_fmt = base or resolve_format(model.weight_format, flavor)
        expert_fmt = resolve_format(experts, flavor) if experts else weight_fmt
    # KV "auto": vLLM and SGLang store the cache in the model's activation dtype (BF16)
    # unless told otherwise (--kv-cache-dtype); the attention math of an FP8 cache is
    # `attention_class`'s, unless `attention` names one.
    kv_fmt = resolve_format(kv, flavor) if kv is not None else "bf16"
    if attention.strip().lower() == "auto":
        attention = attention_class(chip, model, kv_fmt)
    act_fmt = resolve_format(activations, flavor)
    native = chip.native_classes
    requested = {"weights": weight_fmt if base is not None and weight_fmt == base else None,
                 "experts": expert_fmt if (experts or base) and model.is_moe else None}
    if attention.strip().lower() == "fp8":
        requested["attention"] = "fp8"
    for key, fmt in requested.items():
        if fmt is not None and not emulate and FORMAT_CLASS[fmt] not in native:
            raise ValueError(
                f"precision: {chip.name} does not compute {fmt} natively (its classes: "
                f"{', '.join(native)}); pass emulate=True (--emulate) to model {key} stored "
                f"in {fmt} and computed in BF16 (weight-only quantization), or choose a "
                "native format")
    attention_cls = "fp8" if (attention.strip().lower() == "fp8" and "fp8" in native) \
        else "bf16"
    return Precision(
        weight_bytes=FORMAT_BYTES[weight_fmt], expert_bytes=FORMAT_BYTES[expert_fmt],
        kv_bytes=FORMAT_BYTES[kv_fmt], activation_bytes=FORMAT_BYTES[act_fmt],
        weight_compute=_one_hot(compute_class(weight_fmt, native, flavor)),
        expert_compute=_one_hot(compute_class(expert_fmt, native, flavor)),
        attention_compute=_one_hot(attention_cls),
        names=(weight_fmt, expert_fmt, kv_fmt))


#: Classes of state a `SliceMapping` places: three weight classes and the KV cache.
STATE_CLASSES = ("attention", "dense", "experts", "kv")
#: Which weight class each operator of `perfmodel.roofline.operators` reads.
WEIGHT_CLASS_OF = {"qkv_proj": "attention", "out_proj": "attention", "experts": "experts"}


class SliceMapping(eqx.Module):
    """Where each class of state lives across a chip's slices: probabilities over
    `PLACEMENTS` (one-hot for a real design) for attention weights, dense weights (dense and
    shared-expert FFN, router, LM head, draft module), routed-expert weights and the KV cache.

    - interleaved: addresses striped over all slices (what GPUs do); a fraction (S-1)/S of
      reads cross the slice fabric.
    - partitioned: each slice holds its own part and reads it locally; weights pay a
      cross-slice reduction of partial sums; the KV of a request lives on one slice, so with
      fewer running sequences than slices some slices idle.
    - replicated: every slice holds a copy: local reads at S times the capacity.

    `SliceMapping(weights=...)` places all three weight classes alike.
    """

    attention: jnp.ndarray
    dense: jnp.ndarray
    experts: jnp.ndarray
    kv: jnp.ndarray

    def __init__(self, attention=None, dense=None, experts=None, kv=None, *, weights=None):
        default = (1.0, 0.0, 0.0)
        if weights is not None:
            weights = _array(weights)
            if weights.shape[-1:] != (len(PLACEMENTS),):
                raise ValueError(f"SliceMapping.weights needs {len(PLACEMENTS)} entries, one "
                                 f"per placement {PLACEMENTS}")
        base = default if weights is None else weights
        self.attention = _array(base if attention is None else attention)
        self.dense = _array(base if dense is None else dense)
        self.experts = _array(base if experts is None else experts)
        self.kv = _array(default if kv is None else kv)

    def __check_init__(self):
        for key in STATE_CLASSES:
            if getattr(self, key).shape[-1:] != (len(PLACEMENTS),):
                raise ValueError(f"SliceMapping.{key} needs {len(PLACEMENTS)} entries, one per "
                                 f"placement {PLACEMENTS}")
        distribution(self, STATE_CLASSES, PLACEMENTS)

    def weight_class(self, name: str) -> jnp.ndarray:
        """Placement of the weights read by operator `name`."""
        return getattr(self, WEIGHT_CLASS_OF.get(name, "dense"))


def mapping(weights: str = "interleaved", kv: str = "interleaved", *, attention=None,
            dense=None, experts=None) -> SliceMapping:
    """A concrete `SliceMapping` from placement names; `weights` places the three weight
    classes unless `attention`, `dense` or `experts` say otherwise.

    Example:
        >>> m = mapping("partitioned", "partitioned", dense="replicated")
        >>> m.attention.tolist(), m.dense.tolist()
        ([0.0, 1.0, 0.0], [0.0, 0.0, 1.0])
    """
    names = {"weights": weights, "kv": kv, "attention": attention, "dense": dense,
             "experts": experts}
    for key, value in names.items():
        if value is not None and value not in PLACEMENTS:
            raise ValueError(f"mapping {key}={value!r}; valid placements: {PLACEMENTS}")

    def hot(name):
        return [1.0 if p == name else 0.0 for p in PLACEMENTS]

    return SliceMapping(attention=hot(attention or weights), dense=hot(dense or weights),
                        experts=hot(experts or weights), kv=hot(kv))


class SpecDecode(eqx.Module):
    """Speculative decoding with draft tokens verified in one step (DeepSeek MTP, EAGLE).

    With i.i.d. acceptance probability a and k draft tokens, a step emits
    (1 - a^(k+1)) / (1 - a) tokens on average (Leviathan et al., ICML 2023, eq. 1).
    `draft_tokens = 0` disables it.
    """

    draft_tokens: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Draft length k (tokens)."""
    acceptance: jnp.ndarray = eqx.field(converter=as_number, default=0.7)
    """Per-token acceptance probability (dimensionless, [0, 1))."""
    draft_layers: jnp.ndarray = eqx.field(converter=as_number, default=1.0)
    """Transformer layers of the draft module run per draft token (DeepSeek MTP: 1)."""

    def __check_init__(self):
        check(self, {"draft_tokens": NON_NEGATIVE, "draft_layers": NON_NEGATIVE,
                     "acceptance": Range(low=0.0, high=1.0, high_open=True)})

    @property
    def tokens_per_step(self):
        a = jnp.clip(self.acceptance, 0.0, 0.999)
        return (1.0 - a ** (self.draft_tokens + 1.0)) / (1.0 - a)


class Runtime(eqx.Module):
    """The serving engine's settings and overheads (vLLM, SGLang, TensorRT-LLM).

    `step_overhead` is host-side time per engine step not hidden behind the GPU (scheduling,
    sampling, detokenization, Python); `framework` names whose fitted value it is.
    """

    step_overhead: jnp.ndarray = eqx.field(converter=as_number, default=1.0e-3)
    """Host time per engine step (s)."""
    max_batched_tokens: jnp.ndarray = eqx.field(converter=as_number, default=8192.0)
    """Prefill chunk: tokens one step may carry (vLLM max_num_batched_tokens) (tokens)."""
    memory_fraction: jnp.ndarray = eqx.field(converter=as_number, default=0.9)
    """Fraction of memory the engine may use: of the whole HBM (vLLM
    `gpu_memory_utilization`, SGLang `mem_fraction_static`) or, with `fraction_of_free`,
    of what the weights and the activation reserve leave (TensorRT-LLM
    `free_gpu_memory_fraction`) (dimensionless)."""
    fraction_of_free: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """What `memory_fraction` is a fraction of: 0 the whole HBM, where the KV cache gets
    `capacity x fraction - weights - reserve` (vLLM, SGLang); 1 the memory left after the
    weights and activations, where it gets `(capacity - weights - reserve) x fraction`
    (TensorRT-LLM: "90% of free GPU memory for KV cache", its KV cache configuration
    guide, nvidia.github.io/TensorRT-LLM/examples/kvcacheconfig.html). A number, not a
    static choice, so rows of different engines share one compiled fit; values between
    blend the two linearly (dimensionless)."""
    reserve_output: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """How much of each request's output the KV cache reserves at admission: 0 for engines
    that allocate KV blocks as tokens are made (vLLM, SGLang; a running request holds its
    current context), 1 for TensorRT-LLM's default GUARANTEED_NO_EVICT capacity policy
    (a request is admitted only when its whole prompt and output fit, so each holds prompt
    + output; `CapacitySchedulerPolicy`, TensorRT-LLM's scheduler configuration). Sizes the
    batch that fits (`kv_context`), not the attention (dimensionless)."""
    activation_reserve: jnp.ndarray = eqx.field(converter=as_number, default=4e9)
    """HBM reserved for activations, CUDA graphs and workspace (bytes)."""
    max_running: jnp.ndarray = eqx.field(converter=as_number, default=jnp.inf)
    """Cap on running sequences per instance (vLLM max_num_seqs); inf for none."""
    seq_overhead: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Host time per running sequence per engine step not hidden behind the GPU (sampling,
    detokenization, scheduler bookkeeping); vLLM-era Python engines show tens of us (s)."""
    stream_time: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Time per decoding sequence per engine step of the instance's streaming process, which
    runs beside the GPU: detokenizing and streaming every request's tokens (SGLang's one
    DetokenizerManager serves all DP ranks; Dynamo's frontend all workers). It bounds the
    step from below instead of adding to it: a step lasts at least stream_time x the
    instance's decoding sequences (`roofline.step_cost`) (s)."""
    request_overhead: jnp.ndarray = eqx.field(converter=as_number, default=0.015)
    """Per-request time outside the engine steps, seen by the client in TTFT and E2E: HTTP,
    tokenization, hand-off to the engine process, the first streamed chunk (s)."""
    prefill_request_time: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Host time per request whose prompt is in an engine step, not hidden behind the GPU:
    scheduling it and allocating its KV blocks, and on a disaggregated prefill instance
    setting up the hand-off of its KV cache to the decode instance (s). Paid in the step
    (`roofline.step_cost`, per prompt of `prefill_seqs`), so it lowers a prefill pool's
    capacity and adds to TTFT."""
    admission_steps: jnp.ndarray = eqx.field(converter=as_number, default=0.5)
    """Engine steps a new request waits before its prefill is scheduled (0.5: the step in
    flight; schedulers that favour running decodes wait longer); in a disaggregated
    deployment, the decode steps a request waits, once its KV cache has arrived, to join the
    decode batch, whose instance streams its first token (steps)."""
    dp_admission_steps: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Further engine steps a new request waits before its prefill in an aggregated
    deployment whose attention runs data-parallel (`Layout.dp_attention`), on top of
    `admission_steps`; not paid without DP attention, nor by a disaggregated deployment
    (whose decode-side wait is `admission_steps`).
    TensorRT-LLM's attention-DP balancing (`AttentionDpConfig`: `enable_balance`,
    `timeout_iters`, `batching_wait_iters`; NVIDIA/TensorRT-LLM
    tensorrt_llm/llmapi/llm_args.py, applied in `PyExecutor._balance_adp_requests`) holds
    new contexts until every DP rank has one, or `timeout_iters` steps pass, then waits up
    to `batching_wait_iters` steps to batch them, so that no rank runs a prefill alone.
    Fitted per framework (`calibration/fit.py`; TensorRT-LLM's InferenceMAX rows fit 16.8
    steps, calibration/README.md, "The TTFT tail") (steps)."""
    dp_sync_time: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """Host time per engine step per other attention-DP rank: under attention DP every rank
    exchanges its batch's shape with all the others before each step (SGLang's
    `prepare_mlp_sync_batch`, an all-gather over the CPU process group; TensorRT-LLM's
    `PyExecutor`, `tp_allgather` of each rank's request counts every iteration), a ring of
    dp - 1 hops, paid in every step (`roofline.step_cost`; fitted per framework,
    `calibration/README.md`) (s)."""
    poll_steps: jnp.ndarray = eqx.field(converter=as_number, default=1.0)
    """Decode steps between two looks of the scheduler for new requests, >= 1: SGLang's
    `--scheduler-recv-interval N` receives requests once every N decode steps
    (`SchedulerRecvSkipper`, sgl-project/sglang
    python/sglang/srt/managers/scheduler_recv_skipper.py: a counter gains 1 per decode
    step and receives at N); 1 (the engines' default) looks every step. SGLang's
    `--num-continuous-decode-steps` is not one: its loop left the scheduler in
    sgl-project/sglang PR 2095 (November 2024) and the argument does nothing since. A request
    arriving at a random phase waits (N - 1) / 2 steps on average, up to N - 1, on top of
    `admission_steps` (`serving`) (steps)."""
    expert_efficiency: jnp.ndarray = eqx.field(converter=as_number, default=1.0)
    """Speed of the engine's routed-expert kernels relative to the dense matmuls the chip's
    fitted efficiencies describe, in (0, 1]: the expert operator's time is divided by it.
    Grouped-GEMM MoE kernels that gather tokens per expert (vLLM's fused_moe) run below
    dense-GEMM bandwidth at small per-expert batches; 1 for engines the latency fit
    describes (dimensionless)."""
    kernel_efficiency: jnp.ndarray = eqx.field(converter=as_number, default=1.0)
    """Speed of the engine's kernels (matmuls, attention, collectives) relative to those
    of the engines the chip's fitted efficiencies describe, in (0, 1]: the step's busy
    time (operators and collectives, not host overhead) is divided by it. An engine whose
    kernels for a chip generation are less tuned runs below them; 1 for engines the
    latency fit describes (dimensionless)."""
    pipeline_overlap: jnp.ndarray = eqx.field(converter=as_number, default=1.0)
    """How far the engine overlaps micro-batches across pipeline stages, in [0, 1]: the
    running batch is split into `1 + overlap (pp - 1)` micro-batches in flight (1: every
    stage busy; 0: one batch crosses the stages while the others idle) (dimensionless)."""
    dispatch_per_rank: jnp.ndarray = eqx.field(converter=as_number, default=0.0)
    """How the engine's MoE dispatch under attention DP with expert parallelism sends a
    token (and its combine returns it). 0: one copy per routed expert, k copies of which
    (ep - 1) / ep leave the chip (DeepEP's low-latency kernels, which SGLang's wide-EP
    decode runs, write each token into each of its experts' receive slots). 1:
    TensorRT-LLM's rule: up to ep = k every rank's tokens are all-gathered on every rank
    and the outputs reduce-scattered (ep copies), and above it, on a multi-node NVLink
    domain, its all-to-all sends each token once to every rank holding any of its experts
    (`moe.ranks_per_token`: 7.3 for DeepSeek-R1 at EP 32, against k = 8 per expert
    and 32 gathered). TensorRT-LLM's fused MoE enables the all-to-all only when
    `moe_ep_size > experts_per_token`, attention DP is on and MNNVL is supported
    (`enable_alltoall`, NVIDIA/TensorRT-LLM tensorrt_llm/_torch/modules/fused_moe); the
    rule here does not check the fabric. Every fitted engine's runtime keeps 0, TensorRT-LLM's
    too: the refit with its rule predicts unseen rows worse (calibration/README.md, "The
    MoE dispatch under attention DP"). A number, not a static choice, so rows of different
    engines share one compiled fit; values between blend the two (dimensionless)."""
    framework: str = eqx.field(static=True, default="generic")

    def __check_init__(self):
        check(self, {"step_overhead": NON_NEGATIVE, "seq_overhead": NON_NEGATIVE,
                     "stream_time": NON_NEGATIVE,
                     "request_overhead": NON_NEGATIVE, "admission_steps": NON_NEGATIVE,
                     "dp_admission_steps": NON_NEGATIVE,
                     "dp_sync_time": NON_NEGATIVE,
                     "prefill_request_time": NON_NEGATIVE,
                     "poll_steps": Range(low=1.0),
                     "activation_reserve": NON_NEGATIVE,
                     "max_batched_tokens": Range(low=1.0),
                     "max_running": Range(low=1.0, infinite=True),
                     "memory_fraction": FRACTION, "expert_efficiency": FRACTION,
                     "fraction_of_free": UNIT_INTERVAL, "reserve_output": UNIT_INTERVAL,
                     "dispatch_per_rank": UNIT_INTERVAL,
                     "kernel_efficiency": FRACTION, "pipeline_overlap": UNIT_INTERVAL})

    def kv_context(self, workload) -> jnp.ndarray:
        """Tokens of KV cache each running sequence holds, which sizes the batch that fits:
        the workload's mean decode context (prompt plus half the output, length-biased),
        and with `reserve_output` the rest of the output reserved too (prompt plus the
        whole length-biased output) (tokens).

        Example:
            >>> from perfmodel.workload import Workload
            >>> w = Workload(1000, 1000, 1.0, 1.0)
            >>> float(Runtime().kv_context(w)), float(Runtime(reserve_output=1.0).kv_context(w))
            (1500.0, 2000.0)
        """
        context = workload.decode_context
        return context + self.reserve_output * (context - workload.mean_input_len)


class Design(eqx.Module):
    """A full serving design.

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> chip, model = get_chip("h200"), get_model("llama-3.1-8b")
        >>> d = Design(concurrency=16, layout=Layout(tp=1), precision=precision(chip, model))
        >>> d.chips
        1
    """

    concurrency: jnp.ndarray = eqx.field(converter=as_number)
    """Requests in flight across the deployment (closed-loop clients)."""
    layout: Layout | LayoutNumbers | Disaggregated
    """Parallel layout: static (`Layout`), as numbers (`LayoutNumbers`), or a prefill/decode
    split (`Disaggregated`, of either kind)."""
    precision: Precision
    # Factories, not instances: defaults built at import time would freeze the dtype in
    # force then (float32 before a caller enables x64).
    mapping: SliceMapping = eqx.field(default_factory=SliceMapping)
    speculative: SpecDecode = eqx.field(default_factory=SpecDecode)
    runtime: Runtime = eqx.field(default_factory=Runtime)

    def __check_init__(self):
        check(self, {"concurrency": POSITIVE})
        instance(self, "layout", Layout, LayoutNumbers, Disaggregated)
        instance(self, "precision", Precision)
        instance(self, "mapping", SliceMapping)
        instance(self, "speculative", SpecDecode)
        instance(self, "runtime", Runtime)

    @property
    def chips(self):
        """Chips of the deployment (an int, or an array for `LayoutNumbers`)."""
        return self.layout.chips

    @property
    def disaggregated(self) -> bool:
        return isinstance(self.layout, Disaggregated)

    def to_json(self) -> dict:
        """Every field as JSON-ready data (`perfmodel.serialize.to_json`); `from_json`
        rebuilds this design exactly."""
        from .serialize import to_json

        return to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> Design:
        """The design `to_json` wrote: a dict, or `perfmodel optimize --format json`
        output (its `spec.design`).

        Raises:
            ValueError: not a design, or a field its constructor refuses.

        Example:
            >>> from perfmodel.presets import get_chip, get_model
            >>> chip, model = get_chip("h200"), get_model("llama-3.1-8b")
            >>> d = Design(concurrency=16, layout=Layout(tp=2), precision=precision(chip, model))
            >>> Design.from_json(d.to_json()).layout.describe()
            'tp2'
        """
        from .serialize import from_json

        if isinstance(data, dict) and "spec" in data and "type" not in data:
            data = data["spec"]["design"]
        design = from_json(data)
        if not isinstance(design, cls):
            raise ValueError(f"Design.from_json: the data holds a {type(design).__name__}, "
                             "not a Design")
        return design
