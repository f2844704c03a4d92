"""vLLM adapter for per-user output-token pacing: scheduler mixin, hooks, HTTP
guard, metrics transport."""
