"""Weight versions cross every edge through `syncd.weight_version`: what it accepts and refuses, and
the generator's text labels."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from syncd.weight_version import (
    MAX_WEIGHT_VERSION,
    Version,
    WeightVersionJson,
    parse_weight_version,
    version_label,
    version_of_label,
)


class Body(BaseModel):
    version: WeightVersionJson


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        (7, 7),
        (MAX_WEIGHT_VERSION, MAX_WEIGHT_VERSION),
        ("0", 0),
        ("42", 42),
        ("007", 7),
    ],
)
def test_versions_are_parsed(value: object, expected: int) -> None:
    assert parse_weight_version(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [
        -1,
        MAX_WEIGHT_VERSION + 1,
        True,
        7.0,
        None,
        "",
        "-1",
        "+3",
        " 3",
        "3.0",
        "latest",
        "٣",
        str(MAX_WEIGHT_VERSION + 1),
    ],
)
def test_what_is_no_version_is_refused_naming_it(value: object) -> None:
    with pytest.raises(
        ValueError, match=r"weight version .* is not an integer from 0 to 9223372036854775807"
    ):
        parse_weight_version(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value, ok",
    [
        (0, True),
        (MAX_WEIGHT_VERSION, True),
        (-1, False),
        (MAX_WEIGHT_VERSION + 1, False),
        (True, False),
        (7.0, False),
        ("7", False),  # JSON bodies are strict: a string is no version there
    ],
)
def test_json_bodies_follow_the_same_range(value: object, ok: bool) -> None:
    if ok:
        assert Body(version=value).version == value  # type: ignore[arg-type]
    else:
        with pytest.raises(ValidationError):
            Body(version=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [0, 1, 12, MAX_WEIGHT_VERSION])
def test_a_label_names_its_version_again(version: int) -> None:
    label = version_label(parse_weight_version(version))
    assert label == str(version) and version_of_label(label) == version


@pytest.mark.parametrize("label", ["base", "sft-2", "1.5", "-1", ""])
def test_other_labels_name_no_trainer_version(label: str) -> None:
    assert version_of_label(label) is None


def test_both_handles_name_a_version_alike_by_label_and_step() -> None:
    assert Version.of(3) == Version.of("3") == Version.of(Version("3", 3)) == Version("3", 3)
    assert Version.of("base") == Version("base", None) and str(Version.of(3)) == "3"


@pytest.mark.parametrize(
    "served, wanted, exact, reaches",
    [
        ("3", "3", False, True),
        ("5", "3", False, True),  # a newer step serves a wait for an older one
        ("5", "3", True, False),
        ("2", "3", False, False),
        ("base", "3", False, False),  # a label that names no step is older than none, newer than none
        ("3", "base", False, False),
        ("base", "base", True, True),
    ],
)
def test_a_served_version_reaches_the_one_asked_for_or_an_older_step(served, wanted, exact, reaches) -> None:
    assert Version.of(served).reaches(Version.of(wanted), exact) is reaches
