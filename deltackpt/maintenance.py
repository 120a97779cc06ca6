"""Maintenance of a store: garbage collection, verification and index repair.

Where it sits: beside the save/load pipeline, never on it. These are the only operations that scan the whole
history. ``repair`` holds the store's gc lock exclusively, so no save or load runs meanwhile (they wait); ``gc``
too while it finds the garbage and while it repacks each pack, letting saves and loads run between two packs.
One gc or repair runs at a time (``maint.lock``). ``verify`` holds the gc lock shared, like a load.

Crash safety of gc: orphan manifests (of saves killed before their commit, of deletes killed before their
unlink) are unlinked first, durably, so that no manifest outlives the chunks it names. Then one LMDB
transaction drops the dead chunk entries, after which packs with no live frame and temporary files are
unlinked. Each sparse pack is then repacked on its own: its live frames are copied and fsynced, one transaction
points their entries at the copies (that pack's commit point), and only then is the old pack unlinked. A crash
at any point leaves at most unreferenced packs or copies, which the next gc removes.

:class:`GcAfterRetention` is the rule by which a Checkpointer (and the DCP writer) runs gc after retention.
"""

from __future__ import annotations

import errno
import fcntl
import numbers
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np

from deltackpt import codec, config, kernel, manifest, packs, tree
from deltackpt.errors import (
    CheckpointNotFoundError,
    CorruptChunkError,
    CorruptIndexError,
    CorruptionError,
    CorruptManifestError,
    DeltackptError,
    FormatVersionError,
    IndexWriteError,
    ReadOnlyStoreError,
    StoreLockedError,
    UnsupportedTypeError,
)
from deltackpt.index import LMDB_DAMAGE, REPAIR_HINT, ChunkLoc, Commit, Record, chunk_key, chunk_keys, unwalkable
from deltackpt.layout import read_store_file, write_store_file
from deltackpt.scratch import Scratch

if TYPE_CHECKING:
    from deltackpt.store import Store

Progress = Callable[[int, int], None]  # (done, total)


@dataclass
class Problem:
    """One thing ``verify`` found wrong: in a checkpoint (its tensor and chunk when known), in a pack file
    (``pack``: its id), or in the index (``checkpoint`` and ``pack`` None)."""

    checkpoint: str | None
    step: int | None
    key: str | None
    chunk_id: str | None
    message: str
    pack: str | None = None

    def __str__(self) -> str:
        where = (f"checkpoint {self.checkpoint} (step {self.step})" if self.checkpoint is not None
                 else "index" if self.pack is None else f"pack {self.pack}")
        if self.key is not None:
            where += f", tensor {self.key!r}"
        if self.chunk_id is not None:
            where += f", chunk {self.chunk_id}"
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    checkpoints: int = 0
    chunks: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class GcReport:
    dead_chunks: int = 0
    #: packs unlinked: those with no live frame, and the repacked ones
    deleted_packs: int = 0
    #: sparse packs whose live frames were copied into new packs before they were unlinked (in ``deleted_packs``)
    repacked_packs: int = 0
    moved_chunks: int = 0
    #: bytes of packs and orphan manifests deleted, less what repacking copied into new packs
    freed_bytes: int = 0
    orphan_manifests: int = 0
    skipped_active_packs: int = 0
    #: why repacking stopped early (no space left for the copies), with what is left to do; None when it did not
    repack_stopped: str | None = None
    #: sparse packs left in place because a live frame in them is damaged (copying would spread the damage;
    #: ``verify`` names the checkpoints that need it, ``repair`` rebuilds around it), each with the damage
    damaged_packs: list[str] = field(default_factory=list)
    #: packs that the index says hold chunks retained checkpoints need, but which do not exist (lost, or deleted
    #: by hand); gc frees what it would have all the same, and ``verify`` names the checkpoints that lost chunks
    missing_packs: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """Whether gc met something to look into: repacking stopped, damage, a missing pack."""
        return bool(self.repack_stopped or self.damaged_packs or self.missing_packs)

    def damage(self) -> list[str]:
        """What gc met of damage, a line each (the first pack named), for a warning after a gc that no one
        asked for (a Checkpointer's or DCP writer's after retention)."""
        out = []
        if self.damaged_packs:
            out.append(f"left {len(self.damaged_packs)} pack(s) holding damaged frames in place: "
                       f"{self.damaged_packs[0]}; 'deltackpt verify' names the checkpoints")
        if self.missing_packs:
            out.append(f"found {len(self.missing_packs)} pack(s) missing that retained checkpoints need: "
                       f"{self.missing_packs[0]}; 'deltackpt verify' names the checkpoints")
        return out


@dataclass
class RepairReport:
    packs: int = 0
    chunks: int = 0
    checkpoints: int = 0
    #: manifests that could not be read (damaged, or not the checkpoint their name says): not restored
    lost_checkpoints: list[str] = field(default_factory=list)
    #: checkpoints restored although chunks they name were not found intact (``verify`` names them)
    incomplete_checkpoints: list[str] = field(default_factory=list)
    damaged_packs: list[str] = field(default_factory=list)


def _stored_chunks(m: manifest.Manifest) -> list[tuple[str, bytes]]:
    out = []
    for t in m.tensors:
        for _, digest, length in m.chunk_keys(t):
            out.append((t.key, chunk_key(digest, length)))
    return out


def _check_progress(progress: Any) -> None:
    """TypeError unless ``progress`` is None or callable (checked before anything runs, not at its first call)."""
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable (done, total) or None, got {type(progress).__name__}")


def verify(
    store: Store, *, step: int | None = None, id: str | None = None, progress: Progress | None = None
) -> VerifyReport:
    """Decode every chunk of one checkpoint (or all) and check it against its id; report, never raise.

    Each distinct chunk is checked once, however many checkpoints share it. A damaged delta base or prediction
    input is reported for every chunk that depends on it. Chunks that predicted frames tie together are checked
    by one worker in checkpoint order, sharing their decoded inputs (see :func:`_check_group`). An index that
    cannot be read (or is older than the store) ends the check with that problem in the report.
    """
    _check_progress(progress)
    report = VerifyReport()
    try:
        with store.reader.transient():
            _verify_into(report, store, step, id, progress)
    except CorruptIndexError as exc:
        report.problems.append(Problem(None, None, None, None, str(exc)))
    return report


def _refused_manifest(m: manifest.Manifest) -> tuple[str | None, str] | None:
    """(tensor key or None, why) when a load of ``m`` would refuse it before decoding a chunk: a tensor entry's
    dtype that is malformed, or a state skeleton that does not rebuild (checked without unpickling anything or
    running registered decoders). A dtype or device this torch does not know is as saved, not damage."""
    for t in m.tensors:
        try:
            # (torch_itemsize raises as torch_dtype does, and imports torch only for a name outside its table:
            # verify of a store of torch tensors runs without torch, as ls does)
            tree.torch_itemsize(t.dtype) if t.kind == "torch" else tree.numpy_dtype(t.dtype)
        except CorruptManifestError as exc:
            return t.key, str(exc)
        except UnsupportedTypeError:
            pass
    try:
        tree.check_skeleton(m.tree, list(m.tensors))
    except CorruptManifestError as exc:
        return None, str(exc)
    except UnsupportedTypeError:
        pass
    return None


