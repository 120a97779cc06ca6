"""Proposed: the index's record and chunk-entry parsers on their own (a new tests/test_index.py, or next to
test_index_chunk_entries_of_any_value_are_typed_errors in tests/test_corruption.py). The hypothesis tests there
replace a whole value by arbitrary JSON or bytes; these pin the range checks at their edges."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from deltackpt import index
from deltackpt.errors import CorruptIndexError
from deltackpt.index import ChunkLoc, Record, chunk_key

DIGEST = bytes(range(16))


def _loc(offset: int = 16, frame_len: int = 200) -> bytes:
    return ChunkLoc("ab" * 16, offset, frame_len, 1, 0, bytes(16)).pack()


def test_a_chunk_entry_within_its_bounds_unpacks() -> None:
    key = chunk_key(DIGEST, 4096)
    hi = index.max_frame_len(4096)
    assert ChunkLoc.unpack(_loc(16, hi), key).frame_len == hi
    assert ChunkLoc.unpack(_loc(16, 64), key).offset == 16


@pytest.mark.parametrize("raw_len", [0, 4096, 1 << 20])
def test_a_chunk_entry_longer_than_any_frame_of_its_chunk_is_damage(raw_len: int) -> None:
    """A frame of a chunk of ``raw_len`` bytes is at most a raw frame plus slack: a damaged length must not make
    a read reserve (and read) up to 4 GiB for a 4 KiB chunk."""
    key = chunk_key(DIGEST, raw_len)
    for frame_len in (index.max_frame_len(raw_len) + 1, 0xFFFFFFFF):
        with pytest.raises(CorruptIndexError, match="is damaged"):
            ChunkLoc.unpack(_loc(16, frame_len), key)


def test_a_chunk_entry_of_another_size_is_damage() -> None:
    raw = _loc()
    for bad in (raw[:-1], raw + b"\0"):
        with pytest.raises(CorruptIndexError, match="chunk location record has"):
            ChunkLoc.unpack(bad, chunk_key(DIGEST, 4096))


def _record(**change: object) -> bytes:
    rec = Record(id="0123456789abcdef", step=1, created=1.0, parent=None, manifest_checksum="0" * 32,
                 logical_bytes=10, written_bytes=10, seq=5)
    for k, v in change.items():
        setattr(rec, k, v)
    return rec.dumps()


def test_a_good_record_loads() -> None:
    assert Record.loads(_record()).seq == 5


@pytest.mark.parametrize("checksum", ["0" * 31, "0" * 33, "G" * 32, "A" * 32, " " + "0" * 31])
def test_a_record_whose_manifest_checksum_is_not_32_hex_digits_is_damage(checksum: str) -> None:
    with pytest.raises(CorruptIndexError, match="manifest_checksum is"):
        Record.loads(_record(manifest_checksum=checksum))


@pytest.mark.parametrize("seq", [-1, 1 << 64, 1 << 70])
def test_a_record_whose_seq_is_no_u64_is_damage(seq: int) -> None:
    with pytest.raises(CorruptIndexError, match="seq is"):
        Record.loads(_record(seq=seq))


def test_a_record_stored_under_another_seq_is_damage() -> None:
    raw = _record(seq=5)
    assert index.record_at(struct.pack(">Q", 5), raw).seq == 5
    with pytest.raises(CorruptIndexError, match="is stored under seq 6"):
        index.record_at(struct.pack(">Q", 6), raw)


@pytest.mark.parametrize("text", [f"{1 << 62:020d}\n", f"{(1 << 64) - 1:020d}\n"])
def test_a_last_commit_past_any_real_seq_is_not_trusted(tmp_path: Path, text: str) -> None:
    (tmp_path / index.LAST_COMMIT).write_text(text)
    assert index.read_last_commit(tmp_path) is None
    (tmp_path / index.LAST_COMMIT).write_text(f"{(1 << 62) - 1:020d}\n")
    assert index.read_last_commit(tmp_path) == (1 << 62) - 1


def test_an_index_held_open_by_another_lmdb_handle_is_not_called_damage(tmp_path: Path) -> None:
    """LMDB allows one handle per environment per process: a user's own ``lmdb.open`` of a store's index made
    opening the store raise CorruptIndexError advising a repair, which would rebuild an index that is fine."""
    import lmdb
    import torch

    import deltackpt
    from deltackpt.errors import CorruptionError, DeltackptError

    with deltackpt.Store(tmp_path / "s") as s:
        s.save({"w": torch.ones(3)}, step=1)
    env = lmdb.open(str(tmp_path / "s" / "index"), readonly=True, max_dbs=8)
    try:
        with pytest.raises(DeltackptError, match="an LMDB handle of its own") as info:
            deltackpt.Store(tmp_path / "s")
        assert not isinstance(info.value, CorruptionError)
        assert "repair" not in str(info.value)
    finally:
        env.close()
    with deltackpt.Store(tmp_path / "s") as s:  # (closed: the store opens)
        assert s.load(1)["w"].tolist() == [1.0, 1.0, 1.0]


def test_an_interrupt_as_a_store_closes_its_index_lets_the_store_open_again(tmp_path: Path) -> None:
    """A KeyboardInterrupt raised as the last handle of a store lets go of its LMDB environment (a Ctrl-C's
    handler runs as a call returns: here as the environment, taken out of the registry, returned to be closed)
    leaves the store openable again in this process. (The environment stayed open out of the registry for as long
    as the traceback lived, a notebook's last one say, and every Store() of it meanwhile raised that the process
    "holds it open through an LMDB handle of its own".)"""
    import sys
    from typing import Any

    import torch

    from deltackpt import Store

    s = Store(tmp_path / "s")
    s.save({"a": torch.zeros(4)}, step=1)

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return" and (arg is not None or frame.f_locals.get("close")):  # (the last reference)
            sys.settrace(None)
            raise KeyboardInterrupt
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is index.Index._let_go.__code__ else None

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:  # (kept, as a notebook keeps its last traceback)
            s.close()
    finally:
        sys.settrace(None)
    with Store(tmp_path / "s") as again:
        assert [i.step for i in again.list()] == [1]
    del caught


def test_prefetched_lookups_answer_as_the_index_does(tmp_path: Path) -> None:
    """A save reads the entries of many tensors at once (``ChunkReader.prefetch``): has and lookup answer from
    them as LMDB would, a key not read goes to LMDB, and a damaged entry raises where it is looked up (as without
    the prefetch), not where it was read."""
    import torch

    import deltackpt

    with deltackpt.Store(tmp_path / "s", chunk_size=4096) as s:
        s.save({"w": torch.arange(3 * 1024.0)}, step=1)
        stored = sorted(k for k, _ in s.index.iter_chunks())
        bad = chunk_key(bytes(15) + b"\x01", 4096)
        with s.index.env.begin(db=s.index.db_chunks, write=True) as txn:
            txn.put(bad, b"\x00" * 7)  # (a record of the wrong size)
        absent = [chunk_key(bytes(16), 4096), chunk_key(DIGEST, 4096)]
        with s.index.chunk_reader() as plain:
            want_has = plain.has([*stored, *absent])
            want = plain.lookup([*stored, *absent])
            with pytest.raises(CorruptIndexError) as plain_error:
                plain.lookup([stored[0], bad])
        with s.index.chunk_reader() as chunks:
            chunks.prefetch([*stored[:2], absent[0], bad])  # (reads the damaged entry: no error yet)
            assert chunks.has([*stored[:2], absent[0]]) == set(stored[:2])
            assert chunks.has([*stored, *absent]) == want_has  # (keys not prefetched: read from LMDB)
            assert chunks.lookup([*stored, *absent]) == want
            assert chunks.lookup(stored[:2]) == {k: want[k] for k in stored[:2]}
            assert chunks.has([bad]) == {bad}
            with pytest.raises(CorruptIndexError) as error:
                chunks.lookup([stored[0], bad])
            assert str(error.value) == str(plain_error.value)
            damaged: dict[bytes, str] = {}
            assert chunks.lookup([stored[0], bad], damaged) == {stored[0]: want[stored[0]]}
            assert list(damaged) == [bad]
