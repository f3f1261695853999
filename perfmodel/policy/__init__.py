"""Batch-policy tuning: the scheduler settings, layout and format that serve a load with
the most goodput per chip (or per kW) under p99 TTFT and TPOT SLOs.

One module per job: `problem` (the problem, its options, the box, rounding, the
simulator's verdict), `gradient` (tuning by gradient on the surrogate, verified and backed
off in the simulator), `grid` (the reference grid search in the simulator).
"""

from .gradient import Candidate, Tuned, instance_load, tune
from .grid import BUDGETS, SEATS, GridResult, default_chunks, grid_points, grid_search
from .problem import (
    OBJECTIVES,
    Option,
    Problem,
    as_dict,
    bounds,
    load_of,
    objective_of,
    options,
    problem,
    rounded,
    simulated,
    slo_met,
)

__all__ = [
    "BUDGETS", "OBJECTIVES", "SEATS", "Candidate", "GridResult", "Option", "Problem",
    "Tuned", "as_dict", "bounds", "default_chunks", "grid_points", "grid_search",
    "instance_load", "load_of", "objective_of", "options", "problem", "rounded",
    "simulated", "slo_met", "tune",
]
