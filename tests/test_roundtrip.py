"""Round trips: whatever a state holds comes back with the same structure, types, dtypes, shapes and bits."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import re
import struct
import tempfile
import threading
import warnings
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_CHUNK, assert_same_state, dir_snapshot, float_bits, tensor_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltackpt
from deltackpt import InvalidNameError, ShapeMismatchError, UnsafeLoadError, UnsupportedTypeError, tree
from deltackpt.tree import DEFAULT_FACTORIES

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

TORCH_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64, torch.complex128, torch.bool, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
]
EXTRA_TORCH_DTYPES = [
    getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex32")
    if isinstance(getattr(torch, n, None), torch.dtype)
]
NUMPY_DTYPES = [
    np.dtype(s) for s in (
        "?", "i1", "i2", "<i4", "<i8", "u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16",
        ">f4", ">f8", ">i2", ">i8", ">u4", ">c8", ">c16", ">f2",
    )
]


# -- strategies ------------------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).filter(lambda s: math.prod(s) <= 300)


def _from_raw(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    n = math.prod(shape)
    size = dtype.itemsize
    raw = np.frombuffer(data[: n * size], dtype=np.uint8).copy()
    if dtype == torch.bool:
        raw &= 1  # only 0 and 1 are valid bools
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


@st.composite
def torch_tensors(
    draw: st.DrawFn, dtypes: list[torch.dtype] = TORCH_DTYPES + EXTRA_TORCH_DTYPES
) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes)
    size = dtype.itemsize
    layout = draw(st.sampled_from(["plain", "transposed", "sliced", "conj", "expanded"]))
    if layout == "transposed" and len(shape) >= 2:
        base_shape = list(shape)
        base_shape[0], base_shape[-1] = base_shape[-1], base_shape[0]
        data = draw(st.binary(min_size=math.prod(shape) * size, max_size=math.prod(shape) * size))
        t = _from_raw(data, dtype, base_shape).transpose(0, -1)
    elif layout == "sliced" and len(shape) >= 1:
        base_shape = [2 * shape[0] + 1, *shape[1:]]
        n = math.prod(base_shape)
        data = draw(st.binary(min_size=n * size, max_size=n * size))
        t = _from_raw(data, dtype, base_shape)[1::2]
    elif layout == "expanded" and len(shape) >= 1:
        base_shape = [1, *shape[1:]]
        n = math.prod(base_shape)
        data = draw(st.binary(min_size=n * size, max_size=n * size))
        t = _from_raw(data, dtype, base_shape).expand(shape)  # stride 0 along dim 0
    else:
        n = math.prod(shape)
        data = draw(st.binary(min_size=n * size, max_size=n * size))
        t = _from_raw(data, dtype, shape)
        if layout == "conj" and dtype in (torch.complex64, torch.complex128):
            t = t.conj()  # a lazily conjugated view
    assert tuple(t.shape) == tuple(shape)
    if (dtype.is_floating_point or dtype.is_complex) and dtype.itemsize >= 2 and draw(st.booleans()):
        if draw(st.booleans()):
            t = torch.nn.Parameter(t.contiguous(), requires_grad=draw(st.booleans()))
        elif dtype in (torch.float32, torch.float64):
            t = t.detach().requires_grad_(True)
    return t


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    shape = draw(shapes)
    n = math.prod(shape)
    if draw(st.booleans()) and len(shape) >= 2:
        base_shape = list(reversed(shape))
        data = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
        a = np.frombuffer(data, dtype=dtype).copy().reshape(base_shape).T  # non-contiguous
    elif draw(st.booleans()) and len(shape) >= 1:
        data = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
        a = np.frombuffer(data, dtype=dtype).reshape(shape)[::-1]  # negative stride, read-only
    else:
        data = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
        a = np.frombuffer(data, dtype=dtype).copy().reshape(shape)
    if dtype.kind == "b":
        a = a.view(np.uint8) & 1
        a = a.astype(np.bool_)
    return a


raw_floats = st.binary(min_size=8, max_size=8).map(lambda b: struct.unpack("<d", b)[0])
numpy_scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(0, 255).map(np.uint8),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.binary(min_size=4, max_size=4).map(lambda b: np.frombuffer(b, np.float32)[0]),
    st.binary(min_size=8, max_size=8).map(lambda b: np.frombuffer(b, np.float64)[0]),
    st.binary(min_size=2, max_size=2).map(lambda b: np.frombuffer(b, np.float16)[0]),
    st.binary(min_size=16, max_size=16).map(lambda b: np.frombuffer(b, np.complex128)[0]),
    st.booleans().map(np.bool_),
)
plain_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**200, -(2**200), 2**63, -(2**63) - 1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    raw_floats,  # NaN payloads, -0.0, subnormals
    st.sampled_from([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0]),
    st.text(),
    st.sampled_from(["", "ünïcödé ✓ 🐍", "\x00nul", "a.b[0]", "\ud800 lone surrogate"]),
    st.binary(max_size=64),
    st.sampled_from(TORCH_DTYPES),
    st.sampled_from([torch.device(d) for d in ("cpu", "cuda:1", "meta", "cuda")]),
    st.lists(st.integers(0, 10), max_size=4).map(torch.Size),
    numpy_scalars,
    st.complex_numbers(allow_nan=True, allow_infinity=True),
    st.tuples(raw_floats, raw_floats).map(lambda p: complex(*p)),  # NaN payloads and -0.0 in both parts
)
hashable_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.text(max_size=8), st.binary(max_size=8), raw_floats,
        st.complex_numbers(allow_nan=True), numpy_scalars, st.sampled_from(TORCH_DTYPES + [torch.device("cpu")]),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(tuple), st.frozensets(inner, max_size=3)),
    max_leaves=6,
)
plain_values = st.one_of(plain_values, st.sets(hashable_values, max_size=4), st.frozensets(hashable_values, max_size=4))
dict_keys = st.one_of(
    st.text(max_size=8), st.integers(), st.sampled_from([0, 1, "0", "1", "", 2**100]), hashable_values
)


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.dictionaries(dict_keys, children, max_size=4),
        st.dictionaries(dict_keys, children, max_size=4).map(lambda d: OrderedDict(reversed(d.items()))),
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(dict_keys, children, max_size=4).map(Counter),
        st.tuples(st.sampled_from([None, *DEFAULT_FACTORIES.values()]),
                  st.dictionaries(dict_keys, children, max_size=4)).map(lambda fd: defaultdict(*fd)),
        st.tuples(st.lists(children, max_size=4), st.one_of(st.none(), st.integers(4, 6)))
        .map(lambda lm: deque(*lm)),
    )


@st.composite
def states(draw: st.DrawFn) -> Any:
    """A nested state whose tensors and arrays come from a shared pool, so some appear more than once."""
    pool = draw(st.lists(st.one_of(torch_tensors(), numpy_arrays()), min_size=1, max_size=6))
    leaf = st.one_of(plain_values, st.sampled_from(range(len(pool))).map(lambda i: pool[i]))
    return draw(st.recursive(leaf, containers, max_leaves=20))


# -- hypothesis round trips ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = deltackpt.Store(tmp_path_factory.mktemp("rt") / "store", chunk_size=SMALL_CHUNK, threads=2)
    s.counter = 0
    yield s
    s.close()


def _save_load(store: deltackpt.Store, state: Any, **kw: Any) -> Any:
    store.counter += 1
    info = store.save(state, step=store.counter, **kw)
    assert info.step == store.counter
    return store.load(step=store.counter, **kw)


@given(state=states())
def test_roundtrip_nested_states(shared_store: deltackpt.Store, state: Any) -> None:
    loaded = _save_load(shared_store, state)
    assert_same_state(state, loaded)


@given(state=states())
def test_async_staging_snapshot_is_an_independent_equal_copy(shared_store: deltackpt.Store, state: Any) -> None:
    """What an async save stores: the staging snapshot equals the state (types, bits, aliasing, requires_grad),
    shares no memory with it, and stays as it was when the state changes afterwards."""
    from deltackpt.staging import StagingBuffers

    before = _save_load(shared_store, state)
    staging = StagingBuffers()
    for _ in range(2):  # the second snapshot reuses the first one's buffers
        snap = staging.snapshot(state)
        assert_same_state(state, snap)
    mine = {id(x) for x in _arrays(state)}
    for x in _arrays(snap):
        assert id(x) not in mine
        if isinstance(x, torch.Tensor) and x.numel():
            assert all(not _shares(x, y) for y in _arrays(state)), "the snapshot shares memory with the state"
    for x in _arrays(state):  # the loop may change every tensor once step() returned
        if isinstance(x, torch.Tensor) and x.numel() and x.is_contiguous() and not x.is_conj():
            flat = x.detach().reshape(-1)
            if flat.stride(-1) != 1:  # one element, which torch calls contiguous whatever its stride
                flat = flat.as_strided((1,), (1,))
            flat.view(torch.uint8).bitwise_not_()
        elif isinstance(x, np.ndarray) and x.size and x.flags.writeable and x.flags.c_contiguous:
            x.reshape(-1).view(np.uint8)[...] ^= 0xFF
    assert_same_state(before, _save_load(shared_store, snap))


def _arrays(obj: Any) -> list[Any]:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return [obj]
    if isinstance(obj, dict):
        return [a for v in obj.values() for a in _arrays(v)]
    if isinstance(obj, (list, tuple, deque)) and not isinstance(obj, torch.Size):
        return [a for v in obj for a in _arrays(v)]
    return []


def _shares(a: torch.Tensor, b: Any) -> bool:
    if not isinstance(b, torch.Tensor) or not b.numel():
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@given(t=torch_tensors())
def test_roundtrip_every_torch_dtype(shared_store: deltackpt.Store, t: torch.Tensor) -> None:
    loaded = _save_load(shared_store, {"t": t})
    assert_same_state({"t": t}, loaded)
    assert isinstance(loaded["t"], torch.nn.Parameter) == isinstance(t, torch.nn.Parameter)


@given(a=numpy_arrays())
def test_roundtrip_numpy_arrays(shared_store: deltackpt.Store, a: np.ndarray) -> None:
    loaded = _save_load(shared_store, [a])
    assert_same_state([a], loaded)


@given(v=plain_values)
def test_roundtrip_plain_values(shared_store: deltackpt.Store, v: Any) -> None:
    loaded = _save_load(shared_store, {"v": v, "w": [v], "x": (v,)})
    assert_same_state({"v": v, "w": [v], "x": (v,)}, loaded)


@given(t=torch_tensors(dtypes=[torch.float32, torch.int64, torch.uint8, torch.float16]),
       big=st.integers(1, 3))
def test_roundtrip_multichunk_tensors(shared_store: deltackpt.Store, t: torch.Tensor, big: int) -> None:
    """Tensors spanning several chunks, with a short last chunk."""
    x = torch.cat([t.reshape(-1).detach()] * 1 + [torch.arange(SMALL_CHUNK * big + 7, dtype=torch.int64)
                                                  .to(t.dtype)])
    loaded = _save_load(shared_store, {"x": x})
    assert tensor_bytes(loaded["x"]) == tensor_bytes(x)


# -- explicit round trips ------------------------------------------------------------------------------


def test_every_dtype_random_bits(store: deltackpt.Store) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {}
    for dt in TORCH_DTYPES + EXTRA_TORCH_DTYPES:
        size = dt.itemsize
        raw = torch.randint(0, 256, (3 * 5 * size,), dtype=torch.uint8, generator=gen)
        if dt == torch.bool:
            raw &= 1
        name = str(dt).removeprefix("torch.")
        state[name] = raw.view(dt).reshape(3, 5)
        state[name + "_t"] = state[name].t()
        state[name + "_0d"] = raw.view(dt)[0].clone().reshape(())
        state[name + "_empty"] = torch.empty((4, 0, 2), dtype=dt)
    store.save(state, step=1)
    loaded = store.load(1)
    assert_same_state(state, loaded)
    assert loaded["float32_0d"].dim() == 0
    assert loaded["float32_empty"].shape == (4, 0, 2)


ODD_STRIDE_VIEWS = {
    "one_elem_sliced_int16": lambda: torch.arange(3, dtype=torch.int16)[1::2],  # shape (1,), stride (2,)
    "one_by_one_f64": lambda: torch.arange(6, dtype=torch.float64).reshape(2, 3)[:1, 1::2][:, :1],
    "empty_sliced_int16": lambda: torch.zeros(1, dtype=torch.int16)[1::2],  # shape (0,), stride (2,)
    "empty_sliced_c64": lambda: torch.zeros(4, 3, dtype=torch.complex64)[:, 3:],
    "row_of_expand_f32": lambda: torch.tensor([[7.0]]).expand(1, 1)[:, ::2],
}


@pytest.mark.parametrize("name", list(ODD_STRIDE_VIEWS))
def test_views_that_torch_calls_contiguous_but_have_odd_strides(store: deltackpt.Store, name: str) -> None:
    """Size-0 and size-1 dims make is_contiguous() true whatever their strides: such views must still save."""
    t = ODD_STRIDE_VIEWS[name]()
    assert t.is_contiguous()
    store.save({"t": t}, step=1)
    out = store.load(1)
    assert_same_state({"t": t}, out)
    target = ODD_STRIDE_VIEWS[name]().zero_()  # load_into a target that is such a view too
    store.load_into({"t": target}, step=1)
    assert tensor_bytes(target) == tensor_bytes(t)


def test_nan_payloads_and_negative_zero_bitwise(store: deltackpt.Store) -> None:
    bits = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 0x00000001, 0x7F800000], dtype=np.uint32)
    t = torch.from_numpy(bits.copy()).view(torch.float32)
    d = torch.tensor([0x7FF8DEADBEEF0001, -0x8000000000000000], dtype=torch.int64).view(torch.float64)
    h = torch.tensor([0x7E01, 0x8000, 0xFC01], dtype=torch.int32).to(torch.int16).view(torch.float16)
    nan_payload = struct.unpack(">d", bytes.fromhex("7ff0000000000001"))[0]  # a signalling NaN
    state = {"f32": t, "f64": d, "f16": h, "py": [-0.0, nan_payload, float("-nan")],
             "np": np.frombuffer(bits.tobytes(), dtype="<f4").copy(), "npbe": bits.astype(">u4").view(">f4")}
    store.save(state, step=7)
    out = store.load(7)
    assert out["f32"].view(torch.int32).tolist() == t.view(torch.int32).tolist()
    assert out["f64"].view(torch.int64).tolist() == d.view(torch.int64).tolist()
    assert out["f16"].view(torch.int16).tolist() == [0x7E01, -0x8000, 0xFC01 - 0x10000]
    assert [float_bits(x) for x in out["py"]] == [float_bits(x) for x in state["py"]]
    assert float_bits(out["py"][1]) == bytes.fromhex("7ff0000000000001")
    assert out["npbe"].dtype.str == ">f4"
    assert out["npbe"].tobytes() == state["npbe"].tobytes()
    assert out["np"].view(np.uint32).tolist() == bits.tolist()


def test_plain_values_exact(store: deltackpt.Store) -> None:
    state = {
        "none": None, "t": True, "f": False, "big": 2**200, "neg": -(2**200) - 1, "zero": 0,
        "nan": float("nan"), "inf": float("inf"), "ninf": -float("inf"), "nz": -0.0,
        "s": "héllo wörld ✓ 🐍 \u0000", "b": b"\x00\xff" * 3, "empty_b": b"",
        "dtype": torch.bfloat16, "dev": torch.device("cuda", 3), "size": torch.Size([2, 0, 3]),
        "np_i": np.int16(-7), "np_f": np.float32(-0.0), "np_b": np.bool_(True), "np_c": np.complex64(1 - 2j),
        "np_u64": np.uint64(2**64 - 1), "np_f16": np.float16(np.nan),
        1: "int key", -5: "negative int key", 2**70: "huge int key", "1": "str key that looks like 1",
    }
    store.save(state, step=0)
    out = store.load(0)
    assert_same_state(state, out)
    assert out["t"] is True and out["f"] is False and out["none"] is None
    assert type(out["size"]) is torch.Size and type(out["dev"]) is torch.device
    assert out["dev"] == torch.device("cuda:3")
    assert type(out["np_u64"]) is np.uint64 and int(out["np_u64"]) == 2**64 - 1
    assert list(out) == list(state)
    assert out[1] == "int key" and out["1"] == "str key that looks like 1"


def test_containers_keep_types_and_order(store: deltackpt.Store) -> None:
    t = torch.arange(6.0)
    state = OrderedDict(
        [("z", {"b": 1, "a": 2, 3: [t, (t, [], ())]}), ("a", (1, (2, (3, ()))))]
    )
    state["deep"] = cur = {}
    for i in range(60):  # deep nesting
        cur[i] = nxt = [{}] if i % 2 else {}
        cur = nxt[0] if i % 2 else nxt
    store.save(state, step=1)
    out = store.load()
    assert type(out) is OrderedDict
    assert_same_state(state, out)
    assert list(out["z"]) == ["b", "a", 3]
    assert type(out["z"][3][1]) is tuple and type(out["z"][3][1][1]) is list
    assert out["z"][3][0] is out["z"][3][1][0]


def _manifest_version(store: deltackpt.Store, step: int) -> int:
    data = (store.path / "manifests" / f"{store.info(step).id}.manifest").read_bytes()
    return int.from_bytes(data[8:12], "little")


def test_sets_counters_deques_defaultdicts_complex_and_hashable_keys(store: deltackpt.Store) -> None:
    """Plain containers beyond dict/list/tuple, stored as data (manifest version 2), never pickled."""
    t = torch.arange(4.0)
    state = {
        "milestones": Counter({30: 1, 60: 2}),  # MultiStepLR's state_dict holds one
        "seen": {3, "a", (1, 2.5), None, frozenset({b"x"})},
        "frozen": frozenset({-0.0, 1 + 2j}),
        "c": complex(float("nan"), -0.0),
        "window": deque([t, 1.5, {"k": t}], maxlen=3),
        "queue": deque([]),
        "by_name": defaultdict(list, {"a": [t], "b": []}),
        "plain_dd": defaultdict(None, {1: "x"}),
        "keys": {(1, "a"): 1, None: 2, True: 3, 2.5: 4, b"k": 5, 1j: 6, torch.float16: 7,
                 np.int64(9): 8, frozenset({1}): 9, torch.device("cpu"): 10},
    }
    store.save(state, step=1)
    out = store.load(1)
    assert_same_state(state, out)
    assert out["window"][0] is out["window"][2]["k"] is out["by_name"]["a"][0]
    assert out["by_name"]["new"] == [] and out["window"].maxlen == 3
    assert out["milestones"] + Counter({30: 1}) == Counter({30: 2, 60: 2})
    assert _manifest_version(store, 1) == 2
    store.save({"a": [t, (1, 2)], "b": {"x": 1.5, 2: None}}, step=2)  # version-1 kinds only: a version-1 manifest
    assert _manifest_version(store, 2) == 1


def test_multisteplr_resumes_with_its_counter(store: deltackpt.Store) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4, 5], gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    store.save({"sched": sched.state_dict(), "opt": opt.state_dict()}, step=3)
    expected = []
    for _ in range(3):
        opt.step()
        sched.step()
        expected.append(sched.get_last_lr())
    opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[100])
    out = store.load(3)
    opt2.load_state_dict(out["opt"])
    sched2.load_state_dict(out["sched"])
    assert type(sched2.milestones) is Counter and sched2.milestones == Counter({2: 1, 4: 2, 5: 1})
    got = []
    for _ in range(3):
        opt2.step()
        sched2.step()
        got.append(sched2.get_last_lr())
    assert got == expected == [[0.125], [0.0625], [0.0625]]


# -- aliasing and parameters ----------------------------------------------------------------------------


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight  # tied


def test_same_tensor_twice_is_one_object(store: deltackpt.Store) -> None:
    t = torch.randn(5, 3)
    a = np.arange(7, dtype=np.float32)
    other = t.clone()  # equal bytes, different object: stays separate
    state = {"x": t, "y": [t, {"z": t}], "a": a, "b": (a,), "other": other}
    store.save(state, step=1)
    out = store.load(1)
    assert out["x"] is out["y"][0] is out["y"][1]["z"]
    assert out["a"] is out["b"][0]
    assert out["other"] is not out["x"]
    assert torch.equal(out["other"], out["x"])
    out["x"].add_(1)  # they really are one tensor
    assert torch.equal(out["y"][1]["z"], t + 1)
    assert not torch.equal(out["other"], out["x"])


def test_tied_weights_stay_tied(store: deltackpt.Store) -> None:
    model = TiedLM()
    sd = model.state_dict(keep_vars=True)
    assert sd["emb.weight"] is sd["head.weight"]
    store.save({"model": sd}, step=1)
    out = store.load(1)["model"]
    assert list(out) == list(sd)
    assert out["emb.weight"] is out["head.weight"]
    for k, v in sd.items():
        assert type(out[k]) is torch.nn.Parameter, k
        assert out[k].requires_grad
        assert torch.equal(out[k].detach(), v.detach())


def test_tied_weights_of_a_plain_state_dict_are_one_tensor(store: deltackpt.Store) -> None:
    """``state_dict()`` detaches each parameter into a new tensor: the tied pair is two objects viewing one memory.
    It is stored once and loads as one tensor (``torch.save`` keeps them sharing memory too)."""
    model = TiedLM()
    sd = model.state_dict()
    assert sd["emb.weight"] is not sd["head.weight"]
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    info = store.save({"model": sd}, step=1)
    assert [t.key for t in store.manifest(1).tensors] == ["model.emb.weight", "model.mid.weight", "model.mid.bias"]
    assert info.logical_bytes == sum(v.numel() * 4 for k, v in sd.items() if k != "head.weight")
    out = store.load(1)["model"]
    assert list(out) == list(sd)
    assert out["emb.weight"] is out["head.weight"]
    assert_same_state(sd, out)
    untied = torch.nn.Module()
    untied.emb, untied.mid = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 4)
    untied.head = torch.nn.Linear(4, 11, bias=False)
    untied.load_state_dict(out)
    assert torch.equal(untied.head.weight, sd["emb.weight"])


def test_views_that_only_overlap_stay_separate(store: deltackpt.Store) -> None:
    base = torch.arange(24, dtype=torch.float32)
    c = torch.full((3,), 1 + 2j, dtype=torch.complex64)
    a = np.arange(10, dtype=np.int32)
    state = {
        "whole": base, "reshaped": base.view(4, 6), "slice": base[2:8], "again": base[2:8],
        "ints": base.view(torch.int32), "param": torch.nn.Parameter(base),
        "c": c, "conj": c.conj(), "imag": c.imag, "neg": c.conj().imag,
        "empty1": torch.empty(0), "empty2": torch.empty(0), "a": a, "a_view": a[:], "a_step": a[::2],
    }
    store.save(state, step=1)
    out = store.load(1)
    keys = [t.key for t in store.manifest(1).tensors]
    assert "again" not in keys and "a_view" not in keys  # the same view of the same memory: one leaf each
    assert out["slice"] is out["again"] and out["a"] is out["a_view"]
    distinct = ["whole", "reshaped", "slice", "ints", "param", "c", "conj", "imag", "neg", "empty1", "empty2", "a",
                "a_step"]
    assert len({id(out[k]) for k in distinct}) == len(distinct)
    assert_same_state(state, out)
    assert torch.equal(out["conj"], c.conj()) and torch.equal(out["neg"], torch.full((3,), -2.0))
    assert torch.equal(out["imag"], torch.full((3,), 2.0))


def test_load_into_matches_every_path_of_a_tied_tensor(store: deltackpt.Store) -> None:
    tied = TiedLM()
    sd = tied.state_dict()
    store.save(sd, step=1)  # one tensor entry for emb.weight and head.weight
    untied = TiedLM()
    untied.head.weight = torch.nn.Parameter(torch.zeros(11, 4))
    assert store.load_into(untied.state_dict(), step=1) == []  # head.weight is found under its second path
    assert torch.equal(untied.head.weight, sd["emb.weight"]) and torch.equal(untied.emb.weight, sd["emb.weight"])
    # and the other way: a checkpoint with two separate tensors into a tied target, filled once
    store.save({k: v.clone() for k, v in sd.items()}, step=2)
    assert len(store.manifest(2).tensors) == 4
    target = TiedLM()
    assert target.emb.weight is target.head.weight
    assert store.load_into(target.state_dict(), step=2) == []
    assert torch.equal(target.emb.weight, sd["emb.weight"]) and torch.equal(target.mid.weight, sd["mid.weight"])
    with pytest.raises(ShapeMismatchError, match="head.weight"):
        bad = TiedLM()
        bad.head.weight = torch.nn.Parameter(torch.zeros(11, 5))
        store.load_into(bad.state_dict(), step=1)


def test_parameter_same_object_twice(store: deltackpt.Store) -> None:
    p = torch.nn.Parameter(torch.randn(3, 2))
    frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    g = torch.randn(2, 2, dtype=torch.float64).requires_grad_(True)
    state = {"a": p, "b": p, "frozen": frozen, "g": g, "plain": torch.randn(2)}
    store.save(state, step=1)
    out = store.load(1)
    assert out["a"] is out["b"]
    assert type(out["a"]) is torch.nn.Parameter and out["a"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert type(out["g"]) is torch.Tensor and out["g"].requires_grad and out["g"].is_leaf
    assert type(out["plain"]) is torch.Tensor and not out["plain"].requires_grad
    assert_same_state(state, out)


def test_model_and_optimizer_state(store: deltackpt.Store) -> None:
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model.head(model.mid(model.emb(torch.arange(3)))).sum()
    loss.backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
             "rng": torch.get_rng_state()}
    store.save(state, step=3)
    out = store.load(3)
    assert_same_state(state, out)
    opt2 = torch.optim.AdamW(TiedLM().parameters(), lr=1e-3)
    opt2.load_state_dict(out["optimizer"])
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


# -- several checkpoints, metadata ------------------------------------------------------------------------


def test_many_steps_in_one_store(store: deltackpt.Store) -> None:
    by_step = {s: {"w": torch.randn(100, 30), "step": s, "shared": torch.ones(50)} for s in (10, 20, 30)}
    infos = {s: store.save(state, step=s, metadata={"loss": 1.0 / s}) for s, state in by_step.items()}
    assert [i.step for i in store.list()] == [10, 20, 30]
    assert [i.id for i in store.list()] == [infos[s].id for s in (10, 20, 30)]
    assert len(set(i.id for i in infos.values())) == 3
    for s in (20, 10, 30):
        assert_same_state(by_step[s], store.load(s))
        assert_same_state(by_step[s], store.load(id=infos[s].id))
    assert_same_state(by_step[30], store.load())  # latest
    assert store.latest().id == infos[30].id
    # lineage: each save descends from the previous one by default
    assert infos[10].parent is None
    assert infos[20].parent == infos[10].id and infos[30].parent == infos[20].id
    # same step again: the newest one wins for that step
    again = {"w": torch.zeros(3)}
    store.save(again, step=20)
    assert_same_state(again, store.load(20))
    assert_same_state(again, store.load())
    assert_same_state(by_step[20], store.load(id=infos[20].id))
    assert len(store.list()) == 4
    # deleting a step removes its newest checkpoint; the older one with that step shows again
    store.delete(20)
    assert_same_state(by_step[20], store.load(20))
    assert [i.step for i in store.list()] == [10, 20, 30]
    assert_same_state(by_step[30], store.load())
    # an explicit parent is recorded as given
    info = store.save({"w": torch.ones(2)}, step=40, parent=infos[10].id)
    assert info.parent == infos[10].id and store.info(40).parent == infos[10].id


def test_latest_is_last_committed_and_reopen(store_path: Path) -> None:
    with deltackpt.Store(store_path, chunk_size=SMALL_CHUNK) as s:
        s.save({"a": torch.tensor([1])}, step=1)
        s.save({"a": torch.tensor([2])}, step=2)
    with deltackpt.Store(store_path) as s:  # chunk size comes from the store
        assert s.chunk_size == SMALL_CHUNK
        assert s.load()["a"].item() == 2
        assert s.load(1)["a"].item() == 1
        s.save({"a": torch.tensor([3])}, step=3)
        assert [i.step for i in s.list()] == [1, 2, 3]


def test_metadata_round_trip(store: deltackpt.Store) -> None:
    meta = {"loss": 0.125, "nan": float("nan"), "epoch": 4, "tags": ["a", "b"], "cfg": {"lr": 3e-4, 1: None},
            "big": 2**100, "blob": b"\x00\x01", "dtype": torch.float16, "t": (1, 2)}
    info = store.save({"x": torch.randn(3)}, step=5, metadata=meta)
    for got in (info.metadata, store.info(5).metadata, store.list()[0].metadata, store.info().metadata):
        assert_same_state(meta, got)
    assert store.info(5).step == 5 and store.info(5).id == info.id
    assert store.info(id=info.id).metadata["tags"] == ["a", "b"]
    assert store.save({"x": torch.randn(3)}, step=6).metadata is None
    assert store.info(6).metadata is None


def test_info_sizes(store: deltackpt.Store) -> None:
    state = {"a": torch.randn(1000), "b": np.zeros((10, 10), dtype=np.float64), "c": torch.empty(0)}
    info = store.save(state, step=1)
    assert info.logical_bytes == 4000 + 800
    assert 0 < info.written_bytes
    assert store.info(1).written_bytes == info.written_bytes
    assert store.info(1).logical_bytes == info.logical_bytes
    assert info.created > 0 and info.seq >= 1


# -- load_into -----------------------------------------------------------------------------------------


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))


def test_load_into_fills_in_place(store: deltackpt.Store) -> None:
    src = _model(0)
    src(torch.randn(4, 6))  # move BatchNorm running stats
    store.save(src.state_dict(), step=1)
    dst = _model(1)
    target = dst.state_dict()
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    assert not torch.equal(target["0.weight"], src.state_dict()["0.weight"])
    missing = store.load_into(target, step=1)
    assert missing == []
    after = dst.state_dict()
    for k, v in src.state_dict().items():
        assert after[k].data_ptr() == ptrs[k], k
        assert tensor_bytes(after[k]) == tensor_bytes(v), k
    assert dst[0].weight.data_ptr() == ptrs["0.weight"]
    assert dst[1].num_batches_tracked.item() == 1


def test_load_into_noncontiguous_and_numpy_targets(store: deltackpt.Store) -> None:
    w = torch.randn(5, 7)
    a = np.arange(12, dtype=">i4").reshape(3, 4)
    store.save({"w": w, "a": a, "n": 3}, step=1)
    base = torch.zeros(7, 5)
    arr = np.zeros((3, 4), dtype=">i4")
    target = {"w": base.t(), "a": arr, "n": 0}
    assert store.load_into(target) == []
    assert torch.equal(base.t(), w)
    assert np.array_equal(arr, a) and arr.dtype.str == ">i4"
    assert target["n"] == 0  # plain values are not touched


@pytest.mark.parametrize("change", ["shape", "dtype", "missing", "unexpected"])
def test_load_into_strict_mismatch_changes_nothing(store: deltackpt.Store, change: str) -> None:
    src = _model(0)
    store.save(src.state_dict(), step=1)
    if change == "shape":
        dst = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    else:
        dst = _model(1)
    if change == "dtype":
        dst[2].double()
    target = dst.state_dict()
    if change == "missing":
        target["extra"] = torch.zeros(2)
    if change == "unexpected":
        del target["2.bias"]
    before = {k: v.clone() for k, v in target.items()}
    with pytest.raises(ShapeMismatchError) as info:
        store.load_into(target, step=1)
    if change == "missing":  # (the side with nothing to name is not named: no "not in target []")
        assert str(info.value).endswith("differ: missing in checkpoint ['extra']"), info.value
    if change == "unexpected":
        assert str(info.value).endswith("differ: not in target ['2.bias']"), info.value
    for k, v in target.items():
        assert tensor_bytes(v) == tensor_bytes(before[k]), f"{k} changed by a failed load_into"


def test_load_into_non_strict(store: deltackpt.Store) -> None:
    store.save({"a": torch.ones(3), "b": torch.full((2,), 5.0)}, step=1)
    target = {"a": torch.zeros(3), "c": torch.zeros(4)}
    missing = store.load_into(target, strict=False)
    assert missing == ["c"]
    assert torch.equal(target["a"], torch.ones(3))
    assert torch.equal(target["c"], torch.zeros(4))


# -- load(into=...) -----------------------------------------------------------------------------------


def _garbage_like(shape: tuple[int, ...], dtype: torch.dtype, layout: str, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` full of random bytes; ``layout`` "noncontig" makes it a permuted view."""
    g = torch.Generator().manual_seed(seed)
    if layout == "noncontig" and len(shape) >= 2:
        base = torch.empty(tuple(reversed(shape)), dtype=dtype)
        t = base.permute(*reversed(range(len(shape))))
    else:
        t = base = torch.empty(shape, dtype=dtype)
    if base.numel():
        base.reshape(-1).view(torch.uint8).copy_(torch.randint(0, 256, (base.numel() * base.element_size(),),
                                                               dtype=torch.uint8, generator=g))
    return t


