"""Calibration: fit a few physical parameters to published measurements.

What is fitted (`Params`, all in unconstrained space: logits for fractions, logs for
positive quantities, so every value stays physical):

- per chip family (`FAMILY_FIELDS`): the `Efficiency` fields (compute fraction vs matmul
  rows, bandwidth fraction, memory latency, per-kernel overhead, attention fraction) and the
  scale-up collective terms (bandwidth efficiency, latency per algorithm step, fixed cost);
- per serving framework (`FRAMEWORK_FIELDS`): host time per engine step, per-request time
  outside the engine (HTTP, tokenization) and the engine steps a new request waits before
  its prefill is scheduled (`design.Runtime`).

To what: op-level timings (GEMM latencies vs shape, NCCL collectives vs size) pin the
kernel physics; end-to-end InferenceMAX sweeps (throughput per GPU, median TPOT and TTFT)
pin the rest. Residuals are logs of predicted over measured, under a Huber loss (robust to
the odd broken run), plus Gaussian priors in the unconstrained space that keep parameters
with little data near their physical priors.

Speed: parallel layouts are static in the model, so rows are grouped by static structure
(model, chip, precision, layout or disaggregated layouts); each group gets ONE jitted,
row-vmapped function of (family parameters, framework parameters, row numbers). Its
Jacobian is taken by forward differences batched as extra rows (1 + 9 + 3 evaluations per
row in one call: the compiled graph is the forward one, about a third of the compile time
of `jax.jvp`). Which rows are fitted is a weight mask, so held-out and leave-one-chip-out
refits reuse the same compiled functions (guarded with `eqx.debug.assert_max_traces`).

Solver: Levenberg-Marquardt with iteratively reweighted least squares for the Huber loss
(Marquardt 1963; the Huber IRLS weights as in Holland & Welsch 1977).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .datasets import GEMM_DTYPES, MTP_ACCEPTANCE, MTP_DRAFT_TOKENS, BenchRow
from .design import Design, Disaggregated, Layout, Precision, Runtime, SpecDecode, precision
from .formats import COMPUTE_CLASSES
from .hardware import Chip
from .interconnect import collective_time
from .presets import chip_key, find_model, get_chip
from .roofline import Operator, operator_time
from .serving import Metrics, predict
from .workload import Workload

#: (name, space, prior value, prior width in the unconstrained space) per chip family.
#: Priors: aiconfigurator's 0.8 x HBM and 3 us memory latency (see `hardware.Efficiency`),
#: NCCL's few-us launch cost.
FAMILY_FIELDS = (
    ("compute_max", "logit", 0.75, 1.0),
    ("compute_rows_half", "log", 64.0, 1.5),
    ("bandwidth_max", "logit", 0.8, 1.0),
    ("memory_latency", "log", 3e-6, 1.0),
    ("kernel_overhead", "log", 2e-6, 1.0),
    ("attention_max", "logit", 0.5, 1.0),
    ("collective_efficiency", "logit", 0.8, 1.0),
    ("collective_latency", "log", 1e-6, 1.5),
    ("collective_base_latency", "log", 6e-6, 1.0),
)
#: Per serving framework (fields of `design.Runtime`): a 1 ms host step (vLLM V1 scheduler
#: profiles), 15 ms per request outside the engine, half a step of admission wait. The
#: admission prior is wide: SGLang and TRT-LLM hold new prompts while decodes run.
FRAMEWORK_FIELDS = (
    ("step_overhead", "log", 1e-3, 1.5),
    ("request_overhead", "log", 0.015, 1.5),
    ("admission_steps", "log", 0.5, 2.0),
)
FAMILY_NAMES = tuple(f[0] for f in FAMILY_FIELDS)
FRAMEWORK_NAMES = tuple(f[0] for f in FRAMEWORK_FIELDS)
_EFFICIENCY = FAMILY_NAMES[:6]
_COLLECTIVE = {"collective_efficiency": "efficiency", "collective_latency": "latency",
               "collective_base_latency": "base_latency"}

#: Runtime settings that are documented, not fitted. SGLang's `mem_fraction_static` (0.8-0.9)
#: covers weights and the KV pool only; activations and CUDA graphs live in the rest, so no
#: activation reserve comes out of the fraction (vLLM's gpu_memory_utilization includes its
#: profiled activation peak, hence the 4 GB default reserve there).
FRAMEWORK_SETTINGS = {"sglang": {"activation_reserve": 0.0},
                      "dynamo-sglang": {"activation_reserve": 0.0},
                      "sglang-disagg": {"activation_reserve": 0.0}}

#: Families without data use another's fitted parameters (documented in calibration/).
FAMILY_FALLBACK = {"rubin": "blackwell", "jalapeno": "blackwell", "tpu": "blackwell",
                   "groq": "blackwell", "cdna3": "cdna4", "cdna4": "cdna3",
                   "hopper": "blackwell", "blackwell": "hopper"}
#: Frameworks without data: the engine they are built on.
FRAMEWORK_FALLBACK = {"dynamo-trt": "trt", "dynamo-sglang": "sglang", "sglang-disagg": "sglang",
                      "dynamo-vllm": "vllm", "atom": "vllm", "trt": "vllm",
                      "sglang": "vllm", "vllm": "sglang"}

#: Residual weights of the three end-to-end metrics (TTFT is the noisiest).
METRIC_WEIGHTS = {"tput_per_gpu": 1.0, "median_tpot_s": 1.0, "median_ttft_s": 0.5}
E2E_KEYS = ("tput_per_gpu", "median_tpot_s", "median_ttft_s")
#: Weight of one op-level timing relative to one end-to-end metric.
OP_WEIGHT = 0.3
#: Batch every eager end-to-end evaluation (`predict_rows`) is padded to (fixed shapes:
#: eager ops compile once).
BATCH = 64
#: Forward-difference step in the unconstrained space (float64: ~1e-6 relative accuracy).
FD_STEP = 1e-6

SUCCESSFUL, MAX_STEPS, NONFINITE = "successful", "max_steps_reached", "nonfinite"


def _to_raw(space: str, value: float) -> float:
    return math.log(value / (1.0 - value)) if space == "logit" else math.log(value)


def _from_raw(space: str, raw):
    return jax.nn.sigmoid(raw) if space == "logit" else jnp.exp(raw)


def _prior_row(fields) -> np.ndarray:
    return np.array([_to_raw(space, value) for _, space, value, _ in fields])


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
    """(families, len(FAMILY_FIELDS)) unconstrained values."""
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
        fam = np.tile(_prior_row(FAMILY_FIELDS), (len(families), 1))
        fw = np.tile(_prior_row(FRAMEWORK_FIELDS), (len(frameworks), 1))
        return Params(family_raw=jnp.asarray(fam.reshape(len(families), len(FAMILY_FIELDS))),
                      framework_raw=jnp.asarray(fw.reshape(len(frameworks),
                                                           len(FRAMEWORK_FIELDS))),
                      families=tuple(families), frameworks=tuple(frameworks))

    @property
    def flat(self) -> jnp.ndarray:
        return jnp.concatenate([self.family_raw.ravel(), self.framework_raw.ravel()])

    def with_flat(self, theta) -> Params:
        n = self.family_raw.size
        theta = jnp.asarray(theta, dtype=float)
        return eqx.tree_at(lambda p: (p.family_raw, p.framework_raw), self,
                           (theta[:n].reshape(self.family_raw.shape),
                            theta[n:].reshape(self.framework_raw.shape)))

    def values(self) -> dict:
        """Physical values: {"families": {family: {field: value}}, "frameworks": {...}}."""
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
    """Physical values of one family's unconstrained row (traceable)."""
    return {name: _from_raw(space, raw[..., j]) for j, (name, space, _, _) in
            enumerate(FAMILY_FIELDS)}


