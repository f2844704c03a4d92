"""The pure pacing core: GCRA limiter, per-user accounting, the one rule for user
ids, and the lock-guarded facade the scheduler and the control plane share.

No vLLM, gRPC, Prometheus or OpenTelemetry here, and no reading of the clock:
time comes in as an argument.
"""
