"""Routing keeps its plugins to itself: nothing in kvgate outside kvgate/routing/ imports a
plugin module or names a plugin. The one exception is the config, whose defaults are a
user's words (`routing.scorers`' default weights name the plugins they weigh)."""

from __future__ import annotations

import re
from pathlib import Path

import kvgate
from kvgate.routing.plugins import ALWAYS, PLUGINS

PACKAGE = Path(kvgate.__file__).parent
OUTSIDE = [
    path for path in sorted(PACKAGE.rglob("*.py"))
    if not path.is_relative_to(PACKAGE / "routing") and not path.is_relative_to(PACKAGE / "config")
]
PLUGIN_IMPORT = re.compile(
    r"kvgate\.routing\.plugins\b|from\s+kvgate\.routing\s+import\s+[^\n]*\bplugins\b"
)


def test_there_are_modules_to_check():
    assert len(OUTSIDE) > 50


def test_no_module_outside_routing_imports_a_plugin_module():
    importing = [str(p.relative_to(PACKAGE)) for p in OUTSIDE if PLUGIN_IMPORT.search(p.read_text())]
    assert importing == []


def test_no_module_outside_routing_names_a_plugin():
    names = "|".join(map(re.escape, [*PLUGINS, *ALWAYS]))
    literal = re.compile(rf"""["']({names})["']""")
    naming = [
        f"{p.relative_to(PACKAGE)}: {m.group(0)}"
        for p in OUTSIDE for m in literal.finditer(p.read_text())
    ]
    assert naming == []
