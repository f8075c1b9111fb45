"""`kvgate check-config FILE`: validate, then print the resolved config with secrets masked."""

from __future__ import annotations

import argparse
import sys

import yaml

from kvgate.config import ConfigError, load_config, masked
from kvgate.request.tokenizers import TokenizerError
from kvgate.runtime import Runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the YAML config to check")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
        Runtime.load(config)  # tokenizers and scorers must load too, as at start
    except (ConfigError, TokenizerError) as exc:
        print(f"{args.file}: invalid\n{exc}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump(masked(config), sort_keys=False))
    print(f"# {args.file}: valid", file=sys.stderr)
    return 0
