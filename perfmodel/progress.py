"""Progress bars for long runs: `tqdm` on standard error, shown only on a terminal and only
once a run has lasted `DELAY_S` seconds, removed when it ends.

Functions that run for seconds to minutes (`sweep`, `studies.jalapeno.compare`,
`search.optimize`, `search.exhaustive`, the prediction of benchmark rows) take
`progress: bool | None`: True shows a bar, False none, None (the default) one when
standard error is a terminal. `perfmodel --quiet` passes False.
"""

from __future__ import annotations

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
    # A terminal that reports no size (a bare pseudo-terminal) would get a bar 0 wide and
    # 0 rows high, which tqdm hides.
    size = shutil.get_terminal_size(fallback=(100, 24))
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled,
                delay=DELAY_S, leave=False, ncols=min(size.columns or 100, 120),
                nrows=size.lines or 24)
