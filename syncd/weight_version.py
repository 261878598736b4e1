"""Weight versions: the one type syncd, its members, both services and syncctl use for them.

A trainer numbers its weights by the optimizer steps it has taken, counting anew in each training
run, so a version alone names no weights: (run_id, version) does (`syncd.daemon.versions`). Inside
Python a version is a `WeightVersion`, a non-negative int that fits the protobuf's int64 fields. The
edges convert here and nowhere else:

- `parse_weight_version` takes one in from outside (a CLI argument, a member's Register or
  announcement) and says what was wrong; `WeightVersionJson` is the same rule for pydantic bodies
  (strict: `true`, `"7"` and `7.0` are not versions).
- `version_label` is its text form, for a generator. The generator keeps text versions on its HTTP
  API (`{"version": "3"}`) because vLLM's own `weight_version` is a string label and because an
  operator may load a checkpoint under any label ("base", "sft-2") by hand; syncd's versions reach
  it as their decimal label, and `version_of_label` reads a label back (None for a label that is no
  trainer version).

`Version` is what users see on both attach handles and in the generator's HTTP answers: the label
with the trainer step it came from (`step`, None for a label that is no trainer version), so a
trainer's `handle.version` and a receiver's compare field by field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, NewType

WeightVersion = NewType("WeightVersion", int)

MAX_WEIGHT_VERSION = 2**63 - 1  # the protobuf fields are int64


def __getattr__(name: str):
    """`WeightVersionJson` needs pydantic, which only the HTTP servers have: the member library
    (trainer ranks, GPU workers) imports this module without it."""
    if name == "WeightVersionJson":
        from pydantic import Field, Strict

        return Annotated[WeightVersion, Strict(), Field(ge=0, le=MAX_WEIGHT_VERSION)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_DECIMAL = re.compile(r"[0-9]+")


def parse_weight_version(value: int | str) -> WeightVersion:
    """`value` (an int, or its decimal digits) as a weight version; raises ValueError naming it."""
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WEIGHT_VERSION:
        raise ValueError(f"weight version {value!r} is not an integer from 0 to {MAX_WEIGHT_VERSION}")
    return WeightVersion(value)


def version_label(version: WeightVersion) -> str:
    """The generator's (and vLLM's) label of a trainer version: its decimal digits."""
    return str(version)


def version_of_label(label: str) -> WeightVersion | None:
    """The trainer version a generator's label names, None for any other label."""
    try:
        return parse_weight_version(label)
    except ValueError:
        return None


@dataclass(frozen=True)
class Version:
    """A weight version as the attach handles and the generator's HTTP API show it: syncd's label
    (`version_label`; an operator's label for weights loaded by hand) and the trainer step it came
    from (None for a label that names no step)."""

    label: str
    step: WeightVersion | None

    @classmethod
    def of_step(cls, step: int) -> Version:
        v = parse_weight_version(step)
        return cls(version_label(v), v)

    @classmethod
    def of_label(cls, label: str) -> Version:
        return cls(label, version_of_label(label))

    @classmethod
    def of(cls, value: int | str | Version) -> Version:
        """A step (int), a label (str) or a Version, as a Version."""
        if isinstance(value, Version):
            return value
        return cls.of_step(value) if isinstance(value, int) else cls.of_label(value)

    def reaches(self, wanted: Version, exact: bool = False) -> bool:
        """This version is `wanted`, or (unless `exact`) a newer trainer step: a label that names
        no step reaches only itself."""
        if self.label == wanted.label:
            return True
        if exact or self.step is None or wanted.step is None:
            return False
        return self.step >= wanted.step

    def __str__(self) -> str:
        return self.label
