"""Reading recorded tap runs: one JSONL file per rank, checked line by line.

A run is a directory holding ``tap-rank<r>.jsonl`` (or the path of one such file). Every
file starts with a header naming the format; every other line is one step. Anything else
(a truncated line, a file from another tool, a missing rank) is refused with a
:class:`TapError` that names the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginetap.core.ranks import rank_files
from enginetap.errors import EnginetapError
from enginetap.tap.recorder import FORMAT, VERSION

__all__ = ["RankTap", "StepRecord", "TapError", "TapRun", "load_run"]


class TapError(EnginetapError):
    """A tap run cannot be read or analysed as asked."""


@dataclass
class StepRecord:
    """One recorded step of one rank."""

    step: int
    mode: str
    rows: list[dict[str, Any]]
    checkpoints: list[str]
    hashes: list[list[str]]
    sampler: list[dict[str, Any]]
    sampled: dict[str, int]
    line: int
    dropped: list[str] = field(default_factory=list)
    """Checkpoints left out of this step: deferred tensors modified in place before step
    end (see :mod:`enginetap.tap.deferred`)."""

    def hash_of(self, checkpoint: int, row: int) -> str:
        return self.hashes[checkpoint][row]


@dataclass
class RankTap:
    path: Path
    header: dict[str, Any]
    steps: list[StepRecord] = field(default_factory=list)


@dataclass
class TapRun:
    """Every rank of one recorded run."""

    root: Path
    ranks: dict[int, RankTap]

    @property
    def header(self) -> dict[str, Any]:
        return self.ranks[min(self.ranks)].header

    def rank(self, rank: int = 0) -> RankTap:
        return self.ranks[rank]


_STEP_FIELDS = {"step": int, "mode": str, "rows": list, "checkpoints": list, "hashes": list}


def _parse_line(path: Path, number: int, text: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TapError(f"{path}:{number}: not a JSON line", f"{exc.msg} at column {exc.colno} "
                       "(a truncated or corrupt tap file)",
                       "record the run again; a file cut short cannot be analysed") from None
    if not isinstance(record, dict):
        raise TapError(f"{path}:{number}: not a tap record", "the line is not a JSON object",
                       "pass a directory written by the tap capability")
    return record


def _check_header(path: Path, record: dict[str, Any]) -> None:
    if record.get("kind") != "header" or record.get("format") != FORMAT:
        raise TapError(f"{path}:1: not a tap file",
                       f"the first line is not a {FORMAT} header (a file of another tool?)",
                       "pass a directory written by `enginetap tap run` or the tap capability")
    if record.get("version") != VERSION:
        raise TapError(f"{path}:1: tap format version {record.get('version')!r}",
                       f"this enginetap reads version {VERSION}",
                       "analyse it with the enginetap that recorded it")


def _step(path: Path, number: int, record: dict[str, Any]) -> StepRecord:
    for name, kind in _STEP_FIELDS.items():
        if not isinstance(record.get(name), kind):
            raise TapError(f"{path}:{number}: step record without a valid {name!r}",
                           f"expected {kind.__name__}, got {type(record.get(name)).__name__}",
                           "record the run again with this enginetap")
    rows, checkpoints, packed = record["rows"], record["checkpoints"], record["hashes"]
    if len(packed) != len(checkpoints) \
            or any(not isinstance(h, str) or len(h) != 16 * len(rows) for h in packed):
        raise TapError(f"{path}:{number}: hashes do not match checkpoints x rows",
                       f"{len(checkpoints)} checkpoints, {len(rows)} rows",
                       "record the run again; the file is corrupt")
    hashes = [[h[i:i + 16] for i in range(0, len(h), 16)] for h in packed]
    return StepRecord(record["step"], record["mode"], rows, checkpoints, hashes,
                      record.get("sampler") or [], record.get("sampled") or {}, number,
                      [str(n) for n in record.get("dropped") or []])


def load_rank(path: Path) -> RankTap:
    """Raises: TapError: the file is missing, empty, foreign or corrupt (file and line)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TapError(f"cannot read {path}", exc.strerror or str(exc),
                       "check the path of the run") from None
    if not lines:
        raise TapError(f"{path}:1: empty tap file", "the run recorded nothing",
                       "check that the engine ran armed with the tap capability")
    header = _parse_line(path, 1, lines[0])
    _check_header(path, header)
    rank = RankTap(path, header)
    for number, text in enumerate(lines[1:], start=2):
        if text.strip():
            rank.steps.append(_step(path, number, _parse_line(path, number, text)))
    return rank


def load_run(root: str | Path, name: str = "tap") -> TapRun:
    """Every rank file of the run at ``root`` (a directory, or one rank's file).

    Raises:
        TapError: no tap file there, a rank file missing (the header's world size says
            how many there must be), or any file unreadable as :func:`load_rank` says.
    """
    root = Path(root)
    if root.is_file():
        stem = root.name.rsplit("-rank", 1)[0]
        files = rank_files(root.parent / f"{stem}.jsonl") or {0: root}
    else:
        files = rank_files(root / f"{name}.jsonl")
    if not files:
        raise TapError(f"no tap files in {root}", f"expected {name}-rank<r>.jsonl there",
                       "pass the --out directory of `enginetap tap run`")
    ranks = {r: load_rank(p) for r, p in files.items()}
    world = int(next(iter(ranks.values())).header.get("world_size") or 1)
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        first = next(iter(ranks.values())).path
        raise TapError(f"{first}:1: run of {world} ranks lacks rank file(s) "
                       f"{', '.join(f'{name}-rank{r}.jsonl' for r in missing)}",
                       "every rank writes its own file", "copy every rank's file of the run")
    return TapRun(root, ranks)
