"""The ``deltackpt`` command: inspect and maintain a store from the shell.

Where it sits: a thin layer over :class:`deltackpt.Store` and :mod:`deltackpt.maintenance`; it owns argument
parsing, tables (or JSON with ``--json``), progress bars and exit codes, nothing else. Every subcommand takes the
store directory first.
A checkpoint is named by its step (the newest checkpoint with that step), ``latest``, or its 16-hex id.
On failure it prints one line ``deltackpt: error: ...`` to stderr and exits 1 (2 for usage errors; 130 when
interrupted, 141 when the output pipe closes early).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import errno
import glob
import io
import json
import math
import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import lmdb
import numpy as np

from deltackpt import _lazy, codec, collector, maintenance, manifest, packs, ranks, tree
from deltackpt.checkpointer import _checkpointer_layout, newest_restorable, step_mismatch
from deltackpt.errors import (
    CheckpointNotFoundError,
    CorruptIndexError,
    CorruptionError,
    CorruptManifestError,
    DeltackptError,
    InvalidNameError,
    UnsafeLoadError,
    UnsupportedTypeError,
)
from deltackpt.layout import holds_checkpoints, rank_of_dir, why_readonly
from deltackpt.rng import has_rng
from deltackpt.store import CheckpointInfo, Store, as_saved, check_step

if TYPE_CHECKING:
    import torch
else:
    torch = _lazy.module("torch", globals())


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def when(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def table(rows: Sequence[Sequence[Any]], header: Sequence[str], right: set[int] | None = None) -> str:
    """Aligned columns under ``header`` and a rule; a header of empty names (a two-column listing) prints none."""
    right = right or set()
    titled = any(header)
    cells = ([list(map(str, header))] if titled else []) + [[str(c) for c in r] for r in rows]
    widths = [max([len(r[i]) for r in cells] or [0]) for i in range(len(header))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0 and titled:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


class _Escaped:
    """A text stream (stdout, stderr) that writes what is not printable but newlines and tabs as Python escapes
    (:func:`_escaped`), as ``ls -b`` does: what the CLI prints of a store (keys, values, file names, error
    messages naming them) cannot move the terminal's cursor, recolour it or retitle its window."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write("\n".join(_escaped(line, keep="\t") for line in text.split("\n")))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, ...
        return getattr(self.stream, name)


