"""What every section of the configuration is built from: the frozen model with no unknown
keys, the priority classes, positive numbers, and the error a bad file raises."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

PRIORITY_CLASSES = ("critical", "standard", "sheddable")
PriorityClass = Literal["critical", "standard", "sheddable"]
PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


# Marks a model-level error whose lines already name their key paths.
CROSS_REFERENCES = "cross-references:\n"


class ConfigError(ValueError):
    """The configuration is invalid; `problems` lists `path: message` lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class Section(BaseModel):
    """One section of the configuration: unknown keys are errors, and it is frozen once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)
