"""vLLM integration: the plugin that arms workers, the V1 runner's step context,
tensor-parallel ranks and a server helper.

Importing this package imports neither torch nor vLLM (vLLM imports it in every process
through the ``vllm.general_plugins`` entry point :func:`enginetap.engines.vllm.plugin.register`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from enginetap.engines.vllm.server import VLLMServer

__all__ = ["VLLMServer"]


def __getattr__(name: str) -> Any:
    if name == "VLLMServer":
        from enginetap.engines.vllm.server import VLLMServer

        return VLLMServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
