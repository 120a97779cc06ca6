# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Native backend of the chunk kernel (``deltackpt._kernel``), built from ``native/kernel.c``.

Sits under :mod:`deltackpt.kernel`, which picks it over the pure-Python reference ``deltackpt._pykernel`` when it
is built and current. This module only adapts buffers and errors: it turns any C-contiguous buffer into a byte
view, checks lengths, widths and chunk sizes (``ValueError``, as the reference does), allocates outputs, and runs
each C loop with the GIL released. The loops themselves, and their contracts, are in ``native/kernel.h``.
Signatures, results and return types are those of ``deltackpt._pykernel``, bit for bit.
"""

from libc.stdint cimport uint8_t
from libc.stdlib cimport free, malloc

import numpy as np

cdef extern from "kernel.h" nogil:
    int DCK_EINVAL
    int DCK_MAX_THREADS
    size_t dck_chunk_count(size_t len, size_t chunk_size)
    int dck_chunk_digests(const uint8_t *buf, size_t len, size_t chunk_size, uint8_t *digests, uint8_t *zero,
                          int threads)
    int dck_digest(const uint8_t *buf, size_t len, uint8_t *out)
    int dck_split_planes(const uint8_t *src, uint8_t *dst, size_t len, int width, int threads)
    int dck_merge_planes(const uint8_t *src, uint8_t *dst, size_t len, int width, int threads)
    int dck_xor_split_planes(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width,
                             int threads)
    int dck_merge_planes_xor(const uint8_t *src, const uint8_t *base, uint8_t *dst, size_t len, int width,
                             int threads)
    int DCK_ENOMEM
    int dck_decode_frames(const uint8_t *const *frames, const size_t *frame_lens, const int *codecs,
                          const int *widths, int n, uint8_t *dst, size_t raw_len, const uint8_t *digest, int *bad)
    int dck_predict(int predictor, const double *c, int nc, const uint8_t *base, const uint8_t *const *refs,
                    int nrefs, uint8_t *out, size_t len)
    struct dck_prediction:
        int predictor
        const double *c
        int nc
        const uint8_t *base
        const uint8_t *const *refs
        int nrefs
    int dck_decode_predicted(const uint8_t *const *frames, const size_t *frame_lens, const int *codecs,
                             const int *widths, int n, const dck_prediction *pred, uint8_t *dst, size_t raw_len,
                             const uint8_t *digest, int *bad)
    int dck_use_simd(int level)

# Both are set by setup.py: the package's API version and the hash of the kernel sources this was built from;
# deltackpt.kernel compares them with its own to reject a stale build.
cdef extern from *:
    """
    #ifndef DCK_API_VERSION
    #error "DCK_API_VERSION must be defined by the build (see setup.py)"
    #endif
    #ifndef DCK_SOURCE_HASH
    #error "DCK_SOURCE_HASH must be defined by the build (see setup.py)"
    #endif
    static const char dck_source_hash[] = DCK_SOURCE_HASH;
    """
    int DCK_API_VERSION
    const char *dck_source_hash

API_VERSION = DCK_API_VERSION
SOURCE_HASH = dck_source_hash.decode("ascii")
DIGEST_SIZE = 16


cdef object _as_u8(object buf, bint writable=False):
    """A 1-D unsigned-byte memoryview over buf's bytes (as ``_pykernel._as_u8``)."""
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("kernel buffers must be C-contiguous")
    if writable and mv.readonly:
        raise ValueError("output buffer is read-only")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


cdef int _threads(object threads) except -1:
    if threads is None:
        return 1
    t = int(threads)
    if t < 1:
        return 1
    if t > DCK_MAX_THREADS:
        return DCK_MAX_THREADS
    return t


cdef inline const uint8_t *_rptr(const unsigned char[::1] v) noexcept:
    return <const uint8_t *>&v[0] if v.shape[0] > 0 else NULL


cdef inline uint8_t *_wptr(unsigned char[::1] v) noexcept:
    return <uint8_t *>&v[0] if v.shape[0] > 0 else NULL


cdef bint _overlap(const unsigned char[::1] a, const unsigned char[::1] b) noexcept:
    if a.shape[0] == 0 or b.shape[0] == 0:
        return False
    cdef size_t pa = <size_t>&a[0]
    cdef size_t pb = <size_t>&b[0]
    return pa < pb + <size_t>b.shape[0] and pb < pa + <size_t>a.shape[0]


cdef int _check(int rc) except -1:
    if rc == DCK_EINVAL:
        raise ValueError("deltackpt kernel: invalid argument")
    if rc != 0:
        raise RuntimeError(f"deltackpt kernel: unexpected status {rc}")
    return 0


