"""A real Prometheus server for end-to-end tests (Debian's ``prometheus`` binary).

``PrometheusServer(target)`` binds 127.0.0.1 on a free port, scrapes ``target``
(``host:port``) every second, evaluates the output-rate recording rules every
second, keeps its storage in a temporary directory, and answers instant queries
through its HTTP API. Every wait is bounded; ``stop()`` (or leaving the ``with``
block) terminates the server and removes the directory.

    with PrometheusServer("127.0.0.1:8000") as prometheus:
        prometheus.wait_for('up{job="target"} == 1')
        prometheus.query("model_name_user:vllm_output_rate_throttle_ratio:rate5m")
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
RECORDING_RULES = DASHBOARDS / "output_rate_recording_rules.yml"
#: The scrape job's name, for ``up{job="target"}``.
JOB = "target"

#: Restores vLLM's "vllm:" metric names. prometheus_client (>= 0.22) escapes ":"
#: in sample names to "_" when a scraper negotiates OpenMetrics without
#: ``escaping=allow-utf-8``, as Prometheus 2.x does (prometheus/client_python#1177);
#: the rewrite is a no-op where names arrive intact.
VLLM_NAME_RELABEL = {
    "source_labels": ["__name__"],
    "regex": "vllm_(.+)",
    "target_label": "__name__",
    "replacement": "vllm:$1",
}
_START_ATTEMPTS = 3  # a free port can be taken between choosing and binding it


class PrometheusError(RuntimeError):
    """Prometheus did not start, or answered a query with an error."""


class PrometheusServer:
    """One Prometheus process scraping one target; see the module docstring."""

    def __init__(
        self,
        target: str,
        *,
        metrics_path: str = "/metrics",
        rule_files: Sequence[str | Path] = (RECORDING_RULES,),
        binary: str = "prometheus",
        start_timeout_s: float = 60.0,
    ) -> None:
        self.target = target
        self.metrics_path = metrics_path
        self.rule_files = [Path(path).resolve() for path in rule_files]
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> PrometheusServer:
        """Starts the server and returns once ``/-/ready`` answers 200; raises
        ``PrometheusError`` with the server's log if it does not."""
        executable = shutil.which(self.binary)
        if executable is None:
            raise PrometheusError(
                f"{self.binary!r} not found: install Debian's prometheus package"
            )
        self._dir = Path(tempfile.mkdtemp(prefix="e2e-prometheus-"))
        config = self._dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self._config()))
        try:
            for attempt in range(_START_ATTEMPTS):
                port = _free_port()
                self.url = f"http://127.0.0.1:{port}"
                log = self._dir / f"prometheus-{attempt}.log"
                with log.open("wb") as out:
                    self._process = subprocess.Popen(
                        [
                            executable,
                            f"--config.file={config}",
                            f"--storage.tsdb.path={self._dir / 'data'}",
                            f"--web.listen-address=127.0.0.1:{port}",
                            "--log.level=warn",
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                if self._wait_ready():
                    return self
                text = log.read_text(errors="replace")
                self._terminate()
                if "address already in use" not in text:
                    raise PrometheusError(f"Prometheus did not start:\n{text[-4000:]}")
            raise PrometheusError(f"no free port after {_START_ATTEMPTS} attempts")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminates the server (killing it after 10 s) and deletes its storage."""
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The result vector of instant query ``expr`` evaluated now."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise PrometheusError(f"query {expr!r} failed: {body.get('error')}")
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Polls ``expr`` until its result is non-empty and returns it; raises
        ``PrometheusError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() >= deadline:
                raise PrometheusError(f"{expr!r} still empty after {timeout_s} s")
            time.sleep(0.5)

    def _config(self) -> dict[str, Any]:
        return {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [
                {
                    "job_name": JOB,
                    "metrics_path": self.metrics_path,
                    "static_configs": [{"targets": [self.target]}],
                    "metric_relabel_configs": [VLLM_NAME_RELABEL],
                }
            ],
        }

    def _wait_ready(self) -> bool:
        """Whether ``/-/ready`` answered 200 before the process exited or the
        start-up timeout passed."""
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        return False

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
