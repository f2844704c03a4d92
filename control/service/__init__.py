"""The control plane's operations on the limits table, free of gRPC."""
