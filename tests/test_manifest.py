"""Proposed: manifest.parse on its own (a new tests/test_manifest.py, or the "manifests" part of
tests/test_corruption.py): each field a damaged or foreign manifest can get wrong is refused as
CorruptManifestError even with its checksum made to match, before a load trusts it."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import deltackpt
from deltackpt import CorruptManifestError, manifest


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("m") / "store"
    with deltackpt.Store(path, chunk_size=4096) as s:
        info = s.save({"w": torch.randn(3000), "n": torch.arange(8)}, step=1)
    return (path / "manifests" / f"{info.id}.manifest").read_bytes()


def _sealed(body: bytes | bytearray) -> bytes:
    return bytes(body) + xxhash.xxh3_128_digest(bytes(body))


def _with_header(data: bytes, edit: Any) -> bytes:
    """``data`` with its JSON header edited by ``edit(header)`` (lengths and checksum made to match)."""
    hlen, n = struct.unpack_from("<QQ", data, 16)
    header = json.loads(data[32 : 32 + hlen])
    edit(header)
    head = json.dumps(header).encode()
    return _sealed(data[:16] + struct.pack("<QQ", len(head), n) + head + data[32 + hlen : -16])


def _entry(header: dict[str, Any], key: str) -> dict[str, Any]:
    return next(t for t in header["tensors"] if t["key"] == key)


def test_the_unedited_manifest_parses(good: bytes) -> None:
    m = manifest.parse(good, where="x")
    assert [t.key for t in m.tensors] == ["w", "n"]
    assert manifest.parse(_with_header(good, lambda h: None), where="x").id == m.id


def test_a_manifest_with_another_magic_is_damage(good: bytes) -> None:
    with pytest.raises(CorruptManifestError, match="bad magic"):
        manifest.parse(_sealed(b"XCKMANIF" + good[8:-16]), where="x")


@pytest.mark.parametrize("created", [manifest.MAX_CREATED * 2, -manifest.MAX_CREATED * 2, 1e300])
def test_a_created_time_past_the_last_day_is_damage(good: bytes, created: float) -> None:
    with pytest.raises(CorruptManifestError, match="created is"):
        manifest.parse(_with_header(good, lambda h: h.update(created=created)), where="x")


def test_unknown_header_fields_are_damage(good: bytes) -> None:
    with pytest.raises(CorruptManifestError, match="unknown header fields"):
        manifest.parse(_with_header(good, lambda h: h.update(sizes=[1])), where="x")


@pytest.mark.parametrize("width", [0, 3, 16])
def test_a_tensor_entry_of_another_plane_width_is_damage(good: bytes, width: int) -> None:
    with pytest.raises(CorruptManifestError, match=f"width {width}"):
        manifest.parse(_with_header(good, lambda h: _entry(h, "w").update(width=width)), where="x")


def test_a_tensor_entry_whose_bytes_do_not_match_its_shape_is_damage(good: bytes) -> None:
    """12000 bytes of float32 are 3000 elements: a shape of 2999 (the chunk range still consistent) would have
    a load view 12000 bytes as 11996."""
    with pytest.raises(CorruptManifestError, match="12000 bytes for shape \\[2999\\]"):
        manifest.parse(_with_header(good, lambda h: _entry(h, "w").update(shape=[2999])), where="x")


def test_a_tensor_whose_chunk_range_runs_past_the_table_is_damage(good: bytes) -> None:
    """"w" (12000 bytes in 4096-byte chunks) owns 3 chunks; moved to start at the table's last one it would read
    past the chunk-id table."""
    m = manifest.parse(good, where="x")
    n = len(m.flags)
    with pytest.raises(CorruptManifestError, match="inconsistent chunk range"):
        manifest.parse(_with_header(good, lambda h: _entry(h, "w").update(first=n - 1)), where="x")


def test_a_tensor_whose_chunk_count_disagrees_with_its_bytes_is_damage(good: bytes) -> None:
    with pytest.raises(CorruptManifestError, match="inconsistent chunk range"):
        manifest.parse(_with_header(good, lambda h: _entry(h, "w").update(count=2)), where="x")


@pytest.mark.parametrize(("key", "shape"), [("w", [1 << 62, 1 << 62, 0]), ("w", [1 << 62, 0, 4]),
                                            ("n", [(1 << 63) - 1, 0, 3])])
def test_an_empty_tensor_whose_other_dimensions_span_2_64_is_damage(good: bytes, key: str, shape: list[int]) -> None:
    """An empty tensor holds no bytes, but torch refuses to make one whose dimensions multiply (zeros left out)
    to 2^64 or more, with an error that names no tensor (a load raised RuntimeError "Storage size calculation
    overflowed", and verify passed it); numpy likewise from 2^63 bytes (test_bad_input covers arrays)."""
    def edit(h: dict[str, Any]) -> None:
        _entry(h, key).update(shape=shape, nbytes=0, count=0)
    with pytest.raises(CorruptManifestError, match=f"tensor '{key}': shape .* spans more than torch makes"):
        manifest.parse(_with_header(good, edit), where="x")


def test_an_empty_array_whose_other_dimensions_span_2_63_bytes_is_damage(tmp_path: Path) -> None:
    with deltackpt.Store(tmp_path / "s", chunk_size=4096) as s:
        info = s.save({"a": np.zeros(4, np.float32)}, step=0)
    data = (tmp_path / "s" / "manifests" / f"{info.id}.manifest").read_bytes()

    def edit(h: dict[str, Any]) -> None:
        _entry(h, "a").update(shape=[1 << 61, 0], nbytes=0, count=0)
    with pytest.raises(CorruptManifestError, match="tensor 'a': shape .* spans more than numpy makes"):
        manifest.parse(_with_header(data, edit), where="x")


def test_an_empty_tensor_with_large_dimensions_round_trips(tmp_path: Path) -> None:
    """The largest empty tensor and array each library makes (torch: dimensions multiplying to 2^64 - 1, zeros
    left out; numpy: to 2^63 - 1 bytes) are stored and load."""
    state = {"w": torch.empty((1 << 62) - 1, 4, 0), "a": np.empty(((1 << 60) - 1, 0), np.float64),
             "b": np.empty(((1 << 63) - 1, 0), np.uint8)}
    with deltackpt.Store(tmp_path / "s") as s:
        s.save(state, step=0)
        out = s.load()
    assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in state.items()}


def test_the_itemsize_table_agrees_with_torch() -> None:
    """Manifests are read without torch (deltackpt ls), from a table of element sizes: each entry is torch's, and
    every dtype of this torch is in it but the quantized ones, which tensor entries never hold."""
    from deltackpt import tree

    sizes = {name: dt.itemsize for name, dt in vars(torch).items() if isinstance(dt, torch.dtype)}
    # (the table also holds the dtypes of newer torches than this one: int1 ... int7 and uint1 ... uint7 from 2.5 say)
    assert {name: sizes[name] for name in tree._TORCH_ITEMSIZE if name in sizes} == {
        name: size for name, size in tree._TORCH_ITEMSIZE.items() if name in sizes}
    if tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= (2, 13):  # (the torch the suite targets)
        assert set(tree._TORCH_ITEMSIZE) <= set(sizes)
    assert set(sizes) - set(tree._TORCH_ITEMSIZE) == tree.QUANTIZED_NAMES
    assert tree.torch_itemsize("bfloat16") == 2
    with pytest.raises(deltackpt.UnsupportedTypeError, match="unknown to this torch"):
        tree.torch_itemsize("float2_e1m0")
