"""Run a traffic profile through a driver: the order of sends, receipts, a progress bar.

For each single request: reset the prefix cache, send its cache predecessor (one output
token) if it has one, then the request. For each overlap group: reset, then every member
in one batch. For each arrival replay: reset, then waves — the requests whose (scaled)
arrival time has passed go together as one batch; the next wave waits for the batch
before it (as an engine without continuous batching would run them), and each receipt
records both the arrival time asked and the send time it got.

Request keys are ``<label>.<index>`` (``<label>.warm`` for a predecessor), unique within
a profile, and are what the engine sees as request ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict

from enginetap.traffic.drivers import Driver, Outcome, Role, Submission
from enginetap.traffic.profile import ArrivalReplay, RequestProfile, TrafficProfile
from enginetap.traffic.prompts import PromptBuilder, input_sha256
from enginetap.traffic.scaling import check_fits

__all__ = ["OnSend", "Receipt", "RunReport", "count_submissions", "run_profile"]

OnSend = Callable[[str, Sequence[Submission]], None]
"""``on_send(unit label, batch)``: called before a batch is handed to the driver."""


class Receipt(BaseModel):
    """What was sent for one request and what came back."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    profile: str
    """Name of the traffic profile."""
    label: str
    """The request's label (a predecessor carries its request's label)."""
    key: str
    """Stable request key (``label.index`` or ``label.warm``), the engine's request id."""
    unit: str
    """Label of the single request, group or replay it was sent in."""
    role: Role
    """request, predecessor (cache warm-up), member (overlap group) or arrival (replay)."""
    source: str | None
    """Where the request came from in its trace (``file:line``, or the predecessor's locator)."""
    driver: str
    """Which driver sent it."""
    input_sha256: str
    """SHA-256 of the prompt's token ids (see :func:`~enginetap.traffic.prompts.input_sha256`)."""
    input_tokens: int
    """Prompt length sent."""
    max_tokens: int
    """Output tokens asked for."""
    output_ids: list[int]
    """Tokens generated."""
    finish_reason: str | None
    """The engine's finish reason (``length``, ``stop``)."""
    cached_tokens: int | None
    """Prompt tokens served from the prefix cache, where the engine tells."""
    arrival_s: float | None
    """Scheduled arrival offset (replays only)."""
    sent_s: float
    """Send time, seconds since the profile's run began."""
    latency_s: float
    """Seconds from send to completion."""


class RunReport(BaseModel):
    """Receipts of one profile run, with the provenance of its prompts."""

    model_config = ConfigDict(extra="forbid")

    profile: str
    source: str
    scale: float
    prompts: dict[str, Any]
    started_at: float
    receipts: list[Receipt]


def count_submissions(profile: TrafficProfile) -> int:
    """How many prompts a run of ``profile`` sends (predecessors included)."""
    singles = sum(2 if r.cache_predecessor else 1 for r in profile.requests)
    return (singles + sum(len(g.members) for g in profile.overlap_groups)
            + sum(len(r.members) for r in profile.replays))


