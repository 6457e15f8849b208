"""Arming: which capabilities enginetap installs in an engine process, read once.

The same :class:`ArmConfig` arms every engine (the embedded transformers engine and the
vLLM plugin), so capture/tap/guard code never asks which engine it runs in.

Environment (read once per process, the first time :func:`arming` is called):

- ``ENGINETAP`` — ``1``/``true``/``on``/``yes`` arms; ``0``/``false``/``off``/``no`` disarms
  whatever else is set (a config file included); unset defers to ``ENGINETAP_CONFIG``.
- ``ENGINETAP_CONFIG`` — path of a JSON file holding an :class:`ArmConfig`; arms by itself
  unless the file says ``"enabled": false``.
- ``ENGINETAP_CAPABILITIES`` — comma list, e.g. ``step,tap`` (overrides the file).
- ``ENGINETAP_OUT`` — output directory (overrides the file).
- ``ENGINETAP_REQUESTS`` — substring filter on request ids (overrides the file).
- ``ENGINETAP_STRICT`` — ``1``: an invalid arming config raises in the engine process.

One behaviour for every engine: an invalid config read from the environment is logged as
one what/why/fix error and the process runs **disarmed** (a host program must not die of
a bad enginetap config), unless ``ENGINETAP_STRICT=1`` asks for the error to be raised
(:func:`resolve_process_config`). A config object passed explicitly in Python
(``HFEngine(arm=ArmConfig(...))``) is validated when it is built and raises there.

Capability names and options are validated against :data:`enginetap.capabilities.REGISTRY`
when the config is parsed: an unknown capability or option is refused then, not later.
Only the engines' entry points (the vLLM plugin, the built-in engine) resolve the process
config; features receive it in their :class:`~enginetap.core.capability.ArmContext`.

:func:`env_says_armed` looks only at ``os.environ``: callers that must stay free when
disarmed (the vLLM plugin) check it before importing anything else.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from enginetap.errors import ConfigError, describe_validation

logger = logging.getLogger("enginetap.config")

OptionsT = TypeVar("OptionsT", bound=BaseModel)
ARMING_VARS = ("ENGINETAP", "ENGINETAP_CONFIG", "ENGINETAP_CAPABILITIES", "ENGINETAP_OUT",
               "ENGINETAP_REQUESTS", "ENGINETAP_STRICT")
"""The variables that arm (others, such as ``ENGINETAP_CACHE``, only configure)."""
_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}
MAX_CONFIG_BYTES = 1 << 20

__all__ = ["ARMING_VARS", "ArmConfig", "arming", "capability_names", "env_says_armed",
           "load_config", "parse_options", "reset_arming", "resolve_process_config"]


def capability_names() -> list[str]:
    """The capabilities this enginetap can arm, in installation order."""
    from enginetap.capabilities import REGISTRY

    return REGISTRY.names


class ArmConfig(BaseModel):
    """What to arm in an engine process. Saved beside the data it produced."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Whether anything is armed at all."""
    capabilities: list[str] = Field(default_factory=lambda: ["step"])
    """Capabilities to install (``enginetap.capabilities``); ``step`` (the step context) is
    implied by every other one."""
    out_dir: Path = Path("enginetap-out")
    """Directory for per-rank output files."""
    request_filter: str = ""
    """Only requests whose id contains this substring are recorded ("" = all)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Capability-specific options, by capability name."""

    _parsed: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _validate_against_registry(self) -> ArmConfig:
        from enginetap.capabilities import REGISTRY

        try:
            self.capabilities = REGISTRY.order(self.capabilities)
            self._parsed = REGISTRY.validate(self.capabilities, self.options)
        except ConfigError as exc:
            raise ValueError(f"{exc.what}: {exc.why} ({exc.fix})") from None
        return self

    def parsed_options(self) -> dict[str, BaseModel]:
        """Every capability's validated options model (defaults where none were given)."""
        return dict(self._parsed)


def env_says_armed(environ: dict[str, str] | None = None) -> bool:
    """Cheap check: does the environment ask for arming? Imports nothing.

    ``ENGINETAP=0`` (or false/off/no) says no whatever else is set.
    """
    env = os.environ if environ is None else environ
    flag = env.get("ENGINETAP", "").strip().lower()
    if flag in _FALSE:
        return False
    return flag in _TRUE or bool(env.get("ENGINETAP_CONFIG"))


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
    flag = env.get("ENGINETAP", "").strip().lower()
    data["enabled"] = True if flag in _TRUE else data.get("enabled", True)
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
    from enginetap.core.files import NotRegular, read_capped
    from enginetap.core.untrusted_json import BadJson, loads_bounded

    fix = "write the file as a JSON object of ArmConfig fields"
    try:
        raw = read_capped(path, MAX_CONFIG_BYTES)
    except (FileNotFoundError, NotRegular) as exc:
        if isinstance(exc, FileNotFoundError) or str(exc) == "is missing":
            raise ConfigError(f"config file {path} cannot be read", "it does not exist",
                              "point ENGINETAP_CONFIG at an existing JSON file") from None
        raise ConfigError(f"config file {path} is not a regular file", f"it {exc}",
                          "point ENGINETAP_CONFIG at a JSON file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read", exc.strerror or str(exc),
                          fix) from None
    try:
        data = loads_bounded(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text", "it holds binary data",
                          fix) from None
    except BadJson as exc:
        what = "is not valid JSON" if exc.line is not None else "is not a valid arming config"
        raise ConfigError(f"config file {path} {what}", str(exc), fix) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} is not a JSON object", f"it holds {type(data).__name__}",
                          "write the file as a JSON object of ArmConfig fields")
    return data


_ARMING: ArmConfig | None = None


def arming() -> ArmConfig:
    """The process's arming, read from the environment the first time and then kept.

    Raises:
        ConfigError: the environment's config is invalid (see :func:`resolve_process_config`
            for the non-raising form the engines use).
    """
    global _ARMING
    if _ARMING is None:
        _ARMING = load_config()
    return _ARMING


def resolve_process_config(environ: dict[str, str] | None = None) -> ArmConfig:
    """The engines' entry: the process's arming, or disarmed if the config is invalid.

    An invalid config is logged once (what, why, fix) and the process runs disarmed,
    unless ``ENGINETAP_STRICT=1``.

    Raises:
        ConfigError: the config is invalid and ``ENGINETAP_STRICT=1``.
    """
    global _ARMING
    env = os.environ if environ is None else environ
    if _ARMING is not None and environ is None:
        return _ARMING
    try:
        config = load_config(env)
    except ConfigError as exc:
        if env.get("ENGINETAP_STRICT", "").strip().lower() in _TRUE:
            raise
        logger.error("enginetap: %s; running disarmed (ENGINETAP_STRICT=1 makes this fatal)",
                     exc)
        config = ArmConfig()
    if environ is None:
        _ARMING = config
    return config


def reset_arming(config: ArmConfig | None = None) -> None:
    """Forget (or replace) the cached arming; for tests and for embedding engines."""
    global _ARMING
    _ARMING = config
