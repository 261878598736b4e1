"""A test-only fault inside a receiving member: change one received byte after its bucket's
checksum, before the bytes are unpacked to where they land. Off unless armed.

Tests use it to prove that a receiver catches corruption in its own code path (`landed`), which
the wire checksums cannot see. Armed per refit through a file, so one running generator can take
good and faulty refits in turn: a member whose process has `WEIGHTSYNC_TEST_LANDING_FAULT_FILE`
set reads that file when a transfer starts; if it exists, its content names the fault:

- `after_checksum`: wait until the bucket's checksum has run, then flip a bit (the case the wire
  checksums miss: they cover the bytes as received);
- `racing`: flip it at once, racing the checksum worker (the wire or the landed check may catch
  it, depending on who runs first; either must).

The bit flipped is in the middle bucket this member receives in the stage, at that bucket's
middle byte. No production setting arms it; the variable is read once, when the agent starts.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

import torch

LANDING_FAULT_ENV = "WEIGHTSYNC_TEST_LANDING_FAULT_FILE"


class LandingFault(enum.StrEnum):
    AFTER_CHECKSUM = "after_checksum"
    RACING = "racing"


def fault_file_from_env() -> Path | None:
    """The arming file named by `WEIGHTSYNC_TEST_LANDING_FAULT_FILE`, or None (the default)."""
    value = os.environ.get(LANDING_FAULT_ENV, "")
    return Path(value) if value else None


def armed(fault_file: Path | None) -> LandingFault | None:
    """The fault the file names now, or None when there is no file. Raises ValueError naming the
    file and its content when it names no fault."""
    if fault_file is None:
        return None
    try:
        text = fault_file.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        return LandingFault(text)
    except ValueError:
        known = ", ".join(f.value for f in LandingFault)
        raise ValueError(
            f"{LANDING_FAULT_ENV} file {fault_file} holds {text!r}; expected one of {known}"
        ) from None


@dataclass(frozen=True)
class FaultAt:
    """Where an armed fault strikes in one receive loop: bucket number `index` of its order."""

    fault: LandingFault
    index: int

    @staticmethod
    def of(fault: LandingFault | None, buckets: int) -> FaultAt | None:
        return None if fault is None or not buckets else FaultAt(fault, buckets // 2)


def flip_bit(flat: torch.Tensor) -> None:
    """Flip the lowest bit of the middle byte of `flat` (a uint8 buffer), in place."""
    middle = flat[flat.numel() // 2 : flat.numel() // 2 + 1]
    middle.bitwise_xor_(1)
