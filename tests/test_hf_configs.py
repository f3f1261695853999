"""Shipped Hugging Face configs (perfmodel/data/hf_configs/): each resolves by its Hugging
Face id, cites its source, and gives the parameter count published for the model."""

import json
from importlib import resources

import pytest

import perfmodel as pm
from perfmodel.calibration import model_of
from perfmodel.calibration_power import resolve_model

# Hugging Face id -> published total parameter count, with its source. Counts from
# `Model.total_params` leave out norms and biases (< 0.1% for these models).
PUBLISHED = {
    # Qwen3 model cards (huggingface.co/Qwen/Qwen3-8B, Qwen3-14B): "Number of Parameters:
    # 8.2B" / "14.8B".
    "Qwen/Qwen3-8B": 8.2e9,
    "Qwen/Qwen3-14B": 14.8e9,
    # Qwen3-Coder model cards: "30.5B in total and 3.3B activated", "480B in total and 35B
    # activated"; the FP8 checkpoint is the same model.
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": 30.5e9,
    "Qwen/Qwen3-Coder-480B-A35B-Instruct": 480e9,
    "Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8": 480e9,
    # keras-team/keras-hub keras_hub/src/models/gemma/gemma_presets.py: gemma2_instruct_2b_en
    # 2,614,341,888; gemma2_instruct_9b_en 9,241,705,984; gemma2_instruct_27b_en
    # 27,227,128,320 (Gemma 2 report, arXiv 2408.00118, Table 2: non-embedding
    # 2,024,517,888 / 8,324,201,984 / 26,047,480,320 plus a 256,000-entry embedding).
    "google/gemma-2-2b-it": 2_614_341_888,
    "google/gemma-2-9b-it": 9_241_705_984,
    "google/gemma-2-27b-it": 27_227_128_320,
    # keras-hub keras_hub/src/models/gemma3/gemma3_presets.py, text-only presets
    # gemma3_instruct_12b_text 11,765,788,416 and gemma3_instruct_27b_text 27,009,002,240
    # (the vision tower, ~0.4B, is not part of the language model modelled here).
    "google/gemma-3-12b-it": 11_765_788_416,
    "google/gemma-3-27b-it": 27_009_002_240,
    # keras-hub gemma_presets.py: code_gemma_1.1_2b_en 2,506,172,416; code_gemma_7b_en
    # 8,537,680,896.
    "google/codegemma-1.1-2b": 2_506_172_416,
    "google/codegemma-7b": 8_537_680_896,
    # Mistral 7B (mistral.ai/news/announcing-mistral-7b, arXiv 2310.06825): "7.3B";
    # Mistral NeMo (mistral.ai/news/mistral-nemo, model card): "12B"; Mistral Large 2
    # (mistral.ai/news/mistral-large-2407, model card): "123B".
    "mistralai/Mistral-7B-Instruct-v0.3": 7.3e9,
    "mistralai/Mistral-Nemo-Instruct-2407": 12e9,
    "mistralai/Mistral-Large-Instruct-2407": 123e9,
    # StarCoder2 model cards: "3B", "7B"; starcoder2-15b's README gives "Memory footprint:
    # 32251.33 MB" in bf16, i.e. 16.13e9 parameters (its nominal "15B" is 6% under the
    # checkpoint, whose untied 2 x 49152 x 6144 embeddings add 0.6B).
    "bigcode/starcoder2-3b": 3e9,
    "bigcode/starcoder2-7b": 7e9,
    "bigcode/starcoder2-15b": 32251.33e6 / 2,
    # Code Llama paper (arXiv 2308.12950) / model cards: 7B, 13B, 34B, 70B. The 7B model has
    # the LLaMA-7B shape, whose exact size the LLaMA paper (arXiv 2302.13971, Table 2) gives
    # as 6.7B; the nominal 7B is 3.7% above it.
    "codellama/CodeLlama-7b-hf": 6.7e9,
    "codellama/CodeLlama-13b-hf": 13e9,
    "codellama/CodeLlama-34b-hf": 34e9,
    "codellama/CodeLlama-70b-hf": 70e9,
    # Phi-3 technical report (arXiv 2404.14219) and model cards: 3.8B, 14B.
    "microsoft/Phi-3-mini-4k-instruct": 3.8e9,
    "microsoft/Phi-3-medium-4k-instruct": 14e9,
}


