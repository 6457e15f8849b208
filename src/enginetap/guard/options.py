"""Guard options of the arming config (``options.guard``), and arming by config.

``ArmConfig.options["guard"]`` holds a :class:`GuardOptions`::

    {"mode": "check", "patches": ["my_patches.rmsnorm:install"], "dump_dir": "dumps"}

``install_configured(config)`` imports and calls each ``patches`` entry, for engines
embedded in the caller's process; it lets an install function's error (a drifted lock, a
failed precondition) propagate. Armed engines install the same entries through the
``guard`` capability (:mod:`enginetap.guard.arming`), where a patch whose install raises is
logged and skipped: the refused patch is simply absent and the stock engine serves.

Nothing here reads the environment: :func:`active_guard_options` asks the process's
installed arming (:func:`~enginetap.core.capability.current_arming`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from enginetap.core.capability import ArmSpec, current_arming
from enginetap.core.patching import Target, resolve
from enginetap.errors import ConfigError, PatchError

Mode = Literal["check", "compare", "strict", "off"]

__all__ = ["GuardOptions", "Mode", "active_guard_options", "guard_options",
           "install_configured", "load_install_function"]


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


def guard_options(config: ArmSpec) -> GuardOptions:
    """The guard options of ``config`` (an :class:`~enginetap.config.ArmConfig`).

    Raises:
        ConfigError: ``options.guard`` is not a valid :class:`GuardOptions`.
    """
    parsed = getattr(config, "parsed_options", None)
    options = parsed().get("guard") if callable(parsed) else None
    if isinstance(options, GuardOptions):
        return options
    from enginetap.errors import describe_validation
    from pydantic import ValidationError

    try:
        return GuardOptions.model_validate(config.options.get("guard", {}))
    except ValidationError as exc:
        raise ConfigError("invalid options.guard in the arming config",
                          describe_validation(exc), "see docs/guard.md for the guard options"
                          ) from None


def active_guard_options() -> tuple[GuardOptions, ArmSpec | None]:
    """The installed arming's guard options and config, or defaults and None if disarmed."""
    context = current_arming()
    if context is None or "guard" not in context.capabilities:
        return GuardOptions(), None if context is None else context.config
    options = context.options_of("guard")
    assert isinstance(options, GuardOptions)
    return options, context.config


def install_configured(config: ArmSpec) -> list[str]:
    """Import and call every ``options.guard.patches`` entry; returns the ones called.

    Does nothing unless ``config`` is enabled with the ``guard`` capability.

    Raises:
        ConfigError: the options are invalid or an entry cannot be imported.
        Whatever an install function raises (DriftError, RequirementError, PatchError).
    """
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
        found = resolve(spec)
    except PatchError as exc:
        raise ConfigError(f"cannot load guard patch {spec!r}", exc.why,
                          "name an importable function as 'package.module:function'") from None
    if not callable(found):
        raise ConfigError(f"guard patch {spec!r} is not callable", f"it is {found!r}",
                          "name the patch's install function")
    return found
