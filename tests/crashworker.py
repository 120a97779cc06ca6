"""Worker processes for tests/test_crash.py and tests/test_concurrency.py (a plain script, not a test module).

Run as ``python tests/crashworker.py MODE 'JSON-ARGS'`` with the repository on PYTHONPATH. Modes:

``zygote``   imports torch and deltackpt once, never opens a Store, then reads one JSON command per line
             on stdin. Each command forks a child that opens the store and works (``save``: saves step
             after step, acknowledging each; ``gc``: runs gc in a loop); the zygote SIGKILLs the child after
             the command's ``delay`` seconds, reaps it and answers one JSON line on stdout. Forking from a
             warm process makes a kill cost milliseconds instead of a fresh interpreter and a torch import.
``saver``    saves the given steps (optionally after a barrier file appears), optionally deleting old ones.
``reader``   loops list() / load() of the latest checkpoint until a stop file appears.
``deleter``  deletes the given steps, in the given order.
``gcloop``   runs gc() in a loop until a stop file appears.
``fork``     saves, forks, and checks a fresh Store in the child works; then the parent's handle still works.

The test modules import this file too, for :func:`make_state` (the state of step ``s`` is a pure function of
``s``), :func:`assert_same` (bit-exact comparison) and :func:`read_acks`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHUNK_SIZE = 4096


# -- the deterministic states -------------------------------------------------------------------------------
_ADAM_N = 3072  # elements of the AdamW-trained parameter: three 4 KiB chunks
_adam_memo: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []


def _adam(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parameter, exp_avg, exp_avg_sq) after ``step + 1`` AdamW steps with gradients seeded by the step, in
    float32 numpy (torch ops in a child forked from a process that ran them can hang in OpenMP): consecutive
    saves get predicted frames (docs/format.md 8a)."""
    f32 = np.float32
    while len(_adam_memo) <= step:
        t = len(_adam_memo)
        if t == 0:
            p = np.random.default_rng(11).standard_normal(_ADAM_N).astype(f32)
            m, v = np.zeros(_ADAM_N, f32), np.zeros(_ADAM_N, f32)
        else:
            p, m, v = (x.copy() for x in _adam_memo[-1])
        grad = np.random.default_rng(2_000_003 + t).standard_normal(_ADAM_N).astype(f32)
        p *= f32(1 - 1e-3 * 0.01)
        m += f32(0.1) * (grad - m)
        v = v * f32(0.999) + f32(0.001) * grad * grad
        denom = np.sqrt(v) / f32((1 - 0.999 ** (t + 1)) ** 0.5) + f32(1e-8)
        p -= f32(1e-3 / (1 - 0.9 ** (t + 1))) * m / denom
        _adam_memo.append((p, m, v))
    return tuple(torch.from_numpy(x.copy()) for x in _adam_memo[step])  # type: ignore[return-value]


