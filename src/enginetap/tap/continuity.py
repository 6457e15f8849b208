"""Continuity: state a request carries between steps must come back as it was left.

- A recurrent or convolution state's hash before step t equals its hash after the
  request's previous step (``Lk.gdn.state_before`` vs ``state_after``).
- The KV row written for position p (``Lk.attn.kv_written``) equals that cache column
  re-read at the request's next step (``kv_prev`` of the row at p + 1).
- Host and device computed-token counters agree where the engine has both.

Violations name the checkpoint (layer), the slot, the request and the position.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from enginetap.tap.files import RankTap, StepRecord

__all__ = ["Violation", "check_continuity", "check_metadata"]

_BEFORE = re.compile(r"^(.*)\.(state|conv)_before$")


@dataclass
class Violation:
    kind: str
    """``state``, ``conv``, ``kv`` or ``counters``."""
    step: int
    checkpoint: str
    key: str
    position: int
    slot: int | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _last_row_of(step: StepRecord) -> dict[str, int]:
    last: dict[str, int] = {}
    for i, row in enumerate(step.rows):
        last[row["key"]] = i
    return last


def _check_states(step: StepRecord, after: dict[tuple[str, str], tuple[int, str]],
                  out: list[Violation]) -> None:
    index = {name: c for c, name in enumerate(step.checkpoints)}
    last = _last_row_of(step)
    for c, name in enumerate(step.checkpoints):
        match = _BEFORE.match(name)
        if match is None:
            continue
        for key, i in last.items():
            seen = after.get((f"{match.group(1)}.{match.group(2)}", key))
            if seen is not None and seen[1] != step.hashes[c][i]:
                row = step.rows[i]
                out.append(Violation(match.group(2), step.step, name, key, row["pos"],
                                     row.get("state_slot"),
                                     f"differs from its hash after step {seen[0]}"))
    for name, c in index.items():
        if name.endswith(("state_after", "conv_after")):
            label = name.rsplit("_", 1)[0]
            for key, i in last.items():
                after[(label, key)] = (step.step, step.hashes[c][i])


def _check_kv(step: StepRecord, written: dict[tuple[str, str, int], tuple[int, str, Any]],
              out: list[Violation]) -> None:
    for c, name in enumerate(step.checkpoints):
        if name.endswith(".kv_prev"):
            layer = name[:-len(".kv_prev")]
            for i, row in enumerate(step.rows):
                seen = written.get((layer, row["key"], row["pos"] - 1))
                if seen is not None and seen[0] < step.step and seen[1] != step.hashes[c][i]:
                    out.append(Violation("kv", step.step, f"{layer}.kv_written", row["key"],
                                         row["pos"] - 1, seen[2],
                                         f"KV row written at step {seen[0]} changed by step "
                                         f"{step.step}"))
    for c, name in enumerate(step.checkpoints):
        if name.endswith(".kv_written"):
            layer = name[:-len(".kv_written")]
            for i, row in enumerate(step.rows):
                written[(layer, row["key"], row["pos"])] = (step.step, step.hashes[c][i],
                                                           row.get("kv_slot"))


def check_continuity(rank: RankTap) -> list[Violation]:
    """Every state and KV continuity violation of one rank, in step order."""
    out: list[Violation] = []
    after: dict[tuple[str, str], tuple[int, str]] = {}
    written: dict[tuple[str, str, int], tuple[int, str, Any]] = {}
    for step in rank.steps:
        _check_states(step, after, out)
        _check_kv(step, written, out)
    return out


def check_metadata(rank: RankTap) -> list[Violation]:
    """Rows whose host and device computed-token counters disagree."""
    out = []
    for step in rank.steps:
        for row in step.rows:
            device = row.get("computed_device")
            if device is not None and device != row.get("computed_host"):
                out.append(Violation("counters", step.step, "rows", row["key"], row["pos"],
                                     row.get("kv_slot"), f"host {row.get('computed_host')} "
                                     f"vs device {device}"))
    return out
