"""Generated protocol buffer and gRPC code of the project's APIs."""
