"""Bad input is refused with a typed error that says what was wrong, and refusing it changes nothing."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import warnings
from collections import Counter, OrderedDict, defaultdict, namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_CHUNK, assert_same_state, dir_snapshot
from hypothesis import given
from hypothesis import strategies as st

import deltackpt
from deltackpt import (
    CheckpointNotFoundError,
    CorruptManifestError,
    InvalidNameError,
    ShapeMismatchError,
    UnsupportedTypeError,
)


def _snapshot(store_path: Path) -> dict[str, Any]:
    return {sub: dir_snapshot(store_path / sub) for sub in ("packs", "manifests", "tmp")}


def _state_with(bad: Any) -> dict[str, Any]:
    return {
        "model": {"w": torch.randn(3000), "b": torch.zeros(4)},
        "optimizer": {"state": {0: {"m": torch.randn(3000)}}, "param_groups": [{"lr": 0.1, "foo": bad}]},
    }


Point = namedtuple("Point", "x y")


class Custom:
    pass


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized creation functions are deprecated, still worth refusing
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


UNSUPPORTED = {
    "quantized": _quantized(),
    "set_of_objects": {Custom()},
    "frozenset_of_namedtuples": frozenset([Point(1, 2)]),
    "object": object(),
    "lambda": lambda x: x,
    "custom": Custom(),
    "namedtuple": Point(1, 2),
    "defaultdict_lambda": defaultdict(lambda: 0),
    "defaultdict_custom": defaultdict(Custom),
    "bytearray": bytearray(b"ab"),
    "range": range(3),
    "ellipsis": ...,
    "module": torch.nn.Linear(2, 2),
    "object_array": np.array([object()], dtype=object),
    "str_array": np.array(["a", "b"]),
    "structured_array": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
    "datetime_array": np.array(["2020-01-01"], dtype="datetime64[D]"),
    "sparse": torch.eye(3).to_sparse(),
    "meta": torch.empty(3, device="meta"),
    "numpy_str_scalar": np.str_("x"),
    "numpy_datetime": np.datetime64("2020-01-01"),
    "reference_cycle": (lambda c: (c.append({"again": c}), c)[1])([]),
    "nested_too_deep": functools.reduce(lambda inner, _: [inner], range(deltackpt.tree.MAX_DEPTH), 0),
    # a key nested past Python's recursion limit raised RecursionError
    "key_nested_too_deep": {functools.reduce(lambda inner, _: (inner,), range(2000), ()): 1},
    # torch has no copy of a non-contiguous sub-byte tensor: it raised torch's NotImplementedError mid-save
    **({"noncontiguous_uint4": torch.zeros(640, dtype=torch.uint8).view(torch.uint4).reshape(64, 10).t()}
       if hasattr(torch, "uint4") else {}),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_value_names_key_path_and_writes_nothing(
    store: deltackpt.Store, store_path: Path, name: str
) -> None:
    store.save({"ok": torch.ones(10)}, step=1)
    listed, snap = store.list(), _snapshot(store_path)
    with pytest.raises(UnsupportedTypeError) as ei:
        store.save(_state_with(UNSUPPORTED[name]), step=2)
    assert isinstance(ei.value, TypeError)
    assert "optimizer.param_groups[0].foo" in str(ei.value)
    assert store.list() == listed
    assert _snapshot(store_path) == snap
    # a failed save leaves the store usable
    good = _state_with(0.5)
    store.save(good, step=2)
    assert_same_state(good, store.load(2))
    assert [i.step for i in store.list()] == [1, 2]


@pytest.mark.parametrize(("name", "instead"), [
    ("quantized", "dequantize()"), ("sparse", "to_dense()"), ("meta", "to_empty()"), ("nested", "unbind()"),
    ("nested_jagged", "unbind()"), ("object_array", "a.tolist()"), ("str_array", "a.tolist()"),
    ("structured_array", "a[name]"), ("datetime_array", "a.view(np.int64)"), ("memmap", "np.asarray(...)"),
])
def test_an_unsupported_array_says_what_to_store_instead(store: deltackpt.Store, tmp_path: Path, name: str,
                                                         instead: str) -> None:
    """An array a save refuses is refused naming the key path and what to store instead (before: 'quantized,
    meta and nested tensors are not supported', 'numpy dtype datetime64[D] is not supported', and for an
    np.memmap the advice to register its type or pickle it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nested tensors are a prototype)
        value = {"nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
                 "nested_jagged": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                                     layout=torch.jagged),
                 "memmap": lambda: np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4,)),
                 }.get(name, lambda: UNSUPPORTED[name])()
    with pytest.raises(UnsupportedTypeError, match=r"cannot store optimizer\.param_groups\[0\]\.foo: ") as ei:
        store.save(_state_with(value), step=1)
    assert instead in str(ei.value)


@pytest.mark.parametrize(("make", "instead"), [
    (lambda: torch.nn.Linear(2, 2), "store its state_dict()"),
    (lambda: torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), "store its state_dict()"),
    (lambda: torch.amp.GradScaler("cpu"), "store its state_dict()"),
    (lambda: torch.Generator(), "store its get_state()"),
    (lambda: np.random.default_rng(0), "store its bit_generator.state"),
])
def test_a_live_training_object_says_to_store_its_state(store: deltackpt.Store, make: Any, instead: str) -> None:
    """A module, optimizer, scaler or generator put into a state by mistake (``{"model": model}``, as torch.save
    pickles it) is refused naming the key path and its state to store instead: the advice given to any other type
    (register it with register_type) would store the live object, not its state."""
    with pytest.raises(UnsupportedTypeError, match=r"cannot store train\.model: ") as ei:
        store.save({"train": {"model": make()}}, step=1)
    assert instead in str(ei.value) and "register_type" not in str(ei.value)
    assert store.list() == []


@pytest.mark.parametrize(
    ("state", "path"),
    [
        ({"a": {"b": [1, {"c": {1, object()}}]}}, "a.b[1].c"),
        ([0, [1, 2, object()]], "[1][2]"),
        ({"x": ({7: {"deep": frozenset([(1, Custom())])}},)}, "x[0][7].deep"),
        ({"x": {(1, 2): {None: object()}}}, "x[(1, 2)][None]"),
        ({"layers": OrderedDict([("0.weight", torch.ones(1)), ("1.bias", object())])}, "layers.1.bias"),
        (object(), "<root>"),
    ],
)
def test_key_paths_in_messages(store: deltackpt.Store, state: Any, path: str) -> None:
    with pytest.raises(UnsupportedTypeError, match=re.escape(path)):
        store.save(state, step=1)
    assert store.list() == []


@pytest.mark.parametrize("key", [(1, object()), Custom(), Point(1, 2), frozenset([Custom()]), torch.ones(1)])
def test_bad_dict_keys(store: deltackpt.Store, store_path: Path, key: Any) -> None:
    snap = _snapshot(store_path)
    state = {"optimizer": {"state": {key: torch.ones(2)}}}
    with pytest.raises(UnsupportedTypeError) as ei:
        store.save(state, step=1)
    assert "optimizer.state" in str(ei.value)
    assert store.list() == [] and _snapshot(store_path) == snap


@given(
    prefix=st.lists(st.one_of(st.text("abcxyz_", min_size=1, max_size=5), st.integers(0, 3)), max_size=4),
    bad=st.sampled_from([{Custom()}, object(), frozenset([Point(1, 2)]), (lambda: 0), defaultdict(Custom)]),
)
def test_unsupported_anywhere_hypothesis(tmp_path_factory: pytest.TempPathFactory, prefix: list[Any],
                                         bad: Any) -> None:
    """Build a nest of dicts (str keys) and lists (int indices) around an unsupported value."""
    state: Any = bad
    expected = ""
    for k in reversed(prefix):
        if isinstance(k, int):
            state = [None] * k + [state]
        else:
            state = {k: state, "t": torch.ones(3)}
    for k in prefix:
        expected = f"{expected}[{k}]" if isinstance(k, int) else (f"{expected}.{k}" if expected else k)
    path = tmp_path_factory.mktemp("h") / "s"
    with deltackpt.Store(path, chunk_size=SMALL_CHUNK) as s:
        with pytest.raises(UnsupportedTypeError) as ei:
            s.save(state, step=1)
        assert f"cannot store {expected or '<root>'}: unsupported type" in str(ei.value)
        assert s.list() == []
    assert dir_snapshot(path / "packs") == {} and dir_snapshot(path / "manifests") == {}


