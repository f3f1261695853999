"""Chip and model presets, built from the data files shipped inside the package.

`data/chips.csv` carries one row per chip with its `source` and the `assumptions` made where
a spec is unknown (Jalapeno's HBM capacity and slice count, TPU power): every assumed number
is listed there, never silent, and can be overridden. `data/models.csv` is a copy of the
published Hugging Face configurations (with `source`).
"""

from __future__ import annotations

import csv
import difflib
import functools
import json
import os
import re
from importlib import resources

from .architecture import Model
from .hardware import Chip, from_datasheet

#: Model keys -> row name in models.csv, aliases, released (non-expert, expert) formats.
_MODELS = {
    "gpt-oss-120b": ("gpt-oss-120b", ("openai/gpt-oss-120b", "gptoss-120b"), ("bf16", "mxfp4")),
    "gpt-oss-20b": ("gpt-oss-20b", ("openai/gpt-oss-20b",), ("bf16", "mxfp4")),
    "deepseek-v3": ("DeepSeek-V3", ("deepseek-ai/deepseek-v3",), ("fp8", "fp8")),
    "deepseek-r1": ("DeepSeek-R1", ("deepseek-r1-0528", "deepseek-ai/deepseek-r1", "dsr1",
                                    "deepseek r1"), ("fp8", "fp8")),
    "kimi-k2": ("Kimi-K2-Instruct", ("kimi-k2-instruct", "moonshotai/kimi-k2-instruct"),
                ("fp8", "fp8")),
    "kimi-k2.5": ("Kimi-K2.5", ("moonshotai/kimi-k2.5", "kimi k2.5"), ("bf16", "int4")),
    "llama-2-70b": ("Llama-2-70B", ("meta-llama/llama-2-70b-hf", "llama2-70b",
                                    "llama-2-70b-chat-hf"), ("bf16", "bf16")),
    "llama-3.1-8b": ("Llama-3.1-8B", ("meta-llama/meta-llama-3.1-8b", "llama3.1-8b",
                                      "meta-llama-3.1-8b", "llama-3.1-8b-instruct"),
                     ("bf16", "bf16")),
    "llama-3.1-70b": ("Llama-3.1-70B", ("meta-llama/meta-llama-3.1-70b", "llama3.1-70b",
                                        "meta-llama-3.1-70b", "llama-3.3-70b"),
                      ("bf16", "bf16")),
    "llama-3.1-405b": ("Llama-3.1-405B", ("meta-llama/meta-llama-3.1-405b", "llama3.1-405b",
                                          "meta-llama-3.1-405b"), ("bf16", "bf16")),
    # The 2507 instruct and thinking releases keep the base architecture (their HF configs).
    "qwen3-235b-a22b": ("Qwen3-235B-A22B", ("qwen/qwen3-235b-a22b",
                                            "qwen3-235b-a22b-thinking-2507"),
                        ("bf16", "bf16")),
    "qwen3-32b": ("Qwen3-32B", ("qwen/qwen3-32b",), ("bf16", "bf16")),
    "qwen3-30b-a3b": ("Qwen3-30B-A3B", ("qwen/qwen3-30b-a3b", "qwen3-30b-a3b-thinking-2507"),
                      ("bf16", "bf16")),
    "mixtral-8x7b": ("Mixtral-8x7B", ("mistralai/mixtral-8x7b-v0.1", "mixtral-8x7b-instruct"),
                     ("bf16", "bf16")),
    "mixtral-8x22b": ("Mixtral-8x22B", ("mistralai/mixtral-8x22b-v0.1",
                                        "mixtral-8x22b-instruct"), ("bf16", "bf16")),
    "llama-4-scout": ("Llama-4-Scout-17B-16E", ("meta-llama/llama-4-scout-17b-16e-instruct",
                                                "llama-4-scout-17b-16e"), ("bf16", "bf16")),
    "llama-4-maverick": ("Llama-4-Maverick-17B-128E",
                         ("meta-llama/llama-4-maverick-17b-128e-instruct",
                          "llama-4-maverick-17b-128e"), ("bf16", "bf16")),
}


