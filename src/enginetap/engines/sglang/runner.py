"""Step context from SGLang's model runner (``srt/model_executor/model_runner.py``).

SGLang's scheduler process (one per TP rank) runs one batch per step through its TP
worker: ``ModelRunner.forward(forward_batch)`` runs the model, then
``ModelRunner.sample(logits_output, forward_batch)`` samples the next tokens. The adapter

- builds the :class:`~enginetap.core.context.Step` when ``forward`` is entered with a
  ``ForwardBatch`` of requests (SGLang prepared it: rows are read from its own tensors,
  never recomputed) and makes it current, so every kernel of the forward sees it;
- ends it when ``sample`` returned for that batch (``step.sampled``: the first sampled
  token of each request);
- abandons it, without end listeners, when ``forward`` raised, or when the next forward
  begins and nothing sampled (prefill-only requests): only steps that sampled are real.

Idle batches (data-parallel padding) and CUDA-graph capture runs carry no requests and
are never published.

Per row: the request id (``ForwardBatch.rids``, the caller's ``rid`` where it gave one,
also the key), position (``forward_batch.positions``), token id, KV slot
(``out_cache_loc``: SGLang's flat token slot), the request's cached prefix
(``extend_prefix_lens``: the radix cache's hit on an extend step) as the computed count,
sequence length, and for hybrid models the request's recurrent-state slot (the mamba
pool index of its ``req_pool_indices`` entry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from enginetap.core.context import Step, StepRows
from enginetap.core.patching import bind_arguments
from enginetap.engines.sglang.probes.common import CURRENT, current_runner
from enginetap.engines.steps import RunnerState, StepAdapter

RUNNER = "sglang.srt.model_executor.model_runner:ModelRunner"

__all__ = ["RUNNER", "SGLangStepAdapter", "current_runner", "read_step"]

@dataclass
class SGLangStepAdapter(StepAdapter, engine="SGLang", runner=RUNNER):
    """Publishes one :class:`Step` per real step of every SGLang model runner here; the
    state's ``batch`` is the step's ForwardBatch (``sample`` of another batch does not
    end it)."""

    def wrappers(self) -> dict[str, Callable[..., Any]]:
        return {"forward": self._on_forward, "sample": self._on_sample}

    def _on_forward(self, wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        state = self._states.setdefault(runner, RunnerState())
        self._abandon(state)  # the step before never sampled: not a real step
        batch = bind_arguments(wrapped, args, kwargs)["forward_batch"]
        if not batch.rids or batch.forward_mode.is_idle():
            return wrapped(*args, **kwargs)
        step = self._read(lambda: read_step(runner, batch, state.next_step,
                                            (self.rank, self.world_size)))
        if step is None:
            return wrapped(*args, **kwargs)
        state.batch = batch
        CURRENT[0] = runner
        self._begin(state, step)
        try:
            return wrapped(*args, **kwargs)
        except BaseException:
            self._abandon(state)
            raise

    def _on_sample(self, wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        state = self._states.get(runner)
        if state is None or state.active is None:
            return wrapped(*args, **kwargs)
        if bind_arguments(wrapped, args, kwargs)["forward_batch"] is not state.batch:
            return wrapped(*args, **kwargs)
        return self._sample(state, wrapped, args, kwargs, _fill_sampled)

    def _cleared(self, state: RunnerState) -> None:
        state.batch = None
        CURRENT[0] = None


def _fill_sampled(step: Step, tokens: Any) -> None:
    """``step.sampled``: the token ``sample`` returned for each request, in batch order."""
    if tokens is not None and hasattr(tokens, "tolist"):
        ids = step.extra.get("rids", [])
        step.sampled = {rid: int(t) for rid, t in zip(ids, tokens.tolist())}


def _mode(batch: Any) -> str:
    mode = batch.forward_mode
    if mode.is_decode():
        return "decode"
    if mode.is_mixed():
        return "mixed"
    return "prefill"


def read_step(runner: Any, batch: Any, number: int, rank_world: tuple[int, int]) -> Step:
    """The step ``runner`` is about to run for ``batch`` (a ``ForwardBatch``)."""
    rids = [str(r) for r in batch.rids]
    n = len(rids)
    seq_lens = [int(x) for x in (batch.seq_lens_cpu if batch.seq_lens_cpu is not None
                                 else batch.seq_lens).tolist()][:n]
    mode = _mode(batch)
    if mode == "decode":
        counts, prefix = [1] * n, [s - 1 for s in seq_lens]
    else:
        counts = [int(x) for x in batch.extend_seq_lens_cpu][:n]
        prefix = [int(x) for x in batch.extend_prefix_lens_cpu][:n]
    owner = [r for r in range(n) for _ in range(counts[r])]
    starts, total = [], 0
    for c in counts:
        starts.append(total)
        total += c
    num_tokens = len(owner)
    positions = batch.positions[:num_tokens].tolist()
    token_ids = batch.input_ids[:num_tokens].tolist()
    kv = batch.out_cache_loc[:num_tokens].tolist() if batch.out_cache_loc is not None else None
    state = _state_slots(runner, batch, n)
    # a MIXED batch: a request with one new token past its prompt is a decode row
    prefill_rows = sum(1 for r in owner if mode == "prefill" or counts[r] > 1)
    rows = StepRows(
        request_ids=[rids[r] for r in owner],
        positions=positions,
        token_ids=token_ids,
        query_start=[starts[r] for r in owner],
        computed_host=[prefix[r] for r in owner],
        kv_slots=kv,
        state_slots=None if state is None else [state[r] for r in owner],
        token_index=list(range(num_tokens)),
        planned_tokens=[counts[r] for r in owner],
        query_lens=[counts[r] for r in owner],
        seq_lens=[seq_lens[r] for r in owner],
    )
    extra = {"runner": "sglang", "num_reqs": n, "rids": rids,
             "forward_mode": batch.forward_mode.name,
             "req_pool_indices": batch.req_pool_indices[:n].tolist()}
    if mode != "decode":
        extra["prefix_hits"] = dict(zip(rids, prefix))
    return Step("sglang", number, Step.mode_of(prefill_rows, num_tokens - prefill_rows),
                rows, rank=rank_world[0], world_size=rank_world[1],
                padded_tokens=int(batch.input_ids.shape[0]),
                kv_block_size=int(getattr(runner, "page_size", 1) or 1), extra=extra)


def _state_slots(runner: Any, batch: Any, n: int) -> list[int] | None:
    """Each request's recurrent-state slot (hybrid models), from the request pool."""
    pool = getattr(runner, "req_to_token_pool", None)
    get = getattr(pool, "get_mamba_indices", None)
    if get is None:
        return None
    indices = get(batch.req_pool_indices[:n])
    return [int(x) for x in indices.tolist()]
