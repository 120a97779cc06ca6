"""Back-compat: a store written by format version 1 (tests/fixtures/store-v1) must stay readable forever.

The fixture was written by ``python tests/test_compat.py write`` with deltackpt 0.1.0. Never regenerate it for a
new version: add a new fixture beside it instead. ``expected_states`` only uses arithmetic on fixed numbers (no
RNG), so it yields the same values in every future version of torch and numpy.
"""

from __future__ import annotations

import shutil
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt import maintenance

FIXTURE = Path(__file__).parent / "fixtures" / "store-v1"


def expected_states() -> list[tuple[int, dict]]:
    out = []
    base = torch.arange(4096, dtype=torch.float32) / 7.0
    for step in (10, 20, 30):
        w = base + step * 1e-3  # small changes between steps: the fixture holds delta frames
        out.append(
            (
                step,
                {
                    "model": OrderedDict([("w", w.reshape(64, 64)), ("b", torch.zeros(3000))]),
                    "half": (base[:1000] * step).to(torch.bfloat16),
                    "ints": torch.arange(step, step + 500, dtype=torch.int64),
                    "mask": torch.arange(300) % 3 == 0,
                    "arr": np.arange(100, dtype=">f8") * step,
                    "plain": {"step": step, "lr": 1e-3 / step, "name": "run", "big": 2**100 + step,
                              "t": (1, None, b"\x00\xff"), "dt": torch.float16, "neg0": -0.0},
                },
            )
        )
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return isinstance(b, float) and np.float64(a).tobytes() == np.float64(b).tobytes()
    return type(a) is type(b) and a == b


@pytest.fixture
def v1_store(tmp_path: Path) -> Path:
    dest = tmp_path / "store-v1"
    shutil.copytree(FIXTURE, dest)
    return dest


def test_fixture_is_version_1() -> None:
    assert (FIXTURE / "STORE").read_text().count('"version": 1') == 1


def test_v1_store_loads_bit_exactly(v1_store: Path) -> None:
    with deltackpt.Store(v1_store) as s:
        assert [i.step for i in s.list()] == [10, 20, 30]
        for step, state in expected_states():
            assert _same(state, s.load(step=step)), step
        assert s.verify().ok


def test_v1_store_holds_delta_frames(v1_store: Path) -> None:
    with deltackpt.Store(v1_store) as s:
        depths = {loc.depth for _, loc in s.index.iter_chunks()}
    assert max(depths) >= 1, "the fixture should exercise delta decoding"


def test_v1_store_repairs_and_accepts_new_saves(v1_store: Path) -> None:
    shutil.rmtree(v1_store / "index")
    with maintenance.open_for_repair(v1_store) as s:
        assert s.repair().checkpoints == 3
        for step, state in expected_states():
            assert _same(state, s.load(step=step))
        s.save({"x": torch.ones(10)}, step=40)
        assert [i.step for i in s.list()] == [10, 20, 30, 40]


def write(dest: Path) -> None:  # pragma: no cover - run by hand once per format version
    if dest.exists():
        raise SystemExit(f"{dest} exists: fixtures are never rewritten")
    with deltackpt.Store(dest, chunk_size=4096, max_chain=4) as s:
        for step, state in expected_states():
            s.save(state, step=step, metadata={"fixture": "v1"})
    for junk in (dest / "index" / "lock.mdb",):
        junk.unlink(missing_ok=True)


if __name__ == "__main__" and sys.argv[1:] == ["write"]:
    write(FIXTURE)
