"""Exactness proof per key: a patched implementation is used only where it is bit-exact.

An :class:`ExactPatch` installs, through :class:`enginetap.core.patching.Patch`, a wrapper
on the stock target. In ``check`` mode the first call for each key (by default the
shapes, dtypes and devices of the tensor arguments) runs both implementations on the same
inputs — the patched one on clones of the arguments the stock path may write — compares
every output bit for bit, agrees with every rank of the process group (a rank that
differs makes every rank keep the stock path), remembers the decision and from then on
runs only the chosen implementation.

``agree`` is a collective: every rank must reach the first call of a key at the same
moment. Keys must therefore be rank-invariant — derived from shapes, as in tensor
parallelism where every rank sees the same shapes — and never from data, ranks or time.
Proven keys live in an LRU of ``max_keys``; a key evicted is proven again on its next call
(the same sequence of keys evicts the same keys on every rank, so this stays in step).

Modes: ``check`` (above), ``compare`` (always run both, serve the stock result, log every
mismatch, dump the first), ``strict`` (as ``check``, but a mismatch on any rank raises
:class:`ExactnessError` on every rank), ``off`` (stock only). Not thread-safe: one engine
thread calls a patched operator at a time, as engines do per rank.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args


from enginetap.core.patching import Patch, ReachesCaller, WrapperError, call_signature
from enginetap.core.jsonl import RankJsonl
from enginetap.core.ranks import agree, rank_world
from enginetap.errors import ConfigError
from enginetap.core.tensors import (Difference, capturing, clone_tree, compare_bits, flatten,
                                    holds_tensor, summarize)
from enginetap.guard.bits import dump_mismatch
from enginetap.guard.keys import KeyFunction, describe_key, shape_key
from enginetap.guard.lock import GuardLock, check_lock
from enginetap.guard.options import Mode, active_guard_options

logger = logging.getLogger("enginetap.guard")

__all__ = ["Decision", "ExactPatch", "ExactnessError"]


@dataclass(frozen=True)
class Decision:
    """Which implementation serves one key, and why."""

    key: Hashable
    patched: bool
    """True: the patched implementation serves this key from now on."""
    reason: str
    local_exact: bool
    """Whether this rank alone accepted the outputs (bit-identical, or within the
    patch's tolerance when it has one)."""


class ExactnessError(ReachesCaller):
    """``strict`` mode: the patched implementation differs from the stock one.

    A :class:`~enginetap.core.patching.ReachesCaller`: the patching layer lets it through
    to the engine's caller instead of containing it, since ``strict`` exists to stop the run.
    """


@dataclass
class _Trial:
    """One side run of the patched implementation, kept until the stock result is compared."""

    bound: inspect.BoundArguments | None = None
    cloned: list[str] = field(default_factory=list)
    pristine: dict[str, Any] | None = None
    patched_leaves: list[tuple[str, Any]] | None = None
    failure: str = ""


class ExactPatch:
    """A patched implementation installed beside the stock one, used only where bit-exact.

    Args:
        target: ``"package.module:Qualname.attr"`` of the stock function or method.
        patched: the replacement; called with the stock call's arguments, plus ``self``
            (or ``cls``) first for methods and classmethods.
        name: label in logs, records and dump file names (default: the attribute name).
        key: ``key(args, kwargs) -> hashable`` (``self`` excluded); must be rank-invariant.
        mutates: names of the arguments the stock path writes in place; ``None`` (default)
            clones every argument that holds a tensor. Cloned arguments are compared too.
        mode: ``check`` / ``compare`` / ``strict`` / ``off``; ``None`` takes
            ``options.guard.mode`` of the process's installed arming, else ``check``.
        lock: a :class:`GuardLock` or its path, checked by :meth:`install`.
        group: process group for agreement (``None``: the default group).
        max_keys: bound on remembered decisions (``options.guard.max_keys`` overrides it).
        dump_dir: where the first mismatch is dumped (default from the options; see there).
        applies: ``applies(instance, args, kwargs) -> bool``; a call for which it is False
            runs the stock path with no proof and no decision (``instance`` is None for
            functions). Must be rank-invariant, like ``key``.
        tolerance: largest absolute difference per element that still proves a key
            (0, the default: bit-exact only). For patches that change summation order on
            purpose; the reason logged says how far the outputs were apart.

    Raises:
        ConfigError: an unknown ``mode``, ``max_keys`` < 1 or a negative ``tolerance``.
    """

    def __init__(self, target: str, patched: Callable[..., Any], *, name: str | None = None,
                 key: KeyFunction | None = None, mutates: Iterable[str] | None = None,
                 mode: Mode | None = None, lock: GuardLock | str | Path | None = None,
                 group: Any = None, max_keys: int = 256,
                 dump_dir: str | Path | None = None,
                 applies: Callable[[Any, tuple, dict], bool] | None = None,
                 tolerance: float = 0.0) -> None:
        self.target = target
        self.patched = patched
        self.name = name or target.rpartition(".")[2].rpartition(":")[2]
        self.key = key or shape_key
        self.mutates = None if mutates is None else tuple(mutates)
        self.lock = lock
        self.group = group
        if max_keys < 1:
            raise ConfigError(f"max_keys={max_keys} for {target}", "at least one key must be kept",
                              "pass max_keys >= 1")
        if not tolerance >= 0:
            raise ConfigError(f"tolerance={tolerance} for {target}",
                              "a tolerance is a largest absolute difference", "pass 0 or more")
        self.applies = applies
        self.tolerance = float(tolerance)
        self._explicit_mode = _valid_mode(mode) if mode is not None else None
        self._mode: Mode = self._explicit_mode or "check"
        self.max_keys = max_keys
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self._records: Path | None = None
        self._cache: OrderedDict[Hashable, Decision] = OrderedDict()
        self._patch: Patch | None = None
        self.dumps: list[Path] = []
        self.mismatches = 0

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> ExactPatch:
        """Check the lock, read the options, install the wrapper (idempotent).

        Raises:
            DriftError: a target pinned in ``lock`` changed, vanished or cannot be read.
            ConfigError: the lock file or the guard options are invalid.
            PatchError: the target does not resolve.
        """
        if self._patch is not None:
            return self
        if self.lock is not None:
            check_lock(self.lock)
        self._configure()
        self._patch = Patch(self.target, self._call).install()
        return self

    def uninstall(self) -> None:
        """Restore the stock target and forget every decision."""
        if self._patch is not None:
            self._patch.uninstall()
            self._patch = None
        self.reset()

    def __enter__(self) -> ExactPatch:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _configure(self) -> None:
        options, config = active_guard_options()
        self._mode = self._explicit_mode or options.mode or "check"
        if options.max_keys is not None:
            self.max_keys = options.max_keys
        if config is not None and config.enabled:
            if self.dump_dir is None:
                self.dump_dir = options.dump_dir or config.out_dir / "guard-dumps"
            if options.record:
                self._records = config.out_dir / "guard.jsonl"

    # ------------------------------------------------------------------ inspection
    @property
    def installed(self) -> bool:
        return self._patch is not None and self._patch.installed

    @property
    def mode(self) -> Mode:
        """The mode in force. Setting it forgets every decision (keys are proven again).

        Raises:
            ConfigError: on setting a mode other than check / compare / strict / off.
        """
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        self._mode = _valid_mode(mode)
        self.reset()

    @property
    def decisions(self) -> dict[Hashable, Decision]:
        """A snapshot of the remembered decisions, oldest first."""
        return dict(self._cache)

    @property
    def errors(self) -> list[WrapperError]:
        """Failures of the guard's own code, contained by the patching layer."""
        return list(self._patch.errors) if self._patch is not None else []

    def reset(self) -> None:
        """Forget every decision and allow one more dump."""
        self._cache.clear()
        self.dumps.clear()
        self.mismatches = 0

    # ------------------------------------------------------------------ hot path
    def _call(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        mode = self._mode
        if mode == "off":
            return wrapped(*args, **kwargs)
        if self.applies is not None and not self.applies(instance, args, kwargs):
            return wrapped(*args, **kwargs)
        if mode == "compare":
            return self._compare(wrapped, instance, args, kwargs)
        key = self.key(args, kwargs)
        decision = self._cache.get(key)
        if decision is None:
            return self._prove(key, wrapped, instance, args, kwargs)
        self._cache.move_to_end(key)
        if decision.patched:
            return self._run_patched(instance, args, kwargs)
        return wrapped(*args, **kwargs)

    def _run_patched(self, instance: Any, args: tuple, kwargs: dict) -> Any:
        if instance is None:
            return self.patched(*args, **kwargs)
        return self.patched(instance, *args, **kwargs)

    # ------------------------------------------------------------------ proofs
    def _prove(self, key: Hashable, wrapped: Callable[..., Any], instance: Any,
               args: tuple, kwargs: dict) -> Any:
        if capturing():
            # No collectives and no side runs inside torch.compile tracing or graph capture;
            # every rank compiles / captures the same calls, so they stay in step.
            return wrapped(*args, **kwargs)
        result, differences = self._side_by_side(key, wrapped, instance, args, kwargs)
        local = not differences or _within(differences, self.tolerance)
        everyone = agree(local, self.group)
        decision = Decision(key, everyone, _reason(local, everyone, differences, self.tolerance),
                            local)
        self._remember(decision)
        if self._mode == "strict" and not everyone:
            raise ExactnessError(f"{self.name} {describe_key(key)}: {decision.reason}")
        return result

    def _compare(self, wrapped: Callable[..., Any], instance: Any, args: tuple,
                 kwargs: dict) -> Any:
        key = self.key(args, kwargs)
        result, differences = self._side_by_side(key, wrapped, instance, args, kwargs)
        if differences:
            self.mismatches += 1
            logger.warning("enginetap guard %s %s: mismatch: %s", self.name, describe_key(key),
                           summarize(differences))
            self._record("mismatch", key, differences=[str(d) for d in differences])
        return result

    def _side_by_side(self, key: Hashable, wrapped: Callable[..., Any], instance: Any,
                      args: tuple, kwargs: dict) -> tuple[Any, list[Difference]]:
        """Run patched (on clones) then stock (on the caller's arguments); compare."""
        trial = self._run_trial(wrapped, instance, args, kwargs)
        result = wrapped(*args, **kwargs)  # the engine's call: its exceptions propagate
        if trial.bound is None or trial.patched_leaves is None:
            return result, [Difference("patched", trial.failure)]
        try:
            stock = flatten(result) + _argument_leaves(trial.bound.arguments, trial.cloned)
            differences = compare_bits(stock, trial.patched_leaves)
        except Exception as exc:  # our comparison failed: not proven, so not exact
            return result, [Difference("out", f"comparison failed: {exc!r}")]
        if differences and trial.pristine is not None:
            self._dump(key, trial, stock, differences)
        # Drop the patched outputs and clones now, before the engine goes on.
        trial.patched_leaves = trial.pristine = None
        return result, differences

    def _run_trial(self, wrapped: Callable[..., Any], instance: Any, args: tuple,
                   kwargs: dict) -> _Trial:
        trial = _Trial()
        try:
            bound = trial.bound = call_signature(wrapped).bind(*args, **kwargs)
            trial.cloned = self._cloned_names(bound)
            if self.dump_dir is not None and not self.dumps:
                # The caller's arguments are still untouched here: keep them for the dump.
                trial.pristine = {n: clone_tree(bound.arguments[n]) for n in trial.cloned}
            side = call_signature(wrapped).bind(*args, **kwargs)
            for name in trial.cloned:
                side.arguments[name] = clone_tree(side.arguments[name])
            out = self._run_patched(instance, side.args, side.kwargs)
            trial.patched_leaves = flatten(out) + _argument_leaves(side.arguments, trial.cloned)
        except Exception as exc:  # a patched path that raises (or cannot be run) is not exact
            trial.failure = f"patched run failed: {exc!r}"
        return trial

    def _cloned_names(self, bound: inspect.BoundArguments) -> list[str]:
        if self.mutates is None:
            return [n for n, v in bound.arguments.items() if holds_tensor(v)]
        unknown = [n for n in self.mutates if n not in bound.signature.parameters]
        if unknown:
            # A misspelt name would hand the caller's own tensors to the patched run.
            raise ValueError(f"mutates names {unknown}, which {self.target} does not take")
        return [n for n in self.mutates if n in bound.arguments
                and holds_tensor(bound.arguments[n])]

    def _remember(self, decision: Decision) -> None:
        self._cache[decision.key] = decision
        while len(self._cache) > self.max_keys:
            self._cache.popitem(last=False)
        chosen = "patched" if decision.patched else "stock"
        log = logger.info if decision.patched else logger.warning
        log("enginetap guard %s %s -> %s: %s", self.name, describe_key(decision.key), chosen,
            decision.reason)
        self._record("decision", decision.key, chosen=chosen, reason=decision.reason,
                     local_exact=decision.local_exact)

    # ------------------------------------------------------------------ evidence
    def _dump(self, key: Hashable, trial: _Trial, stock: list[tuple[str, Any]],
              differences: list[Difference]) -> None:
        if self.dump_dir is None or trial.bound is None or trial.pristine is None:
            return
        rank = rank_world(self.group)[0]
        inputs = {**trial.bound.arguments, **trial.pristine}
        try:
            path = dump_mismatch(
                self.dump_dir, f"{self.name}-rank{rank}",
                inputs=[pair for n, v in inputs.items() for pair in flatten(v, n)],
                stock=stock, patched=trial.patched_leaves or [], differences=differences,
                meta={"op": self.name, "target": self.target, "key": describe_key(key),
                      "rank": str(rank), "mode": self._mode})
        except OSError as exc:
            logger.error("enginetap guard %s: cannot write mismatch dump: %s", self.name, exc)
            return
        self.dumps.append(path)
        logger.warning("enginetap guard %s: first mismatch dumped to %s", self.name, path)

    def _record(self, event: str, key: Hashable, **fields: Any) -> None:
        if self._records is None:
            return
        rank = rank_world(self.group)[0]
        try:
            RankJsonl(self._records, rank).write({
                "event": event, "op": self.name, "key": describe_key(key), "mode": self._mode,
                **fields})
        except OSError as exc:
            logger.error("enginetap guard %s: cannot write record: %s", self.name, exc)


def _within(differences: list[Difference], tolerance: float) -> bool:
    """Every difference is elementwise and at most ``tolerance`` apart (NaN never is)."""
    return tolerance > 0 and all(d.differing >= 0 and d.max_abs <= tolerance
                                 for d in differences)


def _reason(local: bool, everyone: bool, differences: list[Difference],
            tolerance: float = 0.0) -> str:
    if everyone and not differences:
        return "bit-exact on every rank" if tolerance == 0 else (
            "bit-exact here, within tolerance on every rank")
    if everyone:
        return f"within tolerance on every rank (here: {summarize(differences)})"
    if local:
        here = "bit-exact" if not differences else "within tolerance"
        return f"{here} here, but another rank differed"
    return summarize(differences)


def _valid_mode(mode: str) -> Mode:
    if mode not in get_args(Mode):
        raise ConfigError(f"unknown guard mode {mode!r}", f"modes are {', '.join(get_args(Mode))}",
                          "pick one of them")
    return mode  # type: ignore[return-value]


def _argument_leaves(arguments: dict[str, Any], names: list[str]) -> list[tuple[str, Any]]:
    return [pair for n in names for pair in flatten(arguments[n], f"arg.{n}")]
