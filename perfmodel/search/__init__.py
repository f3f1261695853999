"""Design optimization by gradient descent: the most tokens per watt (or per chip, or per
dollar) under latency, power, memory and accuracy constraints.

One module per job: `space` (targets, the grid, its option tables, grid points),
`evaluate` (one scored evaluation), `relax` (the relaxation), `lagrangian` (the
augmented-Lagrangian solver), `harden` (rounding and local search), `sensitivity` (shadow
prices), `exhaustive` (enumeration), `driver` (`optimize` and its report), `compile` (how
the kernels are compiled).

Example:
    >>> import perfmodel as pm
    >>> from perfmodel import search
    >>> chip, model = pm.get_chip("h200"), pm.get_model("llama-3.1-8b")
    >>> space = search.design_space(model, chip, 1, concurrency=(1, 4, 16, 64))
    >>> r = search.optimize(model, chip, pm.Workload(1024, 256), space,
    ...                     search.targets(max_tpot_ms=8))
    >>> r.feasible, search.succeeded(r.result)
    (True, True)
"""

from ..solvers import RESULTS, succeeded
from .driver import OptimizeResult, optimize
from .evaluate import Evaluation, Problem
from .exhaustive import ExhaustiveResult, exhaustive
from .harden import Neighbourhood, neighbourhood
from .lagrangian import AugmentedLagrangian, AugmentedLagrangianState, augmented_lagrangian
from .relax import Relaxed, relaxed_evaluate
from .space import (
    CONSTRAINTS,
    DEFAULT_QUALITY,
    OBJECTIVES,
    SOFTWARE_MAPPED_FAMILIES,
    TENSOR_CLASSES,
    UNITS,
    Choice,
    GridIndex,
    Space,
    Tables,
    Targets,
    candidate_layouts,
    design_space,
    tables,
    targets,
)

__all__ = [
    "CONSTRAINTS", "DEFAULT_QUALITY", "OBJECTIVES", "RESULTS", "SOFTWARE_MAPPED_FAMILIES",
    "TENSOR_CLASSES", "UNITS", "AugmentedLagrangian", "AugmentedLagrangianState", "Choice",
    "Evaluation", "ExhaustiveResult", "GridIndex", "Neighbourhood", "OptimizeResult",
    "Problem", "Relaxed", "Space", "Tables", "Targets", "augmented_lagrangian",
    "candidate_layouts", "design_space", "exhaustive", "neighbourhood", "optimize",
    "relaxed_evaluate", "succeeded", "tables", "targets",
]
