"""The Store: save and load whole training states; list and delete checkpoints.

Where it sits: the top of the pipeline. ``save`` = flatten the tree (:mod:`tree`) -> each tensor's bytes on the
host (:mod:`staging`) -> name its chunks (:mod:`kernel`) -> look them up (:mod:`index`) -> encode the new ones
(:mod:`codec`) on worker threads -> append them to a pack (:mod:`packs`) -> fsync -> write the manifest
(:mod:`manifest`) -> commit in LMDB. ``load`` runs it backwards and verifies every chunk it decodes. Maintenance
(gc, verify, repair) lives in :mod:`deltackpt.maintenance` and is reached through methods here.

The store directory (``STORE``, ``index/``, ``packs/``, ``manifests/``, ``tmp/``, the lock files) is described
in :mod:`deltackpt.layout`, with the functions that create it and read its ``STORE`` file (see ``docs/format.md``).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import copy
import dataclasses
import fcntl
import functools
import inspect
import operator
import os
import re
import secrets
import shutil
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import numpy as np

from deltackpt import _lazy, codec, collector, config, kernel, manifest, packs, predict, staging, tree
from deltackpt.cache import ChunkCache
from deltackpt.errors import (
    CheckpointNotFoundError,
    CorruptChunkError,
    CorruptIndexError,
    CorruptManifestError,
    DeltackptError,
    FormatVersionError,
    ReadOnlyStoreError,
    ShapeMismatchError,
    StateChangedError,
    UnsafeLoadError,
    UnsupportedTypeError,
)
from deltackpt.index import REPAIR_HINT, ChunkLoc, ChunkReader, Commit, Index, Record, check_local, chunk_key, record_at
from deltackpt.layout import (
    check_new_store_dir,
    lost_store,
    lost_store_file,
    read_store_file,
    why_readonly,
    write_store_file,
)
from deltackpt.manifest import Manifest, TensorEntry
from deltackpt.packs import (
    PackReader,
    PackWriter,
    close_lock,
    flock_within,
    fsync_dir,
    make_dirs,
    open_lock,
)
from deltackpt.retention import Retention, check_ranked, deleting_only
from deltackpt.scratch import Scratch

if TYPE_CHECKING:
    import torch

    from deltackpt.maintenance import GcReport, Progress, RepairReport, VerifyReport  # (it imports this module)
else:
    torch = _lazy.module("torch", globals())

MAX_STEP = (1 << 63) - 1
_INFLIGHT_PER_THREAD = 3
#: what the chunks a save has in flight, or a load's or verify's read workers, may hold at once besides the state
#: itself: each chunk in flight holds up to about four chunk-sized buffers (its bytes, the encoder's or decoder's
#: byte planes, the frame: a save of one 1 GiB chunk took 3.7 GiB above the state, a load 1.8), so with very
#: large chunks fewer run at once; at the default 1 MiB this bounds nothing
_CHUNK_WORK_BYTES = 2 << 30
#: chunks smaller than this are encoded on the saving thread: handing a 4 KiB chunk to a worker (a future, a
#: queue and two GIL handoffs) costs more than encoding it (docs/performance.md, "Many small tensors")
_INLINE_BELOW = 64 << 10
#: how many CPU tensors a save hashes ahead of encoding them, reading their chunks' index entries together
#: (:meth:`Store._write_leaves`), and about how many bytes of them at most
_AHEAD_TENSORS = 512
_AHEAD_BYTES = 64 << 20
#: the least a writer's pack holds before a save moves on to a new one (:meth:`PackWriter.seal_past`)
_SEAL_BYTES = 64 << 20
#: per read worker of :meth:`Store._read_each`: what to call before a frame read waits on the disk
_worker = threading.local()
_T = TypeVar("_T")
_R = TypeVar("_R")
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as :meth:`Store.list`, :meth:`Store.info` and :meth:`Store.save` report it."""

    id: str
    step: int
    created: float  # seconds since the epoch
    parent: str | None
    logical_bytes: int  # bytes of all tensors/arrays in the state
    written_bytes: int  # bytes this save added to packs (compressed frames)
    metadata: Any
    seq: int  # commit order within the store

    @classmethod
    def from_record(cls, rec: Record) -> CheckpointInfo:
        try:
            meta = tree.decode_plain(rec.metadata) if rec.metadata is not None else None
        except (CorruptManifestError, UnsafeLoadError, UnsupportedTypeError) as exc:
            if isinstance(exc, UnsupportedTypeError) and tree.holds_torch_name(rec.metadata):
                # (a device of a backend this torch lacks, a newer torch's dtype: the record is as saved, a repair
                # would not help)
                raise UnsupportedTypeError(f"checkpoint {rec.id} (step {rec.step}): its metadata: {exc}") from None
            # saves write plain values only: a registered type or a pickle there is damage of the record
            raise CorruptIndexError(f"index record of checkpoint {rec.id} (step {rec.step}) holds unreadable "
                                    f"metadata: {exc}; {REPAIR_HINT}") from None
        return cls(rec.id, rec.step, rec.created, rec.parent, rec.logical_bytes, rec.written_bytes, meta, rec.seq)


#: what :meth:`Store._read_each` puts among its failures to stop its workers when its own wait was interrupted
_STOPPED = KeyboardInterrupt()


def _outwait(workers: list[Future[None]]) -> None:
    """Wait until each of ``workers`` (a list that grows until its last worker ends) has ended, through further
    interrupts: each worker stops after the item it holds. (Their work catches what its items raise.)"""
    i = 0
    while i < len(workers):
        try:
            workers[i].result()
        except KeyboardInterrupt:  # another Ctrl-C during this wait: wait on
            continue
        except BaseException:  # (the wait's own failure is the one raised)
            pass
        i += 1


def _detached(info: CheckpointInfo) -> CheckpointInfo:
    """``info`` with a copy of its metadata when that is a container (numbers and strings cannot change)."""
    if isinstance(info.metadata, (dict, list, tuple, set)):
        return dataclasses.replace(info, metadata=copy.deepcopy(info.metadata))
    return info


def _operation(fn: _F) -> _F:
    """Run the :class:`Store` method ``fn`` as one of the handle's operations in progress (:meth:`Store._in_use`),
    which :meth:`Store.close` on another thread waits for."""

    @functools.wraps(fn)
    def run(self: Store, *args: Any, **kwargs: Any) -> Any:
        with self._in_use():
            return fn(self, *args, **kwargs)

    return cast(_F, run)


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    step = int(step)
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be between 0 and 2**63-1, got {step}")
    return step


