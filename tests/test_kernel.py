"""Chunk kernel: native and Python backends agree bit for bit, round trips hold, golden digests stay pinned.

The native extension (``deltackpt._kernel``) and the reference (``deltackpt._pykernel``) are imported
directly and compared whichever backend ``deltackpt.kernel`` picked; round-trip and error tests run on the
active backend and on both modules. ``DELTACKPT_EXPECT_BACKEND`` (set by the Makefile for each pass) pins
which one ran.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltackpt import _pykernel as ref
from deltackpt import kernel

try:
    from deltackpt import _kernel as native
except ImportError:  # not built: native comparisons skip, the python pass still runs everything else
    native = None

# (not conftest's ROOT: importing conftest imports torch and puts the checkout, with its uninstrumented kernel, first
# on sys.path, and `make asan` runs this file without conftest against the instrumented build)
ROOT = Path(__file__).resolve().parent.parent
NATIVE_DIR = ROOT / "native"

needs_native = pytest.mark.skipif(native is None, reason="native extension deltackpt._kernel is not built")
BACKENDS = [pytest.param(ref, id="python"), pytest.param(native, id="native", marks=needs_native)]

# Modest example counts (HYPOTHESIS_PROFILE=thorough raises them): the file runs in seconds on 2 cores.
FAST = settings(
    max_examples=max(60, settings.default.max_examples),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# A thread gets work only with DCK_MIN_BYTES_PER_THREAD (256 KiB) of input, so thread fan-out needs inputs
# above k * 256 KiB; these sizes cover 2..4 threads with ranges that do not fall on block or chunk boundaries.
BIG_SIZES = [(1 << 20) + 13, (3 << 19) + 7, (5 << 18) + 1]


def make_buffer(n: int, seed: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        return np.zeros(n, np.uint8)
    if kind == "sparse":  # mostly zero: exercises the zero-prefix scan and zero-run hashing
        a = np.zeros(n, np.uint8)
        if n:
            idx = rng.integers(0, n, size=int(rng.integers(1, 4)))
            a[idx] = rng.integers(1, 256, size=len(idx), dtype=np.uint8)
        return a
    a = rng.integers(0, 256, n, dtype=np.uint8)
    if kind == "runs" and n:  # random data with zero runs that start and end anywhere
        for _ in range(int(rng.integers(1, 5))):
            s = int(rng.integers(0, n))
            a[s : s + int(rng.integers(0, n))] = 0
    return a


@st.composite
def buffers(draw: st.DrawFn, max_len: int = 5000) -> np.ndarray:
    n = draw(
        st.one_of(
            st.sampled_from([0, 1, 2, 3, 7, 15, 16, 17, 31, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025]),
            st.integers(0, max_len),
        )
    )
    kind = draw(st.sampled_from(["random", "zeros", "sparse", "runs"]))
    return make_buffer(n, draw(st.integers(0, 2**32 - 1)), kind)


chunk_sizes = st.one_of(st.sampled_from([1, 2, 3, 16, 64, 127, 128, 129, 256, 1000, 4096]), st.integers(1, 6000))
widths = st.sampled_from([1, 2, 4, 8])
thread_counts = st.integers(1, 4)


def expected_chunks(data: bytes, chunk_size: int) -> tuple[list[bytes], list[bool]]:
    pieces = [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]
    return [xxhash.xxh3_128_digest(p) for p in pieces], [not any(p) for p in pieces]


def assert_digests_equal(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> None:
    assert a[0].dtype == np.uint8 and a[0].shape == b[0].shape and a[0].shape[1:] == (16,)
    assert a[1].dtype == np.bool_ and a[1].shape == b[1].shape
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


# ---------------------------------------------------------------------------------------- which backend ran


def test_expected_backend() -> None:
    expect = os.environ.get("DELTACKPT_EXPECT_BACKEND")
    if not expect:
        pytest.skip("DELTACKPT_EXPECT_BACKEND not set")
    assert kernel.backend == expect


def test_expected_kernel_build() -> None:
    """``make asan`` names the instrumented build's directory: the kernel these tests call must be that one, not
    the checkout's, and torch (not instrumented, and slow under ASan) must stay out of the process."""
    where = os.environ.get("DELTACKPT_EXPECT_KERNEL_DIR")
    if not where:
        pytest.skip("DELTACKPT_EXPECT_KERNEL_DIR not set")
    assert native is not None, "the native kernel is not importable"
    assert Path(native.__file__).resolve().is_relative_to(Path(where).resolve()), native.__file__
    assert "torch" not in sys.modules


def test_kernel_api_is_the_backend_api() -> None:
    impl = native if kernel.backend == "native" else ref
    for name in (
        "chunk_digests",
        "digest",
        "split_planes",
        "merge_planes",
        "xor_split_planes",
        "merge_planes_xor",
        "decode_frames",
    ):
        assert getattr(kernel, name) is getattr(impl, name)
    assert kernel.DIGEST_SIZE == 16


# ---------------------------------------------------------------------------- native == python, bit for bit


@contextlib.contextmanager
def simd_loops(level: int) -> Iterator[None]:
    """Run the native kernel with its run-time-chosen vector loops limited to ``level`` (``use_simd``)."""
    was = native.use_simd(level)
    try:
        yield
    finally:
        native.use_simd(was)


#: the kernel's vector-loop levels (native.use_simd): the widest the CPU has (AVX-512 for predictions), AVX2 at
#: most, and the portable loops; on a CPU without one, a level runs the next narrower loops
SIMD_LEVELS = pytest.mark.parametrize("simd", [2, 1, 0], ids=["widest", "avx2", "portable"])


@needs_native
@SIMD_LEVELS
@FAST
@given(data=buffers(), chunk_size=chunk_sizes, threads=thread_counts)
def test_chunk_digests_native_equals_python(simd: int, data: np.ndarray, chunk_size: int, threads: int) -> None:
    """Digests agree with the reference, through XXH3's vector long-input loop (AVX2 where the CPU has it) and
    through its portable one."""
    with simd_loops(simd):
        assert_digests_equal(native.chunk_digests(data, chunk_size, threads), ref.chunk_digests(data, chunk_size))
        assert native.digest(data) == ref.digest(data)