def make_state(step: int) -> dict[str, Any]:
    """The training state of ``step``: a pure function of ``step``.

    Consecutive steps share most chunks (``model.w`` differs in one 4 KiB chunk, ``emb``/``mask``/``exp_avg``
    change every 4 steps, ``zeros`` never) so each save dedups most chunks and writes a few new ones; the
    AdamW-trained ``model.adam_w`` and its optimizer state change at every step (predicted frames).
    """
    adam_w, adam_m, adam_v = _adam(step)
    g = torch.Generator().manual_seed(step)
    slow = torch.Generator().manual_seed(1_000_003 + step // 4)
    fixed = torch.Generator().manual_seed(7)
    w = torch.randn(12288, generator=fixed)  # 48 KiB: 12 chunks, 11 of them identical in every step
    k = step % 12
    w[k * 1024 : (k + 1) * 1024] = torch.randn(1024, generator=g)
    n = 100 + (step * 37) % 2000  # a varied size, rarely chunk aligned
    return {
        "model": {
            "w": w,
            "emb": torch.randn(64, 48, generator=slow).to(torch.bfloat16),
            "b": torch.randn(n, generator=g, dtype=torch.float64),
            "mask": torch.rand(777, generator=slow) > 0.5,
            "idx": torch.arange(step, step + 300, dtype=torch.int64),
            "zeros": torch.zeros(3000),
            "adam_w": adam_w,
        },
        "optim": {
            "state": {
                0: {"exp_avg": torch.randn(5000, generator=slow) * 1e-3, "step": torch.tensor(float(step))},
                1: {"exp_avg": adam_m, "exp_avg_sq": adam_v, "step": torch.tensor(float(step + 1))},
            },
            "param_groups": [{"lr": 0.1 / (step + 1), "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "np": np.random.default_rng(step).standard_normal(300).astype(np.float32),
        "step": step,
        "name": f"step-{step}",
        "even": step % 2 == 0,
        "nothing": None,
    }


def assert_same(expected: Any, actual: Any, path: str = "state") -> None:
    """Raise AssertionError unless ``actual`` equals ``expected`` bit for bit, types and structure too."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {list(actual.shape)} != {list(expected.shape)}"
        # compared with numpy: a torch op in a forked child can hang in torch's OpenMP pool (a torch limit)
        a = actual.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        e = expected.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert a == e, f"{path}: tensor bytes differ"
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: expected an ndarray, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        assert actual.tobytes() == expected.tobytes(), f"{path}: array bytes differ"
    elif isinstance(expected, dict):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert type(actual) is float, f"{path}: {type(actual).__name__} is not float"
        assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{path}: {actual!r} != {expected!r}"
    else:
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def read_acks(path: Path) -> list[int]:
    """Steps acknowledged in an ack file (a torn last line, without its newline, does not count)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    return [int(x) for x in lines[:-1] if x]


def worker_env() -> dict[str, str]:
    """The environment for a worker: this one, the repository first on PYTHONPATH, the same kernel backend."""
    import deltackpt

    env = os.environ.copy()
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["DELTACKPT_BACKEND"] = deltackpt.backend  # the workers run exactly the kernel the test runs
    return env


def child_outcome(pid: int, timeout: float = 10.0) -> int | str:
    """The exit code of forked child ``pid``, or "hung" for one still running after ``timeout`` seconds, which is
    then killed (for test scripts that fork: ``from tests.crashworker import child_outcome``)."""
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "hung"
    return os.waitstatus_to_exitcode(done[1])


def _ack(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{value}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _open(store: str, **kw: Any) -> Any:
    from deltackpt import Store

    return Store(store, chunk_size=CHUNK_SIZE, threads=2, **kw)


def _wait_for(path: str | None, timeout: float = 60.0) -> None:
    if path is None:
        return
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.002)


# -- zygote children ----------------------------------------------------------------------------------------
def _child_save(cmd: dict[str, Any]) -> None:
    st = _open(cmd["store"], pack_size=cmd.get("pack_size"))
    step = cmd["start"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # runs until killed
        st.save(make_state(step), step, metadata={"step": step})
        _ack(cmd["ack"], str(step))
        step += 1
    os._exit(3)


def thinned_state(step: int) -> dict[str, Any]:
    """What retention's thinning keeps of ``make_state(step)``: the model weights."""
    return {"model": make_state(step)["model"], "step": step, "thinned": True}


def is_thinned(info: Any) -> bool:
    """Whether checkpoint ``info`` holds a thinned state (metadata ``thinned``, set by the rewrite child)."""
    return isinstance(info.metadata, dict) and bool(info.metadata.get("thinned"))


def expected_state(info: Any) -> dict[str, Any]:
    """The state checkpoint ``info`` holds: its step's full state, or the thinned one."""
    return thinned_state(info.step) if is_thinned(info) else make_state(info.step)


def _child_rewrite(cmd: dict[str, Any]) -> None:
    """Rewrites every checkpoint in turn, newest first, to its thinned state or back to its full one (whichever it
    does not hold: metadata ``thinned``), until killed; acks the step after each commit."""
    st = _open(cmd["store"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # runs until killed
        for info in reversed(st.list()):
            thin = not is_thinned(info)
            state = thinned_state(info.step) if thin else make_state(info.step)
            st.rewrite(state, id=info.id, metadata={"thinned": thin})
            _ack(cmd["ack"], str(info.step))
    os._exit(3)


def _child_gc(cmd: dict[str, Any]) -> None:
    st = _open(cmd["store"])
    deadline = time.monotonic() + 60
    runs = 0
    while time.monotonic() < deadline:  # runs until killed
        st.gc()
        runs += 1
        _ack(cmd["ack"], str(runs))
    os._exit(3)


def zygote() -> None:
    import deltackpt  # imported once, before any fork; no Store is ever opened in this process

    out = sys.stdout
    out.write(json.dumps({"ready": True, "backend": deltackpt.backend}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        sys.stderr.flush()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                {"save": _child_save, "gc": _child_gc, "rewrite": _child_rewrite}[cmd["op"]](cmd)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        # Wait up to `delay` seconds, but notice a child that died by itself earlier.
        end = t0 + cmd["delay"]
        status = None
        while True:
            left = end - time.monotonic()
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            if left <= 0:
                break
            time.sleep(min(left, 0.001))
        killed = False
        if status is None:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        reply = {
            "pid": pid,
            "killed": killed,
            "exitcode": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "elapsed": time.monotonic() - t0,
        }
        out.write(json.dumps(reply) + "\n")
        out.flush()


class Zygote:
    """The test side of a zygote process (see the module docstring)."""

    def __init__(self, env: dict[str, str], stderr_path: Path) -> None:
        import subprocess

        self._stderr = open(stderr_path, "w+b")
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "zygote", "{}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env=env,
        )
        self.backend = self._reply(120)["backend"]

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(f"zygote did not answer; its stderr:\n{self.errors()}")
        return json.loads(line)

    def run(self, timeout: float = 120, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._reply(timeout)

    def errors(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-5000:]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._stderr.close()


# -- plain modes (each its own process) ---------------------------------------------------------------------
def saver(a: dict[str, Any]) -> dict[str, Any]:
    if a.get("open_after_barrier"):  # the store may not exist yet: the savers race to create it
        Path(a["ready"]).touch()
        _wait_for(a.get("barrier"))
        st = _open(a["store"], pack_size=a.get("pack_size"))
    else:
        st = _open(a["store"], pack_size=a.get("pack_size"))
        Path(a["ready"]).touch()
        _wait_for(a.get("barrier"))
    keep = a.get("keep")
    saved: list[int] = []
    deleted: list[int] = []
    t_first = time.monotonic()
    for step in a["steps"]:
        info = st.save(make_state(step), step, metadata={"step": step, "by": os.getpid()})
        assert info.step == step
        saved.append(step)
        if len(saved) == 1 and a.get("rendezvous"):  # no saver gets past its first save alone
            mine, *others = a["rendezvous"]
            Path(mine).touch()
            for other in others:
                _wait_for(other)
        if a.get("check_load"):
            assert_same(make_state(step), st.load(step))
        if keep is not None and len(saved) - len(deleted) > keep:
            old = saved[len(deleted)]
            st.delete(old)
            deleted.append(old)
    t_last = time.monotonic()
    st.close()
    return {"saved": saved, "deleted": deleted, "window": [t_first, t_last]}


def deleter(a: dict[str, Any]) -> dict[str, Any]:
    st = _open(a["store"])
    Path(a["ready"]).touch()
    _wait_for(a.get("barrier"))
    t0 = time.monotonic()
    for step in a["steps"]:
        st.delete(step)
        time.sleep(a.get("pause", 0.0))
    st.close()
    return {"deleted": a["steps"], "seconds": time.monotonic() - t0}


def reader(a: dict[str, Any]) -> dict[str, Any]:
    """Loop list() and load() while others save (and, with ``deletes``, delete old checkpoints).

    A load returns the state of its step or, for a checkpoint that may have been deleted meanwhile (or of
    an empty store), raises CheckpointNotFoundError. Anything else is recorded in ``errors``; the loop goes
    on.
    """
    from deltackpt import CheckpointNotFoundError

    st = _open(a["store"])
    Path(a["ready"]).touch()
    _wait_for(a.get("barrier"))
    loads = 0
    not_found = 0
    seen: set[int] = set()
    lists = 0
    errors: list[str] = []

    def load(step: int | None, may_vanish: bool, **kw: Any) -> None:
        nonlocal loads, not_found
        try:
            state = st.load(step, **kw)
        except CheckpointNotFoundError:
            if not may_vanish:
                raise
            not_found += 1
            return
        except Exception as exc:
            errors.append(f"load({step}, {kw}): {type(exc).__name__}: {exc}")
            return
        assert_same(make_state(state["step"]), state, f"step {state['step']}")
        assert step is None or state["step"] == step
        loads += 1

    while True:
        # decided before the pass, so that one full pass runs after the writer has ended
        stop = os.path.exists(a["stop"])
        infos = st.list()
        lists += 1
        steps = [i.step for i in infos]
        assert steps == sorted(steps), f"list() is not in commit order: {steps}"
        assert len(set(steps)) == len(steps), f"list() repeats a step: {steps}"
        for i in infos:
            assert i.metadata == {"step": i.step, "by": i.metadata["by"]}, i
        latest = st.latest()
        vanish = a.get("deletes", False)  # may a checkpoint listed a moment ago be gone?
        if latest is not None:
            load(None, vanish, id=latest.id)
            load(latest.step, vanish)
            seen.add(latest.step)
        if infos:  # the oldest: the next one a writer that keeps the last few deletes
            load(None, vanish, id=infos[0].id)
            load(infos[0].step, vanish)
        else:  # empty a moment ago: load() of the latest finds none or, if a commit came, a valid state
            load(None, True)
        if stop:
            break
    st.close()
    return {"loads": loads, "not_found": not_found, "lists": lists, "seen": sorted(seen), "errors": errors}


def gcloop(a: dict[str, Any]) -> dict[str, Any]:
    st = _open(a["store"])
    Path(a["ready"]).touch()
    runs = 0
    dead = 0
    deleted_packs = 0
    repacked = 0
    errors: list[str] = []
    while not os.path.exists(a["stop"]):
        try:
            rep = st.gc()
        except Exception as exc:  # reported; the loop goes on and the test fails on it after its other checks
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            runs += 1
            dead += rep.dead_chunks
            deleted_packs += rep.deleted_packs
            repacked += rep.repacked_packs
        time.sleep(a.get("sleep", 0.005))
    st.close()
    return {"runs": runs, "dead_chunks": dead, "deleted_packs": deleted_packs, "repacked_packs": repacked,
            "errors": errors}


def fork(a: dict[str, Any]) -> dict[str, Any]:
    st = _open(a["store"])
    st.save(make_state(0), 0)
    assert_same(make_state(0), st.load(0))  # the thread pool and LMDB environment are in use before the fork
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child = _open(a["store"])
            assert_same(make_state(0), child.load(0))
            child.save(make_state(1), 1)
            assert_same(make_state(1), child.load(1))
            assert sorted(i.step for i in child.list()) == [0, 1]
            child.close()
            code = 0
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"forked child failed: status {status}"
    # the parent's handle, untouched by the child, sees the child's checkpoint and keeps working
    assert_same(make_state(1), st.load(1))
    st.save(make_state(2), 2)
    assert sorted(i.step for i in st.list()) == [0, 1, 2]
    st.close()
    return {"ok": True}


def main() -> None:
    mode = sys.argv[1]
    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    if mode == "zygote":
        zygote()
        return
    modes = {"saver": saver, "deleter": deleter, "reader": reader, "gcloop": gcloop, "fork": fork}
    result = modes[mode](args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
