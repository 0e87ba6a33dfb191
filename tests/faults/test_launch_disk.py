"""mpicoll.elastic.disk: the relaunching supervisor's commit on disk (serial)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mpicoll.elastic import disk


@pytest.fixture()
def commit_env(tmp_path, monkeypatch):
    directory = tmp_path / "commits"
    monkeypatch.setenv(disk.ENV_DIR, str(directory))
    monkeypatch.delenv(disk.ENV_RESTART, raising=False)
    return directory


def test_inactive_without_directory(monkeypatch):
    monkeypatch.delenv(disk.ENV_DIR, raising=False)
    assert not disk.active()
    assert disk.load() is None
    with pytest.raises(disk.CommitError, match=disk.ENV_DIR):
        disk.save(b"x")
    monkeypatch.setenv(disk.ENV_DIR, "")
    assert not disk.active()


def test_save_load_keeps_previous(commit_env):
    assert disk.active()
    assert disk.load() is None                  # no commit yet (directory absent)
    disk.save(b"first")
    assert disk.load() == b"first"
    assert not (commit_env / disk.PREVIOUS_NAME).exists()
    disk.save(bytearray(b"second"))
    assert disk.load() == b"second"
    disk.save(memoryview(b"\x00" * 3 + b"third"))
    assert disk.load() == b"\x00\x00\x00third"
    assert disk._read(commit_env / disk.PREVIOUS_NAME) == b"second"
    assert sorted(p.name for p in commit_env.iterdir()) == [disk.COMMIT_NAME,
                                                            disk.PREVIOUS_NAME]
    disk.save(b"")                              # an empty payload is a commit too
    assert disk.load() == b""


def test_damaged_last_commit_falls_back(commit_env):
    disk.save(b"older commit")
    disk.save(b"newer commit")
    last = commit_env / disk.COMMIT_NAME
    blob = bytearray(last.read_bytes())
    blob[-1] ^= 0xFF                            # corrupt one payload byte
    last.write_bytes(bytes(blob))
    assert disk.load() == b"older commit"
    last.write_bytes(bytes(blob[:5]))           # truncated inside the header
    assert disk.load() == b"older commit"
    last.write_bytes(b"not a commit at all, long enough for a header")
    assert disk.load() == b"older commit"
    (commit_env / disk.PREVIOUS_NAME).unlink()
    assert disk.load() is None


def test_bad_payload_and_directory(commit_env, tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="bytes-like"):
        disk.save("text")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(disk.ENV_DIR, str(blocker / "sub"))
    with pytest.raises(disk.CommitError, match="cannot create"):
        disk.save(b"x")


def test_restart_count(monkeypatch):
    monkeypatch.delenv(disk.ENV_RESTART, raising=False)
    assert disk.restart_count() == 0
    monkeypatch.setenv(disk.ENV_RESTART, "3")
    assert disk.restart_count() == 3
    for bad in ("-1", "two"):
        monkeypatch.setenv(disk.ENV_RESTART, bad)
        with pytest.raises(ValueError, match=disk.ENV_RESTART):
            disk.restart_count()


def test_light_import():
    """The supervisor and every rank import it cheaply: the standard library only."""
    import ast  # noqa: PLC0415

    tree = ast.parse(Path(disk.__file__).read_text())
    modules = {alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert modules <= set(sys.stdlib_module_names), modules


def test_a_commit_that_cannot_be_written_leaves_nothing_behind(commit_env):
    """The last commit's place is taken by a directory: no previous copy can be linked,
    the new commit cannot replace it: CommitError, and no temporary file is left."""
    (commit_env / disk.COMMIT_NAME).mkdir(parents=True)
    with pytest.raises(disk.CommitError, match="cannot write the commit"):
        disk.save(b"state")
    assert sorted(p.name for p in commit_env.iterdir()) == [disk.COMMIT_NAME]


def test_a_first_launch_under_the_supervisor_starts_from_the_state_given(commit_env):
    """Under the supervisor with no commit on disk yet, ``load_from_disk`` leaves the state
    alone; after a commit it loads that commit."""
    from mpicoll import elastic
    from mpicoll.elastic.state import load_from_disk

    state = elastic.ObjectState(step=5)
    assert not load_from_disk(state) and state.step == 5
    state.commit()                                # rank 0 writes it to disk
    fresh = elastic.ObjectState(step=0)
    assert load_from_disk(fresh) and fresh.step == 5


def test_a_commit_rank_0_cannot_write_raises_on_every_rank(commit_env):
    """Only rank 0 writes the commit: its CommitError alone made it a lost rank under ULFM,
    then each next rank 0 in turn, until none was left. Now every rank raises
    CollectiveError together (rank 0 tells them, a byte's broadcast)."""
    from mpicoll import CollectiveError, elastic

    (commit_env / disk.COMMIT_NAME).mkdir(parents=True)  # the commit cannot replace it
    state = elastic.ObjectState(step=5)
    with pytest.raises(CollectiveError, match="the commit to disk failed on rank 0: "
                                               "cannot write the commit"):
        state.commit()


def test_a_commit_of_an_older_script_keeps_the_new_attributes(commit_env):
    """Resuming with a script that added an attribute: the commit from disk has no value
    for it, so it keeps the one given, and is committed from then on (it was dropped from
    every later commit and sync)."""
    from mpicoll import elastic
    from mpicoll.elastic.state import load_from_disk

    elastic.ObjectState(step=4).commit()
    newer = elastic.ObjectState(step=0, seen=0)
    assert load_from_disk(newer) and (newer.step, newer.seen) == (4, 0)
    newer.seen = 2
    newer.commit()
    again = elastic.ObjectState(step=0, seen=0)
    assert load_from_disk(again) and (again.step, again.seen) == (4, 2)
