"""docs/configuration.md is the reference of every configuration key; it must match the schema
(`kvgate.config.Config`), defaults included. The README's excerpt must be a valid config."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvgate.config import AdmissionConfig, Config, parse_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([^`]+)` \| (.*?) \|", re.MULTILINE)


def nested(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The section a field holds, if any, and how its path goes on: `[]` for a list of
    entries, `.<name>` for a map of them."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if origin is list:
        model, rest = nested(typing.get_args(annotation)[0])
        return model, "[]" + rest
    if origin is dict:
        model, rest = nested(typing.get_args(annotation)[1])
        return model, ".<name>" + rest
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return nested(options[0])
    return None, ""


Key = tuple[type[BaseModel], str, FieldInfo]  # the section, the field's name, the field


def keys(model: type[BaseModel], prefix: str = "") -> dict[str, Key]:
    """Every key path of the schema, sections included."""
    out = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        out[path] = (model, name, field)
        section, rest = nested(field.annotation)
        if section is not None:
            out.update(keys(section, path + rest))
    return out


def documented() -> dict[str, str]:
    """The reference tables: key path -> its default cell."""
    return dict(ROW.findall(DOC.read_text(encoding="utf-8")))


def default(field: FieldInfo) -> Any:
    value = field.get_default(call_default_factory=True)
    return value.model_dump() if isinstance(value, BaseModel) else value


def test_every_documented_key_exists():
    assert set(documented()) - set(keys(Config)) == set()


def test_every_setting_is_documented():
    """Each setting once at least: a section used in two places (a model's and a tenant's
    normalization) is documented at one of them."""
    schema, doc = keys(Config), documented()
    leaves: dict[tuple[type[BaseModel], str], set[str]] = {}
    for path, (section, name, field) in schema.items():
        if nested(field.annotation)[0] is None:
            leaves.setdefault((section, name), set()).add(path)
    missing = sorted(min(paths) for paths in leaves.values() if not paths & set(doc))
    assert missing == []


def test_the_documented_defaults_are_the_schemas():
    schema = keys(Config)
    wrong = {}
    for path, cell in documented().items():
        if path not in schema:
            continue  # test_every_documented_key_exists says so
        field = schema[path][2]
        if cell == "required" and not field.is_required():
            wrong[path] = "documented as required, has a default"
        elif re.fullmatch(r"`[^`]*`", cell) and yaml.safe_load(cell.strip("`")) != default(field):
            wrong[path] = f"documented {cell}, default {default(field)!r}"
    assert wrong == {}


def readme_excerpt() -> dict[str, Any]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    # its Kubernetes manifest (the InferencePool) aside
    blocks = [b for b in blocks if not b.startswith("apiVersion:")]
    assert len(blocks) == 1, "the README shows one YAML excerpt of kvgate's config"
    tree = yaml.safe_load(blocks[0])
    assert isinstance(tree, dict)
    return tree


def test_the_readmes_excerpt_is_a_valid_config():
    parse_config(readme_excerpt(), env={})


def test_the_readmes_excerpt_shows_admission_as_it_is_by_default():
    """The README says what admission does by default; its excerpt's admission section is
    the defaults, so a changed default cannot leave the front page behind."""
    shown = readme_excerpt()["admission"]
    defaults = AdmissionConfig().model_dump()

    def same(shown: dict[str, Any], defaults: dict[str, Any], path: str) -> list[str]:
        out = []
        for key, value in shown.items():
            if isinstance(value, dict) and isinstance(defaults[key], dict) and defaults[key]:
                out += same(value, defaults[key], f"{path}.{key}")
            elif value != defaults[key]:
                out.append(f"{path}.{key}: {value!r}, default {defaults[key]!r}")
        return out

    assert same(shown, defaults, "admission") == []
