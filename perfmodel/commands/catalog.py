"""`perfmodel list models|chips|engines`: the names the other commands accept, with the
aliases and the source of each."""

from __future__ import annotations

import argparse
import json
from importlib import resources

from . import add_format_arg, render

KINDS = ("models", "chips", "engines")

#: Table columns per kind: (row key, header, format).
_COLUMNS = {
    "models": (("name", "name", "s"), ("kind", "kind", "s"), ("aliases", "aliases", "s")),
    "chips": (("name", "name", "s"), ("label", "chip", "s"), ("aliases", "aliases", "s")),
    "engines": (("name", "name", "s"), ("fitted_as", "fitted as", "s"),
                ("fit", "fit", "s")),
}


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "list", help="list the model, chip and engine names the commands accept",
        description="List model presets and shipped Hugging Face configs, chip presets, or "
                    "the serving engines with fitted terms, with aliases and sources "
                    "(sources in the JSON and CSV formats).")
    parser.add_argument("kind", choices=KINDS, help="what to list")
    add_format_arg(parser)
    parser.set_defaults(func=run)
    return parser


def _models() -> list[dict]:
    from .. import presets

    rows = []
    for key in presets.model_names():
        info = presets.model_info(key)
        rows.append({"name": key, "kind": "preset",
                     "aliases": " ".join(presets.model_aliases(key)),
                     "source": info.get("source", "")})
    folder = resources.files("perfmodel").joinpath("data", "hf_configs")
    for path in sorted(folder.iterdir(), key=lambda p: p.name.lower()):
        if path.name.endswith(".json"):
            config = json.loads(path.read_text())
            rows.append({"name": path.name[:-5].replace("__", "/"),
                         "kind": "hugging face config", "aliases": "",
                         "source": config.get("_source", "")})
    return rows


def _chips() -> list[dict]:
    from .. import presets

    rows = []
    for key in presets.chip_names():
        info = presets.chip_info(key)
        rows.append({"name": key, "label": info["name"],
                     "aliases": " ".join(a for a in info["aliases"].split("|") if a),
                     "source": info["source"]})
    return rows


def _engines() -> list[dict]:
    from .. import fitted

    latency, power = fitted.read(fitted.LATENCY_FILE), fitted.read(fitted.POWER_FILE)
    version = f"{fitted.LATENCY_FILE} v{latency.get('version', '?')}"
    rows = [{"name": name, "fitted_as": name, "fit": version}
            for name in latency.get("frameworks", {})]
    rows += [{"name": name, "fitted_as": target, "fit": version}
             for name, target in latency.get("framework_fallback", {}).items()]
    rows += [{"name": name, "fitted_as": target,
              "fit": f"{fitted.POWER_FILE} v{power.get('version', '?')}"}
             for name, target in fitted.POWER_FRAMEWORKS.items()]
    return rows


def run(args) -> int:
    rows = {"models": _models, "chips": _chips, "engines": _engines}[args.kind]()
    print(render(rows, args.format, _COLUMNS[args.kind]))
    return 0
