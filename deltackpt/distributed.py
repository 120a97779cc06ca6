"""Sharded checkpoints of many ranks through ``torch.distributed.checkpoint`` (DCP), stored incrementally.

Where it sits: beside :class:`deltackpt.Store`, as DCP's storage layer. ``dcp.save(state, storage_writer=
DeltaStorageWriter(root, step=n))`` has every rank save the shards DCP plans for it as one checkpoint of its own
store, ``root/rank-<r>`` (so each rank's shards are deduplicated and delta-coded against its previous save,
and no two processes write one store); then the coordinator saves DCP's metadata (which shard of which tensor
lies in which rank's checkpoint) as a checkpoint of ``root/meta``. That commit is the DCP checkpoint's commit
point: a crash before it leaves the previous step the newest. ``dcp.load(state, storage_reader=
DeltaStorageReader(root))`` reads the metadata of a step (the newest by default) and has DCP plan the reads
for the loading ranks, however many and however sharded (resharding), and each rank reads the slices it needs
from whichever rank stores hold them.

The meta checkpoint's metadata (its index record) only names the step's rank checkpoints (and holds the
metadata the writer was given for the step); DCP's own metadata is a JSON document in its state, chunked and
deduplicated from step to step. With a retention policy, the coordinator deletes the meta checkpoints of the
steps it drops after each commit, and each rank deletes its own checkpoints that no step names any more at its
next save (:func:`prune`'s rule), so no process writes another's store.

Nothing is unpickled on load by default: DCP serialises non-tensor values (``BYTE_IO`` items) with pickle, so
the writer stores those it can as plain values instead (the kinds :mod:`deltackpt.tree` encodes: numbers,
strings, lists, dicts, ...), those holding arrays as state trees (numpy arrays and CPU tensors inside tuples,
lists, dicts: NumPy's RNG state), and keeps the pickle only for the others; loading a pickled one needs
``allow_pickle=True`` on the reader. DCP's metadata is stored as plain values too.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultSavePlanner, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from deltackpt import config, kernel, layout, manifest, tree
from deltackpt.errors import (
    CheckpointNotFoundError,
    CorruptionError,
    CorruptManifestError,
    DeltackptError,
    FormatVersionError,
    UnsafeLoadError,
    UnsupportedTypeError,
    caller_level,
)
from deltackpt.retention import Retention, check_ranked, deleting_only
from deltackpt.store import (
    CheckpointInfo,
    Store,
    as_saved,
    check_metadata,
    check_options,
    check_step,
    on_release_thread,
)

try:
    from torch.distributed.checkpoint.metadata import StorageMeta
except ImportError:  # torch < 2.4: DCP has no StorageMeta (and its Metadata no storage_meta, no version)
    StorageMeta = None  # type: ignore[assignment,misc]

#: the fields of DCP's Metadata here (torch 2.3's: state_dict_metadata, planner_data, storage_data)
_METADATA_FIELDS = {f.name for f in fields(Metadata)}

#: version of the layout of DCP metadata in ``root/meta`` checkpoints. 4: items of kind "tree" (a value holding arrays,
#: stored as a state tree under ``_TREES`` of the rank checkpoint), written only by steps that hold one, so that the
#: others stay readable by format-3 readers. 3: the bulk of DCP's metadata is a chunked
#: document in the meta checkpoint's state (deduplicated from step to step), and its metadata (which every index
#: record copies and every listing reads) only names the rank checkpoints; 2 kept the whole document in the meta
#: checkpoint's metadata; 1 also kept plain values in the rank checkpoints' metadata. Readers accept all four.
META_FORMAT = 4
_TENSORS, _PICKLED, _OBJECTS, _BLOBS, _TREES = "tensors", "pickled", "dcp_objects", "blobs", "dcp_trees"
#: the kinds of stored DCP items (the document's items name one each): anything else is refused as damage
_KINDS = frozenset({"tensor", "blob", "object", "tree", "pickled"})
#: the meta checkpoint's state key of the DCP metadata document (format 3)
_DOC = "dcp_metadata"
#: why DCP retention refuses full_last
_NO_THINNING = "DCP retention cannot thin steps to model weights: a rank's shards do not say which are the model's"
#: ``bytes`` values at least this long are stored as uint8 arrays (chunked, deduplicated, counted as written)
BLOB_MIN = 4096


@dataclass(frozen=True)
class _Slot:
    """A save plan's storage data: the rank whose store the plan's items go to, and the step the coordinator
    commits (each rank checks it saves the same)."""

    rank: int
    step: int | None = None


@dataclass(frozen=True)
class _Chosen:
    """A load plan's storage data: the meta checkpoint whose DCP metadata the rank planned its reads from, and
    what the rank asked for (its reader's step and id)."""

    checkpoint: str | None
    asked: tuple[int | None, str | None] = (None, None)


@dataclass(frozen=True)
class _Stored:
    """Where one DCP item lies: its key in checkpoint ``checkpoint`` of rank ``rank``'s store, how (``kind``:
    tensor, blob for large bytes values, object for plain values, tree for values holding arrays, pickled) and
    its size in bytes."""

    rank: int
    key: str
    checkpoint: str
    kind: str
    nbytes: int


def _rank_path(root: Path, rank: int) -> Path:
    return root / layout.rank_dir(rank)


def stores(root: str | os.PathLike[str]) -> list[Path]:
    """The stores of the DCP root ``root``: its meta store, then each rank's (``rank-NNNNN``, by rank), those
    that exist. Other directories (a copy named ``rank-00000.bak``) are not the root's."""
    root = Path(root)
    check_dir(root)  # (a bare [Errno 2] or [Errno 20] named nothing)
    # (by the name the writer gives each rank: 'rank-000001' is no store of the root's, as its prune knows)
    ranks = sorted((rank, p) for p in root.iterdir() if (rank := layout.rank_of_dir(p.name)) is not None)
    return [p for p in [root / "meta", *(p for _, p in ranks)] if (p / "STORE").exists()]


def check_dir(root: Path) -> None:
    """CheckpointNotFoundError when ``root`` is not a directory, saying whether it exists."""
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root} is not a sharded (DCP) checkpoint root: "
                                      f"{'it is not a directory' if root.exists() else 'it does not exist'}")


def _item_key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(map(str, index.offset))
    return f"{index.fqn}@{offset}"