def with_family(chip: Chip, raw) -> Chip:
    """`chip` with one family's parameters (an unconstrained row of `Params.family_raw`)."""
    values = family_values(raw)
    eff = eqx.tree_at(lambda e: tuple(getattr(e, n) for n in _EFFICIENCY), chip.efficiency,
                      tuple(values[n] for n in _EFFICIENCY))
    chip = eqx.tree_at(lambda c: c.efficiency, chip, eff)
    return eqx.tree_at(lambda c: tuple(getattr(c.scale_up, v) for v in _COLLECTIVE.values()),
                       chip, tuple(values[k] for k in _COLLECTIVE))


def to_json(params: Params, meta: dict | None = None, families_with_data=None,
            frameworks_with_data=None) -> dict:
    """The `perfmodel/data/fitted_params.json` layout that `perfmodel.params` reads."""
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
    """`Params` from the JSON layout of `to_json` (families as fitted, no fallbacks)."""
    fams = {}
    for fam, groups in data.get("families", {}).items():
        if "efficiency" not in groups:
            continue
        v = dict(groups["efficiency"])
        for key, field in _COLLECTIVE.items():
            if field in groups.get("scale_up", {}):
                v[key] = groups["scale_up"][field]
        fams[fam] = v
    fws = {fw: {k: v for k, v in given.items() if k in FRAMEWORK_NAMES}
           for fw, given in data.get("frameworks", {}).items()}
    return Params.from_values({"families": fams, "frameworks": fws})


# ---------------------------------------------------------------------------------------
# End-to-end benchmark rows.


@dataclasses.dataclass
class Group:
    """Rows sharing one static structure (model, chip, precision, layout)."""

    model: object
    chip: Chip
    family: str
    design: Design
    rows: list
    error: str = ""


def _layout(pool) -> Layout:
    return Layout(tp=pool.tp, ep=pool.ep, dp_attention=pool.dp_attention,
                  replicas=pool.replicas)


def model_of(name: str):
    """A model preset by name, else a shipped Hugging Face config (`presets.find_model`).

    Raises:
        ValueError: neither exists ("unknown model ...").
    """
    return find_model(name)


def build_groups(rows: Sequence[BenchRow]) -> tuple[list[Group], dict[int, str]]:
    """Group rows by static structure and build their specs (uncalibrated chip).

    Returns:
        (groups, errors): rows that cannot be modelled are left out, with a message by row
        index (unknown model or chip, a layout the model rejects).
    """
    structures: dict[tuple, list[BenchRow]] = {}
    for row in rows:
        structures.setdefault(row.structure, []).append(row)
    groups, errors = [], {}
    for members in structures.values():
        row = members[0]
        try:
            model = model_of(row.model)
            chip = get_chip(row.hardware, calibrated=False)
            prec = precision(chip, model, row.precision)
            if row.disaggregated:
                layout = Disaggregated(prefill=_layout(row.prefill), decode=_layout(row.decode))
                pools = (layout.prefill, layout.decode)
            else:
                layout = _layout(row.layout)
                pools = (layout,)
            if model.is_moe:
                # Wide EP over a group that does not divide the experts (SGLang's 48-GPU
                # decode with EPLB's redundant experts): experts spread over the largest
                # divisor, tensor-parallel over the rest of the group.
                fixed = [Layout(tp=pool.tp, ep=math.gcd(pool.ep, model.num_experts),
                                pp=pool.pp, dp_attention=pool.dp_attention,
                                replicas=pool.replicas) for pool in pools]
                if isinstance(layout, Disaggregated):
                    layout = Disaggregated(prefill=fixed[0], decode=fixed[1])
                else:
                    layout = fixed[0]
            design = Design(concurrency=1.0, layout=layout, precision=prec)
        except ValueError as error:
            for member in members:
                errors[member.index] = str(error)
            continue
        groups.append(Group(model=model, chip=chip, family=chip.family, design=design,
                            rows=members))
    return groups, errors


