"""perfmodel: a differentiable performance model of LLM inference on AI accelerators."""

from .architecture import Model, from_hf_config
from .design import (
                     Design,
                     Disaggregated,
                     Layout,
                     LayoutNumbers,
                     Precision,
                     Runtime,
                     SliceMapping,
                     SpecDecode,
                     mapping,
                     precision,
)
from .hardware import Chip, Efficiency, EnergyCoefficients, from_datasheet
from .interconnect import AbstractInterconnect, Ring, Switch, Torus, collective_time
from .kvcache import kv_bytes_per_request, kv_bytes_per_token_layer, max_batch
from .moe import expected_experts_touched
from .presets import chip_names, get_chip, get_model, model_names
from .roofline import operators, step_cost
from .serving import Metrics, predict, predict_jit
from .smooth import smooth_max, smooth_min
from .workload import Workload

__all__ = [
    "AbstractInterconnect", "Chip", "Design", "Disaggregated", "Efficiency",
    "EnergyCoefficients", "Layout", "LayoutNumbers", "Metrics", "Model", "Precision", "Ring",
    "Runtime", "SliceMapping", "SpecDecode", "Switch", "Torus", "Workload", "chip_names",
    "collective_time", "expected_experts_touched", "from_datasheet", "from_hf_config",
    "get_chip", "get_model", "kv_bytes_per_request", "kv_bytes_per_token_layer", "mapping",
    "max_batch", "model_names", "operators", "precision", "predict", "predict_jit",
    "smooth_max", "smooth_min", "step_cost",
]
