"""An augmented-Lagrangian solver for inequality constraints, in optimistix's shape.

Maximise score(y) subject to g_i(y) <= 0, each g a dimensionless ratio value / limit - 1,
by Adam on Rockafellar's augmented Lagrangian (Rockafellar 1973; Nocedal & Wright,
"Numerical Optimization", 2nd ed., eq. 17.65 for inequalities):

    L(y; lam, mu) = -score(y) + sum_i [max(0, lam_i + mu g_i(y))^2 - lam_i^2] / (2 mu),

with the multipliers updated every `steps_per_block` steps (one block of Adam steps
approximately minimises L at fixed lam, mu):

    lam_i <- max(0, lam_i + mu g_i(y)),   mu <- min(2 mu, mu_max) while the largest
    violation does not halve from one update to the next.

At a solution lam_i is the shadow price d score / d g_i. The objective's discrete choices
are softmaxes whose temperature the solver anneals geometrically over `max_steps`.

As optimistix's solvers: `init` builds the state, `step` makes one Adam step (and, at a
block boundary, the multiplier update first, from the same evaluation), `terminate` is the
convergence test, and `run` loops them. One step costs one evaluation and one reverse
pass: the update at a block boundary uses the constraint values of the step's own
evaluation, and the pullback is taken with the updated multipliers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ..solvers import RESULTS


def _array(x):
    return jnp.asarray(x, dtype=float)


def augmented_lagrangian(score, g, lam, mu):
    """L = -score + sum_i [max(0, lam_i + mu g_i)^2 - lam_i^2] / (2 mu) (dimensionless).

    Example:
        >>> lam = jnp.asarray([0.0, 1.0])
        >>> float(augmented_lagrangian(1.0, jnp.asarray([-0.5, 0.1]), lam, 10.0))  # -1 + 3/20
        -0.85
    """
    return -score + jnp.sum(jnp.maximum(lam + mu * g, 0.0) ** 2 - lam ** 2) / (2.0 * mu)


def _max_abs(tree):
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree_util.tree_leaves(tree)]))


class AugmentedLagrangianState(eqx.Module):
    """The solver's state between steps (arrays)."""

    step: jnp.ndarray
    """Adam steps taken."""
    opt_state: Any
    lam: jnp.ndarray
    """Multipliers in use, one per constraint (dimensionless, >= 0)."""
    mu: jnp.ndarray
    """Penalty weight in use."""
    block_violation: jnp.ndarray
    """Largest constraint violation at the last multiplier update (inf before the first)."""
    block_y: Any
    """The parameters at the last multiplier update."""
    converged: jnp.ndarray
    """Whether the last multiplier update found the iteration converged (`terminate`)."""
    scores: jnp.ndarray
    """Score at every step taken (0 after), shape (max_steps,)."""
    violations: jnp.ndarray
    """Largest violation at every step taken, shape (max_steps,)."""
    loss: jnp.ndarray
    """Augmented Lagrangian at the last step's evaluation."""
    aux: Any
    """`fn`'s auxiliary output at the last step's evaluation."""