def _framework_of(name: str, frameworks: Sequence[str]) -> str:
    seen = set()
    while name and name not in frameworks and name not in seen:
        seen.add(name)
        name = FRAMEWORK_FALLBACK.get(name, "")
    return name if name in frameworks else ""



def _framework_rows(rows: Sequence[BenchRow], params: Params) -> np.ndarray:
    """(rows, len(FRAMEWORK_FIELDS)) unconstrained framework values of each row: its own,
    its fallback's (`FRAMEWORK_FALLBACK`), else the priors."""
    table = np.asarray(params.framework_raw)
    prior = _prior_row(FRAMEWORK_FIELDS)
    out = np.empty((len(rows), len(FRAMEWORK_FIELDS)))
    for i, row in enumerate(rows):
        name = _framework_of(row.framework, params.frameworks)
        out[i] = table[params.frameworks.index(name)] if name else prior
    return out


def _row_inputs(rows: Sequence[BenchRow]) -> dict:
    """Numeric per-row inputs of the model (float64 arrays)."""
    reserve = Runtime().activation_reserve
    return dict(
        isl=np.array([r.isl for r in rows], dtype=float),
        osl=np.array([r.osl for r in rows], dtype=float),
        conc=np.array([r.conc for r in rows], dtype=float),
        draft=np.array([MTP_DRAFT_TOKENS if r.mtp else 0.0 for r in rows]),
        reserve=np.array([FRAMEWORK_SETTINGS.get(r.framework, {}).get(
            "activation_reserve", float(reserve)) for r in rows]))


def row_metrics(group: Group, family_raw, framework_raw, isl, osl, conc, draft,
                reserve) -> Metrics:
    """Metrics of rows of `group` (arrays broadcast together) under given parameters.

    Args:
        group: the rows' shared static structure (`build_groups`).
        family_raw: (len(FAMILY_FIELDS),) unconstrained family values.
        framework_raw: (..., len(FRAMEWORK_FIELDS)) unconstrained framework values per row.
        isl, osl, conc, draft, reserve: per-row input and output tokens, concurrency, MTP
            draft tokens and activation reserve (bytes).
    """
    chip = with_family(group.chip, family_raw)
    fw = {name: _from_raw(space, framework_raw[..., j])
          for j, (name, space, _, _) in enumerate(FRAMEWORK_FIELDS)}
    runtime = Runtime(**fw, activation_reserve=reserve)
    spec = SpecDecode(draft_tokens=draft, acceptance=MTP_ACCEPTANCE)
    design = eqx.tree_at(lambda d: (d.concurrency, d.speculative, d.runtime), group.design,
                         (conc, spec, runtime))
    return predict(group.model, chip, Workload(isl, osl), design, check=False)


#: Outputs of the compiled group functions, per row.
OUTPUTS = ("log_tput_per_gpu", "log_tpot", "log_ttft", "log_e2e", "memory_excess")


def _outputs(m: Metrics):
    return jnp.stack([jnp.log(m.throughput_per_chip), jnp.log(m.tpot), jnp.log(m.ttft),
                      jnp.log(m.e2e), m.memory_excess], axis=-1)


class GroupFunction:
    """One compiled function for all rows of a group: values and forward-difference
    Jacobians in the family and framework parameters, evaluated as extra rows.

    Example:
        >>> import perfmodel.datasets as ds
        >>> row = ds.BenchRow(0, 2, "gpt-oss-120b", "b200", "vllm", "fp4", 1024., 1024.,
        ...                   8., False, ds.PoolLayout(1, 1, False), None, None, {})
        >>> group = build_groups([row])[0][0]
        >>> f = GroupFunction(group)
        >>> p = Params.prior(("blackwell",), ("vllm",))
        >>> values, jac_family, jac_framework = f(p.family_raw[0], p.framework_raw)
        >>> values.shape, jac_family.shape, jac_framework.shape
        ((1, 5), (1, 5, 9), (1, 5, 3))
    """

    def __init__(self, group: Group):
        self.group = group
        self.inputs = _row_inputs(group.rows)
        self.n = len(group.rows)

        def one(family_raw, framework_raw, isl, osl, conc, draft, reserve):
            return _outputs(row_metrics(group, family_raw, framework_raw, isl, osl, conc,
                                        draft, reserve))

        # One trace per group: every refit and every mask reuses it.
        self._fn = eqx.filter_jit(eqx.debug.assert_max_traces(jax.vmap(one), max_traces=1))
        directions = 1 + len(FAMILY_FIELDS) + len(FRAMEWORK_FIELDS)
        self._tiled = {k: jnp.asarray(np.tile(v, directions)) for k, v in self.inputs.items()}

    def __call__(self, family_raw, framework_rows, step: float = FD_STEP):
        """Values (n, 5) of `OUTPUTS` and their Jacobians (n, 5, 9) in the family row and
        (n, 5, 3) in each row's own framework values.

        `framework_rows` is (n, 3) per-row framework values, or a (1, 3) / (frameworks, 3)
        table when every row uses the table's first row (docstring example)."""
        nf, nw, n = len(FAMILY_FIELDS), len(FRAMEWORK_FIELDS), self.n
        fam = np.asarray(family_raw, dtype=float)
        fw = np.asarray(framework_rows, dtype=float)
        if fw.shape[0] != n:
            fw = np.broadcast_to(fw[:1], (n, nw))
        fam_b = np.tile(fam, (1 + nf + nw, n, 1))
        fam_b[1:1 + nf] += step * np.eye(nf)[:, None, :]
        fw_b = np.tile(fw, (1 + nf + nw, 1, 1))
        fw_b[1 + nf:] += step * np.eye(nw)[:, None, :]
        out = np.asarray(self._fn(jnp.asarray(fam_b.reshape(-1, nf)),
                                  jnp.asarray(fw_b.reshape(-1, nw)), **self._tiled))
        out = out.reshape(1 + nf + nw, n, len(OUTPUTS))
        jac = (out[1:] - out[0]) / step
        return out[0], np.moveaxis(jac[:nf], 0, -1), np.moveaxis(jac[nf:], 0, -1)


