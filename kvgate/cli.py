"""`kvgate serve | check-config | envoy-config | sim | demo | plan | top`: one sub-command
per module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, help). Each module has add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "serve": ("kvgate.commands.serve", "run the gateway"),
    "check-config": ("kvgate.commands.check_config", "validate a config file and print it resolved"),
    "envoy-config": ("kvgate.commands.envoy_config",
                     "Envoy's config, with kvgate as its endpoint picker"),
    "sim": ("kvgate.sim.cli", "run simulated vLLM replicas"),
    "demo": ("kvgate.commands.demo", "run a simulated fleet with kvgate in front"),
    "plan": ("kvgate.tools.plan", "KV-cache capacity plan for a model and GPU"),
    "top": ("kvgate.commands.top", "a live terminal view of a running kvgate"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Import only the command asked for (all of them for --help): `kvgate plan` need not load
    # aiohttp, and one command's import error cannot break another.
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if chosen is not None and name != chosen:
            continue
        module = importlib.import_module(module_name)
        module.add_arguments(command_parser)
        command_parser.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
