"""The LMDB index: chunk id -> frame location, the checkpoint records, and THE commit point.

Where it sits: ``save`` asks a :meth:`Index.chunk_reader` (one read transaction) which chunks are already stored
(and where, for a self-contained save and for delta bases), writes the new ones to packs and its manifest to disk,
then calls :meth:`Index.commit_checkpoint`: one LMDB write transaction that records the new chunks' locations and
the checkpoint. That transaction's commit is the single moment a checkpoint comes to exist. ``load`` resolves a step
to a record and chunk ids to locations here.

Databases in the environment ``index/``:

``meta``    ``format`` -> index format version, ``seq`` -> last commit sequence number (u64 BE), ``dropped`` -> bytes
            written by checkpoints deleted or replaced since the last gc (u64 BE)
``chunks``  digest(16) + raw length (u32 BE) -> :data:`LOC` (pack, offset, frame length, codec, depth, base)
``ckpts``   seq (u64 BE) -> checkpoint record (JSON, see :class:`Record`)
``ids``     checkpoint id (ascii) -> seq
``steps``   step (u64 BE) + seq (u64 BE) -> b""

LMDB has no page checksums; the manifests carry their own, and records hold the manifest's checksum. Beside the
environment, the store file :data:`LAST_COMMIT` holds the seq of the newest checkpoint committed: an index whose
own ``seq`` is lower is older than the store (restored from an older copy, or LMDB reading an older meta page
after one flipped bit), and every operation refuses it (:meth:`Index.check_current`) before gc could take the
newer checkpoints' manifests for orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import inspect
import itertools
import json
import mmap
import os
import re
import resource
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from deltackpt import manifest
from deltackpt.codec import HEADER_SIZE as _FRAME_HEADER
from deltackpt.errors import (
    CheckpointNotFoundError,
    CorruptIndexError,
    CorruptManifestError,
    DeltackptError,
    FormatVersionError,
    IndexWriteError,
    NetworkFilesystemError,
    ReadOnlyStoreError,
)
from deltackpt.packs import fsync_dir, make_dirs, read_file

INDEX_VERSION = 1
LOC = struct.Struct("<16sQIBB16s")  # pack id (uuid bytes), offset, frame length, codec, chain depth, base digest
_U64 = struct.Struct(">Q")
_CHUNK_LEN = struct.Struct(">I")
MAP_SIZE = 1 << 38
#: a commit of the index: its environment and the transaction id (equal to an earlier one when nothing committed)
Commit = tuple[lmdb.Environment, int]

NETWORK_FILESYSTEMS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "9p", "afs", "beegfs",
    "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.glusterfs", "fuse.cephfs", "panfs", "wekafs",
}


def chunk_key(digest: bytes, length: int) -> bytes:
    return digest + _CHUNK_LEN.pack(length)


def chunk_keys(digests: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """:func:`chunk_key` of each row of ``digests`` (K, 16) with its length, built in one pass."""
    rows = np.empty((len(lengths), 16 + _CHUNK_LEN.size), dtype=np.uint8)
    rows[:, :16] = digests
    rows[:, 16:] = np.asarray(lengths, dtype=">u4").view(np.uint8).reshape(-1, _CHUNK_LEN.size)
    raw, width = rows.tobytes(), rows.shape[1]
    return [raw[i : i + width] for i in range(0, len(raw), width)]


@dataclass(frozen=True, slots=True)
class ChunkLoc:
    pack_id: str
    offset: int
    frame_len: int
    codec: int
    # frames a decode reads beyond this one: 0 standalone, base's depth + 1 for a delta, 1 + the deepest of its
    # base and references for a predicted frame (an upper bound once an input is re-pointed to a shallower frame)
    depth: int
    base: bytes  # 16 zero bytes unless the frame is a delta or predicted frame

    def pack(self) -> bytes:
        return LOC.pack(bytes.fromhex(self.pack_id), self.offset, self.frame_len, self.codec, self.depth, self.base)

    @classmethod
    def unpack(cls, raw: bytes, key: bytes | None = None) -> ChunkLoc:
        """The location stored for chunk ``key``, its offset and frame length checked to be ones a frame of
        that chunk can have: a damaged entry must not have a read seek past what a file offset holds or reserve
        gigabytes (format.md §6)."""
        if len(raw) != LOC.size:
            raise CorruptIndexError(f"chunk location record has {len(raw)} bytes, expected {LOC.size}")
        pack_id, offset, frame_len, codec, depth, base = LOC.unpack(raw)
        if key is not None:
            raw_len = int.from_bytes(key[16:], "big")
            if len(key) != 16 + _CHUNK_LEN.size or not MIN_OFFSET <= offset < MAX_OFFSET or not (
                    _FRAME_HEADER <= frame_len <= max_frame_len(raw_len)):
                raise CorruptIndexError(
                    f"index entry of chunk {key[:16].hex()}-{raw_len} is damaged (offset {offset}, frame length "
                    f"{frame_len}); {REPAIR_HINT}")
        return cls(pack_id.hex(), offset, frame_len, codec, depth, base)


#: the smallest pack offset an index entry may hold (frames start after the pack's 16-byte header, format.md §4)
MIN_OFFSET = 16
#: the largest pack offset an index entry may hold (a file offset is a signed 64-bit number)
MAX_OFFSET = 1 << 62


def max_frame_len(raw_len: int) -> int:
    """The longest frame a chunk of ``raw_len`` bytes may have: a raw frame is header + raw bytes, and a writer
    keeps another encoding only when it is smaller (a predicted frame's record adds at most a few hundred
    bytes); the slack is generous."""
    return _FRAME_HEADER + raw_len + raw_len // 64 + 4096


@dataclass
class Record:
    """What the index keeps about one checkpoint (the manifest holds the rest)."""

    id: str
    step: int
    created: float
    parent: str | None
    manifest_checksum: str
    logical_bytes: int
    written_bytes: int
    metadata: Any = None  # tree-encoded (see deltackpt.tree), None when absent
    seq: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def loads(cls, raw: bytes) -> Record:
        """The record from its JSON, each field checked for its type and range (format.md §6)."""
        d: Any = None
        try:
            d = json.loads(raw)
            if type(d) is not dict or not d.keys() <= _RECORD_FIELDS:
                raise ValueError(f"unknown fields {sorted(d.keys() - _RECORD_FIELDS) if type(d) is dict else d!r:.80}")
            manifest.check_fields(d)
            if type(d.get("manifest_checksum")) is not str or not _CHECKSUM.fullmatch(d["manifest_checksum"]):
                raise ValueError(f"manifest_checksum is {d.get('manifest_checksum')!r:.60}")
            if type(d.get("seq", 0)) is not int or not 0 <= d.get("seq", 0) < 1 << 64:
                raise ValueError(f"seq is {d['seq']!r:.60}")
            return cls(**d)  # (its metadata is decoded where it is used: CheckpointInfo.from_record)
        except (ValueError, TypeError, RecursionError, CorruptManifestError) as exc:
            named = type(d) is dict and type(d.get("id")) is str and type(d.get("step")) is int
            which = f" of checkpoint {d['id']:.40} (step {d['step']})" if named else ""
            raise CorruptIndexError(f"unreadable checkpoint record{which}: {exc}; {REPAIR_HINT}") from None


_RECORD_FIELDS = frozenset(f.name for f in fields(Record))
_CHECKSUM = re.compile(r"[0-9a-f]{32}")


REPAIR_HINT = "'deltackpt repair STORE' rebuilds the index"

#: the store file (beside ``index/``) that holds the seq of the newest committed checkpoint, as 20 ASCII digits
#: and a newline (format.md §6)
LAST_COMMIT = "LAST_COMMIT"
#: no store makes 2^62 commits: a recorded seq at or above it is damage (and a repair numbering on from it could
#: run out of u64)
_SEQ_LIMIT = 1 << 62


#: ``meta`` key of the bytes written by the checkpoints deleted or replaced since the last gc (format.md §6): what
#: a Checkpointer's gc rule weighs, kept in the store so that it adds up across the processes of a restarted job
DROPPED = b"dropped"


def _dropped_value(raw: bytes | memoryview | None) -> int:
    """The ``dropped`` counter from its stored value; 0 for none, and for a value out of shape (it is advisory:
    damage only delays or brings forward a gc, and the next delete writes it again)."""
    return _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 and raw[0] < 0x40 else 0


def read_last_commit(store: Path) -> int | None:
    """The seq ``LAST_COMMIT`` of the store at ``store`` records; None when there is none, or it cannot be read
    or parsed (damaged, or cut short): the next commit writes it again, and until then nothing is checked."""
    try:  # (not through a link, nor a FIFO's wait, nor more than a line: the file is the store's own, and small)
        text = read_file(store / LAST_COMMIT, 64, follow=False).strip()
    except OSError:
        return None
    value = int(text) if 0 < len(text) <= 20 and text.isdigit() else None
    return value if value is not None and value < _SEQ_LIMIT else None


def write_last_commit(store: Path, seq: int) -> None:
    """Record ``seq`` in the store's ``LAST_COMMIT``, after its commit (one write, no fsync: a lost or late write
    only leaves the file behind the index, which the check allows). A failure is ignored for the same reason."""
    try:  # never through a symbolic link (it would write outside the store), nor waiting on a FIFO
        fd = os.open(store / LAST_COMMIT, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                     0o644)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return  # (a device, a FIFO with a reader: not the store's file, and not written)
        os.pwrite(fd, f"{seq:020d}\n".encode(), 0)
    except OSError:
        pass
    finally:
        os.close(fd)


def record_at(sk: bytes, raw: bytes) -> Record:
    """The record stored under key ``sk`` of the checkpoints table, checked to be the one of that seq."""
    rec = Record.loads(raw)
    if len(sk) != 8 or rec.seq != _U64.unpack(sk)[0]:
        raise CorruptIndexError(f"index record of checkpoint {rec.id} (seq {rec.seq}) is stored under seq "
                                f"{int.from_bytes(sk, 'big')}; {REPAIR_HINT}")
    return rec


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` as /proc/self/mounts names it ('' when unknown)."""
    try:
        real = os.path.realpath(path)
        best, best_type = "", ""
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, best_type = mnt, parts[2]
        return best_type
    except OSError:
        return ""


