"""Batch-policy tuning (`perfmodel.policy`) and `perfmodel policy`."""

import json
import math

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

import perfmodel as pm
from perfmodel import policy, surrogate
from perfmodel.cli import main

CHIP, MODEL = pm.get_chip("h100"), pm.get_model("llama-3.1-8b")
LOAD = surrogate.Load(rate=4.0, input_len=512, output_len=64)


@given(budget=st.floats(1.0, 1e5), seats=st.floats(0.1, 5e3), chunk=st.floats(1.0, 1e4))
def test_rounded_policy_is_engine_valid(budget, seats, chunk):
    p = policy.rounded(jnp.asarray([budget, seats, chunk]), LOAD)
    b, s = float(p.max_num_batched_tokens), float(p.max_num_seqs)
    c = float(p.long_prefill_token_threshold)
    assert s >= 1 and s == round(s)
    assert b >= s and (b % 16 == 0 or b == s)
    assert math.isinf(c) or (c % 16 == 0 and 16 <= c < 512)
    # Rounding moves a setting by at most half a step (or to a bound).
    assert abs(s - seats) <= 0.5 or s == 1
    if math.isinf(c):
        assert chunk >= 512 - 8


def test_options_are_the_layouts_that_hold_the_model():
    found = policy.options(MODEL, CHIP, 4, 1024, 256)
    assert [(o.tp, o.replicas) for o in found] == [(1, 4), (2, 2), (4, 1)]
    assert all(o.served.layout.chips == 4 for o in found)
    big = pm.get_model("llama-3.1-70b")
    assert [o.tp for o in policy.options(big, CHIP, 4, 1024, 256)] == [2, 4]
    with pytest.raises(ValueError, match="does not fit"):
        policy.options(big, CHIP, 1, 1024, 256)


def test_problem_rejects_bad_inputs():
    with pytest.raises(ValueError, match="objective"):
        policy.problem(MODEL, CHIP, 1, LOAD, 1.0, 0.05, objective="tokens", num_requests=10)
    with pytest.raises(ValueError, match="max_tpot"):
        policy.problem(MODEL, CHIP, 1, LOAD, 1.0, 0.0, num_requests=10)


def test_a_trace_is_summarised_as_a_load():
    requests = pm.simulate.trace(jnp.asarray([10.0, 11.0, 12.0, 13.0]),
                                 jnp.asarray([100.0, 300.0, 100.0, 300.0]),
                                 jnp.asarray([10.0, 20.0, 30.0, 40.0]))
    load = policy.load_of(requests)
    assert float(load.rate) == pytest.approx(1.0)
    assert float(load.input_len) == pytest.approx(200.0)
    assert float(load.output_len) == pytest.approx(25.0)
    assert float(load.cv) < 0.01   # equal gaps


