"""Progress bars for long runs: `tqdm` on standard error, shown only on a terminal and only
once a run has lasted `DELAY_S` seconds (`$PERFMODEL_PROGRESS_DELAY_S` overrides it; 0 shows
a bar from the start), removed when it ends.

Functions that run for seconds to minutes (`sweep`, `studies.jalapeno.compare`,
`search.optimize`, `search.exhaustive`, the prediction of benchmark rows) take
`progress: bool | None`: True shows a bar, False none, None (the default) one when
standard error is a terminal. `perfmodel --quiet` passes False.
"""

from __future__ import annotations

import os
import shutil
import sys

#: Seconds before a bar appears: shorter runs print nothing.
DELAY_S = 2.0


def bar(total: int | None, desc: str, progress: bool | None = None, unit: str = "step"):
    """A `tqdm` bar over `total` steps (None: a count with elapsed time and rate, for work
    whose length is not known), used as a context manager; `.update(n)` advances it.

    Example:
        >>> with bar(3, "demo", progress=False) as b:
        ...     for _ in range(3):
        ...         b.update(1)
    """
    from tqdm import tqdm

    enabled = sys.stderr.isatty() if progress is None else bool(progress)
    delay = _delay()
    # A terminal that reports no size (a bare pseudo-terminal) would get a bar 0 wide and
    # 0 rows high, which tqdm hides.
    size = shutil.get_terminal_size(fallback=(100, 24))
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled,
                delay=delay, leave=False, ncols=min(size.columns or 100, 120),
                nrows=size.lines or 24)


def _delay() -> float:
    """`DELAY_S`, or `$PERFMODEL_PROGRESS_DELAY_S` when set (seconds, >= 0)."""
    raw = os.environ.get("PERFMODEL_PROGRESS_DELAY_S")
    if raw is None or raw == "":
        return DELAY_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0.0:
        raise ValueError(f"PERFMODEL_PROGRESS_DELAY_S must be a number of seconds >= 0, got "
                         f"{raw!r}; unset it for the default {DELAY_S:g} s")
    return value