@contextmanager
def progress(desc: str) -> Iterator[Callable[[int, int], None] | None]:
    """A tqdm bar on a terminal, nothing otherwise."""
    err = _raw_stderr()  # (its \r redraws the bar)
    if not err.isatty():
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="", leave=False, file=err)
    try:

        def update(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        yield update
    finally:
        bar.close()


def _raw_stderr() -> Any:
    """stderr beneath :func:`main`'s escaping wrapper: where progress bars draw."""
    return sys.stderr.stream if isinstance(sys.stderr, _Escaped) else sys.stderr


def _which(arg: str, s: Store) -> dict[str, Any]:
    """The checkpoint a command-line argument names: ``latest``, a step, or a 16-hex-digit id. Sixteen decimal
    digits are the id of a checkpoint of ``s`` when it has one by that id (deltackpt no longer makes such
    ids, but older stores can hold one), else a step."""
    if arg == "latest":
        return {}
    if arg.isascii() and arg.isdigit():
        if len(arg) == 16:
            with contextlib.suppress(CheckpointNotFoundError):
                return {"id": s.info(id=arg).id}
        return {"step": int(arg)}
    try:
        return {"id": manifest.check_id(arg)}
    except InvalidNameError:
        raise InvalidNameError(f"invalid checkpoint {arg!r}: expected a step (a non-negative integer), 'latest' "
                               "or an id (16 lowercase hex digits)") from None


def _open(path: str, *, readonly: bool = False) -> Store:
    """The store at ``path``; ``readonly`` for commands that only read (they then work on a read-only mount and
    never change anything)."""
    if not path:
        raise DeltackptError("the store path is empty")
    p = Path(path)
    if not (p / "STORE").exists():
        if _is_dcp_root(p):
            raise DeltackptError(f"{path} is a sharded (DCP) checkpoint root: 'deltackpt dcp {path}' lists its "
                                 f"steps; its stores are {p / 'meta'} and {p / 'rank-*'} (each rank's shards)")
        if not os.path.lexists(p):  # (a symbolic link loop exists, as a link: the message below names it)
            raise DeltackptError(f"{path} is not a deltackpt store: it does not exist")
        try:
            os.stat(p)
        except OSError as exc:  # (a link to nothing, or a loop of links; else what stat says: EACCES)
            if exc.errno not in (errno.ENOENT, errno.ELOOP):
                raise
            raise DeltackptError(f"{path} is not a deltackpt store: it is a dangling symbolic link (or a loop of "
                                 "them)") from None
        if not p.is_dir():
            raise DeltackptError(f"{path} is not a deltackpt store: it is not a directory")
        if not holds_checkpoints(p):  # (else the store names what is wrong: STORE lost)
            raise DeltackptError(f"{path} is not a deltackpt store (no STORE file)")
    return Store(p, readonly=True if readonly else None)


def cmd_ls(args: argparse.Namespace) -> int:
    with _open(args.store, readonly=True) as s:
        infos = s.list()
        if args.json:
            _print_json([_info_json(i) for i in infos])
            return 0
        rows = [
            (i.step, i.id, when(i.created), human(i.logical_bytes), human(i.written_bytes),
             _meta_str(i.metadata))
            for i in infos
        ]
        print(table(rows, ["step", "id", "created", "logical", "written", "metadata"], right={0, 3, 4}))
    return 0


def _meta_str(meta: Any) -> str:
    if not meta:
        return ""
    if isinstance(meta, dict):
        return " ".join(f"{_short(k)}={_short(v)}" for k, v in meta.items())
    return _short(meta)


def _short(value: Any, limit: int = 80) -> str:
    """A metadata value for a listing: at most ``limit`` characters."""
    try:
        text = tree.int_text(value) if type(value) is int else str(value)
    except ValueError:  # a container holding an int of more digits than Python converts at once
        text = f"<{type(value).__name__}>"
    text = _escaped(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _escaped(text: str, keep: str = "") -> str:
    """``text`` with its unprintable characters but those in ``keep`` (a newline, a terminal escape, a
    right-to-left override), which would break a table or reach the terminal, written as Python escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def _jsonable(value: Any) -> Any:
    """``value`` (plain values as checkpoint metadata holds them) as JSON can hold it: tuples (a ``torch.Size``)
    become lists, numpy scalars Python numbers (a longdouble its nearest float), bytes their hex, a dict key that
    is not a str its ``repr`` (every key of a dict where that repr is also a str key of it: ``{1: .., "1": ..}``
    becomes ``{"1": .., "'1'": ..}``), a float that is not finite the string ``"nan"``, ``"inf"`` or ``"-inf"``,
    and anything else JSON has no kind for (a torch dtype or device) its ``str``."""
    if isinstance(value, np.generic):
        value = value.item()
        if isinstance(value, np.floating):  # (a longdouble, which item() keeps: its nearest float)
            value = float(value)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if np.isfinite(value) else str(value)
    if isinstance(value, dict):
        keys = [k if isinstance(k, str) else repr(k) for k in value]
        if len(set(keys)) < len(keys):  # ({1: .., "1": ..}: every key its repr, which tells them apart)
            keys = [repr(k) for k in value]
        return {k: _jsonable(v) for k, v in zip(keys, value.values())}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    return str(value)


def _print_json(value: Any) -> None:
    """``--json``: one JSON document on stdout (strict JSON: no NaN; ints of any size in full, so Python's limit on
    the digits of an int converted to text, global to the process, is lifted while it is written)."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()  # (0: no limit, or a Python without one)
    if limit:
        sys.set_int_max_str_digits(0)
    try:
        text = json.dumps(_jsonable(value), indent=2, allow_nan=False)
    finally:
        if limit:
            sys.set_int_max_str_digits(limit)
    print(text)


def _info_json(i: CheckpointInfo) -> dict[str, Any]:
    return {"step": i.step, "id": i.id, "created": i.created, "parent": i.parent, "logical_bytes": i.logical_bytes,
            "written_bytes": i.written_bytes, "metadata": i.metadata}


@collector.paused_during  # (as diff, below)
def cmd_show(args: argparse.Namespace) -> int:
    with _open(args.store, readonly=True) as s:
        info = s.info(**_which(args.checkpoint, s))
        m = s.manifest(id=info.id)
        also: dict[int, list[str]] = {}  # further paths of a tensor the state holds twice (tied weights)
        for _, path, i in tree.leaf_refs(m.tree):
            if 0 <= i < len(m.tensors) and path != m.tensors[i].key:
                also.setdefault(i, []).append(path)
        if args.json:
            _print_json({**_info_json(info), "chunk_size": m.chunk_size, "tensors": [
                {"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "logical_bytes": t.nbytes,
                 "written_bytes": t.written, "also_at": also.get(i, [])} for i, t in enumerate(m.tensors)]})
            return 0
        print(f"checkpoint {info.id}  step {info.step}  created {when(info.created)}  parent {info.parent or '-'}")
        if info.metadata:
            print(f"metadata   {_meta_str(info.metadata)}")
        print(f"logical    {human(info.logical_bytes)}   written {human(info.written_bytes)}   "
              f"tensors {len(m.tensors)}   chunk size {human(m.chunk_size)}")
        print()
        rows = [
            (_escaped(t.key) or "<root>", _escaped(t.dtype), "x".join(map(str, t.shape)) or "()", human(t.nbytes),
             human(t.written)) + ((", ".join(map(_escaped, also.get(i, []))),) if also else ())
            for i, t in enumerate(m.tensors)
        ]
        print(table(rows, ["key", "dtype", "shape", "logical", "written"] + (["also at"] if also else []),
                    right={3, 4}))
    return 0


def _tensor_change(ma: manifest.Manifest, a: manifest.TensorEntry, mb: manifest.Manifest,
                   b: manifest.TensorEntry) -> tuple[str, int | None]:
    """(what changed, how many of the tensor's chunks differ: None when its values were not compared) between a
    tensor of ``ma`` and the tensor at the same place in ``mb``; what changed is '' when their bytes and
    attributes are the same."""
    what = [f"{name} {_escaped(str(x))} -> {_escaped(str(y))}" for name, x, y in (
        ("kind", a.kind, b.kind), ("dtype", a.dtype, b.dtype),
        ("shape", "x".join(map(str, a.shape)) or "()", "x".join(map(str, b.shape)) or "()"),
        ("device", a.device, b.device), ("requires_grad", a.requires_grad, b.requires_grad),
        ("parameter", a.parameter, b.parameter)) if x != y]
    if (a.kind, a.dtype, a.shape) != (b.kind, b.dtype, b.shape):  # other values: nothing to compare
        return ", ".join(what), None
    if ma.chunk_size != mb.chunk_size:  # (saved with another chunk size: digests of other byte ranges)
        return ", ".join(["values not compared (chunk sizes differ)", *what]), None
    ra, rb = slice(a.first, a.first + a.count), slice(b.first, b.first + b.count)
    differ = int(((ma.digests[ra] != mb.digests[rb]).any(axis=1) | (ma.flags[ra] != mb.flags[rb])).sum())
    if differ:
        what.insert(0, "values")
    return ", ".join(what), differ


def _tensor_index(m: manifest.Manifest, node: Any) -> int:
    """The index in ``m``'s tensor table that an array leaf node of its skeleton names (refused when none)."""
    i = int(node[1])
    if not 0 <= i < len(m.tensors):
        raise CorruptManifestError(f"checkpoint {m.id}: its skeleton names tensor {i} of {len(m.tensors)}")
    return i


# The collector held off (collector.paused): two manifests' trees, leaves and rows are a few objects per leaf that
# all live until the command returns, so its collections reclaim nothing; with it on they were 27-31% of a diff of
# 10^5-4x10^5 small tensors (4.4 -> 3.3 s and 18.7 -> 14.1 s). The CLI's process is its own: no user's heap waits.
@collector.paused_during
def cmd_diff(args: argparse.Namespace) -> int:
    with _open(args.store, readonly=True) as s:
        infos = [s.info(**_which(arg, s)) for arg in (args.a, args.b)]
        ma, mb = (s.manifest(id=i.id) for i in infos)
    if not args.json:
        for side, i in zip("AB", infos):
            print(f"{side}: checkpoint {i.id}  step {i.step}  created {when(i.created)}")
    leaves = [{place: (path, node) for place, path, node in tree.leaf_nodes(m.tree)} for m in (ma, mb)]
    tensors = [{p: m.tensors[_tensor_index(m, n)] for p, (_, n) in lv.items() if n[0] in ("T", "A")} for m, lv in
               zip((ma, mb), leaves)]
    prefixes = [{place[:i] for place in lv for i in range(len(place) + 1)} for lv in leaves]
    gone: dict[tuple[str, tree.Place], list[int]] = {}  # (added|removed, subtree) -> [row, leaves, tensor bytes]
    rows: list[tuple[str, ...]] = []
    docs: list[dict[str, Any]] = []  # (--json: each row as exact values, in the rows' order)
    counts: Counter[str] = Counter()
    for place in list(leaves[0]) + [p for p in leaves[1] if p not in leaves[0]]:
        a, b = leaves[0].get(place), leaves[1].get(place)
        ta, tb = tensors[0].get(place), tensors[1].get(place)
        either = a if a is not None else b
        assert either is not None  # (the place is a leaf of one side at least)
        path = _escaped(either[0]) or "<root>"
        shown = (_shown(a, ta), _shown(b, tb))
        sides = (_side_json(a, ta), _side_json(b, tb)) if args.json else (None, None)
        if ta is not None and tb is not None:
            what, differ = _tensor_change(ma, ta, mb, tb)
            counts["tensors changed" if what else "tensors the same"] += 1
            if what or args.all:
                rows.append((path, what or "same", f"{differ}/{ta.count}" if differ else "", *shown))
                docs.append(_row_json(either[0], what or "same", *sides,
                                      chunks=None if differ is None else {"differ": differ, "of": ta.count}))
        elif (a is None or b is None) and either[1][0] in _CONTAINER_NAMES \
                and place in prefixes[0 if a is None else 1]:
            continue  # an empty container the other side fills: its entries are the rows
        elif a is None or b is None:
            kind = "added" if a is None else "removed"
            counts[kind] += 1
            # a subtree only one side has is one row: the outermost place the other side lacks
            other = prefixes[0 if a is None else 1]
            root = next((place[:i] for i in range(1, len(place)) if place[:i] not in other), place)
            if (kind, root) not in gone:
                gone[kind, root] = [len(rows), 0, 0]
                rows.append((path, kind, "", *shown))
                docs.append(_row_json(either[0], kind, *sides))
            group = gone[kind, root]
            group[1] += 1
            entry = ta if ta is not None else tb
            group[2] += entry.nbytes if entry is not None else 0
            if group[1] > 1:
                size = f"{group[1]} leaves, {human(group[2])}"
                rows[group[0]] = (_place_path(root), kind, "", "-" if a is None else size, size if a is None else "-")
                subtree = {"leaves": group[1], "bytes": group[2]}
                docs[group[0]] = _row_json(_place_key(root), kind, None if a is None else subtree,
                                           subtree if a is None else None)
        elif a[1] != b[1] and a[1][0] in _CONTAINER_NAMES and b[1][0] in _CONTAINER_NAMES:
            continue  # two empty containers of other types: that is the containers' row below
        elif ta is not None or tb is not None or a[1] != b[1]:
            counts["values changed"] += 1
            kind = "tensor -> value" if ta is not None else "value -> tensor" if tb is not None else "value"
            rows.append((path, kind, "", *shown))
            docs.append(_row_json(either[0], kind, *sides))
        else:
            counts["values the same"] += 1
            if args.all:
                rows.append((path, "same", "", *shown))
                docs.append(_row_json(either[0], "same", *sides))
    kinds = [{place: (path, _container(node)) for place, path, node in tree.container_nodes(m.tree)}
             for m in (ma, mb)]
    for place, (path, ka) in kinds[0].items():  # a tuple that became a list, a deque's maxlen, key 1 become True
        kb = kinds[1].get(place, (path, ka))[1]
        if ka[0] != kb[0] or (ka[2] == kb[2] and ka[1] != kb[1]):  # (keys added or removed are leaves' rows)
            counts["containers changed"] += 1
            what = f"type {ka[0]} -> {kb[0]}" if ka[0] != kb[0] else "dict key types"
            # the keys each side stores and the other does not, as Python shows them (1 on one side, True on the other)
            only = [sorted(dict(k[3])[j] for j in k[1] - o[1]) for k, o in ((ka, kb), (kb, ka))]
            keys = [_escaped(", ".join(o))[:40] if ka[0] == kb[0] else k[0] for o, k in zip(only, (ka, kb))]
            rows.append((_escaped(path) or "<root>", what, "", *keys))
            side_a, side_b = ({"keys": o} if ka[0] == kb[0] else {"type": k[0]} for o, k in zip(only, (ka, kb)))
            docs.append(_row_json(path, what, side_a, side_b))
        elif ka[0] == kb[0] and (order := _common_order(ka[3], kb[3])):  # (loads keep the order)
            counts["containers changed"] += 1
            rows.append((_escaped(path) or "<root>", "dict key order", "",
                         *(_escaped(", ".join(o))[:40] for o in order)))
            docs.append(_row_json(path, "dict key order", {"keys": order[0]}, {"keys": order[1]}))
    differ = sum(n for what, n in counts.items() if not what.endswith("the same"))
    rc = 1 if args.exit_code and differ else 0
    if args.json:
        _print_json({"a": _info_json(infos[0]), "b": _info_json(infos[1]), "changes": docs,
                     "counts": {what.replace(" the ", " ").replace(" ", "_"): counts[what] for what in _DIFF_COUNTS},
                     "differ": bool(differ)})
        return rc
    if rows:
        print()
        print(table(rows, ["key", "change", "chunks", "A", "B"], right={2}))
    print()
    print(", ".join(f"{what}: {n}" for what, n in counts.items() if n) or "both states are empty")
    return rc


#: what ``diff`` counts (its last line; ``--json``'s ``counts``, named with underscores: ``tensors_same``)
_DIFF_COUNTS = ("tensors changed", "tensors the same", "values changed", "values the same", "added", "removed",
                "containers changed")


def _row_json(key: str, change: str, a: Any, b: Any, chunks: dict[str, int] | None = None) -> dict[str, Any]:
    """A row of ``diff``'s table as ``--json`` prints it: the key path as the state holds it ('' for the root),
    what changed, the chunks that differ of those compared (null when the values were not compared: another
    dtype, shape or chunk size, or no tensor on one side), and each side (null when it has nothing there)."""
    return {"key": key, "change": change, "chunks": chunks, "a": a, "b": b}


def _side_json(leaf: tuple[str, Any] | None, t: manifest.TensorEntry | None) -> dict[str, Any] | None:
    """One side of a ``diff --json`` row (what :func:`_shown` shows, exactly): a tensor's ``dtype``, ``shape``
    and ``bytes``; a plain value's ``value`` in full; ``undecoded`` (as ``get`` shows it) for a value not
    decoded here (a pickled one is never unpickled); None when absent."""
    if leaf is None:
        return None
    if t is not None:
        return {"dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes}
    try:
        return {"value": tree.decode_plain(leaf[1])}
    except DeltackptError:
        return {"undecoded": _undecoded(leaf[1])}


_CONTAINER_NAMES = {"d": "dict", "o": "OrderedDict", "C": "Counter", "D": "defaultdict", "l": "list", "t": "tuple",
                    "q": "deque", "x": "registered type"}


def _container(node: Any) -> tuple[str, frozenset[str], frozenset[Any], tuple[tuple[str, str], ...]]:
    """What ``diff`` compares of a container beyond its leaves: its type (with a deque's maxlen, a defaultdict's
    factory, a registered type's name), its dict keys as stored (1 and True are one key to a dict, not one
    state) and as Python compares them, and their order (each as stored, and its ``repr``)."""
    tag = node[0]
    name = _CONTAINER_NAMES.get(tag, tag)
    if tag == "q":
        name = f"deque(maxlen={node[2]})"
    elif tag == "D":
        name = f"defaultdict({node[1]})"
    elif tag == "x":
        name = f"registered type {node[1]}"
    if not tree.is_dict_node(node):
        return name, frozenset(), frozenset(), ()
    stored = [json.dumps(k) for k in tree._dict_parts(node)[0]]
    keys = [k for k, _ in tree.node_children(node)]
    return name, frozenset(stored), frozenset(keys), tuple(zip(stored, map(_repr, keys)))


def _common_order(a: tuple[tuple[str, str], ...], b: tuple[tuple[str, str], ...]) -> tuple[list[str], list[str]] | None:
    """The keys both sides hold, as each orders them (``repr``s), when the orders differ."""
    common = {k for k, _ in a} & {k for k, _ in b}
    order = [[(k, r) for k, r in side if k in common] for side in (a, b)]
    if [k for k, _ in order[0]] == [k for k, _ in order[1]]:
        return None
    return [r for _, r in order[0]], [r for _, r in order[1]]


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except ValueError:  # an int of more digits than Python converts at once (or a container holding one)
        return tree.int_text(value) if type(value) is int else f"<{type(value).__name__}>"


def _place_key(place: tree.Place) -> str:
    """The key path of ``place`` as the state holds it (not escaped; '' for the root)."""
    path = ""
    for kind, key in place:
        if kind in ("k", "i"):
            path = tree.child_path(path, key)
    return path


def _place_path(place: tree.Place) -> str:
    return _place_paths(place)[-1]


def _place_paths(place: tree.Place) -> list[str]:
    """The key paths of ``place`` and of every container it lies in, outermost (``<root>``) first, as listings
    print them (escaped); a path with control characters is also there as it is."""
    paths, path = ["<root>"], ""
    for kind, key in place:
        if kind in ("k", "i"):
            path = tree.child_path(path, key)
            paths.append(_escaped(path) or "<root>")
            if paths[-1] != path and path:
                paths.insert(-1, path)
    return paths


def _shown(leaf: tuple[str, Any] | None, t: manifest.TensorEntry | None) -> str:
    """One side of a ``diff`` row: a tensor's size, a plain value (shortened), or '-' when absent."""
    if leaf is None:
        return "-"
    if t is not None:
        return human(t.nbytes)
    try:
        value = tree.decode_plain(leaf[1])
    except DeltackptError:
        return _undecoded(leaf[1])
    return _short(repr(value) if isinstance(value, (str, bytes)) else value, 40)  # ('1' is not 1, 'None' not None)


def cmd_get(args: argparse.Namespace) -> int:
    key = args.key
    with _open(args.store, readonly=True) as s:
        info = s.info(**_which(args.checkpoint, s))
        m = s.manifest(id=info.id)
        found = [(place, path, node) for place, path, node in tree.leaf_nodes(m.tree) if key in _place_paths(place)]
        places, chosen = [place for place, _, _ in found], [(path, node) for _, path, node in found]
        if not chosen:
            # (the step names it when it is the newest checkpoint of its step; else its id does)
            ref = info.step if s.info(step=info.step).id == info.id else info.id
            raise DeltackptError(f"checkpoint {info.id} (step {info.step}) holds nothing at {key!r} ('deltackpt diff "
                                 f"{args.store} {ref} {ref} --all' lists its key paths)")
        wanted = sorted({_tensor_index(m, node) for _, node in chosen if node[0] in ("T", "A")})
        arrays = dict(zip(wanted, s._read_tensors(info.id, wanted)))
    if args.json:
        # a key path naming one leaf itself: that leaf's object; else (a container, or a path that names several
        # leaves) a list of the leaves' objects under it, as the table's lines (every leaf an object, so that a
        # string, a dict value and a value never unpickled are told apart)
        if len(chosen) == 1 and not _names_a_container(key, places[0]):
            _print_json(_leaf_json(*chosen[0], m, arrays, values=True))
        else:
            _print_json([_leaf_json(p, n, m, arrays, values=len(chosen) == 1) for p, n in chosen])
        return 0
    for path, node in chosen:
        if node[0] in ("T", "A"):
            t, value = m.tensors[int(node[1])], arrays[int(node[1])]
            print(f"{_escaped(path) or '<root>'}: {t.kind} {_escaped(t.dtype)} {'x'.join(map(str, t.shape)) or '()'}"
                  f"{_stats(value)}")
            if len(chosen) == 1:
                try:
                    print(repr(value) if isinstance(value, np.ndarray) else str(value))
                except (RuntimeError, TypeError) as exc:  # (sub-byte dtypes: torch cannot print their values)
                    print(f"(its values cannot be printed: {_first_line(exc)})")
        else:
            print(f"{_escaped(path) or '<root>'}: {_shown((path, node), None) if len(chosen) > 1 else _plain(node)}")
    return 0


def _names_a_container(key: str, place: tree.Place) -> bool:
    """``key`` names a container that the leaf at ``place`` lies in, not the leaf alone: ``<root>`` names the root
    of ``{"": 5}`` as well as its one leaf."""
    steps = [i for i, (kind, _) in enumerate(place) if kind in ("k", "i")]
    return bool(steps) and key in _place_paths(place[:steps[-1]])


def _leaf_json(path: str, node: Any, m: manifest.Manifest, arrays: dict[int, Any], *,
               values: bool) -> dict[str, Any]:
    """A leaf as ``get --json`` prints it: its ``key`` (as the state holds it), and a plain value's ``value`` in
    full (``undecoded`` for one not decoded here, as the table shows it: a pickled one is never unpickled), or a
    tensor's ``kind``, ``dtype``, ``shape``, ``statistics`` (:func:`_statistics`) and, with ``values``, its
    ``values`` as nested lists when the table prints every one (at most torch's and numpy's print threshold, 1000
    elements), else null."""
    if node[0] not in ("T", "A"):
        try:
            return {"key": path, "value": tree.decode_plain(node)}
        except DeltackptError:
            return {"key": path, "undecoded": _undecoded(node)}
    t, value = m.tensors[int(node[1])], arrays[int(node[1])]
    doc: dict[str, Any] = {"key": path, "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape),
                           "statistics": _statistics(value)}
    if values:
        size = value.size if isinstance(value, np.ndarray) else value.numel()
        try:
            doc["values"] = value.tolist() if size <= _PRINT_THRESHOLD else None
        except (RuntimeError, TypeError):  # (sub-byte dtypes: torch cannot convert their values)
            doc["values"] = None
    return doc


#: elements up to which torch and numpy print every value of a tensor (their default print threshold)
_PRINT_THRESHOLD = 1000


def _plain(node: Any) -> str:
    """A plain value of a skeleton in full (escaped), or what kind of node it is when it does not decode."""
    try:
        value = tree.decode_plain(node)
    except DeltackptError:
        return _undecoded(node)
    return _escaped(_repr(value))


def _undecoded(node: Any) -> str:
    """What a listing shows for a plain-value node it does not decode (a pickled value is never unpickled)."""
    return "<pickled, not unpickled here>" if node[0] == "p" else f"<{node[0]}>"


#: elements per block of ``get``'s float statistics: a few MiB of float64 temporaries however large the tensor
_STATS_BLOCK = 1 << 18


def _stats(value: torch.Tensor | Any) -> str:
    """Summary statistics of a tensor or array for ``deltackpt get`` (:func:`_statistics`), as its line shows
    them."""
    size = value.size if isinstance(value, np.ndarray) else value.numel()
    if size == 0:
        return "  (empty)"
    st = _statistics(value)
    if "true" in st:
        return f"  true {st['true']} of {size}"
    tail = f"  non-finite {st['non_finite']}" if st.get("non_finite") else ""
    if "mean" in st:
        return f"  min {st['min']:.6g} max {st['max']:.6g} mean {st['mean']:.6g} std {st['std']:.6g}{tail}"
    if "min" in st:
        return f"  min {tree.int_text(st['min'])} max {tree.int_text(st['max'])}"
    return tail


def _statistics(value: torch.Tensor | Any) -> dict[str, Any]:
    """Summary statistics of a tensor or array for ``deltackpt get``: ``min``, ``max``, ``mean`` and ``std``
    (population: ddof=0) of its finite values and how many are not finite, ``non_finite`` (floats; only that when
    none is finite), ``min`` and ``max`` (integers, exact), how many are ``true`` (bools); none of an empty one,
    or of a dtype with no order (complex) or that torch cannot compute with."""
    if value.size == 0 if isinstance(value, np.ndarray) else value.numel() == 0:
        return {}
    try:
        if not isinstance(value, np.ndarray):  # a tensor (asked this way round, an array's get imports no torch)
            t = value.detach().reshape(-1)
            if t.dtype == torch.bool:
                return {"true": int(t.sum())}
            if t.is_complex():
                return {}
            if not t.is_floating_point():  # (exact: not through float64, which rounds past 2**53)
                try:
                    lo, hi = (int(v) for v in t.aminmax())
                except RuntimeError:  # (not implemented for every dtype: uint64, say)
                    a = t.numpy()
                    lo, hi = int(a.min()), int(a.max())
                return {"min": lo, "max": hi}
            try:
                value = t.numpy()  # (float16, 32, 64: numpy converts the blocks below, no torch call each)
            except TypeError:  # (bfloat16, float8: torch converts them)
                t[:1].double()  # (a dtype torch cannot convert raises here)
                size = t.numel()

                def block(i: int) -> np.ndarray:
                    return t[i:i + _STATS_BLOCK].double().numpy()
        if isinstance(value, np.ndarray):
            a = value.reshape(-1)
            if a.dtype.kind == "b":
                return {"true": int(a.sum())}
            if a.dtype.kind in "iu":
                return {"min": int(a.min()), "max": int(a.max())}
            if a.dtype.kind != "f":
                return {}
            size = a.size

            def block(i: int) -> np.ndarray:
                return a[i:i + _STATS_BLOCK].astype(np.float64)
    except (RuntimeError, TypeError):  # (a dtype torch cannot compute with: sub-byte integers, say)
        return {}
    # Block by block in float64, two passes as numpy's std makes them: whole-array temporaries (the float64 copy,
    # the finite values, std's deviations) took seven times a large tensor's own memory.
    count, total, least, most = 0, 0.0, np.inf, -np.inf
    with np.errstate(over="ignore", invalid="ignore"):  # (a sum that overflows is summed again below)
        for i in range(0, size, _STATS_BLOCK):
            x = block(i)
            x = x[np.isfinite(x)]
            if x.size:
                count, total = count + x.size, total + float(x.sum())
                least, most = min(least, float(x.min())), max(most, float(x.max()))
    if count == 0:
        return {"non_finite": size}
    # Values near float64's largest sum (and square) past it: the sums are then taken of the values over a power
    # of two, which is exact, and leaves every value in (-2, 2); the mean and std of finite values are finite.
    scale = math.ldexp(1.0, math.frexp(max(abs(least), abs(most)))[1] - 1)
    if math.isfinite(total):
        mean = total / count
    else:
        total = 0.0
        for i in range(0, size, _STATS_BLOCK):
            x = block(i)
            total += float((x[np.isfinite(x)] / scale).sum())
        mean = total / count * scale
    squares = 0.0
    for i in range(0, size, _STATS_BLOCK):
        x = block(i)
        x = x[np.isfinite(x)] / scale - mean / scale
        squares += float(np.dot(x, x))
    return {"min": least, "max": most, "mean": mean, "std": float(np.sqrt(squares / count)) * scale,
            "non_finite": size - count}


def cmd_log(args: argparse.Namespace) -> int:
    with _open(args.store, readonly=True) as s:
        infos = s.list()
        by_id = {i.id: i for i in infos}
        first_child: dict[str, str] = {}  # each parent's first child in commit order continues its line
        for i in infos:
            if i.parent is not None:
                first_child.setdefault(i.parent, i.id)
        if args.json:
            _print_json([{**_info_json(i),
                          "parent_step": by_id[i.parent].step if i.parent in by_id else None,
                          "parent_deleted": i.parent is not None and i.parent not in by_id,
                          "branch": i.parent is not None and first_child[i.parent] != i.id} for i in infos])
            return 0
        rows = []
        for i in infos:
            if i.parent is None:
                parent = "-"
            elif i.parent in by_id:
                parent = f"{by_id[i.parent].step} ({i.parent})"
            else:
                parent = f"deleted ({i.parent})"
            mark = "branch" if i.parent is not None and first_child[i.parent] != i.id else ""
            rows.append((i.step, i.id, parent, when(i.created), human(i.written_bytes), mark))
        print(table(rows, ["step", "id", "parent", "created", "written", "lineage"], right={0, 4}))
    return 0


def cmd_du(args: argparse.Namespace) -> int:
    with _open(args.store, readonly=True) as s:
        infos = s.list()
        logical = sum(i.logical_bytes for i in infos)
        unique_raw = frames = 0
        n_chunks = 0
        deltas = [0, 0, 0]  # delta frames: count, raw bytes, frame bytes
        predicted = [0, 0, 0]  # predicted frames: the same
        deepest = 0
        try:  # what gc would keep: chunks of deleted checkpoints are not counted, and gc reclaims their frames
            live: set[bytes] | None = maintenance._live_keys(s, s.index.records(), read_headers=False)[0]
            scope = "what retained checkpoints reach"
        except CorruptIndexError:  # a damaged index page: reading on (every chunk entry) could abort LMDB itself
            raise
        except (DeltackptError, OSError) as exc:  # a damaged manifest: what it names is unknown, count all
            live, scope = None, "every indexed chunk"
            print(f"deltackpt: counting every indexed chunk, as gc could not tell which are live: {_first_line(exc)}",
                  file=sys.stderr)
        for k, loc in s.index.iter_chunks():
            if live is not None and k not in live:
                continue
            raw = int.from_bytes(k[16:], "big")
            unique_raw += raw
            frames += loc.frame_len
            n_chunks += 1
            if loc.codec in codec.BASED:
                row = deltas if loc.codec == codec.DELTA else predicted
                row[0] += 1
                row[1] += raw
                row[2] += loc.frame_len
                deepest = max(deepest, loc.depth)
        pack_sizes = [p.stat().st_size for p in packs.pack_files(s.path / "packs").values()]
        packs_bytes = sum(pack_sizes)
        headers = packs.PACK_HEADER.size * len(pack_sizes)  # (a pack's header is not dead: gc keeps it too)
        man_bytes = sum(p.stat().st_size for p in (s.path / "manifests").glob("*.manifest") if p.is_file())
        on_disk = packs_bytes + man_bytes
        rank_files, rank_bytes = ranks.usage(s.path)
        if args.json:
            _print_json({
                "checkpoints": len(infos), "logical_bytes": logical,
                "chunks_counted": "live" if live is not None else "all",
                "unique_chunk_bytes": unique_raw, "chunks": n_chunks, "stored_frame_bytes": frames,
                "pack_bytes": packs_bytes, "manifest_bytes": man_bytes,
                "delta_frames": {"count": deltas[0], "raw_bytes": deltas[1], "frame_bytes": deltas[2]},
                "predicted_frames": {"count": predicted[0], "raw_bytes": predicted[1], "frame_bytes": predicted[2]},
                "deepest_chain": deepest + 1 if n_chunks else 0,
                "dead_pack_bytes": max(0, packs_bytes - headers - frames),
                "dropped_since_gc_bytes": s.index.dropped_bytes(),
                "rank_rng_files": rank_files, "rank_rng_bytes": rank_bytes,
            })
            return 0
        rows = [
            ("checkpoints", len(infos)),
            ("logical bytes (all checkpoints)", human(logical)),
            (f"unique chunk bytes ({scope})", f"{human(unique_raw)} in {n_chunks} chunks"),
            (f"stored frame bytes ({scope})", human(frames)),
            ("packs + manifests on disk", f"{human(packs_bytes)} + {human(man_bytes)}"),
            ("dedup ratio (logical / unique)", f"{logical / unique_raw:.2f}x" if unique_raw else "-"),
            ("compression ratio (unique / stored)", f"{unique_raw / frames:.2f}x" if frames else "-"),
            ("overall (logical / on disk)", f"{logical / on_disk:.2f}x" if on_disk and logical else "-"),
            ("delta frames (of all chunks)", f"{deltas[0]} of {n_chunks}, {human(deltas[2])} for {human(deltas[1])} raw"
             + (f" ({deltas[1] / deltas[2]:.2f}x)" if deltas[2] else "")),
            ("predicted frames (of all chunks)",
             f"{predicted[0]} of {n_chunks}, {human(predicted[2])} for {human(predicted[1])} raw"
             + (f" ({predicted[1] / predicted[2]:.2f}x)" if predicted[2] else "")),
            ("deepest chain (frames a decode reads, <= max_chain + 1)", str(deepest + 1) if n_chunks else "-"),
            ("dead bytes in packs (what gc --repack-below 1 frees)", human(max(0, packs_bytes - headers - frames))),
            ("written by checkpoints deleted or thinned since the last gc", human(s.index.dropped_bytes())),
        ]
        if rank_files:  # (a data-parallel job's ranks other than 0, Checkpointer(rank=))
            rows.append(("RNG states ranks keep beside the store (rng/)", f"{rank_files} files, {human(rank_bytes)}"))
        print(table(rows, ["", ""]))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with _open(args.store, readonly=True) as s, progress("verify") as bar:
        which = _which(args.checkpoint, s) if args.checkpoint is not None else {}  # ("" is no checkpoint)
        if args.checkpoint == "latest":
            which = {"id": s.info().id}
        report = s.verify(progress=bar, **which)
    if args.json:
        _print_json(_verify_json(report))
        return 0 if report.ok else 1
    for p in report.problems:
        print(p)
    status = "OK" if report.ok else f"{len(report.problems)} problem(s)"
    print(f"verified {report.checkpoints} checkpoint(s), {report.chunks} chunk reference(s): {status}")
    return 0 if report.ok else 1


def _verify_json(report: maintenance.VerifyReport) -> dict[str, Any]:
    """A verify report as ``verify --json`` prints it (and ``dcp --verify --json`` each store's)."""
    return {"ok": report.ok, "checkpoints": report.checkpoints, "chunk_references": report.chunks,
            "problems": [{"checkpoint": p.checkpoint, "step": p.step, "key": p.key, "chunk_id": p.chunk_id,
                          "pack": p.pack, "message": p.message} for p in report.problems]}


def cmd_rm(args: argparse.Namespace) -> int:
    rank_of = _rank_store_of(Path(args.store)) if args.store else None
    with _open(args.store) as s:
        # every argument resolved before anything is deleted: a bad or missing one fails the call, which then
        # deleted nothing (one named twice is deleted once)
        ids = list(dict.fromkeys(s.info(**_which(c, s)).id for c in args.checkpoint))
        if rank_of is not None and not args.force:
            _refuse_named_shards(args.store, *rank_of, s, ids)
        deleted = list(s._delete([(None, i) for i in ids]).values())  # (one commit: all of them or none)
    if args.json:
        _print_json({"deleted": [_info_json(i) for i in deleted]})
        return 0
    for info in deleted:
        print(f"deleted checkpoint {info.id} (step {info.step})")
    print("run 'deltackpt gc' to reclaim space")
    return 0


def _refuse_named_shards(path: str, root: Path, rank: int, store: Any, ids: Sequence[str]) -> None:
    """Refuse deleting checkpoints ``ids`` of ``store``, rank ``rank``'s store of the sharded (DCP) root ``root``,
    that a step of the root names (that step would no longer load); also when a step cannot be read, as it may
    name them. ``deltackpt rm --force`` deletes them all the same."""
    from deltackpt import distributed

    steps, unreadable = distributed._named_steps(root)
    if unreadable:
        info, exc = unreadable[0]
        raise DeltackptError(f"{distributed._unreadable(info, exc)}; it may name checkpoints of {path} (rank "
                             f"{rank}'s shards), so nothing was deleted ('deltackpt dcp {root} --rm {info.step}' "
                             "deletes that step; --force deletes the checkpoints all the same)")
    naming: dict[str, list[int]] = {}  # rank checkpoint id -> the steps that name it
    for info, named in steps:
        for r, ckpt in named:
            if r == rank:
                naming.setdefault(ckpt, []).append(info.step)
    store._refresh()
    moved = store._moved()  # (a checkpoint that a rewrite replaced is named by its old id: the new one is too)
    for old, new in moved.items():
        if old in naming:
            naming.setdefault(new, []).extend(naming[old])
    hit = [i for i in ids if i in naming]
    if hit:
        which = "; ".join(f"checkpoint {i} by step {', '.join(map(str, sorted(set(naming[i]))))}" for i in hit[:3])
        raise DeltackptError(f"{path} holds rank {rank}'s shards of the sharded (DCP) root {root}, and steps of the "
                             f"root name what this would delete ({which}{' ...' if len(hit) > 3 else ''}): those "
                             f"steps would no longer load, so nothing was deleted. 'deltackpt dcp {root} --rm STEP' "
                             "deletes a step with its shards; --force deletes the checkpoints all the same")


def cmd_gc(args: argparse.Namespace) -> int:
    if not 0 <= args.repack_below <= 1:  # (before the store is opened; nan too)
        raise ValueError(f"--repack-below must be a fraction between 0 and 1, got {args.repack_below}")
    with _open(args.store) as s, progress("gc") as bar:
        r = s.gc(repack_below=args.repack_below, progress=bar)
    if args.json:  # (the exit status as without --json: 1 when repacking stopped or met damage)
        _print_json(dataclasses.asdict(r))
        return 1 if r.failed else 0
    print(f"dropped {r.dead_chunks} dead chunk(s); deleted {r.deleted_packs} pack(s) ({r.repacked_packs} of them "
          f"repacked: {r.moved_chunks} live chunk(s) moved); removed {r.orphan_manifests} orphan manifest(s); "
          f"freed {human(r.freed_bytes)}")
    return _gc_problems(r, "", "deltackpt verify")


def _gc_problems(r: maintenance.GcReport, where: str, verify: str) -> int:
    """Report what a gc left alone and why (``where``: the store it ran on, as a prefix); its exit status: 1 when
    repacking stopped or met a damaged live frame, or a pack is missing (``verify``: the command that lists the
    damage)."""
    if r.skipped_active_packs:
        print(f"{where}{r.skipped_active_packs} pack(s) still being written by another process were left alone")
    for damage in r.damaged_packs:
        print(f"deltackpt: {where}not repacked, a live frame is damaged: {damage}; run '{verify}'", file=sys.stderr)
    for pack_id in r.missing_packs:
        print(f"deltackpt: {where}pack {pack_id} is missing, and retained checkpoints need chunks in it; run "
              f"'{verify}'", file=sys.stderr)
    if r.repack_stopped:
        print(f"deltackpt: {where}repacking stopped: {r.repack_stopped}", file=sys.stderr)
    return 1 if r.failed else 0


#: a duration (a negative one is well-formed: Retention refuses it as out of range, status 1)
_DURATION = re.compile(r"(-?(?:\d+(?:\.\d*)?|\.\d+))([smhdw]?)")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _duration(text: str) -> float:
    """Seconds of ``90``, ``90s``, ``15m``, ``12h``, ``7d`` or ``2w`` (an argparse type)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (seconds, or a number with s, m, h, d or w)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def _best(text: str) -> tuple[str, str]:
    """``METRIC:min`` or ``METRIC:max`` (an argparse type)."""
    metric, sep, how = text.rpartition(":")
    if not sep or not metric or how not in ("min", "max"):
        raise argparse.ArgumentTypeError(f"expected METRIC:min or METRIC:max, got {text!r}")
    return metric, how


#: Retention's fields, as `deltackpt keep` names them
_POLICY_FLAGS = {"keep_last": "--last", "keep_every": "--every", "keep_within": "--within", "keep_best": "--best",
                 "best_k": "--best-k"}


def cmd_keep(args: argparse.Namespace) -> int:
    from deltackpt.retention import Retention

    if args.best_k is not None and args.best is None:
        raise ValueError("--best-k needs --best METRIC:min|max to rank by")
    try:
        policy = Retention(keep_last=args.last, keep_every=args.every, keep_within=args.within, keep_best=args.best,
                           best_k=1 if args.best_k is None else args.best_k, keep_tagged=not args.no_tagged)
    except (TypeError, ValueError) as exc:  # (named by the flags given, not by Retention's fields)
        message = str(exc)
        for field, flag in _POLICY_FLAGS.items():
            message = message.replace(f"Retention.{field}", flag)
        raise type(exc)(message) from None
    if not policy.deletes_anything:
        raise ValueError("give a rule that deletes: --last, --every, --within or --best (the others only keep)")
    verb = "would delete" if args.dry_run else "deleted"
    root = Path(args.store)
    if args.store and (parent := _dcp_root_of(root)) is not None:
        raise DeltackptError(f"{args.store} is a store of the sharded (DCP) root {parent}: thinning it alone would "
                             f"break the steps that name its checkpoints; 'deltackpt keep {parent}' thins the "
                             "root's steps")
    dcp = _is_dcp_root(root)
    if dcp:  # its steps
        from deltackpt import distributed

        # the steps, with the metadata their writers were given (from the meta store alone: no rank store opened)
        with distributed._meta_store(root, readonly=True) as meta:
            listed = [replace(i, metadata=distributed._user_metadata(i.metadata)) for i in meta.list()]
        _check_metric(policy, listed)
        total = len(listed)
        dropped = distributed.retain(root, policy, dry_run=args.dry_run)
        deleted = [{"step": i.step, "id": i.id, "committed": i.created, "metadata": i.metadata} for i in dropped]
        if not args.json:
            for info in dropped:
                print(f"{verb} step {info.step} (committed {when(info.created)}) {_meta_str(info.metadata)}".rstrip())
            print(f"{verb} {len(dropped)} of {total} step(s)")
        stores = distributed.stores(root)
        verify, gc = f"deltackpt dcp {root} --verify", f"deltackpt dcp {root} --gc"
    else:
        with _open(args.store, readonly=args.dry_run) as s:
            infos = s.list()
            _check_metric(policy, infos)
            total = len(infos)
            dropped = s.retain(policy, dry_run=args.dry_run)
        deleted = [_info_json(i) for i in dropped]
        if not args.json:
            for info in dropped:
                print(f"{verb} checkpoint {info.id} (step {info.step}) {_meta_str(info.metadata)}".rstrip())
            print(f"{verb} {len(dropped)} of {total} checkpoint(s)")
        stores, verify, gc = [Path(args.store)], "deltackpt verify", "deltackpt gc"
    if args.json:  # (the exit status as without --json: 1 when a gc's repacking stopped or met damage)
        reports: list[dict[str, Any]] | None = [] if args.gc and not args.dry_run else None
        doc = {"dry_run": args.dry_run, "dcp_root": dcp, "deleted": deleted, "total": total, "gc": reports,
               "error": None}
        with _json_even_on_error(doc):  # (the deletes are committed whatever the gc does)
            rc = _gc_stores(stores, verify, reports) if reports is not None else 0
        return rc
    if args.gc and not args.dry_run:
        return _gc_stores(stores, verify)
    if dropped and not args.dry_run:
        print(f"run '{gc}' (or this command with --gc) to reclaim space")
    return 0


@contextmanager
def _json_even_on_error(doc: dict[str, Any]) -> Iterator[None]:
    """Print ``doc`` (``--json``) when the body returns, and also when it raises: then with the error's first line
    as ``error``, before the error goes on to main (which prints it and exits 1), so that a script reads what the
    command did before it failed (checkpoints deleted, then a gc that failed)."""
    try:
        yield
    except Exception as exc:
        doc["error"] = _first_line(exc)
        _print_json(doc)
        raise
    _print_json(doc)


def _is_dcp_root(path: Path) -> bool:
    """Whether ``path`` is a sharded (DCP) root: its meta store, and no store of its own. (Asked here, not of
    :mod:`deltackpt.distributed`, whose import brings torch.distributed.checkpoint.)"""
    return not (path / "STORE").exists() and (path / "meta" / "STORE").exists()


def _dcp_root_of(path: Path) -> Path | None:
    """The sharded (DCP) root whose ``meta`` or ``rank-NNNNN`` store ``path`` is, else None."""
    member = _root_member(path)
    return None if member is None else member[0]


def _root_member(path: Path) -> tuple[Path, str] | None:
    """(the sharded (DCP) root, the name there) when ``path`` is the root's ``meta`` or ``rank-NNNNN`` store: by
    its real path, or by the path as given (the root's ``rank-00001`` a symbolic link to a store elsewhere, which
    the root's writer and loads go through all the same), else None."""
    # (not Path.resolve(): a symbolic link loop is the store open's to name)
    for where in (Path(os.path.realpath(path)), Path(os.path.abspath(path))):
        if (where.parent / "meta" / "STORE").exists() and (where.name == "meta" or
                                                            rank_of_dir(where.name) is not None):
            return where.parent, where.name
    return None


def _rank_store_of(path: Path) -> tuple[Path, int] | None:
    """(the sharded root, the rank) when ``path`` is a rank's store of a sharded (DCP) root, else None."""
    member = _root_member(path)
    rank = None if member is None else rank_of_dir(member[1])
    return None if member is None or rank is None else (member[0], rank)


def _check_metric(policy: Any, infos: Sequence[Any]) -> None:
    """Refuse ``--best METRIC`` when no checkpoint records METRIC: a misspelt name would otherwise delete every
    checkpoint the other rules do not keep, the best one included."""
    from deltackpt.retention import unranked_metric

    missing = unranked_metric(policy, infos)
    if missing is not None and infos:
        metric, found = missing
        recorded = f"numbers they record: {', '.join(map(repr, found))}" if found else "they record no numbers"
        raise DeltackptError(f"--best {metric}: no checkpoint records {metric!r} as a number ({recorded}); "
                             "nothing deleted")


def _gc_stores(stores: Sequence[Path], verify: str, reports: list[dict[str, Any]] | None = None) -> int:
    """gc each store, printing what each freed (or, given ``reports``, putting there each store's ``store`` name
    and the fields of its report, and printing nothing: ``--json``); the worst exit status of
    :func:`_gc_problems`."""
    rc = 0
    for path in stores:
        with Store(path) as s:
            r = s.gc()
        name = path.name or str(path)  # (a DCP root's meta, rank-00000, ...; '.' for the store in the directory)
        if reports is not None:
            reports.append({"store": name, **dataclasses.asdict(r)})
            rc = max(rc, 1 if r.failed else 0)
            continue
        print(f"gc {name}: freed {human(r.freed_bytes)}")
        rc = max(rc, _gc_problems(r, f"{name}: ", verify))
    return rc


def cmd_dcp(args: argparse.Namespace) -> int:
    from deltackpt import distributed  # imports torch.distributed.checkpoint: only for this command

    root = Path(args.store)
    distributed.check_dir(root)  # (not "no deltackpt store" as for a directory without one, or a bare [Errno 2])
    if (root / "STORE").exists():
        raise DeltackptError(f"{root} is a deltackpt store, not a sharded (DCP) checkpoint root: 'deltackpt ls "
                             f"{root}' lists its checkpoints")
    if args.rm:
        missing = sorted(set(args.rm) - set(distributed.steps(root)))
        if missing:  # refused before any step is deleted
            raise DeltackptError(f"{root} has no DCP checkpoint of step {', '.join(map(str, missing))}")
    doc: dict[str, Any] = {"deleted_steps": [], "pruned": None, "gc": None, "verify": None, "steps": None,
                           "unreadable": None, "missing_ranks": None, "unheld": None, "error": None}  # (--json)
    # (with --json, what the options did is printed even when one fails: steps deleted, then a failed gc)
    with _json_even_on_error(doc) if args.json else contextlib.nullcontext():
        return _dcp(args, root, doc)


def _dcp(args: argparse.Namespace, root: Path, doc: dict[str, Any]) -> int:
    """``deltackpt dcp``'s work once its arguments are checked (``doc``: the ``--json`` document it fills)."""
    from deltackpt import distributed

    for step in dict.fromkeys(args.rm):
        distributed.delete(root, step)
        doc["deleted_steps"].append(step)
        if not args.json:
            print(f"deleted DCP checkpoint of step {step}")
    if args.prune:
        doc["pruned"] = distributed.prune(root)
        if not args.json:
            print(f"pruned {doc['pruned']} rank checkpoint(s) no step names")
    rc = 0
    stores = distributed.stores(root)
    if args.gc:
        doc["gc"] = [] if args.json else None
        rc = _gc_stores(stores, f"deltackpt dcp {root} --verify", doc["gc"])
    if args.verify:
        doc["verify"] = {"stores": [], "steps": []}
        for path in stores:
            with Store(path) as s, progress(f"verify {path.name}") as bar:
                report = s.verify(progress=bar)
            doc["verify"]["stores"].append({"store": path.name, **_verify_json(report)})
            if not args.json:
                for problem in report.problems:
                    print(f"{path.name}: {problem}")
                print(f"verify {path.name}: {report.checkpoints} checkpoint(s), "
                      f"{'OK' if report.ok else f'{len(report.problems)} problem(s)'}")
            rc = rc if report.ok else 1
        names = doc["verify"]["steps"] = distributed.verify_names(root)
        if not args.json:
            for line in names:
                print(line)
            print(f"verify steps: {'OK' if not names else f'{len(names)} problem(s)'}")
        rc = rc if not names else 1
    # (a step whose meta checkpoint is damaged is listed apart, and one that names a rank checkpoint no store holds)
    steps, unreadable, unheld = distributed._summary(root)
    if args.json:  # (printed by cmd_dcp)
        doc["steps"] = [
            {"step": i.step, "id": i.id, "committed": i.created, "ranks": i.ranks, "logical_bytes": i.logical_bytes,
             "written_bytes": i.written_bytes, "metadata": i.metadata} for i in steps]
        doc["unreadable"] = [{"step": info.step, "id": info.id, "message": distributed._unreadable(info, exc)}
                             for info, exc in unreadable]
        doc["missing_ranks"] = distributed.missing_stores(root)
        doc["unheld"] = unheld
        return rc if not unreadable else 1
    rows: list[tuple[Any, ...]] = [(i.step, i.id, when(i.created), i.ranks, human(i.logical_bytes),
                                    human(i.written_bytes)) for i in steps]
    head = ["step", "id", "committed", "ranks", "logical", "written"]
    if any(i.metadata for i in steps):  # what the writer was given per step (a loss, a tag), as ls shows it
        rows = [(*row, _meta_str(i.metadata)) for row, i in zip(rows, steps)]
        head.append("metadata")
    print(table(rows, head, right={0, 3, 4, 5}))
    for info, exc in unreadable:  # (--verify named them too: verify_names)
        print(distributed._unreadable(info, exc))
    if not args.verify:  # (--verify named them: verify_names)
        for line in unheld:
            print(line)
    which = "listed above" if args.verify else "--verify lists them"
    for rank in distributed.missing_stores(root):
        print(f"rank {rank}'s store is gone: the steps that name its checkpoints cannot load ({which})")
    return rc if not unreadable else 1


def cmd_repair(args: argparse.Namespace) -> int:
    if not args.store:  # (it named the current directory: "." is not a store, or repaired the one it is)
        raise DeltackptError("the store path is empty")
    root = Path(args.store)
    if _is_dcp_root(root):
        raise DeltackptError(f"{args.store} is a sharded (DCP) checkpoint root: repair its stores one by one, "
                             f"'deltackpt repair {root / 'meta'}' and each of {root / 'rank-*'}")
    store = maintenance.open_for_repair(args.store)
    with store as s, progress("repair") as bar:
        r = s.repair(progress=bar)
    if args.json:  # (the exit status as without --json: 1 when anything was passed over)
        _print_json(dataclasses.asdict(r))
        return 0 if not (r.lost_checkpoints or r.incomplete_checkpoints or r.damaged_packs) else 1
    print(f"indexed {r.chunks} chunk(s) from {r.packs} pack(s); {r.checkpoints} checkpoint(s) restored")
    for p in r.damaged_packs:
        print(f"pack {p} is damaged: its intact frames were indexed, the damaged ones skipped")
    for c in r.lost_checkpoints:
        print(f"checkpoint {c} could not be restored (its manifest is damaged)")
    for c in r.incomplete_checkpoints:
        print(f"checkpoint {c} is restored but incomplete: chunks it names are damaged or gone ('deltackpt verify' "
              "lists them; 'deltackpt rm' it to let gc free the rest)")
    return 0 if not (r.lost_checkpoints or r.incomplete_checkpoints or r.damaged_packs) else 1


def _tensor_dict(state: Any) -> dict[str, torch.Tensor]:
    """Flatten a tree whose leaves are all tensors into {dotted key path: tensor} for safetensors."""
    skeleton, leaves = tree.flatten(state)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for path, idx in _tensor_leaves(skeleton):
        t = leaves[idx].obj
        assert isinstance(t, torch.Tensor)
        t = t.detach().contiguous()
        if path in out:
            raise DeltackptError(
                f"two tensors would both be named {path!r} in the safetensors file (keys that differ only in "
                "'.' nesting or int/str type): export .pt instead"
            )
        out[path] = t.clone() if idx in seen else t  # safetensors refuses shared tensors
        seen.add(idx)
    return out


def _tensor_leaves(skeleton: Any, at: str = "") -> list[tuple[str, int]]:
    """(safetensors name, leaf index) of each tensor of ``skeleton`` (a state's, as :func:`tree.flatten` returns
    it and a manifest holds it); raises where it holds anything else, or a key that names no tensor faithfully.
    ``at``: the key path of ``skeleton`` in its checkpoint (``export --key``), which errors name paths under."""
    found: list[tuple[str, int]] = []
    plain: list[str] = []

    def walk(node: Any, name: str, path: str) -> None:  # (name: the safetensors name; path: the key path)
        tag = node[0]
        if tree.is_dict_node(node) or tree.is_sequence_node(node):
            for k, v in tree.node_children(node):
                where = tree.child_path(path, k)
                if type(k) not in (str, int):  # (safetensors names tensors by text: no faithful name for it)
                    raise DeltackptError(f"safetensors names tensors by text keys; {where} has a "
                                         f"{type(k).__name__} key: export .pt instead")
                walk(v, f"{name}.{k}" if name else str(k), where)
        elif tag == "T":
            found.append((name, node[1]))
        else:
            plain.append(path or "<root>")  # (named as get and show name it)

    walk(skeleton, "", at)
    if plain:
        raise DeltackptError(
            f"safetensors holds tensors only; this checkpoint also holds other values at {plain[:3]}: export .pt"
            + (", or a subtree of tensors only with --key (--key model)" if not at else "")
        )
    return found


def _subtree(m: manifest.Manifest, key: str, store: str) -> tuple[str, Any]:
    """The key path and node of ``m``'s skeleton at key path ``key`` (as show, diff and get print paths, control
    characters escaped or not; ``<root>`` for all), or
    :class:`DeltackptError` naming the checkpoint when it holds nothing there, or more than one thing (key paths
    need not be distinct: ``{"a.b": x, "a": {"b": y}}``)."""
    if key == "<root>":
        return "", m.tree  # (its key path: a tensor alone is named by it, as by an export without --key)
    # (an empty container is listed as a container and as a leaf; a registered type's value has its key path)
    at = {place: (path, node) for place, path, node in tree.container_nodes(m.tree) + tree.leaf_nodes(m.tree)
          if key in (path, _escaped(path))}
    found = [v for place, v in at.items() if not any(place[:len(p)] == p for p in at if len(p) < len(place))]
    if len(found) > 1:
        raise DeltackptError(f"checkpoint {m.id} (step {m.step}) holds {len(found)} values at {key!r} (keys such as "
                             "'a.b' and 'a' holding 'b' have one key path): export the whole checkpoint to .pt, or "
                             "Store.load it in Python")
    if found:
        return found[0]
    raise DeltackptError(f"checkpoint {m.id} (step {m.step}) holds nothing at {key!r} ('deltackpt diff {store} "
                         f"{m.id} {m.id} --all' lists its key paths)")


def _unwritable_dtypes(m: manifest.Manifest, write: Callable[[Any], Any], fmt: str, other: str,
                       indices: set[int] | None = None) -> None:
    """Raise, naming the key path, where ``m`` holds a torch tensor of a dtype that ``write`` (the export's writer,
    given ``{"x": <empty tensor>}``) cannot write: torch.save has no encoding for the sub-byte integers (int1-int7,
    uint1-uint7), safetensors neither for those nor for complex32, complex128, the bits types, ... Each dtype is
    tried once, on an empty tensor, before the checkpoint is loaded; before, a whole checkpoint was loaded and
    then refused with the writer's bare words (``cannot write out.safetensors: torch.bits16``). ``indices``: only
    those tensors of the table (an export of a subtree)."""
    verdict: dict[str, bool] = {}
    for n, t in enumerate(m.tensors):
        if t.kind != "torch" or (indices is not None and n not in indices):
            continue
        if t.dtype not in verdict:
            try:
                write({"x": torch.empty(0, dtype=tree.torch_dtype(t.dtype))})
                verdict[t.dtype] = True
            except Exception:  # (torch raises a KeyError, safetensors a KeyError or its own error)
                verdict[t.dtype] = False
        if not verdict[t.dtype]:
            raise DeltackptError(f"{fmt} cannot hold {t.key or '<root>'} ({t.dtype} tensor): {other}")


def cmd_export(args: argparse.Namespace) -> int:
    dest = Path(args.file)
    # the destination is checked before the checkpoint is read (a load of a big one takes minutes)
    if dest.suffix not in (".safetensors", ".pt", ".pth"):
        raise DeltackptError(f"cannot export to {args.file}: use a .pt or .safetensors file name")
    if dest.is_dir() or args.file.endswith(os.sep):  # (Path drops a trailing /, which names a directory)
        raise DeltackptError(f"cannot export to {args.file}: it is a directory")
    parent = Path(os.path.realpath(dest)).parent
    if not parent.is_dir():  # (checked here: the writers' own messages call a file "a missing directory")
        what = "is not a directory" if parent.exists() else "does not exist"
        raise DeltackptError(f"cannot export to {dest}: {parent} {what}")
    if not dest.exists() or Path(os.path.realpath(dest)).is_file():  # (a regular file: written beside it)
        why = why_readonly(parent)
        if why is None and not os.access(parent, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
            why = "not writable by this user"
        if why is not None:  # (torch's own words for it: "[enforce fail at inline_container.cc:...] ...")
            raise DeltackptError(f"cannot export to {dest}: {parent} is {why}")
    if dest.suffix == ".safetensors":
        try:
            from safetensors.torch import save as save_file_bytes
            from safetensors.torch import save_file
        except ImportError:
            raise DeltackptError("exporting .safetensors needs the 'safetensors' package") from None
    with _open(args.store, readonly=True) as s:
        which = _which(args.checkpoint, s)
        m = s.manifest(**which)
        at, node = ("", m.tree) if args.key is None else _subtree(m, args.key, args.store)
        indices = {i for _, _, i in tree.leaf_refs(node)}
        pickled = tree.pickled_paths(node)  # (key paths within the subtree exported)
        if pickled:
            under = "" if args.key is None else f" under {args.key!r}"
            raise UnsafeLoadError(f"checkpoint {m.id} holds pickled values (saved with allow_pickle=True){under} at "
                                  f"{', '.join(map(repr, pickled[:3]))}{' ...' if len(pickled) > 3 else ''}, which "
                                  "export never unpickles; if you trust the store, Store.load(..., allow_pickle=True) "
                                  "them in Python")
        # (a state safetensors cannot hold is refused from the manifest's skeleton, before the load: a checkpoint
        # of 10^5 plain values was loaded whole first, 3.7 s; the loaded state is checked again)
        if dest.suffix == ".safetensors":
            if node[0] != "T":  # (a tensor alone is named by its key path)
                _tensor_leaves(node, at)
            _unwritable_dtypes(m, save_file_bytes, "safetensors",
                               "export .pt, or convert the tensor (Store.load it in Python)", indices)
        else:
            _unwritable_dtypes(m, lambda obj: torch.save(obj, io.BytesIO()), "torch.save (.pt)",
                               "Store.load the checkpoint in Python, or convert the tensor before saving", indices)
        if args.key is None:
            state = s.load(id=m.id, map_location="cpu")
        else:  # only the subtree's chunks are read
            wanted = sorted(indices)
            objs: list[Any] = [None] * len(m.tensors)
            for i, value in zip(wanted, s._read_tensors(m.id, wanted)):
                objs[i] = as_saved(m.tensors[i], value)
            state = tree.unflatten(node, objs)
    # (a destination that is not a regular file, a named pipe or a device, is written through a file object:
    # torch.save given its path checks positions a pipe does not have, and safetensors' save_file puts a regular
    # file in its place)
    if dest.suffix == ".safetensors":
        tensors = _tensor_dict(state if not isinstance(state, torch.Tensor) else {at: state})

        def write(path: Path, direct: bool) -> None:
            if direct:
                with open(path, "wb") as f:
                    f.write(save_file_bytes(tensors))
            else:
                save_file(tensors, str(path))
    else:
        def write(path: Path, direct: bool) -> None:
            if direct:
                with open(path, "wb") as f:
                    sink = _Sink(f)
                    try:
                        torch.save(state, cast(IO[bytes], sink))  # (it writes and flushes only)
                    except RuntimeError:
                        # (torch's writer turns the pipe's own error, a reader gone, into 'unexpected pos')
                        if sink.error is not None:
                            raise sink.error from None
                        raise
            else:
                torch.save(state, path)
    real = Path(os.path.realpath(dest))  # (through a symlink, the file it names is written)
    # a regular file is written next to the destination and renamed over it, so a failed export leaves no
    # partial file; anything else (a pipe, a device) is written directly
    tmp = None
    if not real.exists() or real.is_file():
        host = re.sub(r"[^A-Za-z0-9-]", "_", os.uname().nodename)
        _remove_killed_exports(real, host)
        tmp = _export_tmp(real, host, os.getpid())
    try:
        write(tmp or real, tmp is None)
        if tmp is not None:  # durable before it takes the place of an earlier export (a power loss keeps one)
            # (the mode any new file gets from the umask, as torch.save's: safetensors creates its files 0600)
            os.chmod(tmp, 0o666 & ~_umask())
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, real)
            packs.fsync_dir(real.parent)
    except Exception as exc:  # safetensors raises its own SafetensorError, torch a RuntimeError
        if tmp is not None:
            with contextlib.suppress(OSError):  # (best effort: the write's own error is what is reported)
                tmp.unlink(missing_ok=True)
        raise DeltackptError(f"cannot write {dest}: {_first_line(exc)}") from None
    if args.json:  # (bytes: null for a destination that is not a regular file, a pipe)
        _print_json({"id": m.id, "step": m.step, "key": args.key, "file": str(dest),
                     "bytes": real.stat().st_size if real.is_file() else None})
        return 0
    size = f" ({human(real.stat().st_size)})" if real.is_file() else ""
    what = "" if args.key is None else f"{args.key!r} of "
    print(f"exported {what}checkpoint {m.id} (step {m.step}) to {dest}{size}")  # (not "latest", or a step saved twice)
    return 0


class _Sink:
    """A file for torch.save that keeps the error its writes raised (torch reports a short write only)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _umask() -> int:
    """This process's umask (read from /proc where it can be, which changes nothing; else set and set back)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: the longest file name: Linux's and macOS's file systems (ext4, xfs, btrfs, tmpfs, APFS) take 255 bytes
_NAME_MAX = 255
#: digits kept for a process id in an export's temporary name (pid_max is at most 2**22 on Linux)
_PID_DIGITS = 10


def _export_tmp_stem(real: Path, host: str) -> str:
    """``.NAME.HOST.`` of the temporary files that exports to ``real`` write beside it, NAME cut short (by bytes,
    as the file system counts them) where the whole name, with a process id and ``.tmp`` after it, would pass the
    file system's limit: a destination whose name is near that limit is a valid name."""
    name = os.fsencode(real.name)
    room = _NAME_MAX - len(os.fsencode(f"..{host}..tmp")) - _PID_DIGITS
    return f".{os.fsdecode(name[:max(room, 1)])}.{host}."


def _export_tmp(real: Path, host: str, pid: int) -> Path:
    """The temporary file that process ``pid`` of ``host`` writes an export to ``real`` into, beside it."""
    return real.with_name(f"{_export_tmp_stem(real, host)}{pid}.tmp")


def _remove_killed_exports(real: Path, host: str) -> None:
    """Remove what exports to ``real`` killed while writing left next to it: the temporary files of this host's
    processes that are gone (``.NAME.HOST.PID.tmp``; another host's, or a live process's, are left alone)."""
    stem = _export_tmp_stem(real, host)
    for leftover in real.parent.glob(f"{glob.escape(stem)}*.tmp"):
        pid = leftover.name[len(stem):-4]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # (gone; PermissionError: another user's live process)
            with contextlib.suppress(OSError):
                leftover.unlink()
        except (OSError, OverflowError):
            continue


def cmd_import(args: argparse.Namespace) -> int:
    src = Path(args.file)
    if not src.is_file():  # (before a reader's words for it: an unpickler's, a format's)
        raise DeltackptError(f"{src} {'is not a file' if src.exists() else 'does not exist'}")
    if src.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise DeltackptError("importing .safetensors needs the 'safetensors' package") from None
        try:
            state: Any = load_file(str(src))
        except Exception as exc:  # safetensors raises its own SafetensorError for damaged files
            raise DeltackptError(f"{src} is not a readable safetensors file: {_first_line(exc)}") from None
    else:
        try:
            with warnings.catch_warnings():  # (torch's note on the pickle protocol: the error below says enough)
                warnings.simplefilter("ignore", UserWarning)
                state = torch.load(src, map_location="cpu", weights_only=True)
        except Exception as exc:
            if not _like_torch_save(src):  # (torch's own words for that are an unpickler's: "101")
                raise DeltackptError(f"{src} is not a torch.save file (neither its zip format nor a legacy "
                                     "pickle)") from None
            raise DeltackptError(
                f"{src} cannot be read with torch.load(weights_only=True): {_weights_only_reason(exc)} "
                "(deltackpt never unpickles arbitrary objects; if you trust the file, torch.load it in Python with "
                "weights_only=False and Store.save what it holds)"
            ) from None
    if not args.store:
        raise DeltackptError("the store path is empty")
    dest = Path(args.store)
    if _is_dcp_root(dest):
        _open(args.store)  # a DCP root: refused, with the same message as every other command
    if (root := _dcp_root_of(dest)) is not None:
        raise DeltackptError(f"{args.store} is a store of the sharded (DCP) root {root}: a checkpoint imported into "
                             "it is not a step of the root (in meta, it breaks the root's listing and loads)")
    # a step or state the store cannot hold is refused before a new store is created for it
    check_step(args.step)
    tree.flatten(state)
    with Store(dest) as s:
        info = s.save(state, step=args.step, metadata={"imported_from": src.name})
    if args.json:
        _print_json({"file": str(src), "checkpoint": _info_json(info)})
        return 0
    print(f"imported {src} as checkpoint {info.id} (step {info.step}); wrote {human(info.written_bytes)}")
    return 0


def _first_line(exc: BaseException) -> str:
    # (no colour codes are cut out here: a message names the user's paths and keys, whose escapes the output
    # shows escaped; torch's own colour codes are cut from its weights-only refusal, the one message that has them)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _like_torch_save(path: Path) -> bool:
    """Whether the file starts as torch.save writes: a zip archive, or (before torch 1.6) a pickle."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return True  # (the load's own error names that)
    return head.startswith((b"PK\x03\x04", b"\x80"))


def _weights_only_reason(exc: BaseException) -> str:
    """torch's refusal of a file by ``weights_only``, in one line: its first line and the one naming what it
    refused (``Unsupported global: GLOBAL collections.deque``)."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    why = next((line for line in lines[1:] if "unsupported" in line.lower()), None)
    if why is None:
        # (torch < 2.4 says it all in one line: "Weights only load failed. ... WeightsUnpickler error: Unsupported
        # class collections.deque")
        why = next((line.split("Unpickler error:", 1)[1].strip() or None for line in lines
                    if "Unpickler error:" in line), None)
    if why is not None:  # (torch's advice to allowlist the global is for code that loads, not for this command)
        why = why.split(" Please use ", 1)[0].rstrip(".")
    first = lines[0] if lines else type(exc).__name__
    if first.startswith("Weights only load failed"):  # (torch's advice to rerun with weights_only=False: not ours)
        first = "the weights-only unpickler refused it"
    return f"{first} ({why})" if why is not None and why not in first else first


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _settings(value: dict[Any, Any], limit: int = 80) -> str:
    """``key=value`` of a state dict's plain public entries (a scheduler's ``last_epoch=3, step_size=5``), the
    step counters first, as many as fit in ``limit`` characters."""
    keys = sorted((k for k in value if isinstance(k, str) and not k.startswith("_")
                   and isinstance(value[k], (int, float, str))), key=lambda k: k not in ("last_epoch", "scale"))
    out = ""
    for k in keys:
        item = f"{k}={_short(value[k], 24)}"
        if len(out) + len(item) + 2 > limit:
            return out + ", …"
        out = f"{out}, {item}" if out else item
    return out


def _resume_point(s: Store, passed: list[dict[str, Any]] | None = None) -> CheckpointInfo | None:
    """The checkpoint ``Checkpointer.restore()`` would restore, found as it does (``newest_restorable``): the
    newest whose chunks all decode and verify, passing over damaged ones (printed, or with ``passed`` put there);
    None for an empty store. Raises :class:`DeltackptError` when no checkpoint would restore."""

    def verified(info: CheckpointInfo) -> CheckpointInfo:
        if _refused_before_a_chunk(s, info):
            # restore() checks the skeleton before it reads a chunk, and refuses such a checkpoint (an error, not
            # damage: it falls back to no older one), whatever its chunks hold; resume-info then says why
            return info
        report = s.verify(id=info.id)  # (a damaged manifest raises CorruptionError itself)
        if not report.ok:
            raise CorruptionError(str(report.problems[0]))
        return info

    passed_over: list[CheckpointInfo] = []

    def damaged(info: CheckpointInfo, exc: CorruptionError) -> None:
        passed_over.append(info)
        if passed is not None:
            passed.append({"id": info.id, "step": info.step, "damage": _first_line(exc)})
        else:
            print(f"checkpoint {info.id} (step {info.step}) is damaged, a restore passes over it: {_first_line(exc)}")

    try:
        return newest_restorable(s, verified, damaged)
    except CorruptionError as exc:
        raise DeltackptError(f"no checkpoint of {s.path} would restore: the {len(passed_over)} newest are damaged "
                             "and no full checkpoint before them is intact ('deltackpt verify' lists the damage)"
                             ) from exc


def _refused_before_a_chunk(s: Store, info: CheckpointInfo) -> bool:
    """Whether ``Checkpointer.restore()`` refuses the checkpoint by its manifest alone, as resume-info names it
    (pickled values, not a Checkpointer's layout, a 'step' entry that is not its step, a dtype this torch does not
    know, thinned). A damaged manifest raises CorruptionError, as it does for restore()."""
    m = s.manifest(id=info.id)
    if tree.pickled_paths(m.tree):
        return True
    try:
        state = m.skeleton()
    except Exception:  # (a registered type's decoder that cannot take tensor entries: the decode says)
        return False
    if not isinstance(state, dict) or not _checkpointer_layout(state):
        return True
    return _refusal(state, m, info.step) is not None or bool(state.get("thinned"))


def cmd_resume_info(args: argparse.Namespace) -> int:
    with _open(args.store, readonly=True) as s:
        passed: list[dict[str, Any]] | None = [] if args.json else None
        latest = _resume_point(s, passed) if args.verify else s.latest()
        doc: dict[str, Any] = {"start_step": None, "checkpoint": None, "refused": None, "verified": args.verify,
                               "passed_over": passed or [], "rng": None, "parts": {}}

        def refused(why: str) -> int:  # (--json: restore() refuses the newest checkpoint, for this reason)
            _print_json({**doc, "refused": why})
            return 1 if args.verify else 0  # (--verify: no checkpoint would restore)

        if latest is None:
            if args.json:
                _print_json({**doc, "start_step": 0})
                return 0
            print(f"{args.store} holds no checkpoint: a run would start from step 0")
            return 0
        doc["checkpoint"] = _info_json(latest)
        m = s.manifest(id=latest.id)
        # the skeleton with tensor descriptions in place of tensors: plain values without loading any bytes
        pickled = tree.pickled_paths(m.tree)
        # (no Checkpointer writes one: a Store.save of the same layout with allow_pickle=True did; its top-level
        # keys are read without unpickling anything)
        if pickled and _checkpointer_layout(dict(tree.node_children(m.tree)) if tree.is_dict_node(m.tree) else None):
            if args.json:
                return refused(f"it holds pickled values (saved with allow_pickle=True) at {pickled[0]!r}")
            print(f"the newest checkpoint, step {latest.step} (checkpoint {latest.id}, saved {when(latest.created)}), "
                  f"holds pickled values (saved with allow_pickle=True) at {', '.join(map(repr, pickled[:3]))}"
                  f"{' ...' if len(pickled) > 3 else ''}: a Checkpointer's restore() refuses it (it never unpickles)")
            return 1 if args.verify else 0  # (--verify: no checkpoint would restore)
        state = m.skeleton() if not pickled else None
        if not isinstance(state, dict) or not _checkpointer_layout(state):
            if args.json:
                return refused("it was not written by a Checkpointer (no 'step' and 'model' entries)")
            print(f"the newest checkpoint, step {latest.step} (checkpoint {latest.id}, saved "
                  f"{when(latest.created)}), was not written by a Checkpointer (no 'step' and 'model' entries): a "
                  "Checkpointer's restore() refuses it; Store.load it directly")
            return 1 if args.verify else 0  # (--verify: no checkpoint would restore)
        if (why := _refusal(state, m, latest.step)) is not None:
            if args.json:
                return refused(why)
            print(f"the newest checkpoint, step {latest.step} (checkpoint {latest.id}, saved "
                  f"{when(latest.created)}): {why}: a Checkpointer's restore() refuses it")
            return 1 if args.verify else 0  # (--verify: no checkpoint would restore)
        if state.get("thinned") and args.json:
            return refused("it was thinned to model weights only and cannot resume training")
        if state.get("thinned") and args.verify:  # restore() refuses it: no checkpoint would restore
            raise DeltackptError(f"no checkpoint of {args.store} would restore: the newest one left, step "
                                 f"{latest.step} ({latest.id}), was thinned to model weights only")
        if state.get("thinned"):  # (as the refusals above: it said "a run would resume from" it, then warned)
            print(f"the newest checkpoint, step {latest.step} (checkpoint {latest.id}, saved "
                  f"{when(latest.created)}), was thinned to model weights only and cannot resume training: a "
                  "Checkpointer's restore() refuses it; Store.load its weights")
            return 0
        kept = _rank_rng(s, state, latest.step)
        if args.json:
            doc.update(start_step=latest.step, rng=has_rng(state), parts=_parts_json(state),
                       rank_rng=[{"rank": r, "problem": why} for r, why in kept])
            _print_json(doc)
            return 0
        print(f"a run would resume from step {latest.step} (checkpoint {latest.id}, saved {when(latest.created)})"
              + ("" if args.verify else "; its chunks were not read ('--verify' decodes them and passes over "
                 "damaged checkpoints, as a restore does)"))
        rows = []
        for part, value in _parts(state):
            entries = list({id(e): e for e in _entries(value)}.values())  # a tied weight is one tensor
            size = sum(e.nbytes for e in entries)
            detail = f"{len(entries)} tensors, {human(size)}" if entries else ""
            if part == "data" and isinstance(value, dict):
                detail = ", ".join(f"{k}={v}" for k, v in value.items() if not isinstance(v, (dict, list)))
            elif part == "rng":
                detail = ", ".join(value) if isinstance(value, dict) else detail
            elif part == "extra" and isinstance(value, dict):
                detail = "keys: " + ", ".join(map(str, value))
            elif part == "optimizer" and isinstance(value, dict) and "param_groups" in value:
                detail = f"{len(value['param_groups'])} param group(s), " + (detail or "no state tensors")
            elif not detail and isinstance(value, dict):  # a scheduler, a scaler: its plain public settings
                detail = _settings(value)
            rows.append((part, _escaped(detail)))  # (keys and values are the run's: a newline, an escape)
        print(table(rows, ["part", "holds"]))
        if not has_rng(state):
            print("note: it holds no RNG states (a Checkpointer made with rng=False saved it, or a Store.save of "
                  "the same layout did): a default restore() refuses it; a Checkpointer restores it with rng=False, "
                  "or with restore(strict=False), which leaves the RNGs as they are")
        if kept:
            good = [str(r) for r, why in kept if why is None]
            who = (f"rank {good[0]} keeps" if len(good) == 1 else f"ranks {', '.join(good)} keep" if good
                   else "no rank keeps")
            print(f"ranks' own RNG states (rng/): {who} this step's")
            for r, why in kept:
                if why is not None:
                    print(f"  rank {r}: {_escaped(why)}: its restore warns and leaves its generators as they are")
        if latest.metadata:
            print(f"metadata: {_meta_str(latest.metadata)}")
    return 0


def _rank_rng(s: Store, state: dict[str, Any], step: int) -> list[tuple[int, str | None]]:
    """For each data-parallel rank that keeps RNG states beside the store (:mod:`deltackpt.ranks`), why its
    restore of the checkpoint whose skeleton is ``state`` finds none (None: it finds them, checked whole)."""
    out: list[tuple[int, str | None]] = []
    for r in ranks.ranks_kept(s.path):
        try:
            ranks.read_for(s.path, r, step, state.get("rng"), tensors=False)  # (checked whole; torch not imported)
            out.append((r, None))
        except ranks.RankStateError as exc:
            out.append((r, str(exc)))
    return out


def _parts(state: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The parts a Checkpointer's checkpoint holds, in the order resume-info lists them."""
    for part in ("model", "optimizer", "scheduler", "scaler", "data", "extra", "rng"):
        value = state.get(part)
        if value is not None and value != {}:
            yield part, value


def _parts_json(state: dict[str, Any]) -> dict[str, Any]:
    """resume-info's table as JSON: each part's tensors and bytes, and what the table says of it besides (the
    data position's and a scheduler's or scaler's plain values, the optimizer's param groups, extra's keys, the
    RNG states' names)."""
    out: dict[str, Any] = {}
    for part, value in _parts(state):
        entries = list({id(e): e for e in _entries(value)}.values())  # a tied weight is one tensor
        item: dict[str, Any] = {"tensors": len(entries), "bytes": sum(e.nbytes for e in entries)}
        if isinstance(value, dict):
            if part == "optimizer" and "param_groups" in value:
                item["param_groups"] = len(value["param_groups"])
            elif part in ("rng", "extra"):
                item["keys"] = list(value)
            elif part != "model":  # data, scheduler, scaler: their plain values
                item["values"] = {k: v for k, v in value.items()
                                  if isinstance(k, str) and isinstance(v, (bool, int, float, str))}
        out[part] = item
    return out


def _refusal(state: dict[str, Any], m: manifest.Manifest, step: int) -> str | None:
    """Why ``Checkpointer.restore()`` refuses the checkpoint of Checkpointer layout whose skeleton is ``state``,
    manifest ``m``, listed at ``step``, beyond what its chunks hold (damage: ``--verify``): a 'step' entry that is
    no step or not the manifest's step, a torch dtype this torch does not know (the load raises
    UnsupportedTypeError). None when it does not."""
    try:
        check_step(state["step"])
    except (TypeError, ValueError) as exc:
        return f"its 'step' entry is not a step: {exc}"
    if (mismatch := step_mismatch(state, step)) is not None:
        return mismatch
    for t in m.tensors:
        if t.kind == "torch":
            try:
                tree.check_known_torch_dtype(t.dtype)  # (torch imported only for a rarer dtype)
            except UnsupportedTypeError as exc:
                return f"tensor {t.key!r:.60}: {exc}"
    return None


def _entries(value: Any) -> list[manifest.TensorEntry]:
    if isinstance(value, manifest.TensorEntry):
        return [value]
    if isinstance(value, dict):
        return [e for v in value.values() for e in _entries(v)]
    if isinstance(value, (list, tuple)):
        return [e for v in value for e in _entries(v)]
    return []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltackpt", description="Inspect and maintain a deltackpt checkpoint store.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str,
            store: str = "store directory") -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument("store", help=store)
        sp.set_defaults(fn=fn)
        return sp

    json_help = "print one JSON document instead of the table"
    add("ls", cmd_ls, "list checkpoints").add_argument("--json", action="store_true", help=json_help)
    sh = add("show", cmd_show, "show a checkpoint's tensors")
    sh.add_argument("checkpoint", help="step, 'latest' or id")
    sh.add_argument("--json", action="store_true", help=json_help)
    df = add("diff", cmd_diff, "what changed between two checkpoints: tensors (by chunk digests, nothing decoded) "
             "and plain values")
    df.add_argument("a", help="step, 'latest' or id")
    df.add_argument("b", help="step, 'latest' or id")
    df.add_argument("--all", action="store_true", help="also list what is the same")
    df.add_argument("--exit-code", action="store_true", help="exit 1 when they differ (as git diff --exit-code)")
    df.add_argument("--json", action="store_true", help=json_help)
    gt = add("get", cmd_get, "print a value of a checkpoint, or a tensor's statistics and values (only its chunks are "
             "read); a key path names a subtree too")
    gt.add_argument("checkpoint", help="step, 'latest' or id")
    gt.add_argument("key", help="key path, as show and diff print it (model.fc.weight, optimizer.param_groups[0].lr)")
    gt.add_argument("--json", action="store_true", help="print the value (or the tensor, or the leaves under the "
                    "key path) as one JSON document")
    add("log", cmd_log, "show checkpoint lineage (parents and branches)").add_argument(
        "--json", action="store_true", help=json_help)
    add("du", cmd_du, "logical vs stored bytes, dedup and compression ratios").add_argument(
        "--json", action="store_true", help=json_help)
    vf = add("verify", cmd_verify, "decode and check every chunk (exit 1 on damage)")
    vf.add_argument("checkpoint", nargs="?", help="step, 'latest' or id (default: all)")
    vf.add_argument("--json", action="store_true", help="print the report as one JSON document")
    rm = add("rm", cmd_rm, "delete checkpoints")
    rm.add_argument("checkpoint", nargs="+", help="steps, 'latest' or ids")
    rm.add_argument("--json", action="store_true", help="print what it deleted as one JSON document")
    rm.add_argument("--force", action="store_true",
                    help="in a rank's store of a sharded (DCP) root, delete checkpoints that steps name all the same")
    gc = add("gc", cmd_gc, "reclaim space no retained checkpoint uses")
    gc.add_argument("--repack-below", type=float, default=0.5, metavar="F",
                    help="repack packs whose live fraction is below F, between 0 and 1 (0.5)")
    gc.add_argument("--json", action="store_true", help="print the report as one JSON document")
    add("repair", cmd_repair, "rebuild the index from packs and manifests").add_argument(
        "--json", action="store_true", help="print the report as one JSON document")
    ex = add("export", cmd_export, "write a checkpoint as .pt (.pth) or .safetensors")
    ex.add_argument("checkpoint", help="step, 'latest' or id")
    ex.add_argument("file", help="destination (.pt, .pth or .safetensors)")
    ex.add_argument("--key", metavar="KEY", help="export only what the checkpoint holds at this key path (model)")
    ex.add_argument("--json", action="store_true", help="print what it wrote as one JSON document")
    im = add("import", cmd_import, "store a .pt (weights_only) or .safetensors file as a checkpoint")
    im.add_argument("file", help="source file")
    im.add_argument("--step", type=int, required=True, help="step to record")
    im.add_argument("--json", action="store_true", help="print the checkpoint it stored as one JSON document")
    ri = add("resume-info", cmd_resume_info, "which step a training run would resume from, and what it holds")
    ri.add_argument("--json", action="store_true", help=json_help)
    ri.add_argument("--verify", action="store_true",
                    help="decode the checkpoints as a restore does, passing over damaged ones (reads their chunks)")
    kp = add("keep", cmd_keep, "apply a retention policy now: delete the checkpoints (or a DCP root's steps) it "
             "does not keep", store="store directory, or a sharded (DCP) checkpoint root")
    kp.add_argument("--last", type=int, metavar="N", help="keep the N newest")
    kp.add_argument("--every", type=int, metavar="N", help="keep steps that are multiples of N")
    kp.add_argument("--within", type=_duration, metavar="AGE", help="keep those at most AGE old (7d, 12h, 3600)")
    kp.add_argument("--best", type=_best, metavar="METRIC:min|max", help="keep the best by a metadata value")
    kp.add_argument("--best-k", type=int, default=None, metavar="K", help="how many --best keeps (1)")
    kp.add_argument("--no-tagged", action="store_true", help="do not keep tagged checkpoints for their tag")
    kp.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    kp.add_argument("--gc", action="store_true", help="then reclaim the space (gc every store)")
    kp.add_argument("--json", action="store_true", help="print what it deleted (and what gc did) as one JSON "
                    "document")
    dc = add("dcp", cmd_dcp,
             "list (and delete, prune, gc, verify) the steps of a sharded torch.distributed.checkpoint root",
             store="the sharded (DCP) checkpoint root (holding meta/ and rank-NNNNN/ stores)")
    dc.add_argument("--rm", type=int, nargs="+", default=[], metavar="STEP", help="delete these steps first")
    dc.add_argument("--prune", action="store_true",
                    help="delete rank checkpoints no step names (of saves that never committed, interrupted deletes)")
    dc.add_argument("--gc", action="store_true", help="then gc every store of the root")
    dc.add_argument("--verify", action="store_true", help="then verify every store of the root (exit 1 on damage)")
    dc.add_argument("--json", action="store_true", help="print the steps (and what --rm, --prune, --gc and --verify "
                    "did) as one JSON document")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for stream in (sys.stdout, sys.stderr):
        # names a store holds need not be printable text (a key with a lone surrogate): escape what is not
        with contextlib.suppress(AttributeError, ValueError):  # (a stream without reconfigure: tests)
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = cast(IO[str], _Escaped(out)), cast(IO[str], _Escaped(err))
    on_wait, packs.on_wait = packs.on_wait, _say_waiting
    try:
        with warnings.catch_warnings():
            # torch's note, the first time a process makes a complex32 tensor (get's loaded one, export's probe of
            # what its format holds), is no news to whoever stored one: stderr stays the command's own (one line on
            # an error)
            warnings.filterwarnings("ignore", message="ComplexHalf support is experimental", category=UserWarning)
            rc = _run(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # the reader of the output went away (``deltackpt ls STORE | head -1``): no error message, and no second
        # failure when the interpreter flushes stdout at exit; 141 as for a process killed by SIGPIPE
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # (a stdout without a file descriptor: tests)
            pass
        return 141
    finally:
        packs.on_wait = on_wait  # (a program's own, when it runs main() in-process)
        sys.stdout, sys.stderr = out, err


def _say_waiting(busy: str) -> None:
    """What a command waits for, once it has waited a second for a lock another process holds."""
    from tqdm import tqdm

    # a progress bar on screen (verify and gc draw theirs before they take the lock) is cleared first, else the
    # line would run on from the end of the bar's, and drawn again after
    with tqdm.external_write_mode(file=_raw_stderr()):
        print(f"deltackpt: waiting: {busy}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.fn(args))
    except BrokenPipeError:
        raise
    except KeyboardInterrupt:
        print("deltackpt: interrupted", file=sys.stderr)
        return 130
    except lmdb.Error as exc:
        print(f"deltackpt: error: the store's index is unreadable ({_first_line(exc)}); 'deltackpt repair STORE' "
              "rebuilds it", file=sys.stderr)
        return 1
    except (DeltackptError, OSError, ValueError, TypeError, RuntimeError, ImportError) as exc:
        # (ImportError: a DELTACKPT_BACKEND that cannot run, which Store() raises)
        print(f"deltackpt: error: {_first_line(exc)}", file=sys.stderr)
        return 1
    except MemoryError as exc:  # (a tensor larger than this machine's memory: get, export, resume-info --verify)
        print(f"deltackpt: error: out of memory: {_first_line(exc) or 'an allocation failed'}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
