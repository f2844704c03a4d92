"""How much of a server's time is spent in our code, sampled with ``py-spy``.

Row 2 of ``compare_stock`` compares wall-clock throughput, which on a small shared
machine varies by 10-15 % from one run to the next on the same server: a cost of
1-2 % cannot be read from it. Sampling the paced server's processes under the same
load reads that cost directly. A sample counts as ours when, walking from the
innermost frame outwards, a frame of our packages comes before any frame of vLLM:
our code calling the standard library or ``prometheus_client`` is ours; our hook
calling vLLM's own step loop (``super().schedule()``) is vLLM's; a thread of ours
blocked in a wait is nobody's. An upper bound: the HTTP guard passing a request on
to the app counts Starlette's own work below it as ours, up to vLLM's handler.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

#: Top-level packages of ours that run inside a server (tools/ and tests/ do not).
OUR_PACKAGES = ("engine_ext", "pacing", "store", "control", "protos")
_OURS = re.compile(r"\((?:" + "|".join(OUR_PACKAGES) + r")/")
_VLLM = re.compile(r"\(vllm/")
#: A stack whose innermost frame is in these standard-library modules is a thread
#: blocked in a wait (an ``Event.wait``, ``queue.get``, ``select``): py-spy, not
#: pausing the server, cannot always tell such a thread idle, and our waiting
#: threads (the idle heartbeat, the engine's idle wait) would count as our work.
_BLOCKED = re.compile(r"\((?:threading|queue|selectors)\.py:\d+\)$")
#: py-spy's frame for a process: ``process PID:"command line"``.
_PROCESS = "process "

#: vLLM names its processes; anything else under the server is the API server.
ROLES = (("EngineCore", "engine core"), ("Worker", "worker"))
API_SERVER = "API server"


class ProfilerUnavailable(RuntimeError):
    """py-spy is missing or may not attach (no ptrace permission)."""


@dataclass
class Share:
    """Samples of one server process: all of them, and those in our code."""

    samples: int = 0
    ours: int = 0
    #: Our innermost frames and their sample counts, for a closer look.
    frames: dict[str, int] = field(default_factory=dict)


def role_of(frames: list[str]) -> str:
    """The server process a raw stack was sampled in, from its process frames
    (the server's root process first, then the subprocess, if any)."""
    processes = [frame for frame in frames if frame.startswith(_PROCESS)]
    if len(processes) <= 1:
        return API_SERVER
    for marker, role in ROLES:
        if marker in processes[-1]:
            return role
    return "other"


def our_frame(frames: list[str]) -> str | None:
    """The innermost frame of ours, if it comes before any of vLLM's and the
    stack is not blocked in a wait."""
    if _BLOCKED.search(frames[-1]):
        return None
    for frame in reversed(frames):
        if _OURS.search(frame):
            return frame
        if _VLLM.search(frame):
            return None
    return None


def shares(raw_lines: Iterable[str]) -> dict[str, Share]:
    """Per server process, from py-spy's ``--format raw`` output (one line per
    distinct stack: frames joined by ``;``, a space, the sample count)."""
    found: dict[str, Share] = {}
    for line in raw_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        share = found.setdefault(role_of(frames), Share())
        samples = int(count)
        share.samples += samples
        frame = our_frame(frames)
        if frame is not None:
            share.ours += samples
            share.frames[frame] = share.frames.get(frame, 0) + samples
    return found


def py_spy() -> str:
    """The py-spy executable beside this Python's, else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise ProfilerUnavailable("py-spy is not installed (pip install py-spy)")
    return found


@dataclass(frozen=True)
class Profile:
    """Samples per server process over ``seconds`` of wall time at ``rate``."""

    shares: dict[str, Share]
    seconds: float
    rate: int

    def wall_share(self, role: str | None = None) -> float:
        """Our samples over the samples a thread busy throughout would give:
        the share of wall time our code ran (or waited for a CPU) in ``role``'s
        process, or in all of them together. Several processes on one CPU
        each count as busy while waiting for it, so busy samples overstate
        the time a process held the CPU; wall time does not."""
        ours = sum(
            share.ours
            for name, share in self.shares.items()
            if role is None or name == role
        )
        return ours / (self.seconds * self.rate)


def profile(
    pid: int, load: Callable[[], object], seconds: float, rate: int = 100
) -> Profile:
    """Samples process ``pid`` and its subprocesses for ``seconds`` while
    ``load()`` runs over and over; the load in flight when sampling stops
    finishes unsampled."""
    with tempfile.TemporaryDirectory(prefix="output-rate-profile-") as workdir:
        out = Path(workdir) / "raw.txt"
        command = [
            py_spy(),
            "record",
            "--pid",
            str(pid),
            "--subprocesses",
            "--nonblocking",  # never pauses the server
            "--format",
            "raw",
            "--rate",
            str(rate),
            "--duration",
            str(round(seconds)),
            "--output",
            str(out),
        ]
        spy = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        started = time.monotonic()
        while spy.poll() is None:
            load()
        elapsed = time.monotonic() - started
        log = spy.stdout.read() if spy.stdout else ""
        if spy.returncode != 0 or not out.exists():
            raise ProfilerUnavailable(f"py-spy failed ({spy.returncode}): {log[-500:]}")
        found = shares(out.read_text().splitlines())
    # py-spy's own start-up is in ``elapsed``; its duration is what it sampled.
    return Profile(found, min(elapsed, round(seconds)), rate)
