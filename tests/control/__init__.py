"""Tests of the control plane (``control/``): the gRPC service, the limits file
and the ``output-rate-ctl`` CLI."""