@needs_native
@FAST
@given(data=buffers(), base_seed=st.integers(0, 2**32 - 1), width=widths, threads=thread_counts)
def test_planes_native_equals_python(data: np.ndarray, base_seed: int, width: int, threads: int) -> None:
    base = make_buffer(len(data), base_seed, "random")
    for nat, py in (
        (native.split_planes(data, width, threads=threads), ref.split_planes(data, width)),
        (native.merge_planes(data, width, threads=threads), ref.merge_planes(data, width)),
        (
            native.xor_split_planes(data, base, width, threads=threads),
            ref.xor_split_planes(data, base, width),
        ),
        (
            native.merge_planes_xor(data, base, width, threads=threads),
            ref.merge_planes_xor(data, base, width),
        ),
    ):
        assert isinstance(nat, np.ndarray) and nat.dtype == np.uint8
        np.testing.assert_array_equal(nat, py)


@needs_native
@pytest.mark.parametrize("size", BIG_SIZES)
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_threaded_large_inputs_native_equals_python(size: int, threads: int) -> None:
    data = make_buffer(size, size + threads, "runs")
    base = make_buffer(size, size - threads, "random")
    for chunk_size in (4096, 65536 + 3, 1 << 20):
        assert_digests_equal(native.chunk_digests(data, chunk_size, threads), ref.chunk_digests(data, chunk_size))
    for width in (1, 2, 4, 8):
        np.testing.assert_array_equal(native.split_planes(data, width, threads=threads), ref.split_planes(data, width))
        np.testing.assert_array_equal(native.merge_planes(data, width, threads=threads), ref.merge_planes(data, width))
        np.testing.assert_array_equal(
            native.xor_split_planes(data, base, width, threads=threads),
            ref.xor_split_planes(data, base, width),
        )
        np.testing.assert_array_equal(
            native.merge_planes_xor(data, base, width, threads=threads),
            ref.merge_planes_xor(data, base, width),
        )


@needs_native
@pytest.mark.parametrize(
    ("size", "widths"),
    [
        # tiled (from 8 MiB): a partial tile and a scalar tail in the last thread's range
        ((8 << 20) + 1000 * 8 + 3, (2, 4, 8)),
        # split also streams (from 32 MiB): every plane 16-byte aligned, non-temporal stores throughout
        (32 << 20, (2, 4)),
        # m % 16 == 8: planes alternate between streamed (aligned) and plain stores
        ((32 << 20) + 1000 * 8 + 5, (8,)),
    ],
)
def test_large_buffer_paths_native_equals_python(size: int, widths: tuple[int, ...]) -> None:
    data = make_buffer(size, size, "runs")
    base = make_buffer(size, size + 1, "random")
    merges = size < (32 << 20)  # merge has no streaming path: checked once, on the tiled size
    for width in widths:
        want = [ref.split_planes(data, width), ref.xor_split_planes(data, base, width)]
        if merges:
            want += [ref.merge_planes(data, width), ref.merge_planes_xor(data, base, width)]
        for threads in (1, 3):
            got = [
                native.split_planes(data, width, threads=threads),
                native.xor_split_planes(data, base, width, threads=threads),
            ]
            if merges:
                got += [
                    native.merge_planes(data, width, threads=threads),
                    native.merge_planes_xor(data, base, width, threads=threads),
                ]
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)


