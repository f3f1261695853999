"""Compile time of each public entry point: a fresh process, twice, on one fresh cache.

    python benchmarks/compile_times.py [predict compare predict-inferencemax predict-power
                                        predict-mlperf pareto optimize simulate]   # one JSON

Each entry point runs in a new process against an empty persistent compilation cache
(`PERFMODEL_CACHE_DIR`, a temporary folder), then again in another process on that cache.
`first_s` is the cold wall time, `second_s` the warm one, `compile_s` their difference
(what compiling costs beyond loading the cached kernels). `predict` is `pm.predict_jit`
called from Python (its first call minus its second, in one process, no cache); the others
are the commands with the arguments below (`predict-inferencemax`, `predict-power` and
`predict-mlperf`: `perfmodel predict` of every shipped InferenceMAX row, power measurement
and MLPerf result).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXE = str(Path(sys.executable).parent / "perfmodel")

PREDICT = """
import time, jax
jax.config.update("jax_enable_x64", True)
import perfmodel as pm
chip, model = pm.get_chip("gb200"), pm.get_model("deepseek-r1")
design = pm.Design(concurrency=64.0, layout=pm.Layout(tp=8, ep=8, dp_attention=True),
                   precision=pm.precision(chip, model, "fp4"))
w = pm.Workload(input_len=8192, output_len=1024)
t = []
for _ in range(2):
    s = time.perf_counter(); jax.block_until_ready(pm.predict_jit(model, chip, w, design))
    t.append(time.perf_counter() - s)
print(t[0], t[1])
"""

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "compare": [EXE, "compare"],
    "predict-inferencemax": [EXE, "predict", str(ROOT / "calibration" / "data" /
                                                 "benchmarks_inferencemax.csv"),
                             "--out", os.devnull, "--quiet"],
    "predict-power": [EXE, "predict", str(ROOT / "calibration" / "power" /
                                          "power_measurements.csv"),
                      "--out", os.devnull, "--quiet"],
    "predict-mlperf": [EXE, "predict", str(ROOT / "calibration" / "data" /
                                           "benchmarks_mlperf.csv"),
                       "--out", os.devnull, "--quiet"],
    "pareto": [EXE, "pareto"],
    "optimize": [EXE, "optimize"],
    "simulate": [EXE, "simulate", "--model", "deepseek-r1", "--chip", "gb200", "--tp", "8",
                 "--rate", "2", "--isl", "1024", "--osl", "256", "--requests", "200"],
}


def predict() -> dict:
    done = subprocess.run([sys.executable, "-c", PREDICT], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PERFMODEL_CACHE_DIR": "off"})
    if done.returncode:
        return dict(error=done.stderr.strip()[-300:])
    first, second = map(float, done.stdout.split())
    return dict(call="pm.predict_jit(deepseek-r1, gb200, 8K/1K, tp8-ep8 DPA fp4)",
                first_s=first, second_s=second, compile_s=first - second)


def command(args: list[str]) -> dict:
    walls = []
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(2):
            start = time.perf_counter()
            done = subprocess.run(args, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "PERFMODEL_CACHE_DIR": cache})
            walls.append(time.perf_counter() - start)
            if done.returncode:
                return dict(command=" ".join(["perfmodel", *args[1:]]),
                            error=done.stderr.strip()[-300:])
    return dict(command=" ".join(["perfmodel", *args[1:]]), first_s=walls[0],
                second_s=walls[1], compile_s=walls[0] - walls[1])


def main(argv=None) -> dict:
    names = (argv if argv is not None else sys.argv[1:]) or ["predict", *COMMANDS]
    result = {name: predict() if name == "predict" else command(COMMANDS[name])
              for name in names}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