@st.composite
def tensor_trees(draw: st.DrawFn) -> Any:
    """Dicts and lists of torch tensors from a small pool (so some appear twice), two levels deep, with keys that
    look like key paths (``{"a.b": x, "a": {"b": y}}``)."""
    pool = draw(st.lists(torch_tensors(), min_size=1, max_size=5))
    leaf = st.sampled_from(range(len(pool))).map(lambda i: pool[i])
    keys = st.one_of(st.sampled_from(["a", "b", "a.b", "0", "[0]"]), st.integers(0, 2))
    inner = st.one_of(leaf, st.dictionaries(keys, leaf, min_size=1, max_size=3),
                      st.lists(leaf, min_size=1, max_size=3))
    return draw(st.one_of(st.dictionaries(keys, inner, min_size=1, max_size=4),
                          st.lists(inner, min_size=1, max_size=4)))


@given(state=tensor_trees(), data=st.data())
def test_load_decodes_into_offered_tensors(shared_store: deltackpt.Store, state: Any, data: st.DataObject) -> None:
    """``load(into=...)``: a stored tensor goes into the first offered tensor of its dtype and shape at one of its
    places (the returned state then holds that object, at every place of the stored tensor); offers that do not
    match, and second offers for one stored tensor, are left untouched; every value loads bit-exactly."""
    shared_store.counter += 1
    shared_store.save(state, step=shared_store.counter)
    places: list[tuple[torch.Tensor, Any]] = []  # (original tensor, offer) in document order

    def mirror(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            how = data.draw(st.sampled_from(["match"] * 3 + ["noncontig"] * 2 + ["none", "shape", "dtype", "numpy"]))
            offer: Any = None
            if how in ("match", "noncontig"):
                offer = _garbage_like(tuple(obj.shape), obj.dtype, how, len(places))
            elif how == "shape":
                offer = _garbage_like((obj.numel() + 1,), obj.dtype, how, len(places))
            elif how == "dtype":
                other = torch.int16 if obj.dtype != torch.int16 else torch.int32
                offer = _garbage_like(tuple(obj.shape), other, how, len(places))
            elif how == "numpy":
                offer = np.zeros(tuple(obj.shape), dtype=np.uint8)
            places.append((obj, offer))
            return offer
        if isinstance(obj, dict):
            return {k: mirror(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple, deque)) and not isinstance(obj, torch.Size):
            return [mirror(v) for v in obj]
        return None

    into = mirror(state)
    before = [tensor_bytes(x) if isinstance(x, torch.Tensor) else None for _, x in places]
    loaded = shared_store.load(step=shared_store.counter, into=into)
    got = [x for x in _arrays(loaded) if isinstance(x, torch.Tensor)]
    assert len(got) == len(places)
    first: dict[Any, torch.Tensor | None] = {}  # per stored tensor: the offer it must have gone into
    for (orig, offer), out in zip(places, got):
        assert out.dtype == orig.dtype and out.shape == orig.shape
        assert tensor_bytes(out) == tensor_bytes(orig)
        fits = isinstance(offer, torch.Tensor) and offer.dtype == orig.dtype and offer.shape == orig.shape
        first.setdefault(deltackpt.tree.alias_key(orig), None)
        if fits and first[deltackpt.tree.alias_key(orig)] is None:
            first[deltackpt.tree.alias_key(orig)] = offer
    for (orig, offer), out, was in zip(places, got, before):
        chosen = first[deltackpt.tree.alias_key(orig)]
        if chosen is None:
            assert all(out is not x for _, x in places), "a stored tensor went into an offer that did not fit"
        else:
            assert out is chosen
        if isinstance(offer, torch.Tensor) and offer is not chosen:
            assert tensor_bytes(offer) == was, "an offer that was not taken changed"


@given(state=tensor_trees(), data=st.data())
def test_load_into_fills_each_place(shared_store: deltackpt.Store, state: Any, data: st.DataObject) -> None:
    """``load_into`` fills the target tensor at each place of the state (contiguous or not) with the tensor stored
    at that same place, also where places share a key path (``{"a.b": x, "a": {"b": y}}``)."""
    shared_store.counter += 1
    shared_store.save(state, step=shared_store.counter)
    offers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def mirror(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            layout = data.draw(st.sampled_from(["contig", "noncontig"]))
            offers.append((obj, _garbage_like(tuple(obj.shape), obj.dtype, layout, len(offers))))
            return offers[-1][1]
        if isinstance(obj, dict):
            return {k: mirror(v) for k, v in obj.items()}
        return [mirror(v) for v in obj]

    target = mirror(state)
    assert shared_store.load_into(target, step=shared_store.counter) == []
    for orig, offer in offers:
        assert tensor_bytes(offer) == tensor_bytes(orig)


def test_load_into_matches_places_not_key_paths(store: deltackpt.Store) -> None:
    """Places that share a key path are told apart: strict mode reports the place a target lacks, non-strict
    mode leaves the tensor at the other place alone, and a span naming a shared key path is refused."""
    x, y = torch.randn(3), torch.randn(3)
    store.save({"a.b": x, "a": {"b": y}, "m": {0: x + 1}}, step=1)
    target = {"a.b": torch.zeros(3), "a": {"b": torch.zeros(3)}, "m": {0: torch.zeros(3)}}
    assert store.load_into(target, step=1) == []
    assert torch.equal(target["a.b"], x) and torch.equal(target["a"]["b"], y) and torch.equal(target["m"][0], x + 1)
    flat = {"a.b": torch.zeros(3), "m": [torch.zeros(3)]}  # {0: ...} and [...] both say m[0]
    differ = r"missing in checkpoint \['m\[0\]'\], not in target \['a.b', 'm\[0\]'\]"
    with pytest.raises(ShapeMismatchError, match=differ):
        store.load_into(flat, step=1)
    assert store.load_into(flat, step=1, strict=False) == ["m[0]"]
    assert torch.equal(flat["a.b"], x) and torch.equal(flat["m"][0], torch.zeros(3))
    many = {f"k{i}": torch.zeros(3) for i in range(8)}  # a message names five paths, and how many more differ
    with pytest.raises(ShapeMismatchError, match=r"missing in checkpoint \['k0', .*'k4'\] and 3 more, not in target "
                       r"\['a.b', 'a.b', 'm\[0\]'\]$"):  # (two places whose key path is a.b)
        store.load_into(many, step=1)
    with pytest.raises(ValueError, match="2 places"):
        store.load_into(target, step=1, spans={"a.b": (0, 4)})
    with pytest.raises(ValueError, match="not a tensor of the target"):
        store.load_into(target, step=1, spans={"a.c": (0, 4)})
    with pytest.raises(ValueError, match="two ints"):
        store.load_into(target, step=1, spans={"m[0]": (0.5, 4)})


@given(x=st.one_of(st.integers(), st.integers(1, 30_000).map(lambda n: 7**n),
                   st.integers(1, 30_000).map(lambda n: -(3**n))))
def test_ints_of_any_size_in_text(x: int) -> None:
    """The manifest's decimal text of an int, past Python's 4300-digit limit of one conversion."""
    text = deltackpt.tree.int_text(x)
    assert deltackpt.tree.int_value(text) == x
    assert text == f"{x:d}" if abs(x) < 10**4000 else text.lstrip("-").isdigit() and text[:1] != "0"


def test_huge_ints_in_state_and_metadata(store: deltackpt.Store) -> None:
    big, neg = 10**4300 + 17, -(2**40_000)
    store.save({"n": big, "m": [neg, {big: 1}], "w": torch.ones(3)}, step=1, metadata={"n": big})
    out = store.load(1)
    assert out["n"] == big and out["m"][0] == neg and out["m"][1] == {big: 1}
    assert store.info(1).metadata == {"n": big}


def test_targets_whose_elements_share_memory(store: deltackpt.Store) -> None:
    """An expanded (stride-0) tensor or a read-only numpy array cannot hold a stored tensor's values: load(into=)
    leaves such offers alone and loads new arrays; load_into refuses them, naming the key, before writing."""
    b, a = torch.arange(6.0).reshape(2, 3), np.arange(6.0).reshape(2, 3)
    store.save({"b": b, "a": a, "w": torch.ones(4)}, step=1)
    expanded, frozen = torch.zeros(3).expand(2, 3), np.broadcast_to(np.zeros(3), (2, 3))
    state = store.load(step=1, into={"b": expanded, "a": frozen})
    assert state["b"] is not expanded and torch.equal(state["b"], b) and not expanded.any()
    assert state["a"] is not frozen and np.array_equal(state["a"], a) and not frozen.any()
    for key, bad in (("b", expanded), ("a", frozen)):
        target = {"b": torch.zeros(2, 3), "a": np.zeros((2, 3)), "w": torch.zeros(4), key: bad}
        with pytest.raises(ShapeMismatchError, match=f"'{key}': the target cannot hold"):
            store.load_into(target, step=1)
        assert not target["w"].any() and not target["b"].any() and not target["a"].any()  # nothing written


def test_offers_without_plain_memory_are_left_alone(store: deltackpt.Store) -> None:
    """A nested, meta, sparse or quantized tensor offered to load(into=) holds no memory a stored tensor could be
    decoded into: it is left alone, as a mismatched offer is, and the tensor loads into memory of its own.
    Before, a nested tensor of the stored dtype raised torch's RuntimeError ("Internal error: NestedTensorImpl
    doesn't support sizes") from the shape comparison."""
    store.save({"x": torch.arange(3.0), "y": torch.ones(2)}, step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nested and quantized tensors are prototypes, or deprecated)
        offers = [torch.nested.nested_tensor([torch.zeros(3)]), torch.empty(3, device="meta"),
                  torch.zeros(3).to_sparse(), torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8)]
    for offer in offers:
        y = torch.zeros(2)
        state = store.load(step=1, into={"x": offer, "y": y})
        assert state["x"] is not offer and torch.equal(state["x"], torch.arange(3.0)), offer.layout
        assert state["y"] is y and torch.equal(y, torch.ones(2))


def test_a_memmap_target_is_filled(store: deltackpt.Store, tmp_path: Path) -> None:
    """An np.memmap (an ndarray subclass: a large array on disk) is a target like any array: load_into and
    load(into=) fill its memory, a span too. Before, load_into took it for a value that is no array: strict, it
    raised "not in target ['a']" for a target that holds 'a'; with strict=False it returned [] and filled
    nothing. A masked array is refused naming it (its mask is no stored array's), a read-only map as read-only."""
    a = np.arange(3000, dtype=np.float32)
    store.save({"a": a, "b": np.ones(3)}, step=1)
    for strict in (True, False):
        mm = np.memmap(tmp_path / f"m{strict}.bin", dtype=np.float32, mode="w+", shape=(3000,))
        assert store.load_into({"a": mm, "b": np.zeros(3)}, step=1, strict=strict) == []
        assert np.array_equal(mm, a)
    mm = np.memmap(tmp_path / "into.bin", dtype=np.float32, mode="w+", shape=(3000,))
    state = store.load(step=1, into={"a": mm})
    assert state["a"] is mm and np.array_equal(mm, a)
    mm = np.memmap(tmp_path / "span.bin", dtype=np.float32, mode="w+", shape=(3000,))
    store.load_into({"a": mm, "b": np.zeros(3)}, step=1, spans={"a": (400, 800)})
    assert np.array_equal(mm[100:200], a[100:200]) and not mm[:100].any() and not mm[200:].any()
    ro = np.memmap(tmp_path / "into.bin", dtype=np.float32, mode="r", shape=(3000,))
    with pytest.raises(ShapeMismatchError, match="'a': the target cannot hold the checkpoint's values: it is a read"):
        store.load_into({"a": ro, "b": np.zeros(3)}, step=1)
    masked = np.ma.masked_array(np.zeros(3), mask=[0, 1, 0])
    with pytest.raises(ShapeMismatchError, match="b: it is a numpy masked array"):
        store.load_into({"a": np.zeros(3000, np.float32), "b": masked}, step=1)


def test_load_into_a_model_needs_no_second_copy(store: deltackpt.Store) -> None:
    """The model's own tensors come back in the loaded state, so load_state_dict has nothing to copy; the
    optimizer's state is new; the values are the saved ones."""
    src = _model(0)
    opt = torch.optim.AdamW(src.parameters())
    src(torch.randn(4, 6)).sum().backward()
    opt.step()
    store.save({"model": src.state_dict(), "optimizer": opt.state_dict()}, step=1)
    dst = _model(1)
    mine = dst.state_dict()
    state = store.load(step=1, into={"model": mine})
    for k, v in mine.items():
        assert state["model"][k] is v, k
        assert tensor_bytes(v) == tensor_bytes(src.state_dict()[k]), k
    assert tensor_bytes(dst[0].weight) == tensor_bytes(src[0].weight)  # filled through the model's memory
    exp_avg = state["optimizer"]["state"][0]["exp_avg"]
    assert all(exp_avg.data_ptr() != p.data_ptr() for p in dst.parameters())
    assert tensor_bytes(exp_avg) == tensor_bytes(opt.state_dict()["state"][0]["exp_avg"])


def test_a_module_or_optimizer_offered_for_its_state_dict_is_refused(store: deltackpt.Store) -> None:
    """A module offered where its state_dict() belongs matched no place: load(into=) returned the checkpoint and
    left the model as it was, without a word (load_into refused it). It is refused, naming its place, before
    anything is read; so is an optimizer, at any depth."""
    src = _model(0)
    opt = torch.optim.AdamW(src.parameters())
    store.save({"model": src.state_dict(), "optimizer": opt.state_dict()}, step=1)
    dst = _model(1)
    before = tensor_bytes(dst[0].weight)
    for into, where in (({"model": dst}, "model"), ([{"model": dst.state_dict(), "opt": opt}], "[0].opt")):
        with pytest.raises(deltackpt.UnsupportedTypeError, match=re.escape(f"cannot load into {where}: it is a ")):
            store.load(step=1, into=into)
    assert tensor_bytes(dst[0].weight) == before
    with pytest.raises(deltackpt.UnsupportedTypeError, match="cannot load into <root>: it is a Sequential"):
        store.load(step=1, into=dst)
    cyclic: dict[str, Any] = {"model": dst.state_dict()}
    cyclic["self"] = cyclic  # (a container that holds itself is walked once)
    assert tensor_bytes(store.load(step=1, into=cyclic)["model"]["0.weight"]) == tensor_bytes(src[0].weight)
    store.save(src[0].weight.detach(), step=2)  # (a state that is one tensor: offered as one, not walked into)
    one = torch.zeros_like(src[0].weight)
    assert store.load(step=2, into=one) is one and tensor_bytes(one) == tensor_bytes(src[0].weight)


def test_load_into_parameters_and_lazy_views(store: deltackpt.Store) -> None:
    """Offers that need care: a Parameter that requires grad (filled through a detached view, still requiring
    grad), a lazily conjugated view and a transposed view of a Parameter (both through a host buffer)."""
    w, c, t = torch.randn(4, 5), torch.randn(3, dtype=torch.complex64), torch.randn(5, 4)
    store.save({"w": torch.nn.Parameter(w), "c": c, "t": t}, step=1)
    p = torch.nn.Parameter(torch.zeros(4, 5))
    lazy = torch.zeros(3, dtype=torch.complex64).conj()
    pt = torch.nn.Parameter(torch.zeros(4, 5)).t()
    state = store.load(step=1, into={"w": p, "c": lazy, "t": pt})
    assert state["w"] is p and p.requires_grad and torch.equal(p, w)
    assert state["c"] is lazy and lazy.is_conj() and torch.equal(lazy, c)
    assert state["t"] is pt and torch.equal(pt, t)


def test_pair_leaves_matches_places_not_key_paths() -> None:
    """The skeleton of {"a.b": x, "a": {"b": y}} pairs each leaf with the object at its own place; a target
    mapping that cannot look a key up is skipped, not blamed on the manifest; a malformed skeleton is."""
    skeleton, _ = deltackpt.tree.flatten({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}, "l": [torch.zeros(2)]})
    x, y, z = object(), object(), object()
    assert list(deltackpt.tree.pair_leaves(skeleton, {"a": {"b": y}, "a.b": x, "l": (z,)})) == [(0, x), (1, y), (2, z)]
    assert list(deltackpt.tree.pair_leaves(skeleton, {"a": [y], "l": {}})) == []

    class Picky(dict):
        def get(self, key: Any, default: Any = None) -> Any:
            raise TypeError("no")

    assert list(deltackpt.tree.pair_leaves(skeleton, Picky(a=x))) == []
    with pytest.raises(deltackpt.CorruptManifestError):
        list(deltackpt.tree.pair_leaves(["d", [["s", "a"]], [["T"]]], {"a": x}))


