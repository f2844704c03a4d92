"""Debian's nginx as the gateway in front of a vLLM server in end-to-end tests: it
maps each API key (``Authorization: Bearer KEY``) to a user id and a team, sets
the id as a request header and the team as another (removing a client-sent one
for a key without a team). ``gateway_config`` is the recipe
docs/operating/identity.md shows; ``start_gateway`` runs it on loopback inside a
minimal nginx.conf of its own."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Debian's binary, also where ``$PATH`` lacks /usr/sbin.
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
STARTUP_TIMEOUT_S = 30
#: What the generated config quotes verbatim: nothing nginx would read as a
#: variable, an escape or the end of a string.
_PLAIN = re.compile(r"[A-Za-z0-9._~+/=:-]+")

#: The values the docs' recipe (docs/operating/identity.md) is rendered with.
DOCS_EXAMPLE = {
    "listen": "127.0.0.1:8080",
    "upstream": "http://127.0.0.1:8000",
    "keys": {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob"},
    "header": "X-User-Id",
    "teams": {"sk-alice-1": "acme", "sk-alice-2": "acme"},
    "team_header": "X-Team-Id",
}


def gateway_config(
    listen: str,
    upstream: str,
    keys: Mapping[str, str],
    header: str,
    teams: Mapping[str, str],
    team_header: str,
) -> str:
    """The ``map`` and ``server`` blocks (inside nginx's ``http`` block): a
    request with a key in ``keys`` goes to ``upstream`` with ``header`` set to
    its user id and ``team_header`` to its team in ``teams`` (absent for a key
    without one), replacing any the client sent; any other gets 401."""
    values = (listen, upstream, header, team_header, *keys, *keys.values())
    for value in (*values, *teams, *teams.values()):
        if not _PLAIN.fullmatch(value):
            raise ValueError(f"{value!r} needs quoting this helper does not do")
    entries = "\n".join(f'    "Bearer {key}" "{user}";' for key, user in keys.items())
    team_entries = "\n".join(
        f'    "Bearer {key}" "{team}";' for key, team in teams.items()
    )
    return f"""\
# API key -> user id; any other Authorization maps to "".
map $http_authorization $output_rate_user {{
    default "";
{entries}
}}

# API key -> team; a key without one maps to "".
map $http_authorization $output_rate_team {{
    default "";
{team_entries}
}}

server {{
    listen {listen};

    location / {{
        # No known key, no request.
        if ($output_rate_user = "") {{
            return 401;
        }}
        # Replaces every {header} the client sent, in any letter case.
        proxy_set_header {header} $output_rate_user;
        # The same for {team_header}; an empty value is not sent at all, so a
        # client-sent team never reaches vLLM.
        proxy_set_header {team_header} $output_rate_team;
        # vLLM has no use for the key: keep it out of its logs.
        proxy_set_header Authorization "";
        proxy_pass {upstream};
        proxy_http_version 1.1;
        # Tokens reach the client as they are made.
        proxy_buffering off;
        proxy_read_timeout 300s;
    }}
}}
"""


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    base_url: str
    error_log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # nginx's graceful stop
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_gateway(
    workdir: Path,
    port: int,
    upstream: str,
    keys: Mapping[str, str],
    header: str,
    teams: Mapping[str, str],
    team_header: str,
) -> Gateway:
    """Runs nginx in the foreground on 127.0.0.1:``port`` with the recipe of
    ``gateway_config``; its pid file, logs and temporary files stay in
    ``workdir``. Returns once the port accepts connections."""
    listen = f"127.0.0.1:{port}"
    recipe = gateway_config(listen, upstream, keys, header, teams, team_header)
    conf = workdir / "nginx.conf"
    conf.write_text(
        f"""\
daemon off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log info;
events {{
    worker_connections 256;
}}
http {{
    access_log {workdir}/access.log;
    client_body_temp_path {workdir}/client_body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    # Request bodies stay in memory: run as root, nginx's workers switch to
    # nobody, who cannot write under the test's private temporary directory.
    client_body_buffer_size 1m;

{textwrap.indent(recipe, "    ")}}}
"""
    )
    error_log = workdir / "error.log"
    process = subprocess.Popen(
        [NGINX, "-p", str(workdir), "-c", str(conf), "-e", str(error_log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    gateway = Gateway(process, f"http://{listen}", error_log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nginx exited at start-up:\n{_tail(error_log)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return gateway
        except OSError:
            time.sleep(0.1)
    gateway.stop()
    raise RuntimeError(f"nginx not listening in {STARTUP_TIMEOUT_S} s")


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""
