"""The entry points: `simulate` (eager) and `simulate_jit`, the compiled one
(`eqx.filter_jit`), which also searches `window="auto"`."""

from __future__ import annotations

import sys

import equinox as eqx
import jax

from ..architecture import Model
from ..design import Design, Layout
from ..hardware import Chip
from .arrivals import Requests
from .engines import Policy
from .replicas import _replicated
from .results import Result
from .scheduler import _instance
from .validate import _checked, _validate


def simulate(model: Model, chip: Chip, design: Design, policy: Policy, requests: Requests,
             *, max_steps: int = 100_000, hard: bool = True,
             vectorize: bool = True, window: int | str | None = None) -> Result:
    """Simulate engine instances serving `requests` under `policy`: one, or
    `design.layout.replicas` behind a round-robin router (`_replicated`).

    Args:
        model: architecture (static).
        chip: accelerator spec.
        design: layout (aggregated; its replicas are data-parallel engines), precisions,
            runtime (its
            `step_overhead` and `seq_overhead` are paid every step); `design.concurrency`
            is not read (the load is `requests`).
        policy: scheduler settings.
        requests: arrivals and lengths (N requests; the loop's arrays have that size).
        max_steps: static; the most engine steps simulated (unfinished requests are
            reported as such).
        hard: static; exact max in the step-time roofline (default), else the smooth one.
        vectorize: static; evaluate each step's operators as one stack
            (`roofline.step_cost`): the same numbers in fewer, larger operations, faster on
            CPU inside the loop (XLA:CPU pays per operation).
        window: static; each step looks at this many requests from the first unfinished
            one (in index order: sort open-loop requests by arrival, as the builders do)
            instead of all N, which makes a step's time independent of N. Exact while
            the running requests and the head of the queue lie within it; when they may
            not, `Result.window_overflow` is True. None: all requests. "auto": the
            smallest of `AUTO_WINDOW` x 2^k that does not overflow (each compiled once,
            an overflowing run stopped at its first overflow), found when the policy and
            requests are concrete values; traced (under `jit` or `vmap`), all requests.

    Returns:
        `Result` (see `summarize`).

    Raises:
        ValueError: a spec of the wrong kind, a disaggregated layout, a layout that cannot
            hold the model, closed-loop clients that replicas cannot share evenly.
        equinox.EquinoxRuntimeError: a traced policy value out of range (`Policy`'s rules).

    Queue order uses float keys of size steps x requests: run with `jax_enable_x64` (as the
    package's tests and command line do) for long simulations.
    """
    if isinstance(window, str):
        return simulate_jit(model, chip, design, policy, requests, max_steps=max_steps,
                            hard=hard, vectorize=vectorize, window=window)
    return _simulate(model, chip, design, policy, requests, max_steps=max_steps, hard=hard,
                     vectorize=vectorize, window=window)


def _simulate(model, chip, design, policy, requests, *, max_steps, hard, vectorize, window,
              stop_on_overflow=False):
    _validate(model, chip, design, policy, requests)
    policy = _checked(policy)
    layout = design.layout
    args = (max_steps, hard, vectorize, window, stop_on_overflow)
    if isinstance(layout, Layout) and layout.replicas > 1:
        return _replicated(model, chip, design, policy, requests, *args)
    return _instance(model, chip, design, policy, requests, *args)


#: The one compiled simulation; `simulate_jit` calls it once per window it tries.
_simulate_compiled = eqx.filter_jit(_simulate)


def simulate_jit(model: Model, chip: Chip, design: Design, policy: Policy,
                 requests: Requests, *, max_steps: int = 100_000, hard: bool = True,
                 vectorize: bool = True, window: int | str | None = "auto") -> Result:
    """`simulate`, compiled (`eqx.filter_jit`), with the window chosen by default
    (`window="auto"`: the same result as all requests, faster).

    "auto" runs `_simulate_compiled` at `AUTO_WINDOW` x 2^k requests until a run does not
    overflow (each width compiled once, an overflowing run stopped at its first
    overflow); the search needs concrete values, so with traced ones (under `jit` or
    `vmap`) it simulates all requests instead.
    """
    kw = dict(max_steps=max_steps, hard=hard, vectorize=vectorize)
    if not isinstance(window, str):
        return _simulate_compiled(model, chip, design, policy, requests, window=window, **kw)
    if window != "auto":
        raise ValueError(f"window must be an int, None or 'auto', got {window!r}")
    _validate(model, chip, design, policy, requests)
    n = requests.size
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(
            (chip, design, policy, requests))):
        return _simulate(model, chip, design, policy, requests, window=None, **kw)
    width = min(n, _first_window())
    while True:
        result = _simulate_compiled(model, chip, design, policy, requests, window=width,
                                    stop_on_overflow=width < n, **kw)
        if width >= n or not bool(result.window_overflow):
            return result
        width = min(2 * width, n)


#: First window `window="auto"` tries (requests).
AUTO_WINDOW = 256


def _first_window() -> int:
    # Read from the package at call time, where the name is public: setting
    # `perfmodel.simulate.AUTO_WINDOW` changes the search (the tests start it small).
    return sys.modules[__package__].AUTO_WINDOW
