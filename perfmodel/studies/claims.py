"""What was reported about Jalapeno (`data/jalapeno_claims.csv`) and the checks a reader
needs to judge it: the reported figures (J01-J09) by claim id, the band each figure gives,
whether a `compare` row meets each within `CLAIM_TOLERANCE`, and the Little's-law
consistency of a reported pair (`consistency`): tokens/s per kW = E2E ratio x TDP ratio x
requests-per-chip ratio at each chip's peak, so a pair implies the requests per chip each
side ran and excludes comparison definitions that force one of its ratios.
"""

from __future__ import annotations

import csv
import functools
from importlib import resources

#: The reported pairs (shared/data/jalapeno_claims.csv J01-J06): model, baseline, and the
#: claim ids of tokens/s per kW at peak throughput and of the E2E latency ratio.
PAIRS = (("gpt-oss-120b", "gb200", "J01", "J02"),
         ("deepseek-r1", "gb300", "J03", "J04"),
         ("kimi-k2.5", "gb300", "J05", "J06"))

@functools.cache
def reported_claims() -> dict[str, dict]:
    """The claims file shipped with the package (`data/jalapeno_claims.csv`), by claim id."""
    text = resources.files("perfmodel").joinpath("data", "jalapeno_claims.csv").read_text()
    return {row["claim_id"]: row for row in csv.DictReader(text.splitlines())}


#: The per-user speed claim of each model (jalapeno_claims.csv: J08 DeepSeek-R1, J09
#: gpt-oss-120b and Kimi-K2.5), at the low-concurrency point.
SPEED_CLAIMS = {"gpt-oss-120b": "J09", "deepseek-r1": "J08", "kimi-k2.5": "J09"}

#: The claim of the tokens/s per kW ratio at the high-interactivity point (a range over the
#: three models).
HIGH_INTERACTIVITY_CLAIM = "J07"

#: A figure is met within this relative distance of its reported value or band (issue 21's
#: acceptance: every reported figure within 15 %).
CLAIM_TOLERANCE = 0.15


def claim_band(claim_id: str) -> tuple[float, float]:
    """The band [low, high] of a reported figure's value in the claims file: "a-b" a range,
    ">a" at least a (high inf), "~a" or "a" the value itself (low = high).

    Example:
        >>> claim_band("J07"), claim_band("J08"), claim_band("J09"), claim_band("J01")
        ((2.1, 4.1), (700.0, inf), (1400.0, 1400.0), (1.9, 1.9))
    """
    text = reported_claims()[claim_id]["value"].strip().replace(",", "")
    if text.startswith(">"):
        return float(text[1:]), float("inf")
    text = text.lstrip("~")
    if "-" in text:
        low, high = text.split("-")
        return float(low), float(high)
    return float(text), float(text)


def claim_keys(model: str) -> dict[str, str]:
    """Claim id -> the row key holding the figure it reports, for a model's row."""
    out = {}
    for name, _, kw_id, e2e_id in PAIRS:
        if name == model:
            out[kw_id] = "ratio_tok_s_per_kw_at_peak"
            out[e2e_id] = "ratio_e2e_latency"
            out[HIGH_INTERACTIVITY_CLAIM] = "ratio_tok_s_per_kw_high_interactivity"
    if model in SPEED_CLAIMS:
        out[SPEED_CLAIMS[model]] = "interactivity_low_concurrency"
    return out


def claim_checks(row: dict) -> dict:
    """Per claim a row can evaluate (its model's pair, J07, its speed claim): the row's
    value (`claim_<id>_value`), the reported text (`claim_<id>_reported`) and whether the
    value is within `CLAIM_TOLERANCE` of the reported band (`claim_<id>_within_15pct`).

    Example:
        >>> row = {"model": "deepseek-r1", "ratio_tok_s_per_kw_at_peak": 1.8,
        ...        "ratio_e2e_latency": 2.0, "ratio_tok_s_per_kw_high_interactivity": 0.8,
        ...        "interactivity_low_concurrency": 650.0}
        >>> c = claim_checks(row)
        >>> c["claim_J03_within_15pct"], c["claim_J04_within_15pct"], c["claim_J08_reported"]
        (True, False, '>700')
        >>> c["claim_J08_within_15pct"], c["claim_J07_within_15pct"]
        (True, False)
    """
    out = {}
    for claim, key in claim_keys(row["model"]).items():
        if key not in row:
            continue
        low, high = claim_band(claim)
        value = float(row[key])
        out[f"claim_{claim}_value"] = value
        out[f"claim_{claim}_reported"] = reported_claims()[claim]["value"]
        out[f"claim_{claim}_within_15pct"] = bool(
            low * (1.0 - CLAIM_TOLERANCE) <= value <= high * (1.0 + CLAIM_TOLERANCE))
    return out