def test_load_into_tied_offer_and_untied_checkpoint(store: deltackpt.Store) -> None:
    """Two stored tensors at the two places of one tied offered tensor: the first fills it, the second loads as
    a new tensor (as torch would, load_state_dict then copies it over the first)."""
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    store.save({"emb": a, "head": b}, step=1)
    w = torch.zeros(4, 3)
    state = store.load(step=1, into={"emb": w, "head": w.view(4, 3)})
    assert state["emb"] is w and torch.equal(w, a)
    assert state["head"] is not w and torch.equal(state["head"], b)


# -- registered types and pickle -----------------------------------------------------------------------


@dataclasses.dataclass
class Adapter:
    name: str
    weight: torch.Tensor
    scale: float


def test_register_type_round_trip(store: deltackpt.Store) -> None:
    deltackpt.register_type(
        Adapter, "tests.Adapter",
        lambda a: {"name": a.name, "weight": a.weight, "scale": a.scale},
        lambda d: Adapter(**d),
    )
    try:
        w = torch.randn(4, 4)
        state = {"adapters": [Adapter("lora", w, 0.5), Adapter("b", torch.ones(2), -0.0)], "w": w}
        store.save(state, step=1)
        out = store.load(1)
        assert [type(a) for a in out["adapters"]] == [Adapter, Adapter]
        assert out["adapters"][0].name == "lora" and out["adapters"][0].scale == 0.5
        assert float_bits(out["adapters"][1].scale) == float_bits(-0.0)
        assert torch.equal(out["adapters"][0].weight, w)
        assert out["adapters"][0].weight is out["w"]  # aliasing through the hook
    finally:
        deltackpt.unregister_type(Adapter)
    with pytest.raises(UnsupportedTypeError, match="tests.Adapter"):
        store.load(1)  # no decoder registered any more
    with pytest.raises(UnsupportedTypeError):
        store.save({"a": Adapter("x", torch.ones(1), 1.0)}, step=2)


