"""The LMDB index must not live on a network filesystem unless the user forces it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deltackpt
from deltackpt import index


@pytest.mark.parametrize("fstype", ["nfs4", "nfs", "lustre", "cifs", "gpfs", "fuse.sshfs"])
def test_network_filesystem_is_refused_and_nothing_is_created(tmp_path: Path, monkeypatch, fstype: str) -> None:
    monkeypatch.setattr(index, "filesystem_type", lambda p: fstype)
    path = tmp_path / "store"
    with pytest.raises(deltackpt.NetworkFilesystemError, match=fstype):
        deltackpt.Store(path)
    assert not path.exists()


def test_forcing_allows_a_network_filesystem(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(index, "filesystem_type", lambda p: "nfs4")
    with deltackpt.Store(tmp_path / "a", allow_network_fs=True) as s:
        s.save({"x": torch.ones(3)}, step=1)
        assert torch.equal(s.load()["x"], torch.ones(3))
    monkeypatch.setenv("DELTACKPT_ALLOW_NETWORK_FS", "1")
    with deltackpt.Store(tmp_path / "b") as s:
        assert s.list() == []


def test_local_filesystems_pass(tmp_path: Path) -> None:
    assert index.filesystem_type(tmp_path) not in index.NETWORK_FILESYSTEMS
    index.check_local(tmp_path / "not-yet-created")  # raises nothing on the test machine's local disk


def test_filesystem_type_reads_the_mount_table(tmp_path: Path) -> None:
    assert index.filesystem_type(Path("/proc")) == "proc"
    assert index.filesystem_type(tmp_path) != ""


def test_a_dcp_reader_on_a_shared_filesystem(tmp_path: Path, monkeypatch) -> None:
    """Ranks loading on several hosts read the stores from a shared filesystem: refused by default, as every
    store is, and allowed by DeltaStorageReader(allow_network_fs=True)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from deltackpt.distributed import DeltaStorageReader, DeltaStorageWriter

    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.arange(5.0)}, storage_writer=DeltaStorageWriter(root, step=1))
        monkeypatch.setattr(index, "filesystem_type", lambda p: "nfs4")
        target = {"x": torch.zeros(5)}
        with pytest.raises(CheckpointException, match="nfs4"):
            dcp.load(target, storage_reader=DeltaStorageReader(root))
        dcp.load(target, storage_reader=DeltaStorageReader(root, allow_network_fs=True))
    assert torch.equal(target["x"], torch.arange(5.0))
