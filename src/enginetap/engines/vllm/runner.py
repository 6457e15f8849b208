"""Step context for vLLM's V1 model runner (``vllm/v1/worker/gpu_model_runner.py``).

vLLM CPU runs this runner (``CPUModelRunner`` subclasses ``GPUModelRunner`` and keeps its
``execute_model`` / ``_model_forward`` / ``sample_tokens``). One engine step is two calls:
``execute_model`` prepares inputs, runs the forward and stores its state;
``sample_tokens`` then samples from that state. The adapter therefore

- builds the :class:`~enginetap.core.context.Step` when ``_model_forward`` is entered from
  inside ``execute_model`` (inputs are prepared and the forward context is set, so rows
  are read from the runner's own buffers and metadata, never recomputed), and makes it
  current there, so every kernel of the forward sees :func:`current_step`;
- ends it (end listeners, e.g. the step recorder) when ``sample_tokens`` returned for it;
- abandons it, without end listeners, when ``execute_model`` raised or stored nothing to
  sample, or when sampling raised: only steps that sampled are real.

Dummy, profile and warm-up runs call the model directly (``_dummy_run``), and a step with
no scheduled tokens returns before the forward: neither is ever published.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from enginetap.core.context import Step, StepRows
from enginetap.core.patching import bind_arguments
from enginetap.core.scope import short_name
from enginetap.engines.steps import RunnerState, StepAdapter

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V1_RUNNER = f"{V1_RUNNER_MODULE}:GPUModelRunner"

__all__ = ["V1_RUNNER", "V1_RUNNER_MODULE", "V1StepAdapter", "read_step", "request_key"]


@dataclass
class V1StepAdapter(StepAdapter, engine="vLLM", runner=V1_RUNNER):
    """Publishes one :class:`Step` per real step of every V1 model runner in this process
    (:class:`~enginetap.engines.steps.StepAdapter`: a failed reading disarms). The state's
    ``batch`` is the scheduler output while ``execute_model`` runs."""

    def wrappers(self) -> dict[str, Callable[..., Any]]:
        return {"execute_model": self._on_execute, "_model_forward": self._on_forward,
                "sample_tokens": self._on_sample}

    def _on_execute(self, wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        state = self._states.setdefault(runner, RunnerState())
        state.batch = bind_arguments(wrapped, args, kwargs)["scheduler_output"]
        try:
            return wrapped(*args, **kwargs)
        finally:
            state.batch = None
            if runner.execute_model_state is None:  # nothing to sample: not a real step
                self._abandon(state)

    def _on_forward(self, wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        state = self._states.get(runner)
        if state is None or state.batch is None or state.active is not None:
            return wrapped(*args, **kwargs)  # not the forward of a scheduled step
        step = self._read(lambda: read_step(runner, state.next_step,
                                            bind_arguments(wrapped, args, kwargs),
                                            state.batch, (self.rank, self.world_size)))
        if step is not None:
            self._begin(state, step)
        return wrapped(*args, **kwargs)

    def _on_sample(self, wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        state = self._states.get(runner)
        if state is None or state.active is None:
            return wrapped(*args, **kwargs)
        return self._sample(state, wrapped, args, kwargs, _fill_sampled)


def _fill_sampled(step: Step, result: Any) -> None:
    """``step.sampled`` from a plain ``ModelRunnerOutput`` (its first token per request;
    an asynchronous output is left unread: reading it would wait for the device)."""
    ids, tokens = getattr(result, "req_ids", None), getattr(result, "sampled_token_ids", None)
    if not ids or not isinstance(tokens, list):
        return
    keys = dict(zip(step.rows.request_ids, step.rows.keys))
    step.sampled = {keys.get(i, request_key(i)): int(t[0]) for i, t in zip(ids, tokens) if t}


_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_COMPLETION = re.compile(r"^cmpl-(.+)-\d+$")


def request_key(request_id: str) -> str:
    """vLLM's request id without the random 8-hex-digit suffix its input processor adds
    to the caller's id (``"3-1a2b3c4d"`` → ``"3"``): stable across runs of the same
    prompts in the same order, and equal to an id the caller chose. The OpenAI server
    names a completion ``cmpl-<X-Request-Id>-<choice>``: the key is the header's id."""
    key = _SUFFIX.sub("", request_id)
    completion = _COMPLETION.match(key)
    return completion.group(1) if completion else key


