"""The `perfmodel` command line: `perfmodel <command> [options]`.

Subcommands live in `perfmodel/commands/`, one module per command in `_COMMANDS`, each with a
`register(subparsers)` that adds its parser and `set_defaults(func=...)`. Errors (bad names,
values, a model that does not fit) print one line, ``perfmodel: error: ...``, to stderr and
exit with status 2; never a traceback.

Example:
    >>> main(["pareto", "--chip", "nonesuch"])   # stderr: perfmodel: error: unknown chip ...
    2
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

#: Subcommands, in help order, and the module of `perfmodel.commands` that provides each
#: (`list` would shadow the builtin inside the package).
_COMMANDS = {"pareto": "pareto", "compare": "compare", "predict": "predict",
             "optimize": "optimize", "simulate": "simulate", "policy": "policy",
             "sweep": "sweep", "list": "catalog"}


class _UsageError(Exception):
    """A command-line usage error, printed as one line by `main`."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of printing usage and exiting, so `main` can
    print one line."""

    def error(self, message):
        raise _UsageError(message)


class _Version(argparse.Action):
    """--version: print `version()` on one line (argparse's own action wraps it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand of `_COMMANDS` registered."""
    parser = _Parser(prog="perfmodel",
                     description="Differentiable performance model of LLM inference.")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print the version and the fitted parameters' versions, exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                       parser_class=_Parser)
    for module in _COMMANDS.values():
        command = importlib.import_module(f"perfmodel.commands.{module}").register(subparsers)
        command.add_argument("--quiet", "-q", action="store_true",
                             help="no progress bar (one appears on a terminal when a run "
                                  "lasts more than two seconds)")
    return parser


def version() -> str:
    """"perfmodel X.Y.Z (fitted parameters: fitted_params.json vN of DATE, ...)"."""
    from .commands import versions

    v = versions()
    return (f"perfmodel {v['perfmodel_version']} (fitted parameters: {v['fitted_latency']}, "
            f"{v['fitted_power']})")


def _runtime_message(error: RuntimeError) -> str | None:
    """The message of a failed `eqx.error_if` check without equinox's advice on debugging,
    or None when `error` is not one."""
    text = str(error)
    found = re.search(r"Equinox\w*Error: (.*)", text, re.S)
    if found is not None:
        text = found.group(1)
    elif not type(error).__name__.startswith("Equinox"):
        return None
    return re.split(r"\n\s*-{5,}|\n\s*\n", text.strip(), maxsplit=1)[0].strip()


def _fail(message: str) -> int:
    text = " ".join(str(message).split())   # one line, whatever the message held
    print(f"perfmodel: error: {text}", file=sys.stderr)
    return 2


def compilation_cache_dir() -> str | None:
    """Where the command line keeps compiled kernels between runs (JAX's persistent
    compilation cache): `$PERFMODEL_CACHE_DIR`, default `~/.cache/perfmodel/xla`; None when
    the variable is "off" or the folder cannot be created."""
    path = os.environ.get("PERFMODEL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "perfmodel", "xla")
    if path.strip().lower() == "off":
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path


def main(argv: list[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: arguments without the program name (default `sys.argv[1:]`).

    Returns:
        The exit status: 0 on success, 2 on a usage or value error.
    """
    import jax

    jax.config.update("jax_enable_x64", True)
    # A second `perfmodel optimize` loads its kernels instead of compiling them (minutes).
    cache = compilation_cache_dir()
    if cache is not None and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache)
        # Every kernel, the small eager ones too: recompiling those (JAX caches only
        # kernels that took a second) cost about 0.5 s of each warm `perfmodel optimize`.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except _UsageError as error:
        return _fail(error)
    except ValueError as error:
        return _fail(error)
    except BrokenPipeError:   # `perfmodel pareto | head`
        return 0
    except RuntimeError as error:   # a run-time check of a traced value (`eqx.error_if`)
        message = _runtime_message(error)
        if message is None:
            raise
        return _fail(message)
    except OSError as error:   # a file that went away or filled the disk mid-run
        where = f"{error.filename}: " if error.filename else ""
        return _fail(f"{where}{error.strerror or error}")


if __name__ == "__main__":
    sys.exit(main())