def reported_ratios(model: str) -> dict:
    """Reported (tokens/s per kW at peak, E2E latency) ratios of a model's pair, or {}."""
    claims = reported_claims()
    for name, baseline, kw_id, e2e_id in PAIRS:
        if name == model:
            return {"baseline": baseline,
                    "reported_ratio_tok_s_per_kw_at_peak": float(claims[kw_id]["value"]),
                    "reported_ratio_e2e_latency": float(claims[e2e_id]["value"]),
                    "reported_ratio_tok_s_per_kw_high_interactivity": claims["J07"]["value"],
                    "reported_claims": f"{kw_id},{e2e_id},J07"}
    return {}


#: Comparison definitions a reported pair can be checked against: (name, the ratio it fixes,
#: what it forces, why).
EXCLUSIONS = (
    ("matched throughput per chip", "tok_s_per_kw", "the TDP ratio",
     "equal tokens/s per chip leaves only the TDP normalisation"),
    ("matched tokens/s per kW", "tok_s_per_kw", "1", "the per-kW ratio is 1 by definition"),
    ("matched interactivity", "e2e", "~1",
     "at one tokens/s/user the E2E differs only by the TTFT"),
)

#: Relative tolerance of a reported one-decimal ratio against a forced value: rounding (up to
#: 0.05 on 1.5-3.6, 3.3%) plus margin.
EXCLUSION_TOLERANCE = 0.05


def consistency(row: dict) -> dict:
    """Little's-law checks of one `compare` row (see the module docstring).

    Returns:
        `requests_per_chip_ratio_at_peak` (chip/baseline, the row's own points),
        `littles_law_ratio_tok_s_per_kw` (E2E ratio x TDP ratio x requests ratio: equal to
        the row's per-kW ratio where throughput is requests x tokens per request / E2E), and
        with reported ratios `implied_requests_per_chip_ratio` (what the reported pair
        implies) and per definition of `EXCLUSIONS` a `check_<definition>` line
        ("excluded: ..." or "consistent: ...", with what it forces and the reported value).
    """
    tdp = row["baseline_tdp_w"] / row["tdp_w"]
    out = {"tdp_ratio": tdp,
           "requests_per_chip_ratio_at_peak":
               row["requests_per_chip_at_peak"] / row["baseline_requests_per_chip_at_peak"]}
    out["littles_law_ratio_tok_s_per_kw"] = (row["ratio_e2e_latency"] * tdp
                                             * out["requests_per_chip_ratio_at_peak"])
    if "reported_ratio_tok_s_per_kw_at_peak" not in row:
        return out
    kw, e2e = row["reported_ratio_tok_s_per_kw_at_peak"], row["reported_ratio_e2e_latency"]
    out["implied_requests_per_chip_ratio"] = kw / (e2e * tdp)
    # At one interactivity I the E2E ratio is at most 1 + TTFT_baseline x I / OSL.
    e2e_bound = 1.0 + row["baseline_ttft_s_at_peak"] * row["baseline_interactivity_at_peak"] \
        / row["output_len"]
    for name, ratio, forced, why in EXCLUSIONS:
        if ratio == "tok_s_per_kw":
            value = tdp if forced == "the TDP ratio" else 1.0
            off = abs(kw / value - 1.0) > EXCLUSION_TOLERANCE
            text = (f"forces tok/s/kW x{value:.2f} ({why}); reported x{kw:g}")
        else:
            off = e2e > e2e_bound * (1.0 + EXCLUSION_TOLERANCE)
            text = (f"forces E2E x{forced} (at most x{e2e_bound:.2f} here: {why}); "
                    f"reported x{e2e:g}")
        out["check_" + name.replace(" ", "_").replace("/", "_per_")] = (
            ("excluded: " if off else "consistent: ") + text)
    return out
