"""What a power loss needs: the order of writes, fsyncs and directory fsyncs, traced from the real system calls.

A SIGKILL cannot show a missing fsync (the page cache survives the process), so these tests record the
calls the store makes through ``os`` (the calls themselves run as usual) and check the rules of
docs/format.md section 7: every byte a commit references is fsynced in its file, and every file or directory
created has its entry made durable by an fsync of the directory that holds it, before anything relies on it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltackpt import Store, cli, packs
from deltackpt.maintenance import open_for_repair
from deltackpt.packs import PackWriter

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc")


class Trace:
    """The calls made through ``os`` while active: (what, path[, second path]), in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def index(self, *event: str) -> int:
        """Where ``event`` last happened (ValueError if never)."""
        for i in range(len(self.events) - 1, -1, -1):
            if self.events[i] == event:
                return i
        raise ValueError(f"{event} never happened in {self.events}")

    def fsynced_after(self, path: Path | str, i: int) -> bool:
        return ("fsync", str(path)) in self.events[i + 1:]


@pytest.fixture
def trace(monkeypatch: pytest.MonkeyPatch) -> Iterator[Trace]:
    t = Trace()
    real = {name: getattr(os, name) for name in ("write", "pwrite", "fsync", "mkdir", "rename", "replace", "link")}

    def name(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def write(fd: int, data: bytes | memoryview) -> int:
        t.events.append(("write", name(fd)))
        return real["write"](fd, data)

    def pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:  # (packs are written at their offsets)
        t.events.append(("write", name(fd)))
        return real["pwrite"](fd, data, offset)

    def fsync(fd: int) -> None:
        real["fsync"](fd)
        t.events.append(("fsync", name(fd)))

    def mkdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        real["mkdir"](path, *args, **kwargs)
        t.events.append(("mkdir", os.path.realpath(path)))

    def two(what: str) -> object:
        def call(src: str | os.PathLike[str], dst: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
            real[what](src, dst, *args, **kwargs)
            t.events.append((what, os.path.realpath(src) if what == "link" else str(src), os.path.realpath(dst)))
        return call

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "mkdir", mkdir)
    for what in ("rename", "replace", "link"):
        monkeypatch.setattr(os, what, two(what))
    yield t


def _made_dirs_durable(trace: Trace) -> None:
    for i, event in enumerate(trace.events):
        if event[0] == "mkdir":
            parent = os.path.dirname(event[1])
            assert trace.fsynced_after(parent, i), f"{parent} was not fsynced after {event[1]} was created in it"


@pytest.mark.parametrize("buffer", [1, 1 << 20])
def test_sync_makes_every_pack_written_since_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trace: Trace, buffer: int
) -> None:
    """After sync() every byte appended since the last sync is fsynced, in whichever pack it went: a save whose
    frames roll over into new packs commits them all (the full packs it left were once only closed)."""
    monkeypatch.setattr(packs, "WRITE_BUFFER", buffer)
    w = PackWriter(tmp_path, max_size=200)
    for i in range(20):  # about eight packs
        w.append(bytes([i]) * 70)
    w.sync()
    w.close()
    written = {e[1] for e in trace.events if e[0] == "write" and e[1].endswith(".pack")}
    assert len(written) >= 5
    for f in written:
        assert trace.fsynced_after(f, trace.index("write", f)), f"{f} was never fsynced after its last write"


def test_a_new_store_is_durable_before_its_first_checkpoint(tmp_path: Path, trace: Trace) -> None:
    """Creating a store in directories that do not exist yet: each directory created has its entry fsynced in
    its parent, and the index directory (whose data.mdb LMDB creates) is fsynced before STORE is linked, so a
    power loss leaves either no store or one whose index holds its format record."""
    root = tmp_path / "runs" / "a" / "store"
    with Store(root) as st:
        st.save({"w": torch.ones(1000)}, step=1)
    made = [e[1] for e in trace.events if e[0] == "mkdir"]
    for d in (root.parent.parent, root.parent, root, root / "index", root / "packs", root / "manifests"):
        assert str(d) in made
    _made_dirs_durable(trace)
    link = next(i for i, e in enumerate(trace.events) if e[0] == "link" and e[2] == str(root / "STORE"))
    assert ("fsync", str(root / "index")) in trace.events[:link], "index/ not fsynced before STORE was linked"
    assert trace.fsynced_after(root, link)