# ---------------------------------------------------------------------------------------
# Residual blocks: each maps the flat parameter vector to weighted log residuals and their
# Jacobian.


@dataclasses.dataclass
class Block:
    """A set of residuals: `evaluate(theta, jacobian)` -> (r, J or None)."""

    name: str
    evaluate: Callable
    size: int


def _family_columns(params: Params, family: str) -> np.ndarray:
    i = params.families.index(family)
    k = len(FAMILY_FIELDS)
    return np.arange(i * k, (i + 1) * k)


def _framework_columns(params: Params, framework: int) -> np.ndarray:
    start = params.family_raw.size + framework * len(FRAMEWORK_FIELDS)
    return np.arange(start, start + len(FRAMEWORK_FIELDS))


def _cached(evaluate):
    """Every evaluation computes the Jacobian anyway: remember the last one."""
    memo = {}

    def wrapped(theta, jacobian):
        key = np.asarray(theta, dtype=float).tobytes()
        if memo.get("key") != key:
            memo["key"], memo["value"] = key, evaluate(theta)
        r, J = memo["value"]
        return r, (J if jacobian else None)

    return wrapped


class EndToEnd:
    """Every InferenceMAX row, grouped and compiled once; `block(params, weights)` is the
    residual block of the rows with non-zero weight (a mask: no recompilation).

    Args:
        rows: rows with measurements (fitted and held-out alike).
        progress: show a progress bar while compiling.
    """

    def __init__(self, rows: Sequence[BenchRow], progress: bool = True):
        self.rows = list(rows)
        groups, self.errors = build_groups(self.rows)
        self.functions = [GroupFunction(g) for g in groups]
        self.position = {row.index: k for k, row in enumerate(self.rows)}
        self.targets = np.full((len(self.rows), len(E2E_KEYS)), np.nan)
        for k, row in enumerate(self.rows):
            for m, key in enumerate(E2E_KEYS):
                if key in row.measured:
                    self.targets[k, m] = math.log(row.measured[key])
        self.frameworks = tuple(sorted({r.framework for r in self.rows}))
        self.families = tuple(sorted({f.group.family for f in self.functions}))
        self._compile(progress)

    def _compile(self, progress):
        p = Params.prior(self.families, self.frameworks)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(self.functions), desc="compile groups", leave=False)
        self.excess = np.zeros(len(self.rows))
        for f in self.functions:
            values, _, _ = f(p.family_raw[self.families.index(f.group.family)],
                             _framework_rows(f.group.rows, p))
            for j, row in enumerate(f.group.rows):
                self.excess[self.position[row.index]] = values[j, 4]
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()

    def fits(self) -> np.ndarray:
        """Per row: True when the weights and one sequence fit in HBM (not fitted params)."""
        return self.excess <= 0

    def predict(self, params: Params, fallback: dict | None = None) -> dict:
        """Per-row predicted tput/GPU, TPOT, TTFT, E2E (seconds, tokens/s) and the basis.

        Families absent from `params` use `fallback` (default `FAMILY_FALLBACK`), frameworks
        absent use `FRAMEWORK_FALLBACK`, else priors.
        """
        out = {k: np.full(len(self.rows), np.nan) for k in
               ("tput_per_gpu", "median_tpot_s", "median_ttft_s", "median_e2el_s")}
        out["basis"] = [""] * len(self.rows)
        for f in self.functions:
            family, basis = resolve_family(f.group.family, params, fallback)
            raw = (params.family_raw[params.families.index(family)] if family else
                   Params.prior((f.group.family,), ()).family_raw[0])
            values, _, _ = f(raw, _framework_rows(f.group.rows, params))
            for j, row in enumerate(f.group.rows):
                k = self.position[row.index]
                for c, key in enumerate(("tput_per_gpu", "median_tpot_s", "median_ttft_s",
                                         "median_e2el_s")):
                    out[key][k] = math.exp(values[j, c])
                out["basis"][k] = basis
        return out

    def block(self, params: Params, weights: np.ndarray) -> Block:
        """Residuals of rows with `weights[row] > 0` (row order of `self.rows`), under the
        families and frameworks of `params` (rows of other families are skipped)."""
        plan = []
        for f in self.functions:
            if f.group.family not in params.families:
                continue
            k = np.array([self.position[r.index] for r in f.group.rows])
            w = weights[k][:, None] * np.sqrt([METRIC_WEIGHTS[m] for m in E2E_KEYS])
            w = np.where(np.isfinite(self.targets[k]), w, 0.0)
            picks = np.argwhere(w > 0)
            if len(picks):
                fw = np.array([params.frameworks.index(_framework_of(r.framework,
                                                                     params.frameworks))
                               if _framework_of(r.framework, params.frameworks) else -1
                               for r in f.group.rows])
                plan.append((f, k, w, picks, fw))
        total = sum(len(p[3]) for p in plan)

        def evaluate(theta):
            p = params.with_flat(theta)
            r = np.empty(total)
            J = np.zeros((total, len(theta)))
            at = 0
            for f, k, w, picks, fw in plan:
                values, jf, jw = f(p.family_raw[p.families.index(f.group.family)],
                                   _framework_rows(f.group.rows, p))
                i, m = picks[:, 0], picks[:, 1]
                rows = np.arange(at, at + len(i))
                weight = w[i, m]
                r[rows] = (values[i, m] - self.targets[k][i, m]) * weight
                J[rows[:, None], _family_columns(p, f.group.family)[None, :]] = \
                    jf[i, m] * weight[:, None]
                known = fw[i] >= 0
                cols = np.stack([_framework_columns(p, c) for c in np.maximum(fw[i], 0)])
                J[rows[known][:, None], cols[known]] = (jw[i, m] * weight[:, None])[known]
                at += len(i)
            return r, J

        return Block("inferencemax", _cached(evaluate), total)


