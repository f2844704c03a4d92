"""The control plane's error classes; each becomes one gRPC status code at the RPC
boundary (``control.interceptors.error_mapping``) and nowhere else."""

from __future__ import annotations


class ControlError(Exception):
    """A request the control plane refuses; the message names the offending field.

    ``code`` is the name of the ``grpc.StatusCode`` it maps to.
    """

    code = "UNKNOWN"


class InvalidArgument(ControlError):
    """A field of the request is malformed or out of range."""

    code = "INVALID_ARGUMENT"


class NotFound(ControlError):
    """The named resource does not exist."""

    code = "NOT_FOUND"


class AlreadyExists(ControlError):
    """The resource to create exists already."""

    code = "ALREADY_EXISTS"


class FailedPrecondition(ControlError):
    """The request is well-formed but the current state refuses it (a tier that
    does not exist, a tier that still has members)."""

    code = "FAILED_PRECONDITION"


class Aborted(ControlError):
    """A concurrent change won: the request's etag is not the current one."""

    code = "ABORTED"


class ResourceExhausted(ControlError):
    """A bound of the server would be exceeded (table size, concurrent watches)."""

    code = "RESOURCE_EXHAUSTED"


class Cancelled(ControlError):
    """The client went away before its request arrived."""

    code = "CANCELLED"


class Unauthenticated(ControlError):
    """The call carries no valid credentials."""

    code = "UNAUTHENTICATED"


class Unavailable(ControlError):
    """The change could not be made durable (the config file could not be
    written); nothing was applied, so the call may be retried."""

    code = "UNAVAILABLE"
