"""Shadow prices of a grid design: its own KKT multipliers along the continuous coordinates.

The hardened design sits on the grid, not at the relaxed optimum, so the relaxed problem's
multipliers describe a different point. Its own are the least-squares solution of the
first-order condition grad score = sum_i lam_i grad g_i over the coordinates that can move
(log concurrency and the power cap, formats and placements held), over the constraints
that bind, clipped at 0: the least-squares multiplier estimate of SQP methods (Nocedal &
Wright, "Numerical Optimization", 2nd ed., chapters 12 and 18). They come from the exact
model's derivatives at the design, so they do not depend on how far Adam converged.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .evaluate import Problem
from .space import GridIndex


class Sensitivity(eqx.Module):
    """Derivatives of a grid design along u = (log concurrency, power cap / TDP)."""

    score: jnp.ndarray
    """d score / du, shape (2,)."""
    g: jnp.ndarray
    """d g_i / du, shape (constraints, 2)."""
    held: jnp.ndarray
    """Which coordinates a grid bound holds: at the edge of its range with the score
    pushing outward (bool, shape (2,))."""


def sensitivity(prob: Problem, layout, index: GridIndex) -> Sensitivity:
    """`Sensitivity` of the grid design `index` (one point; exact model; traceable)."""
    base = index.choice(prob.tables)
    t = prob.tables

    def at(u):
        choice = eqx.tree_at(lambda c: (c.concurrency, c.power_cap), base,
                             (jnp.exp(u[0]), u[1]))
        out = prob.evaluate(layout, choice, hard=True)
        return out.score, out.g

    u = jnp.stack([jnp.log(base.concurrency), base.power_cap])
    lo = jnp.stack([t.log_concurrency[0], t.power_caps[0]])
    hi = jnp.stack([t.log_concurrency[-1], t.power_caps[-1]])
    ds, dg = jax.jacfwd(at)(u)
    held = ((u <= lo * (1 + 1e-12)) & (ds < 0)) | ((u >= hi * (1 - 1e-12)) & (ds > 0))
    return Sensitivity(score=ds, g=dg, held=held)


def shadow_prices(sens: Sensitivity, active) -> np.ndarray:
    """The multipliers of the `active` constraints (bool per constraint; host arrays):
    least squares over the coordinates `sens.held` leaves free, clipped at 0; 0 for the
    inactive ones and when no coordinate is free.

    Example:
        >>> sens = Sensitivity(score=np.array([2.0, 0.0]),
        ...                    g=np.array([[1.0, 0.0], [0.0, 0.0]]),
        ...                    held=np.array([False, True]))
        >>> shadow_prices(sens, np.array([True, False])).tolist()
        [2.0, 0.0]
    """
    free = ~np.asarray(sens.held)
    active = np.asarray(active, dtype=bool)
    lam = np.zeros(active.shape)
    if free.any() and active.any():
        a = np.asarray(sens.g)[np.ix_(active, free)].T
        solution = np.linalg.lstsq(a, np.asarray(sens.score)[free], rcond=None)[0]
        lam[active] = np.maximum(solution, 0.0)
    return lam
