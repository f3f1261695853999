"""The relaxation: unconstrained parameters whose `Choice` the model takes as it is.

Concurrency and the power cap are continuous (log concurrency and the cap through a
sigmoid over the grid's range); each format and placement is a softmax over its allowed
options with a traced temperature. Rounding (`Relaxed.nearest`) takes the grid point
nearest the parameters: the start of hardening.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..architecture import Model
from ..hardware import Chip
from ..smooth import DEFAULT_SHARPNESS
from ..workload import Workload
from .evaluate import problem
from .space import Choice, GridIndex, Space, Tables, Targets, tables

_LOGITS = ("weights", "experts", "kv", "attention_placement", "dense_placement",
           "expert_placement", "kv_placement")


class Relaxed(eqx.Module):
    """Unconstrained parameters of one relaxed design: what Adam updates.

    concurrency = exp(lo + (hi - lo) sigmoid(concurrency_logit)) over the grid's log range,
    power cap = cap_lo + (cap_hi - cap_lo) sigmoid(cap_logit) over its caps, and one logit
    vector per format and placement coordinate (a softmax at a temperature).

    Example:
        >>> from perfmodel.presets import get_chip, get_model
        >>> from perfmodel.search import design_space, tables
        >>> chip = get_chip("h200")
        >>> space = design_space(get_model("llama-3.1-8b"), chip, 1, concurrency=(1, 64))
        >>> p = Relaxed.initial(space, 0.5)
        >>> round(float(p.choice(tables(space, chip), 1.0).concurrency), 6)
        8.0
    """

    concurrency_logit: jnp.ndarray
    cap_logit: jnp.ndarray
    weights: jnp.ndarray
    experts: jnp.ndarray
    kv: jnp.ndarray
    attention_placement: jnp.ndarray
    dense_placement: jnp.ndarray
    expert_placement: jnp.ndarray
    kv_placement: jnp.ndarray

    @classmethod
    def initial(cls, space: Space, start: float = 0.5) -> Relaxed:
        """Uniform softmaxes, the power cap near its top, and concurrency at `start` (a
        position in (0, 1) of the grid's log range). Float64 numpy leaves when x64 is on
        (explicit dtypes: weakly typed leaves would retrace the kernels)."""
        if not 0.0 < start < 1.0:
            raise ValueError(f"Relaxed.initial: start is a position in (0, 1), got {start!r}")
        dtype = jnp.zeros(()).dtype
        sizes = space.sizes
        return cls(concurrency_logit=np.asarray(math.log(start / (1.0 - start)), dtype),
                   cap_logit=np.asarray(2.0, dtype),
                   **{name: np.zeros(getattr(sizes, name), dtype) for name in _LOGITS})

    def choice(self, t: Tables, temperature) -> Choice:
        """The relaxed design at softmax temperature `temperature` (traced)."""
        lo, hi = t.log_concurrency[0], t.log_concurrency[-1]
        concurrency = jnp.exp(lo + (hi - lo) * jax.nn.sigmoid(self.concurrency_logit))
        cap = t.power_caps[0] + (t.power_caps[-1] - t.power_caps[0]) * jax.nn.sigmoid(
            self.cap_logit)
        # The seven softmaxes as one over rows padded to the widest and masked: XLA:CPU runs
        # each softmax as a handful of small kernels, and a step pays per kernel.
        logits = [getattr(self, name) for name in _LOGITS]
        sizes = [x.shape[-1] for x in logits]
        width = max(sizes)
        rows = jnp.stack([jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
                          for x, n in zip(logits, sizes, strict=True)], axis=-2)
        mask = np.arange(width)[None, :] < np.asarray(sizes)[:, None]
        p = jax.nn.softmax(rows / temperature, axis=-1, where=mask)
        probabilities = {name: p[..., i, :n] for i, (name, n) in
                         enumerate(zip(_LOGITS, sizes, strict=True))}
        return Choice(concurrency=concurrency, power_cap=cap, **probabilities)

    def nearest(self, t: Tables) -> GridIndex:
        """The grid point nearest these parameters: concurrency and power cap to the
        nearest grid value (in log concurrency), each softmax to its argmax."""
        log_c, caps = t.log_concurrency, t.power_caps
        c = log_c[0] + (log_c[-1] - log_c[0]) * jax.nn.sigmoid(self.concurrency_logit)
        cap = caps[0] + (caps[-1] - caps[0]) * jax.nn.sigmoid(self.cap_logit)
        return GridIndex(concurrency=jnp.argmin(jnp.abs(log_c - c)).astype(jnp.int32),
                         power_cap=jnp.argmin(jnp.abs(caps - cap)).astype(jnp.int32),
                         **{name: jnp.argmax(getattr(self, name)).astype(jnp.int32)
                            for name in _LOGITS})


@eqx.filter_jit
def relaxed_evaluate(model: Model, chip: Chip, workload: Workload, layout, space: Space,
                     params: Relaxed, tgt: Targets, objective: str = "tok_s_per_kw",
                     temperature=1.0, sharpness=DEFAULT_SHARPNESS):
    """Score, constraints and metrics of relaxed parameters (differentiable in `params`,
    the specs and the targets; jitted).

    Args:
        model, chip, workload: what is served, on what.
        layout: a layout of `space` (static `Layout`, `Disaggregated`, or `LayoutNumbers`).
        space: the grid (`design_space`).
        params: the relaxed design.
        tgt: limits and prices (`targets`).
        objective: a key of `OBJECTIVES`.
        temperature: softmax temperature (dimensionless, traced).
        sharpness: smooth-max p (traced).

    Returns:
        (score, g, metrics): score = +-log(objective) (larger is better), g the
        dimensionless constraint ratios in `CONSTRAINTS` order (<= 0 is met), metrics
        `Metrics.to_row()`.

    Raises:
        ValueError: an unknown objective or specs of the wrong type (before tracing).

    Example:
        >>> import perfmodel as pm
        >>> from perfmodel.search import design_space, targets
        >>> chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-8b")
        >>> space = design_space(model, chip, 1, concurrency=(1, 64))
        >>> s, g, m = relaxed_evaluate(model, chip, pm.Workload(1024, 256), space.layouts[0],
        ...                            space, Relaxed.initial(space), targets(max_tpot_ms=20))
        >>> g.shape, bool(jnp.isfinite(s))
        ((6,), True)
    """
    prob = problem(model, chip, workload, tables(space, chip), tgt, objective, sharpness)
    out = prob.evaluate(layout, params.choice(prob.tables, temperature))
    return out.score, out.g, out.metrics
