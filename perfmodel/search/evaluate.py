"""One evaluation of the search: a `Choice` (relaxed or one-hot) made into model inputs,
predicted, and scored against the targets. The relaxed search, hardening, shadow prices
and enumeration all go through `Problem.evaluate`, so they score the same thing.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..architecture import Model
from ..design import Design, Precision, Runtime, SliceMapping
from ..formats import FORMAT_BYTES
from ..hardware import Chip
from ..serving import predict
from ..smooth import DEFAULT_SHARPNESS
from ..workload import Workload
from .space import OBJECTIVES, Choice, Tables, Targets

#: Largest constraint ratio g that still counts as met (rounding of exact evaluations).
FEASIBLE_TOL = 1e-9


def _array(x):
    return jnp.asarray(x, dtype=float)


class Evaluation(eqx.Module):
    """What one design scores (arrays; any batch shape a `vmap` adds in front)."""

    score: jnp.ndarray
    """log(objective) when larger is better, -log(objective) for costs: larger is better."""
    g: jnp.ndarray
    """One dimensionless ratio per `CONSTRAINTS`, value / limit - 1 (<= 0 is met)."""
    value: jnp.ndarray
    """The objective in its own units."""
    metrics: dict
    """`Metrics.to_row()` of the design."""

    @property
    def rank(self) -> jnp.ndarray:
        """Larger is better: feasible designs by score, infeasible ones below every
        feasible one, by their total violation. On host arrays (a kernel's output), on
        the host."""
        xp = np if isinstance(self.score, np.ndarray) else jnp
        feasible = xp.all(self.g <= FEASIBLE_TOL, axis=-1)
        return xp.where(feasible, self.score,
                        -1e6 - xp.sum(xp.maximum(self.g, 0.0), axis=-1))


def materialize(chip: Chip, t: Tables, layout, choice: Choice, vectorize: bool = True):
    """(chip with the power cap as its TDP, `Design`, summed quality cost) of a choice: each
    probability vector times its option table, so a mixture of options is a valid model
    input. `vectorize` as in `Problem.evaluate`."""

    def mix(probabilities, table):
        if not vectorize:
            # Under a wide vmap a dot is one batched matmul: twice as fast there.
            return probabilities @ table
        # For one design, a multiply and a sum: XLA:CPU fuses them with their neighbours,
        # and runs a tiny dot as a library call of its own.
        p = probabilities if table.ndim == 1 else probabilities[..., None]
        return jnp.sum(p * table, axis=-table.ndim)

    prec = Precision(
        weight_bytes=mix(choice.weights, t.weight_bytes),
        expert_bytes=mix(choice.experts, t.expert_bytes),
        kv_bytes=mix(choice.kv, t.kv_bytes), activation_bytes=FORMAT_BYTES["bf16"],
        weight_compute=mix(choice.weights, t.weight_compute),
        expert_compute=mix(choice.experts, t.expert_compute),
        attention_compute=mix(choice.kv, t.attention_compute))
    mapping = SliceMapping(
        attention=mix(choice.attention_placement, t.attention_placement),
        dense=mix(choice.dense_placement, t.dense_placement),
        experts=mix(choice.expert_placement, t.expert_placement),
        kv=mix(choice.kv_placement, t.kv_placement))
    # `sweep.default_runtime` (activation reserve capped at 10% of HBM), traced.
    runtime = Runtime(activation_reserve=jnp.minimum(4e9, 0.1 * chip.hbm_capacity))
    design = Design(concurrency=choice.concurrency, layout=layout, precision=prec,
                    mapping=mapping, runtime=runtime)
    capped = eqx.tree_at(lambda c: c.tdp, chip, choice.power_cap * chip.tdp)
    quality = (mix(choice.weights, t.quality_weights) + mix(choice.experts, t.quality_experts)
               + mix(choice.kv, t.quality_kv))
    return capped, design, quality


class Problem(eqx.Module):
    """What the search scores: the specs, the grid's option tables, the targets and the
    objective. Every numeric leaf is traced, so new targets or chip numbers never
    recompile; the model and the objective are static."""

    model: Model
    chip: Chip
    workload: Workload
    tables: Tables
    targets: Targets
    objective: str = eqx.field(static=True)
    sharpness: jnp.ndarray = eqx.field(converter=_array, default=DEFAULT_SHARPNESS)
    """p of the relaxed model's smooth max (dimensionless; unused by hard evaluations)."""

    def evaluate(self, layout, choice: Choice, *, hard: bool = False,
                 vectorize: bool = True) -> Evaluation:
        """Score, constraints and metrics of one design.

        Args:
            layout: a static `Layout` or `Disaggregated`, or `LayoutNumbers`.
            choice: the design's remaining coordinates.
            hard: static; the exact model (hard max/min) instead of the smooth one.
            vectorize: static; `predict`'s evaluation order: True (each step's operators
                along an array axis) for single designs and gradients, False under a wide
                `vmap` (enumeration), where it is faster; the numbers agree.
        """
        return _evaluate(self, layout, choice, hard=hard, vectorize=vectorize)


# Jitted so that a search kernel traces the model once per kind of evaluation: the
# relaxed search, hardening and the shadow prices call it under different transforms
# (vmap, vjp, jvp) and from `eval_shape`, and jit's cache hands each the same jaxpr.
@functools.partial(jax.jit, static_argnames=("hard", "vectorize"))
def _evaluate(prob: Problem, layout, choice: Choice, hard: bool, vectorize: bool):
    capped, design, quality = materialize(prob.chip, prob.tables, layout, choice, vectorize)
    metrics = predict(prob.model, capped, prob.workload, design, sharpness=prob.sharpness,
                      hard=hard, check=False, vectorize=vectorize, unfit="value")
    value = objective_value(prob.objective, metrics, prob.targets)
    sign = 1.0 if OBJECTIVES[prob.objective][1] else -1.0
    score = sign * jnp.log(jnp.maximum(value, 1e-300))
    measured = jnp.stack([metrics.tpot, metrics.ttft, metrics.e2e, metrics.power_per_chip,
                          metrics.memory_excess + 1.0, quality])
    return Evaluation(score=score, g=measured / prob.targets.limits() - 1.0, value=value,
                      metrics=metrics.to_row())


def objective_value(objective: str, metrics, tgt: Targets):
    """The objective `objective` (a key of `OBJECTIVES`) of `metrics`, in its units."""
    if objective == "tok_s_per_kw":
        return metrics.tok_s_per_kw_tdp
    if objective == "tok_s_per_kw_modeled":
        return metrics.throughput_per_chip / (metrics.power_per_chip / 1e3)
    if objective == "tok_s_per_mw_allin":
        return metrics.tok_s_per_mw_allin
    if objective == "tok_s_per_chip":
        return metrics.throughput_per_chip
    hourly = tgt.usd_per_chip_hour + metrics.power_per_chip / 1e3 * tgt.usd_per_kwh
    return hourly / 3600.0 / metrics.throughput_per_chip * 1e6


def problem(model: Model, chip: Chip, workload: Workload, tables: Tables, tgt: Targets,
            objective: str, sharpness=DEFAULT_SHARPNESS) -> Problem:
    """A `Problem`, after checking what tracing would not (raises ValueError)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}; valid objectives: {tuple(OBJECTIVES)}")
    if not isinstance(model, Model) or not isinstance(chip, Chip):
        raise ValueError("model and chip must be perfmodel Model and Chip (see get_model, "
                         "get_chip)")
    if not isinstance(workload, Workload):
        raise ValueError("workload must be a perfmodel Workload")
    if not isinstance(tgt, Targets):
        raise ValueError("targets must be Targets (see targets)")
    return Problem(model=model, chip=chip, workload=workload, tables=tables, targets=tgt,
                   objective=objective, sharpness=sharpness)