def resolve_family(family: str, params: Params, fallback: dict | None = None
                   ) -> tuple[str, str]:
    """(fitted family to use or "", a basis label) along the fallback map."""
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


def _gemm_time(chip: Chip, m, n, k, dtype: str):
    wb, ab, cls = GEMM_DTYPES[dtype]
    mix = jnp.asarray([1.0 if c == cls else 0.0 for c in COMPUTE_CLASSES])
    op = Operator(name="gemm", flops=2.0 * m * n * k, weight_bytes=n * k * wb,
                  kv_bytes=jnp.zeros_like(m), activation_bytes=(m * k + m * n) * ab,
                  rows=m, compute_mix=mix, kernels=jnp.ones_like(m),
                  fabric_rows=jnp.zeros_like(m))
    zero = jnp.zeros(len(COMPUTE_CLASSES))
    prec = Precision(weight_bytes=wb, expert_bytes=wb, kv_bytes=ab, activation_bytes=ab,
                     weight_compute=mix, expert_compute=zero, attention_compute=zero)
    design = Design(concurrency=1.0, layout=Layout(), precision=prec)
    t, _ = operator_time(op, chip, design, jnp.ones_like(m))
    return t



def _op_function(chip: Chip, time_of: Callable):
    """Compiled f(family rows (D, 9)) -> (D, samples) log seconds."""

    def one(raw):
        return jnp.log(time_of(with_family(chip, raw)))

    return eqx.filter_jit(eqx.debug.assert_max_traces(jax.vmap(one), max_traces=1))


def _op_block(name: str, params: Params, plans: list, targets: np.ndarray) -> Block:
    """plans: (family, compiled function, slice into targets) per chip."""
    weight = math.sqrt(OP_WEIGHT)
    nf = len(FAMILY_FIELDS)

    def evaluate(theta):
        p = params.with_flat(theta)
        r = np.empty(len(targets))
        J = np.zeros((len(targets), len(theta)))
        for family, fn, sl in plans:
            base = np.asarray(p.family_raw[p.families.index(family)])
            batch = np.tile(base, (1 + nf, 1))
            batch[1:] += FD_STEP * np.eye(nf)
            out = np.asarray(fn(jnp.asarray(batch)))
            r[sl] = (out[0] - targets[sl]) * weight
            J[sl, _family_columns(p, family)] = ((out[1:] - out[0]) / FD_STEP).T * weight
        return r, J

    return Block(name, _cached(evaluate), len(targets))


def _by_fitted_chip(params: Params, samples: Sequence[dict]) -> dict[str, list]:
    """Op-level samples grouped by chip, for chips whose family `params` fits."""
    by_chip: dict[str, list] = {}
    for s in samples:
        if get_chip(s["chip"], calibrated=False).family in params.families:
            by_chip.setdefault(s["chip"], []).append(s)
    return by_chip


def gemm_block(params: Params, samples: Sequence[dict]) -> tuple[Block, list]:
    """Residual block of GEMM timings: log of predicted over measured seconds of one
    kernel (`roofline.operator_time` on one GEMM), for chips whose family is in `params`.
    One compiled function per chip."""
    plans, labels, targets = [], [], []
    for name, members in _by_fitted_chip(params, samples).items():
        chip = get_chip(name, calibrated=False)
        members = sorted(members, key=lambda s: s["dtype"])
        dtypes = sorted({s["dtype"] for s in members})
        shapes = {d: tuple(jnp.asarray([s[f] for s in members if s["dtype"] == d], dtype=float)
                           for f in ("m", "n", "k")) for d in dtypes}

        def time_of(c, shapes=shapes, dtypes=dtypes):
            return jnp.concatenate([_gemm_time(c, *shapes[d], d) for d in dtypes])

        start = len(targets)
        targets.extend(math.log(s["seconds"]) for s in members)
        labels.extend((name, s) for s in members)
        plans.append((chip.family, _op_function(chip, time_of), slice(start, len(targets))))
    return _op_block("gemm", params, plans, np.array(targets)), labels


