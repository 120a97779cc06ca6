"""The chunk kernel: one API over the native extension or the pure-Python reference.

Where it sits: every byte of every save and load passes through here. ``save`` calls :func:`chunk_digests` on
each tensor's bytes to name its chunks (XXH3-128) and find all-zero ones; the codec calls the byte-plane and
XOR functions to prepare chunks for zstd and to undo that on load.

Backends
--------
``native``  the Cython/C extension ``deltackpt._kernel`` (built from ``native/``): whole loops run with the
            GIL released and are spread over ``threads`` POSIX threads.
``python``  ``deltackpt._pykernel``: numpy + the ``xxhash`` package, bit-identical, slower.

``DELTACKPT_BACKEND=python`` forces the reference; ``DELTACKPT_BACKEND=native`` makes a missing or stale
extension an ImportError instead of a warning. Without the variable the native backend is used when it is
built and current; otherwise one warning is issued and the reference is used. :data:`backend` says which one
runs. A backend the variable asks for and that cannot run (another value, a native kernel that is not there or
stale) does not fail the import, so that the ``deltackpt`` command can report it as one line: :func:`check`
(which ``Store()`` calls first) and every kernel function raise the ImportError naming the variable, and
:data:`backend` is ``"none"``.

Contract (both backends)
------------------------
- Buffers are anything exporting the buffer protocol, C-contiguous (bytes, memoryview, numpy arrays, the
  uint8 numpy view of a CPU tensor); they are read as raw bytes. Output buffers are writable and exactly as
  long as the input; when ``out`` is None a new uint8 numpy array is returned.
- :func:`chunk_digests` returns ``(digests, zero)``: ``digests`` is a ``(n, 16)`` uint8 array holding the
  canonical (big-endian) XXH3-128 digest of each chunk, as ``xxhash.xxh3_128_digest`` prints it, and
  ``zero`` a ``(n,)`` bool array, True where a chunk's bytes are all zero. ``n = ceil(len / chunk_size)``;
  the last chunk may be short; an empty buffer has no chunks.
- Byte planes of width ``w`` (1, 2, 4 or 8): with ``m = len // w`` elements, output byte ``k * m + i`` is
  input byte ``i * w + k``; the ``len % w`` tail bytes are copied unchanged after the planes. Width 1 is a
  copy.
- :func:`xor_split_planes` is ``split_planes(src XOR base)``; :func:`merge_planes_xor` is
  ``merge_planes(src) XOR base``; ``base`` is as long as ``src``.
- :func:`decode_frames` ``(frames, codecs, widths, out, digest=None) -> (status, bad)`` decodes one chunk:
  it applies whole frames (header + payload, see :mod:`deltackpt.codec`) in order to ``out`` (a keyframe
  overwrites it, a delta frame XORs onto it, so ``out`` holds the base when the first frame is a delta; a
  predicted frame, only ever the first, XORs its residual onto the prediction the caller put in ``out``) after
  checking each frame's checksum, then compares the result's digest with ``digest`` when given. ``status`` is
  0, or :data:`ECHECKSUM` / :data:`EPAYLOAD` (frame ``bad`` is damaged) or :data:`EDIGEST` (``bad == n``).
  With ``prediction=(predictor, coefs, base, refs)`` the first frame must be a predicted one and the kernel
  computes its prediction itself: the same result as :func:`predict` into ``out`` first (the native version
  writes it a few KiB at a time just before the residual is XORed onto them: one pass over ``out``, not two).
  Codecs and widths come from the caller's parsed headers. The native version runs one C call without the
  GIL (its own zstd context per thread): the load path's whole per-chunk work.
- :func:`predict` ``(predictor, coefs, base, refs, out)`` computes a predicted frame's prediction: float32
  elements of ``base`` and ``refs`` in, float32 out (bfloat16 for predictors 4 and 5: widened to float32 in,
  rounded to nearest even out), with the exact operation sequence of ``docs/format.md`` §8a (subnormal inputs
  read as zero, canonical NaN, results below 2^-126 flushed to zero), so both backends and every machine
  produce the same bytes. Arguments are checked by :mod:`deltackpt.predict`.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import warnings
from pathlib import Path
from typing import Any

from deltackpt.errors import caller_level

#: Bumped whenever the native functions' signatures or semantics change; compiled into the extension.
API_VERSION = 5

_NATIVE_SOURCES = ("kernel.c", "kernel.h", "_kernel.pyx")


def source_hash(native_dir: Path) -> str | None:
    """Hash of the kernel sources as the build computes it (None when they are not beside the package)."""
    h = hashlib.sha256()
    for name in _NATIVE_SOURCES:
        p = native_dir / name
        if not p.exists():
            return None
        h.update(name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


class StaleBuildError(ImportError):
    """The compiled kernel does not match the Python package or the kernel sources beside it."""


def _load_native() -> Any:
    try:
        _kernel = importlib.import_module("deltackpt._kernel")
    except ModuleNotFoundError as exc:
        if exc.name != "deltackpt._kernel":
            raise
        raise ImportError(
            "the compiled kernel deltackpt._kernel is not there: building it needs the xxHash headers and the zstd "
            "library (apt-get install libxxhash-dev libzstd-dev), then pip install . (or make build in a checkout)"
        ) from None

    if getattr(_kernel, "API_VERSION", None) != API_VERSION:
        raise StaleBuildError(
            f"deltackpt native kernel has API version {getattr(_kernel, 'API_VERSION', None)}, the package "
            f"expects {API_VERSION}: rebuild it (pip install -e . or make build)"
        )
    # In a source checkout (editable install) the sources sit next to the package: a build older than them is
    # stale even when the API version did not move.
    native_dir = Path(__file__).resolve().parent.parent / "native"
    current = source_hash(native_dir)
    built = getattr(_kernel, "SOURCE_HASH", None)
    if current is not None and built != current:
        raise StaleBuildError(
            f"deltackpt native kernel was built from other sources (built {built}, sources {current}): "
            "rebuild it (pip install -e . or make build)"
        )
    return _kernel


def _select() -> tuple[str, Any]:
    raw = os.environ.get("DELTACKPT_BACKEND", "")
    want = raw.strip().lower()
    if want not in ("", "native", "python"):
        raise ImportError(f"DELTACKPT_BACKEND must be 'native', 'python' or unset, got {raw!r}")
    if want == "python":
        from deltackpt import _pykernel

        return "python", _pykernel
    try:
        return "native", _load_native()
    except ImportError as exc:
        if want == "native":
            raise type(exc)(f"DELTACKPT_BACKEND=native, but {exc}") from None
        warnings.warn(
            f"deltackpt: native kernel unavailable ({exc}); using the slow pure-Python backend",
            RuntimeWarning,
            stacklevel=caller_level(),
        )
        from deltackpt import _pykernel

        return "python", _pykernel


class _Unusable:
    """Stands for the backend ``DELTACKPT_BACKEND`` asks for when it cannot run: each function raises why."""

    def __init__(self, error: ImportError) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            check()

        return refuse


def check() -> None:
    """Raise the ImportError that keeps the backend ``DELTACKPT_BACKEND`` asks for from running, if any."""
    if isinstance(_impl, _Unusable):
        raise _impl.error.with_traceback(None)


_impl: Any
try:
    backend, _impl = _select()
except ImportError as _exc:
    backend, _impl = "none", _Unusable(_exc)

chunk_digests = _impl.chunk_digests
digest = _impl.digest
split_planes = _impl.split_planes
merge_planes = _impl.merge_planes
xor_split_planes = _impl.xor_split_planes
merge_planes_xor = _impl.merge_planes_xor
decode_frames = _impl.decode_frames
predict = _impl.predict
DIGEST_SIZE = 16
#: Status codes of :func:`decode_frames`.
ECHECKSUM, EPAYLOAD, EDIGEST = -2, -3, -4

__all__ = [
    "API_VERSION",
    "DIGEST_SIZE",
    "StaleBuildError",
    "backend",
    "check",
    "chunk_digests",
    "decode_frames",
    "digest",
    "merge_planes",
    "merge_planes_xor",
    "predict",
    "split_planes",
    "xor_split_planes",
]
