"""Reading recorded tap runs: one JSONL file per rank, checked line by line.

A run is a directory holding ``tap-rank<r>.jsonl`` (or the path of one such file). Every
file starts with a header naming the format; every other line is one step. Anything else
(a truncated line, a file from another tool, a missing rank, a record of the wrong shape:
every line is validated through :mod:`enginetap.tap.schema`) is refused with a
:class:`TapError` that names the file and the line ("bad record at FILE:LINE: why").
Only regular files are read (a FIFO or a device is refused without
blocking) and one line holds at most :data:`MAX_LINE` bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from enginetap.core.files import NotRegular, iter_lines
from enginetap.core.ranks import rank_files
from enginetap.errors import EnginetapError
from enginetap.tap.schema import FORMAT, HASH_DIGITS, VERSION, TapHeader, TapStep

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
    end (see :mod:`enginetap.tap.record.deferred`)."""

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


MAX_LINE = 64 << 20
"""Bytes one line of a tap file may hold (a step of 4,096 rows and 300 checkpoints takes
about 20 MiB): a longer line is refused without being read into memory."""

_FIX = "record the run again with this enginetap; a tap file is written by the tap only"


def _bad(path: Path, number: int, why: str, fix: str = _FIX) -> TapError:
    return TapError(f"bad record at {path}:{number}", why, fix)


def _parse_line(path: Path, number: int, raw: bytes | None) -> dict[str, Any]:
    if raw is None:
        raise _bad(path, number, f"the line is longer than {MAX_LINE >> 20} MiB (the tap "
                                 "writes far shorter lines; a corrupt or foreign file?)")
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _bad(path, number, f"not a JSON line: {exc.msg} at column {exc.colno} "
                                 "(a truncated or corrupt tap file)",
                   "record the run again; a file cut short cannot be analysed") from None
    except RecursionError:
        raise _bad(path, number, "the JSON is nested too deep to be a tap record") from None
    except ValueError as exc:  # an integer past Python's digit limit, bad UTF-8
        raise _bad(path, number, f"not a tap record ({exc}; an integer of that many digits "
                                 "or bytes that are not UTF-8)") from None
    if not isinstance(record, dict):
        raise _bad(path, number, "not a tap record: the line is not a JSON object",
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
    _validate(TapHeader, path, 1, record)


def _validate(model: type[BaseModel], path: Path, number: int, record: dict[str, Any]) -> None:
    try:
        model.model_validate(record)
    except ValidationError as exc:
        raise _bad(path, number, _first_error(model, exc)) from None


def _first_error(model: type[BaseModel], exc: ValidationError) -> str:
    """The first failure, its field named as a reader of the file would: ``row 3: 'pos'
    ...``, ``checkpoint 2 ...``, ``header field 'models' ...``."""
    error = exc.errors(include_url=False)[0]
    loc, msg = list(error["loc"]), error["msg"].removeprefix("Value error, ")
    if not loc:
        return msg
    if model is TapHeader:
        return f"header field {loc[0]!r}: {msg}"
    if loc[0] == "rows" and len(loc) > 2:
        return f"row {loc[1]}: {loc[2]!r}: {msg}"
    if loc[0] == "rows" and len(loc) == 2:
        return f"row {loc[1]}: {msg} (a row is an object)"
    if loc[0] == "checkpoints" and len(loc) > 1:
        return f"checkpoint {loc[1]}: {msg} (a checkpoint name is a string)"
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    return f"{loc[0]!r}{where}: {msg}"


def _step(path: Path, number: int, record: dict[str, Any]) -> StepRecord:
    _validate(TapStep, path, number, record)
    rows = record["rows"]
    for row in rows:
        row.setdefault("prefix", None)
        row.setdefault("request_id", None)
        row.setdefault("computed_host", None)
    hashes = [[h[i:i + HASH_DIGITS] for i in range(0, len(h), HASH_DIGITS)]
              for h in record["hashes"]]
    return StepRecord(record["step"], record["mode"], rows, record["checkpoints"], hashes,
                      record.get("sampler") or [], record.get("sampled") or {}, number,
                      [str(n) for n in record.get("dropped") or []])


def load_rank(path: Path) -> RankTap:
    """Raises: TapError: the file is missing, not a regular file (a FIFO, a device), empty,
    foreign or corrupt (file and line)."""
    rank: RankTap | None = None
    try:
        for number, raw in iter_lines(path, MAX_LINE):
            if rank is None:
                header = _parse_line(path, 1, raw)
                _check_header(path, header)
                rank = RankTap(path, header)
            elif raw is None or raw.strip():
                rank.steps.append(_step(path, number, _parse_line(path, number, raw)))
    except OSError as exc:
        raise TapError(f"cannot read {path}", _os_reason(exc),
                       "check the path of the run; only regular files are read") from None
    if rank is None:
        raise TapError(f"{path}:1: empty tap file", "the run recorded nothing",
                       "check that the engine ran armed with the tap capability")
    return rank


def _os_reason(exc: OSError) -> str:
    return f"it {exc}" if isinstance(exc, NotRegular) else exc.strerror or str(exc)


def load_run(root: str | Path, name: str = "tap") -> TapRun:
    """Every rank file of the run at ``root`` (a directory, or one rank's file).

    Raises:
        TapError: no tap file there, a rank file missing (the header's world size says
            how many there must be), or any file unreadable as :func:`load_rank` says.
    """
    root = Path(root)
    if not root.is_dir() and os.path.lexists(root):  # one rank's file (or not a file at all)
        stem = root.name.rsplit("-rank", 1)[0]
        files = rank_files(root.parent / f"{stem}.jsonl") or {0: root}
    else:
        files = rank_files(root / f"{name}.jsonl")
    if not files:
        raise TapError(f"no tap files in {root}", f"expected {name}-rank<r>.jsonl there",
                       "pass the --out directory of `enginetap tap run`")
    ranks = {r: load_rank(p) for r, p in files.items()}
    world = next(iter(ranks.values())).header.get("world_size") or 1
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        first = next(iter(ranks.values())).path
        listed = ", ".join(f"{name}-rank{r}.jsonl" for r in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise TapError(f"{first}:1: run of {world} ranks lacks rank file(s) {listed}{more}",
                       "every rank writes its own file", "copy every rank's file of the run")
    return TapRun(root, ranks)