class _Celsius(float):
    pass


class _Fahrenheit(float):
    pass


def test_a_type_name_belongs_to_one_class(store: deltackpt.Store) -> None:
    """A name taken by another class is refused (loads would build the wrong class from what either saved), and
    unregistering one class never takes a name another holds; registering a class again replaces its name."""
    deltackpt.register_type(_Celsius, "tests.temp", float, _Celsius)
    try:
        with pytest.raises(InvalidNameError, match="tests.temp.*_Celsius"):
            deltackpt.register_type(_Fahrenheit, "tests.temp", float, _Fahrenheit)
        deltackpt.unregister_type(_Fahrenheit)  # was never registered: the name stays _Celsius's
        store.save({"t": _Celsius(21.5)}, step=1)
        assert type(store.load(1)["t"]) is _Celsius
        deltackpt.register_type(_Celsius, "tests.celsius", float, _Celsius)  # renamed: the old name is free
        deltackpt.register_type(_Fahrenheit, "tests.temp", float, _Fahrenheit)
        deltackpt.unregister_type(_Celsius)  # takes its own name only
        store.save({"t": _Fahrenheit(70.7)}, step=2)
        assert type(store.load(2)["t"]) is _Fahrenheit
        with pytest.raises(UnsupportedTypeError, match="_Celsius"):
            store.save({"t": _Celsius(1.0)}, step=3)
    finally:
        deltackpt.unregister_type(_Celsius)
        deltackpt.unregister_type(_Fahrenheit)


