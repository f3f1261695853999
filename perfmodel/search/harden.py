"""Hardening: from the grid points nearest the relaxed designs to a feasible, locally best
grid design, by steepest ascent over a fixed neighbourhood with the exact model, and the
layout screen that decides which layouts are hardened.

The first round evaluates the rounded design of every start of every layout; when there
are more layouts than `keep`, it evaluates each at every grid concurrency (the
concurrency line through it) and screens the layouts (`screen_order`: by the best exact
rank among a layout's designs, and by its relaxed loss, alternately). It starts one walker
on each of the first `keep` layouts, from that layout's best design. Every later round
evaluates the whole neighbourhood (`neighbourhood`) of every walker's design, and each
walker moves to its best neighbour while that ranks higher (`Evaluation.rank`: a
violated constraint is repaired first, then the objective improved). Every round is one
vmapped evaluation of the same number of designs, so one compiled loop serves them all.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..design import LayoutNumbers
from .evaluate import FEASIBLE_TOL, Evaluation, Problem
from .space import GridIndex

#: Concurrency steps of the neighbourhood, alone (grid positions).
CONCURRENCY_MOVES = (-8, -4, -2, -1, 1, 2, 4, 8)
#: Concurrency steps combined with each change of another coordinate (grid positions).
COMBINED_MOVES = (0, -4, -2, -1, 1, 2, 4)

_CHOICES = ("weights", "experts", "kv", "attention_placement", "dense_placement",
            "expert_placement", "kv_placement")


class Neighbourhood(eqx.Module):
    """The moves of the local search, one row each: the neighbour of a grid point `i` has,
    per coordinate, clip(where(mask, value, i) + delta, 0, size - 1)."""

    mask: GridIndex
    """Whether the move sets the coordinate (bool, one per move)."""
    value: GridIndex
    """The option a setting move picks (int)."""
    delta: GridIndex
    """The step a move adds (int)."""

    def around(self, index: GridIndex, sizes: GridIndex) -> GridIndex:
        """The neighbours of one grid point (a leading axis of moves)."""
        return jax.tree_util.tree_map(
            lambda i, m, v, d, n: jnp.clip(jnp.where(m, v, i) + d, 0, n - 1),
            index, self.mask, self.value, self.delta, sizes)

    @property
    def size(self) -> int:
        return self.mask.concurrency.shape[0]


def neighbourhood(sizes: GridIndex) -> Neighbourhood:
    """Concurrency moves alone; every option of each format and placement coordinate with
    more than one, and the power cap one step either way, each combined with small
    concurrency moves (host arrays).

    Example:
        >>> from perfmodel.search import GridIndex
        >>> neighbourhood(GridIndex(40, 3, 1, 2, 1, 1, 1, 1, 1)).size   # 8 + (3 + 2) x 7
        43
    """
    rows = []

    def row(field=None, value=0, step=0, concurrency=0):
        move = {"mask": dict.fromkeys(_FIELDS, False), "value": dict.fromkeys(_FIELDS, 0),
                "delta": dict.fromkeys(_FIELDS, 0)}
        if field is not None and step == 0:
            move["mask"][field], move["value"][field] = True, value
        elif field is not None:
            move["delta"][field] = step
        move["delta"]["concurrency"] += concurrency
        rows.append(move)

    for d in CONCURRENCY_MOVES:
        row(concurrency=d)
    for field in _CHOICES:
        n = getattr(sizes, field)
        for k in range(n if n > 1 else 0):
            for d in COMBINED_MOVES:
                row(field, value=k, concurrency=d)
    if sizes.power_cap > 1:
        for step in (-1, 1):
            for d in COMBINED_MOVES:
                row("power_cap", step=step, concurrency=d)

    def column(part, dtype):
        return GridIndex(**{f: np.asarray([r[part][f] for r in rows], dtype) for f in _FIELDS})

    return Neighbourhood(mask=column("mask", bool), value=column("value", np.int32),
                         delta=column("delta", np.int32))


_FIELDS = ("concurrency", "weights", "experts", "kv", "attention_placement",
           "dense_placement", "expert_placement", "kv_placement", "power_cap")


class Hardened(eqx.Module):
    """The result of hardening: per walker (a leading axis, best screened first) the
    hardened design of its layout, and the screen."""

    layout: jnp.ndarray
    """The walker's layout (its position among the search's layouts)."""
    start: jnp.ndarray
    """The start whose rounded design the walker began from."""
    index: GridIndex
    """The hardened grid design."""
    evaluation: Evaluation
    """Its exact evaluation (`hard=True`)."""
    blocking: jnp.ndarray
    """Per constraint, the smallest violation among the better-scoring designs of the
    walker's last neighbourhood evaluated (inf if none): what stops the search there."""
    moves: jnp.ndarray
    """Moves the walker made."""
    capped: jnp.ndarray
    """True when the walker stopped at the cap on moves while still improving."""
    order: jnp.ndarray
    """Every layout, in the screen's order (no walker axis)."""
    evaluations: jnp.ndarray
    """Exact evaluations made, padding not counted (no walker axis)."""


