"""Clean-room conformance check of docs/format.md.

The reader below (everything above ``# ---- the test``) is written from the format specification alone: it uses
the standard library, numpy, zstandard, xxhash and lmdb, never ``deltackpt``. The test writes a store with
deltackpt (standalone, XOR delta and predicted frames of all five predictors, a keyframe save, a rewrite),
reads every checkpoint with the independent reader and compares each tensor's bytes, and the plain values of
the skeleton and metadata, with what ``Store.load`` returns.
"""

from __future__ import annotations

import base64
import collections
import fcntl
import json
import math
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import xxhash
import zstandard


class SpecDamage(Exception):
    """The store is not what docs/format.md says it is."""


class SpecNewer(Exception):
    """An intact object of a version this reader does not know."""


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise SpecDamage(what)


def digest128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


# ---- §2 / §6: the store, its index and the checkpoint records

U64 = struct.Struct(">Q")
CHUNK_ENTRY = struct.Struct("<16sQIBB16s")
FRAME_HEADER = struct.Struct("<4sBBBBQQ16s16sQ")
RECORD_FIELDS = {
    "id", "step", "created", "parent", "manifest_checksum", "logical_bytes", "written_bytes", "metadata", "seq",
    "extra",
}
HEADER_FIELDS = {
    "id", "step", "created", "parent", "chunk_size", "metadata", "logical_bytes", "written_bytes", "extra", "tree",
    "tensors",
}
ENTRY_FIELDS = {
    "key", "kind", "dtype", "shape", "nbytes", "width", "first", "count", "written", "requires_grad", "parameter",
    "device",
}
HEX32 = re.compile(r"[0-9a-f]{32}")
CKPT_ID = re.compile(r"[0-9a-f]{16}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _open_regular(path: Path) -> bytes:
    """Read a pack or manifest: open without blocking, check it is a regular file (§9)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise SpecDamage(f"{path}: {e}") from e
    try:
        _need(stat.S_ISREG(os.fstat(fd).st_mode), f"{path} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


class SpecStore:
    """A read-only reader of a deltackpt store built from docs/format.md only."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        store = json.loads((self.path / "STORE").read_text("utf-8"))
        _need(isinstance(store, dict) and store.get("format") == "deltackpt-store", "STORE format")
        _need(_is_int(store.get("version")) and _is_int(store.get("chunk_size")), "STORE field types")
        if store["version"] > 1:
            raise SpecNewer(f"store version {store['version']}")
        self.chunk_size = store["chunk_size"]
        _need(self._chunk_size_ok(self.chunk_size), "STORE chunk_size")
        # §7: readers hold gc.lock shared, so that no gc unlinks a pack under them
        self._gc_lock = open(self.path / "gc.lock", "rb")
        fcntl.flock(self._gc_lock, fcntl.LOCK_SH)
        # §6: LAST_COMMIT is read before the index's seq; a value that is not 1-20 digits or >= 2^62 is ignored
        last_commit = None
        try:
            text = (self.path / "LAST_COMMIT").read_bytes()
        except OSError:
            text = b""
        m = re.fullmatch(rb"([0-9]{1,20})\n?", text)
        if m and int(m.group(1)) < 2**62:
            last_commit = int(m.group(1))
        # a read-only opener still takes a reader slot in lock.mdb (§7)
        self.env = lmdb.open(str(self.path / "index"), readonly=True, max_dbs=5, subdir=True)
        self.db = {name: self.env.open_db(name.encode(), create=False) for name in
                   ("meta", "chunks", "ckpts", "ids", "steps")}
        with self.env.begin() as tx:
            _need(tx.get(b"format", db=self.db["meta"]) == b"1", "index format record")
            seq_raw = tx.get(b"seq", db=self.db["meta"])
        _need(seq_raw is not None and len(seq_raw) == 8, "index seq")
        self.seq = U64.unpack(seq_raw)[0]
        _need(last_commit is None or last_commit <= self.seq, "index older than LAST_COMMIT")
        self._cache: dict[tuple[bytes, int], bytes] = {}
        self.depths: dict[tuple[bytes, int], tuple[int, int]] = {}  # chunk: (actual depth, recorded depth)
        self.frame_kinds: collections.Counter[tuple[int, int]] = collections.Counter()  # (codec, version byte)
        self.predictors: collections.Counter[int] = collections.Counter()

    def close(self) -> None:
        self.env.close()
        self._gc_lock.close()

    @staticmethod
    def _chunk_size_ok(n: Any) -> bool:
        return _is_int(n) and 4096 <= n <= 2**30 and n & (n - 1) == 0

    # -- checkpoints

    def list_checkpoints(self) -> list[dict[str, Any]]:
        """Every committed record, in commit (seq) order, cross-checked against ids and steps."""
        out = []
        with self.env.begin() as tx:
            for key, value in tx.cursor(db=self.db["ckpts"]):
                _need(len(key) == 8, "ckpts key length")
                rec = json.loads(value)
                self._check_record(rec, U64.unpack(key)[0])
                out.append(rec)
            by_id = {bytes(k): bytes(v) for k, v in tx.cursor(db=self.db["ids"])}
            steps = [bytes(k) for k, _ in tx.cursor(db=self.db["steps"])]
        _need(len(by_id) == len(out) == len(steps), "ids/steps/ckpts sizes differ")
        for rec in out:
            _need(by_id.get(rec["id"].encode()) == U64.pack(rec["seq"]), f"ids entry of {rec['id']}")
            _need(U64.pack(rec["step"]) + U64.pack(rec["seq"]) in steps, f"steps entry of {rec['id']}")
        return out

    def _check_record(self, rec: Any, seq: int) -> None:
        _need(isinstance(rec, dict) and set(rec) == RECORD_FIELDS, "record fields")
        _need(rec["seq"] == seq, "record seq differs from its key")
        _need(isinstance(rec["id"], str) and CKPT_ID.fullmatch(rec["id"]) is not None, "record id")
        _need(_is_int(rec["step"]) and 0 <= rec["step"] < 2**63, "record step")
        _need(isinstance(rec["created"], (int, float)) and math.isfinite(rec["created"])
              and rec["created"] <= 253402300799, "record created")
        _need(rec["parent"] is None or (isinstance(rec["parent"], str) and CKPT_ID.fullmatch(rec["parent"])),
              "record parent")
        _need(isinstance(rec["manifest_checksum"], str) and HEX32.fullmatch(rec["manifest_checksum"]) is not None,
              "record manifest_checksum")
        for k in ("logical_bytes", "written_bytes"):
            _need(_is_int(rec[k]) and 0 <= rec[k] < 2**63, f"record {k}")
        _need(isinstance(rec["extra"], dict), "record extra")
        self._check_replaces(rec["extra"])
        if rec["metadata"] is not None:
            decode_node(rec["metadata"], version=1, metadata=True)

    @staticmethod
    def _check_replaces(extra: dict[str, Any]) -> None:
        if "replaces" in extra:
            r = extra["replaces"]
            _need(isinstance(r, list) and r and all(isinstance(i, str) and CKPT_ID.fullmatch(i) for i in r),
                  "extra.replaces")

    def resolve(self, *, step: int | None = None, ckpt_id: str | None = None) -> dict[str, Any]:
        """The record of an id (through `replaces` if it is gone), of the newest commit of a step, or the latest."""
        recs = self.list_checkpoints()
        _need(bool(recs), "no checkpoints")
        if ckpt_id is not None:
            for rec in recs:
                if rec["id"] == ckpt_id:
                    return rec
            for rec in recs:
                if ckpt_id in rec["extra"].get("replaces", []):
                    return rec
            raise KeyError(ckpt_id)
        if step is not None:
            recs = [r for r in recs if r["step"] == step]
            if not recs:
                raise KeyError(step)
        return max(recs, key=lambda r: r["seq"])

    # -- §5 manifests

    def read_manifest(self, rec: dict[str, Any]) -> dict[str, Any]:
        data = _open_regular(self.path / "manifests" / f"{rec['id']}.manifest")
        _need(len(data) >= 48 and data[:8] == b"DCKMANIF", "manifest magic")
        version, flags, hlen, n = struct.unpack_from("<IIQQ", data, 8)
        if version > 3:
            raise SpecNewer(f"manifest version {version}")
        _need(version >= 1 and flags == 0, "manifest version/flags")
        _need(len(data) == 32 + hlen + 17 * n + 16, "manifest length")
        _need(digest128(data[:-16]) == data[-16:], "manifest digest")
        _need(data[-16:].hex() == rec["manifest_checksum"], "manifest digest differs from the record's")
        header = json.loads(data[32:32 + hlen].decode("utf-8"))
        _need(isinstance(header, dict) and set(header) == HEADER_FIELDS, "manifest header fields")
        table = data[32 + hlen:32 + hlen + 16 * n]
        flag_bytes = data[32 + hlen + 16 * n:32 + hlen + 17 * n]
        _need(all(f & 0xFE == 0 for f in flag_bytes), "reserved chunk flag bit set")
        _need(header["id"] == rec["id"] and header["step"] == rec["step"], "manifest id/step differ from record")
        _need(self._chunk_size_ok(header["chunk_size"]), "manifest chunk_size")
        extra = header["extra"]
        _need(isinstance(extra, dict), "manifest extra")
        if "generation" in extra:
            _need(_is_int(extra["generation"]) and extra["generation"] >= 0, "extra.generation")
        self._check_replaces(extra)
        tensors = header["tensors"]
        _need(isinstance(tensors, list), "tensors")
        cs = header["chunk_size"]
        for e in tensors:
            _need(isinstance(e, dict) and set(e) == ENTRY_FIELDS, "tensor entry fields")
            _need(e["kind"] in ("torch", "numpy"), "entry kind")
            _need(isinstance(e["shape"], list) and all(_is_int(d) and d >= 0 for d in e["shape"]), "entry shape")
            itemsize, width = dtype_layout(e["kind"], e["dtype"])
            _need(e["nbytes"] == math.prod(e["shape"]) * itemsize, "entry nbytes")
            _need(e["width"] == width, f"entry width {e['width']} for {e['dtype']}")
            _need(_is_int(e["first"]) and _is_int(e["count"]) and e["first"] >= 0, "entry first/count")
            _need(e["count"] == -(-e["nbytes"] // cs) and e["first"] + e["count"] <= n, "entry chunk range")
            if e["kind"] == "numpy":
                _need((e["requires_grad"], e["parameter"], e["device"]) == (False, False, "cpu"), "numpy entry")
        _need(header["logical_bytes"] == sum(e["nbytes"] for e in tensors), "logical_bytes")
        _need(header["written_bytes"] == sum(e["written"] for e in tensors), "written_bytes")
        tree = decode_node(header["tree"], version=version, n_tensors=len(tensors), tensors=tensors)
        metadata = None
        if header["metadata"] is not None:
            metadata = decode_node(header["metadata"], version=1, metadata=True)
        return {
            "version": version, "header": header, "tree": tree, "metadata": metadata, "tensors": tensors,
            "required_version": required_version(header["tree"]),
            "chunks": [(table[16 * i:16 * i + 16], flag_bytes[i]) for i in range(n)],
        }

    def tensor_bytes(self, manifest: dict[str, Any], i: int) -> bytes:
        """Entry i's raw bytes, chunk by chunk, located through the index."""
        e = manifest["tensors"][i]
        cs = manifest["header"]["chunk_size"]
        parts = []
        for j in range(e["count"]):
            length = min(cs, e["nbytes"] - j * cs)
            dig, flag = manifest["chunks"][e["first"] + j]
            if flag & 1:
                chunk = bytes(length)
                _need(digest128(chunk) == dig, "zero chunk digest")  # 'need not check'; we do
            else:
                chunk = self.chunk(dig, length)
                _need(any(chunk), "an all-zero chunk without the zero flag")
            parts.append(chunk)
        out = b"".join(parts)
        _need(len(out) == e["nbytes"], "tensor length")
        return out

    # -- §3, §6, §8, §8a: frames and chunks

    def _frame(self, dig: bytes, raw_len: int) -> tuple[tuple[Any, ...], bytes, tuple[Any, ...]]:
        with self.env.begin() as tx:
            value = tx.get(dig + struct.pack(">I", raw_len), db=self.db["chunks"])
        _need(value is not None and len(value) == CHUNK_ENTRY.size, f"no index entry for {dig.hex()}-{raw_len}")
        entry = CHUNK_ENTRY.unpack(value)
        pack_id, offset, flen, _codec, _depth, _base = entry
        _need(16 <= offset < 2**62, "entry offset")
        _need(64 <= flen <= 64 + raw_len + raw_len // 64 + 4096, "entry frame length")
        with open(self.path / "packs" / f"{pack_id.hex()}.pack", "rb") as f:
            _need(stat.S_ISREG(os.fstat(f.fileno()).st_mode), "pack is not a regular file")
            frame = os.pread(f.fileno(), flen, offset)
        _need(len(frame) == flen, "frame cut short")
        hdr = FRAME_HEADER.unpack_from(frame)
        magic, version, codec, width, flags, r, s, raw_dig, base_dig, checksum = hdr
        _need(magic == b"DCKF", "frame magic")
        _need(flen == 64 + s, "frame length differs from the index entry's")
        _need(xxhash.xxh3_64_intdigest(frame[:56] + frame[64:]) == checksum, "frame checksum")
        if codec in (0, 1, 2, 3) and version != 1 or codec == 4 and version not in (2, 3, 4):
            if version > 4:
                raise SpecNewer(f"frame version {version}")
            raise SpecDamage("frame version/codec")
        _need(codec <= 4 and width in (1, 2, 4, 8) and flags == 0, "frame codec/width/flags")
        _need((base_dig == bytes(16)) == (codec <= 2), "base digest zero exactly for codecs 0-2")
        _need(s == r if codec == 0 else (s <= 2**31 + 1024 and r <= 2**31), "S for the codec")
        _need(r == raw_len and raw_dig == dig, "frame is not the chunk looked up")
        return hdr, frame[64:], entry

    def chunk(self, dig: bytes, raw_len: int, nesting: int = 0) -> bytes:
        key = (dig, raw_len)
        if key not in self._cache:
            _need(nesting <= 65, "prediction inputs nest too deep")
            out, _ = self._decode(dig, raw_len, nesting, 0)
            _need(digest128(out) == dig, f"chunk {dig.hex()}-{raw_len} decodes to other bytes")
            self._cache[key] = out
        return self._cache[key]

    def _decode(self, dig: bytes, raw_len: int, nesting: int, links: int) -> tuple[bytes, int]:
        """The chunk's bytes (not yet re-hashed) and its actual chain depth (§6).

        §8's two counts: `links`, the frames of one chain of base links, and `nesting`, prediction inputs (a
        predicted frame's base and references) within inputs; each at most 65.
        """
        _need(links < 65 and nesting <= 65, "delta chain or prediction nesting deeper than 65")
        hdr, payload, entry = self._frame(dig, raw_len)
        version, codec, s, base_dig = hdr[1], hdr[2], hdr[6], hdr[8]
        self.frame_kinds[codec, version] += 1
        # what verify checks: the index entry names the frame's codec and base
        _need(entry[3] == codec and entry[5] == base_dig, "index entry's codec/base differ from the frame's")
        _need(codec == 0 or s < raw_len, "an encoded frame not smaller than raw")  # writers MUST choose raw
        out, depth = self._decode_payload(hdr, payload, raw_len, nesting, links)
        self.depths[dig, raw_len] = (depth, entry[4])
        return out, depth

    def _decode_payload(self, hdr: tuple[Any, ...], payload: bytes, raw_len: int, nesting: int,
                        links: int) -> tuple[bytes, int]:
        version, codec, width, base_dig = hdr[1], hdr[2], hdr[3], hdr[8]
        if codec == 0:
            return payload, 0
        if codec == 1:
            return zstd_exact(payload, raw_len), 0
        if codec == 2:
            return unplanes(zstd_exact(payload, raw_len), width), 0
        if codec == 3:
            base, depth = self._decode(base_dig, raw_len, nesting, links + 1)
            return xor(unplanes(zstd_exact(payload, raw_len), width), base), depth + 1
        # codec 4: predicted
        size = 2 if version == 4 else 4  # (bfloat16 or float32 elements)
        _need(width == size and raw_len % size == 0, "predicted frame width / length")
        _need(len(payload) >= 4, "predicted payload")
        (rec_len,) = struct.unpack_from("<I", payload)
        _need(len(payload) >= 4 + rec_len, "predicted payload shorter than its record")
        predictor, refs, coefs = parse_record(payload[4:4 + rec_len])
        _need(version == {1: 2, 2: 2, 3: 3, 4: 4, 5: 4}[predictor], "predictor does not match the frame version")
        self.predictors[predictor] += 1
        base, depth = self._decode(base_dig, raw_len, nesting + 1, 0)
        inputs = [self.chunk(r, raw_len, nesting + 1) for r in refs]
        depth = max([depth] + [self.depths[r, raw_len][0] for r in refs])
        pred = predict(predictor, coefs, base, inputs)
        return xor(unplanes(zstd_exact(payload[4 + rec_len:], raw_len), size), pred), depth + 1


def zstd_exact(data: bytes, raw_len: int) -> bytes:
    """Exactly one zstd frame, declaring content size R, nothing before or after it."""
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise SpecDamage(f"zstd frame header: {e}") from e
    _need(params.content_size == raw_len, "zstd frame does not declare R")
    _need(params.window_size <= 2**27, "zstd window above 2^27")  # we decode with a window buffer
    obj = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = obj.decompress(data)
    except zstandard.ZstdError as e:
        raise SpecDamage(f"zstd: {e}") from e
    _need(obj.eof and not obj.unused_data and len(out) == raw_len, "not exactly one zstd frame of R bytes")
    return out


def unplanes(data: bytes, w: int) -> bytes:
    """Invert §3's byte planes: input byte i*w+k = plane byte k*m+i; the n mod w trailing bytes follow."""
    if w == 1:
        return data
    m = len(data) // w
    a = np.frombuffer(data, np.uint8)
    return a[:m * w].reshape(w, m).T.tobytes() + data[m * w:]


def xor(a: bytes, b: bytes) -> bytes:
    _need(len(a) == len(b), "xor lengths")
    return (np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)).tobytes()


PREDICTORS = {1: (2, 4), 2: (3, 7), 3: (2, 3), 4: (2, 4), 5: (3, 7)}  # predictor: (references, coefficients)


def parse_record(rec: bytes) -> tuple[int, list[bytes], list[float]]:
    _need(len(rec) >= 8, "prediction record")
    predictor, n, c, reserved = struct.unpack_from("<BBHI", rec)
    _need(predictor in PREDICTORS and PREDICTORS[predictor] == (n, c), "predictor / n / c")
    _need(reserved == 0 and len(rec) == 8 + 16 * n + 8 * c, "record reserved / length")
    refs = [rec[8 + 16 * i:24 + 16 * i] for i in range(n)]
    coefs = list(struct.unpack_from(f"<{c}d", rec, 8 + 16 * n))
    for x in coefs:
        _need(math.isfinite(x) and (x == 0 or 2.0**-60 <= abs(x) <= 2.0**60), f"coefficient {x!r}")
    return predictor, refs, coefs


def _f32_in(b: bytes) -> np.ndarray:
    a = np.frombuffer(b, "<f4")
    with np.errstate(invalid="ignore"):  # (a signalling NaN widens to a quiet one: any NaN gives 0x7FC00000)
        a = np.where((a != 0) & (np.abs(a) < np.float32(2.0**-126)), np.copysign(np.float32(0), a), a)
        return a.astype(np.float64)


def _f32_out(q: np.ndarray) -> bytes:
    with np.errstate(over="ignore", invalid="ignore"):
        out = q.astype("<f4")
        tiny = np.abs(q) < 2.0**-126
    out = np.where(tiny, np.copysign(np.float32(0), q).astype("<f4"), out)
    bits = out.view("<u4").copy()
    bits[np.isnan(q)] = 0x7FC00000
    return bits.tobytes()


def _bf16_to_f32(b: bytes) -> bytes:
    """§8a: a bfloat16 element widened to float32 by appending 16 zero bits."""
    return (np.frombuffer(b, "<u2").astype("<u4") << 16).astype("<u4").tobytes()


def _f32_to_bf16(b: bytes) -> bytes:
    """§8a: a float32 result rounded to bfloat16, to nearest even on the 16 bits dropped; NaN to 0x7FC0."""
    out = []
    for (bits,) in struct.iter_unpack("<I", b):
        if bits & 0x7FFFFFFF > 0x7F800000:
            out.append(0x7FC0)
        else:
            out.append(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)
    return struct.pack(f"<{len(out)}H", *out)


def predict(predictor: int, c: list[float], base: bytes, refs: list[bytes]) -> bytes:
    """§8a: each step one binary64 operation, in the order written; inputs flushed, output rounded to float32
    (predictors 4 and 5: 1 and 2 over the inputs widened from bfloat16, the result rounded to bfloat16)."""
    if predictor in (4, 5):
        wide = predict(predictor - 3, c, _bf16_to_f32(base), [_bf16_to_f32(r) for r in refs])
        return _f32_to_bf16(wide)
    x = [np.float64(v) for v in c]
    b = _f32_in(base)
    r = [_f32_in(v) for v in refs]
    with np.errstate(all="ignore"):
        if predictor in (1, 2):
            m, m1 = r[0], r[1]
            v1 = b if predictor == 1 else r[2]
            g = m - x[0] * m1
            g = g * x[1]
            g = g * g
            g = g * x[3]
            w = x[2] * v1
            w = w + g
            if predictor == 1:
                return _f32_out(w)
            d = np.sqrt(w)
            d = d + x[6]
            u = m / d
            u = u * x[5]
            q = x[4] * b
            q = q - u
            return _f32_out(q)
        bb, b1 = r
        q = x[0] * b
        u = x[1] * bb
        q = q - u
        u = x[2] * b1
        q = q + u
        return _f32_out(q)


# ---- §5 skeleton and Appendix A dtypes

TORCH_DTYPES = {  # name: (item size, width)
    **{n: (8, 8) for n in ("float64", "int64", "uint64")},
    **{n: (4, 4) for n in ("float32", "int32", "uint32")},
    **{n: (2, 2) for n in ("float16", "bfloat16", "int16", "uint16", "bits16")},
    "complex128": (16, 8), "complex64": (8, 4), "complex32": (4, 2),
    **{n: (1, 1) for n in ("int8", "uint8", "bool", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                           "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits1x8", "bits2x4",
                           "bits4x2")},
    **{f"{p}int{i}": (1, 1) for p in ("", "u") for i in range(1, 8)},
}
QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


def _width(itemsize: int, complex_: bool) -> int:
    half = itemsize // 2 if complex_ else itemsize
    return next(w for w in (8, 4, 2, 1) if half % w == 0)


def dtype_layout(kind: str, name: Any) -> tuple[int, int]:
    _need(isinstance(name, str), "dtype name")
    if kind == "torch":
        _need(name not in QUANTIZED, "quantized tensor entry")
        _need(name in TORCH_DTYPES, f"unknown torch dtype {name}")
        return TORCH_DTYPES[name]
    m = re.fullmatch(r"([<>|=])([biufc])([0-9]+)", name)
    _need(m is not None, f"numpy dtype {name}")
    size = int(m.group(3))
    return size, _width(size, m.group(2) == "c")


class TensorRef:
    def __init__(self, tag: str, index: int) -> None:
        self.tag, self.index = tag, index


class Tagged:
    """A value the reader keeps symbolic (dtype, device, Size, numpy scalar)."""

    def __init__(self, tag: str, value: Any) -> None:
        self.tag, self.value = tag, value


INT_TEXT = re.compile(r"-?(0|[1-9][0-9]*)")
V2_TAGS = {"c", "S", "F", "C", "q", "D"}
HASHABLE_TAGS = {"N", "b", "i", "f", "s", "y", "c", "ns", "dt", "dv"}
FACTORIES = {
    "int": int, "float": float, "complex": complex, "bool": bool, "str": str, "bytes": bytes, "list": list,
    "tuple": tuple, "dict": dict, "set": set, "frozenset": frozenset, "OrderedDict": collections.OrderedDict,
    "Counter": collections.Counter, "deque": collections.deque,
}


def _hex(text: Any, size: int) -> bytes:
    _need(isinstance(text, str) and re.fullmatch(f"[0-9a-f]{{{2 * size}}}", text) is not None, "hex text")
    return bytes.fromhex(text)


def _key_ok(node: Any, version: int) -> bool:
    if version == 1:
        return node[0] in ("s", "i")
    if node[0] in ("t", "F"):
        return all(_key_ok(k, version) for k in (node[1]))
    return node[0] in HASHABLE_TAGS


def decode_node(node: Any, *, version: int, metadata: bool = False, n_tensors: int = 0,
                tensors: list[dict[str, Any]] | None = None) -> Any:
    def go(nd: Any, allow_refs: bool) -> Any:
        _need(isinstance(nd, list) and nd and isinstance(nd[0], str), "skeleton node")
        tag, args = nd[0], nd[1:]
        if tag in V2_TAGS:
            _need(version >= 2, f"version-2 node {tag} in a version-{version} skeleton")
        if tag == "N":
            _need(not args, "N")
            return None
        if tag == "b":
            _need(len(args) == 1 and isinstance(args[0], bool), "b")
            return args[0]
        if tag == "i":
            _need(len(args) == 1 and isinstance(args[0], str) and INT_TEXT.fullmatch(args[0]) is not None
                  and args[0] != "-0", "i text")
            return int(args[0])
        if tag == "f":
            _need(len(args) == 1, "f")
            return struct.unpack(">d", _hex(args[0], 8))[0]
        if tag == "c":
            _need(len(args) == 2, "c")
            return complex(struct.unpack(">d", _hex(args[0], 8))[0], struct.unpack(">d", _hex(args[1], 8))[0])
        if tag == "s":
            _need(len(args) == 1 and isinstance(args[0], str), "s")
            return args[0]
        if tag == "y":
            _need(len(args) == 1 and isinstance(args[0], str), "y")
            return base64.b64decode(args[0], validate=True)
        if tag in ("d", "o", "C"):
            _need(len(args) in ((2, 3) if tag == "o" else (2,)), f"{tag} arity")
            _need(version >= 3 or len(args) == 2, "o attribute in a manifest below version 3")
            keys, values = args[0], args[1]
            _need(isinstance(keys, list) and isinstance(values, list) and len(keys) == len(values), "dict")
            for k in keys:
                _need(isinstance(k, list) and bool(k) and _key_ok(k, version), "dict key")
            cls = {"d": dict, "o": collections.OrderedDict, "C": collections.Counter}[tag]
            out = cls()
            for k, v in zip(keys, values):
                out[go(k, allow_refs)] = go(v, allow_refs)
            if len(args) == 3:
                out._metadata = go(args[2], False)  # type: ignore[attr-defined]
            return out
        if tag == "D":
            _need(len(args) == 3 and (args[0] is None or args[0] in FACTORIES), "D")
            out = collections.defaultdict(None if args[0] is None else FACTORIES[args[0]])
            _need(len(args[1]) == len(args[2]), "D lengths")
            for k, v in zip(args[1], args[2]):
                _need(_key_ok(k, version), "D key")
                out[go(k, allow_refs)] = go(v, allow_refs)
            return out
        if tag in ("l", "t", "S", "F"):
            _need(len(args) == 1 and isinstance(args[0], list), tag)
            if tag in ("S", "F"):
                for v in args[0]:
                    _need(_key_ok(v, 2), "set element")
            items = [go(v, allow_refs) for v in args[0]]
            return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
        if tag == "q":
            _need(len(args) == 2 and (args[1] is None or (_is_int(args[1]) and args[1] >= 0)), "q")
            return collections.deque([go(v, allow_refs) for v in args[0]], args[1])
        if tag in ("T", "A"):
            _need(not metadata and allow_refs, "tensor reference where none may be")
            _need(len(args) == 1 and _is_int(args[0]) and 0 <= args[0] < n_tensors, tag)
            assert tensors is not None
            _need(tensors[args[0]]["kind"] == ("torch" if tag == "T" else "numpy"), "T/A kind mismatch")
            return TensorRef(tag, args[0])
        if tag == "dt":
            _need(len(args) == 1 and isinstance(args[0], str) and args[0].isidentifier(), "dt")
            _need(args[0] not in QUANTIZED or version >= 3, "quantized dt below version 3")
            return Tagged("dt", args[0])
        if tag == "dv":
            _need(len(args) == 1 and isinstance(args[0], str), "dv")
            return Tagged("dv", args[0])
        if tag == "sz":
            _need(len(args) == 1 and isinstance(args[0], list) and all(_is_int(d) for d in args[0]), "sz")
            return Tagged("sz", list(args[0]))
        if tag == "ns":
            _need(len(args) == 2, "ns")
            size, _ = dtype_layout("numpy", args[0])
            return Tagged("ns", (args[0], _hex(args[1], size)))
        if tag in ("x", "p"):
            _need(not metadata, f"{tag} node in metadata")
            raise SpecNewer(f"{tag} node: this reader has no decoder / does not unpickle")
        raise SpecDamage(f"unknown skeleton tag {tag!r}")

    return go(node, True)


def required_version(node: Any) -> int:
    """The lowest manifest version whose nodes the skeleton holds (§5)."""
    tag, args = node[0], node[1:]
    v, children = 1, []
    if tag in V2_TAGS:
        v = 2
    if tag in ("d", "o", "C", "D"):
        keys, values = (args[1], args[2]) if tag == "D" else (args[0], args[1])
        if any(k[0] not in ("s", "i") for k in keys):
            v = 2
        children = keys + values + ([args[2]] if tag == "o" and len(args) == 3 else [])
        if tag == "o" and len(args) == 3:
            v = 3
    elif tag in ("l", "t", "S", "F", "q"):
        children = args[0]
    elif tag == "x":
        children = [args[1]]
    elif tag == "dt" and args[0] in QUANTIZED:
        v = 3
    return max([v] + [required_version(c) for c in children])


# ---- the test (deltackpt is used only to write the store and to get the expected values)

import pytest  # noqa: E402
import torch  # noqa: E402


def _write_store(path: Path) -> None:
    import deltackpt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sgd_model = torch.nn.Linear(64, 64)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    bf16_model = torch.nn.Linear(64, 64).bfloat16()  # (its AdamW state is bfloat16: predictors 4 and 5)
    bf16_opt = torch.optim.AdamW(bf16_model.parameters(), lr=1e-3)
    store = deltackpt.Store(path, chunk_size=4096, max_chain=3)
    x = torch.randn(256, 64)
    drift = torch.arange(3000, dtype=torch.int32)
    plain = {
        "s": "hé", "f": -0.0, "nan": float("nan"), "n": None, "b": True, "y": b"\x00\xff",
        "l": [1, 2, (3, "x")], 7: -12345678901234567890, "c": complex(1.5, -2), "set": {1, 2},
        "fs": frozenset({"a"}), "cnt": collections.Counter({"a": 3}), "dq": collections.deque([1, 2], maxlen=3),
        "dd": collections.defaultdict(list, {"k": [1]}), (1, "t"): "tuple key", "dt": torch.float16,
        "dv": torch.device("cpu"), "sz": torch.Size([2, 3]), "ns": np.float32(2.5), "nsb": np.array(7, ">i4")[()],
    }
    first_id = None
    for step in range(1, 11):
        for mm, oo in ((model, opt), (sgd_model, sgd), (bf16_model, bf16_opt)):
            oo.zero_grad()
            mm(x.to(next(mm.parameters()).dtype)).float().pow(2).mean().backward()
            oo.step()
        drift[step * 50:step * 50 + 40] += 1  # a slowly changing tensor: XOR deltas
        state = {
            "model": model.state_dict(), "optim": opt.state_dict(), "sgd_model": sgd_model.state_dict(),
            "sgd": sgd.state_dict(), "bf16_model": bf16_model.state_dict(), "bf16_optim": bf16_opt.state_dict(),
            "zeros": torch.zeros(3000), "i64": torch.arange(1000),
            "drift": drift.clone(), "bf": torch.randn(700).bfloat16(), "half": torch.randn(33).half(),
            "np": np.arange(500, dtype=">f8"), "np_c": np.arange(10, dtype="<c8"), "empty": torch.zeros(0),
            "tied": [model[0].weight.detach()] * 2, "plain": plain, "step": step,
            "param": model[2].bias, "u8": (torch.arange(5000) % 7).to(torch.uint8), "c64": torch.ones(300) * 1j,
            "transposed": model[2].weight.detach().t(), "": {"": torch.ones(3)},
        }
        info = store.save(state, step=step, metadata={"loss": 0.5 / step, "tag": "t", "n": step},
                          keyframe=(step == 6))
        if step == 1:
            first_id = info.id
    # a rewrite (a new id replacing step 3, entries re-pointed to standalone frames)
    old = store.load(step=3)
    store.rewrite({"model": old["model"], "step": 3}, id=store.list()[2].id)
    assert first_id is not None
    store.close()


def _torch_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(got: Any, want: Any, man: dict[str, Any], reader: SpecStore, path: str) -> None:
    """Compare what the spec reader decoded with what Store.load returned, bit for bit."""
    if isinstance(got, TensorRef):
        # two references to one entry restore as one object (§5)
        assert man.setdefault("objects", {}).setdefault(got.index, want) is want, path
        e = man["tensors"][got.index]
        data = reader.tensor_bytes(man, got.index)
        if got.tag == "T":
            assert isinstance(want, torch.Tensor), path
            assert str(want.dtype) == f"torch.{e['dtype']}" and list(want.shape) == e["shape"], path
            assert want.requires_grad == e["requires_grad"] and str(want.device) == e["device"], path
            assert isinstance(want, torch.nn.Parameter) == e["parameter"], path
            assert _torch_bytes(want) == data, path
        else:
            assert isinstance(want, np.ndarray), path
            assert want.dtype.str == e["dtype"] and list(want.shape) == e["shape"], path
            assert np.ascontiguousarray(want).tobytes() == data, path
        return
    if isinstance(got, Tagged):
        if got.tag == "dt":
            assert want == getattr(torch, got.value), path
        elif got.tag == "dv":
            assert str(want) == got.value, path
        elif got.tag == "sz":
            assert isinstance(want, torch.Size) and list(want) == got.value, path
        else:
            dtype, raw = got.value
            assert isinstance(want, np.generic) and want.dtype.str == dtype and want.tobytes() == raw, path
        return
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(got, float):
        assert struct.pack(">d", got) == struct.pack(">d", want), path
    elif isinstance(got, complex):
        assert struct.pack(">dd", got.real, got.imag) == struct.pack(">dd", want.real, want.imag), path
    elif isinstance(got, dict):
        assert list(got) == list(want), path
        for k in got:
            _same(got[k], want[k], man, reader, f"{path}[{k!r}]")
        if isinstance(got, collections.defaultdict):
            assert got.default_factory is want.default_factory, path
        if hasattr(got, "_metadata") or hasattr(want, "_metadata"):
            _same(got._metadata, want._metadata, man, reader, f"{path}._metadata")
    elif isinstance(got, (list, tuple, collections.deque)):
        assert len(got) == len(want), path
        if isinstance(got, collections.deque):
            assert got.maxlen == want.maxlen, path
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, man, reader, f"{path}[{i}]")
    else:
        assert got == want, path


@pytest.fixture(scope="module")
def spec_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "store"
    _write_store(path)
    return path


def test_independent_reader_matches_load(spec_store: Path) -> None:
    import deltackpt

    # py-lmdb opens an environment once per process: read the index, then load with deltackpt, then compare
    reader = SpecStore(spec_store)
    recs = reader.list_checkpoints()
    seq = reader.seq
    reader.close()
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert [r["seq"] for r in recs] == sorted(r["seq"] for r in recs) and recs[-1]["seq"] <= seq
    rewritten = [r for r in recs if "replaces" in r["extra"]]
    assert len(rewritten) == 1 and rewritten[0]["step"] == 3
    chosen = [recs[-1], recs[0], recs[len(recs) // 2], rewritten[0], recs[5]]
    store = deltackpt.Store(spec_store, readonly=True)
    listed = {c.id: c for c in store.list()}
    expected = {rec["id"]: store.load(id=rec["id"]) for rec in chosen}
    store.close()
    assert set(listed) == {r["id"] for r in recs}

    reader = SpecStore(spec_store)
    try:
        # the rewritten checkpoint names what it replaced; its old id resolves to it
        assert reader.resolve(ckpt_id=rewritten[0]["extra"]["replaces"][0])["id"] == rewritten[0]["id"]
        assert reader.resolve()["id"] == recs[-1]["id"] and reader.resolve(step=6)["id"] == recs[5]["id"]
        for rec in chosen:
            man = reader.read_manifest(rec)
            assert man["version"] == man["required_version"], "manifest version is not the lowest its nodes need"
            _same(man["tree"], expected[rec["id"]], man, reader, "<root>")
            # every tensor entry is reached from the skeleton; its key is the first path that references it
            assert set(range(len(man["tensors"]))) == _refs(man["tree"])
            paths: dict[int, list[str]] = {}
            _key_paths(man["header"]["tree"], "", paths)
            assert {i: p[0] for i, p in paths.items()} == {i: e["key"] for i, e in enumerate(man["tensors"])}
            info = listed[rec["id"]]
            assert info.step == rec["step"] and info.seq == rec["seq"] and info.parent == rec["parent"]
            _same(man["metadata"], info.metadata, man, reader, "metadata")
            _same(decode_node(rec["metadata"], version=1, metadata=True), info.metadata, man, reader, "record")
        # recorded depths are upper bounds of the actual ones (§6) and within max_chain (§8)
        assert all(actual <= recorded <= 3 for actual, recorded in reader.depths.values()), reader.depths
        assert any(actual == 3 for actual, _ in reader.depths.values())
        # the keyframe save (step 6) stored every chunk it wrote standalone (§8)
        earlier = set()
        for rec in recs[:5]:
            if rec["step"] != 3:
                earlier |= {d for d, _ in reader.read_manifest(rec)["chunks"]}
        man6 = reader.read_manifest(recs[5])
        new6 = {d for d, flag in man6["chunks"] if not flag & 1} - earlier
        assert new6
        with reader.env.begin() as tx:
            for key, value in tx.cursor(db=reader.db["chunks"]):
                if key[:16] in new6:
                    assert CHUNK_ENTRY.unpack(value)[3] <= 2, key.hex()
        kinds = reader.frame_kinds
        assert kinds[0, 1] > 0 and kinds[1, 1] > 0 and kinds[2, 1] > 0, kinds  # standalone: raw, zstd, planes
        assert kinds[3, 1] > 0, kinds  # XOR delta
        assert kinds[4, 2] > 0 and kinds[4, 3] > 0 and kinds[4, 4] > 0, kinds  # predicted, frame versions 2-4
        assert set(reader.predictors) == {1, 2, 3, 4, 5}, reader.predictors
    finally:
        reader.close()


def _key_paths(node: list[Any], path: str, out: dict[int, list[str]]) -> None:
    """§5 "Key paths": every place the raw skeleton references a tensor entry, in skeleton order."""
    tag = node[0]

    def child(key: list[Any]) -> str:
        if key[0] == "s":
            if key[1] == "":
                return path if path == "" else path + "."
            return key[1] if path == "" else f"{path}.{key[1]}"
        if key[0] == "i":
            return f"{path}[{key[1]}]"
        return f"{path}[{decode_node(key, version=3)!r}]"

    if tag in ("T", "A"):
        out.setdefault(node[1], []).append(path)
    elif tag in ("d", "o", "C", "D"):
        keys, values = (node[2], node[3]) if tag == "D" else (node[1], node[2])
        for k, v in zip(keys, values):
            _key_paths(v, child(k), out)
    elif tag in ("l", "t", "q"):
        for i, v in enumerate(node[1]):
            _key_paths(v, f"{path}[{i}]", out)
    elif tag == "x":
        _key_paths(node[2], path, out)


def _refs(node: Any) -> set[int]:
    if isinstance(node, TensorRef):
        return {node.index}
    out: set[int] = set()
    if isinstance(node, dict):
        for v in node.values():
            out |= _refs(v)
    elif isinstance(node, (list, tuple, set, frozenset, collections.deque)):
        for v in node:
            out |= _refs(v)
    return out


def test_predictions_with_special_inputs(tmp_path: Path) -> None:
    """§8a's flush and NaN rules: a predicted second moment whose inputs hold subnormals, NaNs and infinities."""
    import deltackpt

    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(2048))
    opt = torch.optim.AdamW([p], lr=1e-3)
    special = np.array([0x00000001, 0x80000001, 0x007FFFFF, 0x80000000, 0x7FC00000, 0xFFC00000, 0x7FA00001,
                        0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x00800000, 0x80800001, 0x00800001], "<u4")
    special_f = torch.from_numpy(special.view("<f4").copy())
    store = deltackpt.Store(tmp_path / "s", chunk_size=4096)
    for step in range(1, 6):
        opt.zero_grad()
        (p * torch.randn(2048)).sum().backward()
        opt.step()
        sd = opt.state_dict()
        m, v = sd["state"][0]["exp_avg"].clone(), sd["state"][0]["exp_avg_sq"].clone()
        m[200:213] = special_f
        v[300:313] = special_f
        m[400:410] = 1e-30  # g*g and its products fall below 2^-126: flushed predictions
        v[500:510] = 1e-37
        sd["state"][0] = {"step": sd["state"][0]["step"], "exp_avg": m, "exp_avg_sq": v}
        store.save({"model": {"w": p.detach().clone()}, "optim": sd}, step=step)
    ids = [c.id for c in store.list()]
    expected = {i: store.load(id=i) for i in ids}
    store.close()
    reader = SpecStore(tmp_path / "s")
    try:
        predicted_special = 0
        with np.errstate(invalid="ignore"):
            for rec in reader.list_checkpoints():
                man = reader.read_manifest(rec)
                _same(man["tree"], expected[rec["id"]], man, reader, "<root>")
                e = next(e for e in man["tensors"] if e["key"] == "optim.state[0].exp_avg_sq")
                dig = man["chunks"][e["first"]][0]
                with reader.env.begin() as tx:
                    entry = CHUNK_ENTRY.unpack(tx.get(dig + struct.pack(">I", 4096), db=reader.db["chunks"]))
                predicted_special += entry[3] == 4
        assert predicted_special >= 2, "no predicted chunk with special inputs: the test would be vacuous"
    finally:
        reader.close()
