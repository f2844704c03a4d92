"""The pure pacing core: GCRA limiter, per-user accounting, the one rule for user
ids, the lock-guarded facade the scheduler and the control plane share, the one
settings object, and the registration point through which the control plane
attaches itself.

No vLLM, gRPC, Prometheus or OpenTelemetry here, and no reading of the clock:
time comes in as an argument. The import-linter contracts in ``pyproject.toml``
keep it so.
"""
