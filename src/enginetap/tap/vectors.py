"""Raw rows of the tapped checkpoints, kept where hashes alone do not say enough.

With ``options.tap.vectors`` the staged rows of a step (the exact bytes that were hashed,
``[tapped rows, width]`` per checkpoint, in the tensor's dtype) are written to
``<out_dir>/tap-vectors-rank<r>/step<N>.safetensors``:

- ``split``: at the first step where a same-prefix pair of rows differs (checked on the
  host hashes at step end), once per pair of requests;
- ``window``: every step in ``vector_steps`` (first and last step, inclusive).

The file's metadata holds the row keys and positions, so a row is found without the
tap file. Safetensors only: nothing is pickled.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path
from typing import Any

import torch

from enginetap.tap.compare import comparable, last_of_request
from enginetap.tap.fingerprint import StepStaging

__all__ = ["VectorDump", "first_splits"]


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


class VectorDump:
    """Writes a step's staged rows to safetensors when the options ask for it."""

    def __init__(self, out_dir: Path, rank: int, mode: str, window: list[int]) -> None:
        self.dir = out_dir / f"tap-vectors-rank{rank}"
        self.mode, self.window = mode, window
        self.seen: set[tuple[str, str]] = set()

    def wanted(self, step: int) -> bool:
        if self.mode == "window":
            return len(self.window) == 2 and self.window[0] <= step <= self.window[1]
        return self.mode == "split"

    def maybe_dump(self, step: int, rows: list[dict[str, Any]], names: list[str],
                   staging: StepStaging, hashes: torch.Tensor) -> Path | None:
        """Dump ``step`` if its mode says so; the file written, else None."""
        if self.mode == "split":
            split = first_splits(rows, names, hashes.view(len(names), -1).tolist(), self.seen)
            if not split:
                return None
            reason = {"pairs": [list(p) for p in split]}
        elif self.wanted(step):
            reason = {"window": self.window}
        else:
            return None
        return self._write(step, rows, names, staging, reason)

    def _write(self, step: int, rows: list[dict[str, Any]], names: list[str],
               staging: StepStaging, reason: dict[str, Any]) -> Path:
        from safetensors.torch import save_file

        tensors = {name: staging.view_of(j).detach().cpu().contiguous()
                   for j, name in enumerate(names)}
        meta = {"rows": json.dumps([[r["key"], r["pos"]] for r in rows]),
                "reason": json.dumps(reason), "step": str(step)}
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step{step}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        return path
