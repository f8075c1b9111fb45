"""The routing plugins, registered by name.

`PLUGINS` are the built-in ones a config may name: in `routing.scorers` (with a weight, for
those that score) or in `routing.plugins` (with parameters). `ALWAYS` run for every request
whatever the config says, after the configured filters. A plugin is one file here and one
line below.

A plugin from outside is named in the config like any other, once `registry` finds it:
- installed: a package that declares it under the entry-point group `kvgate.routing_plugins`
  (`mine = "my_package.routing:Mine"` in its pyproject's
  `[project.entry-points."kvgate.routing_plugins"]`) is named `mine`;
- or by where it is: `my_package.routing:Mine`, imported from kvgate's Python path.
Both are checked with the config, at start and on reload, as the built-in ones are.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

from kvgate.routing.plugin import Plugin
from kvgate.routing.plugins.least_loaded import LeastLoaded
from kvgate.routing.plugins.prefix_affinity import PrefixAffinity
from kvgate.routing.plugins.round_robin import RoundRobin
from kvgate.routing.plugins.session_affinity import SessionAffinity
from kvgate.routing.plugins.trial_gate import TrialGate

PluginTable = Mapping[str, type[Plugin[Any]]]

PLUGINS: PluginTable = {
    "least_loaded": LeastLoaded,
    "round_robin": RoundRobin,
    "prefix_affinity": PrefixAffinity,
    "session": SessionAffinity,
}

ALWAYS: PluginTable = {
    "trial_gate": TrialGate,
}

ENTRY_POINTS = "kvgate.routing_plugins"


# every plugin from outside `registry` has loaded, by name: the router's table without I/O
_loaded: dict[str, type[Plugin[Any]]] = {}


def registry(names: Iterable[str] = ()) -> dict[str, type[Plugin[Any]]]:
    """The plugins a config may name: the built-in ones, those installed packages declare
    under `kvgate.routing_plugins`, and, of `names`, each given as `module:Class`. A name that
    is none of these is left out (the config check names it); one that cannot be loaded
    raises ValueError saying why. Where `names` are all built in, that is all; else it reads
    the installed packages' metadata and imports: called where a config is loaded
    (`Runtime.load`; off the event loop on a reload), never on a request's path, which reads
    `loaded`."""
    table: dict[str, type[Plugin[Any]]] = dict(PLUGINS)
    names = list(names)
    if all(name in PLUGINS for name in names):  # nothing to look for (nor any I/O to do)
        return table
    for point in entry_points(group=ENTRY_POINTS):
        if point.name not in table:
            table[point.name] = _plugin(point.name, point.load)
    for name in names:
        if ":" in name and name not in table:
            table[name] = _plugin(name, functools.partial(_by_path, name))
    _loaded.update((name, cls) for name, cls in table.items() if name not in PLUGINS)
    return table


def loaded() -> dict[str, type[Plugin[Any]]]:
    """The built-in plugins and those `registry` has loaded: no I/O."""
    return {**PLUGINS, **_loaded}


def _by_path(name: str) -> Any:
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _plugin(name: str, load: Any) -> type[Plugin[Any]]:
    try:
        found = load()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{name}: cannot be loaded ({exc})") from None
    if not (isinstance(found, type) and issubclass(found, Plugin)):
        raise ValueError(f"{name}: {found!r} is not a routing plugin (kvgate.routing.plugin.Plugin)")
    return found
