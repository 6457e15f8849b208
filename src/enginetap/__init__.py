"""enginetap: see, capture and verify what really runs inside LLM inference engines.

Importing this package is cheap on purpose: it imports neither torch nor any engine, so
an engine that loads enginetap through a plugin pays nothing while enginetap is disarmed.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
