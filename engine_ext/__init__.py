"""vLLM adapter for per-user output-token pacing: limiter, scheduler, hooks."""
