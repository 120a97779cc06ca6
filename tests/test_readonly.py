"""Read-only stores: ``Store(path, readonly=True)``, and stores on a read-only filesystem (opened read-only
without being asked). Everything that reads works; every write raises ReadOnlyStoreError and changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import DCP_LOADS_TOP_LEVEL_VALUES, SMALL_CHUNK, assert_same_state, dir_snapshot

import deltackpt
from deltackpt import ReadOnlyStoreError
from deltackpt.cli import main as cli


def _content(path: Path) -> dict[str, str]:
    """Every file of the store but LMDB's reader table (``index/lock.mdb``), which every reader writes to."""
    return {k: v for k, v in dir_snapshot(path).items() if k != "index/lock.mdb"}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, list[dict]]:
    torch.manual_seed(0)
    states = []
    with deltackpt.Store(tmp_path / "s", chunk_size=SMALL_CHUNK) as s:
        w = torch.randn(5000)
        for step in range(3):
            w = w + 0.01 * torch.randn(5000)
            states.append({"w": w.clone(), "step": step})
            s.save(states[-1], step=step)
    return tmp_path / "s", states


def test_readonly_handle_reads_everything_and_writes_nothing(saved: tuple[Path, list[dict]]) -> None:
    path, states = saved
    before = _content(path)
    with deltackpt.Store(path, readonly=True) as s:
        assert s.readonly
        assert [i.step for i in s.list()] == [0, 1, 2]
        for step, state in enumerate(states):
            assert_same_state(state, s.load(step=step))
        target = {"w": torch.zeros(5000), "step": 0}
        s.load_into(target, step=1)
        assert torch.equal(target["w"], states[1]["w"])
        assert s.verify().ok
        for what, op in [("save", lambda: s.save(states[0], step=9)), ("delete", lambda: s.delete(step=0)),
                         ("gc", s.gc), ("repair", s.repair),
                         ("apply a retention policy", lambda: s.retain(deltackpt.Retention(keep_last=1)))]:
            with pytest.raises(ReadOnlyStoreError, match=f"cannot {what}"):
                op()
    assert _content(path) == before
    with deltackpt.Checkpointer(path, model=torch.nn.Linear(2, 2), handle_signals=False) as ckpt:
        assert not ckpt.store.readonly  # a writable handle on the same store still saves
    assert _content(path) == before


def test_readonly_open_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(deltackpt.DeltackptError, match="no STORE file"):
        deltackpt.Store(tmp_path / "nothing", readonly=True)
    assert not (tmp_path / "nothing").exists()


def test_readonly_open_of_a_store_that_lost_its_index(saved: tuple[Path, list[dict]]) -> None:
    path, _ = saved
    for f in (path / "index").iterdir():
        f.unlink()
    (path / "index").rmdir()
    with pytest.raises(deltackpt.CorruptionError, match="repair"):
        deltackpt.Store(path, readonly=True)
    assert not (path / "index").exists()


