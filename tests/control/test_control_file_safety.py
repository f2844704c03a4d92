"""The limits file is private and written where it was opened: a new file is
0600, and a symlink swapped in after start-up (for the directory's path or
for the file) never redirects a write (issue 29, item 12)."""

from __future__ import annotations

import os
import stat

import pytest

from control.persistence import ConfigFile, load_at_start
from tests.control_harness import table

FLAGS = table(default_rate=10, user_rates={"alice": 1})
CHANGED = table(default_rate=5, user_rates={"bob": 2})


@pytest.fixture
def umask():
    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


def mode_of(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_limits_file_is_private_whatever_the_umask(tmp_path, umask):
    path = tmp_path / "limits.json"
    load_at_start(ConfigFile(path), FLAGS)  # created from the flags
    assert mode_of(path) == 0o600


def test_a_write_lands_in_the_directory_opened_at_start_not_a_symlink_swapped_in(
    tmp_path,
):
    original = tmp_path / "etc"
    original.mkdir()
    path = original / "limits.json"
    file = ConfigFile(path)
    load_at_start(file, FLAGS)  # start-up: the directory is opened here
    # An attacker moves the directory away and puts a symlink at its path.
    moved = tmp_path / "etc-moved"
    original.rename(moved)
    attacker = tmp_path / "attacker"
    attacker.mkdir()
    original.symlink_to(attacker)

    file.write(CHANGED)

    assert os.listdir(attacker) == []
    assert ConfigFile(moved / "limits.json").load().policy == CHANGED


def test_a_write_replaces_a_symlink_swapped_in_for_the_file_not_its_target(
    tmp_path,
):
    path = tmp_path / "limits.json"
    file = ConfigFile(path)
    load_at_start(file, FLAGS)
    victim = tmp_path / "victim"
    victim.write_text("not yours\n")
    path.unlink()
    path.symlink_to(victim)

    file.write(CHANGED)

    assert victim.read_text() == "not yours\n"
    assert not path.is_symlink()
    assert mode_of(path) == 0o600
    assert ConfigFile(path).load().policy == CHANGED


def test_a_file_swapped_for_a_symlink_is_not_read_through_it(tmp_path):
    path = tmp_path / "limits.json"
    file = ConfigFile(path)
    load_at_start(file, FLAGS)
    elsewhere = tmp_path / "elsewhere.json"
    ConfigFile(elsewhere).write(CHANGED)
    path.unlink()
    path.symlink_to(elsewhere)

    with pytest.raises(OSError):
        file.read_if_changed()
