"""Damaged bytes are always an error, never data: packs, frames, manifests and the index."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from conftest import SMALL_CHUNK, assert_same_state, dir_snapshot, entries_written_as
from hypothesis import given, settings
from hypothesis import strategies as st

import deltackpt
from deltackpt import CorruptChunkError, CorruptManifestError, codec, kernel, maintenance, manifest, predict, tree
from deltackpt.errors import CorruptIndexError, FormatVersionError
from deltackpt.index import ChunkLoc, chunk_key

CS = SMALL_CHUNK


# -- helpers -----------------------------------------------------------------------------------------------


def _open(path: Path) -> deltackpt.Store:
    return deltackpt.Store(path, chunk_size=CS, threads=2)


def _chunks_of(store: deltackpt.Store, step: int) -> dict[str, list[tuple[str, ChunkLoc]]]:
    """tensor key -> [(chunk id hex, location)] of its stored chunks, in order."""
    m = store.manifest(step)
    out: dict[str, list[tuple[str, ChunkLoc]]] = {}
    for t in m.tensors:
        keys = [chunk_key(d, n) for _, d, n in m.chunk_keys(t)]
        locs = store.index.lookup_chunks(keys)
        out[t.key] = [(codec.chunk_hex(k[:16], int.from_bytes(k[16:], "big")), locs[k]) for k in keys]
    return out


def _pack_path(store_path: Path, loc: ChunkLoc) -> Path:
    return store_path / "packs" / f"{loc.pack_id}.pack"


def _flip(path: Path, offset: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _rand(n_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_bytes // 4, generator=g)


@pytest.fixture
def two_ckpts(store_path: Path) -> dict[str, Any]:
    """Checkpoint 1 {a, b, c}, checkpoint 2 {a, b (same bytes), d}, checkpoint 3 {a}; 3 chunks per tensor."""
    a, b, c, d = (_rand(3 * CS, seed) for seed in range(4))
    s1 = {"a": a, "b": b, "c": c, "meta": {"step": 1}}
    s2 = {"a": a, "b": b.clone(), "d": d}
    s3 = {"a": a.clone()}
    with _open(store_path) as s:
        ids = [s.save(st_, step=i + 1).id for i, st_ in enumerate((s1, s2, s3))]
        chunks = {step: _chunks_of(s, step) for step in (1, 2, 3)}
    return {"states": {1: s1, 2: s2, 3: s3}, "ids": dict(zip((1, 2, 3), ids, strict=True)), "chunks": chunks}


def _problems(report: Any) -> set[tuple[str, str | None, str | None]]:
    return {(p.checkpoint, p.key, p.chunk_id) for p in report.problems}


def _assert_names(exc: CorruptChunkError, ckpt: str, key: str, chunk: str) -> None:
    assert exc.checkpoint == ckpt and exc.key == key and exc.chunk_id == chunk, (exc.checkpoint, exc.key,
                                                                                   exc.chunk_id)
    msg = str(exc)
    assert ckpt in msg and repr(key) in msg and chunk in msg, msg


# -- packs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("verify", [True, False])
def test_flipped_payload_byte(store_path: Path, two_ckpts: dict[str, Any], verify: bool) -> None:
    ids, chunks = two_ckpts["ids"], two_ckpts["chunks"]
    cid, loc = chunks[1]["b"][1]
    assert chunks[2]["b"][1][0] == cid  # shared by checkpoints 1 and 2
    middle = loc.offset + codec.HEADER_SIZE + (loc.frame_len - codec.HEADER_SIZE) // 2
    _flip(_pack_path(store_path, loc), middle)
    with _open(store_path) as s:
        for step in (1, 2):
            with pytest.raises(CorruptChunkError) as ei:
                s.load(step, verify=verify)
            _assert_names(ei.value, ids[step], "b", cid)
        with pytest.raises(CorruptChunkError) as ei:
            s.load(id=ids[2], verify=verify)
        _assert_names(ei.value, ids[2], "b", cid)
        with pytest.raises(CorruptChunkError):
            s.load_into({k: torch.empty_like(v) for k, v in two_ckpts["states"][1].items() if k != "meta"}
                        | {"meta": {"step": 0}}, step=1)
        assert_same_state(two_ckpts["states"][3], s.load(3))  # does not need the chunk
        report = s.verify()
        assert not report.ok
        assert _problems(report) == {(ids[1], "b", cid), (ids[2], "b", cid)}
        assert all(p.step in (1, 2) for p in report.problems)
        assert all(cid in str(p) and "'b'" in str(p) for p in report.problems)
        assert _problems(s.verify(step=1)) == {(ids[1], "b", cid)}
        assert s.verify(step=3).ok
        assert len(s.list()) == 3  # corruption is reported, nothing is dropped


# every field of a frame: magic, version, codec, width, flags, raw length, stored length, digest, base,
# checksum, first and last payload byte
FRAME_POSITIONS = [0, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 39, 40, 55, 56, 63, 64, -1]


@pytest.mark.parametrize("pos", FRAME_POSITIONS)
def test_flipped_byte_anywhere_in_frame(store_path: Path, two_ckpts: dict[str, Any], pos: int) -> None:
    ids, chunks = two_ckpts["ids"], two_ckpts["chunks"]
    cid, loc = chunks[1]["c"][2]
    off = loc.offset + (pos if pos >= 0 else loc.frame_len + pos)
    _flip(_pack_path(store_path, loc), off, 0x01)
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError) as ei:
            s.load(1)
        _assert_names(ei.value, ids[1], "c", cid)
        report = s.verify()  # reports, never raises
        assert _problems(report) == {(ids[1], "c", cid)}
        assert_same_state(two_ckpts["states"][2], s.load(2))


def test_a_span_reads_only_the_chunks_it_reaches(store_path: Path) -> None:
    """``load_into(spans=)`` decodes the chunks overlapping a byte range and nothing else: a damaged chunk
    outside it goes unread, one inside is reported; target bytes outside the range are left as they were."""
    w = _rand(16 * CS, 0)  # 16 chunks
    with _open(store_path) as s:
        s.save({"w": w, "b": _rand(2 * CS, 1)}, step=1)
        chunks = _chunks_of(s, 1)["w"]
    loc = chunks[12][1]
    _flip(_pack_path(store_path, loc), loc.offset + codec.HEADER_SIZE + loc.frame_len // 2 - 32)
    with _open(store_path) as s:
        target = torch.full((16 * CS // 4,), -1.0)
        lo, hi = 3 * CS + 100, 9 * CS - 8  # chunks 3 .. 8
        assert s.load_into({"w": target, "b": torch.zeros(2 * CS // 4)}, spans={"w": (lo, hi)}) == []
        got, want = target.view(torch.uint8), w.view(torch.uint8)
        assert torch.equal(got[lo:hi], want[lo:hi])
        assert bool((target[: lo // 4] == -1).all()) and bool((target[hi // 4 :] == -1).all())
        with pytest.raises(CorruptChunkError) as ei:
            s.load_into({"w": target, "b": torch.zeros(2 * CS // 4)}, spans={"w": (lo, 12 * CS + 1)})
        assert ei.value.chunk_id == chunks[12][0] and ei.value.key == "w"
        assert s.load_into({"w": target, "b": torch.zeros(2 * CS // 4)}, spans={"w": (5, 5)}) == []  # empty
        with pytest.raises(ValueError, match="contiguous CPU target"):
            s.load_into({"w": torch.zeros(32 * CS // 4)[::2], "b": torch.zeros(2 * CS // 4)}, spans={"w": (0, 4)})
        for span in ((-8, 16), (0, -1)):  # (-8 read as 0, writing bytes 0..16: not a slice's "from the end")
            untouched = target.clone()
            with pytest.raises(ValueError, match=r"spans\['w'\]: \(start, end\) must be byte offsets of 0 or more"):
                s.load_into({"w": target, "b": torch.zeros(2 * CS // 4)}, spans={"w": span})
            assert torch.equal(target, untouched)


@given(lo=st.integers(0, 5 * CS + 17), n=st.integers(0, 5 * CS + 17))
def test_any_span_writes_exactly_its_range(tmp_path_factory: pytest.TempPathFactory, lo: int,
                                                      n: int) -> None:
    w = _rand(5 * CS + 16, 2)  # six chunks, the last one short, the third all zero
    w[2 * CS // 4 : 3 * CS // 4] = 0
    raw = w.view(torch.uint8)
    path = tmp_path_factory.mktemp("span") / "s"
    with _open(path) as s:
        s.save({"w": w}, step=1)
        target = w.clone()
        target.view(torch.uint8).bitwise_not_()  # every byte differs from the checkpoint's
        s.load_into({"w": target}, spans={"w": (lo, lo + n)})
    hi = min(lo + n, len(raw))
    first, last = (min(lo, len(raw)), hi) if lo < hi else (0, 0)
    got = target.view(torch.uint8)
    assert torch.equal(got[first:last], raw[first:last])  # the range, exactly
    assert bool(got[:first].ne(raw[:first]).all()) and bool(got[last:].ne(raw[last:]).all())  # nothing else


def test_several_damaged_chunks_all_reported(store_path: Path, two_ckpts: dict[str, Any]) -> None:
    ids, chunks = two_ckpts["ids"], two_ckpts["chunks"]
    damaged = [chunks[1]["a"][0], chunks[1]["c"][1], chunks[2]["d"][2]]
    for _, loc in damaged:
        _flip(_pack_path(store_path, loc), loc.offset + loc.frame_len - 1)
    a0, c1, d2 = (cid for cid, _ in damaged)
    with _open(store_path) as s:
        report = s.verify()
        assert _problems(report) == {
            (ids[1], "a", a0), (ids[2], "a", a0), (ids[3], "a", a0), (ids[1], "c", c1), (ids[2], "d", d2),
        }
        for step in (1, 2, 3):
            with pytest.raises(CorruptChunkError) as ei:
                s.load(step)
            assert ei.value.key == "a" and ei.value.chunk_id == a0


def test_truncated_pack(store_path: Path, two_ckpts: dict[str, Any]) -> None:
    ids, chunks = two_ckpts["ids"], two_ckpts["chunks"]
    cid, loc = chunks[1]["b"][1]
    pack = _pack_path(store_path, loc)
    cut = loc.offset + codec.HEADER_SIZE + 10
    os.truncate(pack, cut)
    expected = set()
    for step, by_key in chunks.items():
        for key, lst in by_key.items():
            for c, lc in lst:
                if lc.pack_id == loc.pack_id and lc.offset + lc.frame_len > cut:
                    expected.add((ids[step], key, c))
    assert (ids[1], "b", cid) in expected and (ids[2], "d", chunks[2]["d"][0][0]) in expected
    with _open(store_path) as s:
        for step in (1, 2):
            with pytest.raises(CorruptChunkError) as ei:
                s.load(step)
            _assert_names(ei.value, ids[step], "b", cid)
        assert_same_state(two_ckpts["states"][3], s.load(3))
        assert _problems(s.verify()) == expected
    # truncating the pack to nothing at all
    os.truncate(pack, 0)
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError) as ei:
            s.load(3)
        _assert_names(ei.value, ids[3], "a", chunks[3]["a"][0][0])


def test_pack_shortened_under_an_open_handle(store_path: Path, two_ckpts: dict[str, Any]) -> None:
    """A handle that already read a pack which something then shortens reports the frames past the new end as
    truncated, and still loads the rest."""
    ids, chunks = two_ckpts["ids"], two_ckpts["chunks"]
    cid, loc = chunks[1]["b"][1]
    pack = _pack_path(store_path, loc)
    with _open(store_path) as s:
        for step in (1, 2, 3):
            assert_same_state(two_ckpts["states"][step], s.load(step))  # every pack open
        os.truncate(pack, loc.offset + codec.HEADER_SIZE + 10)
        with pytest.raises(CorruptChunkError, match="truncated") as ei:
            s.load(1)
        _assert_names(ei.value, ids[1], "b", cid)
        assert_same_state(two_ckpts["states"][3], s.load(3))


def test_pack_grown_while_open(store_path: Path) -> None:
    """A handle reads a pack, then appends more frames to it (its next save): loads see the new frames."""
    states = [{"x": _rand(3 * CS, seed), "y": _rand(2 * CS, seed + 10)} for seed in range(4)]
    with _open(store_path) as s:
        for step, state in enumerate(states):
            s.save(state, step=step)
            assert_same_state(state, s.load(step))
        assert len(list((store_path / "packs").glob("*.pack"))) == 1
        for step, state in enumerate(states):
            assert_same_state(state, s.load(step))


def test_deleted_pack(store_path: Path) -> None:
    a, b, d = _rand(3 * CS, 0), _rand(2 * CS, 1), _rand(2 * CS + 100, 2)
    with _open(store_path) as s:
        id1 = s.save({"a": a, "b": b}, step=1).id
    with _open(store_path) as s:  # a new handle appends to a new pack
        id2 = s.save({"a": a, "b": b, "d": d}, step=2).id
        chunks = _chunks_of(s, 2)
    packs_of = {k: {loc.pack_id for _, loc in v} for k, v in chunks.items()}
    assert packs_of["a"] == packs_of["b"] and packs_of["d"].isdisjoint(packs_of["a"])
    (pack_d,) = packs_of["d"]
    (store_path / "packs" / f"{pack_d}.pack").unlink()
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError) as ei:
            s.load(2)
        _assert_names(ei.value, id2, "d", chunks["d"][0][0])
        assert "missing" in str(ei.value)
        assert torch.equal(s.load(1)["a"], a)
        assert _problems(s.verify()) == {(id2, "d", c) for c, _ in chunks["d"]}
    (pack_a,) = packs_of["a"]
    (store_path / "packs" / f"{pack_a}.pack").unlink()
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError) as ei:
            s.load(1)
        _assert_names(ei.value, id1, "a", chunks["a"][0][0])
        problems = _problems(s.verify())
        assert {(id1, "a", c) for c, _ in chunks["a"]} <= problems
        assert len(problems) == len(chunks["a"]) * 2 + len(chunks["b"]) * 2 + len(chunks["d"])


def test_right_checksum_wrong_bytes_caught_by_verify(store_path: Path) -> None:
    """A frame rewritten with other bytes and a recomputed checksum: only the digest check can see it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2 * CS,), dtype=torch.uint8, generator=g)  # incompressible: raw frames
    with _open(store_path) as s:
        ckpt = s.save({"x": x}, step=1).id
        cid, loc = _chunks_of(s, 1)["x"][1]
    assert loc.codec == codec.RAW
    pack = _pack_path(store_path, loc)
    with open(pack, "r+b") as f:
        f.seek(loc.offset)
        frame = bytearray(f.read(loc.frame_len))
        payload = bytes(reversed(frame[codec.HEADER_SIZE:]))
        forged = codec._frame(codec.RAW, 1, CS, bytes(frame[24:40]), codec.NO_BASE, payload)
        assert len(forged) == len(frame) and forged[:CS] != bytes(frame[:CS])
        f.seek(loc.offset)
        f.write(forged)
    codec.check_frame(forged)  # the frame itself is consistent
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError) as ei:
            s.load(1)
        _assert_names(ei.value, ckpt, "x", cid)
        assert "do not match" in ei.value.reason
        unchecked = s.load(1, verify=False)  # frame checksums alone cannot catch it (documented)
        assert unchecked["x"][CS:].numpy().tobytes() == payload
        assert _problems(s.verify()) == {(ckpt, "x", cid)}


