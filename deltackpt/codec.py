"""The chunk codec: one chunk's raw bytes <-> one self-describing frame.

Where it sits: ``save`` hands every chunk the store does not hold yet to :meth:`Encoder.encode`, which returns
the frame appended to a pack; ``load`` gives :func:`decode_chain` a way to fetch frames, and it reads the
chunk's frame and those of its delta bases and turns them into the raw bytes (into a caller's buffer when one is
given) in one kernel call, verifying every frame checksum and, by default, the raw digest. :func:`decode` does
the same for one frame whose base the caller already holds.

Frame layout (little-endian, 64-byte header, then the payload; see ``docs/format.md``)::

    0   4   magic b"DCKF"
    4   1   format version (1; 2 for codec 4, which version-1 readers cannot decode; 3 for codec 4 with
            predictor 3, which version-2 readers cannot decode)
    5   1   codec id (0 raw, 1 zstd, 2 planes+zstd, 3 xor-delta+planes+zstd, 4 predicted)
    6   1   element width (1, 2, 4, 8)
    7   1   flags (0; readers reject other values)
    8   8   raw length
    16  8   stored (payload) length
    24  16  raw digest: canonical XXH3-128 of the raw bytes (the chunk id with the raw length)
    40  16  base digest: for codecs 3 and 4 the id of the base chunk (same raw length); zero otherwise
    56  8   checksum: XXH3-64 over header bytes 0..55 followed by the payload
    64  ..  payload; for codec 4: u32 record length L, the prediction record (L bytes, see
            :mod:`deltackpt.predict`), then zstd(byte planes(raw XOR prediction))

Decoding never allocates more than the raw length the frame records, and that length must equal what the
caller expects: a zstd payload whose declared content size differs, or that holds more than one zstd frame, is
rejected (by the native kernel before anything is decompressed, by either backend before any output is written;
see :func:`deltackpt.kernel.decode_frames`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
import zstandard

from deltackpt import config, kernel, predict
from deltackpt.errors import CorruptChunkError, FormatVersionError

MAGIC = b"DCKF"
FRAME_VERSION = 1
#: the version byte of predicted frames (codec 4): a version-1 reader refuses them as a newer format
PREDICTED_VERSION = 2
#: the version byte of predicted frames whose predictor version-2 readers do not know (momentum-param, §8a)
PREDICTED_V3 = 3
#: the version byte of predicted frames of bfloat16 elements (predictors 4 and 5, §8a), which version-3 readers do
#: not know
PREDICTED_V4 = 4
#: the version byte of predicted frames of the update-param predictor (6, §8a), which version-4 readers do not know
PREDICTED_V5 = 5
_VERSIONS = (FRAME_VERSION, PREDICTED_VERSION, PREDICTED_V3, PREDICTED_V4, PREDICTED_V5)
HEADER = struct.Struct("<4sBBBBQQ16s16sQ")
HEADER_SIZE = HEADER.size  # 64
CHECKED = 56  # header bytes covered by the checksum (everything before it)

RAW = 0
ZSTD = 1
PLANES_ZSTD = 2
DELTA = 3  # XOR with the base chunk, byte planes, zstd
PREDICTED = 4  # XOR with a prediction from the base and referenced chunks, byte planes, zstd
CODEC_NAMES = {RAW: "raw", ZSTD: "zstd", PLANES_ZSTD: "planes+zstd", DELTA: "delta", PREDICTED: "predicted"}
#: codecs whose frame names a base chunk
BASED = (DELTA, PREDICTED)
#: the longest prediction record (adam-param: 3 references, 7 coefficients), after its u32 length
RECORD_MAX = 8 + 16 * 3 + 8 * 7
#: how much of a frame names everything its decode needs: the header, then a predicted frame's record
REFS_PREFIX = HEADER.size + 4 + RECORD_MAX
NO_BASE = bytes(16)
#: Largest raw chunk a frame may declare; bounds any allocation a damaged frame could ask for.
MAX_RAW = 1 << 31
#: A delta frame at most this fraction of the raw size is kept without also trying the standalone encoding.
DELTA_GOOD_ENOUGH = 0.5
#: A predicted frame at most this fraction of the raw size is kept without also trying the delta and standalone
#: encodings. When the prediction holds, a predicted frame is far smaller (AdamW about 0.06, SGD momentum about
#: 0.01 of raw); a larger one may lose to them: weights rounded to a grid after each step (quantization-aware
#: training) predicted at 0.25 of raw while their XOR deltas took 0.04. At this threshold a predicted frame
#: kept untried wastes at most an eighth of its chunk.
PREDICTED_GOOD_ENOUGH = 0.125
#: A delta frame is kept over the standalone one only when at most this fraction of its size. Every load of the
#: chunk then also decodes the base's chain (about one more frame read and decompressed), which a saving of a
#: few percent does not pay for: AdamW's first moment, for one, changes too much per step for deltas to gain more
#: than 2-3%, and storing it standalone keeps restores short (docs/format.md, "Delta frames").
DELTA_MIN_GAIN = 0.9


@dataclass(frozen=True, slots=True)
class FrameHeader:
    codec: int
    width: int
    raw_len: int
    stored_len: int
    digest: bytes
    base: bytes
    checksum: int
    version: int = FRAME_VERSION

    @property
    def frame_len(self) -> int:
        return HEADER_SIZE + self.stored_len


def chunk_hex(digest: bytes, length: int) -> str:
    """Printable chunk id: 32 hex digits of the digest, ``-``, the raw length."""
    return f"{digest.hex()}-{length}"


_INPUTS = ("its delta base ", "its prediction input ")
_THROUGH = "through chunk "


def _root(reason: str) -> str:
    """The damage itself, without the chain of inputs it was reached through (``its delta base <id> is
    damaged: its prediction input <id> is damaged: ...``): a message names the input the chunk needs and what is
    wrong, however deep the damage lies (or however often a cycle went round). Where the damaged chunk is not
    that input but one it decodes from, the damage is named ``through chunk <id>: ...`` (a pack offset in it is
    that chunk's frame's, not the input's)."""
    while reason.startswith(_INPUTS) and " is damaged: " in reason:
        head, rest = reason.split(" is damaged: ", 1)
        if rest.startswith(_INPUTS) and " is damaged: " in rest:
            reason = rest
        elif rest.startswith(_THROUGH):
            return rest
        else:
            return f"{_THROUGH}{head.rsplit(' ', 1)[1]}: {rest}"
    return reason


def predicted_version(predictor: int) -> int:
    """The version byte of a predicted frame whose record names ``predictor`` (docs/format.md §3)."""
    if predictor >= predict.FIRST_V5_PREDICTOR:
        return PREDICTED_V5
    if predictor >= predict.FIRST_V4_PREDICTOR:
        return PREDICTED_V4
    return PREDICTED_V3 if predictor >= predict.FIRST_V3_PREDICTOR else PREDICTED_VERSION


def frame_checksum(header56: bytes | memoryview, payload: bytes | memoryview) -> int:
    h = xxhash.xxh3_64(header56)
    h.update(payload)
    return h.intdigest()


def _frame(codec: int, width: int, raw_len: int, digest: bytes, base: bytes, payload: bytes | memoryview,
           version: int = FRAME_VERSION) -> bytes:
    head = HEADER.pack(MAGIC, version, codec, width, 0, raw_len, len(payload), digest, base, 0)
    head56 = head[:CHECKED]
    return head56 + struct.pack("<Q", frame_checksum(head56, payload)) + payload


#: The largest byte-plane buffer an :class:`Encoder` keeps for its next chunk; the planes of a larger chunk are
#: freed once compressed. A save's workers each keep an encoder for as long as the store is open: a kept buffer
#: of a chunk's size pinned one chunk of memory per worker that ever encoded one between saves (512 MiB after a
#: save of 256 MiB chunks on 4 threads). The native kernel's decoding scratch has the same limit.
SCRATCH_KEEP = 16 << 20


#: zstd levels at which byte planes are compressed with :data:`PLANES_PARAMS` instead of the level's own
PLANES_TUNED_LEVELS = (1, 2)
#: Match finding for byte planes at the fast levels: matches of at least 7 bytes, a 256-entry hash table. Planes
#: of float data hold few real repeats, and level 1's finder (6-byte matches, 8K entries) takes many spurious
#: short ones, which cost more to decode than the literals they replace. On the AdamW states of
#: ``bench.delta`` (``python -m bench.planes_zstd``, docs/performance.md): standalone frames 0.823 -> 0.819 of raw, zstd
#: decoding 1.5× and encoding 2-3× as fast; residuals of predicted frames 0.064 -> 0.060 of raw, decoding 1.1×
#: as fast. Any parameters decode with any zstd decoder: the format does not change.
PLANES_PARAMS = {"min_match": 7, "hash_log": 8}
#: Byte planes of at least this many bytes each are compressed in zstd blocks of their own (the planes of a
#: chunk under 512 KiB are shorter than zstd's 128 KiB blocks). A block that held parts of several planes
#: Huffman-coded all of its literals with one table, fitted to none of them: the near-random low mantissa
#: bytes, which a block of their own stores raw, then decoded at a quarter of the speed, and the skewed
#: exponent plane lost its good code. Standalone frames of a 1.3M-parameter GPT's AdamW state: 64 KiB chunks
#: 0.911 -> 0.832 of raw and zstd decoding 51 -> 13 µs, 256 KiB chunks 0.876 -> 0.830 and 179 -> 47 µs (encoding
#: 1.2x as long); see docs/performance.md. Below this the calls cost more than they gain.
PLANE_BLOCKS_MIN = 1024
#: zstd's largest block (ZSTD_BLOCKSIZE_MAX), which its fast levels cut every frame into: planes of a multiple of
#: it (1 MiB chunks of float32) fall into blocks of their own already, and are compressed in one call (the
#: streaming calls that cut blocks elsewhere cost a 1 MiB chunk half as much time again)
ZSTD_BLOCK = 128 << 10


class Encoder:
    """Encodes chunks into frames. Not thread-safe: use one per thread (it owns zstd contexts and scratch)."""

    def __init__(self, level: int = 1) -> None:
        self.level = level
        self._cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
        # byte planes (and XOR residuals in byte planes); plain bytes keep the level's own match finding
        self._pctx = self._cctx
        if level in PLANES_TUNED_LEVELS:
            self._pctx = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
                compression_level=level, write_content_size=True, write_checksum=False, **PLANES_PARAMS))
        self._scratch = np.empty(0, dtype=np.uint8)

    def _planes(self, raw: memoryview, width: int, base: memoryview | None) -> memoryview:
        if len(raw) > SCRATCH_KEEP:  # (freed once compressed: see SCRATCH_KEEP)
            out = np.empty(len(raw), dtype=np.uint8)
        else:
            if len(self._scratch) < len(raw):
                self._scratch = np.empty(len(raw), dtype=np.uint8)
            out = self._scratch[: len(raw)]
        if base is None:
            kernel.split_planes(raw, width, out)
        else:
            kernel.xor_split_planes(raw, base, width, out)
        return memoryview(out)

    def _zstd_planes(self, cctx: zstandard.ZstdCompressor, planes: memoryview, width: int) -> bytes:
        """One zstd frame of byte planes (``width`` > 1), each plane in blocks of its own (see
        :data:`PLANE_BLOCKS_MIN`): the frame any zstd decoder reads, as :meth:`ZstdCompressor.compress` makes
        it (content size declared), only cut into blocks where the planes are."""
        n = len(planes)
        m = n // width
        if width == 1 or m < PLANE_BLOCKS_MIN or m % ZSTD_BLOCK == 0:  # (planes of whole blocks: they align)
            return cctx.compress(planes)
        co = cctx.compressobj(size=n)
        parts = []
        for k in range(width):  # (the last plane holds the n % width bytes past the whole elements, §3)
            parts.append(co.compress(planes[k * m : (k + 1) * m if k < width - 1 else n]))
            parts.append(co.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        parts.append(co.flush())
        return b"".join(parts)

    def encode(
        self,
        raw: memoryview | bytes | np.ndarray,
        digest: bytes,
        width: int,
        base: memoryview | bytes | np.ndarray | None = None,
        base_digest: bytes | None = None,
        *,
        try_alone: bool = True,
    ) -> bytes:
        """Return the smallest frame for ``raw`` among raw, (planes+)zstd and, with ``base``, the XOR delta.

        The delta wins only by a margin: it is kept when at most :data:`DELTA_MIN_GAIN` of the standalone
        frame's size. With a base and ``try_alone=False`` the standalone encoding is not tried (the caller knows
        deltas win for this tensor); it is always tried without a base.

        ``digest`` is the raw bytes' XXH3-128 (the caller computed it while naming chunks); ``width`` the
        element size used for byte planes (1 means plain zstd). ``base`` is the raw bytes of the chunk at the
        same position in the parent checkpoint and ``base_digest`` its digest.
        """
        raw = memoryview(raw).cast("B")
        n = len(raw)
        if n > MAX_RAW:
            raise ValueError(f"chunk of {n} bytes exceeds the frame limit of {MAX_RAW}")
        if width not in (1, 2, 4, 8):
            raise ValueError(f"element width must be 1, 2, 4 or 8, got {width}")
        best_codec, best, base_id = RAW, b"", NO_BASE
        cctx = self._pctx if width > 1 else self._cctx
        if base is not None:
            if base_digest is None or len(base_digest) != 16:
                raise ValueError("a delta base needs its 16-byte digest")
            base = memoryview(base).cast("B")
            if len(base) != n:
                raise ValueError(f"delta base has {len(base)} bytes, the chunk {n}")
            delta = self._zstd_planes(cctx, self._planes(raw, width, base), width)
            best_codec, best, base_id = DELTA, delta, base_digest
        # A delta this small is not beaten by a standalone encoding of float data: skip the second compression.
        if base is None or (try_alone and len(best) > n * DELTA_GOOD_ENOUGH):
            alone = self._zstd_planes(cctx, self._planes(raw, width, None), width) if width > 1 else cctx.compress(raw)
            if base is None or len(best) > len(alone) * DELTA_MIN_GAIN:
                best_codec, best, base_id = (PLANES_ZSTD if width > 1 else ZSTD), alone, NO_BASE
        if len(best) >= n:
            return _frame(RAW, width, n, digest, NO_BASE, raw)  # (no bytes(raw): one chunk-sized copy less)
        return _frame(best_codec, width, n, digest, base_id, best)

    def encode_predicted(
        self, raw: memoryview | bytes | np.ndarray, digest: bytes, width: int, prediction: memoryview | np.ndarray,
        base_digest: bytes, record: bytes,
    ) -> bytes:
        """Return the predicted frame (codec 4) of ``raw``: ``record`` (a packed
        :class:`deltackpt.predict.Prediction` naming the referenced chunks) and the residual ``raw XOR
        prediction`` in byte planes, zstd-compressed. ``prediction`` is what :func:`deltackpt.predict.predict`
        computes from ``base_digest``'s chunk and the record's references; the caller decides whether the frame
        beats the other encodings."""
        raw = memoryview(raw).cast("B")
        if len(raw) > MAX_RAW:
            raise ValueError(f"chunk of {len(raw)} bytes exceeds the frame limit of {MAX_RAW}")
        residual = self._zstd_planes(self._pctx, self._planes(raw, width, memoryview(prediction).cast("B")), width)
        payload = struct.pack("<I", len(record)) + record + residual
        return _frame(PREDICTED, width, len(raw), digest, base_digest, payload, predicted_version(record[0]))


def built_header(frame: bytes) -> tuple[int, bytes]:
    """(codec, base digest) of a frame this process's :class:`Encoder` just built: :func:`parse_header`'s checks are
    for frames read back, and cost a save of many small chunks more than their own index entries."""
    return frame[5], frame[40:56]


def parse_header(buf: bytes | memoryview, *, where: str | None = None) -> FrameHeader:
    """Parse and sanity-check a frame header (not the checksum, which needs the payload)."""
    if len(buf) < HEADER_SIZE:
        raise CorruptChunkError(f"truncated frame header ({len(buf)} of {HEADER_SIZE} bytes){_at(where)}")
    magic, version, codec, width, flags, raw_len, stored_len, digest, base, checksum = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptChunkError(f"bad frame magic {bytes(magic)!r}{_at(where)}")
    if version not in _VERSIONS:
        raise FormatVersionError(
            f"{_NEWER_FRAME} {version} is not supported (this reader: 1-{_VERSIONS[-1]}){_at(where)}")
    if codec not in CODEC_NAMES or width not in (1, 2, 4, 8) or flags != 0 or (version >= 2) != (codec == PREDICTED):
        raise CorruptChunkError(f"bad frame header (codec {codec}, width {width}, flags {flags}){_at(where)}")
    # (a prediction's elements, and so its residual's planes: float32, bfloat16 in version 4)
    if codec == PREDICTED and width != (want := 2 if version == PREDICTED_V4 else 4):
        raise CorruptChunkError(f"predicted frame of version {version} and width {width} (they have width "
                                f"{want}){_at(where)}")
    if raw_len > MAX_RAW or stored_len > MAX_RAW + 1024:
        raise CorruptChunkError(f"frame declares {raw_len} raw / {stored_len} stored bytes{_at(where)}")
    if codec == RAW and stored_len != raw_len:
        raise CorruptChunkError(f"raw frame stores {stored_len} bytes for {raw_len}{_at(where)}")
    if (codec in BASED) != (base != NO_BASE):
        raise CorruptChunkError(f"frame base digest does not match its codec{_at(where)}")
    return FrameHeader(codec, width, raw_len, stored_len, bytes(digest), bytes(base), checksum, version)


_NEWER_FRAME = "frame format version"


def _version_root(message: str) -> str:
    """What a newer frame's :class:`FormatVersionError` says, without the chunks it was reached through."""
    i = message.find(_NEWER_FRAME)
    return message[i:] if i >= 0 else message


def _at(where: str | None) -> str:
    return f" at {where}" if where else ""


def check_frame(
    frame: bytes | memoryview,
    *,
    expect_digest: bytes | None = None,
    expect_len: int | None = None,
    where: str | None = None,
) -> tuple[FrameHeader, memoryview]:
    """Check a frame's header, identity and checksum without decoding it; return (header, payload). ``frame`` is
    exactly the bytes its index entry spans: 64 + S, as its header says."""
    mv = memoryview(frame).cast("B")
    if len(mv) >= HEADER_SIZE and bytes(mv[:4]) == MAGIC:
        # the checksum first: a damaged byte anywhere (the version byte too) is damage, not a newer format
        stored_len, checksum = HEADER.unpack_from(mv)[6], HEADER.unpack_from(mv)[9]
        if stored_len <= MAX_RAW + 1024 and len(mv) >= HEADER_SIZE + stored_len:
            if frame_checksum(mv[:CHECKED], mv[HEADER_SIZE : HEADER_SIZE + stored_len]) != checksum:
                cid = expect_digest.hex() + f"-{expect_len}" if expect_digest is not None else None
                raise CorruptChunkError(f"frame checksum mismatch{_at(where)}", chunk_id=cid)
    h = parse_header(mv, where=where)
    cid = chunk_hex(h.digest, h.raw_len)
    if expect_digest is not None and h.digest != expect_digest:
        raise CorruptChunkError(
            f"frame holds chunk {cid}{_at(where)}, expected another",
            chunk_id=chunk_hex(expect_digest, expect_len or 0),
        )
    if expect_len is not None and h.raw_len != expect_len:
        raise CorruptChunkError(f"frame holds {h.raw_len} bytes, expected {expect_len}{_at(where)}", chunk_id=cid)
    if len(mv) < h.frame_len:
        raise CorruptChunkError(f"truncated frame ({len(mv)} of {h.frame_len} bytes){_at(where)}", chunk_id=cid)
    if len(mv) > h.frame_len:  # (the index entry's frame length is 64 + S: a longer one is damage of one or other)
        raise CorruptChunkError(f"frame of {h.frame_len} bytes where {len(mv)} were expected{_at(where)}",
                                chunk_id=cid)
    payload = mv[HEADER_SIZE : h.frame_len]
    if frame_checksum(mv[:CHECKED], payload) != h.checksum:
        raise CorruptChunkError(f"frame checksum mismatch{_at(where)}", chunk_id=cid)
    return h, payload


def decode(
    frame: bytes | memoryview,
    *,
    expect_digest: bytes | None = None,
    expect_len: int | None = None,
    out: memoryview | np.ndarray | None = None,
    base: memoryview | bytes | None = None,
    verify: bool = True,
    where: str | None = None,
) -> memoryview:
    """Decode ``frame`` and return the raw bytes (``out`` filled when given).

    ``expect_digest``/``expect_len`` are the chunk id the caller looked up; a frame for another chunk is
    corrupt. A delta frame needs ``base``: the raw bytes of the chunk named by its base digest (see
    :func:`parse_header`). ``verify`` re-hashes the result and compares it with the frame's digest.
    Raises :class:`CorruptChunkError` for any damage.
    """
    h = _parse(frame, expect_digest, expect_len, where)
    cid = chunk_hex(h.digest, h.raw_len)
    dest = _dest(out, h.raw_len, cid)
    if h.codec == PREDICTED:
        raise ValueError(f"predicted chunk {cid} decodes with decode_chain (it needs its referenced chunks)")
    if h.codec == DELTA:
        if base is None:
            raise ValueError(f"delta chunk {cid} needs its base {chunk_hex(h.base, h.raw_len)}")
        base = memoryview(base).cast("B")
        if len(base) != h.raw_len:
            check_frame(frame, where=where)  # a damaged length is damage, not the caller's mistake
            raise ValueError(f"delta base has {len(base)} bytes, chunk {cid} has {h.raw_len}")
        dest[:] = np.frombuffer(base, dtype=np.uint8)
    _run([frame], [h], [where], dest, verify)
    return memoryview(dest)


#: Frames one chunk's decoding may read (its own and its bases'): the longest chain the largest max_chain allows
#: (a delta of depth 64 is 65 frames), so only a damaged index (a cycle of bases) goes past it.
MAX_CHAIN_FRAMES = config.MAX_MAX_CHAIN + 1


def decode_chain(
    digest: bytes,
    raw_len: int,
    fetch: Callable[[bytes], tuple[bytes | memoryview, str | None]],
    *,
    out: memoryview | np.ndarray | None = None,
    verify: bool = True,
    resolve: Callable[[bytes], memoryview | np.ndarray] | None = None,
    have: Callable[[bytes], memoryview | np.ndarray | None] | None = None,
) -> memoryview:
    """Decode the chunk ``(digest, raw_len)`` with its chain of delta bases; return its raw bytes.

    ``fetch(digest)`` returns the frame of the chunk with that digest (and ``raw_len``) and a description of where
    it lies, or raises :class:`CorruptChunkError`. The chunk's frame is fetched first, then its base's while the
    frame is a delta, down to a keyframe or a predicted frame; then the frames are applied oldest first in one
    kernel call (:func:`deltackpt.kernel.decode_frames`: checksums, zstd, byte planes, XOR, and with ``verify``
    the digest of the result; the bases' own digests need no separate check, as any error in them changes the
    result). A predicted frame at the bottom of the chain has its prediction computed (as
    :func:`deltackpt.predict.predict` would, inside the same kernel call, a few KiB at a time just before its
    residual is XORed on) from chunks that ``resolve(digest)`` decodes in full: its base and its references; its
    checksum is checked by that call, or first where its record cannot be read or an input cannot be decoded, so
    that damage to the frame is reported as such. Damage to a base frame is reported for this chunk, naming the
    base: ``its delta base <id> is damaged``; damage to a predicted frame's base or reference likewise, as ``its
    prediction input <id> is damaged``. ``have(digest)``, when given, returns the raw bytes of a chunk the caller
    decoded already (or None): the chain stops at such a base, whose bytes the deltas above it are applied to,
    instead of decoding its frames (and a predicted base's inputs) again.
    """
    cid = chunk_hex(digest, raw_len)
    frames: list[bytes | memoryview] = []
    headers: list[FrameHeader] = []
    wheres: list[str | None] = []
    want = digest
    held: memoryview | np.ndarray | None = None
    while True:
        if len(frames) >= MAX_CHAIN_FRAMES:
            raise CorruptChunkError(f"delta chain is longer than {MAX_CHAIN_FRAMES} frames (a cycle?)", chunk_id=cid)
        try:
            frame, where = fetch(want)
            h = _parse(frame, want, raw_len, where)
        except CorruptChunkError as exc:
            if not frames:
                raise
            # The frame that named this base may be the damaged one (a flipped byte of its base digest names a
            # chunk that does not exist): report its own damage, where it lies, not a base that never was.
            try:
                check_frame(frames[-1], expect_digest=headers[-1].digest, expect_len=raw_len, where=wheres[-1])
            except CorruptChunkError as own:
                if len(frames) == 1:
                    raise CorruptChunkError(own.reason, chunk_id=cid) from None
                raise CorruptChunkError(f"its delta base {chunk_hex(headers[-1].digest, raw_len)} is damaged: "
                                        f"{_root(own.reason)}", chunk_id=cid) from None
            raise CorruptChunkError(
                f"its delta base {chunk_hex(want, raw_len)} is damaged: {_root(exc.reason)}", chunk_id=cid
            ) from None
        except FormatVersionError as exc:  # a newer writer's frame: not damage, but say whose
            base = f"its delta base {chunk_hex(want, raw_len)}: " if frames else ""
            raise FormatVersionError(f"chunk {cid}: {base}{_version_root(str(exc))}") from None
        frames.append(frame)
        headers.append(h)
        wheres.append(where)
        if h.codec != DELTA:
            break
        want = h.base
        held = have(want) if have is not None else None
        if held is not None:
            break
    dest = _dest(out, raw_len, cid)
    frames.reverse()
    headers.reverse()
    wheres.reverse()
    prediction = None
    if held is not None:
        dest[:] = np.frombuffer(memoryview(held).cast("B"), dtype=np.uint8)  # the base, decoded: deltas XOR onto it
    elif headers[0].codec == PREDICTED:
        prediction = _prediction(frames[0], headers[0], wheres[0], resolve, top=len(frames) == 1, cid=cid)
    _run(frames, headers, wheres, dest, verify, prediction)
    return memoryview(dest)


def decode_alone(
    frame: memoryview, digest: bytes, raw_len: int, where: str | None, out: memoryview | np.ndarray,
    verify: bool = True,
) -> bool:
    """:func:`decode_chain` of a chunk whose own frame (``frame``, read from ``where``) is at hand, when that frame
    stands alone (raw, zstd, byte planes): decoded into ``out``, raising as :func:`decode_chain` would, and True.
    False, with nothing written, when the frame is a delta or a predicted frame: those need their inputs, which
    :func:`decode_chain` fetches. A load's chunks are mostly such frames, and most of a small chunk's cost was
    the chain's machinery."""
    try:
        h = _parse(frame, digest, raw_len, where)
    except FormatVersionError as exc:  # (as decode_chain words it for a chunk's own frame)
        raise FormatVersionError(f"chunk {chunk_hex(digest, raw_len)}: {_version_root(str(exc))}") from None
    if h.codec == DELTA or h.codec == PREDICTED:
        return False
    dest = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8)
    if len(dest) != raw_len:
        raise ValueError(f"output buffer has {len(dest)} bytes, chunk {chunk_hex(digest, raw_len)} has {raw_len}")
    _run([frame], [h], [where], dest, verify)
    return True