#: chunk groups verify checks per pass of the read workers, between its progress reports
_VERIFY_BATCH = 1024


def _verify_into(report: VerifyReport, store: Store, step: int | None, id: str | None,
                 progress: Progress | None) -> None:
    """:func:`verify`'s checks, adding to ``report``."""
    results: dict[bytes, str | None] = {}
    with store._gc_lock():
        why = unwalkable(store.index.path)  # (a damaged leaf page aborts LMDB's walks instead of raising)
        if why is not None:
            raise CorruptIndexError(f"the index of {store.path} is damaged: {why}; {REPAIR_HINT}")
        if step is None and id is None:
            records = store.index.records()
            for rec, why in store.index.problems():  # ids or steps that lead elsewhere
                report.problems.append(Problem(rec.id if rec else None, rec.step if rec else None, None, None, why))
        else:
            records = [store._record(step, id)]
        plans: list[tuple[Record, list[tuple[str, bytes]]]] = []
        for rec in records:
            report.checkpoints += 1
            try:
                m = store._manifest(rec)
            except CheckpointNotFoundError:
                report.checkpoints -= 1  # deleted since verify listed it
                continue
            except DeltackptError as exc:
                report.problems.append(Problem(rec.id, rec.step, None, None, str(exc)))
                continue
            if m.chunk_size != store.chunk_size:  # (loads go by the manifest's; saves would cut chunks by STORE's)
                report.problems.append(Problem(rec.id, rec.step, None, None, (
                    f"its manifest names chunk size {m.chunk_size}, the store's STORE file {store.chunk_size} "
                    f"(STORE damaged?); 'deltackpt repair STORE' writes STORE again from the manifests")))
            refused = _refused_manifest(m)
            if refused is not None:
                report.problems.append(Problem(rec.id, rec.step, refused[0], None, f"its manifest: {refused[1]}"))
            differ = _record_differs(rec, m)
            if differ:
                report.problems.append(Problem(rec.id, rec.step, None, None, (
                    f"its index record does not match its manifest in {', '.join(differ)} (list and info show "
                    f"the record; loads read the manifest); {REPAIR_HINT}")))
            plans.append((rec, _stored_chunks(m)))
        unique = list(dict.fromkeys(k for _, chunks in plans for _, k in chunks))
        damaged: dict[bytes, str] = {}
        locs = store.index.lookup_chunks(unique, damaged)
        scratch = Scratch.for_frames(store.chunk_size, (loc.frame_len for loc in locs.values()))
        # (read_each: the read workers take items from one queue; a future per group and per index entry held
        # half of verify's memory, 90 MB for a store of 200,000 chunk references)
        groups = _related(store, unique, locs)
        for start in range(0, len(groups), _VERIFY_BATCH):
            for group in store._read_each(lambda g: _check_group(store, g, locs, scratch),
                                         groups[start:start + _VERIFY_BATCH]):
                results.update(group)
                results.update((k, why) for k, why in damaged.items() if k in results)
                if progress is not None:
                    progress(len(results), len(unique))
        del groups
        # (a pack whose frames are damaged too, cut short say, does lose chunks, and gc does not copy a pack with
        # a damaged live frame: its message says so rather than that nothing is lost)
        hurt = {locs[k].pack_id for k, why in results.items() if why is not None and k in locs}
        for pack_id in sorted({loc.pack_id for loc in locs.values()}):
            why = _header_damage(store.path / "packs" / f"{pack_id}.pack")
            if why is None:
                continue
            if pack_id in hurt:
                why += (". Chunks in it are damaged too (reported apart): once the checkpoints that use them are "
                        "deleted ('deltackpt rm'), 'deltackpt gc STORE' copies the rest to a new pack")
            else:
                why += (". Its frames are found through the index and each one was checked on its own, so no chunk "
                        "is lost, but the file was changed on disk; 'deltackpt gc STORE' copies them to a new pack")
            report.problems.append(Problem(None, None, None, None, why, pack=pack_id))
        if step is None and id is None:
            for problem in store._read_each(lambda item: _entry_problem(store, *item), list(locs.items())):
                if problem is not None:
                    report.problems.append(problem)
        for rec, chunks in plans:
            for key, k in chunks:
                report.chunks += 1
                err = results[k]
                if err is not None:
                    store._damaged.add(k)  # a save (of this process) that holds it writes it again
                    cid = codec.chunk_hex(k[:16], int.from_bytes(k[16:], "big"))
                    report.problems.append(Problem(rec.id, rec.step, key, cid, err))


def find_damaged_frames(store: Store, checkpoint_id: str) -> int:
    """Check the frame of every chunk the checkpoint reaches (its own, and their delta bases and prediction
    inputs, transitively) against its checksum and the chunk it should hold, without decoding anything; return
    how many fail or have no index entry, and remember them (``Store._damaged``), so that the saves of this
    process write those chunks again instead of deduplicating onto them.

    For a checkpoint a restore passed over as damaged (:meth:`Checkpointer.restore`): :func:`verify` reports
    every chunk that does not decode, but within a group of predicted chunks it stops at the first damaged
    input, so other damaged inputs of the group stay unread; the rerun of those steps saves their bytes."""
    with store._gc_lock():
        m = store._manifest(store._record(id=checkpoint_id))
        _, lost = _reach(store, chunk_keys(*m.stored_chunks()), _frame_refs, damaged_entries=True)
        store._damaged.update(lost)
    return len(lost)


def _frame_refs(store: Store, k: bytes, loc: ChunkLoc) -> list[bytes] | None:
    """The chunks ``k``'s frame names (base, prediction inputs), or None when the frame is damaged, another
    chunk's, or of a format this reader does not know (it cannot be decoded here either)."""
    try:
        frame = memoryview(store.reader.read(loc.pack_id, loc.offset, loc.frame_len))
        h, payload = codec.check_frame(frame, expect_digest=k[:16], expect_len=int.from_bytes(k[16:], "big"))
        refs = [h.base + k[16:]] if h.codec in codec.BASED else []
        if h.codec == codec.PREDICTED:
            refs += [r + k[16:] for r in codec.prediction_record(payload, version=h.version).refs]
    except (CorruptChunkError, FormatVersionError):
        return None
    return refs


def _record_differs(rec: Record, m: manifest.Manifest) -> list[str]:
    """The fields an index record copies from its manifest that no longer agree with it (the index keeps no
    checksum: a damaged record could show another parent, time or metadata)."""
    pairs = {
        "created": (rec.created, m.created), "parent": (rec.parent, m.parent), "metadata": (rec.metadata, m.metadata),
        "logical_bytes": (rec.logical_bytes, m.logical_bytes), "written_bytes": (rec.written_bytes, m.written_bytes),
        "replaces": (rec.extra.get("replaces", []), m.extra.get("replaces", [])),
    }
    return [name for name, (a, b) in pairs.items() if a != b]


def _header_damage(path: Path) -> str | None:
    """:func:`packs.header_damage`, None for a pack that cannot be opened (gone: its chunks report that)."""
    try:
        return packs.header_damage(path)
    except OSError:
        return None


