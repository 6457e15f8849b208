"""Options of the ``sp_prefill`` capability (``options.sp_prefill`` of the arming config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Mode = Literal["off", "comm", "shard", "exact"]

__all__ = ["Mode", "SpPrefillOptions"]


class SpPrefillOptions(BaseModel):
    """How sequence-parallel prefill runs once armed (``ENGINETAP_CAPABILITIES=sp_prefill``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Mode = "exact"
    """``off``: install nothing. ``comm``: nothing sharded, every all-reduce of a row-parallel
    projection runs as reduce-scatter + all-gather. ``shard``: the residual stream stays
    split by rows between sublayers. ``exact``: as ``shard``, but every reduce-scatter is an
    all-reduce that keeps this rank's rows, so the engine's output is reproduced bit for bit."""
    min_rows: int = Field(default=2048, ge=1)
    """Prefill chunks with fewer rows run the stock path."""
    tolerance: float = Field(default=0.0, ge=0.0)
    """``comm`` / ``shard``: largest absolute difference of the final hidden states the
    self-check accepts (0: bit-exact only). ``exact`` always demands bit-exact."""
    compare: bool = False
    """Debug: at every reduction site, also run the stock all-reduce on the same partial
    sums and log (and dump, first per op and rank) every difference."""
    record: bool = True
    """Write one line per model forward to ``<out_dir>/sp_prefill-rank<r>.jsonl``: rows, the
    path taken and why, bytes moved by each collective."""

    @model_validator(mode="after")
    def _validate_tolerance(self) -> SpPrefillOptions:
        if self.mode == "exact" and self.tolerance > 0:
            raise ValueError("tolerance: exact mode is bit-exact by definition; "
                             "set tolerance only with mode comm or shard")
        return self
