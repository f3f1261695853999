"""Presets: every chip and model builds, the names used by the shared data resolve, parameter
counts match the published totals, and unknown names fail with the valid ones listed."""

from __future__ import annotations

import csv
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import perfmodel as pm
from perfmodel.formats import COMPUTE_CLASSES
from perfmodel.presets import chip_info, chip_key, model_info, model_key

#: The project's own copy of the published data (with its source column).
CALIBRATION_DATA = pathlib.Path(__file__).resolve().parents[1] / "calibration" / "data"
#: The shared originals, beside the repository (present for developers and CI).
DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


def _rows(path):
    with open(path) as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("name", pm.chip_names())
@pytest.mark.parametrize("calibrated", [True, False])
def test_every_chip_builds(name, calibrated):
    chip = pm.get_chip(name, calibrated=calibrated)
    assert isinstance(chip, pm.Chip) and chip.name == name
    for path, leaf in jax.tree_util.tree_leaves_with_path(chip):
        assert bool(jnp.all(jnp.isfinite(leaf))), jax.tree_util.keystr(path)
        assert bool(jnp.all(leaf >= 0)), jax.tree_util.keystr(path)
    assert chip.peak_flops.shape == (len(COMPUTE_CLASSES),)
    assert float(chip.peak_flops[0]) > 1e13 and float(chip.hbm_bandwidth) > 1e11
    assert "bf16" in chip.native_classes
    # A class the chip lacks runs at the BF16 rate; native FP8/FP4 are not slower than BF16
    # (native INT8 may be: Blackwell Ultra cut it to ~0.15 PFLOPS).
    for i, cls in enumerate(COMPUTE_CLASSES):
        if cls not in chip.native_classes:
            assert float(chip.peak_flops[i]) == float(chip.peak_flops[0])
        elif cls in ("fp8", "fp4"):
            assert float(chip.peak_flops[i]) >= float(chip.peak_flops[0])
    assert 0 < float(chip.idle_power) < float(chip.tdp) <= float(chip.allin_power)
    eff = chip.efficiency
    for fraction in (eff.compute_max, eff.bandwidth_max, eff.attention_max):
        assert 0 < float(fraction) <= 1
    assert chip_info(name)["source"]


@pytest.mark.parametrize("name", pm.model_names())
def test_every_model_builds(name):
    model = pm.get_model(name)
    assert isinstance(model, pm.Model) and model.name == name
    assert 0 < model.active_params <= model.total_params
    assert model.kv_values_per_token_layer > 0
    assert model_info(name)["source"]


# The distinct (hardware, label as logged) and (model, id as logged) pairs of
# shared/data/benchmarks_inferencemax.csv, copied so the test runs without the data directory;
# where the file is present it is read as well, so new rows are covered.
INFERENCEMAX_HARDWARE = [("b200", "b200"), ("b200", "b200-trt"), ("gb200", "gb200"),
                         ("h200", "h200"), ("mi300x", "mi300x"), ("mi355x", "mi355x"),
                         ("mi355x", "mi355x-amd_0")]
INFERENCEMAX_MODELS = [("DeepSeek-R1", "/models/DeepSeek-R1"),
                       ("DeepSeek-R1", "deepseek-ai/DeepSeek-R1"),
                       ("DeepSeek-R1-0528", "/mnt/lustre01/models/deepseek-r1-0528-fp4-v2"),
                       ("DeepSeek-R1-0528", "amd/DeepSeek-R1-0528-MXFP4-Preview"),
                       ("DeepSeek-R1-0528", "deepseek-ai/DeepSeek-R1-0528"),
                       ("DeepSeek-R1-0528", "nvidia/DeepSeek-R1-0528-FP4-V2"),
                       ("gpt-oss-120b", "/mnt/lustre01/models/gpt-oss-120b"),
                       ("gpt-oss-120b", "openai/gpt-oss-120b")]


def _inferencemax_pairs():
    hardware, models = set(INFERENCEMAX_HARDWARE), set(INFERENCEMAX_MODELS)
    for row in _rows(CALIBRATION_DATA / "benchmarks_inferencemax.csv"):
        hardware.add((row["hardware"], row["hw_label_as_logged"]))
        models.add((row["model"], row["model_id_as_logged"]))
    return sorted(hardware), sorted(models)


def test_inferencemax_names_resolve():
    """Every `hardware` and `model` value of the InferenceMAX table (and the labels as logged)
    resolves to the preset it means."""
    hardware, models = _inferencemax_pairs()
    for name, logged in hardware:
        assert chip_key(name) == name.lower()
        assert chip_key(logged) == name.lower(), logged
        pm.get_chip(name)
    for name, logged in models:
        want = "deepseek-r1" if name.lower().startswith("deepseek-r1") else "gpt-oss-120b"
        assert model_key(name) == want, name
        assert model_key(logged) == want, logged
        pm.get_model(name)


