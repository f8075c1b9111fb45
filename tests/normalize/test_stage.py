"""Settings per model and tenant, each level over the one below, and the config's checks."""

from __future__ import annotations

import pytest

from kvgate.config import ConfigError, parse_config
from kvgate.metrics import Metrics
from kvgate.normalize.stage import PromptStage
from tests.normalize.helpers import chat, system, user

POOLS = {"default": {"replicas": [{"url": "http://127.0.0.1:1"}]}}


def config(**tree):
    return parse_config({"pools": POOLS, **tree})


def rules(cfg, model="m", tenant="t"):
    stage = PromptStage(Metrics())
    settings = stage.settings(cfg, model, cfg.tenant(tenant) or cfg.tenants[0])
    return None if settings is None else set(settings.rules)


SAFE = {"invisible_characters", "line_endings", "unicode_nfc", "trailing_whitespace",
        "canonical_json"}


def test_the_safe_rules_are_on_by_default_and_the_others_opt_in():
    assert rules(config(tenants=[{"name": "t"}])) == SAFE


def test_a_tenant_overrides_its_model_which_overrides_the_global_switches():
    cfg = config(
        normalization={"rules": {"unicode_nfc": False}},
        models=[{"name": "m", "normalization": {"rules": {"merge_system": True}}}],
        tenants=[{"name": "t", "normalization": {"rules": {"merge_system": False,
                                                           "system_first": True}}},
                 {"name": "u"}],
    )
    assert rules(cfg, tenant="t") == SAFE - {"unicode_nfc"} | {"system_first"}
    assert rules(cfg, tenant="u") == SAFE - {"unicode_nfc"} | {"merge_system"}
    assert rules(cfg, model="other", tenant="u") == SAFE - {"unicode_nfc"}


def test_normalization_can_be_switched_off_for_one_tenant_only():
    cfg = config(tenants=[{"name": "t", "normalization": {"enabled": False}}, {"name": "u"}])
    assert rules(cfg, tenant="t") is None
    assert rules(cfg, tenant="u") == SAFE


def test_a_tenant_with_normalization_off_still_gets_a_fingerprint():
    cfg = config(tenants=[{"name": "t", "normalization": {"enabled": False}}])
    parsed = chat(system("noisy  "), user("q"))
    out, key = PromptStage(Metrics()).apply(parsed, cfg.tenants[0], cfg)
    assert out is parsed and key is not None


@pytest.mark.parametrize(("tree", "problem"), [
    ({"normalization": {"rules": {"spellcheck": True}}}, "normalization.rules.spellcheck: unknown key"),
    ({"tenants": [{"name": "t", "normalization": {"rules": {"spellcheck": True}}}]},
     "tenants[0].normalization.rules.spellcheck"),
    ({"normalization": {"relocate": {"patterns": ["timestamps"]}}}, "unknown pattern"),
    ({"normalization": {"code_blocks": "strip"}}, "normalization.code_blocks"),
])
def test_bad_normalization_config_is_refused_naming_the_key(tree, problem):
    with pytest.raises(ConfigError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        config(**tree)