def nccl_block(params: Params, samples: Sequence[dict]) -> tuple[Block, list]:
    """Residual block of NCCL timings: log of predicted over measured collective seconds
    (`interconnect.collective_time` over the chip's scale-up tier). One compiled function
    per chip."""
    plans, labels, targets = [], [], []
    for name, members in _by_fitted_chip(params, samples).items():
        chip = get_chip(name, calibrated=False)
        members = sorted(members, key=lambda s: (s["op"], s["n"]))
        keys = sorted({(s["op"], s["n"]) for s in members})
        sizes = {key: jnp.asarray([s["bytes"] for s in members if (s["op"], s["n"]) == key],
                                  dtype=float) for key in keys}

        def time_of(c, sizes=sizes, keys=keys):
            return jnp.concatenate([collective_time(op, sizes[(op, n)], n, c.scale_up,
                                                    c.scale_out, c.domain_size)
                                    for op, n in keys])

        start = len(targets)
        targets.extend(math.log(s["seconds"]) for s in members)
        labels.extend((name, s) for s in members)
        plans.append((chip.family, _op_function(chip, time_of), slice(start, len(targets))))
    return _op_block("nccl", params, plans, np.array(targets)), labels


#: Name of the pooled (across-family) row of a partially pooled fit (`prior_block`).
POOLED = "pooled"


def prior_block(params: Params, pooling: float | None = None) -> Block:
    """Gaussian priors in the unconstrained space: (theta - prior) / width.

    With `pooling` and a `POOLED` row in `params.families` (partial pooling, a hierarchical
    prior): the pooled row has the priors, every other family a Gaussian around the pooled
    row of width `pooling` x the prior width. A family with no data then sits on the pooled
    row, which every family's data inform (what leave-one-chip-out predicts a new family
    with).

    Example:
        >>> p = Params.prior(("hopper", POOLED), ())
        >>> r, J = prior_block(p, pooling=0.5).evaluate(p.flat + 0.1, True)
        >>> bool(abs(r[0]) < 1e-12), round(float(r[-1]), 3)
        (True, 0.1)
    """
    center = np.asarray(Params.prior(params.families, params.frameworks).flat)
    family_widths = np.array([f[3] for f in FAMILY_FIELDS])
    widths = np.concatenate([np.tile(family_widths, len(params.families)),
                             np.tile([f[3] for f in FRAMEWORK_FIELDS],
                                     len(params.frameworks))])
    jac = np.diag(1.0 / widths)
    if pooling is not None and POOLED in params.families:
        nf = len(FAMILY_FIELDS)
        pooled = np.arange(nf) + nf * params.families.index(POOLED)
        for i, fam in enumerate(params.families):
            if fam != POOLED:
                rows = np.arange(nf) + nf * i
                jac[rows, rows] = 1.0 / (pooling * family_widths)
                jac[rows, pooled] = -1.0 / (pooling * family_widths)

    def evaluate(theta, jacobian):
        r = jac @ (np.asarray(theta) - center)
        return r, (jac if jacobian else None)

    return Block("prior", evaluate, len(center))


# ---------------------------------------------------------------------------------------
# Solver.


class FitResult(eqx.Module):
    """Outcome of `fit`."""

    params: Params
    result: str = eqx.field(static=True)
    """"successful", "max_steps_reached" or "nonfinite"."""
    loss: float = eqx.field(static=True)
    steps: int = eqx.field(static=True)
    history: tuple = eqx.field(static=True, default=())


def huber_weights(r, delta):
    """IRLS weights of the Huber loss: 1 inside `delta`, delta / |r| outside."""
    a = np.abs(r)
    return np.where(a <= delta, 1.0, delta / np.maximum(a, 1e-300))


def huber_loss(r, delta):
    """Sum of Huber penalties of residuals `r` (quadratic inside `delta`, linear outside)."""
    a = np.abs(r)
    return float(np.sum(np.where(a <= delta, 0.5 * a**2, delta * (a - 0.5 * delta))))


