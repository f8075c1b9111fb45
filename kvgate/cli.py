"""`kvgate serve | check-config | sim | demo | plan`: one sub-command per module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, help). Each module has add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "serve": ("kvgate.commands.serve", "run the gateway"),
    "check-config": ("kvgate.commands.check_config", "validate a config file and print it resolved"),
    "sim": ("kvgate.sim.cli", "run simulated vLLM replicas"),
    "demo": ("kvgate.commands.demo", "run a simulated fleet with kvgate in front"),
    "plan": ("kvgate.plan", "KV-cache capacity plan for a model and GPU"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(command_parser)
        command_parser.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
