"""perfmodel's speed against the other tools that do its job, in one run on the same configs.

    python benchmarks/run.py --quick --json     # the quick set, under a minute; one JSON object
    python benchmarks/run.py                    # also compile times and 8 fake CPU devices

Figures (written to `benchmarks/run.json` as well):

- `configs_per_s`: serving-metric evaluations per second (`bench_vmap.py`: 100,000 random
  configurations around GB200 + DeepSeek-R1 tp8-ep8 with DP attention, FP4, one jitted
  `vmap` of `predict`, the chip and design constants of the kernel), one device, float64,
  after compilation; `configs_per_s_f32` the same in float32 (a fresh process: JAX's
  precision is set before any array exists); `configs_per_s_specs_as_args` float64 with the
  chip and design passed to the kernel as arguments (`bench_vmap.build(specs_as_args=True)`).
- `grads_per_s`: per-configuration gradients of tokens/s per kW with respect to the six
  inputs of a configuration (`bench_vmap.build_grads`), after compilation.
- `compile_s`, `grad_compile_s`: the first calls of those kernels: compilation, or loading
  them from perfmodel's persistent compilation cache when warm (`PERFMODEL_CACHE_DIR=off`
  compiles every time).
- `pareto_startup_s`: wall time of a fresh `perfmodel pareto` process (its defaults; output
  discarded), start-up and compilation cache included.
- `peers`: each other tool's configurations per second on the first configurations of the
  same draw (`peers.py`, one Python call per configuration), its version, the exact call
  and what differs; `ratio` is perfmodel's float64 rate over the tool's.
- Without `--quick`: `compile_s_entry_points`, the cold and warm wall time of predict,
  compare, predict of the shipped InferenceMAX and power rows, pareto, optimize and
  simulate on a fresh compilation cache (`compile_times.py`, about 9 minutes), and
  `configs_per_s_8dev` (the same kernel split over 8 fake CPU devices on
  `perfmodel.grid.shard`'s mesh, `XLA_FLAGS=--xla_force_host_platform_device_count=8`).

The peers live in their own environment, never in perfmodel's dependencies::

    python -m venv /tmp/bench-peers
    /tmp/bench-peers/bin/pip install llm-analysis genz-llm aiconfigurator

`--peers-python` (default: `$PERFMODEL_BENCH_PEERS`, else /tmp/bench-peers/bin/python where it
exists, else this Python) names that environment's interpreter; a tool it lacks is reported
as absent with the command that installs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_vmap  # noqa: E402  (sets float64 before any array exists)
import jax  # noqa: E402

import perfmodel as pm  # noqa: E402

PEERS_VENV = "/tmp/bench-peers/bin/python"
#: Where the acceptance of issue 23 sets the bar (2-core CPU, single device, float64).
TARGET_CONFIGS_PER_S, TARGET_RATIO = 15e6, 5000.0


def _python_json(args: list[str], env: dict | None = None, stdin: str | None = None,
                 timeout: float = 300) -> dict:
    """Runs `args` and parses the last line of its stdout as JSON."""
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=HERE.parent)
    if done.returncode != 0:
        return dict(error=f"exit {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def vmapped(n: int, repeats: int, grad_n: int) -> dict:
    """float64 configs/s and grads/s in this process (`bench_vmap.main`)."""
    return bench_vmap.measure(n, repeats, grad_n=grad_n)


def float32(n: int, repeats: int) -> dict:
    return _python_json([sys.executable, str(HERE / "bench_vmap.py"), "--n", str(n),
                         "--repeats", str(repeats), "--json"],
                        env=dict(PERFMODEL_BENCH_DTYPE="float32"))


def devices8(n: int, repeats: int) -> dict:
    return _python_json([sys.executable, str(HERE / "bench_vmap.py"), "--n", str(n),
                         "--repeats", str(repeats), "--devices", "8", "--json"],
                        env=dict(XLA_FLAGS="--xla_force_host_platform_device_count=8"))


def pareto_startup() -> dict:
    exe = shutil.which("perfmodel", path=str(Path(sys.executable).parent)) or "perfmodel"
    start = time.perf_counter()
    done = subprocess.run([exe, "pareto"], capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, command="perfmodel pareto", rc=done.returncode)


def peers(python: str, n: int, budget_s: float) -> dict:
    """The other tools on the first `n` configurations of bench_vmap's draw (`peers.py`)."""
    chip = pm.get_chip(bench_vmap.CHIP)
    cfg = bench_vmap.configurations(n)
    configs = [{k: float(v[i]) for k, v in cfg.items()} for i in range(n)]
    request = dict(configs=configs, budget_s=budget_s,
                   chip=dict(hbm_capacity=float(chip.hbm_capacity),
                             hbm_bandwidth=float(chip.hbm_bandwidth),
                             scale_up_bandwidth=float(chip.scale_up.bandwidth),
                             scale_up_latency=float(chip.scale_up.latency),
                             peak_flops_bf16=float(chip.peak_flops[0]),
                             peak_flops_fp8=float(chip.peak_flops[1]),
                             peak_flops_fp4=float(chip.peak_flops[3])))
    if not Path(python).exists():
        install = f"python -m venv {Path(python).parent.parent} && {python} -m pip install {{}}"
        return {tool: dict(absent=True, install=install.format(tool))
                for tool in ("llm-analysis", "genz-llm", "aiconfigurator")}
    result = _python_json([python, str(HERE / "peers.py")], stdin=json.dumps(request))
    result.pop("python", None)
    return result


