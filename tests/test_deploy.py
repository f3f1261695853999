"""Engine launch commands (`perfmodel.deploy`, `perfmodel optimize --emit`): only documented
flags, the layout mapped as each engine expresses it, and designs an engine cannot express
refused with the reason."""

import json

import pytest

from perfmodel import deploy
from perfmodel.cli import main
from perfmodel.presets import get_chip, get_model

ENGINES = tuple(deploy.ENGINES)


def _design(layout, concurrency=64, weights="fp8", experts="fp8", kv="fp8", cap=None):
    return {"layout": layout, "chips": 8, "concurrency": concurrency,
            "formats": {"weights": weights, "experts": experts, "kv": kv},
            "power_cap_w": cap}


def _flags(run):
    return {a for a in run.argv if a.startswith("--")}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", ["tp8", "2xtp4", "tp8-ep8", "tp8-ep8-dpa", "tp4-pp2",
                                    "4xtp2-dpa"])
def test_only_documented_flags(engine, layout):
    spec = deploy.ENGINES[engine]
    assert spec.source.startswith(("vLLM", "SGLang", "TensorRT-LLM")) and "https://" in spec.source
    model = get_model("deepseek-r1")   # released in FP8: no quantization step
    run = deploy.launch(engine, _design(layout), model, get_chip("h200"))
    assert _flags(run) <= spec.flags
    assert run.argv[:len(spec.program)] == spec.program
    assert "deepseek-ai/DeepSeek-R1" in run.argv   # the checkpoint, by its Hugging Face id
    assert run.instances * run.chips_per_instance == 8


def test_layouts_as_each_engine_expresses_them():
    model, chip = get_model("deepseek-r1"), get_chip("b200")
    v = deploy.launch("vllm", _design("tp8-ep8-dpa", concurrency=512), model, chip)
    i = v.argv.index
    assert v.argv[i("--data-parallel-size") + 1] == "8" and "--enable-expert-parallel" in v.argv
    assert "--tensor-parallel-size" not in v.argv
    assert v.argv[i("--max-num-seqs") + 1] == "64"   # per DP rank: 512 / 8
    s = deploy.launch("sglang", _design("tp8-ep8-dpa", concurrency=512), model, chip)
    j = s.argv.index
    assert s.argv[j("--tp-size") + 1] == "8" and s.argv[j("--dp-size") + 1] == "8"
    assert "--enable-dp-attention" in s.argv and s.argv[j("--max-running-requests") + 1] == "512"
    t = deploy.launch("trtllm", _design("tp8-ep4-dpa", kv="fp8"), model, chip)
    assert t.argv[t.argv.index("--ep_size") + 1] == "4"
    yaml = t.files["extra_llm_api_options.yaml"]
    assert "enable_attention_dp: true" in yaml and 'dtype: "fp8"' in yaml
    dense = deploy.launch("vllm", _design("2xtp4", weights="fp8", kv="bf16"),
                          get_model("llama-3.1-70b"), chip)
    assert dense.argv[dense.argv.index("--quantization") + 1] == "fp8"   # bf16 release
    assert "--kv-cache-dtype" not in dense.argv and "--enable-expert-parallel" not in dense.argv
    capped = deploy.launch("vllm", _design("tp8", cap=600.0), model, get_chip("h100"))
    assert any("nvidia-smi -pl 600" in n for n in capped.notes)


def test_a_memory_fraction_read_by_another_rule_is_flagged():
    """TensorRT-LLM's KV fraction is of the free memory, vLLM's of all of it
    (`Runtime.fraction_of_free`): a launch whose prediction used the other rule says so."""
    from perfmodel.design import Runtime

    model, chip = get_model("llama-3.1-70b"), get_chip("h200")
    design = _design("tp8", weights="bf16", experts="bf16", kv="fp8")

    def flagged(engine, runtime):
        run = deploy.launch(engine, design, model, chip, runtime=runtime)
        return any("memory fraction" in n for n in run.notes)

    trt = Runtime(fraction_of_free=1.0, reserve_output=1.0)
    assert flagged("trtllm", Runtime()) and not flagged("trtllm", trt)
    assert flagged("vllm", trt) and not flagged("vllm", Runtime())


@pytest.mark.parametrize("engine, design, model, chip, words", [
    ("vllm", _design("tp8"), "deepseek-r1", "jalapeno", ("does not run on jalapeno",)),
    ("trtllm", _design("tp8"), "deepseek-r1", "mi355x", ("does not run", "NVIDIA")),
    ("sglang", _design("tp8"), "deepseek-r1", "tpu-v6e", ("does not run",)),
    ("vllm", _design("tp8-ep4"), "deepseek-r1", "h200", ("EP = TP x DP", "ep4")),
    ("vllm", _design("tp8", weights="nvfp4", experts="nvfp4"), "deepseek-r1", "b200",
     ("quantized", "released fp8")),
    ("trtllm", _design("tp8", weights="fp8", kv="bf16"), "llama-3.1-70b", "h200",
     ("quantized",)),
    ("sglang", _design("tp8", kv="fp4"), "deepseek-r1", "b200", ("no fp4 KV cache",)),
    ("vllm", _design("P[tp4]+D[tp4]"), "deepseek-r1", "h200", ("disaggregat",)),
    ("ollama", _design("tp8"), "deepseek-r1", "h200", ("unknown engine", "vllm")),
])
def test_designs_an_engine_cannot_express_are_refused(engine, design, model, chip, words):
    with pytest.raises(ValueError) as info:
        deploy.launch(engine, design, get_model(model), get_chip(chip))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_optimize_emit(monkeypatch, capsys):
    assert main(["optimize", "--model", "llama-3.1-8b", "--chip", "h200", "--chips", "2",
                 "--isl", "1024", "--osl", "256", "--max-tpot-ms", "10", "--emit", "vllm",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    run = out["launch"]
    assert run["engine"] == "vllm" and run["argv"][:2] == ["vllm", "serve"]
    assert run["instances"] * run["chips_per_instance"] == out["design"]["chips"]
    # A chip the engine does not run on is refused before the search.
    import perfmodel.search as search

    monkeypatch.setattr(search, "optimize", lambda *a, **k: pytest.fail("searched"))
    assert main(["optimize", "--chip", "jalapeno", "--emit", "sglang"]) == 2
    assert "does not run on jalapeno" in capsys.readouterr().err


def test_pareto_emit(capsys):
    argv = ["pareto", "--model", "llama-3.1-8b", "--chip", "h100", "--chips", "2",
            "--precision", "bf16", "--format", "json"]
    assert main([*argv, "--emit", "trtllm", "--at-interactivity", "100"]) == 0
    data = json.loads(capsys.readouterr().out)
    run = data["launch"]
    chosen = max((r for r in data["rows"] if r["interactivity"] >= 100),
                 key=lambda r: r["tput_per_chip_total"])
    seqs = int(run["argv"][run["argv"].index("--max_batch_size") + 1])
    assert seqs * run["instances"] >= round(chosen["concurrency"])
    assert main([*argv, "--emit", "vllm", "--at-interactivity", "1e6"]) == 2
    assert "no point of the front reaches it" in capsys.readouterr().err
    assert main([*argv[:-2], "--format", "csv", "--emit", "vllm"]) == 2
