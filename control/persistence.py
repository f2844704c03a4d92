"""The limits table's config file (``--user-output-rate-config PATH``): loaded at
start, rewritten atomically after every accepted change, watched for edits.

Format: see ``control.table`` (JSON for ``*.json``, YAML for ``*.yaml``/``*.yml``):
the pacing mode, the fair-share switch, the default, tiers, teams, user
limits, memberships (of tiers and of teams), exemptions and fair-share weights.

Rules:

- At start the table is the flags' table overlaid by the file: the file's
  default wins over ``--default-user-output-tokens-per-second``, its mode over
  ``--output-rate-mode``, its ``fair_share`` over ``--output-rate-fair-share``,
  the file's limit wins for a user both name and the file's weight for a user
  or tier both name (``--output-rate-weights``), the file's rate and weight
  for a team both name and its team for a user both place in one
  (``--output-rate-teams``, ``--output-rate-team-members``); tiers, teams,
  memberships and exemptions are added from the file (the flags'
  ``additional_config`` may hold some too). A file that switches fair share
  on where the engine cannot run it stops the start-up as a bad file does. A
  missing file is created from the flags; a file that does not parse or
  validate stops the start-up with an error naming the field (running on the
  flags alone could silently loosen limits).
- Every accepted change (RPC) writes the whole table: a temp file in the same
  directory, fsync, rename over the file, fsync the directory. A reader sees
  the old file or the new one, never a mix; a crash leaves one of them. The
  file keeps its mode, owner and group; a new one is private (``0600``: it
  names every user and tier). If the write fails it is logged and the change
  is not applied.
- The file is where it was at start-up: its directory is opened once (a
  symlinked path resolved then), and every read, temp file, rename and fsync
  works relative to that open directory and never follows a symlink. Swapping
  the directory's path or the file for a symlink afterwards cannot redirect a
  write; a file replaced by a symlink reads as an error (the last good table
  stays) and the next write replaces the link, not its target.
- An edit of the file by anyone else is noticed within one poll interval
  (content hash compared every poll) and applied as ``flags overlaid by file``,
  the mode and the switch included (an edit that removes either brings back
  the flags').
  An edit that does not parse or validate is logged, counted in ``failures``,
  and ignored: the last good table stays in force until a good edit comes.
- Limits survive a restart. TATs do not, on purpose: they are monotonic clock
  readings that mean nothing in another process. So after a restart each user
  starts with a full bucket: at most one extra burst (0.1 s of its limit, plus
  one token) per user.
- A user named in the flags but deleted by RPC comes back at the next restart
  or file edit, as the flags still name it: remove it from the flags, too.
- With a store (``--output-rate-store``) the file is the engine's durable copy
  of the global table (``FileCopy``): every version the engine makes or
  applies is written to it with its ``store_version``, and that version
  decides at start-up whether the file or the store is newer
  (``store.limits_sync``). It is not watched then: an edit on one engine would
  make it differ from the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import stat
import threading
import weakref
from pathlib import Path

from control.errors import ControlError, InvalidArgument
from control.service.operations import LimitsService
from control.table import dumps, format_of, loads
from pacing.global_limits import LimitsVersion
from pacing.periodic import Periodic
from pacing.policy.document import DEFAULT_RATE_KEY, Document
from pacing.policy.model import Policy
from pacing.settings.flags import DEFAULT_RATE_FLAG, POLICY_FLAG

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

DEFAULT_POLL_INTERVAL_S = 1.0
_YAML_HEADER = (
    "# Per-user output-token limits (tokens per second), tiers, teams, exemptions\n"
    "# and the pacing mode. Edits are applied live; the control plane rewrites this\n"
    "# file after every change it accepts.\n"
)


def merge(flags: Policy, file: Document) -> Document:
    """``flags`` overlaid by ``file`` (``Policy.overlaid``): the file's default,
    mode, switch and each attribute and membership it sets win; what it leaves
    unset stays the flags' (the etag dropped, the file's store version kept)."""
    return Document(flags.overlaid(file.policy), None, file.store_version)


class ConfigFile:
    """One config file: reads it, writes it atomically, and tells whether its
    content changed since this object last read or wrote it. Works relative to
    its directory as first opened (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.format = format_of(str(path))
        # Through a symlink, the target's directory and name, fixed now.
        target = self.path.resolve()
        self._directory_path = target.parent
        self._name = target.name
        self._directory_fd: int | None = None
        self._lock = threading.Lock()
        self._seen: bytes | None = None  # hash of the content last read or written

    def load(self) -> Document | None:
        """The file's table, or ``None`` when there is no file; InvalidArgument
        naming the file and field when it does not parse or validate."""
        with self._lock:
            try:
                data = self._read()
            except FileNotFoundError:
                self._seen = None
                return None
            self._seen = _hash(data)
            return self._parse(data)

    def read_if_changed(self) -> Document | None:
        """The file's table if its content differs from what was last seen, else
        ``None``. A bad new content raises InvalidArgument once and is then seen
        (no repeated error until the next edit); a vanished file raises OSError
        once."""
        with self._lock:
            try:
                data = self._read()
            except FileNotFoundError:
                if self._seen is None:
                    return None
                self._seen = None
                raise
            digest = _hash(data)
            if digest == self._seen:
                return None
            self._seen = digest
            return self._parse(data)

    def write(self, policy: Policy, store_version: LimitsVersion | None = None) -> None:
        """Replaces the file with ``policy`` (and the store version it is)
        atomically and durably, keeping an existing file's mode, owner and
        group (a new file gets ``0600``); logs and raises OSError (leaving no
        temp file) when that fails."""
        text = dumps(Document(policy, None, store_version), self.format)
        if self.format == "yaml":
            text = _YAML_HEADER + text
        data = text.encode()
        with self._lock:
            try:
                _replace(self._directory(), self._name, data)
            except OSError as exc:
                logger.error("cannot write the config file %s: %s", self._target(), exc)
                raise
            self._seen = _hash(data)

    def _directory(self) -> int:
        """The directory's descriptor, opened on first use and kept (closed
        with this object). Requires self._lock."""
        if self._directory_fd is None:
            fd = os.open(self._directory_path, os.O_RDONLY | os.O_DIRECTORY)
            self._directory_fd = fd
            weakref.finalize(self, os.close, fd)
        return self._directory_fd

    def _read(self) -> bytes:
        """The file's bytes, never through a symlink (OSError ELOOP then);
        FileNotFoundError also for a directory missing at the first read.
        Requires self._lock."""
        fd = os.open(self._name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self._directory())
        with os.fdopen(fd, "rb") as file:
            return file.read()

    def _target(self) -> Path:
        return self._directory_path / self._name

    def _parse(self, data: bytes) -> Document:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"{self.path}: not UTF-8 ({exc.reason})") from None
        try:
            return loads(text, self.format, source=str(self.path))
        except RecursionError:  # e.g. 100k "[": the parsers recurse per level
            raise InvalidArgument(
                f"{self.path}: not valid {self.format.upper()}: nested too deeply"
            ) from None


