"""Append-only pack files: where chunk frames live on disk.

Where it sits: ``save`` appends the frames of new chunks to the writer's own pack (:class:`PackWriter`) and
fsyncs it before the manifest is written; ``load`` reads frames back by (pack, offset, length) through
:class:`PackReader`; ``repair`` rebuilds the chunk index by scanning packs with :func:`scan`.

A pack is ``packs/<32 hex>.pack``: a 16-byte header (magic ``DCKPACK1``, u32 version, u32 zero) and frames
back to back. Frames are self-describing (see :mod:`deltackpt.codec`), so a pack can be read without the
index. Packs are never modified in place: only appended to by the one writer that created it (which holds an
exclusive ``flock`` on it while it may still append, and cuts it back past a mark for the frames of a save that
did not commit), and deleted whole by ``gc`` after their live frames were
copied elsewhere. A crash can leave a torn frame at a pack's end; nothing references it and scans stop there.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import mmap
import os
import re
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import overload

import numpy as np

from deltackpt import codec
from deltackpt.errors import CorruptChunkError, CorruptionError, DeltackptError, FormatVersionError, StoreLockedError

PACK_MAGIC = b"DCKPACK1"
PACK_VERSION = 1
PACK_HEADER = struct.Struct("<8sII")
_PACK_NAME = re.compile(r"^[0-9a-f]{32}$")


def valid_pack_id(pack_id: str) -> bool:
    return bool(_PACK_NAME.match(pack_id))


# Descriptors this process holds flocks through (lock files, the packs its writers append to). flock() locks
# belong to the open file, which a forked child shares: a child that kept these descriptors would hold the
# locks after its parent died (a kill -9 mid-save), and gc or repair would wait for the child's whole life.
# The child closes them right after the fork (closing, not unlocking: unlocking would release the parent's
# lock too). The guard keeps a fork out of the moment between an open and its record.
_lock_fds: set[int] = set()
_fork_guard = threading.Lock()


def open_lock(path: Path, flags: int) -> int:
    """``os.open(path, flags)`` (close-on-exec, mode 0644 when created) of a file this process will flock: a
    child forked while it is open closes it. Give it back with :func:`close_lock`. Opened without blocking, and
    refused unless a regular file: a FIFO in its place would otherwise block the open until a writer came. An
    open that may create the file does not follow a symbolic link (a dangling one would have it create a file
    wherever the link leads, outside the store)."""
    create = bool(flags & os.O_CREAT)
    with _fork_guard:
        try:
            fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_NOFOLLOW if create else 0), 0o644)
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.ELOOP, errno.ENXIO):
                raise
            link = "a symbolic link" if create else "a symbolic link that loops"
            what = {errno.EISDIR: "a directory", errno.ELOOP: link}.get(exc.errno, "a FIFO")
            raise CorruptionError(f"the store's lock file {path} is {what}, not a file: move it away (a store "
                                  "makes its lock files again, empty)") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CorruptionError(f"the store's lock file {path} is not a regular file: move it away (a store "
                                  "makes its lock files again, empty)")
        _lock_fds.add(fd)
    return fd


def read_file(path: Path, limit: int | None = None, *, follow: bool = True, head: int | None = None) -> bytes:
    """The bytes of the store file ``path`` (``STORE``, ``LAST_COMMIT``, a manifest), or its first ``head`` bytes
    only (a pack's header). Raises ``OSError`` when it cannot be read, with ``EINVAL`` for anything but a regular
    file (opened without blocking: a FIFO in its place raises rather than waits for a writer; a device is not
    read), ``EFBIG`` past ``limit`` bytes (a link to a large file is not read whole), ``ELOOP`` for a symbolic link
    unless ``follow``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if head is not None:
            return f.read(head)
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    return data


def close_lock(fd: int, opened_by: int, *, unlock: bool = True) -> None:
    """Unlock (for children forked meanwhile as well) and close a descriptor of :func:`open_lock`, opened by the
    process ``opened_by``. In a forked child, which closed it at the fork, this does nothing."""
    if opened_by != os.getpid():
        return
    if unlock:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
    with _fork_guard:
        _lock_fds.discard(fd)
        os.close(fd)


#: this process's id, set again in a forked child (below): what :meth:`PackWriter.append` compares with the pid
#: that opened its pack, once per frame, without a system call each time
_pid = os.getpid()


def _close_locks_in_child() -> None:
    global _fork_guard, _pid
    _pid = os.getpid()
    for fd in _lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_fds.clear()
    _fork_guard = threading.Lock()


os.register_at_fork(before=lambda: _fork_guard.acquire(), after_in_parent=lambda: _fork_guard.release(),
                    after_in_child=_close_locks_in_child)


#: Called once with ``busy`` when :func:`flock_within` without a timeout has waited :data:`WAIT_NOTICE_SECONDS`
#: for a lock. The command line sets it to say on stderr what it waits for (another process's gc, a save); a
#: library caller passes a timeout or waits silently.
on_wait: Callable[[str], None] | None = None
WAIT_NOTICE_SECONDS = 1.0


def flock_within(fd: int, mode: int, timeout: float | None, busy: str) -> None:
    """``flock(fd, mode)``, waiting at most ``timeout`` seconds when given (else as long as it takes); raise
    ``StoreLockedError(busy)`` when the time runs out. ``busy`` says who holds the lock."""
    notice = on_wait if timeout is None else None
    if timeout is None and notice is None:
        fcntl.flock(fd, mode)
        return
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waited = time.monotonic() - start
            if timeout is not None and waited > timeout:
                raise StoreLockedError(busy) from None
            if notice is not None and waited >= WAIT_NOTICE_SECONDS:
                notice(busy)
                fcntl.flock(fd, mode)
                return
            time.sleep(0.05)


def fsync_dir(path: Path) -> None:
    """Make a directory entry (a created, renamed or removed file in ``path``) durable."""
    _fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_file(path: Path) -> None:
    """Make the bytes of the file ``path`` durable (not its directory entry: :func:`fsync_dir`)."""
    _fsync_path(path, os.O_RDONLY | os.O_CLOEXEC)


def _fsync_path(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path, subdirs: tuple[str, ...] = ()) -> None:
    """Create ``path`` (and its missing parents) and ``path/sub`` for each of ``subdirs``, durably: the parent of
    every directory created here is fsynced, so that a power loss cannot take away a directory whose files a
    commit made durable (fsync of a file does not make its directory's entry durable)."""
    missing = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)
    created = False
    for sub in subdirs:
        if not (path / sub).is_dir():
            (path / sub).mkdir(exist_ok=True)
            created = True
    if created:
        fsync_dir(path)