def compile_times() -> dict:
    """Cold and warm wall time of each public entry point (`compile_times.py`)."""
    return _python_json([sys.executable, str(HERE / "compile_times.py")], timeout=1800)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick set (under a minute)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--peers-python", default=os.environ.get(
        "PERFMODEL_BENCH_PEERS", PEERS_VENV if Path(PEERS_VENV).exists() else sys.executable))
    parser.add_argument("--out", default=str(HERE / "run.json"), help="JSON written here")
    args = parser.parse_args(argv)
    n, repeats = 100_000, (30 if args.quick else 50)
    started = time.perf_counter()
    result = dict(command="python benchmarks/run.py" + (" --quick" if args.quick else ""),
                  load_average=list(os.getloadavg()), cpus=os.cpu_count(),
                  platform=jax.devices()[0].platform, device=str(jax.devices()[0].device_kind),
                  python=platform.python_version(), jax=jax.__version__, n=n)
    f64 = vmapped(n, repeats, grad_n=10_000)
    result.update(configs_per_s=f64["configs_per_s"], run_s=f64["run_s"],
                  compile_s=f64["compile_s"], grads_per_s=f64["grads_per_s"],
                  grad_n=f64["grad_n"], grad_compile_s=f64["grad_compile_s"])
    result["configs_per_s_specs_as_args"] = bench_vmap.measure(
        n, repeats, specs_as_args=True)["configs_per_s"]
    f32 = float32(n, repeats)
    result["configs_per_s_f32"] = f32.get("configs_per_s", f32.get("error"))
    result["pareto_startup_s"] = pareto_startup()["seconds"]
    result["peers"] = peers(args.peers_python, 5000, budget_s=1.5 if args.quick else 5.0)
    for peer in result["peers"].values():
        if isinstance(peer, dict) and peer.get("configs_per_s"):
            peer["ratio"] = result["configs_per_s"] / peer["configs_per_s"]
    rates = [p["configs_per_s"] for p in result["peers"].values()
             if isinstance(p, dict) and p.get("configs_per_s")]
    if rates:
        result["ratio_to_fastest_peer"] = result["configs_per_s"] / max(rates)
    result["targets"] = dict(configs_per_s=TARGET_CONFIGS_PER_S, ratio=TARGET_RATIO,
                             met=bool(result["configs_per_s"] >= TARGET_CONFIGS_PER_S
                                      and result.get("ratio_to_fastest_peer", 0)
                                      >= TARGET_RATIO))
    if not args.quick:
        result["configs_per_s_8dev"] = devices8(n, repeats).get("configs_per_s")
        result["compile_s_entry_points"] = compile_times()
    result["load_average_after"] = list(os.getloadavg())
    result["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return result
    def rate(x):
        return f"{x:,.0f}" if isinstance(x, float | int) else str(x)

    print(f"configs/s float64 {rate(result['configs_per_s'])} (specs as arguments "
          f"{rate(result['configs_per_s_specs_as_args'])}), float32 "
          f"{rate(result['configs_per_s_f32'])}; grads/s {rate(result['grads_per_s'])}; "
          f"perfmodel pareto {result['pareto_startup_s']:.1f} s (load "
          f"{', '.join(f'{x:.1f}' for x in result['load_average'])}); fastest peer "
          f"{rate(result.get('ratio_to_fastest_peer'))}x; targets 15 million/s and 5,000x "
          f"{'met' if result['targets']['met'] else 'missed'}")
    for tool, peer in result["peers"].items():
        if not isinstance(peer, dict):
            print(f"  peers: {peer}")
        elif peer.get("configs_per_s"):
            print(f"  {tool} {peer['version']}: {peer['configs_per_s']:,.0f} configs/s "
                  f"(perfmodel {peer['ratio']:,.0f}x)")
        else:
            print(f"  {tool}: {peer.get('install') or peer.get('error')}")
    return result


if __name__ == "__main__":
    main()