@dataclass(slots=True)
class _Requests:
    """The batch's requests in the runner's order, as its prepared inputs hold them."""

    ids: list[str]
    starts: list[int]
    """Query start of each request in the flattened batch, plus the total at the end."""
    host: list[int]
    device: list[int]
    prefill: list[bool]
    planned: list[int]
    """Tokens the scheduler planned per request (``num_scheduled_tokens``)."""
    query_lens: list[int]
    """Tokens per request in the runner's query start offsets as the kernels get them."""
    seq_lens: list[int]
    """The runner's sequence lengths (computed plus scheduled, as its device state has it)."""

    def row_owner(self) -> list[int]:
        return [r for r in range(len(self.ids)) for _ in range(self.starts[r + 1] - self.starts[r])]


def _requests(runner: Any, scheduled: Any) -> _Requests:
    drafts: dict[str, list[int]] = scheduled.scheduled_spec_decode_tokens
    batch = runner.input_batch
    n = batch.num_reqs
    ids = list(batch.req_ids[:n])
    starts = [int(x) for x in runner.query_start_loc.np[: n + 1]]
    host = [int(x) for x in batch.num_computed_tokens_cpu[:n]]
    prompt = [int(x) for x in batch.num_prompt_tokens[:n]]
    prefill = [host[r] < prompt[r] or starts[r + 1] - starts[r] > 1 + len(drafts.get(ids[r], ()))
               for r in range(n)]
    device = [int(x) for x in runner.num_computed_tokens[:n].tolist()]
    planned = [int(scheduled.num_scheduled_tokens.get(i, -1)) for i in ids]
    loc = runner.query_start_loc.gpu[: n + 1].tolist()
    query_lens = [b - a for a, b in zip(loc, loc[1:])]
    seq_lens = [int(x) for x in runner.seq_lens[:n].tolist()]
    return _Requests(ids, starts, host, device, prefill, planned, query_lens, seq_lens)


def read_step(runner: Any, number: int, inputs: dict[str, Any], scheduled: Any,
              rank_world: tuple[int, int]) -> Step:
    """The step the runner is about to run, read from its prepared inputs.

    ``inputs`` are ``_model_forward``'s bound arguments (``input_ids``, ``positions``);
    ``scheduled`` the scheduler's output for the step (planned tokens and speculative
    tokens per request). A request's rows are decode
    rows when its prompt is computed and the step runs one token plus its drafts for it;
    otherwise (prompt chunks, recomputation after preemption) they are prefill rows.
    """
    reqs = _requests(runner, scheduled)
    owner = reqs.row_owner()
    num_tokens = len(owner)
    slots = _slots(runner, num_tokens, len(reqs.ids))
    state_groups = {g: [v[r] for r in owner] for g, v in slots.state_groups.items()}
    rows = StepRows(
        request_ids=[reqs.ids[r] for r in owner],
        request_keys=[request_key(reqs.ids[r]) for r in owner],
        token_index=list(range(num_tokens)),
        kv_groups=slots.kv_groups or None,
        state_groups=state_groups or None,
        positions=_positions(inputs, runner, num_tokens),
        token_ids=_token_ids(inputs, runner, num_tokens),
        query_start=[reqs.starts[r] for r in owner],
        computed_host=[reqs.host[r] for r in owner],
        computed_device=[reqs.device[r] for r in owner],
        kv_slots=slots.kv,
        state_slots=None if slots.state is None else [slots.state[r] for r in owner],
        planned_tokens=[reqs.planned[r] for r in owner],
        query_lens=[reqs.query_lens[r] for r in owner],
        seq_lens=[reqs.seq_lens[r] for r in owner],
    )
    prefill_rows = sum(reqs.prefill[r] for r in owner)
    extra = {"runner": "v1", "num_reqs": len(reqs.ids), "cache_groups": slots.layer_groups,
             "compiled": _compiled(runner),
             "prefill_requests": [i for i, p in zip(reqs.ids, reqs.prefill) if p]}
    padded = inputs.get("input_ids")
    padded = padded.shape[0] if padded is not None else num_tokens
    return Step("vllm", number, Step.mode_of(prefill_rows, num_tokens - prefill_rows), rows,
                rank=rank_world[0], world_size=rank_world[1], padded_tokens=int(padded),
                kv_block_size=slots.kv_block_size, extra=extra)


