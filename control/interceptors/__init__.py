"""gRPC server interceptors of the control plane, one per file, outermost first:
tracing, error mapping (with RPC counting), bearer-token auth."""