@pytest.mark.parametrize("argv, message", [
    (["--max-ttft-p99-ms", "500", "--max-tpot-p99-ms", "40"], "--rate"),
    (["--rate", "2", "--trace", "x.jsonl", "--max-ttft-p99-ms", "500",
      "--max-tpot-p99-ms", "40"], "not both"),
    (["--rate", "2", "--max-ttft-p99-ms", "0", "--max-tpot-p99-ms", "40"], "positive"),
    (["--rate", "2", "--chips", "0", "--max-ttft-p99-ms", "5", "--max-tpot-p99-ms", "4"],
     "not in [1,"),
    (["--rate", "2", "--model", "llama-3.1-70b", "--max-ttft-p99-ms", "500",
      "--max-tpot-p99-ms", "40"], "does not fit"),
    (["--rate", "2", "--osl", "1", "--max-ttft-p99-ms", "500", "--max-tpot-p99-ms", "40"],
     "--osl"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
    assert main(["policy", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("perfmodel: error:") and message in err and err.count("\n") == 1


def _tuned(max_ttft, max_tpot, rate=4.0):
    load = surrogate.Load(rate=rate, input_len=512, output_len=64)
    p = policy.problem(MODEL, CHIP, 1, load, max_ttft, max_tpot, num_requests=200)
    return p, policy.tune(p, max_steps=60, progress=False)


@pytest.mark.slow
def test_tuned_policy_meets_the_slos_in_the_simulator():
    p, t = _tuned(0.5, 0.03)
    assert t.slo_met
    assert float(t.summary.ttft.p99) <= 0.5 and float(t.summary.tpot.p99) <= 0.03
    assert int(t.summary.unfinished) == 0
    # Goodput counts requests meeting both SLOs: at most the rate (per chip, one chip).
    assert 0.9 * 4.0 < t.objective <= 4.0 * 1.05


@pytest.mark.slow
def test_tighter_slos_never_give_more_goodput():
    # Tuned with looser, then tighter SLOs, each verified in the simulator: the tuner is a
    # heuristic, so this can fail (a tighter problem tuned into a better policy). Goodput is
    # requests meeting both SLOs over the run's duration, and two policies that meet them on
    # the same requests still differ in duration by a few steps: the check allows 1e-3 of
    # the goodput, a fifth of one request of the 200.
    loads = []
    for ttft, tpot in ((2.0, 0.2), (0.3, 0.02), (0.15, 0.012)):
        _, t = _tuned(ttft, tpot, rate=12.0)
        loads.append(t.objective)
    slack = 1e-3 * loads[0]
    assert loads[0] + slack >= loads[1] >= loads[2] - slack, loads


@pytest.mark.slow
def test_gradient_is_within_a_few_percent_of_the_grid():
    p = policy.problem(MODEL, CHIP, 1, surrogate.Load(rate=12.0, input_len=512,
                                                      output_len=64),
                       0.3, 0.02, num_requests=200)
    t = policy.tune(p, max_steps=80, progress=False)
    g = policy.grid_search(p, budgets=(512, 1024, 2048, 4096), seats=(16, 32, 64, 128),
                           progress=False)
    assert g.points == 4 * 4 * 1
    assert t.objective >= 0.97 * g.objective


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "since Llama's full attention runs at FlashAttention's efficiency "
    "(Efficiency.full_attention_max) the tuner's re-solves past the SLOs land at the top of "
    "the budget box, where the surrogate under-predicts p99 TPOT: 0.77 of the grid here, "
    "1.055 in benchmarks/bench_policy.py's third scenario (bench_policy.json; 0.995 since "
    "decode and prompt attention were fitted apart, 0.858 before, 1.044 before that)"))
def test_past_what_the_slos_allow_the_reachable_slo_is_kept():
    # 2K-token prompts at 90 % of the default policy's capacity: no policy holds a 450 ms
    # p99 TTFT, a 40 ms p99 TPOT is within reach (`bench_policy.py`'s third scenario,
    # smaller). Goodput counts the requests meeting both, so the best policies hold TPOT
    # and let TTFT go; solving with both constraints dropped lands past the TPOT SLO.
    from perfmodel import simulate as sim

    load = surrogate.Load(rate=1.0, input_len=2048, output_len=128)
    design = policy.options(MODEL, CHIP, 1, 2048, 128)[0].design
    rate = 0.9 * float(surrogate.capacity(MODEL, CHIP, design, sim.Policy(), load))
    p = policy.problem(MODEL, CHIP, 1, surrogate.Load(rate=rate, input_len=2048,
                                                      output_len=128),
                       0.45, 0.04, num_requests=300)
    t = policy.tune(p, progress=False)
    g = policy.grid_search(p, budgets=(1024, 2048, 4096), seats=(64, 128, 256),
                           progress=False)
    assert not g.slo_met and not t.slo_met
    assert t.objective >= 0.97 * g.objective
    assert float(t.summary.tpot.p99) <= 0.04 * 1.05


@pytest.mark.slow
def test_cli_json_keys(capsys):
    argv = ["policy", "--rate", "4", "--isl", "512", "--osl", "64", "--requests", "100",
            "--max-ttft-p99-ms", "500", "--max-tpot-p99-ms", "30", "--check-grid",
            "--format", "json", "--quiet"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"policy", "goodput_per_chip", "slo_met", "p50", "p95", "p99", "utilization",
            "power_w", "surrogate", "wall_s", "grid"} <= set(out)
    for q in ("p50", "p95", "p99"):
        assert set(out[q]) == {"ttft_s", "tpot_s", "e2e_s"}
    assert set(out["surrogate"]) == {"p99", "goodput_per_chip"}
    assert {"policy", "goodput_per_chip", "points", "wall_s"} <= set(out["grid"])
    assert {"max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "tp",
            "replicas"} <= set(out["policy"])
    assert out["p50"]["ttft_s"] <= out["p99"]["ttft_s"]
    # The table of the same run (kernels compiled by now).
    assert main(argv[:-3] + ["--quiet"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("# llama-3.1-8b on 1 x h100") and "surrogate p99" in table
    assert "# grid:" in table


@pytest.mark.slow   # compiles the surrogate and the simulator (80 s)
def test_tuner_power_agrees_with_the_simulator():
    # The power of the per-kW objective (`gradient.instance_power`: idle plus the busy share
    # of the mean step's dynamic power, `power.average_power`) against the simulator's
    # report for the same policy and Poisson load, below saturation: within the surrogate's
    # error on utilization and step mix (measured 1.6 % and 3.8 %; 9 % at saturation,
    # where the mean step's mix differs most).
    from perfmodel import simulate as sim
    from perfmodel.fitted import runtime_for
    from perfmodel.policy.gradient import instance_power

    design = pm.Design(concurrency=1.0, layout=pm.Layout(tp=1),
                       precision=pm.precision(CHIP, MODEL),
                       runtime=runtime_for("vllm", CHIP.family))
    for rate in (2.0, 8.0):
        load = surrogate.Load(rate=rate, input_len=512, output_len=64)
        e = surrogate.estimate(MODEL, CHIP, design, sim.Policy(), load)
        requests = sim.poisson(jax.random.PRNGKey(0), rate, 400, 512, 64)
        s = sim.summarize(sim.simulate_jit(MODEL, CHIP, design, sim.Policy(), requests,
                                           max_steps=20_000))
        assert int(s.unfinished) == 0
        tuned = float(instance_power(MODEL, CHIP, design, e, load))
        assert float(CHIP.idle_power) < tuned < float(CHIP.tdp)
        assert tuned == pytest.approx(float(s.power), rel=0.05)
