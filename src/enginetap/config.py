"""Arming: which capabilities enginetap installs in an engine process, read once.

The same :class:`ArmConfig` arms every engine (the embedded transformers engine and the
vLLM plugin), so capture/tap/guard code never asks which engine it runs in.

Environment (read once per process, the first time :func:`arming` is called):

- ``ENGINETAP`` — ``1``/``true``/``on`` arms; anything else (or unset) leaves it disarmed.
- ``ENGINETAP_CONFIG`` — path of a JSON file holding an :class:`ArmConfig`; arms by itself.
- ``ENGINETAP_CAPABILITIES`` — comma list, e.g. ``step,tap`` (overrides the file).
- ``ENGINETAP_OUT`` — output directory (overrides the file).
- ``ENGINETAP_REQUESTS`` — substring filter on request ids (overrides the file).

:func:`env_says_armed` looks only at ``os.environ``: callers that must stay free when
disarmed (the vLLM plugin) check it before importing anything else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from enginetap.errors import ConfigError, describe_validation

OptionsT = TypeVar("OptionsT", bound=BaseModel)
Capability = Literal["step", "capture", "tap", "guard"]
ARMING_VARS = ("ENGINETAP", "ENGINETAP_CONFIG", "ENGINETAP_CAPABILITIES", "ENGINETAP_OUT",
               "ENGINETAP_REQUESTS")
"""The variables that arm (others, such as ``ENGINETAP_CACHE``, only configure)."""
_TRUE = {"1", "true", "on", "yes"}

__all__ = ["ARMING_VARS", "ArmConfig", "Capability", "arming", "env_says_armed", "parse_options",
           "reset_arming"]


class ArmConfig(BaseModel):
    """What to arm in an engine process. Saved beside the data it produced."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Whether anything is armed at all."""
    capabilities: list[Capability] = Field(default_factory=lambda: ["step"])
    """Capabilities to install; ``step`` (the step context) is implied by every other one."""
    out_dir: Path = Path("enginetap-out")
    """Directory for per-rank output files."""
    request_filter: str = ""
    """Only requests whose id contains this substring are recorded ("" = all)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Capability-specific options, by capability name."""

    @field_validator("capabilities")
    @classmethod
    def _validate_capabilities(cls, value: list[str]) -> list[str]:
        ordered = list(dict.fromkeys(value))
        if ordered and "step" not in ordered:
            ordered.insert(0, "step")
        return ordered


def env_says_armed(environ: dict[str, str] | None = None) -> bool:
    """Cheap check: does the environment ask for arming? Imports nothing."""
    env = os.environ if environ is None else environ
    return env.get("ENGINETAP", "").strip().lower() in _TRUE or bool(env.get("ENGINETAP_CONFIG"))


def load_config(environ: dict[str, str] | None = None) -> ArmConfig:
    """Build the config the environment describes.

    Raises:
        ConfigError: the config file is missing or not a valid ArmConfig, or a variable
            holds an unknown capability.
    """
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    path = env.get("ENGINETAP_CONFIG")
    if path:
        data = _read_config_file(Path(path))
    if not env_says_armed(env):
        return ArmConfig()
    data["enabled"] = True
    if env.get("ENGINETAP_CAPABILITIES"):
        data["capabilities"] = [c.strip() for c in env["ENGINETAP_CAPABILITIES"].split(",") if c.strip()]
    if env.get("ENGINETAP_OUT"):
        data["out_dir"] = env["ENGINETAP_OUT"]
    if "ENGINETAP_REQUESTS" in env:
        data["request_filter"] = env["ENGINETAP_REQUESTS"]
    return parse_options(ArmConfig, data, "invalid enginetap arming configuration",
                         "fix ENGINETAP_* variables or the file named by ENGINETAP_CONFIG")


def parse_options(model: type[OptionsT], raw: Any, what: str, fix: str) -> OptionsT:
    """Validate ``raw`` as ``model`` (an ``ArmConfig`` or a capability's options).

    Raises:
        ConfigError: naming ``what`` failed, every invalid field, and ``fix``.
    """
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(what, describe_validation(exc), fix) from None


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found", "ENGINETAP_CONFIG names it",
                          "point ENGINETAP_CONFIG at an existing JSON file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON", str(exc),
                          "write the file as a JSON object of ArmConfig fields") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} is not a JSON object", f"it holds {type(data).__name__}",
                          "write the file as a JSON object of ArmConfig fields")
    return data


_ARMING: ArmConfig | None = None


def arming() -> ArmConfig:
    """The process's arming, read from the environment the first time and then kept."""
    global _ARMING
    if _ARMING is None:
        _ARMING = load_config()
    return _ARMING


def reset_arming(config: ArmConfig | None = None) -> None:
    """Forget (or replace) the cached arming; for tests and for embedding engines."""
    global _ARMING
    _ARMING = config