def test_pickle_opt_in_still_refuses_unpicklable(store: deltackpt.Store, store_path: Path) -> None:
    snap = _snapshot(store_path)
    with pytest.raises(UnsupportedTypeError, match=r"optimizer\.param_groups\[0\]\.foo"):
        store.save(_state_with(lambda x: x), step=1, allow_pickle=True)
    assert store.list() == [] and _snapshot(store_path) == snap


def test_metadata_is_checked_before_writing(store: deltackpt.Store, store_path: Path) -> None:
    snap = _snapshot(store_path)
    for meta in ({"t": torch.ones(2)}, {"s": {1}}, {"o": object()}, {(1, 2): 3}, {"c": Counter()}, {"z": 1j}):
        with pytest.raises(UnsupportedTypeError):
            store.save({"w": torch.randn(5000)}, step=1, metadata=meta)
    for loss in (torch.tensor(2.5), np.ones(1, np.float32)):  # the loss of the step, not yet a number
        with pytest.raises(UnsupportedTypeError, match=r"'loss'; pass .* as \.item\(\)"):
            store.save({"w": torch.randn(5000)}, step=1, metadata={"loss": loss})
    for meta in ([("a", 1)], [1, 2], "ab", 5):  # not a mapping: named as metadata (dict() took pairs)
        with pytest.raises(TypeError, match="metadata must be a mapping"):
            store.save({"w": torch.randn(5000)}, step=1, metadata=meta)  # type: ignore[arg-type]
    assert store.list() == [] and _snapshot(store_path) == snap


