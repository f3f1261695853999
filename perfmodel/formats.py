"""Number formats: storage bytes per element and the compute class each one runs at.

Storage sizes include the block scales of the microscaling formats:
- MXFP4 (OCP Microscaling spec v1.0): 4-bit E2M1 elements, one 8-bit E8M0 scale per 32
  elements -> 4.25 bits = 0.53125 bytes.
- NVFP4 (NVIDIA Blackwell): 4-bit E2M1, one FP8 E4M3 scale per 16 elements (plus a per-tensor
  FP32 scale, negligible) -> 4.5 bits = 0.5625 bytes.
- INT4 group-32 with a BF16 scale (compressed-tensors, as Kimi-K2.5's routed experts) ->
  0.5 + 2/32 = 0.5625 bytes.
- FP8 with DeepSeek's 128x128 block scales adds 4 bytes per 16,384 elements: counted as 1 byte.
"""

from __future__ import annotations

#: Compute classes: a chip's peak FLOP/s and energy per FLOP are given per class, in this order.
COMPUTE_CLASSES: tuple[str, ...] = ("bf16", "fp8", "int8", "fp4")

#: Storage formats: bytes per element.
FORMAT_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "mxfp4": 0.53125,
    "nvfp4": 0.5625,
    "int4": 0.5625,
}

#: The compute class a storage format's matmuls run at when the chip supports it natively.
FORMAT_CLASS: dict[str, str] = {
    "fp32": "bf16",
    "bf16": "bf16",
    "fp16": "bf16",
    "fp8": "fp8",
    "int8": "int8",
    "mxfp4": "fp4",
    "nvfp4": "fp4",
    "int4": "int8",
}

#: Names users may type, mapped to a storage format (``fp4`` resolves per chip, see
#: `resolve_format`).
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "e4m3": "fp8",
    "fp8_e4m3": "fp8",
    "e5m2": "fp8",
    "fp8_e5m2": "fp8",
    "w4a16": "int4",
}


def resolve_format(name: str, fp4_flavor: str = "nvfp4") -> str:
    """Canonical storage-format name of a user-given one.

    Args:
        name: e.g. ``"fp4"``, ``"MXFP4"``, ``"bf16"``, ``"bfloat16"``.
        fp4_flavor: what plain ``"fp4"`` means on this chip (``"nvfp4"`` on NVIDIA Blackwell,
            ``"mxfp4"`` elsewhere).

    Raises:
        ValueError: unknown format, naming the valid ones.
        TypeError: not a name.

    Example:
        >>> resolve_format("FP4", "mxfp4")
        'mxfp4'
    """
    if not isinstance(name, str):
        raise TypeError(f"a number format is a name such as 'fp8' or 'bf16', got "
                        f"{type(name).__name__} {name!r}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key == "fp4":
        key = fp4_flavor
    if key not in FORMAT_BYTES:
        valid = sorted(set(FORMAT_BYTES) | {"fp4"})
        raise ValueError(f"unknown number format {name!r}; valid formats: {', '.join(valid)}")
    return key


def bytes_per_element(name: str, fp4_flavor: str = "nvfp4") -> float:
    """Storage bytes per element of a format, block scales included."""
    return FORMAT_BYTES[resolve_format(name, fp4_flavor)]


#: Weight formats whose matmuls take wider activations on chips of a given FP4 flavour, and
#: the class they then run at. MXFP4 weights on NVIDIA Blackwell (whose own FP4 is NVFP4)
#: run with MXFP8 activations: TensorRT-LLM's MoE support matrix for gpt-oss lists MXFP8
#: activations x MXFP4 weights for B200/GB200/B300/GB300 on its default (TRTLLM) backend
#: ("Deployment Guide for GPT-OSS on TensorRT-LLM - Blackwell Hardware", MoE Backend Support
#: Matrix, nvidia.github.io/TensorRT-LLM/deployment-guide/deployment-guide-for-gpt-oss-on-
#: trtllm.html), and vLLM ships FlashInfer's MXFP4 x MXFP8 MoE kernels for Blackwell, built
#: for gpt-oss (vllm-project/vllm issue 35528). A mixed FP4 x FP8 tensor-core MMA runs at the
#: FP8 rate; only FP4 x FP4 reaches the FP4 rate.
MIXED_INPUT_CLASS: dict[tuple[str, str], str] = {("mxfp4", "nvfp4"): "fp8"}


def compute_class(name: str, native: tuple[str, ...], fp4_flavor: str = "nvfp4") -> str:
    """The compute class a matmul with operands in `name` runs at on a chip.

    A format the chip runs natively keeps its class, unless the engines run it with wider
    activations on that chip (`MIXED_INPUT_CLASS`: MXFP4 on NVIDIA Blackwell runs at FP8);
    otherwise the weights are dequantized and the matmul runs at BF16 (e.g. MXFP4 weights on
    H100/H200 run as W4A16, as vLLM's Marlin kernels do).

    Example:
        >>> compute_class("mxfp4", ("bf16", "fp8", "int8"))
        'bf16'
        >>> compute_class("mxfp4", ("bf16", "fp8", "int8", "fp4"), "nvfp4")
        'fp8'
    """
    fmt = resolve_format(name, fp4_flavor)
    cls = FORMAT_CLASS[fmt]
    if cls not in native:
        return "bf16"
    mixed = MIXED_INPUT_CLASS.get((fmt, fp4_flavor))
    return mixed if mixed is not None and mixed in native else cls
