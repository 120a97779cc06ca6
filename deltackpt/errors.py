"""Typed errors of deltackpt.

Every failure a user can meet has a type here and a message that names what was wrong (key path, step,
checkpoint id, chunk id, file). Corruption is always an error, never data: :class:`CorruptionError` and its
subclasses are raised by every reader that meets bytes that do not verify. Warnings point at the training
script's line that led to them (:func:`caller_level`).
"""

from __future__ import annotations

import os
import sys


class DeltackptError(Exception):
    """Base class of every error deltackpt raises on purpose."""


class CorruptionError(DeltackptError):
    """Stored bytes do not verify (checksum, digest, layout)."""


class CorruptChunkError(CorruptionError):
    """A chunk frame is damaged, truncated, missing, or decodes to bytes whose digest is not its id.

    ``chunk_id`` is the hex id of the chunk when known; ``checkpoint`` and ``key`` name where it was needed.
    """

    def __init__(
        self,
        message: str,
        *,
        chunk_id: str | None = None,
        checkpoint: str | None = None,
        key: str | None = None,
    ) -> None:
        parts = [message]
        if checkpoint is not None:
            parts.append(f"checkpoint {checkpoint}")
        if key is not None:
            parts.append(f"tensor {key!r}")
        if chunk_id is not None:
            parts.append(f"chunk {chunk_id}")
        super().__init__(": ".join(parts[:1]) + ("" if len(parts) == 1 else " (" + ", ".join(parts[1:]) + ")"))
        self.reason = message
        self.chunk_id = chunk_id
        self.checkpoint = checkpoint
        self.key = key


class CorruptManifestError(CorruptionError):
    """A manifest file is damaged, truncated, or does not match what the index recorded for it."""


class CorruptIndexError(CorruptionError):
    """The LMDB index holds a record that cannot be parsed; ``deltackpt repair`` rebuilds it."""


class FormatVersionError(DeltackptError):
    """The store, a manifest or a frame was written by a newer (or unknown) format version."""


class CheckpointNotFoundError(DeltackptError, KeyError):
    """No retained checkpoint matches the step or id asked for."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class InvalidNameError(DeltackptError, ValueError):
    """An id, tag or file name is not of the allowed form (e.g. it holds ``/`` or ``..``), or a type name
    (:func:`~deltackpt.register_type`) is taken by another class."""


class UnsupportedTypeError(DeltackptError, TypeError):
    """A state holds a value deltackpt cannot store; the message names its key path and type."""


class UnsafeLoadError(DeltackptError):
    """A checkpoint holds pickled values and the caller did not opt in with ``allow_pickle=True``."""


class NetworkFilesystemError(DeltackptError):
    """The LMDB index would live on a network filesystem, where its locking is unsafe."""


class StoreLockedError(DeltackptError):
    """An operation that needs the store alone (gc, repair) could not get it in time."""


class ReadOnlyStoreError(DeltackptError, PermissionError):
    """A save, delete, gc or repair on a store opened read-only (``Store(path, readonly=True)``, or a store on a
    read-only filesystem). Nothing was changed."""


class StateChangedError(DeltackptError, RuntimeError):
    """A tensor changed while a save was reading it (another thread wrote to it after the save hashed it). The
    save raises before its commit: nothing is stored under the changed bytes, and the store is as it was."""


class ShapeMismatchError(DeltackptError, ValueError):
    """``load_into`` found a target tensor whose dtype or shape differs from the stored one."""


class IndexWriteError(DeltackptError, OSError):
    """The LMDB index could not be written (disk full, quota, I/O error); the operation did not commit.

    An ``OSError`` too: ``errno`` is ``ENOSPC`` when LMDB reported a full disk or a full map, else the system
    error LMDB reported (``EFBIG`` past the process's file size limit, ``EDQUOT``, ``EIO``, ...), ``EIO`` when
    it reported an error of its own.
    """


def caller_level() -> int:
    """The ``warnings.warn`` stacklevel, for the function that calls this, of the first frame outside deltackpt
    (the training script's call, however deep inside the package the warning is decided)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