def _folder():
    return resources.files("perfmodel").joinpath("data", "hf_configs")


def _config(hf_id):
    return json.loads(_folder().joinpath(hf_id.replace("/", "__") + ".json").read_text())


def test_every_shipped_config_is_checked():
    shipped = {p.name for p in _folder().iterdir() if p.name.endswith(".json")}
    assert shipped == {k.replace("/", "__") + ".json" for k in PUBLISHED}


@pytest.mark.parametrize("hf_id", sorted(PUBLISHED))
def test_total_params_match_published(hf_id):
    model = resolve_model(hf_id)
    assert model is not None, hf_id
    assert model.name == hf_id                # resolved from the shipped config, not a preset
    with pytest.raises(ValueError):
        pm.get_model(hf_id)
    assert model.total_params == pytest.approx(PUBLISHED[hf_id], rel=0.03)
    assert model_of(hf_id) == model           # the calibration loader reads the same file


@pytest.mark.parametrize("hf_id", sorted(PUBLISHED))
def test_config_cites_its_source(hf_id):
    config = _config(hf_id)
    assert isinstance(config.get("_source"), str) and config["_source"].strip()
    assert config.get("model_type")


def test_starcoder2_non_gated_mlp_and_sliding_window():
    m = resolve_model("bigcode/starcoder2-15b")
    assert not m.gated_mlp and m.dense_ffn_params == 2 * 6144 * 24576
    assert (m.sliding_window, m.num_sliding_layers) == (4096, 40)
    assert not m.tied_embeddings
    assert resolve_model("bigcode/starcoder2-3b").tied_embeddings   # no key: HF default


def test_gemma2_alternates_local_and_global_layers():
    m = resolve_model("google/gemma-2-9b-it")
    assert (m.num_layers, m.num_sliding_layers, m.sliding_window) == (42, 21, 4096)
    assert m.tied_embeddings and m.head_dim == 256


def test_gemma3_five_local_layers_in_six():
    m = resolve_model("google/gemma-3-12b-it")
    assert (m.num_layers, m.num_sliding_layers, m.sliding_window) == (48, 40, 1024)
    m = resolve_model("google/gemma-3-27b-it")
    assert (m.num_layers, m.num_sliding_layers, m.head_dim) == (62, 52, 128)
    assert m.tied_embeddings


def test_gemma3_pattern_without_layer_types():
    base = dict(model_type="gemma3_text", num_hidden_layers=48, hidden_size=3840,
                num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                intermediate_size=15360, vocab_size=262208, sliding_window=1024)
    assert pm.from_hf_config({**base, "sliding_window_pattern": 6}).num_sliding_layers == 40
    assert pm.from_hf_config({**base, "sliding_window_pattern": 4}).num_sliding_layers == 36


def test_mistral_windows_and_head_dim():
    assert resolve_model("mistralai/Mistral-7B-Instruct-v0.3").num_sliding_layers == 0
    nemo = resolve_model("mistralai/Mistral-Nemo-Instruct-2407")
    assert nemo.head_dim == 128 and nemo.hidden // nemo.num_heads == 160
    assert nemo.kv_values_per_token_layer == 2 * 8 * 128


def test_phi3_gqa_and_fp8_checkpoint():
    medium = resolve_model("microsoft/Phi-3-medium-4k-instruct")
    assert (medium.num_heads, medium.num_kv_heads, medium.gated_mlp) == (40, 10, True)
    fp8 = resolve_model("Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8")
    assert (fp8.weight_format, fp8.expert_format) == ("fp8", "fp8")
    base = resolve_model("Qwen/Qwen3-Coder-480B-A35B-Instruct")
    assert base.weight_format == "bf16" and base.total_params == fp8.total_params


def test_gpt_bigcode_multi_query_and_default_ffn():
    m = pm.from_hf_config({"model_type": "gpt_bigcode", "n_layer": 40, "n_embd": 6144,
                           "n_head": 48, "n_inner": None, "vocab_size": 49152,
                           "multi_query": True})
    assert (m.num_kv_heads, m.dense_ffn, m.gated_mlp, m.tied_embeddings) == (1, 24576, False,
                                                                             True)
