"""Guard options read from the arming config (``options.guard``), and arming by config.

``ArmConfig.options["guard"]`` holds a :class:`GuardOptions`::

    {"mode": "check", "patches": ["my_patches.rmsnorm:install"], "dump_dir": "dumps"}

``install_configured()`` imports and calls each ``patches`` entry, for engines embedded in
the caller's process; it lets an install function's error (a drifted lock, a failed
precondition) propagate. The vLLM plugin calls the same entries in each worker before the
model is built, and there a patch whose install raises is logged and skipped: the refused
patch is simply absent and the stock engine serves.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from enginetap.config import ArmConfig, arming, parse_options
from enginetap.core.patching import Target
from enginetap.errors import ConfigError, PatchError

Mode = Literal["check", "compare", "strict", "off"]

__all__ = ["GuardOptions", "Mode", "guard_options", "install_configured"]


class GuardOptions(BaseModel):
    """The ``guard`` entry of ``ArmConfig.options``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Mode | None = None
    """Mode for every exact patch that does not fix its own (None: ``check``)."""
    patches: list[str] = Field(default_factory=list)
    """Install functions, ``"module:function"``, called with no arguments when armed."""
    dump_dir: Path | None = None
    """Where mismatches are dumped as safetensors (None: ``<out_dir>/guard-dumps`` when
    armed, no dumps otherwise)."""
    max_keys: int | None = Field(default=None, ge=1)
    """Bound on proven keys per patch (None: the patch's own bound)."""
    record: bool = True
    """When armed, append decisions and mismatches to ``<out_dir>/guard-rank<N>.jsonl``."""

    @field_validator("patches")
    @classmethod
    def _validate_patches(cls, value: list[str]) -> list[str]:
        for spec in value:
            try:
                Target.parse(spec)
            except PatchError:
                raise ValueError(f"{spec!r} is not 'package.module:function'") from None
        return value


def guard_options(config: ArmConfig | None = None) -> GuardOptions:
    """The guard options of ``config`` (default: the process's arming).

    Raises:
        ConfigError: ``options.guard`` is not a valid :class:`GuardOptions`.
    """
    config = arming() if config is None else config
    return parse_options(GuardOptions, config.options.get("guard", {}),
                         "invalid options.guard in the arming config",
                         "see docs/guard.md for the guard options")


def install_configured(config: ArmConfig | None = None) -> list[str]:
    """Import and call every ``options.guard.patches`` entry; returns the ones called.

    Does nothing unless ``config`` (default: the process's arming) is enabled with the
    ``guard`` capability.

    Raises:
        ConfigError: the options are invalid or an entry cannot be imported.
        Whatever an install function raises (DriftError, RequirementError, PatchError).
    """
    config = arming() if config is None else config
    if not (config.enabled and "guard" in config.capabilities):
        return []
    called = []
    for spec in guard_options(config).patches:
        load_install_function(spec)()
        called.append(spec)
    return called


def load_install_function(spec: str) -> Any:
    """The function ``"package.module:function"`` names.

    Raises:
        ConfigError: it cannot be imported or is not callable.
    """
    try:
        target = Target.parse(spec)
        found: Any = importlib.import_module(target.module)
        for part in target.qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, PatchError) as exc:
        raise ConfigError(f"cannot load guard patch {spec!r}", str(exc),
                          "name an importable function as 'package.module:function'") from None
    if not callable(found):
        raise ConfigError(f"guard patch {spec!r} is not callable", f"it is {found!r}",
                          "name the patch's install function")
    return found

