"""Agreement of the serving surrogate (`perfmodel.surrogate`) with the simulator.

For each (model, chip) case and scheduler policy, the capacity is the surrogate's own
stability bound (`surrogate.capacity`: the rate at which the binding resource, seats or
prompt tokens, is fully loaded). At loads of 50-95 % of it, the simulator serves N
requests (Poisson or gamma arrivals, fixed lengths, one seed) and the surrogate estimates
the same summaries; the script reports the relative error of p99 TTFT and p99 TPOT (and of
p50), surrogate against simulator, by load band, and draws a parity plot. Nothing is fitted:
the surrogate's formulas have no free constant.

    python calibration/surrogate_check.py [--requests 1000] [--json OUT] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import perfmodel as pm  # noqa: E402
from perfmodel import simulate as sim  # noqa: E402
from perfmodel import surrogate  # noqa: E402
from perfmodel.fitted import runtime_for  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: (label, model, chip, tp, input tokens, output tokens, arrival CV).
CASES = (
    ("llama-3.1-8b / h100", "llama-3.1-8b", "h100", 1, 1024, 256, 1.0),
    ("llama-3.1-8b / rtx-pro-6000", "llama-3.1-8b", "rtx-pro-6000", 1, 1024, 256, 1.0),
    ("qwen3-32b / h100 x2", "qwen3-32b", "h100", 2, 2048, 128, 1.0),
    ("llama-3.1-8b / h100, gamma cv 2", "llama-3.1-8b", "h100", 1, 1024, 256, 2.0),
)
#: (label, max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold).
POLICIES = (
    ("256 seqs / 2048 tok", 256, 2048, jnp.inf),
    ("64 seqs / 2048 tok", 64, 2048, jnp.inf),
    ("128 seqs / 512 tok, chunk 256", 128, 512, 256),
)
LOADS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
BANDS = ((0.5, 0.6), (0.7, 0.8), (0.9, 0.95))


def _case(model_name, chip_name, tp):
    chip, model = pm.get_chip(chip_name), pm.get_model(model_name)
    design = pm.Design(concurrency=1.0, layout=pm.Layout(tp=tp),
                       precision=pm.precision(chip, model),
                       runtime=runtime_for("vllm", chip.family))
    return model, chip, design


def run(num: int) -> list[dict]:
    rows = []
    for label, model_name, chip_name, tp, isl, osl, cv in CASES:
        model, chip, design = _case(model_name, chip_name, tp)
        for plabel, seqs, budget, threshold in POLICIES:
            policy = sim.Policy(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                long_prefill_token_threshold=threshold)
            base = surrogate.Load(rate=1.0, input_len=isl, output_len=osl, cv=cv)
            cap = float(surrogate.capacity(model, chip, design, policy, base))
            rates = jnp.asarray(LOADS) * cap
            unit = sim.gamma(jax.random.PRNGKey(7), 1.0, cv, num, isl, osl)
            window = min(num, 2 * seqs + 128)

            def one(rate, unit=unit, policy=policy, window=window, model=model, chip=chip,
                    design=design, isl=isl, osl=osl, cv=cv):
                requests = sim.Requests(arrival=unit.arrival / rate,
                                        input_len=unit.input_len,
                                        output_len=unit.output_len)
                result = sim.simulate(model, chip, design, policy, requests,
                                      max_steps=40 * num + 4 * osl, window=window)
                s = sim.summarize(result)
                e = surrogate.estimate(model, chip, design, policy, surrogate.Load(
                    rate=rate, input_len=isl, output_len=osl, cv=cv))
                return dict(sim_ttft_p50=s.ttft.p50, sim_ttft_p99=s.ttft.p99,
                            sim_tpot_p50=s.tpot.p50, sim_tpot_p99=s.tpot.p99,
                            sim_unfinished=s.unfinished, overflow=result.window_overflow,
                            sim_utilization=s.utilization,
                            sur_ttft_p50=e.ttft.p50, sur_ttft_p99=e.ttft.p99,
                            sur_tpot_p50=e.tpot.p50, sur_tpot_p99=e.tpot.p99,
                            sur_load=e.load, sur_utilization=e.utilization,
                            unstable=e.unstable)

            start = time.perf_counter()
            out = jax.jit(jax.vmap(one))(rates)
            out = {k: np.asarray(v) for k, v in out.items()}
            wall = time.perf_counter() - start
            for i, load in enumerate(LOADS):
                row = dict(case=label, policy=plabel, load=load, rate=float(rates[i]),
                           capacity=cap, cv=cv, **{k: float(v[i]) for k, v in out.items()})
                for metric in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
                    row[f"err_{metric}"] = row[f"sur_{metric}"] / row[f"sim_{metric}"] - 1.0
                rows.append(row)
            print(f"{label:34s} {plabel:30s} capacity {cap:7.2f} req/s  ({wall:5.1f} s)  "
                  + "  ".join(f"{r['load']:.2f}: TTFT99 {100 * r['err_ttft_p99']:+.0f}% "
                              f"TPOT99 {100 * r['err_tpot_p99']:+.0f}%"
                              for r in rows[-len(LOADS):]), flush=True)
    return rows


def bands(rows: list[dict]) -> list[dict]:
    out = []
    for arrivals, keep in (("Poisson", lambda r: r["cv"] == 1.0),
                           ("gamma cv 2", lambda r: r["cv"] != 1.0)):
        for low, high in BANDS + ((0.5, 0.95),):
            sel = [r for r in rows if keep(r) and low - 1e-9 <= r["load"] <= high + 1e-9]
            entry = dict(arrivals=arrivals, band=f"{int(100 * low)}-{int(100 * high)} %",
                         points=len(sel))
            for metric in ("ttft_p99", "tpot_p99", "ttft_p50", "tpot_p50"):
                errors = np.abs([r[f"err_{metric}"] for r in sel])
                entry[f"median_{metric}"] = float(np.median(errors))
                entry[f"worst_{metric}"] = float(np.max(errors))
            out.append(entry)
    return out


def table(summary: list[dict]) -> str:
    lines = ["| arrivals | load band | points | p99 TTFT median | p99 TTFT worst | p99 TPOT median "
             "| p99 TPOT worst | p50 TTFT median | p50 TPOT median |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for b in summary:
        lines.append(f"| {b['arrivals']} | {b['band']} | {b['points']} | "
                     f"{100 * b['median_ttft_p99']:.1f} % | "
                     f"{100 * b['worst_ttft_p99']:.0f} % | {100 * b['median_tpot_p99']:.1f} % | "
                     f"{100 * b['worst_tpot_p99']:.0f} % | {100 * b['median_ttft_p50']:.1f} % | "
                     f"{100 * b['median_tpot_p50']:.1f} % |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, metric, name in ((axes[0], "ttft_p99", "p99 TTFT (s)"),
                             (axes[1], "tpot_p99", "p99 TPOT (s)")):
        x = np.array([r[f"sim_{metric}"] for r in rows])
        y = np.array([r[f"sur_{metric}"] for r in rows])
        load = np.array([r["load"] for r in rows])
        points = ax.scatter(x, y, c=load, cmap="viridis", vmin=0.5, vmax=0.95, s=18)
        low, high = min(x.min(), y.min()) * 0.8, max(x.max(), y.max()) * 1.25
        ax.plot([low, high], [low, high], "k-", lw=0.8)
        for k in (0.85, 1.15):
            ax.plot([low, high], [k * low, k * high], "k:", lw=0.6)
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high),
               xlabel=f"simulator {name}", ylabel=f"surrogate {name}")
        ax.grid(alpha=0.3, which="both")
    fig.colorbar(points, ax=axes, label="load / capacity")
    fig.suptitle("Surrogate vs simulator, 50-95 % of capacity (dotted: +-15 %)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--json", default=str(ROOT / "calibration" / "surrogate_check.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "surrogate.png"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = run(args.requests)
    summary = bands(rows)
    pathlib.Path(args.json).write_text(json.dumps(
        dict(requests=args.requests, bands=summary, rows=rows), indent=1) + "\n")
    plot(rows, pathlib.Path(args.plot))
    print(table(summary))
    print(f"{len(rows)} points, {args.requests} requests each, "
          f"{time.perf_counter() - start:.0f} s; unstable by the surrogate: "
          f"{sum(r['unstable'] > 0 for r in rows)}; window overflow: "
          f"{sum(r['overflow'] > 0 for r in rows)}; unfinished: "
          f"{sum(r['sim_unfinished'] > 0 for r in rows)}")


if __name__ == "__main__":
    main()