def _entry_problem(store: Store, k: bytes, loc: ChunkLoc) -> Problem | None:
    """An index entry whose codec or base is not its frame's: loads follow the frame, but gc keeps what both name
    alive, and a repair makes them agree again. (A frame that cannot be read is the chunk's own problem.)"""
    try:
        h = codec.parse_header(store.reader.read(loc.pack_id, loc.offset, codec.HEADER_SIZE))
    except (DeltackptError, OSError, OverflowError):
        return None
    if h.digest != k[:16] or (h.codec, h.base) == (loc.codec, loc.base):
        return None
    try:  # a damaged header byte is the frame's damage (the chunk's own check reports it), not the entry's
        codec.check_frame(store.reader.read(loc.pack_id, loc.offset, loc.frame_len), expect_digest=k[:16],
                          expect_len=int.from_bytes(k[16:], "big"))
    except (DeltackptError, OSError, OverflowError):
        return None
    cid = codec.chunk_hex(k[:16], int.from_bytes(k[16:], "big"))
    return Problem(None, None, None, cid, f"index entry says codec {loc.codec}, base {loc.base.hex()}; its frame in "
                                          f"pack {loc.pack_id} at offset {loc.offset} has codec {h.codec}, base "
                                          f"{h.base.hex()}; {REPAIR_HINT}")


def _related(store: Store, keys: list[bytes], locs: dict[bytes, ChunkLoc]) -> list[list[tuple[bytes, list[bytes]]]]:
    """``keys`` (in order) split into groups of chunks that delta and predicted frames tie together, each chunk
    with the chunks its decode reads directly (a frame's base and the chunks a predicted frame's record names).
    In one group a base is decoded once: a delta chunk's chain stops at a base the group's memo holds."""
    predicted = [k for k in keys if k in locs and locs[k].codec == codec.PREDICTED]
    # a damaged record (or a header damaged into an unknown version) names nothing here: the chunk's own check
    # reports it
    direct = dict(zip(predicted, store._read_each(
        lambda k: _references(store, k, locs[k], unknown_format=True), predicted)))
    direct.update((k, [locs[k].base + k[16:]]) for k in keys if k in locs and locs[k].codec == codec.DELTA)
    root: dict[bytes, bytes] = {}

    def find(k: bytes) -> bytes:
        while root.get(k, k) != k:
            root[k] = root.get(root[k], root[k])  # path halving
            k = root[k]
        return k
    for k, rs in direct.items():
        for r in rs:
            a, b = find(k), find(r)
            if a != b:
                root[a] = b
    groups: dict[bytes, list[tuple[bytes, list[bytes]]]] = {}
    for k in keys:
        groups.setdefault(find(k), []).append((k, direct.get(k, [])))
    return list(groups.values())


def _check_group(store: Store, group: list[tuple[bytes, list[bytes]]],
                 locs: dict[bytes, ChunkLoc], scratch: Scratch) -> dict[bytes, str | None]:
    """Decode and check the chunks of one group of :func:`_related`, in order, with one memo of decoded chunks:
    every chunk that predictions read is decoded once for the group (not once per dependent), and dropped once
    the last chunk of the group that reads it is done. Returns each chunk's problem, or None."""
    readers = Counter(r for _, rs in group for r in rs)  # chunks of the group still to check that read r
    todo = {k for k, _ in group}
    memo: dict[bytes, np.ndarray] = {}
    out: dict[bytes, str | None] = {}
    try:
        for k, rs in group:
            err: str | None = None
            if k not in locs:
                err = "chunk is not in the index"
            elif k in memo:  # decoded already as another chunk's input (frames checked, bytes not yet hashed)
                if kernel.digest(memo[k]) != k[:16]:
                    err = "decoded bytes do not match the chunk id"
            else:
                buf = scratch.take(int.from_bytes(k[16:], "big"))
                try:
                    store._read_chunk(k, locs[k], out=buf, verify=True, memo=memo, scratch=scratch)
                    memo[k] = buf
                except DeltackptError as exc:  # corruption, or a damaged byte that reads as an unknown format
                    err = getattr(exc, "reason", None) or str(exc)
                    scratch.give(buf)
                except OSError as exc:  # an I/O error, a pack this user may not read: reported, as verify does
                    err = f"cannot read its frames: {exc}"
                    scratch.give(buf)
            out[k] = err
            todo.discard(k)
            for r in rs:
                readers[r] -= 1
            for r in (*rs, k):
                if readers[r] <= 0 and r not in todo and r in memo:
                    scratch.give(memo.pop(r))
    finally:
        for buf in memo.values():
            scratch.give(buf)
    return out


def _references(store: Store, k: bytes, loc: ChunkLoc, *, unknown_format: bool = False) -> list[bytes]:
    """:meth:`Store._references`, but none for a predicted frame whose record is damaged: it cannot be decoded,
    so it needs nothing. With ``unknown_format`` (verify, which frees nothing) none either for a frame of a
    format version this reader does not know, or whose pack cannot be read (an I/O error, a pack this user may
    not read: the chunk's own check reports it); gc lets those errors propagate, as a newer writer's frame may
    need chunks this reader cannot see it names. Any other read error propagates."""
    try:
        return store._references(k, loc)
    except CorruptChunkError:
        return []
    except (FormatVersionError, OSError):
        if unknown_format:
            return []
        raise


#: live chunks whose references one read worker follows at a time
_FOLLOW_BATCH = 256


def _live_keys(store: Store, records: list[Record], *, read_headers: bool = True) -> tuple[set[bytes], set[bytes]]:
    """The chunks the checkpoints of ``records`` reach (transitively), and those of them the index holds no
    entry for (lost with a damaged frame, or with a damaged index). ``read_headers`` (gc) also follows what
    each frame's header names (:func:`_gc_references`); without it, what the index entries say."""
    live: set[bytes] = set()
    for rec in records:
        try:
            m = store._manifest(rec)
        except CheckpointNotFoundError:
            continue  # deleted by another process since gc listed it: its chunks are not live
        except CorruptManifestError as exc:  # aborts gc: never free what it may reference; say how to go on
            raise CorruptManifestError(
                f"{exc}; gc frees nothing while it cannot tell what checkpoint {rec.id} (step {rec.step}) needs: "
                f"'deltackpt rm STORE {rec.id}' gives that checkpoint up, or {REPAIR_HINT} from the manifests "
                "when the index is what is out of date; then run gc again") from None
        # any other error (a read error) aborts gc too
        live.update(chunk_keys(*m.stored_chunks()))
    # what live chunks reference is live too (transitively): delta bases, and the bases and inputs of predicted
    # frames. A predicted frame whose record is damaged cannot be decoded, so what it names is no longer needed
    # by it; a read error aborts gc.
    return _reach(store, live, _gc_references if read_headers else _references)