def test_failed_save_midway_then_save_works(store: deltackpt.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while chunks are being encoded aborts the save: no checkpoint, and the next save works."""
    calls = {"n": 0}
    real = deltackpt.Store._encode

    def flaky(self: deltackpt.Store, *args: Any, **kwargs: Any) -> bytes:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk on fire")
        return real(self, *args, **kwargs)

    state = {"a": torch.randn(10 * SMALL_CHUNK // 4), "b": torch.randn(10 * SMALL_CHUNK // 4)}
    monkeypatch.setattr(deltackpt.Store, "_encode", flaky)
    with pytest.raises(OSError, match="disk on fire"):
        store.save(state, step=1)
    assert store.list() == []
    monkeypatch.setattr(deltackpt.Store, "_encode", real)
    info = store.save(state, step=1)
    assert_same_state(state, store.load(1))
    assert [i.id for i in store.list()] == [info.id]
    assert store.verify().ok
    store.gc()  # frames of the failed save are garbage
    assert_same_state(state, store.load(1))


# -- steps and ids ---------------------------------------------------------------------------------------


def test_unknown_step_and_id(store: deltackpt.Store) -> None:
    with pytest.raises(CheckpointNotFoundError):
        store.load()  # empty store
    with pytest.raises(CheckpointNotFoundError):
        store.info()
    info = store.save({"w": torch.ones(3)}, step=5)
    calls = [
        lambda: store.load(4), lambda: store.load(6), lambda: store.load(id="0123456789abcdef"),
        lambda: store.info(4), lambda: store.info(id="0123456789abcdef"), lambda: store.delete(4),
        lambda: store.delete(id="fedcba9876543210"), lambda: store.verify(step=4),
        lambda: store.load_into({"w": torch.zeros(3)}, step=4), lambda: store.manifest(4),
        lambda: store.load(5, id="0123456789abcdef"),
    ]
    for call in calls:
        with pytest.raises(CheckpointNotFoundError) as ei:
            call()
        assert isinstance(ei.value, KeyError)
        assert str(ei.value).startswith("no checkpoint")
    store.delete(5)
    with pytest.raises(CheckpointNotFoundError):
        store.load(id=info.id)
    with pytest.raises(CheckpointNotFoundError):
        store.delete(5)


BAD_IDS = ["..", "../etc", "a/b", "/abs", "0123456789abcde/", "0123456789ABCDEF", "0123456789abcde",
           "0123456789abcdef0", "", " 0123456789abcdef", "0123456789abcdef\n", "..\\x", 12345]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_invalid_ids(store: deltackpt.Store, store_path: Path, bad: Any) -> None:
    store.save({"w": torch.ones(3)}, step=1)
    snap, listed = _snapshot(store_path), store.list()
    for call in (lambda: store.load(id=bad), lambda: store.delete(id=bad), lambda: store.info(id=bad),
                 lambda: store.verify(id=bad), lambda: store.load_into({"w": torch.zeros(3)}, id=bad),
                 lambda: store.save({"w": torch.ones(3)}, step=2, parent=bad)):
        with pytest.raises(InvalidNameError) as ei:
            call()
        assert isinstance(ei.value, ValueError)
    assert store.list() == listed and _snapshot(store_path) == snap


@pytest.mark.parametrize("step", [-1, -(2**63), 2**63, 2**64 + 5])
def test_out_of_range_steps(store: deltackpt.Store, step: int) -> None:
    store.save({"w": torch.ones(3)}, step=1)
    for call in (lambda: store.save({"w": torch.ones(3)}, step=step), lambda: store.load(step),
                 lambda: store.info(step), lambda: store.delete(step)):
        with pytest.raises(ValueError):
            call()
    assert [i.step for i in store.list()] == [1]


@pytest.mark.parametrize("step", [1.0, 1.5, "1", True, None, [1], np.float64(2.0)])
def test_non_int_steps(store: deltackpt.Store, step: Any) -> None:
    store.save({"w": torch.ones(3)}, step=1)
    with pytest.raises(TypeError):
        store.save({"w": torch.ones(3)}, step=step)
    if step is not None:
        for call in (lambda: store.load(step), lambda: store.info(step), lambda: store.delete(step)):
            with pytest.raises(TypeError):
                call()
    assert [i.step for i in store.list()] == [1]


def test_extreme_and_numpy_steps(store: deltackpt.Store) -> None:
    store.save({"w": torch.ones(1)}, step=0)
    store.save({"w": torch.full((1,), 2.0)}, step=2**63 - 1)
    store.save({"w": torch.full((1,), 3.0)}, step=np.int64(7))
    assert store.load(0)["w"].item() == 1 and store.load(2**63 - 1)["w"].item() == 2
    assert store.load(np.int32(7))["w"].item() == 3
    assert store.info(7).step == 7 and type(store.info(7).step) is int


def test_unknown_parent(store: deltackpt.Store, store_path: Path) -> None:
    store.save({"w": torch.ones(3)}, step=1)
    snap = _snapshot(store_path)
    with pytest.raises(CheckpointNotFoundError):
        store.save({"w": torch.randn(3000)}, step=2, parent="0123456789abcdef")
    assert [i.step for i in store.list()] == [1]
    assert _snapshot(store_path) == snap


def test_delete_needs_a_step_or_id(store: deltackpt.Store) -> None:
    store.save({"w": torch.ones(1)}, step=1)
    with pytest.raises(ValueError):
        store.delete()
    assert len(store.list()) == 1


# -- opening stores ----------------------------------------------------------------------------------------


def test_chunk_size_mismatch(store_path: Path) -> None:
    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK) as s:
        s.save({"w": torch.ones(3)}, step=1)
    with pytest.raises(ValueError, match=str(SMALL_CHUNK)):
        deltackpt.Store(store_path, chunk_size=2 * SMALL_CHUNK)
    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK) as s:
        assert s.load(1)["w"].sum().item() == 3


@pytest.mark.parametrize("cs", [0, 1000, 3 * 4096, 2048, -4096, 2**31])
def test_bad_chunk_size_creates_nothing(tmp_path: Path, cs: int) -> None:
    path = tmp_path / "s"
    with pytest.raises(ValueError):
        deltackpt.Store(path, chunk_size=cs)
    assert not (path / "STORE").exists()


def test_chunk_size_wrong_type(tmp_path: Path) -> None:
    for bad in (4096.0, True, "4096"):
        with pytest.raises(TypeError, match="chunk_size must be an int"):
            deltackpt.Store(tmp_path / "s", chunk_size=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "s" / "STORE").exists()
    with deltackpt.Store(tmp_path / "s", chunk_size=np.int64(8192)) as s:  # (numpy ints, as the other settings)
        assert s.chunk_size == 8192 and type(s.chunk_size) is int


@pytest.mark.parametrize("kwargs, error", [
    ({"max_chain": -1}, ValueError), ({"max_chain": 65}, ValueError), ({"max_chain": 2.5}, TypeError),
    ({"zstd_level": 100}, ValueError), ({"zstd_level": "3"}, TypeError), ({"threads": -1}, ValueError),
    ({"threads": 0}, ValueError), ({"read_threads": 0}, ValueError), ({"pack_size": 0}, ValueError),
    ({"delta_cache_bytes": -1}, ValueError), ({"predict": "no"}, TypeError), ({"predict": 0}, TypeError),
    ({"allow_network_fs": "yes"}, TypeError), ({"max_chain": True}, TypeError),
])
def test_bad_settings_are_refused_when_the_store_opens_and_create_nothing(tmp_path: Path, kwargs: dict[str, Any],
                                                                          error: type) -> None:
    """A setting of the wrong type or range is refused by Store() naming the argument, before a new store's
    directory exists (before, max_chain=-1 first created a whole store, zstd_level=100 failed every save with
    zstd's own message, and predict="no" meant True)."""
    path = tmp_path / "s"
    with pytest.raises(error, match=next(iter(kwargs))):
        deltackpt.Store(path, **kwargs)
    assert not path.exists()


def test_the_read_threads_default_follows_many_threads_within_its_range(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default read threads (4 x threads, at least 8) stop at the largest setting: threads=2000 was refused
    as "DELTACKPT_READ_THREADS must be between 1 and 4096, got 8000", naming a variable nobody set."""
    monkeypatch.delenv("DELTACKPT_READ_THREADS", raising=False)
    with deltackpt.Store(tmp_path / "s", threads=2000) as s:
        assert (s.threads, s.read_threads) == (2000, 4096)
    with deltackpt.Store(tmp_path / "s", threads=3) as s:
        assert s.read_threads == 12


@pytest.mark.parametrize("kwargs, env", [
    ({"zstd_level": 100}, {}), ({"threads": 0}, {}), ({"chunk_size": 8192}, {}), ({}, {"DELTACKPT_THREADS": "0"}),
    ({}, {"DELTACKPT_MAX_CHAIN": "99"}),
])
def test_bad_settings_for_a_repair_leave_a_healthy_store_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  kwargs: dict[str, Any], env: dict[str, str]) -> None:
    """A repair opened with a bad setting raises the setting's error and changes nothing (before, the error was
    read as an unreadable index: the good index was moved aside and every later open raised CorruptIndexError)."""
    path = tmp_path / "s"
    with deltackpt.Store(path, chunk_size=SMALL_CHUNK) as s:
        s.save({"w": torch.arange(3000.0)}, step=1)
    before = dir_snapshot(path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=next(iter(env or kwargs))):
        deltackpt.maintenance.open_for_repair(path, **kwargs)
    assert dir_snapshot(path) == before
    for k in env:
        monkeypatch.delenv(k)
    with deltackpt.Store(path) as s:
        assert torch.equal(s.load(1)["w"], torch.arange(3000.0))
    with deltackpt.maintenance.open_for_repair(path) as s:  # (its locks were given back)
        s.repair()


def test_a_gc_timeout_of_the_wrong_type_or_range_is_refused_before_any_wait(tmp_path: Path) -> None:
    """gc(timeout=) takes None or a number of seconds >= 0. Before, NaN waited for good on a busy store (no
    deadline passes NaN) and "1" failed with float + str."""
    with deltackpt.Store(tmp_path / "s") as s:
        s.save({"w": torch.arange(3000.0)}, step=1)
        for bad, error in ((float("nan"), ValueError), (-1, ValueError), ("1", TypeError), (True, TypeError)):
            with pytest.raises(error, match="timeout must be"):
                s.gc(timeout=bad)
        assert s.gc(timeout=0.5).freed_bytes == 0 and s.gc(timeout=np.float64(1)).freed_bytes == 0


def test_a_gc_repack_fraction_of_the_wrong_type_or_range_is_refused_as_such(tmp_path: Path) -> None:
    """gc(repack_below=) takes a real number in 0..1 (numpy's too, as timeout= does): a wrong type is a TypeError,
    a value out of range a ValueError. Before, every wrong type was a ValueError, and np.float32(0.5) was refused
    as not "a fraction between 0 and 1"."""
    with deltackpt.Store(tmp_path / "s") as s:
        s.save({"w": torch.arange(3000.0)}, step=1)
        for bad, error in (("0.5", TypeError), (True, TypeError), (None, TypeError), (float("nan"), ValueError),
                           (-0.1, ValueError), (2, ValueError)):
            with pytest.raises(error, match="repack_below must be"):
                s.gc(repack_below=bad)
        for good in (np.float32(0.5), np.float64(0.5), 1, 0):
            assert s.gc(repack_below=good).freed_bytes == 0


def test_metadata_of_a_newer_kind_is_refused_naming_its_key_path(store: deltackpt.Store) -> None:
    """Like every other refused value, a metadata value of a kind metadata may not hold (a set, a complex number,
    a Counter, a dict with a tuple key) is named by its key path. Before, the message named no place."""
    for meta, where in (({"x": {"y": [0, 1j]}}, r"x\.y\[1\]"), ({"a": 1, "b": {"c": {2}}}, r"b\.c"),
                        ({"x": {(1,): 2}}, r"x:"), ({"k": Counter(a=1)}, r"k:"), ({(1, 2): 3}, "<root>")):
        with pytest.raises(UnsupportedTypeError, match=f"cannot store metadata at {where}"):
            store.save({"w": torch.randn(5000)}, step=1, metadata=meta)
    assert store.list() == []


def test_metadata_holding_an_object_no_state_may_hold_is_refused_as_metadata(store: deltackpt.Store) -> None:
    """A lambda or a file handle in metadata is named as metadata's, with what metadata may hold. Before, the
    message read as a state's ("cannot store a") and said to register the type or pass allow_pickle=True, neither
    of which metadata takes."""
    with open(__file__) as fh:
        for meta, where in (({"a": lambda: 1}, "a"), ({"x": {"f": fh}}, r"x\.f"), ({"o": [object()]}, r"o\[0\]")):
            for allow_pickle in (False, True):
                refused = f"cannot store metadata at {where}: unsupported type"
                with pytest.raises(UnsupportedTypeError, match=refused) as e:
                    store.save({"w": torch.randn(5000)}, step=1, metadata=meta, allow_pickle=allow_pickle)
                assert "register_type" not in str(e.value) and "allow_pickle" not in str(e.value)
    assert store.list() == []


def test_bad_settings_from_the_environment_name_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTACKPT_ZSTD_LEVEL", "30")
    with pytest.raises(ValueError, match="DELTACKPT_ZSTD_LEVEL"):
        deltackpt.Store(tmp_path / "s")
    monkeypatch.setenv("DELTACKPT_ZSTD_LEVEL", "-5")  # zstd's fast levels are fine
    monkeypatch.setenv("DELTACKPT_MAX_CHAIN", "99")
    with pytest.raises(ValueError, match="DELTACKPT_MAX_CHAIN"):
        deltackpt.Store(tmp_path / "s")
    monkeypatch.delenv("DELTACKPT_MAX_CHAIN")
    monkeypatch.setenv("DELTACKPT_GC_MIN_BYTES", "-1")
    with pytest.raises(ValueError, match="DELTACKPT_GC_MIN_BYTES"):
        deltackpt.Checkpointer(tmp_path / "s", model=torch.nn.Linear(2, 2), handle_signals=False)
    monkeypatch.delenv("DELTACKPT_GC_MIN_BYTES")
    monkeypatch.setenv("DELTACKPT_THREADS", "08")  # a decimal with a leading zero is one (int(x, 0) refused it)
    monkeypatch.setenv("DELTACKPT_READ_THREADS", "0x10")
    with deltackpt.Store(tmp_path / "s") as s:
        s.save({"w": torch.arange(3000.0)}, step=1)
        assert s.zstd_level == -5 and torch.equal(s.load(1)["w"], torch.arange(3000.0))
        assert (s.threads, s.read_threads) == (8, 16)
    monkeypatch.setenv("DELTACKPT_THREADS", "8 threads")
    with pytest.raises(ValueError, match="DELTACKPT_THREADS must be an integer, got '8 threads'"):
        deltackpt.Store(tmp_path / "s")
    monkeypatch.delenv("DELTACKPT_THREADS")
    # the switches: only 1 and 0 (a "2", "yes" or "off" read as on before: "off" certainly meant otherwise)
    for name in ("DELTACKPT_PREDICT", "DELTACKPT_ALLOW_NETWORK_FS"):
        for bad in ("2", "off", "yes", "-1"):
            monkeypatch.setenv(name, bad)
            with pytest.raises(ValueError, match=f"{name} must be 1 \\(on\\) or 0 \\(off\\), got '{bad}'"):
                deltackpt.Store(tmp_path / "s")
        monkeypatch.delenv(name)
    for raw, on in ((" 0 ", False), ("1", True), ("", True)):
        monkeypatch.setenv("DELTACKPT_PREDICT", raw)
        with deltackpt.Store(tmp_path / "s") as s:
            assert s.predict is on


@pytest.mark.parametrize(
    "content",
    ["", "not json", json.dumps({"format": "other", "version": 1, "chunk_size": 4096}),
     json.dumps({"format": "deltackpt-store"}),
     # a version or chunk size of another type (before, "1" and 1.9 were read as version 1, "4096" as a size)
     *(json.dumps({"format": "deltackpt-store", "version": v, "chunk_size": c})
       for v, c in [("1", 4096), (1.9, 4096), (True, 4096), (0, 4096), (1, "4096"), (1, 4096.0)]),
     "[1, 2]", '"deltackpt-store"', "null"],
)
def test_damaged_store_file(store_path: Path, content: str) -> None:
    deltackpt.Store(store_path, chunk_size=SMALL_CHUNK).close()
    (store_path / "STORE").write_text(content)
    with pytest.raises(deltackpt.DeltackptError) as exc:
        deltackpt.Store(store_path)
    assert not isinstance(exc.value, deltackpt.FormatVersionError)
    # the message says what the file holds, not Python's words for indexing it ("list indices must be ...")
    assert "indices" not in str(exc.value) and "subscriptable" not in str(exc.value)


def test_newer_store_version(store_path: Path) -> None:
    deltackpt.Store(store_path, chunk_size=SMALL_CHUNK).close()
    cfg = json.loads((store_path / "STORE").read_text())
    cfg["version"] = 99
    (store_path / "STORE").write_text(json.dumps(cfg))
    with pytest.raises(deltackpt.FormatVersionError):
        deltackpt.Store(store_path)


# -- damaged manifest: typed error, nothing else changes ------------------------------------------------


def test_damaged_manifest_changes_nothing_else(store_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    states = {s: {"w": torch.randn(4000, generator=g), "s": s} for s in (1, 2, 3)}
    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK) as s:
        ids = {k: s.save(v, step=k).id for k, v in states.items()}
    mpath = store_path / "manifests" / f"{ids[2]}.manifest"
    data = bytearray(mpath.read_bytes())
    data[len(data) // 3] ^= 0x10
    mpath.write_bytes(bytes(data))
    with deltackpt.Store(store_path) as s:
        listed = s.list()
        snap = _snapshot(store_path)
        with pytest.raises(CorruptManifestError):
            s.load(2)
        with pytest.raises(CorruptManifestError):
            s.load_into({"w": torch.zeros(4000), "s": 0}, step=2)
        with pytest.raises(CorruptManifestError):
            s.gc()  # gc refuses to guess what a damaged manifest references
        assert s.list() == listed
        assert _snapshot(store_path) == snap
        assert_same_state(states[1], s.load(1))
        assert_same_state(states[3], s.load(3))
        report = s.verify()
        assert [(p.checkpoint, p.key) for p in report.problems] == [(ids[2], None)]
        # deleting the damaged checkpoint works and lets gc run again
        s.delete(2)
        s.gc()
        assert [i.id for i in s.list()] == [ids[1], ids[3]]
        assert_same_state(states[3], s.load(3))


@pytest.mark.parametrize("version", [0, 4, 2**31])
def test_manifest_of_an_unknown_version_is_a_format_version_error(store: deltackpt.Store, version: int) -> None:
    import xxhash

    from deltackpt import manifest

    info = store.save({"c": Counter({1: 2})}, step=1)
    data = (store.path / "manifests" / f"{info.id}.manifest").read_bytes()
    assert int.from_bytes(data[8:12], "little") == 2
    manifest.parse(data, where="m")  # version 2: read
    body = data[:8] + version.to_bytes(4, "little") + data[12:-16]
    with pytest.raises(deltackpt.FormatVersionError, match=f"format version {version} .this reader: 1 to 3"):
        manifest.parse(body + xxhash.xxh3_128_digest(body), where="m")


# -- load side ---------------------------------------------------------------------------------------------


def test_load_into_target_with_wrong_structure(store: deltackpt.Store) -> None:
    store.save({"w": torch.ones(4), "b": torch.zeros(2)}, step=1)
    target = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    with pytest.raises(ShapeMismatchError):
        store.load_into(target)
    assert torch.equal(target["w"], torch.zeros(2, 2)) and torch.equal(target["b"], torch.zeros(2))
    target2 = {"w": np.zeros(4, dtype=np.float32), "b": torch.zeros(2)}
    with pytest.raises(ShapeMismatchError):
        store.load_into(target2)  # numpy where the checkpoint has torch
    assert not target2["w"].any()


def test_load_into_a_module_or_optimizer_instead_of_its_state_dict(store: deltackpt.Store) -> None:
    """A module (or optimizer) offered where its state_dict() belongs is refused, naming the place: before, it
    matched no stored tensor, so ``strict=False`` filled nothing and returned no unfilled tensor either."""
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=1)
    fresh = torch.nn.Linear(3, 3)
    before = fresh.weight.detach().clone()
    for target, where in (({"model": fresh}, "model"), (fresh, "<root>"),
                          ({"model": fresh.state_dict(), "optimizer": opt}, "optimizer")):
        for strict in (True, False):
            with pytest.raises(ShapeMismatchError, match=f"{re.escape(where)}: it is a .* itself, not a state; "
                                                         "offer its state_dict"):
                store.load_into(target, strict=strict)
    assert torch.equal(fresh.weight, before)
    assert store.load_into({"model": fresh.state_dict()}, strict=False) == []
    assert torch.equal(fresh.weight, model.weight)


def test_map_location_type_error(store: deltackpt.Store) -> None:
    store.save({"w": torch.ones(2)}, step=1)
    with pytest.raises(TypeError):
        store.load(1, map_location=3.5)
    assert torch.equal(store.load(1, map_location="cpu")["w"], torch.ones(2))
    assert torch.equal(store.load(1, map_location={"cpu": "cpu"})["w"], torch.ones(2))


def test_closed_store_refuses(store_path: Path) -> None:
    s = deltackpt.Store(store_path, chunk_size=SMALL_CHUNK)
    s.save({"w": torch.ones(2)}, step=1)
    s.close()
    s.close()  # idempotent
    with pytest.raises(deltackpt.DeltackptError, match="closed"):
        s.save({"w": torch.ones(2)}, step=2)
    with pytest.raises(deltackpt.DeltackptError, match="closed"):
        s.load(1)
    with deltackpt.Store(store_path) as again:
        assert [i.step for i in again.list()] == [1]


def test_env_garbage_does_not_crash_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTACKPT_CHUNK_SIZE", "lots")
    with pytest.raises(ValueError, match="DELTACKPT_CHUNK_SIZE"):
        deltackpt.Store(tmp_path / "s")
    assert not (tmp_path / "s" / "STORE").exists()
    monkeypatch.setenv("DELTACKPT_CHUNK_SIZE", "8192")
    with deltackpt.Store(tmp_path / "s") as s:
        assert s.chunk_size == 8192
    assert os.path.exists(tmp_path / "s" / "STORE")


def test_refusal_of_a_value_whose_repr_fails_is_still_typed(store: deltackpt.Store) -> None:
    """The message naming a refused dict key shows its repr; one whose repr raises (a namedtuple holding an int
    of more digits than Python converts at once) is named by its type. Before, the ValueError of the formatting
    escaped instead of UnsupportedTypeError."""
    key = namedtuple("K", "n")(10**5000)
    with pytest.raises(UnsupportedTypeError, match=r"cannot store x: unsupported type .*K as a dict key \(<K>\)"):
        store.save({"x": {key: 1}}, step=1)
    assert store.list() == []


def _forge(path: Path, edit: Any, *, chunk_size: int = SMALL_CHUNK) -> str:
    """A store with one checkpoint of ``{"x": zeros(1024), "y": arange(8.0)}`` whose manifest ``edit(m)`` changed
    (checksums made to match, as a buggy or foreign writer would leave it); its id."""
    with deltackpt.Store(path, chunk_size=chunk_size) as s:
        info = s.save({"x": torch.zeros(1024), "y": torch.arange(8.0)}, step=1)
        m = s.manifest(id=info.id)
        edit(m)
        data = m.to_bytes()
        (path / "manifests" / f"{info.id}.manifest").write_bytes(data)
        rec = s.index.get(id=info.id)
        rec.manifest_checksum = deltackpt.manifest.checksum_of(data)
        s.index.commit_checkpoint(rec, {}, replace=rec)
    return info.id


def _entry(m: Any, key: str) -> Any:
    return next(t for t in m.tensors if t.key == key)


@pytest.mark.parametrize("dtype", ["quint4x2", "quint2x4", "qint8", "quint8", "qint32"])
def test_a_quantized_dtype_in_a_manifest_is_refused_by_name(tmp_path: Path, dtype: str) -> None:
    """Saves refuse quantized tensors; a manifest that names one anyway (quint4x2: two elements per byte) is
    refused before decoding, naming the tensor. It was given a torch.empty of half the bytes, and the kernel
    wrote the chunk past its end (a heap overflow); qint8 and the like loaded as quantized tensors."""
    cid = _forge(tmp_path / "s", lambda m: setattr(_entry(m, "x"), "dtype", dtype))
    with deltackpt.Store(tmp_path / "s") as s:
        with pytest.raises(CorruptManifestError, match=f"checkpoint {cid} .*tensor 'x': quantized torch dtype"):
            s.load(1)


_DTYPE_IMPORT_PROBE = """
import sys
import deltackpt
from deltackpt import distributed, tree
before = set(sys.modules)
for name in ("_dynamo", "_inductor", "onnx"):
    try:
        tree.torch_dtype(name)
    except deltackpt.UnsupportedTypeError:
        pass
    try:
        distributed._expand_md("w", [name, False, [4], [[[0], [4]]]])
    except ValueError:
        pass
print(sorted(set(sys.modules) - before))
"""


def test_a_stored_dtype_name_imports_nothing(tmp_path: Path) -> None:
    """A dtype name read from a store is looked up among torch's dtypes: a name like '_dynamo' once went to
    getattr(torch, name), whose module __getattr__ imported torch._dynamo (820 modules, about a second) before
    the name was refused. In a fresh process, refusing such names imports no module."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DTYPE_IMPORT_PROBE], capture_output=True, text=True, timeout=120,
                          cwd=Path(deltackpt.__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    with pytest.raises(UnsupportedTypeError, match="torch dtype '_dynamo' is unknown"):
        deltackpt.tree.torch_dtype("_dynamo")
    assert deltackpt.tree.torch_dtype("bfloat16") is torch.bfloat16


@pytest.mark.parametrize("device", ["mps", "mps:0", "xpu:0", "meta",
                                    "cuda:7" if torch.cuda.is_available() else "hpu:0"])
def test_a_device_this_process_cannot_use_needs_map_location(tmp_path: Path, device: str) -> None:
    """A checkpoint saved on a device this process cannot use (a Mac's mps, an Intel GPU's xpu) is refused before
    anything is decoded, with UnsupportedTypeError saying to pass map_location; meta (which holds no data) too.
    They raised whatever torch raised after decoding everything, and meta returned a tensor without the values."""
    _forge(tmp_path / "s", lambda m: setattr(_entry(m, "y"), "device", device))
    with deltackpt.Store(tmp_path / "s") as s:
        with pytest.raises(UnsupportedTypeError, match=f"tensor 'y': .*{device}.*map_location"):
            s.load(1)
        assert torch.equal(s.load(1, map_location="cpu")["y"], torch.arange(8.0))


def test_manifest_entries_torch_or_numpy_cannot_build_are_refused_by_the_parser(tmp_path: Path) -> None:
    """An integer tensor that requires grad, a chunk size outside the format's powers of two from 4 KiB to
    1 GiB (one of 2 GiB let a 1 KB manifest describe 64 GiB of all-zero chunks), and a numpy array marked as a
    parameter or placed on a GPU are manifest damage."""
    def int_grad(m: Any) -> None:
        e = _entry(m, "x")
        e.dtype, e.requires_grad = "int32", True

    _forge(tmp_path / "a", int_grad)
    with deltackpt.Store(tmp_path / "a") as s:
        with pytest.raises(CorruptManifestError, match="requires_grad for torch int32"):
            s.load(1)
    _forge(tmp_path / "b", lambda m: setattr(m, "chunk_size", 3 * 4096))
    with deltackpt.Store(tmp_path / "b") as s:
        with pytest.raises(CorruptManifestError, match="chunk_size is 12288"):
            s.load(1)
    for n, (parameter, device) in enumerate([(True, "cpu"), (False, "cuda:0")]):
        def numpy_as_torch(m: Any, parameter: bool = parameter, device: str = device) -> None:
            e = _entry(m, "y")
            e.kind, e.dtype, e.parameter, e.device = "numpy", "<f4", parameter, device

        _forge(tmp_path / f"np{n}", numpy_as_torch)
        with deltackpt.Store(tmp_path / f"np{n}") as s:
            with pytest.raises(CorruptManifestError, match="tensor 'y': a numpy array marked as a parameter or on"):
                s.load(1)


def test_a_tensor_too_large_to_allocate_is_a_memory_error_naming_it(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A stored all-zero tensor of 16 TiB (1 GiB chunks, all zero: no frames) cannot be allocated: MemoryError
    naming the checkpoint and tensor, not torch's RuntimeError."""
    def huge(m: Any) -> None:
        e = _entry(m, "x")
        n = 1 << 14  # chunks of 1 GiB
        e.shape, e.nbytes, e.count = [n << 28], n << 30, n
        y = _entry(m, "y")
        y.first = n
        m.digests = np.concatenate([np.zeros((n, 16), np.uint8), m.digests[y.first - n + 1 :]])
        m.flags = np.concatenate([np.full(n, deltackpt.manifest.FLAG_ZERO, np.uint8), m.flags[1:]])

    cid = _forge(tmp_path / "s", huge, chunk_size=1 << 30)
    with deltackpt.Store(tmp_path / "s") as s:
        with pytest.raises(MemoryError, match=f"checkpoint {cid} .*tensor 'x': cannot allocate its 17592186044416"):
            s.load(1)
    from deltackpt.cli import main  # the command line says so in one line (get and export printed a traceback)

    for argv in (["get", str(tmp_path / "s"), "1", "x"], ["export", str(tmp_path / "s"), "1", str(tmp_path / "x.pt")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("deltackpt: error: out of memory: ") and "cannot allocate" in err
        assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "x.pt").exists()


def test_a_process_with_an_address_space_limit_saves_and_loads(tmp_path: Path) -> None:
    """Under ``ulimit -v`` (16 GB here, as some clusters set), LMDB cannot reserve the index's 256 GiB map: the
    index is opened with a map that fits (a store another process opened with the full map too). Every open
    raised CorruptIndexError advising a repair."""
    import resource
    import subprocess
    import sys

    with deltackpt.Store(tmp_path / "s") as s:  # written first by a process without the limit
        s.save({"w": torch.arange(10.0)}, step=1)
    code = ("import torch, deltackpt\n"
            "with deltackpt.Store(__import__('sys').argv[1]) as s:\n"
            "    assert torch.equal(s.load(1)['w'], torch.arange(10.0))\n"
            "    s.save({'w': torch.ones(10)}, step=2)\n"
            "    print(sorted(i.step for i in s.list()), s.index.env.info()['map_size'] < (1 << 38))\n")
    limit = 16 << 30
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[1,", "2]", "True"], out.stdout
    with deltackpt.Store(tmp_path / "s") as s:
        assert torch.equal(s.load(2)["w"], torch.ones(10))


# -- misuse found by an audit of the public API (each raised deep inside, or did the wrong thing) ----------------
def _mark(path: str) -> int:
    """What unpickling a :class:`_Marker` runs: it leaves a file, so a test sees that code ran."""
    Path(path).touch()
    return 7


class _Marker:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_mark, (self.path,))


@pytest.mark.parametrize("value", ["no", "False", 0, 1, [True]])
def test_switches_take_only_true_or_false(store: deltackpt.Store, tmp_path: Path, value: Any) -> None:
    """allow_pickle="no" was read for its truth: it pickled on save and, worse, unpickled (ran code) on load.
    Every switch of the API now takes True or False only (TypeError naming it), before anything is done."""
    marker = tmp_path / "ran"
    store.save({"x": _Marker(marker)}, step=1, allow_pickle=True)
    before = _snapshot(store.path)
    calls = [
        ("allow_pickle", lambda: store.save({"x": _Marker(marker)}, step=2, allow_pickle=value)),
        ("keyframe", lambda: store.save({"x": torch.ones(2)}, step=2, keyframe=value)),
        ("allow_pickle", lambda: store.load(1, allow_pickle=value)),
        ("verify", lambda: store.load(1, verify=value, allow_pickle=True)),
        ("strict", lambda: store.load_into({"x": torch.ones(2)}, 1, strict=value)),
        ("readonly", lambda: deltackpt.Store(store.path, readonly=value)),
        ("async_save", lambda: deltackpt.Checkpointer(store, async_save=value)),
        ("handle_signals", lambda: deltackpt.Checkpointer(store, handle_signals=value)),
    ]
    for name, call in calls:
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            call()
    assert not marker.exists()  # nothing was unpickled
    assert _snapshot(store.path) == before and [i.step for i in store.list()] == [1]
    assert store.load(1, allow_pickle=True)["x"] == 7 and marker.exists()  # (the opt-in itself works)


@pytest.mark.parametrize("value", ["no", 0, 1])
def test_a_checkpointer_save_takes_only_true_or_false_at_the_call(tmp_path: Path, value: Any) -> None:
    """``ckpt.save(step, keyframe="no")`` of an async Checkpointer returned, and its background save raised the
    TypeError at the next step() or close(), the step not saved; ``wait="no"`` waited."""
    with deltackpt.Checkpointer(tmp_path / "s", model=torch.nn.Linear(2, 2), handle_signals=False) as ck:
        for name in ("keyframe", "wait"):
            with pytest.raises(TypeError, match=f"{name} must be True or False"):
                ck.save(1, **{name: value})
            assert ck.wait() is None  # nothing was started
        assert ck.store.list() == []
        ck.save(1, wait=True)
        assert [i.step for i in ck.store.list()] == [1]


def test_capture_checks_its_step(tmp_path: Path) -> None:
    """``ckpt.capture("3")`` returned a state whose step entry was the string, which a save stored and a restore
    then refused as a checkpoint of another step than the one listed."""
    with deltackpt.Checkpointer(tmp_path / "s", model=torch.nn.Linear(2, 2), handle_signals=False) as ck:
        with pytest.raises(TypeError, match="step must be an int, got str"):
            ck.capture("3")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="step must be between 0"):
            ck.capture(-1)
        assert ck.capture(np.int64(3))["step"] == 3


def test_what_a_checkpointer_is_given_is_checked_member_by_member(store: deltackpt.Store) -> None:
    """A list or dict of models or optimizers was taken as it came; a member without state_dict() failed at the
    first step() with AttributeError. Now the constructor names it; so for extra that is not a dict."""
    m = torch.nn.Linear(2, 2)
    cases = [({"model": [m, 5]}, r"model\[1\]: int has no state_dict"),
             ({"model": list(m.parameters())}, r"model\[0\]: Parameter has no state_dict"),
             ({"optimizer": {"a": torch.optim.SGD(m.parameters(), lr=0.1), "b": None}}, "optimizer.b: NoneType"),
             ({"extra": [1, 2]}, "extra must be a dict")]
    for kwargs, message in cases:
        with pytest.raises(TypeError, match=message):
            deltackpt.Checkpointer(store, handle_signals=False, **kwargs)
    for bad, error in ((True, TypeError), (2.0, TypeError), (None, TypeError), (0, ValueError)):
        with pytest.raises(error, match=f"every_n_steps must be a positive int, got .*{bad}"):
            deltackpt.Checkpointer(store, every_n_steps=bad)
    assert deltackpt.Checkpointer(store, every_n_steps=np.int64(2), handle_signals=False).every_n_steps == 2
    assert store.list() == []


def test_restore_refuses_a_model_on_the_meta_device(store: deltackpt.Store) -> None:
    """A model built under torch.device("meta") holds no memory: restore() reported success and restored
    nothing (torch only warned that each copy was a no-op)."""
    with deltackpt.Checkpointer(store, model=torch.nn.Linear(4, 3), async_save=False, handle_signals=False) as ck:
        ck.step(1)
    with torch.device("meta"):
        meta_model = torch.nn.Linear(4, 3)
    with deltackpt.Checkpointer(store, model=meta_model, async_save=False, handle_signals=False) as ck:
        with pytest.raises(deltackpt.DeltackptError, match="'weight' is on the meta device.*to_empty"):
            ck.restore()
        meta_model.to_empty(device="cpu")
        assert ck.restore() == 1
    assert torch.equal(meta_model.weight, store.load(1)["model"]["weight"])


@pytest.mark.parametrize("map_location,error,message", [
    ("garbage", ValueError, "map_location 'garbage' is not a device torch knows"),
    ({"cpu": None}, TypeError, r"map_location\['cpu'\] must be a device or a device string, got NoneType"),
    ({"cpu": "nowhere:0"}, ValueError, r"map_location\['cpu'\] = 'nowhere:0' is not a device torch knows"),
    (5, TypeError, "map_location must be None, a device, a device string or a dict"),
    pytest.param("cuda:0", UnsupportedTypeError, "map_location sends tensors stored on 'cpu' to 'cuda:0', but CUDA",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
])
def test_a_bad_map_location_is_named(store: deltackpt.Store, map_location: Any, error: type, message: str) -> None:
    """map_location="garbage" raised torch's RuntimeError about device strings; {"cpu": None} blamed the
    checkpoint ("holds a tensor on device None"); a GPU-less machine got a plain RuntimeError telling it to pass
    map_location='cpu' when that is what it had replaced."""
    store.save({"y": torch.arange(3.0)}, step=1)
    with pytest.raises(error, match=message):
        store.load(1, map_location=map_location)
    assert torch.equal(store.load(1, map_location={"cuda:0": "cpu"})["y"], torch.arange(3.0))
    if error is not UnsupportedTypeError:  # a map_location that names no device is refused without a tensor too
        store.save({"n": 1}, step=2)
        with pytest.raises(error, match=message):
            store.load(2, map_location=map_location)


def test_a_map_location_dict_keyed_by_devices_applies(store: deltackpt.Store) -> None:
    """``map_location={torch.device("cuda:0"): "cpu"}`` (the README's ``{stored device: target}``) was looked up by
    the stored device's string only, so a device key never matched and the mapping was ignored without a word: a
    CUDA checkpoint then loaded onto the GPU, or failed for want of the map_location it had been given. A key that
    is neither a device nor a device string is refused."""
    store.save({"y": torch.arange(3.0)}, step=1)
    with pytest.raises(UnsupportedTypeError, match="map_location sends tensors stored on 'cpu' to 'meta'"):
        store.load(1, map_location={torch.device("cpu"): "meta"})
    assert torch.equal(store.load(1, map_location={torch.device("cpu"): torch.device("cpu")})["y"], torch.arange(3.0))
    for key in (5, None):
        with pytest.raises(TypeError, match=f"map_location's keys must be stored devices .*got {type(key).__name__}"):
            store.load(1, map_location={key: "cpu"})


def test_loads_ignore_the_default_device(store: deltackpt.Store) -> None:
    """Loads allocated their tensors and staging buffers on torch's default device: inside
    ``with torch.device("meta")`` (or after set_default_device("cuda")) load raised "can't convert meta device
    type tensor to numpy", naming no key, and load_into of a non-contiguous target the same."""
    state = {"x": torch.arange(6.0).reshape(2, 3), "n": torch.arange(4), "t": torch.ones(3, 2)}
    store.save(state, step=1)
    target = {"x": torch.zeros(3, 2).t(), "n": torch.zeros(4, dtype=torch.int64), "t": torch.zeros(2, 3).t()}
    with torch.device("meta"):
        loaded = store.load(1)
        assert store.load_into(target, 1) == []
    assert_same_state(loaded, state)
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_an_inference_tensor_target_is_refused_before_anything_is_written(store: deltackpt.Store) -> None:
    """An inference tensor (made under torch.inference_mode) cannot be written outside it. A non-contiguous one
    made load_into raise torch's RuntimeError, naming no key, after other targets were overwritten; load(into=)
    raised too, though offers that cannot hold values are to be passed by. Inside inference mode it is filled."""
    store.save({"a": torch.ones(4), "w": torch.arange(6.0).reshape(3, 2)}, step=1)
    with torch.inference_mode():
        w = torch.zeros(2, 3).t()
    a = torch.zeros(4)
    with pytest.raises(ShapeMismatchError, match="'w': the target cannot hold .* an inference tensor"):
        store.load_into({"a": a, "w": w}, 1)
    assert not a.any() and not w.any()
    state = store.load(1, into={"w": w})
    assert state["w"] is not w and torch.equal(state["w"], torch.arange(6.0).reshape(3, 2)) and not w.any()
    with torch.inference_mode():
        assert store.load_into({"a": a, "w": w}, 1) == []
    assert torch.equal(w, torch.arange(6.0).reshape(3, 2)) and torch.equal(a, torch.ones(4))


def test_a_store_needs_a_directory_of_its_own(tmp_path: Path) -> None:
    """Store() made any existing directory a store, and gc then deleted what it found in that directory's tmp/
    (and failed on a directory there, part way). A file as the path raised FileExistsError, a path through a file
    NotADirectoryError. Now each is a DeltackptError naming the path, and nothing is written."""
    project = tmp_path / "project"
    (project / "tmp").mkdir(parents=True)
    (project / "tmp" / "notes.txt").write_text("mine")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    cases = [(project, "is not a deltackpt store and not empty .*'tmp'"), (tmp_path / "afile", "is not a directory"),
             (tmp_path / "afile" / "sub", "a part of the path is not a directory"),
             (tmp_path / "loop", "dangling symbolic link")]
    for path, message in cases:
        with pytest.raises(deltackpt.DeltackptError, match=message):
            deltackpt.Store(path)
    assert sorted(p.name for p in project.rglob("*")) == ["notes.txt", "tmp"]
    assert (tmp_path / "afile").read_text() == "x"
    # what a creation cut short leaves (empty directories, the lock files) is taken up
    half = tmp_path / "half"
    for d in ("packs", "manifests", "tmp", "index"):
        (half / d).mkdir(parents=True)
    (half / "gc.lock").touch()
    with deltackpt.Store(half) as s:
        s.save({"x": torch.ones(2)}, step=1)
        (half / "tmp" / "keep.me").write_text("not a save's")
        (half / "tmp" / "dir").mkdir()
        s.gc()
        assert (half / "tmp" / "keep.me").exists() and (half / "tmp" / "dir").is_dir()


def test_gc_removes_only_files_named_as_deltackpt_names_them_in_tmp_and_manifests(tmp_path: Path) -> None:
    """A store received from elsewhere whose tmp/ (or manifests/) is a link to a directory of the user's: gc
    removed every regular file named *.tmp there, and every *.manifest file whose name was not a committed
    checkpoint's id (notes.manifest too). It removes only what a save leaves: <id>.manifest.<pid>.tmp files and
    <id>.manifest files."""
    path = tmp_path / "s"
    with deltackpt.Store(path, chunk_size=SMALL_CHUNK) as s:
        s.save({"x": torch.ones(2)}, step=1)
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("notes.tmp", "draft.manifest", "a.manifest.1.tmp", "0123456789abcdef.manifest"):
        (mine / name).write_text("mine")
    (mine / "0123456789abcdef.manifest.77.tmp").write_text("a save's")
    shutil.rmtree(path / "tmp")
    (path / "tmp").symlink_to(mine)
    for p in (path / "manifests").iterdir():
        shutil.copy(p, mine)
    shutil.rmtree(path / "manifests")
    (path / "manifests").symlink_to(mine)
    with deltackpt.Store(path) as s:
        s.gc()
        assert s.load(1)["x"].tolist() == [1.0, 1.0]
        kept = s.latest().id
    assert sorted(p.name for p in mine.iterdir() if not p.name.startswith(kept)) == [
        "a.manifest.1.tmp", "draft.manifest", "notes.tmp"]


def test_other_arguments_are_checked_before_anything_runs(store: deltackpt.Store, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """progress=5 failed at verify's first call of it and was never checked by gc; spans given as a list raised
    AttributeError; register_type took None for its hooks; DELTACKPT_CHUNK_SIZE=7 was reported as chunk_size."""
    store.save({"w": torch.ones(8)}, step=1)
    for call in (lambda: store.verify(progress=5), lambda: store.gc(progress=5)):
        with pytest.raises(TypeError, match="progress must be a callable"):
            call()
    with pytest.raises(TypeError, match="spans must map key paths"):
        store.load_into({"w": torch.zeros(8)}, 1, spans=[("w", (0, 4))])  # type: ignore[arg-type]

    class P:
        pass

    with pytest.raises(TypeError, match="encode must be a callable"):
        deltackpt.register_type(P, "p-type", None, None)  # type: ignore[arg-type]
    monkeypatch.setenv("DELTACKPT_CHUNK_SIZE", "7")
    with pytest.raises(ValueError, match="DELTACKPT_CHUNK_SIZE must be a power of two"):
        deltackpt.Store(tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_an_id_given_as_the_step_is_refused_with_the_keyword_to_use(store: deltackpt.Store) -> None:
    info = store.save({"w": torch.ones(3)}, step=1)
    for call in (store.info, store.load, store.manifest):
        with pytest.raises(TypeError, match=f"got str '{info.id}'; pass a checkpoint id as id="):
            call(info.id)
    assert store.info(id=info.id) == info


def test_a_checkpointer_refuses_the_metadata_key_it_marks_thinned_checkpoints_with(tmp_path: Path) -> None:
    """A user's ``{"thinned": ...}`` made retention take the checkpoint for thinned already (never thinning it)
    and overwrote it with True when it did thin one."""
    model = torch.nn.Linear(3, 2)
    ck = deltackpt.Checkpointer(tmp_path / "s", model=model, async_save=False, handle_signals=False)
    try:
        for call in (lambda: ck.step(1, metadata={"thinned": False}), lambda: ck.save(1, metadata={"thinned": 0.5})):
            with pytest.raises(ValueError, match="'thinned' is reserved"):
                call()
        assert ck.store.list() == []
        ck.save(1, metadata={"thinned_at": 3})
        assert ck.store.info(1).metadata == {"thinned_at": 3}
    finally:
        ck.close()


@pytest.mark.parametrize("bad", [[1], None, 5, "state", (("step", 1),)])
def test_a_checkpointer_applies_only_a_captured_state(tmp_path: Path, bad: Any) -> None:
    """``apply`` of something that is not a mapping is a TypeError naming its type (it read as a checkpoint that
    a Checkpointer had not written); the model is left as it was."""
    model = torch.nn.Linear(3, 2)
    before = copy.deepcopy(model.state_dict())
    ck = deltackpt.Checkpointer(tmp_path / "s", model=model, async_save=False, handle_signals=False)
    try:
        with pytest.raises(TypeError, match=f"apply\\(\\) takes a captured state .*got {type(bad).__name__}$"):
            ck.apply(bad)
        assert_same_state(before, model.state_dict())
        with pytest.raises(deltackpt.DeltackptError, match="not written by a Checkpointer"):
            ck.apply({"weights": 1})
        assert ck.apply(ck.capture(7)) == 7
    finally:
        ck.close()


def test_switches_of_dcp_and_the_sampler_take_bools_only(tmp_path: Path) -> None:
    """``distributed.retain(root, policy, dry_run=None)`` deleted steps; ``gc="no"`` and ``shuffle="no"`` meant
    True."""
    from deltackpt import distributed
    from deltackpt.data import ResumableSampler

    with pytest.raises(TypeError, match="dry_run must be True or False, got NoneType"):
        distributed.retain(tmp_path / "missing", deltackpt.Retention(keep_last=1), dry_run=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gc must be True or False"):
        distributed.DeltaStorageWriter(tmp_path / "r", step=1, gc="no")  # type: ignore[arg-type]
    for name in ("shuffle", "drop_last"):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            ResumableSampler(10, **{name: "no"})
    assert ResumableSampler(10, shuffle=np.bool_(False)).shuffle is False


@pytest.mark.parametrize("kwargs,error,match", [
    ({"max_chian": 1}, TypeError, "DeltaStorageWriter: unknown store option.s. max_chian"),
    ({"zstd_level": 99}, ValueError, "DeltaStorageWriter: zstd_level must be between"),
    ({"chunk_size": 1000}, ValueError, "DeltaStorageWriter: chunk_size must be a power of two"),
    ({"predict": "no"}, TypeError, "DeltaStorageWriter: predict must be True or False"),
    ({"readonly": True}, ValueError, "DeltaStorageWriter: readonly=True"),  # (its saves failed, inside DCP's error)
    ({"metadata": "x"}, TypeError, "metadata must be a mapping"),
    ({"metadata": {"t": torch.ones(2)}}, UnsupportedTypeError, "DeltaStorageWriter metadata: .*tensors"),
    ({"step": True}, TypeError, "step must be an int"),
    ({"step": -1}, ValueError, "step must be between 0"),
])
def test_a_dcp_writer_checks_its_arguments_when_it_is_made(tmp_path: Path, kwargs: dict[str, Any], error: type,
                                                           match: str) -> None:
    """Inside ``dcp.save`` the same errors come wrapped in torch's CheckpointException, a BaseException that
    ``except Exception`` does not catch, with the message on the last line of an embedded traceback."""
    from deltackpt.distributed import DeltaStorageWriter

    with pytest.raises(error, match=match):
        DeltaStorageWriter(tmp_path / "root", **{"step": 1, **kwargs})
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"step": "3"}, TypeError, "step must be an int, got str '3'; pass a checkpoint id as id="),
    ({"step": 1.5}, TypeError, "step must be an int, got float"),
    ({"step": -1}, ValueError, "step must be between 0"),
    ({"id": "../x"}, InvalidNameError, "invalid checkpoint id '../x'"),
    ({"id": 5}, InvalidNameError, "invalid checkpoint id 5"),
    ({"allow_network_fs": "no"}, TypeError, "allow_network_fs must be True or False"),
])
def test_a_dcp_reader_checks_its_arguments_when_it_is_made(tmp_path: Path, kwargs: dict[str, Any], error: type,
                                                           match: str) -> None:
    """As the writer's: ``DeltaStorageReader(root, step="3")`` was taken, and ``dcp.load`` then raised torch's
    CheckpointException (a BaseException) around an AssertionError holding the message."""
    from deltackpt.distributed import DeltaStorageReader

    with pytest.raises(error, match=match):
        DeltaStorageReader(tmp_path / "root", **kwargs)
    assert not (tmp_path / "root").exists()


def test_a_step_and_an_id_that_disagree_are_named(store: deltackpt.Store) -> None:
    """It said "no checkpoint with id ...", of an id the store holds (at another step)."""
    store.save({"w": torch.ones(3)}, step=1)
    other = store.save({"w": torch.zeros(3)}, step=2).id
    for call in (store.load, store.info, store.manifest, store.delete):
        with pytest.raises(CheckpointNotFoundError, match=f"checkpoint {other} is at step 2, not at step 1"):
            call(1, id=other)
    assert [i.step for i in store.list()] == [1, 2]


def test_a_restore_refused_names_the_checkpoint(tmp_path: Path) -> None:
    """restore() of the latest picks the checkpoint itself: its refusals said "the checkpoint holds no ..."
    without saying which one."""
    model = torch.nn.Linear(3, 2)
    with deltackpt.Checkpointer(tmp_path / "s", model=model, async_save=False, handle_signals=False) as ck:
        info = ck.save(4) or ck.store.latest()
    assert info is not None
    for kwargs, error, what in (({"model": torch.nn.Sequential(model)}, ShapeMismatchError, "model does not match"),
                                ({"model": model, "extra": {"x": {"a": 1}}}, deltackpt.DeltackptError,
                                 r"the checkpoint holds no extra\['x'\]")):
        with deltackpt.Checkpointer(tmp_path / "s", async_save=False, handle_signals=False, **kwargs) as ck:
            with pytest.raises(error, match=f"^checkpoint {info.id} \\(step 4\\): {what}"):
                ck.restore()