@needs_native
@pytest.mark.parametrize(
    "make",
    [
        lambda a: bytes(a),
        lambda a: bytearray(a),
        lambda a: memoryview(bytes(a)),
        lambda a: a[: len(a) // 4 * 4].view(np.float32),
        lambda a: a[: len(a) // 8 * 8].view(np.int64).reshape(-1, 2) if len(a) >= 16 else a,
        lambda a: memoryview(a[: len(a) // 4 * 4]).cast("i"),
        lambda a: np.frombuffer(bytes(a), np.uint8),  # read-only array
    ],
    ids=["bytes", "bytearray", "memoryview", "float32", "int64-2d", "memoryview-i", "readonly"],
)
def test_input_buffer_types(make: object) -> None:
    buf = make(make_buffer(4103, 5, "runs"))  # type: ignore[operator]
    assert_digests_equal(native.chunk_digests(buf, 1000, 2), ref.chunk_digests(buf, 1000))
    assert native.digest(buf) == ref.digest(buf)
    for width in (2, 8):
        np.testing.assert_array_equal(native.split_planes(buf, width), ref.split_planes(buf, width))
        np.testing.assert_array_equal(native.merge_planes_xor(buf, buf, width), ref.merge_planes_xor(buf, buf, width))


@pytest.mark.parametrize("mod", BACKENDS)
def test_out_buffers_are_filled_and_returned(mod: types.ModuleType) -> None:
    data = make_buffer(1001, 1, "random")
    base = make_buffer(1001, 2, "random")
    out = bytearray(1001)
    assert mod.split_planes(data, 4, out) is out
    assert bytes(out) == ref.split_planes(data, 4).tobytes()
    out2 = np.zeros(1001 // 4 * 4 + 1, np.uint8)
    assert mod.merge_planes_xor(data, base, 4, out2) is out2
    np.testing.assert_array_equal(out2, ref.merge_planes_xor(data, base, 4))


@pytest.mark.parametrize("mod", BACKENDS)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_out_may_alias_inputs(mod: types.ModuleType, width: int) -> None:
    data = make_buffer(777, 3, "random")
    base = make_buffer(777, 4, "random")
    for fn, args, expect in (
        ("split_planes", (), ref.split_planes(data, width)),
        ("merge_planes", (), ref.merge_planes(data, width)),
        ("xor_split_planes", (base,), ref.xor_split_planes(data, base, width)),
        ("merge_planes_xor", (base,), ref.merge_planes_xor(data, base, width)),
    ):
        src = data.copy()  # out is src
        getattr(mod, fn)(src, *args, width, src)
        np.testing.assert_array_equal(src, expect, err_msg=f"{fn} out=src")
        if args:  # out is base
            b = base.copy()
            getattr(mod, fn)(data, b, width, b)
            np.testing.assert_array_equal(b, expect, err_msg=f"{fn} out=base")


# ------------------------------------------------------------------------- properties on the active backend


@FAST
@given(data=buffers(), base_seed=st.integers(0, 2**32 - 1), width=widths, threads=thread_counts)
def test_round_trips(data: np.ndarray, base_seed: int, width: int, threads: int) -> None:
    base = make_buffer(len(data), base_seed, "random")
    planes = kernel.split_planes(data, width, threads=threads)
    np.testing.assert_array_equal(kernel.merge_planes(planes, width, threads=threads), data)
    delta = kernel.xor_split_planes(data, base, width, threads=threads)
    np.testing.assert_array_equal(kernel.merge_planes_xor(delta, base, width, threads=threads), data)
    np.testing.assert_array_equal(delta, kernel.split_planes(np.bitwise_xor(data, base), width))


@FAST
@given(data=buffers(), width=widths)
def test_plane_layout(data: np.ndarray, width: int) -> None:
    out = np.asarray(kernel.split_planes(data, width))
    m = len(data) // width
    for k in range(width):
        np.testing.assert_array_equal(out[k * m : (k + 1) * m], data[k : m * width : width])
    np.testing.assert_array_equal(out[m * width :], data[m * width :])


@FAST
@given(data=buffers(), chunk_size=chunk_sizes, threads=thread_counts)
def test_digests_match_xxhash_per_chunk(data: np.ndarray, chunk_size: int, threads: int) -> None:
    digests, zero = kernel.chunk_digests(data, chunk_size, threads)
    want_digests, want_zero = expected_chunks(data.tobytes(), chunk_size)
    assert [bytes(d) for d in digests] == want_digests
    assert zero.tolist() == want_zero
    assert kernel.digest(data) == xxhash.xxh3_128_digest(data.tobytes())


@pytest.mark.parametrize("mod", BACKENDS)
@pytest.mark.parametrize("chunk_size", [1, 100, 128, 1000, 4096, 70000])
def test_zero_flags(mod: types.ModuleType, chunk_size: int) -> None:
    n = 3 * chunk_size + chunk_size // 2 + 1
    data = np.zeros(n, np.uint8)
    digests, zero = mod.chunk_digests(data, chunk_size)
    assert zero.all()
    assert [bytes(d) for d in digests] == expected_chunks(data.tobytes(), chunk_size)[0]
    # one nonzero byte at the start, inside, and at the end of chunks (around the 128-byte scan blocks)
    for pos in sorted({0, 1, 127, 128, 129, chunk_size - 1, chunk_size, n - 1, n // 2}):
        if not 0 <= pos < n:
            continue
        d = data.copy()
        d[pos] = 1
        digests, zero = mod.chunk_digests(d, chunk_size, 2)
        want_digests, want_zero = expected_chunks(d.tobytes(), chunk_size)
        assert zero.tolist() == want_zero
        assert [bytes(x) for x in digests] == want_digests


@pytest.mark.parametrize("mod", BACKENDS)
@pytest.mark.parametrize("chunk_size", [8, 9, 2**31, 2**63, 2**64, 10**30])
def test_chunk_size_past_the_buffer_makes_one_chunk(mod: types.ModuleType, chunk_size: int) -> None:
    data = np.arange(8, dtype=np.uint8)
    digests, zero = mod.chunk_digests(data, chunk_size, 2)
    assert [bytes(d) for d in digests] == [xxhash.xxh3_128_digest(data.tobytes())] and zero.tolist() == [False]
    digests, zero = mod.chunk_digests(np.empty(0, np.uint8), chunk_size)
    assert digests.shape == (0, 16) and zero.shape == (0,)


@pytest.mark.parametrize("mod", BACKENDS)
def test_empty_inputs(mod: types.ModuleType) -> None:
    digests, zero = mod.chunk_digests(b"", 4096)
    assert digests.shape == (0, 16) and digests.dtype == np.uint8
    assert zero.shape == (0,) and zero.dtype == np.bool_
    for width in (1, 2, 4, 8):
        assert len(mod.split_planes(b"", width)) == 0
        assert len(mod.merge_planes_xor(b"", b"", width)) == 0


# ------------------------------------------------------------------------------------------- golden digests
# Pinned values: chunk digests name chunks in every existing store. If one of these changes, new saves stop
# deduplicating against (and verifying) everything already stored. Do not "fix" them by pasting new values.

GOLDEN_EMPTY = "99aa06d3014798d86001c324468d497f"
GOLDEN_RANGE_1MIB = "1b208d2839093774d36c0e13a3df139e"  # digest of bytes(range(256)) * 4096 (1 MiB)
GOLDEN_RANGE_64KIB_CHUNK = "9b31b2ce54c6e35a9a1db56d610a5516"  # each 64 KiB chunk of it (all 16 are equal)
GOLDEN_PRIME_CHUNKS = [  # bytes(range(251)) * 1000 (251000 bytes) at 64 KiB chunks; the last chunk is short
    "f5e7bc5d3d8675bfaaae63800707a868",
    "0cb99413601b546080ce0fa0e3effe5f",
    "074681942ddb0a4c54aea2bdfdd38f28",
    "11ea6765b8dc007b419a7010aa4fccca",
]
GOLDEN_ZERO_CHUNKS = [  # bytes(100000) at 64 KiB chunks: a full and a short all-zero chunk
    "fd5ee061c8433a0f33b202d302b65caa",
    "a20af01e2ac068be5fd047025c0885a8",
]


def test_golden_digests() -> None:
    assert kernel.digest(b"").hex() == GOLDEN_EMPTY
    data = bytes(range(256)) * 4096
    assert kernel.digest(data).hex() == GOLDEN_RANGE_1MIB
    digests, zero = kernel.chunk_digests(data, 64 << 10, 2)
    assert [bytes(d).hex() for d in digests] == [GOLDEN_RANGE_64KIB_CHUNK] * 16
    assert not zero.any()
    prime = bytes(range(251)) * 1000
    digests, _ = kernel.chunk_digests(prime, 64 << 10, 3)
    assert [bytes(d).hex() for d in digests] == GOLDEN_PRIME_CHUNKS
    zeros_digests, zero = kernel.chunk_digests(bytes(100000), 64 << 10)
    assert zero.all()
    assert [bytes(d).hex() for d in zeros_digests] == GOLDEN_ZERO_CHUNKS


# --------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("mod", BACKENDS)
def test_errors(mod: types.ModuleType) -> None:
    data = np.arange(64, dtype=np.uint8)
    for width in (0, 3, 5, 16, -4):
        with pytest.raises(ValueError):
            mod.split_planes(data, width)
        with pytest.raises(ValueError):
            mod.merge_planes_xor(data, data, width)
    for chunk_size in (0, -1):
        with pytest.raises(ValueError):
            mod.chunk_digests(data, chunk_size)
    for fn, args in (
        ("split_planes", ()),
        ("merge_planes", ()),
        ("xor_split_planes", (data,)),
        ("merge_planes_xor", (data,)),
    ):
        f = getattr(mod, fn)
        with pytest.raises(ValueError):  # out too short
            f(data, *args, 4, np.empty(63, np.uint8))
        with pytest.raises(ValueError):  # out too long
            f(data, *args, 4, bytearray(65))
        with pytest.raises(ValueError):  # read-only out
            f(data, *args, 4, bytes(64))
        with pytest.raises(ValueError):  # read-only numpy out
            ro = np.zeros(64, np.uint8)
            ro.flags.writeable = False
            f(data, *args, 4, ro)
        with pytest.raises(ValueError):  # non-contiguous input
            f(np.arange(128, dtype=np.uint8)[::2], *args, 4)
    with pytest.raises(ValueError):  # base of another length
        mod.xor_split_planes(data, data[:-1], 4)
    with pytest.raises(ValueError):
        mod.merge_planes_xor(data, bytes(65), 4)
    with pytest.raises(ValueError):
        mod.chunk_digests(np.arange(128, dtype=np.uint8)[::2], 16)


@pytest.mark.parametrize("mod", BACKENDS)
def test_any_thread_count_is_accepted(mod: types.ModuleType) -> None:
    data = make_buffer(600_000, 9, "runs")
    want = ref.chunk_digests(data, 5000)
    for threads in (-3, 0, 1, 7, 1000):
        assert_digests_equal(mod.chunk_digests(data, 5000, threads), want)
        np.testing.assert_array_equal(mod.split_planes(data, 8, threads=threads), ref.split_planes(data, 8))


# -------------------------------------------------------------------------------------- the GIL is released


def test_native_releases_the_gil() -> None:
    if kernel.backend != "native":
        pytest.skip("the python backend holds the GIL in places")
    buf = np.full(256 << 20, 0x5A, np.uint8)
    # A Python thread stamps the clock in a loop, yielding the GIL after each stamp. With a switch interval
    # far longer than the call, the main thread gives the GIL up between t0 and t1 only if the kernel
    # releases it, so any stamp strictly between t0 and t1 proves it did. Retried against scheduler noise.
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        for _attempt in range(5):
            stamps: list[float] = []
            stop = threading.Event()

            def spin(stamps: list[float] = stamps, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    stamps.append(time.perf_counter())
                    time.sleep(0)  # releases the GIL, so the main thread never waits for the switch interval

            th = threading.Thread(target=spin, daemon=True)
            th.start()
            while not stamps:
                time.sleep(0.001)
            t0 = time.perf_counter()
            kernel.chunk_digests(buf, 1 << 20, 1)
            t1 = time.perf_counter()
            stop.set()
            th.join()
            if any(t0 < s < t1 for s in stamps):
                return
    finally:
        sys.setswitchinterval(old_interval)
    pytest.fail("no Python thread ran while chunk_digests was running: the GIL was not released")


# --------------------------------------------------------------------------------------- stale-build checks


def _install_fake_native(monkeypatch: pytest.MonkeyPatch, **attrs: object) -> types.ModuleType:
    """Make ``from deltackpt import _kernel`` (inside kernel._load_native) return a stand-in module."""
    mod = types.ModuleType("deltackpt._kernel")
    mod.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, "deltackpt._kernel", mod)
    monkeypatch.setattr(sys.modules["deltackpt"], "_kernel", mod, raising=False)
    return mod


def test_load_native_rejects_stale_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    current = kernel.source_hash(NATIVE_DIR)
    assert current is not None, "the kernel sources should sit beside the package in a checkout"
    _install_fake_native(monkeypatch, API_VERSION=kernel.API_VERSION + 1)
    with pytest.raises(kernel.StaleBuildError, match="API version"):
        kernel._load_native()
    _install_fake_native(monkeypatch, API_VERSION=kernel.API_VERSION, SOURCE_HASH="0" * 16)
    with pytest.raises(kernel.StaleBuildError, match="other sources"):
        kernel._load_native()
    # DELTACKPT_BACKEND=native turns a stale build into an error; without it: one warning, python backend.
    monkeypatch.setenv("DELTACKPT_BACKEND", "native")
    with pytest.raises(kernel.StaleBuildError):
        kernel._select()
    monkeypatch.delenv("DELTACKPT_BACKEND")
    with pytest.warns(RuntimeWarning, match="native kernel unavailable"):
        name, impl = kernel._select()
    assert (name, impl) == ("python", ref)
    good = _install_fake_native(monkeypatch, API_VERSION=kernel.API_VERSION, SOURCE_HASH=current)
    assert kernel._load_native() is good


def test_missing_native_kernel_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # no compiled kernel (installed without the headers, or deleted): the warning, and the error when the native
    # backend is asked for, say what is missing and how to build it (not "partially initialized module")
    monkeypatch.setitem(sys.modules, "deltackpt._kernel", None)  # (what an import then finds: nothing)
    monkeypatch.delenv("DELTACKPT_BACKEND", raising=False)
    with pytest.warns(RuntimeWarning, match=r"deltackpt\._kernel is not there.*libxxhash-dev"):
        assert kernel._select() == ("python", ref)
    monkeypatch.setenv("DELTACKPT_BACKEND", "native")
    with pytest.raises(ImportError, match=r"deltackpt\._kernel is not there.*libxxhash-dev"):
        kernel._select()


def test_setup_py_hashes_sources_like_kernel() -> None:
    # setup.py duplicates kernel.source_hash (it cannot import the package at build time); run its copy.
    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [
        n
        for n in tree.body
        if isinstance(n, ast.Import | ast.ImportFrom)
        and all(a.name in ("hashlib", "annotations", "Path") for a in n.names)
        or isinstance(n, ast.FunctionDef)
        and n.name == "source_hash"
        or isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "_NATIVE_SOURCES" for t in n.targets)
    ]
    ns: dict[str, object] = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "setup.py", "exec"), ns)
    assert ns["_NATIVE_SOURCES"] == kernel._NATIVE_SOURCES
    assert ns["source_hash"](NATIVE_DIR) == kernel.source_hash(NATIVE_DIR)  # type: ignore[operator]


@needs_native
def test_use_simd_levels_round_trip_and_bad_levels_are_refused() -> None:
    """use_simd takes the three levels (and True/False for the widest/portable), returns the previous one, and
    refuses anything else without changing the level."""
    was = native.use_simd(native.SIMD_AVX2)
    try:
        assert native.use_simd(True) == native.SIMD_AVX2
        assert native.use_simd(False) == native.SIMD_ALL
        for bad in (3, -1, "2", None, 1.0):
            with pytest.raises(ValueError):
                native.use_simd(bad)
        assert native.use_simd(native.SIMD_ALL) == native.SIMD_NONE
    finally:
        native.use_simd(was)


@needs_native
def test_built_extension_matches_sources() -> None:
    assert native.API_VERSION == kernel.API_VERSION
    assert native.SOURCE_HASH == kernel.source_hash(NATIVE_DIR), "stale build: run make build"


@needs_native
def test_stale_build_detected_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """End to end: a copy of the package whose kernel sources then change is refused by kernel.check(), which
    Store() calls (the import itself succeeds, with backend "none", so that the command line can report it)."""
    if native.SOURCE_HASH != kernel.source_hash(NATIVE_DIR):
        pytest.skip("the build is already stale (test_built_extension_matches_sources reports it)")
    pkg = tmp_path / "deltackpt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")  # the kernel alone: no store modules, no torch import
    for name in ("kernel.py", "_pykernel.py", "errors.py"):  # errors.py: kernel.py imports caller_level from it
        shutil.copy(ROOT / "deltackpt" / name, pkg / name)
    shutil.copy(native.__file__, pkg / Path(native.__file__).name)
    shutil.copytree(NATIVE_DIR, tmp_path / "native", ignore=shutil.ignore_patterns("_kernel.c", "*.html"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTACKPT_")}
    env["PYTHONPATH"] = str(tmp_path)
    # the copy, not an installed deltackpt, is what runs: kernel.py's own imports must resolve inside it
    code = "import deltackpt.kernel as k; import sys; print(k.backend); print(k.__file__, file=sys.stderr); k.check()"

    def run(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True
        )

    r = run(DELTACKPT_BACKEND="native")
    assert r.returncode == 0 and r.stdout.strip() == "native", r.stderr
    assert r.stderr.splitlines()[0] == str(pkg / "kernel.py"), r.stderr
    with open(tmp_path / "native" / "kernel.c", "a") as f:
        f.write("/* edited after the build */\n")
    r = run(DELTACKPT_BACKEND="native")
    assert r.returncode != 0 and "StaleBuildError" in r.stderr and "other sources" in r.stderr
    assert r.stdout.strip() == "none" and "DELTACKPT_BACKEND=native" in r.stderr
    r = run()
    assert r.returncode == 0 and r.stdout.strip() == "python"
    assert "native kernel unavailable" in r.stderr


def test_a_kernel_that_does_not_build_is_skipped_unless_required(tmp_path: Path) -> None:
    """``pip install`` on a machine without the headers or a compiler (here: a compiler that fails) installs
    deltackpt with the pure-Python backend, a warning saying why; with DELTACKPT_REQUIRE_KERNEL=1 (the Makefile,
    CI) the build fails."""
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    shutil.copytree(NATIVE_DIR, tmp_path / "native", ignore=shutil.ignore_patterns("_kernel.c", "*.html"))
    (tmp_path / "deltackpt").mkdir()
    shutil.copy(ROOT / "deltackpt" / "kernel.py", tmp_path / "deltackpt" / "kernel.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTACKPT_")}

    def build(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path,
                              env={**env, "CC": "false", **extra}, capture_output=True, text=True, timeout=300)

    r = build()
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'building extension "deltackpt._kernel" failed' in r.stdout + r.stderr
    assert not list((tmp_path / "deltackpt").glob("_kernel*.so"))
    r = build(DELTACKPT_REQUIRE_KERNEL="1")
    assert r.returncode != 0


def test_no_warning_when_current() -> None:
    if kernel.backend != "native":
        pytest.skip("python backend")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel._select()[0] == "native"


# ------------------------------------------------------------------------------------------ frame decoding


def _chain(n_frames: int, size: int, width: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    """A keyframe and n_frames - 1 delta frames of an evolving float-like buffer; returns (frames, versions)."""
    from deltackpt import codec

    rng = np.random.default_rng(seed)
    enc = codec.Encoder()
    versions = [rng.integers(0, 256, size, dtype=np.uint8)]
    for _ in range(n_frames - 1):
        nxt = versions[-1].copy()
        flip = rng.integers(0, max(size, 1), size=max(size // 5, 1))
        if size:
            nxt[flip] ^= rng.integers(1, 256, len(flip), dtype=np.uint8)
        versions.append(nxt)
    frames = [enc.encode(memoryview(versions[0]), kernel.digest(versions[0]), width)]
    for prev, cur in zip(versions, versions[1:]):
        frames.append(
            codec._frame(
                codec.DELTA, width, size, kernel.digest(cur), kernel.digest(prev),
                enc._cctx.compress(kernel.xor_split_planes(cur, prev, width).tobytes()),
            )
        )
    return frames, versions


def _fields(frames: list[bytes]) -> tuple[list[int], list[int]]:
    return [f[5] for f in frames], [f[6] for f in frames]


@pytest.mark.parametrize("mod", BACKENDS)
@FAST
@given(n_frames=st.integers(1, 4), size=st.sampled_from([0, 1, 7, 64, 1000, 4097, 16384, 2 * 16384 + 1, 50003]),
       width=widths, seed=st.integers(0, 2**32 - 1))
def test_decode_frames_applies_a_chain(mod: types.ModuleType, n_frames: int, size: int, width: int,
                                       seed: int) -> None:
    frames, versions = _chain(n_frames, size, width, seed)
    codecs, ws = _fields(frames)
    out = np.full(size, 0xAB, np.uint8)
    assert mod.decode_frames(frames, codecs, ws, out, kernel.digest(versions[-1])) == (0, 0)
    np.testing.assert_array_equal(out, versions[-1])
    # the digest is checked over the whole result (the native kernel hashes it in steps as its last pass writes it)
    if size:
        assert mod.decode_frames(frames, codecs, ws, out, kernel.digest(versions[-1][:-1])) == (kernel.EDIGEST,
                                                                                                 n_frames)
    if n_frames > 1:  # a delta frame alone applies onto the base the caller put in ``out``
        out[:] = versions[-2]
        assert mod.decode_frames(frames[-1:], codecs[-1:], ws[-1:], out, None) == (0, 0)
        np.testing.assert_array_equal(out, versions[-1])


@pytest.mark.parametrize("mod", BACKENDS)
@FAST
@given(n_frames=st.integers(1, 4), width=widths, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_decode_frames_reports_the_damaged_frame(mod: types.ModuleType, n_frames: int, width: int, seed: int,
                                                 data: st.DataObject) -> None:
    frames, versions = _chain(n_frames, 3000, width, seed)
    codecs, ws = _fields(frames)
    k = data.draw(st.integers(0, n_frames - 1), label="damaged frame")
    pos = data.draw(st.sampled_from(list(range(0, 56)) + list(range(64, len(frames[k])))), label="byte")
    bad = bytearray(frames[k])
    bad[pos] ^= data.draw(st.integers(1, 255), label="mask")
    frames[k] = bytes(bad)
    out = np.empty(3000, np.uint8)
    assert mod.decode_frames(frames, codecs, ws, out, kernel.digest(versions[-1])) == (kernel.ECHECKSUM, k)


@pytest.mark.parametrize("mod", BACKENDS)
def test_decode_frames_payload_and_digest_errors(mod: types.ModuleType) -> None:
    from deltackpt import codec

    frames, versions = _chain(2, 5000, 4, 7)
    codecs, ws = _fields(frames)
    out = np.empty(5000, np.uint8)
    # the right frames checked against another digest: the result is reported, not a frame (bad == n)
    assert mod.decode_frames(frames, codecs, ws, out, kernel.digest(versions[0])) == (kernel.EDIGEST, 2)
    assert mod.decode_frames(frames, codecs, ws, out, None) == (0, 0)
    raw = versions[0]
    d = kernel.digest(raw)
    zst = codec.Encoder()._cctx.compress(raw.tobytes())
    forged = [
        codec._frame(codec.ZSTD, 1, 5000, d, codec.NO_BASE, zst[:-3]),  # truncated zstd data, valid checksum
        codec._frame(codec.ZSTD, 1, 5000, d, codec.NO_BASE, zst + zst),  # two zstd frames
        codec._frame(codec.ZSTD, 1, 5000, d, codec.NO_BASE, b"\x28\xb5\x2f\xfd" + bytes(40)),  # garbage
        codec._frame(codec.ZSTD, 1, 5000, d, codec.NO_BASE, codec.Encoder()._cctx.compress(raw[:4999].tobytes())),
        codec._frame(codec.RAW, 1, 5000, d, codec.NO_BASE, raw[:4999].tobytes()),  # raw payload of the wrong size
    ]
    for f in forged:
        assert mod.decode_frames([f], [f[5]], [f[6]], out, d) == (kernel.EPAYLOAD, 0)
    ok = codec._frame(codec.ZSTD, 1, 5000, d, codec.NO_BASE, zst)
    assert mod.decode_frames([ok], [1], [1], out, d) == (0, 0)
    np.testing.assert_array_equal(out, raw)
    with pytest.raises(ValueError):
        mod.decode_frames([], [], [], out, None)
    with pytest.raises(ValueError):
        mod.decode_frames([ok], [9], [1], out, None)
    with pytest.raises(ValueError):
        mod.decode_frames([ok], [1], [3], out, None)
    with pytest.raises(ValueError):
        mod.decode_frames([ok[:40]], [1], [1], out, None)
    with pytest.raises(ValueError):
        mod.decode_frames([ok], [1], [1], out, b"short")


@pytest.mark.parametrize("mod", BACKENDS)
def test_decode_frames_refuses_a_cut_zstd_frame_of_no_bytes(mod: types.ModuleType) -> None:
    """A zstd frame that declares no content, cut short (its last block header gone) under a valid frame
    checksum, is bad zstd data on both backends, as a cut frame with content is: python-zstandard's decompress()
    returns b"" for it without reading its blocks."""
    from deltackpt import codec

    d = kernel.digest(b"")
    zst = codec.Encoder()._cctx.compress(b"")
    out = np.empty(0, np.uint8)
    ok = codec._frame(codec.ZSTD, 1, 0, d, codec.NO_BASE, zst)
    assert mod.decode_frames([ok], [codec.ZSTD], [1], out, d) == (0, 0)
    for cut in (1, 2, 3):
        f = codec._frame(codec.ZSTD, 1, 0, d, codec.NO_BASE, zst[:-cut])
        assert mod.decode_frames([f], [codec.ZSTD], [1], out, d) == (kernel.EPAYLOAD, 0), cut
    f = codec._frame(codec.PLANES_ZSTD, 4, 0, d, codec.NO_BASE, zst[:-3])
    assert mod.decode_frames([f], [codec.PLANES_ZSTD], [4], out, d) == (kernel.EPAYLOAD, 0)


@pytest.mark.parametrize("mod", BACKENDS)
def test_decode_frames_ignores_the_declared_window(mod: types.ModuleType) -> None:
    """A zstd payload is decoded in one pass into the chunk's own bytes, with no window buffer: a frame declaring
    a window of 2^30 (which no writer makes) decodes on both backends, as format.md section 3 says a one-pass
    reader does, and costs no more memory."""
    from deltackpt import codec

    raw = np.frombuffer(bytes(range(256)) * 4096, np.uint8)  # 1 MiB
    zst = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw.tobytes())
    fhd = zst[4]
    assert fhd & 0x07 == 0  # no dictionary id, no checksum: the header is descriptor, [window], content size
    single = bool(fhd & 0x20)
    blocks = zst[5 + (0 if single else 1) + {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]:]
    wide = zst[:4] + bytes([0x80, (30 - 10) << 3]) + len(raw).to_bytes(4, "little") + blocks  # window 2^30
    assert zstandard.get_frame_parameters(wide).window_size == 1 << 30
    d = kernel.digest(raw)
    out = np.zeros(len(raw), np.uint8)
    frame = codec._frame(codec.ZSTD, 1, len(raw), d, codec.NO_BASE, wide)
    assert mod.decode_frames([frame], [codec.ZSTD], [1], out, d) == (0, 0)
    np.testing.assert_array_equal(out, raw)


@needs_native
def test_decode_frames_threads_share_nothing() -> None:
    """Many threads decode at once (each has its own zstd context and scratch) and all get the right bytes."""
    chains = [_chain(3, 200_000 + i, 4, i) for i in range(8)]
    errors: list[str] = []

    def work(i: int) -> None:
        frames, versions = chains[i]
        codecs, ws = _fields(frames)
        out = np.empty(len(versions[-1]), np.uint8)
        for _ in range(20):
            if native.decode_frames(frames, codecs, ws, out, kernel.digest(versions[-1])) != (0, 0):
                errors.append(f"chain {i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("mod", BACKENDS)
def test_decode_frames_large_chunks_repeatedly(mod: types.ModuleType) -> None:
    """Chunks above the 16 MiB the native decoder keeps as per-thread scratch (freed after each call): decoding
    one, a small one, then the large one again gives the right bytes each time."""
    big = _chain(2, (17 << 20) + 3, 4, 11)
    small = _chain(2, 4096, 4, 12)
    for frames, versions in (big, small, big):
        codecs, ws = _fields(frames)
        out = np.empty(len(versions[-1]), np.uint8)
        assert mod.decode_frames(frames, codecs, ws, out, kernel.digest(versions[-1])) == (0, 0)
        np.testing.assert_array_equal(out, versions[-1])


# -- predictions (dck_predict; docs/format.md 8a) ------------------------------------------------------------

_coef = st.one_of(st.just(0.0), st.floats(2.0**-60, 2.0**60), st.floats(-(2.0**60), -(2.0**-60)))
#: (references, coefficients) of each predictor id (native/kernel.h)
_PREDICTOR_SHAPES = {1: (2, 4), 2: (3, 7), 3: (2, 3), 4: (2, 4), 5: (3, 7), 6: (1, 2)}
_SPECIAL_F32 = [0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 0x00800000, 0x7F7FFFFF,
                0x80000000]


@needs_native
@SIMD_LEVELS
@FAST
@given(predictor=st.sampled_from([1, 2, 3, 4, 5, 6]), n=st.integers(0, 700),
       coefs=st.lists(_coef, min_size=7, max_size=7), f32=st.booleans(), seed=st.integers(0, 2**32 - 1),
       specials=st.lists(st.sampled_from(_SPECIAL_F32), max_size=8))
def test_predict_backends_agree_bit_for_bit(simd: int, predictor: int, n: int, coefs: list[float], f32: bool,
                                            seed: int, specials: list[int]) -> None:
    """Arbitrary float32 bit patterns (subnormals, infinities, NaN payloads), any length (blocks of 512, groups
    of four and a tail), any coefficients in range: the native kernel, with each level of its run-time-chosen
    vector loops (AVX-512, AVX2, portable on x86-64) and the numpy reference produce the same bytes. The
    bfloat16 predictors (4, 5) get the high halves of such patterns; update-param (6) rounds its last step once
    (round-to-odd in vector registers too; with float32 coefficients, ``f32``, its float32 loops and their
    fallback near 2^-126)."""
    if f32:
        coefs = [float(np.float32(c)) for c in coefs]
    rng = np.random.default_rng(seed)
    arrays = []
    for _ in range(4):
        a = (rng.standard_normal(n) * 10.0 ** rng.integers(-40, 38, n)).astype(np.float32).view(np.uint32)
        a[: len(specials)] = specials[: len(a)]
        rng.shuffle(a)
        arrays.append((a >> 16).astype("<u2").view(np.uint8) if predictor in (4, 5) else a.view(np.uint8))
    nrefs, nc = _PREDICTOR_SHAPES[predictor]
    outs = []
    for mod in (ref, native):
        out = np.empty(len(arrays[0]), np.uint8)
        with np.errstate(all="ignore"), simd_loops(simd):
            mod.predict(predictor, coefs[:nc], arrays[0], arrays[1 : 1 + nrefs], out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])


@needs_native
@SIMD_LEVELS
def test_bf16_predictions_round_ties_to_even_at_every_level(simd: int) -> None:
    """bfloat16 predictions whose float32 result lies exactly halfway between two bfloat16 values (p1·(1 + 2^-8)
    with c5 = 0: the dropped 16 bits are p1's significand, exactly 0x8000 for a power of two) round to the even
    one, in the native kernel's
    vector loops and tails as in the numpy reference, and NaN inputs give 0x7FC0."""
    rng = np.random.default_rng(3)
    n = 4099  # (blocks of 8 and 4 and a tail)
    scale = 2.0 ** rng.integers(-3, 4, n) * np.where(rng.random(n) < 0.5, -1.0, 1.0)
    p1 = ((scale * np.where(rng.random(n) < 0.3, 1.0, rng.uniform(1.0, 2.0, n))).astype(np.float32)
          .view(np.uint32) >> 16).astype("<u2")  # (three in ten a power of two)
    p1[:3] = [0x7FC1, 0xFF80, 0x0001]  # a NaN with a payload, -inf, a subnormal
    m = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype("<u2")
    v = (np.abs(rng.standard_normal(n)).astype(np.float32).view(np.uint32) >> 16).astype("<u2")
    coefs = (0.9, 10.0, 0.999, 1e-3, 1.0 + 2.0**-8, 0.0, 1e-8)
    wide = np.empty(4 * n, np.uint8)
    ref.predict(2, coefs, (p1.astype("<u4") << 16), [(a.astype("<u4") << 16) for a in (m, m, v)], wide)
    ties = 0
    want = []
    for b in wide.view("<u4").tolist():
        high, low = b >> 16, b & 0xFFFF
        if (b & 0x7FFFFFFF) > 0x7F800000:
            want.append(0x7FC0)
            continue
        ties += low == 0x8000
        want.append(high + (low > 0x8000 or (low == 0x8000 and high & 1)))
    assert ties > 500, ties
    for mod in (ref, native):
        out = np.empty(2 * n, np.uint8)
        with np.errstate(all="ignore"), simd_loops(simd):
            mod.predict(5, coefs, p1, [m, m, v], out)
        assert out.view("<u2").tolist() == want


@pytest.mark.parametrize("mod", BACKENDS)
def test_predict_rejects_bad_arguments(mod: types.ModuleType) -> None:
    a = np.zeros(64, np.uint8)
    out = np.empty(64, np.uint8)
    bad = [
        (7, [0.0] * 3, a, [a, a]),  # unknown predictor
        (0, [0.0] * 4, a, [a, a]),  # unknown predictor
        (6, [0.0] * 3, a, [a, a]),  # update-param's coefficients and references are two and one
        (6, [0.0] * 2, a, [a, a]),  # too many references
        (6, [0.0] * 3, a, [a]),  # coefficients of another predictor
        (4, [0.0] * 7, a, [a, a]),  # coefficients of another predictor
        (5, [0.0] * 7, a, [a, a]),  # too few references
        (1, [0.0] * 7, a, [a, a]),  # coefficients of another predictor
        (3, [0.0] * 4, a, [a, a]),  # coefficients of another predictor
        (3, [0.0] * 3, a, [a, a, a]),  # too many references
        (2, [0.0] * 7, a, [a, a]),  # too few references
        (1, [0.0] * 4, a[:60], [a, a]),  # lengths differ
        (1, [0.0] * 4, a[:62], [a[:62], a[:62]]),  # not whole float32 elements
        (4, [0.0] * 4, a[:63], [a[:63], a[:63]]),  # not whole bfloat16 elements
    ]
    for predictor, coefs, base, refs in bad:
        with pytest.raises(ValueError):
            mod.predict(predictor, coefs, base, refs, out[: len(base)])


@pytest.mark.parametrize("mod", BACKENDS)
@FAST
@given(predictor=st.sampled_from([1, 2, 3, 4, 5, 6]),
       n=st.sampled_from([0, 1, 3, 700, 4096, 4097 * 2 + 1, 3 * 4096 + 5]),
       width=widths, seed=st.integers(0, 2**32 - 1), deltas=st.integers(0, 2), damage=st.sampled_from(
           [None, "frame", "digest"]))
def test_decode_frames_computes_the_prediction(mod: types.ModuleType, predictor: int, n: int, width: int, seed: int,
                                               deltas: int, damage: str | None) -> None:
    """decode_frames(..., prediction=...) is predict() into out, then decode_frames: same bytes, same status, for
    lengths that cross the native kernel's 16 KiB steps or end in a tail shorter than the width, with delta frames
    above the predicted one, a damaged frame or a wrong digest; float32 and bfloat16 (4, 5) predictors, and
    update-param (6) with its one reference."""
    from deltackpt import codec
    from deltackpt import predict as pred_mod

    rng = np.random.default_rng(seed)
    arrays = [(rng.standard_normal(n) * 1e-3).astype(np.float32) for _ in range(4)]
    arrays[2] = np.abs(arrays[2])
    size = 2 if predictor in (4, 5) else 4
    if size == 2:  # (bfloat16: the high halves)
        arrays = [(a.view(np.uint32) >> 16).astype("<u2") for a in arrays]
    nrefs, coefs = {1: (2, (0.9, 10.0, 0.999, 1e-3)), 2: (3, (0.9, 10.0, 0.999, 1e-3, 0.99999, 1e-4, 1e-8)),
                    3: (2, (0.99999, 1.9e-3, 0.9e-3)), 6: (1, (0.998, 0.0785))}[
                        predictor if predictor == 6 else (predictor - 1) % 3 + 1]
    if predictor in (1, 4):
        base, refs = arrays[2], [arrays[1], arrays[3]]
    else:
        base, refs = arrays[0], [arrays[1], arrays[3], arrays[2]][:nrefs]
    guess = np.empty(size * n, np.uint8)
    ref.predict(predictor, coefs, base, refs, guess)
    raw = guess.copy()
    if len(raw):  # (off by a few low bits here and there)
        raw[rng.integers(0, len(raw), max(1, len(raw) // 50)) // size * size] ^= 3
    rec = pred_mod.Prediction(predictor, (bytes(16),) * nrefs, coefs).pack()
    enc = codec.Encoder(1)
    frames = [enc.encode_predicted(raw, kernel.digest(raw), width, guess, bytes(16), rec)]
    versions = [raw]
    for _ in range(deltas):
        nxt = versions[-1].copy()
        if len(nxt):
            nxt[rng.integers(0, len(nxt), 5)] ^= 0x5A
        frames.append(codec._frame(codec.DELTA, width, len(nxt), kernel.digest(nxt), kernel.digest(versions[-1]),
                                   enc._cctx.compress(kernel.xor_split_planes(nxt, versions[-1], width).tobytes())))
        versions.append(nxt)
    codecs, ws = _fields(frames)
    digest = kernel.digest(versions[-1])
    if damage == "frame" and n:
        k = int(rng.integers(0, len(frames)))
        f = bytearray(frames[k])
        f[-1] ^= 1
        frames[k] = bytes(f)
    elif damage == "digest":
        digest = kernel.digest(versions[-1][:-1])
    prediction = (predictor, coefs, base, refs)
    want = np.full(size * n, 0xCD, np.uint8)
    ref.predict(*prediction, want)
    status = ref.decode_frames(frames, codecs, ws, want, digest)
    out = np.full(size * n, 0xAB, np.uint8)
    assert mod.decode_frames(frames, codecs, ws, out, digest, prediction) == status
    if status == (0, 0):
        np.testing.assert_array_equal(out, versions[-1])
    else:
        assert damage is not None
    with pytest.raises(ValueError):  # only a predicted first frame has a prediction
        mod.decode_frames(frames[1:] or [enc.encode(raw, kernel.digest(raw), width)],
                          codecs[1:] or [codec.PLANES_ZSTD if width > 1 else codec.ZSTD], ws[1:] or [width], out,
                          None, prediction)
