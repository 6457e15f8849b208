"""Raw rows of the tapped checkpoints, kept where hashes alone do not say enough.

With ``options.tap.vectors`` the staged rows of a step (the exact bytes that were hashed,
``[tapped rows, width]`` per checkpoint, in the tensor's dtype) are written to
``<out_dir>/tap-vectors-rank<r>/step<N>.safetensors``:

- ``split``: at the first step where a same-prefix pair of rows differs (checked on the
  host hashes at step end), once per pair of requests;
- ``window``: every step in ``vector_steps`` (first and last step, inclusive);
- ``control``: as the control file (``vector_control``) says when it is re-read at the
  end of every step: a step window, optionally narrowed to some checkpoints (names or
  name prefixes) and some requests (key substrings). Editing the file while the engine
  runs starts, moves or stops the dumps; a file that cannot be read or parsed is logged
  (once per content) and writes nothing until it is fixed. Only a regular file of at most
  :data:`MAX_CONTROL` bytes is read, opened without blocking: a FIFO or a device in its
  place never stalls the engine's step.

The file's metadata holds the row keys and positions, so a row is found without the
tap file. Safetensors only: nothing is pickled.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from enginetap.core.files import NotRegular, read_capped
from enginetap.errors import describe_validation

from enginetap.tap.compare import comparable, last_of_request
from enginetap.tap.record.staging import StepStaging

logger = logging.getLogger("enginetap.tap")

__all__ = ["ControlFile", "VectorControl", "VectorDump", "first_splits"]

MAX_CONTROL = 64 << 10
"""Bytes a control file may hold (it is a small JSON object, re-read every step)."""


def first_splits(rows: list[dict[str, Any]], names: list[str], hashes: list[list[int]],
                 seen: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Pairs of request keys (not in ``seen``) whose same-prefix rows differ somewhere in
    ``hashes`` (``[checkpoint][row]``); they are added to ``seen``."""
    groups: dict[tuple[int, str], list[int]] = {}
    for i, row in enumerate(rows):
        if row.get("prefix") is not None:
            groups.setdefault((row["pos"], row["prefix"]), []).append(i)
    found = []
    last = last_of_request(rows)
    for members in groups.values():
        for i, j in combinations(members, 2):
            pair = tuple(sorted((rows[i]["key"], rows[j]["key"])))
            both_last = i in last and j in last
            if pair[0] != pair[1] and pair not in seen and any(
                    h[i] != h[j] and comparable(n, rows[i], rows[j], both_last)
                    for n, h in zip(names, hashes)):
                seen.add(pair)  # type: ignore[arg-type]
                found.append(pair)
    return found  # type: ignore[return-value]


class VectorControl(BaseModel):
    """What a vector control file asks for (its JSON object)."""

    model_config = ConfigDict(extra="forbid")

    steps: list[int] = Field(min_length=2, max_length=2)
    """``[first, last]`` step, inclusive."""
    checkpoints: list[str] = Field(default_factory=list)
    """Checkpoint names or prefixes (``"L3"``, ``"L3.attn"``); empty: every checkpoint."""
    requests: list[str] = Field(default_factory=list)
    """Request-key substrings; empty: every tapped row."""

    def wants_checkpoint(self, name: str) -> bool:
        return not self.checkpoints or any(
            name == c or name.startswith(c + ".") for c in self.checkpoints)

    def wants_row(self, key: str) -> bool:
        return not self.requests or any(r in key for r in self.requests)


@dataclass
class ControlFile:
    """A control file, re-read on every :meth:`read`; parsed again only when its text
    changed."""

    path: Path
    _text: str | None = None
    _parsed: VectorControl | None = None

    def read(self) -> VectorControl | None:
        try:
            text = read_capped(self.path, MAX_CONTROL).decode("utf-8", errors="replace")
        except NotRegular as exc:
            text = "" if str(exc) == "is missing" else f"unreadable: it {exc}"
        except OSError as exc:
            text = f"unreadable: {exc.strerror or exc}"
        if text != self._text:
            self._text, self._parsed = text, self._parse(text)
        return self._parsed

    def _parse(self, text: str) -> VectorControl | None:
        if not text.strip():
            return None
        if text.startswith("unreadable: "):
            logger.warning("tap: vector control file %s cannot be read (%s); no rows are "
                           "written until it is a regular file of at most %d bytes",
                           self.path, text.partition(": ")[2], MAX_CONTROL)
            return None
        try:
            return VectorControl.model_validate_json(text)
        except ValidationError as exc:
            logger.warning("tap: vector control file %s is not valid (%s); no rows are "
                           "written until it is fixed (write {\"steps\": [first, last]} and "
                           "optionally \"checkpoints\", \"requests\")", self.path,
                           describe_validation(exc))
            return None


@dataclass
class VectorDump:
    """Writes a step's staged rows to safetensors when the options ask for it."""

    dir: Path
    mode: str
    window: list[int]
    control: ControlFile | None = None
    seen: set[tuple[str, str]] = field(default_factory=set)

    @classmethod
    def from_options(cls, out_dir: Path, rank: int, options: Any) -> VectorDump | None:
        """The dump ``options`` (:class:`~enginetap.tap.options.TapOptions`) ask for."""
        if options.vectors == "off":
            return None
        control = ControlFile(Path(options.vector_control)) if options.vector_control else None
        return cls(out_dir / f"tap-vectors-rank{rank}", options.vectors,
                   list(options.vector_steps), control)

    def wanted(self, step: int) -> bool:
        if self.mode == "window":
            return len(self.window) == 2 and self.window[0] <= step <= self.window[1]
        return self.mode == "split"

    def maybe_dump(self, step: int, rows: list[dict[str, Any]], names: list[str],
                   staging: StepStaging, hashes: torch.Tensor) -> Path | None:
        """Dump ``step`` if its mode says so; the file written, else None."""
        wanted = None
        if self.mode == "split":
            split = first_splits(rows, names, hashes.view(len(names), -1).tolist(), self.seen)
            if not split:
                return None
            reason: dict[str, Any] = {"pairs": [list(p) for p in split]}
        elif self.mode == "control":
            wanted = self.control.read() if self.control is not None else None
            if wanted is None or not wanted.steps[0] <= step <= wanted.steps[1]:
                return None
            reason = {"control": wanted.model_dump()}
        elif self.wanted(step):
            reason = {"window": self.window}
        else:
            return None
        return self._write(step, rows, names, staging, reason, wanted)

    def _write(self, step: int, rows: list[dict[str, Any]], names: list[str],
               staging: StepStaging, reason: dict[str, Any],
               wanted: VectorControl | None = None) -> Path | None:
        from safetensors.torch import save_file

        keep = [i for i, r in enumerate(rows) if wanted is None or wanted.wants_row(r["key"])]
        picked = [(j, n) for j, n in enumerate(names)
                  if wanted is None or wanted.wants_checkpoint(n)]
        if not keep or not picked:
            return None
        index = torch.tensor(keep, dtype=torch.long)
        tensors = {name: staging.view_of(j).detach().cpu().index_select(0, index).contiguous()
                   for j, name in picked}
        meta = {"rows": json.dumps([[rows[i]["key"], rows[i]["pos"]] for i in keep]),
                "reason": json.dumps(reason), "step": str(step)}
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step{step}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        return path
