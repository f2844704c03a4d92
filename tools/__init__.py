"""Development and test tools: the demo, the tiny local model, a local vLLM server
launcher, client-side rate measurement, the offline scheduler harness and the fake
clock. Used by tests, benchmarks and scripts; never installed (the wheel holds only
``engine_ext``, ``control`` and ``protos``)."""