def test_models_csv_hf_ids_resolve():
    """Each Hugging Face id of models.csv (the package's copy of shared/data/models.csv)
    resolves to the preset built from that very row."""
    from perfmodel.presets import _model_rows
    rows = list(_model_rows().values())
    assert len(rows) >= len(pm.model_names())
    for row in rows:
        key = model_key(row["hf_id"])
        assert model_info(key)["model"] == row["model"], row["hf_id"]
        model = pm.get_model(row["hf_id"])
        assert model.num_layers == int(row["layers"]) and model.hidden == int(row["hidden"])
    shared = DATA / "models.csv"
    if shared.is_file():   # the shared table and the package's copy list the same hf_ids
        assert {r["hf_id"] for r in _rows(shared)} == {r["hf_id"] for r in rows}


def test_mlperf_names_resolve():
    expected_models = {"deepseek-r1": "deepseek-r1", "llama2-70b-99": "llama-2-70b",
                       "llama2-70b-99.9": "llama-2-70b", "llama3.1-405b": "llama-3.1-405b",
                       "llama3.1-8b": "llama-3.1-8b", "mixtral-8x7b": "mixtral-8x7b"}
    for name, key in expected_models.items():
        assert model_key(name) == key
    expected_chips = {"NVIDIA B200-SXM-180GB": "b200", "NVIDIA GB200": "gb200",
                      "NVIDIA GB300": "gb300", "NVIDIA H100-SXM-80GB": "h100",
                      "NVIDIA H200-SXM-141GB": "h200", "NVIDIA H200-SXM-141GB-CTS": "h200",
                      "AMD Instinct MI300X 192GB HBM3": "mi300x",
                      "AMD Instinct MI325X 256GB HBM3e": "mi325x",
                      "AMD Instinct MI355X 288GB HBM3e": "mi355x"}
    for name, key in expected_chips.items():
        assert chip_key(name) == key, name


# Published active counts differ in whether the input-embedding table counts as "active":
# perfmodel's active_params leaves it out (a lookup of one row, no FLOPs, no streaming).
# Meta's "17B active" for Llama 4 includes it (16.14 B + 1.03 B of embedding = 17.17 B), as do
# the nominal sizes of dense models ("8B", "70B", "405B": total parameters).
_ACTIVE_WITH_EMBEDDING = {"llama-4-scout", "llama-4-maverick"}


def _published(row, key):
    return float(row[key]) * 1e9 if row.get(key) else None


def _has_counts(name):
    row = model_info(name)
    return bool(row.get("total_params_B") or row.get("active_params_B"))


def test_only_mixtral_8x22b_lacks_published_counts():
    """The parameter-count check below covers every preset but the one models.csv gives no
    figures for; a new preset without figures must be named here on purpose."""
    assert [n for n in pm.model_names() if not _has_counts(n)] == ["mixtral-8x22b"]


@pytest.mark.parametrize("name", [n for n in pm.model_names() if _has_counts(n)])
def test_parameter_counts_match_models_csv(name):
    """Within 3 %: the figures are rounded by their publishers ("1 trillion" for Kimi K2,
    whose config gives 1.026e12 (2.6 %); "30B" for Qwen3-30B-A3B at 30.5e9 (1.8 %); "70B" for
    Llama-2-70B at 69.0e9 (1.5 %)); all others agree within 1.2 % (DeepSeek-V3: 671.0e9 of
    671B, 36.6e9 of 37B active; Qwen3-235B-A22B: 21.6e9 of 22B active, 2.0 %)."""
    model = pm.get_model(name)
    row = model_info(name)
    total, active = _published(row, "total_params_B"), _published(row, "active_params_B")
    embedding = model.vocab * model.hidden
    if total is not None:
        np.testing.assert_allclose(model.total_params, total, rtol=0.03)
    if active is not None:
        if not model.is_moe:
            ours = model.total_params        # nominal size of a dense model
        elif name in _ACTIVE_WITH_EMBEDDING:
            ours = model.active_params + embedding
        else:
            ours = model.active_params
        np.testing.assert_allclose(ours, active, rtol=0.03)


def test_llama_4_active_excludes_embedding_gap():
    """Without the embedding table Llama 4's active count falls 5 % short of Meta's 17B: the
    convention above is needed, and it is this table that closes the gap."""
    model = pm.get_model("llama-4-scout")
    assert model.active_params / 17e9 < 0.96
    np.testing.assert_allclose((model.active_params + model.vocab * model.hidden) / 17e9, 1.0,
                               rtol=0.015)


@pytest.mark.parametrize("get, names, kind", [(pm.get_chip, pm.chip_names, "chip"),
                                              (pm.get_model, pm.model_names, "model")])
def test_unknown_names_raise_listing_valid_ones(get, names, kind):
    with pytest.raises(ValueError, match=f"unknown {kind}") as info:
        get("no-such-accelerator-xyz")
    message = str(info.value)
    for valid in names():
        assert valid in message


def test_names_are_case_insensitive():
    assert pm.get_chip("GB200") is pm.get_chip("gb200") or \
        pm.get_chip("GB200").name == pm.get_chip("gb200").name
    assert pm.get_model("DeepSeek-R1-0528").name == "deepseek-r1"
    assert pm.get_model("openai/GPT-OSS-120B").name == "gpt-oss-120b"
