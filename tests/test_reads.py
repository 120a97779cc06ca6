"""How loads read: items fanned out over read workers (Store._read_each), which start one per CPU and grow when a
frame read has to wait on the disk (PackReader.read with ``before_blocking``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_same_state
from hypothesis import given
from hypothesis import strategies as st

import deltackpt
from bench.util import evict
from deltackpt import codec as codec_module
from deltackpt import packs
from deltackpt import store as store_module
from deltackpt.index import chunk_key

CS = 64 * 1024


@given(n=st.integers(0, 40), fail=st.sets(st.integers(0, 39), max_size=4), threads=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_read_each_order_and_earliest_failure(tmp_path_factory: pytest.TempPathFactory, n: int, fail: set[int],
                                              threads: int, seed: int) -> None:
    """Loads fan chunks out with Store._read_each: results come back in item order; of several failures the
    earliest item's is raised, whatever the timing; once an item has failed, each other worker starts at most
    one more item (it may have looked for work just before the failure was recorded); every started item has
    finished when the call returns."""
    rng = np.random.default_rng(seed)
    delays = rng.uniform(0, 0.002, size=n)
    events: list[tuple[str, int]] = []  # appends are atomic: one log of starts and ends across workers

    def fn(i: int) -> int:
        events.append(("start", i))
        time.sleep(delays[i])
        events.append(("end", i))
        if i in fail:
            raise ValueError(i)
        return i * i

    with deltackpt.Store(tmp_path_factory.mktemp("each") / "s", read_threads=threads) as s:
        failing = sorted(f for f in fail if f < n)
        if not failing:
            assert s._read_each(fn, list(range(n))) == [i * i for i in range(n)]
            assert sorted(i for e, i in events if e == "start") == list(range(n))
            return
        with pytest.raises(ValueError) as ei:
            s._read_each(fn, list(range(n)), lambda item, exc: ValueError(("named", item, exc.args[0])))
        started = [i for e, i in events if e == "start"]
        assert ei.value.args[0] == ("named", failing[0], failing[0])
        assert sorted(started) == sorted(i for e, i in events if e == "end")  # nothing still running
        assert sorted(started) == list(range(len(started)))  # handed out in order: a prefix of the items ran
        first_failure = min(events.index(("end", f)) for f in failing if ("end", f) in events)
        assert sum(e == "start" for e, _ in events[first_failure:]) <= threads - 1


def test_an_interrupted_read_each_raises_once_no_worker_runs(tmp_path: Path) -> None:
    """A Ctrl-C during a load's wait (KeyboardInterrupt, here from SIGALRM) is raised once each worker has
    finished the item it holds, and no worker starts another. Before, the workers went on decoding into the
    caller's tensors after the load had raised (and after it had given back the gc lock)."""
    running: list[int] = []
    started: list[int] = []

    def fn(i: int) -> int:
        started.append(i)
        running.append(i)
        time.sleep(0.005)
        running.remove(i)
        return i

    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    try:
        with deltackpt.Store(tmp_path / "s", threads=2, read_threads=2) as s:
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            with pytest.raises(KeyboardInterrupt):
                s._read_each(fn, list(range(400)))
            assert running == []
            n = len(started)
            time.sleep(0.05)
            assert len(started) == n < 400
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("blocking", [False, True])
def test_read_each_starts_one_worker_per_cpu_and_grows_while_reads_wait(tmp_path: Path, blocking: bool) -> None:
    """Decoding from the page cache is CPU-bound: read_each starts ``threads`` workers. A worker about to wait
    on the disk (the hook PackReader.read calls, here called directly) starts another, up to ``read_threads``."""
    seen: set[int] = set()

    def fn(i: int) -> int:
        seen.add(threading.get_ident())
        hook = store_module._worker.before_blocking
        if blocking:
            hook()
        time.sleep(0.005)
        return i

    with deltackpt.Store(tmp_path / "s", threads=2, read_threads=6) as s:
        assert s._read_each(fn, list(range(60))) == list(range(60))
        # the hook is the workers' only while they work for read_each: other tasks on the pool see none
        hooks = list(s._read_pool.map(lambda _: getattr(store_module._worker, "before_blocking", None), range(24)))
    assert hooks == [None] * 24
    if blocking:
        assert 2 < len(seen) <= 6
    else:
        assert len(seen) <= 2