def test_reopening_a_store_that_lost_its_empty_directories_makes_them_durable(tmp_path: Path, trace: Trace) -> None:
    """A store copied without its empty directories (git keeps none): the ones created again on open hold the
    next checkpoint's pack and manifest, so their entries in the store directory are fsynced too."""
    root = tmp_path / "store"
    Store(root).close()
    for sub in ("packs", "manifests", "tmp"):
        (root / sub).rmdir()
    trace.events.clear()
    with Store(root) as st:
        st.save({"w": torch.ones(1000)}, step=1)
    assert len([e for e in trace.events if e[0] == "mkdir"]) == 3
    _made_dirs_durable(trace)


def test_repair_of_a_damaged_index_makes_the_new_index_durable(tmp_path: Path, trace: Trace) -> None:
    """A repair moves a damaged index aside and builds a new one: the move, the new directory and the new
    data.mdb are fsynced in their directories, so the rebuilt index survives a power loss after the repair."""
    root = tmp_path / "store"
    with Store(root) as st:
        st.save({"w": torch.ones(1000)}, step=1)
    (root / "index" / "data.mdb").write_bytes(b"\0" * 8192)  # garbled: LMDB refuses it
    trace.events.clear()
    st = open_for_repair(root)
    try:
        assert st.repair().checkpoints == 1
    finally:
        st.close()
    moved = next(i for i, e in enumerate(trace.events) if e[0] == "rename" and e[1] == str(root / "index"))
    assert trace.fsynced_after(root, moved)
    _made_dirs_durable(trace)
    assert ("fsync", str(root / "index")) in trace.events
    with Store(root) as st:
        assert torch.equal(st.load(step=1)["w"], torch.ones(1000))


