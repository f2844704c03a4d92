"""The concerns of the pacing scheduler, one module each.

``engine_ext.scheduler`` (the thin class over vLLM's ``Scheduler``) delegates
here; ``upstream`` is the one module that names vLLM's scheduler internals.
"""