class AugmentedLagrangian(eqx.Module):
    """Adam on an augmented Lagrangian with annealed softmax temperature (module docstring).

    `fn(y, args, temperature)` returns ((score, g), aux): a scalar to maximise, a vector of
    constraint ratios (<= 0 is met) and anything else to keep of the latest evaluation.

    Example:
        >>> # Maximise -(y - 2)^2 subject to y / 1 - 1 <= 0: the optimum is y = 1, where the
        >>> # multiplier is the score's slope, 2.
        >>> def fn(y, args, temperature):
        ...     return (-(y - 2.0) ** 2, jnp.stack([y - 1.0])), None
        >>> solver = AugmentedLagrangian(max_steps=600, steps_per_block=50, learning_rate=0.05,
        ...                              mu=10.0)
        >>> y, state = run(solver, fn, jnp.asarray(0.0), None)
        >>> round(float(y), 2), round(float(state.lam[0]), 1)
        (1.0, 2.0)
    """

    max_steps: int = eqx.field(static=True)
    """Adam steps at most (the temperature reaches its end value at the last)."""
    steps_per_block: int = eqx.field(static=True)
    """Adam steps between multiplier updates."""
    learning_rate: jnp.ndarray = eqx.field(converter=_array, default=0.2)
    temperature_start: jnp.ndarray = eqx.field(converter=_array, default=1.0)
    temperature_end: jnp.ndarray = eqx.field(converter=_array, default=1.0)
    mu: jnp.ndarray = eqx.field(converter=_array, default=10.0)
    """Initial penalty weight."""
    mu_max: float = eqx.field(static=True, default=1e4)
    rtol: jnp.ndarray = eqx.field(converter=_array, default=1e-3)
    """Relative change of parameters and multipliers over a block below which the
    iteration has converged."""
    atol: jnp.ndarray = eqx.field(converter=_array, default=1e-3)
    """Largest constraint violation a converged iteration may have (dimensionless)."""

    def __check_init__(self):
        if self.max_steps < 1 or self.steps_per_block < 1:
            raise ValueError(f"AugmentedLagrangian: max_steps ({self.max_steps}) and "
                             f"steps_per_block ({self.steps_per_block}) must be >= 1")

    @property
    def optimizer(self) -> optax.GradientTransformation:
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(self.learning_rate))

    def temperature(self, step):
        """The softmax temperature of step `step`: geometric from start to end."""
        fraction = step / max(self.max_steps - 1, 1)
        return self.temperature_start * (self.temperature_end / self.temperature_start) ** (
            fraction)

    def init(self, fn: Callable, y, args) -> AugmentedLagrangianState:
        (score, g), aux = jax.eval_shape(lambda y: fn(y, args, self.temperature_start), y)
        zeros = jnp.zeros(self.max_steps, score.dtype)
        return AugmentedLagrangianState(
            step=jnp.asarray(0), opt_state=self.optimizer.init(y),
            lam=jnp.zeros(g.shape, g.dtype), mu=self.mu.astype(g.dtype),
            block_violation=jnp.asarray(jnp.inf, g.dtype), block_y=y,
            converged=jnp.asarray(False), scores=zeros, violations=zeros,
            loss=jnp.zeros((), score.dtype),
            aux=jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), aux))

    def step(self, fn: Callable, y, args, state: AugmentedLagrangianState):
        """One Adam step; at a block boundary, the multiplier update first. Returns
        (y, state, aux)."""
        temperature = self.temperature(state.step)
        (score, g), pullback, aux = jax.vjp(lambda y: fn(y, args, temperature), y,
                                            has_aux=True)
        violation = jnp.max(jnp.maximum(g, 0.0))
        update = (state.step > 0) & (state.step % self.steps_per_block == 0)
        lam = jnp.where(update, jnp.maximum(state.lam + state.mu * g, 0.0), state.lam)
        grow = update & (violation > 0.5 * state.block_violation)
        mu = jnp.where(grow, jnp.minimum(2.0 * state.mu, self.mu_max), state.mu)
        converged = update & (violation <= self.atol) & (
            jnp.max(jnp.abs(lam - state.lam)) <= self.rtol * (1.0 + jnp.max(lam))) & (
            _max_abs(jax.tree_util.tree_map(jnp.subtract, y, state.block_y))
            <= self.rtol * (1.0 + _max_abs(y)))
        # dL/dg_i = max(0, lam_i + mu g_i): the pullback of (score, g) gives dL/dy.
        weights = jnp.maximum(lam + mu * g, 0.0)
        (grad,) = pullback((-jnp.ones_like(score), weights))
        updates, opt_state = self.optimizer.update(grad, state.opt_state, y)
        state = AugmentedLagrangianState(
            step=state.step + 1, opt_state=opt_state, lam=lam, mu=mu,
            block_violation=jnp.where(update, violation, state.block_violation),
            block_y=jax.tree_util.tree_map(lambda a, b: jnp.where(update, a, b), y,
                                           state.block_y),
            converged=converged, scores=state.scores.at[state.step].set(score),
            violations=state.violations.at[state.step].set(violation),
            loss=augmented_lagrangian(score, g, lam, mu), aux=aux)
        return optax.apply_updates(y, updates), state, aux

    def terminate(self, fn: Callable, y, args, state: AugmentedLagrangianState):
        """(done, result): done once a multiplier update finds every constraint met to
        `atol` and parameters and multipliers settled over the block to `rtol`."""
        return state.converged, RESULTS.successful

    def result(self, state: AugmentedLagrangianState):
        """`RESULTS.successful` when converged, else `nonlinear_max_steps_reached`."""
        return RESULTS.where(state.converged, RESULTS.successful,
                             RESULTS.nonlinear_max_steps_reached)

    def final_multipliers(self, state: AugmentedLagrangianState, g):
        """The multiplier update that would follow the last step, from its constraint
        values `g`: the multipliers of the relaxed problem's solution."""
        return jnp.maximum(state.lam + state.mu * g, 0.0)


def run(solver: AugmentedLagrangian, fn: Callable, y, args, state=None, until=None, *,
        batched: bool = False, batched_args: bool = False):
    """Step `solver` from `y` (and `state`, default `solver.init`) until it terminates or
    has taken `until` steps (traced; default and at most `max_steps`); returns (y, state).

    With `batched`, `y` (and `state`) hold many problems along a leading axis, and so does
    `args` with `batched_args`. Each problem stops on its own (a finished one is held) and
    the loop ends when all have. The vmap sits inside the loop, not around it: vmapping a
    `while_loop` batches its body's jaxpr to a fixed point, several times over, which cost
    most of the search's tracing time.
    """
    def step(y, state, args):
        return solver.step(fn, y, args, state)[:2]

    def done(y, state, args):
        return solver.terminate(fn, y, args, state)[0]

    if batched:
        axes = (0, 0, 0 if batched_args else None)
        step, done = jax.vmap(step, in_axes=axes), jax.vmap(done, in_axes=axes)
    if state is None and not batched:
        state = solver.init(fn, y, args)
    elif state is None:
        # One problem's initial state, broadcast (only `block_y` differs): `init` under
        # vmap would batch the evaluation it traces for its structure.
        n = jax.tree_util.tree_leaves(y)[0].shape[0]
        first = jax.tree_util.tree_map(lambda x: x[0], args) if batched_args else args
        state = solver.init(fn, jax.tree_util.tree_map(lambda x: x[0], y), first)
        state = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))),
                                       state)
        state = eqx.tree_at(lambda s: s.block_y, state, y)
    until = solver.max_steps if until is None else jnp.minimum(until, solver.max_steps)

    def active(y, state):
        return (state.step < until) & ~done(y, state, args)

    def cond(carry):
        return jnp.any(active(*carry))

    def body(carry):
        y, state = carry
        going = active(y, state)
        new = step(y, state, args)

        def hold(a, b):
            return jnp.where(going.reshape(going.shape + (1,) * (a.ndim - going.ndim)), a, b)

        return jax.tree_util.tree_map(hold, new, (y, state))

    return jax.lax.while_loop(cond, body, (y, state))
