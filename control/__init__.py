"""Control plane of per-user output pacing: a gRPC API over the engine's limiter."""