class _Run:
    """State of one profile run: the driver, prompts, clock and receipts so far."""

    def __init__(self, profile: TrafficProfile, driver: Driver, builder: PromptBuilder,
                 advance: Callable[[int], None], on_send: OnSend | None) -> None:
        self.profile, self.driver, self.builder = profile, driver, builder
        self.advance, self.on_send = advance, on_send
        self.t0 = time.time()
        self.receipts: list[Receipt] = []

    def submission(self, req: RequestProfile, key: str, role: Role) -> Submission:
        return Submission(key, req.label, role, self.builder.request(req), req.output_tokens,
                          req.source)

    def send(self, unit: str, batch: Sequence[Submission],
             arrivals: Sequence[float | None] = ()) -> None:
        if self.on_send is not None:
            self.on_send(unit, batch)
        outcomes = self.driver.submit(batch)
        for i, (sub, out) in enumerate(zip(batch, outcomes)):
            self.receipts.append(self._receipt(unit, sub, out,
                                               arrivals[i] if arrivals else None))
        self.advance(len(batch))

    def _receipt(self, unit: str, sub: Submission, out: Outcome,
                 arrival: float | None) -> Receipt:
        return Receipt(
            profile=self.profile.name, label=sub.label, key=sub.key, unit=unit, role=sub.role,
            source=sub.source,
            driver=self.driver.name, input_sha256=input_sha256(sub.prompt_ids),
            input_tokens=len(sub.prompt_ids), max_tokens=sub.max_tokens,
            output_ids=out.output_ids, finish_reason=out.finish_reason,
            cached_tokens=out.cached_tokens, arrival_s=arrival, sent_s=out.started - self.t0,
            latency_s=out.finished - out.started)

    def single(self, req: RequestProfile) -> None:
        self.driver.reset_prefix_cache()
        warm = self.builder.predecessor(req)
        if warm is not None:
            locator = req.cache_predecessor.locator if req.cache_predecessor else None
            self.send(req.label, [Submission(f"{req.label}.warm", req.label, "predecessor",
                                             warm, 1, locator)])
        self.send(req.label, [self.submission(req, f"{req.label}.0", "request")])

    def replay(self, replay: ArrivalReplay) -> None:
        self.driver.reset_prefix_cache()
        pending = list(enumerate(replay.members))
        start = time.monotonic()
        while pending:
            wait = (pending[0][1].arrival_s or 0.0) - (time.monotonic() - start)
            if wait > 0:
                time.sleep(wait)
            now = time.monotonic() - start
            wave = [(i, m) for i, m in pending if (m.arrival_s or 0.0) <= now]
            pending = pending[len(wave):]
            self.send(replay.label,
                      [self.submission(m, f"{replay.label}.{i}", "arrival") for i, m in wave],
                      [m.arrival_s for _, m in wave])


LINE_EVERY_S = 5.0
"""Seconds between two progress lines (``progress="lines"``)."""


@contextmanager
def _progress(total: int, enabled: bool | str, title: str) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    if enabled == "lines":
        yield _lines(total, title)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=total)
        yield lambda n: bar.advance(task, n)


def _lines(total: int, title: str) -> Callable[[int], None]:
    """Progress as plain lines on stderr (a log, a pipe): the first request, then one line
    at most every :data:`LINE_EVERY_S` seconds, and the last."""
    import sys

    start, done, last = time.monotonic(), 0, float("-inf")

    def advance(n: int) -> None:
        nonlocal done, last
        done += n
        now = time.monotonic()
        if done >= total or now - last >= LINE_EVERY_S:
            last = now
            print(f"{title}: {done}/{total} prompts done ({now - start:.0f} s)",
                  file=sys.stderr, flush=True)

    print(f"{title}: {total} prompts to send", file=sys.stderr, flush=True)
    return advance


def run_profile(profile: TrafficProfile, driver: Driver, *, progress: bool | str = True,
                builder: PromptBuilder | None = None,
                on_send: OnSend | None = None) -> RunReport:
    """Send every request of ``profile`` through ``driver``; one receipt per prompt sent.

    ``progress``: True, a progress bar on stderr; ``"lines"``, plain lines there (for a
    log or a pipe); False, nothing.

    ``builder`` defaults to ``driver.prompts(profile.seed)``. ``on_send(unit, batch)`` is
    called just before each batch goes to the driver (capture notes which keys belong to
    which profile unit there).

    Raises:
        TrafficError: a prompt does not fit the driver's context, or the driver failed.
    """
    check_fits(profile, driver.max_context)
    builder = builder or driver.prompts(profile.seed)
    with _progress(count_submissions(profile), progress, f"traffic {profile.name}") as advance:
        run = _Run(profile, driver, builder, advance, on_send)
        for req in profile.requests:
            run.single(req)
        for group in profile.overlap_groups:
            driver.reset_prefix_cache()
            run.send(group.label, [run.submission(m, f"{group.label}.{i}", "member")
                                   for i, m in enumerate(group.members)])
        for replay in profile.replays:
            run.replay(replay)
    return RunReport(profile=profile.name, source=profile.source, scale=profile.scale,
                     prompts=builder.provenance(), started_at=run.t0, receipts=run.receipts)