# -- manifests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip_header", "flip_middle", "flip_last", "truncate", "delete", "swap"])
def test_damaged_manifest(store_path: Path, two_ckpts: dict[str, Any], damage: str) -> None:
    ids = two_ckpts["ids"]
    mdir = store_path / "manifests"
    path = mdir / f"{ids[2]}.manifest"
    size = path.stat().st_size
    if damage == "flip_header":
        _flip(path, 10)
    elif damage == "flip_middle":
        _flip(path, size // 2)
    elif damage == "flip_last":
        _flip(path, size - 1)
    elif damage == "truncate":
        os.truncate(path, size - 20)
    elif damage == "delete":
        path.unlink()
    else:
        shutil.copyfile(mdir / f"{ids[1]}.manifest", path)
    with _open(store_path) as s:
        for call in (lambda: s.load(2), lambda: s.load(id=ids[2]), lambda: s.manifest(2),
                     lambda: s.load_into({"a": torch.empty(3 * CS // 4)}, step=2, strict=False)):
            with pytest.raises(CorruptManifestError) as ei:
                call()
            assert ids[2] in str(ei.value)
            assert damage != "delete" or "deltackpt repair" in str(ei.value)  # (an older index names it, say)
        report = s.verify()
        assert [(p.checkpoint, p.key, p.chunk_id) for p in report.problems] == [(ids[2], None, None)]
        assert_same_state(two_ckpts["states"][1], s.load(1))
        assert_same_state(two_ckpts["states"][3], s.load(3))
        assert [i.id for i in s.list()] == [ids[1], ids[2], ids[3]]
        assert s.info(2).id == ids[2]  # the index record is intact


_STORE_FILE_PROBE = """
import sys, deltackpt
try:
    with deltackpt.Store(sys.argv[1], readonly=sys.argv[2] == "ro") as s:
        s.list(); s.load(); s.verify()
        if sys.argv[2] != "ro":
            s.save({"w": deltackpt.__version__}, step=9)
            s.repair()
    print("ok")
except deltackpt.DeltackptError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("what", ["STORE fifo", "STORE -> /dev/zero", "LAST_COMMIT fifo", "LAST_COMMIT link",
                                  "gc.lock fifo"])
def test_store_files_that_are_no_regular_file(tmp_path: Path, what: str) -> None:
    """A FIFO, a device or a link in place of the store's small files: every operation returns (in a child
    process, under a timeout), with a typed error or working on, and nothing outside the store is written.
    (Before, a FIFO as STORE, LAST_COMMIT or gc.lock made opening, loading or repair wait forever for a writer,
    STORE linked to /dev/zero read until memory ran out, and saves and repair wrote LAST_COMMIT through a
    link, into the file it named.)"""
    store_path = tmp_path / "s"
    with _open(store_path) as s:
        s.save({"w": _rand(CS, 0)}, step=1)
    name, kind = what.split(" ", 1)
    victim = store_path / name
    outside = tmp_path / "outside.txt"
    outside.write_text("a file of the user's, outside the store\n")
    victim.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(victim)
    elif kind == "link":
        victim.symlink_to(outside)
    else:
        victim.symlink_to("/dev/zero")
    for mode in ("ro", "rw"):
        done = subprocess.run([sys.executable, "-c", _STORE_FILE_PROBE, str(store_path), mode], capture_output=True,
                              text=True, timeout=60, cwd=Path(deltackpt.__file__).parent.parent)
        assert done.returncode == 0, done.stderr
        out = done.stdout.strip()
        if name == "STORE":
            assert out.startswith("DeltackptError") and "not a regular file" in out, out
        elif name == "gc.lock":
            assert out.startswith("CorruptionError") and "is not a regular file: move it away" in out, out
        else:  # (LAST_COMMIT is advisory: a store works on without it)
            assert out == "ok", out
    assert outside.read_text() == "a file of the user's, outside the store\n"


@pytest.mark.parametrize("what", ["pack", "manifest", "dangling pack link", "pack fifo", "manifest fifo",
                                  "manifest link loop", "pack link loop"])
def test_pack_or_manifest_that_is_no_file(store_path: Path, what: str) -> None:
    """A directory, a FIFO or a link that leads nowhere where a pack or manifest should be is damage like a
    missing file: typed errors that name the checkpoint, verify reports it, and gc and du neither crash, hang
    nor touch it. (Before, a FIFO made loads, verify, gc and repair wait forever for a writer, and a link loop
    raised a bare OSError.)"""
    a, b = _rand(2 * CS, 0), _rand(2 * CS, 1)
    with _open(store_path) as s:
        s.save({"a": a}, step=1)
    with _open(store_path) as s:
        info = s.save({"a": a, "b": b}, step=2)
        (pack_b,) = {loc.pack_id for _, loc in _chunks_of(s, 2)["b"]}
    manifest = what.startswith("manifest")
    victim = (store_path / "manifests" / f"{info.id}.manifest" if manifest
              else store_path / "packs" / f"{pack_b}.pack")
    victim.unlink()
    if what == "dangling pack link":
        victim.symlink_to(store_path / "nowhere.pack")
    elif what.endswith("link loop"):
        victim.symlink_to(victim)
    elif what.endswith("fifo"):
        os.mkfifo(victim)
    else:
        victim.mkdir()
    error = CorruptManifestError if manifest else CorruptChunkError
    with _open(store_path) as s:
        with pytest.raises(error, match=info.id if manifest else "checkpoint " + info.id):
            s.load(2)
        assert_same_state({"a": a}, s.load(1))
        problems = s.verify().problems
        assert problems and {p.checkpoint for p in problems} == {info.id}
        if not manifest:  # (gc refuses to run while a manifest is damaged: it could free what it names)
            s.gc()
            assert s.verify().problems == problems
        else:
            with pytest.raises(CorruptManifestError, match=info.id):
                s.gc()
    du = subprocess.run([sys.executable, "-m", "deltackpt", "du", str(store_path)], capture_output=True, text=True,
                        timeout=60)
    assert du.returncode == 0 and "Traceback" not in du.stderr
    assert victim.is_symlink() or victim.is_dir() or victim.is_fifo()
    repair = subprocess.run([sys.executable, "-m", "deltackpt", "repair", str(store_path)], capture_output=True,
                            text=True, timeout=60)
    assert "Traceback" not in repair.stderr
    assert repair.returncode == 1 and info.id in repair.stdout  # that checkpoint lost, or restored incomplete


def _eio_file() -> str:
    """A file that opens as a regular file and whose read at offset 0 raises EIO: /proc/self/mem (Linux; the
    process's lowest addresses are never mapped)."""
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY)
    except OSError:
        pytest.skip("no /proc/self/mem")
    try:
        os.pread(fd, 16, 0)
    except OSError as exc:
        if exc.errno == errno.EIO and stat.S_ISREG(os.fstat(fd).st_mode):
            return "/proc/self/mem"
    finally:
        os.close(fd)
    pytest.skip("/proc/self/mem does not raise EIO at offset 0 here")


def test_a_pack_whose_read_fails_is_damage_naming_pack_checkpoint_and_chunk(store_path: Path) -> None:
    """A pack whose read raises OSError (EIO: a bad sector; here a link to /proc/self/mem, a regular file that
    reads as none at offset 0): the load raises CorruptChunkError naming the pack, the checkpoint, the tensor
    and the chunk, as for a truncated pack, and verify reports it; it was a bare OSError naming no chunk."""
    eio = _eio_file()
    a, b = _rand(2 * CS, 0), _rand(2 * CS, 1)
    with _open(store_path) as s:
        s.save({"a": a}, step=1)
    with _open(store_path) as s:
        info = s.save({"a": a, "b": b}, step=2)
        chunks = _chunks_of(s, 2)["b"]
    (pack_b,) = {loc.pack_id for _, loc in chunks}
    assert all(loc.offset + loc.frame_len < 1 << 16 for _, loc in chunks)
    victim = store_path / "packs" / f"{pack_b}.pack"
    victim.unlink()
    victim.symlink_to(eio)
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError, match=f"pack {pack_b} cannot be read") as ei:
            s.load(2)
        _assert_names(ei.value, info.id, "b", ei.value.chunk_id or "")
        assert ei.value.chunk_id in {c for c, _ in chunks}
        assert_same_state({"a": a}, s.load(1))
        problems = s.verify().problems
        assert problems and {(p.checkpoint, p.key) for p in problems} == {(info.id, "b")}


@pytest.mark.parametrize("name", ["gc.lock", "maint.lock"])
@pytest.mark.parametrize("what", ["directory", "link loop", "dangling link"])
def test_a_lock_file_that_is_no_file_is_a_typed_error_naming_it(store_path: Path, name: str, what: str) -> None:
    """A directory (or a link looping to itself) in place of one of the store's lock files: what takes that lock
    (saves, loads, gc and repair; gc and repair alone take ``maint.lock``) raises CorruptionError naming the
    file, changes nothing, and works again once it is moved away. (They
    raised a bare IsADirectoryError or OSError, and a repair could not say what to do.) A link leading nowhere
    (in a store received from elsewhere) had saves, gc and repair create the file it names, outside the store."""
    a = _rand(2 * CS, 0)
    with _open(store_path) as s:
        s.save({"a": a}, step=1)
    lock = store_path / name
    lock.unlink()
    outside = store_path.parent / f"outside-{name}"
    if what == "directory":
        lock.mkdir()
    else:
        lock.symlink_to(lock if what == "link loop" else outside)
    before = dir_snapshot(store_path)
    with _open(store_path) as s:
        calls = [s.gc] if name == "maint.lock" else [lambda: s.load(1), lambda: s.save({"a": a + 1}, step=2), s.gc]
        for call in calls:
            with pytest.raises(deltackpt.CorruptionError, match=f"lock file {lock}.* not a file"):
                call()
    with pytest.raises(deltackpt.CorruptionError, match=f"lock file {lock}"):
        maintenance.open_for_repair(store_path)
    assert dir_snapshot(store_path) == before and not outside.exists()
    if what == "directory":
        lock.rmdir()
    else:
        lock.unlink()
    with _open(store_path) as s:
        s.save({"a": a + 1}, step=2)
        assert_same_state({"a": a}, s.load(1))
        assert s.verify().ok


# -- the index ---------------------------------------------------------------------------------------------


def _fill(store_path: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    states = {
        1: {"w": torch.randn(5000, generator=g), "opt": {"lr": 0.1}, "z": torch.zeros(3000)},
        2: {"w": torch.randn(5000, generator=g), "n": np.arange(999, dtype=">i8")},
        3: {"w": torch.randn(7, generator=g), "p": torch.nn.Parameter(torch.ones(3))},
        4: {"w": torch.randn(6000, generator=g)},
    }
    with _open(store_path) as s:
        infos = {k: s.save(v, step=k, metadata={"k": k}) for k, v in states.items()}
        s.delete(2)
        listed = [(i.id, i.step, i.metadata, i.parent) for i in s.list()]
    return {"states": states, "infos": infos, "listed": listed}


def _check_repaired(store: deltackpt.Store, filled: dict[str, Any]) -> None:
    assert [(i.id, i.step, i.metadata, i.parent) for i in store.list()] == filled["listed"]
    for step in (1, 3, 4):
        assert_same_state(filled["states"][step], store.load(step))
        assert_same_state(filled["states"][step], store.load(id=filled["infos"][step].id))
    assert_same_state(filled["states"][4], store.load())
    with pytest.raises(deltackpt.CheckpointNotFoundError):
        store.load(2)  # deleted before the index was lost: stays deleted
    assert store.verify().ok
    info = store.save({"w": torch.ones(4)}, step=5)  # the repaired store keeps working
    assert info.written_bytes > 0 and store.load()["w"].sum().item() == 4
    assert store.list()[-1].seq > max(i.seq for i in store.list()[:-1])


@pytest.mark.parametrize("how", ["files_removed", "dir_removed", "emptied", "link_loop"])
def test_lost_index_is_refused_until_repaired(store_path: Path, how: str) -> None:
    """A store whose index was lost does not open as an empty store (whose gc would free every pack): every
    open raises CorruptIndexError naming the repair, without creating or changing a file; a repair rebuilds it.
    (A data file that is a link looping to itself used to raise a bare OSError.)"""
    filled = _fill(store_path)
    if how == "files_removed":
        for p in (store_path / "index").iterdir():
            p.unlink()
    elif how == "dir_removed":
        shutil.rmtree(store_path / "index")
    elif how == "link_loop":
        (store_path / "index" / "data.mdb").unlink()
        (store_path / "index" / "data.mdb").symlink_to(store_path / "index" / "data.mdb")
    else:
        (store_path / "index" / "data.mdb").write_bytes(b"")
    before = dir_snapshot(store_path)
    for readonly in (None, False, True):
        with pytest.raises(CorruptIndexError, match="lost or emptied.*deltackpt repair"):
            deltackpt.Store(store_path, readonly=readonly)
    cli = subprocess.run([sys.executable, "-m", "deltackpt", "gc", "--repack-below", "0.99", str(store_path)],
                         capture_output=True, text=True)
    assert cli.returncode == 1 and "deltackpt repair" in cli.stderr and "Traceback" not in cli.stderr
    assert dir_snapshot(store_path) == before
    with maintenance.open_for_repair(store_path) as s:
        report = s.repair()
        assert report.checkpoints == 3 and report.lost_checkpoints == []
        _check_repaired(s, filled)
    with deltackpt.Store(store_path) as s:  # the rebuilt index is the store's index again
        assert [i.step for i in s.list()] == [1, 3, 4, 5]


def test_repair_reads_the_frames_of_a_pack_whose_header_is_damaged(store_path: Path) -> None:
    """Readers never look at a pack's header, and neither does a repair need it: every frame verifies on its
    own. One flipped header byte is reported as damage and costs no checkpoint (it used to cost all of them)."""
    filled = _fill(store_path)
    (pack,) = (store_path / "packs").glob("*.pack")
    with open(pack, "r+b") as f:
        f.write(b"X")  # the first byte of the magic
    shutil.rmtree(store_path / "index")
    with maintenance.open_for_repair(store_path) as s:
        report = s.repair()
        assert report.checkpoints == 3 and report.lost_checkpoints == [] and report.damaged_packs == [pack.stem]
        (problem,) = s.verify().problems  # the header is still damaged: a gc copies the frames to a new pack
        assert f"pack {pack.stem}: its header is damaged" in str(problem)
        assert s.gc().repacked_packs == 1
        _check_repaired(s, filled)


@pytest.mark.parametrize("at", [0, 8, 12])  # magic, version, the zero after them
def test_verify_reports_a_damaged_pack_header_and_gc_repairs_it(store_path: Path, at: int) -> None:
    """Loads never need a pack's header (frames are found through the index), but a changed header byte is
    damage on disk all the same: verify reported nothing for it. It now names the pack (and loses no chunk),
    and gc copies the pack's frames to a new one, after which verify is clean."""
    states = {i: {"a": torch.randn(3000), "b": torch.arange(float(i), i + 500.0)} for i in (1, 2)}
    with _open(store_path) as s:
        for i, state in states.items():
            s.save(state, step=i)
    (pack,) = (store_path / "packs").glob("*.pack")
    _flip(pack, at, 0x01)
    with _open(store_path) as s:
        for check in (s.verify(), s.verify(2)):
            assert [(p.checkpoint, p.chunk_id, p.pack) for p in check.problems] == [(None, None, pack.stem)]
            assert str(check.problems[0]).startswith(f"pack {pack.stem}: its header is damaged")
            assert "'deltackpt gc STORE'" in str(check.problems[0])
        for i, state in states.items():
            assert_same_state(state, s.load(i))
        gc = s.gc()
        assert gc.repacked_packs == 1 and gc.damaged_packs == [] and not pack.exists()
        assert s.verify().problems == []
        for i, state in states.items():
            assert_same_state(state, s.load(i))


@pytest.mark.parametrize("size", [10, "tail"])  # shorter than its header; a header flipped and the tail cut
def test_verify_does_not_call_chunks_of_a_damaged_pack_safe_when_they_are_not(store_path: Path, size: Any) -> None:
    """A pack whose header is damaged and whose frames are damaged too (a pack cut short: under its 16-byte header,
    or its tail): verify said of the pack 'no chunk is lost' and that gc would copy its frames to a new pack, while
    it reported the pack's chunks as lost and gc refuses to copy a pack with a damaged live frame."""
    with _open(store_path) as s:
        for i in (1, 2):
            s.save({"a": torch.randn(3000) + i}, step=i)
    (pack,) = (store_path / "packs").glob("*.pack")
    if size == "tail":
        os.truncate(pack, pack.stat().st_size - 100)
        _flip(pack, 0, 0x01)
    else:
        os.truncate(pack, size)
    with _open(store_path) as s:
        report = s.verify()
        (header,) = [p for p in report.problems if p.pack is not None]
        assert any(p.chunk_id is not None for p in report.problems)
        assert "no chunk is lost" not in header.message and "copies them to a new pack" not in header.message
        assert "damaged too" in header.message


@pytest.mark.parametrize("what", ["manifest", "frame"])
def test_repair_refuses_what_a_newer_format_wrote(store_path: Path, what: str) -> None:
    """An intact manifest or frame of a version this reader does not know (a newer deltackpt's) stops a repair
    with FormatVersionError naming it; before, the manifest was dropped as lost (and the next gc deleted it
    and freed its chunks) and the frame skipped as damage. A damaged version byte is still damage."""

    with _open(store_path) as s:
        s.save({"a": torch.randn(1000)}, step=1)
        info = s.save({"b": torch.randn(1000)}, step=2)
    if what == "manifest":
        path = store_path / "manifests" / f"{info.id}.manifest"
        data = bytearray(path.read_bytes())
        struct.pack_into("<I", data, 8, 9)  # version 9, checksum recomputed: as a newer writer wrote it
        data[-16:] = xxhash.xxh3_128_digest(bytes(data[:-16]))
    else:
        (path,) = (store_path / "packs").glob("*.pack")
        data = bytearray(path.read_bytes())
        at = 16  # the first frame, after the pack header
        stored = struct.unpack_from("<Q", data, at + 16)[0]
        data[at + 4] = 9  # its version byte
        checked = bytes(data[at : at + 56] + data[at + 64 : at + 64 + stored])
        struct.pack_into("<Q", data, at + 56, xxhash.xxh3_64(checked).intdigest())
    path.write_bytes(bytes(data))
    shutil.rmtree(store_path / "index")
    with pytest.raises(deltackpt.FormatVersionError, match="version 9.*a newer deltackpt wrote this store"):
        with maintenance.open_for_repair(store_path) as s:
            s.repair()
    assert path.read_bytes() == bytes(data)  # nothing it could not read was dropped or changed
    if what == "frame":
        data[at + 5] ^= 0xFF  # the codec byte too: the checksum fails, so it is damage, skipped
        path.write_bytes(bytes(data))
        with maintenance.open_for_repair(store_path) as s:
            report = s.repair()
        assert report.damaged_packs == [path.stem] and report.incomplete_checkpoints


def test_a_predicted_frame_whose_length_is_no_whole_number_of_floats_is_damage(store_path: Path) -> None:
    """A predicted frame (its checksum intact) of 6 raw bytes: load and verify name it as damage of that chunk
    (before, the kernel's bare ValueError escaped both)."""
    import uuid

    import lmdb

    with deltackpt.Store(store_path, chunk_size=4096, threads=1) as s:
        t, a, b, c = (np.frombuffer(bytes([i + 1] * 3 + [i + 7] * 3), dtype=np.uint8).copy() for i in range(4))
        s.save({"t": t, "a": a, "b": b, "c": c}, step=1)
    raw = 6
    digest = [xxhash.xxh3_128_digest(x.tobytes()) for x in (t, a, b, c)]
    record = struct.pack("<BBHI", 1, 2, 4, 0) + digest[2] + digest[3] + struct.pack("<4d", 0.5, 1.0, 0.5, 1.0)
    payload = (struct.pack("<I", len(record)) + record
               + zstandard.ZstdCompressor(write_content_size=True).compress(bytes(raw)))
    head = struct.pack("<4sBBBBQQ16s16s", b"DCKF", 2, codec.PREDICTED, 4, 0, raw, len(payload), digest[0], digest[1])
    frame = head + struct.pack("<Q", xxhash.xxh3_64(head + payload).intdigest()) + payload
    pack = uuid.uuid4()
    (store_path / "packs" / f"{pack.hex}.pack").write_bytes(struct.pack("<8sII", b"DCKPACK1", 1, 0) + frame)
    env = lmdb.open(str(store_path / "index"), max_dbs=8)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True) as txn:  # t's chunk now lies in that frame
        txn.put(digest[0] + struct.pack(">I", raw),
                struct.pack("<16sQIBB16s", pack.bytes, 16, len(frame), codec.PREDICTED, 1, digest[1]), db=chunks)
    env.close()
    cid = f"{digest[0].hex()}-{raw}"
    with deltackpt.Store(store_path, threads=1) as s:
        with pytest.raises(CorruptChunkError, match="not a whole number of float32 values") as exc:
            s.load(step=1)
        assert exc.value.chunk_id == cid
        problems = s.verify().problems
        assert [p.chunk_id for p in problems] == [cid] and "float32" in problems[0].message


def test_lost_store_file_is_refused_and_written_again_by_repair(store_path: Path) -> None:
    """A store that lost its STORE file is not taken for a new, empty directory (which would get the default
    chunk size): opening it raises; a repair writes STORE again with the chunk size its manifests name."""
    filled = _fill(store_path)
    (store_path / "STORE").unlink()
    before = dir_snapshot(store_path)
    with pytest.raises(deltackpt.DeltackptError, match="no STORE file but holds"):
        deltackpt.Store(store_path)
    with pytest.raises(deltackpt.DeltackptError, match="no STORE file"):
        deltackpt.Store(store_path, readonly=True)
    assert dir_snapshot(store_path) == before
    with maintenance.open_for_repair(store_path) as s:
        assert s.chunk_size == CS != deltackpt.config.chunk_size()
        s.repair()
        _check_repaired(s, filled)


@pytest.mark.parametrize("damage", ["garbage", "chunk_size"])
def test_damaged_store_file_is_a_typed_error_and_written_again_by_repair(store_path: Path, damage: str) -> None:
    """A STORE file that no longer parses, or that names an impossible chunk size (one flipped digit): opening
    raises DeltackptError naming the file and the repair (before: a plain ValueError), and a repair moves it
    aside and writes it again from the manifests (before: it failed the same way)."""
    filled = _fill(store_path)
    text = (store_path / "STORE").read_text()
    if damage == "garbage":
        (store_path / "STORE").write_text(text.replace('"format"', '"form\x00t'))
    else:
        (store_path / "STORE").write_text(text.replace(f'"chunk_size": {CS}', f'"chunk_size": {CS + 40}'))
    before = dir_snapshot(store_path)
    for readonly in (False, True):
        with pytest.raises(deltackpt.DeltackptError, match="STORE.*deltackpt repair"):
            deltackpt.Store(store_path, readonly=readonly)
    assert dir_snapshot(store_path) == before
    cli = subprocess.run([sys.executable, "-m", "deltackpt", "repair", str(store_path)], capture_output=True,
                         text=True)
    assert cli.returncode == 0, cli.stderr
    assert len(list(store_path.glob("STORE.broken-*"))) == 1
    with _open(store_path) as s:
        _check_repaired(s, filled)


def test_store_file_naming_another_valid_chunk_size_is_found_and_repaired(store_path: Path) -> None:
    """A STORE file damaged into another chunk size that is still valid (one flipped bit: 8 KiB for 4 KiB) parses:
    before, nothing noticed, a repair kept it, and every later save cut chunks of the wrong size, deduplicating
    nothing against the checkpoints before. verify reports every checkpoint whose manifest names another chunk
    size, a save refuses before it writes anything (a keyframe save and one with deltas off too, which read no
    delta parent), and a repair writes STORE again from the manifests."""
    filled = _fill(store_path)
    text = (store_path / "STORE").read_text()
    (store_path / "STORE").write_text(text.replace(f'"chunk_size": {CS}', f'"chunk_size": {CS * 2}'))
    before = dir_snapshot(store_path)
    with deltackpt.Store(store_path) as s:
        assert s.chunk_size == CS * 2
        problems = s.verify().problems
        assert {p.step for p in problems} == {1, 3, 4}
        assert all(f"chunk size {CS}" in p.message and "deltackpt repair" in p.message for p in problems)
        with pytest.raises(deltackpt.DeltackptError, match="STORE is damaged"):
            s.save(filled["states"][4], step=5)
        with pytest.raises(deltackpt.DeltackptError, match="STORE is damaged"):  # (reads no delta parent)
            s.save(filled["states"][4], step=5, keyframe=True)
    with deltackpt.Store(store_path, max_chain=0) as s, \
            pytest.raises(deltackpt.DeltackptError, match="STORE is damaged"):
        s.save(filled["states"][4], step=5)
    unchanged = {k: v for k, v in dir_snapshot(store_path).items() if k != "index/lock.mdb"}
    assert unchanged == {k: v for k, v in before.items() if k != "index/lock.mdb"}
    with maintenance.open_for_repair(store_path) as s:
        s.repair()
    assert len(list(store_path.glob("STORE.broken-*"))) == 1
    with _open(store_path) as s:
        assert s.chunk_size == CS
        assert s.save(filled["states"][4], step=6).written_bytes == 0  # deduplicates again
        s.delete(6)
        _check_repaired(s, filled)


def test_repair_parses_each_manifest_once(store_path: Path) -> None:
    """open_for_repair checks the STORE file against the chunk size the manifests name, and parsed every manifest
    for it, before the repair parsed each again (10,000 parses for 5,000 manifests). An intact STORE file is now
    kept once one readable manifest agrees with it; a damaged one is still found (the tests above)."""
    with deltackpt.Store(store_path, chunk_size=CS) as s:
        for step in range(12):
            s.save({"x": torch.full((64,), float(step))}, step=step)
    with mock.patch.object(manifest, "parse", wraps=manifest.parse) as parse:
        with maintenance.open_for_repair(store_path) as s:
            report = s.repair()
    assert report.checkpoints == 12 and not report.lost_checkpoints
    assert parse.call_count <= 12 + 1, parse.call_count  # (24 before)
    with _open(store_path) as s:
        assert [c.step for c in s.list()] == list(range(12))


@pytest.mark.parametrize("keep", [0.5, 4096 + 100])  # half the file; only the meta pages and a few bytes
def test_truncated_index_is_a_typed_error_and_repaired(store_path: Path, keep: float) -> None:
    """A data.mdb shorter than its meta page says (a torn copy) made LMDB read past the end of its map: SIGBUS
    killed every process that opened the store, the repair included. Opening now raises CorruptIndexError naming
    the truncation, and the repair (a real `deltackpt repair` process) rebuilds the index."""
    filled = _fill(store_path)
    data = store_path / "index" / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, int(size * keep) if keep < 1 else int(keep))
    probe = subprocess.run([sys.executable, "-c", f"import deltackpt; deltackpt.Store({str(store_path)!r}).list()"],
                           capture_output=True, text=True)
    assert probe.returncode == 1 and "CorruptIndexError" in probe.stderr and "truncated" in probe.stderr, probe
    cli = subprocess.run([sys.executable, "-m", "deltackpt", "ls", str(store_path)], capture_output=True, text=True)
    assert cli.returncode == 1 and "deltackpt repair" in cli.stderr
    cli = subprocess.run([sys.executable, "-m", "deltackpt", "repair", str(store_path)], capture_output=True,
                         text=True)
    assert cli.returncode == 0, cli
    with _open(store_path) as s:
        _check_repaired(s, filled)


def test_repair_elsewhere_while_a_handle_is_open_loses_no_later_save(store_path: Path) -> None:
    """A repair (another process) moves a damaged index aside while this process has the store open. The open
    handle follows it to the rebuilt index: its next save is seen by other processes and survives their gc.
    Before, it committed into the moved-aside index, and the next gc removed its manifest as an orphan."""
    filled = _fill(store_path)
    s = _open(store_path)
    s.list()
    data = store_path / "index" / "data.mdb"
    raw = data.read_bytes()
    first = filled["infos"][1].id
    with open(data, "r+b") as f:  # every copy of checkpoint 1's record is garbled: the index is damaged
        pos = raw.find(f'{{"id":"{first}"'.encode())
        while pos >= 0:
            f.seek(pos)
            f.write(b"[")
            pos = raw.find(f'{{"id":"{first}"'.encode(), pos + 1)
    run = [sys.executable, "-m", "deltackpt"]
    assert subprocess.run([*run, "repair", str(store_path)], capture_output=True).returncode == 0
    later = s.save({"w": torch.full((3000,), 5.0)}, step=5)
    listed = subprocess.run([*run, "ls", str(store_path)], capture_output=True, text=True)
    assert later.id in listed.stdout, listed
    assert subprocess.run([*run, "gc", str(store_path)], capture_output=True).returncode == 0
    s.close()
    with _open(store_path) as again:
        assert torch.equal(again.load(id=later.id)["w"], torch.full((3000,), 5.0))
        assert_same_state(filled["states"][4], again.load(4))
        assert again.verify().ok


def _killed_at_commit(path: Path, state: dict[str, torch.Tensor], step: int, parent: str) -> None:
    """A save in a child process that dies at the commit point (its frames and manifest are durable), after a
    committed save of other data into the same pack, so that pack stays live."""
    pid = os.fork()
    if pid == 0:
        try:
            with deltackpt.Store(path) as a:
                a.save({"other": _rand(4 * CS, 99)}, step=100, parent=parent)
                a.index.commit_checkpoint = lambda *args, **kwargs: os._exit(0)  # type: ignore[method-assign]
                a.save(state, step=step, parent=parent)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, "the child should have died at its commit"


@pytest.mark.parametrize("trial", range(4))  # the packs' random names decide which frame a scan meets first
def test_repair_chooses_a_frame_whose_base_is_there(store_path: Path, trial: int) -> None:
    """A save killed at its commit leaves durable delta frames against its parent. The chunks are later
    committed again as deltas against another base, and gc frees the first base. Repair must index the frames
    that decode (whose base is there), not drop the chunks for the stale frames it met first."""
    v1 = _rand(8 * CS, trial)
    v2, v3 = v1.clone(), v1.clone()
    v2[::97] += 1
    v3[::89] += 2
    with _open(store_path) as s:
        c1 = s.save({"w": v1}, step=1).id
    _killed_at_commit(store_path, {"w": v3}, 3, c1)
    with _open(store_path) as s:
        c2 = s.save({"w": v2}, step=2, parent=c1, keyframe=True).id
        c3 = s.save({"w": v3}, step=3, parent=c2).id
        assert any(loc.codec == codec.DELTA for _, loc in _chunks_of(s, 3)["w"])
        s.delete(id=c1)
        s.delete(id=c2)
        s.gc()
    shutil.rmtree(store_path / "index")
    with maintenance.open_for_repair(store_path) as s:
        report = s.repair()
        assert report.incomplete_checkpoints == []
        assert torch.equal(s.load(id=c3)["w"], v3)
        assert s.verify().ok


def test_repair_interrupted_before_its_commit_leaves_the_index_lost(store_path: Path) -> None:
    """The rebuilt index becomes the store's in the rebuild's one transaction: a repair that stops before it
    (here: an exception after the packs were scanned) leaves a store that is still refused, not one that looks
    empty."""
    filled = _fill(store_path)
    shutil.rmtree(store_path / "index")
    with maintenance.open_for_repair(store_path) as s, mock.patch.object(
            maintenance, "_choose_frames", side_effect=MemoryError), pytest.raises(MemoryError):
        s.repair()
    with pytest.raises(CorruptIndexError):
        deltackpt.Store(store_path)
    with maintenance.open_for_repair(store_path) as s:
        assert s.repair().checkpoints == 3
        _check_repaired(s, filled)


def test_index_garbled_and_repaired(store_path: Path) -> None:
    filled = _fill(store_path)
    data = store_path / "index" / "data.mdb"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.write(os.urandom(min(size, 3 * 4096)))
    with pytest.raises(CorruptIndexError, match="deltackpt repair"):  # LMDB's own error, typed and explained
        deltackpt.Store(store_path)
    with maintenance.open_for_repair(store_path) as s:
        report = s.repair()
        assert report.checkpoints == 3
        _check_repaired(s, filled)


def _damage_index_entry(store_path: Path, table: str, key: bytes, new_key: bytes, value: bytes) -> None:
    """Replace the ``key`` entry of one index table by ``new_key`` -> ``value``, as one damaged byte would (a
    flipped bit in an id's seq or a step's key keeps the page valid for LMDB)."""
    import lmdb

    env = lmdb.open(str(store_path / "index"), max_dbs=8, subdir=True)
    try:
        db = env.open_db(table.encode(), create=False)
        with env.begin(write=True, db=db) as txn:
            assert txn.delete(key)
            txn.put(new_key, value)
    finally:
        env.close()


@pytest.mark.parametrize("damage", ["id_seq", "step_key", "record_step"])
def test_a_damaged_index_entry_never_hands_out_another_checkpoint(store_path: Path, damage: str) -> None:
    """An id entry leading to another checkpoint's record, a step entry moved to another step, or a record
    whose step changed: loads, info and delete raise CorruptIndexError naming what was asked for, rather than
    return (or delete) another checkpoint; verify reports it, and a repair rebuilds the index. Before, load(id=)
    and load(step=) returned the other checkpoint and verify found nothing."""
    filled = _fill(store_path)
    ids = {k: filled["infos"][k].id for k in (1, 3, 4)}
    seq = {i.id: i.seq for i in filled["infos"].values()}
    u64 = struct.Struct(">Q").pack
    if damage == "id_seq":  # checkpoint 3's id leads to checkpoint 1's record
        _damage_index_entry(store_path, "ids", ids[3].encode(), ids[3].encode(), u64(seq[ids[1]]))
        asks: list[dict[str, Any]] = [{"id": ids[3]}]
    elif damage == "step_key":  # checkpoint 4's step entry says step 3
        sk = u64(seq[ids[4]])
        _damage_index_entry(store_path, "steps", u64(4) + sk, u64(3) + sk, b"")
        asks = [{"step": 3}]
    else:  # checkpoint 3's record says step 2: its manifest says 3
        import lmdb

        env = lmdb.open(str(store_path / "index"), max_dbs=8, subdir=True)
        db = env.open_db(b"ckpts", create=False)
        with env.begin(write=True, db=db) as txn:
            raw = txn.get(u64(seq[ids[3]]))
            txn.put(u64(seq[ids[3]]), raw.replace(b'"step":3', b'"step":2'))
        env.close()
        asks = [{"id": ids[3]}]
    before = dir_snapshot(store_path)
    with _open(store_path) as s:
        for ask in asks:
            with pytest.raises(CorruptIndexError, match=f"{list(ask.values())[0]}.*deltackpt repair"):
                s.load(**ask)
            if damage != "record_step":  # (info and delete read the record alone: its id is right)
                with pytest.raises(CorruptIndexError):
                    s.info(**ask)
                with pytest.raises(CorruptIndexError):
                    s.delete(**ask)
        report = s.verify()
        assert not report.ok and any(ids[3 if damage != "step_key" else 4] in str(p) for p in report.problems)
    assert dir_snapshot(store_path) == before
    cli = subprocess.run([sys.executable, "-m", "deltackpt", "verify", str(store_path)], capture_output=True,
                         text=True)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr
    with _open(store_path) as s:
        s.repair()
        _check_repaired(s, filled)


def test_repair_reports_checkpoints_whose_chunks_are_gone(store_path: Path) -> None:
    a, d = _rand(2 * CS, 0), _rand(2 * CS, 1)
    with _open(store_path) as s:
        id1 = s.save({"a": a}, step=1).id
    with _open(store_path) as s:
        id2 = s.save({"a": a, "d": d}, step=2).id
        (pack_d,) = {loc.pack_id for _, loc in _chunks_of(s, 2)["d"]}
    (store_path / "packs" / f"{pack_d}.pack").unlink()
    shutil.rmtree(store_path / "index")
    with maintenance.open_for_repair(store_path) as s:
        report = s.repair()
        assert report.lost_checkpoints == [] and report.incomplete_checkpoints == [id2]
        assert [i.id for i in s.list()] == [id1, id2]  # as before the index was lost
        assert torch.equal(s.load(1)["a"], a)
        with pytest.raises(CorruptChunkError, match=f"checkpoint {id2}.*'d'"):
            s.load(2)
        assert s.load_into({"a": torch.empty_like(a)}, step=2, strict=False) == []  # what survived still loads
        s.gc()  # frees nothing the damage did not take: "a" of checkpoint 2 stays
        assert {p.key for p in s.verify().problems} == {"d"}
        target = {"a": torch.empty_like(a)}
        s.load_into(target, step=2, strict=False)
        assert torch.equal(target["a"], a)


def test_repair_keeps_intact_frames_after_a_damaged_one(store_path: Path, two_ckpts: dict[str, Any]) -> None:
    """One damaged frame in the middle of a pack must not cost the checkpoints that never reference it."""
    ids, chunks = two_ckpts["ids"], two_ckpts["chunks"]
    cid, loc = chunks[1]["c"][0]  # only checkpoint 1 references "c"; "d" (checkpoint 2) comes after it
    assert all(lc.offset > loc.offset for _, lc in chunks[2]["d"])
    _flip(_pack_path(store_path, loc), loc.offset + codec.HEADER_SIZE + 5)
    shutil.rmtree(store_path / "index")
    with maintenance.open_for_repair(store_path) as s:
        report = s.repair()
        assert report.incomplete_checkpoints == [ids[1]]
        assert [i.id for i in s.list()] == [ids[1], ids[2], ids[3]]
        with pytest.raises(CorruptChunkError, match=cid):
            s.load(1)
        assert_same_state(two_ckpts["states"][2], s.load(2))
        assert_same_state(two_ckpts["states"][3], s.load(3))


# -- frames: codec level -----------------------------------------------------------------------------------


def _frames() -> dict[str, tuple[bytes, bytes]]:
    """(frame, raw) for each codec."""
    enc = codec.Encoder(1)
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()
    text = b"deltackpt " * 100
    floats = rng.standard_normal(256).astype(np.float32).tobytes()
    base = bytes(floats)
    near = bytearray(floats)
    near[100] ^= 1
    near = bytes(near)
    out = {
        "raw": (enc.encode(noise, kernel.digest(noise), 1), noise),
        "zstd": (enc.encode(text, kernel.digest(text), 1), text),
        "planes": (enc.encode(floats, kernel.digest(floats), 4), floats),
        "delta": (enc.encode(near, kernel.digest(near), 4, base=base, base_digest=kernel.digest(base)), near),
    }
    for name, want in (("raw", codec.RAW), ("zstd", codec.ZSTD), ("planes", codec.PLANES_ZSTD),
                       ("delta", codec.DELTA)):
        assert codec.parse_header(out[name][0]).codec == want, name
    return out


FRAMES = _frames()


def _decode(frame: bytes, raw: bytes, **kw: Any) -> memoryview:
    h = codec.parse_header(frame) if len(frame) >= codec.HEADER_SIZE else None
    base = None
    if h is not None and h.codec == codec.DELTA:
        base = FRAMES["planes"][1]
    return codec.decode(frame, base=base, **kw)


@pytest.mark.parametrize("name", list(FRAMES))
def test_frames_decode(name: str) -> None:
    frame, raw = FRAMES[name]
    assert bytes(_decode(frame, raw)) == raw
    out = np.empty(len(raw), np.uint8)
    _decode(frame, raw, out=out, expect_digest=kernel.digest(raw), expect_len=len(raw))
    assert out.tobytes() == raw


@pytest.mark.parametrize("name", list(FRAMES))
def test_truncated_frames(name: str) -> None:
    frame, raw = FRAMES[name]
    for n in [0, 1, 10, 56, 63, 64, 65, len(frame) // 2, len(frame) - 1]:
        with pytest.raises(CorruptChunkError):
            _decode(frame[:n], raw)


@pytest.mark.parametrize("name", list(FRAMES))
@given(data=st.data())
def test_garbled_frames(name: str, data: st.DataObject) -> None:
    frame, raw = FRAMES[name]
    pos = data.draw(st.integers(0, len(frame) - 1).filter(lambda p: p != 4), label="pos")
    mask = data.draw(st.integers(1, 255), label="mask")
    bad = bytearray(frame)
    bad[pos] ^= mask
    with pytest.raises(CorruptChunkError):
        _decode(bytes(bad), raw)
    with pytest.raises(CorruptChunkError):
        _decode(bytes(bad), raw, verify=False)


def test_garbled_version_byte_is_an_error() -> None:
    frame, raw = FRAMES["zstd"]
    bad = bytearray(frame)
    bad[4] ^= 0x02
    with pytest.raises(deltackpt.DeltackptError):
        _decode(bytes(bad), raw)


def test_wrong_chunk_expected() -> None:
    frame, raw = FRAMES["zstd"]
    with pytest.raises(CorruptChunkError):
        codec.decode(frame, expect_digest=bytes(16), expect_len=len(raw))
    with pytest.raises(CorruptChunkError):
        codec.decode(frame, expect_digest=kernel.digest(raw), expect_len=len(raw) + 1)


def test_a_predicted_frame_of_another_width_is_damage() -> None:
    """Predicted frames are of float32 state and have width 4 (format.md §3): one whose header says 2 (checksum
    made to match) is refused before it is decoded, rather than its residual merged as 16-bit planes."""
    floats = np.random.default_rng(1).standard_normal(64).astype(np.float32).tobytes()
    digest = kernel.digest(floats)
    record = struct.pack("<BBHI", 1, 2, 4, 0) + digest + digest + struct.pack("<4d", 0.5, 1.0, 0.5, 1.0)
    frame = bytearray(codec.Encoder(1).encode_predicted(floats, digest, 4, bytes(len(floats)), digest, record))
    assert codec.parse_header(frame).width == 4
    frame[6] = 2
    struct.pack_into("<Q", frame, 56, xxhash.xxh3_64(bytes(frame[:56]) + bytes(frame[64:])).intdigest())
    with pytest.raises(CorruptChunkError, match="width 2"):
        codec.parse_header(frame)


@pytest.mark.parametrize("damage", ["flag bit", "version", "version 3"])
def test_manifest_reserved_flags_and_a_version_below_its_nodes_are_damage(store_path: Path, damage: str) -> None:
    """A chunk flag with a reserved bit set, or a manifest whose skeleton holds version-2 nodes (a set) while its
    header says version 1, or module versions (version 3) while it says 2, is damage (format.md §5), checksums
    made to match: all were read as if valid (the module versions dropped)."""
    from deltackpt import manifest

    state: dict[str, Any] = {"w": torch.ones(5000), "tags": {"a", "b"}}
    if damage == "version 3":
        state["model"] = torch.nn.Linear(2, 2).state_dict()
    with _open(store_path) as s:
        info = s.save(state, step=1)
    mpath = store_path / "manifests" / f"{info.id}.manifest"
    raw = bytearray(mpath.read_bytes())
    assert struct.unpack_from("<I", raw, 8)[0] == (3 if damage == "version 3" else 2)
    if damage.startswith("version"):
        struct.pack_into("<I", raw, 8, 2 if damage == "version 3" else 1)
    else:
        raw[-17] |= 0x04  # the last chunk's flags
    body = bytes(raw[:-16])
    damaged = body + xxhash.xxh3_128_digest(body)
    mpath.write_bytes(damaged)
    _set_record(store_path, 1, lambda r: r.update(manifest_checksum=manifest.checksum_of(damaged)))
    with _open(store_path) as s:
        what = {"flag bit": "reserved bit", "version": "version-2 nodes", "version 3": "version-3 nodes"}[damage]
        with pytest.raises(CorruptManifestError, match=what):
            s.load(1)
        assert any(what in p.message for p in s.verify().problems)


@pytest.mark.parametrize("codec_id", [codec.RAW, codec.ZSTD, codec.PLANES_ZSTD])
def test_valid_checksum_wrong_digest(codec_id: int) -> None:
    raw = b"0123456789abcdef" * 64
    other = b"fedcba9876543210" * 64
    payload = other if codec_id == codec.RAW else zstandard.ZstdCompressor().compress(other)
    frame = codec._frame(codec_id, 1 if codec_id != codec.PLANES_ZSTD else 2, len(raw), kernel.digest(raw),
                         codec.NO_BASE, payload)
    codec.check_frame(frame, expect_digest=kernel.digest(raw), expect_len=len(raw))  # checksum is fine
    with pytest.raises(CorruptChunkError, match="do not match"):
        codec.decode(frame, expect_digest=kernel.digest(raw), expect_len=len(raw))
    assert len(codec.decode(frame, verify=False)) == len(raw)  # without verify it cannot be seen


def _no_big_allocation(fn: Any, limit: int = 2 << 20) -> None:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(CorruptChunkError):
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"decoding a damaged frame allocated {peak} bytes"
    assert time.perf_counter() - t0 < 2.0


BOMB_SIZE = 200 << 20  # what the payload would expand to


@pytest.fixture(scope="module")
def bomb() -> bytes:
    cctx = zstandard.ZstdCompressor(level=1)
    chunks = cctx.compressobj(size=BOMB_SIZE)
    zero = bytes(1 << 20)
    parts = [chunks.compress(zero) for _ in range(BOMB_SIZE >> 20)]
    payload = b"".join(parts) + chunks.flush()
    assert zstandard.get_frame_parameters(payload).content_size == BOMB_SIZE
    return payload


def test_zstd_bomb_declared_larger_than_frame(bomb: bytes) -> None:
    digest = kernel.digest(bytes(16))
    frame = codec._frame(codec.ZSTD, 1, 16, digest, codec.NO_BASE, bomb)
    _no_big_allocation(lambda: codec.decode(frame))
    _no_big_allocation(lambda: codec.decode(frame, expect_digest=digest, expect_len=16, verify=False))
    planes = codec._frame(codec.PLANES_ZSTD, 4, 16, digest, codec.NO_BASE, bomb)
    _no_big_allocation(lambda: codec.decode(planes))


def test_zstd_payload_without_content_size() -> None:
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=False)
    obj = cctx.compressobj()
    payload = b"".join(obj.compress(bytes(1 << 20)) for _ in range(50)) + obj.flush()  # 50 MB of zeros
    assert zstandard.get_frame_parameters(payload).content_size in (0, 2**64 - 1)
    for raw_len in (0, 16, 4096):
        raw = bytes(raw_len)
        frame = codec._frame(codec.ZSTD, 1, raw_len, kernel.digest(raw), codec.NO_BASE, payload)
        _no_big_allocation(lambda frame=frame: codec.decode(frame))


def test_zstd_payload_smaller_than_declared() -> None:
    raw = bytes(range(256)) * 16
    payload = zstandard.ZstdCompressor().compress(raw[:100])
    frame = codec._frame(codec.ZSTD, 1, len(raw), kernel.digest(raw), codec.NO_BASE, payload)
    with pytest.raises(CorruptChunkError):
        codec.decode(frame)
    zstd_magic = b"\x28\xb5\x2f\xfd"
    garbage = codec._frame(codec.ZSTD, 1, len(raw), kernel.digest(raw), codec.NO_BASE, zstd_magic + bytes(40))
    with pytest.raises(CorruptChunkError):
        codec.decode(garbage)


def test_frame_declaring_huge_raw_length() -> None:
    frame = bytearray(FRAMES["zstd"][0])
    struct.pack_into("<Q", frame, 8, 1 << 40)
    _no_big_allocation(lambda: codec.decode(bytes(frame)))
    struct.pack_into("<Q", frame, 8, codec.MAX_RAW)  # allowed by the header, contradicted by the payload
    head = bytes(frame[: codec.CHECKED])
    frame[56:64] = struct.pack("<Q", codec.frame_checksum(head, bytes(frame[64:])))
    _no_big_allocation(lambda: codec.decode(bytes(frame), expect_len=len(FRAMES["zstd"][1])))


# -- delta chains ------------------------------------------------------------------------------------------


def _nudged_history(store: deltackpt.Store, n: int) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8 * CS // 4, generator=g)
    out = {}
    for step in range(1, n + 1):
        x = x.clone()
        x[:: CS // 16] += 0.01 * step  # a few elements of every chunk
        out[step] = {"x": x, "other": torch.arange(3000) + step * 0}
        store.save(out[step], step=step)
    return out


def test_damaged_delta_base_breaks_its_dependents(store_path: Path) -> None:
    with _open(store_path) as s:
        history = _nudged_history(s, 3)
        ids = {i.step: i.id for i in s.list()}
        chunks = {step: _chunks_of(s, step) for step in (1, 2, 3)}
        all_locs = dict(s.index.iter_chunks())
    hex_of = {codec.chunk_hex(k[:16], int.from_bytes(k[16:], "big")): k for k in all_locs}
    deltas = [(cid, loc) for cid, loc in chunks[2]["x"] if loc.codec == codec.DELTA]
    assert deltas, "the test needs a delta chunk"
    dep_cid, dep_loc = deltas[0]
    base_key = dep_loc.base + hex_of[dep_cid][16:]
    base_loc = all_locs[base_key]
    base_cid = codec.chunk_hex(base_key[:16], int.from_bytes(base_key[16:], "big"))
    _flip(_pack_path(store_path, base_loc), base_loc.offset + base_loc.frame_len - 3)

    def broken(k: bytes) -> bool:  # the damaged chunk, or one whose delta chain reaches it
        while True:
            if k == base_key:
                return True
            loc = all_locs[k]
            if loc.codec != codec.DELTA:
                return False
            k = loc.base + k[16:]

    expected = {(ids[step], key, cid) for step in (1, 2, 3) for key, lst in chunks[step].items()
                for cid, _ in lst if broken(hex_of[cid])}
    assert (ids[2], "x", dep_cid) in expected
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError) as ei:
            s.load(2)
        assert ei.value.checkpoint == ids[2] and ei.value.key == "x"
        assert ei.value.chunk_id in {cid for (ck, _, cid) in expected if ck == ids[2]}
        assert _problems(s.verify()) == expected
        assert {key for _, key, _ in expected} == {"x"}
        for step in (1, 2, 3):
            if not any(ck == ids[step] for ck, _, _ in expected):
                assert_same_state(history[step], s.load(step))
        assert base_cid in {cid for _, _, cid in expected}


def test_damaged_parent_does_not_spread_into_new_saves(store_path: Path) -> None:
    with _open(store_path) as s:
        history = _nudged_history(s, 2)
        chunks = _chunks_of(s, 2)["x"]
    for _, loc in chunks:  # every chunk of the parent's "x" is damaged
        _flip(_pack_path(store_path, loc), loc.offset + loc.frame_len - 1)
    with _open(store_path) as s:  # a new handle: no cached bases, they must be read from the packs
        x = history[2]["x"].clone()
        x[::100] -= 1.0
        state = {"x": x, "other": torch.arange(3000)}
        info = s.save(state, step=3)
        assert info.parent == s.info(2).id
        assert_same_state(state, s.load(3))
        assert s.verify(step=3).ok
        with pytest.raises(CorruptChunkError):
            s.load(2)


@pytest.mark.parametrize("damage", ["payload", "header", "tail_lost"])
def test_gc_leaves_a_sparse_pack_with_a_damaged_live_frame_and_goes_on(store_path: Path, damage: str) -> None:
    """Repacking copies live frames; a damaged one is not copied (the damage would spread into the new pack)
    and does not fail gc either: that pack stays as it is, named in the report, while everything else gc does
    (dropping dead chunks) is done. The checkpoint that needs the frame still reports the damage; the others
    still load. A pack that lost its tail, live frames with it, is repacked and reported the same way (before,
    its lost frames counted as live bytes: it never looked sparse, and gc passed over it without a word)."""
    header = damage == "header"
    a, b, c = (_rand(3 * CS, seed) for seed in range(3))
    with _open(store_path) as s:
        s.save({"a": a}, step=1)
        s.save({"a": a, "b": b}, step=2)
    with _open(store_path) as s:  # (c in a pack of its own)
        s.save({"c": c}, step=3)
        s.delete(step=2)  # b's chunks die: the pack is sparse
        (_, loc), *_ = _chunks_of(s, 1)["a"]
        if damage == "tail_lost":  # the pack ends inside a's first frame: its later frames are gone too
            loc = max((c[1] for c in _chunks_of(s, 1)["a"]), key=lambda loc: loc.offset)
    if damage == "tail_lost":
        os.truncate(_pack_path(store_path, loc), loc.offset + 10)
    else:
        _flip(_pack_path(store_path, loc), loc.offset + loc.frame_len - 1)
    if header:  # garbage over the header that reads as an unknown version (the length is out of range too)
        with open(_pack_path(store_path, loc), "r+b") as f:
            f.seek(loc.offset + 4)
            f.write(b"\xff" * 20)
    with _open(store_path) as s:
        report = s.gc(repack_below=0.99)
        assert report.dead_chunks == 3 and report.repacked_packs == 0
        assert len(report.damaged_packs) == 1 and loc.pack_id in report.damaged_packs[0]
        assert _pack_path(store_path, loc).exists()
        assert_same_state({"c": c}, s.load(3))
        with pytest.raises(CorruptChunkError if not header else deltackpt.FormatVersionError):
            s.load(1)
        assert not s.verify().ok
    cli = subprocess.run([sys.executable, "-m", "deltackpt", "gc", "--repack-below", "0.99", str(store_path)],
                         capture_output=True, text=True)
    assert cli.returncode == 1 and "a live frame is damaged" in cli.stderr, cli.stderr


def _evolving_store(store_path: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 1-4 of a slowly changing tensor saved by one handle (delta frames), step 5 by another (its own
    pack); step 1 deleted, so its chunks live on only as the bases of step 2's deltas."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4 * CS // 4, generator=g)
    states = {}
    with _open(store_path) as s:
        for step in range(1, 5):
            w = w + 1e-4 * torch.randn(w.shape, generator=g)
            states[step] = {"w": w.clone()}
            s.save(states[step], step=step)
    with _open(store_path) as s:
        states[5] = {"w": torch.randn(3 * CS // 4, generator=g)}
        s.save(states[5], step=5)
        s.delete(1)
    del states[1]
    return states


def _edit_index(store_path: Path, table: str, edit: Any) -> None:
    """Apply ``edit(txn, db)`` to one table of the index, as damage the index cannot notice (LMDB keeps no
    checksum of values)."""
    import lmdb

    env = lmdb.open(str(store_path / "index"), max_dbs=8, subdir=True)
    try:
        db = env.open_db(table.encode(), create=False)
        with env.begin(write=True, db=db) as txn:
            edit(txn, db)
    finally:
        env.close()


def test_an_index_frame_length_longer_than_its_frame_is_damage(store_path: Path) -> None:
    """An index entry whose frame length exceeds the frame's 64 + S (format.md §6), the frame not at the pack's end:
    load and verify name the chunk as damaged. Before, the read took the next frame's first bytes along and
    decoded as if nothing were wrong."""
    with _open(store_path) as s:
        s.save({"a": _rand(3 * CS, 1), "b": _rand(3 * CS, 2)}, step=1)
        cid, loc = min((c for cs in _chunks_of(s, 1).values() for c in cs), key=lambda c: c[1].offset)
    key = bytes.fromhex(cid[:32]) + struct.pack(">I", int(cid[33:]))

    def edit(txn: Any, db: Any) -> None:
        value = bytearray(txn.get(key))
        struct.pack_into("<I", value, 24, loc.frame_len + 8)
        txn.put(key, bytes(value))

    _edit_index(store_path, "chunks", edit)
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError, match="were expected") as exc:
            s.load(1)
        assert exc.value.chunk_id == cid
        assert cid in {p.chunk_id for p in s.verify().problems}


@pytest.mark.parametrize("offset", [0, 8, 15])
def test_an_index_offset_inside_the_pack_header_is_index_damage(store_path: Path, offset: int) -> None:
    """An index entry whose offset points into the pack's 16-byte header (no frame starts there, format.md §6)
    is refused as a damaged index entry naming the chunk and the repair, as an offset past 2^62 is. Before, the
    read went ahead and failed on the frame's magic, a chunk's damage rather than the index's."""
    with _open(store_path) as s:
        s.save({"a": _rand(3 * CS, 1)}, step=1)
        cid, _ = min((c for cs in _chunks_of(s, 1).values() for c in cs), key=lambda c: c[1].offset)
    key = bytes.fromhex(cid[:32]) + struct.pack(">I", int(cid[33:]))

    def edit(txn: Any, db: Any) -> None:
        value = bytearray(txn.get(key))
        struct.pack_into("<Q", value, 16, offset)
        txn.put(key, bytes(value))

    _edit_index(store_path, "chunks", edit)
    with _open(store_path) as s:
        with pytest.raises(CorruptIndexError, match=f"index entry of chunk {cid} is damaged .*repair"):
            s.load(1)


@pytest.mark.parametrize("damage", ["entries_lost", "pack_id_field", "base_field", "codec_field", "record_lost"])
def test_gc_on_a_damaged_index_frees_nothing_a_checkpoint_needs(store_path: Path, damage: str) -> None:
    """gc trusts the index to say what is live; where the index is damaged it must not free a chunk a retained
    checkpoint needs. Live chunks whose entries were lost while their pack is still there, or name a pack that
    does not exist (one bit flipped in the pack id), or a checkpoint record lost while its id still names it,
    make gc refuse (CorruptIndexError, naming the repair) before it changes anything; an entry naming another
    delta base (or no base) than its frame does makes gc keep both. Afterwards every checkpoint loads (after a
    repair where gc refused). Before, gc deleted the pack of the unindexed chunks (and the pack whose chunks'
    entries name a missing pack), the manifest of the lost record, and the base the frame really needs."""
    states = _evolving_store(store_path)
    with _open(store_path) as s:
        entries = list(s.index.iter_chunks())
        seq3 = s.info(step=3).seq
    newest_pack = max({loc.pack_id for _, loc in entries},
                      key=lambda p: (store_path / "packs" / f"{p}.pack").stat().st_mtime_ns)
    deltas = [(k, loc) for k, loc in entries if loc.codec == codec.DELTA]
    assert deltas, "the store has no delta frame to damage"

    def edit(txn: Any, db: Any) -> None:
        if damage == "entries_lost":
            for k, loc in entries:
                if loc.pack_id == newest_pack:
                    assert txn.delete(k)
        elif damage == "record_lost":
            assert txn.delete(struct.pack(">Q", seq3))
        elif damage == "pack_id_field":
            flipped = f"{int(newest_pack[:2], 16) ^ 1:02x}{newest_pack[2:]}"
            for k, loc in entries:
                if loc.pack_id == newest_pack:
                    txn.put(k, ChunkLoc(flipped, loc.offset, loc.frame_len, loc.codec, loc.depth, loc.base).pack())
        else:
            for k, loc in deltas:
                base = bytes([loc.base[0] ^ 1]) + loc.base[1:] if damage == "base_field" else bytes(16)
                kind = loc.codec if damage == "base_field" else codec.PLANES_ZSTD
                txn.put(k, ChunkLoc(loc.pack_id, loc.offset, loc.frame_len, kind, 0, base).pack())

    _edit_index(store_path, "ckpts" if damage == "record_lost" else "chunks", edit)
    before = dir_snapshot(store_path)
    with _open(store_path) as s:
        if damage in ("entries_lost", "pack_id_field", "record_lost"):
            with pytest.raises(CorruptIndexError, match="deltackpt repair"):
                s.gc(repack_below=1.0)
            assert dir_snapshot(store_path) == before
            s.repair()
        else:
            report = s.verify()
            assert {p.chunk_id for p in report.problems} == {
                codec.chunk_hex(k[:16], int.from_bytes(k[16:], "big")) for k, _ in deltas}
            assert all(p.checkpoint is None and "deltackpt repair" in p.message for p in report.problems)
            s.gc(repack_below=1.0)  # repacks everything: only what gc kept survives
        for step, state in states.items():
            assert_same_state(state, s.load(step))
        s.repair()
        assert s.verify().ok


def _flip_older_meta_txnid(store_path: Path) -> None:
    """Flip one bit (bit 32) of the transaction number in the older of LMDB's two meta pages: LMDB keeps no
    checksum of them and opens the snapshot of the meta page with the larger number, the one before the last
    commit."""
    path = store_path / "index" / "data.mdb"
    raw = bytearray(path.read_bytes())
    page = struct.unpack_from("<I", raw, 40)[0]  # the main meta page's free-list db record holds the page size
    txnid = [struct.unpack_from("<Q", raw, n * page + 144)[0] for n in (0, 1)]
    older = 0 if txnid[0] < txnid[1] else 1
    raw[older * page + 144 + 4] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["older_copy", "meta_page_bit"])
def test_an_index_older_than_the_store_is_refused_and_repaired(store_path: Path, damage: str) -> None:
    """An index that lacks the newest commits looks consistent: an ``index/`` restored from an older copy of the
    store, or one bit flipped in the older LMDB meta page's transaction number (LMDB then reads the snapshot
    before the last commit). Every open and every operation of a handle opened before refuses it
    (CorruptIndexError naming the repair), nothing on disk changes, and a repair restores every checkpoint.
    Before, list() lacked the newer checkpoints, verify passed, and gc deleted their manifests as orphans of
    crashed saves, after which no repair could bring them back."""
    g = torch.Generator().manual_seed(11)
    states = {}
    w = torch.randn(2 * CS // 4, generator=g)
    with _open(store_path) as s:
        for step in (1, 2):
            w = w + 0.01 * torch.randn(w.shape, generator=g)
            states[step] = {"w": w.clone(), "n": step}
            s.save(states[step], step=step)
    copy = store_path.parent / "index-copy"
    shutil.copytree(store_path / "index", copy)
    with _open(store_path) as s:
        for step in (3, 4):
            w = w + 0.01 * torch.randn(w.shape, generator=g)
            states[step] = {"w": w.clone(), "n": step}
            s.save(states[step], step=step)
    assert (store_path / "LAST_COMMIT").read_text() == f"{4:020d}\n"
    early = _open(store_path) if damage == "older_copy" else None  # opened while the index was intact
    if damage == "older_copy":
        shutil.rmtree(store_path / "index")
        shutil.copytree(copy, store_path / "index")
    else:  # (with no handle open: one that is keeps reading the newest snapshot, which LMDB's lock file names)
        _flip_older_meta_txnid(store_path)
    before = dir_snapshot(store_path)
    with pytest.raises(CorruptIndexError, match="older than the store.*deltackpt repair") as refused:
        _open(store_path)
    assert refused.value.__context__ is None  # (one error, not printed as raised while handling another)
    with pytest.raises(CorruptIndexError, match="older than the store"):
        deltackpt.Store(store_path, readonly=True)
    if early is not None:  # it follows the replaced index/ (as after a repair), and finds it older
        for op in (early.list, early.latest, lambda: early.load(2), lambda: early.save({"w": w}, step=5),
                   early.gc, lambda: early.delete(1)):
            with pytest.raises(CorruptIndexError, match="older than the store"):
                op()
        early.close()
    unchanged = {k: v for k, v in dir_snapshot(store_path).items() if k != "index/lock.mdb"}  # (LMDB's reader table)
    assert unchanged == {k: v for k, v in before.items() if k != "index/lock.mdb"}
    with maintenance.open_for_repair(store_path) as r:
        report = r.repair()
    assert not report.lost_checkpoints and not report.incomplete_checkpoints
    with _open(store_path) as s:
        assert [c.step for c in s.list()] == [1, 2, 3, 4]
        for step, state in states.items():
            assert_same_state(state, s.load(step))
        s.save({"w": w + 1, "n": 5}, step=5)
        assert s.verify().ok
    assert (store_path / "LAST_COMMIT").read_text() == f"{5:020d}\n"


def test_a_repair_never_lowers_last_commit(store_path: Path) -> None:
    """A repair numbers the records it restores 1..n; after deletes n is below the seq LAST_COMMIT holds. Lowering
    the file after the rebuild (as the first version did) raised the "older than the store" error at stores that
    were healthy: an open that had read the file before the rebuild, a repair killed before it wrote the file,
    a power loss that kept the file's old value. The rebuilt index's seq now counts on from the file's value,
    which stays; the next save takes the seq after it."""
    with _open(store_path) as s:
        for step in range(1, 6):
            s.save({"w": _rand(CS, step)}, step=step)
        s.delete(2)
        s.delete(4)
    assert (store_path / "LAST_COMMIT").read_text() == f"{5:020d}\n"
    with maintenance.open_for_repair(store_path) as r:
        r.repair()
        assert [i.seq for i in r.list()] == [1, 2, 3]
    assert (store_path / "LAST_COMMIT").read_text() == f"{5:020d}\n"
    # what a kill or a power loss between the rebuild and its write of the file could leave: the old value
    (store_path / "LAST_COMMIT").write_text(f"{5:020d}\n")
    with _open(store_path) as s:
        assert [i.step for i in s.list()] == [1, 3, 5]
        assert s.save({"w": _rand(CS, 6)}, step=6).seq == 6
        assert_same_state({"w": _rand(CS, 5)}, s.load(5))
    assert (store_path / "LAST_COMMIT").read_text() == f"{6:020d}\n"


# -- damage that keeps every checksum: fields of the wrong type or range ---------------------------------------
# LMDB keeps no checksum of values, and a manifest's checksum only proves that its writer wrote it. Whatever a
# field holds, every operation either works or raises a DeltackptError naming the damage: no AttributeError,
# OverflowError, struct.error or RecursionError out of the store, and nothing freed on the strength of it.

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def varied_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two checkpoints of a state with tensors of two kinds and plain values of many skeleton node kinds."""
    from collections import deque

    path = tmp_path_factory.mktemp("varied") / "store"
    g = torch.Generator().manual_seed(3)
    with _open(path) as s:
        for step in (1, 2):
            s.save({"w": torch.randn(3000, generator=g), "n": np.arange(10, dtype=">i4"), "dt": torch.float16,
                    "dv": torch.device("cpu"), "sz": torch.Size([2, 3]), "q": deque([1, 2], maxlen=5),
                    "ns": np.float32(1.5), "b": b"xy", "t": (1, "a", None), "f": 0.25},
                   step=step, metadata={"loss": 1.5, "tags": ["a"]})
    return path


def _exercise(path: Path, step: int = 2) -> None:
    """Every read and gc on the store at ``path``: each works or raises a DeltackptError."""
    for op in ("list", "info", "manifest", "skeleton", "load", "verify", "gc"):
        try:
            with deltackpt.Store(path, threads=1) as s:
                if op == "list":
                    s.list()
                elif op == "info":
                    s.info(step)
                elif op == "manifest":
                    s.manifest(step)
                elif op == "skeleton":
                    s.manifest(step).skeleton()
                elif op == "load":
                    s.load(step)
                elif op == "verify":
                    s.verify()
                else:
                    s.gc()
        except deltackpt.DeltackptError:
            pass


def _set_record(path: Path, step: int, edit: Any) -> None:
    """``edit(record dict)`` on the index record of the checkpoint at ``step``."""
    import json

    def apply(txn: Any, db: Any) -> None:
        for k, v in list(txn.cursor()):
            r = json.loads(v)
            if r["step"] == step:
                edit(r)
                txn.put(k, json.dumps(r).encode())

    _edit_index(path, "ckpts", apply)


def _edit_manifest_header(path: Path, step: int, checkpoint: str, edit: Any) -> None:
    """``edit(header dict)`` on the JSON header of checkpoint ``checkpoint``'s manifest, with the manifest's
    checksum and the index record's of it (the record of ``step``) made to match."""
    import json

    from deltackpt import manifest

    mpath = path / "manifests" / f"{checkpoint}.manifest"
    raw = mpath.read_bytes()
    head_len, n = struct.unpack_from("<QQ", raw, 16)
    header = json.loads(raw[32 : 32 + head_len])
    edit(header)
    head = json.dumps(header).encode()
    body = raw[:16] + struct.pack("<QQ", len(head), n) + head + raw[32 + head_len : -16]
    damaged = body + xxhash.xxh3_128_digest(body)
    mpath.write_bytes(damaged)
    _set_record(path, step, lambda r: r.update(manifest_checksum=manifest.checksum_of(damaged)))


def _pick(data: st.DataObject, node: Any) -> tuple[Any, Any]:
    """A (container, key) of some place inside the JSON value ``node``."""
    places: list[tuple[Any, Any]] = []

    def walk(n: Any) -> None:
        for k in range(len(n)) if isinstance(n, list) else list(n) if isinstance(n, dict) else []:
            places.append((n, k))
            walk(n[k])
    walk(node)
    return data.draw(st.sampled_from(places))


@given(data=st.data())
def test_manifest_fields_of_any_value_are_typed_errors(varied_store: Path, tmp_path_factory: pytest.TempPathFactory,
                                                      data: st.DataObject) -> None:
    """A manifest header field, tensor entry field or skeleton node replaced by any JSON value (or a field
    added), with the manifest's checksum and the index's record of it made to match."""


    path = tmp_path_factory.mktemp("m") / "store"
    shutil.copytree(varied_store, path)
    with deltackpt.Store(path) as s:
        info = s.info(2)
    value = data.draw(_JSON)
    where = data.draw(st.sampled_from(["field", "new field", "tensor", "tree"]))

    def edit(header: dict[str, Any]) -> None:
        if where == "field":
            header[data.draw(st.sampled_from(sorted(header)))] = value
        elif where == "new field":
            header[data.draw(st.text(min_size=1, max_size=5))] = value
        elif where == "tensor":
            entry = data.draw(st.sampled_from(header["tensors"]))
            entry[data.draw(st.sampled_from(sorted(entry)))] = value
        else:
            container, key = _pick(data, header["tree"])
            container[key] = value

    _edit_manifest_header(path, 2, info.id, edit)
    _exercise(path)
    with deltackpt.Store(path, threads=1) as s:  # what a load refuses as damage, verify reports
        try:
            s.load(2)
        except deltackpt.CorruptionError:
            assert not s.verify().ok
        except deltackpt.DeltackptError:
            pass


@pytest.mark.parametrize("node", ["pickle", "registered"])
def test_a_manifest_whose_metadata_is_no_plain_value_is_damage_that_repair_ends(
        varied_store: Path, tmp_path: Path, node: str) -> None:
    """Saves write plain values as metadata. A manifest whose metadata holds a pickle or a registered type (a
    checksum made to match) is a damaged manifest: loads and verify say so, nothing is unpickled, and a repair
    leaves that checkpoint out. (A repair used to index it; every listing then raised CorruptIndexError naming a
    repair, which indexed it again.)"""
    import base64
    import pickle

    marker = tmp_path / "unpickled"
    path = tmp_path / "store"
    shutil.copytree(varied_store, path)
    with deltackpt.Store(path) as s:
        info = s.info(2)
    evil = base64.b64encode(pickle.dumps(_Mkdir(str(marker)))).decode()
    metadata = ["p", evil] if node == "pickle" else ["x", "os.mkdir", ["s", str(marker)]]
    _edit_manifest_header(path, 2, info.id, lambda header: header.update(metadata=metadata))
    with deltackpt.Store(path) as s:
        with pytest.raises(CorruptManifestError, match=f"{info.id}.*metadata"):
            s.load(2)
        report = s.verify()
        assert [p.checkpoint for p in report.problems] == [info.id]
    with maintenance.open_for_repair(path) as s:
        assert s.repair().lost_checkpoints == [info.id]
    with deltackpt.Store(path) as s:
        assert [i.step for i in s.list()] == [1] and s.verify().ok
    assert not marker.exists()


class _Mkdir:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


@given(data=st.data())
def test_index_record_fields_of_any_value_are_typed_errors(varied_store: Path,
                                                          tmp_path_factory: pytest.TempPathFactory,
                                                          data: st.DataObject) -> None:
    """An index record's field (or a part of its metadata) replaced by any JSON value, or a field added."""
    path = tmp_path_factory.mktemp("r") / "store"
    shutil.copytree(varied_store, path)
    value = data.draw(_JSON)
    where = data.draw(st.sampled_from(["field", "new field", "metadata"]))

    def edit(r: dict[str, Any]) -> None:
        if where == "field":
            r[data.draw(st.sampled_from(sorted(r)))] = value
        elif where == "new field":
            r[data.draw(st.text(min_size=1, max_size=5))] = value
        else:
            container, key = _pick(data, r["metadata"])
            container[key] = value

    _set_record(path, 2, edit)
    _exercise(path)


@given(data=st.data())
def test_index_chunk_entries_of_any_value_are_typed_errors(varied_store: Path,
                                                          tmp_path_factory: pytest.TempPathFactory,
                                                          data: st.DataObject) -> None:
    """A chunk's index entry with any field changed to any value of its width (offsets past what a file
    offset holds, frame lengths of gigabytes: a read must neither overflow nor reserve them), or any bytes."""
    path = tmp_path_factory.mktemp("c") / "store"
    shutil.copytree(varied_store, path)
    widths = {"pack": 16, "offset": 8, "frame_len": 4, "codec": 1, "depth": 1, "base": 16}

    def edit(txn: Any, db: Any) -> None:
        k, v = data.draw(st.sampled_from(list(txn.cursor())))
        field = data.draw(st.sampled_from([*widths, "bytes"]))
        if field == "bytes":
            new = data.draw(st.binary(max_size=80))
        else:
            at = sum(list(widths.values())[: list(widths).index(field)])
            new = v[:at] + data.draw(st.binary(min_size=widths[field], max_size=widths[field])) + v[at + widths[field]:]
        txn.put(k, new)

    _edit_index(path, "chunks", edit)
    _exercise(path)


@pytest.mark.parametrize("damage", ["zeroed", "inverted"])
def test_damaged_index_pages_are_typed_errors(varied_store: Path, tmp_path: Path, damage: str) -> None:
    """Each page of the index's data file damaged in turn, zeroed (LMDB then meets pages of the wrong type) or
    its first 256 bytes inverted (a header and nodes of garbage; LMDB then fails a transaction midway, and its
    later calls in it return MDB_BAD_TXN, which the repair's freeing of the old tables met): reads, verify and
    gc raise CorruptIndexError naming the repair, never lmdb's own errors; a repair afterwards restores every
    checkpoint."""
    size = (varied_store / "index" / "data.mdb").stat().st_size
    seen: set[str] = set()
    for page in range(2, size // 4096):  # (pages 0 and 1 are LMDB's meta pages: it checks those itself)
        path = tmp_path / f"p{page}"
        shutil.copytree(varied_store, path)
        with open(path / "index" / "data.mdb", "r+b") as f:
            f.seek(page * 4096)
            old = f.read(256 if damage == "inverted" else 4096)
            f.seek(page * 4096)
            f.write(bytes(b ^ 0xFF for b in old) if damage == "inverted" else bytes(4096))
        for op in ("list", "load", "verify", "gc"):
            try:
                with deltackpt.Store(path, threads=1) as s:
                    getattr(s, op)()
            except deltackpt.DeltackptError as exc:
                seen.add(type(exc).__name__)
        try:  # a handle open on the damaged index repairs it, else the one open_for_repair gives (the CLI's)
            with deltackpt.Store(path, threads=1) as s:
                s.repair()
        except CorruptIndexError:
            with maintenance.open_for_repair(path) as s:
                s.repair()
        with deltackpt.Store(path, threads=1) as s:
            assert [i.step for i in s.list()] == [1, 2] and s.verify().ok
        shutil.rmtree(path)
    assert "CorruptIndexError" in seen


# -- damaged pages of an index table that a full scan would step onto ---------------------------------------------


def _table_pages(store: Path, table: str) -> tuple[list[int], list[int]]:
    """The branch and leaf pages of ``table`` in the index of ``store`` (no handle of this process open on it),
    found by walking LMDB's B-tree in the file from the root the table's record in the main table names."""
    import lmdb

    env = lmdb.open(str(store / "index"), max_dbs=8, subdir=True, readonly=True, lock=False)
    try:
        psize = env.stat()["psize"]
        with env.begin() as txn:
            root = struct.unpack_from("<Q", txn.get(table.encode()), 40)[0]
    finally:
        env.close()
    data = (store / "index" / "data.mdb").read_bytes()
    branches: list[int] = []
    leaves: list[int] = []
    level = [root]
    while level:
        below = []
        for p in level:
            page = data[p * psize:(p + 1) * psize]
            flags, lower = struct.unpack_from("<HH", page, 10)
            if flags & 0x01:
                branches.append(p)
                for i in range((lower - 16) // 2):
                    lo, hi, high = struct.unpack_from("<HHH", page, struct.unpack_from("<H", page, 16 + 2 * i)[0])
                    below.append(lo | hi << 16 | high << 32)
            else:
                assert flags & 0x02, (p, flags)
                leaves.append(p)
        level = below
    return branches, leaves


def _damage_page(store: Path, page: int, how: str) -> None:
    with open(store / "index" / "data.mdb", "r+b") as f:
        f.seek(page * 4096)
        raw = bytearray(f.read(4096))
        if how == "zeroed":
            raw = bytearray(4096)
        elif how == "garbage":
            raw[:512] = np.random.default_rng(page).integers(0, 256, 512, dtype=np.uint8).tobytes()
        elif how == "retyped":
            raw[10:12] = struct.pack("<H", 0x04)  # an overflow page's flags
        elif how == "renumbered":
            raw[:8] = struct.pack("<Q", page + 1)
        elif how == "node-outside":
            raw[16:18] = struct.pack("<H", 4094)  # the first node's offset: its header would end past the page
        elif how == "bounds":
            raw[12:16] = struct.pack("<HH", 4000, 100)  # mp_lower above mp_upper
        f.seek(page * 4096)
        f.write(raw)


#: Runs each of the operations its first argument names (``list`` and ``gc``: the Store's; others: commands of the
#: command line) on each store named after it, each in a forked child, and prints what each did as JSON: its error
#: or exit status and stderr, or the signal that killed it (LMDB's abort, a SIGBUS or SIGSEGV: a pytest process
#: would die of them).
_SCAN_WORKER = r"""
import contextlib, io, json, os, sys
import deltackpt, deltackpt.cli
from deltackpt.errors import CorruptIndexError

def run(op, path):
    if op in ("list", "gc"):
        try:
            with deltackpt.Store(path, threads=1) as s:
                getattr(s, op)()
            return "ok"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = deltackpt.cli.main([op, path])
    return f"exit {rc}: {err.getvalue()}"

out = {}
for path in sys.argv[2:]:
    for op in sys.argv[1].split(","):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                text = run(op, path)
            except BaseException as exc:
                text = f"{type(exc).__name__}: {exc}"
            os.write(w, text.encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            text = f.read().decode()
        _, status = os.waitpid(pid, 0)
        out[f"{path} {op}"] = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else text
print(json.dumps(out))
"""


def _scans(paths: list[Path], ops: str = "list,ls,log") -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _SCAN_WORKER, ops, *map(str, paths)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, str] = json.loads(done.stdout)
    return out


def _deep_records(path: Path, records: int) -> None:
    """A store at ``path`` whose records table holds ``records`` records (copies of one real checkpoint's record
    under other ids and steps, written by one rebuild: far faster than as many saves)."""
    import copy

    with _open(path) as s:
        s.save({"w": torch.arange(64, dtype=torch.float32)}, step=0, metadata={"loss": 1.0})
        first = s.index.records()[0]
        out = [first]
        for i in range(1, records):
            rec = copy.deepcopy(first)
            rec.id, rec.step = f"{first.id[:-8]}{i:08x}", i
            out.append(rec)
        s.index.rebuild(dict(s.index.iter_chunks()), out)


@pytest.mark.parametrize("tree_depth", [2, 3])
def test_a_damaged_page_of_the_records_table_is_a_typed_error_in_listings(tmp_path: Path, tree_depth: int) -> None:
    """Every branch and leaf page of the checkpoint records table damaged in turn (zeroed, garbage, another page
    type, another page number, a node or the free-space bounds outside the page): ``Store.list()``, ``deltackpt
    ls`` and ``deltackpt log`` raise CorruptIndexError naming the table and the repair, or exit with the command
    line's error, rather than die. (LMDB asserts the type of a leaf page its cursor steps onto, an abort of the
    process, and trusts its node offsets: index.unsafe_pages checks the tree before a scan.) The deeper tree
    (5000 records: three levels) has its branch pages and a few of its leaves damaged."""
    good = tmp_path / "good"
    if tree_depth == 2:
        with _open(good) as s:
            for step in range(80):
                s.save({"w": torch.full((64,), float(step))}, step=step,
                       metadata={"blob": "x" * 3000} if step % 20 == 7 else {"loss": step})  # (overflow pages)
        kinds = ["zeroed", "garbage", "retyped", "renumbered", "node-outside", "bounds"]
    else:
        _deep_records(good, 5000)
        kinds = ["zeroed", "retyped", "node-outside"]
    branches, leaves = _table_pages(good, "ckpts")
    assert branches and (len(branches) > 1) == (tree_depth == 3), (len(branches), len(leaves))
    if tree_depth == 3:
        leaves = [leaves[0], leaves[1], leaves[len(leaves) // 2], leaves[-1]]
    assert _scans([good]) == {f"{good} list": "ok", f"{good} ls": "exit 0: ", f"{good} log": "exit 0: "}
    cases = []
    for page in branches + leaves:
        for how in kinds:
            path = tmp_path / f"{page}-{how}"
            shutil.copytree(good, path)
            _damage_page(path, page, how)
            cases.append(path)
    results = _scans(cases)
    died = sorted(case for case, text in results.items() if text.startswith("signal"))
    assert not died, f"{len(died)} of {len(results)} died: {died[:10]}"
    for case, text in results.items():
        if case.endswith(" list"):
            assert text.startswith("CorruptIndexError: ") and "ckpts table" in text and "deltackpt repair" in text, (
                case, text)
        else:
            assert text.startswith("exit 1: deltackpt: error: the index of ") and "is damaged (ckpts table: " in text \
                and "deltackpt repair" in text, (case, text)


def test_a_damaged_page_of_the_chunks_table_is_a_typed_error_in_du_and_gc(tmp_path: Path) -> None:
    """The same for the chunk entries' table, which ``deltackpt du`` and gc scan whole: each of its pages zeroed
    or of another type, they raise CorruptIndexError naming the repair (du: the command line's error; the damage
    LMDB's lookups of live chunks meet first, or the page check's) rather than die."""
    good = tmp_path / "good"
    with _open(good) as s:
        for step in range(80):
            s.save({"w": torch.full((64,), float(step))}, step=step)
        for info in s.list()[:-3]:  # (their chunks' entries stay until a gc: leaves no lookup of a live chunk reads)
            s.delete(id=info.id)
    branches, leaves = _table_pages(good, "chunks")
    assert branches, "a tree of one page"
    cases = []
    for page in branches + leaves:
        for how in ("zeroed", "retyped"):
            path = tmp_path / f"{page}-{how}"
            shutil.copytree(good, path)
            _damage_page(path, page, how)
            cases.append(path)
    results = _scans(cases, "du,gc")
    died = sorted(case for case, text in results.items() if text.startswith("signal"))
    assert not died, f"{len(died)} of {len(results)} died: {died[:10]}"
    for case, text in results.items():
        assert "is damaged (" in text and "deltackpt repair" in text, (case, text)  # (or a lookup's LMDB error)
        assert text.startswith("CorruptIndexError: " if case.endswith(" gc") else "exit 1: deltackpt: error: "), (
            case, text)


def test_the_page_check_passes_good_stores_of_any_shape(store_path: Path) -> None:
    """No good store is refused: the check of every table's pages passes as a store grows from one record to
    a tree of several levels, with records that need overflow pages, after deletes (LMDB reuses the freed pages),
    gc with repacking and a repair; listings, verify and gc run throughout."""
    from deltackpt import index

    g = torch.Generator().manual_seed(5)

    def check() -> None:
        with s.index.env.begin() as txn:
            for name in ("meta", "chunks", "ckpts", "ids", "steps"):
                assert index.unsafe_pages(txn, s.index._shared().main, name, s.index.path / "data.mdb",
                                          s.index._shared().data_id) is None, name
        assert s.index.problems() == [] and len(list(s.index.iter_chunks())) == s.index.count_chunks()

    step = 0
    with _open(store_path) as s:
        for _ in range(3):
            for _ in range(30):
                step += 1
                size = int(torch.randint(1, 3000, (), generator=g))
                s.save({"w": torch.randn(size, generator=g)}, step=step,
                       metadata={"blob": "x" * (0, 10, 3000, 9000)[step % 4]})
                check()
            infos = s.list()
            for info in infos[: len(infos) // 2 : 2] + infos[len(infos) // 2 + 1 :: 3]:
                s.delete(id=info.id)
            check()
            s.gc(repack_below=1.0)
            check()
        assert s.verify().ok
        s.repair()
        check()
        with s.index.env.begin() as txn:
            stat = txn.stat(s.index.db_ckpts)
        assert stat["depth"] >= 2 and stat["overflow_pages"] > 0, stat


def test_the_page_check_knows_only_its_layout(tmp_path: Path) -> None:
    """A data file whose meta pages are not of the layout the check knows (magic, version, page size) is not
    checked: LMDB reads it as before, and a good store of a layout yet unknown is never refused."""
    import mmap

    from deltackpt import index

    path = tmp_path / "store"
    _deep_records(path, 300)
    branches, leaves = _table_pages(path, "ckpts")
    _damage_page(path, leaves[1], "zeroed")
    import lmdb

    env = lmdb.open(str(path / "index"), max_dbs=8, subdir=True, readonly=True, lock=False)
    with env.begin() as txn:
        txnid = txn.id()
    env.close()
    raw = bytearray((path / "index" / "data.mdb").read_bytes())

    def walk(data: bytearray) -> str | None:
        with open(tmp_path / "copy", "wb") as f:
            f.write(data)
        with open(tmp_path / "copy", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return index._walk(mm, len(data), txnid, 4096, branches[0])

    assert walk(raw) == f"page {leaves[1]} holds another page number in its header (flags 0x0)"
    for at, value in ((16, 0xBEEFC0DF), (20, 2), (40, 8192)):  # magic, version, page size, in both meta pages
        other = bytearray(raw)
        for meta in (0, 4096):
            other[meta + at:meta + at + 4] = struct.pack("<I", value)
        assert walk(other) is None, at


#: Saves into the store at argv[1] until the file argv[2] exists, deleting the oldest of its own checkpoints
#: beyond 40 (LMDB then reuses the pages the deletes freed).
_WRITER = r"""
import collections, sys, torch, deltackpt
from pathlib import Path
path, stop = Path(sys.argv[1]), Path(sys.argv[2])
kept = collections.deque()
with deltackpt.Store(path, chunk_size=4096, threads=1) as s:
    step = 10_000
    print("ready", flush=True)
    while not stop.exists():
        step += 1
        kept.append(s.save({"w": torch.full((64,), float(step))}, step=step,
                           metadata={"blob": "x" * (step % 5) * 800}).id)
        if len(kept) > 40:
            s.delete(id=kept.popleft())
"""


@pytest.mark.plumbing
def test_the_page_check_is_never_fooled_by_a_concurrent_writer(store_path: Path, tmp_path: Path) -> None:
    """A process listing the store in a loop while another saves and deletes (LMDB's copy-on-write writes new
    pages, and reuses freed ones, meanwhile): the check reads the pages of its own transaction's snapshot, never
    a false CorruptIndexError."""
    from deltackpt.index import read_last_commit

    with _open(store_path) as s:
        for step in range(60):
            s.save({"w": torch.full((64,), float(step))}, step=step)
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(store_path), str(stop)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        first = read_last_commit(store_path) or 0
        listings, deadline = 0, time.monotonic() + 120
        with _open(store_path) as s:
            while listings < 200 or ((read_last_commit(store_path) or 0) - first < 30 and time.monotonic() < deadline):
                assert len(s.list()) >= 60
                if listings % 10 == 0:
                    s.index.problems()
                    list(s.index.iter_chunks())
                listings += 1
        assert (read_last_commit(store_path) or 0) - first >= 30, "the writer did not run alongside"
    finally:
        stop.touch()
        assert writer.wait(timeout=120) == 0


@pytest.mark.parametrize("intact", [True, False])
def test_gc_stops_at_a_live_frame_of_a_newer_format(store_path: Path, intact: bool) -> None:
    """A live chunk whose frame is of a format version this reader does not know (a newer writer's; its index
    entry says nothing of it) may need chunks this reader cannot see it names: gc raises FormatVersionError
    before it frees anything. A version byte damaged into an unknown one fails the frame's checksum: that is
    damage, and gc runs. Before, gc followed the index entry only and never looked at the frame."""

    with _open(store_path) as s:
        s.save({"a": torch.randn(1000)}, step=1)
        s.save({"b": torch.randn(1000)}, step=2)
        s.delete(1)  # something for gc to free
    (path,) = (store_path / "packs").glob("*.pack")
    data = bytearray(path.read_bytes())
    at = 16  # the first frame (checkpoint 1's, now dead); the live one follows it
    at += 64 + struct.unpack_from("<Q", data, at + 16)[0]
    stored = struct.unpack_from("<Q", data, at + 16)[0]
    data[at + 4] = 9  # its version byte
    if intact:  # as a newer writer wrote it
        checked = bytes(data[at : at + 56] + data[at + 64 : at + 64 + stored])
        struct.pack_into("<Q", data, at + 56, xxhash.xxh3_64(checked).intdigest())
    path.write_bytes(bytes(data))
    before = dir_snapshot(store_path)
    with _open(store_path) as s:
        if intact:
            with pytest.raises(deltackpt.FormatVersionError, match="version 9"):
                s.gc()
            assert dir_snapshot(store_path) == before
        else:
            assert s.gc().dead_chunks > 0


def test_gc_runs_after_a_repair_that_left_checkpoints_incomplete(store_path: Path) -> None:
    """A damaged base frame: a repair cannot index the intact delta frame that decodes from it and reports its
    checkpoints incomplete. That frame decodes to nothing, so gc must not take it for a chunk the index lost
    (it refused, asked for a repair, and refused again after it), and the rest of the store stays loadable."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(CS // 4, generator=g)
    keep = torch.arange(CS // 4, dtype=torch.float32)
    with deltackpt.Store(store_path, chunk_size=CS, predict=False) as s:
        s.save({"a": a, "keep": keep}, step=1)
    b = a.clone()
    b[:10] += 1
    with deltackpt.Store(store_path, chunk_size=CS, predict=False) as s:
        s.save({"a": b, "keep": keep}, step=2)
        s.save({"keep": keep}, step=3)
    with _open(store_path) as s:
        (_, loc), = _chunks_of(s, 1)["a"]
        assert {loc.codec for _, loc in _chunks_of(s, 2)["a"]} == {codec.DELTA}
    _flip(_pack_path(store_path, loc), loc.offset + loc.frame_len - 5)
    with _open(store_path) as s:
        assert len(s.repair().incomplete_checkpoints) == 2
        s.gc(repack_below=1.0)
        assert_same_state({"keep": keep}, s.load(3))
        s.repair()
        s.gc()
        assert_same_state({"keep": keep}, s.load(3))


@pytest.mark.parametrize("what", ["device", "dtype"])
def test_a_tensor_this_torch_cannot_load_keeps_its_checkpoint(store_path: Path, what: str) -> None:
    """A tensor saved on a device backend this process lacks (torch_npu records "npu:0") or of a dtype of a
    newer torch is not damage: the manifest parses, load raises a typed error (a device is loadable with
    map_location), and repair and gc keep the checkpoint. Before, manifest parsing refused the device, so a
    repair dropped the checkpoint as lost and the next gc freed it."""
    with entries_written_as(**({"device": "npu:0"} if what == "device" else {"dtype": "float4_e9m9_future"})):
        with _open(store_path) as s:
            s.save({"w": torch.ones(1000)}, step=1)
    with _open(store_path) as s:
        with pytest.raises(deltackpt.UnsupportedTypeError, match="npu:0" if what == "device" else "float4_e9m9_future"):
            s.load(1)
        if what == "device":
            assert s.load(1, map_location="cpu")["w"].sum().item() == 1000
        report = s.repair()
        assert report.checkpoints == 1 and not report.lost_checkpoints
        s.gc()
        assert [i.step for i in s.list()] == [1] and s.manifest(1).tensors[0].nbytes == 4000


@pytest.mark.parametrize("node", [["dv", "npu:0"], ["dt", "float4_e9m9_future"]])
@pytest.mark.parametrize("holder", ["value", "dict key", "set element"])
def test_a_device_or_dtype_this_torch_lacks_is_not_damage_wherever_it_is(store_path: Path, node: list[str],
                                                                         holder: str) -> None:
    """A torch.device of a backend this process lacks, or a newer torch's dtype, held in the state is what the
    process cannot load, not damage (format.md §6): load raises UnsupportedTypeError naming it, verify reports
    nothing, and repair keeps the checkpoint, whether the node is a value, a dict key or a set element. As a dict
    key (a version-2 manifest) load and load_into reported it as a malformed state skeleton (CorruptManifestError):
    the walks of the skeleton that build keys turned the UnsupportedTypeError (a TypeError) into damage."""
    value = {"value": {"v": torch.device("cpu")}, "dict key": {torch.device("cpu"): 1},
             "set element": {torch.device("cpu")}}[holder]
    with _open(store_path) as s:
        info = s.save({"w": torch.ones(3), "x": value}, step=1)

    def edit(header: dict[str, Any]) -> None:
        def swap(n: Any) -> None:
            if isinstance(n, list):
                if n[:2] == ["dv", "cpu"]:
                    n[:] = node
                for child in n:
                    swap(child)
        swap(header["tree"])
    _edit_manifest_header(store_path, 1, info.id, edit)
    with _open(store_path) as s:
        with pytest.raises(deltackpt.UnsupportedTypeError, match=node[1]):
            s.load(1)
        target = torch.zeros(3)
        try:  # (a place under such a key is none a target can name: filling the others is fine too)
            s.load_into({"w": target}, step=1, strict=False)
            assert target.sum().item() == 3
        except deltackpt.UnsupportedTypeError as exc:
            assert node[1] in str(exc)
        assert s.verify().ok
        report = s.repair()
        assert report.checkpoints == 1 and not report.lost_checkpoints


def test_a_newer_torch_dtype_is_not_damage_a_restore_skips(store_path: Path) -> None:
    """The newest checkpoint holding a dtype this torch does not know is refused with UnsupportedTypeError (the
    store is fine; the process needs a newer torch), not skipped as damaged for an older one, which a
    CorruptManifestError did: the restore went back a step and the job lost the newest one. A dtype name that
    is no identifier is damage still."""
    from deltackpt import tree

    model = torch.nn.Linear(3, 2)
    with deltackpt.Checkpointer(_open(store_path), model=model, handle_signals=False, async_save=False) as ckpt:
        ckpt.save(1)
        with entries_written_as(dtype="float4_e9m9_future"):
            ckpt.save(2)
    with deltackpt.Checkpointer(_open(store_path), model=torch.nn.Linear(3, 2), handle_signals=False) as ckpt:
        with pytest.raises(deltackpt.UnsupportedTypeError, match="float4_e9m9_future"):
            ckpt.restore()
        assert ckpt.restore(1) == 1
    with pytest.raises(CorruptManifestError, match="malformed torch dtype"):
        tree.torch_dtype("float 32")


def test_a_numpy_dtype_string_numpy_cannot_parse_is_a_typed_error() -> None:
    """numpy parses some dtype strings as tuple specs and raises SyntaxError for them ("5)m"): a skeleton's
    numpy scalar node naming one is a CorruptManifestError (before, the SyntaxError escaped, and a repair that
    met such a manifest aborted)."""
    from deltackpt import tree

    with pytest.raises(CorruptManifestError, match="numpy dtype"):
        tree.numpy_dtype("5)m")
    with pytest.raises(CorruptManifestError):
        tree.decode_plain(["ns", "5)m", "00"])


@pytest.mark.parametrize("node", [
    ["i", "+5"], ["i", " 5"], ["i", "1_000"], ["i", "007"], ["i", "-0"], ["i", "\u0663"], ["i", ""], ["i", 5],
    ["f", "3FF0000000000000"], ["f", "3ff0 00000000000"], ["f", "3ff00000000000"], ["c", "0" * 16, "0" * 15 + "G"],
    ["ns", "<f4", "0000 803f"[:8]], ["ns", "<f4", "0000803F"],
])
def test_skeleton_scalars_have_one_lexical_form(node: list) -> None:
    """Int, float, complex and numpy scalar nodes are read in the one form writers write (format.md §5):
    Python's ``int`` and ``bytes.fromhex`` would also take signs, spaces, underscores, other digits and upper
    case, so a damaged node could read as some value instead of as damage."""
    from deltackpt import tree

    with pytest.raises(CorruptManifestError):
        tree.decode_plain(node)


@pytest.mark.parametrize("node", [
    ["d", [["y", "AA=="], ["y", "AA=="]], [["N"], ["i", "1"]]],
    ["d", [["i", "1"], ["f", "3ff0000000000000"]], [["N"], ["N"]]],
    ["o", [["s", "a"], ["s", "a"]], [["N"], ["N"]]], ["C", [["s", "a"], ["s", "a"]], [["i", "1"], ["i", "2"]]],
    ["D", None, [["b", True], ["i", "1"]], [["N"], ["N"]]], ["S", [["s", "a"], ["s", "a"]]],
    ["F", [["i", "0"], ["b", False]]], ["q", [["N"], ["N"], ["N"]], 2],
])
def test_a_skeleton_node_whose_value_would_drop_what_it_lists_is_damage(node: list) -> None:
    """No dict holds a key twice (1 and 1.0 are one key), no set an element twice, no deque more items than its
    maxlen: such a node, which no writer makes, loaded as a value missing some of what it listed, with no error.
    A NaN key or element is not equal to another, so several of them are no such node."""
    from deltackpt import tree

    with pytest.raises(CorruptManifestError, match="twice|maxlen"):
        tree.decode_plain(node)
    nan = ["f", "7ff8000000000000"]
    assert len(tree.decode_plain(["d", [nan, nan], [["N"], ["N"]]])) == 2
    assert len(tree.decode_plain(["S", [nan, nan]])) == 2
    assert len(tree.decode_plain(["q", [["N"], ["N"]], 2])) == 2


@given(st.integers() | st.integers(min_value=-(10**9000), max_value=10**9000))
@settings(max_examples=60, deadline=None)
def test_ints_round_trip_through_their_canonical_text(x: int) -> None:
    from deltackpt import tree

    text = tree.int_text(x)
    assert text == str(x) if abs(x) < 10**4000 else text.lstrip("-").isdigit()
    assert tree.int_value(text) == x and tree.decode_plain(["i", text]) == x


def test_a_tensor_node_must_name_an_entry_of_its_kind(store_path: Path) -> None:
    """``T`` nodes name torch entries and ``A`` nodes numpy ones (format.md §5): a skeleton that says otherwise
    is damage, not a numpy array handed out where a tensor was saved (or the other way round)."""
    import dataclasses

    from deltackpt import manifest, tree

    with _open(store_path) as s:
        s.save({"t": torch.ones(3), "a": np.ones(3)}, step=1)
        m = s.manifest(1)
    swapped = json.loads(json.dumps(m.tree).replace('["T", 0]', '["A", 0]').replace('["A", 1]', '["T", 1]'))
    assert swapped != m.tree
    forged = manifest.parse(dataclasses.replace(m, tree=swapped).to_bytes(), where="test")
    with pytest.raises(CorruptManifestError, match="kind"):
        forged.skeleton()
    with pytest.raises(CorruptManifestError, match="kind"):
        tree.unflatten(["A", 0], [torch.ones(1)])
    with pytest.raises(CorruptManifestError, match="kind"):
        tree.unflatten(["T", 0], [np.ones(1)])
    assert tree.unflatten(["l", [["T", 0], ["A", 1]]], [torch.ones(1), np.ones(1)])[1].dtype == np.float64


@pytest.mark.parametrize("found_by", ["verify", "load"])
def test_a_save_writes_the_chunks_found_damaged_again(store_path: Path, two_ckpts: dict[str, Any],
                                                      found_by: str) -> None:
    """Saving bytes the store holds in a damaged frame deduplicated onto that frame: the new checkpoint was
    damaged as it committed. Once a verify or a load of the handle found the damage, a save of those bytes
    writes them again (standalone) and re-points the index, which repairs the older checkpoints that hold them;
    chunks it did not find damaged are still deduplicated."""
    with _open(store_path) as s:
        m = s.manifest(1)
        keys = [chunk_key(d, n) for _, d, n in m.chunk_keys(next(t for t in m.tensors if t.key == "c"))][:2]
        damaged = list(s.index.lookup_chunks(keys).items())
    for _, loc in damaged:
        _flip(_pack_path(store_path, loc), loc.offset + loc.frame_len - 1)
    with _open(store_path) as s:
        if found_by == "verify":
            assert len(s.verify(step=1).problems) == 2
        else:
            with pytest.raises(CorruptChunkError):
                s.load(1)
        again = s.save(two_ckpts["states"][1], step=4)
        assert again.written_bytes > 0
        new = s.index.lookup_chunks(k for k, _ in damaged)
        moved = sum((new[k].pack_id, new[k].offset) != (loc.pack_id, loc.offset) for k, loc in damaged)
        # a load stops handing out chunks at the first it cannot decode (the other read worker may have the next)
        assert moved == 2 if found_by == "verify" else 1 <= moved <= 2
        if found_by == "verify":
            assert_same_state(two_ckpts["states"][1], s.load(4))
            assert_same_state(two_ckpts["states"][1], s.load(1))  # repaired by the save
            assert s.verify().ok
        assert all(new[k].depth == 0 for k, loc in damaged
                   if (new[k].pack_id, new[k].offset) != (loc.pack_id, loc.offset))


def test_a_save_writes_again_a_damaged_base_no_checkpoint_lists(store_path: Path) -> None:
    """The damaged frames are delta bases that no checkpoint lists any more (their checkpoint was deleted):
    verify finds the chunks that depend on them. The bases their decode read are remembered too (only the
    dependent chunks were), so a later save of the bases' bytes writes them again; and the finding is shared by
    every handle of the process on the store (a second handle deduplicated onto the damaged frames)."""
    x = _rand(4 * CS, 0)
    y = x.clone()
    y[::97] += 1e-3  # a small change: each chunk of y is a delta on x's
    with _open(store_path) as s:
        first = s.save({"w": x}, step=1).id
        m = s.manifest(id=s.save({"w": y}, step=2).id)
        ylocs = s.index.lookup_chunks(chunk_key(d, n) for _, d, n in m.chunk_keys(m.tensors[0]))
        bases = {loc.base + k[16:] for k, loc in ylocs.items() if loc.codec == codec.DELTA}
        assert bases  # (a chunk on its staggered keyframe turn has none)
        s.delete(id=first)
        xlocs = s.index.lookup_chunks(bases)  # still indexed, as bases of step 2
    for loc in xlocs.values():
        _flip(_pack_path(store_path, loc), loc.offset + loc.frame_len - 1)
    with _open(store_path) as a, _open(store_path) as b:
        assert a.verify().problems  # step 2's delta chunks, whose bases are damaged
        b.save({"w": y}, step=3)  # another handle: writes y's chunks again, repairing step 2
        assert b.verify().ok
        again = b.save({"w": x}, step=4)  # x's bytes: written again, not deduplicated onto the damaged frames
        assert again.written_bytes > 0
        assert_same_state({"w": x}, b.load(4))
        assert_same_state({"w": y}, b.load(2))
        assert b.verify().ok


def test_unreadable_record_metadata_names_its_checkpoint(store_path: Path) -> None:
    """Record metadata holding a registered-type node (saves write plain values only) or a version-2 node (a set:
    metadata is of version-1 kinds, format.md §5) is index damage naming the checkpoint and the repair; a
    torch.device of a backend this torch lacks, or a newer torch's dtype, is named as such (a repair would not
    help). The first two raised UnsupportedTypeError naming no checkpoint, or were accepted."""
    with _open(store_path) as s:
        info = s.save({"w": torch.ones(3)}, step=1, metadata={"note": 1})
    for node, error, words in ((["x", "foo", ["N"]], CorruptIndexError, "deltackpt repair"),
                               (["dv", "npu:0"], deltackpt.UnsupportedTypeError, "npu:0"),
                               (["dt", "float4_e9m9_future"], deltackpt.UnsupportedTypeError, "float4_e9m9_future"),
                               (["S", []], CorruptIndexError, "version-2 node.*deltackpt repair")):
        def edit(txn: Any, db: Any, node: Any = node) -> None:
            key, raw = next(iter(txn.cursor()))
            rec = json.loads(raw)
            rec["metadata"] = ["d", [["s", "note"]], [node]]
            txn.put(key, json.dumps(rec).encode())

        _edit_index(store_path, "ckpts", edit)
        with _open(store_path) as s:
            with pytest.raises(error, match=f"checkpoint {info.id} \\(step 1\\).*{words}"):
                s.list()


def test_a_format_record_of_many_digits_is_index_damage(store_path: Path) -> None:
    """An index format record of 5000 digits is damage naming the repair (int() of it raised ValueError on every
    open: Python's limit on digits)."""
    with _open(store_path) as s:
        s.save({"w": torch.ones(3)}, step=1)
    _edit_index(store_path, "meta", lambda txn, db: txn.put(b"format", b"9" * 5000))
    with pytest.raises(CorruptIndexError, match="format record is b'9999"):
        _open(store_path)


def _with_flags(frame: bytes, flags: int) -> bytes:
    head = bytearray(frame[: codec.CHECKED])
    head[7] = flags
    payload = frame[codec.HEADER_SIZE:]
    return bytes(head) + struct.pack("<Q", codec.frame_checksum(bytes(head), payload)) + payload


@pytest.mark.parametrize("flags", [1, 0x80])
def test_a_frame_with_nonzero_flags_is_refused(flags: int) -> None:
    """Frame header byte 7, flags, is 0 and readers reject other values (format.md §3): a frame with a valid
    checksum and a flag set (a newer writer's feature bit) is not decoded as if the flag were absent."""
    raw = bytes(range(256)) * 16
    digest = kernel.digest(raw)
    frame = codec.Encoder().encode(raw, digest, 4)
    assert bytes(codec.decode(frame, expect_digest=digest, expect_len=len(raw))) == raw
    bad = _with_flags(frame, flags)
    with pytest.raises(CorruptChunkError):
        codec.parse_header(bad)
    with pytest.raises(CorruptChunkError):
        codec.check_frame(bad)
    with pytest.raises(CorruptChunkError):
        codec.decode(bad, expect_digest=digest, expect_len=len(raw))


def test_a_damaged_base_payload_is_named_in_the_dependents_error(tmp_path: Path) -> None:
    """Damage to a base frame found while applying a chain (its payload checksum fails in the kernel) is
    reported for the chunk read, naming the base: 'its delta base <id> is damaged' (codec.decode_chain)."""
    store_path = tmp_path / "store"
    with _open(store_path) as s:
        _nudged_history(s, 3)
        all_locs = dict(s.index.iter_chunks())
        deltas = [(cid, loc) for cid, loc in _chunks_of(s, 2)["x"] if loc.codec == codec.DELTA]
    assert deltas
    dep_cid, dep_loc = deltas[0]
    dep_key = next(k for k in all_locs if codec.chunk_hex(k[:16], int.from_bytes(k[16:], "big")) == dep_cid)
    base_key = dep_loc.base + dep_key[16:]
    base_loc = all_locs[base_key]
    base_cid = codec.chunk_hex(base_key[:16], int.from_bytes(base_key[16:], "big"))
    _flip(_pack_path(store_path, base_loc), base_loc.offset + base_loc.frame_len - 3)  # payload: checksum fails
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError) as ei:
            s._read_chunk(dep_key, all_locs[dep_key])
    assert ei.value.chunk_id == dep_cid
    assert f"its delta base {base_cid} is damaged" in str(ei.value), str(ei.value)


def _sealed(frame: bytearray) -> bytes:
    """``frame`` with its checksum made to match its (edited) header and payload."""
    struct.pack_into("<Q", frame, 56, codec.frame_checksum(bytes(frame[:56]), bytes(frame[64:])))
    return bytes(frame)


def _zstd_frame() -> tuple[bytearray, bytes]:
    text = b"deltackpt " * 100
    frame = codec.Encoder(1).encode(text, kernel.digest(text), 1)
    assert codec.parse_header(frame).codec == codec.ZSTD
    return bytearray(frame), text


def test_frame_version_zero_is_damage_not_a_frame() -> None:
    """Versions are 1, 2, 3: a version byte of 0 (checksum made to match) is refused, not read as version 1."""
    frame, raw = _zstd_frame()
    frame[4] = 0
    bad = _sealed(frame)
    with pytest.raises((CorruptChunkError, FormatVersionError)):
        codec.parse_header(bad)
    with pytest.raises((CorruptChunkError, FormatVersionError)):
        codec.decode(bad, expect_digest=kernel.digest(raw), expect_len=len(raw))


def test_a_raw_frame_storing_another_length_than_it_holds_is_damage() -> None:
    noise = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    frame = bytearray(codec.Encoder(1).encode(noise, kernel.digest(noise), 1))
    assert codec.parse_header(frame).codec == codec.RAW
    forged = bytearray(frame[:-8])  # a raw frame whose payload is 8 bytes short of its raw length
    struct.pack_into("<Q", forged, 16, len(noise) - 8)
    with pytest.raises(CorruptChunkError, match="raw frame stores 992 bytes for 1000"):
        codec.parse_header(_sealed(forged))


def test_a_predicted_frame_record_longer_than_its_payload_is_damage() -> None:
    rec = predict.Prediction(predict.SECOND_MOMENT, (b"m" * 16, b"n" * 16), (1.0, 0.0, 1.0, 0.0)).pack()
    assert codec.prediction_record(struct.pack("<I", len(rec)) + rec, None, codec.PREDICTED_VERSION)
    for extra in (1, 2, 4):  # the u32 length reaches past the payload's end by fewer than its own 4 bytes
        with pytest.raises(CorruptChunkError, match="overruns its payload"):
            codec.prediction_record(struct.pack("<I", len(rec) + extra) + rec, None, codec.PREDICTED_VERSION)


def test_a_frame_with_another_magic_is_damage_even_with_a_matching_checksum() -> None:
    """The magic is what a scan resynchronises on after damage: a header without it is no frame, whatever its
    checksum says (a repair must not index it, a load must not decode it)."""
    frame, raw = _zstd_frame()
    frame[0:4] = b"XCKF"
    bad = _sealed(frame)
    with pytest.raises(CorruptChunkError, match="bad frame magic"):
        codec.parse_header(bad)
    with pytest.raises(CorruptChunkError, match="bad frame magic"):
        codec.decode(bad, expect_digest=kernel.digest(raw), expect_len=len(raw))


def test_an_index_of_a_newer_format_is_refused_as_newer(store_path: Path) -> None:
    """An index whose format record names a version past this reader's (a newer deltackpt's) is refused with
    FormatVersionError before anything is read or written through it: its records may mean something else."""
    with _open(store_path) as s:
        s.save({"w": torch.ones(3)}, step=1)
    _edit_index(store_path, "meta", lambda txn, db: txn.put(b"format", b"2"))
    with pytest.raises(FormatVersionError, match="index format 2 is newer"):
        _open(store_path)


def test_a_manifest_the_index_did_not_record_is_refused(store_path: Path) -> None:
    """The index keeps each manifest's checksum: a manifest file replaced by another intact one of the same
    checkpoint id (an older copy put back, a rewrite's leftover) is refused, not loaded as that checkpoint."""
    with _open(store_path) as s:
        a = s.save({"w": torch.ones(3)}, step=1)
        rec = s.index.get(id=a.id)
    good = manifest.read(store_path / "manifests", a.id, expect_checksum=rec.manifest_checksum)
    assert good.id == a.id
    with pytest.raises(CorruptManifestError, match="does not match the checksum the index recorded"):
        manifest.read(store_path / "manifests", a.id, expect_checksum="0" * 32)


def test_a_manifest_file_holding_another_checkpoint_is_refused(store_path: Path) -> None:
    """``manifests/<id>.manifest`` must hold checkpoint ``id``: a manifest copied under another id's name (the
    repair reads manifests without an index checksum to compare) is damage, not a second checkpoint."""
    with _open(store_path) as s:
        a = s.save({"w": torch.ones(3)}, step=1)
    other = "0123456789abcdef"
    assert other != a.id
    shutil.copy(store_path / "manifests" / f"{a.id}.manifest", store_path / "manifests" / f"{other}.manifest")
    with pytest.raises(CorruptManifestError, match=f"{other}.manifest holds checkpoint {a.id}"):
        manifest.read(store_path / "manifests", other)


@pytest.mark.parametrize("name", ["O", "<M8[D]", "<m8[s]", "<U3", "S2", "V8", "[('a', '<i4')]"])
def test_numpy_dtypes_of_kinds_saves_refuse_are_manifest_damage(name: str) -> None:
    """Saves store numpy arrays of kinds b, i, u, f, c only: a manifest naming an object, datetime, string or
    void dtype is damage (an object dtype would have a load build an array of PyObject pointers from chunk
    bytes)."""
    with pytest.raises(CorruptManifestError, match="numpy dtype"):
        tree.numpy_dtype(name)


@pytest.mark.parametrize("name", ["<f4", "<i8", "|u1", "|b1", "<c16"])
def test_numpy_dtypes_saves_write_are_accepted(name: str) -> None:
    assert tree.numpy_dtype(name).kind in "biufc"


def test_a_damaged_base_digest_is_the_frames_own_damage(store_path: Path) -> None:
    """A flipped byte of a delta frame's base digest names a chunk that does not exist: loads and verify report
    the damaged frame where it lies (and, for a chunk decoded through it, that frame as the damaged base), not
    the bogus base the damaged header names."""
    a = _rand(CS, 0)
    states = [{"a": a}]
    for i in (1, 2):
        nxt = states[-1]["a"].clone()
        nxt[:4] += i
        states.append({"a": nxt})
    with _open(store_path) as s:
        ids = [s.save(st_, step=i + 1).id for i, st_ in enumerate(states)]
        (cid2, loc2), = _chunks_of(s, 2)["a"]
        (cid3, loc3), = _chunks_of(s, 3)["a"]
    assert loc2.codec == codec.DELTA and loc3.codec == codec.DELTA and loc3.base.hex() == cid2.split("-")[0]
    _flip(_pack_path(store_path, loc2), loc2.offset + 45, 0x01)  # inside the base digest (offsets 40-55)
    where = f"pack {loc2.pack_id} offset {loc2.offset}"
    with _open(store_path) as s:
        with pytest.raises(CorruptChunkError) as ei:
            s.load(2)
        _assert_names(ei.value, ids[1], "a", cid2)
        assert ei.value.reason == f"frame checksum mismatch at {where}", ei.value.reason
        with pytest.raises(CorruptChunkError) as ei:
            s.load(3)
        _assert_names(ei.value, ids[2], "a", cid3)
        assert ei.value.reason == f"its delta base {cid2} is damaged: frame checksum mismatch at {where}"
        report = s.verify()
        assert _problems(report) == {(ids[1], "a", cid2), (ids[2], "a", cid3)}
        assert all(where in p.message and "not in the index" not in p.message for p in report.problems), report


def test_du_on_a_damaged_index_page_is_an_error_not_an_abort(store_path: Path) -> None:
    """Each page of the index's data file zeroed in turn, in a store whose chunks table spans several leaf
    pages. ``deltackpt du`` met the damage in its lookups of the live chunks (a CorruptIndexError), took it for a
    damaged manifest, and went on to walk every chunk entry: LMDB's cursor then reached the zeroed leaf page and
    failed an assertion (``IS_LEAF(mp)``), which aborts the process (SIGABRT, no message). Now it stops at the
    damage, as gc and verify do: exit status 1 and one line naming the repair."""
    g = torch.Generator().manual_seed(5)
    with _open(store_path) as s:
        s.save({"w": torch.randn(400 * CS // 4, generator=g)}, step=1)  # 400 chunks: ~8 leaf pages of entries
    data = store_path / "index" / "data.mdb"
    raw = data.read_bytes()
    for page in range(2, len(raw) // 4096):
        if raw[page * 4096:(page + 1) * 4096] == bytes(4096):
            continue  # a page no tree uses
        data.write_bytes(raw[:page * 4096] + bytes(4096) + raw[(page + 1) * 4096:])
        du = subprocess.run([sys.executable, "-m", "deltackpt", "du", str(store_path)], capture_output=True,
                            text=True)
        assert du.returncode in (0, 1) and "Traceback" not in du.stderr, (page, du)
        if du.returncode:
            assert "deltackpt repair" in du.stderr, (page, du)
    data.write_bytes(raw)


def test_a_damaged_leaf_page_of_many_records_is_reported_and_repaired(store_path: Path) -> None:
    """40 checkpoints: their records fill several leaf pages. Each index page zeroed in turn: LMDB checks a
    page's type where a search passes it but only asserts it where a cursor steps onto the next leaf page, so a
    walk of the records (list, verify, and the repair's read of the old index) aborted the process (SIGABRT).
    The repair died of it too, and the store could not be repaired. Now verify reports the damage (exit 1)
    and the repair moves such an index aside and restores every checkpoint."""
    with _open(store_path) as s:
        for step in range(1, 41):
            s.save({"w": torch.full((100,), float(step))}, step=step, metadata={"tag": "x" * 50})
    data = store_path / "index" / "data.mdb"
    raw = data.read_bytes()
    run = [sys.executable, "-m", "deltackpt"]
    for page in range(2, len(raw) // 4096):
        if raw[page * 4096:(page + 1) * 4096] == bytes(4096):
            continue  # a page no tree uses
        data.write_bytes(raw[:page * 4096] + bytes(4096) + raw[(page + 1) * 4096:])
        verify = subprocess.run([*run, "verify", str(store_path)], capture_output=True, text=True)
        assert verify.returncode in (0, 1) and "Traceback" not in verify.stderr, (page, verify)
        repair = subprocess.run([*run, "repair", str(store_path)], capture_output=True, text=True)
        assert repair.returncode == 0, (page, repair)
        with _open(store_path) as s:
            assert [i.step for i in s.list()] == list(range(1, 41)), page
            assert torch.equal(s.load(40)["w"], torch.full((100,), 40.0))
            raw = data.read_bytes()  # (the repaired index, damaged next)
        for broken in store_path.glob("index.broken-*"):
            shutil.rmtree(broken)


def test_a_step_entry_without_its_seq_is_damage(store_path: Path) -> None:
    """A ``steps`` entry that lost its seq (8 bytes instead of 16; a zeroed index page leaves such keys, and
    empty ones in ``ckpts``): load of that step looked up the empty rest as a seq, and LMDB raised its own
    BadValsizeError, no DeltackptError. Now it is a CorruptIndexError naming the repair."""
    with _open(store_path) as s:
        s.save({"w": _rand(CS, 1)}, step=1)
    _edit_index(store_path, "steps", lambda txn, db: txn.put(struct.pack(">Q", 7), b"", db=db))
    with _open(store_path) as s, pytest.raises(CorruptIndexError, match="repair"):
        s.load(7)


@pytest.mark.parametrize("name", ["lock.mdb", "data.mdb"])
def test_an_index_file_that_is_a_symbolic_link_is_refused_and_what_it_names_is_left_as_it_is(tmp_path: Path,
                                                                                              name: str) -> None:
    """A store received from elsewhere whose index/lock.mdb is a link to a file of the user's: LMDB opens it
    for writing through the link and writes its reader table over it, at the first listing. Such a link is
    damage of the index (no writer makes one), refused before LMDB opens anything; a repair moves it aside."""
    store_path = tmp_path / "s"
    w = torch.randn(3000)
    with _open(store_path) as s:
        s.save({"w": w}, step=1)
    victim = tmp_path / "victim"
    victim.write_bytes((store_path / "index" / name).read_bytes() if name == "data.mdb" else b"precious\n" * 100)
    before = victim.read_bytes()
    (store_path / "index" / name).unlink()
    (store_path / "index" / name).symlink_to(victim)
    for op in (lambda: _open(store_path), lambda: deltackpt.Store(store_path, readonly=True)):
        with pytest.raises(CorruptIndexError, match=f"{name} is a symbolic link.*deltackpt repair"):
            op()
    out = subprocess.run([sys.executable, "-m", "deltackpt", "ls", str(store_path)], capture_output=True, text=True)
    assert out.returncode != 0 and "is a symbolic link" in out.stderr and "Traceback" not in out.stderr
    assert victim.read_bytes() == before
    with maintenance.open_for_repair(store_path) as r:
        r.repair()
    assert victim.read_bytes() == before
    with _open(store_path) as s:
        assert torch.equal(s.load(1)["w"], w)


def test_a_huge_sparse_file_in_place_of_a_manifest_is_damage_and_is_not_read_whole(tmp_path: Path) -> None:
    """A received store whose manifest is a sparse file of 64 GiB (no disk space, tar --sparse keeps it): verify,
    load and repair read it whole, and ran out of memory ("out of memory: MemoryError", or the OOM killer). A
    large file whose head is not a manifest's of its size is refused unread, as a manifest that cannot be read.
    (Run under an address-space limit of 4 GiB, so that a regression fails rather than exhausts the machine.)"""
    store_path = tmp_path / "s"
    with _open(store_path) as s:
        s.save({"w": torch.ones(10)}, step=1)
        info = s.save({"w": torch.zeros(10)}, step=2)
    with open(store_path / "manifests" / f"{info.id}.manifest", "r+b") as f:
        f.truncate(64 << 30)
    script = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import deltackpt
from deltackpt import maintenance
with deltackpt.Store({str(store_path)!r}) as s:
    try:
        s.load(2)
    except deltackpt.CorruptManifestError as exc:
        assert "not a manifest's of that size, not read" in str(exc), exc
    else:
        sys.exit("loaded")
    report = s.verify()
    assert not report.ok and "not read" in str(report.problems[0]), report
    assert s.load(1)["w"].tolist() == [1.0] * 10
with maintenance.open_for_repair({str(store_path)!r}) as r:
    assert {info.id!r} in r.repair().lost_checkpoints
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]


def test_store_strings_that_show_and_diff_print_are_escaped(store_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor entry's dtype or device holding a terminal escape or a newline (a store received from elsewhere):
    show, diff and get printed them as they were, so they reached the terminal and broke the tables; keys and
    metadata were already shown escaped."""
    from deltackpt.cli import main

    with _open(store_path) as s:
        s.save({"w": torch.ones(3), "a": np.arange(4, dtype=np.int32)}, step=1)
        info = s.save({"w": torch.zeros(3), "a": np.arange(4, dtype=np.int32)}, step=2)

    def edit(h: dict[str, Any]) -> None:
        for t in h["tensors"]:
            t.update(dtype="<i4\x1b[31m") if t["key"] == "a" else t.update(device="cuda\x1b]0;x\x07:0\n")
    _edit_manifest_header(store_path, 2, info.id, edit)
    capsys.readouterr()
    for args in (["show", "2"], ["diff", "1", "2"], ["get", "2", "a"]):
        main([args[0], str(store_path), *args[1:]])
        out, err = capsys.readouterr()
        assert "\x1b" not in out + err and "\x07" not in out + err, args
    main(["show", str(store_path), "2"])
    assert "<i4\\x1b[31m" in capsys.readouterr().out
