"""Shared fixtures and helpers of the deltackpt test suite.

Hypothesis profiles: ``ci`` (the default: modest example counts, no deadline) and ``thorough`` (many more
examples); pick one with ``HYPOTHESIS_PROFILE=thorough``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import inspect
import os
import signal
import struct
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint
from hypothesis import HealthCheck, settings

# Test the checkout these tests live in, whatever else an (editable) install in the environment points at.
ROOT = Path(__file__).resolve().parent.parent
if not sys.path or Path(sys.path[0] or ".").resolve() != ROOT:
    sys.path.insert(0, str(ROOT))

import deltackpt  # noqa: E402
import deltackpt.store  # noqa: E402

# A run started in the background of a non-interactive shell (``make test`` runs the two backends' suites side by
# side) starts with SIGINT ignored, and its child processes inherit that. The signal tests expect Python's own
# Ctrl-C handler, which a training script started from a terminal has: give the run (and so its children) that.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "plumbing: a test of process plumbing (signal handlers, exit hooks, the "
                            "command line's entry points and pipes, process groups of DCP ranks); see "
                            "pytest_collection_modifyitems")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``make test`` runs the suite once per kernel backend. The plumbing tests start Python processes (DCP's:
    a process group of ranks) and wait on their signals and exits: which backend hashes and encodes is not what
    they test (the backends are tested
    against each other elsewhere), and they are a third of the suite's time. The pass pinned to the pure-Python
    backend (``DELTACKPT_EXPECT_BACKEND=python``, whose companion pass runs them) skips them; any other run of
    the suite runs them, on whichever backend it has."""
    if os.environ.get("DELTACKPT_EXPECT_BACKEND") != "python":
        return
    skip = pytest.mark.skip(reason="process plumbing: run in the native backend's pass of make test")
    for item in items:
        if item.get_closest_marker("plumbing") is not None:
            item.add_marker(skip)


#: ``no_dist=True`` for dcp.save and dcp.load where they take it (torch 2.4+); torch 2.3's infer it from there being
#: no initialized process group, as in the tests that pass it in-process
DCP_NO_DIST: dict[str, Any] = (
    {"no_dist": True} if "no_dist" in inspect.signature(torch.distributed.checkpoint.save).parameters else {})

#: whether dcp.load writes top-level non-tensor values into the caller's state dict: torch 2.3's loads them into a
#: copy of its top level (``statetful_sd``) and drops them, whatever the storage reader returns (torch 2.4 fixed it)
DCP_LOADS_TOP_LEVEL_VALUES = "no_dist" in inspect.signature(torch.distributed.checkpoint.load).parameters

#: whether DCP flattens a nested dict that holds no tensor into its entries (``{"extra": {"step": 7}}`` saves and
#: loads ``extra.step``), as the torch that wrote the DCP fixtures did: torch 2.3's keeps such a dict one value
#: (``extra``), so that its load planner asks for a key those fixtures' metadata does not have (KeyError)
DCP_FLATTENS_VALUE_DICTS = "e.a" in torch.distributed.checkpoint._nested_dict.flatten_state_dict({"e": {"a": 1}})[0]


def optimizers_take_names() -> bool:
    """Whether an optimizer can be built from ``named_parameters()`` (torch 2.6+: ``param_names``)."""
    try:
        torch.optim.SGD([("p", torch.nn.Parameter(torch.zeros(1)))], lr=0.1)
    except TypeError:
        return False
    return True


settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

assert Path(deltackpt.__file__).resolve().parent == ROOT / "deltackpt", (
    f"testing {deltackpt.__file__}, not the checkout at {ROOT}"
)

SMALL_CHUNK = 4096


@pytest.fixture(autouse=True)
def _encode_where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves encode chunks under 64 KiB on the saving thread and larger ones on the worker pool; the suite's
    4 KiB chunks would then never reach the pool. Every other test (by a hash of its id, so the same ones each
    run) sends every chunk to the pool instead, so both paths run under every kind of test."""
    if zlib.crc32(request.node.nodeid.encode()) % 2:
        monkeypatch.setattr(deltackpt.store, "_INLINE_BELOW", 0)


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_path: Path) -> Iterator[deltackpt.Store]:
    """A fresh store with a small chunk size (4 KiB) and two worker threads."""
    s = deltackpt.Store(store_path, chunk_size=SMALL_CHUNK, threads=2)
    try:
        yield s
    finally:
        s.close()


# -- helpers shared by the test modules ------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's elements in logical (row-major) order."""
    src = t.detach().resolve_conj().resolve_neg()
    # a fresh tensor: torch calls some odd-strided one-element views contiguous but cannot view them as bytes
    t = torch.empty(src.shape, dtype=src.dtype).copy_(src)
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def array_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def float_bits(x: float) -> bytes:
    return struct.pack(">d", x)


def dir_snapshot(path: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``path`` (empty when it does not exist)."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for p in sorted(path.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextlib.contextmanager
def entries_written_as(**fields: Any) -> Iterator[None]:
    """Saves in the block write every torch tensor's entry with ``fields`` replaced: a dtype or device that a
    newer torch or another backend wrote (``dtype="float4_e9m9_future"``, ``device="npu:0"``)."""
    import dataclasses

    from deltackpt import tree

    real = tree._torch_leaf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tree, "_torch_leaf", lambda t, p, **kw: dataclasses.replace(real(t, p, **kw), **fields))
        yield