def check_metadata(metadata: Any) -> dict[str, Any] | None:
    """A save's ``metadata`` as a dict (None stays None); TypeError naming the argument for anything that is not
    a mapping (a list of pairs included: ``dict()`` would take it, or fail with a message about sequences)."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping of names to plain values, got {type(metadata).__name__}")
    return dict(metadata)


def as_saved(t: TensorEntry, obj: Any) -> Any:
    """The decoded tensor ``obj`` of entry ``t`` made what was saved: a parameter, or one that requires grad (a
    numpy array as it is)."""
    if t.kind == "torch":
        if t.parameter:
            return torch.nn.Parameter(obj, requires_grad=t.requires_grad)
        if t.requires_grad:
            obj.requires_grad_(True)
    return obj


def _same_entry(m: Manifest, a: TensorEntry, b: TensorEntry) -> bool:
    """Whether two tensor entries of ``m`` hold the same bytes (the same entry, or equal chunk ids)."""
    return a is b or (a.nbytes == b.nbytes and a.count == b.count and np.array_equal(
        m.digests[a.first : a.first + a.count], m.digests[b.first : b.first + b.count]))


def _shared_paths(paths: Iterable[str]) -> set[str]:
    """The key paths that name more than one tensor."""
    return {p for p, n in collections.Counter(paths).items() if n > 1}


class _Done:
    """A job run on the calling thread, in the place of its future: its result, or the exception it raised."""

    __slots__ = ("_value", "_error")

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error = value, error

    @classmethod
    def run(cls, fn: Callable[..., Any], *args: Any) -> _Done:
        try:
            return cls(fn(*args), None)
        except Exception as exc:  # raised by result(), where a worker's would be
            return cls(None, exc)

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False


def _settings(*, chunk_size: Any = None, zstd_level: Any = None, threads: Any = None, allow_network_fs: Any = None,
              pack_size: Any = None, max_chain: Any = None, delta_cache_bytes: Any = None, read_threads: Any = None,
              predict: Any = None, readonly: Any = None) -> tuple[int, int, int, int, int, int, bool, bool]:
    """:class:`Store`'s settings, checked (TypeError, ValueError) and with the environment's defaults filled in:
    (zstd_level, threads, read_threads, pack_size, max_chain, delta_cache_bytes, predict, allow_network_fs).
    ``chunk_size`` is only checked here: a store that exists keeps its own."""
    if chunk_size is not None:
        config.check_chunk_size(chunk_size)
    zstd_level = config.setting("zstd_level", zstd_level, config.zstd_level, "DELTACKPT_ZSTD_LEVEL",
                                config.MIN_ZSTD_LEVEL, config.MAX_ZSTD_LEVEL)
    threads = config.setting("threads", threads, config.threads, "DELTACKPT_THREADS", 1, config.MAX_THREADS)
    read_threads = config.setting("read_threads", read_threads, lambda: config.read_threads(threads),
                                  "DELTACKPT_READ_THREADS", 1, config.MAX_THREADS)
    pack_size = config.setting("pack_size", pack_size, config.pack_size, "DELTACKPT_PACK_SIZE", 1, 1 << 40)
    max_chain = config.setting("max_chain", max_chain, config.max_chain, "DELTACKPT_MAX_CHAIN", 0,
                               config.MAX_MAX_CHAIN)
    cache = config.setting("delta_cache_bytes", delta_cache_bytes, config.delta_cache_bytes,
                           "DELTACKPT_DELTA_CACHE", 0, 1 << 50)
    predict = config.flag("predict", predict, config.predict)
    allow = config.flag("allow_network_fs", allow_network_fs, config.allow_network_fs)
    if readonly is not None:
        config.boolean("readonly", readonly)
    return zstd_level, threads, read_threads, pack_size, max_chain, cache, predict, allow


def check_options(what: str, options: Mapping[str, Any]) -> None:
    """Raise TypeError or ValueError, naming ``what`` (who takes them), for ``options`` that ``Store(path,
    **options)`` would refuse: an unknown name (a typo) or a bad value. Opens and creates nothing."""
    names = [p for p in inspect.signature(Store.__init__).parameters if p not in ("self", "path", "_repair")]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(f"{what}: unknown store option(s) {', '.join(unknown)} (Store takes {', '.join(names)})")
    try:
        _settings(**options)  # (its keywords are Store's settings)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None


#: a tensor's bytes on the host, its chunks' digests and zero flags, (position, key) of its chunks not all zero
_Hashed = tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, bytes]]]


def _concurrent_chunks(chunk_size: int, most: int) -> int:
    """How many chunks of ``chunk_size`` may be worked on at once, of ``most`` (at least one)."""
    return max(1, min(most, _CHUNK_WORK_BYTES // (4 * chunk_size)))


class Store:
    """An incremental, content-addressed checkpoint store in a directory.

    ``Store(path)`` creates the store or opens an existing one. ``chunk_size`` is fixed when the store is
    created (a power of two, default 1 MiB); the other settings apply to this handle: ``zstd_level``,
    ``threads`` (worker threads for hashing, encoding and decoding), ``max_chain`` (the most delta frames a
    chunk's decode may read beyond its own; 0 turns deltas off) and ``delta_cache_bytes`` (raw bytes of the
    last save kept in memory as delta bases for the next one; bases not found there are decoded from disk) and
    ``read_threads`` (the most workers for loads and verify: a load starts ``threads`` and adds one whenever a
    frame read has to wait on the disk) and
    ``predict`` (store changed AdamW second moments and parameters as predicted frames, on by default; see
    :mod:`deltackpt.predict`).
    ``readonly=True`` opens an existing store without writing anything to it (no lock or directory is created,
    the index is opened read-only): loads, listing and verify work, and save, delete, gc and repair raise
    :class:`ReadOnlyStoreError`. A store on a read-only filesystem, or one whose directories this process may
    not write (another user's), is opened that way unless ``readonly=False`` is given, which then raises
    :class:`ReadOnlyStoreError` at once.
    A Store may be used from several threads and shared with other processes on the same host; it must not
    be used across ``fork`` (open a new one in the child).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        chunk_size: int | None = None,
        zstd_level: int | None = None,
        threads: int | None = None,
        *,
        allow_network_fs: bool | None = None,
        pack_size: int | None = None,
        max_chain: int | None = None,
        delta_cache_bytes: int | None = None,
        read_threads: int | None = None,
        predict: bool | None = None,
        readonly: bool | None = None,
        _repair: bool = False,
    ) -> None:
        """``_repair`` is for :func:`deltackpt.maintenance.open_for_repair` only: it opens a store whose index
        was lost, which a repair then rebuilds."""
        self.path = Path(path)
        kernel.check()  # (a DELTACKPT_BACKEND that cannot run: the import let the CLI report it)
        # every setting checked before anything is created
        (self.zstd_level, self.threads, self.read_threads, pack_size, self.max_chain, cache, self.predict,
         allow) = _settings(chunk_size=chunk_size, zstd_level=zstd_level, threads=threads, pack_size=pack_size,
                            max_chain=max_chain, delta_cache_bytes=delta_cache_bytes, read_threads=read_threads,
                            predict=predict, readonly=readonly, allow_network_fs=allow_network_fs)
        if not allow:
            check_local(self.path)  # before anything is created
        why = why_readonly(self.path)
        if why is not None and readonly is False:
            if not (self.path / "STORE").exists():  # (readonly=True would not make one either)
                raise ReadOnlyStoreError(f"cannot create a store at {self.path}: it is {why}")
            raise ReadOnlyStoreError(f"store {self.path} is {why}: open it with readonly=True")
        self.readonly = why is not None if readonly is None else bool(readonly)
        self._readonly_why = why or "open read-only"
        self._readonly_unasked = self.readonly and readonly is None
        self.index: Index = None  # type: ignore[assignment]  # a new store's is opened as it is created
        try:
            self.chunk_size = self._init_layout(chunk_size, allow)
            if self.index is None:
                self.index = Index(self.path / "index", allow_network_fs=allow, readonly=self.readonly,
                                   rebuilding=_repair)
        except BaseException:
            if self.index is not None:
                self.index.close()
            raise
        self._packs_dir = self.path / "packs"
        self._manifests_dir = self.path / "manifests"
        self._tmp_dir = self.path / "tmp"
        self._writer = PackWriter(self._packs_dir, max_size=pack_size)
        self.reader = PackReader(self._packs_dir)
        # a handle dropped unclosed releases its files once collected (close() detaches this; not at exit: the
        # process's end releases them)
        #: (descriptor, process) of the gc and maintenance locks a repair's handle holds (``_alone_fd``), for the
        #: finalizer: a repair's handle dropped unrepaired kept them, and every gc, repair, or open of a store whose
        #: index needs a look, in this process then waited for them forever
        self._alone_held: list[tuple[int, int]] = []
        self._finalizer = weakref.finalize(self, _release_dropped, self._writer, self.reader, self.index,
                                           self._alone_held)
        self._finalizer.atexit = False
        self._save_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._pools_of: tuple[int, ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._local = threading.local()
        self._head: str | None = None  # the checkpoint the next save descends from (last saved or loaded)
        self._last_manifest: Manifest | None = None
        self._pinned = staging.Pinned()
        #: what the last list() decoded, by record key and bytes: records that did not change are not decoded again
        self._listed: dict[tuple[bytes, bytes], tuple[CheckpointInfo, tuple[str, ...]]] = {}
        self._moved_at: tuple[Commit, dict[str, str]] | None = None  # _moved's answer, and the commit it read
        self._delta_stats: dict[str, tuple[int, int]] = {}
        self._predict_stats: dict[str, tuple[int, int]] = {}  # the same for predicted frames
        self._base_cache = ChunkCache(cache if self.max_chain else 0)
        #: chunks a load or verify in this process found it cannot decode, and the bases and inputs their decode
        #: read (one of which is damaged): a save holding one writes it again, standalone, instead of
        #: deduplicating onto the stored frame. Shared by every handle of this process on this store.
        self._damaged = _damaged_in(self.path)
        #: chunks :meth:`_taint` found to decode through no damaged chunk, while ``_damaged`` was ``_clean_for``
        self._clean: set[bytes] = set()
        self._clean_for: set[bytes] = set()
        self._closed = False
        #: close() has released everything (False after a close() that an exception interrupted, a Ctrl-C while it
        #: waited for another thread's load: close() again finishes; it returned at once, leaving all held)
        self._released = False
        #: operations of this handle in progress (:meth:`_in_use`), by (process, thread): close() waits for them
        self._users: collections.Counter[tuple[int, int]] = collections.Counter()
        # (taken as the lock itself, a C one, not through the condition: Condition.__enter__ and __exit__ are Python
        # functions, at whose start a Ctrl-C's KeyboardInterrupt left an operation counted, or the lock held)
        self._users_lock = threading.Lock()
        self._users_changed = threading.Condition(self._users_lock)
        _HANDLES.add(self)  # (a forked child takes its locks afresh)
        #: the gc lock file, held exclusively from :func:`~deltackpt.maintenance.open_for_repair` until the
        #: repair commits (or the store closes); this handle's own operations then take no lock
        self._alone_fd: int | None = None
        #: ``maint.lock``, held exclusively with ``_alone_fd`` (one gc or repair at a time)
        self._maint_fd: int | None = None
        self._alone_pid = os.getpid()  # the process that took those two (a forked child does not release them)
        try:
            self.index.check_current()  # an index older than the store's last commit (not while repairing) ...
            current = True
        except CorruptIndexError:
            current = False
        if not current:  # (outside the except: an error raised below is not shown chained to the first)
            try:
                with self._gc_lock():  # ... or one a repair is rebuilding: look again once it is done
                    pass
            except BaseException:
                self.close()
                raise

    # -- layout -----------------------------------------------------------------------------------------
    def _init_layout(self, chunk_size: int | None, allow_network_fs: bool) -> int:
        cfg_path = self.path / "STORE"
        if self.path.is_symlink() and not self.path.exists():
            raise DeltackptError(f"{self.path} is a dangling symbolic link (or a loop of them), not a store")
        if self.path.exists() and not self.path.is_dir():
            raise DeltackptError(f"{self.path} is not a directory, so not a store (a store is a directory)")
        if lost_store(self.path):
            raise lost_store_file(self.path)
        if not cfg_path.exists() and self.readonly:
            if self._readonly_unasked:  # (the filesystem or permissions decide)
                raise ReadOnlyStoreError(f"cannot create a store at {self.path}: it is {self._readonly_why}")
            raise DeltackptError(f"{self.path} is not a deltackpt store (no STORE file; a read-only open creates none)")
        if not cfg_path.exists():
            cs = (config.check_chunk_size(config.chunk_size(), "DELTACKPT_CHUNK_SIZE") if chunk_size is None
                  else config.check_chunk_size(chunk_size))
            check_new_store_dir(self.path)
            make_dirs(self.path, ("packs", "manifests", "tmp", "index"))
            (self.path / "gc.lock").touch()
            (self.path / "maint.lock").touch()
            # One creation at a time (processes creating one store at once wait for the first, then open it)
            fd = open_lock(self.path / "gc.lock", os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not cfg_path.exists():
                    if lost_store(self.path):
                        raise lost_store_file(self.path)
                    # An index here is what an earlier creation left when it failed before STORE (a full disk,
                    # a crash): nothing can have committed into it, and a failed one may hold half its pages.
                    index_dir = self.path / "index"
                    if any(index_dir.iterdir()):
                        shutil.rmtree(index_dir)
                        make_dirs(self.path, ("index",))
                    # the index (with its format record) before STORE: a store that has STORE and an index without
                    # that record lost its index, and is refused until a repair rebuilds it
                    self.index = Index(index_dir, allow_network_fs=allow_network_fs, create=True)
                    write_store_file(self.path, cs)
            finally:
                close_lock(fd, os.getpid())
        cs = read_store_file(self.path)
        if chunk_size is not None and chunk_size != cs:
            raise ValueError(f"store {self.path} was created with chunk_size={cs}, not {chunk_size}")
        for sub in ("packs", "manifests", "tmp"):
            where = self.path / sub
            if (where.exists() or where.is_symlink()) and not where.is_dir():
                raise DeltackptError(f"store {self.path} is damaged: its {sub} is not a directory ({where})")
        if not self.readonly:  # e.g. an empty tmp/ does not survive a copy through git
            make_dirs(self.path, ("packs", "manifests", "tmp"))
        return cs

    def _writable(self, what: str) -> None:
        """Raise :class:`ReadOnlyStoreError` (before anything is done) when this handle may not write."""
        if self.readonly:
            raise ReadOnlyStoreError(f"cannot {what}: store {self.path} is {self._readonly_why}")

    def close(self) -> None:
        """Release the pack being written, worker threads and open files. Idempotent.

        Operations that other threads run on this handle (saves, loads, listings, gc, verify, ...) finish first;
        those that start once close() began raise :class:`DeltackptError` ("store ... is closed"). Called from
        inside an operation of this thread on this handle (a ``progress`` callback of verify, gc or repair, a
        signal handler interrupting a load) it raises :class:`DeltackptError` and closes nothing: the operation
        would go on with its index and workers closed under it. A close() that an exception interrupts (a Ctrl-C
        while it waits for another thread's operation) leaves the handle closed to new operations; close() again
        finishes releasing it."""
        me = (os.getpid(), threading.get_ident())
        with self._users_lock:
            if self._released:
                return
            if self._users[me]:
                raise DeltackptError(f"store {self.path}: close() called from inside an operation on this store "
                                     "(a progress callback?); close it once the operation has returned")
            self._closed = True
            # (not one a forked child inherited)
            self._users_changed.wait_for(lambda: all(u[0] != me[0] for u in self._users))
        with self._save_lock:
            self._writer.close()
        if self._pools_of is not None and self._pools_of[0] == os.getpid():
            for pool in self._pools_of[1:]:
                pool.shutdown(wait=True)
        self.reader.close()
        self.index.close()
        self._finalizer.detach()
        self._release_alone()
        self._base_cache.clear()
        self._last_manifest = None
        self._pinned = staging.Pinned()  # (page-locked host memory of the largest GPU tensor saved)
        self._released = True

    @contextmanager
    def _in_use(self) -> Iterator[None]:
        """One operation of this handle in progress: :meth:`close` waits until it ends. Raises
        :class:`DeltackptError` when the handle is closed (or closing): closing the index or the pools under a
        running load or verify crashed the process or raised lmdb's and concurrent.futures' own errors."""
        me = (os.getpid(), threading.get_ident())
        counted = False
        # (counted inside the try: a signal handler runs as the with block's __exit__ returns, and a Ctrl-C's
        # KeyboardInterrupt there left the operation counted for good: every later close() of the handle raised
        # "called from inside an operation", or, on another thread, waited forever)
        try:
            with self._users_lock:
                if self._closed and not self._users[me]:  # (one it runs inside, retain's delete, goes on)
                    raise DeltackptError(f"store {self.path} is closed")
                self._users[me] += 1
                counted = True
            yield
        finally:
            if counted:
                with self._users_lock:
                    left = self._users.pop(me) - 1  # (dict's pop: Counter's __delitem__ is a Python function)
                    if left:
                        self._users[me] = left
                    else:
                        self._users_changed.notify_all()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        # (pickle and copy.deepcopy: a spawned process's arguments, a Pool's task, a spawned DataLoader worker's
        # dataset) locks, threads and an LMDB environment do not travel; what did say "cannot pickle
        # '_thread.lock' object"
        raise TypeError(f"a Store cannot be pickled (sent to a spawned process, a Pool's task, deep-copied): pass "
                        f"its path, {str(self.path)!r}, and open Store(path) in that process")

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, chunk_size={self.chunk_size})"

    def _pools(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """(workers for saves, workers for loads), created on first use and again after fork (threads do not
        survive it). Loads may use more workers than CPUs (``read_threads``): cold reads wait on the disk."""
        pools = self._pools_of
        if pools is None or pools[0] != os.getpid():
            with self._pool_lock:
                pools = self._pools_of
                if pools is None or pools[0] != os.getpid():
                    pools = self._pools_of = (
                        os.getpid(),
                        ThreadPoolExecutor(self.threads, thread_name_prefix="deltackpt"),
                        ThreadPoolExecutor(self._read_workers, thread_name_prefix="deltackpt-read"),
                    )
        return pools[1], pools[2]

    def _submit(self, fn: Callable[..., _R], *args: Any) -> Future[_R] | _Done:
        """``pool.submit(fn, *args)``; run here once the interpreter is exiting, when concurrent.futures takes no
        new work (an async save still running as the main thread ended, a save from an ``atexit`` handler)."""
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError:
            return _Done.run(fn, *args)

    @property
    def _pool(self) -> ThreadPoolExecutor:
        return self._pools()[0]

    @property
    def _read_pool(self) -> ThreadPoolExecutor:
        """The read workers: ``read_threads`` of them, fewer for chunks too large for that many in memory."""
        return self._pools()[1]

    @property
    def _read_workers(self) -> int:
        return _concurrent_chunks(self.chunk_size, self.read_threads)

    @contextmanager
    def _gc_lock(self, exclusive: bool = False, timeout: float | None = None) -> Iterator[None]:
        """Saves and loads hold this shared; gc and repair hold it exclusively. A read-only handle takes it when
        it can open the lock file for reading, and reads without it otherwise (nothing on a read-only
        filesystem can change the store under it)."""
        if self._closed and not self._users[(os.getpid(), threading.get_ident())]:  # (close() waits for those)
            raise DeltackptError(f"store {self.path} is closed")
        if self._alone_fd is not None:  # a repair's handle: the store is this handle's alone already
            self.index.refresh()
            yield
            return
        pid = os.getpid()
        fd = self._open_gc_lock()
        if fd is None:
            yield
            return
        try:
            flock_within(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, timeout,
                         f"store {self.path} is busy ({'saves or loads' if exclusive else 'a gc or repair'} in "
                         "progress)")
            # what is decided under the lock (a gc's garbage, a save's dedup) must see every surviving commit
            self.index.refresh()
            yield
        finally:
            # Unlock, then close: a process forked meanwhile (a DataLoader starting its workers while an async
            # save runs) closed its copy at the fork (packs.open_lock), but one forked from C, without Python's
            # fork hooks, shares this open file, and closing alone would leave the lock held for its life.
            # Unlocked here first, before a Python function is called: signal handlers run as one starts, and a
            # Ctrl-C's KeyboardInterrupt at close_lock's start left the lock held by a descriptor nothing closes
            # (every gc and repair, of any process, then waited for this one to exit). Not in a forked child
            # (packs._pid, no call: the child closed the descriptor at the fork, and its number may be another
            # file's by now, one the child locked itself).
            try:
                if pid == packs._pid:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            close_lock(fd, pid)

    def _refresh(self) -> None:
        """:meth:`Index.refresh` for what users ask about the store (``list``, ``info``, ...), which takes no lock.
        A repair in another process rebuilding the index makes it read as lost until the rebuild commits: then
        wait for the repair (it holds the gc lock exclusively) and look again, as saves and loads do."""
        try:
            self.index.refresh()
        except CorruptIndexError:
            if self._alone_fd is not None:
                raise
            with self._gc_lock():  # (which refreshes once it has the lock: still lost, it raises)
                pass

    def _release_alone(self) -> None:
        """Let go of the gc lock a repair's handle holds (see ``_alone_fd``)."""
        # Each dropped before it is closed: close() may run again after an interrupted one (a Ctrl-C's
        # KeyboardInterrupt as a close_lock starts), and a descriptor closed twice closed whatever file had its
        # number by then.
        self._alone_held.clear()
        fd, self._alone_fd = self._alone_fd, None  # (the gc lock first: taken last)
        if fd is not None:
            close_lock(fd, self._alone_pid)
        fd, self._maint_fd = self._maint_fd, None
        if fd is not None:
            close_lock(fd, self._alone_pid)

    def _open_gc_lock(self) -> int | None:
        """The lock file, opened for flock(); None for a read-only handle that cannot open it."""
        if not self.readonly:
            return open_lock(self.path / "gc.lock", os.O_RDWR | os.O_CREAT)
        try:
            return open_lock(self.path / "gc.lock", os.O_RDONLY)
        except OSError:
            return None

    def _encoder(self) -> codec.Encoder:
        enc = getattr(self._local, "encoder", None)
        if enc is None or enc.level != self.zstd_level:
            enc = self._local.encoder = codec.Encoder(self.zstd_level)
        return enc

    # -- lookup -------------------------------------------------------------------------------------------
    def _record(self, step: int | None = None, id: str | None = None) -> Record:
        if id is not None:
            manifest.check_id(id)
        if type(step) is str:  # (a checkpoint id given where the step goes: info(info.id))
            raise TypeError(f"step must be an int, got str {step!r:.40}; pass a checkpoint id as id=")
        if step is not None:
            step = check_step(step)
        rec = self.index.get(step=step, id=id)
        if rec is None and id is not None:
            rec = self._replacing(id)
        if rec is not None and step is not None and id is not None and rec.step != step:
            raise CheckpointNotFoundError(f"checkpoint {id} is at step {rec.step}, not at step {step}, in {self.path}")
        if rec is None:
            if id is not None:
                raise CheckpointNotFoundError(f"no checkpoint with id {id} in {self.path}")
            if step is not None:
                raise CheckpointNotFoundError(f"no checkpoint at step {step} in {self.path}")
            raise CheckpointNotFoundError(f"store {self.path} holds no checkpoint")
        return rec

    def _manifest(self, rec: Record) -> Manifest:
        try:
            m = manifest.read(self._manifests_dir, rec.id, expect_checksum=rec.manifest_checksum)
        except CorruptManifestError:
            # a delete (here or in another process) removes the record, then the file: not corruption
            if self.index.get(id=rec.id) is None:
                raise CheckpointNotFoundError(
                    f"checkpoint {rec.id} (step {rec.step}) was deleted meanwhile"
                ) from None
            raise
        if m.id != rec.id or m.step != rec.step:
            raise CorruptIndexError(f"the index record of checkpoint {rec.id} (step {rec.step}) does not match "
                                    f"its manifest (checkpoint {m.id}, step {m.step}); {REPAIR_HINT}")
        return m

    def _current_id(self, cid: str | None) -> str | None:
        """``cid``, or the id of the checkpoint a rewrite put in its place; None when it is gone."""
        if cid is None or self.index.get(id=cid) is not None:
            return cid
        rec = self._replacing(cid)
        return None if rec is None else rec.id

    def _replacing(self, old_id: str) -> Record | None:
        """The checkpoint that took the place of ``old_id`` in a :meth:`rewrite`. Asked of every checkpoint
        whose parent retention deleted, so it scans the records through the listing's memo (decoding only those
        not seen before: decoding every record took 1.8 s at 10,000 kept)."""
        new = self._moved().get(old_id)
        return None if new is None else self.index.get(id=new)

    def _moved(self) -> dict[str, str]:
        """Old id -> the id of the checkpoint a :meth:`rewrite` put in its place, for every retained rewrite
        (the index as last refreshed). Read again only after a commit: ``info`` of a checkpoint whose parent
        was deleted asks it, and reading every record at each such ``info`` made one call per retained
        checkpoint quadratic (2,500 calls took 12.8 s on a store thinned to 2,500 of 5,000)."""
        at = self.index.last_commit()
        memo = self._moved_at
        if memo is None or memo[0] != at:
            memo = self._moved_at = (at, _moved_in(self._rows()))
        return memo[1]

    def _info(self, rec: Record) -> CheckpointInfo:
        """``rec`` as users see it: a parent that was rewritten is named by its current id."""
        info = CheckpointInfo.from_record(rec)
        now = self._current_id(rec.parent)
        return info if now is None or now == rec.parent else dataclasses.replace(info, parent=now)

    # (the signatures below say builtins.list: in this class's scope, which type checkers read them in, ``list``
    # is this method)
    @_operation
    def list(self) -> list[CheckpointInfo]:
        """Every retained checkpoint, oldest commit first."""
        # (each its own metadata: what a caller does to one is not what the next listing, or retention, reads)
        return [_detached(info) for info in self._listing()]

    @_operation
    def _listing(self) -> builtins.list[CheckpointInfo]:
        """:meth:`list`, its infos shared with earlier listings of this handle (their metadata too): for readers
        that change nothing, such as retention after every save."""
        self._refresh()
        rows = self._rows()
        ids = {info.id for info, _ in rows}
        moved = _moved_in(rows)
        return [info if info.parent in ids or info.parent not in moved
                else dataclasses.replace(info, parent=moved[info.parent]) for info, _ in rows]

    def _rows(self) -> builtins.list[tuple[CheckpointInfo, tuple[str, ...]]]:
        """Every record, oldest commit first, as (info with its parent as recorded, ids it replaced).

        A Checkpointer with a retention policy lists after every save: the records listed before are taken from
        the last listing when their bytes are the same (decoding one took 12 us: 30 ms at 2,500 kept)."""
        memo, listed = self._listed, {}
        rows: list[tuple[CheckpointInfo, tuple[str, ...]]] = []
        for key, raw in self.index.raw_records():
            row = memo.get((key, raw))
            if row is None:
                rec = record_at(key, raw)
                row = (CheckpointInfo.from_record(rec), tuple(rec.extra.get("replaces", ())))
            listed[(key, raw)] = row
            rows.append(row)
        self._listed = listed
        return rows

    @_operation
    def info(self, step: int | None = None, *, id: str | None = None) -> CheckpointInfo:
        """The checkpoint at ``step`` (the newest one with that step), or with ``id`` (also an id it replaced in
        a :meth:`rewrite`); latest when neither."""
        self._refresh()
        return self._info(self._record(step, id))

    @_operation
    def latest(self) -> CheckpointInfo | None:
        self._refresh()
        rec = self.index.get()
        return None if rec is None else self._info(rec)

    @_operation
    def manifest(self, step: int | None = None, *, id: str | None = None) -> Manifest:
        """The parsed, verified manifest of a checkpoint (for inspection tools)."""
        self._refresh()
        return self._manifest(self._record(step, id))

    @_operation
    def __len__(self) -> int:
        self._refresh()
        return self.index.count()

    # -- save ---------------------------------------------------------------------------------------------
    def save(
        self,
        state: Any,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        *,
        parent: str | None = None,
        allow_pickle: bool = False,
        keyframe: bool = False,
    ) -> CheckpointInfo:
        """Durably store ``state`` as a checkpoint at ``step`` and return its info.

        Only chunks the store does not hold yet are written; with deltas on (the default) a changed chunk of a
        tensor that the parent checkpoint also holds (same key, dtype and shape) may be stored as an XOR delta
        against the parent's chunk. When this returns the checkpoint survives a crash. ``parent`` (a
        checkpoint id) is the lineage and delta parent; by default the checkpoint this handle last saved or
        loaded, else the latest one. ``keyframe=True`` stores every new chunk standalone (no deltas), so the
        changed tensors of this checkpoint restore from one frame per chunk: for the last save before a
        planned stop, and for a step a retention policy keeps for good (as deltas it would keep alive the chunks
        of the deleted checkpoints before it that it decodes from). Raises UnsupportedTypeError (a TypeError
        naming the key path) before writing anything if the state holds something that cannot be stored.
        """
        return self._save(state, step, metadata, parent=parent, allow_pickle=allow_pickle, keyframe=keyframe)

    @_operation
    @collector.paused_during
    def _save(
        self,
        state: Any,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        *,
        parent: str | None = None,
        allow_pickle: bool = False,
        keyframe: bool = False,
        _replace: Record | None = None,
        _pairs: Mapping[str, str] | None = None,
        _flat: tuple[str, Mapping[str, Any], Mapping[str, Any] | None] | None = None,
        _self_contained: bool = False,
        _devices: Mapping[int, str] | None = None,
        _after: str | None = None,
    ) -> CheckpointInfo:
        """:meth:`save`, with what :meth:`rewrite`, a Checkpointer and a DCP writer add.

        ``_replace``: the checkpoint a rewrite replaces. ``_pairs`` (optimizer state entry's key path -> its
        parameter's) and ``_flat`` (a DCP rank's shard hints, and those hints' betas and eps at the rank's save
        before, or None) tell :mod:`deltackpt.predict` what predicts what.
        ``_self_contained`` (with ``keyframe``; a step retention keeps for good): chunks of the state that the
        store holds only as delta or predicted frames are written again standalone too, as a rewrite does, so
        the checkpoint keeps no older checkpoint's frames alive. ``_devices`` (by ``id`` of a tensor of
        ``state``): the device to record for it, where it is a host copy of a tensor there (an async save's
        staging buffer), so that loads put it back where it was. ``_after``: the checkpoint a Checkpointer last
        saved or restored, descended from in place of this handle's last saved or loaded one (which another
        thread's load through the same handle may have moved).
        """
        self._writable("save")
        step = check_step(step)
        allow_pickle, keyframe = config.boolean("allow_pickle", allow_pickle), config.boolean("keyframe", keyframe)
        skeleton, leaves = tree.flatten(state, allow_pickle=allow_pickle)
        if _devices:
            for leaf in leaves:
                leaf.device = _devices.get(id(leaf.obj), leaf.device)
        metadata = check_metadata(metadata)
        meta_node = tree.encode_plain(metadata) if metadata is not None else None
        if parent is not None:
            manifest.check_id(parent)
        ckpt_id = secrets.token_hex(8)
        while ckpt_id.isdigit():  # (1 in 1850) the command line would read it as a step
            ckpt_id = secrets.token_hex(8)
        with self._save_lock, self._gc_lock():
            self.reader.drop_unlinked()
            if _replace is not None:
                pass  # a rewrite keeps the replaced checkpoint's parent, None (a root) included
            elif parent is None:
                parent = self._current_id(_after or self._head)  # (None when deleted meanwhile)
                if parent is None:
                    latest = self.index.get()
                    parent = latest.id if latest is not None else None
            else:
                named, parent = parent, self._current_id(parent)
                if parent is None:
                    raise CheckpointNotFoundError(f"parent checkpoint {named} is not in {self.path}")
            use_delta = parent is not None and self.max_chain > 0 and _replace is None and not keyframe
            pm = self._parent_manifest(parent) if use_delta and parent is not None else None
            ref = pm
            if ref is None and parent is not None:  # (a keyframe, a rewrite: the parent still tells, when readable)
                with contextlib.suppress(CorruptManifestError, FormatVersionError):
                    ref = self._parent_manifest(parent)
            if ref is not None and ref.chunk_size != self.chunk_size:  # (fixed at creation: STORE lost a digit)
                raise DeltackptError(
                    f"store {self.path}: checkpoint {ref.id} was cut into chunks of {ref.chunk_size} bytes, the "
                    f"STORE file says {self.chunk_size}: STORE is damaged ('deltackpt repair STORE' writes it "
                    f"again from the manifests); nothing was saved")
            whole = _replace is not None or (keyframe and _self_contained)
            # a parent that wrote nothing (a save between optimizer steps: gradient accumulation) takes no keyframe
            # turn, so the next save takes it: else with every other save unchanged, half the chunk positions' turns
            # fell on saves that wrote nothing, and those chunks reached the chain bound together (21% more bytes
            # per changed save, 31% with 4 micro-batches)
            generation = int(pm.extra.get("generation", 0)) + (pm.written_bytes > 0) if pm is not None else 0
            # a rewrite takes the place of a checkpoint under a new id: it names the ids it replaces, so that a
            # later checkpoint's parent (and load(id=...) of the old id) still finds it
            replaces = {"replaces": [_replace.id, *_replace.extra.get("replaces", [])]} if _replace else {}
            roles = predict.plan(state, leaves, _pairs) if self.predict and pm is not None else {}
            if _flat is not None and self.predict and pm is not None:  # a DCP rank's shards (distributed.py)
                roles = {**predict.plan_flat(leaves, _flat[1], _flat[0]), **roles}
                if _flat[2]:  # the betas of the rank's save before (its skeleton holds no param_groups)
                    before = predict.plan_flat(leaves, {**_flat[1], **_flat[2]}, _flat[0])
                    roles = predict.with_betas_before(roles, {r.m: (r.beta1, r.beta2, r.eps) for r in before.values()})
            if roles and pm is not None:  # the betas the parent's update used: see predict.choose_coefs
                roles = predict.with_betas_before(roles, predict.betas_in_skeleton(pm.tree))
                roles = predict.with_lr_before(roles, pm.tree)
            mark = self._writer.mark()
            try:
                entries, digests, flags, new_locs, written, state_keys = self._write_leaves(
                    leaves, pm, generation, roles, self_contained=whole
                )
                self._writer.sync()  # 1. every new frame durable
                m = Manifest(
                    id=ckpt_id,
                    step=step,
                    created=_replace.created if _replace is not None else time.time(),  # a rewrite: same place
                    parent=parent,
                    chunk_size=self.chunk_size,
                    tree=skeleton,
                    tensors=entries,
                    digests=digests,
                    flags=flags,
                    metadata=meta_node,
                    logical_bytes=sum(e.nbytes for e in entries),
                    written_bytes=written,
                    extra={"generation": generation, **replaces},
                )
                self._tmp_dir.mkdir(exist_ok=True)  # (an empty tmp/ can be lost: a cleaner of empty directories)
                _, checksum = manifest.write(self._manifests_dir, self._tmp_dir, m)  # 2. manifest durable
                rec = Record(
                    id=ckpt_id,
                    step=step,
                    created=m.created,
                    parent=parent,
                    manifest_checksum=checksum,
                    logical_bytes=m.logical_bytes,
                    written_bytes=written,
                    metadata=meta_node,
                    extra=replaces,
                )
                rec = self.index.commit_checkpoint(rec, new_locs, replace=_replace,  # 3. THE COMMIT POINT
                                                   repoint=True if whole else self._damaged)
            except BaseException:
                # Nothing of a save that did not commit is referenced: on a full disk, say, its frames and its
                # manifest give their space back (else gc reclaims them).
                if not self._committed(ckpt_id):
                    self._writer.rollback(mark)
                    self._unlink_manifests([ckpt_id])  # (best effort: the save's own error is what propagates)
                    raise
                # An exception after the commit (a Ctrl-C's KeyboardInterrupt as the index returned): the
                # checkpoint stands, so the handle's next save descends from it, as after a save that returned
                # (the next one branched from the checkpoint before).
                self._committed_as(ckpt_id, m, state_keys, new_locs, _replace)
                raise
            self._committed_as(ckpt_id, m, state_keys, new_locs, _replace)
        return CheckpointInfo.from_record(rec)

    def _committed_as(self, ckpt_id: str, m: Manifest, state_keys: set[bytes],
                      new_locs: Mapping[bytes, ChunkLoc], replace: Record | None) -> None:
        """The handle's bookkeeping after a save (or rewrite) committed as ``ckpt_id``: its parent for the next
        save, the delta bases kept, the pack writer moved on. Caller holds the save lock (and a rewrite's
        ``gc.lock``)."""
        self._damaged.difference_update(new_locs)
        if replace is None:
            self._head, self._last_manifest = ckpt_id, m  # (one statement: no interrupt between the two)
            # the next save's delta bases are this state's chunks: the cache keeps those, no older ones
            self._base_cache.retain(state_keys)
            # a pack this writer still appends to is one gc cannot delete: move on once it holds more than a
            # state's worth (at least _SEAL_BYTES), so what retention deletes is freed by the next gc
            self._writer.seal_past(max(_SEAL_BYTES, m.logical_bytes))
        else:  # still under gc.lock, so that no repair restores the replaced checkpoint from its manifest
            if self._head == replace.id:  # (under the save lock: a save by another thread is not undone)
                self._head = ckpt_id
            self._unlink_manifests([replace.id])

    def _committed(self, checkpoint_id: str) -> bool:
        """Whether a save's commit took place after all (true when the index cannot say)."""
        try:
            return self.index.get(id=checkpoint_id) is not None
        except Exception:
            return True

    @_operation
    def rewrite(self, state: Any, *, id: str, metadata: Mapping[str, Any] | None = None,
                _devices: Mapping[int, str] | None = None) -> CheckpointInfo:
        """Replace checkpoint ``id`` by ``state`` (same step and parent, same place in commit order). The new
        checkpoint keeps the old one's metadata unless ``metadata`` is given (``{}`` clears it), and takes a new
        id; the old id still resolves to it (:meth:`load`, :meth:`info` with ``id=``).

        One index transaction swaps the old checkpoint for the new one, so a crash leaves one or the other.
        Retention uses it to thin old checkpoints to model weights; the handle's parent for later saves is
        unchanged. The new checkpoint is self-contained: its chunks that the store holds as delta or predicted
        frames are written again standalone and their index entries re-pointed in the same transaction, so it
        keeps no older checkpoint's chunks alive (thinning frees the optimizer state those frames decoded
        from). Later checkpoints that decode from these chunks read the standalone frames.
        """
        old = self._record(id=id)
        if metadata is None:
            metadata = CheckpointInfo.from_record(old).metadata
        return self._save(state, old.step, metadata, parent=old.parent, _replace=old, _devices=_devices)

    def _parent_manifest(self, parent: str) -> Manifest | None:
        last = self._last_manifest
        if last is not None and last.id == parent:
            return last
        rec = self.index.get(id=parent)
        return None if rec is None else self._manifest(rec)

    def _write_leaves(
        self, leaves: builtins.list[tree.Leaf], pm: Manifest | None, generation: int,
        roles: Mapping[str, predict.Role] | None = None, *, self_contained: bool = False,
    ) -> tuple[builtins.list[TensorEntry], np.ndarray, np.ndarray, dict[bytes, ChunkLoc], int, set[bytes]]:
        """Name every chunk of ``leaves``, encode and append the new ones; return the manifest's tensor entries,
        digests and flags, the new chunks' locations, the bytes written and the keys of every stored chunk.

        Chunks are encoded on the worker pool as they are named, except those of tensors with a predictor role
        (``roles``, from :func:`deltackpt.predict.plan`): they wait until every other chunk is written, so the
        chain depth of the first-moment chunks they reference is known. The keyframe turns of a parameter and
        of its second moment are aligned (both take the first moment's phase): their chains then have the same
        depths, and each can be predicted whenever the other can.

        With ``self_contained`` (a rewrite, a keyframe retention keeps for good; ``pm`` is then None, so new chunks
        are standalone), chunks the store holds only as delta or predicted frames are encoded again standalone
        too; their new locations are among those returned, for the commit to re-point.
        """
        cs = self.chunk_size
        k_max = self.max_chain
        # Key paths are names, not addresses: {"a.b": x} and {"a": {"b": y}} share one. A path two tensors share
        # (here or in the parent) takes no part in predictions and has no delta parent, which are found by path:
        # the two tensors' bytes would be mixed up (decodes stay lossless, but a save failed its digest check).
        shared = _shared_paths(leaf.path for leaf in leaves)
        parents: dict[str, TensorEntry] = {}
        if pm is not None and pm.chunk_size == cs:
            shared |= _shared_paths(t.key for t in pm.tensors)
            parents = {t.key: t for t in pm.tensors if t.key not in shared}
        roles = {p: r for p, r in (roles or {}).items() if not {p, r.m, r.v} & shared}
        # (a Muon parameter's prediction reads an update chunk, not its momentum buffer: the buffer is neither)
        first_moments = {r.m for r in roles.values() if not r.average and r.update is None}
        sources = {r.m for r in roles.values() if r.update is None}  # what predictions read of this save
        entries: list[TensorEntry] = []
        all_digests: list[np.ndarray] = []
        all_flags: list[np.ndarray] = []
        new_locs: dict[bytes, ChunkLoc] = {}
        state_keys: set[bytes] = set()  # every stored chunk of the state (what the next save's bases are)
        pending: set[bytes] = set()
        # (future, key, entry, depth if the frame is a delta, depth if it is a predicted frame, the parent's chunks
        # it reads from the base cache)
        inflight: collections.deque[
            tuple[Future[bytes | _WithUpdate] | _Done, bytes, TensorEntry, int, int, tuple[bytes, ...]]
        ] = collections.deque()
        # The parent's chunks that encodes submitted or still to come read from the base cache (delta bases,
        # prediction inputs), with how many read each. Once the last has read one it leaves the cache (unless
        # this state holds it too): the cache then holds about one state during a save, not the parent's and this
        # save's chunks together, and the bases still to be read are not the least recently used when it is full.
        reads: collections.Counter[bytes] = collections.Counter()
        limit = _concurrent_chunks(cs, self.threads * _INFLIGHT_PER_THREAD)
        written = 0
        first = 0
        # tensors with a predictor role and their first moments (on the CPU): (bytes, digests, zero flags)
        hosted: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        deferred: list[tuple[tree.Leaf, TensorEntry, int, bytes, tuple[bytes, int]]] = []

        def drain(keep: int) -> None:
            nonlocal written
            while len(inflight) > keep:
                fut, key, entry, delta_depth, pred_depth, read = inflight.popleft()
                try:
                    got = fut.result()
                except StateChangedError as exc:
                    raise StateChangedError(f"{entry.key!r}: {exc}") from None
                if isinstance(got, _WithUpdate):  # the update chunk the frame references goes first
                    frame, (uk, uframe) = got.frame, got.update
                    # once per save, at depth 0 as the frame's depth assumed: also where the state holds the same
                    # bytes in a chunk written as a delta (which then reads this frame too, a shorter chain)
                    if uk not in new_locs or new_locs[uk].depth > 0:
                        pack_id, offset = self._writer.append(uframe)
                        ukind, ubase = codec.built_header(uframe)
                        new_locs[uk] = ChunkLoc(pack_id, offset, len(uframe), ukind, 0, ubase)
                        entry.written += len(uframe)
                        written += len(uframe)
                else:
                    frame = got
                for b in read:
                    left = reads[b] - 1
                    reads[b] = left
                    if left <= 0:
                        del reads[b]
                        if b not in state_keys:
                            self._base_cache.discard(b)
                pack_id, offset = self._writer.append(frame)
                kind, base = codec.built_header(frame)
                depth = delta_depth if kind == codec.DELTA else pred_depth if kind == codec.PREDICTED else 0
                if pred_depth > 0:  # a prediction was tried: did it win?
                    self._count_delta(entry.key, kind == codec.PREDICTED, self._predict_stats)
                elif delta_depth > 0 and kind != codec.RAW:  # did the offered delta win?
                    self._count_delta(entry.key, kind == codec.DELTA)
                prior = new_locs.get(key)  # (an update chunk of the same bytes, written first: the shallower)
                if prior is None or prior.depth > depth:
                    new_locs[key] = ChunkLoc(pack_id, offset, len(frame), kind, depth, base)
                entry.written += len(frame)
                written += len(frame)

        def submit(leaf: tree.Leaf, entry: TensorEntry, i: int, k: bytes, base: tuple[bytes, int] | None,
                   buf: np.ndarray, prediction: tuple[predict.Role, builtins.list[bytes], int] | None = None,
                   read: tuple[bytes, ...] | None = None) -> None:
            """Encode chunk ``i`` on the pool. ``read``: the parent's chunks it reads, counted in ``reads`` already
            (by default its base, counted here)."""
            if read is None:
                read = ()
                if base:
                    read = (base[0],)
                    reads[base[0]] = reads.get(base[0], 0) + 1
            view = memoryview(buf)[i * cs : i * cs + min(cs, leaf.nbytes - i * cs)]
            run = self._submit if len(view) >= _INLINE_BELOW else _Done.run
            # room first: with this chunk, at most ``limit`` are encoded at once (a drain after the submit let
            # limit + 1 run: two 1 GiB chunks where the bound allows one)
            drain(limit - 1)
            if prediction is not None:
                assert base is not None
                role, refs, pred_depth = prediction
                if role.update is not None:
                    fut = run(self._encode_update, view, k, leaf.width, base[0], role)
                else:
                    m = hosted[role.m][0][i * cs : i * cs + len(view)]
                    fut = run(self._encode_predicted, view, k, leaf.width, base[0], role, refs, m)
                inflight.append((fut, k, entry, base[1] + 1, pred_depth, read))
            else:
                # every 16th chunk of the checkpoint (counted across tensors, shifted by one each generation)
                # tries both encodings, so the statistics behind the encoding mode stay current
                mode = "both" if (entry.first + i + generation) % 16 == 0 else self._delta_mode(leaf.path)
                fut = run(self._encode, view, k, leaf.width, base[0] if base else None, mode)
                inflight.append((fut, k, entry, base[1] + 1 if base else 0, 0, read))

        def hashed(leaf: tree.Leaf, pinned: staging.Pinned | None) -> _Hashed:
            """The leaf's bytes on the host, its chunks' digests and zero flags, and (position, key) of each chunk
            that is not all zero."""
            try:
                buf = staging.host_bytes(leaf.obj, pinned)
            # (NotImplementedError: a dtype torch cannot copy this way; tree refuses those it knows)
            except (NotImplementedError, RuntimeError) as exc:
                refused = staging.copy_refused(exc, leaf.path)
                if refused is None:
                    raise
                raise refused from None
            digests, zero = kernel.chunk_digests(buf, cs, self.threads)
            nbytes, raw = leaf.nbytes, digests.tobytes()
            keyed = [(i, chunk_key(raw[16 * i : 16 * i + 16], min(cs, nbytes - i * cs)))
                     for i, z in enumerate(zero.tolist()) if not z]
            return buf, digests, zero, keyed

        # CPU tensors hashed ahead of the loop below, a group at a time, by position in ``leaves``
        ahead: dict[int, _Hashed] = {}
        # the parent's digests and zero flags, read without a numpy call per chunk
        parent_digests = pm.digests.tobytes() if parents and pm is not None else b""
        parent_zero = (pm.flags & manifest.FLAG_ZERO).tolist() if parents and pm is not None else []

        def look_ahead(start: int, chunks: ChunkReader) -> None:
            """Hash the CPU tensors from ``leaves[start]`` on (up to :data:`_AHEAD_TENSORS` of them, about
            :data:`_AHEAD_BYTES`) and read at once the index entries the loop below will look up for them: of
            their chunks not named yet in this save, and of the parent's chunks at the same positions (delta
            bases; read for a few more positions than the loop asks for: those on their keyframe turn, those whose
            bytes another tensor holds too). The loop then decides as before, without an LMDB call per tensor."""
            ahead.clear()
            size = 0
            for j in range(start, min(len(leaves), start + _AHEAD_TENSORS)):
                leaf = leaves[j]
                if (ahead and size + leaf.nbytes > _AHEAD_BYTES) or (
                        isinstance(leaf.obj, torch.Tensor) and not leaf.obj.is_cpu):
                    break
                ahead[j] = hashed(leaf, None)
                size += leaf.nbytes
            read: list[bytes] = []
            for j, (_, _, _, keyed) in ahead.items():
                read += [k for _, k in keyed if k not in pending]
                leaf = leaves[j]
                pt = parents.get(leaf.path)
                if (k_max and pt is not None and leaf.path not in first_moments
                        and (pt.kind, pt.dtype, list(pt.shape)) == (leaf.kind, leaf.dtype, list(leaf.shape))):
                    read += [parent_digests[16 * (pt.first + i) : 16 * (pt.first + i) + 16] + k[16:]
                             for i, k in keyed if not parent_zero[pt.first + i]]
            chunks.prefetch(read)

        try:
            # one read transaction of the chunk table for the lookups of every tensor (not one per tensor)
            with self.index.chunk_reader() as chunks:
                for li, leaf in enumerate(leaves):
                    on_device = li not in ahead and isinstance(leaf.obj, torch.Tensor) and not leaf.obj.is_cpu
                    if on_device:
                        drain(0)  # the pinned staging buffer is about to be overwritten
                        buf, digests, zero, todo = hashed(leaf, self._pinned)
                    else:
                        if li not in ahead:
                            look_ahead(li, chunks)
                        buf, digests, zero, todo = ahead.pop(li)
                    n = len(zero)
                    entry = TensorEntry(
                        key=leaf.path, kind=leaf.kind, dtype=leaf.dtype, shape=list(leaf.shape), nbytes=leaf.nbytes,
                        width=leaf.width, first=first, count=n, requires_grad=leaf.requires_grad,
                        parameter=leaf.parameter, device=leaf.device,
                    )
                    first += n
                    entries.append(entry)
                    all_digests.append(digests)
                    all_flags.append(zero)
                    if not on_device and (leaf.path in roles or leaf.path in sources):
                        hosted[leaf.path] = (buf, digests, zero)  # kept until the predictions are encoded
                    state_keys.update(k for _, k in todo)
                    todo = [(i, k) for i, k in todo if k not in pending and k not in new_locs]
                    if self_contained:
                        found = chunks.lookup(k for _, k in todo)
                        stored = {k for k, loc in found.items() if loc.codec not in codec.BASED}
                    else:
                        stored = chunks.has(k for _, k in todo)
                    if self._damaged:
                        self._taint(k for _, k in todo if k in stored)
                    todo = [(i, k) for i, k in todo if k not in stored or k in self._damaged]
                    role = roles.get(leaf.path) if not on_device else None
                    phase = generation + (zlib.crc32(role.m.encode()) if role is not None else entry.first)
                    if role is not None and role.average and role.m in roles:
                        # keyframes where the parameter's chain is longest: an average's depth exceeds its parameter's
                        phase = generation + zlib.crc32(roles[role.m].m.encode()) + 1
                    bases = {}
                    # a first moment that predictions reference stays standalone: its deltas gain 2-3%, and their
                    # depth would add to every prediction's, which then reaches the chain bound sooner
                    if k_max and leaf.path not in first_moments and leaf.path not in shared:
                        bases = self._bases(leaf, parents.get(leaf.path), pm, todo, phase, chunks,
                                            (parent_digests, parent_zero))
                    for i, k in todo:
                        if k in pending:
                            continue  # the same bytes twice in this tensor
                        pending.add(k)
                        # a chunk written again for a damaged frame is a keyframe: chains through it keep their depth
                        base = bases.get(i) if k not in self._damaged else None
                        if role is not None and base is not None:
                            deferred.append((leaf, entry, i, k, base))
                        else:
                            submit(leaf, entry, i, k, base, buf)
            drain(0)  # every chunk a prediction may reference is written: its depth is known
            # a parameter's chunk i and its second moment's read the parent's first moment chunk i both: encoded one
            # after the other, the parent's three chunks at i leave the cache together
            pairs = {m: n for n, m in enumerate(dict.fromkeys(roles[leaf.path].m for leaf, *_ in deferred))}
            deferred.sort(key=lambda d: (roles[d[0].path].average, pairs[roles[d[0].path].m], d[2]))
            # what the deferred chunks read of the parent: their bases, and what their predictions would reference
            planned = [(base[0], *_parent_refs(roles[leaf.path], i, k, parents, pm))
                       for leaf, _, i, k, base in deferred]
            for read in planned:
                reads.update(read)
            if deferred:  # (not in a rewrite: the cache keeps the bases of the next save, the newest state's chunks)
                self._base_cache.retain(state_keys | reads.keys())  # the parent's chunks nothing reads any more
            averaging = False
            for (leaf, entry, i, k, base), read in zip(deferred, planned):
                role = roles[leaf.path]
                if role.average and not averaging:  # (last: they reference parameter chunks, now of known depth)
                    averaging = True
                    drain(0)
                prediction = None
                # as with deltas, every 16th chunk tries even when predictions stopped winning for this role
                if self._predicting(leaf.path) or (entry.first + i + generation) % 16 == 0:
                    prediction = self._prediction_inputs(role, i, k, base, hosted, parents, pm, new_locs)
                submit(leaf, entry, i, k, base, hosted[leaf.path][0], prediction, read)
            drain(0)
        except BaseException:
            for fut, *_ in inflight:
                fut.cancel()
            for fut, *_ in inflight:
                if not fut.cancelled():
                    try:
                        fut.result()
                    except BaseException:
                        pass
            raise
        digests = np.concatenate(all_digests) if all_digests else np.empty((0, 16), np.uint8)
        flags = np.concatenate(all_flags).astype(np.uint8) if all_flags else np.empty(0, np.uint8)
        return entries, digests, flags, new_locs, written, state_keys

    def _prediction_inputs(
        self, role: predict.Role, i: int, k: bytes, base: tuple[bytes, int],
        hosted: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
        parents: Mapping[str, TensorEntry], pm: Manifest | None,
        new_locs: Mapping[bytes, ChunkLoc],
    ) -> tuple[predict.Role, builtins.list[bytes], int] | None:
        """The keys of the chunks a prediction of chunk ``i`` (key ``k``) would reference, in the record's order
        (this checkpoint's first moment, the parent's first moment, for a parameter the parent's second
        moment), and the chain depth it would have; None when it cannot be predicted within the chain bound or
        a referenced chunk is all zero, on a device, or missing from the parent. A Muon parameter's prediction
        (:attr:`~deltackpt.predict.Role.update`) references an update chunk that its encoding makes (standalone:
        depth 0), so only its base counts, and its references are known only then."""
        if role.update is not None:
            depth = base[1] + 1
            return (role, [], depth) if pm is not None and depth <= self.max_chain else None
        got = hosted.get(role.m)
        if got is None or i >= len(got[2]) or got[2][i] or pm is None:
            return None
        mine = got[1][i].tobytes() + k[16:]
        if role.average:  # (this save's parameter chunk twice: c2 = 0, and the depth is the parameter's + 1)
            refs = [mine, mine]
        else:
            parent_refs = _parent_refs(role, i, k, parents, pm, got[0].nbytes)
            if len(parent_refs) != (2 if role.predictor == predict.PARAM else 1):
                return None
            refs = [mine, *parent_refs]
        if self._damaged:
            self._taint(refs)
            if any(r in self._damaged for r in refs):
                return None
        depths = [new_locs[r].depth if r in new_locs else None for r in refs]
        missing = [r for r, d in zip(refs, depths) if d is None]
        found = self.index.lookup_chunks(missing) if missing else {}
        depth = base[1]
        for r, d in zip(refs, depths):
            if d is None:
                loc = found.get(r)
                if loc is None:
                    return None
                d = loc.depth
            depth = max(depth, d)
        if depth + 1 > self.max_chain:
            return None
        return role, refs, depth + 1

    def _taint(self, keys: Iterable[bytes]) -> None:
        """Add to the chunks known damaged (``_damaged``) those of ``keys`` whose decoding reads one: through a
        delta base or a prediction input, at any depth. A save then writes them again rather than deduplicate
        onto them, and takes none of them as a base or an input: a checkpoint saved on them would be as damaged
        as they are, although its writer holds the right bytes. Only called while something is known damaged
        (rare): it reads the header and record of each predicted frame it walks. Chunks found clean are
        remembered until more damage is found."""
        if not self._damaged <= self._clean_for:  # more damage since: what was clean may not be
            self._clean.clear()

        def tainted(k: bytes, depth: int) -> bool:
            if k in self._damaged:
                return True
            if k in self._clean:
                return False
            if depth > codec.MAX_CHAIN_FRAMES:  # (a cycle, which no writer makes: not decodable either)
                return True
            loc = self.index.lookup_chunks([k]).get(k)
            if loc is None:  # a chunk not stored (yet): nothing to read
                return False
            refs = [loc.base + k[16:]] if loc.codec in codec.BASED else []
            if loc.codec == codec.PREDICTED:
                refs += self._named_inputs(k, loc)
            if any(tainted(r, depth + 1) for r in refs):
                self._damaged.add(k)
                return True
            self._clean.add(k)
            return False

        for k in keys:
            tainted(k, 0)
        self._clean_for = set(self._damaged)

    def _bases(
        self,
        leaf: tree.Leaf,
        pt: TensorEntry | None,
        pm: Manifest | None,
        todo: builtins.list[tuple[int, bytes]],
        phase: int,
        chunks: ChunkReader,
        table: tuple[bytes, builtins.list[int]],
    ) -> dict[int, tuple[bytes, int]]:
        """Delta base (key, depth) for each new chunk position whose parent chunk may serve as one.

        A chunk gets no base (a keyframe) when the parent tensor differs in kind, dtype or shape, when the
        parent chunk is all zero, when the chain would exceed ``max_chain`` frames, and on its staggered
        keyframe turn ``(phase + position) % (max_chain + 1) == 0``. ``phase`` is the checkpoint's generation
        plus the index of the tensor's first chunk in the checkpoint, so keyframes are spread over all chunks
        of a checkpoint (small one-chunk tensors too) and over checkpoints: every checkpoint restores in about
        the same time. (A tensor with a predictor role takes the generation plus a hash of its first moment's
        key path instead, + 1 for an average: see :meth:`_write_leaves`, which keeps a parameter's chunks and
        their moments' on the same turn.) ``table``: ``pm``'s digests as bytes and its zero flags as a list (read
        once per save, not with a numpy call per chunk).
        """
        if pt is None or pm is None or not todo:
            return {}
        if (pt.kind, pt.dtype, list(pt.shape)) != (leaf.kind, leaf.dtype, list(leaf.shape)):
            return {}
        period = self.max_chain + 1
        cand: dict[int, bytes] = {}
        digests, zero = table
        first = pt.first
        for i, k in todo:
            if (phase + i) % period == 0:
                continue
            j = first + i
            if zero[j]:
                continue
            cand[i] = digests[16 * j : 16 * j + 16] + k[16:]
        if self._damaged:
            self._taint(cand.values())
            cand = {i: bk for i, bk in cand.items() if bk not in self._damaged}
        locs = chunks.lookup(list(cand.values()))
        out: dict[int, tuple[bytes, int]] = {}
        k_max = self.max_chain
        for i, bk in cand.items():
            loc = locs.get(bk)
            if loc is not None and loc.depth + 1 <= k_max:
                out[i] = (bk, loc.depth)
        return out

    def _delta_mode(self, path: str) -> str:
        """How to encode the changed chunks of tensor ``path``, from how chunks of its role fared in recent saves:
        ``"delta"`` when deltas almost always won, ``"alone"`` when they almost never did, else ``"both"``
        (the encoder tries both and keeps the smaller). Saves a second compression per chunk.

        The statistics are kept per role, not per tensor (:func:`_role`: ``optimizer.state[7].exp_avg`` and
        ``optimizer.state[9].exp_avg`` share those of ``optimizer.state[#].exp_avg``): most tensors of a model
        have only a few chunks and would otherwise take many saves to leave ``"both"``, while tensors of one role
        change alike."""
        won, tried = self._delta_stats.get(_role(path), (0, 0))
        if tried < 8:
            return "both"
        if won >= 0.95 * tried:
            return "delta"
        if won <= 0.05 * tried:
            return "alone"
        return "both"

    def _count_delta(self, path: str, won: bool, stats: dict[str, tuple[int, int]] | None = None) -> None:
        stats = self._delta_stats if stats is None else stats
        role = _role(path)
        w, t = stats.get(role, (0, 0))
        if t >= 64:  # a moving window: training changes how well deltas do
            w, t = w // 2, t // 2
        stats[role] = (w + int(won), t + 1)

    def _predicting(self, path: str) -> bool:
        """Whether to try predicted frames for tensor ``path``: not when they almost never won for its role in
        recent saves (saves several optimizer steps apart, another optimizer), which saves a trial encoding."""
        won, tried = self._predict_stats.get(_role(path), (0, 0))
        return tried < 8 or won > 0.05 * tried

    def _encode(self, view: memoryview, key: bytes, width: int, base_key: bytes | None, mode: str = "both", *,
                checked: np.ndarray | None = None) -> bytes:
        """The frame of a new chunk: standalone, or a delta against ``base_key`` (``mode`` as for
        :meth:`_delta_mode`). ``checked``: the chunk's bytes as :meth:`_checked` returned them, when the caller
        has them already."""
        raw = checked if checked is not None else self._checked(view, key)
        base: np.ndarray | memoryview | None = None
        if base_key is not None and mode == "alone":
            base_key = None
        if base_key is not None:
            base = self._base_cache.get(base_key)
            if base is None:
                try:
                    base = self._read_chunk(base_key)
                except CorruptChunkError:
                    base, base_key = None, None  # a damaged base must not spread: store a keyframe
        return self._encoder().encode(
            raw, key[:16], width, base, None if base_key is None else base_key[:16], try_alone=mode != "delta"
        )

    def _checked(self, view: memoryview | np.ndarray, key: bytes) -> np.ndarray:
        """A new chunk's bytes to encode: a private copy whose digest is that of the bytes the save hashed
        (``key``), kept as the next save's delta base when the cache takes chunks that large. Raises
        :class:`StateChangedError` when the tensor changed since it was hashed (another thread wrote to it):
        encoded from the live bytes, its frame would not decode to its id, and later saves of the same bytes
        would dedup onto that frame."""
        raw = self._base_cache.put(key, view)
        kept = raw is not None
        if raw is None:
            raw = np.array(view, dtype=np.uint8, copy=True)
        if kernel.digest(raw) != key[:16]:
            if kept:
                self._base_cache.discard(key)
            raise StateChangedError("a tensor changed while this save was reading it (another thread wrote to "
                                    f"it); nothing was committed: chunk {_kid(key)}")
        return raw

    def _raw_of(self, key: bytes) -> np.ndarray | memoryview:
        """The raw bytes of a stored chunk: from the cache of the last save's chunks, else decoded."""
        got = self._base_cache.get(key)
        return got if got is not None else self._read_chunk(key)

    def _encode_predicted(
        self, view: memoryview, key: bytes, width: int, base_key: bytes, role: predict.Role, refs: builtins.list[bytes],
        m: np.ndarray,
    ) -> bytes:
        """Encode a chunk of a tensor with a predictor role: the predicted frame when it is at most
        :data:`~deltackpt.codec.PREDICTED_GOOD_ENOUGH` of the raw size or at most
        :data:`~deltackpt.codec.DELTA_MIN_GAIN` of the better of the delta and standalone frames
        (:meth:`_encode`), else that frame. ``refs`` are the keys of the
        chunks the prediction references (:meth:`_prediction_inputs`), ``m`` the bytes of the first of them,
        this save's first moment."""
        n = len(view)
        raw = self._checked(view, key)
        try:
            base = self._raw_of(base_key)
            # the first moment as this save hashed it: its chunk was encoded (and kept) before, else a checked copy
            first = self._base_cache.get(refs[0])
            inputs: list[np.ndarray | memoryview] = [first if first is not None else self._checked(m, refs[0])]
            inputs += [inputs[0] if r == refs[0] else self._raw_of(r) for r in refs[1:]]
        except CorruptChunkError:
            return self._encode(view, key, width, None, checked=raw)  # a damaged input must not spread: a keyframe
        coefs = predict.choose_coefs(role, base, raw, inputs, width)
        if coefs is None:
            return self._encode(view, key, width, base_key, checked=raw)
        record = predict.Prediction(predict.element_predictor(role.predictor, width), tuple(r[:16] for r in refs),
                                    coefs)
        guess = np.empty(n, dtype=np.uint8)
        predict.predict(record, base, inputs, guess)
        frame = self._encoder().encode_predicted(raw, key[:16], width, guess, base_key[:16], record.pack())
        if len(frame) > n * codec.PREDICTED_GOOD_ENOUGH:  # a poor prediction (saves apart, other optimizer, grid)
            other = self._encode(view, key, width, base_key, checked=raw)
            # as for deltas, a margin: every later load of a predicted chunk also decodes its inputs
            if len(frame) > len(other) * codec.DELTA_MIN_GAIN:
                return other
        return frame

    def _encode_update(
        self, view: memoryview, key: bytes, width: int, base_key: bytes, role: predict.Role,
    ) -> bytes | _WithUpdate:
        """Encode a chunk of a Muon parameter (:attr:`~deltackpt.predict.Role.update`): its step's update ``u``
        becomes a standalone chunk of its own (an *update chunk*, float32 elements that are bfloat16 numbers: its
        low byte planes are zeros), and the chunk a predicted frame that references it (update-param,
        ``p = f32(c0·p') - c1·u`` rounded once, as torch steps it), whose residual is then all zeros. Both are
        kept when together they are at most :data:`~deltackpt.codec.DELTA_GOOD_ENOUGH` of the raw size or
        :data:`~deltackpt.codec.DELTA_MIN_GAIN` of the frame :meth:`_encode` makes, else that frame. The update
        chunk is listed in no manifest: the frame's reference keeps it alive (``docs/format.md`` §8a)."""
        n = len(view)
        raw = self._checked(view, key)
        try:
            base = self._raw_of(base_key)
        except CorruptChunkError:
            return self._encode(view, key, width, None, checked=raw)  # a damaged base must not spread: a keyframe
        fitted = predict.fit_update(role, base, raw)
        if fitted is None:
            return self._encode(view, key, width, base_key, checked=raw)
        coefs, u = fitted
        ub = u.view(np.uint8)
        if not ub.any():  # (an all-zero chunk has no frame to reference)
            return self._encode(view, key, width, base_key, checked=raw)
        digest = kernel.digest(ub)
        record = predict.Prediction(predict.UPDATE_PARAM, (digest,), coefs)
        guess = np.empty(n, dtype=np.uint8)
        predict.predict(record, base, [ub], guess)
        encoder = self._encoder()
        frame = encoder.encode_predicted(raw, key[:16], width, guess, base_key[:16], record.pack())
        uframe = encoder.encode(ub, digest, 4)
        size = len(frame) + len(uframe)
        if size > n * codec.DELTA_GOOD_ENOUGH:
            other = self._encode(view, key, width, base_key, checked=raw)
            if size > len(other) * codec.DELTA_MIN_GAIN:
                return other
        return _WithUpdate(frame, (chunk_key(digest, n), uframe))

    # -- load ---------------------------------------------------------------------------------------------
    @collector.paused_during
    @_operation
    def load(
        self,
        step: int | None = None,
        *,
        id: str | None = None,
        map_location: Any = None,
        verify: bool = True,
        allow_pickle: bool = False,
        into: Any = None,
        _head: bool = True,
    ) -> Any:
        """Load a checkpoint (the latest when ``step`` and ``id`` are None) and return its state.

        ``map_location`` works like ``torch.load``'s (a device, a device string, or a dict mapping stored
        devices, as strings or devices, to targets). ``verify=False`` skips re-hashing decoded chunks (frame
        checksums are still checked). The next ``save`` through this handle descends from the loaded checkpoint.

        ``into`` (e.g. ``{"model": model.state_dict()}``) offers tensors to decode into: a stored tensor whose
        place in the state (dict keys and list positions, matched structurally) holds a tensor of the same dtype
        and shape in ``into`` (a writable numpy array, for a stored array) is written into that tensor's memory,
        on its device (``map_location`` does not apply to it), and the returned state holds that very object.
        Other stored tensors, and offered tensors that do not match, are handled as without ``into``. Then
        ``model.load_state_dict(state["model"])`` finds its own memory already holding the values (torch's
        ``copy_`` skips a copy onto itself): no second copy of the model is allocated. If the load raises,
        the offered tensors may hold part of the checkpoint. A module or optimizer offered where its
        ``state_dict()`` belongs is refused (:class:`UnsupportedTypeError`) before anything is read.

        ``_head=False`` (a Checkpointer's retention, loading a checkpoint to thin it) leaves what the next save
        descends from alone: restoring it afterwards would undo a save another thread made meanwhile.
        """
        verify, allow_pickle = config.boolean("verify", verify), config.boolean("allow_pickle", allow_pickle)
        staging.check_map_location(map_location)
        if into is not None:
            tree.check_offer(into)
        with self._gc_lock():  # (resolved under the lock: no gc removes it meanwhile)
            rec = self._record(step, id)
            m = self._manifest(rec)
            if not allow_pickle and (pickled := tree.pickled_paths(m.tree)):  # (refused before decoding a byte)
                raise UnsafeLoadError(
                    f"checkpoint {rec.id} (step {rec.step}) holds pickled values (saved with allow_pickle=True) at "
                    f"{', '.join(map(repr, pickled[:3]))}{' ...' if len(pickled) > 3 else ''}; load it with "
                    "allow_pickle=True only if you trust the store")
            given = _placements(m, into) if into is not None else {}
            objs: list[Any] = []
            jobs: list[tuple[TensorEntry, np.ndarray]] = []
            finals: list[tuple[int, Any, torch.device]] = []  # (a tensor: only those have a device)
            copies: list[tuple[Any, Any]] = []
            devices: dict[str, torch.device] = {}  # (resolved once per stored device)
            for n, t in enumerate(m.tensors):
                target = given.get(n)
                if target is not None:
                    dest, buf = staging.decode_target(target)
                    jobs.append((t, dest))
                    if buf is not None:
                        copies.append((target, buf))
                    objs.append(target)
                else:
                    out, dev, byte_view = staging.new_output(rec, t, map_location, devices)
                    jobs.append((t, byte_view))
                    if dev is not None and dev.type != "cpu":
                        finals.append((len(objs), out, dev))
                    objs.append(out)
            self._read_into(m, jobs, verify=verify)
        staging.copy_back(copies)
        for i, out, dev in finals:
            objs[i] = out.to(dev, non_blocking=dev.type == "cuda")  # (pinned for CUDA only: staging.copy_back)
        staging.synchronize_cuda(dev for _, _, dev in finals)
        for i, t in enumerate(m.tensors):
            if i not in given:
                objs[i] = as_saved(t, objs[i])
        state = tree.unflatten(m.tree, objs, allow_pickle=allow_pickle)
        if _head:
            self._head = rec.id
        return state

    @_operation
    @collector.paused_during
    def load_into(
        self,
        target: Any,
        step: int | None = None,
        *,
        id: str | None = None,
        verify: bool = True,
        strict: bool = True,
        spans: Mapping[str, tuple[int, int]] | None = None,
    ) -> builtins.list[str]:
        """Copy a checkpoint's tensors into the tensors of ``target`` in place, matched by place.

        ``target`` is a state tree of the same shape as the saved one (e.g. ``model.state_dict()``). CPU
        tensors are filled directly (no second full copy); others through a host buffer. Plain values are
        not touched. A stored tensor fills the target tensor at the same place: the same dict keys and sequence
        positions from the root (``{"a.b": x}`` and ``{"a": {"b": x}}`` are different places, although errors
        name both ``a.b``). Every place of a tensor counts: a tensor tied at two places in the checkpoint fills
        both targets, and a target tied at two places is filled once (where the checkpoint holds two different
        tensors there, ``ShapeMismatchError``, in any mode). Returns the key paths of the target's
        tensors that were not filled; with ``strict`` (default) any missing or unexpected tensor, and any dtype
        or shape difference, raises before a byte is copied. ``spans`` maps key paths to byte ranges
        ``(start, end)`` of their tensors (C order): only the chunks overlapping that range are read and
        decoded, and only the target bytes ``start .. end`` are written; for reading a slice of a large tensor,
        such as the rows one rank of a resharded job needs. Contiguous CPU targets only.
        """
        verify, strict = config.boolean("verify", verify), config.boolean("strict", strict)
        if spans is not None and not isinstance(spans, Mapping):
            raise TypeError(f"spans must map key paths to (start, end) byte ranges, got {type(spans).__name__}")
        try:
            skeleton, leaves = tree.flatten(target, opaque=True)  # (its plain values are only looked at)
        except UnsupportedTypeError as exc:  # a meta, sparse, quantized, ... target tensor
            why = str(exc).removeprefix("cannot store ")
            raise ShapeMismatchError(f"the target cannot hold the checkpoint's values: {why}") from None
        wanted = tree.leaf_refs(skeleton)  # every place of every target leaf (a tied weight has two)
        span_at = _span_places(wanted, spans or {})
        with self._gc_lock():
            rec = self._record(step, id)
            m = self._manifest(rec)
            stored: dict[tree.Place, TensorEntry] = {}
            stored_paths: dict[tree.Place, str] = {}
            for place, path, i in tree.leaf_refs(m.tree):
                if not 0 <= i < len(m.tensors):
                    raise CorruptManifestError(f"checkpoint {rec.id}: {path!r} names tensor {i} of {len(m.tensors)}")
                stored[place], stored_paths[place] = m.tensors[i], path
            wanted_places = {place for place, _, _ in wanted}
            missing = sorted(path for place, path, _ in wanted if place not in stored)
            unexpected = sorted(path for place, path in stored_paths.items() if place not in wanted_places)
            if strict and (missing or unexpected):
                differ = [f"{what} {_some(paths)}" for what, paths in (("missing in checkpoint", missing),
                                                                        ("not in target", unexpected)) if paths]
                raise ShapeMismatchError(
                    f"checkpoint {rec.id} (step {rec.step}) and the target differ: {', '.join(differ)}")
            jobs: list[tuple[TensorEntry, np.ndarray]] = []
            job_spans: list[tuple[int, int] | None] = []
            copies: list[tuple[Any, np.ndarray]] = []
            filled: dict[int, tuple[str, TensorEntry]] = {}
            filled_order: list[int] = []
            filled_from: list[TensorEntry] = []
            for place, key, i in wanted:
                t = stored.get(place)
                if t is None:
                    continue
                leaf = leaves[i]
                if leaf.kind != t.kind or leaf.dtype != t.dtype or list(leaf.shape) != t.shape:
                    raise ShapeMismatchError(
                        f"{key!r}: checkpoint has {t.kind} {t.dtype}{tuple(t.shape)}, target has "
                        f"{leaf.kind} {leaf.dtype}{tuple(leaf.shape)}"
                    )
                if i in filled:  # a target leaf at two places (tied) is filled once, when both hold the same
                    first_key, first = filled[i]
                    if not _same_entry(m, first, t):
                        raise ShapeMismatchError(
                            f"target tensor {key!r} is the tensor at {first_key!r}, and the checkpoint holds two "
                            "different tensors there: the target cannot hold both")
                    continue
                unfit = staging.unfillable(leaf.obj)
                if unfit is not None:
                    raise ShapeMismatchError(f"{key!r}: the target cannot hold the checkpoint's values: {unfit}")
                filled[i] = (key, t)
                filled_order.append(i)
                filled_from.append(t)
                out, buf = staging.decode_target(leaf.obj)
                span = span_at.get(place)
                if span is not None and buf is not None:
                    raise ValueError(f"{key!r}: a span needs a contiguous CPU target")
                job_spans.append(span)
                jobs.append((t, out))
                if buf is not None:
                    copies.append((leaf.obj, buf))
            for x, y in staging.overlapping([leaves[i].obj for i in filled_order]):
                (a, ta), (b, tb) = ((leaves[filled_order[k]], filled_from[k]) for k in (x, y))
                if (_same_entry(m, ta, tb) and staging.memory_span(a.obj) == staging.memory_span(b.obj)
                        and staging.strides(a.obj) == staging.strides(b.obj)):
                    continue  # the same bytes written twice to the same memory (a tensor and its numpy view)
                raise ShapeMismatchError(f"target tensors {a.path!r} and {b.path!r} share memory: the target cannot "
                                         "hold two stored tensors there")
            self._read_into(m, jobs, verify=verify, spans=job_spans)
            staging.copy_back(copies)
        self._head = rec.id
        return missing

    def _read_tensors(self, checkpoint_id: str, indices: Sequence[int], *,
                      verify: bool = True) -> builtins.list[torch.Tensor | np.ndarray]:
        """The tensors of checkpoint ``checkpoint_id`` at ``indices`` of its tensor table, decoded (verified, unless
        ``verify`` is False) on the CPU: the other tensors' chunks are not read (``deltackpt get``, DCP values)."""
        with self._gc_lock():
            rec = self._record(id=checkpoint_id)
            m = self._manifest(rec)
            devices: dict[str, torch.device] = {}
            outs = [staging.new_output(rec, m.tensors[i], "cpu", devices) for i in indices]
            self._read_into(m, [(m.tensors[i], o[2]) for i, o in zip(indices, outs)], verify=verify)
        return [o[0] for o in outs]

    def _read_into(self, m: Manifest, jobs: builtins.list[tuple[TensorEntry, np.ndarray]], *,
                   verify: bool, spans: Sequence[tuple[int, int] | None] | None = None) -> None:
        """Decode the tensors of ``jobs`` (entry, output bytes); ``spans[n]``, when given and not None, limits
        job n to the chunks that overlap that byte range of the tensor, and its output to the range: a chunk the
        range covers in part is decoded aside and only the part in range copied out (the rest of the output is
        not written)."""
        self.reader.drop_unlinked()  # packs a gc elsewhere deleted: their space returns once closed
        cs = m.chunk_size
        work: list[tuple[TensorEntry, bytes, np.ndarray]] = []
        parts: list[tuple[np.ndarray, np.ndarray]] = []  # (in-range part of a chunk decoded aside, its output)
        for n, (t, out) in enumerate(jobs):
            if len(out) != t.nbytes:
                raise ShapeMismatchError(f"{t.key!r}: buffer of {len(out)} bytes for {t.nbytes}")
            chunks = range(t.count)
            span = spans[n] if spans is not None else None
            lo, hi = 0, t.nbytes
            if span is not None:
                lo, hi = max(0, span[0]), min(t.nbytes, span[1])
                chunks = range(lo // cs, -(-hi // cs)) if lo < hi else range(0)
            for i in chunks:
                j = t.first + i
                c0, c1 = i * cs, i * cs + t.chunk_len(i, cs)
                a, b = max(lo, c0), min(hi, c1)
                if m.flags[j] & manifest.FLAG_ZERO:
                    out[a:b] = 0
                    continue
                view = out[c0:c1]
                if (a, b) != (c0, c1):  # the range covers this chunk in part: the rest of the output stays
                    view = np.empty(c1 - c0, dtype=np.uint8)
                    parts.append((view[a - c0 : b - c0], out[a:b]))
                work.append((t, chunk_key(m.digests[j].tobytes(), len(view)), view))
        # A chunk that several places of the state hold (AdamW's step counts: one equal scalar per parameter;
        # equal tensors) is looked up and decoded once, for its first place, and copied to the others once every
        # chunk is decoded: a store of many small tensors decoded its step counts' one chunk hundreds of times.
        # Its failure still names its first place, the one an error named before.
        first_of: dict[bytes, np.ndarray] = {}
        same: list[tuple[np.ndarray, np.ndarray]] = []  # (the view a chunk is decoded into, another holding it)
        unique: list[tuple[TensorEntry, bytes, np.ndarray]] = []
        for item in work:
            held = first_of.get(item[1])
            if held is None:
                first_of[item[1]] = item[2]
                unique.append(item)
            else:
                same.append((held, item[2]))
        work = unique
        locs = self.index.lookup_chunks(first_of)
        for t, k, _ in work:
            if k not in locs:
                raise CorruptChunkError(
                    "chunk is not in the index", chunk_id=_kid(k), checkpoint=m.id, key=t.key
                )
        chains = self._base_locations(locs)
        # where decodes find their frames: a delta base or a prediction input can be one of this checkpoint's own
        # chunks, which chains leaves out (each was looked up alone as the decode reached it)
        frames_at = collections.ChainMap(chains, locs)
        # Predicted chunks reference this checkpoint's first moments and chunks of older checkpoints that the load
        # does not return. They are decoded after everything else, in groups that share one first moment (a
        # parameter and its second moment), each group with its own memo of decoded inputs: every input is
        # decoded once per group, and memory stays at a few chunks per read thread.
        later = [item for item in work if locs[item[1]].codec == codec.PREDICTED]
        first = [item for item in work if locs[item[1]].codec != codec.PREDICTED] if later else work

        def named(item: tuple[TensorEntry, bytes, Any], exc: BaseException) -> BaseException:
            """A failure as raised by the load: naming the checkpoint, and the chunk and tensor it was for."""
            if isinstance(exc, FormatVersionError):  # a newer writer's frame (its chunk or one it decodes from)
                what = str(exc) if str(exc).startswith("chunk ") else f"chunk {_kid(item[1])}: {exc}"
                return FormatVersionError(f"checkpoint {m.id}, tensor {item[0].key!r}, {what}")
            if not isinstance(exc, CorruptChunkError):
                return exc
            if exc.key is None:  # a chunk's own decode: it is the chunk ``k`` of tensor ``t``
                exc = CorruptChunkError(exc.reason, chunk_id=_kid(item[1]), key=item[0].key)
            return CorruptChunkError(exc.reason, chunk_id=exc.chunk_id, checkpoint=m.id, key=exc.key)

        refs = self._read_each(lambda item: self._named_inputs(item[1], locs[item[1]]), later, named)
        if later or any(loc.codec == codec.PREDICTED for loc in chains.values()):
            # the inputs of the predicted chunks, and of predicted frames under delta frames (decoded in the first
            # pass below), before either pass: a decode that reached one looked it up alone
            self._input_locations(refs, locs, chains)
        scratch = Scratch.for_frames(cs, (loc.frame_len for loc in (*locs.values(), *chains.values())))

        def decode(item: tuple[TensorEntry, bytes, np.ndarray]) -> None:
            k = item[1]
            loc = locs[k]
            try:
                if loc.codec in codec.BASED or not self._read_alone(k, loc, item[2], verify, scratch):
                    self._read_chunk(k, loc, out=item[2], verify=verify, bases=frames_at, scratch=scratch)
            except CorruptChunkError:
                self._damaged.add(k)
                raise

        self._read_each(decode, first, named)
        if not later:
            _copy_out(same, parts)
            return
        decoded = {k: view for _, k, view in first}
        groups: dict[bytes, list[tuple[TensorEntry, bytes, np.ndarray]]] = {}
        group_of = {item[1]: r[0] if r else item[1] for item, r in zip(later, refs)}
        for item in later:
            # an input that is itself one of these predicted chunks (an EMA copy's parameter, this checkpoint's):
            # the chunk joins that input's group, which decodes the input first (it is one level shallower) and
            # keeps it in the group's memo, rather than decode it a second time in a group of its own
            ref0 = group_of[item[1]]
            groups.setdefault(group_of.get(ref0, ref0), []).append(item)
        self._read_each(lambda group: self._read_group(group, locs, frames_at, decoded, verify, scratch),
                       list(groups.values()), lambda group, exc: named(group[0], exc))
        _copy_out(same, parts)

    def _read_each(self, fn: Callable[[_T], _R], items: Sequence[_T],
                  named: Callable[[_T, BaseException], BaseException] | None = None) -> builtins.list[_R]:
        """``[fn(item) for item in items]`` on the read workers, which take items in order from one queue.

        One task per worker rather than a future per item: a load has thousands of chunks, and each future
        (with its condition, lock and work item) cost a worker wakeup and about a dozen objects for the cyclic
        GC, half of all a load allocated. It starts one worker per CPU (``threads``): from the page cache,
        decoding is CPU-bound and more workers only contend. A worker whose frame read must wait on the disk
        (:meth:`PackReader.read` finds it is not cached) first starts another, up to ``read_threads``, so cold
        reads overlap decoding. Once an item fails no more are started; when every started item has
        finished, the failure of the earliest failed item (in ``items`` order) is raised, through
        ``named(item, exc)`` when given. Items are handed out in order, so every item before it was started and
        which failure is raised does not depend on timing. Not for use from a read worker (it would wait on
        its own pool)."""
        results: list[Any] = [None] * len(items)
        failed: list[tuple[int, BaseException]] = []
        todo = collections.deque(enumerate(items))  # popleft is atomic
        workers: list[Future[None]] = []
        most = min(self._read_workers, len(items))
        lock = threading.Lock()
        # more() for work() to find, in a list emptied when this returns: the two closures would otherwise refer to
        # each other, a reference cycle keeping fn (and the caller's buffers it holds) and the results alive
        # until the cyclic collector next runs
        hook: list[Callable[[], None]] = []

        def more() -> None:
            """A worker is about to wait on the disk: another takes its place (up to ``read_threads``)."""
            if len(workers) < most and todo:
                with lock:
                    if len(workers) < most:
                        try:
                            workers.append(self._read_pool.submit(work))
                        except RuntimeError:  # the pool is shutting down (interpreter exit): carry on without
                            pass

        def work() -> None:
            _worker.before_blocking = hook[0] if hook else None
            try:
                while not failed:
                    try:
                        i, item = todo.popleft()
                    except IndexError:
                        return
                    try:
                        results[i] = fn(item)
                    except BaseException as exc:  # stop handing out items; raised below
                        failed.append((i, exc))
            finally:
                _worker.before_blocking = None

        hook.append(more)
        try:
            with lock:
                with contextlib.suppress(RuntimeError):  # the interpreter is exiting (a load from an atexit handler)
                    workers.extend(self._read_pool.submit(work) for _ in range(min(self.threads, most)))
            if not workers:  # ... then this thread does the work (outside the lock, which more() takes)
                workers.append(_Done.run(work))  # type: ignore[arg-type]
            done = 0
            while done < len(workers):  # workers can be added until the last one ends
                workers[done].result()
                done += 1
        except BaseException:  # (a KeyboardInterrupt in the wait): no worker may go on writing into the caller's
            failed.append((len(items), _STOPPED))  # tensors once this returns (nor past the gc lock it holds)
            _outwait(workers)
            raise
        finally:
            hook.clear()  # (every worker has ended)
        if failed:
            i, exc = min(failed, key=lambda f: f[0])
            raise (named(items[i], exc) if named is not None else exc)
        return results

    def _read_group(self, group: builtins.list[tuple[TensorEntry, bytes, np.ndarray]], locs: Mapping[bytes, ChunkLoc],
                    chains: Mapping[bytes, ChunkLoc], decoded: Mapping[bytes, np.ndarray], verify: bool,
                    scratch: Scratch) -> None:
        """Decode predicted chunks that share inputs, with one memo of their inputs (``decoded``: chunks this
        load already holds). An error names the chunk and tensor that failed."""
        memo: dict[bytes, np.ndarray] = {}
        try:
            for t, k, view in sorted(group, key=lambda item: locs[item[1]].depth):
                try:
                    self._read_chunk(k, locs[k], out=view, verify=verify, bases=chains, memo=memo, known=decoded,
                                    scratch=scratch)
                except CorruptChunkError as exc:
                    self._damaged.add(k)
                    raise CorruptChunkError(exc.reason, chunk_id=_kid(k), key=t.key) from None
                memo[k] = view
        finally:
            for buf in memo.values():
                scratch.give(buf)

    def _base_locations(self, locs: dict[bytes, ChunkLoc], known: Mapping[bytes, ChunkLoc] | None = None,
                        damaged: dict[bytes, str] | None = None) -> dict[bytes, ChunkLoc]:
        """The index entries of every delta base that decoding ``locs`` needs (all levels) and ``known`` does not
        hold, looked up in one batch per level instead of once per frame by the decoding workers. ``damaged``
        as for :meth:`ChunkReader.lookup`."""
        bases: dict[bytes, ChunkLoc] = {}
        known = known or {}
        level = locs
        for _ in range(codec.MAX_CHAIN_FRAMES):
            want = {
                loc.base + k[16:]
                for k, loc in level.items()
                if loc.codec in codec.BASED and (b := loc.base + k[16:]) not in bases and b not in locs
                and b not in known
            }
            if not want:
                break
            level = self.index.lookup_chunks(want, damaged)
            bases.update(level)
        return bases

    def _input_locations(self, refs: Iterable[builtins.list[bytes]], locs: Mapping[bytes, ChunkLoc],
                         chains: dict[bytes, ChunkLoc]) -> None:
        """Add to ``chains`` the index entries of the chunks that a load's predictions read beyond its own chunks
        (``locs``) and their bases: the chunks the records of its predicted frames name (``refs``), their bases,
        and, where such an input is itself predicted, the chunks its record names, and so on: one batch lookup per
        level. Decoding looked each up when it reached it, in a read transaction of its own (about 85 µs: 62 of
        them in a restore of 9 every-step AdamW checkpoints of an 8-layer MLP, 216 of 400 small layers). Reading
        an input's record costs a read of its first 180 bytes, on the read workers (a cold read waits on the disk
        there, alongside others, as the frame's own read would have). Entries that are missing or damaged are
        left out: the decode that needs them looks them up and reports it as before."""
        read = {k for k, loc in locs.items() if loc.codec == codec.PREDICTED}  # (records read by _named_inputs)
        named = {r for rs in refs for r in rs}
        for _ in range(codec.MAX_CHAIN_FRAMES):
            want = {k for k in named if k not in locs and k not in chains}
            if want:
                skip: dict[bytes, str] = {}
                found = self.index.lookup_chunks(want, skip)
                chains.update(found)
                chains.update(self._base_locations(found, {**locs, **chains}, skip))
            todo = [(k, loc) for k, loc in chains.items() if loc.codec == codec.PREDICTED and k not in read]
            if not todo:
                return
            read.update(k for k, _ in todo)
            named = {r for rs in self._read_each(lambda item: self._named_inputs(*item), todo) for r in rs}

    def _read_alone(self, key: bytes, loc: ChunkLoc, out: np.ndarray, verify: bool, scratch: Scratch) -> bool:
        """:meth:`read_chunk` of a chunk whose index entry names a standalone frame: its frame read and decoded into
        ``out`` (:func:`deltackpt.codec.decode_alone`), raising as :meth:`read_chunk` does (its caller marks the
        chunk damaged). False, with nothing written, when the frame turns out to be a delta or predicted frame
        after all (a damaged index entry): :meth:`read_chunk` then decodes it, and reports what is wrong."""
        buf: bytes | np.ndarray | None = None
        try:
            buf, where = self._read_frame(loc, scratch)
            return codec.decode_alone(memoryview(buf), key[:16], int.from_bytes(key[16:], "big"), where, out, verify)
        finally:
            if buf is not None:
                scratch.give(buf)

    def _read_chunk(
        self, key: bytes, loc: ChunkLoc | None = None, *, out: np.ndarray | None = None, verify: bool = True,
        bases: Mapping[bytes, ChunkLoc] | None = None, memo: dict[bytes, np.ndarray] | None = None,
        known: Mapping[bytes, np.ndarray] | None = None, scratch: Scratch | None = None, _nesting: int = 0,
    ) -> memoryview:
        """Decode one chunk with its delta bases and return its raw bytes, filling ``out`` when given.

        ``loc`` is the chunk's location and ``bases`` those of (some of) its bases when the caller looked them
        up already; the others come from the index. A predicted chunk's inputs (its base and the chunks it
        references) are decoded the same way, taken from ``known`` or ``memo`` (raw bytes by chunk key) when
        there and added to ``memo`` when decoded. Frames are read into buffers of ``scratch`` (given back before
        returning) and inputs decoded into them: a caller that passes both gives back ``memo``'s values when
        done. Without ``scratch`` this call uses a pool of its own."""
        raw_len = int.from_bytes(key[16:], "big")
        own_memo = memo is None
        if memo is None:
            memo = {}  # inputs shared within this chunk's decode (a parameter's and its base's, say)
        if scratch is None:
            scratch = Scratch.for_frames(raw_len, ())
        held: list[bytes | np.ndarray] = []  # frames read into scratch buffers
        read: list[bytes] = []  # digests of the frames fetched (this chunk's, then its bases')

        def fetch(digest: bytes) -> tuple[bytes | memoryview, str]:
            read.append(digest)
            at = loc if digest == key[:16] and loc is not None else None
            if at is None and bases is not None:
                at = bases.get(digest + key[16:])
            if at is None:
                found = self.index.lookup_chunks([digest + key[16:]])
                at = found.get(digest + key[16:])
                if at is None:
                    raise CorruptChunkError("chunk is not in the index", chunk_id=_kid(digest + key[16:]))
            buf, where = self._read_frame(at, scratch)
            held.append(buf)
            return memoryview(buf), where

        def have(digest: bytes) -> np.ndarray | memoryview | None:
            k = digest + key[16:]
            return known[k] if known is not None and k in known else memo.get(k)

        def resolve(digest: bytes) -> np.ndarray | memoryview:
            k = digest + key[16:]
            if known is not None and k in known:
                return known[k]
            if k in memo:
                return memo[k]
            if _nesting >= codec.MAX_CHAIN_FRAMES:
                raise CorruptChunkError(
                    f"prediction inputs nest deeper than {codec.MAX_CHAIN_FRAMES} (a cycle?)", chunk_id=_kid(k)
                )
            # Not re-hashed: this chunk's own digest catches a wrong result, as for delta bases (a wrong input that
            # leaves the prediction unchanged does no harm: format.md section 3); frame checksums still name a
            # damaged input (with verify=False they are all that is checked).
            buf = scratch.take(raw_len)
            try:
                raw = self._read_chunk(k, out=buf, verify=False, bases=bases, memo=memo, known=known, scratch=scratch,
                                      _nesting=_nesting + 1)
            except BaseException:
                scratch.give(buf)
                raise
            memo[k] = buf  # the memo's owner gives it back
            return raw

        try:
            return codec.decode_chain(key[:16], raw_len, fetch, out=out, verify=verify, resolve=resolve, have=have)
        except CorruptChunkError:
            # one of the frames read is damaged (or missing), or an input, which its own read_chunk marked: a
            # save writes every chunk of the chain again rather than deduplicate onto it
            self._damaged.add(key)
            self._damaged.update(d + key[16:] for d in read)
            raise
        finally:
            for buf in held:
                scratch.give(buf)
            if own_memo:
                for buf in memo.values():
                    scratch.give(buf)

    def _references(self, key: bytes, loc: ChunkLoc, scratch: Scratch | None = None) -> builtins.list[bytes]:
        """Keys of the chunks decoding ``key`` needs directly: a delta's base; a predicted frame's base and
        the chunks its record names (read from the frame, into a buffer of ``scratch`` when given). Raises
        :class:`CorruptChunkError` when a predicted frame's record cannot be read intact."""
        if loc.codec == codec.DELTA:
            return [loc.base + key[16:]]
        if loc.codec != codec.PREDICTED:
            return []
        buf, where = self._read_frame(loc, scratch)
        try:
            h, payload = codec.check_frame(memoryview(buf), expect_digest=key[:16],
                                           expect_len=int.from_bytes(key[16:], "big"), where=where)
            return [r + key[16:] for r in (h.base, *codec.prediction_record(payload, where, h.version).refs)]
        finally:
            if scratch is not None:
                scratch.give(buf)

    def _named_inputs(self, key: bytes, loc: ChunkLoc) -> builtins.list[bytes]:
        """The chunks the record of the predicted frame at ``loc`` names, first moment first, read from the
        frame's header and record alone (no checksum): a load groups its predicted chunks by them. A record that
        cannot be read names nothing; decoding the chunk then reports the damage."""
        buf = np.empty(min(loc.frame_len, codec.REFS_PREFIX), dtype=np.uint8)
        try:
            self.reader.read(loc.pack_id, loc.offset, len(buf), into=buf,
                             before_blocking=getattr(_worker, "before_blocking", None))
            h = codec.parse_header(memoryview(buf))
            rec = codec.prediction_record(memoryview(buf)[codec.HEADER_SIZE :], version=h.version)
        except (CorruptChunkError, FormatVersionError):
            return []
        return [r + key[16:] for r in rec.refs]

    def _read_frame(self, loc: ChunkLoc, scratch: Scratch | None) -> tuple[bytes | np.ndarray, str]:
        """The frame at ``loc`` and where it lies: read into a buffer of ``scratch`` when given (the caller gives
        it back), else into new bytes."""
        if scratch is None:
            return self.reader.read(loc.pack_id, loc.offset, loc.frame_len), f"pack {loc.pack_id} offset {loc.offset}"
        buf = scratch.take(loc.frame_len)
        try:
            self.reader.read(loc.pack_id, loc.offset, loc.frame_len, into=buf,
                             before_blocking=getattr(_worker, "before_blocking", None))
        except BaseException:
            scratch.give(buf)
            raise
        return buf, f"pack {loc.pack_id} offset {loc.offset}"

    # -- delete ---------------------------------------------------------------------------------------------
    @_operation
    def delete(self, step: int | None = None, *, id: str | None = None) -> CheckpointInfo:
        """Remove a checkpoint (the newest with ``step``, or the one with ``id``). Space returns with :meth:`gc`."""
        self._writable("delete")
        if step is None and id is None:
            raise ValueError("delete needs a step or an id")
        return self._delete([(step, id)])[0]

    @_operation
    def _delete(self, which: Sequence[tuple[int | None, str | None]], *, missing_ok: bool = False
                ) -> dict[int, CheckpointInfo]:
        """Delete the checkpoints ``which`` names ((step, id) pairs, as :meth:`delete` takes them) in one index
        commit, then unlink their manifests with one directory fsync. Returns the checkpoint deleted for each
        position of ``which`` (one named twice is deleted once). One that is not there raises
        CheckpointNotFoundError before anything is deleted, or with ``missing_ok`` is passed over (another process
        deleted it). A rewrite (retention thinning one, in another process) racing the commit leaves its checkpoint
        to a second commit, which deletes what took its place; one another process deleted by then is passed
        over. Retention deleting 10,000 checkpoints one commit each took 86 s (an fsynced index commit and a
        directory fsync apiece)."""
        self._writable("delete")
        if not which:
            return {}  # (no lock: retention after a save that drops nothing must not wait behind a gc)
        removed: dict[int, Record] = {}  # seq -> record
        where: dict[int, int] = {}  # position in which -> seq
        # Under gc.lock (shared, as saves): a repair, which rebuilds the index from the manifests it finds, never
        # runs between a commit and the manifests' unlinks.
        with self._gc_lock():
            try:
                todo = list(range(len(which)))
                for attempt in range(16):
                    asked: dict[int, Record] = {}  # seq -> record
                    for pos in todo:
                        try:
                            rec = self._record(*which[pos])
                        except CheckpointNotFoundError:
                            if missing_ok or attempt:  # (found at the first read: deleted meanwhile by another)
                                where.pop(pos, None)
                                continue
                            raise
                        where[pos] = rec.seq
                        if rec.seq not in removed:
                            asked.setdefault(rec.seq, rec)
                    stale = {r.seq for r in self.index.remove_checkpoints(list(asked.values()))}  # commit point
                    removed.update((seq, r) for seq, r in asked.items() if seq not in stale)
                    todo = [pos for pos in todo if where.get(pos) in stale]  # (read those again)
                    if not todo:
                        break
                else:
                    step, id = which[todo[0]]
                    raise DeltackptError(f"checkpoint {id if id is not None else f'at step {step}'} in {self.path} "
                                         "kept changing while it was being deleted")
            finally:  # (what a commit removed loses its manifest, whatever came after)
                if any(r.id == self._head for r in removed.values()):
                    self._head = None
                self._unlink_manifests([rec.id for rec in removed.values()])
        return {pos: CheckpointInfo.from_record(removed[seq]) for pos, seq in where.items() if seq in removed}

    @_operation
    def retain(self, retention: Retention, *, dry_run: bool = False) -> builtins.list[CheckpointInfo]:
        """Apply ``retention`` now (what ``deltackpt keep`` does; a :class:`~deltackpt.Checkpointer` does it after
        each save): delete every checkpoint it does not keep and return those, oldest first (with ``dry_run``,
        those it would delete, deleting nothing). A checkpoint another process deletes meanwhile is passed over.
        ``full_last`` is refused here: thinning needs a Checkpointer's layout. Space returns with :meth:`gc`."""
        deleting_only(retention, "Store.retain does not thin checkpoints: a Checkpointer's retention does")
        dry_run = config.boolean("dry_run", dry_run)
        if not dry_run:
            self._writable("apply a retention policy (delete checkpoints)")
        infos = self._listing()
        check_ranked(retention, infos)
        drop = set(retention.plan(infos).delete)
        dropped = [info for info in infos if info.id in drop]
        if dry_run:
            return dropped
        # (one commit for all: a checkpoint another process deleted meanwhile is passed over, one it rewrote
        # followed to its replacement, as delete(id=) does)
        deleted = self._delete([(None, i.id) for i in dropped], missing_ok=True)
        # what was deleted (a rewrite's replacement under its own id), once each, in the listing's order
        return list({info.seq: info for _, info in sorted(deleted.items())}.values())

    def _unlink_manifests(self, checkpoint_ids: Iterable[str]) -> None:
        """Unlink the manifests of checkpoints the index does not hold (deleted, replaced by a rewrite, or a save
        that did not commit), then fsync ``manifests/`` once. Best effort: it runs once the operation's outcome is
        decided, and a manifest an error here leaves (or one a crash brings back) is an orphan gc deletes. Raised,
        an I/O error of the directory fsync made a delete that had committed look failed (tried again, it raised
        CheckpointNotFoundError), and a Checkpointer's save whose retention deleted raise after its commit."""
        unlinked = False
        for checkpoint_id in checkpoint_ids:
            with contextlib.suppress(OSError):
                manifest.path_for(self._manifests_dir, checkpoint_id).unlink()
                unlinked = True
        if unlinked:
            with contextlib.suppress(OSError):
                fsync_dir(self._manifests_dir)

    # -- maintenance ------------------------------------------------------------------------------------------
    @_operation
    def gc(self, *, repack_below: float = 0.5, timeout: float | None = None,
           progress: Progress | None = None) -> GcReport:
        """Reclaim chunks no retained checkpoint reaches; see :func:`deltackpt.maintenance.gc`."""
        from deltackpt import maintenance

        self._writable("gc")
        if self._alone_fd is not None:
            # a handle of open_for_repair before its repair: its index may be the empty one a lost index was
            # replaced with, in which gc would find every pack and manifest garbage
            raise DeltackptError(f"store {self.path} is open for repair: run repair() before gc")
        return maintenance.gc(self, repack_below=repack_below, timeout=timeout, progress=progress)

    @_operation
    def verify(self, step: int | None = None, *, id: str | None = None,
               progress: Progress | None = None) -> VerifyReport:
        """Decode and check every chunk of one or all checkpoints; see :func:`deltackpt.maintenance.verify`."""
        from deltackpt import maintenance

        return maintenance.verify(self, step=step, id=id, progress=progress)

    @_operation
    def repair(self, *, progress: Progress | None = None) -> RepairReport:
        """Rebuild the index from packs and manifests; see :func:`deltackpt.maintenance.repair`."""
        from deltackpt import maintenance

        self._writable("repair")
        try:
            return maintenance.repair(self, progress=progress)
        except BaseException:
            # A failed repair lets go of the store at once, as close() would (the handle of open_for_repair
            # holds it alone until then): other handles' saves and loads would otherwise wait for as long as this
            # one lives. What it left is refused as before (a lost index until a repair commits).
            self._release_alone()
            raise


class _WithUpdate(NamedTuple):
    """What :meth:`Store._encode_update` returns when its predicted frame won: the frame, and (key, frame) of the
    update chunk the frame references, which the pack gets first."""

    frame: bytes
    update: tuple[bytes, bytes]


def _parent_refs(role: predict.Role, i: int, k: bytes, parents: Mapping[str, TensorEntry],
                 pm: Manifest | None, nbytes: int | None = None) -> tuple[bytes, ...]:
    """The keys of the parent's chunks a prediction of chunk ``i`` (key ``k``) of a tensor with ``role`` would
    reference: the parent's first moment and, for a parameter, its second moment, at position ``i``. Fewer (a
    prefix) where the parent has no such chunk of the same length, or an all-zero one, or (given ``nbytes``,
    this save's first moment's size) a tensor of another size: no prediction then."""
    if pm is None or role.average or role.update is not None:
        return ()
    n = int.from_bytes(k[16:], "big")
    out: list[bytes] = []
    for path in (role.m, role.v) if role.predictor == predict.PARAM else (role.m,):
        pt = parents.get(path or "")
        if pt is None or i >= pt.count or (nbytes is not None and pt.nbytes != nbytes):
            break
        j = pt.first + i
        if pm.flags[j] & manifest.FLAG_ZERO or pt.chunk_len(i, pm.chunk_size) != n:
            break
        out.append(pm.digests[j].tobytes() + k[16:])
    return tuple(out)


#: the Store handles of this process, whose locks :func:`_locks_after_fork` makes again in a forked child
_HANDLES: weakref.WeakSet[Store] = weakref.WeakSet()


def _locks_after_fork() -> None:
    """A child forked while a thread of the parent was inside a save (DataLoader workers starting during an
    async save) inherits the handle's save lock held, by a thread the child does not have: the child's close()
    of the handle (a ``with`` block it leaves by ``sys.exit``) or its save through it waited for it forever. So
    too the lock of the damaged-chunk sets, which a thread opening a store holds: every Store() of the child
    waited for it."""
    global _DAMAGED_LOCK
    _DAMAGED_LOCK = threading.Lock()
    for st in list(_HANDLES):
        st._save_lock = threading.Lock()
        st._pool_lock = threading.Lock()
        st._users_lock = threading.Lock()
        st._users_changed = threading.Condition(st._users_lock)


os.register_at_fork(after_in_child=_locks_after_fork)

_DAMAGED: dict[str, set[bytes]] = {}
_DAMAGED_LOCK = threading.Lock()


def _copy_out(same: Sequence[tuple[np.ndarray, np.ndarray]], parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """The end of :meth:`Store._read_into`: each chunk decoded once copied to the other places holding it, then the
    in-range parts of chunks decoded aside copied to their outputs (a place's chunk may be one of those)."""
    for src, dest in same:
        dest[:] = src
    for part, dest in parts:
        dest[:] = part


def _damaged_in(path: Path) -> set[bytes]:
    """The set of chunks found undecodable in the store at ``path``, one per store per process."""
    with _DAMAGED_LOCK:
        return _DAMAGED.setdefault(os.path.realpath(path), set())


def _span_places(refs: Sequence[tuple[tree.Place, str, int]],
                 spans: Mapping[str, tuple[int, int]]) -> dict[tree.Place, tuple[int, int]]:
    """``load_into``'s ``spans``, keyed by key path, moved to the places of ``refs`` (a target's leaves). A
    key path that names no tensor of the target, or two different places, raises ``ValueError``."""
    by_path: dict[str, list[tree.Place]] = {}
    for place, path, _ in refs:
        by_path.setdefault(path, []).append(place)
    out: dict[tree.Place, tuple[int, int]] = {}
    for path, span in spans.items():
        places = by_path.get(path)
        if not places:
            raise ValueError(f"spans names {path!r}, which is not a tensor of the target")
        if len(places) > 1:
            raise ValueError(f"spans names {path!r}, the key path of {len(places)} places of the target")
        try:
            lo, hi = span
            out[places[0]] = (operator.index(lo), operator.index(hi))
        except (TypeError, ValueError):
            raise ValueError(f"spans[{path!r}]: (start, end) must be two ints, not {span!r}") from None
        if min(out[places[0]]) < 0:  # (byte offsets: a slice's "from the end" would be a guess here)
            raise ValueError(f"spans[{path!r}]: (start, end) must be byte offsets of 0 or more, not {span!r}")
    return out


def on_release_thread(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)``, which releases what a handle collected unclosed held, on a short thread of its own: a
    collection of garbage in a reference cycle runs inside whatever allocation triggers it, also one this thread
    makes while it holds a lock that closing takes (the index registry's), and closing there would wait for
    itself forever."""
    threading.Thread(target=fn, args=args, name="deltackpt-release", daemon=True).start()


def _release_dropped(writer: PackWriter, reader: PackReader, index: Index, alone: list[tuple[int, int]]) -> None:
    """Release the files of a :class:`Store` collected unclosed (its pack's lock, open packs, its index, and a
    repair's handle's gc and maintenance locks, ``alone``), as :meth:`Store.close` does
    (:func:`on_release_thread`)."""
    def release() -> None:
        for part in (writer, reader, index):
            with contextlib.suppress(Exception):  # (best effort, as a file's close at collection)
                part.close()
        for fd, pid in alone:  # (the gc lock first: taken last)
            with contextlib.suppress(Exception):
                close_lock(fd, pid)

    on_release_thread(release)


def _some(paths: list[str], shown: int = 5) -> str:
    """A list of key paths for a message: the first ``shown``, and how many more there are."""
    return repr(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def _placements(m: Manifest, into: Any) -> dict[int, torch.Tensor | np.ndarray]:
    """Which offered tensor each stored tensor of ``m`` is decoded into (by index in the tensor table): the
    first tensor (numpy array, for a stored array) of the same dtype and shape at one of its places in ``into``.
    Memory is filled from one stored tensor only: a tensor offered at two places (tied) while the checkpoint
    stores two is offered to the first."""
    out: dict[int, torch.Tensor | np.ndarray] = {}
    taken: set[Any] = set()
    for i, target in tree.pair_leaves(m.tree, into):
        if i in out or not 0 <= i < len(m.tensors):
            continue
        t = m.tensors[i]
        if isinstance(target, torch.Tensor):
            if torch.nn.parameter.is_lazy(target):
                continue  # (a lazy module's, not yet initialized: no shape, no memory; load_state_dict makes it)
            # (what holds no plain memory first: a nested tensor's .shape raises torch's "Internal error")
            if (target.is_nested or target.is_meta or target.layout != torch.strided or target.is_quantized
                    or t.kind != "torch" or target.dtype != tree.torch_dtype(t.dtype)
                    or list(target.shape) != list(t.shape)):
                continue
            key: Any = (str(target.device), target.data_ptr()) if target.numel() else id(target)
        elif isinstance(target, np.ndarray) and not isinstance(target, np.ma.MaskedArray):  # (an np.memmap too)
            if t.kind != "numpy" or target.dtype.str != t.dtype or list(target.shape) != list(t.shape):
                continue
            key = ("cpu", target.__array_interface__["data"][0]) if target.size else id(target)
        else:
            continue
        if staging.unfillable(target) is not None:
            continue
        if key in taken:
            continue
        taken.add(key)
        out[i] = target
    # Targets that overlap without being one tensor (``buf[0:6]`` and ``buf[3:9]``) would each be overwritten in
    # part by the other's values: the later one offered gets memory of its own instead.
    items = list(out.items())
    dropped: set[int] = set()
    for i, j in sorted(staging.overlapping([t for _, t in items]), key=lambda pair: pair[1]):
        if i not in dropped and j not in dropped:  # j overlaps a target that stays: j's tensor goes elsewhere
            dropped.add(j)
            out.pop(items[j][0], None)
    return out


def _moved_in(rows: Iterable[tuple[CheckpointInfo, tuple[str, ...]]]) -> dict[str, str]:
    """Old id -> the id of the checkpoint that replaced it, from :meth:`Store._rows`."""
    return {old: info.id for info, replaces in rows for old in replaces}


#: the numeric parts of a key path, which :func:`_role` replaces: a dot-separated part of digits only (``blocks.3``,
#: a ModuleList's index in a state_dict key) or an int key in brackets (``state[7]``, :func:`tree.child_path`)
_INDEX_PART = re.compile(r"(?<![^.])\d+(?![^.])|(?<=\[)\d+(?=\])")


@functools.lru_cache(maxsize=1 << 16)  # (twice per changed chunk of a save: the regex cost more than the rest)
def _role(path: str) -> str:
    """A tensor's key path with its numeric parts (layer and parameter indices) replaced by ``#``:
    ``model.blocks.3.attn.weight`` -> ``model.blocks.#.attn.weight``, ``optimizer.state[7].exp_avg`` ->
    ``optimizer.state[#].exp_avg``."""
    return _INDEX_PART.sub("#", path)


def _kid(key: bytes) -> str:
    return codec.chunk_hex(key[:16], int.from_bytes(key[16:], "big"))
