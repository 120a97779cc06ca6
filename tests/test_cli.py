"""The ``deltackpt`` command line: every subcommand's output, exit codes and one-line errors.

Most tests call :func:`deltackpt.cli.main` in-process (capsys captures its output); two run the real entry
points (``python -m deltackpt`` and the installed console script) in a subprocess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import fractions
import gc
import io
import json
import os
import pickle
import re
import select
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    DCP_NO_DIST,
    ROOT,
    SMALL_CHUNK,
    assert_same_state,
    dir_snapshot,
    entries_written_as,
    pack_files,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltackpt
from deltackpt.cli import human, main
from deltackpt.index import chunk_key

CS = SMALL_CHUNK
ERROR_PREFIX = "deltackpt: error: "
FRAME_HEADER = struct.Struct("<4sBBBBQQ16s16sQ")  # magic, version, codec, width, flags, raw, stored, digest, ...
PACK_HEADER_LEN = 16


# -- helpers -----------------------------------------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    """Run ``deltackpt argv...`` in-process; return (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(err: str, *needles: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got {lines!r}"
    line = lines[0]
    assert line.startswith(ERROR_PREFIX), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert "Traceback" not in err
    return line


def table_rows(out: str) -> list[list[str]]:
    """Whitespace-split rows of the first table in ``out`` (the lines after its ``----`` rule)."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if re.fullmatch(r"-+(\s+-+)*", line.strip() or "x"))
    return [line.split() for line in lines[rule + 1 :] if line.strip()]


def ls_pairs(capsys: pytest.CaptureFixture[str], store_path: Path) -> list[tuple[int, str]]:
    rc, out, err = cli(capsys, "ls", store_path)
    assert rc == 0 and err == ""
    return [(int(r[0]), r[1]) for r in table_rows(out)]


def open_store(path: Path) -> deltackpt.Store:
    return deltackpt.Store(path, chunk_size=CS, threads=2)


def damage_frame(path: Path, loc: Any) -> None:
    """Flip the last byte of the frame at ``loc`` (an index ChunkLoc) in the store at ``path``."""
    with open(path / "packs" / f"{loc.pack_id}.pack", "r+b") as f:
        f.seek(loc.offset + loc.frame_len - 1)
        b = f.read(1)
        f.seek(loc.offset + loc.frame_len - 1)
        f.write(bytes([b[0] ^ 0xFF]))


def rand(n_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_bytes // 4, generator=g)


def size_of(text: str) -> float:
    """Bytes of a ``human()`` size such as ``12 B`` or ``3.5 KiB``."""
    num, unit = text.split()
    return float(num) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


@pytest.fixture
def three(store_path: Path) -> dict[str, Any]:
    """Steps 1, 2, 3 of a small training-like state (one store handle)."""
    states = {
        step: {"w": rand(3 * CS, step), "b": torch.arange(10, dtype=torch.int64) + step, "lr": 0.1 * step}
        for step in (1, 2, 3)
    }
    with open_store(store_path) as s:
        ids = {step: s.save(st, step=step, metadata={"epoch": step}).id for step, st in states.items()}
    return {"states": states, "ids": ids}


# -- ls / show / log / du ---------------------------------------------------------------------------------


_WITHOUT_TORCH = """
import runpy, sys
sys.argv = ["deltackpt", *sys.argv[1:]]
try:
    runpy.run_module("deltackpt", run_name="__main__")
except SystemExit as exc:
    assert not exc.code, exc.code
assert "torch" not in sys.modules, "imported torch"
"""


def test_listings_do_not_import_torch(tmp_path: Path) -> None:
    """ls, log, du, show and resume-info read the index and manifests only: importing torch was 1.0 s of ls's 1.5.
    verify and gc check digests, not tensors (verify of a small store: 1.8 s -> 0.26 s); get of a numpy array
    decodes no tensor. Their --json reads no more."""
    path = tmp_path / "s"
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    with deltackpt.Checkpointer(path, model=model, handle_signals=False) as ckpt:
        ckpt.save(1)
    with deltackpt.Store(path) as s:
        s.save({"w": torch.ones(3).to(torch.float8_e4m3fn), "a": np.arange(3.0)}, step=2)
    for args in (["ls"], ["log"], ["du"], ["show", str(path), "2"], ["resume-info"], ["verify"], ["gc"],
                 ["get", str(path), "2", "a"], *([c, str(path), "--json"] for c in ("ls", "log", "du", "verify")),
                 ["show", str(path), "2", "--json"], ["diff", str(path), "1", "2", "--json"],
                 ["get", str(path), "2", "a", "--json"]):
        argv = args if len(args) > 1 else [*args, str(path)]
        done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *argv], capture_output=True, text=True)
        assert done.returncode == 0, (args, done.stderr[-2000:])


def test_resume_info_of_a_checkpointer_checkpoint_does_not_import_torch(tmp_path: Path) -> None:
    """resume-info checks that this torch knows each tensor's dtype (restore() refuses one it does not): it looked
    every name up in torch, so resume-info of a store whose newest checkpoint a Checkpointer wrote imported it."""
    path = tmp_path / "s"
    model = torch.nn.Linear(8, 4)
    with deltackpt.Checkpointer(path, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                handle_signals=False) as ckpt:
        ckpt.save(1)
    for args in (["resume-info", str(path)], ["resume-info", str(path), "--json"]):
        done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *args], capture_output=True, text=True)
        assert done.returncode == 0, (args, done.stderr[-2000:])


def test_ls_lists_every_step_and_id(capsys: pytest.CaptureFixture[str], store_path: Path,
                                    three: dict[str, Any]) -> None:
    rc, out, err = cli(capsys, "ls", store_path)
    assert rc == 0 and err == ""
    assert out.splitlines()[0].split() == ["step", "id", "created", "logical", "written", "metadata"]
    rows = table_rows(out)
    assert [(int(r[0]), r[1]) for r in rows] == sorted(three["ids"].items())
    for r in rows:
        assert f"epoch={r[0]}" in r
        # logical: 3 chunks of w + 80 bytes of b
        assert size_of(" ".join(r[4:6])) == pytest.approx(3 * CS + 80, rel=0.01)


def test_ls_empty_store(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    open_store(store_path).close()
    rc, out, err = cli(capsys, "ls", store_path)
    assert rc == 0 and err == ""
    assert table_rows(out) == []


def test_listings_abbreviate_long_metadata(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """Metadata values are cut to 80 characters in listings, ints past Python's 4300-digit limit included."""
    with open_store(store_path) as s:
        s.save({"w": torch.ones(2)}, step=1, metadata={"n": 10**5000, "t": (10**5000,), "s": "ok"})
    for cmd in (("ls",), ("show", 1)):
        rc, out, err = cli(capsys, cmd[0], store_path, *cmd[1:])
        assert rc == 0 and err == ""
        assert "n=" + "1" + "0" * 78 + "…" in out and "t=<tuple>" in out and "s=ok" in out


def test_listings_escape_control_characters_in_metadata(capsys: pytest.CaptureFixture[str],
                                                         store_path: Path) -> None:
    """A newline or a terminal escape in metadata is shown escaped: it neither breaks the table nor reaches
    the terminal."""
    with open_store(store_path) as s:
        s.save({"x": torch.ones(3)}, step=1, metadata={"note": "two\nlines \x1b[31mred"})
    rc, out, err = cli(capsys, "ls", store_path)
    assert rc == 0 and err == "" and "\x1b" not in out
    assert len(table_rows(out)) == 1 and "two\\nlines \\x1b[31mred" in out


def test_gc_refuses_a_repack_fraction_outside_0_to_1(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                     three: dict[str, Any]) -> None:
    before = dir_snapshot(store_path)
    for bad in ("1.5", "-0.1", "nan"):
        rc, out, err = cli(capsys, "gc", store_path, "--repack-below", bad)
        assert rc == 1 and out == ""
        assert_one_line_error(err, f"--repack-below must be a fraction between 0 and 1, got {float(bad)}")
    assert dir_snapshot(store_path) == before


def test_gc_names_a_missing_pack_and_exits_1(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """A pack file deleted by hand (or lost) that retained checkpoints need chunks in: gc said nothing of it and
    exited 0 ("freed 0 B"), though verify reports the checkpoints as damaged. It now names the pack (stderr, and
    missing_packs in --json and in the Python report) and exits 1, and still frees what nothing needs."""
    packs_of = {}
    for step in (1, 2, 3):
        with open_store(store_path) as s:  # (each handle writes a pack of its own)
            info = s.save({"a": torch.randn(3000) + step}, step=step, keyframe=True)
            m = s.manifest(id=info.id)
            keys = [chunk_key(d, n) for _, d, n in m.chunk_keys(m.tensors[0])]
            packs_of[step] = {loc.pack_id for loc in s.index.lookup_chunks(keys).values()}
    with open_store(store_path) as s:
        s.delete(1)
    (lost,) = packs_of[3] - packs_of[2] - packs_of[1]
    lost = store_path / "packs" / f"{lost}.pack"
    lost.unlink()
    rc, out, err = cli(capsys, "gc", store_path)
    assert rc == 1 and f"pack {lost.stem} is missing, and retained checkpoints need chunks in it" in err
    assert "dropped" in out and "freed" in out  # (step 1's chunks: freed as ever)
    rc, out, err = cli(capsys, "gc", store_path, "--json")
    assert (rc, err) == (1, "") and _strict_json(out)["missing_packs"] == [lost.stem]
    with open_store(store_path) as s:
        report = s.gc()
        assert report.missing_packs == [lost.stem] and report.failed and report.damaged_packs == []
        assert s.load(2)["a"].shape == (3000,)  # (what does not need the pack is untouched)


def test_gc_on_a_damaged_manifest_says_how_to_go_on(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """gc cannot tell what a checkpoint whose manifest is damaged needs, so it frees nothing; its error names
    the checkpoint and the way on (rm it, or repair a stale index), and after `rm` gc runs."""
    with open_store(store_path) as s:
        a = s.save({"w": rand(CS, 1)}, step=1)
        b = s.save({"w": rand(CS, 2)}, step=2)
    shutil.copyfile(store_path / "manifests" / f"{a.id}.manifest", store_path / "manifests" / f"{b.id}.manifest")
    before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "gc", store_path)
    assert rc == 1 and out == ""
    assert_one_line_error(err, f"manifest of checkpoint {b.id} does not match the checksum the index recorded; gc "
                               f"frees nothing while it cannot tell what checkpoint {b.id} (step 2) needs: "
                               f"'deltackpt rm STORE {b.id}' gives that checkpoint up")
    assert dir_snapshot(store_path) == before
    rc, _, _ = cli(capsys, "rm", store_path, b.id)
    assert rc == 0
    rc, out, err = cli(capsys, "gc", store_path)
    assert rc == 0 and "freed" in out
    with open_store(store_path) as s:
        assert [i.step for i in s.list()] == [1]
        assert_same_state(s.load(1), {"w": rand(CS, 1)})


def test_show_names_every_path_of_a_tied_tensor(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    sd = {"emb.weight": emb.state_dict()["weight"], "head.weight": head.state_dict()["weight"], "x": torch.ones(2)}
    with open_store(store_path) as s:
        s.save({"model": sd}, step=1)
    rc, out, _ = cli(capsys, "show", store_path, 1)
    assert rc == 0 and "tensors 2" in out
    row = next(line for line in out.splitlines() if line.startswith("model.emb.weight"))
    assert row.split()[-1] == "model.head.weight" and "also at" in out
    assert "head" not in next(line for line in out.splitlines() if line.startswith("model.x "))


def _diff_rows(out: str) -> dict[str, list[str]]:
    """The rows of ``deltackpt diff``'s table by key: [change, chunks, A, B] (cut at two spaces or more)."""
    lines = out.splitlines()
    if not any(line.startswith("---") for line in lines):
        return {}
    at = next(i for i, line in enumerate(lines) if line.startswith("---"))
    rows = {}
    for line in lines[at + 1 :]:
        if not line.strip():
            break
        cells = re.split(r" {2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


def test_diff_lists_what_changed_between_two_checkpoints(capsys: pytest.CaptureFixture[str],
                                                         store_path: Path) -> None:
    w = rand(3 * CS, 0)
    s1 = {"w": w, "x": torch.zeros(4), "y": torch.ones(2, 3), "same": torch.arange(5), "gone": torch.ones(1),
          "lr": 0.1, "cfg": {"name": "run", "sizes": [1, 2]}, "g": torch.ones(2)}
    w2 = w.clone()
    w2[CS // 4 + 1] += 1  # one element of the second of three chunks
    s2 = {"w": w2, "x": torch.zeros(4, dtype=torch.float64), "y": torch.ones(3, 2), "same": torch.arange(5),
          "lr": 0.2, "cfg": {"name": "run", "sizes": [1, 2]}, "opt": {"m": torch.ones(3), "v": torch.ones(3), "k": 1},
          "g": torch.full((2,), 2.0).requires_grad_()}
    with open_store(store_path) as s:
        s.save(s1, step=1)
        s.save(s2, step=2)
        before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "diff", store_path, 1, "latest")
    assert rc == 0 and not err
    rows = _diff_rows(out)
    assert rows == {
        "w": ["values", "1/3", human(3 * CS), human(3 * CS)],
        "x": ["dtype float32 -> float64", "16 B", "32 B"],
        "y": ["shape 2x3 -> 3x2", "24 B", "24 B"],
        "gone": ["removed", "4 B", "-"],
        "lr": ["value", "0.1", "0.2"],
        "g": ["values, requires_grad False -> True", "1/1", "8 B", "8 B"],
        "opt": ["added", "-", "3 leaves, 24 B"],
    }, out
    assert out.splitlines()[-1] == "tensors changed: 4, tensors the same: 1, removed: 1, values changed: 1, " \
        "values the same: 3, added: 3"
    rc, out, _ = cli(capsys, "diff", store_path, 2, 1, "--all")
    rows = _diff_rows(out)
    assert rows["same"] == ["same", "40 B", "40 B"] and rows["cfg.sizes[1]"] == ["same", "2", "2"]
    assert rows["opt"] == ["removed", "3 leaves, 24 B", "-"] and rows["gone"] == ["added", "-", "4 B"]
    assert (cli(capsys, "diff", store_path, 1, 2, "--exit-code")[0], cli(capsys, "diff", store_path, 2, 2,
            "--exit-code")[0]) == (1, 0)
    rc, out, _ = cli(capsys, "diff", store_path, 2, 2)
    assert rc == 0 and _diff_rows(out) == {} and "changed" not in out
    rc, _, err = cli(capsys, "diff", store_path, 1, 3)
    assert rc == 1
    assert_one_line_error(err, "step 3")
    assert dir_snapshot(store_path) == before


def test_diff_json_holds_each_row_exactly_and_keeps_the_exit_status(capsys: pytest.CaptureFixture[str],
                                                                     store_path: Path) -> None:
    """``diff --json``: both checkpoints' fields, one entry per row of the table with exact sizes, chunk counts and
    values in full, the counts of the last line, and the exit status as without it (--exit-code: 1 when they
    differ); an error is one line on stderr and nothing on stdout."""
    import collections

    w = rand(3 * CS, 0)
    w2 = w.clone()
    w2[CS // 4 + 1] += 1  # one element of the second of three chunks
    long = "x" * 100  # (the table shortens it to 40 characters; --json prints it in full)
    s1 = {"w": w, "x": torch.zeros(4), "gone": torch.ones(1), "lr": 0.1, "name": long, "t": (1, 2),
          "k": {1: "v"}, "od": collections.OrderedDict(a=1, b=2), "same": [1, 2]}
    s2 = {"w": w2, "x": torch.zeros(4, dtype=torch.float64), "lr": float("nan"), "name": long + "!", "t": [1, 2],
          "k": {True: "v"}, "od": collections.OrderedDict(b=2, a=1), "same": [1, 2],
          "opt": {"m": torch.ones(3), "v": torch.ones(3), "k": 1}}
    with open_store(store_path) as s:
        s.save(s1, step=1)
        s.save(s2, step=2)
        infos = s.list()
        ma, mb = (s.manifest(id=i.id) for i in infos)
    by_key = [{t.key: t for t in m.tensors} for m in (ma, mb)]
    rc, out, err = cli(capsys, "diff", store_path, 1, 2, "--json")
    assert (rc, err) == (0, "")
    doc = _strict_json(out)
    assert [doc["a"]["id"], doc["b"]["id"]] == [i.id for i in infos]
    assert (doc["a"]["step"], doc["b"]["created"], doc["b"]["logical_bytes"]) == (1, infos[1].created,
                                                                                 infos[1].logical_bytes)
    rows = {r["key"]: r for r in doc["changes"]}
    assert len(rows) == len(doc["changes"])
    wa, wb = by_key[0]["w"], by_key[1]["w"]
    assert rows["w"] == {"key": "w", "change": "values", "chunks": {"differ": 1, "of": wa.count},
                         "a": {"dtype": wa.dtype, "shape": list(wa.shape), "bytes": wa.nbytes},
                         "b": {"dtype": wb.dtype, "shape": list(wb.shape), "bytes": wb.nbytes}}
    assert (rows["x"]["change"], rows["x"]["chunks"]) == ("dtype float32 -> float64", None)
    assert (rows["x"]["a"]["bytes"], rows["x"]["b"]["bytes"]) == (by_key[0]["x"].nbytes, by_key[1]["x"].nbytes)
    assert (rows["gone"]["change"], rows["gone"]["a"]["bytes"], rows["gone"]["b"]) == ("removed", 4, None)
    assert (rows["lr"]["a"], rows["lr"]["b"]) == ({"value": 0.1}, {"value": "nan"})
    assert (rows["name"]["a"], rows["name"]["b"]) == ({"value": long}, {"value": long + "!"})
    assert rows["opt"]["change"] == "added" and rows["opt"]["a"] is None
    assert rows["opt"]["b"] == {"leaves": 3, "bytes": by_key[1]["opt.m"].nbytes + by_key[1]["opt.v"].nbytes}
    assert (rows["t"]["change"], rows["t"]["a"], rows["t"]["b"]) == ("type tuple -> list", {"type": "tuple"},
                                                                     {"type": "list"})
    assert (rows["k"]["change"], rows["k"]["a"], rows["k"]["b"]) == ("dict key types", {"keys": ["1"]},
                                                                     {"keys": ["True"]})
    assert (rows["od"]["a"], rows["od"]["b"]) == ({"keys": ["'a'", "'b'"]}, {"keys": ["'b'", "'a'"]})
    assert "same" not in rows and "same[0]" not in rows
    assert doc["differ"] is True and doc["counts"] == {
        "tensors_changed": 2, "tensors_same": 0, "values_changed": 2, "values_same": 7, "added": 3, "removed": 1,
        "containers_changed": 3}
    rc, out, _ = cli(capsys, "diff", store_path, 1, 2)  # the same rows and counts as the table
    assert set(_diff_rows(out)) == set(rows) and rc == 0
    assert set(out.splitlines()[-1].split(", ")) == {f"{k.replace('_', ' ').replace('same', 'the same')}: {n}"
                                                     for k, n in doc["counts"].items() if n}
    assert cli(capsys, "diff", store_path, 1, 2, "--json", "--exit-code")[0] == 1
    rc, out, err = cli(capsys, "diff", store_path, 2, 2, "--json", "--exit-code", "--all")
    doc = _strict_json(out)
    assert (rc, err, doc["differ"]) == (0, "", False)
    assert {r["change"] for r in doc["changes"]} == {"same"} and len(doc["changes"]) == sum(doc["counts"].values())
    assert {r["key"]: r["chunks"] for r in doc["changes"] if r["a"].get("dtype")} == {
        t.key: {"differ": 0, "of": t.count} for t in mb.tensors}
    assert next(r for r in doc["changes"] if r["key"] == "same[1]")["b"] == {"value": 2}
    rc, out, err = cli(capsys, "diff", store_path, 1, 3, "--json")
    assert (rc, out) == (1, "")
    assert_one_line_error(err, "step 3")


@pytest.mark.parametrize("command", [("diff", 1, 2), ("show", 2)], ids=["diff", "show"])
def test_manifest_commands_run_no_garbage_collection(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                     command: tuple[Any, ...]) -> None:
    """diff and show hold the cyclic collector off, as saves and loads do: a diff of many small tensors builds a few
    objects per leaf that live until it returns, and the collections they set off (dozens here, 27-31% of a diff
    of 10^5-4x10^5 tensors) reclaimed nothing. The collector is on again after it."""
    state = {f"t{i}": torch.full((1 + i % 4,), float(i)) for i in range(3000)}
    with open_store(store_path) as s:
        s.save(state, step=1)
        s.save(state, step=2)
    collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    was_enabled = gc.isenabled()
    gc.enable()
    gc.callbacks.append(seen)
    try:
        rc, out, err = cli(capsys, command[0], store_path, *command[1:])
    finally:
        gc.callbacks.remove(seen)
        enabled_after = gc.isenabled()
        if not was_enabled:
            gc.disable()
    assert rc == 0 and not err
    assert out.splitlines()[-1] == "tensors the same: 3000" if command[0] == "diff" else "\nt2999 " in out
    assert len(collections) <= 1 and enabled_after, collections  # (one: the pass deferred to when it is back on)


def test_diff_reports_containers_that_changed_type(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """A tuple that became a list, a dict an OrderedDict, a defaultdict's factory, a deque's maxlen, an int key
    become True: same leaves, another state. An empty container the other side fills is not a row of its own."""
    import collections

    with open_store(store_path) as s:
        s.save({"t": (1, 2), "o": {"a": 1}, "dd": collections.defaultdict(list, {"x": 1}),
                "q": collections.deque([1], maxlen=2), "k": {1: "v"}, "e": {}, "same": [1],
                "od": collections.OrderedDict(a=1, b=2, c=3)}, step=1)
        s.save({"t": [1, 2], "o": collections.OrderedDict(a=1), "dd": {"x": 1}, "q": collections.deque([1], maxlen=9),
                "k": {True: "v"}, "e": {"now": 1}, "same": [1], "od": collections.OrderedDict(b=2, new=0, a=1)},
               step=2)
    rc, out, _ = cli(capsys, "diff", store_path, 1, 2, "--exit-code")
    assert rc == 1
    rows = _diff_rows(out)
    assert {k: v[0] for k, v in rows.items()} == {
        "e.now": "added", "t": "type tuple -> list", "o": "type dict -> OrderedDict",
        "dd": "type defaultdict(list) -> dict", "q": "type deque(maxlen=2) -> deque(maxlen=9)", "k": "dict key types",
        "od.c": "removed", "od.new": "added", "od": "dict key order"}
    assert "'a', 'b'" in " ".join(rows["od"]) and "'b', 'a'" in " ".join(rows["od"])
    assert rows["k"][1:] == ["1", "True"]  # (the keys as Python shows them, not as the manifest stores them)
    assert out.splitlines()[-1] == "values the same: 9, removed: 1, added: 2, containers changed: 6"


def test_diff_counts_an_empty_container_that_changed_type_once(capsys: pytest.CaptureFixture[str],
                                                                 store_path: Path) -> None:
    """``[]`` become ``{}`` is one change (the container's type), not also a value change of the empty leaf; two
    empty lists are the same value."""
    with open_store(store_path) as s:
        s.save({"a": [], "b": (), "same": []}, step=1)
        s.save({"a": {}, "b": None, "same": []}, step=2)
    rc, out, _ = cli(capsys, "diff", store_path, 1, 2, "--all")
    assert rc == 0
    rows = _diff_rows(out)
    assert {k: v[0] for k, v in rows.items()} == {"a": "type list -> dict", "b": "value", "same": "same"}
    assert out.splitlines()[-1] == "values changed: 1, values the same: 1, containers changed: 1"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_diff_reports_exactly_the_keys_that_changed(capsys: pytest.CaptureFixture[str], tmp_path_factory: Any,
                                                    data: st.DataObject) -> None:
    """Random states, randomly changed: diff lists every changed, retyped, removed and added key, and no other."""
    keys = [f"k{i}" for i in range(6)]
    before: dict[str, Any] = {}
    for k in data.draw(st.lists(st.sampled_from(keys), unique=True), label="keys"):
        n = data.draw(st.integers(1, 3 * CS // 4), label=f"{k} elements")
        before[k] = data.draw(st.sampled_from([rand(4 * n, n), n]), label=f"{k} kind")
    after: dict[str, Any] = {}
    want: dict[str, str] = {}
    for k in keys:
        op = data.draw(st.sampled_from(["keep", "change", "retype", "drop"] if k in before else ["absent", "add"]),
                       label=f"{k} op")
        v = before.get(k)
        if op == "keep":
            after[k] = v.clone() if isinstance(v, torch.Tensor) else v
        elif op == "change":
            if isinstance(v, torch.Tensor):
                after[k] = v.clone()
                after[k][data.draw(st.integers(0, v.numel() - 1), label=f"{k} at")] += 1
            else:
                after[k] = v + 1
            want[k] = "values" if isinstance(v, torch.Tensor) else "value"
        elif op == "retype":
            after[k] = v.double() if isinstance(v, torch.Tensor) else torch.tensor([v])
            want[k] = "dtype float32 -> float64" if isinstance(v, torch.Tensor) else "value -> tensor"
        elif op == "drop":
            want[k] = "removed"
        elif op == "add":
            after[k], want[k] = torch.ones(2), "added"
    common = [k for k in before if k in after]
    if common != [k for k in after if k in before]:  # (after's keys are in ``keys`` order)
        want["<root>"] = "dict key order"
    path = tmp_path_factory.mktemp("diff")
    with open_store(path) as s:
        s.save(before, step=1)
        s.save(after, step=2)
    rc, out, err = cli(capsys, "diff", path, 1, 2, "--exit-code")
    assert rc == (1 if want else 0) and not err
    got = {k: row[0] for k, row in _diff_rows(out).items()}
    if not before or not after:  # an empty dict is a leaf of its own: its state's root
        got.pop("<root>", None)
    assert got == want, out


def test_show_prints_each_tensor(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    w = rand(2 * CS, 0).reshape(64, 32)
    s1 = {
        "w": w,
        "b": torch.arange(10, dtype=torch.int64),
        "h": torch.ones(3, 4, 5, dtype=torch.bfloat16),
        "s": torch.tensor(2.5, dtype=torch.float64),
        "lr": 0.1,
    }
    s2 = {"w": w + 1, "b": s1["b"].clone(), "h": s1["h"].clone(), "s": s1["s"].clone(), "lr": 0.2}
    with open_store(store_path) as s:
        i1 = s.save(s1, step=1, metadata={"note": "first"}).id
        i2 = s.save(s2, step=2).id
        i3 = s.save(torch.zeros(5), step=3).id

    rc, out, err = cli(capsys, "show", store_path, 1)
    assert rc == 0 and err == ""
    head = out.splitlines()[0]
    assert head.startswith(f"checkpoint {i1}  step 1") and head.endswith("parent -")
    assert "note=first" in out and "tensors 4" in out and "chunk size 4.0 KiB" in out
    header = next(line for line in out.splitlines() if line.startswith("key"))
    assert header.split() == ["key", "dtype", "shape", "logical", "written"]
    rows = {r[0]: r for r in table_rows(out)}
    assert set(rows) == {"w", "b", "h", "s"}
    expect = {"w": ("float32", "64x32", 2 * CS), "b": ("int64", "10", 80), "h": ("bfloat16", "3x4x5", 120),
              "s": ("float64", "()", 8)}
    for key, (dtype, shape, nbytes) in expect.items():
        r = rows[key]
        assert len(r) == 7, r
        assert (r[1], r[2]) == (dtype, shape)
        assert size_of(" ".join(r[3:5])) == pytest.approx(nbytes, rel=0.01)
        assert size_of(" ".join(r[5:7])) > 0  # every tensor of the first checkpoint was written
    # by id, and 'latest'; the written column shows what deduplicated
    rc, out2, _ = cli(capsys, "show", store_path, i2)
    assert rc == 0
    assert out2.splitlines()[0].startswith(f"checkpoint {i2}  step 2") and f"parent {i1}" in out2
    rows2 = {r[0]: r for r in table_rows(out2)}
    for key in ("b", "h", "s"):  # same bytes as in step 1: nothing written
        assert rows2[key][5:7] == ["0", "B"], rows2[key]
    assert size_of(" ".join(rows2["w"][5:7])) > 0
    rc, out3, _ = cli(capsys, "show", store_path, "latest")
    assert rc == 0 and out3.splitlines()[0].startswith(f"checkpoint {i3}  step 3")
    rows3 = table_rows(out3)
    assert rows3 == [["<root>", "float32", "5", "20", "B", "0", "B"]]  # an all-zero tensor stores no frame


def test_log_marks_branch_after_rollback(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """A checkpoint saved after a rollback is marked as a branch; its parent's first child, which continues
    the line, is not (both were marked once). Parents are shown by their full id, which other commands take."""
    with open_store(store_path) as s:
        ids = {step: s.save({"w": rand(CS, step)}, step=step).id for step in (1, 2, 3)}
    with open_store(store_path) as s:
        s.load(1)
        ids[4] = s.save({"w": rand(CS, 4)}, step=4).id

    cid = r"[0-9a-f]{16}"
    row_re = re.compile(
        rf"^\s*(\d+)\s+({cid})\s+(-|\d+ \({cid}\)|deleted \({cid}\))\s+\S+ \S+\s+\S+ \S+\s*(branch)?$"
    )

    def log() -> dict[int, tuple[str, str, bool]]:
        rc, out, err = cli(capsys, "log", store_path)
        assert rc == 0 and err == ""
        lines = out.splitlines()
        assert lines[0].split() == ["step", "id", "parent", "created", "written", "lineage"]
        rows = {}
        for line in lines[2:]:
            m = row_re.match(line)
            assert m, line
            rows[int(m[1])] = (m[2], m[3], m[4] == "branch")
        return rows

    short = ids  # (full ids: what show, diff and rm accept)
    assert log() == {
        1: (ids[1], "-", False),
        2: (ids[2], f"1 ({short[1]})", False),
        3: (ids[3], f"2 ({short[2]})", False),
        4: (ids[4], f"1 ({short[1]})", True),
    }
    rc, out, _ = cli(capsys, "show", store_path, short[1])
    assert rc == 0 and out
    rc, _, _ = cli(capsys, "rm", store_path, 1)
    assert rc == 0
    assert log() == {
        2: (ids[2], f"deleted ({short[1]})", False),
        3: (ids[3], f"2 ({short[2]})", False),
        4: (ids[4], f"deleted ({short[1]})", True),
    }


def _du(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(\S.*)$", line)
        if m and not line.startswith("-"):
            rows[m[1]] = m[2]
    return rows


def test_du_counts_and_ratios(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    compressible = torch.arange(3 * CS // 4, dtype=torch.float32)  # 3 chunks, byte planes compress well
    with open_store(store_path) as s:
        for step in (1, 2, 3):  # the same bytes three times: stored once
            s.save({"x": compressible}, step=step)
    rc, out, err = cli(capsys, "du", store_path)
    assert rc == 0 and err == ""
    assert out.splitlines()[0].startswith("checkpoints")  # a two-column listing: no empty header, no rule
    du = _du(out)
    assert du["checkpoints"] == "3"
    assert size_of(du["logical bytes (all checkpoints)"]) == pytest.approx(9 * CS, rel=0.01)
    assert du["unique chunk bytes (what retained checkpoints reach)"] == "12.0 KiB in 3 chunks"
    assert du["dedup ratio (logical / unique)"] == "3.00x"
    compression = float(du["compression ratio (unique / stored)"].removesuffix("x"))
    assert compression > 1.5
    stored = size_of(du["stored frame bytes (what retained checkpoints reach)"])
    assert stored == pytest.approx(3 * CS / compression, abs=0.05 * 1024 + 0.01 * stored)  # (as printed: 1.7 KiB)
    on_disk = sum(p.stat().st_size for p in pack_files(store_path))
    on_disk += sum(p.stat().st_size for p in (store_path / "manifests").glob("*.manifest"))
    assert du["overall (logical / on disk)"] == f"{9 * CS / on_disk:.2f}x"
    assert du["dead bytes in packs (what gc --repack-below 1 frees)"] == "0 B"  # (pack headers are not dead)
    assert du["delta frames (of all chunks)"].startswith("0 of 3,")
    assert du["deepest chain (frames a decode reads, <= max_chain + 1)"] == "1"


def test_du_reports_delta_frames(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4 * CS // 4, generator=gen)
    with open_store(store_path) as s:
        for step in range(4):
            s.save({"x": x}, step=step)
            x.view(torch.int32).bitwise_xor_(torch.randint(0, 256, x.shape, dtype=torch.int32, generator=gen))
        locs = [loc for _, loc in s.index.iter_chunks()]
    _assert_du_counts(capsys, store_path, locs, deltackpt.codec.DELTA, "delta frames (of all chunks)")


def _assert_du_counts(capsys: pytest.CaptureFixture[str], store_path: Path, locs: list[Any], codec_id: int,
                      row: str) -> None:
    """``du`` counts the frames of ``codec_id`` (there are some) in ``row`` and reports the deepest chain."""
    n = sum(loc.codec == codec_id for loc in locs)
    assert n > 0
    rc, out, _ = cli(capsys, "du", store_path)
    du = _du(out)
    assert rc == 0
    assert du[row].startswith(f"{n} of {len(locs)},")
    assert du["deepest chain (frames a decode reads, <= max_chain + 1)"] == str(max(loc.depth for loc in locs) + 1)


def test_du_reports_predicted_frames(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    from test_predict import _train

    with deltackpt.Store(store_path, chunk_size=1 << 14, max_chain=3) as s:
        _train(6, store=s)
        locs = [loc for _, loc in s.index.iter_chunks()]
    _assert_du_counts(capsys, store_path, locs, deltackpt.codec.PREDICTED, "predicted frames (of all chunks)")


def test_du_empty_store(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    open_store(store_path).close()
    rc, out, _ = cli(capsys, "du", store_path)
    assert rc == 0
    du = _du(out)
    assert du["checkpoints"] == "0"
    assert du["dedup ratio (logical / unique)"] == "-"
    assert du["compression ratio (unique / stored)"] == "-"
    assert du["overall (logical / on disk)"] == "-"  # (not 0.00x: there is nothing to compare)
    assert du["deepest chain (frames a decode reads, <= max_chain + 1)"] == "-"


# -- verify ------------------------------------------------------------------------------------------------


def test_verify_good_store(capsys: pytest.CaptureFixture[str], store_path: Path, three: dict[str, Any]) -> None:
    rc, out, err = cli(capsys, "verify", store_path)
    assert rc == 0 and err == ""
    assert out.strip() == "verified 3 checkpoint(s), 12 chunk reference(s): OK"
    for which in ("2", "latest", three["ids"][1]):
        rc, out, err = cli(capsys, "verify", store_path, which)
        assert rc == 0 and err == ""
        assert out.strip() == "verified 1 checkpoint(s), 4 chunk reference(s): OK"


def test_verify_names_the_damaged_chunk(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    with open_store(store_path) as s:  # one chunk each, one pack: the first frame is w's
        i1 = s.save({"w": rand(4000, 1)}, step=1).id
        i2 = s.save({"other": rand(4000, 2)}, step=2).id
    [pack] = pack_files(store_path)
    data = bytearray(pack.read_bytes())
    magic, _, _, _, _, raw_len, stored_len, digest, _, _ = FRAME_HEADER.unpack_from(data, PACK_HEADER_LEN)
    assert magic == b"DCKF" and raw_len == 4000
    chunk = f"{digest.hex()}-{raw_len}"
    data[PACK_HEADER_LEN + FRAME_HEADER.size + stored_len // 2] ^= 0xFF
    pack.write_bytes(bytes(data))

    rc, out, err = cli(capsys, "verify", store_path)
    assert rc == 1 and err == ""
    lines = out.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"checkpoint {i1} (step 1), tensor 'w', chunk {chunk}: ")
    assert lines[1] == "verified 2 checkpoint(s), 2 chunk reference(s): 1 problem(s)"
    assert i2 not in out
    rc, out, _ = cli(capsys, "verify", store_path, 1)
    assert rc == 1 and chunk in out
    rc, out, _ = cli(capsys, "verify", store_path, 2)  # the other checkpoint is intact
    assert rc == 0 and out.strip().endswith(": OK")


def _strict_json(out: str) -> Any:
    """``out`` parsed as one strict JSON document (NaN and Infinity refused)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"not strict JSON: {name}")
    return json.loads(out, parse_constant=refuse)


def test_listings_and_verify_print_json_that_matches_the_python_api(capsys: pytest.CaptureFixture[str],
                                                                    store_path: Path) -> None:
    """``--json`` of ls, log, show, du and verify: one strict JSON document holding what the Python API says
    (metadata JSON cannot hold as is converted, not dropped), and verify's exit status as without it."""
    w = rand(3 * CS, 1)
    with open_store(store_path) as s:
        s.save({"w": w, "b": torch.arange(4)}, step=1,
               metadata={"loss": float("nan"), "best": float("inf"), "pair": (1, 2.5), 7: b"\x01\xff",
                         "s": np.float32(0.5), "dt": torch.bfloat16, "size": torch.Size([2, 3]), "name": "run\n1"})
        w2 = w + 1
        s.save({"w": w2, "b": torch.arange(4), "tied": {"w": w2}}, step=2)
        s.load(step=1)
        s.save({"w": w - 1, "b": torch.arange(4)}, step=2, metadata={"epoch": 1})  # a branch
        infos = s.list()
        m = s.manifest(id=infos[1].id)
    rc, out, err = cli(capsys, "ls", store_path, "--json")
    assert rc == 0 and err == ""
    listed = _strict_json(out)
    assert [(e["step"], e["id"], e["parent"], e["created"], e["logical_bytes"], e["written_bytes"])
            for e in listed] == [(i.step, i.id, i.parent, i.created, i.logical_bytes, i.written_bytes)
                                 for i in infos]
    assert listed[0]["metadata"] == {"loss": "nan", "best": "inf", "pair": [1, 2.5], "7": "01ff", "s": 0.5,
                                     "dt": "torch.bfloat16", "size": [2, 3], "name": "run\n1"}
    assert listed[2]["metadata"] == {"epoch": 1} and listed[1]["metadata"] is None

    rc, out, err = cli(capsys, "log", store_path, "--json")
    assert rc == 0 and err == ""
    log = _strict_json(out)
    assert [(e["id"], e["parent_step"], e["parent_deleted"], e["branch"]) for e in log] == [
        (infos[0].id, None, False, False), (infos[1].id, 1, False, False), (infos[2].id, 1, False, True)]
    with open_store(store_path) as s:
        s.delete(id=infos[0].id)
    rc, out, _ = cli(capsys, "log", store_path, "--json")
    assert [(e["parent_step"], e["parent_deleted"]) for e in _strict_json(out)] == [(None, True), (None, True)]

    rc, out, err = cli(capsys, "show", store_path, infos[1].id, "--json")
    assert rc == 0 and err == ""
    shown = _strict_json(out)
    assert shown["id"] == infos[1].id and shown["chunk_size"] == CS
    assert [(t["key"], t["dtype"], t["shape"], t["logical_bytes"], t["written_bytes"]) for t in shown["tensors"]] \
        == [(t.key, t.dtype, list(t.shape), t.nbytes, t.written) for t in m.tensors]
    assert {t["key"]: t["also_at"] for t in shown["tensors"]} == {"w": ["tied.w"], "b": []}

    rc, out, err = cli(capsys, "du", store_path, "--json")
    assert rc == 0 and err == ""
    du = _strict_json(out)
    assert du["checkpoints"] == 2 and du["chunks_counted"] == "live"
    assert du["logical_bytes"] == sum(i.logical_bytes for i in infos[1:])
    assert du["pack_bytes"] == sum(p.stat().st_size for p in pack_files(store_path))
    assert 0 < du["stored_frame_bytes"] <= du["pack_bytes"] and du["deepest_chain"] >= 1

    rc, out, err = cli(capsys, "verify", store_path, "--json")
    assert (rc, err) == (0, "")
    assert _strict_json(out) == {"ok": True, "checkpoints": 2, "chunk_references": 8, "problems": []}
    packs_before = sum(p.stat().st_size for p in pack_files(store_path))
    rc, out, err = cli(capsys, "gc", store_path, "--json", "--repack-below", "1")
    gc_report = _strict_json(out)
    assert (rc, err, gc_report["repack_stopped"], gc_report["damaged_packs"]) == (0, "", None, [])
    assert gc_report["dead_chunks"] == 3 and gc_report["freed_bytes"] > 0  # step 1's w (its b is the others' too)
    assert gc_report["freed_bytes"] == packs_before - sum(p.stat().st_size for p in pack_files(store_path))
    (_, d, n), = m.chunk_keys(m.tensors[1])  # step 2's b
    with open_store(store_path) as s:
        loc = s.index.lookup_chunks([chunk_key(d, n)])[chunk_key(d, n)]
    damage_frame(store_path, loc)
    rc, out, err = cli(capsys, "verify", store_path, "--json")
    report = _strict_json(out)
    assert (rc, err, report["ok"]) == (1, "", False)
    assert {(p["checkpoint"], p["step"], p["key"], p["chunk_id"], p["pack"]) for p in report["problems"]} == {
        (i.id, 2, "b", f"{d.hex()}-{n}", None) for i in infos[1:]}
    assert all(p["message"] for p in report["problems"])
    with open(store_path / "packs" / f"{loc.pack_id}.pack", "r+b") as f:  # a pack's own damage: its header
        f.write(b"X")
    rc, out, err = cli(capsys, "verify", store_path, "--json")
    report = _strict_json(out)
    assert (rc, err, report["ok"]) == (1, "", False)
    assert [(p["checkpoint"], p["chunk_id"], p["pack"]) for p in report["problems"] if p["pack"]] == [
        (None, None, loc.pack_id)]
    rc, out, err = cli(capsys, "verify", store_path)
    assert rc == 1 and f"pack {loc.pack_id}: its header is damaged" in out


def test_json_keeps_an_int_key_beside_the_str_key_of_its_digits(capsys: pytest.CaptureFixture[str],
                                                                  store_path: Path) -> None:
    """Metadata converted for JSON is never dropped: an int key and a str key that read alike both stay."""
    with open_store(store_path) as s:
        s.save({"w": torch.ones(2)}, step=1, metadata={1: "int", "1": "str", "k": {2: "a", "b": 3}})
    rc, out, err = cli(capsys, "ls", store_path, "--json")
    assert (rc, err) == (0, "")
    assert _strict_json(out)[0]["metadata"] == {"1": "int", "'1'": "str", "'k'": {"2": "a", "b": 3}}


def test_json_prints_a_metadata_int_of_any_size(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """An int of more digits than Python converts at once (4300) is metadata ls prints; --json prints it too, in
    full, and leaves the process's limit as it was."""
    big = 7 * 10**5000
    with open_store(store_path) as s:
        s.save({"w": torch.ones(2)}, step=1, metadata={"n": big, "k": [-big]})
    limit = sys.get_int_max_str_digits()
    for command in ("ls", "log"):
        rc, out, err = cli(capsys, command, store_path, "--json")
        assert (rc, err) == (0, "")
        assert re.search(r'"n": 7(0{5000}),', out) and re.search(r"-7(0{5000})\n", out)
    rc, out, err = cli(capsys, "show", store_path, 1, "--json")
    assert (rc, err) == (0, "") and '"n": 7' in out
    assert sys.get_int_max_str_digits() == limit


def test_get_prints_values_and_tensors(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    w = torch.tensor([[1.0, -2.0, float("nan")], [4.0, float("inf"), 0.5]])
    state = {"w": w, "n": torch.arange(3, dtype=torch.int64), "b": torch.tensor([True, False, True]),
             "e": torch.zeros(0), "a": np.arange(4, dtype=np.int16), "opt": {"lr": 0.25, "name": "a\nb", "k": [1, 2]}}
    with open_store(store_path) as s:
        s.save(state, step=1)
        before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "get", store_path, 1, "opt.lr")
    assert (rc, out, err) == (0, "opt.lr: 0.25\n", "")
    rc, out, _ = cli(capsys, "get", store_path, "latest", "opt")
    assert out.splitlines() == ["opt.lr: 0.25", "opt.name: 'a\\nb'", "opt.k[0]: 1", "opt.k[1]: 2"]
    rc, out, _ = cli(capsys, "get", store_path, 1, "w")
    head, *values = out.splitlines()
    assert head == "w: torch float32 2x3  min -2 max 4 mean 0.875 std 2.13234  non-finite 2"
    assert "\n".join(values) == str(w)
    rc, out, _ = cli(capsys, "get", store_path, 1, "n")
    assert out.splitlines()[0] == "n: torch int64 3  min 0 max 2"
    rc, out, _ = cli(capsys, "get", store_path, 1, "b")
    assert out.splitlines()[0] == "b: torch bool 3  true 2 of 3"
    rc, out, _ = cli(capsys, "get", store_path, 1, "e")
    assert out.splitlines()[0] == "e: torch float32 0  (empty)"
    rc, out, _ = cli(capsys, "get", store_path, 1, "a")
    assert out.splitlines() == ["a: numpy <i2 4  min 0 max 3", repr(np.arange(4, dtype=np.int16))]
    if hasattr(torch, "uint1"):  # sub-byte dtypes: no statistics, and values only where torch can print them
        with open_store(store_path) as s:
            s.save({"u": torch.zeros(16, dtype=torch.uint1)}, step=2)
        rc, out, _ = cli(capsys, "get", store_path, 2, "u")
        assert rc == 0 and out.splitlines()[0] == "u: torch uint1 16"
        before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "get", store_path, 1, "op")  # a key path, not a prefix of one
    assert rc == 1 and out == ""
    assert_one_line_error(err, "holds nothing at 'op'")
    assert dir_snapshot(store_path) == before


def test_get_json_prints_a_value_a_tensor_or_the_leaves_of_a_subtree(capsys: pytest.CaptureFixture[str],
                                                                     store_path: Path) -> None:
    """``get --json``: a leaf as an object with its key and a plain value's value, or a tensor's kind, dtype,
    shape, exact statistics (those numpy computes of its finite values) and its values where the table prints every
    one, or what a value never unpickled is; a subtree (a container, even of one leaf; a key path naming several
    leaves) a list of its leaves' objects as the table's lines. Errors stay one line with nothing on stdout."""
    w = torch.tensor([[1.0, -2.0, float("nan")], [4.0, float("inf"), 0.5]])
    big = torch.arange(1001, dtype=torch.float32) / 7  # (past the print threshold: the table summarizes)
    state = {"w": w, "n": torch.tensor([-(2**62) - 1, 5]), "b": torch.tensor([True, False, True]),
             "e": torch.zeros(0), "a": np.arange(4, dtype=np.int16), "big": big, "nan": torch.full((2,), float("nan")),
             "opt": {"lr": 0.25, "name": "a\nb", "k": [1, 2], "m": torch.ones(2)}, "one": {"x": (7,)},
             "": {"d": 5}, "d": 6, "f": float("-inf"), "obj": fractions.Fraction(1, 3),
             "s": "<pickled, not unpickled here>", "dtype": {"dtype": "float32"}}
    with open_store(store_path) as s:
        s.save(state, step=1, allow_pickle=True)
        loaded = s.load(step=1, allow_pickle=True)

    def get(key: str) -> Any:
        rc, out, err = cli(capsys, "get", store_path, 1, key, "--json")
        assert (rc, err) == (0, "")
        return _strict_json(out)

    assert get("opt.lr") == {"key": "opt.lr", "value": loaded["opt"]["lr"]}
    assert get("opt.name") == {"key": "opt.name", "value": "a\nb"} and get("f") == {"key": "f", "value": "-inf"}
    assert get("opt.k[1]") == {"key": "opt.k[1]", "value": loaded["opt"]["k"][1]}
    # a value never unpickled, a string that reads like one, a dict value that reads like a tensor's: told apart
    assert get("obj") == {"key": "obj", "undecoded": "<pickled, not unpickled here>"}
    assert get("s") == {"key": "s", "value": "<pickled, not unpickled here>"}
    assert get("dtype") == [{"key": "dtype.dtype", "value": "float32"}]
    doc = get("w")
    x = loaded["w"].double().numpy()
    finite = x[np.isfinite(x)]
    assert (doc["key"], doc["kind"], doc["dtype"], doc["shape"]) == ("w", "torch", "float32", list(w.shape))
    assert doc["statistics"] == {"min": finite.min(), "max": finite.max(), "mean": pytest.approx(finite.mean()),
                                 "std": pytest.approx(finite.std()), "non_finite": x.size - finite.size}
    assert doc["values"] == [[1.0, -2.0, "nan"], [4.0, "inf", 0.5]]
    assert get("n")["statistics"] == {"min": -(2**62) - 1, "max": 5}  # (exact, past 2**53)
    assert get("n")["values"] == loaded["n"].tolist()
    assert get("b")["statistics"] == {"true": int(loaded["b"].sum())}
    assert (get("e")["statistics"], get("e")["values"]) == ({}, [])
    assert get("nan")["statistics"] == {"non_finite": 2}
    doc = get("a")
    assert (doc["kind"], doc["statistics"], doc["values"]) == ("numpy", {"min": 0, "max": 3}, loaded["a"].tolist())
    doc = get("big")
    assert doc["values"] is None and doc["statistics"]["max"] == pytest.approx(float(loaded["big"].max()))
    rc, out, _ = cli(capsys, "get", store_path, 1, "big")
    assert "..." in out  # (the table prints some of its values only)
    leaves = get("opt")  # a subtree: its leaves in order, tensors without their values
    assert [leaf["key"] for leaf in leaves] == ["opt.lr", "opt.name", "opt.k[0]", "opt.k[1]", "opt.m"]
    assert [leaf.get("value") for leaf in leaves[:4]] == [0.25, "a\nb", 1, 2]
    assert leaves[4] == {"key": "opt.m", "kind": "torch", "dtype": "float32", "shape": [2],
                         "statistics": {"min": 1.0, "max": 1.0, "mean": 1.0, "std": 0.0, "non_finite": 0}}
    assert get("one") == get("one.x") == [{"key": "one.x[0]", "value": 7}]  # (a container of one leaf)
    assert get("d") == [{"key": "d", "value": 5}, {"key": "d", "value": 6}]  # (two leaves of one key path)
    rc, out, _ = cli(capsys, "get", store_path, 1, "<root>")  # every leaf, as the table's lines
    assert [leaf["key"] for leaf in get("<root>")] == [line.split(": ")[0] for line in out.splitlines()]
    rc, out, err = cli(capsys, "get", store_path, 1, "op", "--json")
    assert (rc, out) == (1, "")
    assert_one_line_error(err, "holds nothing at 'op'")


def test_get_json_of_a_container_whose_one_leaf_has_its_key_path_is_a_list(capsys: pytest.CaptureFixture[str],
                                                                           store_path: Path) -> None:
    """``get --json`` of a key path naming a container is a list of its leaves, also where the container's one leaf
    has that key path too: ``<root>`` of ``{"": 5}`` (an empty ``str`` key adds nothing to a path) or of
    ``{"<root>": 5}`` is a dict, not the leaf; it printed the leaf's object, as for a state that is ``5``."""
    with open_store(store_path) as s:
        s.save({"": 5}, step=1)
        s.save({"<root>": 5}, step=2)
        s.save(5, step=3)
    for step, key in ((1, ""), (2, "<root>")):
        rc, out, err = cli(capsys, "get", store_path, step, "<root>", "--json")
        assert (rc, err, _strict_json(out)) == (0, "", [{"key": key, "value": 5}])
    rc, out, err = cli(capsys, "get", store_path, 3, "<root>", "--json")  # (the state is the leaf itself)
    assert (rc, err, _strict_json(out)) == (0, "", {"key": "", "value": 5})


def test_get_json_values_of_a_longdouble_array_are_numbers(capsys: pytest.CaptureFixture[str],
                                                           store_path: Path) -> None:
    """``get --json`` of a longdouble (float128) array: its values numbers (their nearest floats) as its
    statistics are, not strings: numpy's ``tolist()`` keeps longdouble scalars, which JSON output turned into their
    ``str`` ("1.5"); a value that is not finite is still ``"nan"``."""
    with open_store(store_path) as s:
        s.save({"x": np.array([1.5, -0.25, np.nan], dtype=np.longdouble)}, step=1)
    rc, out, err = cli(capsys, "get", store_path, 1, "x", "--json")
    doc = _strict_json(out)
    assert (rc, err, doc["values"], doc["statistics"]["max"]) == (0, "", [1.5, -0.25, "nan"], 1.5)


def test_get_statistics_work_in_blocks_not_float64_copies() -> None:
    """``get``'s statistics of a large float tensor or array take a few blocks of temporaries, not several float64
    copies of it (a 300 MB tensor peaked 2.1 GB above it: its float64 copy, the finite values' copy, std's
    deviations), and print what numpy computes over the whole."""
    import tracemalloc

    from deltackpt.cli import _stats

    a = np.random.default_rng(0).standard_normal(1 << 23, dtype=np.float32)  # 32 MiB
    a[::1000] = np.nan
    a[7] = np.inf
    for value in (a, torch.from_numpy(a), torch.from_numpy(a).bfloat16()):
        x = np.asarray(value, dtype=np.float64) if isinstance(value, np.ndarray) else value.double().numpy()
        finite = x[np.isfinite(x)]
        want = (f"  min {finite.min():.6g} max {finite.max():.6g} mean {finite.mean():.6g} std {finite.std():.6g}"
                f"  non-finite {x.size - finite.size}")
        del x, finite
        tracemalloc.start()
        try:
            got = _stats(value)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got == want
        # numpy's allocations are traced: a float64 block and the copies made of it (4.5 MiB), not 5x a.nbytes
        assert peak < 8 << 20, peak


def test_get_hint_names_the_checkpoint_asked_about(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """``get`` of a key a checkpoint lacks hints at the diff that lists its key paths: by id when a newer
    checkpoint of its step exists (the step names that one, whose keys the hint listed)."""
    with open_store(store_path) as s:
        old = s.save({"a": 1}, step=4)
        s.load(step=4)
        s.save({"b": 2}, step=4)
    rc, _, err = cli(capsys, "get", store_path, old.id, "c")
    assert rc == 1
    assert_one_line_error(err, f"checkpoint {old.id} (step 4) holds nothing at 'c'",
                          f"deltackpt diff {store_path} {old.id} {old.id} --all")
    rc, _, err = cli(capsys, "get", store_path, 4, "c")
    assert rc == 1
    assert_one_line_error(err, f"deltackpt diff {store_path} 4 4 --all")


def test_get_matches_places_and_prints_exact_integers(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """A key path names a place or a container it lies in, not a string prefix (``lr`` is not ``lr.warmup``'s
    container when that is one key); the escaped form listings print works; integer statistics are exact past
    2**53."""
    with open_store(store_path) as s:
        s.save({"lr.warmup": 1, "layers": [5], "tab\tkey": 2, "a": {"b": 3},
                "big": torch.tensor([2**62 + 1, 2**62 + 3]), "be": np.array([2**63 - 1], dtype=">i8")}, step=1)
    for key in ("lr", "layer", "a.c"):
        rc, out, err = cli(capsys, "get", store_path, 1, key)
        assert rc == 1 and out == ""
        assert_one_line_error(err, f"holds nothing at {key!r}", f"deltackpt diff {store_path} 1 1 --all")
    assert cli(capsys, "get", store_path, 1, "lr.warmup")[1] == "lr.warmup: 1\n"
    assert cli(capsys, "get", store_path, 1, "layers")[1] == "layers[0]: 5\n"
    assert cli(capsys, "get", store_path, 1, "a")[1] == "a.b: 3\n"
    assert cli(capsys, "get", store_path, 1, "tab\\tkey")[1] == "tab\\tkey: 2\n"  # as show and diff print it
    assert cli(capsys, "get", store_path, 1, "tab\tkey")[1] == "tab\\tkey: 2\n"
    assert cli(capsys, "get", store_path, 1, "big")[1].splitlines()[0] == \
        f"big: torch int64 2  min {2**62 + 1} max {2**62 + 3}"
    assert cli(capsys, "get", store_path, 1, "be")[1].splitlines()[0] == \
        f"be: numpy >i8 1  min {2**63 - 1} max {2**63 - 1}"
    rc, out, _ = cli(capsys, "get", store_path, 1, "<root>")
    assert rc == 0 and len(out.splitlines()) == 6


def test_get_reads_only_the_chunks_of_what_it_prints(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """The damaged frame of one tensor does not stop printing another; the damaged one is reported by chunk."""
    with open_store(store_path) as s:  # one chunk each, one pack: the first frame is w's
        s.save({"w": rand(4000, 1), "other": rand(4000, 2)}, step=1)
    [pack] = pack_files(store_path)
    data = bytearray(pack.read_bytes())
    _, _, _, _, _, raw_len, stored_len, digest, _, _ = FRAME_HEADER.unpack_from(data, PACK_HEADER_LEN)
    data[PACK_HEADER_LEN + FRAME_HEADER.size + stored_len // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    rc, out, _ = cli(capsys, "get", store_path, 1, "other")
    assert rc == 0 and out.startswith("other: torch float32 1000  min ")
    rc, out, err = cli(capsys, "get", store_path, 1, "w")
    assert rc == 1 and out == ""
    assert_one_line_error(err, f"{digest.hex()}-{raw_len}", "'w'")


# -- rm / gc / repair --------------------------------------------------------------------------------------


def test_rm_then_gc_frees_space(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    states, ids = {}, {}
    for step in (1, 2, 3):  # one handle per save: one pack per checkpoint; distinct keys: no delta frames
        states[step] = {f"t{step}": rand(3 * CS, step)}
        with open_store(store_path) as s:
            ids[step] = s.save(states[step], step=step).id
    assert len(pack_files(store_path)) == 3

    rc, out, err = cli(capsys, "gc", store_path)  # nothing to reclaim yet
    assert rc == 0 and err == ""
    assert out.startswith("dropped 0 dead chunk(s); deleted 0 pack(s)") and out.strip().endswith("freed 0 B")

    rc, out, err = cli(capsys, "rm", store_path, 2)
    assert rc == 0 and err == ""
    assert out.splitlines() == [f"deleted checkpoint {ids[2]} (step 2)", "run 'deltackpt gc' to reclaim space"]
    assert ls_pairs(capsys, store_path) == [(1, ids[1]), (3, ids[3])]

    before = sum(p.stat().st_size for p in pack_files(store_path))
    rc, out, err = cli(capsys, "gc", store_path)
    assert rc == 0 and err == ""
    m = re.match(r"dropped (\d+) dead chunk\(s\); deleted (\d+) pack\(s\) .* freed (\d+(?:\.\d)? \w+)$", out.strip())
    assert m, out
    assert int(m[1]) == 3 and int(m[2]) == 1
    after = sum(p.stat().st_size for p in pack_files(store_path))
    assert len(pack_files(store_path)) == 2
    assert size_of(m[3]) == pytest.approx(before - after, rel=0.01) and before - after > 2 * CS

    rc, out, _ = cli(capsys, "verify", store_path)
    assert rc == 0 and out.strip().endswith(": OK")
    with open_store(store_path) as s:
        for step in (1, 3):
            assert_same_state(states[step], s.load(step))


def test_rm_several_and_latest(capsys: pytest.CaptureFixture[str], store_path: Path, three: dict[str, Any]) -> None:
    ids = three["ids"]
    rc, out, err = cli(capsys, "rm", store_path, "latest", ids[1])
    assert rc == 0 and err == ""
    assert f"deleted checkpoint {ids[3]} (step 3)" in out and f"deleted checkpoint {ids[1]} (step 1)" in out
    assert ls_pairs(capsys, store_path) == [(2, ids[2])]


def test_rm_resolves_every_argument_before_deleting_any(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                        three: dict[str, Any]) -> None:
    """A failed rm deletes nothing: before, `rm S 1 notanid` deleted step 1, then failed on the bad id."""
    ids = three["ids"]
    for bad in (["1", "notanid"], ["2", "99"], ["latest", "\u00b9"]):
        rc, out, err = cli(capsys, "rm", store_path, *bad)
        assert rc == 1 and out == ""
        assert_one_line_error(err)
        assert ls_pairs(capsys, store_path) == sorted(ids.items())
    rc, out, err = cli(capsys, "rm", store_path, 3, 3, ids[3])  # one checkpoint named three times: deleted once
    assert rc == 0 and err == ""
    assert out.splitlines() == [f"deleted checkpoint {ids[3]} (step 3)", "run 'deltackpt gc' to reclaim space"]
    assert ls_pairs(capsys, store_path) == [(1, ids[1]), (2, ids[2])]


def test_du_counts_what_retained_checkpoints_reach(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """After deleting checkpoints, du's unique and stored bytes are those of the retained ones, and "reclaimable
    by gc" is what gc then frees (before, chunks of deleted checkpoints counted as live: 16 B reclaimable)."""
    with open_store(store_path) as s:
        for step in range(1, 6):
            s.save({f"t{step}": rand(3 * CS, step)}, step=step)
        for step in range(1, 5):
            s.delete(step)
    rc, out, err = cli(capsys, "du", store_path)
    assert rc == 0 and err == ""
    du = _du(out)
    assert du["unique chunk bytes (what retained checkpoints reach)"].endswith(" in 3 chunks")
    reclaimable = size_of(du["dead bytes in packs (what gc --repack-below 1 frees)"])
    with open_store(store_path) as s:
        freed = s.gc().freed_bytes
    assert freed > 8 * CS and reclaimable == pytest.approx(freed, rel=0.05)


@pytest.mark.plumbing
def test_output_to_a_closed_pipe_is_not_an_error(store_path: Path, three: dict[str, Any]) -> None:
    """`deltackpt ls STORE | head -1`: the reader goes away; deltackpt exits 141 (as on SIGPIPE) with nothing
    on stderr, where it printed "error: [Errno 32] Broken pipe" and exited 1."""
    for cmd in (["ls"], ["log"], ["du"], ["verify"], ["resume-info"]):
        p = subprocess.Popen([sys.executable, "-m", "deltackpt", *cmd, str(store_path)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # before anything is written: the first write meets a closed pipe
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141 and err == "", (cmd, err)


def test_repair_restores_checkpoints_after_index_loss(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                      three: dict[str, Any]) -> None:
    shutil.rmtree(store_path / "index")
    rc, out, err = cli(capsys, "ls", store_path)  # a read command creates nothing, an empty index least of all
    assert rc == 1 and out == "" and "repair" in err
    assert_one_line_error(err)
    rc, out, err = cli(capsys, "repair", store_path)
    assert rc == 0 and err == ""
    m = re.fullmatch(r"indexed (\d+) chunk\(s\) from (\d+) pack\(s\); 3 checkpoint\(s\) restored", out.strip())
    assert m, out
    assert int(m[1]) == 12 and int(m[2]) == len(pack_files(store_path))
    assert ls_pairs(capsys, store_path) == sorted(three["ids"].items())
    with open_store(store_path) as s:
        for step, st in three["states"].items():
            assert_same_state(st, s.load(step))


def test_rm_and_repair_json_name_what_they_deleted_and_what_the_index_holds(capsys: pytest.CaptureFixture[str],
                                                                           store_path: Path,
                                                                           three: dict[str, Any]) -> None:
    """``rm --json``: the checkpoints it deleted, with the fields ``ls`` gives them (a bad argument deletes
    nothing and prints nothing on stdout). ``repair --json``: the fields of ``Store.repair()``'s report, what
    the rebuilt index holds and what it passed over, with its exit status (1 when it passed anything over)."""
    from deltackpt import maintenance

    with open_store(store_path) as s:
        infos = {i.step: i for i in s.list()}
        m3 = s.manifest(step=3)
        (_, d, n), *_ = m3.chunk_keys(next(t for t in m3.tensors if t.key == "w"))
        loc = s.index.lookup_chunks([chunk_key(d, n)])[chunk_key(d, n)]
    rc, out, err = cli(capsys, "rm", store_path, 1, "9", "--json")
    assert (rc, out) == (1, "")
    assert_one_line_error(err, "step 9")
    rc, out, err = cli(capsys, "rm", store_path, 1, "1", "--json")
    assert (rc, err) == (0, "")
    assert _strict_json(out) == {"deleted": [{"step": 1, "id": infos[1].id, "created": infos[1].created,
                                              "parent": infos[1].parent, "logical_bytes": infos[1].logical_bytes,
                                              "written_bytes": infos[1].written_bytes, "metadata": {"epoch": 1}}]}
    assert ls_pairs(capsys, store_path) == [(2, infos[2].id), (3, infos[3].id)]

    shutil.rmtree(store_path / "index")
    rc, out, err = cli(capsys, "repair", store_path, "--json")
    doc = _strict_json(out)
    assert (rc, err) == (0, "")
    with open_store(store_path) as s:
        assert doc == {"packs": len(pack_files(store_path)), "chunks": sum(1 for _ in s.index.iter_chunks()),
                       "checkpoints": len(s.list()), "lost_checkpoints": [], "incomplete_checkpoints": [],
                       "damaged_packs": []}
        assert doc["checkpoints"] == 2  # (the deleted step's manifest is gone: rm deleted it for good)
    manifest = store_path / "manifests" / f"{infos[2].id}.manifest"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    manifest.write_bytes(bytes(data))
    damage_frame(store_path, loc)  # a chunk of step 3's
    shutil.rmtree(store_path / "index")
    rc, out, err = cli(capsys, "repair", store_path, "--json")
    doc = _strict_json(out)
    assert (rc, err) == (1, "")
    assert (doc["lost_checkpoints"], doc["incomplete_checkpoints"]) == ([infos[2].id], [infos[3].id])
    assert len(doc["damaged_packs"]) == 1 and loc.pack_id in doc["damaged_packs"][0]
    with maintenance.open_for_repair(store_path) as s:  # what the Python API says of the same store
        assert doc == dataclasses.asdict(s.repair())


def test_damaged_index_is_a_one_line_error(capsys: pytest.CaptureFixture[str], store_path: Path,
                                           three: dict[str, Any]) -> None:
    data = store_path / "index" / "data.mdb"
    with open(data, "r+b") as f:
        f.write(b"\xff" * 4096)
    rc, out, err = cli(capsys, "ls", store_path)
    assert rc == 1 and out == ""
    assert_one_line_error(err)
    rc, out, _ = cli(capsys, "repair", store_path)  # repair moves the damaged index aside and rebuilds it
    assert rc == 0 and "3 checkpoint(s) restored" in out
    assert ls_pairs(capsys, store_path) == sorted(three["ids"].items())


# -- keep -------------------------------------------------------------------------------------------------


def test_keep_applies_a_retention_policy_and_dry_run_changes_nothing(capsys: pytest.CaptureFixture[str],
                                                                     store_path: Path) -> None:
    """``deltackpt keep``: --dry-run lists what the policy drops and leaves every file as it was; the real run
    deletes exactly those (tagged ones kept unless --no-tagged), every kept one still loads, and --gc frees
    the space of the deleted ones."""
    states = {i: {"w": rand(2 * CS, i)} for i in range(10)}
    with open_store(store_path) as s:
        for i, st in states.items():
            s.save(st, step=i, metadata={"loss": 0.5 if i == 3 else 10.0 - i, **({"tag": "warm"} if i == 1 else {})})
    before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "keep", store_path, "--last", "3", "--every", "4", "--best", "loss:min", "--dry-run")
    assert rc == 0 and err == ""
    assert [int(m) for m in re.findall(r"would delete checkpoint \w+ \(step (\d+)\)", out)] == [2, 5, 6]
    assert "would delete 3 of 10 checkpoint(s)" in out
    assert dir_snapshot(store_path) == before
    rc, out, err = cli(capsys, "keep", store_path, "--last", "3", "--every", "4", "--best", "loss:min")
    assert rc == 0 and "deleted 3 of 10" in out and "deltackpt gc" in out
    assert [step for step, _ in ls_pairs(capsys, store_path)] == [0, 1, 3, 4, 7, 8, 9]
    rc, out, err = cli(capsys, "keep", store_path, "--last", "2", "--no-tagged", "--gc")
    assert rc == 0 and "deleted 5 of 7" in out
    freed = re.search(r"gc \S+: freed (.+)$", out, re.M)
    assert freed is not None and size_of(freed.group(1)) > 5 * CS
    with open_store(store_path) as s:
        assert [i.step for i in s.list()] == [8, 9]
        for i in s.list():
            assert_same_state(s.load(id=i.id), states[i.step])


def test_keep_json_names_what_it_deleted_and_what_gc_did(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                         tmp_path: Path) -> None:
    """``keep --json``: the checkpoints the policy drops (as ``Store.retain`` names them), with --dry-run deleting
    nothing; with --gc each store's gc report, and the exit status 1 when a gc met a damaged live frame, as
    without --json. A refused policy is one line on stderr and nothing on stdout."""
    with open_store(store_path) as s:
        for i in range(6):  # (the three it drops hold most of the pack: its gc repacks it whatever the frame sizes)
            s.save({"w": rand((2 if i in (1, 4, 5) else 6) * CS, i)}, step=i,
                   metadata={"loss": 0.5 if i == 1 else 10.0 - i, "run": (i, "x")})
        policy = deltackpt.Retention(keep_last=2, keep_best=("loss", "min"))
        dropped = s.retain(policy, dry_run=True)
    before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "keep", store_path, "--last", "2", "--best", "loss:min", "--dry-run", "--json")
    doc = _strict_json(out)
    assert (rc, err, doc["dry_run"], doc["dcp_root"], doc["total"], doc["gc"]) == (0, "", True, False, 6, None)
    assert [(d["id"], d["step"], d["created"], d["parent"], d["logical_bytes"], d["written_bytes"]) for d in
            doc["deleted"]] == [(i.id, i.step, i.created, i.parent, i.logical_bytes, i.written_bytes) for i in dropped]
    assert [d["metadata"] for d in doc["deleted"]] == [{"loss": i.metadata["loss"], "run": [i.step, "x"]}
                                                      for i in dropped]
    assert dir_snapshot(store_path) == before and len(dropped) == 3
    packs_before = sum(p.stat().st_size for p in pack_files(store_path))
    rc, out, err = cli(capsys, "keep", store_path, "--last", "2", "--best", "loss:min", "--gc", "--json")
    doc = _strict_json(out)
    assert (rc, err, doc["dry_run"], doc["total"]) == (0, "", False, 6)
    assert [d["id"] for d in doc["deleted"]] == [i.id for i in dropped]
    with open_store(store_path) as s:
        assert {i.id for i in s.list()}.isdisjoint(d["id"] for d in doc["deleted"]) and len(s.list()) == 3
    (report,) = doc["gc"]
    assert report["store"] == store_path.name and (report["repack_stopped"], report["damaged_packs"]) == (None, [])
    assert report["freed_bytes"] == packs_before - sum(p.stat().st_size for p in pack_files(store_path)) > 0
    rc, out, err = cli(capsys, "keep", store_path, "--last", "1", "--best", "lost:min", "--json")
    assert (rc, out) == (1, "")
    assert_one_line_error(err, "no checkpoint records 'lost'")

    damaged = tmp_path / "damaged"  # a sparse pack whose live frame is damaged: gc does not repack it
    a = rand(CS, 7)
    with open_store(damaged) as s:
        s.save({"a": a, "b": rand(6 * CS, 8)}, step=1)
        s.save({"a": a}, step=2)
        m = s.manifest(step=2)
        (_, d, n), = m.chunk_keys(m.tensors[0])
        loc = s.index.lookup_chunks([chunk_key(d, n)])[chunk_key(d, n)]
    damage_frame(damaged, loc)
    rc, out, err = cli(capsys, "keep", damaged, "--last", "1", "--gc", "--json")
    doc = _strict_json(out)
    assert (rc, err, [d["step"] for d in doc["deleted"]]) == (1, "", [1])
    assert len(doc["gc"][0]["damaged_packs"]) == 1 and loc.pack_id in doc["gc"][0]["damaged_packs"][0]


def test_keep_gc_names_the_store_in_the_current_directory(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``keep . --gc`` (run inside the store) names the store it gc'ed '.', in the table and in ``--json``'s
    ``store``: ``Path('.').name`` is empty, and the table printed 'gc : freed', the JSON an empty name."""
    with open_store(store_path) as s:
        for i in range(3):
            s.save({"w": rand(2 * CS, i)}, step=i)
    monkeypatch.chdir(store_path)
    rc, out, err = cli(capsys, "keep", ".", "--last", "2", "--gc", "--json")
    assert (rc, err) == (0, "") and [r["store"] for r in _strict_json(out)["gc"]] == ["."]
    rc, out, err = cli(capsys, "keep", ".", "--last", "1", "--gc")
    assert (rc, err) == (0, "") and "gc .: freed " in out


def _dcp_root(root: Path, steps: Any) -> None:
    """A sharded (DCP) root under ``root`` of one rank, one step each of ``steps`` (a float tensor that changes a
    little each step), saved in this process; each step's metadata records its ``loss``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from deltackpt.distributed import DeltaStorageWriter

    x = rand(4 * CS, 0)
    w = DeltaStorageWriter(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in steps:
            w.step, w.metadata = step, {"loss": 0.1 if step == 2 else 10.0 - step}
            x[:10] += 1.0
            dcp.save({"x": x}, storage_writer=w, **DCP_NO_DIST)
    w.close()


def test_keep_json_on_a_dcp_root_names_the_steps(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``keep --json`` on a sharded (DCP) root: the steps it drops (as ``distributed.retain`` names them, with
    their writers' metadata), and with --gc the report of each store of the root."""
    from deltackpt import distributed

    root = tmp_path / "ckpt"
    _dcp_root(root, range(1, 6))
    policy = deltackpt.Retention(keep_last=2, keep_best=("loss", "min"))
    dropped = distributed.retain(root, policy, dry_run=True)
    listed = {i.step: i for i in distributed.summary(root)}
    before = dir_snapshot(root)
    rc, out, err = cli(capsys, "keep", root, "--last", "2", "--best", "loss:min", "--dry-run", "--json")
    doc = _strict_json(out)
    assert (rc, err, doc["dry_run"], doc["dcp_root"], doc["total"], doc["gc"]) == (0, "", True, True, 5, None)
    assert doc["deleted"] == [{"step": i.step, "id": i.id, "committed": i.created,
                               "metadata": listed[i.step].metadata} for i in dropped]
    assert [d["step"] for d in doc["deleted"]] == [1, 3] and dir_snapshot(root) == before
    rc, out, err = cli(capsys, "keep", root, "--last", "2", "--best", "loss:min", "--gc", "--json")
    doc = _strict_json(out)
    assert (rc, err, [d["step"] for d in doc["deleted"]]) == (0, "", [1, 3])
    assert distributed.steps(root) == [2, 4, 5]
    assert [r["store"] for r in doc["gc"]] == [p.name for p in distributed.stores(root)] == ["meta", "rank-00000"]
    assert all(r["damaged_packs"] == [] and r["repack_stopped"] is None for r in doc["gc"])


def test_dcp_json_lists_the_steps_and_what_rm_prune_gc_and_verify_did(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """``dcp --json``: the root's steps as ``distributed.summary`` gives them, the steps --rm deleted, what --prune
    pruned, each store's gc and verify report, the steps whose names are wrong, and apart the steps that cannot be
    read and the ranks whose store is gone; exit 1 on damage, as without --json."""
    import shutil

    from deltackpt import distributed
    from deltackpt.maintenance import GcReport

    root = tmp_path / "ckpt"
    _dcp_root(root, [1, 2, 3])
    rc, out, err = cli(capsys, "dcp", root, "--json")
    doc = _strict_json(out)
    assert (rc, err) == (0, "")
    assert doc["steps"] == [{"step": i.step, "id": i.id, "committed": i.created, "ranks": i.ranks,
                             "logical_bytes": i.logical_bytes, "written_bytes": i.written_bytes,
                             "metadata": i.metadata} for i in distributed.summary(root)]
    assert [d["metadata"] for d in doc["steps"]] == [{"loss": 9.0}, {"loss": 0.1}, {"loss": 7.0}]
    assert {k: doc[k] for k in ("deleted_steps", "pruned", "gc", "verify", "unreadable", "missing_ranks")} == {
        "deleted_steps": [], "pruned": None, "gc": None, "verify": None, "unreadable": [], "missing_ranks": []}
    rc, out, err = cli(capsys, "dcp", root, "--rm", "1", "--prune", "--gc", "--verify", "--json")
    doc = _strict_json(out)
    assert (rc, err, doc["deleted_steps"], doc["pruned"]) == (0, "", [1], 0)
    assert [d["step"] for d in doc["steps"]] == distributed.steps(root) == [2, 3]
    assert [r["store"] for r in doc["gc"]] == ["meta", "rank-00000"]
    assert all(set(r) == {"store", *vars(GcReport())} and r["damaged_packs"] == [] for r in doc["gc"])
    assert doc["verify"]["steps"] == []
    for report in doc["verify"]["stores"]:
        with deltackpt.Store(root / report["store"]) as st:
            v = st.verify()
        assert report == {"store": report["store"], "ok": True, "checkpoints": v.checkpoints,
                          "chunk_references": v.chunks, "problems": []}
    pack = next((root / "rank-00000" / "packs").glob("*.pack"))
    intact = pack.read_bytes()
    data = bytearray(intact)
    data[len(data) // 2] ^= 0xFF  # damage a frame of the steps' shards
    pack.write_bytes(bytes(data))
    rc, out, err = cli(capsys, "dcp", root, "--verify", "--json")
    doc = _strict_json(out)
    assert (rc, err) == (1, "")
    with deltackpt.Store(root / "rank-00000") as st:
        v = st.verify()
    rank = doc["verify"]["stores"][1]
    assert (rank["store"], rank["ok"], len(rank["problems"])) == ("rank-00000", False, len(v.problems))
    assert {(p["checkpoint"], p["chunk_id"]) for p in rank["problems"]} == {(p.checkpoint, p.chunk_id)
                                                                           for p in v.problems}
    assert cli(capsys, "dcp", root, "--json")[0] == 0  # (the listing reads no chunks)
    pack.write_bytes(intact)
    manifest = root / "meta" / "manifests" / f"{doc['steps'][0]['id']}.manifest"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # step 2's meta checkpoint cannot be read
    manifest.write_bytes(bytes(data))
    rc, out, err = cli(capsys, "dcp", root, "--json")
    doc = _strict_json(out)
    assert (rc, err, [d["step"] for d in doc["steps"]]) == (1, "", [3])
    assert [(u["step"], u["message"]) for u in doc["unreadable"]] == [(2, m) for m in distributed.verify_names(root)]
    shutil.rmtree(root / "rank-00000")
    rc, out, err = cli(capsys, "dcp", root, "--json")
    doc = _strict_json(out)
    assert (rc, doc["missing_ranks"]) == (1, distributed.missing_stores(root)) and doc["missing_ranks"] == [0]
    rc, out, err = cli(capsys, "dcp", root, "--rm", "7", "--json")
    assert (rc, out) == (1, "")
    assert_one_line_error(err, "no DCP checkpoint of step 7")


def test_json_says_what_was_deleted_when_the_gc_after_it_fails(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``keep --gc --json`` and ``dcp --rm --gc --json`` whose gc fails (here: the disk fills) after the deletes
    were committed: stdout still holds the document, with what was deleted and the error's line as ``error``;
    stderr and the exit status are those without --json. (stdout was empty: a script could not tell that
    checkpoints had gone.)"""
    store_path = tmp_path / "store"
    with open_store(store_path) as s:
        for i in range(3):
            s.save({"w": rand(2 * CS, i)}, step=i)
    root = tmp_path / "ckpt"
    _dcp_root(root, [1, 2, 3])
    rc, out, err = cli(capsys, "keep", store_path, "--last", "2", "--gc", "--json")  # (gc works: error null)
    assert (rc, err, [d["step"] for d in _strict_json(out)["deleted"]], _strict_json(out)["error"]) == (
        0, "", [0], None)

    def full(self: deltackpt.Store, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(deltackpt.Store, "gc", full)
    rc, out, err = cli(capsys, "keep", store_path, "--last", "1", "--gc", "--json")
    doc = _strict_json(out)
    line = assert_one_line_error(err, "No space left on device")
    assert (rc, [d["step"] for d in doc["deleted"]], doc["gc"]) == (1, [1], [])
    assert line.endswith(doc["error"]) and "No space left" in doc["error"]
    with deltackpt.Store(store_path, readonly=True) as s:
        assert [i.step for i in s.list()] == [2]
    rc, out, err = cli(capsys, "dcp", root, "--rm", "1", "--gc", "--json")
    doc = _strict_json(out)
    assert_one_line_error(err, "No space left on device")
    assert (rc, doc["deleted_steps"], doc["gc"], doc["steps"]) == (1, [1], [], None)
    assert "No space left" in doc["error"]
    rc, out, err = cli(capsys, "dcp", root, "--rm", "9", "--json")  # refused before anything is done: no document
    assert (rc, out) == (1, "")


def test_keep_refuses_a_best_metric_no_checkpoint_records(capsys: pytest.CaptureFixture[str],
                                                          store_path: Path) -> None:
    """``--best`` with a metric no checkpoint records (a typo) would keep only what the other rules keep,
    deleting the best checkpoint too: refused, naming the metrics recorded, and nothing is deleted."""
    with open_store(store_path) as s:
        for i in range(5):
            s.save({"w": rand(CS, i)}, step=i, metadata={"val_loss": 0.5 if i == 1 else 5.0 - i, "note": "x"})
    before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "keep", store_path, "--last", "1", "--best", "val-loss:min")
    assert rc == 1 and out == ""
    assert "no checkpoint records 'val-loss' as a number (numbers they record: 'val_loss'); nothing deleted" in err
    assert dir_snapshot(store_path) == before
    rc, out, err = cli(capsys, "keep", store_path, "--last", "1", "--best", "val_loss:min")
    assert rc == 0 and "deleted 3 of 5" in out
    assert [step for step, _ in ls_pairs(capsys, store_path)] == [1, 4]


@pytest.mark.parametrize("argv, needle", [
    ([], "give a rule that deletes"),
    (["--no-tagged"], "give a rule that deletes"),
    (["--last", "0"], "--last must be a positive int, got 0"),  # (the flag given, not Retention's field)
    (["--every", "-3"], "--every must be a positive int, got -3"),
    (["--best", "loss:min", "--best-k", "0"], "--best-k must be a positive int, got 0"),
    (["--best-k", "2", "--last", "1"], "--best-k needs --best METRIC:min|max"),
    (["--best-k", "1", "--last", "1"], "--best-k needs --best METRIC:min|max"),
    (["--within=-5m"], "--within must be a finite number of seconds >= 0"),  # (before: a usage error, 2)
])
def test_keep_refuses_a_policy_that_deletes_nothing_or_is_bad(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                              three: dict[str, Any], argv: list[str],
                                                              needle: str) -> None:
    before = dir_snapshot(store_path)
    rc, _, err = cli(capsys, "keep", store_path, *argv)
    assert rc == 1
    assert_one_line_error(err, needle)
    assert dir_snapshot(store_path) == before


@pytest.mark.parametrize("argv, needle", [(["--within", "7x"], "not a duration: '7x'"),
                                          (["--best", "loss"], "expected METRIC:min or METRIC:max, got 'loss'"),
                                          (["--best", "loss:median"], "got 'loss:median'")])
def test_keep_usage_errors(capsys: pytest.CaptureFixture[str], store_path: Path, argv: list[str],
                           needle: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["keep", str(store_path), *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_keep_within_takes_durations() -> None:
    from deltackpt.cli import _duration

    assert [_duration(t) for t in ("90", "90s", "1.5m", "12h", "7d", "2w", ".5h")] == [
        90, 90, 90, 43200, 604800, 1209600, 1800]


# -- export / import ---------------------------------------------------------------------------------------


def test_export_pt_round_trips(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path) -> None:
    state = {
        "model": {"w": rand(2 * CS + 16, 0).reshape(-1, 4), "b": torch.arange(7, dtype=torch.int16),
                  "p": torch.nn.Parameter(torch.randn(3))},
        "layers": [torch.ones(2, 2, dtype=torch.bfloat16), torch.tensor(True)],
        "opt": {"lr": 0.01, "betas": (0.9, 0.999), "name": "adam", "steps": 12, "nothing": None},
    }
    with open_store(store_path) as s:
        s.save({"old": torch.zeros(1)}, step=1)
        s.save(state, step=2)
        expected = s.load(2)
        cid = s.info(2).id
    dest = tmp_path / "out.pt"
    rc, out, err = cli(capsys, "export", store_path, 2, dest)
    assert rc == 0 and err == ""
    assert out.startswith(f"exported checkpoint {cid} (step 2) to {dest} (")  # (the one exported, by id)
    loaded = torch.load(dest, weights_only=True)
    assert_same_state(expected, loaded)
    assert_same_state(state, loaded)
    dest2 = tmp_path / "latest.pth"
    rc, _, _ = cli(capsys, "export", store_path, "latest", dest2)
    assert rc == 0
    assert_same_state(expected, torch.load(dest2, weights_only=True))


def test_export_safetensors_tensor_only(capsys: pytest.CaptureFixture[str], store_path: Path,
                                        tmp_path: Path) -> None:
    from safetensors.torch import load_file

    w = rand(CS + 8, 3).reshape(-1, 2)
    state = {"model": {"w": w, "b": torch.arange(5, dtype=torch.int64)},
             "layers": [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2, 2)], "tied": w}
    with open_store(store_path) as s:
        info = s.save(state, step=4)
        expected = s.load(4)
    dest = tmp_path / "out.safetensors"
    rc, out, err = cli(capsys, "export", store_path, info.id, dest)
    assert rc == 0 and err == ""
    got = load_file(str(dest))
    want = {"model.w": expected["model"]["w"], "model.b": expected["model"]["b"], "layers.0": expected["layers"][0],
            "layers.1": expected["layers"][1], "tied": expected["tied"]}
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


def test_export_key_writes_one_subtree_and_reads_only_its_chunks(capsys: pytest.CaptureFixture[str],
                                                                  store_path: Path, tmp_path: Path) -> None:
    """A Checkpointer's checkpoint holds its step and optimizer beside the model, which safetensors cannot hold:
    --key model exports the model's weights alone, named as its state_dict() names them; --key of one tensor or
    of the optimizer (.pt) works the same way. Only the subtree's chunks are read: a damaged optimizer chunk does
    not stop an export of the model. A key path the checkpoint lacks writes nothing."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(CS // 16, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, CS // 16)).sum().backward()
    opt.step()
    with deltackpt.Checkpointer(store_path, model=model, optimizer=opt, handle_signals=False) as ck:
        ck.save(5)
    with deltackpt.Store(store_path) as s:
        saved = s.load(5)
    dest = tmp_path / "model.safetensors"
    rc, out, err = cli(capsys, "export", store_path, 5, dest)  # the whole checkpoint: refused, with the way out
    assert rc == 1 and not dest.exists()
    assert_one_line_error(err, "['step', 'optimizer.param_groups[0].lr'", "--key model")
    rc, out, err = cli(capsys, "export", store_path, 5, dest, "--key", "model")
    assert rc == 0 and err == "" and out.startswith("exported 'model' of checkpoint ")
    got = load_file(str(dest))
    assert set(got) == set(model.state_dict())
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    rc, _, err = cli(capsys, "export", store_path, 5, tmp_path / "w.safetensors", "--key", "model.0.weight")
    assert rc == 0 and err == ""
    assert list(load_file(str(tmp_path / "w.safetensors"))) == ["model.0.weight"]
    rc, _, err = cli(capsys, "export", store_path, 5, tmp_path / "o.safetensors", "--key", "optimizer")
    assert rc == 1 and not (tmp_path / "o.safetensors").exists()
    assert_one_line_error(err, "['optimizer.param_groups[0].lr'")
    rc, _, err = cli(capsys, "export", store_path, 5, tmp_path / "o.pt", "--key", "optimizer")
    assert rc == 0 and err == ""
    o = torch.load(tmp_path / "o.pt", weights_only=True)
    assert o["param_groups"] == saved["optimizer"]["param_groups"]
    assert all(torch.equal(o["state"][0][k], v) for k, v in saved["optimizer"]["state"][0].items())
    rc, _, err = cli(capsys, "export", store_path, 5, tmp_path / "x.pt", "--key", "model.2")
    assert rc == 1 and not (tmp_path / "x.pt").exists()
    assert_one_line_error(err, "holds nothing at 'model.2'")

    with deltackpt.Store(store_path) as s:
        m = s.manifest(5)
        t = next(t for t in m.tensors if t.key == "optimizer.state[0].exp_avg")
        (_, d, n), = m.chunk_keys(t)[:1]
        loc = s.index.lookup_chunks([chunk_key(d, n)])[chunk_key(d, n)]
    damage_frame(store_path, loc)
    rc, _, err = cli(capsys, "export", store_path, 5, tmp_path / "o2.pt", "--key", "optimizer")
    assert rc == 1 and "exp_avg" in err
    dest.unlink()
    rc, _, err = cli(capsys, "export", store_path, 5, dest, "--key", "model")
    assert rc == 0 and err == "" and set(load_file(str(dest))) == set(model.state_dict())


def test_export_key_refuses_a_key_path_that_names_two_values(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                             tmp_path: Path) -> None:
    """Key paths need not be distinct ('a.b' and 'a' holding 'b'; an empty key adds nothing to a path): --key of
    such a path is refused rather than writing one of the values it names."""
    with deltackpt.Store(store_path) as s:
        s.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}, "": {"k": torch.ones(2)}, "k": torch.zeros(2),
                "e": {}}, step=1)
    rc, _, err = cli(capsys, "export", store_path, 1, tmp_path / "e.pt", "--key", "e")  # (an empty container: one node)
    assert rc == 0 and torch.load(tmp_path / "e.pt", weights_only=True) == {}
    for key in ("a.b", "k"):
        dest = tmp_path / "x.pt"
        rc, _, err = cli(capsys, "export", store_path, 1, dest, "--key", key)
        assert rc == 1 and not dest.exists()
        assert_one_line_error(err, f"holds 2 values at {key!r}")
    rc, _, err = cli(capsys, "export", store_path, 1, tmp_path / "a.pt", "--key", "a")
    assert rc == 0 and torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["b"], torch.zeros(1))
    deltackpt.register_type(_Box, "test_cli.box", lambda b: {"t": b.t}, lambda v: _Box(v["t"]))
    try:  # (a registered type's encoded value has the type's key path: one value)
        with deltackpt.Store(store_path) as s:
            s.save({"box": _Box(torch.ones(2))}, step=2)
        rc, _, err = cli(capsys, "export", store_path, 2, tmp_path / "box.pt", "--key", "box")
        assert (rc, err) == (0, "")
        assert torch.equal(torch.load(tmp_path / "box.pt", weights_only=False).t, torch.ones(2))
    finally:
        deltackpt.unregister_type(_Box)


class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_export_names_a_tensor_alone_by_its_key_path(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                     tmp_path: Path) -> None:
    """A tensor exported alone to .safetensors is named by its key path: the path itself where --key gave it
    with escapes as show prints it, and "" for a checkpoint that is one tensor (exported whole, as before --key)."""
    from safetensors.torch import load_file

    with deltackpt.Store(store_path) as s:
        s.save({"n": {"a\nb": torch.ones(1)}}, step=1)
        s.save(torch.arange(3.0), step=2)
    rc, _, err = cli(capsys, "export", store_path, 1, tmp_path / "a.safetensors", "--key", "n.a\\nb")
    assert (rc, err) == (0, "") and list(load_file(str(tmp_path / "a.safetensors"))) == ["n.a\nb"]
    rc, _, err = cli(capsys, "export", store_path, 2, tmp_path / "b.safetensors")
    assert (rc, err) == (0, "")
    assert torch.equal(load_file(str(tmp_path / "b.safetensors"))[""], torch.arange(3.0))
    rc, _, err = cli(capsys, "export", store_path, 2, tmp_path / "c.safetensors", "--key", "<root>")
    assert (rc, err) == (0, "")  # (the same file: --key <root> names all of it, as show prints it)
    assert list(load_file(str(tmp_path / "c.safetensors"))) == [""]


def test_export_safetensors_refuses_plain_values(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                 tmp_path: Path) -> None:
    with open_store(store_path) as s:
        s.save({"w": torch.ones(3), "lr": 0.1, "cfg": {"name": "x"}, "groups": [{"betas": (0.9, 0.99)}]}, step=1)
    dest = tmp_path / "out.safetensors"
    rc, out, err = cli(capsys, "export", store_path, 1, dest)
    assert rc == 1 and out == ""
    # named as get and show name them (before: 'groups.0.betas.0', which get does not take)
    assert_one_line_error(err, "safetensors", "['lr', 'cfg.name', 'groups[0].betas[0]']", ".pt")
    assert not dest.exists()
    rc, out, err = cli(capsys, "get", store_path, 1, "groups[0].betas[0]")
    assert rc == 0 and out.strip() == "groups[0].betas[0]: 0.9"


def test_export_safetensors_refuses_before_it_loads(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What safetensors cannot hold (a plain value, a key that is not text) is refused from the manifest's
    skeleton: before, the whole checkpoint was loaded first (3.7 s for 10^5 plain values). A state of tensors
    alone is still loaded, once, and exported."""
    from deltackpt import store

    loads: list[Any] = []
    real = store.Store.load
    monkeypatch.setattr(store.Store, "load", lambda self, *a, **kw: loads.append(kw) or real(self, *a, **kw))
    with open_store(store_path) as s:
        s.save({"w": torch.ones(3), **{f"v{i}": i for i in range(1000)}}, step=1)
        s.save({"w": torch.ones(3), "d": {1.5: torch.zeros(1)}}, step=2)
        s.save({"w": torch.ones(3), "b": {"c": torch.zeros(2)}}, step=3)
    for step, shown in ((1, "['v0', 'v1', 'v2']"), (2, "d[1.5]")):
        dest = tmp_path / f"out{step}.safetensors"
        rc, out, err = cli(capsys, "export", store_path, step, dest)
        assert rc == 1 and out == "" and not dest.exists()
        assert_one_line_error(err, "safetensors", shown, ".pt")
    assert loads == []  # (one load of each before)
    rc, out, err = cli(capsys, "export", store_path, 3, tmp_path / "out3.safetensors")
    assert rc == 0 and len(loads) == 1, err


def test_export_refuses_a_dtype_its_format_cannot_hold(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dtype the destination's writer has no encoding for (safetensors: complex128, complex32, the bits
    types, ...; torch.save: the sub-byte integers) is refused from the manifest, naming the key path and the
    dtype, before the checkpoint is loaded. Before, the whole checkpoint was loaded and then refused with the
    writer's bare words: 'cannot write out.safetensors: torch.complex128', 'cannot write out.pt: 'dtype
    torch.uint4 is not recognized''."""
    from deltackpt import store

    loads: list[Any] = []
    real = store.Store.load
    monkeypatch.setattr(store.Store, "load", lambda self, *a, **kw: loads.append(kw) or real(self, *a, **kw))
    with open_store(store_path) as s:
        s.save({"w": torch.ones(3), "b": {"c": torch.ones(2, dtype=torch.complex128)}}, step=1)
        s.save({"w": torch.ones(3), "q": torch.zeros(4, dtype=torch.uint8).view(torch.uint4)}, step=2)
    rc, out, err = cli(capsys, "export", store_path, 1, tmp_path / "out.safetensors")
    assert rc == 1 and out == ""
    assert_one_line_error(err, "safetensors", "b.c", "complex128", ".pt")
    for suffix in (".safetensors", ".pt"):
        rc, out, err = cli(capsys, "export", store_path, 2, tmp_path / f"out{suffix}")
        assert rc == 1 and out == ""
        assert_one_line_error(err, "q", "uint4")
    assert loads == [] and sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    rc, out, err = cli(capsys, "export", store_path, 1, tmp_path / "out.pt")  # (torch.save holds complex128)
    assert rc == 0 and len(loads) == 1, err
    assert torch.equal(torch.load(tmp_path / "out.pt")["b"]["c"], torch.ones(2, dtype=torch.complex128))


def test_export_removes_what_a_killed_export_left(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                 tmp_path: Path) -> None:
    """An export killed while it wrote leaves its temporary file next to the destination (a real one is killed
    here); the next export to that name removes those of this host's processes that are gone, and leaves a live
    process's and another host's alone."""
    with open_store(store_path) as s:
        s.save({"w": rand(64 * CS, 1)}, step=1)
    dest = tmp_path / "out.pt"
    host = re.sub(r"[^A-Za-z0-9-]", "_", os.uname().nodename)
    code = """if True:
        import os, sys, torch, deltackpt.cli
        save = torch.save
        def killed_while_writing(obj, f, *args, **kwargs):
            if not isinstance(f, (str, os.PathLike)):  # (the dtype check's save into memory)
                return save(obj, f, *args, **kwargs)
            with open(f, "wb") as out:
                out.write(b"partial")
            os.kill(os.getpid(), 9)
        torch.save = killed_while_writing
        deltackpt.cli.main(sys.argv[1:])
    """
    done = subprocess.run([sys.executable, "-c", code, "export", str(store_path), "1", str(dest)],
                          capture_output=True, text=True)
    assert done.returncode == -9, done.stderr[-2000:]
    (killed,) = tmp_path.glob(f".out.pt.{host}.*.tmp")
    live = tmp_path / f".out.pt.{host}.{os.getppid()}.tmp"  # (the process that ran these tests)
    elsewhere = tmp_path / f".out.pt.otherhost.{2**22 + 7}.tmp"
    for f in (live, elsewhere):
        f.write_bytes(b"x")
    rc, out, err = cli(capsys, "export", store_path, 1, dest)
    assert (rc, err) == (0, "") and dest.is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted([live.name,
                                                                                            elsewhere.name])
    assert not killed.exists()


def test_export_refuses_a_destination_before_it_loads(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A destination export cannot write (another suffix, a directory, a missing directory) is refused before the
    checkpoint is read: before, the whole checkpoint was loaded first and then refused."""
    from deltackpt import store

    loads: list[Any] = []
    real = store.Store.load
    monkeypatch.setattr(store.Store, "load", lambda self, *a, **kw: loads.append(kw) or real(self, *a, **kw))
    with open_store(store_path) as s:
        s.save({"w": torch.ones(3)}, step=1)
    (tmp_path / "dir.pt").mkdir()
    for dest, shown in ((tmp_path / "out.txt", ".pt or .safetensors"), (tmp_path / "dir.pt", "directory"),
                        (tmp_path / "missing" / "out.pt", "does not exist")):
        rc, out, err = cli(capsys, "export", store_path, 1, dest)
        assert rc == 1 and out == "", err
        assert_one_line_error(err, shown)
    assert loads == []
    rc, out, err = cli(capsys, "export", store_path, 1, tmp_path / "out.pt")
    assert rc == 0 and len(loads) == 1, err


def test_export_safetensors_never_drops_a_tensor(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                 tmp_path: Path) -> None:
    """Two key paths that flatten to the same safetensors name: refuse, or keep both; never lose one."""
    from safetensors.torch import load_file

    with open_store(store_path) as s:
        s.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(3)}}, step=1)
    dest = tmp_path / "out.safetensors"
    rc, out, err = cli(capsys, "export", store_path, 1, dest)
    if rc == 0:
        got = load_file(str(dest))
        assert len(got) == 2, f"the export holds {sorted(got)}: a tensor of the checkpoint was silently dropped"
    else:
        assert rc == 1
        assert_one_line_error(err)
        assert not dest.exists()


def test_export_unknown_suffix(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path,
                               three: dict[str, Any]) -> None:
    dest = tmp_path / "out.npz"
    rc, out, err = cli(capsys, "export", store_path, 1, dest)
    assert rc == 1 and out == ""
    assert_one_line_error(err, "out.npz")
    assert not dest.exists()


def test_import_pt(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path,
                   three: dict[str, Any]) -> None:
    state = {"w": rand(2 * CS, 9), "b": torch.arange(10, dtype=torch.int64), "cfg": {"lr": 0.1, "layers": [1, 2]},
             "pair": (torch.ones(2), "x")}
    src = tmp_path / "weights.pt"
    torch.save(state, src)
    rc, out, err = cli(capsys, "import", store_path, src, "--step", 7)
    assert rc == 0 and err == ""
    m = re.match(rf"imported {re.escape(str(src))} as checkpoint ([0-9a-f]{{16}}) \(step 7\); wrote ", out)
    assert m, out
    assert ls_pairs(capsys, store_path) == [*sorted(three["ids"].items()), (7, m[1])]
    with open_store(store_path) as s:
        info = s.info(7)
        assert info.id == m[1] and info.metadata == {"imported_from": "weights.pt"}
        assert_same_state(torch.load(src, weights_only=True), s.load(7))
        assert_same_state(state, s.load(7))


def test_export_and_import_json(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path) -> None:
    """``export --json`` names the checkpoint written (by id and step), the key path, the file and its size;
    ``import --json`` the file read and the checkpoint stored, with the fields ``ls --json`` gives it."""
    with open_store(store_path) as s:
        s.save({"model": {"w": rand(2 * CS, 1)}, "step": 3}, step=3)
        cid = s.info(3).id
    dest = tmp_path / "w.safetensors"
    rc, out, err = cli(capsys, "export", store_path, "latest", dest, "--key", "model", "--json")
    assert (rc, err) == (0, "")
    assert _strict_json(out) == {"id": cid, "step": 3, "key": "model", "file": str(dest),
                                 "bytes": dest.stat().st_size}
    other = tmp_path / "other"
    rc, out, err = cli(capsys, "import", other, dest, "--step", 9, "--json")
    doc = _strict_json(out)
    assert (rc, err, doc["file"]) == (0, "", str(dest))
    rc, listed, _ = cli(capsys, "ls", other, "--json")
    assert [doc["checkpoint"]] == _strict_json(listed) and doc["checkpoint"]["step"] == 9
    assert doc["checkpoint"]["metadata"] == {"imported_from": "w.safetensors"}


def test_import_with_a_bad_step_creates_no_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    src = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(3)}, src)
    dest = tmp_path / "new"
    rc, out, err = cli(capsys, "import", dest, src, "--step", -1)
    assert rc == 1 and out == ""
    assert_one_line_error(err, "step must be between 0 and 2**63-1, got -1")
    assert not dest.exists()


def test_import_refuses_an_empty_path_and_a_dcp_roots_stores(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``import "" FILE`` made a store in the current directory (every other command refuses an empty path), and
    an import into a DCP root's meta or rank store was taken, which broke the root's listing and loads
    (``keep`` refuses those stores)."""
    src = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(3)}, src)
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    rc, _, err = cli(capsys, "import", "", src, "--step", 1)
    assert rc == 1
    assert_one_line_error(err, "the store path is empty")
    assert list(here.iterdir()) == []
    root = tmp_path / "root"
    for name in ("meta", "rank-00000"):
        with deltackpt.Store(root / name) as s:
            s.save({"x": 1}, step=1)
    for name in ("meta", "rank-00000"):
        before = dir_snapshot(root / name)
        rc, _, err = cli(capsys, "import", root / name, src, "--step", 2)
        assert rc == 1
        assert_one_line_error(err, f"is a store of the sharded (DCP) root {root}")
        assert dir_snapshot(root / name) == before


def test_import_safetensors(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"w": rand(CS, 5), "b": torch.arange(4, dtype=torch.int32)}
    src = tmp_path / "w.safetensors"
    save_file(tensors, str(src))
    rc, out, err = cli(capsys, "import", store_path, src, "--step", 3)
    assert rc == 0 and err == "" and "(step 3)" in out
    with deltackpt.Store(store_path) as s:  # import created the store with the default chunk size
        loaded = s.load(3)
    assert set(loaded) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(loaded[k], t)


_UNPICKLED: list[Any] = []


class _Custom:
    """An arbitrary object: unpickling it would run this module's code."""

    def __init__(self) -> None:
        self.x = 1

    def __getstate__(self) -> dict[str, Any]:
        return {"x": self.x}

    def __setstate__(self, state: dict[str, Any]) -> None:
        _UNPICKLED.append(state)
        self.__dict__.update(state)


def test_import_refuses_arbitrary_pickles(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path,
                                          three: dict[str, Any]) -> None:
    src = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "obj": _Custom()}, src)
    _UNPICKLED.clear()
    before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "import", store_path, src, "--step", 9)
    assert rc == 1 and out == ""
    assert_one_line_error(err, "weights_only")
    assert _UNPICKLED == []
    assert dir_snapshot(store_path) == before
    assert ls_pairs(capsys, store_path) == sorted(three["ids"].items())
    fresh = tmp_path / "fresh"
    rc, _, err = cli(capsys, "import", fresh, src, "--step", 9)
    assert rc == 1 and not fresh.exists()
    assert_one_line_error(err)
    # the file really holds an object whose unpickling runs code (so the refusal above is what kept it out)
    torch.load(src, weights_only=False)
    assert _UNPICKLED == [{"x": 1}]
    _UNPICKLED.clear()
    # a raw pickle of another protocol: one line naming what was refused, not torch's protocol warning on top
    # nor its advice to rerun with weights_only=False
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps({"obj": _Custom()}, protocol=4))
    rc, _, err = cli(capsys, "import", store_path, raw, "--step", 9)
    assert rc == 1 and _UNPICKLED == []
    assert_one_line_error(err, "the weights-only unpickler refused it (Unsupported")
    assert "weights_only` set to `False`" not in err and "Warning" not in err


def test_import_names_what_weights_only_refused_and_creates_nothing(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    """The refusal names the refused type (torch's message puts it on a later line, with terminal escapes);
    a state the store cannot hold is refused before a new store is created for it; a DCP root is no store."""
    import collections

    src = tmp_path / "deque.pt"
    torch.save({"q": collections.deque([1, 2])}, src)
    rc, _, err = cli(capsys, "import", tmp_path / "new", src, "--step", 1)
    assert rc == 1 and not (tmp_path / "new").exists()
    line = assert_one_line_error(err, "collections.deque", "if you trust the file, torch.load it in Python")
    assert "\x1b" not in line and "add_safe_globals" not in line  # (torch's advice is for code, not this command)
    sparse = tmp_path / "sparse.pt"
    torch.save({"s": torch.eye(3).to_sparse()}, sparse)
    rc, _, err = cli(capsys, "import", tmp_path / "new", sparse, "--step", 1)
    assert rc == 1 and not (tmp_path / "new").exists()
    assert_one_line_error(err, "sparse")
    root = tmp_path / "dcp"
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "STORE").write_text("{}")
    ok = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(2)}, ok)
    rc, _, err = cli(capsys, "import", root, ok, "--step", 1)
    assert rc == 1 and sorted(p.name for p in root.iterdir()) == ["meta"]
    assert_one_line_error(err, "sharded (DCP) checkpoint root")


def test_failed_export_is_one_line_and_leaves_no_file(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                      tmp_path: Path) -> None:
    with open_store(store_path) as s:
        s.save({"w": torch.ones(3)}, step=1)
    (tmp_path / "isdir.safetensors").mkdir()
    for dest, needle in ((tmp_path / "isdir.safetensors", "is a directory"),
                         (tmp_path / "nodir" / "x.safetensors", "nodir does not exist"),
                         (tmp_path / "nodir" / "x.pt", "nodir does not exist")):
        rc, out, err = cli(capsys, "export", store_path, 1, dest)
        assert rc == 1 and out == ""
        assert_one_line_error(err, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["isdir.safetensors", "store"]
    link = tmp_path / "link.pt"
    link.symlink_to(tmp_path / "target.pt")
    rc, _, _ = cli(capsys, "export", store_path, 1, link)
    assert rc == 0 and link.is_symlink() and (tmp_path / "target.pt").is_file()  # written through the link


def test_import_damaged_safetensors_is_a_one_line_error(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                        tmp_path: Path, three: dict[str, Any]) -> None:
    src = tmp_path / "broken.safetensors"
    src.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "import", store_path, src, "--step", 9)
    assert rc == 1 and out == ""
    assert_one_line_error(err)
    assert dir_snapshot(store_path) == before


@pytest.mark.parametrize("content", [b"hello world\n", b"", b"PK\x03\x04 not really a zip"])
def test_import_of_a_file_torch_save_did_not_write_says_so(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                           tmp_path: Path, three: dict[str, Any],
                                                           content: bytes) -> None:
    """A text file (or an empty one) given to import is named as no torch.save file; before, the message was
    torch's unpickler's '101'. A file that starts as a zip archive gets torch's reason."""
    src = tmp_path / "in.pt"
    src.write_bytes(content)
    before = dir_snapshot(store_path)
    rc, out, err = cli(capsys, "import", store_path, src, "--step", 9)
    assert rc == 1 and out == ""
    assert_one_line_error(err, "is not a torch.save file" if not content.startswith(b"PK") else
                          "cannot be read with torch.load(weights_only=True)")
    assert dir_snapshot(store_path) == before


# -- resume-info -----------------------------------------------------------------------------------------


def test_resume_info_checkpointer_store(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    with deltackpt.Checkpointer(store_path, model=model, optimizer=opt, scheduler=sched, extra={"epoch": 2},
                                async_save=False, handle_signals=False) as ck:
        ck.save(3)
        ck.save(5, metadata={"loss": 1.5})
        latest = ck.last_info
    assert latest is not None and latest.step == 5

    rc, out, err = cli(capsys, "resume-info", store_path)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"a run would resume from step 5 (checkpoint {latest.id}, saved ")
    parts = {line.split(None, 1)[0]: line.split(None, 1)[1] if " " in line.strip() else ""
             for line in lines[3:] if line and not line.startswith("metadata")}
    assert list(parts) == ["model", "optimizer", "scheduler", "extra", "rng"]
    assert parts["scheduler"].startswith("last_epoch=1, step_size=5, gamma=0.1")  # plain public settings
    assert parts["model"].startswith("2 tensors, 60 B")  # weight 3x4 + bias 3, float32
    assert parts["optimizer"].startswith("1 param group(s), 2 tensors")  # two momentum buffers
    assert parts["extra"] == "keys: epoch"
    assert parts["rng"] == "python, numpy, torch, run"
    assert lines[-1] == "metadata: loss=1.5"
    rc, out, err = cli(capsys, "resume-info", store_path, "--json")  # the same, for scripts
    doc = _strict_json(out)
    assert (rc, err, doc["start_step"], doc["refused"], doc["rng"], doc["verified"]) == (0, "", 5, None, True, False)
    assert doc["checkpoint"]["id"] == latest.id and doc["checkpoint"]["metadata"] == {"loss": 1.5}
    assert doc["parts"] == {
        "model": {"tensors": 2, "bytes": 60},
        "optimizer": {"tensors": 2, "bytes": 60, "param_groups": 1},
        "scheduler": {"tensors": 0, "bytes": 0, "values": {
            k: v for k, v in sched.state_dict().items() if isinstance(v, (int, float, str))}},
        "extra": {"tensors": 0, "bytes": 0, "keys": ["epoch"]},
        "rng": doc["parts"]["rng"] | {"keys": ["python", "numpy", "torch", "run"]},
    }
    # it is the step a Checkpointer would resume from
    with deltackpt.Checkpointer(store_path, model=torch.nn.Linear(4, 3), handle_signals=False) as ck2:
        with pytest.warns(RuntimeWarning, match=r"also holds optimizer, scheduler, extra\['epoch'\]"):
            assert ck2.restore() == 5
    assert "RNG" not in out


def test_resume_info_of_a_checkpoint_holding_pickled_values_says_so(capsys: pytest.CaptureFixture[str],
                                                                    store_path: Path) -> None:
    """A checkpoint of a Checkpointer's layout holding a pickled value (a Store.save with allow_pickle=True, a
    store received from elsewhere): resume-info said it was 'not written by a Checkpointer (no 'step' and
    'model' entries)', which it holds; restore() refuses it for the pickle (UnsafeLoadError)."""
    model = torch.nn.Linear(4, 3)
    with deltackpt.Checkpointer(store_path, model=model, async_save=False, handle_signals=False) as ck:
        ck.save(3)
    with deltackpt.Store(store_path) as s:
        state = s.load()
        state["extra"], state["step"] = {"obj": fractions.Fraction(1, 3)}, 4
        s.save(state, step=4, allow_pickle=True)
    for flags, code in (((), 0), (("--verify",), 1)):
        rc, out, err = cli(capsys, "resume-info", store_path, *flags)
        assert rc == code and "holds pickled values (saved with allow_pickle=True) at 'extra.obj'" in out
        assert "not written by a Checkpointer" not in out
    with deltackpt.Checkpointer(store_path, model=model, handle_signals=False, extra={"obj": None}) as ck:
        with pytest.raises(deltackpt.UnsafeLoadError, match="extra.obj"):
            ck.restore()


def test_resume_info_says_a_checkpoint_holds_no_rng_states(capsys: pytest.CaptureFixture[str],
                                                          store_path: Path) -> None:
    """A checkpoint saved with rng=False, which a default Checkpointer's restore() refuses: resume-info says so
    and how it restores."""
    model = torch.nn.Linear(4, 3)
    with deltackpt.Checkpointer(store_path, model=model, async_save=False, handle_signals=False, rng=False) as ck:
        ck.save(3)
    rc, out, err = cli(capsys, "resume-info", store_path)
    assert rc == 0 and err == ""
    assert "note: it holds no RNG states (a Checkpointer made with rng=False saved it, or a Store.save of the same " \
           "layout did): a default restore() refuses it; a Checkpointer restores it with rng=False" in out
    with deltackpt.Checkpointer(store_path, model=model, handle_signals=False) as ck:
        with pytest.raises(deltackpt.DeltackptError, match="no RNG states"):
            ck.restore()
    with deltackpt.Checkpointer(store_path, model=model, handle_signals=False, rng=False) as ck:
        assert ck.restore() == 3


def test_a_step_entry_that_is_not_the_manifest_step_is_refused_and_resume_info_says_so(
        capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """A Store.save(state, step=N) of a state a Checkpointer captured at another step: restore() returned the
    state's 'step' entry while the store lists the checkpoint at N, and resume-info said a run resumes from N.
    restore() refuses it, naming both steps and the checkpoint, before the model is touched; resume-info says
    so (and --verify exits 1), as it does for other checkpoints restore() refuses."""
    model = torch.nn.Linear(4, 3)
    with deltackpt.Checkpointer(store_path, model=model, async_save=False, handle_signals=False) as ck:
        ck.save(3)
    with deltackpt.Store(store_path) as s:
        info = s.save(s.load(), step=7)  # its 'step' entry is 3
    for flags, code in (((), 0), (("--verify",), 1)):
        rc, out, err = cli(capsys, "resume-info", store_path, *flags)
        assert rc == code and err == ""
        assert out.startswith(f"the newest checkpoint, step 7 (checkpoint {info.id}, saved ")
        assert "its 'step' entry is 3 but its manifest's step is 7" in out and "restore() refuses it" in out
        assert "would resume" not in out
        rc, out, err = cli(capsys, "resume-info", store_path, "--json", *flags)
        doc = _strict_json(out)
        assert (rc, err, doc["start_step"], doc["checkpoint"]["step"]) == (code, "", None, 7)
        assert "its 'step' entry is 3 but its manifest's step is 7" in doc["refused"]
    live = torch.nn.Linear(4, 3)
    before = live.weight.detach().clone()
    with deltackpt.Checkpointer(store_path, model=live, handle_signals=False) as ck:
        for kw in ({}, {"step": 7}):
            with pytest.raises(deltackpt.DeltackptError,
                               match=rf"checkpoint {info.id} \(step 7\): its 'step' entry is 3 but its manifest's "
                                     r"step is 7"):
                ck.restore(**kw)
        assert torch.equal(live.weight, before)  # refused before anything was decoded into it
        assert ck.restore(3) == 3


def test_resume_info_says_restore_refuses_a_dtype_this_torch_does_not_know(
        capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """The newest checkpoint holds a tensor of a dtype a newer torch wrote: restore() raises UnsupportedTypeError
    (it is not damage, and it is not passed over), while `resume-info --verify` said a run would resume from
    it. It says restore() refuses it, naming the dtype, and --verify exits 1."""
    model = torch.nn.Linear(3, 2)
    with deltackpt.Checkpointer(store_path, model=model, handle_signals=False, async_save=False) as ck:
        ck.save(1)
        with entries_written_as(dtype="float4_e9m9_future"):
            ck.save(2)
    for flags, code in (((), 0), (("--verify",), 1)):
        rc, out, err = cli(capsys, "resume-info", store_path, *flags)
        assert rc == code and err == ""
        assert out.startswith("the newest checkpoint, step 2 (checkpoint ")
        assert "'float4_e9m9_future' is unknown to this torch" in out and "restore() refuses it" in out
        assert "would resume" not in out
    with deltackpt.Checkpointer(store_path, model=torch.nn.Linear(3, 2), handle_signals=False) as ck:
        with pytest.raises(deltackpt.UnsupportedTypeError, match="float4_e9m9_future"):
            ck.restore()


def test_resume_info_verify_passes_over_damage_as_restore_does(capsys: pytest.CaptureFixture[str],
                                                               store_path: Path) -> None:
    """With the newest checkpoint damaged, `resume-info` names it (it reads no chunk, and says so) while
    `resume-info --verify` decodes as `Checkpointer.restore()` does and names the step restore resumes from."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with deltackpt.Checkpointer(store_path, model=model, async_save=False, handle_signals=False) as ck:
        ck.save(3)
        ids = {3: ck.last_info.id}
        with torch.no_grad():
            model.weight.add_(1.0)
        ck.save(5, metadata={"loss": 1.5})
        ids[5] = ck.last_info.id
    newest = max(pack_files(store_path), key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(newest.read_bytes())
    data[-8] ^= 0xFF  # the payload of the last frame written: step 5's new weight chunk
    newest.write_bytes(bytes(data))
    rc, out, err = cli(capsys, "resume-info", store_path)
    assert rc == 0 and err == ""
    assert out.startswith(f"a run would resume from step 5 (checkpoint {ids[5]}") and "'--verify'" in out
    rc, out, err = cli(capsys, "resume-info", store_path, "--verify")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"checkpoint {ids[5]} (step 5) is damaged, a restore passes over it: ")
    assert lines[1].startswith(f"a run would resume from step 3 (checkpoint {ids[3]}, saved ")
    rc, out, err = cli(capsys, "resume-info", store_path, "--verify", "--json")
    doc = _strict_json(out)
    assert (rc, err, doc["start_step"], doc["checkpoint"]["id"], doc["verified"]) == (0, "", 3, ids[3], True)
    assert [(p["id"], p["step"]) for p in doc["passed_over"]] == [(ids[5], 5)] and doc["passed_over"][0]["damage"]
    with deltackpt.Checkpointer(store_path, model=torch.nn.Linear(4, 3), handle_signals=False) as ck2:
        with pytest.warns(RuntimeWarning):
            assert ck2.restore() == 3
    m3 = store_path / "manifests" / f"{ids[3]}.manifest"
    data = bytearray(m3.read_bytes())
    data[40] ^= 0xFF
    m3.write_bytes(bytes(data))
    rc, out, err = cli(capsys, "resume-info", store_path, "--verify")  # nothing would restore: an error
    assert rc == 1 and out.count("is damaged, a restore passes over it") == 2
    assert_one_line_error(err, "no checkpoint of", "would restore")


def test_resume_info_verify_does_not_pass_over_a_damaged_checkpoint_restore_refuses(
        capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """`resume-info --verify` with the newest checkpoint both damaged and one `restore()` refuses by its skeleton
    (here a `Store.save` of an older step's state, as after a rollback): restore() raises for it, before a chunk is
    read, rather than fall back, so no run would resume. It said the run would resume from the step before it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with deltackpt.Checkpointer(store_path, model=model, async_save=False, handle_signals=False) as ck:
        ck.save(3)
        with torch.no_grad():
            model.weight.add_(1.0)
        ck.save(4)
    with deltackpt.Store(store_path) as s:
        state = s.load(step=3)
        state["model"]["weight"] = state["model"]["weight"] + 2.0  # a new chunk, the last frame written
        newest = s.save(state, step=5)
    pack = max(pack_files(store_path), key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(pack.read_bytes())
    data[-8] ^= 0xFF
    pack.write_bytes(bytes(data))
    with deltackpt.Checkpointer(store_path, model=torch.nn.Linear(4, 3), handle_signals=False) as ck2:
        with pytest.raises(deltackpt.DeltackptError, match="'step' entry is 3 but its manifest's step is 5"):
            ck2.restore()
    rc, out, err = cli(capsys, "resume-info", store_path, "--verify")
    assert (rc, err) == (1, "")
    assert out.startswith(f"the newest checkpoint, step 5 (checkpoint {newest.id}") and "refuses it" in out
    assert "passes over" not in out and "would resume" not in out
    rc, out, err = cli(capsys, "resume-info", store_path, "--verify", "--json")
    doc = _strict_json(out)
    assert (rc, doc["start_step"], doc["checkpoint"]["id"], doc["passed_over"]) == (1, None, newest.id, [])
    assert "manifest's step is 5" in doc["refused"]


def test_resume_info_empty_store(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    open_store(store_path).close()
    rc, out, err = cli(capsys, "resume-info", store_path)
    assert rc == 0 and err == ""
    assert out.strip() == f"{store_path} holds no checkpoint: a run would start from step 0"
    rc, out, err = cli(capsys, "resume-info", store_path, "--json")
    assert (rc, err) == (0, "") and _strict_json(out) == {
        "start_step": 0, "checkpoint": None, "refused": None, "verified": False, "passed_over": [], "rng": None,
        "parts": {}}


def test_resume_info_plain_store(capsys: pytest.CaptureFixture[str], store_path: Path,
                                 three: dict[str, Any]) -> None:
    """A store a plain Store.save wrote: no run resumes from it (a Checkpointer's restore() refuses its newest
    checkpoint), and resume-info does not say one would."""
    rc, out, _ = cli(capsys, "resume-info", store_path)
    assert rc == 0
    assert out.startswith(f"the newest checkpoint, step 3 (checkpoint {three['ids'][3]}, saved ")
    assert "was not written by a Checkpointer (no 'step' and 'model' entries): a Checkpointer's restore() refuses " \
           "it" in out
    assert "would resume" not in out
    for flags, code in (([], 0), (["--verify"], 1)):
        rc, out, _ = cli(capsys, "resume-info", store_path, "--json", *flags)
        doc = _strict_json(out)
        assert (rc, doc["start_step"], doc["checkpoint"]["id"]) == (code, None, three["ids"][3])
        assert "not written by a Checkpointer" in doc["refused"]
    with deltackpt.Checkpointer(store_path, model=torch.nn.Linear(2, 2), handle_signals=False) as ck:
        with pytest.raises(deltackpt.DeltackptError, match="not written by a Checkpointer"):
            ck.restore()
    # a state with a model but no step (the README's own Store example layout, less its step) is no exception,
    # and --verify, which says whether a restore would succeed, fails for it
    with deltackpt.Store(store_path) as s:
        s.save({"model": torch.nn.Linear(2, 2).state_dict()}, step=4)
    rc, out, _ = cli(capsys, "resume-info", store_path, "--verify")
    assert rc == 1 and "was not written by a Checkpointer" in out and "would resume" not in out


@pytest.mark.parametrize("first", [True, False], ids=["pickled-value-first", "pickled-value-later"])
def test_resume_info_pickled_state(capsys: pytest.CaptureFixture[str], store_path: Path, first: bool) -> None:
    """A state saved with allow_pickle=True (a Checkpointer never saves one): resume-info says it was not
    written by a Checkpointer, wherever the pickled value is. Before, with the pickled value the first of its
    dict, it missed it and failed on the pickle instead ("the checkpoint holds pickled values; load it with
    allow_pickle=True only if you trust the store")."""
    items = [("a", fractions.Fraction(1, 3)), ("step", 1)]
    with deltackpt.Store(store_path) as s:
        s.save(dict(items if first else items[::-1]), step=1, allow_pickle=True)
    rc, out, err = cli(capsys, "resume-info", store_path)
    assert rc == 0 and err == ""
    assert "was not written by a Checkpointer" in out and "would resume" not in out


# -- errors -----------------------------------------------------------------------------------------------

_READ_COMMANDS = [
    ["ls"], ["show", "1"], ["diff", "1", "2"], ["get", "1", "w"], ["log"], ["du"], ["verify"], ["verify", "1"],
    ["rm", "1"], ["gc"], ["repair"], ["export", "1", "OUT"], ["resume-info"], ["keep", "--last", "1"],
]


@pytest.mark.parametrize("exists", [False, True, "loop"], ids=["missing", "empty-dir", "link-loop"])
@pytest.mark.parametrize("args", _READ_COMMANDS, ids=lambda a: "-".join(a))
def test_not_a_store(capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], exists: Any) -> None:
    """Every command names a path that holds no store the same way (before, keep on a symbolic link loop
    printed pathlib's 'Symlink loop from ...')."""
    path = tmp_path / "nothing"
    if exists == "loop":
        (tmp_path / "other").symlink_to(path)
        path.symlink_to(tmp_path / "other")
    elif exists:
        path.mkdir()
    dest = tmp_path / "out.pt"
    argv = [args[0], path, *(dest if a == "OUT" else a for a in args[1:])]
    rc, out, err = cli(capsys, *argv)
    assert rc == 1 and out == ""
    assert_one_line_error(err, "not a deltackpt store" + (": it does not exist" if exists is False else ""))
    assert path.exists() == (exists is True) and not (path / "STORE").exists()
    assert not dest.exists()


_CHECKPOINT_COMMANDS = [["show", "C"], ["diff", "1", "C"], ["get", "C", "w"], ["verify", "C"], ["rm", "C"],
                        ["export", "C", "OUT"]]


@pytest.mark.parametrize("args", _CHECKPOINT_COMMANDS, ids=lambda a: a[0])
def test_unknown_step(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path, args: list[str],
                      three: dict[str, Any]) -> None:
    dest = tmp_path / "out.pt"
    argv = [args[0], store_path, *(dest if a == "OUT" else "99" if a == "C" else a for a in args[1:])]
    rc, out, err = cli(capsys, *argv)
    assert rc == 1 and out == ""
    assert_one_line_error(err, "no checkpoint at step 99")
    assert not dest.exists()
    assert ls_pairs(capsys, store_path) == sorted(three["ids"].items())


@pytest.mark.parametrize("bad", ["../x", "..", "/etc/passwd", "0123456789ABCDEF", "0123456789abcdef0", "lates", ""])
@pytest.mark.parametrize("args", _CHECKPOINT_COMMANDS, ids=lambda a: a[0])
def test_bad_checkpoint_id(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path, args: list[str],
                           bad: str, three: dict[str, Any]) -> None:
    dest = tmp_path / "out.pt"
    argv = [args[0], store_path, *(dest if a == "OUT" else bad if a == "C" else a for a in args[1:])]
    rc, out, err = cli(capsys, *argv)
    assert rc == 1 and out == ""
    assert_one_line_error(err, f"invalid checkpoint {bad!r}", "expected a step", "'latest' or an id")
    assert not dest.exists()
    assert ls_pairs(capsys, store_path) == sorted(three["ids"].items())


def test_unknown_id(capsys: pytest.CaptureFixture[str], store_path: Path, three: dict[str, Any]) -> None:
    rc, out, err = cli(capsys, "show", store_path, "0123456789abcdef")
    assert rc == 1 and out == ""
    assert_one_line_error(err, "no checkpoint with id 0123456789abcdef")


def test_latest_of_empty_store(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    open_store(store_path).close()
    rc, out, err = cli(capsys, "show", store_path, "latest")
    assert rc == 1 and out == ""
    assert_one_line_error(err, "holds no checkpoint")


@pytest.mark.parametrize(
    "argv",
    [[], ["frobnicate", "S"], ["show", "S"], ["import", "S", "f.pt"], ["gc", "S", "--repack-below", "x"], ["ls"]],
    ids=["nothing", "unknown-command", "show-no-checkpoint", "import-no-step", "gc-bad-float", "ls-no-store"],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: deltackpt" in capsys.readouterr().err


# -- entry points ----------------------------------------------------------------------------------------


@pytest.mark.plumbing
def test_python_m_deltackpt(store_path: Path, three: dict[str, Any], tmp_path: Path) -> None:
    run = [sys.executable, "-m", "deltackpt", "ls"]
    p = subprocess.run([*run, str(store_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    assert [(int(r[0]), r[1]) for r in table_rows(p.stdout)] == sorted(three["ids"].items())
    # the exit status of a failure reaches the shell
    p = subprocess.run([*run, str(tmp_path / "nothing")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout == ""
    assert_one_line_error(p.stderr, "not a deltackpt store")


@pytest.mark.plumbing
@pytest.mark.parametrize("entry", ["python -m", "import"])
def test_backend_that_cannot_run_is_one_line(store_path: Path, three: dict[str, Any], entry: str) -> None:
    """A DELTACKPT_BACKEND that names no backend (or names the native one where no kernel is built) is one error
    line naming the variable and exit status 1, from ``python -m deltackpt`` as from a script's ``import
    deltackpt``, whose Store() raises it as ImportError (before, the import failed and the command printed a
    traceback)."""
    env = {**os.environ, "DELTACKPT_BACKEND": "bogus"}
    if entry == "python -m":
        run = [sys.executable, "-m", "deltackpt", "ls", str(store_path)]
    else:
        run = [sys.executable, "-c", "import sys, deltackpt\n"
               "try:\n    deltackpt.Store(sys.argv[1])\nexcept ImportError as e:\n    sys.exit(f'ImportError: {e}')",
               str(store_path)]
    p = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1 and p.stdout == "", p.stderr
    if entry == "python -m":
        assert_one_line_error(p.stderr, "DELTACKPT_BACKEND", "'native'", "'python'", "'bogus'")
    else:
        assert p.stderr.strip().startswith("ImportError: DELTACKPT_BACKEND must be"), p.stderr
    code = ("import sys; sys.modules['deltackpt._kernel'] = None\n"  # (what an import finds without a build)
            "from deltackpt.cli import main; sys.exit(main(['ls', sys.argv[1]]))")
    p = subprocess.run([sys.executable, "-c", code, str(store_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**env, "DELTACKPT_BACKEND": "native"})
    assert p.returncode == 1 and p.stdout == ""
    assert_one_line_error(p.stderr, "DELTACKPT_BACKEND=native", "deltackpt._kernel is not there")


@pytest.mark.plumbing
def test_console_script_help() -> None:
    candidates = [Path(sys.executable).parent / "deltackpt", ROOT / ".venv" / "bin" / "deltackpt"]
    script = next((c for c in candidates if c.exists()), None)
    if script is None:
        pytest.skip("the deltackpt console script is not installed")
    p = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: deltackpt")
    for command in ("ls", "show", "log", "du", "verify", "rm", "gc", "repair", "export", "import", "resume-info"):
        assert re.search(rf"^\s+{re.escape(command)}\s", p.stdout, re.M), command


def test_export_safetensors_refuses_keys_that_are_not_text(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                           tmp_path: Path) -> None:
    """safetensors names tensors by text: a None, float, tuple or bytes dict key has no faithful name there, so
    export refuses it naming the key path (before, a None key raised IndexError and the others were named by
    their skeleton encoding, '3ff8000000000000')."""
    with open_store(store_path) as s:
        for step, key in enumerate([None, 1.5, (1, "a"), b"k"], 1):
            s.save({"ok": torch.ones(2), "d": {key: torch.zeros(1)}}, step=step)
    for step, shown in enumerate(["d[None]", "d[1.5]", "d[(1, 'a')]", "d[b'k']"], 1):
        dest = tmp_path / f"out{step}.safetensors"
        rc, out, err = cli(capsys, "export", store_path, step, dest)
        assert rc == 1 and out == "" and not dest.exists()
        assert_one_line_error(err, "safetensors", shown, ".pt")


def test_show_escapes_keys_that_are_not_printable_text(store_path: Path) -> None:
    """A str key holding a lone surrogate round-trips, and `show` prints it escaped instead of failing half-way
    through its table with a UnicodeEncodeError."""
    with open_store(store_path) as s:
        s.save({"w\ud800": torch.ones(2), "ok": torch.zeros(1)}, step=1)
    r = subprocess.run([sys.executable, "-m", "deltackpt", "show", str(store_path), "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert r.returncode == 0, r.stderr
    assert "w\\ud800" in r.stdout and "\nok " in r.stdout


def test_show_escapes_control_characters_in_keys(store_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key holding a newline or a terminal escape is shown escaped: one table row per tensor, and no escape
    sequence reaches the terminal (tied paths too)."""
    w = torch.ones(2)
    with open_store(store_path) as s:
        s.save({"a\nb": w, "red\x1b[31m": torch.zeros(1), "tied\t": w}, step=1)
    rc, out, _ = cli(capsys, "show", store_path, "1")
    assert rc == 0
    assert "\x1b" not in out and "\t" not in out
    assert "a\\nb" in out and "red\\x1b[31m" in out and "tied\\t" in out


def test_messages_escape_what_a_terminal_would_take_for_commands(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever a command prints, error messages naming a file or directory included, reaches the terminal with
    its terminal escapes, bells and right-to-left overrides escaped, as ls and show print keys (the messages
    printed them as they were): in-process, and through the real streams of ``python -m deltackpt``."""
    odd = tmp_path / "a\x1b]0;title\x07b\u202ec"
    rc, _, err = cli(capsys, "ls", odd)
    assert rc == 1
    assert_one_line_error(err, "a\\x1b]0;title\\x07b\\u202ec", "not a deltackpt store")
    assert not any(c in err for c in "\x1b\x07\u202e")
    r = subprocess.run([sys.executable, "-m", "deltackpt", "ls", str(odd)], cwd=ROOT, capture_output=True,
                       timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert r.returncode == 1 and r.stdout == b""
    assert b"a\\x1b]0;title\\x07b\\u202ec" in r.stderr and not any(c in r.stderr for c in (b"\x1b", b"\x07"))


def test_messages_keep_colour_codes_of_the_paths_they_name(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A colour code (``ESC [ 31 m``) in a path given to a command is shown escaped in its error message, not cut
    out of it: the message named another path than the one given (``STORE`` of ``STORE`` + ``ESC [ 0 m``, a
    store)."""
    with deltackpt.Store(tmp_path / "s") as s:
        s.save({"x": 1}, step=1)
    rc, _, err = cli(capsys, "ls", f"{tmp_path / 's'}\x1b[0m")
    assert rc == 1
    assert_one_line_error(err, f"{tmp_path / 's'}\\x1b[0m is not a deltackpt store")
    assert "\x1b" not in err


def test_a_command_says_what_it_waits_for(store_path: Path) -> None:
    """A command kept waiting more than a second for a lock another process holds says so on stderr, once, with
    what holds it (a gc or repair for verify, saves or loads for gc), and goes on when the lock is let go: it
    used to wait without a word."""
    with open_store(store_path) as s:
        s.save({"w": torch.ones(4)}, step=1)
    for mode, command, holder, done in ((fcntl.LOCK_EX, "verify", "a gc or repair", "OK"),
                                        (fcntl.LOCK_SH, "gc", "saves or loads", "freed")):
        fd = os.open(store_path / "gc.lock", os.O_RDWR)  # (an open file description of its own: flock conflicts)
        try:
            fcntl.flock(fd, mode)
            p = subprocess.Popen([sys.executable, "-m", "deltackpt", command, str(store_path)], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert p.stderr is not None
            assert select.select([p.stderr], [], [], 120)[0], f"{command} said nothing while it waited"
            line = p.stderr.readline().decode()
            assert line == f"deltackpt: waiting: store {store_path} is busy ({holder} in progress)\n"
            assert p.poll() is None, f"{command} did not wait for the lock"
        finally:
            os.close(fd)  # (lets go of the lock)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and err == b"", err
        assert done in out.decode()


def test_resume_info_counts_a_tied_weight_once(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """A tied weight (one tensor at two places of the state dict) is stored once; resume-info counts it once, as
    show does (it counted it at both places: 3 tensors where the checkpoint holds 2)."""
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    with deltackpt.Checkpointer(store_path, model=model, async_save=False, handle_signals=False) as ck:
        ck.save(1)
    rc, out, _ = cli(capsys, "resume-info", store_path)
    model_line = next(line for line in out.splitlines() if line.startswith("model"))
    assert rc == 0 and model_line.split(None, 1)[1].startswith("1 tensors, 128 B"), model_line


class _DigitsId(str):
    """An id of decimal digits only, as 1 in 1850 of those earlier versions drew (the check that now draws again
    is told it is not)."""

    def isdigit(self) -> bool:
        return False


def test_an_id_of_decimal_digits_names_its_checkpoint(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line read every all-digit argument as a step, so a checkpoint whose id is sixteen decimal
    digits could not be shown, exported or removed; such an argument now names that id when the store has it
    (else a step), and saves no longer draw such ids."""
    with deltackpt.Store(store_path) as s:
        s.save({"w": torch.zeros(4)}, step=6)
        with monkeypatch.context() as m:
            m.setattr("deltackpt.store.secrets.token_hex", lambda n: _DigitsId("4821509937716402"))
            s.save({"w": torch.ones(4)}, step=6)
        draws = iter(["1234567890123456", "00000000000000ab"])
        with monkeypatch.context() as m:
            m.setattr("deltackpt.store.secrets.token_hex", lambda n: next(draws))
            assert s.save({"w": torch.full((4,), 2.0)}, step=7).id == "00000000000000ab"
    rc, out, _ = cli(capsys, "show", store_path, "4821509937716402")
    assert rc == 0 and "4821509937716402" in out
    rc, out, _ = cli(capsys, "show", store_path, "6")  # a step: the newest checkpoint of step 6
    assert rc == 0 and "4821509937716402" in out
    rc, _, err = cli(capsys, "show", store_path, "1234567890123456")
    assert rc == 1 and "no checkpoint at step 1234567890123456" in err
    assert cli(capsys, "rm", store_path, "4821509937716402")[0] == 0
    with deltackpt.Store(store_path) as s:
        assert [i.step for i in s.list()] == [6, 7]
    rc, _, err = cli(capsys, "show", store_path, "-1")
    assert rc == 1 and "expected a step (a non-negative integer), 'latest' or an id" in err


def test_resume_info_verify_fails_when_only_a_thinned_checkpoint_is_left(capsys: pytest.CaptureFixture[str],
                                                                         store_path: Path) -> None:
    """restore() refuses a checkpoint thinned to weights only, so --verify, which finds the checkpoint a restore
    would resume from, fails (it printed that a run would resume from it, and exited 0)."""
    with deltackpt.Checkpointer(store_path, model=torch.nn.Linear(2, 2), async_save=False,
                                handle_signals=False) as ckpt:
        ckpt.step(1)
        ckpt._thin([ckpt.store.info(1).id], {i.id: i for i in ckpt.store.list()})
    rc, out, err = cli(capsys, "resume-info", store_path, "--verify")
    assert rc == 1 and out == ""  # (it printed "a run would resume from step 1" before the error)
    assert_one_line_error(err, "would restore", "step 1", "thinned to model weights only")
    rc, out, _ = cli(capsys, "resume-info", store_path)  # (it said "a run would resume from step 1", then warned)
    assert rc == 0 and "cannot resume training" in out and "restore() refuses it" in out
    assert "would resume" not in out


def test_every_command_says_a_store_lost_its_store_file(capsys: pytest.CaptureFixture[str],
                                                        store_path: Path) -> None:
    """A store whose STORE file is gone (its packs and manifests are there) is named as such by every command,
    with the way out ('deltackpt repair'); ls, verify and gc said it was no store at all."""
    with deltackpt.Store(store_path) as s:
        s.save({"w": torch.ones(3)}, step=1)
    (store_path / "STORE").unlink()
    before = dir_snapshot(store_path)
    for cmd in (["ls"], ["verify"], ["gc"], ["du"], ["log"], ["rm", "1"]):
        rc, _, err = cli(capsys, cmd[0], store_path, *cmd[1:])
        assert rc == 1
        assert_one_line_error(err, "STORE was lost?", "'deltackpt repair' writes it again")
    assert dir_snapshot(store_path) == before
    assert cli(capsys, "repair", store_path)[0] == 0
    assert cli(capsys, "ls", store_path)[0] == 0


class _Settings:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def test_resume_info_escapes_control_characters(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """The run's own keys and values (a scheduler's settings, extra's keys) are written with control characters
    escaped, as ls and show write them: a newline broke the table and a terminal escape reached the terminal."""
    with deltackpt.Checkpointer(store_path, model=torch.nn.Linear(2, 2), async_save=False, handle_signals=False,
                                scheduler=_Settings({"last_epoch": 3, "odd\x1b[2Jkey": 1}),
                                extra={"cfg\nnext": 1}) as ckpt:
        ckpt.save(1)
    rc, out, _ = cli(capsys, "resume-info", store_path)
    assert rc == 0 and "\x1b" not in out
    assert "odd\\x1b[2Jkey=1" in out and "keys: cfg\\nnext" in out


def test_export_of_pickled_values_says_export_never_unpickles(capsys: pytest.CaptureFixture[str],
                                                              store_path: Path, tmp_path: Path) -> None:
    """A checkpoint saved with allow_pickle=True cannot be exported: the error says export never unpickles and
    names the checkpoint (it advised an allow_pickle=True that export has no way to take)."""
    with deltackpt.Store(store_path) as s:
        cid = s.save({"w": torch.ones(2), "odd": fractions.Fraction(1, 3)},
                     step=1, allow_pickle=True).id
    rc, out, err = cli(capsys, "export", store_path, "1", tmp_path / "out.pt")
    assert rc == 1 and out == ""
    assert_one_line_error(err, f"checkpoint {cid} holds pickled values", "at 'odd'", "export never unpickles")
    assert not (tmp_path / "out.pt").exists()


def test_export_under_a_regular_file_says_so(capsys: pytest.CaptureFixture[str], store_path: Path,
                                             tmp_path: Path) -> None:
    """An export whose directory is a regular file, or missing, says which (the writers' own messages called a
    file a missing directory, or named their temporary file); an empty store path is named as empty."""
    with deltackpt.Store(store_path) as s:
        s.save({"w": torch.ones(2)}, step=1)
    (tmp_path / "plain").write_text("")
    for name in ("x.pt", "x.safetensors"):
        rc, _, err = cli(capsys, "export", store_path, "1", tmp_path / "plain" / name)
        assert rc == 1
        assert_one_line_error(err, f"cannot export to {tmp_path / 'plain' / name}: {tmp_path / 'plain'} is not a "
                                   "directory")
    rc, _, err = cli(capsys, "export", store_path, "1", tmp_path / "missing" / "x.pt")
    assert rc == 1
    assert_one_line_error(err, f"{tmp_path / 'missing'} does not exist")
    assert not (tmp_path / "missing").exists() and (tmp_path / "plain").read_text() == ""
    # a trailing / names a directory (before, o.pt/ wrote the file o.pt); a refused name is named as given
    # (before, "." and a directory were named by their last component, "" for ".")
    for dest, needle in ((f"{tmp_path / 'o.pt'}/", f"cannot export to {tmp_path / 'o.pt'}/: it is a directory"),
                         (".", "cannot export to .: use a .pt or .safetensors file name"),
                         (str(tmp_path), f"cannot export to {tmp_path}: use a .pt")):
        rc, _, err = cli(capsys, "export", store_path, "1", dest)
        assert rc == 1
        assert_one_line_error(err, needle)
    assert not (tmp_path / "o.pt").exists()
    for cmd in ("ls", "du", "repair"):  # (repair said ". is not a deltackpt store", and repaired one that is)
        rc, _, err = cli(capsys, cmd, "")
        assert rc == 1
        assert_one_line_error(err, "the store path is empty")


def test_repair_exits_1_for_a_damaged_pack_even_when_every_checkpoint_is_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pack damaged where only a deleted checkpoint's chunk is (every checkpoint whole): repair says so and
    exits 1."""
    path = tmp_path / "store"
    g = torch.Generator().manual_seed(0)
    with deltackpt.Store(path, chunk_size=SMALL_CHUNK, threads=1) as s:
        s.save({"w": torch.randint(0, 256, (SMALL_CHUNK,), dtype=torch.uint8, generator=g)}, step=1)
        m = s.manifest(1)
        (_, d, n), = m.chunk_keys(m.tensors[0])
        loc = s.index.lookup_chunks([chunk_key(d, n)])[chunk_key(d, n)]
        s.save({"w": torch.randint(0, 256, (SMALL_CHUNK,), dtype=torch.uint8, generator=g)}, step=2, keyframe=True)
        s.delete(1)  # step 1's chunk is dead, not yet gc'd
    damage_frame(path, loc)
    capsys.readouterr()
    rc = main(["repair", str(path)])
    out = capsys.readouterr().out
    assert "is damaged" in out, out
    assert rc == 1, out
    with deltackpt.Store(path) as s:
        assert [i.step for i in s.list()] == [2]
        s.load(2)


def test_a_missing_store_or_import_file_is_named_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`ls` of a path that does not exist said it is "not a deltackpt store (no STORE file)"; `import` of a
    missing file said it "cannot be read with torch.load(weights_only=True) ... (deltackpt never unpickles
    arbitrary objects)"; `ls` of a file said "no STORE file", `dcp` of a missing root "DCP checkpoints: X is
    missing"."""
    rc, _, err = cli(capsys, "ls", tmp_path / "nowhere")
    assert rc == 1
    assert_one_line_error(err, f"{tmp_path / 'nowhere'} is not a deltackpt store: it does not exist")
    for name in ("missing.pt", "missing.safetensors"):
        rc, _, err = cli(capsys, "import", tmp_path / "s", tmp_path / name, "--step", "1")
        assert rc == 1
        assert_one_line_error(err, f"{tmp_path / name} does not exist")
    rc, _, err = cli(capsys, "import", tmp_path / "s", tmp_path, "--step", "1")
    assert rc == 1
    assert_one_line_error(err, f"{tmp_path} is not a file")
    assert not (tmp_path / "s").exists() and not (tmp_path / "nowhere").exists()
    (tmp_path / "afile").write_text("x")
    rc, _, err = cli(capsys, "ls", tmp_path / "afile")
    assert rc == 1
    assert_one_line_error(err, f"{tmp_path / 'afile'} is not a deltackpt store: it is not a directory")
    rc, _, err = cli(capsys, "dcp", tmp_path / "nowhere")
    assert rc == 1
    assert_one_line_error(err, f"{tmp_path / 'nowhere'} is not a sharded (DCP) checkpoint root: it does not exist")
    rc, _, err = cli(capsys, "dcp", tmp_path / "afile")
    assert rc == 1
    assert_one_line_error(err, f"{tmp_path / 'afile'} is not a sharded (DCP) checkpoint root: it is not a directory")


def test_dcp_help_summary_names_everything_it_does() -> None:
    """`deltackpt --help` lists dcp as listing, deleting, pruning, collecting and verifying (it left out verify)."""
    import argparse

    from deltackpt.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    summary = next(c.help for c in sub._choices_actions if c.dest == "dcp")
    for word in ("list", "delete", "prune", "gc", "verify"):
        assert word in summary, word


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_file_mode_follows_the_umask(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path,
                                            suffix: str) -> None:
    """An export is a file to share (a model hub, a colleague's job): its mode is what the umask gives any new
    file, as torch.save's own files have, not safetensors' 0600 (which only its owner can read)."""
    with open_store(store_path) as s:
        s.save({"w": torch.ones(3)}, step=1)
    old = os.umask(0o022)
    try:
        for umask in (0o022, 0o027):
            os.umask(umask)
            dest = tmp_path / f"out{umask:o}{suffix}"
            rc, _, err = cli(capsys, "export", store_path, "1", dest)
            assert rc == 0 and err == ""
            assert dest.stat().st_mode & 0o777 == 0o666 & ~umask, (oct(dest.stat().st_mode), oct(umask))
    finally:
        os.umask(old)


@pytest.mark.plumbing
def test_complex32_adds_no_torch_warning_to_stderr(store_path: Path, tmp_path: Path) -> None:
    """torch warns that ComplexHalf is experimental the first time a process makes a complex32 tensor; get and
    export make one (the loaded tensor; export's probe of what its format can hold), which put torch's two-line
    warning before the command's output or its one error line."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        state = {"c": torch.zeros(3, dtype=torch.complex32), "w": torch.ones(2)}
    with open_store(store_path) as s:
        s.save(state, step=1)
    run = [sys.executable, "-m", "deltackpt"]
    for argv in (["get", store_path, "1", "c"], ["get", store_path, "1", "c", "--json"],
                 ["export", store_path, "1", tmp_path / "c.pt"]):
        p = subprocess.run([*run, *map(str, argv)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and p.stderr == "", (argv, p.stderr)
    p = subprocess.run([*run, "export", str(store_path), "1", str(tmp_path / "c.safetensors")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout == ""
    assert_one_line_error(p.stderr, "complex32")


def test_get_statistics_of_values_near_float_max(capsys: pytest.CaptureFixture[str], store_path: Path) -> None:
    """The mean and std of finite values are finite: values near float64's largest summed to inf, so get printed
    a mean and std of inf (and numpy's overflow warnings on stderr)."""
    import warnings

    big = 1e308
    with open_store(store_path) as s:
        s.save({"t": torch.tensor([big, big], dtype=torch.float64), "a": np.array([big, -big, np.inf]),
                "s": torch.tensor([3.0, 5.0], dtype=torch.float64)}, step=1)
    want = {"t": {"min": big, "max": big, "mean": big, "std": 0.0, "non_finite": 0},
            "a": {"min": -big, "max": big, "mean": 0.0, "std": big, "non_finite": 1},
            "s": {"min": 3.0, "max": 5.0, "mean": 4.0, "std": 1.0, "non_finite": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for key, stats in want.items():
            rc, out, err = cli(capsys, "get", store_path, "1", key, "--json")
            assert rc == 0 and err == ""
            assert json.loads(out)["statistics"] == stats, key
            rc, out, err = cli(capsys, "get", store_path, "1", key)
            assert rc == 0 and err == "" and "inf" not in out.splitlines()[0], out


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_to_a_named_pipe_writes_into_it(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path,
                                               suffix: str) -> None:
    """A destination that is not a regular file (a named pipe to a compressor or an upload) is written directly:
    torch.save given the pipe's path failed ('unexpected pos'), and safetensors put a regular file in the pipe's
    place, which no reader ever saw, while export reported success."""
    import threading

    state = {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(3, dtype=torch.bool),
             "c": torch.ones(5, dtype=torch.bfloat16), "e": torch.zeros(0, 3)}
    with open_store(store_path) as s:
        s.save(state, step=1)
    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    rc, out, err = cli(capsys, "export", store_path, "1", fifo, "--json")
    if rc != 0:  # (unblock the reader)
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    reader.join(30)
    assert rc == 0 and err == "", err
    assert json.loads(out)["bytes"] is None
    assert fifo.is_fifo()
    if suffix == ".pt":
        loaded = torch.load(io.BytesIO(got[0]), weights_only=True)
    else:
        from safetensors.torch import load as load_bytes

        loaded = load_bytes(got[0])
    assert set(loaded) == set(state)
    for k, t in state.items():
        assert loaded[k].dtype == t.dtype and torch.equal(loaded[k], t), k


@pytest.mark.parametrize("char", ["x", "ü"])
def test_export_to_a_long_file_name(capsys: pytest.CaptureFixture[str], store_path: Path, tmp_path: Path,
                                    char: str) -> None:
    """A destination whose name is near the file system's limit (255 bytes) is a valid name: the export's
    temporary file, .NAME.HOST.PID.tmp beside it, cuts NAME short instead of failing ('File name too long'), and
    the next export to that name finds what a killed one left under the shortened name."""
    with open_store(store_path) as s:
        s.save({"w": torch.arange(10.0)}, step=1)
    for suffix in (".pt", ".safetensors"):
        dest = tmp_path / f"{char * ((255 - len(suffix)) // len(char.encode()))}{suffix}"
        assert 254 <= len(os.fsencode(dest.name)) <= 255
        rc, out, err = cli(capsys, "export", store_path, "1", dest)
        assert (rc, err) == (0, ""), err
        assert dest.is_file()
        from deltackpt import cli as cli_module

        host = re.sub(r"[^A-Za-z0-9-]", "_", os.uname().nodename)
        left = cli_module._export_tmp(Path(os.path.realpath(dest)), host, 2**22 + 11)  # (no such process)
        assert len(os.fsencode(left.name)) <= 255
        left.write_bytes(b"partial")
        rc, out, err = cli(capsys, "export", store_path, "1", dest)
        assert (rc, err) == (0, "") and not left.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_dangling_link_as_store_is_named_as_such(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A store path that is a symbolic link to nothing (a store moved or deleted, or a loop of links) is said to be
    that, by every command, as Store() says it for import, not 'no STORE file'."""
    dangling, loop = tmp_path / "dangling", tmp_path / "loop"
    dangling.symlink_to(tmp_path / "gone")
    loop.symlink_to(loop)
    for link in (dangling, loop):
        for argv in (["ls", link], ["verify", link, "--json"], ["gc", link], ["keep", link, "--last", "1"]):
            rc, out, err = cli(capsys, *argv)
            assert rc == 1 and out == ""
            assert_one_line_error(err, str(link), "dangling symbolic link")
        assert link.is_symlink()


def test_repair_names_a_dangling_link_as_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """repair, like the other commands, says a store path that is a link to nothing (or a loop of links) is that,
    not that it has 'no readable STORE file'."""
    dangling, loop = tmp_path / "dangling", tmp_path / "loop"
    dangling.symlink_to(tmp_path / "gone")
    loop.symlink_to(loop)
    for link in (dangling, loop):
        rc, out, err = cli(capsys, "repair", link)
        assert rc == 1 and out == ""
        assert_one_line_error(err, str(link), "dangling symbolic link")
        assert link.is_symlink()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_into_a_pipe_whose_reader_goes_away_says_so(capsys: pytest.CaptureFixture[str], store_path: Path,
                                                           tmp_path: Path, suffix: str) -> None:
    """A reader of the named pipe that stops early (a crashed torch.load): the .pt export said only torch's
    'unexpected pos 704 vs 598', which names nothing the user did; it now says the pipe broke, as .safetensors'."""
    import threading

    with open_store(store_path) as s:
        s.save({"w": torch.randn(50_000)}, step=1)
    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)

    def read_a_little() -> None:
        with open(fifo, "rb") as f:
            f.read(10)

    reader = threading.Thread(target=read_a_little, daemon=True)
    reader.start()
    rc, out, err = cli(capsys, "export", store_path, "1", fifo)
    reader.join(30)
    assert rc == 1 and out == ""
    assert_one_line_error(err, str(fifo), "Broken pipe")
    assert "unexpected pos" not in err


def test_the_waiting_line_does_not_run_into_a_progress_bar(store_path: Path) -> None:
    """On a terminal, a command's progress bar is on screen (verify, gc) before it takes the store's lock: the
    'waiting' line, printed once it waited a second, clears the bar first rather than run on from the end of
    the bar's line ('verify: 0it [00:00, ?it/s]deltackpt: waiting: ...')."""
    import pty

    with open_store(store_path) as s:
        s.save({"w": torch.ones(4)}, step=1)
    fd = os.open(store_path / "gc.lock", os.O_RDWR)
    master, slave = pty.openpty()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        p = subprocess.Popen([sys.executable, "-m", "deltackpt", "verify", str(store_path)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
        seen = b""
        while b"deltackpt: waiting" not in seen or not seen.endswith(b"\n") and p.poll() is None:
            assert select.select([master], [], [], 120)[0], f"verify printed nothing more: {seen!r}"
            seen += os.read(master, 4096)
            if b"deltackpt: waiting" in seen and b"\n" in seen.split(b"deltackpt: waiting", 1)[1]:
                break
        os.close(fd)  # (lets go of the lock)
        fd = -1
        assert p.wait(timeout=120) == 0
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(master)
    before = seen.split(b"deltackpt: waiting", 1)[0]
    assert b"verify" in before, seen  # (a bar was drawn: the case under test)
    assert before.replace(b" ", b"").endswith((b"\r", b"\n")), seen
