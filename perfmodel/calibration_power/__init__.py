"""Power calibration: idle power and energy per FLOP, per HBM byte and per link byte.

Measured GPU board power while serving (ML.ENERGY Benchmark v2/v3, InferenceX power runs;
`calibration/power/power_measurements.csv`) is reproduced by the serving model
(`perfmodel.serving.predict`) with the power model of `perfmodel.power`:

    P = P_idle + (sum_c e_c FLOP_c + e_hbm bytes_HBM + e_link bytes_link
                  + P_active t_busy) / t,

capped at TDP (t_busy: the time kernels run; host overheads are idle time). The fit
(`fit.fit_power`) evaluates `serving.predict` itself on every measured row, with the
fitted quantities as its inputs, and minimises a robust (Huber) loss on log power and log J
per output token by Levenberg-Marquardt (`optimistix.least_squares`). Coefficients are
fitted in log space, one set per chip family (ampere, hopper, blackwell) pulled towards a
shared *generic* set expressed in units of each chip's own peak rates:

    e_flop,c = a_c TDP / peak_flops_c,  e_hbm = a_hbm TDP / hbm_bandwidth,
    e_link = a_link TDP / scale_up_bandwidth,  P_active = a_active TDP,  P_idle = a_idle TDP,

the fraction of TDP each unit would draw running alone at its peak. Chips never measured
(Jalapeno, TPUs, AMD) and held-out chips take the generic set.

The same fit sets the serving engines' time terms that only these measurements see (per
runtime: host time per step and per running sequence, the expert kernels' efficiency and
the pipeline overlap of `design.Runtime`; per runtime and chip family: its kernels'
efficiency): J per token is power times time, so a throughput the model gets wrong is a
J/token it gets wrong.

Modules: `rows` (measurement rows as model inputs, `predict_power_rows`, error figures),
`fit` (parameters, the residuals and the solve) and `intervals` (prediction intervals from
the fit's out-of-model residuals).
"""

from .fit import (
    FAMILIES,
    GAUSSIAN_PRIORS,
    HUBER_DELTA,
    PRIOR,
    REGULARISATION,
    RESIDUAL_SCALE,
    RUNTIMES,
    PowerFit,
    PowerParams,
    PowerProblem,
    RowGroup,
    RowPredictions,
    build_problem,
    errors,
    evaluate,
    fit_power,
    metric_pairs,
    residuals,
    robust,
    to_fitted,
    usable,
)
from .rows import (
    ASSUMED_ISL,
    DEFAULT_ISL,
    RowSpec,
    assumed_isl,
    group_inputs,
    groups_of,
    predict_power_rows,
    read_rows,
    resolve_model,
    row_spec,
    runtime_key,
    specs_of,
)

__all__ = [
    "ASSUMED_ISL", "DEFAULT_ISL", "FAMILIES", "GAUSSIAN_PRIORS", "HUBER_DELTA", "PRIOR",
    "REGULARISATION", "RESIDUAL_SCALE", "RUNTIMES", "PowerFit", "PowerParams",
    "PowerProblem", "RowGroup", "RowPredictions", "RowSpec", "assumed_isl", "build_problem",
    "errors", "evaluate", "fit_power", "group_inputs", "groups_of", "metric_pairs",
    "predict_power_rows", "read_rows", "resolve_model", "residuals", "robust", "row_spec",
    "runtime_key", "specs_of", "to_fitted", "usable",
]
