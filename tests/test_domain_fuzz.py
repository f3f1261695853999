"""No NaN, no infinity and no impossible value across the valid domain, in values and
forward derivatives, through every layout representation, in float64 and float32
(`domain_fuzz.py`): 10,000 points per precision over every case, with the slow tests (each
case compiles its vmapped values and derivatives for 5-15 s; float32 runs in its own
process, since the suite fixes x64)."""

import os
import subprocess
import sys

import pytest
from domain_fuzz import CASES, problems

HERE = os.path.dirname(__file__)


def _x32(points, cases):
    """The fuzz in a fresh process with x64 off (this process keeps x64 on)."""
    done = subprocess.run([sys.executable, os.path.join(HERE, "domain_fuzz.py"), "--x32",
                           "--points", str(points), "--cases", *cases],
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "JAX_ENABLE_X64": "0"})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "no problem" in done.stdout


@pytest.mark.slow   # five cases compiled twice, 10,000 points each way (about 90 s)
@pytest.mark.parametrize("x32", [False, True])
def test_valid_domain_every_case_10000_points(x32):
    if x32:
        _x32(10_000, tuple(CASES))
    else:
        found = []
        for k, name in enumerate(CASES):
            found += problems(name, 2000, seed=100 + k)
        assert not found, found
