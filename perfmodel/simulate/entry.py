"""The entry points: `simulate` and its compiled form `simulate_jit` (one `eqx.filter_jit`
call), and the `window="auto"` search both run inside the computation."""

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
            narrowest of `AUTO_WINDOW` x 2^k requests (up to N) whose run does not
            overflow, searched inside the computation (a chain of `lax.cond`: a width runs
            only when the narrower one overflowed, each stopped at its first overflow),
            so it holds under `jit` too; under a `vmap` every width runs (the
            conditions become selects).

    Returns:
        `Result` (see `summarize`).

    Raises:
        ValueError: a spec of the wrong kind, a disaggregated layout, a layout that cannot
            hold the model, closed-loop clients that replicas cannot share evenly.
        equinox.EquinoxRuntimeError: a traced policy value out of range (`Policy`'s rules).

    Queue order uses float keys of size steps x requests: run with `jax_enable_x64` (as the
    package's tests and command line do) for long simulations.
    """
    _validate(model, chip, design, policy, requests)
    return _simulate(model, chip, design, policy, requests, max_steps=max_steps, hard=hard,
                     vectorize=vectorize, widths=_widths(window, requests.size))


def _simulate(model, chip, design, policy, requests, *, max_steps, hard, vectorize, widths):
    """`simulate` with the window widths to try, narrowest first (static)."""
    _validate(model, chip, design, policy, requests)
    policy = _checked(policy)
    layout = design.layout
    serve = _replicated if isinstance(layout, Layout) and layout.replicas > 1 else _instance

    def search(widths):
        width, wider = widths[0], widths[1:]
        result = serve(model, chip, design, policy, requests, max_steps, hard, vectorize,
                       width, bool(wider))
        if not wider:
            return result
        return jax.lax.cond(result.window_overflow, lambda: search(wider), lambda: result)

    return search(widths)


#: First window `window="auto"` tries (requests).
AUTO_WINDOW = 256


def _widths(window, n: int) -> tuple:
    """The widths `window` asks for, narrowest first (None: all `n` requests)."""
    if not isinstance(window, str):
        return (window,)
    if window != "auto":
        raise ValueError(f"window must be an int, None or 'auto', got {window!r}")
    # Read from the package at call time, where the name is public: setting
    # `perfmodel.simulate.AUTO_WINDOW` changes the search (the tests start it small).
    widths = [min(n, sys.modules[__package__].AUTO_WINDOW)]
    while widths[-1] < n:
        widths.append(min(2 * widths[-1], n))
    return tuple(widths)


_simulate_compiled = eqx.filter_jit(_simulate)


def simulate_jit(model: Model, chip: Chip, design: Design, policy: Policy,
                 requests: Requests, *, max_steps: int = 100_000, hard: bool = True,
                 vectorize: bool = True, window: int | str | None = "auto") -> Result:
    """`simulate` as one compiled call (`eqx.filter_jit`), with the window chosen by
    default (`window="auto"`: the same result as all requests, faster); the widths to try
    are resolved here, so they are part of what the compilation is keyed on."""
    _validate(model, chip, design, policy, requests)
    return _simulate_compiled(model, chip, design, policy, requests, max_steps=max_steps,
                              hard=hard, vectorize=vectorize,
                              widths=_widths(window, requests.size))