def _reach(store: Store, roots: Iterable[bytes], follow: Callable[[Store, bytes, ChunkLoc], Iterable[bytes] | None], *,
           damaged_entries: bool = False) -> tuple[set[bytes], set[bytes]]:
    """Every chunk ``roots`` reach through what ``follow(store, key, loc)`` says each one's frame needs
    (transitively), and those of them that are lost: no index entry, or (``follow`` returns None) a frame that
    cannot be decoded. An index entry that does not parse raises, or with ``damaged_entries`` counts as lost.

    The frames are read on the read workers, in batches: from a cold disk each is a small random read, and
    several overlap."""
    reached = set(roots)
    lost: set[bytes] = set()
    frontier = list(reached)
    while frontier:
        locs = store.index.lookup_chunks(frontier, {} if damaged_entries else None)
        lost.update(k for k in frontier if k not in locs)
        frontier = []
        items = list(locs.items())
        batches = [items[i : i + _FOLLOW_BATCH] for i in range(0, len(items), _FOLLOW_BATCH)]
        for found in store._read_pool.map(lambda batch: [(k, follow(store, k, loc)) for k, loc in batch], batches):
            for k, refs in found:
                if refs is None:
                    lost.add(k)
                    continue
                for r in refs:
                    if r not in reached:
                        reached.add(r)
                        frontier.append(r)
    return reached, lost


def _gc_references(store: Store, k: bytes, loc: ChunkLoc) -> set[bytes]:
    """What gc keeps alive for chunk ``k``: the references its index entry names and those its frame names. Loads
    follow the frame; the index entry has no checksum, so a damaged one (another base, another codec) must not
    make gc free the base the frame needs.

    Only the frame's header and, for a predicted frame, its prediction record are read (gc reads one per live
    chunk, under the exclusive lock: whole predicted frames were 6% of every checkpoint's raw bytes), without
    the frame's checksum. A damaged record names chunks no decode needs: the frame fails its checksum whatever
    it names, so keeping what a damaged record names (and not what it named before the damage) loses nothing."""
    refs = {loc.base + k[16:]} if loc.codec in codec.BASED else set()
    try:
        buf = memoryview(store.reader.read(loc.pack_id, loc.offset,
                                           max(codec.HEADER_SIZE, min(loc.frame_len, codec.REFS_PREFIX))))
        h = codec.parse_header(buf)
    except CorruptChunkError:
        return refs  # no readable frame there: nothing more it could need
    except FormatVersionError:
        # An intact frame of a newer format may need chunks this reader cannot see it names: gc stops. A version
        # byte damaged into an unknown one fails the checksum. For an entry of a predicted frame, what the whole
        # frame says decides (as a load would read it: an unknown version it cannot check is a newer format).
        if loc.codec == codec.PREDICTED:
            return refs | set(_references(store, k, loc))
        newer: list[str] = []
        packs.intact_frame(memoryview(store.reader.read(loc.pack_id, loc.offset, loc.frame_len)), 0, newer)
        if newer:
            raise FormatVersionError(f"{newer[0]} in pack {loc.pack_id}") from None
        return refs  # garbage that reads as an unknown version (its checksum fails): damage, not a newer frame
    if h.digest != k[:16] or h.raw_len != int.from_bytes(k[16:], "big"):
        return refs  # another chunk's frame: the entry is damaged, and what that frame needs is its own affair
    if h.codec in codec.BASED:
        refs.add(h.base + k[16:])
    if h.codec == codec.PREDICTED:
        if len(buf) < min(h.frame_len, codec.REFS_PREFIX):  # the entry's length was short
            buf = memoryview(store.reader.read(loc.pack_id, loc.offset, min(h.frame_len, codec.REFS_PREFIX)))
        try:
            rec = codec.prediction_record(buf[codec.HEADER_SIZE : h.frame_len], version=h.version)
        except CorruptChunkError:
            return refs  # a damaged record: the frame cannot be decoded, so it needs nothing more
        refs.update(r + k[16:] for r in rec.refs)
    return refs


def _unindexed_live_frames(store: Store, missing: set[bytes], paths: list[Path]) -> list[str]:
    """Where the packs ``paths`` (those gc would delete or repack) hold a frame that decodes to a live chunk the
    index has no entry for: only a damaged index loses the entry of such a frame, and freeing the pack would
    lose the chunk. A delta or predicted frame whose references the index does not hold either (and no such
    frame provides) does not decode: a repair leaves it out too (its checkpoint incomplete), so it is no reason
    to keep a pack."""
    found: dict[bytes, list[tuple[str, list[bytes]]]] = {}  # chunk -> (where, the chunks its decode needs)
    for path in paths:
        try:
            for offset, h in packs.scan(path):
                k = chunk_key(h.digest, h.raw_len)
                if k not in missing:
                    continue
                where = f"chunk {codec.chunk_hex(h.digest, h.raw_len)} in pack {path.stem} at offset {offset}"
                try:
                    refs = store._references(k, ChunkLoc(path.stem, offset, h.frame_len, h.codec, 0, h.base))
                except CorruptChunkError:
                    continue
                found.setdefault(k, []).append((where, refs))
        except FileNotFoundError:
            continue
    # which of them decode: their references are indexed, or are among them and decode (a fixed point)
    indexed = set(store.index.lookup_chunks({r for frames in found.values() for _, refs in frames for r in refs}))
    decodes: dict[bytes, str] = {}
    grew = True
    while grew:
        grew = False
        for k, frames in found.items():
            if k in decodes:
                continue
            for where, refs in frames:
                if all(r in indexed or r in decodes for r in refs):
                    decodes[k] = where
                    grew = True
                    break
    return list(decodes.values())


def gc(
    store: Store, *, repack_below: float = 0.5, timeout: float | None = None, progress: Progress | None = None
) -> GcReport:
    """Reclaim everything no retained checkpoint can reach.

    Chunk entries no manifest (or live delta chain) references are dropped; packs with no live frame are
    deleted; packs whose live fraction is below ``repack_below`` have their live frames copied to a new pack
    and are deleted. Packs another writer still appends to are left alone. Orphan manifests and temporary
    files of interrupted saves are removed.

    What frees space without writing comes first, then the sparse packs one at a time, so gc helps on a full
    disk: when a copy finds no space (``ENOSPC``, ``EDQUOT``, ``EFBIG``) the copies of that pack are removed,
    repacking stops and ``repack_stopped`` in the report says so; everything freed until then stays freed. A
    sparse pack holding a damaged live frame is not copied (the damage would spread into the new pack) but left
    as it is, named in ``damaged_packs``; the other packs are still repacked.

    Saves and loads wait while gc finds the garbage and frees what needs no writing, and while it copies each
    sparse pack, but run between two packs: a training job that saves every step stalls for one pack's copy at
    a time, not for the whole repack. One gc or repair runs at a time (``maint.lock``). ``timeout`` bounds each
    wait for the store: one that runs out before anything was freed raises ``StoreLockedError``; later, it stops
    the repack (``repack_stopped``).
    """
    if isinstance(repack_below, (bool, np.bool_)) or not isinstance(repack_below, numbers.Real):
        raise TypeError(f"repack_below must be a fraction between 0 and 1, got {type(repack_below).__name__}")
    if not 0 <= repack_below <= 1:  # (NaN too)
        raise ValueError(f"repack_below must be a fraction between 0 and 1, got {repack_below!r}")
    repack_below = float(repack_below)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if timeout is not None and not timeout >= 0:  # (NaN too: no deadline would ever pass)
        raise ValueError(f"timeout must be at least 0 seconds, got {timeout!r}")
    _check_progress(progress)
    report = GcReport()
    with store._save_lock:
        store._writer.close()  # our own pack is sealed: gc may treat it like any other
    with _maintenance_lock(store, timeout), store.reader.transient():
        with store._gc_lock(exclusive=True, timeout=timeout):
            plan = _collect(store, repack_below, report)
        if plan:
            _repack(store, plan, report, timeout, progress)
    return report