def screen_order(exact, losses):
    """Layouts in the screen's order: the best exact rank first, then the lowest relaxed
    loss, then alternately by each (each without the layouts already placed). The exact
    rank finds the best layout for the relaxed format and placement choice as rounded; the
    relaxed loss still sees a layout whose choice has not settled on the grid.

    Example:
        >>> screen_order(jnp.asarray([0.0, 2.0, 1.0]), jnp.asarray([3.0, 2.0, 1.0])).tolist()
        [1, 2, 0]
    """
    n = exact.shape[0]
    candidates = jnp.stack([jnp.argsort(-exact), jnp.argsort(losses)], axis=1).reshape(-1)

    def place(i, carry):
        order, count, placed = carry
        c = candidates[i]
        new = ~placed[c]
        slot = jnp.minimum(count, n - 1)
        order = order.at[slot].set(jnp.where(new, c, order[slot]))
        return order, count + new.astype(count.dtype), placed.at[c].set(True)

    init = (jnp.zeros(n, candidates.dtype), jnp.zeros((), candidates.dtype),
            jnp.zeros(n, bool))
    return jax.lax.fori_loop(0, 2 * n, place, init)[0]


def harden(prob: Problem, layouts, starts: GridIndex, losses, keep: int,
           moves: Neighbourhood, max_moves) -> Hardened:
    """Screen the layouts and harden the first `keep` (module docstring). Traceable.

    Args:
        prob: what is scored.
        layouts: one static layout, or `LayoutNumbers` with a leading layout axis.
        starts: rounded relaxed designs, shape (layouts, starts).
        losses: each layout's relaxed loss (the screen's second criterion), shape (layouts,).
        keep: layouts hardened (static, at most the layouts).
        moves: the neighbourhood.
        max_moves: cap on each walker's moves (traced).
    """
    sizes = prob.tables.sizes
    n_layouts, n_starts = starts.concurrency.shape
    n_moves = moves.size
    stacked = isinstance(layouts, LayoutNumbers)
    walkers = jnp.arange(keep)
    if n_layouts > keep:
        # The screen sees each rounded design at every grid concurrency: the relaxed
        # concurrency is the coordinate that settles last, and a layout whose rounded
        # design misses it would be screened out for that alone.
        line = jnp.arange(sizes.concurrency, dtype=jnp.int32)
        starts = jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to(x[..., None], (*x.shape, line.shape[0])), starts)
        starts = eqx.tree_at(lambda i: i.concurrency, starts,
                             jnp.broadcast_to(line, starts.concurrency.shape))
    per_layout = math.prod(starts.concurrency.shape[1:])
    width = max(keep * n_moves, n_layouts * per_layout)

    def one(index, owner):
        layout = jax.tree_util.tree_map(lambda x: x[owner], layouts) if stacked else layouts
        return prob.evaluate(layout, index.choice(prob.tables), hard=True)

    def evaluate(indices: GridIndex, owners) -> Evaluation:
        return jax.vmap(one)(indices, owners)

    def pad(x):
        return jnp.concatenate([x, jnp.broadcast_to(x[:1], (width - x.shape[0],
                                                             *x.shape[1:]))])

    first_round = jax.tree_util.tree_map(lambda x: pad(x.reshape(-1)), starts)
    first_owners = pad(jnp.repeat(jnp.arange(n_layouts, dtype=jnp.int32), per_layout))

    def cond(carry):
        rounds, made, improved = carry[:3]
        return (rounds == 0) | jnp.any(improved & (made < max_moves))

    def body(carry):
        rounds, made, _, owner, start, current, current_eval, _, order = carry
        first = rounds == 0
        around = jax.vmap(lambda i: moves.around(i, sizes))(current)
        candidates = jax.tree_util.tree_map(lambda a, b: jnp.where(first, a, pad(b.reshape(-1))),
                                            first_round, around)
        owners = jnp.where(first, first_owners, pad(jnp.repeat(owner, n_moves)))
        evaluated = evaluate(candidates, owners)
        rank = evaluated.rank
        # The first round: the screen, and each walker's start.
        by_layout = rank[:n_layouts * per_layout].reshape(n_layouts, per_layout)
        best_point = jnp.argmax(by_layout, axis=1).astype(jnp.int32)
        screened = screen_order(jnp.max(by_layout, axis=1), losses).astype(jnp.int32)
        kept = screened[:keep]
        # Later rounds: each walker's best neighbour.
        neighbour = jnp.argmax(rank[:keep * n_moves].reshape(keep, n_moves), axis=1)
        position = walkers * n_moves + neighbour
        better = (rank[position] > current_eval.rank + 1e-12) & (made < max_moves)
        position = jnp.where(first, kept * per_layout + best_point[kept], position)
        moved = first | better

        def pick(new, old):
            new = new[position]
            return jnp.where(moved.reshape(-1, *[1] * (new.ndim - 1)), new, old)

        return (rounds + 1, made + (~first & better).astype(jnp.int32), moved,
                jnp.where(first, kept, owner),
                jnp.where(first, best_point[kept] // (per_layout // n_starts), start),
                jax.tree_util.tree_map(pick, candidates, current),
                jax.tree_util.tree_map(pick, evaluated, current_eval), evaluated,
                jnp.where(first, screened, order))

    zeros = jnp.zeros(keep, jnp.int32)
    current = jax.tree_util.tree_map(lambda x: x[:keep], first_round)
    # The structure of one evaluation, traced outside vmap (cheaper than batching it).
    shapes = jax.eval_shape(one, jax.tree_util.tree_map(lambda x: x[0], first_round),
                            first_owners[0])
    last = jax.tree_util.tree_map(lambda s: jnp.zeros((width, *s.shape), s.dtype), shapes)
    init = (jnp.zeros((), jnp.int32), zeros, jnp.ones(keep, bool), zeros, zeros, current,
            jax.tree_util.tree_map(lambda x: x[:keep], last), last,
            jnp.zeros(n_layouts, jnp.int32))
    rounds, made, improved, owner, start, current, current_eval, last, order = \
        jax.lax.while_loop(cond, body, init)
    # What blocks a better neighbour, from each walker's last neighbourhood (none has been
    # evaluated when the first round was the last).
    neighbours = jax.tree_util.tree_map(
        lambda x: x[:keep * n_moves].reshape(keep, n_moves, *x.shape[1:]), last)
    better = (neighbours.score > current_eval.score[:, None] + 1e-12)[..., None] & (
        neighbours.g > FEASIBLE_TOL)
    blocking = jnp.where(rounds > 1, jnp.min(jnp.where(better, neighbours.g, jnp.inf), axis=1),
                         jnp.inf)
    return Hardened(layout=owner, start=start, index=current, evaluation=current_eval,
                    blocking=blocking, moves=made, capped=improved, order=order,
                    evaluations=n_layouts * per_layout + (rounds - 1) * keep * n_moves)
