"""The command line on malformed arguments: hypothesis draws argument lists with one fault
each (an unknown option, name or format, a value of the wrong type, out of range, NaN or
infinite, a missing value), and every one is refused with exit status 2 and one line on
standard error, before any work, never a traceback and never exit 0."""


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perfmodel.cli import build_parser, main

#: Valid argument lists, one per command, that the faults are injected into.
BASES = {
    "pareto": ["pareto", "--model", "llama-3.1-8b", "--chip", "h100", "--chips", "1"],
    "optimize": ["optimize", "--model", "llama-3.1-8b", "--chip", "h200", "--chips", "1",
                 "--max-tpot-ms", "8"],
    "compare": ["compare", "--model", "gpt-oss-120b", "--mode", "predicted"],
    "predict": ["predict", "calibration/data/benchmarks_inferencemax.csv"],
    "list": ["list", "chips"],
    "policy": ["policy", "--model", "llama-3.1-8b", "--chip", "h100", "--rate", "4",
               "--max-ttft-p99-ms", "500", "--max-tpot-p99-ms", "40"],
}

#: Options whose value must be a positive integer, per command.
INTEGERS = {"pareto": ("--isl", "--osl", "--chips"), "optimize": ("--isl", "--osl", "--chips",
            "--steps", "--blocks"), "compare": ("--isl", "--osl"),
            "policy": ("--isl", "--osl", "--chips", "--requests")}
#: Options whose value must be a positive finite number (optimize's limits and prices).
LIMITS = ("--max-tpot-ms", "--min-interactivity", "--max-ttft-ms", "--max-e2e-s",
          "--max-power-w", "--max-deployment-power-kw", "--usd-per-chip-hour", "--usd-per-kwh")
#: Options naming something, per command.
NAMES = {"pareto": ("--model", "--chip", "--precision", "--format"),
         "optimize": ("--model", "--chip", "--precision", "--format", "--objective"),
         "compare": ("--model", "--chips", "--mode", "--format"),
         "list": ("--format",), "policy": ("--model", "--chip", "--format", "--objective")}

bad_numbers = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "-0.5", "1e400", "", "x",
                               "1,2", "0x10", "NaN", "--"])
bad_integers = st.sampled_from(["0", "-3", "1.5", "nan", "inf", "", "two", "1e3", "99999999999"
                                "99999999"])
junk = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
               min_size=1, max_size=12).filter(lambda s: not s.startswith("-"))


@st.composite
def faulty(draw):
    command = draw(st.sampled_from(sorted(BASES)))
    argv = list(BASES[command])
    kind = draw(st.sampled_from(["option", "integer", "limit", "name", "missing", "positional",
                                 "caps", "classes"]))
    if kind == "option":
        argv.append("--" + draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1,
                                        max_size=10)).strip("-") + "-nope")
    elif kind == "integer" and command in INTEGERS:
        argv += [draw(st.sampled_from(INTEGERS[command])), draw(bad_integers)]
    elif kind == "limit" and command == "optimize":
        argv += [draw(st.sampled_from(LIMITS)), draw(bad_numbers)]
    elif kind == "name" and command in NAMES:
        argv += [draw(st.sampled_from(NAMES[command])), "zz" + draw(junk)]
    elif kind == "missing" and command in NAMES:
        argv.append(draw(st.sampled_from(NAMES[command])))   # the value is missing
    elif kind == "positional":
        if command == "predict":
            argv[1] = draw(st.sampled_from(["no/such/file.csv", "/", "pyproject.toml",
                                            "README.md"]))
        else:
            argv.insert(1, "zz" + draw(junk))
    elif kind == "caps" and command == "optimize":
        argv += ["--power-caps", draw(st.sampled_from(["nan", "0", "-0.5", "2", "inf", "",
                                                       "0.5,,1", "a,b", "1.5,0.8"]))]
    elif kind == "classes" and command == "optimize":
        option = draw(st.sampled_from(["--formats", "--placements"]))
        argv += [option, draw(st.sampled_from(["weights", "=fp8", "weights=", "bogus=fp8",
                                               "weights=fp3", "kv=bogus", "attention=nope"]))]
    else:
        argv.append("--" + "bogus")
    return argv


@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(faulty())
def test_malformed_arguments_are_refused(argv):
    try:
        status = main(argv)
    except SystemExit as error:   # --help cannot be drawn; any other exit is a bug
        pytest.fail(f"SystemExit({error.code}) for {argv}")
    assert status == 2, argv


def test_the_bases_are_valid():
    """The faults are in what is drawn, not in the argument lists they are put into: every
    base parses (running them all would take minutes), and the cheap one runs."""
    parser = build_parser()
    for argv in BASES.values():
        parser.parse_args(argv)
    assert main(BASES["list"]) == 0