def prediction_record(payload: bytes | memoryview, where: str | None = None,
                      version: int = PREDICTED_VERSION) -> predict.Prediction:
    """The prediction record at the start of a predicted frame's (checked) payload; ``version`` is the frame's,
    which must be the one its predictor takes."""
    n = int.from_bytes(payload[:4], "little") if len(payload) >= 4 else -1
    if n < 0 or n > len(payload) - 4:
        raise CorruptChunkError(f"predicted frame's record overruns its payload{_at(where)}")
    try:
        rec = predict.Prediction.unpack(payload[4 : 4 + n])
    except CorruptChunkError as exc:
        raise CorruptChunkError(f"{exc.reason}{_at(where)}") from None
    if predicted_version(rec.predictor) != version:
        raise CorruptChunkError(f"predictor {rec.predictor} in a frame of version {version}{_at(where)}")
    return rec


def _prediction(frame: bytes | memoryview, h: FrameHeader, where: str | None,
                resolve: Callable[[bytes], memoryview | np.ndarray] | None, *, top: bool,
                cid: str) -> tuple[int, tuple[float, ...], Any, list[Any]]:
    """The prediction of the predicted frame ``frame`` (whose length :func:`_parse` checked), as
    :func:`deltackpt.kernel.decode_frames` computes it: ``(predictor, coefs, base, refs)``, its inputs decoded.

    Its checksum is left to the kernel, which checks it before the frame is used, except where something goes
    wrong first: a record that cannot be read, an input that cannot be decoded. The checksum is then checked
    before reporting that, so that damage to the frame (its record naming a chunk that does not exist, say) is
    reported as damage to it, not as a bad record or a missing input. Checking it up front hashed every predicted
    frame twice."""

    def reported(exc: CorruptChunkError) -> CorruptChunkError:
        """``exc``, damage found in this frame, as this chunk's decode reports it."""
        if top:
            return CorruptChunkError(exc.reason, chunk_id=cid)
        return CorruptChunkError(f"its delta base {chunk_hex(h.digest, h.raw_len)} is damaged: {_root(exc.reason)}",
                                 chunk_id=cid)

    def checksum_damage() -> CorruptChunkError | None:
        """This frame's checksum mismatch, reported, when its checksum does not match."""
        try:
            check_frame(frame, expect_digest=h.digest, expect_len=h.raw_len, where=where)
        except CorruptChunkError as own:
            return reported(own)
        return None

    try:
        rec = prediction_record(memoryview(frame)[HEADER_SIZE : h.frame_len], where, h.version)
        if h.raw_len % h.width:  # predictions are of float32 (bfloat16) values, the frame's width
            raise CorruptChunkError(f"predicted frame of {h.raw_len} bytes, not a whole number of "
                                    f"{'bfloat16' if h.width == 2 else 'float32'} values{_at(where)}")
    except CorruptChunkError as exc:
        raise (checksum_damage() or reported(exc)) from None
    if resolve is None:  # (a damaged frame is damage, whatever the caller passed)
        raise checksum_damage() or ValueError(f"predicted chunk {chunk_hex(h.digest, h.raw_len)} needs a resolver "
                                              "for the chunks it references")
    inputs = []
    for ref in (h.base, *rec.refs):
        try:
            inputs.append(resolve(ref))
        except CorruptChunkError as exc:
            raise (checksum_damage() or CorruptChunkError(
                f"its prediction input {chunk_hex(ref, h.raw_len)} is damaged: {_root(exc.reason)}", chunk_id=cid
            )) from None
        except FormatVersionError as exc:
            own = checksum_damage()
            if own is not None:
                raise own from None
            raise FormatVersionError(f"chunk {cid}: its prediction input {chunk_hex(ref, h.raw_len)}: "
                                     f"{_version_root(str(exc))}") from None
    return rec.predictor, rec.coefs, inputs[0], inputs[1:]


