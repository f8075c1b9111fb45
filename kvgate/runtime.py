"""One version of the config and what is built from it: the snapshot a request runs under.

    reload ──► Runtime.load(config) ──► gateway.runtime ──► rt = gateway.runtime (a request)
                                                       └──► CurrentConfig (background stages)

A request takes the runtime in force when it starts, `rt = gateway.runtime`, and every stage of
its path reads that one — `rt.config`, its tenants, its models' prompt counters — so a reload
never changes the rules under a request in flight. Background stages, and the state every
request shares (a pool's queue, the circuits, the leases), read the config in force whenever
they need a setting, through one accessor (`kvgate.config.CurrentConfig`); nothing is copied
into them at reload. Loading a runtime is where a config is refused for what the schema alone
cannot tell: a tokenizer that does not load, a routing plugin that does not exist or that
refuses its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.config import Config
from kvgate.request.catalog import Catalog
from kvgate.routing.router import check_routing
from kvgate.tenants import Directory


@dataclass(frozen=True, slots=True)
class Runtime:
    config: Config
    directory: Directory  # the tenants: who sent a request, what it may do
    catalog: Catalog  # the models: a prompt counter each, over the loaded tokenizers

    @classmethod
    def load(cls, config: Config, previous: Runtime | None = None) -> Runtime:
        """Everything `config` needs to serve, loaded now; raises ConfigError or
        TokenizerError. Tokenizers the `previous` runtime loaded are shared, not loaded again."""
        check_routing(config.routing)
        return cls(
            config,
            Directory(config.auth, config.tenants),
            Catalog(config, previous.catalog if previous is not None else None),
        )