def test_allow_pickle_opt_in(store: deltackpt.Store, store_path: Path) -> None:
    ns = argparse.Namespace(lr=0.1, name="run", layers=[1, 2])
    state = {"args": ns, "w": torch.randn(3)}
    before = dir_snapshot(store_path / "packs")
    with pytest.raises(UnsupportedTypeError, match="args"):
        store.save(state, step=1)
    assert store.list() == [] and dir_snapshot(store_path / "packs") == before
    store.save(state, step=1, allow_pickle=True)
    with pytest.raises(UnsafeLoadError, match="'args'"):
        store.load(1)
    with pytest.raises(UnsafeLoadError):
        store.load(1, allow_pickle=False)
    out = store.load(1, allow_pickle=True)
    assert type(out["args"]) is argparse.Namespace and out["args"] == ns
    assert torch.equal(out["w"], state["w"])


def test_a_load_that_may_not_unpickle_refuses_before_it_decodes(store: deltackpt.Store) -> None:
    """A checkpoint with pickled values is refused before any tensor is decoded: a tensor offered with ``into``
    keeps its bytes, and the error names the key paths of the pickled values (every one up to three)."""
    store.save({"w": torch.randn(1000), "cfg": [argparse.Namespace(a=1), {"b": argparse.Namespace(b=2)}]},
               step=1, allow_pickle=True)
    target = torch.zeros(1000)
    with pytest.raises(UnsafeLoadError, match=r"step 1\) holds pickled values .* at 'cfg\[0\]', 'cfg\[1\]\.b';"):
        store.load(1, into={"w": target})
    assert not target.any()
    assert store.load(1, into={"w": target}, allow_pickle=True)["cfg"][1]["b"].b == 2 and target.any()


