"""The installed `perfmodel` console script, run in a fresh process as a user runs it."""

import os
import shutil
import subprocess
import sys


def command() -> str:
    """The console script installed beside this interpreter (pip's entry point)."""
    script = os.path.join(os.path.dirname(sys.executable), "perfmodel")
    found = script if os.path.exists(script) else shutil.which("perfmodel")
    assert found, "the perfmodel console script is not installed (pip install -e .)"
    return found


def run(*argv, timeout=300):
    """(exit status, stdout, stderr) of `perfmodel ARGV` in a fresh process, piped."""
    done = subprocess.run([command(), *argv], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout, done.stderr
