"""The routing plugins, registered by name in one explicit table.

`PLUGINS` are those a config may name: in `routing.scorers` (with a weight, for those that
score) or in `routing.plugins` (with parameters). `ALWAYS` run for every request whatever the
config says, after the configured filters. A plugin is one file here and one line below;
the router takes the tables as arguments, so a plugin written elsewhere is registered by
handing the router a table with it (`Router(deps, {**PLUGINS, "mine": Mine})`).
"""

from __future__ import annotations

from collections.abc import Mapping
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
