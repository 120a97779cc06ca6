"""Deduplication and space accounting: only new chunks are written, and gc gives space back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from conftest import SMALL_CHUNK, assert_same_state, dir_size, pack_files, tensor_bytes

import deltackpt
from deltackpt import codec, packs
from deltackpt.index import chunk_key

BIG_CHUNK = 64 * 1024


@pytest.fixture
def big_store(store_path: Path):
    s = deltackpt.Store(store_path, chunk_size=BIG_CHUNK, threads=2)
    yield s
    s.close()


def _random_tensors(n: int, numel: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i:03d}.weight": torch.randn(numel, generator=g) for i in range(n)}


def _frames_bytes(store_path: Path) -> int:
    """Bytes of every intact frame in every pack (pack headers excluded)."""
    return sum(h.frame_len for p in pack_files(store_path) for _, h in packs.scan(p))


def test_resave_unchanged_writes_almost_nothing(big_store: deltackpt.Store, store_path: Path) -> None:
    # ~2.6 MB in 40 tensors of one chunk and a bit (short last chunks too)
    state = {"model": _random_tensors(40, BIG_CHUNK // 4 + 100, seed=0), "step": 1}
    first = big_store.save(state, step=1)
    assert first.written_bytes > 0.5 * first.logical_bytes  # random floats do not compress much
    size = dir_size(store_path / "packs")
    second = big_store.save(state, step=2)
    assert second.written_bytes < 0.01 * first.written_bytes
    assert second.logical_bytes == first.logical_bytes
    assert dir_size(store_path / "packs") - size < 0.01 * first.written_bytes
    assert_same_state(state, big_store.load(2))


def test_resave_after_reopen_writes_nothing(store_path: Path) -> None:
    state = {"w": torch.randn(50_000)}
    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK) as s:
        first = s.save(state, step=1)
    with deltackpt.Store(store_path) as s:
        second = s.save(state, step=2)
    assert first.written_bytes > 0
    assert second.written_bytes == 0


def test_changing_one_of_100_tensors_writes_about_one_percent(big_store: deltackpt.Store) -> None:
    state = _random_tensors(100, BIG_CHUNK // 4, seed=1)  # 100 x 64 KiB, one chunk each
    first = big_store.save(state, step=1)
    state["layer042.weight"] = torch.randn(BIG_CHUNK // 4, generator=torch.Generator().manual_seed(99))
    second = big_store.save(state, step=2)
    ratio = second.written_bytes / first.written_bytes
    assert 0.5 / 100 <= ratio <= 2 / 100, ratio
    assert_same_state(state, big_store.load(2))


def test_changing_one_element_writes_one_chunk(store: deltackpt.Store) -> None:
    x = torch.randn(64 * SMALL_CHUNK // 4)  # 64 chunks
    first = store.save({"x": x}, step=1)
    y = x.clone()
    y[12345] = 7.0
    second = store.save({"x": y}, step=2)
    assert 0 < second.written_bytes <= SMALL_CHUNK + 64
    assert first.written_bytes > 32 * SMALL_CHUNK
    assert torch.equal(store.load(1)["x"], x) and torch.equal(store.load(2)["x"], y)


def test_identical_tensors_in_one_state_written_once(tmp_path: Path) -> None:
    x = torch.randn(20_000)
    with deltackpt.Store(tmp_path / "one", chunk_size=SMALL_CHUNK) as s:
        single = s.save({"a": x}, step=1).written_bytes
    with deltackpt.Store(tmp_path / "three", chunk_size=SMALL_CHUNK) as s:
        state = {"a": x, "b": x.clone(), "c": [x.clone().numpy()], "d": x}
        info = s.save(state, step=1)
        assert info.written_bytes == single
        assert info.logical_bytes == 3 * x.numel() * 4  # "d" is the same object as "a": one leaf
        out = s.load(1)
        assert_same_state(state, out)
        assert out["a"] is out["d"] and out["a"] is not out["b"]
    assert single > 0


def test_same_bytes_different_dtype_dedup(store: deltackpt.Store) -> None:
    x = torch.randn(10_000)
    first = store.save({"f": x}, step=1)
    second = store.save({"i": x.view(torch.int32).clone(), "u8": x.view(torch.uint8).clone()}, step=2)
    assert first.written_bytes > 0 and second.written_bytes == 0
    out = store.load(2)
    assert out["i"].dtype == torch.int32 and tensor_bytes(out["u8"]) == tensor_bytes(x)


def test_all_zero_tensors_write_nothing(store: deltackpt.Store, store_path: Path) -> None:
    state = {"z": torch.zeros(100_000), "zi": torch.zeros(3, 5000, dtype=torch.int64),
             "zn": np.zeros((7, 999), dtype=np.float64),
             "odd": torch.zeros(SMALL_CHUNK + 3, dtype=torch.uint8)}
    info = store.save(state, step=1)
    assert info.logical_bytes == 400_000 + 120_000 + 7 * 999 * 8 + SMALL_CHUNK + 3
    assert info.written_bytes == 0
    assert _frames_bytes(store_path) == 0
    out = store.load(1)
    assert_same_state(state, out)
    # half zero: only the non-zero half is written
    h = torch.zeros(64 * SMALL_CHUNK // 4)
    h[: h.numel() // 2] = torch.randn(h.numel() // 2)
    half = store.save({"h": h}, step=2)
    assert 16 * SMALL_CHUNK < half.written_bytes < 36 * SMALL_CHUNK
    assert torch.equal(store.load(2)["h"], h)


def test_appending_to_a_tensor_writes_only_the_tail(store: deltackpt.Store) -> None:
    x = torch.randn(10 * SMALL_CHUNK // 4)  # exactly 10 chunks
    store.save({"x": x}, step=1)
    y = torch.cat([x, torch.randn(SMALL_CHUNK // 4)])
    info = store.save({"x": y}, step=2)
    assert 0 < info.written_bytes <= SMALL_CHUNK + 64


def test_written_bytes_matches_pack_growth(store: deltackpt.Store, store_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    total = 0
    prev_size, prev_packs = 0, 0
    for step in range(1, 5):
        state = {"fixed": torch.arange(30_000.0), f"new{step}": torch.randn(7_000 * step, generator=g),
                 "ints": torch.randint(0, 5, (5000,), generator=g)}
        info = store.save(state, step=step)
        total += info.written_bytes
        size, n_packs = dir_size(store_path / "packs"), len(pack_files(store_path))
        # growth is the frames written plus a 16-byte header per new pack file
        assert size - prev_size == info.written_bytes + packs.PACK_HEADER.size * (n_packs - prev_packs)
        prev_size, prev_packs = size, n_packs
        assert info.written_bytes == store.info(step).written_bytes
    assert _frames_bytes(store_path) == total
    assert sum(i.written_bytes for i in store.list()) == total


def test_shared_tensor_survives_delete_and_gc(store: deltackpt.Store, store_path: Path) -> None:
    shared = torch.randn(30_000)
    only_first = torch.randn(30_000)
    s1 = {"shared": shared, "a": only_first}
    s2 = {"shared": shared.clone(), "b": torch.randn(30_000)}
    store.save(s1, step=1)
    store.save(s2, step=2)
    chunks_before = store.index.count_chunks()
    store.delete(1)
    assert [i.step for i in store.list()] == [2]
    report = store.gc()
    n_only_first = -(-30_000 * 4 // SMALL_CHUNK)
    assert report.dead_chunks == n_only_first
    assert store.index.count_chunks() == chunks_before - n_only_first
    assert_same_state(s2, store.load(2))
    assert store.verify().ok
    store.close()
    with deltackpt.Store(store_path) as fresh:  # nothing cached
        assert_same_state(s2, fresh.load(2))
        assert fresh.verify().ok


def test_gc_reclaims_packs_and_keeps_last(store: deltackpt.Store, store_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    states = [{"w": torch.randn(60_000, generator=g), "b": torch.randn(100, generator=g), "step": i}
              for i in range(4)]
    for i, s in enumerate(states):
        store.save(s, step=i)
    before = dir_size(store_path / "packs")
    for i in range(3):
        store.delete(i)
    assert dir_size(store_path / "packs") == before  # deleting alone frees nothing
    report = store.gc()
    after = dir_size(store_path / "packs")
    assert after < 0.4 * before, (before, after)
    # net of what repacking copied, the new packs' headers included: the packs shrank by exactly that (it
    # overstated by a header per new pack)
    assert report.freed_bytes == before - after, (report, before, after)
    assert report.dead_chunks > 0
    assert_same_state(states[3], store.load(3))
    assert_same_state(states[3], store.load())
    assert store.verify().ok
    # a second gc finds nothing more to do, and the last checkpoint still loads from a fresh handle
    again = store.gc()
    assert again.dead_chunks == 0 and again.deleted_packs == 0
    store.close()
    with deltackpt.Store(store_path) as fresh:
        assert_same_state(states[3], fresh.load(3))
        # the store keeps working after gc
        fresh.save(states[0], step=10)
        assert_same_state(states[0], fresh.load(10))
        assert_same_state(states[3], fresh.load(3))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files through /proc")
def test_verify_makes_no_future_per_chunk(store: deltackpt.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify hands chunks to the read workers from one queue (``Store._read_each``), not as a future per chunk,
    chunk group and index entry: those futures (a condition, a lock and a work item each) were half of what
    verify of a store with 200,000 chunk references held at its peak (189 MB), and grew with the store."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(SMALL_CHUNK // 4 * 3, generator=g) for i in range(100)}  # 300 chunks
    store.save(state, step=1)
    for t in state.values():
        t.add_(1)
    store.save(state, step=2)  # 300 delta chunks on the 300 of step 1
    submitted: list[int] = []
    real = store._read_pool.submit
    monkeypatch.setattr(store._read_pool, "submit", lambda *a, **k: submitted.append(1) or real(*a, **k))
    calls: list[tuple[int, int]] = []
    report = store.verify(progress=lambda done, total: calls.append((done, total)))
    assert report.ok and report.chunks == 600
    assert calls[-1] == (600, 600)
    assert len(submitted) < 100, len(submitted)  # (a few workers per pass; a future per chunk: 900 and more)


def test_gc_and_verify_leave_no_pack_files_open(store_path: Path) -> None:
    """A training process whose Checkpointer runs gc would otherwise keep one open file per pack gc read."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4 * SMALL_CHUNK // 4, generator=g)
    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK, pack_size=SMALL_CHUNK) as s:
        for step in range(6):  # small changes: deltas, whose headers gc reads
            w = w + 1e-3 * torch.randn(w.shape, generator=g)
            s.save({"w": w}, step=step)
    assert len(pack_files(store_path)) > 6

    def pack_fds() -> int:
        fd_dir = Path("/proc/self/fd")
        return sum(1 for fd in fd_dir.iterdir() if fd.resolve().parent == store_path.resolve() / "packs")

    with deltackpt.Store(store_path) as s:
        s.delete(step=1)
        s.gc()
        assert pack_fds() == 0
        assert s.verify().ok
        assert pack_fds() == 0
        assert_same_state({"w": w}, s.load())


