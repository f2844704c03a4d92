"""Tests of the vLLM adapter (``engine_ext/``): the scheduler, the engine loop,
the metrics payload, the HTTP guard and the start-up through vLLM's parser."""
