"""The demo job: capture from a real engine, then replay.

1. build (or reuse) the built-in tiny models named by the job;
2. drive the built-in transformers engine on each with a traffic profile, capturing every
   operator the probes cover into one FlashInfer-Trace dataset per model (``OUT/dataset/NAME``);
3. validate each dataset and replay every captured workload against its definition's
   reference, giving one verdict per definition.

The job is ``ok`` when every dataset validates and every workload that carries engine
outputs replays PASS. Workloads captured with inputs only (the built-in engine computes
MLA un-absorbed, so it never produces the MLA definitions' output) get the verdict
``INPUTS ONLY``, which does not fail the job.

``out`` is never followed when it is a link. The demo writes only ``OUT/dataset`` and a
marker file listing the files it wrote there; a re-run deletes exactly those (refusing if
anything else has appeared under ``OUT/dataset``) and leaves everything else in ``OUT``
alone. A non-empty directory without that marker is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from enginetap.errors import ConfigError

if TYPE_CHECKING:
    from enginetap.dataset.schema import Definition
    from enginetap.jobs.capture import CaptureResult

__all__ = ["DemoJob", "DemoResult", "DemoView", "MARKER", "ModelReplay", "Verdict",
           "run_demo"]

MARKER = ".enginetap-demo"


@dataclass
class DemoJob:
    """What the demo runs: built-in models, a traffic profile, an output directory."""

    out: Path
    models: Sequence[str]
    profile: str = "builtin:mooncake-tiny"
    max_output_tokens: int = 8
    capture_progress: bool | str = True
    """The capture's progress: a bar (True), plain lines (``"lines"``) or nothing (False)."""
    replay_progress: bool = False


@dataclass
class Verdict:
    """One definition's replay verdict: PASS, INPUTS ONLY, or the worst status with the
    first reason; ``worst`` is the largest max-abs error compared (``-``: none)."""

    name: str
    workloads: int
    verdict: str
    note: str
    worst: str


@dataclass
class ModelReplay:
    """One model's dataset checked: its validation problems and its replay verdicts."""

    root: Path
    problems: list[str]
    verdicts: list[Verdict]

    @property
    def ok(self) -> bool:
        return not self.problems and all(v.verdict in ("PASS", "INPUTS ONLY")
                                         for v in self.verdicts)


@dataclass
class DemoResult:
    out: Path
    replays: list[ModelReplay]
    next_root: Path
    """The dataset the next step (replaying one's own kernel) is suggested on."""
    next_definition: Definition | None
    """A definition of the simplest family there (an rmsnorm if any); None: no definitions."""

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.replays)


class DemoView(Protocol):
    """What the demo tells its caller as it goes (the CLI prints each step)."""

    def building(self, index: int, name: str) -> AbstractContextManager[Any]:
        """Entered around building model ``name`` (the ``index``-th, from 1)."""

    def captured(self, name: str, root: Path, result: CaptureResult) -> None: ...

    def validated(self, root: Path, problems: list[str]) -> None: ...

    def replayed(self, replay: ModelReplay) -> None: ...


def run_demo(job: DemoJob, view: DemoView) -> DemoResult:
    """Run ``job``, telling ``view`` about each model as it is captured and replayed.

    Raises:
        ConfigError: no model named, ``job.out`` is unusable (see the module docstring), or
            capture refused its input (before anything was written for that model).
    """
    from enginetap.dataset import validate_dataset
    from enginetap.jobs.capture import CaptureJob, run_capture
    from enginetap.models import build_model
    from enginetap.replay import replay_dataset

    if not job.models:
        raise ConfigError("no model to run the demo on", "--models names none",
                          "pass --models as a comma list of built-in models "
                          "(`enginetap models list`)")
    prepare_out(job.out)
    replays: list[ModelReplay] = []
    for index, name in enumerate(job.models, 1):
        root = job.out / "dataset" / name
        with view.building(index, name):
            build_model(name)
        captured = run_capture(CaptureJob(
            "builtin", f"builtin:{name}", job.profile, root, policy="default",
            max_output_tokens=job.max_output_tokens, progress=job.capture_progress))
        view.captured(name, root, captured)
        problems = validate_dataset(root)
        view.validated(root, problems)
        report = replay_dataset(root, progress=job.replay_progress)
        replay = ModelReplay(root, problems, [verdict_of(r) for r in report.definitions])
        view.replayed(replay)
        replays.append(replay)
        _write_marker(job.out, sorted(_tree(job.out / "dataset")[0]))
    first = job.out / "dataset" / job.models[0]
    return DemoResult(job.out, replays, first, simplest_definition(first))


