"""Pure-Python reference backend of the chunk kernel (numpy + the ``xxhash`` package).

Sits under :mod:`deltackpt.kernel`. It is the scalar reference the native kernel is checked against: every
function here returns results bit-identical to its C counterpart in ``native/kernel.c``. It is used when the
extension is not built or when ``DELTACKPT_BACKEND=python``. ``threads`` is accepted for signature
compatibility and ignored (the work is done by numpy and xxhash, which release the GIL only in places).
"""

from __future__ import annotations

import numpy as np
import xxhash

DIGEST_SIZE = 16


def _as_u8(buf: object, writable: bool = False) -> np.ndarray:
    mv = memoryview(buf)  # type: ignore[arg-type]
    if not mv.c_contiguous:
        raise ValueError("kernel buffers must be C-contiguous")
    if writable and mv.readonly:
        raise ValueError("output buffer is read-only")
    arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)
    return arr


def chunk_digests(buf: object, chunk_size: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    data = _as_u8(buf)
    n = (len(data) + chunk_size - 1) // chunk_size
    digests = np.empty((n, DIGEST_SIZE), dtype=np.uint8)
    zero = np.empty(n, dtype=np.bool_)
    mv = memoryview(data)
    for i in range(n):
        piece = mv[i * chunk_size : (i + 1) * chunk_size]
        digests[i] = np.frombuffer(xxhash.xxh3_128_digest(piece), dtype=np.uint8)
        zero[i] = not np.any(data[i * chunk_size : (i + 1) * chunk_size])
    return digests, zero


def digest(buf: object) -> bytes:
    return xxhash.xxh3_128_digest(memoryview(_as_u8(buf)))


def _check(src: np.ndarray, out: np.ndarray, width: int) -> None:
    if width not in (1, 2, 4, 8):
        raise ValueError(f"element width must be 1, 2, 4 or 8, got {width}")
    if len(out) != len(src):
        raise ValueError(f"output length {len(out)} != input length {len(src)}")


def _out(src: np.ndarray, out: object | None) -> tuple[np.ndarray, object]:
    if out is None:
        arr = np.empty(len(src), dtype=np.uint8)
        return arr, arr
    return _as_u8(out, writable=True), out


def split_planes(src: object, width: int, out: object | None = None, threads: int = 1) -> object:
    s = _as_u8(src)
    o, ret = _out(s, out)
    _check(s, o, width)
    n = len(s) // width
    body = n * width
    o[:body] = s[:body].reshape(n, width).T.reshape(-1)
    o[body:] = s[body:]
    return ret


def merge_planes(src: object, width: int, out: object | None = None, threads: int = 1) -> object:
    s = _as_u8(src)
    o, ret = _out(s, out)
    _check(s, o, width)
    n = len(s) // width
    body = n * width
    o[:body] = s[:body].reshape(width, n).T.reshape(-1)
    o[body:] = s[body:]
    return ret


def xor_split_planes(
    src: object, base: object, width: int, out: object | None = None, threads: int = 1
) -> object:
    s = _as_u8(src)
    b = _as_u8(base)
    if len(b) != len(s):
        raise ValueError(f"base length {len(b)} != input length {len(s)}")
    return split_planes(np.bitwise_xor(s, b), width, out)


def merge_planes_xor(
    src: object, base: object, width: int, out: object | None = None, threads: int = 1
) -> object:
    s = _as_u8(src)
    b = _as_u8(base)
    if len(b) != len(s):
        raise ValueError(f"base length {len(b)} != input length {len(s)}")
    o, ret = _out(s, out)
    if np.may_share_memory(o, b):
        b = b.copy()  # the merge below overwrites o before base is read
    merge_planes(s, width, o)
    np.bitwise_xor(o, b, out=o)
    return ret


# Status codes of decode_frames (the C side's DCK_E* values).
ECHECKSUM = -2
EPAYLOAD = -3
EDIGEST = -4
_CODECS = (0, 1, 2, 3, 4)  # raw, zstd, planes+zstd, delta, predicted
_HEADER, _CHECKED = 64, 56


def _unzstd(payload: memoryview, raw_len: int) -> bytes | None:
    import zstandard

    try:
        params = zstandard.get_frame_parameters(payload)
        if params.content_size != raw_len:
            return None
        if raw_len == 0:  # (decompress() takes a frame that declares no content as whole even when cut short)
            d = zstandard.ZstdDecompressor().decompressobj()
            return b"" if d.decompress(payload) == b"" and d.eof and not d.unused_data else None
        # one pass into an output of the declared content size, checked above (as the C side does: no window
        # buffer, so the window the frame declares costs nothing); exactly one frame, nothing after it
        data = zstandard.ZstdDecompressor().decompress(payload, allow_extra_data=False)
    except zstandard.ZstdError:
        return None
    return data if len(data) == raw_len else None


def decode_frames(
    frames: list[object], codecs: list[int], widths: list[int], out: object, digest: bytes | None = None,
    prediction: tuple[int, object, object, list[object]] | None = None,
) -> tuple[int, int]:
    n = len(frames)
    if n < 1 or len(codecs) != n or len(widths) != n:
        raise ValueError("decode_frames needs one or more frames, each with a codec and a width")
    dst = _as_u8(out, writable=True)
    if digest is not None and len(digest) != DIGEST_SIZE:
        raise ValueError(f"digest must have 16 bytes, got {len(digest)}")
    views = [memoryview(_as_u8(f)) for f in frames]
    for k, (v, c, w) in enumerate(zip(views, codecs, widths)):
        if len(v) < _HEADER or c not in _CODECS or w not in (1, 2, 4, 8) or (c == 4 and k != 0):
            raise ValueError("deltackpt kernel: invalid argument")
    if prediction is not None:  # computed into out first, as predict() would (the native kernel: step by step)
        if codecs[0] != 4:
            raise ValueError("deltackpt kernel: invalid argument")
        predict(*prediction, out)
    raw_len = len(dst)
    for k, (v, c, w) in enumerate(zip(views, codecs, widths)):
        h = xxhash.xxh3_64(v[:_CHECKED])
        h.update(v[_HEADER:])
        if h.intdigest() != int.from_bytes(v[_CHECKED:_HEADER], "little"):
            return ECHECKSUM, k
        payload = v[_HEADER:]
        if c == 0:
            if len(payload) != raw_len:
                return EPAYLOAD, k
            dst[:] = np.frombuffer(payload, dtype=np.uint8)
            continue
        if c == 4:  # skip the prediction record (u32 length, record); dst holds the prediction
            rec = int.from_bytes(payload[:4], "little") if len(payload) >= 4 else -1
            if rec < 0 or rec > len(payload) - 4:
                return EPAYLOAD, k
            payload = payload[4 + rec :]
        data = _unzstd(payload, raw_len)
        if data is None:
            return EPAYLOAD, k
        if c == 1:
            dst[:] = np.frombuffer(data, dtype=np.uint8)
        elif c == 2:
            merge_planes(data, w, dst)
        else:
            merge_planes_xor(data, dst.copy(), w, dst)
    if digest is not None and xxhash.xxh3_128_digest(memoryview(dst)) != bytes(digest):
        return EDIGEST, n
    return 0, 0


_F32_MIN = 2.0**-126


def _f32_in(buf: object) -> np.ndarray:
    """float32 elements widened to float64, subnormals read as zeros of their sign."""
    bits = np.frombuffer(_as_u8(buf), dtype="<u4")
    sub = (bits & 0x7F800000) == 0
    if sub.any():
        bits = np.where(sub, bits & 0x80000000, bits)
    return bits.view("<f4").astype(np.float64)


def adam_w(c: tuple[float, ...] | list[float], m: np.ndarray, m1: np.ndarray, v1: np.ndarray) -> np.ndarray:
    """The predictors' second-moment estimate in float64: ``g = m - c0*m1; g*c1; g*g; g*c3; c2*v1 + g``."""
    g = m - c[0] * m1
    g *= c[1]
    g *= g
    g *= c[3]
    w = c[2] * v1
    w += g
    return w


#: a bfloat16 predictor's id is this plus its float32 predictor's (native/kernel.h, DCK_PREDICT_BF16): 4 and 5
_BF16 = 3
#: update-param, a float32 predictor (native/kernel.h, DCK_PREDICT_UPDATE_PARAM)
_UPDATE_PARAM = 6


def _round32(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to float32 as a prediction's result is (a zero of its sign below 2^-126, a NaN stays one),
    widened back to float64: update-param's first step (dck_round32)."""
    r = x.astype(np.float32).astype(np.float64)
    tiny = np.abs(x) < _F32_MIN
    r[tiny] = np.copysign(0.0, x[tiny])
    return r


def _sub_odd(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a - b`` rounded to odd (dck_sub_odd): exact when a double, else the neighbouring double whose last
    significand bit is 1, so that rounding it to float32 rounds the exact difference once. TwoSum gives the error
    ``e`` of ``s = a - b``; where it is not zero, an even ``s`` moves one unit towards ``e``."""
    s = a - b
    bb = s - a
    e = (a - (s - bb)) + (-b - bb)
    sb = s.view(np.uint64)
    fix = (e != 0) & ~np.isnan(e) & np.isfinite(s) & ((sb & np.uint64(1)) == 0)
    if fix.any():
        away = (sb ^ e.view(np.uint64)) >> np.uint64(63) == 0
        sb[fix] = np.where(away[fix], sb[fix] + np.uint64(1), sb[fix] - np.uint64(1))
    return s


def _bf16_widened(buf: object) -> np.ndarray:
    """The little-endian bfloat16 elements of ``buf`` as little-endian float32 bytes (16 zero bits appended)."""
    return (np.frombuffer(_as_u8(buf), dtype="<u2").astype("<u4") << 16).view(np.uint8)


def predict(predictor: int, coefs: object, base: object, refs: list[object], out: object) -> None:
    """Reference of the native ``dck_predict`` (see native/kernel.h): one numpy ufunc per double operation, in
    the same order, so both are correctly rounded IEEE operations with identical results."""
    o = _as_u8(out, writable=True)
    n = len(o)
    c = [float(x) for x in coefs]  # type: ignore[attr-defined]
    bf16 = predictor in (_BF16 + 1, _BF16 + 2)
    f32 = predictor - _BF16 if bf16 else predictor
    ok = (f32, len(c), len(refs)) in ((1, 4, 2), (2, 7, 3), (3, 3, 2), (_UPDATE_PARAM, 2, 1))
    size = 2 if bf16 else 4
    if n % size or not ok or len(_as_u8(base)) != n or any(len(_as_u8(r)) != n for r in refs):
        raise ValueError("deltackpt kernel: invalid argument")
    if bf16:  # bfloat16: the float32 predictor over the inputs widened, its result rounded to bfloat16
        wide = np.empty(2 * n, dtype=np.uint8)
        predict(f32, c, _bf16_widened(base), [_bf16_widened(r) for r in refs], wide)
        bits = wide.view("<u4")
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = (bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16
        o[:] = np.where(nan, 0x7FC0, rounded).astype("<u2").view(np.uint8)
        return
    with np.errstate(all="ignore"):
        m = _f32_in(refs[0])
        if predictor == _UPDATE_PARAM:  # q = f32(c0*p1); q - c1*u rounded once
            q = _sub_odd(_round32(c[0] * _f32_in(base)), c[1] * m)
        elif predictor == 3:  # q = c0*p1 - c1*b + c2*b1
            u = c[1] * m
            q = c[0] * _f32_in(base)
            q -= u
            q += c[2] * _f32_in(refs[1])
        elif predictor == 1:
            q = adam_w(c, m, _f32_in(refs[1]), _f32_in(base))
        else:
            d = np.sqrt(adam_w(c, m, _f32_in(refs[1]), _f32_in(refs[2])))
            d += c[6]
            u = m / d
            u *= c[5]
            q = c[4] * _f32_in(base)
            q -= u
        res = q.astype("<f4")
        bits = res.view("<u4")
        tiny = np.abs(q) < _F32_MIN
        if tiny.any():
            bits[tiny] = np.where(np.signbit(q[tiny]), 0x80000000, 0).astype("<u4")
        bits[np.isnan(q)] = 0x7FC00000
    o[:] = res.view(np.uint8)