def test_read_commands_open_read_only(saved: tuple[Path, list[dict]], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = saved
    before = _content(path)
    for args in (["ls"], ["log"], ["du"], ["verify"], ["show", str(path), "latest"],
                 ["diff", str(path), "0", "latest"], ["get", str(path), "1", "w"], ["resume-info"]):
        argv = args if len(args) > 1 else [*args, str(path)]
        assert cli(argv) == 0, args
    assert _content(path) == before
    capsys.readouterr()


@contextlib.contextmanager
def _mounted_readonly(path: Path, mnt: Path) -> Iterator[Path]:
    """``path`` seen through a read-only bind mount at ``mnt`` (needs root and mount; skips otherwise)."""
    mnt.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root on Linux")
    if subprocess.run(["mount", "--bind", str(path), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("mount --bind is not permitted here")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], capture_output=True).returncode != 0:
            pytest.skip("a read-only remount is not permitted here")
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.fixture
def readonly_mount(saved: tuple[Path, list[dict]], tmp_path: Path) -> Iterator[tuple[Path, list[dict]]]:
    path, states = saved
    with _mounted_readonly(path, tmp_path / "ro") as mnt:
        yield mnt, states


def test_store_on_a_readonly_filesystem(readonly_mount: tuple[Path, list[dict]],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    mnt, states = readonly_mount
    with deltackpt.Store(mnt) as s:  # not asked for: the filesystem decides
        assert s.readonly
        assert_same_state(states[-1], s.load())
        assert s.verify().ok
        with pytest.raises(ReadOnlyStoreError, match="read-only filesystem"):
            s.save(states[0], step=7)
    with pytest.raises(ReadOnlyStoreError, match="readonly=True"):
        deltackpt.Store(mnt, readonly=False)
    # a new store there: it said "not a deltackpt store (no STORE file; a read-only open creates none)", of an open
    # no one had asked to be read-only
    with pytest.raises(ReadOnlyStoreError, match=f"cannot create a store at {mnt / 'new'}: it is on a read-only "
                                                 "filesystem"):
        deltackpt.Store(mnt / "new")
    with pytest.raises(ReadOnlyStoreError, match="cannot create a store at .*: it is on a read-only filesystem"):
        deltackpt.Store(mnt / "new", readonly=False)  # (not "open it with readonly=True", which creates none)
    assert cli(["ls", str(mnt)]) == 0
    assert cli(["diff", str(mnt), "latest", "latest"]) == 0
    assert cli(["gc", str(mnt)]) == 1
    assert "read-only filesystem" in capsys.readouterr().err
    assert cli(["repair", str(mnt)]) == 1  # refused as such, not a raw "[Errno 30] ... gc.lock"
    err = capsys.readouterr().err
    assert "cannot repair" in err and "Errno" not in err
    # an export there: refused before the load, not with torch's "[enforce fail at inline_container.cc:...]"
    assert cli(["export", str(mnt), "latest", str(mnt / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert f"cannot export to {mnt / 'out.pt'}: {mnt} is on a read-only filesystem" in err and "enforce" not in err


def test_a_sharded_checkpoint_on_a_readonly_filesystem(tmp_path: Path) -> None:
    """torch.distributed.checkpoint loads from a read-only root, and its steps can be listed."""
    import torch.distributed.checkpoint as dcp

    from deltackpt.distributed import DeltaStorageReader, DeltaStorageWriter, steps

    state = {"w": torch.randn(300, 40), "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = DeltaStorageWriter(tmp_path / "ckpt", step=3)  # its stores stay open: the mount's share them
        dcp.save(state, storage_writer=writer)
    with _mounted_readonly(tmp_path / "ckpt", tmp_path / "ro") as mnt:
        before = _content(mnt)
        assert steps(mnt) == [3]
        target = {"w": torch.zeros(300, 40), "step": 0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=DeltaStorageReader(mnt))
        # (torch 2.3's dcp.load drops top-level non-tensor values: conftest)
        assert torch.equal(target["w"], state["w"]) and (target["step"] == 3 or not DCP_LOADS_TOP_LEVEL_VALUES)
        assert _content(mnt) == before
    writer.close()


@pytest.fixture
def nobody() -> tuple[list[str], dict[str, str]]:
    """The command prefix that runs a process as user nobody, and its environment (this checkout on
    PYTHONPATH); skips where root, setpriv or a checkout nobody can read are missing."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another user")
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = {**os.environ, "PYTHONPATH": str(Path(deltackpt.__file__).parent.parent)}
    if subprocess.run([*prefix, sys.executable, "-c", "import torch, deltackpt"], capture_output=True,
                      env=env).returncode:
        pytest.skip("the interpreter or the checkout cannot be read by an unprivileged user here")
    return prefix, env


def test_another_users_store_opens_read_only(saved: tuple[Path, list[dict]],
                                             nobody: tuple[list[str], dict[str, str]]) -> None:
    """A store this user may not write (here: root's, opened as nobody) opens read-only by itself: it loads and
    verifies, without LMDB's lock file where that is not writable either, and a save says why it cannot."""
    path, states = saved
    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        shared.chmod(0o755)
        shutil.copytree(path, shared / "s")
        before = _content(shared / "s")
        code = (
            "import sys, deltackpt, torch\n"
            "s = deltackpt.Store(sys.argv[1])\n"
            "assert s.readonly and s.verify().ok\n"
            "assert torch.equal(s.load()['w'], torch.load(sys.argv[2]))\n"
            "try:\n    s.save({'w': torch.ones(2)}, step=9)\n"
            "except deltackpt.ReadOnlyStoreError as e:\n    print(e)\n"
        )
        torch.save(states[-1]["w"], shared / "w.pt")
        (shared / "w.pt").chmod(0o644)
        done = subprocess.run([*nobody[0], sys.executable, "-c", code, str(shared / "s"), str(shared / "w.pt")],
                              capture_output=True, text=True, env=nobody[1])
        assert done.returncode == 0, done.stderr
        assert "not writable by this user" in done.stdout
        assert _content(shared / "s") == before
    finally:
        shutil.rmtree(shared)


def test_verify_reports_a_pack_this_user_cannot_read(saved: tuple[Path, list[dict]],
                                                     nobody: tuple[list[str], dict[str, str]]) -> None:
    """A pack this user may not read (mode 000, opened as nobody): verify reports its chunks, naming why, instead
    of raising a bare PermissionError (verify reports, never raises)."""
    path, _ = saved
    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        shared.chmod(0o755)
        shutil.copytree(path, shared / "s")
        packs = sorted((shared / "s" / "packs").glob("*.pack"))
        packs[0].chmod(0)
        code = (
            "import sys, deltackpt\n"
            "r = deltackpt.Store(sys.argv[1]).verify()\n"
            "print(r.ok, len(r.problems), r.checkpoints, r.problems[0].message if r.problems else '')\n"
        )
        done = subprocess.run([*nobody[0], sys.executable, "-c", code, str(shared / "s")], capture_output=True,
                              text=True, env=nobody[1])
        assert done.returncode == 0, done.stderr
        ok, problems, checkpoints, reason = done.stdout.split(" ", 3)
        assert ok == "False" and int(problems) > 0 and int(checkpoints) > 0
        assert "Permission denied" in reason and packs[0].stem in reason
    finally:
        shutil.rmtree(shared)


def test_an_index_lock_file_this_user_cannot_write_is_no_damage(tmp_path: Path) -> None:
    """LMDB's lock.mdb belongs to another user (a shared store a colleague opened first): a save cannot open the
    index for writing. That is a ReadOnlyStoreError saying so; it was a CorruptIndexError suggesting 'deltackpt
    repair', which moves the intact index aside and rebuilds it."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to give lock.mdb away, then drop the capabilities that bypass permissions)")
    path = tmp_path / "s"
    with deltackpt.Store(path) as s:
        s.save({"w": torch.ones(3)}, step=1)
    os.chown(path / "index" / "lock.mdb", 65534, -1)
    before = _content(path)
    code = ("import sys, deltackpt, torch\n"
            "try:\n    deltackpt.Store(sys.argv[1]).save({'w': torch.zeros(3)}, step=2)\n"
            "except deltackpt.ReadOnlyStoreError as e:\n    print(e)\n")
    done = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-c", code,
                           str(path)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(deltackpt.__file__).parent.parent)})
    assert done.returncode == 0, done.stderr
    assert "not writable by this user" in done.stdout and "repair" not in done.stdout
    assert _content(path) == before