def _read(name: str) -> list[dict]:
    text = resources.files("perfmodel").joinpath("data", name).read_text()
    return list(csv.DictReader(text.splitlines()))


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


@functools.cache
def _chip_rows() -> dict[str, dict]:
    return {row["key"]: row for row in _read("chips.csv")}


@functools.cache
def _model_rows() -> dict[str, dict]:
    return {row["model"]: row for row in _read("models.csv")}


def chip_names() -> tuple[str, ...]:
    """Keys of every chip preset."""
    return tuple(_chip_rows())


def model_names() -> tuple[str, ...]:
    """Keys of every model preset."""
    return tuple(_MODELS)


#: Qualifier tokens a preset name may carry after a separator ("-", "_", " ") without naming
#: another chip or model: form factor, memory size, host CPU, partition mode, serving stack,
#: precision, release date or version, instruction tuning, MLPerf accuracy target
#: ("b200-sxm-180gb", "gb200-186gb_aarch64", "qwen3-32b-fp8", "mixtral-8x7b-instruct-v0.1",
#: "llama2-70b-99.9"). Anything else after a preset's name ("rubin-cpx", "kimi-k2-thinking",
#: "deepseek-r1-distill-llama-8b") is another product, so it is an error, never a match.
_QUALIFIER = re.compile(
    r"(sxm\d?|nvl\d*|pcie|hgx|dgx|oam|hbm\d?e?|\d+g(b)?(x\d+)?|\d+w|aarch64|x86|"
    r"nps\d|spx|cts|maxq|maxp|trt|trtllm|tensorrt|tensorrt-llm|sglang|vllm|dynamo|disagg|"
    r"mtp|bf16|fp16|fp8|fp4|nvfp4|mxfp4|int4|int8|w4a16|w8a8|awq|gptq|dynamic|"
    r"instruct|chat|it|hf|base|preview|v\d+(\.\d+)*|\d+(\.\d+)?)")
_SEPARATORS = re.compile(r"[-_ ]+")


def _qualified(key: str, name: str) -> bool:
    """Whether `name` is `key` followed only by separators and qualifier tokens."""
    if not name.startswith(key):
        return False
    rest = name[len(key):]
    if not rest:
        return True
    if not _SEPARATORS.match(rest):
        return False
    return all(_QUALIFIER.fullmatch(t) for t in _SEPARATORS.split(rest) if t)


#: Vendor words a name may start with ("NVIDIA GB200", "AMD Instinct MI355X 288GB HBM3e").
_VENDOR = re.compile(r"^(nvidia|amd instinct|amd|google|openai|groq)[ -]+")


def _exact(key: str, keys, aliases: dict[str, str]) -> str:
    key = _VENDOR.sub("", key) or key
    for name in (key, key.split("/")[-1]):
        if name in keys:
            return name
        if name in aliases:
            return aliases[name]
    # The longest name that, with qualifiers only, makes up the given one.
    for name in (key, key.split("/")[-1]):
        for cand in sorted([*keys, *aliases], key=len, reverse=True):
            if _qualified(cand, name):
                return aliases.get(cand, cand)
    return ""


