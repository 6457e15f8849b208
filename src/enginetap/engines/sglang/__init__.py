"""SGLang as an enginetap engine (0.5.23): the ``sglang.srt.plugins`` entry point
(:mod:`.plugin`), arming in scheduler processes (:mod:`.worker`), the step context
(:mod:`.runner`), tap points (:mod:`.tap`), capture probes (:mod:`.probes`), runs and
servers (:mod:`.run`, :mod:`.server`, :mod:`.launch`) and the CPU path without SGLang's
kernel package (:mod:`.cpu`). Importing this package imports nothing of SGLang or torch.
See docs/sglang.md."""
