"""RNG states of data-parallel ranks other than 0, kept beside the store those ranks restore from.

Where it sits: beside the pipeline, not in it. In a data-parallel job every rank restores one store and rank 0
alone saves into it (:class:`~deltackpt.Checkpointer` ``rank=0``), so a checkpoint holds rank 0's random
state only. A Checkpointer made with ``rank=r > 0`` saves no checkpoint: at every :meth:`~deltackpt.Checkpointer.step`
it writes its process's RNG states to ``STORE/rng/rank-RRRRR/STEP-RUN.rng`` (:func:`write`), and its restore
reads the file of the restored checkpoint's step and run (:func:`read`). No collective is involved, so ranks that
see a stop signal at different steps cannot deadlock over it.

A *run* is named by the checkpoint the ranks restored from and the newest commit in the store then
(:func:`run_name`), or, for a rollback mid-run, by the run left and the checkpoint restored (:func:`next_run`);
every rank computes it alike, and rank 0 records it in each checkpoint's ``rng`` entry. Two runs that went on
from the same checkpoint (rolling back to it twice) keep their files apart.

File format (``docs/format.md`` §8c): a UTF-8 JSON object followed by the XXH3-128 digest of those bytes (16 bytes,
big-endian, as a manifest's). No pickle: the states are bytes in base64 and plain numbers.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from deltackpt import _lazy, layout
from deltackpt.errors import DeltackptError
from deltackpt.packs import fsync_dir, fsync_file, make_dirs, read_file
from deltackpt.rng import try_rng_state

if TYPE_CHECKING:
    import torch

    from deltackpt.store import Store
else:
    torch = _lazy.module("torch", globals())

FORMAT = "deltackpt-rank-rng"
VERSION = 1
#: the largest file :func:`read` takes: a state with hundreds of CUDA devices is far below it
MAX_FILE = 1 << 22
#: ``rng`` entry of a checkpoint that names the run which saved it (:func:`run_name`)
RUN_KEY = "run"
_NAME = re.compile(r"(\d{1,19})-([0-9a-z]{1,16})-(\d{1,19})\.rng")


class RankStateError(ValueError):
    """A rank's RNG state file that is missing, damaged or not the one asked for (what a restore warns of)."""


def directory(store_path: Path, rank: int) -> Path:
    return store_path / "rng" / layout.rank_dir(rank)  # (named as a sharded root's rank stores: rank-00001)


def ranks_kept(store_path: Path) -> list[int]:
    """The ranks that keep RNG states beside the store (their directories under ``rng/``), in order."""
    try:
        names = [e.name for e in os.scandir(store_path / "rng") if e.is_dir(follow_symlinks=False)]
    except OSError:  # (none, or none this process may list: no rank's states it could read either)
        return []
    return sorted(r for n in names if (r := layout.rank_of_dir(n)) is not None)


def usage(store_path: Path) -> tuple[int, int]:
    """(files, bytes) of the RNG states ranks keep beside the store (what ``deltackpt du`` reports)."""
    files = size = 0
    for rank in ranks_kept(store_path):
        with contextlib.suppress(OSError):  # (a directory removed meanwhile)
            for e in os.scandir(directory(store_path, rank)):
                if _NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                    files += 1
                    size += e.stat(follow_symlinks=False).st_size
    return files, size


def run_name(restored: str | None, store: Store) -> str:
    """The name of a run: the id of the checkpoint it restored from (``new`` when none) and the commit number of
    the newest checkpoint in ``store`` when it did, as ``ID-SEQ``. (0 for an empty store, and for one whose index
    cannot be listed: every rank reads the same index, and names the run alike.)"""
    return f"{restored or 'new'}-{newest_seq(store)}"


def newest_seq(store: Store) -> int:
    """The commit number of the newest checkpoint in ``store`` (0 for an empty store, and for one whose index
    cannot be listed)."""
    try:
        return max((i.seq for i in store._listing()), default=0)
    except DeltackptError:
        return 0


