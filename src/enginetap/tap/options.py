"""``options.tap`` of the arming config: which rows and checkpoints the tap records."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TapOptions"]


class TapOptions(BaseModel):
    """What the ``tap`` capability records each step (saved in every tap file's header)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_rows: int = Field(64, ge=1, le=4096)
    """Token rows tapped per step: the last rows of the batch that pass the filter."""
    request_filter: str = ""
    """Only rows whose request key contains this substring are tapped ("" = every row);
    the arming config's ``request_filter`` applies as well."""
    depth: Literal["sublayers", "layers"] = "sublayers"
    """``sublayers``: every decoder layer's input and output and every sublayer's output
    (norms, attention, MoE gate and experts, MLP...). ``layers``: decoder layers' input
    and output only (plus the kernel-level points of ``continuity``): about a third of
    the checkpoints and no call of ours in a sublayer, for a tap left on in production; it
    names the first diverging (step, layer), and a second run with ``sublayers`` (or a
    diff against one: runs are compared on the checkpoints both have) names the
    sublayer."""
    inputs: Literal["layers", "all"] = "layers"
    """Record the input rows of decoder layers only, or of every sublayer (twice the
    checkpoints; names the culprit more precisely where untapped ops sit between
    sublayers)."""
    continuity: bool = True
    """Kernel-level points where the engine has them: recurrent state before/after each
    step, the KV row written this step and the previous one re-read."""
    sampler: bool = True
    """Argmax, runner-up and top-1/top-2 logit gap per tapped request."""
    vectors: Literal["off", "split", "window", "control"] = "off"
    """Also write the raw tapped rows (safetensors): at each pair's first split, for the
    steps of ``vector_steps``, or as the ``vector_control`` file says."""
    vector_steps: list[int] = Field(default_factory=list, max_length=2)
    """``[first, last]`` step (inclusive) whose rows ``vectors="window"`` writes."""
    vector_control: str = ""
    """With ``vectors="control"``: a JSON file re-read at the end of every step,
    ``{"steps": [first, last], "checkpoints": [...], "requests": [...]}`` (checkpoint
    names or name prefixes like ``"L3"``, request-key substrings; both optional): the
    rows written for the steps in that window. Missing or empty: nothing is written."""
    defer: bool = True
    """On a device Triton runs on (CUDA): hash checkpoints whose tensors nothing modifies
    later in the step at step end, in place, all in one kernel, instead of one gather per
    checkpoint; each checkpoint is verified against the gather path the first times it is
    seen in a step of each kind and every ``defer_verify_every`` steps (see
    ``enginetap.tap.record.deferred`` for what that cannot see). Not with ``vectors`` (they need the gathered
    rows)."""
    defer_bytes: int = Field(1 << 30, ge=0)
    """Most bytes of checkpointed tensors kept alive until step end by ``defer`` (beyond
    it, checkpoints are gathered as they come: long prefills)."""
    defer_verify_every: int = Field(50, ge=0)
    """With ``defer``: every this many steps, every deferred checkpoint is also gathered
    and the two hashes compared (0: only the first steps of each kind)."""
    force: bool = False
    """Record even under torch.compile tracing or CUDA-graph capture (where the hooks
    would be traced into the graph); refused by default."""
    file: str = "tap"
    """Output name: ``<out_dir>/<file>-rank<r>.jsonl``."""
    run: dict[str, Any] = Field(default_factory=dict)
    """What the job that recorded the run was asked (``enginetap tap run`` fills it):
    engine, model, dtype, device, batch size, new tokens per request and the prompts, so
    ``enginetap tap explain`` can run the same prompts again. Empty where the tap was armed
    by hand (such a run cannot be explained)."""

    @model_validator(mode="after")
    def _validate_vectors(self) -> TapOptions:
        if self.depth == "layers" and self.inputs == "all":
            raise ValueError("inputs='all' records every sublayer's input: it needs "
                             "depth='sublayers' (or set inputs='layers')")
        if (self.vectors == "control") != bool(self.vector_control):
            raise ValueError("vectors='control' and vector_control (the control file's path) "
                             "go together")
        if self.vectors == "window" and len(self.vector_steps) != 2:
            raise ValueError("vectors='window' needs vector_steps=[first, last]")
        return self
