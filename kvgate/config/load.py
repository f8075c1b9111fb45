"""Reading a configuration: a YAML file or tree, `${ENV}` interpolation, validation with
errors that name the key path, command-line overrides, and the resolved config with its
secrets masked. A bad file is refused whole: at start the process exits non-zero; on SIGHUP
the old configuration stays in force (see `kvgate.app`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr, ValidationError

from kvgate.config.base import CROSS_REFERENCES, ConfigError
from kvgate.config.schema import Config
from kvgate.error_path import error_path

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(tree: Any, env: Mapping[str, str]) -> Any:
    """Replace `${VAR}` / `${VAR:-default}` in every string of a parsed YAML tree; every
    variable that is unset and has no default is reported, each with its key path."""
    problems: list[str] = []
    out = _interpolate(tree, env, "", problems)
    if problems:
        raise ConfigError(problems)
    return out


def _interpolate(tree: Any, env: Mapping[str, str], path: str, problems: list[str]) -> Any:
    if isinstance(tree, dict):
        return {k: _interpolate(v, env, _join(path, k), problems) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_interpolate(v, env, f"{path}[{i}]", problems) for i, v in enumerate(tree)]
    if not isinstance(tree, str):
        return tree

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        problems.append(f"{path or '<root>'}: environment variable {name} is not set")
        return match.group(0)

    return _ENV.sub(substitute, tree)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _problems(error: Mapping[str, Any]) -> list[str]:
    message = _message(error)
    if message.startswith(CROSS_REFERENCES):
        return message.removeprefix(CROSS_REFERENCES).split("\n")
    return [f"{error_path(error['loc']) or '<root>'}: {message}"]


def _message(error: Mapping[str, Any]) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key"
    if error["type"] == "missing":
        return "required"
    message = str(error["msg"])
    return message.removeprefix("Value error, ")


def parse_config(tree: Any, env: Mapping[str, str] | None = None) -> Config:
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(["<root>: must be a mapping"])
    tree = interpolate(tree, os.environ if env is None else env)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError([p for e in exc.errors() for p in _problems(e)]) from None


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    return parse_config(read_tree(path), env)


LONG_THRESHOLD = 16384  # worst-case tokens from which `--long-upstream` replicas serve


def quick_config(
    upstreams: list[str], long_upstreams: list[str] | None = None, redis_url: str | None = None
) -> dict[str, Any]:
    """The config tree `kvgate serve --upstream URL ...` runs with when no file is given."""
    tree: dict[str, Any] = {"pools": {"default": {"replicas": [{"url": u} for u in upstreams]}}}
    if long_upstreams:
        tree["pools"]["long"] = {
            "replicas": [{"url": u} for u in long_upstreams],
            "min_worst_case_tokens": LONG_THRESHOLD,
        }
    if redis_url:
        tree["state"] = {"backend": "redis", "redis_url": redis_url}
    return tree


def apply_overrides(
    tree: dict[str, Any],
    *,
    upstreams: list[str] | None = None,
    long_upstreams: list[str] | None = None,
    long_threshold: int | None = None,
    redis_url: str | None = None,
    host: str | None = None,
    port: int | None = None,
) -> dict[str, Any]:
    """Command-line flags win over the file."""
    tree = dict(tree)
    pools = dict(tree.get("pools") or {})
    if upstreams:
        name = next(iter(pools), "default") if pools else "default"
        pools[name] = {**dict(pools.get(name) or {}), "replicas": [{"url": u} for u in upstreams]}
    if long_upstreams:
        long_pool = dict(pools.get("long") or {"min_worst_case_tokens": LONG_THRESHOLD})
        long_pool["replicas"] = [{"url": u} for u in long_upstreams]
        pools["long"] = long_pool
    if long_threshold is not None:
        if "long" not in pools:
            raise ConfigError(["--long-threshold: there is no long pool (add --long-upstream)"])
        pools["long"] = {**dict(pools["long"]), "min_worst_case_tokens": long_threshold}
    if pools:
        tree["pools"] = pools
    if redis_url:
        tree["state"] = {**dict(tree.get("state") or {}), "backend": "redis", "redis_url": redis_url}
    server = dict(tree.get("server") or {})
    if host is not None:
        server["host"] = host
    if port is not None:
        server["port"] = port
    if server:
        tree["server"] = server
    return tree


def read_tree(path: str | Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: {exc.strerror or exc}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError([f"{path}: must be a mapping"])
    return tree


def masked(config: Config) -> dict[str, Any]:
    """The resolved config as plain data, with every secret replaced by '***'."""
    data = config.model_dump(mode="json")
    if config.state.redis_url is not None:  # the URL shows, its password does not
        data["state"]["redis_url"] = secret(config.state.redis_url)

    def mask(node: Any, key: str = "") -> Any:
        if isinstance(node, dict):
            return {k: mask(v, k) for k, v in node.items()}
        if isinstance(node, list):
            return [mask(v, key) for v in node]
        if key in ("api_key", "redis_url") and node:
            return "***" if key == "api_key" else _mask_url(str(node))
        return node

    return mask(data)  # type: ignore[no-any-return]


def _mask_url(url: str) -> str:
    """`redis://user:pw@host/0` -> `redis://user:***@host/0`; a `password=` query too. All
    before the last '@' counts as userinfo, so a password with a raw '/' or '@' is hidden too."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.\-]*://)(.*)@", url)
    if match:
        user, colon, _ = match.group(2).partition(":")
        userinfo = f"{user}:***" if colon else "***"
        url = f"{match.group(1)}{userinfo}@{url[match.end():]}"
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)


def secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None