def _resolve(name: str, keys, aliases: dict[str, str], kind: str, valid,
             label: bool = False) -> str:
    if not isinstance(name, str):
        raise ValueError(f"{kind} name must be a string, got {type(name).__name__} {name!r}")
    key = _norm(name)
    found = _exact(key, keys, aliases)
    if not found and label:
        # A measurement file's system description ("Dell PowerEdge XE9680 (8x
        # H100-SXM-80GB, TensorRT)"): the first word, or "_"/"."-separated part of one, that
        # is itself an exact name; counts such as "8x" are dropped.
        for word in re.split(r"[\s,;()\[\]/]+", key):
            word = re.sub(r"^(\d+x)+", "", word)
            for part in (word, *re.split(r"[_.]", word)):
                found = part and _exact(part, keys, aliases)
                if found:
                    break
            if found:
                break
    if found:
        return found
    close = difflib.get_close_matches(key, [*keys, *aliases], n=3, cutoff=0.6)
    hint = (f"; did you mean {' or '.join(dict.fromkeys(aliases.get(c, c) for c in close))}?"
            if close else ";")
    raise ValueError(f"unknown {kind} {name!r}{hint} valid {kind}s: {', '.join(valid)}")


def chip_key(name: str, label: bool = False) -> str:
    """Canonical preset key of a chip name: a key or alias (case-insensitive), optionally
    with qualifiers (`_QUALIFIER`: "b200-sxm-180gb", "h200_sxm"). With `label`, also a
    measurement file's system description that names one ("Dell PowerEdge XE9680 (8x
    H100-SXM-80GB, TensorRT)").

    Raises:
        ValueError: no such chip, with the closest names ("did you mean gb200?").

    Example:
        >>> chip_key("B200-TRT"), chip_key("NVIDIA H200-SXM-141GB (8x, MaxQ)", label=True)
        ('b200', 'h200')
        >>> chip_key("gb2000")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: unknown chip 'gb2000'; did you mean gb200 or b200? valid chips: ...
    """
    rows = _chip_rows()
    aliases = {}
    for key, row in rows.items():
        for alias in filter(None, row["aliases"].split("|")):
            aliases[_norm(alias)] = key
        aliases[_norm(row["name"])] = key
    return _resolve(name, rows.keys(), aliases, "chip", chip_names(), label)


def model_key(name: str, label: bool = False) -> str:
    """Canonical preset key of a model name: a key or alias (case-insensitive), a Hugging
    Face id of one, optionally with qualifiers ("Qwen/Qwen3-32B-FP8"); with `label`, also a
    longer description that names one.

    Raises:
        ValueError: no such model, with the closest names.

    Example:
        >>> model_key("DeepSeek-R1-0528"), model_key("openai/gpt-oss-120b")
        ('deepseek-r1', 'gpt-oss-120b')
    """
    aliases = {}
    for key, (row, names, _) in _MODELS.items():
        aliases[_norm(row)] = key
        for alias in names:
            aliases[_norm(alias)] = key
    return _resolve(name, _MODELS.keys(), aliases, "model", model_names(), label)


def _num(row, key):
    value = row.get(key, "")
    return float(value) if value not in ("", None) else None


def _datasheet_kwargs(key: str) -> dict:
    row = _chip_rows()[key]
    tdp = _num(row, "tdp_w")
    idle = _num(row, "idle_w")
    dims = tuple(int(x) for x in row["torus_dims"].split("x")) if row["torus_dims"] else (16, 16)
    allin = _num(row, "allin_kw")
    return dict(
        family=row["family"], bf16_tflops=_num(row, "bf16_tflops"),
        fp8_tflops=_num(row, "fp8_tflops"), int8_tops=_num(row, "int8_tops"),
        fp4_tflops=_num(row, "fp4_tflops"), fp4_flavor=row["fp4_flavor"],
        hbm_gb=_num(row, "hbm_gb"), hbm_tb_s=_num(row, "hbm_tb_s"),
        sram_mb=_num(row, "sram_mb") or 0.0, num_slices=_num(row, "num_slices") or 1.0,
        slice_tb_s=_num(row, "slice_tb_s"), scaleup_gb_s=_num(row, "scaleup_gb_s"),
        scaleup_latency_us=_num(row, "scaleup_latency_us"),
        scaleup_topology=row["scaleup_topology"], torus_dims=dims,
        scaleup_algorithms=row.get("scaleup_algorithms") or "ring",
        domain_size=int(_num(row, "domain_size")), scaleout_gb_s=_num(row, "scaleout_gb_s"),
        scaleout_latency_us=_num(row, "scaleout_latency_us"), tdp_w=tdp,
        idle_w=idle if idle is not None else 0.15 * tdp,
        allin_kw=allin if allin is not None else 2.0 * tdp / 1e3,
        prompt_attention_speedup=_num(row, "prompt_attention_speedup") or 1.0)


