"""What every serving engine's step adapter shares (:class:`StepAdapter`): a step ends
when its sampler returned; a begun step dropped for a reason that is not the engine's own
is logged by number, never dropped silently."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from enginetap.core import context
from enginetap.core.context import Step, StepRows
from enginetap.engines.steps import RunnerState, StepAdapter


class Runner:
    """A model runner with the two calls an engine step makes."""

    def forward(self, n: int) -> int:
        return n * 2

    def sample(self, fail: BaseException | None = None) -> str:
        if fail is not None:
            raise fail
        return "token"


class Adapter(StepAdapter, engine="Toy", runner=f"{__name__}:Runner"):
    def wrappers(self) -> dict[str, Any]:
        return {"forward": self._on_forward, "sample": self._on_sample}

    def _on_forward(self, wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        state = self._states.setdefault(runner, RunnerState())
        rows = StepRows(["r"], [state.next_step], [1], [0], [state.next_step])
        self._begin(state, Step("toy", state.next_step, "decode", rows, rank=self.rank))
        return wrapped(*args, **kwargs)

    def _on_sample(self, wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        state = self._states[runner]
        return self._sample(state, wrapped, args, kwargs, lambda step, _: None)


@pytest.fixture
def adapter():
    ended: list[int] = []

    def on_end(step: Step) -> None:
        ended.append(step.step)

    made = Adapter(rank=1, world_size=2).install()
    context.subscribe(on_end=on_end)
    yield made, ended
    context.unsubscribe(on_end)
    made.uninstall()


def test_steps_end_when_their_sampler_returned(adapter):
    _, ended = adapter
    runner = Runner()
    for n in range(3):
        assert runner.forward(n) == 2 * n
        assert runner.sample() == "token"
    assert ended == [0, 1, 2]


def test_a_sampler_that_raises_drops_its_step_by_name(adapter, caplog):
    _, ended = adapter
    runner = Runner()
    runner.forward(0)
    with caplog.at_level(logging.WARNING, "enginetap.toy"), pytest.raises(SystemExit):
        runner.sample(SystemExit())
    runner.forward(1)
    runner.sample()
    assert ended == [0]  # a dropped step is not real: the next real step takes its number
    assert ("Toy step 0 on rank 1 was not recorded: its sampler raised SystemExit (the "
            "process is ending)") in caplog.text


def test_a_step_still_in_flight_at_exit_or_disarm_is_named(adapter, caplog):
    made, ended = adapter
    runner = Runner()
    runner.forward(0)
    with caplog.at_level(logging.WARNING, "enginetap.toy"):
        made._at_exit()  # what the process's exit runs
        runner.forward(1)
        made.uninstall()
    assert ended == []
    assert ("Toy step 0 on rank 1 was not recorded: the process ended before its sampler "
            "returned") in caplog.text
    assert "Toy step 0 on rank 1 was not recorded: enginetap disarmed while it ran" in caplog.text
    assert runner.forward(2) == 4 and runner.sample() == "token"  # unpatched: no step
    assert ended == []
