"""``output-rate-ctl``: the operator's client of the control plane.

Exit status: 0 success, 1 the server (or a local check of an import file)
refused the request, the status code name printed to stderr, 2 usage errors.
Every argument is checked before anything is sent (numbers against the range
the proto field holds and the server accepts, user ids by the one rule of
``pacing.identity.validate_user``); each error is reported in one line on
stderr.

The command is split by concern: ``control.cli.args`` (the parser and the
argument checks), ``control.cli.commands`` (one function per command),
``control.cli.render`` (JSON, tables, error lines) and ``control.cli.client``
(the channel, the client, the exit statuses). This module runs one command and
turns how it ended into the exit status.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc

from control.cli.args import build_parser
from control.cli.client import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Client,
    UsageError,
    bearer_token,
    open_channel,
)
from control.cli.commands import Command
from control.cli.render import print_error
from control.errors import ControlError

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main", "run"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        token = bearer_token(args)
        with open_channel(args, token) as channel:
            client = Client(channel, token, args.timeout)
            command: Command = args.run
            return command(client, args, sys.stdout)
    except grpc.RpcError as exc:
        print_error(f"error: {exc.code().name}: {exc.details()}")
        return EXIT_FAILED
    except ControlError as exc:  # a local check, reported as the server would
        print_error(f"error: {exc.code}: {exc}")
        return EXIT_FAILED
    except UsageError as exc:
        print_error(f"{parser.prog}: error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:  # ends a watch
        return EXIT_OK


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