#: gc's repack plan: each sparse pack's id and path
_Plan = list[tuple[str, Path]]


def _collect(store: Store, repack_below: float, report: GcReport) -> _Plan:
    """gc's first part, under the gc lock held exclusively: find the garbage, free what needs no writing, and
    return the sparse packs to repack."""
    problems = store.index.problems()
    if problems:
        # a lost record (its id still in the index) would leave its manifest looking like an orphan, its chunks
        # dead: only a repair, which rebuilds the index from what is on disk, can tell
        raise CorruptIndexError(f"gc refuses to run on an inconsistent index ({problems[0][1]}"
                                f"{f', and {len(problems) - 1} more problem(s)' if len(problems) > 1 else ''}"
                                f"); {REPAIR_HINT}, then run gc again")
    records = store.index.records()
    live, missing = _live_keys(store, records)
    dead: list[bytes] = []
    by_pack: dict[str, list[tuple[bytes, ChunkLoc]]] = {}
    for k, loc in store.index.iter_chunks():
        if k in live:
            by_pack.setdefault(loc.pack_id, []).append((k, loc))
        else:
            dead.append(k)
    report.dead_chunks = len(dead)
    all_packs = packs.pack_files(store.path / "packs")
    to_delete: list[Path] = []
    to_repack: list[str] = []
    for pack_id, path in all_packs.items():
        if packs.is_active(path):
            report.skipped_active_packs += 1
            continue
        live_entries = by_pack.get(pack_id, [])
        if not live_entries:
            to_delete.append(path)
            continue
        try:
            size = path.stat().st_size
        except OSError:  # gone meanwhile: nothing to repack
            continue
        live_bytes = sum(loc.frame_len for _, loc in live_entries)
        frames = size - packs.PACK_HEADER.size  # (a pack whose frames are all live is not sparse, at 1.0 too)
        # A pack that lost its tail (live frames past its end) goes to the repack too, whose copy reports the lost
        # frames as damage (damaged_packs), rather than being passed over without a word: its lost frames counted
        # as live bytes, so it never looked sparse.
        lost = any(loc.offset + loc.frame_len > size for _, loc in live_entries)
        # A damaged header is repaired the same way: the copy's new pack has an intact one (loads never needed it).
        if frames > 0 and (lost or live_bytes / frames < repack_below or _header_damage(path) is not None):
            to_repack.append(pack_id)
    # Live chunks whose entry names a pack that does not exist: the pack was lost, or the entry is damaged (one
    # flipped bit in its pack id) and the frame is in another pack, maybe one gc is about to free. The entry has
    # no checksum, so such a chunk counts as one without an entry.
    report.missing_packs = sorted(pack_id for pack_id in by_pack if pack_id not in all_packs)
    missing |= {k for pack_id in report.missing_packs for k, _ in by_pack[pack_id]}
    if missing:
        # Live chunks without an index entry: lost (a damaged frame: repair left its checkpoint incomplete),
        # or their entries are (a damaged index). Then the packs gc would free must not hold them.
        held = _unindexed_live_frames(store, missing, [*to_delete, *(all_packs[p] for p in to_repack)])
        if held:
            raise CorruptIndexError(
                f"the index has no usable entry for {len(missing)} chunk(s) retained checkpoints need (none, or "
                f"one naming a pack that does not exist), and gc would "
                f"free {held[0]}{f' (and {len(held) - 1} more)' if len(held) > 1 else ''}: the index is "
                f"damaged; {REPAIR_HINT}, then run gc again")
    # First what frees space without writing any (a full disk is when gc matters most). Orphan manifests
    # (of saves killed before their commit, of deletes killed before their unlink) go first, durably: a gc
    # killed after freeing their chunks would otherwise leave manifests naming chunks that are gone, which a
    # repair restores as damaged checkpoints. Then the dead entries, in one transaction, and the packs no
    # live frame is in.
    known = {r.id for r in records}
    mdir = store.path / "manifests"
    for p in mdir.glob("*.manifest"):  # (named as a manifest: a directory linked in for manifests/ may hold others)
        if manifest.is_id(p.stem) and p.stem not in known and p.is_file():
            report.freed_bytes += p.stat().st_size
            p.unlink()
            report.orphan_manifests += 1
    packs.fsync_dir(mdir)
    store.index.apply_chunk_changes(dead, {}, collected=True)
    _unlink_packs(store, to_delete, report)
    tmp = store.path / "tmp"
    for p in tmp.iterdir() if tmp.is_dir() else ():  # (an empty tmp/ lost, say by a cleaner: saves make it again)
        if manifest.TMP_NAME.fullmatch(p.name) and not p.is_symlink() and p.is_file():  # what saves leave; no other
            p.unlink()
    # STORE's temporary file, left by a creation killed before it linked STORE (no creation runs now: one
    # holds gc.lock exclusively until STORE is linked, and gc holds it here)
    for p in store.path.glob("STORE.*.tmp"):
        if not p.is_symlink() and p.is_file():
            p.unlink()
    # a lock file prepared for the index (index._reserve_lock_file) by an open killed before it linked it into
    # place; one an open prepares meanwhile (lock.mdb was removed under us) only falls back to LMDB making it
    for p in (store.path / "index").glob("lock.mdb.new-*"):
        if not p.is_symlink() and p.is_file():
            with suppress(FileNotFoundError):
                p.unlink()
    return [(pack_id, all_packs[pack_id]) for pack_id in to_repack]


def _repack(store: Store, plan: _Plan, report: GcReport,
            timeout: float | None, progress: Progress | None) -> None:
    """gc's second part: each sparse pack in turn, under the gc lock held exclusively for that pack only. Its
    live frames are copied and made durable, one transaction re-points them, and only then is the pack unlinked,
    so each step needs at most one pack's live bytes of space.

    Between two packs saves and loads run: a save may deduplicate onto a frame of a pack still to come, a
    rewrite re-point entries away from it. So each pack's turn copies what the index says lies in the pack
    then (a scan of the chunks table), not what gc found live before: also an entry a repair of an older
    deltackpt (which does not wait for ``maint.lock``) pointed at a frame there meanwhile. An entry that a
    delete left dead meanwhile is copied all the same; the next gc frees it. The scan covers every pack still to
    come and is taken again only when something other than gc's own re-pointing committed since (a save, a
    rewrite, a repair): one scan per pack made a repack of P packs read the table P times."""
    writer = packs.PackWriter(store.path / "packs", max_size=store._writer.max_size)  # (the store's pack_size)
    entries = _PackEntries(store, [pack_id for pack_id, _ in plan])
    try:
        for n, (pack_id, path) in enumerate(plan, 1):
            try:
                with store._gc_lock(exclusive=True, timeout=timeout):  # (_repack_one takes no lock of its own)
                    full = _repack_one(store, writer, pack_id, path, report, entries)
            except StoreLockedError as exc:
                report.repack_stopped = f"{exc}: {len(plan) - n + 1} pack(s) left to repack; run gc again"
                break
            if full is not None:
                report.repack_stopped = (f"{full}: {len(plan) - n + 1} pack(s) left to repack; free some space and "
                                         "run gc again")
                break
            if progress is not None:
                progress(n, len(plan))
    finally:
        writer.close()


