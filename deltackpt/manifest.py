"""Manifests: the immutable, checksummed description of one checkpoint.

What :func:`parse` refuses, a repair drops and gc then frees: it refuses only what no writer makes (fields of
the wrong type or range, inconsistent chunk ranges), never what this process merely cannot load (a dtype of a
newer torch, a device backend it lacks), which load reports when it gets there.

Where it sits: after ``save`` has made every chunk durable it writes the manifest (the state skeleton, the tensor
table and the chunk-id table) with :func:`write` (temp file, fsync, rename, fsync the directory); the LMDB
commit that follows registers it. ``load`` reads it back with :func:`read`, which verifies the checksum before
trusting a byte.

Layout of ``manifests/<id>.manifest`` (little-endian)::

    0    8   magic b"DCKMANIF"
    8    4   format version (1; 2 or 3 when the state skeleton holds a node of that version, see
             :func:`tree.format_version`)
    12   4   flags (0)
    16   8   header length H
    24   8   chunk count N
    32   H   header: UTF-8 JSON (id, step, created, parent, chunk_size, metadata, logical_bytes, written_bytes,
             extra, tree, tensors)
    ..   16N chunk digests (canonical XXH3-128), tensor after tensor, chunk after chunk
    ..   N   chunk flags: bit 0 = all-zero chunk (not stored anywhere)
    end  16  XXH3-128 of every byte before it

Tensor ``t`` owns chunks ``first .. first+count-1``; chunk ``i`` of it has ``min(chunk_size, nbytes -
i*chunk_size)`` bytes. Its chunk id is (digest, length).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from deltackpt import config, tree
from deltackpt.errors import (
    CorruptManifestError,
    FormatVersionError,
    InvalidNameError,
    UnsafeLoadError,
    UnsupportedTypeError,
)
from deltackpt.packs import fsync_dir, named, read_file

MAGIC = b"DCKMANIF"
#: the newest manifest version this code reads and writes; a manifest records the oldest one its content needs
MANIFEST_VERSION = 3
_HEAD = struct.Struct("<8sIIQQ")
FLAG_ZERO = 1
_ID = re.compile(r"^[0-9a-f]{16}$")


#: the name of the temporary file :func:`write` writes a manifest to, in the store's ``tmp/``: what gc removes there
TMP_NAME = re.compile(r"[0-9a-f]{16}\.manifest\.[0-9]+\.tmp")


def is_id(name: str) -> bool:
    """Whether ``name`` is a checkpoint id (a manifest file's name without ``.manifest``)."""
    return bool(_ID.fullmatch(name))


def check_id(checkpoint_id: str) -> str:
    """Checkpoint ids are 16 lowercase hex digits; anything else (``..``, ``/``) is refused."""
    if not isinstance(checkpoint_id, str) or not _ID.fullmatch(checkpoint_id):
        raise InvalidNameError(f"invalid checkpoint id {checkpoint_id!r}: expected 16 lowercase hex digits")
    return checkpoint_id


#: the largest ``created`` a manifest or index record may hold (9999-12-31, the last day ``datetime`` shows)
MAX_CREATED = 253402300799.0
#: the header fields a manifest holds (format.md §5): any other is damage
HEADER_FIELDS = frozenset({"id", "step", "created", "parent", "chunk_size", "metadata", "logical_bytes",
                           "written_bytes", "extra", "tree", "tensors"})


def _count(v: Any, what: str, limit: int = 1 << 63) -> int:
    """``v`` when it is an int in [0, limit), else ValueError naming ``what``."""
    if type(v) is not int or not 0 <= v < limit:
        raise ValueError(f"{what} is {v!r:.60}")
    return v


def check_fields(d: dict[str, Any]) -> None:
    """Check the fields a manifest header and an index record share (whichever ``d`` holds) to be of their
    type and range (format.md §5, §6); ValueError naming the first that is not. Damage that keeps the JSON
    (and a checksum made to match) must be refused here, not fail later as an untyped error."""
    if "id" in d:
        check_id(d["id"])
    if "step" in d:
        _count(d["step"], "step")
    if "created" in d:
        c = d["created"]
        if type(c) not in (int, float) or not -MAX_CREATED <= c <= MAX_CREATED:  # (NaN fails too)
            raise ValueError(f"created is {c!r:.60}")
    if d.get("parent") is not None:
        check_id(d["parent"])
    for name in ("logical_bytes", "written_bytes"):
        if name in d:
            _count(d[name], name)
    if d.get("metadata") is not None:
        if (v := tree.format_version(d["metadata"])) > 1:
            raise ValueError(f"metadata holds a version-{v} node (checkpoint metadata is of version-1 kinds only)")
        _check_plain(d["metadata"])
    if "extra" in d:
        extra = d["extra"]
        if type(extra) is not dict:
            raise ValueError(f"extra is {extra!r:.60}")
        if "generation" in extra:
            _count(extra["generation"], "extra.generation")
        if "replaces" in extra:
            if type(extra["replaces"]) is not list:
                raise ValueError(f"extra.replaces is {extra['replaces']!r:.60}")
            for old in extra["replaces"]:
                check_id(old)


def _check_plain(metadata: Any) -> None:
    """ValueError unless ``metadata`` decodes as the plain values saves write there (nothing is unpickled or
    handed to a registered decoder). A torch name this torch does not know (a newer dtype, another backend's
    device) is as saved, not damage."""
    try:
        tree.decode_plain(metadata)
    except UnsupportedTypeError:
        if not tree.holds_torch_name(metadata):
            raise ValueError("metadata holds a value of a registered type (saves write plain values there)") from None
    except UnsafeLoadError:
        raise ValueError("metadata holds a pickled value (saves write plain values there)") from None
    except CorruptManifestError as exc:
        raise ValueError(f"metadata: {exc}") from None


#: the fields of a tensor entry, with the types they must have
_ENTRY_TYPES = {"key": str, "kind": str, "dtype": str, "shape": list, "nbytes": int, "width": int, "first": int,
                "count": int, "written": int, "requires_grad": bool, "parameter": bool, "device": str}


def _entry(t: Any) -> TensorEntry:
    """A tensor entry from its JSON object, checked field by field (ValueError naming the first bad one). On
    every load, once per tensor: the common case takes one pass of cheap checks, and only a failure looks for
    which field is wrong."""
    if type(t) is not dict:
        raise ValueError(f"tensor entry {t!r:.60}")
    try:
        ok = all(type(v) is _ENTRY_TYPES[k] for k, v in t.items())
    except KeyError:
        ok = False
    if ok:
        e = TensorEntry(**t)
        ok = (0 <= e.nbytes < _LIMIT and 0 <= e.first < _LIMIT and 0 <= e.count < _LIMIT and 0 <= e.written < _LIMIT
              and e.width in (1, 2, 4, 8) and e.kind in ("torch", "numpy")
              and all(type(n) is int and 0 <= n < _LIMIT for n in e.shape))
    if not ok:
        raise ValueError(_entry_problem(t))
    itemsize = _itemsize(e.kind, e.dtype)
    elements = span = 1
    for n in e.shape:
        elements *= n
        span *= n or 1
    if itemsize is not None and e.nbytes != itemsize * elements:
        raise ValueError(f"tensor {e.key!r:.60}: {e.nbytes} bytes for shape {e.shape} of {e.dtype}")
    # (an empty tensor's other dimensions too: torch refuses to make one whose dimensions multiply, zeros left
    # out, to 2^64 or more, numpy one of 2^63 bytes or more, with errors that name no tensor; no writer saved one)
    if span >= 1 << 64 if e.kind == "torch" else span * (itemsize or 1) >= _LIMIT:
        raise ValueError(f"tensor {e.key!r:.60}: shape {str(e.shape):.80} of {e.dtype} spans more than "
                         f"{'torch makes' if e.kind == 'torch' else 'numpy makes'}")
    if e.requires_grad and not _differentiable(e.kind, e.dtype):
        raise ValueError(f"tensor {e.key!r:.60}: requires_grad for {e.kind} {e.dtype} (only float and complex "
                         "torch tensors can)")
    if e.kind == "numpy" and (e.parameter or e.device != "cpu"):
        raise ValueError(f"tensor {e.key!r:.60}: a numpy array marked as a parameter or on device {e.device!r:.20}")
    if e.kind == "numpy" and len(e.shape) > _NUMPY_MAX_DIMS:
        raise ValueError(f"tensor {e.key!r:.60}: a numpy array of {len(e.shape)} dimensions (numpy has at most "
                         f"{_NUMPY_MAX_DIMS})")
    # (the device string is not parsed here: a backend this torch lacks, "npu:0", is for load to resolve)
    return e


_LIMIT = 1 << 63
_NUMPY_MAX_DIMS = 64


@functools.lru_cache(maxsize=256)
def _differentiable(kind: str, dtype: str) -> bool:
    """Whether a tensor of this entry's kind and dtype can require gradients (a dtype this torch does not know
    may: loading it fails anyway)."""
    if kind != "torch":
        return False
    try:
        dt = tree.torch_dtype(dtype)
    except (CorruptManifestError, UnsupportedTypeError):
        return True
    return dt.is_floating_point or dt.is_complex


def _entry_problem(t: dict[str, Any]) -> str:
    """What is wrong with a tensor entry :func:`_entry` refused."""
    for name, value in t.items():
        want = _ENTRY_TYPES.get(name)
        if want is None or type(value) is not want:
            return f"tensor entry {t.get('key')!r:.60}: field {name!r} is {value!r:.60}"
    where = f"tensor {t.get('key')!r:.60}"
    for name in ("nbytes", "first", "count", "written"):
        if name in t and not 0 <= t[name] < _LIMIT:
            return f"{where}: {name} is {t[name]!r:.60}"
    if "width" in t and t["width"] not in (1, 2, 4, 8):
        return f"{where}: width {t['width']}"
    if t.get("kind") not in ("torch", "numpy"):
        return f"{where}: kind {t.get('kind')!r:.60}"
    return f"{where}: shape {t.get('shape')!r:.60}"


@functools.lru_cache(maxsize=256)
def _itemsize(kind: str, dtype: str) -> int | None:
    """The element size of a tensor entry's dtype (a manifest names few: looked up once each); None for one
    this torch or numpy does not know. A newer library's dtype is no damage: the manifest stays readable (a
    repair must keep the checkpoint), and only loading that tensor fails."""
    try:
        return tree.torch_itemsize(dtype) if kind == "torch" else tree.numpy_dtype(dtype).itemsize
    except (CorruptManifestError, UnsupportedTypeError):
        return None


@dataclass
class TensorEntry:
    key: str
    kind: str  # "torch" | "numpy"
    dtype: str
    shape: list[int]
    nbytes: int
    width: int
    first: int
    count: int
    written: int = 0  # bytes this checkpoint wrote for the tensor (new frames)
    requires_grad: bool = False
    parameter: bool = False
    device: str = "cpu"

    def chunk_len(self, i: int, chunk_size: int) -> int:
        return min(chunk_size, self.nbytes - i * chunk_size)


@dataclass
class Manifest:
    id: str
    step: int
    created: float
    parent: str | None
    chunk_size: int
    tree: Any
    tensors: list[TensorEntry]
    digests: np.ndarray  # (N, 16) uint8
    flags: np.ndarray  # (N,) uint8
    metadata: Any = None
    logical_bytes: int = 0
    written_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def chunk_keys(self, t: TensorEntry) -> list[tuple[int, bytes, int]]:
        """(position, digest, length) of every stored (non-zero) chunk of tensor ``t``."""
        out = []
        for i in range(t.count):
            j = t.first + i
            if not self.flags[j] & FLAG_ZERO:
                out.append((i, self.digests[j].tobytes(), t.chunk_len(i, self.chunk_size)))
        return out

    def skeleton(self) -> Any:
        """The state with each tensor's :class:`TensorEntry` in its place: its plain values and structure, read
        without decoding a chunk. Raises ``UnsafeLoadError`` for a pickled value."""
        return tree.unflatten(self.tree, list(self.tensors), allow_pickle=False)

    def stored_chunks(self) -> tuple[np.ndarray, np.ndarray]:
        """Digests (K, 16) and lengths (K,) of every stored (non-zero) chunk, tensor after tensor: what
        :meth:`chunk_keys` names, for the whole checkpoint at once."""
        cs = self.chunk_size
        lengths = np.full(len(self.flags), cs, dtype=np.int64)
        ends = np.array([(t.first + t.count - 1, t.nbytes - (t.count - 1) * cs) for t in self.tensors if t.count],
                        dtype=np.int64).reshape(-1, 2)
        lengths[ends[:, 0]] = ends[:, 1]  # each tensor's last chunk may be short
        stored = (self.flags & FLAG_ZERO) == 0
        return self.digests[stored], lengths[stored]

    def header(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "step": self.step,
            "created": self.created,
            "parent": self.parent,
            "chunk_size": self.chunk_size,
            "metadata": self.metadata,
            "logical_bytes": self.logical_bytes,
            "written_bytes": self.written_bytes,
            "extra": self.extra,
            "tree": self.tree,
            "tensors": [t.__dict__ for t in self.tensors],
        }

    def to_bytes(self) -> bytes:
        head = json.dumps(self.header(), separators=(",", ":")).encode()
        n = len(self.flags)
        if self.digests.shape != (n, 16):
            raise ValueError("digest table does not match the flag table")
        body = b"".join(
            [
                _HEAD.pack(MAGIC, tree.format_version(self.tree), 0, len(head), n),
                head,
                np.ascontiguousarray(self.digests, dtype=np.uint8).tobytes(),
                np.ascontiguousarray(self.flags, dtype=np.uint8).tobytes(),
            ]
        )
        return body + xxhash.xxh3_128_digest(body)


def checksum_of(data: bytes) -> str:
    return data[-16:].hex()


def parse(data: bytes, *, where: str) -> Manifest:
    """Parse and verify a manifest's bytes; ``where`` names it in errors."""
    if len(data) < _HEAD.size + 16:
        raise CorruptManifestError(f"manifest {where} is truncated ({len(data)} bytes)")
    if xxhash.xxh3_128_digest(memoryview(data)[:-16]) != data[-16:]:
        raise CorruptManifestError(f"manifest {where} fails its checksum")
    magic, version, flags, hlen, n = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise CorruptManifestError(f"manifest {where} has bad magic {magic!r}")
    if not 1 <= version <= MANIFEST_VERSION:
        raise FormatVersionError(
            f"manifest {where} has format version {version} (this reader: 1 to {MANIFEST_VERSION})"
        )
    if flags != 0 or _HEAD.size + hlen + 17 * n + 16 != len(data):
        raise CorruptManifestError(f"manifest {where} has an inconsistent layout")
    off = _HEAD.size
    try:
        h = json.loads(data[off : off + hlen])
        if type(h) is not dict or not h.keys() <= HEADER_FIELDS:
            unknown = sorted(h.keys() - HEADER_FIELDS) if type(h) is dict else h
            raise ValueError(f"unknown header fields {unknown!r:.80}")
        check_fields(h)
        # (keys=False: earlier writers marked a quantized dtype key or set element as version 2)
        if (need := tree.format_version(h["tree"], keys=False)) > version:
            raise ValueError(f"its state skeleton holds version-{need} nodes in a "
                             f"version-{version} manifest")
        if type(h["tensors"]) is not list:
            raise ValueError("tensors is not a list")
        tensors = [_entry(t) for t in h["tensors"]]
        off += hlen
        digests = np.frombuffer(data, dtype=np.uint8, count=16 * n, offset=off).reshape(n, 16)
        flags_arr = np.frombuffer(data, dtype=np.uint8, count=n, offset=off + 16 * n)
        m = Manifest(
            id=h["id"],
            step=h["step"],
            created=float(h["created"]),
            parent=h["parent"],
            chunk_size=_chunk_size(h["chunk_size"]),
            tree=h["tree"],
            tensors=tensors,
            digests=digests,
            flags=flags_arr,
            metadata=h.get("metadata"),
            logical_bytes=h.get("logical_bytes", 0),
            written_bytes=h.get("written_bytes", 0),
            extra=dict(h.get("extra") or {}),
        )
    except (ValueError, KeyError, TypeError, CorruptManifestError, InvalidNameError, RecursionError) as exc:
        raise CorruptManifestError(f"manifest {where} has an unreadable header: {exc}") from None
    if n and int(np.bitwise_or.reduce(flags_arr)) & ~FLAG_ZERO & 0xFF:
        raise CorruptManifestError(f"manifest {where}: a chunk flag has a reserved bit set")
    for t in tensors:
        expect = -(-t.nbytes // m.chunk_size)
        if t.count != expect or t.first < 0 or t.first + t.count > n:
            raise CorruptManifestError(f"manifest {where}: tensor {t.key!r} has an inconsistent chunk range")
    return m


def _chunk_size(value: Any) -> int:
    """A header's chunk size: a power of two in [4 KiB, 1 GiB] (format §2; a larger one would let a few table
    entries of all-zero chunks describe any number of bytes)."""
    if type(value) is not int or value < config.MIN_CHUNK_SIZE or value > config.MAX_CHUNK_SIZE or value & (value - 1):
        raise ValueError(f"chunk_size is {value!r:.60} (a power of two from {config.MIN_CHUNK_SIZE} to "
                         f"{config.MAX_CHUNK_SIZE})")
    return value


def path_for(directory: Path, checkpoint_id: str) -> Path:
    return directory / f"{check_id(checkpoint_id)}.manifest"


def write(directory: Path, tmp_dir: Path, manifest: Manifest) -> tuple[Path, str]:
    """Durably write the manifest; return (path, checksum hex). The caller commits it to the index after."""
    data = manifest.to_bytes()
    final = path_for(directory, manifest.id)
    tmp = tmp_dir / f"{manifest.id}.manifest.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as exc:  # (a full disk: the error names the file, as a bare ENOSPC did not)
            if (err := named(exc, tmp)) is exc:
                raise
            raise err from None
        finally:
            os.close(fd)
        os.rename(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk, say: give the space back now rather than at the next gc
        raise
    fsync_dir(directory)
    return final, checksum_of(data)


#: manifests larger than this are read whole only when their head describes a manifest of the file's size
_LARGE = 1 << 26


def file_bytes(p: Path) -> bytes:
    """The bytes of the manifest file ``p`` (:func:`deltackpt.packs.read_file`: a regular file, or ``OSError``;
    a FIFO in its place raises rather than waits forever for a writer). A large file whose head is not that of a
    manifest of its size (a sparse file of terabytes in a received store, a link to a disk image) raises
    ``OSError`` (``EINVAL``) before it is read: read whole, it made a listing's verify or a repair run out of
    memory."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode) or size <= _LARGE:
            return read_file(p)  # (small: its damage is reported as parse() finds it, a checksum first)
        head = f.read(_HEAD.size)
        magic, _, _, hlen, n = _HEAD.unpack(head) if len(head) == _HEAD.size else (b"", 0, 0, 0, 0)  # (shrunk)
        if magic != MAGIC or _HEAD.size + hlen + 17 * n + 16 != size:
            raise OSError(errno.EINVAL, f"a file of {size} bytes whose head is not a manifest's of that size, not "
                                        "read", str(p))
        return head + f.read()


def read(directory: Path, checkpoint_id: str, *, expect_checksum: str | None = None) -> Manifest:
    p = path_for(directory, checkpoint_id)
    try:
        data = file_bytes(p)
    except FileNotFoundError:
        # the index names it: an index older than the manifests (copied back from before a rewrite, say), or a
        # lost file; a repair makes the index the manifests' again (and drops a checkpoint whose manifest is gone)
        raise CorruptManifestError(f"manifest of checkpoint {checkpoint_id} is missing ({p}); 'deltackpt repair "
                                   "STORE' rebuilds the index from the manifests") from None
    except OSError as exc:  # a directory, a FIFO, a symlink loop, an I/O error: the checkpoint cannot be read
        raise CorruptManifestError(f"manifest of checkpoint {checkpoint_id} cannot be read ({p}: "
                                   f"{exc.strerror or exc})") from None
    if expect_checksum is not None and checksum_of(data) != expect_checksum:
        raise CorruptManifestError(
            f"manifest of checkpoint {checkpoint_id} does not match the checksum the index recorded"
        )
    m = parse(data, where=checkpoint_id)
    if m.id != checkpoint_id:
        raise CorruptManifestError(f"manifest file {p.name} holds checkpoint {m.id}")
    return m