def test_a_pickled_value_in_a_state_dicts_metadata_is_refused_by_path_before_decoding(
        store: deltackpt.Store) -> None:
    """A pickled value can sit in an OrderedDict's ``_metadata`` (a module state_dict()'s): the refusal names it
    and comes before any tensor is decoded, as for one anywhere else (the check once missed it, decoded
    everything and then refused without a key path)."""
    sd = torch.nn.Linear(4, 2).state_dict()
    sd._metadata[""]["hook"] = argparse.Namespace(a=1)  # type: ignore[attr-defined]
    store.save({"model": sd}, step=1, allow_pickle=True)
    target = {"model": OrderedDict((k, torch.zeros_like(v)) for k, v in sd.items())}
    with pytest.raises(UnsafeLoadError, match=r"holds pickled values .* at 'model\._metadata\.\.hook';"):
        store.load(1, into=target)
    assert not any(t.any() for t in target["model"].values())
    out = store.load(1, allow_pickle=True)["model"]
    assert out._metadata[""]["hook"].a == 1


def test_reopen_in_fresh_directory_roundtrip() -> None:
    """A store written by one handle is read back by a new handle (nothing cached)."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "s"
        state = {"x": torch.randn(3000), "y": [np.arange(5000, dtype="<u2")]}
        with deltackpt.Store(p, chunk_size=SMALL_CHUNK) as s:
            s.save(state, step=1)
        with deltackpt.Store(p) as s:
            assert_same_state(state, s.load(1))


# -- the cyclic garbage collector during saves and loads ------------------------------------------------------


class _GcProbe:
    """Records whether the cyclic collector is enabled when a save pickles it (after calling its ``hook``) and when
    a load rebuilds it."""

    seen: list[bool] = []

    def __init__(self, hook: Any = None) -> None:
        _GcProbe.seen.append(gc.isenabled())
        self.hook = hook

    def __reduce__(self) -> tuple[type, tuple[()]]:
        if self.hook is not None:
            self.hook()
        _GcProbe.seen.append(gc.isenabled())
        return (_GcProbe, ())


@pytest.fixture
def probe() -> Iterator[type[_GcProbe]]:
    _GcProbe.seen = []
    was = gc.isenabled()
    try:
        yield _GcProbe
    finally:
        _GcProbe.seen = []
        (gc.enable if was else gc.disable)()


def test_cyclic_gc_waits_while_a_save_or_load_runs(store: deltackpt.Store, probe: type[_GcProbe]) -> None:
    gc.enable()
    state = {"w": torch.arange(10.0), "p": probe()}
    probe.seen.clear()
    store.save(state, step=1, allow_pickle=True)
    assert probe.seen == [False] and gc.isenabled()
    probe.seen.clear()
    out = store.load(1, allow_pickle=True)
    assert probe.seen == [False] and gc.isenabled()
    assert isinstance(out["p"], _GcProbe)
    with pytest.raises(UnsupportedTypeError):  # a save that fails leaves the collector as it was, too
        store.save({"f": lambda: 0}, step=2)
    assert gc.isenabled()


def test_an_interrupt_anywhere_in_the_collector_pause_leaves_it_as_it_was() -> None:
    """A KeyboardInterrupt as each call inside collector.paused returns (where a Ctrl-C's signal handler runs: a
    save or load starting or ending): the collector is enabled again once nothing is paused. Before, one right
    after gc.disable(), before the pause was counted, left it disabled for the rest of the process (every later
    pause took that for the user's setting)."""
    import sys

    from deltackpt import collector

    code = collector.paused.__wrapped__.__code__  # type: ignore[attr-defined]
    hits = 0
    for n in range(1, 12):
        gc.enable()
        seen = 0

        def interrupt(frame, event, arg, n=n):  # type: ignore[no-untyped-def]
            nonlocal seen, hits
            if event == "c_return" and frame.f_code is code:
                seen += 1
                if seen == n:
                    hits += 1
                    raise KeyboardInterrupt

        sys.setprofile(interrupt)
        try:
            with collector.paused():
                pass
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        assert collector._depth == 0, n
        with collector.paused():
            assert not gc.isenabled()
        assert gc.isenabled(), f"the collector stayed disabled after an interrupt at the return of call {n}"
    assert hits >= 3  # (gc.isenabled, gc.disable, gc.enable: the lock's are not calls)


def test_a_disabled_cyclic_gc_stays_disabled(store: deltackpt.Store, probe: type[_GcProbe]) -> None:
    gc.disable()
    store.save({"w": torch.arange(10.0), "p": probe()}, step=1, allow_pickle=True)
    store.load(1, allow_pickle=True)
    assert not gc.isenabled()


def test_cyclic_gc_resumes_after_the_last_of_overlapping_saves(tmp_path: Path, probe: type[_GcProbe]) -> None:
    gc.enable()
    b_inside, a_inside, b_done = threading.Event(), threading.Event(), threading.Event()
    # b pauses the collector first; a saves meanwhile and, after b returned, looks again
    states = {
        "b": {"p1": probe(lambda: (b_inside.set(), a_inside.wait(30))), "w": torch.arange(1000.0)},
        "a": {"p1": probe(a_inside.set), "p2": probe(lambda: b_done.wait(30)), "w": torch.arange(1000.0)},
    }
    stores = {n: deltackpt.Store(tmp_path / n, chunk_size=SMALL_CHUNK) for n in states}
    errors: list[BaseException] = []

    def save(n: str) -> None:
        try:
            stores[n].save(states[n], step=1, allow_pickle=True)
        except BaseException as exc:
            errors.append(exc)
        finally:
            if n == "b":
                b_done.set()

    probe.seen.clear()
    try:
        threads = [threading.Thread(target=save, args=(n,)) for n in states]
        threads[0].start()
        assert b_inside.wait(30)
        threads[1].start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads)
        assert probe.seen == [False, False, False]  # a's second look came after b returned: still paused
        assert gc.isenabled()
    finally:
        for s in stores.values():
            s.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_save_has_the_cyclic_gc_on(store: deltackpt.Store, probe: type[_GcProbe]) -> None:
    gc.enable()
    children: list[int] = []

    def fork() -> None:
        pid = os.fork()
        if pid == 0:  # the child: the save it was forked in does not go on here
            os._exit(0 if gc.isenabled() else 3)
        children.append(pid)

    store.save({"p": probe(fork)}, step=1, allow_pickle=True)
    (pid,) = children
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class _Node:
    def __init__(self, child: Any = None) -> None:
        self.child = child