@pytest.mark.parametrize("chunk_size", [CS, 256 << 20, 1 << 30])
def test_read_workers_shrink_for_chunks_too_large_for_that_many(tmp_path: Path, chunk_size: int) -> None:
    """Each chunk a read worker decodes holds a few chunk-sized buffers: with very large chunks fewer workers
    read at once (1 GiB chunks: one; 256 MiB: two), with the default ones all ``read_threads``. Loads and verify
    still work, and read_each starts no more workers than the pool has."""
    seen: set[int] = set()
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}
    with deltackpt.Store(tmp_path / "s", chunk_size=chunk_size, threads=2, read_threads=8) as s:
        want = {CS: 8, 256 << 20: 2, 1 << 30: 1}[chunk_size]
        assert s._read_pool._max_workers == want

        def fn(i: int) -> int:
            seen.add(threading.get_ident())
            store_module._worker.before_blocking()  # as a read about to wait on the disk: asks for another
            time.sleep(0.002)
            return i

        assert s._read_each(fn, list(range(40))) == list(range(40))
        assert len(seen) <= want
        s.save(state, step=1)
        assert_same_state(s.load(step=1), state)
        report = s.verify()
        assert report.problems == [] and report.chunks == 2


@pytest.mark.parametrize("most", [1, 2])
def test_a_saves_chunks_in_flight_stay_within_the_bound_for_very_large_chunks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, most: int) -> None:
    """A save encodes at most as many chunks at once as :data:`_CHUNK_WORK_BYTES` holds (four chunk-sized
    buffers each), at least one, however many worker threads it has: with 1 GiB chunks one at a time (3.7 GiB
    above the state), not two (a 2.5 GiB state of 1 GiB chunks peaked 9.4 GiB above it). Here 64 KiB chunks
    under a bound made to fit ``most`` of them, on four workers."""
    monkeypatch.setattr(store_module, "_CHUNK_WORK_BYTES", 4 * CS * most)
    lock = threading.Lock()
    now, peak = [0], [0]
    real = store_module.Store._encode

    def encode(self: Any, *args: Any, **kwargs: Any) -> bytes:
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        try:
            time.sleep(0.01)  # (long enough for the other workers to start theirs, were they let)
            return real(self, *args, **kwargs)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(store_module.Store, "_encode", encode)
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(12 * CS // 4, generator=g)}
    with deltackpt.Store(tmp_path / "s", chunk_size=CS, threads=4) as s:
        s.save(state, step=1)
        assert_same_state(s.load(step=1), state)
    assert 1 <= peak[0] <= most  # (before: most + 1; equal to most whenever the workers overlap, as they do here)


def test_a_load_leaves_no_reference_cycle_behind(tmp_path: Path) -> None:
    """What a load returns, and what it decoded on the way (prediction inputs, scratch buffers), is freed when
    the caller drops it: read_each's two worker closures once referred to each other, a reference cycle that
    held the items (views of the outputs) until the cyclic collector next ran (an every-step checkpoint of
    631 MB kept 640 MB resident after the state was dropped). Here a collection after the load and the drop
    finds nothing of the load's to collect."""
    import gc
    import types

    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(3 * CS // 4, generator=g) for i in range(6)}
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with deltackpt.Store(tmp_path / "s", chunk_size=CS, threads=2) as s:
            s.save(state, step=1)
            gc.collect()
            got = s.load(step=1)
            assert_same_state(got, state)
            del got
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left = sorted({o.__qualname__ for o in gc.garbage if isinstance(o, types.FunctionType)})
        assert left == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


@pytest.fixture
def frame(tmp_path: Path) -> tuple[Path, int, int]:
    """(pack file, offset, length) of the frame of a one-chunk tensor saved into a new store."""
    g = torch.Generator().manual_seed(0)
    with deltackpt.Store(tmp_path / "s", chunk_size=CS) as s:
        s.save({"w": torch.randn(CS // 4, generator=g)}, step=0)
        (t,) = s.manifest(0).tensors
        _, digest, n = next(iter(s.manifest(0).chunk_keys(t)))
        loc = s.index.lookup_chunks([chunk_key(digest, n)])[chunk_key(digest, n)]
        return s.path / "packs" / f"{loc.pack_id}.pack", loc.offset, loc.frame_len


def test_cached_pack_read_does_not_call_before_blocking(frame: tuple[Path, int, int]) -> None:
    path, offset, length = frame
    reader = packs.PackReader(path.parent)
    calls: list[int] = []
    try:
        want = bytes(reader.read(path.stem, offset, length))  # now in the page cache
        out = np.empty(length, dtype=np.uint8)
        reader.read(path.stem, offset, length, into=out, before_blocking=lambda: calls.append(1))
        assert calls == [] and out.tobytes() == want
    finally:
        reader.close()


@pytest.mark.parametrize("cached", ["none", "a third", "all"])
def test_pack_read_takes_the_cached_part_then_calls_before_blocking(
    frame: tuple[Path, int, int], monkeypatch: pytest.MonkeyPatch, cached: str
) -> None:
    """How much of a frame the page cache holds is the kernel's business; here the cache-only read is made to
    return none, a third or all of the frame, and the rest must come from the blocking read, at the right
    offset, after exactly one call of the hook."""
    path, offset, length = frame
    want = path.read_bytes()[offset : offset + length]
    part = {"none": 0, "a third": length // 3, "all": length}[cached]

    def cache_holds(fd: int, into: np.ndarray, at: int) -> int:
        into[:part] = np.frombuffer(os.pread(fd, part, at), dtype=np.uint8)
        return part

    monkeypatch.setattr(packs, "_read_cached", cache_holds)
    reader = packs.PackReader(path.parent)
    calls: list[int] = []
    try:
        out = np.zeros(length, dtype=np.uint8)
        reader.read(path.stem, offset, length, into=out, before_blocking=lambda: calls.append(1))
        assert out.tobytes() == want
        assert calls == ([] if part == length else [1])
    finally:
        reader.close()


def test_load_from_a_dropped_page_cache_is_exact(tmp_path: Path) -> None:
    """A restore after the packs' pages were dropped (as far as the kernel drops them) reads frames partly
    from the cache and partly after waiting, over a growing set of workers: the state still comes back bit for
    bit, predicted and delta frames included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = []
    with deltackpt.Store(tmp_path / "s", chunk_size=4096, threads=2, read_threads=8) as s:
        for step in range(4):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            s.save(state, step=step)
            states.append(torch.utils._pytree.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, state))
        codecs = {loc.codec for _, loc in s.index.iter_chunks()}
    assert {deltackpt.codec.DELTA, deltackpt.codec.PREDICTED} & codecs
    with deltackpt.Store(tmp_path / "s", threads=2, read_threads=8) as s:
        for step in (3, 0, 2):
            evict(tmp_path / "s" / "packs")
            assert_same_state(states[step], s.load(step))


def test_a_chunk_held_at_many_places_is_decoded_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AdamW's step counts (an equal scalar per parameter) and equal tensors share their chunks: a load looks each
    distinct chunk up and decodes it once, then copies it to every other place holding it (a store of 400 small
    layers decoded its step counts' one chunk 800 times)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(5 * CS // 8, generator=g)  # (3 chunks, the last in part)
    state = {"steps": [torch.tensor(7.0) for _ in range(30)], "w": [w.clone() for _ in range(3)], "x": w[:7].clone()}
    decoded: list[bytes] = []
    real = codec_module._run

    def counted(frames: list[Any], headers: list[codec_module.FrameHeader], *args: Any, **kwargs: Any) -> None:
        decoded.append(headers[-1].digest)
        real(frames, headers, *args, **kwargs)

    with deltackpt.Store(tmp_path / "s", chunk_size=CS, threads=2) as s:
        s.save(state, step=1)
        monkeypatch.setattr(codec_module, "_run", counted)
        assert_same_state(s.load(step=1), state)
        assert len(decoded) == len(set(decoded)) == 5  # the step count, w's three chunks, x
        target = {"steps": [torch.zeros(()) for _ in range(30)], "w": [torch.zeros_like(w) for _ in range(3)],
                  "x": torch.zeros(7)}
        assert s.load_into(target, step=1) == []
        assert_same_state(target, state)


def _adamw_saves(s: deltackpt.Store, *, layers: int, steps: int) -> dict[str, Any]:
    """Train ``layers`` Linear(64, 64) layers with AdamW, saving model and optimizer at each of ``steps`` steps
    (so later checkpoints hold predicted frames); return the last state saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(steps):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        s.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=step)
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _predicted_chunks(s: deltackpt.Store, *, step: int) -> dict[bytes, Any]:
    """The chunks of checkpoint ``step`` stored as predicted frames, with their index entries."""
    m = s.manifest(step)
    keys = [chunk_key(d, n) for t in m.tensors for _, d, n in m.chunk_keys(t)]
    return {k: loc for k, loc in s.index.lookup_chunks(keys).items() if loc.codec == codec_module.PREDICTED}


def _count_lookups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the number of keys of each index lookup (``Index.lookup_chunks``) any store makes."""
    from deltackpt.index import Index

    calls: list[int] = []
    real = Index.lookup_chunks

    def counted(self: Index, keys: Any, *args: Any) -> Any:
        keys = list(keys)
        calls.append(len(keys))
        return real(self, keys, *args)

    monkeypatch.setattr(Index, "lookup_chunks", counted)
    return calls


def test_prediction_inputs_are_looked_up_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks a load's predictions read beyond its own (older checkpoints' parameters and moments, and what
    those are predicted from) have their index entries looked up in one batch per level before decoding, not in a
    read transaction each as the decode reaches them; the load's values are the same."""
    with deltackpt.Store(tmp_path / "s", chunk_size=CS) as s:
        want = _adamw_saves(s, layers=6, steps=6)
        predicted = _predicted_chunks(s, step=5)
        assert len(predicted) >= 12  # (the 12 weights and biases, and their second moments)
        calls = _count_lookups(monkeypatch)
        assert_same_state(s.load(step=5), want)
        assert len(calls) <= 2 * 4, calls  # the state's chunks, then a few levels of bases and inputs


def test_inputs_of_a_predicted_base_are_looked_up_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta frame over a predicted one (weights edited after the last optimizer step, then saved): the
    predicted base's inputs have their index entries looked up in the batches before decoding too. The load
    decodes such a chunk in its first pass, before the predicted chunks' inputs were looked up, and looked each
    of the base's inputs up alone; the load's values are the same."""
    with deltackpt.Store(tmp_path / "s", chunk_size=CS) as s:
        state = _adamw_saves(s, layers=6, steps=6)
        with torch.no_grad():
            for t in state["model"].values():
                t.view(-1)[::7] += 1e-3  # (no optimizer step: the previous weights are the better base)
        s.save(state, step=6)
        m = s.manifest(6)
        locs = s.index.lookup_chunks([chunk_key(d, n) for t in m.tensors for _, d, n in m.chunk_keys(t)])
        bases = s.index.lookup_chunks([loc.base + k[16:] for k, loc in locs.items() if loc.codec == codec_module.DELTA])
        assert any(b.codec == codec_module.PREDICTED for b in bases.values())  # (the case under test)
        calls = _count_lookups(monkeypatch)
        assert_same_state(s.load(step=6), state)
        assert len(calls) <= 2 * 4, calls  # the state's chunks, then a few levels of bases and inputs


def test_an_ema_copys_inputs_in_the_checkpoint_itself_are_decoded_and_looked_up_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An EMA copy of the weights is predicted from this checkpoint's own parameters. Decoding it found those
    inputs' index entries neither among the bases and inputs looked up in batches (they are the checkpoint's
    own) nor in the checkpoint's, and looked each up alone (10 of the 16 lookups here); and it decoded each
    parameter chunk again, in a group of its own. Every chunk of the checkpoint is decoded once now: a copy's
    chunk joins its parameter's group."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with deltackpt.Checkpointer(deltackpt.Store(tmp_path / "s", chunk_size=CS), model=model, optimizer=opt,
                                extra={"ema": ema}, async_save=False, handle_signals=False) as ck:
        for step in range(1, 8):
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
            ck.step(step)
    want = ema.state_dict()
    with deltackpt.Store(tmp_path / "s") as s:
        roles = {t.key: loc.codec for t in s.manifest(7).tensors
                 for _, d, n in s.manifest(7).chunk_keys(t)
                 for loc in s.index.lookup_chunks([chunk_key(d, n)]).values()}
        assert any(c == codec_module.PREDICTED for k, c in roles.items() if k.startswith("extra.ema.module."))
        own = {d for t in s.manifest(7).tensors for _, d, _ in s.manifest(7).chunk_keys(t)}
        calls = _count_lookups(monkeypatch)
        decoded: list[bytes] = []
        real = codec_module._run

        def counted(frames: list[Any], headers: list[codec_module.FrameHeader], *args: Any, **kwargs: Any) -> None:
            decoded.append(headers[-1].digest)
            real(frames, headers, *args, **kwargs)

        monkeypatch.setattr(codec_module, "_run", counted)
        got = s.load(step=7)["extra"]["ema"]
        assert len(calls) <= 2 * 4, calls  # the state's chunks, then a few levels of bases and inputs
        mine = [d for d in decoded if d in own]
        assert len(mine) == len(set(mine)), [d.hex()[:8] for d in mine if mine.count(d) > 1]
    assert_same_state(got, want)


def test_a_damaged_predicted_frame_decoded_without_a_resolver_is_damage(tmp_path: Path) -> None:
    """``codec.decode_chain`` leaves a predicted frame's checksum to the kernel call (checking it in Python first
    hashed every predicted frame twice). Without ``resolve`` the decode stops before that call: a damaged predicted
    frame then raised ``ValueError`` ("needs a resolver"), not the ``CorruptChunkError`` it raised before; an
    intact one still raises ValueError."""
    with deltackpt.Store(tmp_path / "s", chunk_size=CS) as s:
        _adamw_saves(s, layers=2, steps=3)
        key, loc = next(iter(_predicted_chunks(s, step=2).items()))
    with open(tmp_path / "s" / "packs" / f"{loc.pack_id}.pack", "rb") as f:
        f.seek(loc.offset)
        intact = f.read(loc.frame_len)
    damaged = bytearray(intact)
    damaged[-1] ^= 0x01  # (the end of its residual: its record still reads)
    for frame, raised in ((intact, ValueError), (bytes(damaged), deltackpt.CorruptChunkError)):
        with pytest.raises(raised):
            codec_module.decode_chain(key[:16], int.from_bytes(key[16:], "big"), lambda d, f=frame: (f, None))