def fit(params: Params, blocks: Sequence[Block], *, max_steps: int = 30, delta: float = 0.2,
        rtol: float = 1e-5, damping: float = 1e-2, progress: bool = True,
        throw: bool = False, callback: Callable | None = None) -> FitResult:
    """Levenberg-Marquardt on the stacked residual blocks, Huber-weighted (IRLS).

    Args:
        params: starting point (and the families/frameworks that are fitted).
        blocks: residual blocks (`EndToEnd.block`, `gemm_block`, `nccl_block`,
            `prior_block`).
        max_steps: accepted-or-rejected Jacobian evaluations at most.
        delta: Huber threshold on the (weighted) log residual; 0.2 is about 22 %.
        rtol: stop when the loss falls by less than this fraction in a step.
        damping: initial Marquardt damping (scaled by the diagonal of J^T W J).
        progress: show a tqdm progress bar.
        throw: raise `RuntimeError` when the result is not "successful".
        callback: called with (step, loss, Params) after every accepted step (checkpoints).

    Returns:
        `FitResult` with a result code.

    Example:
        >>> p = Params.prior(("hopper",), ())
        >>> fit(p, [prior_block(p)], progress=False).result
        'successful'
    """
    theta = np.asarray(params.flat, dtype=float)

    def residuals(th, jacobian):
        rs, Js = [], []
        for b in blocks:
            r, J = b.evaluate(jnp.asarray(th), jacobian)
            rs.append(np.asarray(r))
            Js.append(J)
        r = np.concatenate(rs)
        return r, (np.concatenate(Js) if jacobian else None)

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=max_steps, desc="calibrate", leave=False)
    r, J = residuals(theta, True)
    loss = huber_loss(r, delta)
    history = [loss]
    result, steps, lam = MAX_STEPS, 0, damping
    for count in range(1, max_steps + 1):
        steps = count
        if not np.isfinite(loss) or not np.all(np.isfinite(J)):
            result = NONFINITE
            break
        w = huber_weights(r, delta)
        A = J.T @ (w[:, None] * J)
        g = J.T @ (w * r)
        diag = np.diag(A) + 1e-12
        improved = False
        for _ in range(10):
            try:
                step = np.linalg.solve(A + lam * np.diag(diag), -g)
            except np.linalg.LinAlgError:
                lam *= 10.0
                continue
            trial = theta + step
            r_trial, _ = residuals(trial, False)
            new = huber_loss(r_trial, delta)
            if np.isfinite(new) and new < loss:
                improved = True
                break
            lam *= 4.0
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4g}", damping=f"{lam:.1e}")
        if not improved:
            result = SUCCESSFUL
            break
        drop = (loss - new) / max(loss, 1e-300)
        theta, loss = trial, new
        history.append(loss)
        if callback is not None:
            callback(steps, loss, params.with_flat(theta))
        lam = max(lam / 3.0, 1e-9)
        if drop < rtol or np.max(np.abs(step)) < 1e-7:
            result = SUCCESSFUL
            break
        r, J = residuals(theta, True)
    if bar is not None:
        bar.close()
    fitted = params.with_flat(theta)
    if throw and result != SUCCESSFUL:
        raise RuntimeError(f"calibration did not converge: {result} after {steps} steps "
                           f"(loss {loss:.4g})")
    return FitResult(params=fitted, result=result, loss=float(loss), steps=steps,
                     history=tuple(history))


class Calibration:
    """Compiled residuals of every data set, refittable on any subset without recompiling.

    Args:
        rows: InferenceMAX rows with measurements (all of them: masks pick what is fitted).
        gemm, nccl: op-level samples (`datasets.load_gemm`, `datasets.load_nccl`).
        progress: progress bars.
    """

    def __init__(self, rows: Sequence[BenchRow], gemm: Sequence[dict] = (),
                 nccl: Sequence[dict] = (), progress: bool = True):
        self.progress = progress
        self.e2e = EndToEnd(rows, progress=progress)
        self.gemm, self.nccl = list(gemm), list(nccl)
        op_families = {get_chip(s["chip"], calibrated=False).family
                       for s in self.gemm + self.nccl}
        self.families = tuple(sorted(set(self.e2e.families) | op_families))
        self.frameworks = self.e2e.frameworks
        self._ops: dict[tuple, list[Block]] = {}

    def _op_blocks(self, params: Params, exclude: str | None) -> list[Block]:
        key = (exclude,)
        if key not in self._ops:
            gemm = [s for s in self.gemm if s["chip"] != exclude]
            nccl = [s for s in self.nccl if s["chip"] != exclude]
            blocks = []
            if gemm:
                blocks.append(gemm_block(params, gemm)[0])
            if nccl:
                blocks.append(nccl_block(params, nccl)[0])
            self._ops[key] = blocks
        return self._ops[key]

    def fit(self, rows: Sequence[BenchRow] | None = None, *, exclude_chip: str | None = None,
            max_steps: int = 40, rtol: float = 1e-5, callback: Callable | None = None,
            throw: bool = False, pooling: float | None = None
            ) -> tuple[FitResult, tuple, tuple]:
        """Fit from the priors: op-level blocks alone, then jointly with the end-to-end rows.

        Args:
            rows: the end-to-end rows to fit (a subset of the constructor's); all when None.
            exclude_chip: leave every sample of this chip preset out (leave-one-chip-out).
            max_steps, rtol, callback, throw: as `fit` (the joint stage).
            pooling: partial pooling of the families (`prior_block`); adds a `POOLED` row,
                returned among the families with data.

        Returns:
            (fit result, families that had data, frameworks that had data). Rows whose
            weights and one sequence do not fit in HBM are not fitted (their predictions
            collapse; `predict_rows` flags them).
        """
        chosen = {r.index for r in (self.e2e.rows if rows is None else rows)}
        key = chip_key(exclude_chip) if exclude_chip else None
        weights = np.array([1.0 if (r.index in chosen and chip_key(r.hardware) != key)
                            else 0.0 for r in self.e2e.rows]) * self.e2e.fits()
        names = self.families + ((POOLED,) if pooling is not None else ())
        params = Params.prior(names, self.frameworks)
        ops = self._op_blocks(params, key)
        fitted_rows = [r for r, w in zip(self.e2e.rows, weights, strict=True) if w > 0]
        families = sorted({get_chip(r.hardware, calibrated=False).family for r in fitted_rows}
                          | {get_chip(s["chip"], calibrated=False).family
                             for s in self.gemm + self.nccl if s["chip"] != key}
                          | ({POOLED} if pooling is not None else set()))
        frameworks = sorted({r.framework for r in fitted_rows})
        prior = prior_block(params, pooling)
        if ops:
            params = fit(params, ops + [prior], max_steps=max_steps,
                         progress=self.progress).params
        result = fit(params, ops + [self.e2e.block(params, weights), prior],
                     max_steps=max_steps, rtol=rtol, progress=self.progress,
                     callback=callback, throw=throw)
        return result, tuple(families), tuple(frameworks)