class _Scaled(torch.Tensor):
    pass


def test_a_module_metadata_that_holds_its_state_dict_is_a_cycle(store: deltackpt.Store) -> None:
    """An OrderedDict's ``_metadata`` that holds the OrderedDict itself is a container that contains itself:
    refused with UnsupportedTypeError naming the key path, before anything is written (it recursed until
    RecursionError, as ``_metadata`` was flattened with a cycle check of its own that started empty)."""
    od: Any = OrderedDict(w=torch.ones(2))
    od._metadata = {"": {"version": 1, "self": od}}
    with pytest.raises(UnsupportedTypeError, match=r"cannot store model\._metadata.*it contains itself"):
        store.save({"model": od}, step=1)
    od._metadata = od
    with pytest.raises(UnsupportedTypeError, match="it contains itself"):
        store.save({"model": od}, step=1)
    assert store.list() == []


def test_registered_types_fail_with_typed_errors(store: deltackpt.Store) -> None:
    """A registered encoder that returns the object itself (or chains of registered objects past the depth
    limit) is refused like a container that contains itself, naming the key path (before: RecursionError); an
    encoder or decoder that raises is an UnsupportedTypeError naming the type (a decoder's error was reported as
    a corrupt manifest, and a Checkpointer's restore then fell back to an older checkpoint); metadata may not
    hold registered types (every process listing the store would need the decoder)."""
    def decode(v: Any) -> _Node:
        if v == "bad":
            raise ValueError("my decoder refuses this")
        return _Node(v)

    deltackpt.register_type(_Node, "tests.Node", lambda n: n.child, decode)
    try:
        loop = _Node()
        loop.child = loop
        with pytest.raises(UnsupportedTypeError, match=r"model\.graph: it contains itself"):
            store.save({"model": {"graph": loop}}, step=1)
        chain = None
        for _ in range(1000):
            chain = _Node(chain)
        with pytest.raises(UnsupportedTypeError, match="nested more than"):
            store.save({"model": {"graph": chain}}, step=1)
        with pytest.raises(UnsupportedTypeError, match=r"registered types \(found 'tests.Node' at note\)"):
            store.save({"w": torch.ones(1)}, step=1, metadata={"note": _Node(1)})
        assert store.list() == []
        store.save({"n": _Node("bad")}, step=1)
        with pytest.raises(UnsupportedTypeError, match="decoder registered for type 'tests.Node' failed") as exc:
            store.load(1)
        assert not isinstance(exc.value, deltackpt.CorruptionError)
        # the key path of the value, also inside a registered value and in a list
        store.save({"a": {"b": [0, _Node(_Node("bad"))]}}, step=2)
        with pytest.raises(UnsupportedTypeError, match=r"^the decoder registered for type 'tests.Node' failed at "
                           r"'a.b\[1\]': ValueError\('my decoder refuses this'\)$") as exc:
            store.load(2)
        assert isinstance(exc.value.__cause__, ValueError)
    finally:
        deltackpt.unregister_type(_Node)
    with pytest.raises(UnsupportedTypeError, match=r"^the checkpoint holds a value of registered type 'tests.Node' "
                       r"at 'a.b\[1\]'; register its decoder with deltackpt.register_type before loading$"):
        store.load(2)
    deltackpt.register_type(_Node, "tests.Node", lambda n: 1 / 0, decode)
    try:
        with pytest.raises(UnsupportedTypeError, match=r"cannot store a\[0\]: the encoder registered for _Node"):
            store.save({"a": [_Node(1)]}, step=2)
    finally:
        deltackpt.unregister_type(_Node)


def test_register_type_for_a_tensor_subclass(store: deltackpt.Store) -> None:
    """A torch.Tensor subclass is refused, naming register_type; registered, it is saved through its hook
    (before, the tensor check came first and refused it as an unsupported subclass)."""
    w = torch.arange(6.0).as_subclass(_Scaled)
    with pytest.raises(UnsupportedTypeError, match=r"cannot store w: tensor subclass _Scaled \(deltackpt.register_"):
        store.save({"w": w}, step=1)  # (not registered yet)
    deltackpt.register_type(_Scaled, "tests.Scaled", lambda t: t.as_subclass(torch.Tensor).clone(),
                            lambda t: t.as_subclass(_Scaled))
    try:
        store.save({"w": w}, step=1)
        out = store.load(1)["w"]
        assert type(out) is _Scaled and torch.equal(out.as_subclass(torch.Tensor), torch.arange(6.0))
    finally:
        deltackpt.unregister_type(_Scaled)


@pytest.mark.parametrize("how", ["load_into", "into"])
def test_overlapping_targets_are_never_filled_from_two_tensors(store: deltackpt.Store, how: str) -> None:
    """Two target tensors that overlap without being one tensor (``buf[0:6]`` and ``buf[3:9]``): load_into
    refuses before a byte is copied; load(into=) gives the later one memory of its own. Before, both were
    filled and one overwrote part of the other. Interleaved views share no element and are both filled."""
    a, b = torch.arange(6.0), torch.arange(6.0, 12.0)
    store.save({"a": a, "b": b}, step=1)
    buf = torch.zeros(9)
    if how == "load_into":
        with pytest.raises(ShapeMismatchError, match="'a' and 'b' share memory"):
            store.load_into({"a": buf[0:6], "b": buf[3:9]}, step=1)
        assert not buf.any()
    else:
        out = store.load(1, into={"a": buf[0:6], "b": buf[3:9]})
        assert torch.equal(out["a"], a) and torch.equal(out["b"], b)
        assert out["a"].data_ptr() == buf.data_ptr() and torch.equal(buf[:6], a)
    for dtype in (torch.float32, torch.bfloat16):  # (bfloat16: numpy cannot view it as it is)
        store.save({"a": a.to(dtype), "b": b.to(dtype)}, step=2)
        inter = torch.zeros(12, dtype=dtype)
        target = {"a": inter[0::2], "b": inter[1::2]}
        if how == "load_into":
            assert store.load_into(target, step=2) == []
        else:
            store.load(2, into=target)
        assert torch.equal(inter[0::2], a.to(dtype)) and torch.equal(inter[1::2], b.to(dtype))
    # a tensor and its numpy view, saved so: the same bytes go to the same memory twice, which is fine
    t = torch.arange(8.0)
    store.save({"t": t, "n": t.numpy()}, step=3)
    fresh = torch.zeros(8)
    if how == "load_into":
        assert store.load_into({"t": fresh, "n": fresh.numpy()}, step=3) == []
    else:
        store.load(3, into={"t": fresh, "n": fresh.numpy()})
    assert torch.equal(fresh, t)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(views=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.integers(1, 4)), min_size=1, max_size=5))