def check_local(path: Path) -> None:
    """Raise NetworkFilesystemError if ``path`` (or where it would be created) is on a network filesystem."""
    fstype = filesystem_type(path)
    if fstype in NETWORK_FILESYSTEMS or fstype.startswith("nfs"):  # local FUSE (fuse-overlayfs) is fine
        raise NetworkFilesystemError(
            f"{path} is on a {fstype} filesystem, where LMDB's locking is unsafe; put the store on local "
            "disk, or pass allow_network_fs=True (DELTACKPT_ALLOW_NETWORK_FS=1) if only one host uses it"
        )


def _lmdb_open(path: Path, **opts: Any) -> lmdb.Environment:
    """``lmdb.open``, with a smaller map where the process may not reserve :data:`MAP_SIZE` of address space
    (``ulimit -v``, as some clusters set): the largest power of two of at most a quarter of that limit, and at
    least twice the index file. The map bounds only how large the index may grow (a write past it fails as an
    ``IndexWriteError``), and each process chooses its own."""
    try:
        return lmdb.open(str(path), **opts)
    except lmdb.MemoryError:
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            raise
        try:
            need = 2 * (path / "data.mdb").stat().st_size
        except OSError:
            need = 0
        size = 1 << max(26, (limit // 4).bit_length() - 1)
        if size >= opts["map_size"] or size < need:
            raise
        return lmdb.open(str(path), **{**opts, "map_size": size})


class _Shared:
    """One LMDB environment per process and path: LMDB forbids opening an environment twice in a process."""

    #: LMDB refused the environment for good (``MDB_PANIC``) and it was closed: the next use opens it afresh
    #: (:meth:`Index._reopen_if_failed`)
    failed = False

    def __init__(self, path: Path, readonly: bool, create: bool, rebuilding: bool) -> None:
        """``readonly``: create nothing and write nothing. The environment is still opened for writing where
        that is allowed (LMDB's reader table then works as for any reader, and a writing handle of this process
        can share it); on a read-only filesystem, or without write permission, it is opened read-only, and
        without LMDB's lock file when that cannot be opened either (nothing can write there).

        ``create``: a new store's index, which gets its ``format`` record now. Otherwise an index without that
        record (its files deleted or emptied) is lost, and opening it raises :class:`CorruptIndexError` before
        anything is created, unless ``rebuilding`` (a repair, whose rebuild writes the record)."""
        if path.exists() and not path.is_dir():
            raise CorruptIndexError(_lost(path, f"{path} is not a directory"))
        if not (create or rebuilding):
            data = path / "data.mdb"
            try:
                lost = data.stat().st_size == 0
            except FileNotFoundError:
                lost = True
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                raise CorruptIndexError(_lost(path, f"{data} is a symbolic link that loops")) from None
            if lost:
                raise CorruptIndexError(_lost(path, f"{data} is missing or empty"))
        for name in ("data.mdb", "lock.mdb"):
            # LMDB opens both for writing and follows links: it would rewrite the file a link names, wherever it
            # is (the lock file's reader table overwrites whatever file a received store's lock.mdb leads to, at
            # the first listing); no writer makes one, and a repair moves the index aside
            if (path / name).is_symlink():
                raise CorruptIndexError(f"the index of store {path.parent} is damaged: {path / name} is a symbolic "
                                        "link, which LMDB would write through; 'deltackpt repair STORE' rebuilds the "
                                        "index from packs and manifests")
        short = _truncated(path / "data.mdb")
        if short is not None:  # (a repair too: it moves the index aside and starts a new one)
            raise CorruptIndexError(f"the index of store {path.parent} is damaged: {short}; 'deltackpt repair "
                                    "STORE' rebuilds it from packs and manifests")
        try:
            self._open(path, readonly, create, rebuilding)
        except lmdb.Error as exc:  # LMDB's own errors name no store and are no DeltackptError
            if isinstance(exc, (lmdb.DiskError, lmdb.MapFullError)) or "No space left" in str(exc):  # not damage
                raise IndexWriteError(errno.ENOSPC, f"cannot open the index of store {path.parent}: {exc}; "
                                      "free some space and try again") from exc
            if isinstance(exc, lmdb.ReadonlyError) or "Permission denied" in str(exc):  # (EACCES: not damage)
                raise ReadOnlyStoreError(
                    f"cannot open the index of store {path.parent} for writing: {exc}: a file of {path} is not "
                    "writable by this user (LMDB's lock.mdb, another user's, say); give this user write access to "
                    "the store's files") from exc
            if "already open in this process" in str(exc):  # the user's own LMDB handle on it: no damage
                raise DeltackptError(
                    f"cannot open the index of store {path.parent}: this process holds it open through an LMDB "
                    "handle of its own (lmdb.open of its index directory), and LMDB allows one per process; close "
                    "that handle first (deltackpt's Store handles of one store share theirs)") from exc
            if create:  # a new store's index: nothing there to be damaged, the writes failed (EIO for ENOSPC too)
                raise IndexWriteError(_write_errno(exc), f"could not create the index of store {path.parent}: "
                                      f"{type(exc).__name__}: {exc}") from exc
            raise CorruptIndexError(
                f"cannot open the index of store {path.parent}: {type(exc).__name__}: {exc}; if it is damaged, "
                "'deltackpt repair STORE' rebuilds it from packs and manifests") from exc

    def _open(self, path: Path, readonly: bool, create: bool, rebuilding: bool) -> None:
        opts = dict(map_size=MAP_SIZE, max_dbs=8, subdir=True, sync=True, metasync=True, readahead=False,
                    meminit=False, create=not readonly)
        if not readonly or path.is_dir():
            _reserve_lock_file(path)
        self.readonly = False
        try:
            self.env = _lmdb_open(path, readonly=False, lock=True, **opts)
        except lmdb.Error:
            if not readonly:
                raise
            self.readonly = True
            try:
                self.env = _lmdb_open(path, readonly=True, lock=True, **opts)
            except lmdb.Error:
                self.env = _lmdb_open(path, readonly=True, lock=False, **opts)
        self.refs = 0
        try:
            self.dbs = {name: self.env.open_db(name.encode(), create=not readonly)
                        for name in ("meta", "chunks", "ckpts", "ids", "steps")}
            self.main = self.env.open_db(None)  # (the table records: unsafe_pages reads their roots there)
            try:
                st = (path / "data.mdb").stat()
                self.data_id: tuple[int, int] | None = (st.st_dev, st.st_ino)
            except OSError:
                self.data_id = None
            try:  # (the file whose reader table a forked child must not write: _unshare_reader_table)
                st = (path / "lock.mdb").stat()
                self.lock_id: tuple[int, int, str] | None = (st.st_dev, st.st_ino,
                                                              os.path.realpath(path / "lock.mdb"))
            except OSError:
                self.lock_id = None
            if not self.readonly:
                self.env.reader_check()  # clear reader slots of dead processes
            with self.env.begin(write=create) as txn:
                v = txn.get(b"format", db=self.dbs["meta"])
                if v is None and create:
                    txn.put(b"format", str(INDEX_VERSION).encode(), db=self.dbs["meta"])
                elif v is None and not rebuilding:
                    raise CorruptIndexError(_lost(path, "it holds no format record"))
                elif v is not None and (not v.isdigit() or len(v) > 9):  # (no format number is that long)
                    raise CorruptIndexError(_lost(path, f"its format record is {bytes(v)[:20]!r}"))
                elif v is not None and int(v) > INDEX_VERSION:
                    raise FormatVersionError(f"index format {int(v)} is newer than this reader ({INDEX_VERSION})")
        except BaseException:
            self.env.close()
            raise


#: The size LMDB gives a new lock file: its reader table header and py-lmdb's 126 reader slots (tests check it).
LOCK_FILE_BYTES = 8192


def _reserve_lock_file(path: Path) -> None:
    """Give a new LMDB lock file its disk blocks before LMDB maps it.

    LMDB sizes a new ``lock.mdb`` with ftruncate and then writes into it through a shared map: where the disk is
    full, such a write kills the process with SIGBUS instead of failing. So a missing lock file is made here
    first: a file of :data:`LOCK_FILE_BYTES` (the size LMDB would give it, so LMDB keeps it as it is) with its
    blocks allocated, prepared under another name and linked into place (an existing one, another process's,
    is never replaced). On a full disk that fails with ``ENOSPC``, as an :class:`IndexWriteError`. Anything
    else that goes wrong (no write permission, a read-only filesystem, no hard links or no fallocate there) is
    left to LMDB's open, which makes the file as before or reports the trouble."""
    lock = path / "lock.mdb"
    if os.path.lexists(lock):
        return
    new = path / f"lock.mdb.new-{os.getpid()}-{threading.get_ident()}"
    try:
        path.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            new.unlink()  # left by a process of the same pid that was killed here
        fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError:
        return
    try:
        try:
            os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
        finally:
            os.close(fd)
        os.link(new, lock)
    except FileExistsError:
        pass  # another process made it meanwhile
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise IndexWriteError(errno.ENOSPC, f"cannot open the index of store {path.parent}: no space left "
                                  f"for LMDB's lock file {lock} ({exc.strerror}); free some space and try again"
                                  ) from None
    finally:
        with contextlib.suppress(OSError):
            new.unlink()


#: LMDB's meta pages (pages 0 and 1), x86-64 and other 64-bit little-endian builds: after the 16-byte page
#: header, MDB_meta holds magic and version (u32 each) at 16, the page size in the free DB's ``md_pad`` (u32)
#: at 40, the root pages of the free DB and the main DB (u64 each) at 80 and 128, and the last used page and
#: the transaction id (u64 each) at 136.
_META = struct.Struct("<II16xI36xQ40xQQQ")
_LMDB_MAGIC = 0xBEEFC0DE
_NO_PAGE = (1 << 64) - 1
#: A child process reads every page the index's trees reach: SIGBUS kills it, not the caller, when one lies
#: past the end of the file.
_PROBE = """
import sys, lmdb
path = sys.argv[1]
try:
    env = lmdb.open(path, readonly=False, lock=True, create=False, max_dbs=8, subdir=True)
except lmdb.Error:  # nothing can write there: reading without LMDB's lock is safe
    env = lmdb.open(path, readonly=True, lock=False, create=False, max_dbs=8, subdir=True)
with env.begin(buffers=True) as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
    for name in names:
        for _ in txn.cursor(db=env.open_db(name, txn=txn, create=False)):
            pass
"""


def _truncated(data: Path) -> str | None:
    """Why ``data`` (an LMDB ``data.mdb``) is shorter than the pages it uses, or None. LMDB maps the file and
    reads the pages its trees reach: past the end of a truncated file (a torn copy, a full disk during a copy)
    that is SIGBUS, which kills the process (and a repair with it) instead of raising.

    The newest meta page names the last page used; a file at least that long is whole. A shorter one may still
    be whole: LMDB does not write pages a transaction dirtied and freed again, and the last of those can lie
    past the end. Then the root pages must lie inside the file, and a child process reads every page the trees
    reach. The meta pages are read before the length: a writer elsewhere writes a commit's pages before the
    meta page that names them, and LMDB never shortens the file, so a commit landing meanwhile cannot look like
    a truncation."""
    try:
        with open(data, "rb") as f:
            first = f.read(16 + _META.size)
            if not first:
                return None  # a new environment (LMDB writes its meta pages) or a lost one (refused as such)
            if len(first) < 16 + _META.size:
                return f"{data} holds {len(first)} bytes, less than one meta page (it was truncated)"
            magic, _, psize, *_ = _META.unpack_from(first, 16)
            if magic != _LMDB_MAGIC or psize < 512 or psize > 1 << 16 or psize & (psize - 1):
                return None  # not a layout this check knows: LMDB reports what it finds
            f.seek(psize)
            second = f.read(16 + _META.size)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None  # opening reports it
    metas = [_META.unpack_from(first, 16)]
    if len(second) == 16 + _META.size:
        metas.append(_META.unpack_from(second, 16))
    _, _, _, free_root, main_root, last, _ = max((m for m in metas if m[0] == _LMDB_MAGIC), key=lambda m: m[6])
    pages = size // psize
    if pages >= max(2, last + 1):
        return None
    if pages < 2 or any(root != _NO_PAGE and root >= pages for root in (free_root, main_root)):
        return f"{data} holds {size} bytes, less than the pages its meta page names (it was truncated)"
    if _probe(data.parent) == signal.SIGBUS:
        return f"{data} holds {size} bytes, less than the pages its trees reach (it was truncated)"
    return None


#: LMDB's page and node layout (mdb.c of LMDB 0.9, 64-bit builds): a page starts with a 16-byte header, its page
#: number (u64), a pad (u16), its flags (u16) and ``mp_lower``/``mp_upper`` (u16 each; an overflow page holds its
#: page count there instead), then an array of u16 node offsets, counted from the page's start, up to
#: ``mp_lower``. A node is lo, hi, flags, key size (u16 each) and its key; a branch node's child page number is
#: lo | hi << 16 | flags << 32, a leaf node's data size is lo | hi << 16 and its data follows the key, or for a
#: value of ``F_BIGDATA`` the number (u64) of the first of the overflow pages that hold it.
_PAGE_HEADER = 16
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2, _P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
_P_TYPE = _P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_META | _P_LEAF2 | _P_SUBP
_F_BIGDATA = 0x01
#: MDB_db: pad (u32), flags (u16), depth (u16), branch, leaf and overflow page counts, entries, root (u64 each)
_MDB_DB = struct.Struct("<IHH4QQ")
_MDB_DUPSORT = 0x04
#: LMDB's cursor stack (CURSOR_STACK): no tree it reads is deeper
_MAX_DEPTH = 32


def unsafe_pages(txn: lmdb.Transaction, main: Any, name: str, data: Path, data_id: tuple[int, int] | None,
                 ) -> str | None:
    """Why LMDB's cursor walk of table ``name`` in read transaction ``txn`` would dereference a damaged page,
    or None when every page of that table's tree is sound (or the layout is not one this check knows).

    LMDB checks the pages a search passes, but a cursor that steps to the next leaf (``next`` and ``set_range``
    alike) asserts that page's type (``mdb_cassert(IS_LEAF(mp))``, an abort of the process) and trusts its node
    offsets (a read outside the map: SIGSEGV or SIGBUS). So before a full scan this walks the table's B-tree
    from its root in ``data`` (the environment's ``data.mdb``, mapped read-only) and checks every page it
    reaches: the page number its header holds is its own, its type is branch or leaf (the same on a level, a leaf
    level last, no page reached twice), ``mp_lower``/``mp_upper`` and each node lie inside the page, each child
    page (and each overflow run a big value names) lies at or below the snapshot's last page and within the file.

    The walk reads the pages of ``txn``'s own snapshot, whatever other processes commit meanwhile. The root comes
    from the table's MDB_db record, read in ``txn`` from the main table: the record LMDB's cursor itself loads
    for the table in this transaction. LMDB's copy-on-write never writes into a page reachable from a snapshot a
    live reader holds (a page is freed, and only then reused, once no reader's transaction is older than the
    commit that freed it), and a commit writes its pages before the meta page that publishes it, so every page
    this walk reaches holds what it held when the snapshot was committed; the map of the file is shared with
    LMDB's writes (``pwrite`` into the same page cache). A root taken elsewhere is wrong both ways: one read
    outside a live read transaction (the newest meta page, before the scan's transaction begins) may reach pages
    a writer has freed since and is now reusing, so a good store would look damaged; one newer than the scan's
    snapshot is not the tree the cursor walks, whose damage it would miss. The bound on page numbers is the last
    page of the snapshot's meta page while that meta page still holds the snapshot's transaction (two commits later
    a writer reuses it), else the file's length (an LMDB file never shrinks).

    ``data_id`` is (device, inode) of the ``data.mdb`` the environment opened: a file found under that name that
    is another one (a repair replaced the directory) is not checked. Nothing is checked either where the layout
    is not LMDB 0.9's of a 64-bit little-endian build (magic, version, a page size that is a power of two from
    512 to 64 KiB and LMDB's own), nor for a table of sorted duplicates (none of the index's): LMDB then reads
    as it would have."""
    if struct.calcsize("P") != 8 or sys.byteorder != "little":
        return None
    record = txn.get(name.encode(), db=main)
    if record is None or len(record) != _MDB_DB.size:
        return None  # (LMDB reports a table record it does not know)
    _, flags, _, _, _, _, _, root = _MDB_DB.unpack(record)
    if root == _NO_PAGE or flags & _MDB_DUPSORT:
        return None
    try:
        with open(data, "rb") as f:
            st = os.fstat(f.fileno())
            if data_id is not None and (st.st_dev, st.st_ino) != data_id or st.st_size < 2 * 512:
                return None
            mm = mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    try:
        return _walk(mm, st.st_size, txn.id(), txn.stat(main)["psize"], root)
    finally:
        with contextlib.suppress(BufferError):  # (an array of the walk still held: the map goes with it)
            mm.close()


def _walk(mm: mmap.mmap, size: int, txnid: int, psize: int, root: int) -> str | None:
    """:func:`unsafe_pages`' walk of the tree from page ``root`` in ``mm`` (``size`` bytes), level by level."""
    metas = [_META.unpack_from(mm, offset + _PAGE_HEADER) for offset in (0, psize) if offset + psize <= size]
    known = [m for m in metas if m[0] == _LMDB_MAGIC and m[1] == 1 and m[2] == psize]
    if not known or psize < 512 or psize > 1 << 16 or psize & (psize - 1):
        return None  # not a layout this walk knows
    pages = size // psize
    ours = [m[5] + 1 for m in known if m[6] == txnid]
    bound = min(pages, ours[0]) if ours else pages
    u8 = np.frombuffer(mm, np.uint8, count=pages * psize)
    u16 = u8.view("<u2")
    u64 = u8.view("<u8")
    level = np.array([root], dtype=np.int64)
    seen: list[np.ndarray] = []
    for depth in range(_MAX_DEPTH):
        bad = (level < 2) | (level >= bound)
        if bad.any():
            return f"page {level[bad.argmax()]} is not one of its pages (2 to {bound - 1})"
        seen.append(level)
        reached, times = np.unique(np.concatenate(seen), return_counts=True)
        if (times > 1).any():  # (a tree reaches each page once)
            return f"page {reached[times.argmax()]} is reached twice"
        base = level * psize
        head = base // 2
        number, ptype = u64[base // 8], u16[head + 5] & _P_TYPE
        lower, upper = u16[head + 6].astype(np.int64), u16[head + 7].astype(np.int64)
        kind = int(ptype[0])  # (a level's pages are all branch pages, or all leaves and the last level)
        checks = [
            (number != level.astype(np.uint64), "holds another page number in its header"),
            (ptype != kind if kind in (_P_BRANCH, _P_LEAF) else np.ones(level.size, bool),
             "is not a branch or leaf page like the others of its level"),
            ((lower < _PAGE_HEADER) | (lower & 1 == 1) | (lower > upper) | (upper > psize),
             "has its free-space bounds outside the page"),
        ]
        keys = (lower - _PAGE_HEADER) // 2
        checks.append((keys < (2 if kind == _P_BRANCH else 0 if depth == 0 else 1), "holds too few nodes"))
        for wrong, what in checks:
            if wrong.any():
                at = int(wrong.argmax())
                return f"page {level[at]} {what} (flags {int(u16[head[at] + 5]):#x})"
        # every node of the level: its page's position in `level`, and its offset
        owner = np.repeat(np.arange(level.size), keys)
        slot = np.arange(owner.size) - np.repeat(np.cumsum(keys) - keys, keys)
        offset = u16[head[owner] + 8 + slot].astype(np.int64)
        wrong = (offset < lower[owner]) | (offset & 1 == 1) | (offset > psize - 8)
        if wrong.any():
            return f"page {level[owner[wrong.argmax()]]} has a node outside the page"
        node = (base[owner] + offset) // 2
        lo, hi, nflags, ksize = (u16[node + i].astype(np.int64) for i in range(4))
        if kind == _P_BRANCH:
            wrong = offset + 8 + ksize > psize
            if wrong.any():
                return f"page {level[owner[wrong.argmax()]]} has a node outside the page"
            level = lo | hi << 16 | nflags << 32
            continue
        dsize = lo | hi << 16
        big = (nflags & _F_BIGDATA) == 1
        wrong = offset + 8 + ksize + np.where(big, 8, dsize) > psize
        if wrong.any():
            return f"page {level[owner[wrong.argmax()]]} has a node outside the page"
        for at in np.flatnonzero(big).tolist():
            start = int(base[owner[at]] + offset[at] + 8 + ksize[at])
            first = int.from_bytes(mm[start:start + 8], "little")
            span = (_PAGE_HEADER - 1 + int(dsize[at])) // psize + 1
            where = f"page {level[owner[at]]} names overflow page {first}"
            if first < 2 or first + span > bound:
                return f"{where} of {span}, not among its pages (2 to {bound - 1})"
            if int(u64[first * psize // 8]) != first or not int(u16[first * psize // 2 + 5]) & _P_OVERFLOW:
                return f"{where}, which is not one"
        return None
    return f"its tree is deeper than {_MAX_DEPTH} levels"


def unwalkable(index_dir: Path) -> str | None:
    """Why LMDB cannot walk every page of the index in ``index_dir`` without killing the process, or None.

    LMDB checks the pages a search passes, but only asserts the type of a leaf page a cursor steps onto: a
    damaged one there fails that assertion, which aborts the process (SIGABRT, nothing to catch), and a page
    number pointing past the end of the file is SIGBUS. A child process walks every table (:data:`_PROBE`) and
    dies instead. Costs a process start: for :func:`deltackpt.maintenance.verify`, and for a repair once the
    index opened and before it reads the records (:func:`deltackpt.maintenance.open_for_repair`)."""
    died = _probe(index_dir)
    if died in (signal.SIGABRT, signal.SIGBUS, signal.SIGSEGV):  # (not a kill from elsewhere)
        return f"a process walking its pages died of signal {died}"
    return None


def _probe(index_dir: Path) -> int | None:
    """The signal that killed a child process walking every page of the index in ``index_dir`` (:data:`_PROBE`),
    or None when it ended on its own (or could not be run, or ran past 10 minutes)."""
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE, str(index_dir)], capture_output=True, timeout=600)
    except (OSError, subprocess.SubprocessError):
        return None
    return -probe.returncode if probe.returncode < 0 else None


#: errno by its text: py-lmdb's C extension passes a system error on as text alone ("mdb_txn_commit: File too
#: large"), its cffi variant as (what, errno)
_ERRNO_OF = {os.strerror(code): code for code in sorted(errno.errorcode, reverse=True)}


def _write_errno(exc: lmdb.Error) -> int:
    """The errno of a failed LMDB write: ``ENOSPC`` for a full disk or map, else the system error LMDB reported
    (``EFBIG`` past RLIMIT_FSIZE, ``EDQUOT``, ``EIO``, ...), ``EIO`` when it reported none (LMDB's own codes)."""
    if isinstance(exc, (lmdb.DiskError, lmdb.MapFullError)):
        return errno.ENOSPC
    if len(exc.args) > 1 and type(exc.args[1]) is int and exc.args[1] in errno.errorcode:
        return exc.args[1]
    return _ERRNO_OF.get(str(exc.args[0] if exc.args else "").rpartition(": ")[2].strip(), errno.EIO)


def _lost(path: Path, why: str) -> str:
    return (f"the index of store {path.parent} was lost or emptied ({why}); 'deltackpt repair STORE' rebuilds it "
            "from packs and manifests (in Python: deltackpt.maintenance.open_for_repair(path).repair())")


_REGISTRY: dict[tuple[int, str], _Shared] = {}
_REGISTRY_LOCK = threading.Lock()
#: Environments of index directories a repair replaced (:meth:`Index._follow_repair`), left open: a thread may
#: still be inside a read transaction of one. Few (one per repair the process lived through).
_RETIRED: list[_Shared] = []
#: Write transactions in progress per environment. A child forked while one was open cannot take over the
#: environment: closing the inherited handle would wait forever for the parent thread that holds it.
_WRITERS: dict[tuple[int, str], int] = {}
#: LMDB calls in progress, per thread (:func:`_lmdb_calls`). A fork waits until no other thread has one
#: (:func:`_before_fork`): py-lmdb's close of an environment waits until no call on it is in progress, and in a
#: child forked during one (a thread's lookup, a load's read, with the GIL released) the call never ends, so the
#: child's first open of the store, which closes the inherited environment, hung forever.
_CALLS: dict[int, int] = {}
_GATE = threading.Condition(threading.Lock())
#: the thread whose fork waits for the others' calls to end (they start no new one meanwhile), or None
_FORKING: int | None = None
#: how long a fork waits for the calls of other threads; past that it goes on, and its child refuses to open
#: the store (:func:`_drop_inherited`)
FORK_WAIT_S = 30.0
#: in a child: a call of another thread of the parent was still in progress at the fork
_CALL_AT_FORK = False
_GATE_HELD = _REGISTRY_HELD = False  # (by the fork in progress)


#: entries read in one count of LMDB calls where a caller reads many (lookups, scans): a fork waits for one batch
#: at most, not for a verify's lookup of every chunk of the store (seconds for a million)
_CALLS_BATCH = 4096


def _batches(items: Iterable[bytes]) -> Iterator[list[bytes]]:
    it = iter(items)
    while batch := list(itertools.islice(it, _CALLS_BATCH)):
        yield batch


@contextmanager
def _lmdb_calls() -> Iterator[None]:
    """Count the calling thread's LMDB calls while the block runs (a transaction's, without user code in it), so
    that a fork waits for them to end. A block starts no sooner than a fork that waits ends (a nested one of a
    thread already inside one does: the fork waits for that thread)."""
    me = threading.get_ident()
    with _GATE:
        if me not in _CALLS:
            _GATE.wait_for(lambda: _FORKING is None or _FORKING == me)
        _CALLS[me] = _CALLS.get(me, 0) + 1
    try:
        yield
    finally:
        with _GATE:
            _CALLS[me] -= 1
            if not _CALLS[me]:
                del _CALLS[me]
                _GATE.notify_all()


def _before_fork() -> None:
    """Wait, at most :data:`FORK_WAIT_S`, until no other thread is inside an LMDB call, and let none start one
    until the fork is done; then for :data:`_REGISTRY_LOCK` (a thread opening an environment holds it), which a
    child would otherwise inherit held by a thread it does not have. Holds both across the fork."""
    global _FORKING, _CALL_AT_FORK, _GATE_HELD, _REGISTRY_HELD
    # Each held only once taken, and a call in progress until the wait says otherwise: an exception may end the
    # waits (a KeyboardInterrupt at Ctrl-C, which Python reports and drops before it forks all the same), and the
    # hooks after the fork then release only what this fork took (releasing the registry lock an earlier fork
    # had taken raised there, and the gate stayed shut: every LMDB call of the process waited forever).
    _GATE_HELD = _REGISTRY_HELD = False
    _CALL_AT_FORK = True
    me = threading.get_ident()
    deadline = time.monotonic() + FORK_WAIT_S
    _GATE_HELD = _GATE.acquire()
    _FORKING = me
    _CALL_AT_FORK = not _GATE.wait_for(lambda: all(t == me for t in _CALLS), FORK_WAIT_S)
    # (no holder of _REGISTRY_LOCK waits for the gate: the counted blocks take it, never the other way round)
    _REGISTRY_HELD = _REGISTRY_LOCK.acquire(timeout=max(0.0, deadline - time.monotonic()))


def _after_fork_in_parent() -> None:
    global _FORKING, _CALL_AT_FORK, _GATE_HELD, _REGISTRY_HELD
    if _REGISTRY_HELD:
        _REGISTRY_LOCK.release()
    if _GATE_HELD:
        _FORKING = None
        _GATE.notify_all()
        _GATE.release()
    _CALL_AT_FORK = _GATE_HELD = _REGISTRY_HELD = False


def _after_fork_in_child() -> None:
    global _GATE, _CALLS, _FORKING, _REGISTRY_LOCK
    me = threading.get_ident()
    _CALLS = {me: _CALLS[me]} if me in _CALLS else {}  # (the forking thread's own blocks end in the child)
    _GATE, _FORKING = threading.Condition(threading.Lock()), None
    _REGISTRY_LOCK = threading.Lock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _identity(path: Path) -> str:
    """What names an environment in this process's registry: its directory's device and inode, so that one
    store reached by two paths (a symlink, a bind mount) is one environment, as LMDB requires; the real path
    while the directory does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return f"device {st.st_dev} inode {st.st_ino}"


def _drop_inherited(real: str) -> None:
    """In a forked child, close the environment handles of ``real`` inherited from the parent.

    py-lmdb refuses to open an environment whose files are already open in the process, and a handle
    inherited across fork counts. Closing it in the child is safe (LMDB's fcntl locks and reader slots belong to
    the parent's pid) unless a parent thread was inside a write transaction or an LMDB call at the fork (the
    fork waits for those, :func:`_before_fork`, up to :data:`FORK_WAIT_S`).
    Caller holds _REGISTRY_LOCK.
    """
    me = os.getpid()
    for key in [k for k in _REGISTRY if k[1] == real and k[0] != me]:
        if _WRITERS.get(key, 0):
            raise DeltackptError(
                f"index {real}: this process was forked while another thread was committing to the store; open "
                "stores in processes started with the 'spawn' method, or fork outside of saves"
            )
        if _CALL_AT_FORK:  # its close would wait forever for the call (the fork waited FORK_WAIT_S for it)
            raise DeltackptError(
                f"index {real}: this process was forked while another thread was inside a call of LMDB on the "
                f"store that did not end within {FORK_WAIT_S:g} s; open stores in processes started with the "
                "'spawn' method, or fork outside of saves and loads"
            )
        sh = _REGISTRY.pop(key)
        _WRITERS.pop(key, None)
        _unshare_reader_table(sh.lock_id)
        sh.env.close()


def _unshare_reader_table(lock_id: tuple[int, int, str] | None) -> None:
    """In a forked child, about to close an inherited environment: make this process's mappings of its lock
    file (LMDB's reader table, shared with the parent) private copies.

    Closing the environment aborts the read transactions inherited from the parent's threads (an async save's
    lookups, a load in progress at the fork), and an abort frees its slot in the reader table. In the shared
    table that slot is the parent's: its read would lose its snapshot, and a commit (of any process) could reuse
    the pages it is still reading. Written in a private copy, the aborts change nothing the parent sees."""
    if lock_id is None or not sys.platform.startswith("linux"):
        return
    dev = f"{os.major(lock_id[0]):02x}:{os.minor(lock_id[0]):02x}"
    try:
        with open("/proc/self/maps") as f:
            maps = [line.rstrip("\n").split(maxsplit=5) for line in f]
    except OSError:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for fields_ in maps:  # start-end perms offset dev inode path
        if len(fields_) < 6 or "s" not in fields_[1]:
            continue
        # the file's device and inode, or its path (an overlay filesystem, as in containers, shows the device
        # of the layer beneath, which stat() does not)
        if (fields_[3], int(fields_[4])) != (dev, lock_id[1]) and fields_[5].strip() != lock_id[2]:
            continue
        start, end = (int(x, 16) for x in fields_[0].split("-"))
        copy = ctypes.string_at(start, end - start)
        got = libc.mmap(start, end - start, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
        if got != start:
            raise DeltackptError(f"cannot detach the reader table of {lock_id[2]} inherited across fork "
                                 f"({os.strerror(ctypes.get_errno())}); open stores in processes started with the "
                                 "'spawn' method, or fork outside of saves and loads")
        ctypes.memmove(start, copy, end - start)


_MAP_FIXED = 0x10  # (Linux's; Python's mmap module does not name it)


#: what py-lmdb raises on a damaged page (or a file that is not an LMDB environment any more). MDB_BAD_TXN too:
#: LMDB marks a transaction failed when a page it reads is damaged, and the calls after that in it (a lookup, the
#: drop of a table a repair frees) return MDB_BAD_TXN rather than the damage.
LMDB_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError,
                lmdb.IncompatibleError, lmdb.BadTxnError)


def _damage_error(index: Index, exc: lmdb.Error) -> CorruptIndexError:
    return CorruptIndexError(f"the index of {index.path.parent} is damaged ({exc}); {REPAIR_HINT}")


def _closed_under(exc: lmdb.Error) -> bool:
    """``exc`` is py-lmdb's refusal of a transaction or cursor whose environment was closed: one that began
    before :meth:`Index._reopen_if_failed` replaced the environment."""
    return type(exc) is lmdb.Error and "closed/deleted/dropped" in str(exc)


def _reopened_error(index: Index, exc: lmdb.Error) -> DeltackptError:
    return DeltackptError(
        f"the index of {index.path.parent} was opened afresh while this operation read it, after another "
        f"operation's write of it failed (an I/O error of the disk; {exc}); this operation changed nothing, and "
        "running it again reads the index as it is now")


def _damage_is_corruption(method: Callable[..., Any]) -> Callable[..., Any]:
    """Make LMDB's errors for damaged pages, raised while ``method`` reads, a :class:`CorruptIndexError` naming
    the repair (a generator's too, while it is iterated), and py-lmdb's refusal of a transaction whose
    environment was opened afresh meanwhile a :class:`DeltackptError`."""

    def typed(self: Index, exc: lmdb.Error) -> DeltackptError:
        return _reopened_error(self, exc) if _closed_under(exc) else _damage_error(self, exc)

    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def gen(self: Index, *args: Any, **kwargs: Any) -> Any:
            try:
                yield from method(self, *args, **kwargs)
            except lmdb.Error as exc:
                if not (isinstance(exc, LMDB_DAMAGE) or _closed_under(exc)):
                    raise
                raise typed(self, exc) from exc
        return gen

    @functools.wraps(method)
    def call(self: Index, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except lmdb.Error as exc:
            if not (isinstance(exc, LMDB_DAMAGE) or _closed_under(exc)):
                raise
            raise typed(self, exc) from exc
    return call


class ChunkReader:
    """Lookups in one read transaction of the chunk table (:meth:`Index.chunk_reader`); for the thread that
    opened it, while its ``with`` block runs. Should another operation's failed write make the process open the
    environment afresh meanwhile (:meth:`Index._reopen_if_failed`, which closes the old one), the lookups go on in a
    transaction of the new environment: what they answer is then as of that transaction's start."""

    def __init__(self, index: Index) -> None:
        self._index = index
        #: the entries :meth:`prefetch` read (None: not in the index), which :meth:`has` and :meth:`lookup` answer
        #: from: the transaction's snapshot, read earlier
        self._read: dict[bytes, bytes | None] = {}
        self._begin()

    def _begin(self) -> None:
        for attempt in range(2):
            sh = self._index._shared()  # (outside the count: it may open the environment)
            with _lmdb_calls():
                if not sh.failed:  # (not closed since: that waits for the counted calls to end)
                    try:
                        self._txn, self._sh = sh.env.begin(db=sh.dbs["chunks"], buffers=True), sh
                        return
                    except lmdb.PanicError:  # (another thread's write failed: not yet opened afresh)
                        if attempt:
                            raise
            self._index._reopen_if_failed(sh.env)
        raise DeltackptError(f"the index of {self._index.path.parent} was opened afresh twice as a read of it "
                             "began, after other operations' writes of it failed (an I/O error of the disk)")

    def _end(self) -> None:
        with _lmdb_calls():
            self._txn.abort()  # (a transaction of an environment closed since: nothing to do)

    def _each_batch(self, keys: Iterable[bytes], read: Callable[[Any, list[bytes]], None]) -> None:
        """``read(get, batch)`` for each batch of ``keys`` inside the count of LMDB calls; a batch whose
        transaction's environment was opened afresh meanwhile once more in a transaction of the new one."""
        for batch in _batches(keys):
            for again in (False, True):
                try:
                    if again:
                        self._begin()
                    with _lmdb_calls():
                        read(self._txn.get, batch)
                    break
                except lmdb.Error as exc:
                    if isinstance(exc, LMDB_DAMAGE):
                        raise _damage_error(self._index, exc) from exc
                    if not _closed_under(exc) or not (again or self._sh.failed):
                        raise
                    if again:
                        raise _reopened_error(self._index, exc) from exc

    def prefetch(self, keys: Iterable[bytes]) -> None:
        """Read the entries of ``keys`` now, for the next calls of :meth:`has` and :meth:`lookup` (in place of
        those of the previous call). A save reads those of many small tensors at once: a count of LMDB calls
        (:func:`_lmdb_calls`) per tensor cost more than its lookups. An entry is only read here; a damaged one
        raises when a lookup unpacks it, as it would have."""
        read: dict[bytes, bytes | None] = {}

        def fetch(get: Any, batch: list[bytes]) -> None:
            for k in batch:
                v = get(k)
                read[k] = None if v is None else bytes(v)
        self._each_batch(keys, fetch)
        self._read = read

    def has(self, keys: Iterable[bytes]) -> set[bytes]:
        """Those of ``keys`` the index holds."""
        out: set[bytes] = set()
        if self._read:
            keys = list(keys)
            if all(k in self._read for k in keys):  # (prefetched)
                return {k for k in keys if self._read[k] is not None}

        def read(get: Any, batch: list[bytes]) -> None:
            out.update(k for k in batch if get(k) is not None)
        self._each_batch(keys, read)
        return out

    def lookup(self, keys: Iterable[bytes], damaged: dict[bytes, str] | None = None) -> dict[bytes, ChunkLoc]:
        """The locations of those of ``keys`` the index holds. A damaged entry raises
        :class:`CorruptIndexError`, or with ``damaged`` (verify) goes there, key -> what is wrong."""
        out: dict[bytes, ChunkLoc] = {}

        def unpack(k: bytes, v: Any) -> None:
            try:
                out[k] = ChunkLoc.unpack(bytes(v), k)
            except CorruptIndexError as exc:
                if damaged is None:
                    raise
                damaged[k] = str(exc)

        if self._read:
            keys = list(keys)
            if all(k in self._read for k in keys):  # (prefetched)
                for k in keys:
                    if (v := self._read[k]) is not None:
                        unpack(k, v)
                return out

        def read(get: Any, batch: list[bytes]) -> None:  # (a batch at a time: :data:`_CALLS_BATCH`)
            for k in batch:
                if (v := get(k)) is not None:
                    unpack(k, v)
        self._each_batch(keys, read)
        return out


class Index:
    """The LMDB environment of one store. Safe to use from several threads and from several ``Index``
    objects of one process (they share the environment); a child process after ``fork`` opens its own."""

    def __init__(self, path: Path, *, allow_network_fs: bool = False, readonly: bool = False, create: bool = False,
                 rebuilding: bool = False) -> None:
        """``create``: the index of a new store (it gets its ``format`` record); ``rebuilding``: the index a
        repair will rebuild (it may be empty). Otherwise an index that lost its files raises
        :class:`CorruptIndexError`."""
        self.path = path
        self.readonly = readonly
        self._create = create and not readonly
        self._rebuilding = rebuilding
        if not allow_network_fs:
            check_local(path)
        if not readonly and (create or rebuilding):  # (a lost index is refused before anything is created)
            make_dirs(path)
        self._real = _identity(path)
        self._held: tuple[int, str] | None = None
        self._closed = False
        self._shared()
        if not readonly and (create or rebuilding):
            fsync_dir(path)  # the entries of data.mdb and lock.mdb, which LMDB just created

    def _shared(self) -> _Shared:
        if self._closed:
            raise DeltackptError(f"the index of {self.path.parent} is closed")
        key = (os.getpid(), self._real)
        sh = _REGISTRY.get(key)
        if sh is None or self._held != key or sh.failed:
            with _REGISTRY_LOCK:
                sh = _REGISTRY.get(key)
                if sh is not None and sh.failed:  # closed after LMDB refused it for good (_reopen_if_failed)
                    fresh = _Shared(self.path, sh.readonly, False, self._rebuilding)
                    fresh.refs = sh.refs
                    sh = _REGISTRY[key] = fresh
                if sh is None:
                    _drop_inherited(self._real)
                    sh = _REGISTRY[key] = _Shared(self.path, self.readonly, self._create, self._rebuilding)
                if self._held != key:  # first use in this process (or after fork): take a reference
                    sh.refs += 1
                    self._held = key
        return sh

    @property
    def env(self) -> lmdb.Environment:
        return self._shared().env

    @property
    def db_meta(self) -> Any:
        return self._shared().dbs["meta"]

    @property
    def db_chunks(self) -> Any:
        return self._shared().dbs["chunks"]

    @property
    def db_ckpts(self) -> Any:
        return self._shared().dbs["ckpts"]

    @property
    def db_ids(self) -> Any:
        return self._shared().dbs["ids"]

    @property
    def db_steps(self) -> Any:
        return self._shared().dbs["steps"]

    def close(self) -> None:
        """Drop this object's reference; the environment closes with the last one in the process."""
        if self._closed:
            return
        self._closed = True
        # closed under the lock: until LMDB has closed it, py-lmdb refuses another open of the files, and another
        # thread's open of the store (no longer in the registry) raised DeltackptError; a fork (which waits for
        # the lock) in between left the child a handle it could neither find nor open beside
        with _REGISTRY_LOCK:
            self._let_go(close=True)

    def _let_go(self, *, close: bool = False) -> _Shared | None:
        """Drop this object's reference to its environment; return the environment when that was its last
        reference in this process (it is then out of the registry), or with ``close`` close it. One inherited
        across fork is never returned. Caller holds _REGISTRY_LOCK."""
        key, self._held = self._held, None
        if key is None or key[0] != os.getpid():
            return None
        sh = _REGISTRY.get(key)
        if sh is None:
            return None
        sh.refs -= 1
        if sh.refs > 0:
            return None
        if close:
            # closed here, between the two steps nothing else runs: the caller closed an environment returned to
            # it, and a Ctrl-C's KeyboardInterrupt as the return reached it (signal handlers run as a call
            # returns) left it out of the registry but open; every later open of the store in this process then
            # raised that the process "holds it open through an LMDB handle of its own"
            try:
                sh.env.close()
            finally:
                del _REGISTRY[key]
            return None
        del _REGISTRY[key]
        return sh

    @contextmanager
    def _counted_env(self) -> Iterator[lmdb.Environment]:
        """The environment, inside the count of this thread's LMDB calls (:func:`_lmdb_calls`) while the block
        runs. Taken outside the count (it may take _REGISTRY_LOCK, and open the environment), and taken again
        when :meth:`_reopen_if_failed` closed it in between (which it does only while no call is counted)."""
        for _ in range(2):
            env = self.env
            with _lmdb_calls():
                sh = _REGISTRY.get((os.getpid(), self._real))
                if sh is not None and sh.env is env and not sh.failed:
                    yield env
                    return
        with _lmdb_calls():  # (opened afresh twice meanwhile: its calls raise, as a DeltackptError where typed)
            yield env

    @contextmanager
    def _writing(self) -> Iterator[lmdb.Environment]:
        """The environment, counted in :data:`_WRITERS` while the caller holds a write transaction on it."""
        key = (os.getpid(), self._real)
        with self._counted_env() as env:  # (outside the count of writers: a fork never falls between the two)
            with _REGISTRY_LOCK:
                _WRITERS[key] = _WRITERS.get(key, 0) + 1
            try:
                yield env
            finally:
                with _REGISTRY_LOCK:
                    _WRITERS[key] -= 1

    @contextmanager
    def _read(self, db: Any = None) -> Iterator[lmdb.Transaction[bytes]]:
        """A read transaction, its LMDB calls counted for a fork (:func:`_lmdb_calls`). One begun while another
        thread's failed write left the environment refusing every transaction (``MDB_PANIC``, until
        :meth:`_reopen_if_failed` opens it afresh) begins again in the environment opened afresh."""
        for attempt in range(2):
            with self._counted_env() as env:
                try:
                    txn = env.begin(db=db)
                except lmdb.PanicError:
                    if attempt:
                        raise
                else:
                    with txn:
                        yield txn
                    return
            self._reopen_if_failed(env)  # (outside the count: it waits for the other threads' counted calls)

    @contextmanager
    def _write(self) -> Iterator[lmdb.Transaction]:
        env = None
        try:
            with self._writing() as env, env.begin(write=True) as txn:
                yield txn
        except lmdb.Error as exc:  # a write or the commit failed: LMDB aborted the transaction
            if env is not None:
                self._reopen_if_failed(env)
            raise IndexWriteError(
                _write_errno(exc),
                f"could not write the index of {self.path.parent} ({exc}); the operation did not commit",
            ) from exc

    def _reopen_if_failed(self, env: lmdb.Environment) -> None:
        """Close ``env`` and open the environment afresh when LMDB marked it failed for good. A commit whose meta
        page write fails (an I/O error of the disk) leaves the files at the commit before (LMDB writes the old meta
        page back), but LMDB refuses every later transaction of that handle (``MDB_PANIC``): the store's next
        saves, loads and listings in this process raised :class:`CorruptIndexError` naming a repair, for an index
        that is intact. The handles of this process share the new environment; one that cannot be opened now is
        opened at their next use (:meth:`_shared`), which raises until it can.

        The close waits, as a fork does (:func:`_before_fork`, at most :data:`FORK_WAIT_S`), until no other
        thread is inside an LMDB call, and lets none start one meanwhile: py-lmdb frees what a call of another
        thread may be reading. A transaction another thread holds between its calls ends with the close; its next
        call raises, which a save's lookups (:class:`ChunkReader`) answer from a transaction of the new
        environment, and other reads as a :class:`DeltackptError` saying so. When other threads' calls do not
        end in time, the environment is left as it is (refusing every transaction, as before this existed)."""
        key = (os.getpid(), self._real)
        sh = _REGISTRY.get(key)
        if sh is None or sh.env is not env or sh.failed:
            return  # (another thread opened it afresh meanwhile, or a repair replaced it)
        try:
            with _lmdb_calls():
                env.begin().abort()
            return
        except lmdb.PanicError:
            pass
        except lmdb.Error:
            return
        global _FORKING
        me = threading.get_ident()
        with _GATE:  # (the gate, then the registry lock: the order a fork takes them in)
            if not _GATE.wait_for(lambda: _FORKING is None, FORK_WAIT_S):  # (a fork waiting for calls to end)
                return
            _FORKING = me
            try:
                if not _GATE.wait_for(lambda: all(t == me for t in _CALLS), FORK_WAIT_S):
                    return
                with _REGISTRY_LOCK:
                    if _REGISTRY.get(key) is not sh or sh.failed:
                        return
                    sh.failed = True
                    env.close()  # (py-lmdb refuses a second open of its files in this process)
            finally:
                _FORKING = None
                _GATE.notify_all()
        with contextlib.suppress(lmdb.Error, DeltackptError, OSError):  # (the failed write's error is the one raised)
            self._shared()

    def refresh(self) -> None:
        """Make this process's next reads see every commit that survived, including one whose writer died.

        LMDB publishes a commit to the other processes that have the environment open (through its lock file)
        only after it has written the commit's meta page. A writer killed between the two (kill -9 while the meta
        page's synchronous write is in flight) leaves its commit durable but unpublished: those processes keep
        reading the snapshot before it until some process next takes the write lock, which notices the dead
        writer and publishes the newest meta page. A gc reading that stale snapshot would take the new
        checkpoint's manifest, pack and deduplicated chunks for garbage. Taking and releasing the write lock
        (an empty write transaction, aborted) does the publishing. A read-only handle cannot; its reads may lag
        until a writer comes along, which loses nothing.
        """
        self._follow_repair()
        if not self.readonly:
            try:
                with self._writing() as env:
                    env.begin(write=True).abort()
            except lmdb.Error:
                pass  # the operation's own writes report an index that cannot be written
        self.check_current()

    @_damage_is_corruption
    def check_current(self) -> None:
        """Raise :class:`CorruptIndexError` when the index is older than the newest commit the store recorded in
        ``LAST_COMMIT``: an ``index/`` restored from an older copy, or LMDB reading the older of its two meta
        pages (one flipped bit in its transaction number makes it look newer). Such an index lacks committed
        checkpoints whose manifests gc would delete as orphans of crashed saves. Not checked while a repair
        rebuilds the index."""
        if self._rebuilding:
            return
        want = read_last_commit(self.path.parent)  # first: a commit between the two reads only makes the index newer
        if want is None:
            return
        with self._read() as txn:
            raw = txn.get(b"seq", db=self.db_meta)
        have = _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0
        if have < want:
            raise CorruptIndexError(
                f"the index of {self.path.parent} is older than the store: its newest commit is seq {have}, the "
                f"store recorded seq {want} in {LAST_COMMIT} (an index restored from an older copy, a repair by a "
                f"deltackpt that predates {LAST_COMMIT}, or a damaged LMDB meta page); {REPAIR_HINT} from the "
                "manifests and packs")

    def _follow_repair(self) -> None:
        """Switch to the store's current index directory when a repair (in any process) has replaced the one
        this handle opened: a damaged index is moved aside and rebuilt in a new ``index/``. Without this, a
        process that had the store open would go on reading the old one and commit its next saves there, where
        no other process looks (and the next gc would take their manifests for orphans). The old environment is
        not closed (another thread may still be reading it): it stays open, in ``_RETIRED``, while the process
        lives."""
        real = _identity(self.path)
        if real == self._real or self._closed:
            return
        with _REGISTRY_LOCK:
            if real == self._real:
                return  # another thread of this process followed it meanwhile
            last = self._let_go()
            if last is not None:
                _RETIRED.append(last)
            self._real = real
            self._create = False  # never give a replaced index a format record: only the repair's rebuild does
        self._shared()  # a repair still rebuilding it raises CorruptIndexError here ("lost"), as any open would

    def start_over(self) -> None:
        """Go on with the new, empty index directory a repair put in place of this one (damaged beyond what a
        rebuild in place can overwrite: LMDB meets damaged pages while freeing the old tables). The repair's
        rebuild then fills it. The old environment stays open, as when another process's repair replaced it."""
        self._rebuilding = True  # (the new directory has no format record yet: opened as a repair's)
        self._follow_repair()

    def _walkable(self, txn: lmdb.Transaction, *tables: str) -> None:
        """Raise :class:`CorruptIndexError` when a page of one of ``tables`` would make LMDB abort the process
        (or read outside its map) during a full scan in read transaction ``txn`` (:func:`unsafe_pages`): for
        every method that walks a whole table with a cursor, before it does."""
        sh = self._shared()
        for name in tables:
            why = unsafe_pages(txn, sh.main, name, self.path / "data.mdb", sh.data_id)
            if why is not None:
                raise CorruptIndexError(f"the index of {self.path.parent} is damaged ({name} table: {why}); "
                                        f"{REPAIR_HINT}")

    # -- chunks ---------------------------------------------------------------------------------------
    def lookup_chunks(self, keys: Iterable[bytes], damaged: dict[bytes, str] | None = None) -> dict[bytes, ChunkLoc]:
        """:meth:`ChunkReader.lookup` in a read transaction of its own."""
        with self.chunk_reader() as chunks:
            return chunks.lookup(keys, damaged)

    @contextlib.contextmanager
    def chunk_reader(self) -> Iterator[ChunkReader]:
        """One read transaction of the chunk table for many lookups (a save's, tensor after tensor), answered
        as of when it began, without a transaction (and the environment's checks) per call. Damaged pages raise
        :class:`CorruptIndexError`."""
        try:
            reader = ChunkReader(self)
        except LMDB_DAMAGE as exc:
            raise _damage_error(self, exc) from exc
        try:
            yield reader  # (its lookups count their calls: the caller's code in between does not)
        finally:
            reader._end()

    @_damage_is_corruption
    def iter_chunks(self) -> Iterator[tuple[bytes, ChunkLoc]]:
        # in batches, each read inside the count of LMDB calls and yielded outside it: a caller that forks, or
        # takes its time, between two entries holds up no other thread's fork
        with self._scan() as (_, txn):
            with _lmdb_calls():
                self._walkable(txn, "chunks")
                cur = txn.cursor()
                more = cur.first()
            while more:
                with _lmdb_calls():
                    batch: list[tuple[bytes, bytes]] = []
                    while more and len(batch) < _CALLS_BATCH:
                        batch.append(cur.item())
                        more = cur.next()
                for k, v in batch:
                    yield k, ChunkLoc.unpack(v, k)

    @_damage_is_corruption
    def chunks_in_packs(self, pack_ids: Iterable[str]) -> tuple[Commit, dict[str, list[tuple[bytes, ChunkLoc]]]]:
        """Every entry whose frame lies in one of the packs ``pack_ids``, by pack: one scan of the whole table,
        comparing the pack id bytes each value starts with before unpacking it (about 0.1 µs per entry). With
        the commit it read (:meth:`last_commit`)."""
        pids = {bytes.fromhex(p): p for p in pack_ids}
        found: dict[str, list[tuple[bytes, ChunkLoc]]] = {p: [] for p in pids.values()}
        with self._scan(buffers=True) as (made, txn):
            with _lmdb_calls():
                self._walkable(txn, "chunks")
                cur = txn.cursor()
                more = cur.first()
            while more:
                with _lmdb_calls():  # (a batch at a time, as iter_chunks: a fork waits for one, not the scan)
                    for _ in range(_CALLS_BATCH):
                        k, v = cur.item()
                        pack_id = pids.get(bytes(v[:16]))
                        if pack_id is not None:
                            found[pack_id].append((bytes(k), ChunkLoc.unpack(bytes(v), bytes(k))))
                        if not (more := cur.next()):
                            break
            return made, found

    @contextmanager
    def _scan(self, *, buffers: bool = False) -> Iterator[tuple[Commit, Any]]:
        """A read transaction of the chunk table for a scan, with the commit it reads (:meth:`last_commit`). It
        begins and ends inside the count of LMDB calls (:func:`_lmdb_calls`), which a fork and
        :meth:`_reopen_if_failed`'s close wait for; the scan counts its own calls in between."""
        with self._counted_env() as env:
            txn = env.begin(db=self.db_chunks, buffers=True) if buffers else env.begin(db=self.db_chunks)
            made = (env, txn.id())
        try:
            yield made, txn
        finally:
            with _lmdb_calls():
                txn.abort()

    @_damage_is_corruption
    def last_commit(self) -> Commit:
        """Which commit the index is at (the environment and its transaction id): equal to an earlier answer
        exactly when nothing committed in between."""
        with self._read() as txn:
            return self.env, txn.id()

    @_damage_is_corruption
    def count_chunks(self) -> int:
        with self._read() as txn:
            return int(txn.stat(self.db_chunks)["entries"])

    # -- checkpoints ----------------------------------------------------------------------------------
    def commit_checkpoint(
        self, record: Record, chunks: dict[bytes, ChunkLoc], *, replace: Record | None = None,
        repoint: bool | Set[bytes] = False,
    ) -> Record:
        """THE commit point: record the new chunks and the checkpoint in one durable transaction.

        A chunk another writer recorded meanwhile (both frames are valid) keeps the frame of lower chain depth,
        its first one on a tie: this save computed the depths of its other frames (predicted frames referencing
        its first moments) from its own frames' depths, which must stay upper bounds of what a decode reads, and
        within this writer's ``max_chain`` (format.md §6, §8). With ``repoint`` True (a rewrite, whose chunks are
        all standalone frames) every entry points to the new frame, and so do the entries of the chunks
        ``repoint`` holds when it is a set (frames written again for damaged ones).
        With ``replace``, that checkpoint's records are removed in the same transaction and the new one takes
        its place in commit order (its seq, read again here); it raises CheckpointNotFoundError if ``replace``
        is gone.
        Returns the record with its commit sequence number set.
        """
        again = repoint if not isinstance(repoint, bool) else frozenset()
        with self._write() as txn:
            db_chunks = self.db_chunks  # (a property: once, not per chunk)
            for k, loc in chunks.items():
                if txn.put(k, loc.pack(), db=db_chunks, overwrite=repoint is True or k in again):
                    continue
                try:  # another writer's frame of the same chunk, committed since this save looked
                    deeper = ChunkLoc.unpack(bytes(txn.get(k, b"", db=self.db_chunks)), k).depth > loc.depth
                except CorruptIndexError:
                    deeper = True  # (a damaged entry: this save's frame is intact)
                if deeper:
                    txn.put(k, loc.pack(), db=self.db_chunks)
            if replace is None:
                last = txn.get(b"seq", db=self.db_meta)
                seq = (_U64.unpack(last)[0] if last else 0) + 1
                txn.put(b"seq", _U64.pack(seq), db=self.db_meta)
            else:
                # read again in this transaction: a repair elsewhere may have renumbered it since the caller read
                # it (the order stays), a delete or another rewrite removed it
                sk = txn.get(replace.id.encode(), db=self.db_ids)
                raw = txn.get(sk, db=self.db_ckpts) if sk is not None else None
                if sk is None or raw is None:
                    raise CheckpointNotFoundError(f"checkpoint {replace.id} was deleted or replaced meanwhile")
                current = record_at(bytes(sk), bytes(raw))
                if current.id != replace.id:
                    raise CorruptIndexError(f"index entry for id {replace.id} leads to checkpoint {current.id}; "
                                            f"{REPAIR_HINT}")
                seq = current.seq
                self._remove(txn, current)
                self._add_dropped(txn, current.written_bytes)
            record.seq = seq
            sk = _U64.pack(seq)
            txn.put(sk, record.dumps(), db=self.db_ckpts)
            txn.put(record.id.encode(), sk, db=self.db_ids)
            txn.put(_U64.pack(record.step) + sk, b"", db=self.db_steps)
        if replace is None:
            write_last_commit(self.path.parent, seq)
        return record

    def _remove(self, txn: lmdb.Transaction, record: Record) -> None:
        sk = _U64.pack(record.seq)
        txn.delete(sk, db=self.db_ckpts)
        txn.delete(record.id.encode(), db=self.db_ids)
        txn.delete(_U64.pack(record.step) + sk, db=self.db_steps)

    def _add_dropped(self, txn: lmdb.Transaction, nbytes: int) -> None:
        """Count a removed checkpoint's written bytes into ``dropped``, in the transaction that removes it."""
        total = _dropped_value(txn.get(DROPPED, db=self.db_meta)) + max(0, nbytes)
        txn.put(DROPPED, _U64.pack(min(total, _SEQ_LIMIT - 1)), db=self.db_meta)

    def remove_checkpoints(self, records: Sequence[Record]) -> list[Record]:
        """Remove the checkpoints of ``records`` in one transaction and return those it left: the records whose
        id no longer names their seq (a rewrite took its place or a repair renumbered it since the caller read
        it; nothing of theirs changed, and the caller reads them again)."""
        stale: list[Record] = []
        if not records:
            return stale
        with self._write() as txn:
            removed = 0  # the bytes the removed ones wrote
            for record in records:
                sk = _U64.pack(record.seq)
                if txn.get(record.id.encode(), db=self.db_ids) != sk:
                    stale.append(record)
                    continue
                raw = txn.get(sk, db=self.db_ckpts)
                current = Record.loads(bytes(raw)) if raw is not None else record
                self._remove(txn, current)
                removed += max(0, current.written_bytes)
            if len(stale) < len(records):
                self._add_dropped(txn, removed)
        return stale

    @_damage_is_corruption
    def dropped_bytes(self) -> int:
        """Bytes written by the checkpoints deleted or replaced (rewritten, thinned) since the last gc."""
        with self._read() as txn:
            return _dropped_value(txn.get(DROPPED, db=self.db_meta))

    @_damage_is_corruption
    def get(self, *, step: int | None = None, id: str | None = None) -> Record | None:
        """The newest record with this step (or this id); the newest of all when both are None."""
        with self._read() as txn:
            if id is not None:
                sk = txn.get(id.encode(), db=self.db_ids)
            elif step is not None:
                sk = None
                self._walkable(txn, "steps")  # (prev and set_range step onto a sibling leaf unchecked, as next does)
                cur = txn.cursor(db=self.db_steps)
                prefix = _U64.pack(step)
                # find the first key past this step's keys, then step back to its newest
                past = step + 1 < 1 << 64 and cur.set_range(_U64.pack(step + 1))
                ok = cur.prev() if past else cur.last()
                if ok and cur.key()[:8] == prefix:
                    sk = cur.key()[8:]
            else:
                cur = txn.cursor(db=self.db_ckpts)
                sk = cur.key() if cur.last() else None
            if sk is None:
                return None
            if len(sk) != 8:  # (an empty key is MDB_BAD_VALSIZE to LMDB's get: no error of damage)
                raise CorruptIndexError(f"index names a checkpoint by a key of {len(sk)} bytes, not a seq; "
                                        f"{REPAIR_HINT}")
            raw = txn.get(sk, db=self.db_ckpts)
            seq = _U64.unpack(sk)[0]
            if raw is None:
                raise CorruptIndexError(f"index names checkpoint seq {seq} but holds no record; {REPAIR_HINT}")
            rec = record_at(sk, raw)
            asked = f"id {id}" if id is not None else f"step {step}" if step is not None else None
            if asked is not None and (rec.id != id if id is not None else rec.step != step):
                # one damaged byte of an id's or a step's entry must not hand out another checkpoint
                raise CorruptIndexError(f"index entry for {asked} leads to checkpoint {rec.id} of step {rec.step} "
                                        f"(seq {seq}); {REPAIR_HINT}")
            return rec

    @_damage_is_corruption
    def records(self) -> list[Record]:
        """All checkpoint records in commit order."""
        return [record_at(k, v) for k, v in self.raw_records()]

    @_damage_is_corruption
    def raw_records(self) -> list[tuple[bytes, bytes]]:
        """(key, value) of every checkpoint record in commit order, undecoded (:func:`record_at` decodes one):
        for callers that keep what they decoded before."""
        with self._read(db=self.db_ckpts) as txn:
            self._walkable(txn, "ckpts")
            return list(txn.cursor())

    @_damage_is_corruption
    def problems(self) -> list[tuple[Record | None, str]]:
        """What does not agree between the index's tables: each checkpoint record must be reached from its
        id and from its step, and every id and step entry must reach a record of that id and step. A problem
        of a record comes with it; one of an id or step entry with None. For ``verify``."""
        out: list[tuple[Record | None, str]] = []
        with self._read() as txn:
            self._walkable(txn, "ckpts", "ids", "steps")
            recs: dict[bytes, Record] = {}
            for k, v in txn.cursor(db=self.db_ckpts):
                try:
                    recs[k] = record_at(k, v)
                except CorruptIndexError as exc:
                    out.append((None, str(exc)))
            for k, v in txn.cursor(db=self.db_ids):
                rec = recs.get(v)
                if rec is None or rec.id.encode() != k:
                    out.append((None, f"index entry for id {k.decode(errors='replace')} leads to "
                                     f"{'no checkpoint' if rec is None else f'checkpoint {rec.id}'}"))
            for k, _ in txn.cursor(db=self.db_steps):
                rec = recs.get(k[8:])
                if len(k) != 16 or rec is None or _U64.pack(rec.step) != k[:8]:
                    to = "no checkpoint" if rec is None else f"checkpoint {rec.id} of step {rec.step}"
                    out.append((None, f"index entry for step {int.from_bytes(k[:8], 'big')} leads to {to}"))
            for sk, rec in recs.items():
                if txn.get(rec.id.encode(), db=self.db_ids) != sk:
                    out.append((rec, f"checkpoint {rec.id} is not reached from its id"))
                if txn.get(_U64.pack(rec.step) + sk, db=self.db_steps) is None:
                    out.append((rec, f"checkpoint {rec.id} is not reached from its step {rec.step}"))
        return out

    @_damage_is_corruption
    def count(self) -> int:
        with self._read() as txn:
            return int(txn.stat(self.db_ckpts)["entries"])

    # -- maintenance ----------------------------------------------------------------------------------
    @_damage_is_corruption
    def has_format_record(self) -> bool:
        """Whether the index holds its ``format`` record (an index a repair opened may not: emptied, or lost)."""
        with self._read() as txn:
            return txn.get(b"format", db=self.db_meta) is not None

    def apply_chunk_changes(self, delete: Iterable[bytes], move: dict[bytes, ChunkLoc], *,
                            collected: bool = False) -> Commit:
        """One transaction that drops dead chunk entries and points moved ones at their new frames; with
        ``collected`` (gc's, under its exclusive lock: no delete runs meanwhile) it zeroes ``dropped`` too.
        Returns the commit it made (:meth:`last_commit`)."""
        with self._write() as txn:
            made = (self.env, txn.id())
            for k in delete:
                txn.delete(k, db=self.db_chunks)
            for k, loc in move.items():
                txn.put(k, loc.pack(), db=self.db_chunks)
            if collected:
                txn.put(DROPPED, _U64.pack(0), db=self.db_meta)
        return made

    def rebuild(self, chunks: dict[bytes, ChunkLoc], records: list[Record]) -> None:
        """Replace everything with what ``repair`` found on disk, in one transaction. The records are numbered
        1..n in the given order; the index's ``seq`` counts on from the highest commit the store recorded
        (``LAST_COMMIT``) when that is higher, so that ``LAST_COMMIT`` never has to go down: an open that read
        it before the rebuild, a repair killed before it rewrites it, or a power loss that keeps its old value
        then meets an index at least as new."""
        recorded = read_last_commit(self.path.parent) or 0
        with self._write() as txn:
            for db in (self.db_chunks, self.db_ckpts, self.db_ids, self.db_steps):
                txn.drop(db, delete=False)
            for k, loc in chunks.items():
                txn.put(k, loc.pack(), db=self.db_chunks)
            seq = 0
            for rec in records:
                seq += 1
                rec.seq = seq
                sk = _U64.pack(seq)
                txn.put(sk, rec.dumps(), db=self.db_ckpts)
                txn.put(rec.id.encode(), sk, db=self.db_ids)
                txn.put(_U64.pack(rec.step) + sk, b"", db=self.db_steps)
            seq = max(seq, recorded)
            txn.put(b"seq", _U64.pack(seq), db=self.db_meta)
            txn.put(b"format", str(INDEX_VERSION).encode(), db=self.db_meta)  # the index is the store's again
        write_last_commit(self.path.parent, seq)  # (the same value, or the file was missing or unreadable)
        self._rebuilding = False
