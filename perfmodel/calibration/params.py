"""What the latency calibration fits, and its file format.

`Params` holds, in unconstrained space (logits for fractions, logs for positive quantities,
so every value stays physical):

- per chip family (`FAMILY_FIELDS`): the `hardware.Efficiency` fields (compute fraction vs
  matmul rows, bandwidth fraction, memory latency, per-kernel overhead, attention fraction)
  and the scale-up collective terms (bandwidth efficiency, latency per algorithm step, fixed
  cost);
- per serving framework (`FRAMEWORK_FIELDS`): host time per engine step, per-request time
  outside the engine (HTTP, tokenization), the engine steps a new request waits before its
  prefill is scheduled, host time per prompt in a step, the streaming process's time per
  sequence and step (`design.Runtime`), and the MTP acceptance of its speculative rows.

`to_json` and `from_json` are the only writer and reader of the layout of
`perfmodel/data/fitted_params.json` on the calibration side (`perfmodel.fitted` reads the
file and applies it to chips).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..datasets import MTP_ACCEPTANCE
from ..fitted import lent_terms, with_framework_terms, with_prefill_attention
from ..hardware import Chip

#: (name, space, prior value, prior width in the unconstrained space) per chip family.
#: Priors: aiconfigurator's 0.8 x HBM and 3 us memory latency (see `hardware.Efficiency`),
#: NCCL's few-us launch cost. Decode attention (`attention_max`, which the InferenceMAX rows
#: hardly constrain) 0.3 of the BF16 peak, from MLA decode-kernel microbenchmarks at
#: compute-bound shapes: TensorRT-LLM's trtllm-gen kernel on B200 (SM100), batch 256, 16
#: heads, 4 query tokens, 80k cached tokens, FP8 cache: 4,855 us (vllm-project/vllm PR
#: 41778), 2.85e12 FLOP at 2 (576 + 512) FLOP per head, query and cached token, so 0.59
#: PFLOP/s, 0.26 of B200's dense BF16 2.25 PFLOP/s; FlashMLA on Hopper, batch 128, 1,151
#: cached tokens: 386 TFLOP/s (tile-ai/tilelang issue 1859), 0.39 of 989. Prompt attention
#: of MLA and of windowed models (`prefill_attention_max`, `window_prefill_attention_max`) 0.5,
#: FlashAttention's lower end (`Efficiency.full_attention_max`).
FAMILY_FIELDS = (
    ("compute_max", "logit", 0.75, 1.0),
    ("compute_rows_half", "log", 64.0, 1.5),
    ("bandwidth_max", "logit", 0.8, 1.0),
    ("memory_latency", "log", 3e-6, 1.0),
    ("kernel_overhead", "log", 2e-6, 1.0),
    ("attention_max", "logit", 0.3, 1.0),
    ("prefill_attention_max", "logit", 0.5, 1.0),
    ("window_prefill_attention_max", "logit", 0.5, 1.0),
    ("format_ceiling", "log", 4.0, 1.0),
    ("collective_efficiency", "logit", 0.8, 1.0),
    ("collective_latency", "log", 1e-6, 1.5),
    ("collective_base_latency", "log", 6e-6, 1.0),
)
#: Per serving framework (fields of `design.Runtime`, and the MTP acceptance of its rows'
#: `design.SpecDecode`): a 1 ms host step (vLLM V1 scheduler profiles), 15 ms per request
#: outside the engine, half a step of admission wait; per-token MTP acceptance 0.7 (the
#: DeepSeek-V3 report, arXiv:2412.19437 section 5.4.3: 85-90 % for the second token on real
#: text; InferenceMAX prompts are random tokens, and engines accept drafts their own way,
#: TensorRT-LLM's relaxed acceptance among them), identified by the frameworks with MTP rows.
#: The admission prior is wide: SGLang and TRT-LLM hold new prompts while decodes run.
FRAMEWORK_FIELDS = (
    ("step_overhead", "log", 1e-3, 1.5),
    ("request_overhead", "log", 0.015, 1.5),
    ("admission_steps", "log", 0.5, 2.0),
    ("mtp_acceptance", "logit", MTP_ACCEPTANCE, 1.0),
    # Host time per prompt in a step: a wide prior around 1 ms, assumed (the scheduling and
    # KV-block allocation of one request; no measurement of it alone); the disaggregated
    # prefill pools' saturated rows fit it.
    ("prefill_request_time", "log", 1e-3, 2.0),
    # Time per decoding sequence per step of the instance's streaming process
    # (`design.Runtime.stream_time`; it bounds the step, beside the GPU): a wide prior around
    # 5 us, assumed (one Python process detokenizing and streaming each token); the decode
    # instances running 1,000+ sequences identify it.
    ("stream_time", "log", 5e-6, 2.0),
    # The further admission wait under attention DP (`design.Runtime.dp_admission_steps`):
    # a wide prior around 1 step, assumed (TensorRT-LLM's balancing defaults are not read
    # from the InferenceMAX configurations); frameworks with aggregated DP-attention rows
    # identify it, the others keep the prior.
    ("dp_admission_steps", "log", 1.0, 2.0),
    # The per-step exchange of batch shapes between attention-DP ranks
    # (`design.Runtime.dp_sync_time`, per other rank): a wide prior around 20 us a hop,
    # assumed (a small all-gather over a CPU process group); frameworks with DP-attention
    # rows at several DP sizes identify it, the others keep the prior.
    ("dp_sync_time", "log", 2e-5, 2.0),
)
#: The framework fields that are not `design.Runtime` fields (`runtime_values`).
SPECULATION_FIELDS = ("mtp_acceptance",)
FAMILY_NAMES = tuple(f[0] for f in FAMILY_FIELDS)
FRAMEWORK_NAMES = tuple(f[0] for f in FRAMEWORK_FIELDS)
_COLLECTIVE = {"collective_efficiency": "efficiency", "collective_latency": "latency",
               "collective_base_latency": "base_latency"}
#: The family fields that are `hardware.Efficiency` fields (the rest are the collectives').
_EFFICIENCY = tuple(n for n in FAMILY_NAMES if n not in _COLLECTIVE)

#: Runtime settings that are documented, not fitted. SGLang's `mem_fraction_static` (0.8-0.9)
#: covers weights and the KV pool only; activations and CUDA graphs live in the rest, so no
#: activation reserve comes out of the fraction (vLLM's gpu_memory_utilization includes its
#: profiled activation peak, hence the 4 GB default reserve there). TensorRT-LLM's
#: `free_gpu_memory_fraction` (0.9) is a fraction of the memory the weights and activations
#: leave, not of the whole (`design.Runtime.fraction_of_free`), and its default capacity
#: policy (GUARANTEED_NO_EVICT) reserves each request's whole output (`reserve_output`).
#: Its MoE dispatch rule (`dispatch_per_rank` 1) is not set: the refit with it predicts
#: unseen rows worse (calibration/README.md, "The MoE dispatch under attention DP").
_TRT = {"fraction_of_free": 1.0, "reserve_output": 1.0}
FRAMEWORK_SETTINGS = {"sglang": {"activation_reserve": 0.0},
                      "dynamo-sglang": {"activation_reserve": 0.0},
                      "sglang-disagg": {"activation_reserve": 0.0},
                      "trt": _TRT, "dynamo-trt": _TRT, "trtllm-bench": _TRT}

#: Families without data use another's fitted parameters (documented in calibration/).
FAMILY_FALLBACK = {"rubin": "blackwell", "jalapeno": "blackwell", "tpu": "blackwell",
                   "groq": "blackwell", "cdna3": "cdna4", "cdna4": "cdna3",
                   "hopper": "blackwell", "blackwell": "hopper"}
#: Frameworks without data: the engine they are built on.
FRAMEWORK_FALLBACK = {"dynamo-trt": "trt", "trtllm-bench": "trt", "dynamo-sglang": "sglang",
                      "sglang-disagg": "sglang", "dynamo-vllm": "vllm", "atom": "vllm",
                      "trt": "vllm", "sglang": "vllm", "vllm": "sglang"}

#: Name of the pooled (across-family) row of a partially pooled fit (`latency.Prior`).
POOLED = "pooled"


def _to_raw(space: str, value: float) -> float:
    # A zero of a log field (a term a file was fitted without) as a negligible positive one.
    return math.log(value / (1.0 - value)) if space == "logit" else \
        math.log(max(value, 1e-30))


def _from_raw(space: str, raw):
    return jax.nn.sigmoid(raw) if space == "logit" else jnp.exp(raw)


def prior_row(fields) -> np.ndarray:
    """Unconstrained prior values of `FAMILY_FIELDS` or `FRAMEWORK_FIELDS`, shape (fields,).

    Example:
        >>> round(float(np.exp(prior_row(FRAMEWORK_FIELDS)[0])), 6)
        0.001
    """
    return np.array([_to_raw(space, value) for _, space, value, _ in fields])


def prior_widths(families: Sequence[str], frameworks: Sequence[str]) -> np.ndarray:
    """Prior widths of every unconstrained value, in `Params.flat` order (families first),
    shape (size,).

    Example:
        >>> w = prior_widths(("hopper",), ("vllm",))
        >>> w.shape == (len(FAMILY_FIELDS) + len(FRAMEWORK_FIELDS),), float(w[0])
        (True, 1.0)
    """
    return np.concatenate([np.tile([f[3] for f in FAMILY_FIELDS], len(families)),
                           np.tile([f[3] for f in FRAMEWORK_FIELDS], len(frameworks))])


class Params(eqx.Module):
    """Fitted parameters in unconstrained space (logit for fractions, log for positives).

    Example:
        >>> p = Params.prior(("blackwell",), ("vllm",))
        >>> round(float(p.values()["families"]["blackwell"]["compute_max"]), 3)
        0.75
        >>> round(p.values()["frameworks"]["vllm"]["request_overhead"], 3)
        0.015
    """

    family_raw: jnp.ndarray
    """(families, len(FAMILY_FIELDS)) unconstrained values (logit or log of the SI value)."""
    framework_raw: jnp.ndarray
    """(frameworks, len(FRAMEWORK_FIELDS)) unconstrained values."""
    families: tuple[str, ...] = eqx.field(static=True)
    frameworks: tuple[str, ...] = eqx.field(static=True)

    def __check_init__(self):
        if self.family_raw.shape != (len(self.families), len(FAMILY_FIELDS)):
            raise ValueError(f"Params.family_raw has shape {self.family_raw.shape}; expected "
                             f"({len(self.families)}, {len(FAMILY_FIELDS)})")
        if self.framework_raw.shape != (len(self.frameworks), len(FRAMEWORK_FIELDS)):
            raise ValueError(f"Params.framework_raw has shape {self.framework_raw.shape}; "
                             f"expected ({len(self.frameworks)}, {len(FRAMEWORK_FIELDS)})")

    @staticmethod
    def prior(families: Sequence[str], frameworks: Sequence[str]) -> Params:
        """Parameters at their priors."""
        fam = np.tile(prior_row(FAMILY_FIELDS), (len(families), 1))
        fw = np.tile(prior_row(FRAMEWORK_FIELDS), (len(frameworks), 1))
        return Params(family_raw=jnp.asarray(fam.reshape(len(families), len(FAMILY_FIELDS))),
                      framework_raw=jnp.asarray(fw.reshape(len(frameworks),
                                                           len(FRAMEWORK_FIELDS))),
                      families=tuple(families), frameworks=tuple(frameworks))

    @property
    def flat(self) -> jnp.ndarray:
        """Every unconstrained value, families first, shape (size,)."""
        return jnp.concatenate([self.family_raw.ravel(), self.framework_raw.ravel()])

    def with_flat(self, theta) -> Params:
        """The same families and frameworks with the values of a flat vector (`flat`)."""
        n = self.family_raw.size
        theta = jnp.asarray(theta, dtype=float)
        return eqx.tree_at(lambda p: (p.family_raw, p.framework_raw), self,
                           (theta[:n].reshape(self.family_raw.shape),
                            theta[n:].reshape(self.framework_raw.shape)))

    def values(self) -> dict:
        """Physical values (SI units): {"families": {family: {field: value}},
        "frameworks": {...}}."""
        fams = {fam: {name: float(_from_raw(space, self.family_raw[i, j]))
                      for j, (name, space, _, _) in enumerate(FAMILY_FIELDS)}
                for i, fam in enumerate(self.families)}
        fws = {fw: {name: float(_from_raw(space, self.framework_raw[i, j]))
                    for j, (name, space, _, _) in enumerate(FRAMEWORK_FIELDS)}
               for i, fw in enumerate(self.frameworks)}
        return {"families": fams, "frameworks": fws}

    @staticmethod
    def from_values(values: dict) -> Params:
        """Inverse of `values` (missing fields take their priors)."""
        families = tuple(values.get("families", {}))
        frameworks = tuple(values.get("frameworks", {}))

        def raw(given, fields):
            return [_to_raw(space, float(given.get(name, prior)))
                    for name, space, prior, _ in fields]

        fam = [raw(values["families"][f], FAMILY_FIELDS) for f in families]
        fw = [raw(values["frameworks"][f], FRAMEWORK_FIELDS) for f in frameworks]
        return Params(family_raw=jnp.asarray(np.reshape(np.array(fam, dtype=float),
                                                        (len(families), len(FAMILY_FIELDS)))),
                      framework_raw=jnp.asarray(np.reshape(np.array(fw, dtype=float),
                                                           (len(frameworks),
                                                            len(FRAMEWORK_FIELDS)))),
                      families=families, frameworks=frameworks)

    def subset(self, families: Sequence[str], frameworks: Sequence[str]) -> Params:
        """Only the given families and frameworks (those the data covered)."""
        v = self.values()
        return Params.from_values({
            "families": {f: v["families"][f] for f in self.families if f in families},
            "frameworks": {f: v["frameworks"][f] for f in self.frameworks if f in frameworks}})


def family_values(raw) -> dict:
    """Physical values (SI) of one family's unconstrained row (..., len(FAMILY_FIELDS));
    traceable."""
    return {name: _from_raw(space, raw[..., j]) for j, (name, space, _, _) in
            enumerate(FAMILY_FIELDS)}


def framework_values(raw) -> dict:
    """Physical values (SI) of unconstrained framework rows (..., len(FRAMEWORK_FIELDS));
    traceable."""
    return {name: _from_raw(space, raw[..., j]) for j, (name, space, _, _) in
            enumerate(FRAMEWORK_FIELDS)}


def runtime_values(values: dict) -> dict:
    """The `design.Runtime` fields of `framework_values` (without `SPECULATION_FIELDS`)."""
    return {k: v for k, v in values.items() if k not in SPECULATION_FIELDS}


def with_family(chip: Chip, raw) -> Chip:
    """`chip` with one family's parameters (an unconstrained row of `Params.family_raw`).

    Example:
        >>> from perfmodel.presets import get_chip
        >>> chip = with_family(get_chip("h100", calibrated=False),
        ...                    Params.prior(("hopper",), ()).family_raw[0])
        >>> round(float(chip.efficiency.bandwidth_max), 3)
        0.8
    """
    values = family_values(raw)
    eff = eqx.tree_at(lambda e: tuple(getattr(e, n) for n in _EFFICIENCY), chip.efficiency,
                      tuple(values[n] for n in _EFFICIENCY))
    chip = eqx.tree_at(lambda c: c.efficiency, chip, eff)
    return eqx.tree_at(lambda c: tuple(getattr(c.scale_up, v) for v in _COLLECTIVE.values()),
                       chip, tuple(values[k] for k in _COLLECTIVE))


def resolve_family(family: str, params: Params, fallback: dict | None = None
                   ) -> tuple[str, str]:
    """(fitted family to use or "", a basis label) along the fallback map.

    Example:
        >>> resolve_family("rubin", Params.prior(("blackwell",), ()))
        ('blackwell', 'specs+fitted:blackwell (family rubin unfitted)')
    """
    fallback = FAMILY_FALLBACK if fallback is None else fallback
    name, seen = family, set()
    while name not in params.families and name not in seen and name:
        seen.add(name)
        name = fallback.get(name, "")
    if name in params.families:
        if name != family:
            return name, f"specs+fitted:{name} (family {family} unfitted)"
        return name, f"fitted:{name}"
    return "", f"specs+priors (family {family} unfitted)"


def resolve_framework(name: str, frameworks: Sequence[str]) -> str:
    """The fitted framework a framework uses: itself, else along `FRAMEWORK_FALLBACK`, else
    "" (priors).

    Example:
        >>> resolve_framework("dynamo-trt", ("trt", "vllm")), resolve_framework("x", ("trt",))
        ('trt', '')
    """
    seen = set()
    while name and name not in frameworks and name not in seen:
        seen.add(name)
        name = FRAMEWORK_FALLBACK.get(name, "")
    return name if name in frameworks else ""


def framework_lookup(frameworks: Sequence[str], params: Params) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """Where rows of `frameworks` take their framework values from: per row, the index in
    `params.frameworks` of the fitted framework it uses (itself or its fallback,
    `resolve_framework`; `len(params.frameworks)` for the priors), and a (rows,
    len(FRAMEWORK_FIELDS)) mask of the values that keep their priors instead: the
    `fitted.MODE_TERMS` a fallback to another serving mode does not lend
    (`fitted.lent_terms`).

    Example:
        >>> p = Params.prior((), ("sglang",))
        >>> index, prior = framework_lookup(("sglang", "sglang-disagg", "x"), p)
        >>> index.tolist(), prior.sum(axis=1).tolist()
        ([0, 0, 1], [0, 1, 0])
    """
    names = [f[0] for f in FRAMEWORK_FIELDS]
    index = np.empty(len(frameworks), dtype=int)
    prior = np.zeros((len(frameworks), len(names)), dtype=bool)
    for i, framework in enumerate(frameworks):
        basis = resolve_framework(framework, params.frameworks)
        index[i] = params.frameworks.index(basis) if basis else len(params.frameworks)
        if basis:
            kept = lent_terms(framework, basis, dict.fromkeys(names))
            prior[i] = [n not in kept for n in names]
    return index, prior


def to_json(params: Params, meta: dict | None = None, families_with_data=None,
            frameworks_with_data=None) -> dict:
    """The `perfmodel/data/fitted_params.json` layout that `perfmodel.fitted` reads.

    Args:
        params: fitted parameters.
        meta: fit metadata written before the parameters (date, data files, result, ...).
        families_with_data, frameworks_with_data: what to write (default: all of `params`);
            the fallback maps then cover the rest.

    Example:
        >>> data = to_json(Params.prior(("hopper",), ("vllm",)))
        >>> data["family_fallback"]["blackwell"], data["framework_fallback"]["dynamo-vllm"]
        ('hopper', 'vllm')
    """
    values = params.values()
    keep = families_with_data if families_with_data is not None else params.families
    keep_fw = frameworks_with_data if frameworks_with_data is not None else params.frameworks
    families = {}
    for fam, v in values["families"].items():
        if fam not in keep:
            continue
        families[fam] = {"efficiency": {n: v[n] for n in _EFFICIENCY},
                         "scale_up": {_COLLECTIVE[k]: v[k] for k in _COLLECTIVE}}
    frameworks = {fw: {**v, **FRAMEWORK_SETTINGS.get(fw, {})}
                  for fw, v in values["frameworks"].items() if fw in keep_fw}
    fallback = {fam: t for fam, t in FAMILY_FALLBACK.items()
                if fam not in families and t in families}
    fw_fallback = {fw: t for fw, t in FRAMEWORK_FALLBACK.items()
                   if fw not in frameworks and t in frameworks}
    return {"version": 2, **(meta or {}), "families": families, "family_fallback": fallback,
            "frameworks": frameworks, "framework_fallback": fw_fallback}


def from_json(data: dict) -> Params:
    """`Params` from the JSON layout of `to_json` (families as fitted, no fallbacks).

    Example:
        >>> p = from_json(to_json(Params.prior(("hopper",), ("vllm",))))
        >>> p.families, p.frameworks
        (('hopper',), ('vllm',))
    """
    fams = {}
    for fam, groups in data.get("families", {}).items():
        if "efficiency" not in groups:
            continue
        v = with_prefill_attention(groups["efficiency"])
        for key, field in _COLLECTIVE.items():
            if field in groups.get("scale_up", {}):
                v[key] = groups["scale_up"][field]
        fams[fam] = v
    fws = {fw: with_framework_terms({k: v for k, v in given.items() if k in FRAMEWORK_NAMES})
           for fw, given in data.get("frameworks", {}).items()}
    return Params.from_values({"families": fams, "frameworks": fws})