def test_targets_that_are_random_views_of_one_buffer(store: deltackpt.Store,
                                                     views: list[tuple[int, int, int]]) -> None:
    """Targets are strided slices of one buffer (start, length, step): load_into fills them all when no two share
    an element and else refuses with the buffer untouched; load(into=) returns every tensor's own values either
    way. Before, an overlap was missed when an interleaved view reached further than the one it overlapped."""
    saved = {f"t{i}": torch.arange(n, dtype=torch.float32) + 100 * (i + 1) for i, (_, n, _) in enumerate(views)}
    store.save(saved, step=1)
    buf = torch.zeros(100)
    targets = {f"t{i}": buf[lo : lo + n * stride : stride] for i, (lo, n, stride) in enumerate(views)}
    arrays = [t.numpy() for t in targets.values()]
    overlap = any(np.shares_memory(x, y) for i, x in enumerate(arrays) for y in arrays[i + 1 :])
    if overlap:  # (two equal views are one tensor to the target: "cannot hold both" names that)
        with pytest.raises(ShapeMismatchError, match="share memory|cannot hold both"):
            store.load_into(targets, step=1)
        assert not buf.any()
    else:
        assert store.load_into(targets, step=1) == []
        assert all(torch.equal(targets[k], v) for k, v in saved.items())
    buf.zero_()
    out = store.load(1, into=targets)
    assert all(torch.equal(out[k], v) for k, v in saved.items())
    store.delete(1)


def test_load_into_offered_numpy_arrays(store: deltackpt.Store) -> None:
    """A stored numpy array is decoded into a writable array of the same dtype and shape offered at its place
    (contiguous or a strided view, big-endian too), and the state returns that very array; a read-only one, or
    one of another dtype, is left untouched and the array loads as without ``into``."""
    saved = {"c": np.arange(6, dtype=np.float32), "s": np.arange(4, dtype=np.int64), "be": np.arange(3, dtype=">f8"),
             "ro": np.ones(2), "dt": np.ones(2, dtype=np.float32)}
    store.save(saved, step=1)
    frozen = np.zeros(2)
    frozen.flags.writeable = False
    strided = np.zeros(8, dtype=np.int64)
    into = {"c": np.zeros(6, dtype=np.float32), "s": strided[::2], "be": np.zeros(3, dtype=">f8"), "ro": frozen,
            "dt": np.zeros(2, dtype=np.float64)}
    out = store.load(1, into=into)
    assert_same_state(saved, out)
    assert all(out[k] is into[k] for k in ("c", "s", "be")) and out["ro"] is not frozen and out["dt"] is not into["dt"]
    assert strided.tolist() == [0, 0, 1, 0, 2, 0, 3, 0] and not frozen.any() and not into["dt"].any()


def test_load_into_a_target_holding_values_that_cannot_be_stored(store: deltackpt.Store) -> None:
    """load_into only looks at a target's plain values: a lambda or a lock beside the tensors (a scheduler's
    lr_lambda, a module's state) is fine. Before, the target was flattened with pickling on, so such a value
    raised UnsupportedTypeError ("cannot pickle") and every other one was pickled for nothing."""
    import threading

    store.save({"w": torch.arange(3.0), "f": 1}, step=1)
    target = {"w": torch.zeros(3), "f": lambda x: x, "lock": threading.Lock()}
    assert store.load_into(target, step=1) == []
    assert torch.equal(target["w"], torch.arange(3.0)) and callable(target["f"])


def test_a_target_tied_at_two_places_takes_one_stored_tensor(store: deltackpt.Store) -> None:
    """A target tensor at two places is filled once: fine when the checkpoint holds the same bytes there (a tied
    weight), refused before a byte is written when it holds two different tensors. Before, the second place's
    tensor was silently dropped (``strict`` or not) and the call returned ``[]``."""
    store.save({"a": torch.zeros(4), "b": torch.ones(4), "c": torch.ones(4)}, step=1)
    w = torch.full((4,), 7.0)
    for strict in (True, False):
        with pytest.raises(ShapeMismatchError, match="'b' is the tensor at 'a'"):
            store.load_into({"a": w, "b": w, "c": torch.zeros(4)}, step=1, strict=strict)
        assert torch.equal(w, torch.full((4,), 7.0))
    t = torch.zeros(4)
    assert store.load_into({"a": torch.zeros(4), "b": t, "c": t}, step=1) == []
    assert torch.equal(t, torch.ones(4))


@pytest.mark.parametrize("make", [lambda: torch.empty(3, device="meta"), lambda: torch.zeros(3).to_sparse()])
def test_load_into_a_target_that_cannot_hold_values_is_a_shape_mismatch(store: deltackpt.Store, make: Any) -> None:
    store.save({"a": torch.ones(3)}, step=1)
    with pytest.raises(ShapeMismatchError, match="the target cannot hold the checkpoint's values: a: "):
        store.load_into({"a": make()}, step=1)


@pytest.mark.parametrize("cls", [list, dict, int, float, str, bytes, tuple, set, type(None), bool, torch.Size, "x",
                                 torch.Tensor, torch.nn.Parameter, np.ndarray, torch.dtype, torch.device, np.float32,
                                 np.int64, np.bool_])
def test_register_type_refuses_types_deltackpt_stores_itself(cls: Any) -> None:
    """Their hooks would never be called (the state loaded as the plain value, silently), or, for tensors, arrays,
    dtypes, devices and numpy scalars (checked before the types that hooks may take), would take every value of
    the type away from the store's own encoding: a hook for torch.Tensor wrote every tensor into the manifest."""
    with pytest.raises(TypeError, match="stores itself" if isinstance(cls, type) else "needs a class"):
        deltackpt.register_type(cls, "tests.builtin", lambda x: x, lambda x: x)
    assert "tests.builtin" not in tree._HOOKS_BY_NAME


def test_register_type_names_a_name_of_the_wrong_type() -> None:
    """``register_type(cls, 5, ...)`` raised ValueError("a registered type needs a non-empty name"), which a name of
    5 is not told by; a name that is not a str is a TypeError naming it, an empty one a ValueError."""

    class Thing:
        pass

    for name, error, match in ((5, TypeError, r"register_type\(.*Thing\): name must be a str, got int 5"),
                               (b"x", TypeError, "name must be a str, got bytes"),
                               ("", ValueError, "needs a non-empty name")):
        with pytest.raises(error, match=match):
            deltackpt.register_type(Thing, name, lambda x: 1, lambda x: Thing())  # type: ignore[arg-type]
        assert Thing not in tree._HOOKS_BY_TYPE


def test_quantized_dtypes_as_values_round_trip(store: deltackpt.Store) -> None:
    """A quantized dtype held as a value (a quantization config's) is stored, in a version-3 manifest: it used to
    be saved and then refused by every load as damage, so a Checkpointer holding one could never restore. In
    metadata (which every version reads) it is refused before anything is written."""
    state = {"w": torch.randn(3000), "cfg": {"dtype": torch.qint8, "all": [torch.quint8, torch.qint32,
                                                                            torch.quint4x2, torch.quint2x4]}}
    store.save(state, step=1)
    assert _manifest_version(store, 1) == 3
    out = store.load(1)
    assert out["cfg"] == state["cfg"] and torch.equal(out["w"], state["w"])
    store.save({"cfg": torch.float16}, step=2)
    assert _manifest_version(store, 2) == 1
    with pytest.raises(UnsupportedTypeError, match="quantized dtypes"):
        store.save({"w": torch.ones(3)}, step=3, metadata={"dtype": torch.qint8})
    assert [i.step for i in store.list()] == [1, 2] and store.verify().ok


def test_quantized_dtypes_as_keys_need_version_3(store: deltackpt.Store) -> None:
    """A quantized dtype as a dict key or a set element needs a version-3 manifest as much as one held as a value:
    a reader of versions 1-2 took it for a damaged tensor entry (CorruptManifestError, so a restore passed the
    checkpoint over) instead of refusing a newer format. Manifests that earlier writers marked version 2 for it
    still load."""
    for n, cfg in enumerate([{torch.qint8: "w8"}, {torch.quint8}, frozenset({torch.qint32}),
                             {(torch.qint8, 1): 0}], start=1):
        store.save({"cfg": cfg}, step=n)
        assert _manifest_version(store, n) == 3, cfg
        assert store.load(n)["cfg"] == cfg
    skeleton, _ = tree.flatten({"cfg": {torch.qint8: "w8"}})
    assert tree.format_version(skeleton) == 3
    assert tree.format_version(skeleton, keys=False) == 2  # (what a reader asks of a stored manifest)


def test_module_state_dict_keeps_its_module_versions(store: deltackpt.Store) -> None:
    """A module ``state_dict()``'s ``_metadata`` (each module's version, which ``load_state_dict`` hands to the
    modules' migrations) loads back as ``torch.load`` gives it, from a manifest of version 3; a state without
    one stays readable by version-2 readers, and an OrderedDict without one loads without one."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    sd = model.state_dict()
    info = store.save({"model": sd, "plain": OrderedDict(a=1)}, step=1)
    out = store.load(1)
    assert out["model"]._metadata == sd._metadata and type(out["model"]._metadata) is OrderedDict
    assert not hasattr(out["plain"], "_metadata")
    manifests = store.path / "manifests"
    assert struct.unpack_from("<I", (manifests / f"{info.id}.manifest").read_bytes(), 8)[0] == 3
    other = store.save({"model": OrderedDict(sd)}, step=2)
    assert struct.unpack_from("<I", (manifests / f"{other.id}.manifest").read_bytes(), 8)[0] == 1
    assert not hasattr(store.load(2)["model"], "_metadata")


def test_module_versions_holding_a_tensor_are_refused(store: deltackpt.Store) -> None:
    sd = torch.nn.Linear(3, 2).state_dict()
    sd._metadata[""]["scale"] = torch.ones(2)  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedTypeError, match=r"model: its _metadata attribute holds a tensor .*model\._metadata"):
        store.save({"model": sd}, step=1)
    assert store.list() == []


@pytest.mark.parametrize("node", [
    ["o", [["s", "a"]], [["i", "1"]], ["N"], ["N"]],  # one element too many
    ["o", [["s", "a"]], [["i", "1"]], ["d", [["s", ""]], [["T", 0]]]],  # module versions naming a tensor entry
])
def test_malformed_module_versions_are_damage(node: list[Any]) -> None:
    with pytest.raises(deltackpt.CorruptManifestError, match="malformed state skeleton"):
        tree.check_skeleton(node, [])