class _PackEntries:
    """What the index says lies in each pack a repack has still to copy, from one scan of the chunks table for
    all of them, scanned again only when a commit other than the repack's own came in between. Each of the
    repack's commits re-points entries of the pack it copied only, at the pack its writer appends to (no pack
    of the plan), so it leaves the other packs' lists as they were."""

    def __init__(self, store: Store, pack_ids: list[str]) -> None:
        self.store = store
        self.pending = set(pack_ids)
        self.seen: Commit | None = None  # the commit the lists below are exact at
        self.by_pack: dict[str, list[tuple[bytes, ChunkLoc]]] = {}

    def of(self, pack_id: str) -> list[tuple[bytes, ChunkLoc]]:
        """The entries in pack ``pack_id`` now (called under the gc lock)."""
        if self.seen is None or self.store.index.last_commit() != self.seen:
            self.seen, self.by_pack = self.store.index.chunks_in_packs(self.pending | {pack_id})
        return self.by_pack.get(pack_id, [])

    def copied(self, pack_id: str, made: Commit) -> None:
        """The repack committed ``made``, re-pointing the entries of ``pack_id`` away from it."""
        self.pending.discard(pack_id)
        if self.seen is not None and made[0] is self.seen[0] and made[1] == self.seen[1] + 1:
            self.seen = made  # nothing else committed in between: the other lists still hold
        else:
            self.seen = None


def _repack_one(store: Store, writer: packs.PackWriter, pack_id: str, path: Path, report: GcReport,
                lists: _PackEntries) -> str | None:
    """Copy the live frames of one sparse pack, re-point their entries, unlink it. Returns None, or why gc must
    stop repacking (no space left: the copies are removed)."""
    entries = lists.of(pack_id)
    mark = writer.mark()
    moved: dict[bytes, ChunkLoc] = {}
    try:
        for k, loc in entries:
            frame = store.reader.read(loc.pack_id, loc.offset, loc.frame_len)
            codec.check_frame(frame, expect_digest=k[:16], expect_len=int.from_bytes(k[16:], "big"),
                              where=f"pack {pack_id} offset {loc.offset}")
            new_pack, off = writer.append(frame)
            moved[k] = ChunkLoc(new_pack, off, loc.frame_len, loc.codec, loc.depth, loc.base)
        writer.sync()
        lists.copied(pack_id, store.index.apply_chunk_changes([], moved))  # this pack's commit point
    except BaseException as exc:
        if not _repointed(store, moved):
            writer.rollback(mark)  # nothing references the copies: give their space back
        # damage (or a header damaged into an unknown version): leave the pack as it is, go on
        if isinstance(exc, (CorruptChunkError, FormatVersionError)):
            report.damaged_packs.append(f"pack {pack_id}: {exc}")
            return None
        if not isinstance(exc, OSError) or exc.errno not in _NO_SPACE:
            raise
        return str(exc.strerror or exc)
    report.moved_chunks += len(moved)
    report.repacked_packs += 1
    # their copies, and the header of each pack the copies opened: freed is net
    report.freed_bytes -= sum(loc.frame_len for loc in moved.values()) + packs.PACK_HEADER.size * len(writer.opened)
    _unlink_packs(store, [path], report)
    return None


@contextmanager
def _maintenance_lock(store: Store, timeout: float | None = None) -> Iterator[None]:
    """``maint.lock`` held exclusively: one gc or repair at a time. Taken before the gc lock, never while
    holding it (a gc between two packs holds this one and waits for the gc lock)."""
    if store._maint_fd is not None:  # a repair's handle holds it already (open_for_repair)
        yield
        return
    pid = os.getpid()
    fd = _take_maintenance_lock(store.path, timeout)
    try:
        yield
    finally:
        try:  # (before a Python function is called, and not in a forked child, as the gc lock's: Store._gc_lock)
            if pid == packs._pid:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        packs.close_lock(fd, pid)


def _take_maintenance_lock(root: Path, timeout: float | None = None, what: str = "") -> int:
    """Open ``root/maint.lock`` and flock it exclusively (within ``timeout`` seconds); return its descriptor."""
    return _flock_file(root, "maint.lock", timeout, busy="another gc or repair is running", what=what)