def preload_shim(factory: pytest.TempPathFactory, source: str) -> Path:
    """Compile ``tests/<source>.c`` (an LD_PRELOAD shim that wraps system calls of a child process) into a shared
    library for the tests of a module; skip them where there is no C compiler."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the LD_PRELOAD shim")
    out = factory.mktemp("shim") / f"{source}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(Path(__file__).parent / f"{source}.c"),
                    "-ldl"], check=True)
    return out


def pack_files(store_path: Path) -> list[Path]:
    return sorted((store_path / "packs").glob("*.pack"))


def _canon(x: Any) -> Any:
    """A hashable stand-in for a plain value that compares floats (and complex parts) by their bits, so NaN keys
    and -0.0 compare exactly, and sets by their elements' stand-ins."""
    if isinstance(x, float):
        return ("f", float_bits(x))
    if isinstance(x, complex):
        return ("c", float_bits(x.real), float_bits(x.imag))
    if isinstance(x, (set, frozenset)):
        return (type(x).__name__, frozenset(_canon(v) for v in x))
    if type(x) is tuple:
        return ("t", tuple(_canon(v) for v in x))
    if isinstance(x, np.generic):
        return ("ns", x.dtype.str, x.tobytes())
    return (type(x).__name__, x)


def _identity(obj: Any) -> Any:
    """What the store treats as one array: the same object, or (with elements) the same view of the same memory
    with the same type, dtype, requires_grad and conjugate/negative bits (the entries of a tied model's
    ``state_dict()``)."""
    if isinstance(obj, torch.Tensor) and obj.numel() > 0:
        return (type(obj), obj.device, obj.data_ptr(), obj.shape, obj.stride(), obj.dtype, obj.requires_grad,
                obj.is_conj(), obj.is_neg())
    if isinstance(obj, np.ndarray) and obj.size > 0:
        return (obj.ctypes.data, obj.shape, obj.strides, obj.dtype)
    return id(obj)


def _seen_before(orig: Any, loaded: Any, memo: dict[Any, Any], where: str) -> bool:
    """Aliasing check of assert_same_state: True when ``orig`` was met already (and ``loaded`` is the object it
    came back as then); otherwise records the pair, after checking ``loaded`` is no other original's copy."""
    key = _identity(orig)
    if key in memo:
        assert memo[key] is loaded, f"{where}: aliasing lost"
        return True
    assert all(v is not loaded for v in memo.values()), f"{where}: distinct objects came back as one"
    memo[key] = loaded
    return False


def assert_same_state(orig: Any, loaded: Any, memo: dict[Any, Any] | None = None, path: str = "") -> None:
    """Structure, types, dtypes, shapes and bits of ``loaded`` equal those of ``orig``.

    Tensors and arrays must keep their aliasing: one object in ``orig`` (met twice), or two views of the same
    memory such as tied weights, is one object in ``loaded``, and two distinct arrays stay two.
    """
    if memo is None:
        memo = {}
    where = path or "<root>"
    assert type(loaded) is type(orig), f"{where}: type {type(loaded)} != {type(orig)}"
    if isinstance(orig, torch.Tensor):
        if _seen_before(orig, loaded, memo, where):
            return
        assert loaded.dtype == orig.dtype, f"{where}: dtype {loaded.dtype} != {orig.dtype}"
        assert loaded.shape == orig.shape, f"{where}: shape {loaded.shape} != {orig.shape}"
        assert loaded.device.type == "cpu"
        assert loaded.is_contiguous(), f"{where}: not contiguous"
        assert loaded.requires_grad == orig.requires_grad, f"{where}: requires_grad"
        assert tensor_bytes(loaded) == tensor_bytes(orig), f"{where}: bits differ"
        return
    if isinstance(orig, np.ndarray):
        if _seen_before(orig, loaded, memo, where):
            return
        assert loaded.dtype == orig.dtype, f"{where}: dtype {loaded.dtype} != {orig.dtype}"
        assert loaded.dtype.str == orig.dtype.str, f"{where}: byte order {loaded.dtype.str}"
        assert loaded.shape == orig.shape, f"{where}: shape {loaded.shape} != {orig.shape}"
        assert array_bytes(loaded) == array_bytes(orig), f"{where}: bits differ"
        return
    if isinstance(orig, dict):  # dict, OrderedDict, Counter, defaultdict: same keys (types, bits) in the same order
        assert [_canon(k) for k in loaded] == [_canon(k) for k in orig], f"{where}: keys {list(loaded)} != {list(orig)}"
        if isinstance(orig, collections.defaultdict):
            assert loaded.default_factory is orig.default_factory, f"{where}: default_factory"
        for (k, a), b in zip(orig.items(), loaded.values(), strict=True):
            assert_same_state(a, b, memo, f"{path}[{k!r}]")
        return
    if isinstance(orig, (list, tuple, collections.deque)) and not isinstance(orig, torch.Size):
        assert len(loaded) == len(orig), f"{where}: length {len(loaded)} != {len(orig)}"
        if isinstance(orig, collections.deque):
            assert loaded.maxlen == orig.maxlen, f"{where}: maxlen {loaded.maxlen} != {orig.maxlen}"
        for i, (a, b) in enumerate(zip(orig, loaded, strict=True)):
            assert_same_state(a, b, memo, f"{path}[{i}]")
        return
    if isinstance(orig, (float, complex, set, frozenset)):
        assert _canon(loaded) == _canon(orig), f"{where}: {loaded!r} != {orig!r} (bits)"
        return
    if isinstance(orig, np.generic):
        assert loaded.dtype == orig.dtype, f"{where}: numpy scalar dtype {loaded.dtype} != {orig.dtype}"
        assert loaded.tobytes() == orig.tobytes(), f"{where}: numpy scalar bits"
        return
    assert loaded == orig, f"{where}: {loaded!r} != {orig!r}"