def load_at_start(file: ConfigFile, flags: Policy, *, create: bool = True) -> Document:
    """The table to start with: ``flags`` overlaid by the file, or ``flags``
    (written as a new file when ``create``) when there is none. Raises
    InvalidArgument for a bad file or when neither gives a default limit (the
    policy would limit nobody), OSError when the file cannot be read or
    created."""
    found = file.load()
    start = Document(flags) if found is None else merge(flags, found)
    check_default(start.policy.default_rate, str(file.path))
    if found is None and create:
        file.write(flags)
    return start


def check_default(default_rate: int | None, path: str) -> None:
    """Raises InvalidArgument when the start-up table has no default limit."""
    if default_rate is None:
        raise InvalidArgument(
            f"{path}: {DEFAULT_RATE_KEY}: required (the limit of every user the "
            f"policy does not name), unless {DEFAULT_RATE_FLAG} or "
            f"{POLICY_FLAG} gives one"
        )


class FileCopy:
    """``file`` as the durable copy of a store's table
    (``pacing.global_limits.DurableCopy``), starting at ``version``, the store
    version the file was loaded with."""

    def __init__(self, file: ConfigFile, version: LimitsVersion | None) -> None:
        self._file = file
        self._version = version

    def saved_version(self) -> LimitsVersion | None:
        return self._version

    def save(self, policy: Policy, version: LimitsVersion) -> None:
        switch = bool(policy.fair_share)
        self._file.write(dataclasses.replace(policy, fair_share=switch), version)
        self._version = version