def _flock_file(root: Path, name: str, timeout: float | None = None, *, busy: str, what: str = "") -> int:
    """Open the lock file ``root/name`` and flock it exclusively, within ``timeout`` seconds when given (else
    raise ``StoreLockedError`` saying the store is ``busy``); return its file descriptor."""
    try:
        fd = packs.open_lock(root / name, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise ReadOnlyStoreError(f"{what}store {root} cannot be written ({exc.strerror})") from None
        raise
    try:
        packs.flock_within(fd, fcntl.LOCK_EX, timeout, f"store {root} is busy ({busy})")
    except BaseException:
        packs.close_lock(fd, os.getpid(), unlock=False)
        raise
    return fd


#: errnos of a write that failed for want of space: gc stops repacking and keeps what it freed
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _repointed(store: Store, moved: dict[bytes, ChunkLoc]) -> bool:
    """Whether a repack's commit took place after all (true when the index cannot say)."""
    if not moved:
        return False
    k, loc = next(iter(moved.items()))
    try:
        return store.index.lookup_chunks([k]).get(k) == loc
    except Exception:
        return True


def _unlink_packs(store: Store, paths: list[Path], report: GcReport) -> None:
    """Delete packs whose live frames (if any) are referenced elsewhere since a committed transaction."""
    for path in paths:
        try:
            report.freed_bytes += path.stat().st_size
            store.reader.forget(path.stem)
            path.unlink()
            report.deleted_packs += 1
        except FileNotFoundError:
            pass
    packs.fsync_dir(store.path / "packs")


def _make_durable(store: Store, path: Path, what: str) -> None:
    """fsync the pack or manifest ``path`` before a repair indexes it. A file that cannot be opened is left to the
    read that follows (damage, reported). An fsync that fails (EIO) says nothing of the file's bytes, and after
    one Linux may have dropped those not yet on the disk: the repair raises ``OSError`` before it changes
    anything. (Taken for damage, a transient error dropped an intact checkpoint from the index, whose manifest
    and chunks the next gc then deleted, or every frame of a pack.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        raise OSError(exc.errno, f"repair of {store.path} stopped before it changed anything: {what} {path.name} "
                                 f"could not be made durable ({exc.strerror}); run it again once the disk is "
                                 "healthy") from None
    finally:
        os.close(fd)


def repair(store: Store, *, progress: Progress | None = None) -> RepairReport:
    """Rebuild the LMDB index from the packs and manifests on disk (after the index was lost or damaged).

    Every intact frame of every pack is indexed; every manifest whose checksum holds becomes a checkpoint
    again, ordered by creation time. One whose chunks are not all found intact (a damaged frame, a lost pack)
    is restored too and reported in ``incomplete_checkpoints``: as before the index was lost, loading it
    raises ``CorruptChunkError`` naming what is missing, ``verify`` lists it, and ``gc`` keeps the rest of
    it, so a repair never frees more than the damage took (``delete`` it to let ``gc`` free it). Manifests that
    cannot be read are reported in ``lost_checkpoints``. A checkpoint that a :meth:`Store.rewrite` replaced (a
    complete manifest names it in ``replaces``) is not restored, even if the rewrite crashed before unlinking its
    manifest, or before its commit (the replacement's manifest is durable before the commit, and a repair cannot
    tell the two apart; later checkpoints may name the replacement as their parent). Note: a checkpoint deleted
    just before a crash (its manifest not yet unlinked) comes back; delete it again.
    """
    _check_progress(progress)
    report = RepairReport()
    with _maintenance_lock(store), store._gc_lock(exclusive=True):
        chunks: dict[bytes, ChunkLoc] = {}  # chunks with a standalone frame
        based: dict[bytes, list[ChunkLoc]] = {}  # the other chunks' delta and predicted frames
        pack_paths = sorted(packs.pack_files(store.path / "packs").values())
        for n, path in enumerate(pack_paths, 1):
            report.packs += 1
            damaged: list[int] = []
            # Durable before the index names its frames: a save killed before its fsync left them in the page
            # cache only, and a later save that deduplicates onto them writes and syncs nothing of its own.
            _make_durable(store, path, "pack")
            try:
                for offset, h in packs.scan(path, damaged=damaged):
                    k = chunk_key(h.digest, h.raw_len)
                    loc = ChunkLoc(path.stem, offset, h.frame_len, h.codec, 0, h.base)
                    if h.codec in codec.BASED:
                        based.setdefault(k, []).append(loc)
                    elif k not in chunks:
                        chunks[k] = loc
            except FormatVersionError as exc:
                raise _newer(exc) from None
            except (DeltackptError, OSError):
                damaged.append(-1)
            if damaged:
                report.damaged_packs.append(path.stem)
            if progress is not None:
                progress(n, len(pack_paths))
        _choose_frames(store, chunks, based)
        records: list[Record] = []
        for p in sorted((store.path / "manifests").glob("*.manifest")):
            try:
                data = manifest.file_bytes(p)
                m = manifest.parse(data, where=p.name)
            except FormatVersionError as exc:
                raise _newer(exc) from None
            except (DeltackptError, OSError):
                report.lost_checkpoints.append(p.stem)
                continue
            _make_durable(store, p, "manifest")  # (as the packs: one a killed save left unsynced becomes a checkpoint)
            if p.stem != m.id:
                report.lost_checkpoints.append(p.stem)
                continue
            if any(k not in chunks for _, k in _stored_chunks(m)):
                report.incomplete_checkpoints.append(m.id)
            records.append(
                Record(
                    id=m.id, step=m.step, created=m.created, parent=m.parent,
                    manifest_checksum=manifest.checksum_of(data), logical_bytes=m.logical_bytes,
                    written_bytes=m.written_bytes, metadata=m.metadata,
                    extra={"replaces": list(m.extra["replaces"])} if m.extra.get("replaces") else {},
                )
            )
        # A rewrite commits, then unlinks the manifest of the checkpoint it replaced: one killed in between left
        # both. The replaced one stays gone (its manifest is garbage for gc) unless its replacement is incomplete.
        incomplete = set(report.incomplete_checkpoints)
        replaced = {old for r in records if r.id not in incomplete for old in r.extra.get("replaces", ())}
        records = [r for r in records if r.id not in replaced]
        report.incomplete_checkpoints = [i for i in report.incomplete_checkpoints if i not in replaced]
        records.sort(key=lambda r: (r.created, r.id))  # (a rewrite keeps the creation time of what it replaced)
        packs.fsync_dir(store.path / "packs")
        packs.fsync_dir(store.path / "manifests")
        try:
            store.index.rebuild(chunks, records)
        except IndexWriteError as exc:
            if not isinstance(exc.__cause__, LMDB_DAMAGE):
                raise
            # pages LMDB meets while freeing the old tables are damaged: start a new index instead (still under
            # the exclusive gc lock, as format.md §7 requires of a repair that moves the index aside)
            rebuild_index_dir(store.path)
            store.index.start_over()
            store.index.rebuild(chunks, records)
        report.chunks = len(chunks)
        report.checkpoints = len(records)
    store._release_alone()  # (a handle of open_for_repair: the rebuilt index is the store's again)
    return report


def _newer(exc: FormatVersionError) -> FormatVersionError:
    """Why a repair stops at an intact frame or manifest of a format it does not know (a newer deltackpt's):
    rebuilding without it would drop that checkpoint, and the next gc would free its chunks."""
    return FormatVersionError(f"{exc}; a newer deltackpt wrote this store: repair it with that version (this one "
                              "would drop what it cannot read)")


def _choose_frames(store: Store, chunks: dict[bytes, ChunkLoc], based: dict[bytes, list[ChunkLoc]]) -> None:
    """Add to ``chunks`` (the standalone frames found, depth 0) one frame of each other chunk that decodes: a
    delta or predicted frame whose references (base, prediction inputs) all resolve, the shallowest one, with
    its chain depth. A chunk can have several such frames (a save killed before its commit leaves durable
    frames that a later save wrote again against other bases), and a reference may be gone (gc freed it): any
    frame whose references resolve will do, since every one of them decodes to the chunk's bytes. Chunks with
    no such frame are left out, as lost."""
    refs: dict[tuple[str, int], list[bytes]] = {}
    for k, locs in based.items():
        if k in chunks:
            continue
        for loc in locs:
            try:
                refs[(loc.pack_id, loc.offset)] = store._references(k, loc)
            except (CorruptChunkError, OSError):
                refs[(loc.pack_id, loc.offset)] = [bytes(20)]  # an unreadable record: never resolves
    pending = {k: locs for k, locs in based.items() if k not in chunks}
    while pending:  # each round resolves the chunks whose references were all resolved in earlier rounds
        found: dict[bytes, ChunkLoc] = {}
        for k, locs in pending.items():
            for loc in locs:
                names = refs[(loc.pack_id, loc.offset)]
                if all(r in chunks for r in names):
                    depth = 1 + max((chunks[r].depth for r in names), default=-1)
                    if k not in found or depth < found[k].depth:
                        found[k] = ChunkLoc(loc.pack_id, loc.offset, loc.frame_len, loc.codec, depth, loc.base)
        if not found:
            break  # what is left references chunks that are gone (or each other: a cycle is damage)
        chunks.update(found)
        for k in found:
            del pending[k]

def rebuild_index_dir(path: Path) -> Path | None:
    """Move a damaged index directory aside so a fresh one can be created; returns where it went."""
    idx = path / "index"
    if not idx.exists():
        return None
    dest = path / f"index.broken-{int(time.time())}"
    n = 1
    while dest.exists():  # (two repairs in one second)
        dest, n = path / f"index.broken-{int(time.time())}-{n}", n + 1
    shutil.move(str(idx), str(dest))
    packs.make_dirs(idx)  # (fsyncs ``path``: the move's entries too)
    return dest


def _manifest_chunk_sizes(root: Path, enough: int | None = None) -> set[int]:
    """The chunk sizes the store's readable manifests name; once one names ``enough``, those found so far (with
    it). A repair reads every manifest again, so reading them all here too parsed each twice, when a STORE file
    that one readable manifest agrees with is kept whatever the others name."""
    sizes = set()
    for p in sorted((root / "manifests").glob("*.manifest")):
        try:
            sizes.add(manifest.parse(manifest.file_bytes(p), where=p.name).chunk_size)
        except (DeltackptError, OSError):
            continue
        if enough is not None and enough in sizes:
            break
    return sizes


def _restore_store_file(root: Path) -> None:
    """Write the ``STORE`` file again with the chunk size the store's manifests name when it is lost or damaged
    (moved aside to ``STORE.broken-<time>``): when it does not describe a store this version can read and write
    (a newer format version is no damage: opening the store reports it), or names another chunk size than the
    one every readable manifest names (the chunk size never changes: a damaged digit that still parses)."""
    stored = None
    if (root / "STORE").exists():
        try:
            stored = read_store_file(root)
        except FormatVersionError:
            return
        except DeltackptError:
            pass
    sizes = _manifest_chunk_sizes(root, enough=stored)
    if stored is not None and (len(sizes) != 1 or stored in sizes):
        return  # intact, as far as the manifests can tell
    if len(sizes) != 1:
        raise DeltackptError(
            (f"{root} is not a deltackpt store: it does not exist" if not os.path.lexists(root) else
             f"{root} is not a deltackpt store: it is a dangling symbolic link (or a loop of them)"
             if not os.path.exists(root) else  # (a link to nothing, or a loop: as the other commands say it)
             f"{root} is not a deltackpt store (no readable STORE file)") if not sizes else
            f"{root} lost its STORE file (or it is damaged) and its manifests name several chunk sizes "
            f"{sorted(sizes)}")
    if (root / "STORE").exists():
        os.replace(root / "STORE", root / f"STORE.broken-{int(time.time())}")
    write_store_file(root, config.check_chunk_size(sizes.pop()))


def _lock_alone(root: Path) -> int:
    """Take the store's gc lock exclusively (as gc and repair do: no save or load of any process runs while it
    is held) and return its file descriptor."""
    return _flock_file(root, "gc.lock", busy="saves or loads in progress", what="cannot repair: ")


def _open_if_readable(path: str | os.PathLike[str], kwargs: dict[str, Any]) -> Store | None:
    """The store at ``path`` opened for repair, or None when its index cannot be opened or its records read."""
    from deltackpt.store import Store

    data = Path(path) / "index" / "data.mdb"
    if not data.is_file() or data.stat().st_size == 0:
        # Lost: not opened here, as LMDB would create a new data file beside the lock file that processes still
        # reading the old (unlinked) one share, and their reads would follow this file's commits. Moved aside
        # instead, so they follow the new index directory (Index.refresh).
        return None
    try:
        store = Store(path, _repair=True, **kwargs)
    except (lmdb.Error, CorruptionError):  # (not a ValueError: a bad setting is the caller's, the index is fine)
        return None
    try:
        # a damaged page LMDB would abort on, reading the records below: the repair with it (probed once the
        # settings are known good: a repair they refuse changes nothing, the probe's reader slot included)
        if unwalkable(data.parent) is not None:
            raise CorruptIndexError(f"the index of store {path} has a page LMDB aborts on")
        store.index.records()
        if not store.index.has_format_record():  # emptied: as lost
            raise CorruptIndexError(f"the index of store {path} holds no format record")
    except (lmdb.Error, CorruptionError, ValueError):
        store.close()
        return None
    return store


def open_for_repair(path: str | os.PathLike[str], **kwargs: Any) -> Store:
    """Open a store whose index may be unreadable, for :func:`repair`: a damaged index is moved aside and an
    empty one created; a lost or damaged ``STORE`` file is written again from the manifests.

    The returned handle holds the store's gc lock exclusively until its repair commits (or it is closed): saves
    and loads of other processes wait for the rebuilt index rather than meet the empty one. Their open handles
    then switch to it (:meth:`Index.refresh`)."""
    from deltackpt.store import Store

    root = Path(path)
    _restore_store_file(root)  # (when lost or damaged; no store opens meanwhile: no lock needed)
    pid = os.getpid()
    mfd = _take_maintenance_lock(root, what="cannot repair: ")  # (before the gc lock: see _maintenance_lock)
    try:
        fd = _lock_alone(root)
    except BaseException:
        packs.close_lock(mfd, pid)
        raise
    try:
        store = _open_if_readable(path, kwargs)
        if store is None:  # the index is unusable: start a new one
            rebuild_index_dir(root)
            store = Store(path, _repair=True, **kwargs)
    except BaseException:
        for f in (fd, mfd):
            packs.close_lock(f, pid)
        raise
    store._alone_fd, store._maint_fd, store._alone_pid = fd, mfd, pid
    store._alone_held[:] = [(fd, pid), (mfd, pid)]  # (released by its finalizer, were it dropped unclosed)
    return store


__all__ = ["GcReport", "Problem", "Progress", "RepairReport", "VerifyReport", "find_damaged_frames", "gc",
           "open_for_repair", "rebuild_index_dir", "repair", "verify"]

#: seconds gc after retention waits for a store another process holds (its gc or repair) before it gives up until
#: the next save
GC_WAIT = 1.0

class GcAfterRetention:
    """The rule that runs gc after retention, for :class:`Checkpointer` and the DCP writer: once the bytes that
    the checkpoints deleted or thinned since a store's last gc wrote (the store counts them, whichever process
    deleted them: :meth:`Index.dropped_bytes`) reach a quarter of what the kept ones wrote, and at least
    ``DELTACKPT_GC_MIN_BYTES`` (read when this is made). A gc that failed is tried again once as much more is
    dropped, not at every save."""

    def __init__(self) -> None:
        self.min_bytes = config.gc_min_bytes()
        #: per store: the count that stands for none here (where a gc failed; 0 after one ran)
        self._floor: dict[os.PathLike[str], int] = {}

    def gc_if_due(self, store: Store, kept: int) -> GcReport | None:
        """gc ``store`` if it is due (``kept``: the bytes the kept checkpoints wrote); None when it is not, or
        another process holds the store for longer than :data:`GC_WAIT` when gc starts (tried again at the next
        save; a repack stopped later is in the report, ``repack_stopped``). Raises what gc raises."""
        dropped = store.index.dropped_bytes()
        floor = self._floor[store.path] = min(self._floor.get(store.path, 0), dropped)  # (a gc elsewhere zeroed it)
        if dropped <= floor or dropped - floor < max(self.min_bytes, kept // 4):
            return None
        try:
            report = store.gc(timeout=GC_WAIT)
        except StoreLockedError:
            return None
        except (DeltackptError, OSError):
            self._floor[store.path] = dropped
            raise
        self._floor[store.path] = 0
        return report