def _parse(frame: bytes | memoryview, digest: bytes | None, raw_len: int | None, where: str | None) -> FrameHeader:
    """The header of ``frame``, checked against the expected identity and the frame's length. The checksum is
    left to the kernel, except when the header disagrees with what was expected: a damaged byte is then
    reported as a checksum mismatch (damage), not as a newer format or another chunk."""
    try:
        h = parse_header(frame, where=where)
    except (CorruptChunkError, FormatVersionError):
        check_frame(frame, expect_digest=digest, expect_len=raw_len, where=where)  # checksum first
        raise
    wrong = (digest is not None and h.digest != digest) or (raw_len is not None and h.raw_len != raw_len)
    if wrong or len(frame) != h.frame_len:
        check_frame(frame, expect_digest=digest, expect_len=raw_len, where=where)  # raises the precise error
    return h


def _dest(out: memoryview | np.ndarray | None, raw_len: int, cid: str) -> np.ndarray:
    if out is None:
        return np.empty(raw_len, dtype=np.uint8)
    dest = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8)
    if len(dest) != raw_len:
        raise ValueError(f"output buffer has {len(dest)} bytes, chunk {cid} has {raw_len}")
    return dest


_PAYLOAD_DAMAGE = {
    kernel.ECHECKSUM: "frame checksum mismatch",
    kernel.EPAYLOAD: "payload does not decode to the recorded length (bad zstd data)",
}