def calibrate(rows: Sequence[BenchRow], gemm: Sequence[dict] = (), nccl: Sequence[dict] = (),
              *, exclude_chip: str | None = None, max_steps: int = 40, rtol: float = 1e-5,
              progress: bool = True, callback: Callable | None = None
              ) -> tuple[FitResult, tuple]:
    """Fit the parameters of every family and framework the data covers (compiles every
    group of `rows` first; use `Calibration` to refit subsets without recompiling).

    Returns:
        (fit result, families that had data).
    """
    problem = Calibration(rows, gemm, nccl, progress=progress)
    result, families, _ = problem.fit(exclude_chip=exclude_chip, max_steps=max_steps,
                                      rtol=rtol, callback=callback)
    return result, families


# ---------------------------------------------------------------------------------------
# Prediction of benchmark rows with given parameters (eager: no compilation per layout).

PREDICTION_KEYS = ("pred_tput_per_gpu", "pred_output_tput_per_gpu", "pred_median_ttft_s",
                   "pred_median_tpot_s", "pred_median_e2el_s",
                   "pred_median_intvty_tok_s_user", "pred_p99_ttft_s", "pred_p99_tpot_s",
                   "pred_power_w_per_gpu", "pred_j_per_output_token")


def _padded(rows: Sequence[BenchRow], start: int) -> list:
    chunk = list(rows[start:start + BATCH])
    return chunk + [chunk[-1]] * (BATCH - len(chunk))


def predict_rows(rows: Sequence[BenchRow], params: Params | None = None,
                 fallback: dict | None = None,
                 measured: Sequence[str] | None = None) -> list[dict]:
    """Predictions for benchmark rows, in row order.

    Args:
        rows: interpreted rows (`datasets.load_benchmarks`).
        params: fitted parameters; None loads the shipped `fitted_params.json`.
        fallback: family -> family map for families absent from `params`
            (default `FAMILY_FALLBACK`).
        measured: chips with end-to-end measurements in the fit (for `pred_basis`); the
            shipped file's list when `params` is None.

    Returns:
        One dict per row: the `PREDICTION_KEYS` (floats, or None with `pred_error` set),
        `pred_basis` (which family's fitted parameters were used, and whether the chip
        itself was measured) and `pred_error` (why a row has no prediction, or a warning
        when the layout does not fit in HBM).
    """
    if params is None:
        from . import fitted as shipped
        params = from_json(shipped.read(shipped.LATENCY_FILE))
        measured = shipped.read(shipped.LATENCY_FILE).get("measured_chips", measured)
    groups, errors = build_groups(rows)
    out: list[dict | None] = [None] * len(rows)
    position = {row.index: k for k, row in enumerate(rows)}
    for index, message in errors.items():
        out[position[index]] = {key: None for key in PREDICTION_KEYS} | {
            "pred_basis": "", "pred_error": message}
    for g in groups:
        family, basis = resolve_family(g.family, params, fallback)
        if family == g.family and measured is not None and g.chip.name not in measured:
            basis = f"specs+fitted:{family} ({g.chip.name} not measured)"
        raw = (params.family_raw[params.families.index(family)] if family else
               Params.prior((g.family,), ()).family_raw[0])
        for start in range(0, len(g.rows), BATCH):
            chunk = _padded(g.rows, start)
            x = {k: jnp.asarray(v) for k, v in _row_inputs(chunk).items()}
            m = row_metrics(g, raw, jnp.asarray(_framework_rows(chunk, params)), **x)
            values = {
                "pred_tput_per_gpu": m.throughput_per_chip,
                "pred_output_tput_per_gpu": m.output_throughput_per_chip,
                "pred_median_ttft_s": m.ttft, "pred_median_tpot_s": m.tpot,
                "pred_median_e2el_s": m.e2e, "pred_median_intvty_tok_s_user": m.interactivity,
                "pred_p99_ttft_s": m.p99_ttft, "pred_p99_tpot_s": m.p99_tpot,
                "pred_power_w_per_gpu": m.power_per_chip,
                "pred_j_per_output_token": m.j_per_output_token}
            values = {k: np.broadcast_to(np.asarray(v), (BATCH,)) for k, v in values.items()}
            excess = np.broadcast_to(np.asarray(m.memory_excess), (BATCH,))
            for j, row in enumerate(g.rows[start:start + BATCH]):
                entry = {k: float(v[j]) for k, v in values.items()}
                bad = [k for k, v in entry.items() if not math.isfinite(v)]
                entry["pred_basis"] = basis
                entry["pred_error"] = ""
                if bad:
                    entry = {k: None for k in PREDICTION_KEYS} | {
                        "pred_basis": basis,
                        "pred_error": f"non-finite prediction ({', '.join(bad)})"}
                elif excess[j] > 0:
                    entry["pred_error"] = (
                        f"warning: does not fit: weights + reserve + one sequence need "
                        f"{1.0 + excess[j]:.2f}x the usable HBM per chip (memory_fraction x "
                        f"capacity); throughput is predicted as if almost nothing ran")
                out[position[row.index]] = entry
    return out