def next_run(previous: str, restored: str) -> str:
    """The name of the run that a rollback mid-run starts: from run ``previous``, restoring checkpoint ``restored``.
    Not the newest commit, as :func:`run_name`: rank 0's save of the step the ranks roll back at may commit before
    another rank's restore reads the store or after it. A digest of the run rolled back from and the checkpoint
    restored, as ``ID-N`` (N: 19 decimal digits at most), which every rank computes alike from the run they were
    in; two rollbacks to one checkpoint start runs of other names, as each comes from another run."""
    n = xxhash.xxh3_64_intdigest(f"{previous}\0{restored}".encode()) % 10**19
    return f"{restored}-{n}"


def file_name(step: int, run: str) -> str:
    return f"{step}-{run}.rng"


def encode(state: dict[str, Any], *, rank: int, step: int, run: str) -> bytes:
    """The file of :func:`deltackpt.rng.rng_state`'s ``state`` for ``rank`` at ``step`` of ``run``."""
    version, words, gauss = state["python"]
    kind, key, pos, has_gauss, cached = state["numpy"]

    def b64(a: Any) -> str:
        return base64.b64encode(bytes(a)).decode("ascii")

    body = {
        "format": FORMAT, "version": VERSION, "rank": rank, "step": step, "run": run,
        "python": {"version": int(version), "words": b64(np.asarray(words, dtype="<u4").tobytes()),
                   "gauss": gauss},
        "numpy": {"kind": str(kind), "key": b64(np.asarray(key, dtype="<u4").tobytes()), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": b64(state["torch"].cpu().numpy().tobytes()),
        "cuda": [b64(s.cpu().numpy().tobytes()) for s in state.get("cuda", ())],
    }
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    return data + xxhash.xxh3_128_digest(data)


def decode(data: bytes, *, rank: int, step: int, run: str, tensors: bool = True) -> dict[str, Any]:
    """The RNG state of a file :func:`encode` wrote, in the form :func:`deltackpt.rng.set_rng_state` takes
    (without ``tensors``, torch's states as bytes: torch is not imported). Raises :class:`RankStateError` when the
    bytes are damaged or are another rank's, step's or run's."""
    if len(data) < 17 or xxhash.xxh3_128_digest(memoryview(data)[:-16]) != data[-16:]:
        raise RankStateError("its checksum does not match (a damaged or cut-short file)")
    try:
        body = json.loads(data[:-16])
        if type(body) is not dict or body.get("format") != FORMAT:
            raise RankStateError("it is not a rank RNG state file")
        if type(body["version"]) is not int or body["version"] > VERSION:
            raise RankStateError(f"it has format version {body['version']!r:.20}; this deltackpt reads {VERSION}")
        if (body["rank"], body["step"], body["run"]) != (rank, step, run):
            raise RankStateError(f"it holds rank {body['rank']!r:.20}'s state at step {body['step']!r:.30} of run "
                                 f"{body['run']!r:.60}")
        py, npy = body["python"], body["numpy"]
        gauss = py["gauss"]
        if not (gauss is None or type(gauss) is float) or type(npy["cached_gaussian"]) is not float:
            raise RankStateError("a cached Gaussian is not a float")
        words = np.frombuffer(base64.b64decode(py["words"], validate=True), dtype="<u4").astype(np.uint32)
        key = np.frombuffer(base64.b64decode(npy["key"], validate=True), dtype="<u4").astype(np.uint32)
        state: dict[str, Any] = {
            "python": (py["version"], words, gauss),
            "numpy": (npy["kind"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]),
            "torch": _torch_state(body["torch"], tensors),
        }
        if body["cuda"]:
            state["cuda"] = [_torch_state(s, tensors) for s in body["cuda"]]
        _try_states(state, tensors)
    except RankStateError:
        raise
    except (ValueError, KeyError, TypeError) as exc:  # (JSON, base64, a missing or mistyped field)
        raise RankStateError(f"it is not a well-formed rank RNG state file ({type(exc).__name__}: {exc})") from None
    return state


def _try_states(state: dict[str, Any], tensors: bool) -> None:
    """Raise :class:`RankStateError` when a generator refuses its state in ``state``: tried on generators of their
    own (Python's, NumPy's; torch's CPU one with ``tensors``), so a restore puts back none of a file's states, with
    a warning, rather than failing (a well-formed file another writer made, or a crafted one)."""
    try:
        try_rng_state(state, with_torch=tensors)
    except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
        raise RankStateError(f"the generators refuse its states ({type(exc).__name__}: {exc})") from None


def _torch_state(text: str, tensor: bool) -> torch.Tensor | bytes:
    raw = base64.b64decode(text, validate=True)
    if not raw:
        raise RankStateError("it holds an empty torch generator state")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if tensor else raw


def write(store_path: Path, rank: int, step: int, run: str, state: dict[str, Any], *, durable: bool) -> Path:
    """Write ``rank``'s RNG ``state`` at ``step`` of ``run`` atomically (a temporary file renamed into place, so a
    reader sees the old file or the new one whole); ``durable``: fsynced, file and directory, before it returns."""
    d = directory(store_path, rank)
    path = d / file_name(step, run)
    data = encode(state, rank=rank, step=step, run=run)
    tmp = d / f".{path.name}.{os.getpid()}.tmp"
    for attempt in range(2):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            break
        except FileNotFoundError:
            if attempt:
                raise
            make_dirs(d)  # (the first write, or a cleaner took the directory: made durably, parents fsynced)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(d)
    return path


def sync(path: Path) -> None:
    """Make a file :func:`write` wrote without ``durable`` durable: the file, then its directory's entry."""
    fsync_file(path)
    fsync_dir(path.parent)


def read(store_path: Path, rank: int, step: int, run: str, *, tensors: bool = True) -> dict[str, Any]:
    """``rank``'s RNG state at ``step`` of ``run`` (:func:`decode`); :class:`RankStateError` naming the file when it
    is missing, unreadable or damaged."""
    path = directory(store_path, rank) / file_name(step, run)
    try:
        return decode(read_file(path, MAX_FILE), rank=rank, step=step, run=run, tensors=tensors)
    except FileNotFoundError:
        raise RankStateError(f"{path} does not exist") from None
    except OSError as exc:
        raise RankStateError(f"{path} cannot be read ({exc.strerror or exc})") from None
    except RankStateError as exc:
        raise RankStateError(f"{path}: {exc}") from None


def read_for(store_path: Path, rank: int, step: int, rng: Any, *, tensors: bool = True) -> dict[str, Any]:
    """:func:`read` of ``rank``'s states at ``step`` of the run that the checkpoint's ``rng`` entry names
    (:data:`RUN_KEY`); :class:`RankStateError` also when it names none (saved by an older deltackpt)."""
    run = rng.get(RUN_KEY) if isinstance(rng, Mapping) else None
    if not isinstance(run, str):
        raise RankStateError("the checkpoint names no run (saved by an older deltackpt?)")
    return read(store_path, rank, step, run, tensors=tensors)


#: a temporary file this old is what a process killed while it wrote left
_STALE_TMP = 3600.0


def prune(store_path: Path, rank: int, keep: Callable[[int], bool]) -> int:
    """Remove ``rank``'s files of the steps ``keep`` says no (steps the store holds no checkpoint of and whose
    save is not under way), and temporary files killed writers left. Returns how many it removed; a file another
    process removed meanwhile is no error; a directory, whatever its name, is left alone."""
    d = directory(store_path, rank)
    removed = 0
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return 0
    stale = time.time() - _STALE_TMP
    for e in entries:
        m = _NAME.fullmatch(e.name)
        with contextlib.suppress(OSError):
            if e.is_dir(follow_symlinks=False):
                continue  # (named like a file of ours, but not one: left alone, not an IsADirectoryError)
        if m is not None:
            if keep(int(m.group(1))):
                continue
        elif not (e.name.startswith(".") and e.name.endswith(".tmp")):
            continue  # (not ours: left alone)
        else:
            with contextlib.suppress(OSError):
                if e.stat(follow_symlinks=False).st_mtime > stale:
                    continue
        try:
            os.unlink(e.path)
            removed += 1
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
    return removed


__all__ = ["RUN_KEY", "RankStateError", "decode", "encode", "newest_seq", "next_run", "prune", "ranks_kept", "read",
           "read_for", "run_name", "sync", "usage", "write"]