#: frames smaller than this are gathered and written together, in writes of about this many bytes (less than
#: twice it): one system call
#: per 4 KiB frame took a quarter of the first save of 16,500 small tensors (docs/performance.md, "Many small tensors")
WRITE_BUFFER = 1 << 20


class PackWriter:
    """The one writer of a pack. Not thread-safe; the store serialises appends.

    The writer rolls over to a new pack once the current one exceeds ``max_size`` bytes. After any failed
    write the pack is abandoned (its tail may be torn) and the next append starts a new pack. A caller whose
    frames will never be referenced (a save that failed before its commit) gives their space back with
    :meth:`rollback` to a :meth:`mark` taken before the first of them.

    Small frames are held in memory until :data:`WRITE_BUFFER` bytes are gathered, a large frame comes, or
    :meth:`sync`: an append's error may surface at a later append or at the sync, which is where a caller learns
    that its frames are durable in any case.
    """

    def __init__(self, directory: Path, max_size: int = 1 << 30) -> None:
        self.directory = directory
        self.max_size = max_size
        self.pack_id: str | None = None
        self._fd: int | None = None
        self._offset = 0  # where the next appended frame goes
        self._end = 0  # where the next write goes: _offset less the frames held (file offsets are this
        # writer's own, written with pwrite, never the file position: see rollback)
        self._dir_dirty = False
        self._unsynced = False
        self._pid = os.getpid()
        self._opened: list[str] = []  # packs opened since the last mark
        self._held: list[bytes] = []  # frames appended but not written yet (they end at self._offset)
        self._held_len = 0

    def _open_new(self) -> None:
        self.close()
        pack_id = uuid.uuid4().hex
        path = self.directory / f"{pack_id}.pack"
        fd = open_lock(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            header = PACK_HEADER.pack(PACK_MAGIC, PACK_VERSION, 0)
            _write_all(fd, header, 0)
        except BaseException as exc:
            close_lock(fd, os.getpid(), unlock=False)
            path.unlink(missing_ok=True)
            if isinstance(exc, OSError):  # (the header's write on a full disk: name the pack, as appends do)
                raise named(exc, path) from None
            raise
        self._fd, self.pack_id, self._offset, self._end = fd, pack_id, len(header), len(header)
        self._opened.append(pack_id)
        self._pid = os.getpid()
        self._dir_dirty = True
        self._unsynced = True

    def append(self, frame: bytes | memoryview) -> tuple[str, int]:
        """Append one frame; return (pack id, offset). Durable only after :meth:`sync`."""
        if self._fd is not None and self._pid != _pid:
            self._abandon()  # inherited across fork: the parent may still append to that pack
        if self._fd is None or self._offset >= self.max_size:
            # a full pack is made durable before the writer leaves it: :meth:`sync` fsyncs the current pack only,
            # and frames of this save may already be in this one
            self.sync()
            self._open_new()
        assert self._fd is not None and self.pack_id is not None
        offset = self._offset
        if len(frame) < WRITE_BUFFER:
            self._held.append(bytes(frame))
            self._held_len += len(frame)
            if self._held_len >= WRITE_BUFFER:
                self._write_held()
        else:
            self._write_held()
            self._write(frame)
        self._offset += len(frame)
        self._unsynced = True
        return self.pack_id, offset

    def _write_held(self) -> None:
        if self._held:
            held, self._held, self._held_len = self._held, [], 0
            self._write(held[0] if len(held) == 1 else b"".join(held))

    def _write(self, data: bytes | memoryview) -> None:
        assert self._fd is not None
        try:
            _write_all(self._fd, data, self._end)
            self._end += len(data)
        except OSError as exc:
            err = named(exc, self.directory / f"{self.pack_id}.pack")
            self._abandon()
            if err is exc:
                raise
            raise err from None

    def sync(self) -> None:
        """Write the frames held back, then fsync the pack (and, the first time, its directory entry). A failed
        write or fsync abandons the pack."""
        if self._fd is None or not self._unsynced:
            return
        self._write_held()
        what = self.directory / f"{self.pack_id}.pack"
        try:
            os.fsync(self._fd)
            if self._dir_dirty:
                what = self.directory
                fsync_dir(self.directory)
                self._dir_dirty = False
        except OSError as exc:
            err = named(exc, what)
            self._abandon()  # the state of unsynced data after a failed fsync is unknown: never reuse it
            if err is exc:
                raise
            raise err from None
        self._unsynced = False

    def seal_past(self, nbytes: int) -> None:
        """Stop appending to the current pack if it holds more than ``nbytes``: the next frame starts a new one.
        gc cannot delete a pack its writer still appends to, so what retention deletes stays on disk until the
        writer moves on."""
        if self._fd is not None and self._offset > nbytes:
            self.close()

    @property
    def opened(self) -> list[str]:
        """The packs opened since the last :meth:`mark` (each starts with a header of ``PACK_HEADER.size`` bytes)."""
        return list(self._opened)

    def mark(self) -> tuple[str | None, int]:
        """Where the next frame goes, for :meth:`rollback`."""
        self._write_held()  # a rollback cuts the file back to the mark: everything before it must be in the file
        if self._fd is not None and self._end != self._offset:
            # an append interrupted between its updates (a KeyboardInterrupt as a call returns) whose save's
            # rollback did not run either (a second Ctrl-C): where it writes is not where it says frames go
            self._abandon()
        self._opened = []
        return self.pack_id, self._offset

    def rollback(self, mark: tuple[str | None, int]) -> None:
        """Remove every frame appended since ``mark``: packs opened since are deleted, the pack open at the mark
        is cut back to its length then. Only for frames nothing references (their save did not commit). Best
        effort, as it runs while a failure propagates: an error here leaves garbage for gc, never harm. Safe
        after the pack's lock was released: bytes past the mark are nobody's, and no other writer appends to
        this writer's packs."""
        pack_id, offset = mark
        opened = self._opened
        try:
            if self._fd is not None and self.pack_id == pack_id and pack_id not in opened:
                # Appends go on in this pack from the mark. One statement resets all that the next append uses:
                # no signal handler runs between its stores, so a second Ctrl-C here leaves the writer either
                # as it was or cut back (a Ctrl-C between a seek and the offset's update made later frames land
                # elsewhere than their index entries said). Writes go to _end with pwrite, not to the file
                # position; the cut below is only space given back (bytes left past the mark are overwritten).
                self._held, self._held_len, self._offset, self._end, self._opened = [], 0, offset, offset, []
                os.ftruncate(self._fd, offset)
            else:  # (the pack open at the mark was left, or none was open: the next append opens a new one)
                self._abandon()
                self._opened = []
                for p in opened:
                    (self.directory / f"{p}.pack").unlink(missing_ok=True)
                if pack_id is not None:
                    fd = os.open(self.directory / f"{pack_id}.pack", os.O_WRONLY | os.O_CLOEXEC)
                    try:
                        os.ftruncate(fd, offset)
                    finally:
                        os.close(fd)
        except OSError:
            pass

    def _abandon(self) -> None:
        fd, self._fd, self.pack_id = self._fd, None, None
        self._held, self._held_len = [], 0  # never written: nothing references frames that were never synced
        if fd is not None:  # (in a forked child: closed at the fork, and its parent's lock is not to be released)
            close_lock(fd, self._pid)

    def close(self) -> None:
        """Stop appending to the current pack (it stays on disk) and release its lock."""
        self._abandon()


def named(exc: OSError, path: Path) -> OSError:
    """``exc`` (of a write or fsync of a pack or manifest, or of a directory's fsync) naming ``path`` where it
    names no file: a bare ``[Errno 28] No space left on device`` said nothing of which store or disk. The same
    class and errno."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror, str(path))


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (pwrite: the file position is not used)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write to pack")
        view = view[n:]
        offset += n


def open_files_budget() -> int:
    """How many pack files a :class:`PackReader` keeps open at most: a quarter of this process's soft limit on
    open files, between 16 and 1024. A store holds a pack per gigabyte, per writing session and per gc (each
    seals the pack being written; a pack at least half live stays), and a checkpoint
    that dedups against many sessions' packs, or ``verify`` of a large store, reads from more packs than a
    common limit of 1024 open files allows."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 4))


class _Handle:
    """An open pack file and how many reads are using it; closed by whoever lets go of it last after it was
    dropped from the cache."""

    __slots__ = ("fd", "users", "dropped")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.dropped = False


#: what a read of a pack's bytes raises when the file cannot give them: damage, as a checksum mismatch is (an I/O
#: error of the disk, a file in the pack's place that is not one). Other errors are the reading process's own.
_UNREADABLE = frozenset({errno.EIO, errno.ENXIO, errno.EINVAL, errno.EISDIR, errno.EOVERFLOW, errno.ENODATA})


class PackReader:
    """Reads frames by (pack id, offset, length). Thread-safe. Keeps up to ``max_open`` pack files open (the
    least recently read are closed first, once no read is using them; default :func:`open_files_budget`)."""

    def __init__(self, directory: Path, max_open: int | None = None) -> None:
        self.directory = directory
        self.max_open = max(1, open_files_budget() if max_open is None else int(max_open))
        self._open: collections.OrderedDict[str, _Handle] = collections.OrderedDict()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _fd(self, pack_id: str) -> Iterator[int]:
        """The open file of pack ``pack_id``, kept open until the ``with`` block ends."""
        h = self._take(pack_id)
        try:
            yield h.fd
        finally:
            self._let_go(h)

    def _let_go(self, h: _Handle) -> None:
        """The end of a read of ``h`` (:meth:`_take`): closed when it was dropped and this was its last read."""
        with self._lock:
            h.users -= 1
            close = h.dropped and h.users == 0
        if close:
            os.close(h.fd)

    def _take(self, pack_id: str) -> _Handle:
        with self._lock:
            h = self._open.get(pack_id)
            if h is not None:
                self._open.move_to_end(pack_id)
                h.users += 1
                return h
        if not valid_pack_id(pack_id):
            raise CorruptionError(f"index names an invalid pack id {pack_id!r}")
        path = self.directory / f"{pack_id}.pack"
        # without blocking: a FIFO in a pack's place would otherwise wait forever for a writer
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise CorruptChunkError(f"pack {pack_id} is missing") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # (format.md §9: damage, as a missing pack)
                raise CorruptChunkError(f"pack {pack_id} is a symbolic link that loops ({path})") from None
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            self._shed(0)  # out of file descriptors: close every idle pack file, then try once more
            fd = os.open(path, flags)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory opens too, and fails only at the first read
            os.close(fd)
            raise CorruptChunkError(f"pack {pack_id} is not a regular file ({path})")
        os.set_blocking(fd, True)
        with self._lock:
            h = self._open.get(pack_id)
            if h is None:  # (another thread may have opened it meanwhile: keep theirs)
                h = self._open[pack_id] = _Handle(fd)
                fd = -1
            h.users += 1
            self._open.move_to_end(pack_id)
        if fd >= 0:
            os.close(fd)
        self._shed(self.max_open)
        return h

    @contextlib.contextmanager
    def transient(self) -> Iterator[None]:
        """Pack files first opened inside the block are closed when it ends (those in use once their reads end):
        for a pass over many packs (gc, verify) in a process that goes on reading few, such as a training job
        whose Checkpointer runs gc, which would otherwise keep one open file per pack."""
        with self._lock:
            before = set(self._open)
        try:
            yield
        finally:
            closing = []
            with self._lock:
                for pack_id in [p for p in self._open if p not in before]:
                    h = self._open.pop(pack_id)
                    h.dropped = True
                    if h.users == 0:
                        closing.append(h.fd)
            for fd in closing:
                os.close(fd)

    def _shed(self, keep: int) -> None:
        """Drop the least recently read pack files beyond ``keep``; those in use close when their reads end."""
        closing = []
        with self._lock:
            while len(self._open) > keep:
                _, h = self._open.popitem(last=False)
                h.dropped = True
                if h.users == 0:
                    closing.append(h.fd)
        for fd in closing:
            os.close(fd)

    @overload
    def read(self, pack_id: str, offset: int, length: int, into: None = None,
             before_blocking: Callable[[], None] | None = None) -> bytes: ...
    @overload
    def read(self, pack_id: str, offset: int, length: int, into: np.ndarray,
             before_blocking: Callable[[], None] | None = None) -> np.ndarray: ...

    def read(self, pack_id: str, offset: int, length: int, into: np.ndarray | None = None,
             before_blocking: Callable[[], None] | None = None) -> bytes | np.ndarray:
        """The ``length`` bytes at ``offset`` of a pack: read into ``into`` (a writable uint8 buffer of exactly
        ``length`` bytes, returned) when given, else into new bytes. With ``before_blocking`` (and ``into``),
        the read first takes only what the page cache holds (``RWF_NOWAIT``, Linux), and calls
        ``before_blocking()`` before it waits on the disk for the rest."""
        if into is not None and len(into) != length:
            raise ValueError(f"read buffer has {len(into)} bytes for {length}")
        h = self._take(pack_id)  # (not self._fd: its generator and context manager were a third of a read's Python)
        try:
            fd = h.fd
            try:
                if into is None:
                    data: bytes | np.ndarray = os.pread(fd, length, offset)
                    got = len(data)
                else:
                    data = into
                    got = _read_cached(fd, into, offset) if before_blocking is not None else 0
                    if got < length:
                        if before_blocking is not None:
                            before_blocking()
                        got += os.preadv(fd, [into[got:]], offset + got)
            except OSError as exc:  # (a bad sector's EIO; a file in the pack's place that reads as none does)
                if exc.errno not in _UNREADABLE:
                    raise  # (EBADF, ENOMEM, ...: this process's trouble, not the pack's)
                raise CorruptChunkError(f"pack {pack_id} cannot be read: frame at offset {offset}: "
                                        f"{exc.strerror or exc}") from None
        finally:
            self._let_go(h)
        if got != length:
            raise CorruptChunkError(
                f"pack {pack_id} is truncated: frame at offset {offset} needs {length} bytes, got {got}"
            )
        return data

    def forget(self, pack_id: str) -> None:
        """Close pack ``pack_id`` (once no read is using it): before it is deleted or replaced."""
        with self._lock:
            h = self._open.pop(pack_id, None)
            if h is None:
                return
            h.dropped = True
            close = h.users == 0
        if close:
            os.close(h.fd)

    def drop_unlinked(self) -> None:
        """Close the cached pack files that were deleted meanwhile (by a gc in another process, or another
        handle's): an open file keeps a deleted pack's disk space in use for as long as it stays open."""
        with self._lock:
            gone = []
            for pack_id, h in self._open.items():
                try:
                    if os.fstat(h.fd).st_nlink == 0:
                        gone.append(pack_id)
                except OSError:
                    gone.append(pack_id)
        for pack_id in gone:
            self.forget(pack_id)

    def close(self) -> None:
        self._shed(0)


_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def _read_cached(fd: int, into: np.ndarray, offset: int) -> int:
    """Bytes of ``into`` filled from the page cache alone (0 when none are cached, or where the system or file
    system cannot tell: no ``RWF_NOWAIT``)."""
    if _NOWAIT is None:
        return 0
    try:
        return os.preadv(fd, [into], offset, _NOWAIT)
    except BlockingIOError:
        return 0
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return 0
        raise


def pack_files(directory: Path) -> dict[str, Path]:
    """The packs of a ``packs/`` directory by id: regular files (or links to one) with a pack's name. Anything
    else there (a directory, a dangling link) is no pack, and maintenance leaves it alone."""
    return {p.stem: p for p in directory.glob("*.pack") if valid_pack_id(p.stem) and p.is_file()}


def header_damage(path: Path) -> str | None:
    """What is wrong with the pack's 16-byte header, or None when it is the one writers write (magic, version,
    zero). Readers find frames through the index and check each on its own, so a damaged header loses nothing;
    but it is damage on disk, which verify reports and gc repairs by copying the frames to a new pack. Raises
    ``OSError`` as :func:`read_file` does (``EINVAL`` for a FIFO in a pack's place, which a plain open would wait
    on for a writer forever; its chunks' reads report it)."""
    head = read_file(path, head=PACK_HEADER.size)
    if len(head) < PACK_HEADER.size:
        return f"{len(head)} bytes long, shorter than its {PACK_HEADER.size}-byte header"
    magic, version, reserved = PACK_HEADER.unpack(head)
    if (magic, version, reserved) == (PACK_MAGIC, PACK_VERSION, 0):
        return None
    return (f"its header is damaged (magic {magic!r}, version {version}, reserved {reserved}; written as "
            f"{PACK_MAGIC!r}, {PACK_VERSION}, 0)")


def is_active(path: Path) -> bool:
    """True while some writer holds the pack open for appending (its exclusive flock)."""
    try:
        fd = open_lock(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        close_lock(fd, os.getpid(), unlock=False)  # closing drops the lock we may have taken
    return False


def scan(path: Path, damaged: list[int] | None = None) -> Iterator[tuple[int, codec.FrameHeader]]:
    """Yield (offset, header) of every intact frame of a pack.

    A damaged frame (a header that does not parse, a checksum that fails) is skipped by searching, from the
    byte after its start, for the next offset where an intact frame starts, whatever length its header records
    (a frame found inside the damaged one's span is intact all the same: its checksum and digest hold). The
    offsets of damage are appended to ``damaged``.
    A torn frame at the very end (a crash while appending) is not reported as damage.
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < PACK_HEADER.size:
            return
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # packs can be large: do not read them whole
    newer: list[str] = []
    try:
        yield from _scan(path, data, damaged, newer)
    finally:
        data.close()  # (no view of it may outlive _scan: an exception raised through it would keep one)
    if newer:
        raise FormatVersionError(f"{newer[0]} in pack {path.stem}")


def _scan(path: Path, data: mmap.mmap, damaged: list[int] | None,
          newer: list[str]) -> Iterator[tuple[int, codec.FrameHeader]]:
    magic, version, _ = PACK_HEADER.unpack_from(data)
    if (magic, version) != (PACK_MAGIC, PACK_VERSION) and damaged is not None:
        # a damaged header is damage like any other: every frame after it verifies on its own (frame checksums
        # and versions), so the intact ones are still found; readers never look at the header
        damaged.append(0)
    offset = PACK_HEADER.size
    end = len(data)
    view = memoryview(data)
    try:
        while offset + codec.HEADER_SIZE <= end:
            h = intact_frame(view, offset, newer)
            if newer:
                return
            if h is not None:
                yield offset, h
                offset += h.frame_len
                continue
            # damage: resynchronise on the next frame that verifies
            nxt = data.find(codec.MAGIC, offset + 1)
            while nxt != -1 and intact_frame(view, nxt, newer) is None:
                if newer:
                    return
                nxt = data.find(codec.MAGIC, nxt + 1)
            if nxt == -1:
                if damaged is not None and not _torn_tail(view, offset):
                    damaged.append(offset)
                return
            if damaged is not None:
                damaged.append(offset)
            offset = nxt
    finally:
        view.release()


def intact_frame(view: memoryview, offset: int, newer: list[str]) -> codec.FrameHeader | None:
    """The header of the frame at ``offset`` when it is intact, else None. An intact frame (its checksum holds)
    of a version this reader does not know, a newer writer's, is no damage: its error goes into ``newer`` (a
    scan stops there: a repair would drop it, and gc then free what it references)."""
    try:
        h = codec.parse_header(view[offset : offset + codec.HEADER_SIZE])
    except FormatVersionError as exc:
        fields = codec.HEADER.unpack_from(view, offset)
        stored_len, checksum = fields[6], fields[9]
        payload = view[offset + codec.HEADER_SIZE : offset + codec.HEADER_SIZE + stored_len]
        if len(payload) == stored_len and codec.frame_checksum(view[offset : offset + codec.CHECKED],
                                                               payload) == checksum:
            newer.append(f"{exc} at offset {offset}")  # (a damaged version byte fails the checksum: damage)
        return None
    except DeltackptError:
        return None
    payload = view[offset + codec.HEADER_SIZE : offset + h.frame_len]
    if len(payload) < h.stored_len:
        return None
    if codec.frame_checksum(view[offset : offset + codec.CHECKED], payload) != h.checksum:
        return None
    return h


def _torn_tail(view: memoryview, offset: int) -> bool:
    """True when the bytes from ``offset`` to the end look like a frame cut short by a crash."""
    try:
        h = codec.parse_header(view[offset : offset + codec.HEADER_SIZE])
    except DeltackptError:
        return len(view) - offset < codec.HEADER_SIZE
    return offset + h.frame_len > len(view)