def _is_root(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sharded checkpoint root (it has the meta store)."""
    return (Path(path) / "meta" / "STORE").exists()


def _existing(path: Path, what: str, *, readonly: bool = False, allow_network_fs: bool | None = None) -> Store:
    """The existing store at ``path`` (``what`` names it in the error when there is none); ``readonly`` for
    readers, which then change nothing and work on a read-only mount."""
    if not (path / "STORE").exists():
        raise CheckpointNotFoundError(f"{what}: no deltackpt store at {path}")
    return Store(path, threads=_threads_per_rank(), readonly=True if readonly else None,
                 allow_network_fs=allow_network_fs)


def _meta_store(root: Path, *, readonly: bool = False, allow_network_fs: bool | None = None) -> Store:
    """The meta store of the DCP root ``root`` (:func:`_existing`); a plain store, or one rank's, given as the
    root is named as such."""
    if not (root / "meta" / "STORE").exists() and (root / "STORE").exists():
        raise CheckpointNotFoundError(f"{root} is a deltackpt store, not a sharded (DCP) checkpoint root (which "
                                      "holds meta/ and rank-NNNNN/ stores)")
    return _existing(root / "meta", "DCP checkpoints", readonly=readonly, allow_network_fs=allow_network_fs)


if TYPE_CHECKING:
    from deltackpt.maintenance import GcAfterRetention


@dataclass
class _Kept:
    """What a :class:`DeltaStorageWriter` keeps from one save to the next (its copies in one process share one)."""

    gc_rule: GcAfterRetention
    stores: dict[Path, Store] = field(default_factory=dict)
    #: a read-only handle on the meta store, for retention on a rank that does not commit (``stores`` has no
    #: writable one): open from save to save, it decodes only the records that are new since its last listing
    reader: Store | None = None
    named: dict[str, set[tuple[int, str]]] = field(default_factory=dict)  #: meta checkpoint id -> what it names
    #: meta checkpoint id -> the metadata its writer was given, as its manifest holds it (retention's)
    user: dict[str, Any] = field(default_factory=dict)
    #: ids of the meta checkpoints retention could not read and said so about (once per writer: it keeps them)
    unreadable: set[str] = field(default_factory=set)
    #: rank -> the optimizer groups' betas and eps (DCP's flat keys) at the rank's last save: what the update that
    #: the next save holds used, where a schedule changes them (OneCycleLR cycles β1; see predict.choose_coefs)
    betas: dict[int, dict[str, Any]] = field(default_factory=dict)


#: by writer: what the copies of a writer unpickled in this process keep (DeltaStorageWriter.__setstate__)
_COPIES: dict[str, _Kept] = {}
_SHARED_LOCK = threading.Lock()  # (for _COPIES and _LOADED)


@dataclass
class _Branch:
    """What the last DCP load of an older step in this process read from a root, for the saves that follow."""

    #: the checkpoints of the step loaded, which the next save of each store descends from: the meta
    #: checkpoint's id under "meta", each rank checkpoint's under its rank. One is taken out once the branch has
    #: begun in its store (DeltaStorageWriter._descend): the meta store's at its commit, a rank's once a
    #: committed step names the checkpoint saved from it
    origin: dict[int | str, str]
    #: rank -> the checkpoint this process saved from ``origin[rank]``, until a committed step names it
    saved: dict[int, str] = field(default_factory=dict)


#: by root (its real path): the branch the last DCP load of an older step in this process began
_LOADED: dict[str, _Branch] = {}


class DeltaStorageWriter(StorageWriter):
    """DCP storage writer into the deltackpt stores under ``root`` (see the module docstring).

    ``step`` is the training step the checkpoint is saved as; set ``writer.step`` before each ``dcp.save`` to
    reuse one writer (its stores stay open, so each rank's last save stays in memory as delta bases). A
    ``checkpoint_id`` given to ``dcp.save`` is taken as the root. ``store_options`` go to every rank's
    :class:`~deltackpt.Store` (``max_chain``, ``threads``, ...).

    ``metadata`` (a mapping of plain values, such as ``{"loss": 2.31, "tag": "epoch-3"}``; set
    ``writer.metadata`` before each ``dcp.save`` as ``writer.step``) is kept with the step: :func:`summary` and
    ``deltackpt dcp ROOT`` show it, and retention's ``keep_best`` and ``keep_tagged`` go by it.

    ``retention`` (a :class:`~deltackpt.Retention` without ``full_last``) is applied to the steps after each
    commit: the coordinator deletes the meta checkpoints of the steps it drops (the steps
    are gone at once), and each rank, at its next save, deletes its own checkpoints that no step names any more
    (as :func:`prune` does). With ``gc`` (default), each store is then collected once what was deleted from it
    since its last gc (the store counts it, across restarts) wrote at least 64 MiB and a quarter of what it
    keeps, as a :class:`~deltackpt.Checkpointer` does. A step that
    ``keep_every`` keeps for good while saves come more often is saved as a keyframe (:meth:`_kept_for_good`).
    Trouble in retention or gc is a warning, not a failed save: the step is committed before either runs.

    The first save into ``root`` after a :class:`DeltaStorageReader` of this process loaded a step from it descends
    from that step's checkpoints (after a rollback, a branch; see :meth:`_descend`), later ones from the save before.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 metadata: Mapping[str, Any] | None = None, retention: Retention | None = None, gc: bool = True,
                 **store_options: Any) -> None:
        super().__init__()
        if retention is not None:
            deleting_only(retention, _NO_THINNING)
        # What can be checked is checked here, where a TypeError or ValueError reaches the caller as it is:
        # inside dcp.save it comes wrapped in torch's CheckpointException, which `except Exception` does not catch.
        kernel.check()  # (a DELTACKPT_BACKEND that cannot run: the ImportError the stores would raise)
        check_options("DeltaStorageWriter", store_options)
        if store_options.get("readonly") is True:  # (every save would fail, wrapped in DCP's CheckpointException)
            raise ValueError("DeltaStorageWriter: readonly=True opens no store to write; a writer saves (leave it out)")
        if step is not None:
            step = check_step(step)
        if metadata is not None:
            try:
                tree.encode_plain(check_metadata(metadata))
            except UnsupportedTypeError as exc:
                raise UnsupportedTypeError(f"DeltaStorageWriter metadata: {exc}") from None
        self.root = None if root is None else Path(root)
        self.step = step
        self.metadata = metadata
        self.retention = retention
        self.gc = config.boolean("gc", gc)
        from deltackpt.maintenance import GcAfterRetention

        self.store_options = store_options
        self._kept = _Kept(GcAfterRetention())
        self._token = secrets.token_hex(8)
        #: of the save in progress: the checkpoints its stores descend from (meta and by rank), when a load in this
        #: process read the root since the last save into it; each store's newest otherwise
        self._branch: dict[int | str, str] = {}
        self._alone_as: int | None = None  # (set_up_storage_writer: this process's rank when it may save alone)
        # A writer made for one save and dropped (DCP's usual pattern) releases the stores it opened once collected:
        # they held their files open (the pack locked, so gc skipped it) until the process ended, about 2.5
        # descriptors a save. (Only the writer made here: the copies that a process-based async save unpickles
        # share what one writer keeps, from save to save, in their process.)
        # (not at exit: the process's end releases them)
        weakref.finalize(self, on_release_thread, _release, self._kept).atexit = False

    def __getstate__(self) -> dict[str, Any]:
        """A pickled writer leaves its open stores (locks, files, threads) behind. DCP's process-based
        ``async_save`` sends such a copy with every save to a background process that lives for the run."""
        state = self.__dict__.copy()
        state["_kept"] = replace(self._kept, stores={}, reader=None)
        # A rollback loaded here: the save that the copy makes there branches from it. A writer without a root yet
        # (dcp.async_save's checkpoint_id sets it there) takes every root's.
        with _SHARED_LOCK:
            keys = list(_LOADED) if self.root is None else [k for k in [_root_key(self.root)] if k in _LOADED]
            loaded = {k: _LOADED.pop(k) for k in keys}
        state["_loaded"] = loaded
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The copies of one writer in one process share what the first kept (:class:`_Kept`): the stores it
        opened (so each rank's previous save stays the delta base in memory, and no save opens a store, and
        starts a pack, that nothing closes), the meta manifests it read and the gc rule's state."""
        loaded = state.pop("_loaded", {})
        self.__dict__.update(state)
        with _SHARED_LOCK:
            self._kept = _COPIES.setdefault(self._token, self._kept)
            _LOADED.update(loaded)

    def _store(self, path: Path) -> Store:
        s = self._kept.stores.get(path)
        if s is None:
            s = self._kept.stores[path] = Store(path, **{"threads": _threads_per_rank(), **self.store_options})
        return s

    def close(self) -> None:
        """Close the stores this writer opened (a copy closes those it shares with the other copies in its
        process). A writer that is collected unclosed closes them then."""
        _release(self._kept)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and (self.root is None or Path(checkpoint_id) != self.root):
            self.close()
            self.root = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("DeltaStorageWriter needs DCP's collectives (use_collectives=True): the coordinator "
                             "commits every rank's shards at once")
        rank = kwargs.get("rank")
        # dcp.save(no_dist=True) on every rank of a job: each process saves alone, as rank 0 (or a process group of
        # its own, which cannot be told apart from it). Warned in prepare_global_plan, where the plans say whether
        # this process saves alone: rank 0 of a subgroup of several ranks (the job's rank 1 of a group [1, 2]) does not
        self._alone_as = None
        if rank == 0 and torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1 and torch.distributed.get_rank() != 0:
            self._alone_as = torch.distributed.get_rank()
        if self.root is None:
            raise ValueError("DeltaStorageWriter needs a root directory (or a checkpoint_id to dcp.save)")
        if self.step is None:
            raise ValueError("DeltaStorageWriter needs the step to save as (DeltaStorageWriter(root, step=n))")
        self.step = check_step(self.step)  # on every rank, before any writes (a TypeError/ValueError naming it)
        user = check_metadata(self.metadata)
        if user is not None:
            try:
                tree.encode_plain(user)
            except UnsupportedTypeError as exc:
                raise UnsupportedTypeError(f"metadata of DCP step {self.step}: {exc}") from None
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"{self.root} is not a directory: give DCP saves a directory of their own")
        if (self.root / "STORE").exists():
            raise ValueError(f"{self.root} is a deltackpt store, not a sharded checkpoint root: give DCP saves a "
                             "directory of their own")
        self._forget_begun_branch()
        with _SHARED_LOCK:
            loaded = _LOADED.get(_root_key(self.root))
            self._branch = dict(loaded.origin) if loaded is not None else {}

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) == 1 and self._alone_as is not None:
            warnings.warn(f"DeltaStorageWriter: this process is rank {self._alone_as} of "
                          f"{torch.distributed.get_world_size()} but saves as rank 0 of its own (no_dist=True, or a "
                          "process group of its own): processes that save this way into one root replace each "
                          "other's shards at each step; save with the job's process group, or give each its own "
                          "root", RuntimeWarning, stacklevel=caller_level())
        return [replace(p, storage_data=_Slot(rank, self.step)) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.root is not None and self.step is not None
        fut: Future[list[WriteResult]] = Future()
        if not plan.items:
            # Nothing planned for this rank (a replicated state saved by the lowest rank only, say): no checkpoint,
            # as one that no DCP checkpoint names would never be deleted with its step
            fut.set_result([])
            return fut
        rank = plan.storage_data.rank if isinstance(plan.storage_data, _Slot) else 0
        step = plan.storage_data.step if isinstance(plan.storage_data, _Slot) else None
        if step is not None and step != self.step:  # (before anything is written)
            raise DeltackptError(f"rank {rank} saves step {self.step}, but the coordinator commits step {step}: "
                                 "set writer.step to the same step on every rank")
        tensors: dict[str, torch.Tensor] = {}
        pickled: dict[str, np.ndarray] = {}
        blobs: dict[str, np.ndarray] = {}
        objects: dict[str, Any] = {}
        trees: dict[str, Any] = {}
        kinds: list[tuple[Any, str, str, int]] = []
        for item in plan.items:
            key = _item_key(item.index)
            if item.type == WriteItemType.BYTE_IO:
                obj, how, n = _stored_as(planner, item.index)
                if how == "object" and type(obj) is bytes and len(obj) >= BLOB_MIN:
                    blobs[key] = np.frombuffer(obj, np.uint8)
                    kinds.append((item.index, key, "blob", len(obj)))
                elif how == "object":
                    objects[key] = obj
                    kinds.append((item.index, key, "object", 0))
                elif how == "tree":
                    trees[key] = obj
                    kinds.append((item.index, key, "tree", n))
                else:
                    data = cast(io.BytesIO, planner.resolve_data(item))  # (a bytes item's data: DCP's contract)
                    raw = np.frombuffer(data.getbuffer(), np.uint8).copy()
                    pickled[key] = raw
                    kinds.append((item.index, key, "pickled", raw.nbytes))
            else:
                t = cast(torch.Tensor, planner.resolve_data(item)).detach()
                tensors[key] = t if t.is_contiguous() else t.contiguous()
                kinds.append((item.index, key, "tensor", t.numel() * t.element_size()))
        store = self._store(_rank_path(self.root, rank))
        # Plain values go into the state's skeleton (the manifest), once; large bytes values are chunked like tensors
        # DCP's flat state (every rank has it whole) names the optimizer's moments, betas and parameters, which
        # predicted frames need and a rank's shards alone do not hold
        flat = getattr(planner, "state_dict", None)
        hints = None
        if isinstance(flat, Mapping):  # (a step that is a DTensor is left out: reading it would be a collective)
            hints = {k: v for k, v in _group_items(flat) if (
                k.endswith((".params", ".param_names", ".betas", ".eps"))
                or (k.endswith(".step")
                    and (isinstance(v, (int, float)) or (type(v) is torch.Tensor and v.numel() == 1))))}
        whole = self._kept_for_good(store.latest(), self.step)
        before = self._kept.betas.get(rank)
        # (values holding arrays under a key of their own, there only when some are: a rank checkpoint without
        # any is as format-3 writers wrote it)
        with self._descend(store, rank):
            info = store._save({_TENSORS: tensors, _PICKLED: pickled, _BLOBS: blobs, _OBJECTS: objects,
                                **({_TREES: trees} if trees else {})},
                               step=self.step, keyframe=whole, _self_contained=whole,
                               _flat=(_TENSORS, hints, before) if hints else None)
        if hints:
            self._kept.betas[rank] = {k: v for k, v in hints.items() if k.endswith((".betas", ".eps"))}
        results = [WriteResult(index=index, size_in_bytes=n, storage_data=_Stored(rank, key, info.id, kind, n))
                   for index, key, kind, n in kinds]
        if self.retention is not None:
            self._drop_unnamed(store, rank)
        fut.set_result(results)
        return fut

    @contextmanager
    def _descend(self, store: Store, which: int | str) -> Iterator[None]:
        """Make the save in the block, of ``store`` (rank ``which``'s, or ``"meta"``), descend from its checkpoint
        that a load in this process read since the last save into the root (after a rollback, the save is a
        branch from the step loaded), else from the store's newest, as a handle's first save does. Not from what
        this handle saved last: a process-based async save's copy, in its background process, and the writer
        saving in its own process hold two handles on each store, and each would skip the other's saves. The
        loaded checkpoint is forgotten once the step has committed (so a save that failed, a full disk say, and
        is tried again still branches): the meta store's at its commit, a rank's at the next save's set-up."""
        store._head = self._branch.get(which)
        yield
        assert self.root is not None
        with _SHARED_LOCK:
            loaded = _LOADED.get(_root_key(self.root))
            if loaded is None or which not in loaded.origin or loaded.origin[which] != self._branch.get(which):
                return
            if isinstance(which, str):  # (meta: the step's commit point, so the branch has begun)
                del loaded.origin[which]
            elif store._head is not None:  # forgotten once a step names it (_forget_begun_branch)
                loaded.saved[which] = store._head

    def _forget_begun_branch(self) -> None:
        """Forget the loaded rank checkpoints whose branch has begun: those from which this process saved a rank
        checkpoint that the newest step now names. One that no step names (its step failed at the
        coordinator's commit, after the rank's save) is kept, so that the save tried again branches again."""
        assert self.root is not None
        with _SHARED_LOCK:
            loaded = _LOADED.get(_root_key(self.root))
            saved = dict(loaded.saved) if loaded is not None else {}
        if not saved:
            return
        try:
            with _meta_store(self.root, readonly=True,
                             allow_network_fs=self.store_options.get("allow_network_fs")) as meta:
                newest = meta.latest()
                named = _named(meta, newest.id) if newest is not None else set()
        except (DeltackptError, OSError):
            return  # (kept: the next save looks again)
        with _SHARED_LOCK:
            loaded = _LOADED.get(_root_key(self.root))
            if loaded is None:
                return
            for rank, ckpt in saved.items():
                loaded.saved.pop(rank, None)
                if (rank, ckpt) in named:
                    loaded.origin.pop(rank, None)

    def _kept_for_good(self, latest: CheckpointInfo | None, step: int) -> bool:
        """Whether retention keeps ``step`` for good while it drops the saves around it: a multiple of
        ``keep_every`` saved less than ``keep_every`` steps after this rank's previous save (``latest``, its
        store's latest checkpoint). Such a step is saved as a self-contained keyframe, as a Checkpointer does (see
        :meth:`deltackpt.Checkpointer._kept_for_good`): as a delta it would keep the dropped steps' frames alive."""
        every = self.retention.keep_every if self.retention is not None else None
        if every is None or step % every:
            return False
        return latest is not None and step - latest.step < every

    def _drop_unnamed(self, store: Store, rank: int) -> None:
        """Retention's part on a rank: delete this rank's checkpoints of the steps it dropped (those no meta
        checkpoint names, committed before one that is named: never a save in progress), then maybe gc."""
        assert self.root is not None
        try:
            if not (self.root / "meta" / "STORE").exists():
                return
            # (the coordinator's handle, open from its last commit on, else a read-only one kept from save to save:
            # a handle opened at each save decoded every meta record again, which grew each save with the steps
            # kept. Between operations a handle holds no lock, and it follows a repair's new index)
            meta = self._kept.stores.get(self.root / "meta", self._kept.reader)
            if meta is None:
                meta = self._kept.reader = _meta_store(
                    self.root, readonly=True, allow_network_fs=self.store_options.get("allow_network_fs"))
            # (each meta checkpoint's manifest read once per writer: a manifest never changes, and reading
            # every kept one at every save made retention's cost grow with the square of the kept steps)
            memo, self._kept.named, kept_steps = self._kept.named, {}, set()
            for i in meta._listing():
                try:
                    self._kept.named[i.id] = memo[i.id] if i.id in memo else _named(meta, i.id)
                except (CorruptManifestError, FormatVersionError) as exc:
                    # (what it names cannot be read: a step names the rank checkpoints saved as that step, and
                    # those stay, as the step does; the rank's other dropped checkpoints go)
                    kept_steps.add(i.step)
                    self._unreadable_step(meta, i, exc)
            named = set().union(set(), *self._kept.named.values())
            store._delete([(None, c.id) for c in _unnamed(store._listing(), _mine(store, rank, named))
                           if c.step not in kept_steps], missing_ok=True)
            self._gc_if_due(store)
        except (DeltackptError, OSError) as exc:
            warnings.warn(f"deltackpt: DCP retention on rank {rank} failed; the checkpoints of dropped steps stay "
                          f"until a later save or 'deltackpt dcp ROOT --prune' ({type(exc).__name__}: {exc})",
                          RuntimeWarning, stacklevel=caller_level())

    def _unreadable_step(self, meta: Store, info: CheckpointInfo, exc: DeltackptError) -> None:
        """Warn (once per writer and meta checkpoint) that retention keeps the step of meta checkpoint ``info``,
        which it cannot read, and thins the others."""
        with _SHARED_LOCK:
            if info.id in self._kept.unreadable:
                return
            self._kept.unreadable.add(info.id)
        warnings.warn(f"deltackpt: DCP retention keeps {_unreadable(info, exc)}; it goes on thinning the other "
                      f"steps, and never deletes this one or its shards ('deltackpt rm {meta.path} {info.id}' "
                      "deletes the step)", RuntimeWarning, stacklevel=caller_level())

    def _gc_if_due(self, store: Store) -> None:
        """gc ``store`` once what retention deleted from it is worth a pass (see the class docstring)."""
        if not self.gc:
            return
        report = self._kept.gc_rule.gc_if_due(store, sum(i.written_bytes for i in store._listing()))
        for damage in report.damage() if report is not None else ():
            warnings.warn(f"deltackpt: gc of {store.path} after DCP retention {damage}", RuntimeWarning,
                          stacklevel=caller_level())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.root is not None and self.step is not None
        stored = [r for rs in results for r in rs]
        # What stays the same from step to step (unless the plan changes) goes into the document, whose chunks
        # then deduplicate; what changes at every step (the rank checkpoints' ids, DCP's save id) into the head
        doc = {
            "version": getattr(metadata, "version", None),
            "state_dict_metadata": {fqn: _compact_md(md) for fqn, md in metadata.state_dict_metadata.items()},
            "planner_data": _compact_planner_data(metadata.planner_data),
            "items": [[r.index.fqn, None if r.index.offset is None else list(r.index.offset), r.index.index,
                       r.storage_data.rank, r.storage_data.key, r.storage_data.kind, r.size_in_bytes] for r in stored],
        }
        sm = getattr(metadata, "storage_meta", None)
        checkpoints = [list(rc) for rc in sorted({(r.storage_data.rank, r.storage_data.checkpoint) for r in stored})]
        head = {
            # (a step without trees stays readable by format-3 readers; they refuse one with trees as newer)
            "format": META_FORMAT if any(r.storage_data.kind == "tree" for r in stored) else 3,
            "checkpoints": checkpoints,
            "storage_meta": None if sm is None else {"checkpoint_id": None if sm.checkpoint_id is None
                                                     else str(sm.checkpoint_id),
                                                     "save_id": sm.save_id, "modules": list(sm.modules)},
            "metadata": check_metadata(self.metadata),
        }
        try:
            text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
            tree.encode_plain(head)
        except UnsupportedTypeError as exc:
            raise UnsupportedTypeError(f"DCP metadata of step {self.step}: {exc}") from None
        _check_saved_here(self.root, self.step, checkpoints)
        meta = self._store(self.root / "meta")
        with self._descend(meta, "meta"):
            meta.save({_DOC: np.frombuffer(text, np.uint8)}, step=self.step, metadata=head)  # the commit point
        if self.retention is not None:
            try:
                # gone now; their shards go at the next save
                dropped = _dropped_steps(meta, self.retention, self._kept.user,
                                         unreadable=lambda i, exc: self._unreadable_step(meta, i, exc))
                meta._delete([(None, info.id) for info in dropped], missing_ok=True)
                self._gc_if_due(meta)
            except (DeltackptError, OSError) as exc:
                warnings.warn(f"deltackpt: DCP retention after step {self.step} failed; the step is saved "
                              f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=caller_level())

    def storage_meta(self) -> StorageMeta | None:
        if StorageMeta is None:  # (torch < 2.4 never asks)
            return None
        return StorageMeta(checkpoint_id=None if self.root is None else str(self.root))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_root(checkpoint_id)


def _release(kept: _Kept) -> None:
    """Close the stores that ``kept`` (a writer's) holds open."""
    for s in [*kept.stores.values(), *filter(None, [kept.reader])]:
        s.close()
    kept.stores.clear()
    kept.reader = None


def _root_key(root: Path) -> str:
    return os.path.realpath(root)


def _check_saved_here(root: Path, step: int, checkpoints: list[list[Any]]) -> None:
    """Refuse to commit ``step`` unless each rank checkpoint it names (``[rank, id]``) is in that rank's store
    under ``root``, its manifest there (written before the rank's index commit, so present once its save
    returned): a rank that saved into another directory (a relative root and another working directory, a
    node-local disk) would leave the newest step unloadable. One stat per rank checkpoint."""
    away = [(rank, ckpt) for rank, ckpt in checkpoints
            if not manifest.path_for(_rank_path(root, rank) / "manifests", ckpt).exists()]
    if away:
        rank, ckpt = away[0]
        more = f" (and {len(away) - 1} other rank(s))" if len(away) > 1 else ""
        raise DeltackptError(
            f"DCP step {step} is not committed: rank {rank}'s shards (checkpoint {ckpt}) are not in "
            f"{_rank_path(root, rank)}{more}; every rank must save into the same root, on a filesystem all ranks "
            "share (a relative root resolves against each process's working directory)")


def _threads_per_rank() -> int:
    """Worker threads for one rank's stores: ``DELTACKPT_THREADS`` when set; else the CPUs this process may use,
    divided among the ranks of this host (``LOCAL_WORLD_SIZE``, set by torchrun) unless the launcher pinned
    each rank to CPUs of its own (fewer CPUs than the host's). An empty ``DELTACKPT_THREADS`` is unset, as for a
    Store."""
    if os.environ.get("DELTACKPT_THREADS", "").strip():
        return config.threads()
    n = config.cpu_count()
    if n == (os.cpu_count() or n):
        try:
            n //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
        except ValueError:
            pass
    return max(1, n)


def _group_items(flat: Mapping[Any, Any]) -> Iterator[tuple[str, Any]]:
    """The items of DCP's flat state, with the string keys, as torch 2.4+ flattens it: a list of parameter groups
    (dicts without tensors), which torch 2.3's flattening keeps as one value (``optim.param_groups``), gives an item
    per entry of each group (``optim.param_groups.0.betas``), where the writer's hints look for them."""
    for k, v in flat.items():
        if not isinstance(k, str):
            continue
        if k.rpartition(".")[2] == "param_groups" and isinstance(v, list) and all(isinstance(g, Mapping) for g in v):
            for i, group in enumerate(v):
                for name, x in group.items():
                    if isinstance(name, str):
                        yield f"{k}.{i}.{name}", x
        else:
            yield k, v


def _stored_as(planner: SavePlanner, index: MetadataIndex) -> tuple[Any, str, int]:
    """The value behind a ``BYTE_IO`` item, how it is stored without pickle and the bytes of its arrays:
    ``"object"`` for plain data (:func:`tree.encode_plain`'s); ``"tree"`` for any other state tree that a load
    rebuilds alone (numpy arrays and CPU tensors, as leaves of its tensor table, in tuples, lists, dicts, sets,
    ...): no registered type, whose decoder the loading process may lack, and no tensor on another device,
    which a load would bring back on the CPU; ``"pickled"`` (and None) for the others. Only for planners that
    serialise the value as :class:`DefaultSavePlanner` does (``torch.save`` of the looked-up object): another
    planner's bytes may be more than the object, so they are kept as they are."""
    if type(planner).transform_object is not DefaultSavePlanner.transform_object:  # type: ignore[attr-defined]
        return None, "pickled", 0
    obj = planner.lookup_object(index)  # type: ignore[attr-defined]
    try:
        tree.encode_plain(obj)
        return obj, "object", 0
    except UnsupportedTypeError:
        pass
    try:
        skeleton, leaves = tree.flatten(obj)
    except UnsupportedTypeError:
        return None, "pickled", 0
    if tree._first_registered(skeleton, "") is not None or any(leaf.device != "cpu" for leaf in leaves):
        return None, "pickled", 0
    return obj, "tree", sum(leaf.nbytes for leaf in leaves)


def _compact_md(md: Any) -> list[Any] | None:
    """DCP storage metadata in a format-3 document: None for bytes, else [dtype name, requires_grad, size,
    [[offsets, sizes], ...]]."""
    if isinstance(md, BytesStorageMetadata):
        return None
    if isinstance(md, TensorStorageMetadata):
        return [str(md.properties.dtype).removeprefix("torch."), bool(md.properties.requires_grad), list(md.size),
                [[list(c.offsets), list(c.sizes)] for c in md.chunks]]
    raise UnsupportedTypeError(f"unknown DCP storage metadata {type(md).__name__}")


def _compact_planner_data(data: Any) -> dict[str, Any]:
    """A planner's data in a format-3 document: ``{"paths": {fqn: [key, ...]}}`` for what DefaultSavePlanner
    keeps (each fqn's path of str and int keys, a tuple), else ``{"plain": skeleton}`` (plain values only)."""
    if isinstance(data, dict) and all(
            type(k) is str and type(v) is tuple and all(type(c) is str or type(c) is int for c in v)
            for k, v in data.items()):
        return {"paths": {k: list(v) for k, v in data.items()}}
    return {"plain": tree.encode_plain(data)}


def _expand_md(fqn: str, d: Any) -> dict[str, Any]:
    """A format-3 document's entry of ``fqn`` in the shape formats 1 and 2 keep (what :func:`_decode_md` reads)."""
    if d is None:
        return {"kind": "bytes"}
    name, requires_grad, size, chunks = d
    dtype = tree.dtype_named(name)
    if dtype is None:
        raise ValueError(f"{fqn!r} has dtype {name!r:.40}")
    return {"kind": "tensor", "dtype": dtype, "requires_grad": requires_grad, "size": size, "chunks": chunks}


def _expand_planner_data(d: Any) -> Any:
    if type(d) is not dict or len(d) != 1:
        raise ValueError(f"planner data {d!r:.60}")
    if "paths" in d:
        paths = d["paths"]
        if type(paths) is not dict or not all(type(v) is list and all(type(c) in (str, int) for c in v)
                                              for v in paths.values()):
            raise ValueError("planner data paths")
        return {k: tuple(v) for k, v in paths.items()}
    return tree.decode_plain(d["plain"])


def _dims(value: Any, what: str) -> list[int]:
    """``value`` as a list of dimensions: non-negative ints (not bools), below 2**63."""
    if type(value) is not list or any(type(v) is not int or not 0 <= v < 1 << 63 for v in value):
        raise ValueError(f"{what} {value!r:.60}")
    return value


def _decode_md(fqn: str, d: Any, where: str) -> Any:
    try:
        if d["kind"] == "bytes":
            return BytesStorageMetadata()
        if d["kind"] == "tensor":
            if not isinstance(d["dtype"], torch.dtype):
                raise TypeError("dtype")
            if type(d["requires_grad"]) is not bool:  # (bool() would take "yes", or "false", as True)
                raise TypeError(f"requires_grad {d['requires_grad']!r:.60}")
            size = _dims(d["size"], "size")
            chunks = []
            for o, n in d["chunks"]:
                offsets, sizes = _dims(o, "chunk offsets"), _dims(n, "chunk sizes")
                # a shard lies inside the tensor: DCP would read a negative or outlying one as nothing, silently,
                # and a reader allocates what the sizes claim
                if len(offsets) != len(size) or len(sizes) != len(size) or any(
                        at + k > dim for at, k, dim in zip(offsets, sizes, size)):
                    raise ValueError(f"a shard at {list(offsets)} of {list(sizes)} outside the size {list(size)}")
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            return TensorStorageMetadata(
                properties=TensorProperties(dtype=d["dtype"], requires_grad=d["requires_grad"]),
                size=torch.Size(size),
                chunks=chunks,
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptManifestError(f"{where}: DCP metadata of {fqn!r} is malformed ({exc})") from None
    raise CorruptManifestError(f"{where}: DCP metadata of {fqn!r} has unknown kind {d.get('kind')!r}")


class DeltaStorageReader(StorageReader):
    """DCP storage reader of the deltackpt stores under ``root``: the DCP checkpoint of ``step`` (the newest
    when None; of a step saved more than once, after a rollback, the newest of them), or the one with ``id``
    (:class:`StepInfo`'s, from :func:`summary`). ``allow_pickle=True`` loads non-tensor values the writer could
    only keep pickled; ``verify`` is :meth:`Store.load`'s; ``allow_network_fs`` is :class:`Store`'s (loading
    ranks on several hosts read the stores from a shared filesystem: safe while no process writes them)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 id: str | None = None, allow_pickle: bool = False, verify: bool = True,
                 allow_network_fs: bool | None = None) -> None:
        super().__init__()
        kernel.check()  # (here rather than wrapped in dcp.load's CheckpointException, as the writer's checks)
        if step is not None and id is not None:
            raise ValueError("DeltaStorageReader takes a step or an id, not both")
        # checked here, as the writer's arguments: inside dcp.load a TypeError or ValueError comes wrapped in
        # torch's CheckpointException (a BaseException) around an AssertionError
        if type(step) is str:  # (a checkpoint id given where the step goes)
            raise TypeError(f"step must be an int, got str {step!r:.40}; pass a checkpoint id as id=")
        if step is not None:
            step = check_step(step)
        if id is not None:
            manifest.check_id(id)
        if allow_network_fs is not None:
            config.boolean("allow_network_fs", allow_network_fs)
        self.root = None if root is None else Path(root)
        self.step = step
        self.id = id
        self.allow_pickle = config.boolean("allow_pickle", allow_pickle)
        self.verify = config.boolean("verify", verify)
        self.allow_network_fs = allow_network_fs
        self._where: dict[MetadataIndex, _Stored] = {}
        self._chosen: str | None = None  # id of the meta checkpoint read_metadata read
        self._chosen_step: int | None = None  # (its step)
        #: the checkpoints of the step read_metadata chose: the meta checkpoint's id under "meta", each rank's
        #: under its rank (see _LOADED)
        self._read: dict[int | str, str] = {}


    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.root = Path(checkpoint_id)

    # (no ``**kwargs``: DCP would take that for per-rank metadata and, when this raises, call it again per rank)
    def read_metadata(self) -> Metadata:
        if self.root is None:
            raise ValueError("DeltaStorageReader needs a root directory (or a checkpoint_id to dcp.load)")
        with _meta_store(self.root, readonly=True,
                       allow_network_fs=self.allow_network_fs) as meta:
            newest = meta.latest()
            info = meta.info(self.step, id=self.id) if self.step is not None or self.id is not None else newest
            if info is None:
                raise CheckpointNotFoundError(f"no DCP checkpoint in {self.root}")
            where = f"DCP checkpoint of step {info.step} in {self.root}"
            with _naming(f"the metadata of DCP step {info.step} ({meta.path})"):
                doc = _full_doc(meta, info.id, where, verify=self.verify)
        self._chosen, self._chosen_step = info.id, info.step
        try:
            sdm = {fqn: _decode_md(fqn, d, where) for fqn, d in doc["state_dict_metadata"].items()}
            storage = {MetadataIndex(fqn, offset, index): _Stored(int(rank), str(key), str(ckpt),
                                                                  _known_kind(fqn, kind, where), int(n))
                       for fqn, offset, index, rank, key, ckpt, kind, n in doc["items"]}
            sm = doc["storage_meta"]
            newer: dict[str, Any] = {}  # (the fields torch >= 2.4 has)
            if "storage_meta" in _METADATA_FIELDS and StorageMeta is not None:
                newer["storage_meta"] = StorageMeta() if sm is None else StorageMeta(
                    checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"], modules=list(sm["modules"]))
            if "version" in _METADATA_FIELDS:
                newer["version"] = doc["version"]
            planner_data = doc["planner_data"]
            # (the newest is what saves descend from anyway: a load of it, by an evaluation while an async save is
            # in flight say, must not make the save after that one descend from the step before it)
            self._read = {} if newest is not None and info.id == newest.id else \
                {"meta": info.id, **{s.rank: s.checkpoint for s in storage.values()}}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptManifestError(f"{where}: malformed DCP metadata ({exc!r})") from None
        return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage, **newer)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._where = dict(metadata.storage_data)
        self._sizes = {MetadataIndex(fqn, c.offsets): c.sizes for fqn, md in metadata.state_dict_metadata.items()
                       if isinstance(md, TensorStorageMetadata) for c in md.chunks}
        self._dtypes = {fqn: md.properties.dtype for fqn, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return replace(plan, storage_data=_Chosen(self._chosen, (self.step, self.id)))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Every rank read the metadata of a step on its own: without a fixed step, one that committed between
        # two ranks' reads would have them load different steps, a state mixed of both
        chosen = {p.storage_data.checkpoint for p in plans if isinstance(p.storage_data, _Chosen)}
        asked = {rank: p.storage_data.asked for rank, p in enumerate(plans) if isinstance(p.storage_data, _Chosen)}
        if len(chosen) > 1 and len(set(asked.values())) > 1:  # (asked alike or not: one checkpoint is a load)
            def what(rank: int) -> str:
                step, id = asked[rank]
                return f"id={id}" if id is not None else f"step={step}" if step is not None else "the newest"

            first = min(asked)
            other = min(r for r in asked if asked[r] != asked[first])
            raise DeltackptError(f"the loading ranks asked for different DCP checkpoints in {self.root}: rank {first} "
                                 f"{what(first)}, rank {other} {what(other)}; give every rank's DeltaStorageReader the "
                                 "same step (or id)")
        if len(chosen) > 1:
            raise DeltackptError(
                f"the loading ranks read the metadata of different DCP checkpoints in {self.root} (a save "
                "committed while they started loading the newest); load again, or pass step= to DeltaStorageReader")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.root is not None
        by_checkpoint: dict[tuple[int, str], list[tuple[ReadItem, _Stored]]] = {}
        for req in plan.items:
            s = self._where.get(req.storage_index)
            if s is None:
                raise CorruptManifestError(f"DCP metadata in {self.root} does not say where {req.storage_index} lies")
            by_checkpoint.setdefault((s.rank, s.checkpoint), []).append((req, s))
        for (rank, ckpt), reqs in sorted(by_checkpoint.items()):
            with _existing(_rank_path(self.root, rank), f"rank {rank}'s shards", readonly=True,
                           allow_network_fs=self.allow_network_fs) as store, \
                    _naming(f"rank {rank}'s shards of DCP step {self._chosen_step} ({store.path})"):
                self._read_checkpoint(store, ckpt, reqs, planner)
        with _SHARED_LOCK:  # (a load of the newest forgets an older one: the next save descends from the newest)
            if self._read:
                _LOADED[_root_key(self.root)] = _Branch(dict(self._read))
            else:
                _LOADED.pop(_root_key(self.root), None)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_checkpoint(self, store: Store, ckpt: str, reqs: list[tuple[ReadItem, _Stored]],
                         planner: LoadPlanner) -> None:
        # every stored shard that a read needs, decoded once into a host buffer: the chunks of it that the reads'
        # slices reach (a rank of a resharded job may need a few rows of a shard), or all of it
        bufs: dict[str, torch.Tensor] = {}
        spans: dict[str, tuple[int, int]] = {}
        pickled: dict[str, np.ndarray] = {}
        blobs: dict[str, np.ndarray] = {}
        for req, s in reqs:
            if s.kind == "tensor":
                if s.key not in bufs:
                    sizes = self._sizes.get(MetadataIndex(req.storage_index.fqn, req.storage_index.offset))
                    if sizes is None:
                        raise CorruptManifestError(f"DCP metadata in {self.root} has no chunk {req.storage_index}")
                    bufs[s.key] = torch.empty(sizes, dtype=self._dtypes[req.storage_index.fqn], device="cpu")
                span = _byte_span(bufs[s.key], req.storage_offsets, req.lengths)
                path = tree.child_path(_TENSORS, s.key)
                if span is not None:
                    old = spans.get(path, span)
                    spans[path] = (min(old[0], span[0]), max(old[1], span[1]))
            elif s.kind == "pickled":
                if not self.allow_pickle:
                    raise UnsafeLoadError(
                        f"DCP item {req.storage_index.fqn!r} was saved pickled (a value deltackpt cannot store as "
                        "plain data); pass allow_pickle=True to DeltaStorageReader to unpickle it")
                pickled[s.key] = np.empty(s.nbytes, np.uint8)
            elif s.kind == "blob":
                blobs[s.key] = np.empty(s.nbytes, np.uint8)
        objects: Mapping[str, Any] = {}
        if any(s.kind == "object" for _, s in reqs):
            objects = _stored_objects(store, ckpt)
        trees = _stored_trees(store, ckpt, sorted({s.key for _, s in reqs if s.kind == "tree"}), verify=self.verify)
        if bufs or pickled or blobs:
            missing = store.load_into({_TENSORS: bufs, _PICKLED: pickled, _BLOBS: blobs}, id=ckpt,
                                      verify=self.verify, strict=False, spans=spans)
            if missing:
                raise CorruptManifestError(f"checkpoint {ckpt} of {store.path} lacks DCP items {missing[:5]}")
        for req, s in reqs:
            if req.type == LoadItemType.BYTE_IO:
                if s.kind in ("object", "tree"):
                    found = objects if s.kind == "object" else trees
                    if s.key not in found:
                        raise CorruptManifestError(f"checkpoint {ckpt} of {store.path} lacks DCP item {s.key!r}")
                    value = io.BytesIO()
                    torch.save(found[s.key], value)  # values this reader decoded: nothing of the store runs
                elif s.kind == "blob":
                    value = io.BytesIO()
                    torch.save(blobs[s.key].tobytes(), value)
                elif s.kind == "pickled":
                    value = io.BytesIO(pickled[s.key].tobytes())
                else:  # (read_metadata refused it already: a reader never guesses what an unknown kind holds)
                    raise CorruptManifestError(f"DCP item {req.storage_index.fqn!r} has unknown kind {s.kind!r}")
                value.seek(0)
                planner.load_bytes(req, value)
                continue
            if s.kind != "tensor":
                raise CorruptManifestError(
                    f"DCP item {req.storage_index.fqn!r} is stored as {s.kind}, read as a tensor")
            src = bufs[s.key]
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise DeltackptError(f"DCP item {req.storage_index.fqn!r}: read {tuple(src.size())} for a target of "
                                     f"{tuple(target.size())}")
            target.copy_(src)
            planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_root(checkpoint_id)


@contextmanager
def _naming(where: str) -> Iterator[None]:
    """Damage met inside (a frame, a manifest of one of the root's stores) names the store and the DCP step it
    was read for: the store's own message names a pack or a checkpoint id, which a root holds in each of its
    stores. Its type and attributes stay; a message naming its DCP checkpoint already is left as it is."""
    try:
        yield
    except CorruptionError as exc:
        if len(exc.args) == 1 and isinstance(exc.args[0], str) and not exc.args[0].startswith((where, "DCP ")):
            exc.args = (f"{where}: {exc.args[0]}",)
        raise


def _stored_objects(store: Store, ckpt: str) -> Mapping[str, Any]:
    """The plain DCP values of rank checkpoint ``ckpt``: from its state's skeleton (read without decoding any
    chunk), or from its metadata where a version-1 writer kept them."""
    m = store.manifest(id=ckpt)
    skeleton = m.skeleton()
    if isinstance(skeleton, dict) and isinstance(skeleton.get(_OBJECTS), dict):
        return skeleton[_OBJECTS]
    meta = _doc(store, m.id)
    return meta.get(_OBJECTS, {}) if isinstance(meta, dict) else {}


def _stored_trees(store: Store, ckpt: str, keys: Sequence[str], *, verify: bool) -> dict[str, Any]:
    """The DCP values ``keys`` (of kind tree) of rank checkpoint ``ckpt``, rebuilt from their nodes of the state's
    skeleton with the arrays those reference, decoded on the CPU (only those: not the rank's shards) and made
    what :meth:`Store.load` makes of them (a parameter, requires_grad)."""
    if not keys:
        return {}
    m = store.manifest(id=ckpt)
    top = dict(tree.node_children(m.tree))
    nodes = dict(tree.node_children(top.get(_TREES)))
    lacking = [k for k in keys if k not in nodes]
    if lacking:
        raise CorruptManifestError(f"checkpoint {ckpt} of {store.path} lacks DCP items {lacking[:5]}")
    indices = sorted({i for k in keys for _, _, i in tree.leaf_refs(nodes[k])})
    if any(not 0 <= i < len(m.tensors) for i in indices):
        raise CorruptManifestError(f"checkpoint {ckpt} of {store.path}: a DCP value names a tensor beyond its "
                                   f"{len(m.tensors)}")
    leaves: list[Any] = [None] * len(m.tensors)
    for i, obj in zip(indices, store._read_tensors(ckpt, indices, verify=verify)):
        leaves[i] = as_saved(m.tensors[i], obj)
    return {k: tree.unflatten(nodes[k], leaves) for k in keys}


def _known_kind(fqn: str, kind: Any, where: str) -> str:
    """``kind``, the stored kind of DCP item ``fqn``, when this reader knows it; a kind it does not know (a newer
    writer's, or damage) is refused naming the item, never read as another."""
    if kind not in _KINDS:
        raise CorruptManifestError(f"{where}: DCP item {fqn!r} has unknown kind {kind!r:.40}")
    return cast(str, kind)


def _byte_span(shard: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """The bytes of the C-ordered ``shard`` from the first to the last element of the slice at ``offsets`` with
    ``lengths`` (None for an empty slice): the slice lies within them."""
    if any(n <= 0 for n in lengths):
        return None
    strides = shard.stride()
    first = sum(o * st for o, st in zip(offsets, strides))
    last = sum((o + n - 1) * st for o, n, st in zip(offsets, lengths, strides))
    return first * shard.element_size(), (last + 1) * shard.element_size()


def steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps of the DCP checkpoints under ``root``, oldest first."""
    with _meta_store(Path(root), readonly=True) as meta:
        return [c.step for c in meta.list()]


@dataclass(frozen=True)
class StepInfo:
    """One DCP checkpoint: its step, when it was committed, how many ranks saved shards, their logical and
    written bytes summed over those ranks' checkpoints, and the metadata the writer was given for it."""

    step: int
    created: float
    ranks: int
    logical_bytes: int
    written_bytes: int
    metadata: Any = None
    id: str = ""  # the meta checkpoint's: DeltaStorageReader(root, id=) loads this one of a step saved twice


def _dropped_steps(meta: Store, retention: Retention, known: dict[str, Any] | None = None, *,
                   unreadable: Callable[[CheckpointInfo, DeltackptError], None] | None = None
                   ) -> list[CheckpointInfo]:
    """The meta checkpoints ``retention`` does not keep (oldest first), each with the metadata its writer was
    given, read from its checksummed manifest (what keep_best and keep_tagged go by: a damaged index copy must
    not decide a delete). ``known`` (a writer's, from one save to the next) holds what earlier calls read, by
    checkpoint id (a manifest never changes): a writer's retention read every kept step's manifest at every
    save, 2.4 s a save with 3,000 steps kept. It is left holding the steps listed now.

    A meta checkpoint that cannot be read (a damaged manifest, a newer format) raises, naming the step: nothing
    is deleted. With ``unreadable`` (a writer's retention) it is reported there instead and kept: it takes part
    in the plan with no metadata (its place, step and time are the index's), so no rule keeps fewer of the others
    than it would with its metadata known, and it is never among the dropped."""
    infos = []
    memo = {} if known is None else known
    seen: dict[str, Any] = {}
    kept: set[str] = set()
    for i in meta._listing():  # (each info replaced below: none of them is changed)
        try:
            user = memo[i.id] if i.id in memo else _user_metadata(_doc(meta, i.id))
            seen[i.id] = user
            infos.append(replace(i, metadata=user))
        except CheckpointNotFoundError:
            continue  # deleted meanwhile (a delete in another process)
        except (CorruptManifestError, FormatVersionError) as exc:  # (its metadata may be what keeps it)
            if unreadable is None:
                raise type(exc)(f"{_unreadable(i, exc)}; retention deletes nothing ('deltackpt rm "
                                f"{meta.path} {i.id}' deletes the step)") from None
            unreadable(i, exc)
            kept.add(i.id)
            infos.append(replace(i, metadata=None))
    if known is not None:
        known.clear()
        known.update(seen)
    if unreadable is None:  # (retain(): a metric no step records is refused, as Store.retain refuses it)
        check_ranked(retention, infos)
    drop = set(retention.plan(infos).delete) - kept
    return [i for i in infos if i.id in drop]


def _user_metadata(head: Any) -> Any:
    """The metadata a writer was given for a step, from its meta checkpoint's metadata (None before format 3)."""
    user = head.get("metadata") if isinstance(head, dict) and head.get("format", 0) >= 3 else None
    return user if isinstance(user, dict) else None


def summary(root: str | os.PathLike[str]) -> list[StepInfo]:
    """Every DCP checkpoint under ``root``, oldest commit first. The sizes count the rank checkpoints the stores
    hold: a rank whose store is gone counts nothing (:func:`verify_names` names the steps that cannot load). A
    step whose meta checkpoint cannot be read (a damaged manifest, a newer format) raises its error
    (:func:`verify_names` names every such step instead)."""
    infos, unreadable, _ = _summary(Path(root))
    if unreadable:
        raise unreadable[0][1]
    return infos


def _summary(root: Path) -> tuple[list[StepInfo], list[tuple[Any, DeltackptError]], list[str]]:
    """:func:`summary` of the steps whose meta checkpoint can be read; each other step's meta checkpoint info with
    its error; and what :func:`verify_names` says of the steps that name a rank checkpoint a store that exists
    does not hold (``deltackpt dcp ROOT`` lists the last two apart)."""
    steps, unreadable = _named_steps(root)
    sizes: dict[tuple[int, str], tuple[int, int]] = {}
    unheld: list[str] = []
    for rank, pairs in sorted(_by_rank(steps).items()):
        if not (_rank_path(root, rank) / "STORE").exists():
            continue  # its store is gone: its shards count nothing (verify_names reports the steps that name them)
        with _existing(_rank_path(root, rank), f"rank {rank}'s shards", readonly=True) as store:
            for ckpt in {c for _, c in pairs}:
                c = _resolved(store, ckpt)
                if c is not None:
                    sizes[rank, ckpt] = (c.logical_bytes, c.written_bytes)
        unheld += [_unheld(i, rank, ckpt, "its store does not hold it")
                   for i, ckpt in pairs if (rank, ckpt) not in sizes]
    return ([StepInfo(i.step, i.created, len({r for r, _ in named}), sum(sizes.get(n, (0, 0))[0] for n in named),
                      sum(sizes.get(n, (0, 0))[1] for n in named), _user_metadata(i.metadata), i.id)
             for i, named in steps],
            unreadable, unheld)


def missing_stores(root: str | os.PathLike[str]) -> list[int]:
    """The ranks that a DCP checkpoint under ``root`` names a checkpoint of but whose store is gone (the steps
    naming them cannot load; :func:`verify_names` says which)."""
    root = Path(root)
    ranks = {r for _, named in _named_steps(root)[0] for r, _ in named}
    return sorted(r for r in ranks if not (_rank_path(root, r) / "STORE").exists())


def verify_names(root: str | os.PathLike[str]) -> list[str]:
    """What is wrong with how the DCP checkpoints under ``root`` name their rank checkpoints: each step that names
    one its rank's store does not hold (removed with ``deltackpt rm`` on the rank store, or the store itself
    gone), and each step whose meta checkpoint cannot be read (a damaged manifest, a newer format, a damaged
    chunk of the DCP metadata document it holds), so the step cannot load. Empty when every step is whole. Each
    store's own damage is ``verify``'s too."""
    root = Path(root)
    steps, unreadable = _named_steps(root)
    problems = [_unreadable(i, exc) for i, exc in unreadable]
    with _meta_store(root, readonly=True) as meta:  # (the document a load reads, from format 3 on, is verified)
        for i, _ in steps:
            try:
                _full_doc(meta, i.id, f"DCP checkpoint {i.id} in {meta.path}")
            except CheckpointNotFoundError:
                continue  # (deleted meanwhile, by another process)
            except DeltackptError as exc:
                problems.append(_unreadable(i, exc))
    for rank, pairs in sorted(_by_rank(steps).items()):
        path = _rank_path(root, rank)
        held = None
        if (path / "STORE").exists():
            with _existing(path, f"rank {rank}'s shards", readonly=True) as store:
                held = {ckpt for ckpt in {c for _, c in pairs} if _resolved(store, ckpt)}
        for i, ckpt in pairs:
            if held is None or ckpt not in held:
                problems.append(_unheld(i, rank, ckpt, "its store is gone" if held is None else
                                        "its store does not hold it"))
    return problems


def _unheld(info: Any, rank: int, ckpt: str, where: str) -> str:
    """What is wrong with the step of meta checkpoint ``info``, which names ``rank``'s checkpoint ``ckpt``."""
    return (f"step {info.step} (DCP checkpoint {info.id}) names rank {rank}'s checkpoint {ckpt}, but {where}: the "
            "step cannot load")


def _by_rank(steps: list[tuple[Any, set[tuple[int, str]]]]) -> dict[int, list[tuple[Any, str]]]:
    """rank -> (meta checkpoint info, rank checkpoint id) of each rank checkpoint that ``steps`` (what
    :func:`_named_steps` lists) name, in the steps' order. One pass over the pairs: going over every step's for
    each rank grew with the square of the ranks (R x steps x R pairs)."""
    by_rank: dict[int, list[tuple[Any, str]]] = {}
    for i, named in steps:
        for r, ckpt in sorted(named):
            by_rank.setdefault(r, []).append((i, ckpt))
    return by_rank


def _unreadable(info: Any, exc: DeltackptError) -> str:
    """What is wrong with the step of meta checkpoint ``info``, which raised ``exc`` when read."""
    return f"step {info.step} (DCP checkpoint {info.id}): its DCP metadata cannot be read ({exc}): the step cannot load"


def _named_steps(root: Path) -> tuple[list[tuple[Any, set[tuple[int, str]]]], list[tuple[Any, DeltackptError]]]:
    """Every DCP checkpoint under ``root`` (oldest commit first) with the rank checkpoints it names; and apart,
    each one whose meta checkpoint cannot be read (a damaged or missing manifest, a newer format) with the error
    that reading it raised: one such step leaves the others listed. One deleted meanwhile (by another process)
    is left out."""
    steps: list[tuple[Any, set[tuple[int, str]]]] = []
    unreadable: list[tuple[Any, DeltackptError]] = []
    with _meta_store(root, readonly=True) as meta:
        for i in meta.list():
            try:
                steps.append((i, _named(meta, i.id)))
            except CheckpointNotFoundError:
                continue
            except (CorruptManifestError, FormatVersionError) as exc:
                unreadable.append((i, exc))
    return steps, unreadable


def _resolved(store: Store, ckpt: str) -> Any:
    """The info of rank checkpoint ``ckpt`` (of the checkpoint that replaced it, after a rewrite), or None when
    the store does not hold it."""
    try:
        return store.info(id=ckpt)
    except CheckpointNotFoundError:
        return None


def delete(root: str | os.PathLike[str], step: int) -> None:
    """Delete the DCP checkpoint of ``step`` (every one, if the step was saved more than once): its meta
    checkpoint first (so the step is gone at once, even if this is interrupted), then the rank checkpoints it
    names. Space returns with ``gc`` of each store; :func:`prune` removes what an interrupted delete left, and
    the rank checkpoints of a step whose meta checkpoint could not be read (a damaged manifest), which this
    deletes without knowing them."""
    step = check_step(step)  # (before meta.info, whose hint for a str names an id= this function lacks)
    root = Path(root)
    with _meta_store(root) as meta:
        meta.info(step)  # CheckpointNotFoundError naming the step when there is none
        ids = [c.id for c in meta.list() if c.step == step]
    _delete_ids(root, ids)


def retain(root: str | os.PathLike[str], retention: Retention, *, dry_run: bool = False) -> list[CheckpointInfo]:
    """Apply ``retention`` to the DCP checkpoints under ``root`` now (what ``deltackpt keep ROOT`` does): delete
    each step it drops as :func:`delete` does, meta checkpoint first, and return the meta checkpoints of the
    steps deleted, with the steps' metadata (with ``dry_run``, of the steps it would delete, deleting nothing).
    ``keep_best`` and ``keep_tagged`` go by the steps' metadata; ``full_last`` is refused (nothing here can thin
    a step). Space returns with ``gc`` of each store."""
    deleting_only(retention, _NO_THINNING)
    dry_run = config.boolean("dry_run", dry_run)  # (dry_run=None must not delete)
    root = Path(root)
    with _meta_store(root, readonly=True) as meta:
        dropped = _dropped_steps(meta, retention)
    if not dry_run:
        _delete_ids(root, [i.id for i in dropped])
    return dropped


def _delete_ids(root: Path, ids: Sequence[str]) -> None:
    """Delete the meta checkpoints ``ids`` (so their steps are gone at once), then the rank checkpoints they name.
    The rank stores they name are opened and listed first: one that cannot be (a lost index) is refused before a
    step is deleted, rather than after its meta checkpoint is gone."""
    named: set[tuple[int, str]] = set()
    with _meta_store(root) as meta:
        names: dict[str, set[tuple[int, str]]] = {}
        for cid in ids:
            try:
                names[cid] = _named(meta, cid)
            except CheckpointNotFoundError:
                continue  # deleted meanwhile (another process's retention): its rank checkpoints are its to delete
            except (CorruptManifestError, FormatVersionError):
                names[cid] = set()  # unreadable: deleted all the same; the rank checkpoints it names are prune's
        _check_rank_stores(root, set().union(set(), *names.values()))
        order = list(names)
        for pos in meta._delete([(None, cid) for cid in order], missing_ok=True):  # (passed over: as above)
            named |= names[order[pos]]
    _delete_rank_checkpoints(root, named)


def _check_rank_stores(root: Path, which: set[tuple[int, str]]) -> None:
    """Raise where a rank store that ``which`` names is there but cannot be opened and listed."""
    for rank in sorted({r for r, _ in which}):
        if (_rank_path(root, rank) / "STORE").exists():
            with _existing(_rank_path(root, rank), f"rank {rank}'s shards", readonly=True) as store:
                store.list()


def prune(root: str | os.PathLike[str]) -> int:
    """Delete the rank checkpoints that no DCP checkpoint names and that their rank store committed before one
    that a DCP checkpoint does name: what a save that crashed before its commit, or an interrupted
    :func:`delete`, left behind. A rank's newest unnamed checkpoints may be a save in progress and are kept
    (commit order within each store decides, not clocks, which may differ between hosts). In a rank store none
    of whose checkpoints a step names (a rank that a restart with fewer ranks no longer uses, once its steps
    are dropped), every checkpoint but the newest is deleted: the names are read again after the store is
    listed, so that one a step committed meanwhile counts as named. Returns how many were deleted; space
    returns with ``gc``."""
    root = Path(root)
    named = _grouped(_all_named(root))  # (by rank: _mine of each rank went over every rank's names)
    stale: set[tuple[int, str]] = set()
    for path in stores(root)[1:]:
        rank = int(path.name.removeprefix("rank-"))
        with _existing(path, f"rank {rank}'s shards") as store:
            infos = store.list()
            mine = _mine(store, rank, named.get(rank, set()))
            orphans = not any(c.id in mine for c in infos)
            if orphans:  # read the names again, after the listing
                mine = _mine(store, rank, _all_named(root))
            stale |= {(rank, c.id) for c in _unnamed(infos, mine, orphans=orphans)}
    _delete_rank_checkpoints(root, stale)
    return len(stale)


def _all_named(root: Path) -> set[tuple[int, str]]:
    """Every (rank, rank checkpoint id) that a DCP checkpoint under ``root`` names."""
    with _meta_store(root) as meta:
        return set().union(set(), *(_names_of(meta, i, "prune") for i in meta.list()))


def _names_of(meta: Store, info: CheckpointInfo, who: str) -> set[tuple[int, str]]:
    """:func:`_named` of meta checkpoint ``info`` for ``who`` (prune, retention), which deletes nothing when it
    cannot be read: the error then names the step and how to delete it."""
    try:
        return _named(meta, info.id)
    except (CorruptManifestError, FormatVersionError) as exc:
        raise type(exc)(f"{_unreadable(info, exc)}; {who} cannot tell which rank checkpoints the step names, so "
                        f"it deletes nothing ('deltackpt rm {meta.path} {info.id}' deletes the step)") from None


def _mine(store: Store, rank: int, named: set[tuple[int, str]]) -> set[str]:
    """The ids of rank ``rank``'s checkpoints that ``named`` names, with those of the checkpoints that replaced
    them (a rank checkpoint that a rewrite replaced is named by its old id: the new one is named too)."""
    mine = {k for r, k in named if r == rank}
    store._refresh()
    moved = store._moved()  # (one pass over the records: store.info of each named id scanned them all)
    return mine | {moved[k] for k in mine if k in moved}


def _unnamed(infos: list[Any], mine: set[str], *, orphans: bool = False) -> list[Any]:
    """The checkpoints of a rank store (``infos``: its listing, in commit order) that are not among the ones a
    DCP checkpoint names (``mine``, from :func:`_mine`) and that the store committed before one that is (its
    newest unnamed ones may be a save in progress). With ``orphans``, in a store none of whose checkpoints is
    named (a rank that a restart with fewer ranks left behind), every one but the newest, which may be a save in
    progress (one save runs at a time; ``mine`` MUST then have been read after ``infos``, see :func:`prune`)."""
    last_named = max((i for i, c in enumerate(infos) if c.id in mine), default=-1)
    if last_named < 0 and orphans:
        return infos[:-1]
    return [c for c in infos[:max(last_named, 0)] if c.id not in mine]


def _doc(store: Store, ckpt: str) -> Any:
    """The metadata of checkpoint ``ckpt`` as its checksummed manifest holds it: what loads, prune and delete go
    by. (The index record holds a copy, which LMDB keeps no checksum of: a damaged copy made a load report a
    wrong shape, and could make prune delete shards a step needs.)"""
    node = store.manifest(id=ckpt).metadata
    return tree.decode_plain(node) if node is not None else None


def _head(meta: Store, ckpt: str, where: str) -> dict[str, Any]:
    """The metadata of meta checkpoint ``ckpt`` (``where`` names it in errors), checked to be DCP metadata of a
    format this reader knows: in format 3 its head, in formats 1 and 2 the whole document."""
    head = _doc(meta, ckpt)
    if not isinstance(head, dict) or type(head.get("format")) is not int:
        raise CorruptManifestError(f"{where}: not DCP metadata")
    if head["format"] > META_FORMAT:  # (format 1 differs from 2 only in where rank checkpoints keep plain values)
        raise FormatVersionError(f"{where}: DCP metadata format {head['format']} is newer than this reader's")
    return head


def _full_doc(meta: Store, ckpt: str, where: str, *, verify: bool = True) -> dict[str, Any]:
    """The whole DCP metadata document of meta checkpoint ``ckpt`` in format 2's shape (items naming their rank
    checkpoint): its metadata, with, from format 3 on, the document its state holds."""
    head = _head(meta, ckpt, where)
    if head["format"] < 3:
        return head
    ranks = _checkpoints(head, where)
    state = meta.load(id=ckpt, verify=verify)
    text = state.get(_DOC) if isinstance(state, dict) else None
    if not isinstance(text, np.ndarray) or text.dtype != np.uint8 or text.ndim != 1:
        raise CorruptManifestError(f"{where}: the checkpoint holds no DCP metadata document")
    try:
        doc = json.loads(text.tobytes())
        # the first format-3 writers (2026-12-04, before the document became compact JSON) wrote the document as
        # a plain-value skeleton (§5, a list at the top), its state_dict_metadata and planner_data in the shape
        # formats 1 and 2 keep
        skeleton = type(doc) is list
        if skeleton:
            doc = tree.decode_plain(doc)
        if type(doc) is not dict or not (doc["version"] is None or type(doc["version"]) is str):
            raise ValueError("not a document")
        items = [[fqn, offset, index, rank, key, ranks[rank], kind, n]
                 for fqn, offset, index, rank, key, kind, n in doc["items"]]
        if skeleton:
            sdm, planner_data = dict(doc["state_dict_metadata"]), doc["planner_data"]
        else:
            sdm = {fqn: _expand_md(fqn, d) for fqn, d in doc["state_dict_metadata"].items()}
            planner_data = _expand_planner_data(doc["planner_data"])
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, CorruptManifestError) as exc:
        raise CorruptManifestError(f"{where}: malformed DCP metadata document ({exc!r:.200})") from None
    for it in items:
        _known_kind(it[0], it[6], where)
    return {"version": doc["version"], "state_dict_metadata": sdm, "planner_data": planner_data,
            "storage_meta": head.get("storage_meta"), "items": items}


def _rank_checkpoint(rank: Any, ckpt: Any) -> bool:
    """Whether a rank and a rank checkpoint id that meta metadata names are of their types and ranges: a rank of
    63 bits at most (the name of its store, ``rank-<rank>``, stays a file name), a checkpoint id of 16 hex
    digits (``../x`` would have been looked up, and the listing given up, as a caller's invalid argument)."""
    return type(rank) is int and 0 <= rank < 1 << 63 and type(ckpt) is str and manifest.is_id(ckpt)


def _checkpoints(head: dict[str, Any], where: str) -> dict[int, str]:
    """rank -> the id of its checkpoint, as a format-3 head names them."""
    try:
        pairs = [(r, c) for r, c in head["checkpoints"]]
        if not all(_rank_checkpoint(r, c) for r, c in pairs):
            raise ValueError(f"checkpoints {head['checkpoints']!r:.80}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptManifestError(f"{where}: malformed DCP metadata ({exc!r})") from None
    return dict(pairs)


def _named(meta: Store, ckpt: str) -> set[tuple[int, str]]:
    """(rank, checkpoint id) of every rank checkpoint that meta checkpoint ``ckpt`` names (from its metadata alone:
    in format 3 the document need not be read)."""
    where = f"DCP checkpoint {ckpt} in {meta.path}"
    head = _head(meta, ckpt, where)
    if head["format"] >= 3:
        return set(_checkpoints(head, where).items())
    try:
        named = {(int(it[3]), str(it[5])) for it in head.get("items", [])}
        if not all(_rank_checkpoint(r, c) for r, c in named):
            raise ValueError(f"items name {sorted(p for p in named if not _rank_checkpoint(*p))[0]!r:.80}")
        return named
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:  # (an item that is a dict: KeyError)
        raise CorruptManifestError(f"{where}: malformed DCP metadata ({exc!r})") from None


def _grouped(pairs: set[tuple[int, str]]) -> dict[int, set[tuple[int, str]]]:
    """``pairs`` (rank, rank checkpoint id) by rank: for the loops over the ranks, which went over every rank's
    pairs for each rank (the square of the ranks)."""
    by_rank: dict[int, set[tuple[int, str]]] = {}
    for pair in pairs:
        by_rank.setdefault(pair[0], set()).add(pair)
    return by_rank


def _delete_rank_checkpoints(root: Path, which: set[tuple[int, str]]) -> None:
    for rank, pairs in sorted(_grouped(which).items()):
        if not (_rank_path(root, rank) / "STORE").exists():
            continue  # the rank's store is gone (removed by hand): so are its checkpoints
        with _existing(_rank_path(root, rank), f"rank {rank}'s shards") as store:
            # (one deleted already, by an interrupted delete, is passed over)
            store._delete([(None, ckpt) for _, ckpt in sorted(pairs)], missing_ok=True)


__all__ = ["DeltaStorageReader", "DeltaStorageWriter", "StepInfo", "delete", "missing_stores", "prune", "retain",
           "steps", "stores", "summary", "verify_names"]
