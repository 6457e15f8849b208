"""Reading recorded tap runs: one JSONL file per rank, checked line by line.

A run is a directory holding ``tap-rank<r>.jsonl`` (or the path of one such file). Every
file starts with a header naming the format; every other line is one step. Anything else
(a truncated line, a file from another tool, a missing rank, a record of the wrong shape)
is refused with a :class:`TapError` that names the file and the line ("bad record at
FILE:LINE: why"). Only regular files are read (a FIFO or a device is refused without
blocking) and one line holds at most :data:`MAX_LINE` bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginetap.core.files import NotRegular, iter_lines
from enginetap.core.ranks import rank_files
from enginetap.errors import EnginetapError
from enginetap.tap.format import FORMAT, VERSION

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


MAX_LINE = 64 << 20
"""Bytes one line of a tap file may hold (a step of 4,096 rows and 300 checkpoints takes
about 20 MiB): a longer line is refused without being read into memory."""

MAX_WORLD = 1 << 16
"""The largest world size a header may declare (every rank writes its own file)."""

_STEP_FIELDS = {"step": int, "mode": str, "rows": list, "checkpoints": list, "hashes": list}
_ROW_INTS = ("computed_host", "computed_device", "kv_slot", "state_slot", "planned",
             "query_len", "seq_len", "token_index", "row", "tok")
_FIX = "record the run again with this enginetap; a tap file is written by the tap only"


def _bad(path: Path, number: int, why: str, fix: str = _FIX) -> TapError:
    return TapError(f"bad record at {path}:{number}", why, fix)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    models = record.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise _bad(path, 1, "header field 'models' is not a list of objects")
    world = record.get("world_size", 1)
    if world is not None and not (_is_int(world) and 1 <= world <= MAX_WORLD):
        raise _bad(path, 1, f"header field 'world_size' is {str(world)[:40]!r}, not a rank "
                            f"count from 1 to {MAX_WORLD}")
    for name in ("cache_groups", "options"):
        if not isinstance(record.get(name) or {}, dict):
            raise _bad(path, 1, f"header field {name!r} is not an object")


def _check_row(path: Path, number: int, i: int, row: Any) -> None:
    if not isinstance(row, dict):
        raise _bad(path, number, f"row {i} is a {type(row).__name__}, not an object")
    if not isinstance(row.get("key"), str):
        raise _bad(path, number, f"row {i} has no 'key' (the request key, a string)")
    if not _is_int(row.get("pos")):
        raise _bad(path, number, f"row {i} has no 'pos' (its position, an integer)")
    row.setdefault("prefix", None)
    row.setdefault("request_id", None)
    row.setdefault("computed_host", None)
    if not isinstance(row["prefix"], (str, type(None))):
        raise _bad(path, number, f"row {i}: 'prefix' is not a string")
    if not isinstance(row["request_id"], (str, type(None))):
        raise _bad(path, number, f"row {i}: 'request_id' is not a string")
    for name in _ROW_INTS:
        if row.get(name) is not None and not _is_int(row[name]):
            raise _bad(path, number, f"row {i}: {name!r} is not an integer")
    for name in ("kv_groups", "state_groups"):
        groups = row.get(name)
        if groups is not None and not (isinstance(groups, dict)
                                       and all(_is_int(v) for v in groups.values())):
            raise _bad(path, number, f"row {i}: {name!r} is not an object of slots")


def _check_sampler(path: Path, number: int, record: dict[str, Any]) -> None:
    sampler = record.get("sampler") or []
    if not isinstance(sampler, list) or not all(
            isinstance(s, dict) and _is_int(s.get("argmax"))
            and isinstance(s.get("gap"), (int, float)) and not isinstance(s["gap"], bool)
            for s in sampler):
        raise _bad(path, number, "'sampler' is not a list of objects with an integer "
                                 "'argmax' and a numeric 'gap'")
    sampled = record.get("sampled") or {}
    if not isinstance(sampled, dict) or not all(_is_int(t) for t in sampled.values()):
        raise _bad(path, number, "'sampled' is not an object of request id to token id")


def _step(path: Path, number: int, record: dict[str, Any]) -> StepRecord:
    for name, kind in _STEP_FIELDS.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise _bad(path, number, f"step record without a valid {name!r}: expected "
                                     f"{kind.__name__}, got {type(value).__name__}")
    rows, checkpoints, packed = record["rows"], record["checkpoints"], record["hashes"]
    for i, row in enumerate(rows):
        _check_row(path, number, i, row)
    if not all(isinstance(name, str) for name in checkpoints):
        raise _bad(path, number, "a checkpoint name is not a string")
    if len(packed) != len(checkpoints) \
            or any(not isinstance(h, str) or len(h) != 16 * len(rows) for h in packed):
        raise _bad(path, number, f"hashes do not match checkpoints x rows ({len(checkpoints)} "
                                 f"checkpoints, {len(rows)} rows)",
                   "record the run again; the file is corrupt")
    _check_sampler(path, number, record)
    dropped = record.get("dropped") or []
    if not isinstance(dropped, list):
        raise _bad(path, number, "'dropped' is not a list of checkpoint names")
    hashes = [[h[i:i + 16] for i in range(0, len(h), 16)] for h in packed]
    return StepRecord(record["step"], record["mode"], rows, checkpoints, hashes,
                      record.get("sampler") or [], record.get("sampled") or {}, number,
                      [str(n) for n in dropped])


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