def test_gc_after_deleting_everything(store: deltackpt.Store, store_path: Path) -> None:
    store.save({"w": torch.randn(20_000)}, step=1)
    store.save({"w": torch.randn(20_000)}, step=2)
    store.delete(1)
    store.delete(2)
    assert store.list() == []
    store.gc()
    assert _frames_bytes(store_path) == 0
    assert store.index.count_chunks() == 0
    assert list((store_path / "manifests").glob("*.manifest")) == []
    info = store.save({"w": torch.ones(10)}, step=3)
    assert torch.equal(store.load(3)["w"], torch.ones(10)) and info.written_bytes > 0


def test_resave_after_gc_rewrites_dropped_chunks(store: deltackpt.Store) -> None:
    x = torch.randn(20_000)
    store.save({"x": x}, step=1)
    store.delete(1)
    store.gc()
    info = store.save({"x": x}, step=2)  # its chunks were reclaimed: they must be written again
    assert info.written_bytes > 0
    assert torch.equal(store.load(2)["x"], x)
    assert store.verify().ok


# -- delta chunks ------------------------------------------------------------------------------------------


def _nudge(x: torch.Tensor, step: int) -> torch.Tensor:
    """A copy of ``x`` with a few elements of every chunk changed (like a small optimizer step)."""
    y = x.clone()
    per_chunk = SMALL_CHUNK // 4
    idx = torch.arange(step % 7, y.numel(), per_chunk // 4)
    y[idx] += 0.001 * step
    return y


def _delta_history(store: deltackpt.Store, n: int) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(16 * SMALL_CHUNK // 4, generator=g)
    y = torch.randn(3 * SMALL_CHUNK // 4 + 5, generator=g).double()
    history = {}
    for step in range(1, n + 1):
        x, y = _nudge(x, step), _nudge(y, step)
        history[step] = {"x": x, "y": y, "fixed": torch.arange(2000)}
        store.save(history[step], step=step)
    return history


def test_delta_chain_round_trips(store: deltackpt.Store) -> None:
    history = _delta_history(store, 12)
    locs = [loc for _, loc in store.index.iter_chunks()]
    assert any(loc.codec == deltackpt.codec.DELTA for loc in locs), "small changes should be stored as deltas"
    assert all(loc.depth <= store.max_chain for loc in locs)
    infos = {i.step: i for i in store.list()}
    assert sum(infos[s].written_bytes for s in range(2, 13)) < 11 * infos[1].written_bytes * 0.8
    for step, state in history.items():
        assert_same_state(state, store.load(step))
        assert_same_state(state, store.load(step, verify=False))
    assert store.verify().ok


def test_delta_bases_survive_delete_and_gc(store: deltackpt.Store, store_path: Path) -> None:
    history = _delta_history(store, 9)
    for step in range(1, 9):
        if step % 3:
            store.delete(step)
    store.gc()
    for step in (3, 6, 9):
        assert_same_state(history[step], store.load(step))
    for step in (3, 6):
        store.delete(step)
    store.gc()
    assert_same_state(history[9], store.load(9))
    assert store.verify().ok
    store.close()
    with deltackpt.Store(store_path) as fresh:  # no cached bases
        assert_same_state(history[9], fresh.load(9))
        nxt = {"x": _nudge(history[9]["x"], 10), "y": _nudge(history[9]["y"], 10),
               "fixed": torch.arange(2000)}
        fresh.save(nxt, step=10)
        assert_same_state(nxt, fresh.load(10))
        assert fresh.verify().ok


def test_no_deltas_when_max_chain_is_zero(store_path: Path) -> None:
    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK, max_chain=0) as s:
        history = _delta_history(s, 4)
        assert all(loc.codec != deltackpt.codec.DELTA for _, loc in s.index.iter_chunks())
        for step, state in history.items():
            assert_same_state(state, s.load(step))


def test_the_largest_max_chain_writes_chains_readers_decode(store_path: Path) -> None:
    """At max_chain=64, the largest a store takes, a tensor whose deltas keep winning reaches depth 64: a chain
    of 65 frames, which loads and verify must decode (readers refused chains over 64 frames, so the 64th save
    was written and could never be read)."""
    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK, max_chain=deltackpt.config.MAX_MAX_CHAIN) as s:
        t = torch.arange(SMALL_CHUNK // 4, dtype=torch.int32)
        saved = {}
        for step in range(deltackpt.config.MAX_MAX_CHAIN + 2):
            t[step] += 1
            s.save({"t": t}, step=step)
            saved[step] = t.clone()
        assert max(loc.depth for _, loc in s.index.iter_chunks()) == deltackpt.config.MAX_MAX_CHAIN
    with deltackpt.Store(store_path) as s:
        for step, want in saved.items():
            assert torch.equal(s.load(step)["t"], want), step
        assert s.verify().ok


def test_encoder_keeps_no_plane_buffer_of_a_large_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder (one per save worker, kept while the store is open) keeps its byte-plane buffer for the next
    chunk only up to codec.SCRATCH_KEEP bytes: a chunk-sized one pinned a chunk of memory per worker between saves
    (512 MiB after a save of 256 MiB chunks on 4 threads). Frames are the same either way."""
    monkeypatch.setattr(codec, "SCRATCH_KEEP", 64 << 10, raising=False)
    enc = codec.Encoder()
    rng = np.random.default_rng(4)
    for n in (16 << 10, 256 << 10):
        base = rng.standard_normal(n // 4, dtype=np.float32)
        new = base.copy()
        new[::7] += 1
        d, bd = deltackpt.kernel.digest(new), deltackpt.kernel.digest(base)
        for frame in (enc.encode(memoryview(new).cast("B"), d, 4),
                      enc.encode(memoryview(new).cast("B"), d, 4, memoryview(base).cast("B"), bd)):
            assert codec.parse_header(frame).codec in (codec.PLANES_ZSTD, codec.DELTA)
            based = codec.parse_header(frame).codec == codec.DELTA
            got = codec.decode(frame, expect_digest=d, expect_len=n, base=base.tobytes() if based else None)
            assert bytes(got) == new.tobytes()
        assert enc._scratch.nbytes <= 64 << 10


def test_delta_kept_only_when_clearly_smaller() -> None:
    """The encoder keeps a delta frame only when it is at most DELTA_MIN_GAIN of the standalone frame: a delta
    that gains a few percent would cost every later load a base decode."""
    enc = deltackpt.codec.Encoder()
    rng = np.random.default_rng(3)
    base = rng.standard_normal(1 << 14, dtype=np.float32)
    bd = deltackpt.kernel.digest(base)

    def codec_for(new: np.ndarray) -> tuple[int, int, int]:
        frame = enc.encode(memoryview(new).cast("B"), deltackpt.kernel.digest(new), 4, memoryview(base).cast("B"), bd)
        alone = enc.encode(memoryview(new).cast("B"), deltackpt.kernel.digest(new), 4)
        return deltackpt.codec.parse_header(frame).codec, len(frame), len(alone)

    # low mantissa bits changing: the delta is far smaller and wins
    small = (base.view(np.uint32) ^ rng.integers(0, 1 << 8, base.size, dtype=np.uint32)).view(np.float32)
    c, n_frame, n_alone = codec_for(small)
    assert c == deltackpt.codec.DELTA and n_frame < 0.9 * n_alone
    # momentum-like change (x * 0.9 + noise): the delta gains 2-3% and the standalone frame is kept
    big = base * np.float32(0.9) + np.float32(0.3) * rng.standard_normal(base.size, dtype=np.float32)
    c, n_frame, n_alone = codec_for(big.astype(np.float32))
    assert c != deltackpt.codec.DELTA and n_frame == n_alone


def test_delta_statistics_are_shared_by_tensor_role(store_path: Path) -> None:
    """Layers of one role share their delta statistics, so a model of many small tensors settles on one
    encoding per role within a save or two instead of compressing every chunk twice for many saves."""
    from deltackpt.store import _role

    assert _role("model.blocks.3.attn.weight") == "model.blocks.#.attn.weight"
    assert _role("optimizer.state.12.exp_avg") == "optimizer.state.#.exp_avg"
    assert _role("optimizer.state[12].exp_avg") == "optimizer.state[#].exp_avg"  # int dict keys
    assert _role("x[ab].y[3c]") == "x[ab].y[3c]"
    assert _role("layer3.w") == "layer3.w" and _role("x.3b.y") == "x.3b.y" and _role("7") == "#"
    rng = np.random.default_rng(0)
    state = {f"blocks.{i}.w": torch.from_numpy(rng.standard_normal(SMALL_CHUNK // 4, dtype=np.float32))
             for i in range(24)}
    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK) as s:
        s.save(state, step=0)
        for step in (1, 2):
            for t in state.values():  # low mantissa bits change: deltas win
                t.view(torch.int32).bitwise_xor_(torch.randint(0, 64, t.shape, dtype=torch.int32))
            s.save(state, step=step)
        assert s._delta_mode("blocks.5.w") == "delta"  # 24 one-chunk tensors, one role
        assert_same_state(state, s.load(2))


def test_keyframe_save_writes_no_deltas(store_path: Path) -> None:
    """``save(keyframe=True)`` stores every new chunk standalone (what a restart after a planned stop wants);
    the saves after it take deltas against it again."""
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal(4 * SMALL_CHUNK // 4, dtype=np.float32))

    def nudge() -> None:
        x.view(torch.int32).bitwise_xor_(torch.randint(0, 64, x.shape, dtype=torch.int32))

    def codecs(info: deltackpt.CheckpointInfo) -> set[int]:
        m = s.manifest(id=info.id)
        keys = [dg + ln.to_bytes(4, "big") for t in m.tensors for _, dg, ln in m.chunk_keys(t)]
        return {loc.codec for loc in s.index.lookup_chunks(keys).values()}

    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK) as s:
        s.save({"x": x}, step=0)
        nudge()
        assert deltackpt.codec.DELTA in codecs(s.save({"x": x}, step=1))
        nudge()
        kf = s.save({"x": x}, step=2, keyframe=True)
        assert deltackpt.codec.DELTA not in codecs(kf)
        assert kf.parent == s.info(1).id  # lineage is kept
        want = x.clone()
        nudge()
        assert deltackpt.codec.DELTA in codecs(s.save({"x": x}, step=3))
        assert torch.equal(s.load(2)["x"], want) and torch.equal(s.load(3)["x"], x)


def test_planes_use_their_own_match_finder_and_plain_bytes_the_levels() -> None:
    """Byte planes go through the coarse match finder (codec.PLANES_PARAMS), plain bytes (width 1) through the
    level's own: far-apart repeats in bytes (text, pickles) need the level's larger hash table. Both decode."""
    enc = deltackpt.codec.Encoder()
    text = np.frombuffer((Path(__file__).read_bytes() * 64)[: 1 << 20], np.uint8)
    frame = enc.encode(memoryview(text), deltackpt.kernel.digest(text), 1)
    with_planes_finder = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        compression_level=1, **deltackpt.codec.PLANES_PARAMS)).compress(text.tobytes())
    assert len(frame) < len(with_planes_finder) / 4
    floats = np.random.default_rng(5).standard_normal(1 << 18, dtype=np.float32)
    fframe = enc.encode(memoryview(floats).cast("B"), deltackpt.kernel.digest(floats), 4)
    planes = np.empty(floats.nbytes, np.uint8)
    deltackpt.kernel.split_planes(memoryview(floats).cast("B"), 4, planes)
    assert len(fframe) - deltackpt.codec.HEADER_SIZE == len(
        zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
            compression_level=1, write_content_size=True, **deltackpt.codec.PLANES_PARAMS)).compress(planes))
    for f, raw in ((frame, text), (fframe, floats)):
        assert bytes(deltackpt.codec.decode(f)) == raw.tobytes()


@pytest.mark.parametrize("dtype,elements", [(np.float32, 1 << 14), (np.float32, 3 << 14), (np.float32, 1 << 16),
                                            (np.float16, 5 << 13), (np.float32, 1100)])
def test_planes_shorter_than_a_zstd_block_get_blocks_of_their_own(dtype: type, elements: int) -> None:
    """The byte planes of a chunk under 512 KiB are shorter than zstd's 128 KiB blocks, and compressed in one call
    a block held parts of several: one Huffman table for all its literals, which coded the near-random low
    mantissa bytes (stored raw in a block of their own) at a quarter of the decoding speed and lost the
    exponent plane's skew. Such planes now get blocks of their own: one zstd frame all the same (content size
    declared), decoded by either backend, and smaller (64 KiB of float32 weights: 0.93 -> 0.84 of raw)."""
    enc = deltackpt.codec.Encoder()
    x = (np.random.default_rng(7).standard_normal(elements) * 0.02).astype(dtype)
    raw = memoryview(x).cast("B")
    width = x.itemsize
    frame = enc.encode(raw, deltackpt.kernel.digest(x), width)
    assert frame[5] == deltackpt.codec.PLANES_ZSTD
    payload = frame[deltackpt.codec.HEADER_SIZE:]
    assert zstandard.frame_content_size(payload) == x.nbytes
    planes = np.empty(x.nbytes, np.uint8)
    deltackpt.kernel.split_planes(raw, width, planes)
    one_call = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        compression_level=1, write_content_size=True, **deltackpt.codec.PLANES_PARAMS)).compress(planes)
    # (about what a 1 MiB chunk's planes, block-aligned, take: 0.835; in one call 0.87-0.94)
    assert len(payload) < min(len(one_call), 0.86 * x.nbytes), (len(payload), len(one_call), x.nbytes)
    assert bytes(deltackpt.codec.decode(frame)) == x.tobytes()


def test_verify_decodes_a_delta_chain_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify checks chunks that delta frames tie together in one group, oldest first, and a delta chunk's chain
    stops at the base the group decoded already: one kernel decode per distinct chunk. (Checked one by one, a
    chain of depth d decoded d + 1 frames again for every chunk on it; and a delta on a predicted base decoded
    that base's prediction inputs again.)"""
    from deltackpt import codec, kernel

    rng = np.random.default_rng(0)
    x = rng.standard_normal(8 * SMALL_CHUNK // 4).astype(np.float32)
    with deltackpt.Store(tmp_path / "s", chunk_size=SMALL_CHUNK, max_chain=3, predict=False) as s:
        for step in range(8):
            x[rng.integers(0, len(x), 64)] += 1.0  # a few elements change: XOR deltas win
            s.save({"x": torch.from_numpy(x.copy())}, step=step)
        locs = dict(s.index.iter_chunks())
        assert max(loc.depth for loc in locs.values()) == 3
        assert sum(loc.codec == codec.DELTA for loc in locs.values()) > len(locs) // 2
        calls: list[int] = []
        real = kernel.decode_frames
        monkeypatch.setattr(kernel, "decode_frames", lambda *a: calls.append(len(a[0])) or real(*a))
        report = s.verify()
        assert report.ok and report.checkpoints == 8
        assert len(calls) == len(locs) and sum(calls) == len(locs), (len(calls), sum(calls), len(locs))


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_depth_bound_when_the_keyframe_turn_never_comes(tmp_path: Path, offset: int) -> None:
    """A chunk's keyframe turn is (phase + position) % (max_chain + 1) == 0 with phase = generation + the index of the
    tensor's first chunk in the checkpoint. When tensors are added before it at each save so that its phase stays the
    same modulo max_chain + 1, its turn never comes, and only the depth check (`loc.depth + 1 <= max_chain`) keeps
    chains within max_chain. The existing chain tests save the same layout at every step, where the keyframe turns
    alone bound the depth: an off-by-one in the depth check went unnoticed (at max_chain=64 it writes 66-frame
    chains that readers refuse)."""
    g = torch.Generator().manual_seed(offset)
    x = torch.randn(SMALL_CHUNK // 4, generator=g)
    history = {}
    with deltackpt.Store(tmp_path / "s", chunk_size=SMALL_CHUNK, max_chain=2, predict=False) as s:
        for step in range(1, 10):
            x = x.clone()
            x[step * 7 : step * 7 + 3] += 1.0  # a small change: deltas win
            # 2 more one-chunk tensors before x at each save: generation + 1 and first index + 2 keep
            # its phase constant mod (2 + 1)
            n_before = offset + (step - 1) * 2
            state = {f"a{j:03d}": torch.randint(0, 1 << 30, (SMALL_CHUNK // 4,), generator=g, dtype=torch.int32)
                     for j in range(n_before)}
            state["x"] = x
            s.save(state, step=step)
            history[step] = state
        depths = [loc.depth for _, loc in s.index.iter_chunks()]
        assert max(depths) <= 2, sorted(depths)[-5:]
        for step, state in history.items():
            assert_same_state(state, s.load(step))


def test_keyframes_are_spread_over_the_saves(tmp_path: Path) -> None:
    """Keyframes are staggered, (phase + position) % (max_chain + 1) == 0, so that every checkpoint restores in
    about the same time: without it every chunk of a tensor is a delta for max_chain saves, then all are
    keyframes at once."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9 * SMALL_CHUNK // 4, generator=g)
    with deltackpt.Store(tmp_path / "s", chunk_size=SMALL_CHUNK, max_chain=2, predict=False) as s:
        for step in range(1, 8):
            x = x.clone()
            x[:: SMALL_CHUNK // 4] += 1.0  # one element of every chunk changes: every chunk is written, deltas win
            s.save({"x": x}, step=step)
        for step in range(2, 8):
            m = s.manifest(step)
            keys = [chunk_key(d, n) for _, d, n in m.chunk_keys(m.tensors[0])]
            locs = s.index.lookup_chunks(keys)
            depths = [locs[k].depth for k in keys]
            assert 0 < sum(d == 0 for d in depths) < len(keys), (step, depths)
            assert any(locs[k].codec == codec.DELTA for k in keys)


def test_a_fully_live_pack_is_not_repacked_at_repack_below_1(tmp_path: Path) -> None:
    """A pack whose frames are all live is not sparse, at repack_below=1.0 too: gc does not copy it again at
    every run."""
    with deltackpt.Store(tmp_path / "s", chunk_size=4096) as s:
        s.save({"w": torch.randn(5000, generator=torch.Generator().manual_seed(0))}, step=1)
        r = s.gc(repack_below=1.0)
        assert r.repacked_packs == 0 and r.moved_chunks == 0, r


def test_gc_repacks_into_packs_of_the_stores_pack_size(tmp_path: Path) -> None:
    """The packs gc writes as it repacks roll over at the store's ``pack_size``, as a save's do (they used the
    default 1 GiB: repacking a store of small packs made one big pack)."""
    w = torch.randn(24 * 1024, generator=torch.Generator().manual_seed(0))  # 24 chunks, random: 6-7 packs
    with deltackpt.Store(tmp_path / "s", chunk_size=4096, pack_size=16384, max_chain=0, predict=False) as s:
        s.save({"w": w}, step=1)
        w2 = w.clone()
        w2.view(24, 1024)[::2] += 1.0  # every other chunk changes: step 1's packs are left half live
        s.save({"w": w2}, step=2)
        s.delete(step=1)
        before = {p.name for p in (tmp_path / "s" / "packs").glob("*.pack")}
        r = s.gc(repack_below=1.0)
        assert r.repacked_packs > 0 and r.moved_chunks >= 12, r
        new = [p.stat().st_size for p in (tmp_path / "s" / "packs").glob("*.pack") if p.name not in before]
        assert len(new) > 1 and max(new) < 16384 + 2 * 4096, new  # (rolls over once past pack_size)
        assert torch.equal(s.load(2)["w"], w2) and s.verify().ok


def test_tensors_hashed_ahead_in_groups_write_the_frames_one_at_a_time_would(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A save hashes CPU tensors a group ahead and reads their index entries together: whatever the group size,
    the same chunks are deduplicated, offered the same delta bases and written as the same frames in the same
    order (dedup inside a group and across groups, zero chunks, a multi-chunk tensor, a tensor of a new shape)."""
    from deltackpt import index as index_mod
    from deltackpt import store as store_mod

    def frames(ahead: int, nbytes: int, prefetch: bool = True) -> list[tuple[int, bytes, int, int, bytes, bytes]]:
        monkeypatch.setattr(store_mod, "_AHEAD_TENSORS", ahead)
        monkeypatch.setattr(store_mod, "_AHEAD_BYTES", nbytes)
        if not prefetch:  # every lookup asks LMDB, one tensor at a time, as before the look-ahead
            monkeypatch.setattr(index_mod.ChunkReader, "prefetch", lambda self, keys: None)
        state = _random_tensors(12, 700, seed=3)
        state["same1"] = torch.ones(900)
        state["same2"] = torch.ones(900)  # (the same bytes as same1: one chunk, written once)
        state["zero"] = torch.zeros(2000)
        state["big"] = torch.randn(5 * SMALL_CHUNK // 4, generator=torch.Generator().manual_seed(4))
        path = tmp_path / f"s{ahead}-{nbytes}-{prefetch}"
        with deltackpt.Store(path, chunk_size=SMALL_CHUNK) as s:
            for step in range(4):
                for i, (name, t) in enumerate(state.items()):
                    if name.startswith("layer") and (i + step) % 2 == 0:
                        t.add_(1e-3)
                if step == 2:
                    # (a new shape: no delta base)
                    state["layer005.weight"] = torch.randn(350, generator=torch.Generator().manual_seed(5))
                    state["big"][:100] += 1
                s.save(state, step=step)
            got = []
            for k, loc in s.index.iter_chunks():
                with open(path / "packs" / f"{loc.pack_id}.pack", "rb") as f:
                    f.seek(loc.offset)
                    got.append((loc.offset, k, loc.codec, loc.depth, loc.base, f.read(loc.frame_len)))
            monkeypatch.undo()
            return sorted(got)

    one = frames(1, 1 << 30, prefetch=False)
    assert {c for _, _, c, *_ in one} >= {codec.DELTA}
    assert frames(1, 1 << 30) == one
    assert frames(3, 1 << 30) == one
    assert frames(512, 6000) == one  # (groups cut by bytes)
    assert frames(512, 64 << 20) == one