def chunk_digests(buf, chunk_size, threads=1):
    """``(digests (n, 16) uint8, zero (n,) bool)`` of buf's chunks; see deltackpt.kernel."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    cdef const unsigned char[::1] data = _as_u8(buf)
    cdef size_t length = data.shape[0]
    # a chunk size past the buffer (even past size_t) makes one chunk of it all, as in the Python reference
    cdef size_t cs = chunk_size if chunk_size < length else max(length, <size_t>1)
    cdef int nt = _threads(threads)
    cdef size_t n = dck_chunk_count(length, cs)
    digests = np.empty((n, 16), dtype=np.uint8)
    zero = np.empty(n, dtype=np.bool_)
    cdef unsigned char[::1] dv = digests.reshape(-1)
    cdef unsigned char[::1] zv = zero.view(np.uint8)
    cdef const uint8_t *p = _rptr(data)
    cdef uint8_t *pd = _wptr(dv)
    cdef uint8_t *pz = _wptr(zv)
    cdef int rc
    with nogil:
        rc = dck_chunk_digests(p, length, cs, pd, pz, nt)
    _check(rc)
    return digests, zero


def digest(buf):
    """Canonical XXH3-128 digest (16 bytes) of the whole buffer."""
    cdef const unsigned char[::1] data = _as_u8(buf)
    cdef size_t length = data.shape[0]
    cdef const uint8_t *p = _rptr(data)
    cdef uint8_t out[16]
    cdef int rc
    with nogil:
        rc = dck_digest(p, length, out)
    _check(rc)
    return (<char *>out)[:16]


cdef _planes(src, base, width, out, threads, bint merge):
    """Shared adapter of the four plane functions; base None: no XOR."""
    cdef const unsigned char[::1] s = _as_u8(src)
    cdef const unsigned char[::1] b
    cdef bint has_base = base is not None
    if has_base:
        b = _as_u8(base)
        if b.shape[0] != s.shape[0]:
            raise ValueError(f"base length {b.shape[0]} != input length {s.shape[0]}")
    if out is None:
        ret = np.empty(s.shape[0], dtype=np.uint8)
        omv = ret
    else:
        ret = out
        omv = _as_u8(out, writable=True)
    cdef unsigned char[::1] o = omv
    if width not in (1, 2, 4, 8):
        raise ValueError(f"element width must be 1, 2, 4 or 8, got {width}")
    if o.shape[0] != s.shape[0]:
        raise ValueError(f"output length {o.shape[0]} != input length {s.shape[0]}")
    # The loops read and write in different orders: an input the output overlaps is read from a copy.
    if _overlap(o, s):
        s = bytes(s)
    if has_base and _overlap(o, b):
        b = bytes(b)
    cdef int w = width
    cdef int nt = _threads(threads)
    cdef size_t length = s.shape[0]
    cdef const uint8_t *ps = _rptr(s)
    cdef const uint8_t *pb = _rptr(b) if has_base else NULL
    cdef uint8_t *po = _wptr(o)
    cdef int rc
    with nogil:
        if has_base:
            if merge:
                rc = dck_merge_planes_xor(ps, pb, po, length, w, nt)
            else:
                rc = dck_xor_split_planes(ps, pb, po, length, w, nt)
        else:
            if merge:
                rc = dck_merge_planes(ps, po, length, w, nt)
            else:
                rc = dck_split_planes(ps, po, length, w, nt)
    _check(rc)
    return ret


def split_planes(src, width, out=None, threads=1):
    """Byte planes of width-byte elements; see deltackpt.kernel."""
    return _planes(src, None, width, out, threads, False)


def merge_planes(src, width, out=None, threads=1):
    """Inverse of split_planes."""
    return _planes(src, None, width, out, threads, True)


def xor_split_planes(src, base, width, out=None, threads=1):
    """split_planes(src XOR base) in one pass."""
    if base is None:
        raise TypeError("base must be a buffer, not None")
    return _planes(src, base, width, out, threads, False)


def merge_planes_xor(src, base, width, out=None, threads=1):
    """merge_planes(src) XOR base in one pass."""
    if base is None:
        raise TypeError("base must be a buffer, not None")
    return _planes(src, base, width, out, threads, True)


def decode_frames(frames, codecs, widths, out, digest=None, prediction=None):
    """Apply frames in order to ``out`` and check its digest; ``(status, bad)``; see deltackpt.kernel."""
    cdef Py_ssize_t n = len(frames)
    if n < 1 or len(codecs) != n or len(widths) != n:
        raise ValueError("decode_frames needs one or more frames, each with a codec and a width")
    cdef unsigned char[::1] o = _as_u8(out, writable=True)
    cdef dck_prediction pred
    cdef double pc_[7]
    cdef const uint8_t *pr_[3]
    cdef const unsigned char[::1] pv
    cdef Py_ssize_t j
    pviews = None
    if prediction is not None:  # (predictor, coefs, base, refs): checked as predict() checks them
        predictor, coefs, pbase, prefs = prediction
        pviews = [_as_u8(pbase)] + [_as_u8(r) for r in prefs]
        if (codecs[0] != 4 or o.shape[0] % 2 or not 1 <= len(prefs) <= 3 or not 2 <= len(coefs) <= 7
                or any(len(v) != o.shape[0] for v in pviews)):
            raise ValueError("deltackpt kernel: invalid argument")
        for j in range(len(coefs)):
            pc_[j] = coefs[j]
        for j in range(len(pviews)):
            pv = pviews[j]
            if _overlap(o, pv):
                raise ValueError("output buffer overlaps an input")
            if j:
                pr_[j - 1] = _rptr(pv)
        pv = pviews[0]
        pred.predictor = predictor
        pred.c = pc_
        pred.nc = len(coefs)
        pred.base = _rptr(pv)
        pred.refs = pr_
        pred.nrefs = len(prefs)
    cdef const unsigned char[::1] dg
    cdef const uint8_t *pdg = NULL
    if digest is not None:
        dg = _as_u8(digest)
        if dg.shape[0] != 16:
            raise ValueError(f"digest must have 16 bytes, got {dg.shape[0]}")
        pdg = &dg[0]
    views = [_as_u8(f) for f in frames]  # keeps every frame's buffer exported while the loop runs
    cdef const uint8_t **pf = <const uint8_t **>malloc(n * sizeof(uint8_t *))
    cdef size_t *pl = <size_t *>malloc(n * sizeof(size_t))
    cdef int *pc = <int *>malloc(n * sizeof(int))
    cdef int *pw = <int *>malloc(n * sizeof(int))
    cdef const unsigned char[::1] v
    cdef Py_ssize_t k
    cdef int rc, bad = 0
    cdef size_t raw_len = o.shape[0]
    cdef uint8_t *po = _wptr(o)
    try:
        if pf == NULL or pl == NULL or pc == NULL or pw == NULL:
            raise MemoryError()
        for k in range(n):
            v = views[k]
            pf[k] = _rptr(v)
            pl[k] = v.shape[0]
            pc[k] = codecs[k]
            pw[k] = widths[k]
            if _overlap(o, v):
                raise ValueError("output buffer overlaps a frame")
        if pviews is None:
            with nogil:
                rc = dck_decode_frames(pf, pl, pc, pw, <int>n, po, raw_len, pdg, &bad)
        else:
            with nogil:
                rc = dck_decode_predicted(pf, pl, pc, pw, <int>n, &pred, po, raw_len, pdg, &bad)
    finally:
        free(pf)
        free(pl)
        free(pc)
        free(pw)
    if rc == DCK_ENOMEM:
        raise MemoryError("deltackpt kernel: no memory for decoding scratch")
    _check(rc if rc == DCK_EINVAL else 0)
    return rc, bad


def predict(predictor, coefs, base, refs, out):
    """Write the prediction of ``predictor`` from ``coefs``, ``base`` and ``refs`` into ``out``; see
    deltackpt.kernel."""
    cdef unsigned char[::1] o = _as_u8(out, writable=True)
    cdef Py_ssize_t n = o.shape[0]
    cdef const unsigned char[::1] b = _as_u8(base)
    views = [_as_u8(r) for r in refs]
    cdef int nrefs = len(views)
    cdef int nc = len(coefs)
    if n % 2 or b.shape[0] != n or any(len(v) != n for v in views) or not 1 <= nrefs <= 3 or not 2 <= nc <= 7:
        raise ValueError("deltackpt kernel: invalid argument")
    cdef double c[7]
    cdef const uint8_t *pr[3]
    cdef const unsigned char[::1] v
    cdef int k, rc
    for k in range(nc):
        c[k] = coefs[k]
    for k in range(nrefs):
        v = views[k]
        pr[k] = _rptr(v)
        if _overlap(o, v):
            raise ValueError("output buffer overlaps an input")
    if _overlap(o, b):
        raise ValueError("output buffer overlaps an input")
    cdef const uint8_t *pb = _rptr(b)
    cdef uint8_t *po = _wptr(o)
    cdef int pred = predictor
    with nogil:
        rc = dck_predict(pred, c, nc, pb, pr, nrefs, po, <size_t>n)
    _check(rc)


#: levels of :func:`use_simd`: portable loops only; those and AVX2; any (AVX-512 where the CPU has it, the default)
SIMD_NONE, SIMD_AVX2, SIMD_ALL = 0, 1, 2


def use_simd(level):
    """Limit the kernel's run-time-chosen vector loops to ``level`` (``SIMD_NONE``, ``SIMD_AVX2`` or ``SIMD_ALL``,
    the default; ``True`` means ``SIMD_ALL`` and ``False`` ``SIMD_NONE``); returns the previous level. The
    results are identical at every level: tests use this to check the narrower loops on machines whose CPU would
    otherwise always take the widest. Native backend only."""
    if level is True or level is False:
        level = SIMD_ALL if level else SIMD_NONE
    if type(level) is not int or level not in (SIMD_NONE, SIMD_AVX2, SIMD_ALL):
        raise ValueError(f"use_simd: level must be 0, 1 or 2, got {level!r}")
    return dck_use_simd(level)