def simplest_definition(root: Path) -> Definition | None:
    """The first definition of the simplest family in ``root``: an rmsnorm if the dataset
    has one, else the alphabetically first family (None: no definitions)."""
    from enginetap.dataset import Dataset
    from enginetap.definitions.base import family_of

    first: dict[str, Definition] = {}
    for _, definition in sorted(Dataset(root).definitions().items()):
        first.setdefault(family_of(definition) or "", definition)
    family = min(first, key=lambda f: (f != "rmsnorm", "rmsnorm" not in f, f), default="")
    return first[family] if family else None


def verdict_of(result: Any) -> Verdict:
    """One verdict for a replayed definition (a ``DefinitionResult``)."""
    checks = [c for w in result.workloads for c in w.checks]
    errors = [c.comparison.max_abs_error for c in checks
              if c.comparison is not None and c.comparison.max_abs_error is not None]
    worst = f"{max(errors):.3g}" if errors else "-"
    count = len(result.workloads)
    if result.status == "PASS":
        return Verdict(result.name, count, "PASS", _unexposed(checks), worst)
    reasons = [c.message or "" for c in checks if c.status != "PASS"] + [
        w.message or "" for w in result.workloads if w.status != "PASS" and not w.checks]
    if reasons and all(r.startswith("nothing compared") for r in reasons):
        return Verdict(result.name, count, "INPUTS ONLY", "engine exposes no output", worst)
    note = next((r for r in reasons if r), result.message or "")
    return Verdict(result.name, count, result.status, note, worst)


def _unexposed(checks: list[Any]) -> str:
    from enginetap.replay.results import NOT_EXPOSED

    names = dict.fromkeys(c.output for c in checks if c.message == NOT_EXPOSED)
    return f"{', '.join(names)}: not exposed by this engine" if names else ""


# ---------------------------------------------------------------------- the output directory
def prepare_out(out: Path) -> None:
    """Make ``out`` ready: new, empty, or a previous demo output whose own files are removed.

    Raises:
        ConfigError: ``out`` is a link or not a directory, holds data the demo did not write
            (or cannot tell), or cannot be written.
    """
    if out.is_symlink():
        raise ConfigError(f"--out {out} is a symbolic link", "the demo never writes or deletes "
                          "through a link", "pass the directory it points to, or another --out")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is not a directory", "", "pass a directory path")
    if out.exists() and any(out.iterdir()):
        _remove_previous(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create --out {out}", exc.strerror or str(exc),
                          "pass a writable directory path") from None
    _write_marker(out, None)  # before anything else: a re-run after a crash recognises it


def _write_marker(out: Path, files: list[str] | None) -> None:
    from enginetap.dataset.atomic import replace_text

    text = json.dumps({"made_by": "enginetap demo", "dataset_files": files}, indent=1) + "\n"
    try:
        replace_text(out / MARKER, text)
    except OSError as exc:
        raise ConfigError(f"cannot write {out / MARKER}", exc.strerror or str(exc),
                          "pass a writable --out directory") from None


def _remove_previous(out: Path) -> None:
    """Delete the files a previous demo listed in its marker, and then its empty folders."""
    listed = _listed_files(out)
    dataset = out / "dataset"
    if not dataset.exists() and not dataset.is_symlink():
        return
    files, others = _tree(dataset)
    foreign = sorted(others + [f for f in files if f not in set(listed or [])])
    if listed is None:
        why = f"{dataset} is from a demo run that did not finish (its files are unlisted)"
    elif foreign:
        why = f"{dataset} holds {foreign[0]!r}, which the demo did not write"
    if listed is None or foreign:
        raise ConfigError(f"{out} is not only the demo's own output", why,
                          "move that data elsewhere or pass another --out")
    try:
        for rel in files:
            (dataset / rel).unlink()
        for folder, _, _ in sorted(os.walk(dataset), key=lambda w: -len(w[0])):
            Path(folder).rmdir()
    except OSError as exc:
        raise ConfigError(f"cannot remove the previous demo output in {dataset}",
                          exc.strerror or str(exc), "remove it yourself") from None


def _listed_files(out: Path) -> list[str] | None:
    """The dataset files the marker lists (``None``: not listed); refuses a non-demo folder."""
    marker = out / MARKER
    if marker.is_symlink() or not marker.is_file():
        raise ConfigError(f"{out} exists and was not made by `enginetap demo`",
                          "the demo never deletes data it did not write",
                          "pass another --out, or remove the directory yourself")
    try:
        files = json.loads(marker.read_bytes()).get("dataset_files")
    except (ValueError, AttributeError, OSError):
        return None  # an older demo's marker: it listed nothing
    return files if isinstance(files, list) else None


def _tree(root: Path) -> tuple[list[str], list[str]]:
    """Regular files under ``root`` and everything else (links, FIFOs...), relative; links
    are never followed."""
    if root.is_symlink() or not root.is_dir():
        return [], ["."]
    files, others = [], []
    for folder, dirs, names in os.walk(root):
        for name in names + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            (files if path.is_file() and not path.is_symlink() else others).append(rel)
    return files, others
