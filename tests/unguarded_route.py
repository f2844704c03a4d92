"""A route the HTTP guard does not know, added to a real server through vLLM's
own ``vllm.endpoint_plugins`` entry point: it submits a generation request with
whatever ``vllm_xargs`` its client sends, straight to the engine, as a new vLLM
route, a third-party plugin or another front end would. The end-to-end tests
use it to show that such a path can at most reach the anonymous budget (or is
refused when a user is required), never a named user's.

``plugin_env`` installs it for one server: a distribution's metadata in a
directory put on ``PYTHONPATH``, and the plugin named in ``VLLM_PLUGINS``
(endpoint plugins load only when named there) beside every installed plugin.
"""

from __future__ import annotations

import itertools
import os
from argparse import Namespace
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.datastructures import State

from tools.local_server import PLUGIN_GROUPS

NAME = "unguarded_route"
PATH = "/test/unguarded/generate"
_ids = itertools.count()


class UnguardedRoute:
    """``POST PATH`` with ``{"prompt", "max_tokens", "vllm_xargs"}``; answers
    ``{"finish_reason", "tokens"}`` of the finished request."""

    name = NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.add_api_route(PATH, self.generate, methods=["POST"])

    async def init_state(
        self, engine_client: Any, state: State, args: Namespace
    ) -> None:
        state.unguarded_engine = engine_client

    async def generate(self, request: Request) -> dict[str, Any]:
        from vllm import SamplingParams

        body = await request.json()
        params = SamplingParams(
            max_tokens=body["max_tokens"],
            ignore_eos=True,
            extra_args=body["vllm_xargs"],
        )
        final = None
        async for output in request.app.state.unguarded_engine.generate(
            body["prompt"], params, f"unguarded-{next(_ids)}"
        ):
            final = output
        assert final is not None
        completion = final.outputs[0]
        return {
            "finish_reason": completion.finish_reason,
            "tokens": len(completion.token_ids),
        }


def plugin_env(directory: Path) -> dict[str, str]:
    """The environment that loads this route in a server started with it."""
    dist_info = directory / f"{NAME}-0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[vllm.endpoint_plugins]\n{NAME} = {__name__}:UnguardedRoute\n"
    )
    installed = {
        plugin.name for group in PLUGIN_GROUPS for plugin in entry_points(group=group)
    }
    # The repository too, where this module lives.
    repository = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(
        p for p in (str(directory), repository, os.environ.get("PYTHONPATH", "")) if p
    )
    return {"PYTHONPATH": path, "VLLM_PLUGINS": ",".join(sorted(installed | {NAME}))}