def test_repair_makes_what_it_indexes_durable_first(tmp_path: Path, trace: Trace,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A save killed before its fsync leaves frames (and a manifest) in the page cache only. A repair indexes
    them, and a later save deduplicating onto such a frame writes nothing of its own to sync: so the repair
    fsyncs every pack and manifest it indexes (and their directories) before the rebuilt index commits."""
    from deltackpt.index import Index

    root = tmp_path / "store"
    with Store(root, chunk_size=4096) as st:
        st.save({"w": torch.ones(1000)}, step=1)
        st.save({"v": torch.arange(1000.0)}, step=2)
    rebuild = Index.rebuild

    def traced(self: Index, *args: object) -> None:
        trace.events.append(("rebuild",))  # (LMDB's own fsync of the commit is not made through os)
        rebuild(self, *args)

    monkeypatch.setattr(Index, "rebuild", traced)
    trace.events.clear()
    st = open_for_repair(root)
    try:
        assert st.repair().checkpoints == 2
    finally:
        st.close()
    commit = trace.index("rebuild")
    synced = {e[1] for e in trace.events[:commit] if e[0] == "fsync"}
    files = [*(root / "packs").rglob("*.pack"), *(root / "manifests").glob("*.manifest")]
    assert len(files) >= 3 and {str(f) for f in files} <= synced, sorted({str(f) for f in files} - synced)
    assert {str(root / "packs"), str(root / "manifests")} <= synced


def test_export_is_durable_before_it_replaces_an_earlier_one(tmp_path: Path, trace: Trace) -> None:
    """``deltackpt export`` writes a temp file and renames it over the destination: the temp file is fsynced
    before the rename (else a power loss could leave an empty file where a good export was) and the directory
    after it."""
    root = tmp_path / "store"
    with Store(root) as st:
        st.save({"w": torch.ones(1000)}, step=1)
    dest = tmp_path / "out.pt"
    dest.write_bytes(b"an earlier export")
    trace.events.clear()
    assert cli.main(["export", str(root), "1", str(dest)]) == 0
    i = next(i for i, e in enumerate(trace.events) if e[0] == "replace" and e[2] == str(dest))
    tmp = trace.events[i][1]
    assert ("fsync", tmp) in trace.events[:i], "the export was not fsynced before it replaced the earlier one"
    assert trace.fsynced_after(tmp_path, i)


def test_pack_is_fsynced_before_the_manifest_is_renamed_into_place(tmp_path: Path, trace: Trace) -> None:
    """A save's order (format.md §7): frames appended to a pack, the pack fsynced, the manifest renamed into
    ``manifests/``, the LMDB commit. The pack is durable before the manifest naming its frames is in place: a
    repair after a power loss restores the manifests it finds."""
    root = tmp_path / "store"
    with Store(root, chunk_size=4096) as st:
        st.save({"w": torch.arange(5000, dtype=torch.float32)}, step=1)
        trace.events.clear()
        st.save({"w": torch.arange(5000, dtype=torch.float32) + 1}, step=2)
    renames = [i for i, e in enumerate(trace.events)
               if e[0] in ("rename", "replace", "link") and e[-1].startswith(str(root / "manifests"))]
    assert renames, trace.events
    packs_written = {e[1] for e in trace.events if e[0] == "write" and e[1].endswith(".pack")}
    assert packs_written, trace.events
    for p in packs_written:
        last_write = trace.index("write", p)
        fsyncs = [i for i, e in enumerate(trace.events) if e == ("fsync", p) and i > last_write]
        assert fsyncs and fsyncs[0] < renames[0], (
            f"pack {p} made durable only after the manifest was renamed into manifests/: {trace.events}")


def test_a_new_packs_directory_entry_is_durable_before_the_manifest_naming_it(tmp_path: Path, trace: Trace) -> None:
    """fsync of a new pack makes its bytes durable, not its name in ``packs/`` (format.md §7): the directory is
    fsynced too, before the manifest that references the pack's frames is renamed into place. Without it a power
    loss can leave a committed checkpoint whose pack file is gone."""
    root = tmp_path / "store"
    with Store(root, chunk_size=4096) as st:
        trace.events.clear()
        st.save({"w": torch.arange(5000, dtype=torch.float32)}, step=1)  # the handle's first pack
    renames = [i for i, e in enumerate(trace.events)
               if e[0] in ("rename", "replace", "link") and e[-1].startswith(str(root / "manifests"))]
    assert renames, trace.events
    assert ("fsync", str(root / "packs")) in trace.events[: renames[0]], (
        f"packs/ was not fsynced before the manifest was renamed into place: {trace.events}")


def test_a_manifest_is_durable_in_its_file_and_its_directory_when_save_returns(tmp_path: Path, trace: Trace) -> None:
    """The manifest's bytes are fsynced before the rename that puts it in place, and ``manifests/`` after it
    (format.md §7): the index commit that follows must not name a checkpoint whose manifest a power loss can
    take away (a repair would then drop it, and gc free its chunks)."""
    import os

    root = tmp_path / "store"
    with Store(root, chunk_size=4096) as st:
        trace.events.clear()
        st.save({"w": torch.arange(5000, dtype=torch.float32)}, step=1)
    (i, src), = [(i, e[1]) for i, e in enumerate(trace.events)
                 if e[0] in ("rename", "replace", "link") and e[-1].startswith(str(root / "manifests"))]
    assert ("fsync", os.path.realpath(src)) in trace.events[:i], f"the manifest was renamed unsynced: {trace.events}"
    assert trace.fsynced_after(root / "manifests", i), f"manifests/ was not fsynced after the rename: {trace.events}"