def _compiled(runner: Any) -> str | None:
    """vLLM's torch.compile mode for the model (``VLLM_COMPILE``...), None when eager."""
    mode = getattr(getattr(runner.vllm_config, "compilation_config", None), "mode", 0)
    return getattr(mode, "name", str(mode)) if mode else None


def _positions(inputs: dict[str, Any], runner: Any, num_tokens: int) -> list[int]:
    positions = inputs.get("positions")
    if positions is None:
        positions = runner.positions
    if positions.dim() == 2:  # M-RoPE: [sections, tokens]; text rows agree across sections
        positions = positions[0]
    return positions[:num_tokens].tolist()


def _token_ids(inputs: dict[str, Any], runner: Any, num_tokens: int) -> list[int]:
    input_ids = inputs.get("input_ids")
    if input_ids is None:  # the model is fed embeddings; the runner still holds the ids
        input_ids = runner.input_ids.gpu
    return input_ids[:num_tokens].tolist()


@dataclass(slots=True)
class _Slots:
    kv: list[int] | None = None
    """KV-cache slot per row, from the first attention group's slot mapping."""
    kv_block_size: int | None = None
    state: list[int] | None = None
    """Recurrent-state slot per request, from the first recurrent group's metadata."""
    kv_groups: dict[str, list[int]] = field(default_factory=dict)
    """Slot per row of every attention group, by ``group<i>``."""
    state_groups: dict[str, list[int]] = field(default_factory=dict)
    """Slot per request of every recurrent group, by ``group<i>``."""
    layer_groups: dict[str, str] = field(default_factory=dict)
    """The cache group of every layer, by the layer's short name (``L1.gdn``)."""


def _slots(runner: Any, num_tokens: int, num_reqs: int) -> _Slots:
    """The slots the kernels of this forward use, as the forward context holds them."""
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    found = _Slots()
    if not is_forward_context_available():
        return found
    forward = get_forward_context()
    if not isinstance(forward.slot_mapping, dict) or not isinstance(forward.attn_metadata, dict):
        return found  # micro-batched step: one mapping per micro-batch
    for index, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        spec, layer = group.kv_cache_spec, group.layer_names[0]
        found.layer_groups.update((short_name(n), f"group{index}") for n in group.layer_names)
        mapping = forward.slot_mapping.get(layer)
        if isinstance(spec, AttentionSpec) and mapping is not None:
            found.kv_groups[f"group{index}"] = mapping[:num_tokens].tolist()
            if found.kv is None:
                found.kv, found.kv_block_size = found.kv_groups[f"group{index}"], spec.block_size
        if isinstance(spec, MambaSpec):
            state = _state_indices(forward.attn_metadata.get(layer), num_reqs)
            if state is not None:
                found.state_groups[f"group{index}"] = state
                if found.state is None:
                    found.state = state
    return found


def _state_indices(metadata: Any, num_reqs: int) -> list[int] | None:
    """Per-request state slot from a recurrent layer's metadata (GDN, Mamba, linear attn)."""
    if metadata is None:
        return None
    indices = getattr(metadata, "non_spec_state_indices_tensor", None)
    if indices is None:
        indices = getattr(metadata, "state_indices_tensor", None)
    if indices is None:
        decode = getattr(metadata, "state_indices_tensor_d", None)
        prefill = getattr(metadata, "state_indices_tensor_p", None)
        parts = [t[:n] for t, n in ((decode, getattr(metadata, "num_decodes", 0)),
                                    (prefill, getattr(metadata, "num_prefills", 0)))
                 if t is not None and n]
        if not parts:
            return None
        import torch

        indices = torch.cat(parts)
    if indices.dim() == 2:
        indices = indices[:, 0]
    if indices.shape[0] < num_reqs:
        return None
    return indices[:num_reqs].tolist()
