"""The store directory and its ``STORE`` description: read first when a Store opens, written when one is created,
written again by repair.

Where it sits: before the pipeline. Opening a :class:`~deltackpt.Store` asks :func:`why_readonly` whether it may
write, refuses a directory that lost ``STORE`` (:func:`lost_store`), and reads the chunk size from ``STORE``
(:func:`read_store_file`); creating one first refuses a directory that holds anything else
(:func:`check_new_store_dir`) and links ``STORE`` after the index exists (:func:`write_store_file`). ``repair``
writes a lost or damaged ``STORE`` again from the manifests' chunk size (:mod:`deltackpt.maintenance`); the
command line tells a store that lost ``STORE`` from a directory that is no store with :func:`holds_checkpoints`.

On-disk layout of a store (see ``docs/format.md``)::

    STORE              JSON: store format version and chunk size, written once at creation
    index/             LMDB environment (the commit point)
    packs/*.pack       append-only frame files
    manifests/*.manifest   one immutable file per checkpoint
    tmp/               temporary files of saves in progress
    gc.lock            shared by saves and loads, exclusive for gc and repair
    maint.lock         exclusive for gc and repair (one at a time; gc lets saves run between repacked packs)
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

from deltackpt import config
from deltackpt.errors import DeltackptError, FormatVersionError
from deltackpt.packs import fsync_dir, read_file

STORE_FORMAT = "deltackpt-store"
STORE_VERSION = 1


def check_new_store_dir(path: Path) -> None:
    """Refuse to make a store in a directory that holds anything else: gc and repair treat everything in a
    store's directories as theirs, and a typo'd path should not turn a project folder into a store."""
    def ours(e: os.DirEntry[str]) -> bool:
        if e.name in ("tmp", "packs", "manifests"):  # (packs or manifests with files: a lost STORE, lost_store)
            return e.is_dir(follow_symlinks=False) and not any(os.scandir(e.path))
        if e.name == "index":
            return e.is_dir(follow_symlinks=False) and all(
                f.name in ("data.mdb", "lock.mdb") or f.name.startswith("lock.mdb.new-") for f in os.scandir(e.path))
        # the lock files, and STORE's temporary file (what a creation that a crash cut short leaves)
        return e.name in ("gc.lock", "maint.lock") or (e.name.startswith("STORE.") and e.name.endswith(".tmp"))

    try:
        others = sorted(e.name for e in os.scandir(path) if not ours(e))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise DeltackptError(f"{path}: a part of the path is not a directory") from None
    if others and not (path / "STORE").exists():  # (STORE now: another process made the store meanwhile)
        shown = ", ".join(map(repr, others[:3])) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise DeltackptError(f"{path} is not a deltackpt store and not empty (it holds {shown}): a new store "
                             "needs an empty or new directory")


def read_store_file(path: Path) -> int:
    """The chunk size that ``path/STORE`` names. Raises :class:`FormatVersionError` for a newer store format,
    :class:`DeltackptError` for a file that is not a store description or names an impossible chunk size (a
    damaged file: ``deltackpt repair`` writes it again from the manifests)."""
    cfg_path = path / "STORE"
    try:
        cfg = json.loads(read_file(cfg_path, 1 << 16))  # (a regular file of at most 64 KiB: no FIFO, no device)
        if type(cfg) is not dict:
            raise ValueError(f"a JSON {type(cfg).__name__}, not an object")
        fmt, version, cs = cfg["format"], cfg["version"], cfg["chunk_size"]
        if type(version) is not int or version < 1 or type(cs) is not int:  # ("1", 1.9, true: damage)
            raise ValueError(f"version {version!r:.40}, chunk_size {cs!r:.40}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DeltackptError(f"{cfg_path} is not a deltackpt store description ({exc}); if it is damaged, "
                             "'deltackpt repair STORE' writes it again from the manifests") from None
    if fmt != STORE_FORMAT:
        raise DeltackptError(f"{path} is not a deltackpt store ({cfg_path} names format {fmt!r})")
    if version > STORE_VERSION:
        raise FormatVersionError(f"store {path} has format version {version}; this deltackpt reads {STORE_VERSION}")
    try:
        return config.check_chunk_size(cs)
    except ValueError as exc:
        raise DeltackptError(f"{cfg_path} names an impossible chunk size ({exc}); if it is damaged, "
                             "'deltackpt repair STORE' writes it again from the manifests") from None


def write_store_file(path: Path, chunk_size: int) -> None:
    """Write ``path/STORE`` durably (temp file, fsync, link, fsync the directory); of two processes writing it
    at once, the first wins."""
    tmp = path / f"STORE.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp.write_text(json.dumps({"format": STORE_FORMAT, "version": STORE_VERSION, "chunk_size": chunk_size}) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    try:
        os.link(tmp, path / "STORE")  # fails if another process created the store meanwhile: theirs wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    fsync_dir(path)



def lost_store_file(path: Path) -> DeltackptError:
    """The error of a store directory without STORE that holds packs or manifests (for a repair, not a creation)."""
    return DeltackptError(f"{path} has no STORE file but holds a store's packs or manifests (STORE was lost?); "
                          "'deltackpt repair' writes it again, with the chunk size the manifests name")


def lost_store(path: Path) -> bool:
    """Whether ``path`` holds a store's packs or manifests but no STORE file. Looked at in that order: a process
    that creates a store writes STORE before anything else that is not empty, so a store another process is
    creating meanwhile is not taken for one that lost STORE."""
    return holds_checkpoints(path) and not (path / "STORE").exists()


def holds_checkpoints(path: Path) -> bool:
    """Whether ``path`` holds a store's packs or manifests (a crash while creating a store leaves neither)."""
    return any(any((path / sub).glob(pattern)) for sub, pattern in (("packs", "*.pack"), ("manifests", "*.manifest")))


def why_readonly(path: Path) -> str | None:
    """Why the store at ``path`` can only be read, or None when it can be written (or does not exist yet): its
    filesystem is mounted read-only, or this process may not write its directories (another user's store)."""
    for p in (path, *path.absolute().parents):
        try:
            if os.statvfs(p).f_flag & os.ST_RDONLY:
                return "on a read-only filesystem"
            break
        except FileNotFoundError:
            continue
        except OSError:
            break
    if (path / "STORE").exists():
        for sub in (path, path / "index", path / "packs", path / "manifests"):
            if sub.exists() and not os.access(sub, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
                return f"not writable by this user (no write permission on {sub})"
    return None


def rank_dir(rank: int) -> str:
    """The name of rank ``rank``'s store in a sharded (DCP) root, beside its ``meta`` store."""
    return f"rank-{rank:05d}"


def rank_of_dir(name: str) -> int | None:
    """The rank whose store a sharded root's directory ``name`` is, by the name :func:`rank_dir` gives it
    (``rank-00001``; not ``rank-000001`` or ``rank-00001.bak``, which no rank's store is named), else None."""
    m = re.fullmatch(r"rank-(\d{5,})", name)
    return int(m.group(1)) if m and name == rank_dir(int(m.group(1))) else None