def _run(frames: list[bytes | memoryview], headers: list[FrameHeader], wheres: list[str | None], dest: np.ndarray,
         verify: bool, prediction: tuple[int, tuple[float, ...], Any, list[Any]] | None = None) -> None:
    """Apply parsed frames (oldest first) to ``dest`` in the kernel, the first frame's prediction computed there
    when given (:func:`_prediction`); map its status to the error to raise."""
    top = headers[-1]
    status, bad = kernel.decode_frames(
        [memoryview(f)[: h.frame_len] for f, h in zip(frames, headers)],
        [h.codec for h in headers],
        [h.width for h in headers],
        dest,
        top.digest if verify else None,
        prediction,
    )
    if status == 0:
        return
    cid = chunk_hex(top.digest, top.raw_len)
    if status == kernel.EDIGEST:
        raise CorruptChunkError(f"decoded bytes do not match the chunk id{_at(wheres[-1])}", chunk_id=cid)
    reason = f"{_PAYLOAD_DAMAGE.get(status, f'decoder status {status}')}{_at(wheres[bad])}"
    if bad == len(frames) - 1:
        raise CorruptChunkError(reason, chunk_id=cid)
    h = headers[bad]
    raise CorruptChunkError(f"its delta base {chunk_hex(h.digest, h.raw_len)} is damaged: {reason}", chunk_id=cid)