@functools.cache
def _build_chip(key: str) -> Chip:
    return from_datasheet(key, **_datasheet_kwargs(key))


def get_chip(name: str, calibrated: bool = True, label: bool = False, **overrides) -> Chip:
    """A chip preset by name, with the fitted latency and power terms of its family when
    `calibrated` and a fit exists (`perfmodel.fitted.apply`, the rule every command uses).

    Args:
        name: preset key or any known label ("GB200", "b200-trt", "H100 80GB HBM3").
        calibrated: apply the family's fitted parameters.
        label: also accept a measurement file's system description (`chip_key`).
        **overrides: datasheet-unit arguments of `hardware.from_datasheet` replacing the
            preset's (e.g. ``hbm_gb=216, num_slices=4`` for a Jalapeno variant).

    Raises:
        ValueError: unknown name, listing the valid ones; unknown override names.

    Example:
        >>> chip = get_chip("GB200")
        >>> chip.name, chip.domain_size, round(float(chip.hbm_bandwidth) / 1e12, 1)
        ('gb200', 72, 8.0)
        >>> round(float(get_chip("jalapeno", hbm_gb=216).hbm_capacity) / 1e9)
        216
    """
    key = chip_key(name, label)
    if overrides:
        kwargs = _datasheet_kwargs(key)
        unknown = sorted(set(overrides) - set(kwargs))
        if unknown:
            raise ValueError(f"unknown chip override(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(kwargs))}")
        chip = from_datasheet(key, **{**kwargs, **overrides})
    else:
        chip = _build_chip(key)
    if calibrated:
        from . import fitted
        chip = fitted.apply(chip)
    return chip


def chip_info(name: str) -> dict:
    """The preset's data row: sources and documented assumptions."""
    return dict(_chip_rows()[chip_key(name)])


def _int(row, key, default=0):
    value = row.get(key, "")
    return int(float(value)) if value not in ("", None) else default