class ConfigWatcher:
    """Applies edits of ``file`` to ``service`` (as ``flags`` overlaid by the
    file), checking every ``interval_s`` in a daemon thread."""

    def __init__(
        self,
        file: ConfigFile,
        service: LimitsService,
        flags: Policy,
        *,
        interval_s: float = DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        self._file = file
        self._service = service
        self._flags = flags
        self._periodic = Periodic("output-rate-config-watcher", interval_s, self._tick)
        self._failures = 0
        self._successes = 0
        self.last_error: str | None = None

    @property
    def failures(self) -> int:
        """How many edits of the file were rejected so far."""
        return self._failures

    @property
    def successes(self) -> int:
        """How many edits of the file were applied so far."""
        return self._successes

    def poll(self) -> bool:
        """Checks the file once; returns whether the table changed."""
        return self._service.reload(self._read)

    def start(self) -> None:
        """Starts polling in a daemon thread."""
        self._periodic.start()

    def stop(self) -> None:
        """Stops polling and waits for the thread to end."""
        self._periodic.stop()

    def _tick(self) -> None:
        try:
            if self.poll():
                self._successes += 1
                logger.info("applied an edit of %s", self._file.path)
        except ControlError as exc:  # an edit this engine cannot apply
            self._reject(f"{self._file.path}: {exc}")
            logger.error(
                "ignored an edit of the config file, keeping the last good table: "
                "%s: %s",
                self._file.path,
                exc,
            )
        except Exception:  # keep watching whatever one poll hit
            self._reject("unexpected error")
            logger.exception("checking %s failed", self._file.path)

    def _read(self) -> Policy | None:
        try:
            doc = self._file.read_if_changed()
        except InvalidArgument as exc:
            self._reject(str(exc))
            logger.error(
                "ignored an edit of the config file, keeping the last good table: %s",
                exc,
            )
            return None
        except OSError as exc:
            self._reject(f"{self._file.path}: {exc}")
            logger.error(
                "cannot read the config file, keeping the last good table: %s", exc
            )
            return None
        return None if doc is None else merge(self._flags, doc).policy

    def _reject(self, error: str) -> None:
        self._failures += 1
        self.last_error = error


def _hash(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _replace(directory: int, name: str, data: bytes) -> None:
    """Writes ``data`` to a temp file in ``directory`` (a descriptor), fsyncs it
    and renames it over ``name`` there, then fsyncs the directory; removes the
    temp file on failure. Nothing here follows a symlink: a symlink at ``name``
    is replaced, its target untouched."""
    try:
        existing: os.stat_result | None = os.stat(
            name, dir_fd=directory, follow_symlinks=False
        )
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        existing = None  # a symlink or other thing swapped in: not ours to copy
    # Private from the start; a replaced file's mode and owner are copied once
    # the temp file is ours alone.
    fd, temp = _create_temp(directory, name)
    try:
        with os.fdopen(fd, "wb") as out:
            if existing is not None:
                _keep_metadata(out.fileno(), existing)
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=directory)
        raise
    os.fsync(directory)


def _create_temp(directory: int, name: str) -> tuple[int, str]:
    """A new file ``.{name}.{random}.tmp`` in ``directory``, created exclusively
    with mode ``0600``."""
    temp = f".{name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    return os.open(temp, flags, 0o600, dir_fd=directory), temp


def _keep_metadata(fd: int, existing: os.stat_result) -> None:
    """Gives the open file the owner, group and mode of ``existing``. Owner and
    group only where allowed (root, or a group we belong to), else ours; chown
    first, as it may clear set-id bits."""
    with contextlib.suppress(PermissionError):
        os.fchown(fd, existing.st_uid, existing.st_gid)
    os.fchmod(fd, stat.S_IMODE(existing.st_mode))
