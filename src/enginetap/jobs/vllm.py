"""vLLM jobs beyond capture: serve a model with vLLM armed by enginetap until stopped, and
merge the per-rank files an armed vLLM wrote into one."""

from __future__ import annotations

import signal
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from enginetap.config import ArmConfig, capability_names
from enginetap.errors import ConfigError

if TYPE_CHECKING:
    from enginetap.engines.vllm.server import VLLMServer

__all__ = ["ServeView", "merge_ranks", "serve_arming", "serve_until_stopped"]


def serve_arming(capabilities: list[str], out_dir: Path, requests: str) -> ArmConfig | None:
    """The arming of a served vLLM (None: disarmed, no capability named).

    Raises:
        ConfigError: an unknown capability.
    """
    unknown = sorted(set(capabilities) - set(capability_names()))
    if unknown:
        raise ConfigError(f"unknown capability {', '.join(unknown)}",
                          f"the capabilities are {', '.join(capability_names())}",
                          "pass --arm as a comma list of those, or --arm none")
    if not capabilities:
        return None
    return ArmConfig(enabled=True, capabilities=capabilities, out_dir=out_dir.resolve(),
                     request_filter=requests)


class ServeView(Protocol):
    """What serving tells its caller (the CLI prints each)."""

    def starting(self, server: VLLMServer) -> AbstractContextManager[Any]:
        """Entered around starting the server and waiting for its health check."""

    def serving(self, server: VLLMServer) -> None: ...

    def exited(self, server: VLLMServer) -> None:
        """The server exited by itself (before it is shut down)."""

    def stopping(self) -> None: ...


def serve_until_stopped(server: VLLMServer, view: ServeView) -> bool:
    """Start ``server`` and keep it until an interrupt (Ctrl-C or SIGTERM to this process)
    or until it exits by itself; it is always shut down. Returns True when it was stopped,
    False when it exited by itself (its log tail says why).

    Raises:
        EnginetapError: the server did not start (from :meth:`VLLMServer.start`).
    """
    # The server runs in a session of its own: a SIGTERM to us must still stop it.
    signal.signal(signal.SIGTERM, _interrupt)
    with view.starting(server):
        server.start()
    view.serving(server)
    try:
        while server.process is not None and server.process.poll() is None:
            time.sleep(1.0)
        view.exited(server)
        return False
    except KeyboardInterrupt:
        view.stopping()
        return True
    finally:
        server.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def merge_ranks(out_dir: Path, name: str, to: Path | None) -> tuple[list[int], Path]:
    """Merge ``out_dir``'s per-rank files of ``name`` into ``to`` (default:
    ``out_dir/name``), ordered by (step, rank); returns the ranks merged and the file.

    Raises:
        ConfigError: ``to`` is a directory or one of the files merged, or cannot be written.
    """
    from enginetap.core.ranks import merge_rank_files, rank_files

    files = rank_files(out_dir / name)
    target = to if to is not None else out_dir / name
    try:
        _refuse_target(target, list(files.values()))
        merged = merge_rank_files(out_dir / name, to)
    except OSError as exc:
        raise ConfigError(f"cannot write the merged file {target}", exc.strerror or str(exc),
                          "pass --to a writable file path with room on its disk") from None
    return sorted(files), merged


def _refuse_target(target: Path, inputs: list[Path]) -> None:
    """The merged file must not replace one of its inputs, nor a directory."""
    if target.is_dir():
        raise ConfigError(f"--to {target} is a directory", "the merged file is one file",
                          "pass a file path, e.g. --to merged.jsonl")
    for source in inputs:
        if target.resolve() == source.resolve() or (target.exists() and target.samefile(source)):
            raise ConfigError(f"--to {target} is one of the files being merged",
                              "writing it would destroy that rank's records",
                              "pass another --to path")