@functools.cache
def _build_model(key: str) -> Model:
    row_name, _, (weight_fmt, expert_fmt) = _MODELS[key]
    row = _model_rows()[row_name]
    attention = "mla" if row["attention_type"].startswith("MLA") else "gqa"
    layers, hidden, heads = _int(row, "layers"), _int(row, "hidden"), _int(row, "heads")
    head_dim = _int(row, "head_dim") or hidden // heads
    kwargs = dict(name=key, num_layers=layers, hidden=hidden, num_heads=heads,
                  num_kv_heads=_int(row, "kv_heads") or heads, head_dim=head_dim,
                  vocab=_int(row, "vocab"), attention=attention,
                  max_context=_int(row, "max_position_embeddings"),
                  weight_format=weight_fmt, expert_format=expert_fmt)
    if attention == "mla":
        kwargs.update(kv_lora_rank=_int(row, "kv_lora_rank"),
                      q_lora_rank=_int(row, "q_lora_rank"),
                      qk_rope_head_dim=_int(row, "qk_rope_head_dim"),
                      qk_nope_head_dim=_int(row, "qk_nope_head_dim"),
                      v_head_dim=_int(row, "v_head_dim"),
                      head_dim=_int(row, "qk_nope_head_dim") + _int(row, "qk_rope_head_dim"),
                      mtp_layers=1 if key.startswith("deepseek") else 0)
    experts = _int(row, "num_routed_experts")
    pattern = row.get("moe_layer_pattern", "")
    if experts:
        step = 2 if "every 2" in pattern else 1
        first = _int(row, "first_dense_layers")
        kwargs.update(num_experts=experts, experts_per_token=_int(row, "experts_per_token"),
                      moe_ffn=_int(row, "moe_intermediate_size"),
                      num_shared_experts=_int(row, "shared_experts"),
                      first_dense_layers=first, moe_layer_step=step,
                      dense_ffn=_int(row, "intermediate_size_dense") if (first or step > 1)
                      else 0)
    else:
        kwargs["dense_ffn"] = _int(row, "intermediate_size_dense")
    window = _int(row, "sliding_window")
    if window:
        kwargs.update(sliding_window=window, num_sliding_layers=_int(row, "sliding_window_layers"))
    if "chunked local attention" in row["attention_type"]:
        # Llama 4: chunked local attention (8192) on three of every four layers.
        kwargs.update(sliding_window=8192, num_sliding_layers=layers - layers // 4)
    return Model(**kwargs)


def get_model(name: str, label: bool = False) -> Model:
    """A model preset by name (case-insensitive; HF ids and InferenceMAX names accepted).

    Raises:
        ValueError: unknown name, listing the valid ones.

    Example:
        >>> m = get_model("DeepSeek-R1-0528")
        >>> m.attention, round(m.total_params / 1e9)
        ('mla', 671)
    """
    return _build_model(model_key(name, label))


@functools.cache
def _hf_config_files() -> dict[str, str]:
    folder = resources.files("perfmodel").joinpath("data", "hf_configs")
    if not folder.is_dir():
        return {}
    return {p.name[:-5].lower(): p.name for p in folder.iterdir() if p.name.endswith(".json")}


@functools.cache
def find_model(name: str, label: bool = False) -> Model:
    """A model: a path to a Hugging Face `config.json` (or a folder holding one), a preset
    by name, else the Hugging Face config the package ships in
    `perfmodel/data/hf_configs/` (file named after the Hugging Face id with "/" as "__";
    case-insensitive; a trailing parenthetical such as "(GPT-J 6B, ...)" is ignored).

    Raises:
        ValueError: neither exists ("unknown model ...").

    Example:
        >>> find_model("openai/gpt-oss-120b").name, find_model("bigcode/starcoder2-15b").name
        ('gpt-oss-120b', 'bigcode/starcoder2-15b')
    """
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if path.endswith(".json") and os.path.isfile(path):
        return _from_config_file(path)
    base = re.sub(r"\s*\(.*\)$", "", name.strip())
    try:
        return get_model(base, label)
    except ValueError as error:    # not a preset: try a shipped config
        preset_error = str(error)
    files = _hf_config_files()
    key = base.replace("/", "__").lower()
    if key not in files:
        raise ValueError(f"{preset_error} (no shipped Hugging Face config either: add its "
                         f"config.json, with a _source key, to perfmodel/data/hf_configs/ as "
                         f"{base.replace('/', '__')}.json)")
    from .architecture import from_hf_config
    config = json.loads(resources.files("perfmodel").joinpath(
        "data", "hf_configs", files[key]).read_text())
    config.pop("_source", None)
    return from_hf_config(config, name=base)


def _from_config_file(path: str) -> Model:
    """A model from a local Hugging Face `config.json`, named after its `_name_or_path`,
    else the folder that holds it (what `huggingface-cli download --local-dir` makes)."""
    from .architecture import from_hf_config

    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--model {path}: not a readable config.json ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model {path}: a config.json holds a JSON object")
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return from_hf_config(config, name=str(config.get("_name_or_path") or folder))


def model_aliases(name: str) -> tuple[str, ...]:
    """The other names a model preset answers to (Hugging Face ids among them)."""
    return _MODELS[model_key(name)][1]


def model_info(name: str) -> dict:
    """The preset's data row (with its source)."""
    return dict(_model_rows()[_MODELS[model_key(name)][0]])
