"""Build a built-in tiny model folder (config, seeded weights, tokenizer) and cache it.

The folder is what ``from_pretrained`` and ``vllm.LLM(model=...)`` load. A build goes to a
temporary sibling folder and is renamed into place, so a reader never sees half a model;
the last file written, :data:`MARKER`, lists every file's SHA-256 and marks it complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from enginetap.errors import ConfigError
from enginetap.models.configs import MODEL_NAMES, model_config

__all__ = ["BUILDER_VERSION", "MARKER", "build_model", "cache_root", "default_model_dir",
           "is_complete"]

BUILDER_VERSION = 1
"""Bumped whenever the builder would write different bytes for the same name and seed."""

MARKER = "enginetap-model.json"

Progress = Callable[[str], None]


def cache_root() -> Path:
    """``$ENGINETAP_CACHE`` or ``~/.cache/enginetap``."""
    return Path(os.environ.get("ENGINETAP_CACHE") or Path.home() / ".cache" / "enginetap")


def _config_of(name: str) -> dict[str, Any]:
    if name not in MODEL_NAMES:
        raise ConfigError(
            f"unknown built-in model {name!r}",
            f"the built-in models are {', '.join(MODEL_NAMES)}",
            "pick one of those names (`enginetap models list` shows them)",
        )
    return model_config(name)


def _build_key(name: str) -> str:
    """Short hash of everything that decides the bytes, except the seed."""
    from enginetap.models.tokenizer import corpus_digest

    payload = json.dumps({"config": _config_of(name), "builder": BUILDER_VERSION,
                          "corpus": corpus_digest()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:10]


def default_model_dir(name: str, seed: int = 0) -> Path:
    """Where :func:`build_model` caches ``name`` built with ``seed``.

    Raises:
        ConfigError: ``name`` is not a built-in model.
    """
    return cache_root() / "models" / f"{name}-seed{seed}-{_build_key(name)}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_complete(folder: Path, name: str, seed: int) -> bool:
    """True if ``folder`` holds a finished build of ``name``/``seed`` whose files all match."""
    marker = _read_marker(folder)
    expected = {"name": name, "seed": seed, "key": _build_key(name)}
    if marker is None or any(marker.get(k) != v for k, v in expected.items()):
        return False
    files = marker.get("files", {})
    return bool(files) and all(
        (folder / f).is_file() and _sha256(folder / f) == digest for f, digest in files.items()
    )


def _dump_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_model(folder: Path, name: str, seed: int, progress: Progress) -> None:
    """Write every file of the model into ``folder`` (an empty directory), marker last."""
    from safetensors.torch import save_file

    from enginetap.models.tokenizer import write_tokenizer
    from enginetap.models.weights import checkpoint_layout, draw_weights

    config = _config_of(name)
    _dump_json(folder / "config.json", config)
    _dump_json(folder / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"], "do_sample": False,
    })
    progress("drawing weights")
    weights = draw_weights(checkpoint_layout(folder), config, seed)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    progress("training tokenizer")
    write_tokenizer(folder, config["vocab_size"], config["max_position_embeddings"])
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    _make_readable(folder, files)
    _dump_json(folder / MARKER, {
        "name": name, "seed": seed, "key": _build_key(name), "builder": BUILDER_VERSION,
        "files": {f: _sha256(folder / f) for f in files},
    })


def _make_readable(folder: Path, files: list[str]) -> None:
    """Give the folder and files the usual modes (mkdtemp and some writers use owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in files:
        (folder / f).chmod(0o666 & ~umask)


def _clear_target(target: Path, name: str, seed: int, force: bool, cache: bool,
                  check_only: bool = False) -> None:
    """Remove an existing ``target`` we may replace; refuse to delete anything else
    (``check_only``: refuse, but remove nothing: called before building, so a refused
    build costs nothing).

    Without ``force``, a build of this model is replaced only when the folder holds nothing
    but what the build wrote; edited files are the user's too, except in the ``cache``
    (enginetap's own folder, where a damaged build is repaired)."""
    if not target.exists():
        return
    if target.is_dir() and not any(target.iterdir()):
        if not check_only:
            target.rmdir()
        return
    marker = _read_marker(target) if target.is_dir() else None
    if marker is None:
        raise ConfigError(
            f"cannot build into {target}",
            "it exists and is not a folder enginetap built",
            "pass an empty or new folder as --out",
        )
    same = marker.get("name") == name and marker.get("seed") == seed
    if not same and not force:
        raise ConfigError(
            f"cannot build {name} (seed {seed}) into {target}",
            f"it holds the built-in model {marker.get('name')} (seed {marker.get('seed')})",
            "pass another folder, or --force to replace it",
        )
    kept = [] if force else _not_ours(target, marker, edits_are_ours=cache)
    if kept:
        shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        raise ConfigError(
            f"cannot rebuild {name} (seed {seed}) in {target}",
            f"rebuilding replaces the whole folder, which holds what the build did not write: "
            f"{shown}",
            f"move those files elsewhere, pass another folder, or replace the folder and "
            f"everything in it with `enginetap models build {name}"
            f"{'' if cache else f' --out {target}'} --force`",
        )
    if not check_only:
        shutil.rmtree(target)


def _not_ours(folder: Path, marker: dict[str, Any], edits_are_ours: bool) -> list[str]:
    """What in ``folder`` a rebuild would lose: anything the build did not write (the
    user's own files) and, unless ``edits_are_ours``, files edited since the build."""
    files = marker.get("files")
    files = files if isinstance(files, dict) else {}
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.name == MARKER:
            continue
        digest = files.get(entry.name)
        if digest is None or entry.is_symlink() or not entry.is_file():
            found.append(f"{entry.name} (not written by the build)")
        elif not edits_are_ours and _sha256(entry) != digest:
            found.append(f"{entry.name} (edited since the build)")
    return found


def build_model(name: str, *, out_dir: str | Path | None = None, seed: int = 0,
                force: bool = False, progress: Progress | None = None) -> Path:
    """Build built-in model ``name`` with random weights drawn from ``seed``; return its folder.

    The same name and seed always give the same bytes in every file. A complete folder
    already at the target (default: :func:`default_model_dir`) is reused unless ``force``.
    ``progress`` receives a short label at each stage (for a CLI status line).

    Raises:
        ConfigError: ``name`` is unknown, ``seed`` is negative, or ``out_dir`` exists and
            holds something other than this model (another built-in model: unless ``force``),
            or (unless ``force``) a build of it with edited files or files the build did not
            write: a rebuild replaces the folder, so it never deletes those unasked.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"bad seed {seed!r}", "a seed is an integer ≥ 0", "pass e.g. --seed 0")
    target = Path(out_dir).expanduser().resolve() if out_dir else default_model_dir(name, seed)
    _config_of(name)
    if not force and is_complete(target, name, seed):
        return target
    _clear_target(target, name, seed, force, cache=not out_dir, check_only=True)
    report = progress or (lambda _label: None)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial",
                                    dir=target.parent))
    try:
        _write_model(scratch, name, seed, report)
        _clear_target(target, name, seed, force, cache=not out_dir)
        _rename_into(scratch, target, name, seed)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _rename_into(scratch: Path, target: Path, name: str, seed: int) -> None:
    try:
        os.rename(scratch, target)
    except OSError:
        # A concurrent build of the same model got there first: theirs is as good as ours.
        if not is_complete(target, name, seed):
            raise
