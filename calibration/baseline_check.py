"""The GPU baseline of `perfmodel compare` against the measured InferenceMAX tops:
`python calibration/baseline_check.py` (about a minute on 2 CPU cores).

For DeepSeek-R1 on GB200 at 8K/1K FP4 (the rows hold no GB300 and no Kimi-K2.5), the
highest-throughput measured dynamo-trt row with and without MTP (`baseline.measured_top`)
beside the best point the model's own search of the InferenceMAX recipe predicts at the same
requests per GPU and MTP setting (`baseline.check_top`: the configuration is chosen by the
model, not read from the row). Then every measured concurrency of the same rows at its
own measured layout (`perfmodel.calibration.predict_rows`, the shipped fit's reading of the
rows: the recipe's FP8 KV cache and draft lengths, FP8 attention math as
`design.attention_class` gives it), repeated runs of
one configuration averaged: issue 21 asks for the baseline within 15 % at each
concurrency, and the tops alone do not say whether it is. Writes
`calibration/baseline_check.md`.
"""

from __future__ import annotations

import pathlib
import sys

import jax

jax.config.update("jax_enable_x64", True)

from perfmodel.calibration import predict_rows  # noqa: E402
from perfmodel.datasets import load_benchmarks  # noqa: E402
from perfmodel.presets import get_chip, get_model  # noqa: E402
from perfmodel.studies import baseline  # noqa: E402
from perfmodel.workload import Workload  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
#: The acceptance band of issue 21: within 15 % of the measured rows.
TOLERANCE = 0.15


def within(r: dict) -> bool:
    """Throughput and interactivity both within `TOLERANCE` of the measured values."""
    return (abs(r["ratio_tput"] - 1) <= TOLERANCE
            and abs(r["ratio_interactivity"] - 1) <= TOLERANCE)


def table(rows: list[dict]) -> str:
    lines = ["| MTP | measured (run, layout) | requests/GPU | measured tok/s/GPU | "
             "predicted | ratio | measured tok/s/user | predicted | ratio | predicted "
             "configuration |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(
            f"| {'yes' if r['measured_mtp'] else 'no'} | {r['measured_run_id']}, "
            f"{r['measured_layout']} | {r['measured_requests_per_gpu']:.1f} | "
            f"{r['measured_tput_per_gpu']:.0f} | {r['predicted_tput_per_gpu']:.0f} | "
            f"{r['ratio_tput']:.2f} | {r['measured_interactivity']:.1f} | "
            f"{r['predicted_interactivity']:.1f} | {r['ratio_interactivity']:.2f} | "
            f"{r['predicted_config']} |")
    return "\n".join(lines) + "\n"


def each_concurrency(path=baseline.ROWS) -> list[dict]:
    """Every 8K/1K FP4 dynamo-trt DeepSeek-R1 GB200 configuration (MTP, concurrency, prefill
    workers, decode width), measured and predicted at its own layout, means over its runs."""
    rows = [r for r in load_benchmarks(path)
            if baseline.is_recipe_row("deepseek-r1", "gb200", r.model, r.hardware,
                                      r.framework, r.precision, r.isl, r.osl)]
    groups: dict = {}
    for row, pred in zip(rows, predict_rows(tuple(rows)), strict=True):
        key = (row.mtp, row.conc, row.prefill.replicas, row.prefill.tp, row.decode.tp,
               row.decode.replicas, row.decode.dp_attention)
        groups.setdefault(key, []).append((row, pred))
    def mean(values):
        return sum(values) / len(values)

    out = []
    for (mtp, conc, prefill, prefill_tp, width, workers, dpa), members in sorted(
            groups.items()):
        measured = mean([r.measured["tput_per_gpu"] for r, _ in members])
        predicted = mean([p["pred_tput_per_chip_total"] for _, p in members])
        m_int = mean([r.measured["median_intvty_tok_s_user"] for r, _ in members])
        p_int = mean([p["pred_interactivity"] for _, p in members])
        out.append({"mtp": mtp, "conc": conc, "draft_tokens": members[0][0].draft_tokens,
                    "layout": f"{prefill}x P TP{prefill_tp} + {workers}x D TP{width}"
                              f"{' DPA' if dpa else ''}", "runs": len(members),
                    "measured_tput_per_gpu": measured, "predicted_tput_per_gpu": predicted,
                    "ratio_tput": predicted / measured, "measured_interactivity": m_int,
                    "predicted_interactivity": p_int, "ratio_interactivity": p_int / m_int})
    return out


def concurrency_table(rows: list[dict]) -> str:
    lines = ["| MTP (drafts) | requests | layout | runs | measured tok/s/GPU | predicted | "
             "ratio | measured tok/s/user | predicted | ratio |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        mtp = f"yes ({r['draft_tokens']:.0f})" if r["mtp"] else "no"
        lines.append(
            f"| {mtp} | {r['conc']:.0f} | {r['layout']} | {r['runs']} | "
            f"{r['measured_tput_per_gpu']:.0f} | {r['predicted_tput_per_gpu']:.0f} | "
            f"{r['ratio_tput']:.2f} | {r['measured_interactivity']:.1f} | "
            f"{r['predicted_interactivity']:.1f} | {r['ratio_interactivity']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    rows = baseline.check_top("deepseek-r1", get_chip("gb200"), get_model("deepseek-r1"),
                              Workload(8192, 1024))
    tops = [within(r) for r in rows]
    text = ("DeepSeek-R1 on GB200, 8K/1K FP4: the measured InferenceMAX top (dynamo-trt) and "
            "the best point of the model's search of the recipe (`perfmodel.studies.baseline`) "
            "at the same requests per GPU. Generated by `python "
            "calibration/baseline_check.py`.\n\n" + table(rows) + "\n"
            + f"Within {TOLERANCE:.0%} on both: "
            + ", ".join(f"{'MTP' if r['measured_mtp'] else 'no MTP'} "
                        f"{'yes' if ok else 'no'}" for r, ok in zip(rows, tops, strict=True))
            + ".\n")
    each = each_concurrency()
    counts = {mtp: (sum(within(r) for r in each if r["mtp"] == mtp),
                    sum(r["mtp"] == mtp for r in each)) for mtp in (False, True)}
    text += ("\nEach measured concurrency at its own measured layout (`perfmodel predict`'s "
             "reading of the rows: the recipe's FP8 KV cache and draft lengths, the FP8 "
             "attention math of `design.attention_class`, as the search above; repeated runs "
             "averaged):\n\n" + concurrency_table(each) + "\n"
             + f"Within {TOLERANCE:.0%} on both: {sum(map(within, each))} of "
             + f"{len(each)} configurations (no MTP {counts[False][0]} of {counts[False][1]}, "
             + f"MTP {counts[True][0]} of {counts[True][1]}).\n")
    (HERE / "baseline_check.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
