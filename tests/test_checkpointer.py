"""The Checkpointer in a training loop: exact resume (in-process, and after SIGKILL with real processes),
async saves that do not see later mutations, background errors that are not lost, bounded staging memory,
SIGTERM handling (save at the step boundary, exit 143, chaining a previous handler), rollback onto a branch.

The subprocess tests run tests/train_worker.py: a deterministic CPU training run with dropout, AdamW, a
cosine schedule and a ``ResumableLoader`` over a 2-worker DataLoader. The SIGKILL test forks its runs from a
warm "zygote" of that script (a cold start costs ~5 s of torch imports) and compares them with a reference
run in a fresh interpreter. Kill points are random; the seed is printed - rerun a failure with
``DELTACKPT_RESUME_SEED=<seed>``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import importlib.util
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt import Checkpointer, Retention, Store, UnsupportedTypeError, codec, manifest
from deltackpt.index import chunk_key, chunk_keys

HERE = Path(__file__).resolve().parent
WORKER = HERE / "train_worker.py"
_spec = importlib.util.spec_from_file_location("deltackpt_train_worker", WORKER)
assert _spec is not None and _spec.loader is not None
tw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tw)

TOTAL_STEPS = 40  # 13 batches an epoch (the last one partial): the runs cross three epoch boundaries
STEP_SLEEP = 0.03  # seconds a worker sleeps after each step, so a kill lands mid-run
SHM = Path("/dev/shm")

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="needs fork, process groups, Linux signals")


# -- helpers ----------------------------------------------------------------------------------------------

def _fast_root() -> Path | None:
    """A tmpfs directory when there is one: fsync there is free, and a save costs ~5 ms instead of ~40."""
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        return SHM
    return None


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    root = _fast_root()
    if root is None:
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="deltackpt-test-", dir=root))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a small machine, torch's thread pool spinning against the background save
    threads makes a tiny forward pass take milliseconds."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("DELTACKPT_RESUME_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"seed: DELTACKPT_RESUME_SEED={seed}")
    return random.Random(seed)


def worker_env() -> dict[str, str]:
    env = os.environ.copy()
    root = str(HERE.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # DELTACKPT_BACKEND passes through as set (both backends are bit-identical; forcing "native" would turn a
    # stale build into an ImportError in the worker, which has nothing to do with what these tests check)
    env.pop("DELTACKPT_THREADS", None)
    return env


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(expected: Any, actual: Any, path: str = "state") -> None:
    """``actual`` equals ``expected`` bit for bit (tensors compared as uint8, floats by their bits)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__} is not a tensor"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), f"{path}: dtype/shape"
        assert torch.equal(as_bytes(actual), as_bytes(expected)), f"{path}: bits differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {type(actual).__name__} is not a dict"
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_bitwise(expected[k], actual[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{path}: {actual!r}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_bitwise(e, a, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert isinstance(actual, float), f"{path}: {actual!r} is not a float"
        assert actual.hex() == expected.hex(), f"{path}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def read_log(path: Path) -> tuple[int | None, list[tuple[int, str]]]:
    """(the START step, [(step, loss hex), ...]) of one run's log."""
    start = None
    losses = []
    if not path.exists():
        return None, []
    for line in path.read_text().splitlines():
        a, b = line.split()
        if a == "START":
            start = int(b)
        else:
            losses.append((int(a), b))
    return start, losses


def wait_for_lines(path: Path, n: int, alive: Any, timeout: float = 60.0) -> None:
    """Until ``path`` logs ``n`` step lines; fails if ``alive()`` turns False first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if len(read_log(path)[1]) >= n:
            return
        assert alive(), f"the worker ended before logging {n} steps: {read_log(path)}"
        assert time.monotonic() < deadline, f"no {n} steps logged in {timeout} s"
        time.sleep(0.003)


def worker_argv(store: Path, log: Path, *, out: Path | None = None, steps: int = TOTAL_STEPS, every: int = 1,
                sleep: float = STEP_SLEEP, **more: Any) -> list[str]:
    argv = ["--store", str(store), "--log", str(log), "--steps", str(steps), "--every", str(every),
            "--sleep", str(sleep)]
    if out is not None:
        argv += ["--out", str(out)]
    for k, v in more.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def kill_group(pid: int) -> None:
    """SIGKILL what is left of a worker's process group (its DataLoader workers)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Zygote:
    """tests/train_worker.py --zygote: forks training runs from a warm interpreter."""

    def __init__(self, stderr: Path) -> None:
        self._stderr_path = stderr
        self._stderr = open(stderr, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env=worker_env(), text=True, start_new_session=True,
        )
        assert self._read(180) == {"ready": True}

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"the zygote did not answer in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the zygote died: {self._stderr_path.read_text()[-3000:]}")
        return json.loads(line)

    def _send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def run(self, argv: list[str], output: Path) -> int:
        self._send({"op": "run", "argv": argv, "output": str(output)})
        return int(self._read(30)["pid"])

    def wait(self, pid: int, timeout: float = 120) -> int:
        self._send({"op": "wait", "pid": pid})
        try:
            return int(self._read(timeout)["code"])
        except AssertionError:
            kill_group(pid)
            raise
        finally:
            kill_group(pid)

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            self._stderr.close()


class Reference:
    """The uninterrupted run, in a fresh interpreter, started in the background."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.log, self.out = d / "log", d / "final.pt"
        self._stdout = open(d / "stdout", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), *worker_argv(d / "store", self.log, out=self.out, sleep=0)],
            stdout=self._stdout, stderr=subprocess.STDOUT, env=worker_env(), start_new_session=True,
        )
        self._result: tuple[dict[int, str], Any] | None = None

    def result(self) -> tuple[dict[int, str], Any]:
        if self._result is None:
            try:
                code = self.proc.wait(timeout=180)
            finally:
                kill_group(self.proc.pid)
                self._stdout.close()
            output = (self.dir / "stdout").read_text()
            assert code == 0 and "DONE" in output, f"reference run failed ({code}): {output[-3000:]}"
            start, losses = read_log(self.log)
            assert start == 0
            assert [s for s, _ in losses] == list(range(1, TOTAL_STEPS + 1))
            self._result = dict(losses), torch.load(self.out)
        return self._result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    root = _fast_root()
    d = Path(tempfile.mkdtemp(prefix="deltackpt-ref-", dir=root)) if root else tmp_path_factory.mktemp("ref")
    ref = Reference(d)
    try:
        yield ref
    finally:
        if ref.proc.poll() is None:
            kill_group(ref.proc.pid)
            ref.proc.wait()
        if root:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote") / "stderr")
    try:
        yield z
    finally:
        z.close()


# -- 1. exact resume after SIGKILL ------------------------------------------------------------------------

@linux_only
@pytest.mark.parametrize("every,kills,when_busy", [(1, 2, "wait"), (3, 1, "wait"), (1, 2, "skip")])
def test_exact_resume_after_sigkill(reference: Reference, zygote: Zygote, fast_dir: Path, rng: random.Random,
                                    every: int, kills: int, when_busy: str) -> None:
    """SIGKILL a run at random steps, rerun the same command until it finishes: the final model, optimizer,
    scheduler, RNG and data position are bit-identical to an uninterrupted run's, and so is every loss any
    run logged (a resumed run repeats the steps after its last committed checkpoint). With when_busy="skip" the
    runs save the steps they reach while no save runs, and resume from the last of those that committed."""
    store, out = fast_dir / "store", fast_dir / "final.pt"
    runs: list[tuple[int, list[tuple[int, str]]]] = []
    for run in range(kills + 1):
        log, output = fast_dir / f"log{run}", fast_dir / f"out{run}"
        # (skipping: steps without a sleep, so that saves outlast steps and steps are skipped)
        sleep = STEP_SLEEP if when_busy == "wait" else 0.0
        pid = zygote.run(worker_argv(store, log, out=out, every=every, sleep=sleep, when_busy=when_busy), output)
        if run == kills:
            code = zygote.wait(pid)
            text = output.read_text()
            assert code == 0 and "DONE" in text, f"last run: exit {code}: {text[-3000:]}"
        else:

            def alive(output: Path = output) -> bool:
                return "FINALLY" not in (output.read_text() if output.exists() else "")

            while read_log(log)[0] is None:
                assert alive(), output.read_text()
                time.sleep(0.003)
            start = read_log(log)[0]
            assert start is not None
            # (skipping, the first save commits while later steps train: give it some of them)
            low = (3 if every == 1 and when_busy == "wait" else 7) if run == 0 else 2
            k = rng.randint(low, max(low, min(25, TOTAL_STEPS - start - 8)))
            wait_for_lines(log, k, alive)
            time.sleep(rng.uniform(0, STEP_SLEEP))  # land anywhere in a step: training, logging, saving
            kill_group(pid)
            code = zygote.wait(pid)
            assert code == -signal.SIGKILL, f"run {run} was not killed (exit {code}): k={k}, start={start}"
        start, losses = read_log(log)
        assert start is not None, f"run {run} logged no START"
        runs.append((start, losses))

    ref_losses, ref_final = reference.result()
    print("runs (start, last logged):", [(s, ls[-1][0] if ls else None) for s, ls in runs])
    assert runs[0][0] == 0
    for i, (start, losses) in enumerate(runs):
        assert [s for s, _ in losses] == list(range(start + 1, start + 1 + len(losses))), f"run {i} skipped"
        for step, loss in losses:
            assert loss == ref_losses[step], (
                f"run {i} (resumed at {start}): step {step} loss {float.fromhex(loss)!r} != reference "
                f"{float.fromhex(ref_losses[step])!r}"
            )
        if i:
            prev_start, prev = runs[i - 1]
            last = prev[-1][0] if prev else prev_start
            # ckpt.step(last - 1) returned before step `last` was logged; it saved the newest multiple m of
            # `every` <= last - 1 after waiting for the save of m - every, so that one was committed
            # (skipping, any step since the run before started may be the last whose save committed)
            m = (last - 1) // every * every if when_busy == "wait" else prev_start + every
            assert start % every == 0, f"run {i} resumed at step {start}, not a multiple of {every}"
            assert max(prev_start, m - every) <= start <= last, (
                f"run {i} resumed at {start}; run {i - 1} started at {prev_start} and logged up to {last}"
            )
    assert runs[-1][1][-1][0] == TOTAL_STEPS
    assert runs[-1][0] > 0, "the last run did not resume from a checkpoint"
    assert_bitwise(ref_final, torch.load(out), "final")


# -- 8. exact resume in-process ---------------------------------------------------------------------------

def _run_steps(parts: dict[str, Any], ckpt: Checkpointer, first: int, last: int) -> list[str]:
    losses = []
    batches = parts["data"].batches()
    for step in range(first, last + 1):
        losses.append(tw.train_step(parts, next(batches)).hex())
        ckpt.step(step)
    return losses


def _checkpointer(path: Path, parts: dict[str, Any], **kw: Any) -> Checkpointer:
    return Checkpointer(path, model=parts["model"], optimizer=parts["optimizer"],
                        scheduler=parts["scheduler"], data=parts["data"], handle_signals=False, **kw)


@pytest.mark.parametrize("total,split", [(12, 5), (30, 13), (30, 21)])
def test_exact_resume_in_process(fast_dir: Path, total: int, split: int) -> None:
    """12 uninterrupted steps == 5 steps, close, fresh objects (another init seed), restore, 7 steps; also
    across an epoch end (13 batches an epoch) and with a resume exactly at one."""
    parts = tw.build(total, num_workers=0, seed=0)
    ckpt = _checkpointer(fast_dir / "a", parts)
    assert ckpt.restore() == 0
    ref_losses = _run_steps(parts, ckpt, 1, total)
    ckpt.close()
    ref = tw.final_state(parts)

    parts = tw.build(total, num_workers=0, seed=0)
    ckpt = _checkpointer(fast_dir / "b", parts)
    losses = _run_steps(parts, ckpt, 1, split)
    ckpt.close()
    torch.manual_seed(12345)  # nothing of the first half may leak through the global RNG
    parts = tw.build(total, num_workers=0, seed=777)
    ckpt = _checkpointer(fast_dir / "b", parts)
    assert ckpt.restore() == split
    losses += _run_steps(parts, ckpt, split + 1, total)
    ckpt.close()
    assert losses == ref_losses
    assert_bitwise(ref, tw.final_state(parts), "final")


def _ddp_job(tmp_path: Path, store: Path, steps: int, out: Path, mode: str,
             stop_at: int | None = None) -> tuple[list[int], list[str]]:
    """Two gloo ranks of tests/ddp_worker.py; their exit statuses and stderr."""
    worker = Path(__file__).resolve().parent / "ddp_worker.py"
    init = tmp_path / f"pg-{out.name}"
    args = [str(store), str(steps), str(out), mode] + ([str(stop_at)] if stop_at is not None else [])
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(init), *args], stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    codes, errs = [], []
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert stop_at is not None or p.returncode == 0, err[-3000:]
        codes.append(p.returncode)
        errs.append(err)
    return codes, errs


@pytest.mark.plumbing
def test_a_data_parallel_rank_other_than_0_that_saves_is_warned(tmp_path: Path) -> None:
    """Every rank of a DDP job stepping a Checkpointer made without rank= saves each step once per rank into the
    job's store: rank 1's first save warns, naming rank=; rank 0's does not."""
    _, errs = _ddp_job(tmp_path, tmp_path / "s", 2, tmp_path / "out", "unranked")
    assert "rank 1 of a DistributedDataParallel job saves a checkpoint" in errs[1], errs[1][-2000:]
    assert "rank=torch.distributed.get_rank()" in errs[1] and "DistributedDataParallel" not in errs[0], errs


@pytest.mark.plumbing
def test_a_data_parallel_group_of_its_own_saves_unwarned(tmp_path: Path) -> None:
    """DDP over a subgroup (each rank a data-parallel group of one, a store of its own: pipeline stages' replicas
    say) saves from each group's rank 0, which is rank 1 of the job for the second: no warning."""
    _, errs = _ddp_job(tmp_path, tmp_path / "s", 2, tmp_path / "out", "subgroups")
    assert not any("DistributedDataParallel job saves" in e for e in errs), errs
    for rank in range(2):
        with Store(tmp_path / f"s-{rank}") as s:
            assert [c.step for c in s.list()] == [2]


def _same_weights(a: Path, b: Path) -> bool:
    want, got = torch.load(a), torch.load(b)
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.plumbing
def test_data_parallel_ranks_resume_exactly_from_rank_0s_saves(tmp_path: Path) -> None:
    """The older data-parallel pattern, two gloo ranks of DistributedDataParallel (tests/ddp_worker.py seeded):
    rank 0 alone steps its Checkpointer, each rank seeds its generator from the step. 10 uninterrupted steps ==
    5 steps, a new job, restore on every rank, 5 more; on both ranks, bit for bit."""
    _ddp_job(tmp_path, tmp_path / "a", 10, tmp_path / "full", "seeded")
    _ddp_job(tmp_path, tmp_path / "b", 5, tmp_path / "half", "seeded")
    _, errs = _ddp_job(tmp_path, tmp_path / "b", 10, tmp_path / "resumed", "seeded")
    assert not any("DistributedDataParallel job saves" in e for e in errs), errs  # (rank 1 saves nothing)
    with Store(tmp_path / "b") as s:
        assert [c.step for c in s.list()] == [2, 4, 6, 8, 10]  # rank 0's saves only
    for rank in range(2):
        want, got = (torch.load(tmp_path / f"{name}.{rank}") for name in ("full", "resumed"))
        assert_bitwise(want, got, f"rank {rank}")


@pytest.mark.plumbing
def test_data_parallel_ranks_keep_their_own_rng_states(tmp_path: Path) -> None:
    """The README's data-parallel pattern (tests/ddp_worker.py ranks): every rank passes rank= and steps its
    Checkpointer, and draws its dropout and a NumPy noise term from streams seeded apart at start, never from the
    step. 10 uninterrupted steps == 5, a new job, 5 more; and == a job stopped by a job-wide SIGTERM after step 5
    (rank 0 saves step 6 and exits, rank 1 fails in the next all-reduce), restarted. On both ranks, bit for bit.
    Without rank 1's kept states (their directory removed) rank 1 resumes otherwise, with a warning, and the job
    ends elsewhere: the test can tell."""
    _ddp_job(tmp_path, tmp_path / "a", 10, tmp_path / "full", "ranks")
    _ddp_job(tmp_path, tmp_path / "b", 5, tmp_path / "half", "ranks")
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    _ddp_job(tmp_path, tmp_path / "b", 10, tmp_path / "resumed", "ranks")
    with Store(tmp_path / "b") as s:
        assert [c.step for c in s.list()] == [2, 4, 6, 8, 10]  # rank 0's saves only
    assert sorted(p.name for p in (tmp_path / "b" / "rng").iterdir()) == ["rank-00001"]
    for rank in range(2):
        assert _same_weights(tmp_path / f"full.{rank}", tmp_path / f"resumed.{rank}"), f"rank {rank}"

    codes, _ = _ddp_job(tmp_path, tmp_path / "d", 10, tmp_path / "stopped", "ranks", stop_at=5)
    assert codes == [128 + signal.SIGTERM] * 2, codes  # (each passed the signal on: SIG_DFL exits so)
    with Store(tmp_path / "d") as s:
        assert [c.step for c in s.list()] == [2, 4, 6]
    _ddp_job(tmp_path, tmp_path / "d", 10, tmp_path / "stop-resumed", "ranks")
    for rank in range(2):
        assert _same_weights(tmp_path / f"full.{rank}", tmp_path / f"stop-resumed.{rank}"), f"rank {rank}"

    shutil.rmtree(tmp_path / "c" / "rng")
    worker = Path(__file__).resolve().parent / "ddp_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(tmp_path / "pg-x"),
                               str(tmp_path / "c"), "10", str(tmp_path / "lost"), "ranks"], stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert "rank 1 has no RNG states of step 4 to restore" in errs[1] and "RNG" not in errs[0], errs
    # (the gradients are averaged over the ranks: rank 1's other draws move the weights of both)
    assert not _same_weights(tmp_path / "full.0", tmp_path / "lost.0")


@pytest.mark.plumbing
def test_data_parallel_ranks_that_skip_busy_steps_resume_exactly(tmp_path: Path) -> None:
    """when_busy="skip" on every rank (tests/ddp_worker.py MODE skip): whichever steps rank 0 saved, a new job
    after 5 steps, or after a job-wide SIGTERM at step 5 (rank 0 saves step 6 and exits), ends where 10
    uninterrupted steps end, on both ranks, bit for bit, and no rank misses its RNG states."""
    _ddp_job(tmp_path, tmp_path / "a", 10, tmp_path / "full", "skip")
    _ddp_job(tmp_path, tmp_path / "b", 5, tmp_path / "half", "skip")
    _, errs = _ddp_job(tmp_path, tmp_path / "b", 10, tmp_path / "resumed", "skip")
    assert not any("RNG states" in e for e in errs), errs
    codes, _ = _ddp_job(tmp_path, tmp_path / "d", 10, tmp_path / "stopped", "skip", stop_at=5)
    assert codes == [128 + signal.SIGTERM] * 2, codes
    with Store(tmp_path / "d") as s:
        assert s.latest().step == 6  # type: ignore[union-attr]
    _, errs = _ddp_job(tmp_path, tmp_path / "d", 10, tmp_path / "stop-resumed", "skip")
    assert not any("RNG states" in e for e in errs), errs
    for rank in range(2):
        for run in ("resumed", "stop-resumed"):
            assert _same_weights(tmp_path / f"full.{rank}", tmp_path / f"{run}.{rank}"), f"rank {rank}, {run}"


def test_restore_decodes_into_the_model(fast_dir: Path) -> None:
    """restore() hands load_state_dict the model's own tensors, already holding the checkpoint's values: no
    second copy of the model is allocated. The optimizer's state is loaded as usual."""
    seen: list[bool] = []

    class Spy(torch.nn.Sequential):
        def load_state_dict(self, state: Any, *args: Any, **kwargs: Any) -> Any:
            mine = self.state_dict()
            seen.append(all(state[k].data_ptr() == v.data_ptr() for k, v in mine.items()))
            return super().load_state_dict(state, *args, **kwargs)

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = Spy(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, opt = build(0)
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    with deltackpt.Checkpointer(fast_dir / "s", model=model, optimizer=opt, async_save=False,
                                handle_signals=False) as ckpt:
        ckpt.save(1)
    model2, opt2 = build(1)
    ptrs = [p.data_ptr() for p in model2.parameters()]
    with deltackpt.Checkpointer(fast_dir / "s", model=model2, optimizer=opt2, handle_signals=False) as ckpt:
        assert ckpt.restore() == 1
    assert seen == [True]
    assert [p.data_ptr() for p in model2.parameters()] == ptrs
    assert_bitwise(model.state_dict(), model2.state_dict(), "model")
    assert_bitwise(opt.state_dict(), opt2.state_dict(), "optimizer")


def _cpu_fused_adamw() -> bool:
    """Whether this torch has a fused AdamW for CPU tensors (torch 2.4+)."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _cpu_fused_adamw(), reason="this torch has no fused AdamW for CPU tensors (torch 2.4+)"))])
def test_a_channels_last_model_resumes_exactly(fast_dir: Path, fused: bool) -> None:
    """A CNN trained in channels_last memory format: the optimizer's moments come back in their parameters'
    layout, as the optimizer made them (the store restores tensors contiguous). In another layout torch's fused
    AdamW pairs the elements of parameter and moments wrongly, and the other kernels round otherwise."""
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1)).contiguous(
        memory_format=torch.channels_last)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
        model.to(memory_format=torch.channels_last)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    ref_model, ref_opt = build()
    train(ref_model, ref_opt, 4)
    model, opt = build()
    train(model, opt, 2)
    with deltackpt.Checkpointer(fast_dir / "s", model=model, optimizer=opt, async_save=False,
                                handle_signals=False) as ckpt:
        ckpt.save(2)
    model, opt = build()
    with deltackpt.Checkpointer(fast_dir / "s", model=model, optimizer=opt, handle_signals=False) as ckpt:
        assert ckpt.restore() == 2
    w = model[0].weight
    assert opt.state[w]["exp_avg"].stride() == w.stride()
    train(model, opt, 2)
    assert_bitwise(ref_model.state_dict(), model.state_dict(), "model")
    assert_bitwise(ref_opt.state_dict(), opt.state_dict(), "optimizer")


# -- 2. async saves do not see later mutations ------------------------------------------------------------

@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
])
def test_async_save_snapshots_before_returning(fast_dir: Path, device: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, handle_signals=False)
    expected: dict[int, tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]] = {}
    try:
        for step in (1, 2, 3):
            model(torch.randn(16, 512, device=device)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            moments = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
            expected[step] = weights, moments
            assert ckpt.step(step)
            with torch.no_grad():  # at once, while the background save runs
                for p in model.parameters():
                    p.add_(1000.0)
                for s in opt.state.values():
                    s["exp_avg"].mul_(-7.0)
                    s["exp_avg_sq"].fill_(3.0)
                    s["step"].add_(100.0)
            for k, v in model.state_dict().items():
                assert not torch.equal(v, weights[k])
        ckpt.wait()
        for step, (weights, moments) in expected.items():
            state = ckpt.store.load(step=step)
            assert state["step"] == step
            for k, v in weights.items():
                assert torch.equal(as_bytes(state["model"][k]), as_bytes(v)), f"step {step}: model {k}"
            assert set(state["optimizer"]["state"]) == set(moments)
            for i, s in moments.items():
                for k, v in s.items():
                    got = state["optimizer"]["state"][i][k]
                    assert torch.equal(as_bytes(got), as_bytes(v)), f"step {step}: optimizer state {i}.{k}"
    finally:
        ckpt.close()


# -- 3. background errors ---------------------------------------------------------------------------------

def _small() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters())


def _steps_and_manifests(path: Path) -> tuple[list[int], int]:
    with Store(path) as store:
        steps = [i.step for i in store.list()]
    return steps, len(list((path / "manifests").glob("*")))


def test_background_error_raised_at_next_step(fast_dir: Path) -> None:
    model, opt = _small()
    extra: dict[str, Any] = {"epoch": 1}
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, extra=extra, handle_signals=False)
    try:
        assert ckpt.step(1)
        ckpt.wait()
        extra["bad"] = object()  # a plain value the store cannot hold: the background save fails
        assert ckpt.step(2), "the async save only fails in the background"
        with pytest.raises(UnsupportedTypeError, match="bad") as info:  # the save's own error, type and all
            ckpt.step(3)
        if sys.version_info >= (3, 11):
            assert "background save of step 2" in "".join(info.value.__notes__)
        assert [i.step for i in ckpt.store.list()] == [1], "nothing may be committed for the failed step"
        # the error was raised once; with the value gone, training and saving go on
        del extra["bad"]
        assert ckpt.step(4)
    finally:
        ckpt.close()
    assert _steps_and_manifests(fast_dir / "store") == ([1, 4], 2)


def test_background_error_not_lost_between_save_steps(fast_dir: Path) -> None:
    model, opt = _small()
    extra: dict[str, Any] = {"bad": object()}
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, extra=extra, every_n_steps=2,
                        handle_signals=False)
    try:
        assert not ckpt.step(1)
        assert ckpt.step(2)
        with pytest.raises(UnsupportedTypeError):
            ckpt.step(3)  # not due: raises if the failure is known by now ...
            ckpt.step(4)  # ... and at the latest here, before the next save
        assert len(ckpt.store.list()) == 0
    finally:
        extra.clear()
        ckpt.close()
    assert _steps_and_manifests(fast_dir / "store") == ([], 0)


def test_background_error_raised_at_close(fast_dir: Path) -> None:
    model, opt = _small()
    extra: dict[str, Any] = {}
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, extra=extra, handle_signals=False)
    assert ckpt.step(1)
    extra["bad"] = {"nested": [1, object()]}
    assert ckpt.step(2)
    with pytest.raises(UnsupportedTypeError, match="bad"):
        ckpt.close()
    ckpt.close()  # idempotent: the error was reported once
    assert _steps_and_manifests(fast_dir / "store") == ([1], 1)


# -- when_busy: a step of the schedule while the save before it still runs --------------------------------

def _held(ckpt: Checkpointer) -> threading.Semaphore:
    """Hold each of ``ckpt``'s saves in its store until the semaphore returned is released once for it (the store's
    own save, late)."""
    go = threading.Semaphore(0)
    store_save = ckpt.store._save  # (what a Checkpointer's save calls)

    def held_save(*args: Any, **kwargs: Any) -> Any:
        assert go.acquire(timeout=60)
        return store_save(*args, **kwargs)

    ckpt.store._save = held_save  # type: ignore[method-assign]
    return go


def _waits_for_the_held_save(ckpt: Checkpointer, step: int, go: threading.Semaphore, permits: int = 1) -> bool:
    """``ckpt.step(step)`` on a thread while the save before it is held (:func:`_held`): it must not return until
    ``permits`` saves are let through; then what it returned."""
    saved: list[bool] = []
    t = threading.Thread(target=lambda: saved.append(ckpt.step(step)))
    t.start()
    t.join(0.3)
    assert t.is_alive(), f"step({step}) returned while the save before it was held"
    go.release(permits)
    t.join(60)
    return saved == [True]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """One AdamW step on random data; the model's weights after it (copies)."""
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_when_busy_skip_saves_no_step_while_the_save_before_it_runs(fast_dir: Path) -> None:
    model, opt = _small()
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, when_busy="skip", handle_signals=False)
    go = _held(ckpt)
    try:
        weights = {1: _train(model, opt)}
        assert ckpt.step(1)  # (its save is held: in flight until go)
        for s in (2, 3):
            _train(model, opt)
            assert not ckpt.step(s), f"step {s} was saved while the save of step 1 ran"
        assert ckpt.skipped == 2 and ckpt.last_saved_step == 1
        go.release()
        ckpt.wait()
        weights[4] = _train(model, opt)
        assert ckpt.step(4) and ckpt.skipped == 2
        go.release()
        ckpt.wait()
        infos = ckpt.store.list()
        assert [i.step for i in infos] == [1, 4]
        assert infos[1].parent == infos[0].id  # (the save after the skipped steps descends from the last saved)
        for s, expected in weights.items():
            assert_bitwise(expected, ckpt.store.load(step=s)["model"], f"step {s}")
    finally:
        go.release(10)
        ckpt.close()


def test_when_busy_wait_saves_every_step_of_the_schedule(fast_dir: Path) -> None:
    """The default: a step of the schedule waits for the save before it, however long it takes."""
    model, opt = _small()
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, handle_signals=False)
    go = _held(ckpt)
    try:
        _train(model, opt)
        assert ckpt.step(1)
        _train(model, opt)
        assert _waits_for_the_held_save(ckpt, 2, go, permits=2) and ckpt.skipped == 0
        ckpt.wait()
        assert [i.step for i in ckpt.store.list()] == [1, 2]
    finally:
        go.release(10)
        ckpt.close()


def test_when_busy_skip_waits_at_a_step_retention_keeps_for_good(fast_dir: Path) -> None:
    """keep_every=3: step 3 is waited for, however long the save before it runs, so that the history keeps one
    checkpoint every 3 steps; steps 2, 4 and 5 are skipped."""
    model, opt = _small()
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, when_busy="skip", handle_signals=False,
                        retention=Retention(keep_last=1, keep_every=3))
    go = _held(ckpt)
    try:
        _train(model, opt)
        assert ckpt.step(1)
        _train(model, opt)
        assert not ckpt.step(2)
        _train(model, opt)
        assert _waits_for_the_held_save(ckpt, 3, go)  # (retention keeps it for good)
        for s in (4, 5):  # (step 3's save is held)
            _train(model, opt)
            assert not ckpt.step(s)
        assert ckpt.skipped == 3
        go.release()
        ckpt.wait()
        assert [i.step for i in ckpt.store.list()] == [3]
    finally:
        go.release(10)
        ckpt.close()


@linux_only
def test_when_busy_skip_still_saves_at_a_stop_signal(fast_dir: Path) -> None:
    """A stop signal's save waits for the save in flight, whatever when_busy says, then passes the signal on."""
    model, opt = _small()
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, when_busy="skip")
        go = _held(ckpt)
        try:
            _train(model, opt)
            assert ckpt.step(1)
            expected = _train(model, opt)
            signal.raise_signal(signal.SIGTERM)
            assert got == []  # (held until the step boundary)
            threading.Timer(0.3, lambda: go.release(2)).start()
            assert ckpt.step(2)
            assert got == [signal.SIGTERM] and ckpt.skipped == 0
            assert [i.step for i in ckpt.store.list()] == [1, 2]
            assert_bitwise(expected, ckpt.store.load(step=2)["model"])
        finally:
            go.release(10)
            ckpt.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_when_busy_skip_every_saved_step_is_the_state_at_that_step(fast_dir: Path) -> None:
    """Real saves, not held: however the saves and steps interleave, step() says which steps it saved, the store
    holds exactly those, each is the state of its step, and each descends from the one saved before it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.Linear(2048, 512))  # 8 MB of weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, when_busy="skip", handle_signals=False)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for s in range(1, 16):
            with torch.no_grad():  # (a cheap step: the saves are the slow part)
                for p in model.parameters():
                    p.add_(torch.full_like(p, 1e-3 * s))
            if ckpt.step(s):
                expected[s] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ckpt.wait()
        infos = ckpt.store.list()
        assert [i.step for i in infos] == sorted(expected)
        assert len(expected) + ckpt.skipped == 15
        assert [i.parent for i in infos[1:]] == [i.id for i in infos[:-1]]
        for s, weights in expected.items():
            assert_bitwise(weights, ckpt.store.load(step=s)["model"], f"step {s}")
    finally:
        ckpt.close()


def test_a_closed_store_is_refused_when_the_checkpointer_is_made(tmp_path: Path) -> None:
    """Before, a Checkpointer took a closed Store and raised "closed" only at its first restore() or step()."""
    model, opt = _small()
    store = Store(tmp_path / "store")
    store.close()
    with pytest.raises(deltackpt.DeltackptError, match="is closed: give the Checkpointer an open Store"):
        Checkpointer(store, model=model, optimizer=opt, handle_signals=False)


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"when_busy": "Skip"}, ValueError, "when_busy must be one of 'wait', 'skip', got 'Skip'"),
    ({"when_busy": None}, TypeError, "when_busy must be one of"),
    ({"when_busy": True}, TypeError, "when_busy must be one of"),
    ({"when_busy": "skip", "async_save": False}, ValueError, "needs async_save=True"),
])
def test_a_bad_when_busy_is_refused_and_creates_no_store(tmp_path: Path, kw: dict[str, Any], error: type[Exception],
                                                         match: str) -> None:
    model, opt = _small()
    with pytest.raises(error, match=match):
        Checkpointer(tmp_path / "store", model=model, optimizer=opt, handle_signals=False, **kw)
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("bad", ["3", 2.0, True, None, -1, 2**63])
def test_bad_step_is_refused_before_anything_is_saved(fast_dir: Path, bad: Any) -> None:
    model, opt = _small()
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, handle_signals=False) as ckpt:
        for call in (ckpt.step, ckpt.save):
            with pytest.raises(TypeError if isinstance(bad, bool) or type(bad) is not int else ValueError,
                               match="step must be"):
                call(bad)
        assert ckpt.store.list() == []


def test_sync_save_error_raised_by_step(fast_dir: Path) -> None:
    model, opt = _small()
    extra: dict[str, Any] = {}
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, extra=extra, async_save=False,
                        handle_signals=False)
    try:
        assert ckpt.step(1)
        extra["bad"] = object()
        with pytest.raises(UnsupportedTypeError):
            ckpt.step(2)
        assert [i.step for i in ckpt.store.list()] == [1]
    finally:
        extra.clear()
        ckpt.close()


# -- 4. bounded staging ----------------------------------------------------------------------------------

def _state_nbytes(state: Any, seen: set[int] | None = None) -> int:
    seen = set() if seen is None else seen
    if isinstance(state, (torch.Tensor, np.ndarray)):
        if id(state) in seen:
            return 0
        seen.add(id(state))
        return state.nbytes
    if isinstance(state, dict):
        return sum(_state_nbytes(v, seen) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_nbytes(v, seen) for v in state)
    return 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_close_frees_staging_without_the_cyclic_collector(fast_dir: Path) -> None:
    """close() gives the staging copy back at once: nothing but the checkpointer holds its buffers (a snapshot
    once left them in a reference cycle, freed only when the cyclic collector next ran), nor the state's own
    tensors."""
    import weakref

    model, opt = _small()
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, every_n_steps=1, async_save=True,
                            handle_signals=False)
        x = torch.randn(4, 8)
        for step in range(1, 4):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            assert ckpt.step(step)
        ckpt.wait()
        buffers = [weakref.ref(b) for b in ckpt._staging._buffers.values() if isinstance(b, torch.Tensor)]
        assert buffers and all(r() is not None for r in buffers)
        ckpt.close()
        alive = sum(r() is not None for r in buffers)
        assert alive == 0, f"{alive} of {len(buffers)} staging buffers outlive close() until a gc.collect()"
        assert ckpt.staging_bytes == 0
    finally:
        if was_enabled:
            gc.enable()


def _deltackpt_garbage() -> list[str]:
    """What a collection finds unreachable that deltackpt made: its functions (closures in a reference cycle),
    objects of its classes, frames of its code. (Collects with DEBUG_SAVEALL, then frees what it saved.)"""
    import types

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = []
        for o in gc.garbage:
            if isinstance(o, types.FunctionType):
                name, module = o.__qualname__, o.__module__ or ""
            elif isinstance(o, types.FrameType):
                name, module = o.f_code.co_qualname, o.f_globals.get("__name__", "")
            else:
                name, module = type(o).__qualname__, type(o).__module__
            if module.split(".")[0] == "deltackpt":
                found.append(f"{module}.{name}")
        return sorted(set(found))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()


def test_saves_loads_and_maintenance_leave_no_reference_cycles(tmp_path: Path) -> None:
    """Saves (sync and async, with retention), loads (bare, into a model, of an older step), verify, delete,
    gc and restore free what they allocated when they return or when the caller drops it, without the cyclic
    collector: a reference cycle through one of deltackpt's closures held a load's outputs, and another an
    async checkpointer's staging copy, until the collector next ran."""
    model, opt = _small()
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        assert _deltackpt_garbage() == []
        x = torch.randn(4, 8)
        with Checkpointer(tmp_path / "c", model=model, optimizer=opt, async_save=True, handle_signals=False,
                          retention=Retention(keep_last=2)) as ckpt:
            for n in range(1, 5):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                ckpt.step(n)
            ckpt.wait()
        assert _deltackpt_garbage() == []
        with Checkpointer(tmp_path / "c", model=model, optimizer=opt, handle_signals=False) as ckpt:
            assert ckpt.restore() == 4
            ckpt.save(5, wait=True)
        with Store(tmp_path / "c") as s:
            s.load()
            s.load(step=3, into={"model": model.state_dict()})
            s.verify()
            s.delete(3)
            s.gc()
        assert _deltackpt_garbage() == []
    finally:
        if was_enabled:
            gc.enable()


def test_staging_is_bounded(fast_dir: Path) -> None:
    """1000 async saves of a state of unchanging shapes: the staging buffers are allocated once, the store
    keeps 3 checkpoints, and neither the Python heap (allocated blocks) nor the RSS grows with the saves."""
    # 1000 saves take ~5 s on tmpfs; where there is none every save pays real fsyncs (~40 ms here), so
    # fewer saves keep the test under ~20 s - the bounds are checked the same way. (tracemalloc would make
    # each save ~5x slower; sys.getallocatedblocks() and the RSS are free to read.)
    n = 1000 if _fast_root() is not None else 250
    model, opt = _small()
    # a tiny delta-base cache: that cache is bounded by its own (1 GiB) limit and is not what this measures
    store = Store(fast_dir / "store", delta_cache_bytes=1 << 14)
    ckpt = Checkpointer(store, model=model, optimizer=opt, every_n_steps=1, retention=Retention(keep_last=3),
                        handle_signals=False)
    x = torch.randn(4, 8)
    try:
        first = None
        blocks_at = rss_at = 0
        for step in range(1, n + 1):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            assert ckpt.step(step)
            if first is None:
                first = ckpt.staging_bytes
                want = _state_nbytes(ckpt.capture(step))
                assert first == want > 0, f"staging holds {first} bytes; one copy of the state is {want}"
            assert ckpt.staging_bytes == first, f"staging grew to {ckpt.staging_bytes} at save {step}"
            if step % 100 == 0:
                ckpt.wait()
                assert len(store.list()) <= 3
            if step == n // 10:
                gc.collect()
                blocks_at, rss_at = sys.getallocatedblocks(), _rss()
        ckpt.wait()
        gc.collect()
        blocks, rss = sys.getallocatedblocks() - blocks_at, _rss() - rss_at
        assert [i.step for i in store.list()] == [n - 2, n - 1, n]
        assert ckpt.staging_bytes == first
        saves = n - n // 10
        assert blocks < saves, f"{blocks} more Python objects after {saves} saves: something leaks per save"
        assert rss < 32 << 20, f"RSS grew by {rss} bytes over {saves} saves"
    finally:
        ckpt.close()
        store.close()


# -- 5. SIGTERM ------------------------------------------------------------------------------------------

def _start(argv: list[str], d: Path) -> tuple[subprocess.Popen[bytes], Path]:
    out = d / "stdout"
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(WORKER), *argv], stdout=f, stderr=subprocess.STDOUT,
                                env=worker_env(), start_new_session=True)
    return proc, out


def _sigterm_run(d: Path, rng: random.Random, *, group: bool = False,
                 **more: Any) -> tuple[int, int, str, list[tuple[int, str]]]:
    """Start a worker (no interval saves), SIGTERM it (``group``: its whole process group, DataLoader workers
    included) after some steps; (exit code, steps logged before the signal, its output, its logged steps)."""
    log = d / "log"
    proc, out = _start(worker_argv(d / "store", log, steps=400, every=1000, sleep=0.05, **more), d)
    try:
        wait_for_lines(log, rng.randint(3, 10), lambda: proc.poll() is None, timeout=120)
        time.sleep(rng.uniform(0, 0.02))
        before = len(read_log(log)[1])
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        if group:  # the DataLoader's workers end with the training process
            deadline = time.monotonic() + 30
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _group_alive(proc.pid), "DataLoader workers outlived the training process"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_group(proc.pid)
    return code, before, out.read_text(), read_log(log)[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _finally_step(output: str) -> int:
    m = re.search(r"^FINALLY (\d+)$", output, re.M)
    assert m, f"the worker's finally block did not run: {output[-3000:]}"
    return int(m.group(1))


def test_async_save_stages_counters_sets_and_keys_that_print_alike(fast_dir: Path) -> None:
    """The staging snapshot keeps container types (MultiStepLR's Counter, defaultdicts, deques), copies mutable
    plain containers (a set changed after step() returns is saved as it was), and gives tensors under keys that
    print alike (1 and "1") buffers of their own."""
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 3, 3], gamma=0.5)
    extra = {
        "seen": {1, 2},
        "by_key": {1: torch.zeros(4), "1": torch.ones(4)},
        "hist": collections.defaultdict(list, {"loss": [0.5]}),
        "window": collections.deque([torch.full((2,), 7.0)], maxlen=4),
    }
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, scheduler=sched, extra=extra,
                      async_save=True, handle_signals=False) as ckpt:
        opt.step()
        sched.step()
        ckpt.save(1)
        extra["seen"].add(99)  # after the snapshot: not part of step 1
        extra["hist"]["loss"].append(0.25)
        ckpt.wait()
        saved = ckpt.store.load(1)
    assert saved["extra"]["seen"] == {1, 2}
    assert saved["extra"]["hist"] == {"loss": [0.5]} and saved["extra"]["hist"].default_factory is list
    assert torch.equal(saved["extra"]["by_key"][1], torch.zeros(4))
    assert torch.equal(saved["extra"]["by_key"]["1"], torch.ones(4))
    assert type(saved["extra"]["window"]) is collections.deque and saved["extra"]["window"].maxlen == 4
    assert torch.equal(saved["extra"]["window"][0], torch.full((2,), 7.0))
    milestones = saved["scheduler"]["milestones"]
    assert type(milestones) is collections.Counter and milestones == collections.Counter({1: 1, 3: 2})


def test_async_save_of_a_tied_model_stages_and_stores_the_tied_weight_once(fast_dir: Path) -> None:
    """A tied model's ``state_dict()`` holds the shared weight under two keys, as two tensor objects: the staging
    copy keeps them one buffer, the checkpoint one tensor, and the restore ties them again."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(64, 16)
            self.head = torch.nn.Linear(16, 64, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=True, handle_signals=False) as ckpt:
        for step in (1, 2):
            model.head(model.emb(torch.arange(8))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.save(step)
        ckpt.wait()
        assert ckpt.staging_bytes == _state_nbytes(ckpt.capture(2)) - 64 * 16 * 4  # the tied weight once
        keys = [t.key for t in ckpt.store.manifest(2).tensors]
        assert "model.emb.weight" in keys and "model.head.weight" not in keys
        want = model.emb.weight.detach().clone()
        restored = Tied()
        with Checkpointer(ckpt.store, model=restored, optimizer=torch.optim.AdamW(restored.parameters()),
                          handle_signals=False) as again:
            assert again.restore() == 2
        assert restored.emb.weight is restored.head.weight
        assert torch.equal(restored.emb.weight, want)


@linux_only
@pytest.mark.plumbing
def test_sigterm_saves_at_step_boundary_and_exits_143(fast_dir: Path, rng: random.Random) -> None:
    code, before, output, logged = _sigterm_run(fast_dir, rng, finally_out=fast_dir / "model.pt")
    assert code == 128 + signal.SIGTERM, f"exit {code}: {output[-3000:]}"
    assert "DONE" not in output and "Traceback" not in output, output[-3000:]
    step = _finally_step(output)
    assert before <= step <= before + 1, f"saved at {step}; {before} steps were logged at the signal"
    assert logged[-1][0] == step, "the run trained past the step it saved at"
    with Store(fast_dir / "store") as store:
        infos = store.list()
        assert [i.step for i in infos] == [step], "one save, at the step where the signal was handled"
        state = store.load()
    assert state["step"] == step
    assert_bitwise(torch.load(fast_dir / "model.pt"), state["model"], "model")


@linux_only
@pytest.mark.parametrize("loaders", [{"workers": 2}, {"workers": 1, "eval_workers": 2}], ids=["given", "eval"])
@pytest.mark.plumbing
def test_sigterm_to_the_whole_job_with_dataloader_workers_saves_at_the_step_boundary(
        fast_dir: Path, rng: random.Random, loaders: dict[str, int]) -> None:
    """SLURM signals every process of a job step: the DataLoader's workers get the SIGTERM too. They used to
    die of it (torch installs its own SIGTERM handler in each worker), the DataLoader raised "worker exited
    unexpectedly" in the training process before the step boundary, and nothing was saved. The checkpointer
    makes the workers of the loader it was given ignore stop signals, and those of an evaluation loader drawn
    from every step once it is given to ``protect_workers``: the run saves at the boundary, exits 143, and its
    workers end with it."""
    code, before, output, logged = _sigterm_run(fast_dir, rng, group=True, **loaders)
    assert code == 128 + signal.SIGTERM, f"exit {code}: {output[-3000:]}"
    assert "Traceback" not in output and "exited unexpectedly" not in output, output[-3000:]
    step = _finally_step(output)
    assert before <= step <= before + 1 and logged[-1][0] == step
    with Store(fast_dir / "store") as store:
        assert [i.step for i in store.list()] == [step]
        assert store.load()["step"] == step


_EXIT_RUN = """
import os, signal, sys, torch
from torch.utils.data import DataLoader, TensorDataset
import deltackpt
from deltackpt.data import ResumableLoader, ResumableSampler
how, store = sys.argv[1], sys.argv[2]
ds = TensorDataset(torch.randn(37, 4))
loader = ResumableLoader(DataLoader(ds, batch_size=5, num_workers=2, persistent_workers=how != "iterator",
                                    sampler=ResumableSampler(ds, seed=0)))
ckpt = deltackpt.Checkpointer(store, model=torch.nn.Linear(4, 1), data=loader, async_save=False)
batches = loader.batches()  # alive until the interpreter exits (its DataLoader iterator too)
for step in range(1, 6):
    next(batches)
    if how == "sigterm" and step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    ckpt.step(step)
if how == "close":
    ckpt.close()
print("DONE", flush=True)
"""


@linux_only
@pytest.mark.parametrize(("how", "code"), [("end", 0), ("close", 0), ("iterator", 0), ("sigterm", 143)])
@pytest.mark.plumbing
def test_a_run_whose_loader_workers_are_alive_at_exit_exits(fast_dir: Path, how: str, code: int) -> None:
    """Workers the checkpointer made ignore SIGTERM, still running when the interpreter exits (persistent ones,
    or those of an iterator a generator holds): multiprocessing stops them with SIGTERM and waits without a
    timeout, and the exit hung for good. Released at exit (and at close), they end at SIGTERM again."""
    proc = subprocess.Popen([sys.executable, "-c", _EXIT_RUN, how, str(fast_dir / "store")], env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.communicate()
        pytest.fail(f"the run ({how}) did not exit")
    finally:
        kill_group(proc.pid)
    text = out.decode(errors="replace")
    assert proc.returncode == code, text[-3000:]
    assert ("DONE" in text) == (how != "sigterm") and "Traceback" not in text, text[-3000:]
    with Store(fast_dir / "store") as store:
        assert store.latest().step == (3 if how == "sigterm" else 5)


_STOP_WHILE_WORKERS_START = """
import os, signal, sys, torch
from torch.utils.data import DataLoader, TensorDataset
import deltackpt
context, store = sys.argv[1], sys.argv[2]
loader = DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=5, num_workers=2, multiprocessing_context=context)
ckpt = deltackpt.Checkpointer(store, model=torch.nn.Linear(4, 1), async_save=False, every_n_steps=1000)
ckpt.protect_workers(loader)
batches = iter(loader)  # the workers start: a spawned one imports torch, a forked one seeds and imports first
os.killpg(0, signal.SIGTERM)  # the job's stop, to every process of the group, while they start
for step, _ in enumerate(batches, 1):
    ckpt.step(step)
print("NOT STOPPED", flush=True)
"""


@linux_only
@pytest.mark.plumbing
def test_a_stop_signal_while_loader_workers_start_waits_for_them(fast_dir: Path) -> None:
    """A SIGTERM sent to the whole process group while the DataLoader's (forked) workers are starting does not
    end them: they start with the stop signals blocked and take them once their handlers are in place (which
    ignore them), so the run saves at its step boundary and exits as the signal says. Before, a worker still
    starting died of it (the handler it inherited could not tell it was a DataLoader worker yet), and the run
    failed with 'DataLoader worker ... exited unexpectedly' without saving (an audit's training runs hit it at an
    epoch's start, 3 times in 12; this test, 5 times in 5)."""
    proc = subprocess.Popen([sys.executable, "-c", _STOP_WHILE_WORKERS_START, "fork", str(fast_dir / "store")],
                            env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_group(proc.pid)
    text = out.decode(errors="replace")
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "NOT STOPPED" not in text and "Traceback" not in text, text[-3000:]
    with Store(fast_dir / "store") as store:
        assert [i.step for i in store.list()] == [1]


class _MyLoader(torch.utils.data.DataLoader):
    """A DataLoader subclass with a state of its own (as torchdata's StatefulDataLoader)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_dataloader_subclass_is_protected_and_two_checkpointers_share_a_loader(fast_dir: Path) -> None:
    """A DataLoader subclass (given as data= or to protect_workers) is protected like a DataLoader: it used to be
    skipped silently. A loader two open checkpointers protect (a GAN's) stays protected until both close."""
    ds = _StopSignalDisposition()
    sub = _MyLoader(ds, batch_size=4, num_workers=1)
    shared = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1)
    with Checkpointer(fast_dir / "a", model=torch.nn.Linear(1, 1), data=sub) as a:
        assert next(iter(sub)).tolist() == [1.0] * 4
        a.protect_workers(shared)
        with Checkpointer(fast_dir / "b", model=torch.nn.Linear(1, 1)) as b:
            b.protect_workers(shared)
        assert next(iter(shared)).tolist() == [1.0] * 4  # b closed; a still protects it
    assert sub.worker_init_fn is None and shared.worker_init_fn is None
    assert next(iter(shared)).tolist() == [0.0] * 4


def test_a_resumable_sampler_given_as_data_protects_the_workers_of_its_loader(fast_dir: Path) -> None:
    """data= may be the ResumableSampler rather than its ResumableLoader (the same state): the workers of the
    DataLoader that the sampler feeds are protected all the same. They were not, and a SIGTERM to the whole job
    killed them, so the DataLoader raised before the step boundary and the stop saved nothing."""
    from deltackpt.data import ResumableLoader, ResumableSampler

    ds = _StopSignalDisposition()
    sampler = ResumableSampler(ds, shuffle=False)
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, sampler=sampler)
    loader = ResumableLoader(dl)
    with Checkpointer(fast_dir / "store", model=torch.nn.Linear(1, 1), data=sampler):
        assert next(iter(loader)).tolist() == [1.0] * 4
    assert dl.worker_init_fn is None
    assert next(iter(loader)).tolist() == [0.0] * 4


def test_a_resumable_sampler_given_as_data_protects_a_loader_built_after_the_checkpointer(fast_dir: Path) -> None:
    """A run that restores the sampler before it builds its loaders makes the Checkpointer first (data=sampler),
    then the ResumableLoader: the sampler had no DataLoader yet, so that loader's workers were left unprotected
    (a SIGTERM to the job killed them and the stop saved nothing). A loader that drives the sampler later is
    protected too, while the checkpointer is open."""
    from deltackpt.data import ResumableLoader, ResumableSampler

    ds = _StopSignalDisposition()
    sampler = ResumableSampler(ds, shuffle=False)
    with Checkpointer(fast_dir / "store", model=torch.nn.Linear(1, 1), data=sampler):
        dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, sampler=sampler)
        loader = ResumableLoader(dl)
        assert next(iter(loader)).tolist() == [1.0] * 4
    assert dl.worker_init_fn is None
    later = ResumableLoader(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, sampler=sampler))
    assert later.loader.worker_init_fn is None  # (closed: no longer protects anything)
    assert next(iter(later)).tolist() == [0.0] * 4


def test_protect_workers_takes_dataloaders_only_and_is_undone_at_close(fast_dir: Path) -> None:
    ds = _StopSignalDisposition()
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1)
    plain = torch.utils.data.DataLoader(ds, batch_size=4)  # no workers: nothing to wrap
    with Checkpointer(fast_dir / "store", model=torch.nn.Linear(1, 1)) as ckpt:
        with pytest.raises(TypeError, match="list"):
            ckpt.protect_workers([dl])
        ckpt.protect_workers(dl, plain)
        ckpt.protect_workers(dl)  # twice: wrapped once
        assert dl.worker_init_fn.fn is None and plain.worker_init_fn is None
        assert next(iter(dl)).tolist() == [1.0] * 4
    assert dl.worker_init_fn is None
    assert next(iter(dl)).tolist() == [0.0] * 4
    with pytest.raises(deltackpt.DeltackptError, match="closed"):
        ckpt.protect_workers(dl)
    with Checkpointer(fast_dir / "store2", model=torch.nn.Linear(1, 1), handle_signals=False) as ckpt:
        ckpt.protect_workers(dl)  # signals are not handled: the workers keep torch's handlers
        assert dl.worker_init_fn is None


class _StopSignalDisposition(torch.utils.data.Dataset):
    """Each item: 1.0 when the DataLoader worker that fetched it ignores SIGTERM and SIGINT, else 0.0."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        from deltackpt.workers import WorkersIgnoreStopSignals

        on_term = signal.getsignal(signal.SIGTERM)
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN and isinstance(
            getattr(on_term, "__self__", None), WorkersIgnoreStopSignals) and not on_term.__self__._released.poll()
        return torch.tensor(float(ignored))


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.plumbing
def test_the_given_loaders_workers_ignore_stop_signals_until_close(fast_dir: Path, context: str) -> None:
    """The wrapper around the DataLoader's worker_init_fn runs in forked and spawned workers (spawn pickles it)
    and runs the loader's own function too; close() puts the loader's own back, so its workers are torch's
    again."""
    from deltackpt.data import ResumableLoader, ResumableSampler

    calls = fast_dir / "init-calls"
    ds = _StopSignalDisposition()
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=context,
                                     sampler=ResumableSampler(ds), worker_init_fn=functools.partial(_touch, calls))
    loader = ResumableLoader(dl)
    model = torch.nn.Linear(1, 1)
    with Checkpointer(fast_dir / "store", model=model, data=loader) as ckpt:
        assert ckpt is not None
        assert next(iter(loader)).tolist() == [1.0] * 4
    assert calls.exists(), "the loader's own worker_init_fn did not run"
    assert dl.worker_init_fn.func is _touch
    assert next(iter(loader)).tolist() == [0.0] * 4


def _touch(path: Path, worker_id: int) -> None:
    path.touch()


@linux_only
@pytest.mark.plumbing
def test_sigterm_chains_previous_python_handler(fast_dir: Path, rng: random.Random) -> None:
    marker = fast_dir / "marker"
    code, before, output, logged = _sigterm_run(fast_dir, rng, chain_marker=marker)
    assert code == 0, f"the previous handler exits 0, got {code}: {output[-3000:]}"
    assert "Traceback" not in output, output[-3000:]
    step = _finally_step(output)
    assert marker.exists(), "the previously installed SIGTERM handler was not called"
    signum, latest = map(int, marker.read_text().split())
    assert signum == signal.SIGTERM
    assert latest == step, "the previous handler must run after the save is committed"
    assert before <= step <= before + 1
    with Store(fast_dir / "store") as store:
        assert [i.step for i in store.list()] == [step]


@pytest.mark.parametrize("previous", ["default", "python"])
@pytest.mark.plumbing
def test_signal_after_the_last_step_is_passed_on_by_close(fast_dir: Path, previous: str) -> None:
    """A SIGTERM that lands after the loop's last step (here: while the last async save runs) is not dropped:
    close() commits the save, then hands the signal on like step() does."""
    script = f"""
import os, signal, sys, torch, deltackpt
if {previous!r} == "python":
    signal.signal(signal.SIGTERM, lambda s, f: (print("previous handler", s, flush=True), sys.exit(7)))
model = torch.nn.Linear(64, 64)
ckpt = deltackpt.Checkpointer(sys.argv[1], model=model, async_save=True)
ckpt.step(1)
os.kill(os.getpid(), signal.SIGTERM)
ckpt.close()
print("still running after close", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(fast_dir / "store")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert "still running" not in proc.stdout and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    if previous == "python":
        assert proc.returncode == 7 and f"previous handler {int(signal.SIGTERM)}" in proc.stdout
    else:
        assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    with Store(fast_dir / "store") as store:
        assert [i.step for i in store.list()] == [1]  # the save in flight was committed first


@pytest.mark.parametrize("beneath", ["default", "checkpointer"])
@pytest.mark.plumbing
def test_a_checkpointer_dropped_unclosed_is_collected_and_its_handlers_pass_signals_on(fast_dir: Path,
                                                                                        beneath: str) -> None:
    """Its signal handlers (bound methods) held a Checkpointer dropped without close() until the process ended,
    and with it its store: files, the pack lock, up to delta_cache_bytes of bases (a sweep of trials in one
    process). Now it is collected like any object, its store's files are released, the DataLoaders it protected
    get their own worker_init_fn back, and a SIGTERM goes through its handlers to what they replaced: the default
    action, or an open checkpointer beneath, which saves at its next step and then passes it on (status 143 both
    ways). Sync and async checkpointers, in a real process."""
    script = f"""
import gc, os, signal, sys, threading, weakref
from pathlib import Path
import torch, deltackpt
root = Path(sys.argv[1])
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), num_workers=1)
keep = deltackpt.Checkpointer(root / "a", model=model, optimizer=opt) if {beneath!r} == "checkpointer" else None
refs = []
for i, async_save in enumerate((False, True, False)):
    ckpt = deltackpt.Checkpointer(root / f"b{{i}}", model=model, optimizer=opt, async_save=async_save)
    ckpt.protect_workers(loader)
    ckpt.step(1)
    ckpt.step(2)
    ckpt.wait()
    refs.append(weakref.ref(ckpt))
    del ckpt
gc.collect()
for t in threading.enumerate():  # (a dropped store's files are released on a thread of its own)
    if t.name == "deltackpt-release":
        t.join(30)
held = []
for fd in Path("/proc/self/fd").iterdir():
    try:
        held.append(os.readlink(fd))
    except OSError:
        pass
print("alive", sum(r() is not None for r in refs), "held", [h for h in held if "/b" in h], flush=True)
print("loader's own", loader.worker_init_fn is None and "_get_iterator" not in vars(loader), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
if keep is not None:
    print("flagged", keep.stop_requested, flush=True)
    keep.step(7)
print("still running", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(fast_dir)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert "alive 0 held []" in proc.stdout and "loader's own True" in proc.stdout, proc.stdout + proc.stderr
    assert "still running" not in proc.stdout and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    for i in range(3):
        with Store(fast_dir / f"b{i}", readonly=True) as store:
            assert [c.step for c in store.list()] == [1, 2]
    if beneath == "checkpointer":
        assert "flagged True" in proc.stdout
        with Store(fast_dir / "a", readonly=True) as store:
            assert [c.step for c in store.list()] == [7]  # saved at its step boundary, then passed on


@pytest.mark.plumbing
def test_sigterm_ends_a_sweep_that_dropped_many_checkpointers_unclosed(fast_dir: Path) -> None:
    """A sweep of trials in one process that each drop their Checkpointer unclosed leaves each one's handler
    installed over the one before; a collected one's handler passed the signal on one call deeper per handler,
    and a SIGTERM after some hundreds of trials raised RecursionError (a traceback, status 1) instead of ending
    the process with status 143. Here 80 trials under a recursion limit of 100 (the default 1,000 took 600)."""
    script = """
import gc, os, signal, sys
from pathlib import Path
import torch, deltackpt
root = Path(sys.argv[1])
model = torch.nn.Linear(2, 2)
for i in range(80):
    ckpt = deltackpt.Checkpointer(root / f"t{i}", model=model, async_save=False)
    del ckpt
gc.collect()
sys.setrecursionlimit(100)
os.kill(os.getpid(), signal.SIGTERM)
print("still running", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script, str(fast_dir)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert "still running" not in done.stdout and "Traceback" not in done.stderr, done.stdout + done.stderr


@pytest.mark.plumbing
def test_a_forked_child_ends_by_sigterm_under_a_collected_checkpointers_handler(fast_dir: Path) -> None:
    """A child forked after a checkpointer was dropped and collected inherits its handler, which passed the
    default action on as SystemExit(143): raised into the child's code (a Pool's worker's task), its ``except
    BaseException`` and finally clauses ran in the child, where the handler of an open or closed checkpointer
    ends the child by the signal itself (as the code before collected it did too). ``terminate()`` ends it by
    SIGTERM again, in a real process."""
    script = """
import gc, multiprocessing, sys, time
from pathlib import Path
import torch, deltackpt
root = Path(sys.argv[1])
def child(flag):
    try:
        flag.write_text("started")
        time.sleep(60)
    except BaseException as exc:
        flag.write_text(f"caught {type(exc).__name__}")
        raise
ckpt = deltackpt.Checkpointer(root / "a", model=torch.nn.Linear(4, 4), async_save=False)
del ckpt
gc.collect()
proc = multiprocessing.get_context("fork").Process(target=child, args=(root / "flag",))
proc.start()
while not (root / "flag").exists():
    time.sleep(0.01)
proc.terminate()
proc.join(60)
print("child exit", proc.exitcode, (root / "flag").read_text(), flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script, str(fast_dir)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"child exit {-signal.SIGTERM} started" in done.stdout, done.stdout + done.stderr


@pytest.mark.plumbing
def test_a_signal_handed_to_the_main_thread_by_a_dropped_checkpointer_is_not_left_for_the_next(
        fast_dir: Path) -> None:
    """A checkpointer stepped on a loop's thread hands the SIGTERM it saved at to the main thread (``_forward``);
    dropped by that thread and collected before the main thread ran its handler, its handler passed the signal
    to the one before it but left the hand-over in ``_forward``, so the next checkpointer's handler took a later
    SIGTERM for it and passed it straight on, without saving. In a real process, with the main thread's handler
    held back by a blocked SIGTERM (a main thread busy in C code, a torch op, holds it back the same way)."""
    script = """
import gc, os, signal, sys, threading, time
from pathlib import Path
import torch, deltackpt
root = Path(sys.argv[1])
calls = []
signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))  # the user's handler, which returns
model = torch.nn.Linear(4, 4)
ckpt = deltackpt.Checkpointer(root / "a", model=model, async_save=False)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
def loop(c, n):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    c.step(n)
    if n == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # (its handler runs on the main thread)
for n in (1, 2):  # step 2 saves at the signal and hands it over: pending, the main thread blocks it
    t = threading.Thread(target=loop, args=(ckpt, n))
    t.start()
    t.join()
    time.sleep(0.05)
del ckpt, t
gc.collect()
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
print("passed on", calls, flush=True)
other = deltackpt.Checkpointer(root / "b", model=model, async_save=False)
os.kill(os.getpid(), signal.SIGTERM)
print("flagged", other.stop_requested, calls, flush=True)
other.step(5)
print("passed on", calls, flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(fast_dir)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["passed on [15]", "flagged True [15]", "passed on [15, 15]"], proc.stdout
    with Store(fast_dir / "b", readonly=True) as store:
        assert [c.step for c in store.list()] == [5]  # saved at the signal, then passed on


@pytest.mark.parametrize("how", ["with", "catch"])
@pytest.mark.plumbing
def test_a_signal_after_the_last_step_is_passed_on_when_the_last_save_fails(fast_dir: Path, how: str) -> None:
    """close() raised the last save's error and skipped passing the signal on: a `with` block exited 1, and a
    caller that caught the error carried on with the SIGTERM swallowed. The error is printed, then the signal
    passed on (status 143)."""
    script = f"""
import os, signal, sys, time, torch, deltackpt
extra = {{}}
ckpt = deltackpt.Checkpointer(sys.argv[1], model=torch.nn.Linear(4, 4), extra=extra, async_save=True)
ckpt.step(1)
ckpt.wait()
extra["bad"] = object()  # the last save fails in the background
real = ckpt.store._save
ckpt.store._save = lambda *a, **k: (time.sleep(0.3), real(*a, **k))[1]
ckpt.step(2)
os.kill(os.getpid(), signal.SIGTERM)  # after the last step(), while its save runs
if {how!r} == "with":
    with ckpt:
        pass
else:
    try:
        ckpt.close()
    except Exception as exc:
        print("close() raised", type(exc).__name__, flush=True)
print("still running after close", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(fast_dir / "store")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    assert "still running" not in proc.stdout and "close() raised" not in proc.stdout, proc.stdout
    assert "passed on at close(), after this error" in proc.stderr and "cannot store extra.bad" in proc.stderr
    with Store(fast_dir / "store") as store:
        assert [i.step for i in store.list()] == [1]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.plumbing
def test_a_signal_during_a_steps_save_makes_that_step_the_boundary(fast_dir: Path, mode: str) -> None:
    """A SIGTERM that arrives while step(N) saves (sync: in the save; async: while step(N) waits for the save
    before it) let step(N) return, and the loop trained N+1 and saved it again before exiting: a training step
    and a keyframe save more inside the grace period. step(N) now waits for its save and passes the signal on."""
    script = f"""
import os, signal, sys, threading, time, torch, deltackpt
ckpt = deltackpt.Checkpointer(sys.argv[1], model=torch.nn.Linear(4, 4), every_n_steps=5,
                              async_save={mode == "async"!r})
real = ckpt.store._save
def slow(*a, **k):
    if k.get("step") == 5:
        if {mode == "sync"!r}:  # (sync: the signal comes inside this save)
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        time.sleep(0.8)  # (async: step(10) waits for this save of step 5 ...)
    return real(*a, **k)
ckpt.store._save = slow
for step in range(1, 30):
    print("trained", step, flush=True)
    if {mode == "async"!r} and step == 10:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()  # ... so the signal comes then
    ckpt.step(step)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(fast_dir / "store")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    last = 5 if mode == "sync" else 10
    assert proc.stdout.split()[-1] == str(last), proc.stdout  # no step trained after it
    with Store(fast_dir / "store") as store:
        assert [i.step for i in store.list()] == ([5] if mode == "sync" else [5, 10])


@pytest.mark.plumbing
def test_an_interrupted_wait_at_exit_is_not_reported_as_a_failed_save(fast_dir: Path) -> None:
    """Two Ctrl-C while the interpreter waited at exit (no close()) for a save in flight printed that the save
    had failed, though it went on and committed."""
    script = """
import os, signal, sys, threading, time, torch, deltackpt
ckpt = deltackpt.Checkpointer(sys.argv[1], model=torch.nn.Linear(4, 4))
real = ckpt.store._save
ckpt.store._save = lambda *a, **k: (time.sleep(1.5), real(*a, **k))[1]
def ctrl_c_twice():
    time.sleep(0.4)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=ctrl_c_twice, daemon=True).start()
ckpt.step(1)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(fast_dir / "store")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert "failed as the interpreter exited" not in proc.stderr, proc.stderr
    assert "was interrupted (KeyboardInterrupt); the save goes on" in proc.stderr, proc.stderr
    with Store(fast_dir / "store") as store:
        assert [i.step for i in store.list()] == [1]


def test_an_ignored_sigterm_keeps_the_handlers_watching(fast_dir: Path) -> None:
    """SIGTERM was ignored before the Checkpointer (SIG_IGN): at the step boundary it saves and carries on, and
    still watches for the next signal: a SIGINT after it is saved at the next step and passed on (before, the
    handlers stayed uninstalled and Ctrl-C raised KeyboardInterrupt at once, saving nothing)."""
    old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        model, opt = _small()
        ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False, every_n_steps=100)
        ckpt.step(1)  # (not a step to save at: only signals save here)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not ckpt.stop_requested and time.monotonic() < deadline:
            time.sleep(0.001)
        ckpt.step(2)  # saves (the signal's save), then passes SIGTERM on to SIG_IGN: carries on
        assert not ckpt.stop_requested and signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while not ckpt.stop_requested and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ckpt.stop_requested
        with pytest.raises(KeyboardInterrupt):
            ckpt.step(3)  # saved first, then SIGINT's default handler
        ckpt.close()
        with Store(fast_dir / "store") as store:
            assert [i.step for i in store.list()] == [2, 3]
    finally:
        signal.signal(signal.SIGTERM, old_term)


@pytest.mark.plumbing
@pytest.mark.parametrize("how", ["with", "finally"])
def test_an_error_that_a_passed_on_signal_ends_is_printed(fast_dir: Path, capsys: pytest.CaptureFixture[str],
                                                          how: str) -> None:
    """An error leaving the block that closes the checkpointer (a with block, a finally clause) while a SIGTERM
    waits to be passed on (the save at the signal failed, say) is printed before the exit: the SystemExit(143)
    of SIGTERM's default action replaces it, and Python prints nothing for a SystemExit."""
    model, opt = _small()

    def loop(ckpt: Checkpointer) -> None:
        ckpt.step(1)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not ckpt.stop_requested and time.monotonic() < deadline:
            time.sleep(0.001)
        raise RuntimeError("the loss is nan")

    old_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as ei:
            if how == "with":
                with Checkpointer(fast_dir / "store", model=model, optimizer=opt, every_n_steps=100) as ckpt:
                    loop(ckpt)
            else:
                ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, every_n_steps=100)
                try:
                    loop(ckpt)
                finally:
                    ckpt.close()
    finally:
        signal.signal(signal.SIGTERM, old_term)
    assert ei.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "exiting for SIGTERM" in err and "RuntimeError: the loss is nan" in err
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, every_n_steps=100, handle_signals=False)
    with ckpt:  # a close() with no error on its way prints nothing
        ckpt.step(1)
    assert capsys.readouterr().err == ""


def test_a_refused_restore_leaves_the_live_objects_untouched(fast_dir: Path) -> None:
    """A checkpoint restore() refuses (thinned to weights only; holding no scheduler state this run has) leaves
    the model and optimizer as they were: before, the weights had been decoded into the model (and, for the
    missing scheduler, the optimizer loaded too) when the refusal came."""
    model, opt = _small()
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False,
                      handle_signals=False) as ckpt:
        for step in (1, 2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            ckpt.save(step)
        ids = {i.step: i.id for i in ckpt.store.list()}
        ckpt._thin([ids[1]], {i.id: i for i in ckpt.store.list()})  # what Retention(full_last=) does to it
    fresh, fresh_opt = _small()
    sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=3)
    before = ({k: v.clone() for k, v in fresh.state_dict().items()}, repr(fresh_opt.state_dict()))
    with Checkpointer(fast_dir / "store", model=fresh, optimizer=fresh_opt, handle_signals=False) as ckpt:
        with pytest.raises(deltackpt.DeltackptError, match="thinned"):
            ckpt.restore(step=1)
        assert_bitwise(before[0], fresh.state_dict())
        assert repr(fresh_opt.state_dict()) == before[1]
    with Checkpointer(fast_dir / "store", model=fresh, optimizer=fresh_opt, scheduler=sched,
                      handle_signals=False) as ckpt:
        with pytest.raises(deltackpt.DeltackptError, match="no scheduler state"):
            ckpt.restore()
        assert_bitwise(before[0], fresh.state_dict())
        assert repr(fresh_opt.state_dict()) == before[1]


def test_a_strict_restore_names_everything_the_checkpoint_lacks_at_once(fast_dir: Path) -> None:
    """Components given to a run since its checkpoint was saved are refused in one error naming all of them, and
    the way out (restore(strict=False)): it named the first only, so a user fixed one and met the next."""
    model, opt = _small()
    with Checkpointer(fast_dir / "store", model=model, optimizer={"main": opt}, async_save=False, rng=False,
                      handle_signals=False) as ckpt:
        ckpt.save(1)
    fresh, fresh_opt = _small()
    aux = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=3)
    ema = torch.optim.swa_utils.AveragedModel(fresh)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with Checkpointer(fast_dir / "store", model=fresh, optimizer={"main": fresh_opt, "aux": aux}, scheduler=sched,
                      extra={"ema": ema, "cfg": {"lr": 1.0}}, handle_signals=False) as ckpt:
        with pytest.raises(deltackpt.DeltackptError) as ei:
            ckpt.restore()
        said = str(ei.value)
        for what in ("optimizer state for 'aux'", "scheduler state", "extra['ema']", "extra['cfg']", "RNG states",
                     "restore(strict=False) restores the rest and leaves them as they are"):
            assert what in said, said
        assert_bitwise(before, fresh.state_dict())
        assert not fresh_opt.state and sched.last_epoch == 0
    with Checkpointer(fast_dir / "store", model=fresh, optimizer={"main": fresh_opt}, rng=False,
                      extra={"cfg": {}}, handle_signals=False) as ckpt:
        with pytest.raises(deltackpt.DeltackptError, match=r"holds no extra\['cfg'\] \(restore\(strict=False\) "
                                                           r"restores the rest and leaves it as it is\)$"):
            ckpt.restore()


def test_handlers_restored_on_close(fast_dir: Path) -> None:
    def mine(signum: int, frame: Any) -> None:
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        model, opt = _small()
        ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt)
        assert signal.getsignal(signal.SIGTERM) != mine
        assert not ckpt.stop_requested
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not ckpt.stop_requested and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ckpt.stop_requested
        ckpt.close()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


# -- 6. rollback and branches ---------------------------------------------------------------------------

def test_rollback_continues_on_a_branch(fast_dir: Path) -> None:
    model, opt = _small()
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, handle_signals=False)
    x = torch.randn(4, 8)

    def train(scale: float) -> dict[str, torch.Tensor]:
        (model(x) * scale).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    try:
        old = {}
        for step in range(1, 6):
            old[step] = train(1.0)
            assert ckpt.step(step)
        ckpt.wait()
        old_ids = {i.step: i.id for i in ckpt.store.list()}
        assert sorted(old_ids) == [1, 2, 3, 4, 5]

        assert ckpt.restore(step=3) == 3
        assert_bitwise(old[3], model.state_dict(), "restored model")
        new = {}
        for step in (4, 5):
            new[step] = train(-3.0)
            assert ckpt.step(step), f"step {step} exists on the old branch; saving it again must be allowed"
        ckpt.wait()
        assert not torch.equal(new[4]["weight"], old[4]["weight"])
    finally:
        ckpt.close()

    with Store(fast_dir / "store") as store:
        infos = store.list()
        assert [i.step for i in infos] == [1, 2, 3, 4, 5, 4, 5]
        by_id = {i.id: i for i in infos}
        assert len(by_id) == 7
        new_ids = {i.step: i.id for i in infos[5:]}
        assert by_id[old_ids[1]].parent is None
        for step in (2, 3, 4, 5):
            assert by_id[old_ids[step]].parent == old_ids[step - 1], f"old step {step}"
        assert by_id[new_ids[4]].parent == old_ids[3], "the branch descends from the restored checkpoint"
        assert by_id[new_ids[5]].parent == new_ids[4]
        assert store.info(step=4).id == new_ids[4] and store.latest().id == new_ids[5]
        assert_bitwise(new[4], store.load(step=4)["model"], "load(step=4)")
        assert_bitwise(new[5], store.load(step=5)["model"], "load(step=5)")
        assert_bitwise(old[4], store.load(id=old_ids[4])["model"], "load(id=old 4)")
        assert_bitwise(old[5], store.load(id=old_ids[5])["model"], "load(id=old 5)")
        assert_bitwise(old[3], store.load(step=3)["model"], "load(step=3)")

    model2, opt2 = _small()
    ckpt = Checkpointer(fast_dir / "store", model=model2, optimizer=opt2, handle_signals=False)
    try:
        assert ckpt.restore() == 5
        assert_bitwise(new[5], model2.state_dict(), "resumed on the branch")
        assert ckpt.restore(id=old_ids[4]) == 4
        assert_bitwise(old[4], model2.state_dict(), "restore(id=old 4)")
    finally:
        ckpt.close()


def test_restore_on_an_empty_store_returns_zero(fast_dir: Path) -> None:
    model, opt = _small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, handle_signals=False) as ckpt:
        assert ckpt.restore() == 0
        assert_bitwise(before, model.state_dict())
        with pytest.raises(deltackpt.CheckpointNotFoundError):
            ckpt.restore(step=3)


def test_restore_of_the_latest_skips_damaged_checkpoints(fast_dir: Path) -> None:
    """A restarted job whose newest checkpoint is damaged resumes from the newest one that restores (with a
    warning naming what was skipped) instead of failing at every restart; an explicit step still raises, and
    a thinned (weights-only) checkpoint is never fallen back to."""
    model, opt = _small()
    states: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False,
                      handle_signals=False) as ckpt:
        for step in (1, 2, 3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            ckpt.save(step)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        ids = {i.step: i.id for i in ckpt.store.list()}
    manifest_3 = fast_dir / "store" / "manifests" / f"{ids[3]}.manifest"
    data = bytearray(manifest_3.read_bytes())
    data[40] ^= 0xFF
    manifest_3.write_bytes(bytes(data))
    fresh, fresh_opt = _small()
    with Checkpointer(fast_dir / "store", model=fresh, optimizer=fresh_opt, handle_signals=False) as ckpt:
        with pytest.warns(RuntimeWarning, match=f"checkpoint {ids[3]} \\(step 3\\) is damaged") as warned:
            assert ckpt.restore() == 2
        assert warned[0].filename == __file__  # the warning points at the caller of restore()
        assert_bitwise(states[2], fresh.state_dict())
        with pytest.raises(deltackpt.CorruptManifestError):
            ckpt.restore(step=3)
        ckpt._thin([ids[1]], {i.id: i for i in ckpt.store.list()})  # what Retention(full_last=) does to it
        ckpt.store.delete(2)
        with pytest.warns(RuntimeWarning), pytest.raises(deltackpt.CorruptManifestError):
            ckpt.restore()  # step 1 holds weights only now: the damage of step 3 is reported instead


def test_restore_of_the_latest_passes_over_checkpoints_deleted_meanwhile(fast_dir: Path) -> None:
    """Another process's retention deletes the newest checkpoints between restore()'s list and its load: restore()
    moves on to the newest that is still there instead of raising CheckpointNotFoundError."""
    model, opt = _small()
    states: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False,
                      handle_signals=False) as ckpt:
        for step in (1, 2, 3, 4):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            ckpt.save(step)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = _small()
    with Checkpointer(fast_dir / "store", model=fresh, optimizer=fresh_opt, handle_signals=False) as ckpt, \
            Store(fast_dir / "store") as other:
        real_list = ckpt.store.list
        lists = []

        def list_then_delete() -> list[deltackpt.CheckpointInfo]:
            infos = real_list()
            lists.append([i.step for i in infos])
            if len(lists) == 1:  # the other process deletes the two newest right after the first list
                other.delete(4)
                other.delete(3)
            return infos

        ckpt.store.list = list_then_delete  # type: ignore[method-assign]
        assert ckpt.restore() == 2
        assert lists == [[1, 2, 3, 4]]
        assert_bitwise(states[2], fresh.state_dict())
        other.delete(2)
        other.delete(1)
        lists.clear()
        lists.append([])  # (no more deletes)
        assert ckpt.restore() == 0  # all gone: the same as an empty store


def test_signal_save_is_a_keyframe(fast_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save made at the step boundary after SIGTERM stores its chunks standalone, so the restarted run
    restores from one frame per chunk. (The process-level SIGTERM path is tested above; here the handler's
    hand-off is replaced so the test process survives.)"""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    passed: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: passed.append(signum))  # it returns: carry on
    try:
        ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, every_n_steps=1)
        for step in (1, 2, 3):
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 3:
                ckpt._on_signal(signal.SIGTERM, None)  # the handler, as a SIGTERM runs it
            ckpt.step(step)
        ckpt.close()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert passed == [signal.SIGTERM]
    with Store(fast_dir / "store") as s:
        def delta_frames(step: int) -> int:
            m = s.manifest(step)
            keys = [dg + ln.to_bytes(4, "big") for t in m.tensors for _, dg, ln in m.chunk_keys(t)]
            return sum(loc.codec in deltackpt.codec.BASED for loc in s.index.lookup_chunks(keys).values())

        assert delta_frames(2) > 0, "an ordinary save of changed weights takes deltas (or predicted frames)"
        assert delta_frames(3) == 0


class _RunningStats:
    """A user type (running normalisation statistics) holding a tensor, saved through ``register_type``."""

    def __init__(self, n: int = 1 << 18) -> None:
        self.mean = torch.zeros(n)


def test_async_save_stages_the_tensors_of_a_registered_type(fast_dir: Path) -> None:
    """The snapshot encodes a registered type in step() and copies its tensors: the loop changing them right
    after step() returns does not reach the checkpoint (before, the background save encoded the live object and
    committed a frame that did not decode to its id)."""
    deltackpt.register_type(_RunningStats, "test.RunningStats", lambda o: {"mean": o.mean},
                            lambda d: _stats_from(d["mean"]))
    try:
        stats = _RunningStats()
        model = torch.nn.Linear(4, 4)
        with Checkpointer(fast_dir / "store", model=model, extra={"stats": stats}, async_save=True,
                          handle_signals=False) as ckpt:
            for step in (1, 2, 3):
                stats.mean.fill_(float(step))
                ckpt.step(step)
                stats.mean.fill_(-1.0)  # the loop goes on changing it while the save runs
            ckpt.wait()
            for step in (1, 2, 3):
                got = ckpt.store.load(step)["extra"]["stats"]
                assert type(got) is _RunningStats and torch.equal(got.mean, torch.full_like(stats.mean, step))
            assert not ckpt.store.verify().problems
    finally:
        deltackpt.unregister_type(_RunningStats)


class _Meter:
    """A user type whose encoder builds new arrays each time (a histogram made from a value)."""

    def __init__(self, v: float) -> None:
        self.v = v


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_registered_types_whose_encoder_returns_new_arrays_keep_their_own_values(fast_dir: Path,
                                                                                 async_save: bool) -> None:
    """The async snapshot told tied tensors apart by memory address, and each encoder's array was freed once
    copied: the next meter's new array could take its address and be staged as the same tensor (six meters
    0..5 loaded as six zeros, with verify passing)."""
    deltackpt.register_type(_Meter, "test.Meter", lambda m: {"np": np.full(16, m.v), "t": torch.full((4096,), m.v)},
                            lambda d: _Meter(float(d["np"][0])) if d["t"][-1] == d["np"][0] else None)
    try:
        meters = [_Meter(float(i)) for i in range(6)]
        with Checkpointer(fast_dir / "store", model=torch.nn.Linear(2, 2), extra={"meters": meters},
                          async_save=async_save, handle_signals=False) as ckpt:
            ckpt.step(1)
            ckpt.wait()
            got = ckpt.store.load(1)["extra"]["meters"]
        assert [m.v for m in got] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        deltackpt.unregister_type(_Meter)


def _stats_from(mean: torch.Tensor) -> _RunningStats:
    out = _RunningStats(len(mean))
    out.mean.copy_(mean)
    return out


def test_a_failed_async_save_is_saved_again_by_the_next_step_of_that_step(fast_dir: Path) -> None:
    """A background save that fails (an unsupported value) does not count as saved: after the caller fixes the
    value, step() of the same step saves it, as in sync mode. Before, async mode skipped it for good."""
    for async_save in (False, True):
        extra: dict[str, Any] = {"phase": "ok"}
        with Checkpointer(fast_dir / f"store-{async_save}", model=torch.nn.Linear(2, 2), extra=extra,
                          async_save=async_save, handle_signals=False) as ckpt:
            ckpt.step(1)
            ckpt.wait()
            extra["phase"] = object()
            with pytest.raises(UnsupportedTypeError, match="extra.phase"):
                ckpt.step(2)
                ckpt.wait()
            assert ckpt.last_saved_step == 1
            extra["phase"] = "fixed"
            assert ckpt.step(2)
            ckpt.wait()
            assert [i.step for i in ckpt.store.list()] == [1, 2]
            assert ckpt.store.load(2)["extra"]["phase"] == "fixed"


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_restore_puts_plain_extra_values_into_the_runs_own_objects(fast_dir: Path, async_save: bool) -> None:
    """An ``extra`` entry without state_dict() (an EMA kept as a dict of tensors, a running statistic, an array)
    is restored into the objects the training loop holds: before, restore() put new objects into the
    checkpointer's dict, so the loop went on updating its own (unrestored) ones, and every later save stored the
    restored copy, frozen."""
    def run(seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        return {
            "model": model,
            "ema": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "stat": torch.zeros(3),
            "hist": np.zeros(5),
            "parts": [torch.zeros(2), "label"],
            "pair": (torch.zeros(2), torch.zeros(2, dtype=torch.float64)),
            "counts": collections.Counter(),
            "cfg": {"lr": 0.0},
        }

    def extra_of(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k != "model"}

    def train(r: dict[str, Any], step: int) -> None:
        with torch.no_grad():
            r["model"].weight.add_(0.5)
            for k, v in r["model"].state_dict().items():
                r["ema"][k].mul_(0.9).add_(v, alpha=0.1)
        r["stat"].add_(step)
        r["hist"][step % 5] += step
        r["parts"][0].add_(1)
        r["pair"][0].add_(2)
        r["pair"][1].add_(3)
        r["counts"][f"c{step % 2}"] += 1
        r["cfg"]["lr"] = 0.1 * step

    first = run(0)
    with Checkpointer(fast_dir / "s", model=first["model"], extra=extra_of(first), every_n_steps=1,
                      async_save=async_save, handle_signals=False) as ck:
        for step in (1, 2, 3):
            train(first, step)
            ck.step(step)
    second = run(1)
    second["cfg"]["wd"] = 0.01  # a key the checkpoint lacks (added since): it stays
    held = {k: v for k, v in second.items() if k != "model"}  # what the loop holds: the objects themselves
    ptrs = [second["ema"]["weight"].data_ptr(), second["stat"].data_ptr(), second["pair"][0].data_ptr()]
    ema_values = list(second["ema"].values())
    with Checkpointer(fast_dir / "s", model=second["model"], extra=extra_of(second), every_n_steps=1,
                      async_save=async_save, handle_signals=False) as ck:
        assert ck.restore() == 3
        for k, v in held.items():
            assert ck.extra[k] is v, k
        assert all(a is b for a, b in zip(second["ema"].values(), ema_values))
        assert [second["ema"]["weight"].data_ptr(), second["stat"].data_ptr(), second["pair"][0].data_ptr()] == ptrs
        for k in ("weight", "bias"):
            assert torch.equal(second["ema"][k], first["ema"][k])
        assert torch.equal(second["stat"], first["stat"]) and np.array_equal(second["hist"], first["hist"])
        assert torch.equal(second["parts"][0], first["parts"][0]) and second["parts"][1] == "label"
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(second["pair"], first["pair"]))
        assert second["counts"] == first["counts"] and type(second["counts"]) is collections.Counter
        assert second["cfg"] == {"lr": first["cfg"]["lr"], "wd": 0.01}
        train(second, 4)
        train(first, 4)
        ck.step(4)
    state = Store(fast_dir / "s").load(step=4)["extra"]
    for k in ("weight", "bias"):  # step 4 stores the values the loop went on from, not a frozen copy
        assert torch.equal(state["ema"][k], first["ema"][k])
    assert torch.equal(state["stat"], first["stat"]) and np.array_equal(state["hist"], first["hist"])
    assert torch.equal(state["pair"][1], first["pair"][1])


def test_restore_refuses_a_plain_extra_tensor_of_another_shape_before_changing_anything(fast_dir: Path) -> None:
    """A tensor of a plain ``extra`` entry that has another shape in the checkpoint cannot be restored into the
    run's own: the restore is refused, naming it, before the model is touched. Another dtype is converted, as
    load_state_dict converts a model's."""
    model = torch.nn.Linear(2, 2)
    with Checkpointer(fast_dir / "s", model=model, extra={"ema": {"w": torch.ones(3)}, "t": torch.ones(2)},
                      async_save=False, handle_signals=False) as ck:
        ck.save(1)
    fresh = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    ema = {"w": torch.zeros(4)}
    with Checkpointer(fast_dir / "s", model=fresh, extra={"ema": ema, "t": torch.zeros(2)},
                      handle_signals=False) as ck:
        with pytest.raises(deltackpt.ShapeMismatchError, match=r"extra\['ema'\]\.w has shape \(3,\) in the "
                                                               r"checkpoint, \(4,\) in this run"):
            ck.restore()
        assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
        assert torch.equal(ema["w"], torch.zeros(4))
    half = torch.zeros(2, dtype=torch.float16)
    with Checkpointer(fast_dir / "s", model=fresh, extra={"ema": {"w": torch.zeros(3)}, "t": half},
                      handle_signals=False) as ck:
        assert ck.restore() == 1
        assert ck.extra["t"] is half and torch.equal(half, torch.ones(2, dtype=torch.float16))


@pytest.mark.skipif(not hasattr(torch, "uint4"), reason="torch without sub-byte dtypes")
def test_restore_refuses_a_plain_extra_tensor_of_a_dtype_torch_cannot_convert(fast_dir: Path) -> None:
    """A plain ``extra`` tensor saved as a dtype torch has no copy to or from (uint4, bits8) is refused like one
    of another shape: naming it, before the model is touched. Before, the model was restored first and the
    extra's copy_ then raised torch's NotImplementedError, wrapped in a DeltackptError that could only say
    what it had put back already."""
    packed = torch.arange(4, dtype=torch.uint8)
    with Checkpointer(fast_dir / "s", model=torch.nn.Linear(2, 2), extra={"q": packed.view(torch.uint4)},
                      async_save=False, handle_signals=False) as ck:
        ck.save(1)
    fresh = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    live = torch.zeros(4)
    with Checkpointer(fast_dir / "s", model=fresh, extra={"q": live}, handle_signals=False) as ck:
        with pytest.raises(deltackpt.ShapeMismatchError, match=r"extra\['q'\] is uint4 in the checkpoint, float32 in "
                                                               r"this run, which torch cannot convert it to"):
            ck.restore()
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()) and not live.any()
    mine = torch.zeros(4, dtype=torch.uint8).view(torch.uint4)
    with Checkpointer(fast_dir / "s", model=fresh, extra={"q": mine}, handle_signals=False) as ck:
        assert ck.restore() == 1 and torch.equal(mine.view(torch.uint8), packed)


@pytest.mark.skipif(not hasattr(torch, "uint4"), reason="torch without sub-byte dtypes")
def test_restore_refuses_a_model_tensor_of_a_dtype_torch_cannot_convert(fast_dir: Path) -> None:
    """A model buffer saved as a dtype torch has no copy from (uint4) into this run's (float32) is refused before
    the model is touched, as another shape is. Before, the restore warned that load_state_dict would convert it,
    decoded the other tensors into the model, and then failed in load_state_dict, leaving the model holding
    part of the checkpoint (which the README promises of damage only)."""
    def model(dtype: torch.dtype) -> torch.nn.Module:
        m = torch.nn.Linear(2, 2)
        m.register_buffer("q", torch.zeros(4, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1
                          else torch.zeros(4, dtype=dtype))
        return m

    with Checkpointer(fast_dir / "s", model=model(torch.uint4), async_save=False, handle_signals=False) as ck:
        ck.save(1)
    fresh = model(torch.float32)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with Checkpointer(fast_dir / "s", model=fresh, handle_signals=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning that load_state_dict converts it)
        with pytest.raises(deltackpt.ShapeMismatchError, match=r"model: 'q' is uint4 in the checkpoint, float32 in "
                                                               r"this run, which torch cannot convert it to"):
            ck.restore()
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


class _FailingRetention(Retention):
    def plan(self, infos: Any, now: float | None = None) -> Any:
        raise RuntimeError("retention failed")


def test_a_save_whose_retention_failed_after_the_commit_counts_as_saved(fast_dir: Path) -> None:
    """The save committed, then its retention raised: the error reaches the loop, and the step stays saved
    (saving it again would commit a second checkpoint of that step)."""
    for async_save in (False, True):
        with Checkpointer(fast_dir / f"store-{async_save}", model=torch.nn.Linear(2, 2), async_save=async_save,
                          retention=_FailingRetention(keep_last=1), handle_signals=False) as ckpt:
            with pytest.raises(RuntimeError, match="retention failed"):
                ckpt.step(1)
                ckpt.wait()
            assert ckpt.last_saved_step == 1
            assert not ckpt.step(1)
            assert [i.step for i in ckpt.store.list()] == [1]


@pytest.mark.parametrize("change", ["shape", "key", "param_groups", "optimizer_kind", "param_order"])
def test_restore_refused_for_another_architecture_changes_nothing(fast_dir: Path, change: str) -> None:
    """A restore into a model whose layer has another shape or whose keys differ, or an optimizer with another
    number of parameter groups, raises ShapeMismatchError before anything is loaded. Before, the checkpoint was
    decoded into the model's own tensors first, so the refused restore left layer 0 holding its weights.
    Another kind of optimizer (SGD for the saved AdamW) and the parameters given in another order are refused
    too: torch loaded both, and failed at the first step (a KeyError, a size mismatch)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with deltackpt.Checkpointer(fast_dir / "s", model=model, optimizer=opt, async_save=False,
                                handle_signals=False) as ckpt:
        ckpt.save(1)
    torch.manual_seed(1)
    if change == "shape":
        model2: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 5))
    elif change == "key":
        model2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3), torch.nn.Linear(3, 3))
    else:
        model2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    groups = ([{"params": model2[0].parameters()}, {"params": model2[1].parameters()}] if change == "param_groups"
              else list(model2.parameters())[::-1] if change == "param_order" else model2.parameters())
    opt2 = torch.optim.SGD(groups, lr=0.1, momentum=0.9) if change == "optimizer_kind" else torch.optim.AdamW(groups)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with deltackpt.Checkpointer(fast_dir / "s", model=model2, optimizer=opt2, handle_signals=False) as ckpt:
        expected = {"shape": r"'1.weight' has shape \(3, 4\)", "key": r"not in this run \[\]|missing",
                    "param_groups": "1 parameter groups", "optimizer_kind": r"lacks \['dampening', 'momentum'",
                    "param_order": r"'exp_avg' of shape \(4, 4\) .* of shape \(3,\)"}[change]
        with pytest.raises(deltackpt.ShapeMismatchError, match=expected):
            ckpt.restore()
    assert_bitwise(before, model2.state_dict(), "model")
    assert not opt2.state


@pytest.mark.parametrize("change", ["warmup_added", "warmup_dropped", "chain_longer", "lambda_added"])
def test_restore_refused_for_another_kind_of_scheduler_changes_nothing(fast_dir: Path, change: str) -> None:
    """A scheduler state that torch's scheduler would fail to load (a StepLR's where the run now has a
    SequentialLR with a warmup, the other way round, another number of chained schedulers or of lambdas) is
    refused with ShapeMismatchError naming it before anything is loaded. Before, the model and the optimizer
    held the checkpoint's state when SequentialLR.load_state_dict raised a bare KeyError('_schedulers')."""
    from torch.optim import lr_scheduler as lr

    def scheduler(opt: torch.optim.Optimizer, kind: str) -> Any:
        if kind == "step":
            return lr.StepLR(opt, 2)
        if kind == "lambda":
            return lr.LambdaLR(opt, lambda s: 0.9 ** s)
        parts = [lr.LinearLR(opt, 0.1, total_iters=2), lr.StepLR(opt, 2)]
        return lr.SequentialLR(opt, parts + ([lr.ConstantLR(opt)] if kind == "seq3" else []),
                               milestones=[2] + ([4] if kind == "seq3" else []))

    saved, live = {"warmup_added": ("step", "seq"), "warmup_dropped": ("seq", "step"),
                   "chain_longer": ("seq", "seq3"), "lambda_added": ("step", "lambda")}[change]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))

    def optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[1].parameters()}])

    opt = optimizer(model)
    sched = scheduler(opt, saved)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    with deltackpt.Checkpointer(fast_dir / "s", model=model, optimizer=opt, scheduler=sched, async_save=False,
                                handle_signals=False) as ckpt:
        ckpt.save(1)
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    opt2 = optimizer(model2)
    sched2 = scheduler(opt2, live)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    sched_before = repr(sched2.state_dict())
    with deltackpt.Checkpointer(fast_dir / "s", model=model2, optimizer=opt2, scheduler=sched2,
                                handle_signals=False) as ckpt:
        expected = {"warmup_added": "SequentialLR loads '_schedulers'",
                    "warmup_dropped": None, "chain_longer": r"'_schedulers' has 2 entries .* 3 in this run",
                    "lambda_added": "LambdaLR loads 'lr_lambdas'"}[change]
        if expected is None:  # (a StepLR takes a SequentialLR's state as torch's load takes it: attributes)
            with pytest.warns(RuntimeWarning, match=r"lacks \['base_lrs', 'gamma', 'step_size'\], which this run's "
                              "StepLR has: saved by another kind of scheduler"):
                assert ckpt.restore() == 1
            return
        with pytest.raises(deltackpt.ShapeMismatchError, match=expected):
            ckpt.restore()
    assert_bitwise(before, model2.state_dict(), "model")
    assert not opt2.state and repr(sched2.state_dict()) == sched_before


def test_restore_refused_for_an_ema_of_another_shape_changes_nothing(fast_dir: Path) -> None:
    """An EMA model in ``extra`` (an AveragedModel) whose layer has another shape than the checkpoint's is refused
    with ShapeMismatchError naming it before anything is loaded, as the model is. Before, torch's size mismatch
    came from its load_state_dict after the model had been overwritten with the checkpoint's weights."""
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    with deltackpt.Checkpointer(fast_dir / "s", model=model, extra={"ema": AveragedModel(model)},
                                async_save=False, handle_signals=False) as ckpt:
        ckpt.save(1)
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    other = AveragedModel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 5)))
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with deltackpt.Checkpointer(fast_dir / "s", model=model2, extra={"ema": other}, handle_signals=False) as ckpt:
        with pytest.raises(deltackpt.ShapeMismatchError, match=r"extra\['ema'\]: 'module.1.weight' has shape \(3, 4\)"):
            ckpt.restore()
    assert_bitwise(before, model2.state_dict(), "model")


def test_async_snapshot_refuses_what_a_save_refuses(fast_dir: Path) -> None:
    """The async snapshot of a state a save refuses (a container that contains itself, nesting past the limit, a
    meta tensor, a sub-byte dtype torch cannot copy, a sparse tensor, a lazy module's uninitialized parameter)
    raises the same UnsupportedTypeError naming the key path as a synchronous save, not the staging copy's
    RecursionError or NotImplementedError, and at once (before, a sparse tensor or a tensor subclass was left to
    the background save, whose error came a step later)."""
    cycle: dict[str, Any] = {"name": "run"}
    cycle["self"] = cycle
    deep: Any = 0
    for _ in range(2000):
        deep = [deep]
    odd = torch.arange(10, dtype=torch.uint8).reshape(5, 2).view(torch.uint4)[1:2, 0]
    lazy = torch.nn.LazyLinear(3).weight
    for n, value in enumerate([cycle, deep, torch.empty(3, device="meta"), odd, torch.eye(3).to_sparse(), lazy]):
        errors = []
        for async_save in (False, True):
            with deltackpt.Checkpointer(fast_dir / f"s{n}{async_save}", model=torch.nn.Linear(2, 2),
                                        extra={"cfg": value}, async_save=async_save, handle_signals=False) as ck:
                with pytest.raises(deltackpt.UnsupportedTypeError, match=r"cannot store extra\.cfg") as exc:
                    ck.save(1)
                errors.append(str(exc.value))
        assert errors[0] == errors[1]
    assert "lazy module" in errors[0] and "forward pass" in errors[0]


_QUANTIZED_RUN = """
import sys, warnings
import torch, deltackpt
warnings.simplefilter("ignore")  # (quantized modules are deprecated)
model = torch.ao.nn.quantized.Linear(4, 4)
for async_save in (False, True):
    with deltackpt.Checkpointer(sys.argv[1] + str(async_save), model=model, async_save=async_save,
                                handle_signals=False) as ck:
        try:
            ck.step(1)
        except deltackpt.UnsupportedTypeError as exc:
            print(exc)
"""


def test_async_snapshot_refuses_a_quantized_tensor_without_crashing(fast_dir: Path) -> None:
    """A quantized model's state (torch.ao.nn.quantized.Linear: its packed weight is a quantized tensor) is
    refused by an async save's snapshot as by a synchronous save, naming the key path. Before, the staging copy
    took a uint8 view of the quantized tensor, and torch crashed the training process (SIGSEGV). Run in a
    child process, so that a crash fails this test only."""
    proc = subprocess.run([sys.executable, "-c", _QUANTIZED_RUN, str(fast_dir / "s")], env=worker_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert "cannot store model._packed_params._packed_params[0]" in lines[0] and "quantized" in lines[0]


def test_restore_does_not_pass_over_a_failing_registered_decoder(fast_dir: Path) -> None:
    """A registered type's decoder that raises is the user's error, not damage: restore() raises it (as an
    UnsupportedTypeError) rather than fall back to an older checkpoint."""
    class Cfg:
        def __init__(self, v: int) -> None:
            self.v = v

    def decode(d: Any) -> Cfg:
        if d >= 2:
            raise ValueError("my decoder rejects v >= 2")
        return Cfg(d)

    deltackpt.register_type(Cfg, "tests.Cfg", lambda c: c.v, decode)
    try:
        extra = {"cfg": Cfg(1)}
        with deltackpt.Checkpointer(fast_dir / "s", model=torch.nn.Linear(2, 2), extra=extra, async_save=False,
                                    handle_signals=False) as ck:
            ck.save(1)
            extra["cfg"] = Cfg(2)
            ck.save(2)
        with deltackpt.Checkpointer(fast_dir / "s", model=torch.nn.Linear(2, 2), extra={"cfg": Cfg(0)},
                                    handle_signals=False) as ck:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "damaged, trying the ones before it"
                with pytest.raises(deltackpt.UnsupportedTypeError, match="my decoder rejects"):
                    ck.restore()
    finally:
        deltackpt.unregister_type(Cfg)


class _Reshaping(torch.nn.Module):
    """Loads an old checkpoint's flat ``w`` into its 2-D one (its own ``_load_from_state_dict``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 3))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        if state_dict[prefix + "w"].dim() == 1:
            state_dict[prefix + "w"] = state_dict[prefix + "w"].reshape(2, 3)
        super()._load_from_state_dict(state_dict, prefix, *args)


@pytest.mark.parametrize("case", ["post_hook", "zero_dim", "own_loading", "optimizer_pre_hook"])
def test_restore_accepts_what_load_state_dict_accepts(fast_dir: Path, case: str) -> None:
    """The fit check before a restore refuses only what ``load_state_dict`` would: a load post-hook that
    forgives a new key, a 0-d parameter saved with shape (1,) (torch accepts it), a module whose own loading
    code converts an old layout, and an optimizer pre-hook that merges parameter groups all restore."""
    def build(old: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        if case == "post_hook":
            model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(2, 2))
            if not old:
                model.register_buffer("new_stat", torch.zeros(1))

                def forgive(module: Any, keys: Any) -> None:
                    if "new_stat" in keys.missing_keys:
                        keys.missing_keys.remove("new_stat")
                model.register_load_state_dict_post_hook(forgive)
        elif case == "zero_dim":
            model = torch.nn.Module()
            model.scale = torch.nn.Parameter(torch.ones(1) if old else torch.tensor(0.0))
        elif case == "own_loading":
            model = _Reshaping() if not old else torch.nn.Module()
            if old:
                model.w = torch.nn.Parameter(torch.arange(6.0))
        else:
            model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        if case == "optimizer_pre_hook" and old:
            opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if case == "optimizer_pre_hook" and not old:
            def merge(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
                groups = state["param_groups"]
                merged = {**groups[0], "params": [p for g in groups for p in g["params"]]}
                return {**state, "param_groups": [merged]}
            opt.register_load_state_dict_pre_hook(merge)
        return model, opt

    model, opt = build(old=True)
    with deltackpt.Checkpointer(fast_dir / "s", model=model, optimizer=opt, async_save=False,
                                handle_signals=False) as ck:
        ck.save(1)
    model2, opt2 = build(old=False)
    with deltackpt.Checkpointer(fast_dir / "s", model=model2, optimizer=opt2, handle_signals=False) as ck:
        assert ck.restore() == 1


def test_async_snapshot_passes_on_an_allocation_failure(fast_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Running out of memory while staging an async save is not a state the save refuses: the RuntimeError
    propagates as it is, not as UnsupportedTypeError."""
    from deltackpt import staging

    def no_memory(*args: Any) -> Any:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(staging.StagingBuffers, "_buffer_for", no_memory)
    with deltackpt.Checkpointer(fast_dir / "s", model=torch.nn.Linear(2, 2), handle_signals=False) as ck:
        with pytest.raises(RuntimeError, match="can't allocate") as exc:
            ck.save(1)
        assert not isinstance(exc.value, deltackpt.DeltackptError)


def test_an_interrupted_wait_keeps_the_save_in_flight(fast_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception raised in the main thread while wait() blocks on an async save (a KeyboardInterrupt, the
    DataLoader's SIGCHLD handler for a worker that died) is not the save's: it carries no note blaming the save,
    and the save stays in flight, so the next save waits for it before snapshotting into the staging buffers the
    running save still reads. (The save was dropped: checkpoint 1 was committed holding step 2's weights.)"""
    model = torch.nn.Linear(64, 64)
    ckpt = Checkpointer(fast_dir, model=model, async_save=True, handle_signals=False)
    release = threading.Event()
    save = ckpt.store._save

    def held_save(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)  # the background save reads the staging buffers only once released
        return save(*args, **kwargs)

    monkeypatch.setattr(ckpt.store, "_save", held_save)

    class Interrupted(Exception):
        pass

    def interrupt(*_: Any) -> None:
        raise Interrupted("a signal handler raised while wait() blocked")

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with torch.no_grad():
            model.weight.fill_(1.0)
        ckpt.save(1)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Interrupted) as caught:
            ckpt.wait()
        assert not getattr(caught.value, "__notes__", None)
        with torch.no_grad():
            model.weight.fill_(2.0)
        threading.Timer(0.2, release.set).start()
        ckpt.save(2)  # waits for save 1 (released meanwhile), then snapshots
        ckpt.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release.set()
    with Store(fast_dir) as s:
        for step in (1, 2):
            assert torch.equal(s.load(step)["model"]["weight"], torch.full((64, 64), float(step))), step


def test_an_exception_just_after_an_async_submit_keeps_the_save_in_flight(fast_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception raised in the main thread as an async save is handed to its thread (a second Ctrl-C's
    KeyboardInterrupt during the submit, or just after it) leaves that save either never run or in flight, so
    the next save does not snapshot into the staging buffers under it. (The save ran untracked: the next step's
    snapshot overwrote its buffers, and checkpoint 1 was committed holding step 2's weights.)"""
    model = torch.nn.Linear(64, 64)
    ckpt = Checkpointer(fast_dir, model=model, async_save=True, handle_signals=False)
    assert ckpt._executor is not None
    release = threading.Event()
    submit = ckpt._executor.submit

    def held(fn: Any, *args: Any) -> Any:
        release.wait(30)  # the job starts only once released
        return fn(*args)

    def interrupted_submit(fn: Any, *args: Any, **kwargs: Any) -> Any:
        submit(held, fn, *args, **kwargs)
        raise KeyboardInterrupt  # arrives as the submit returns

    monkeypatch.setattr(ckpt._executor, "submit", interrupted_submit)
    try:
        with torch.no_grad():
            model.weight.fill_(1.0)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(1)
        monkeypatch.undo()
        with torch.no_grad():
            model.weight.fill_(2.0)
        threading.Timer(0.2, release.set).start()
        ckpt.save(2)  # waits for save 1 if it is running, then snapshots
        ckpt.close()
    finally:
        release.set()
    with Store(fast_dir) as s:
        steps = [i.step for i in s.list()]
        assert 2 in steps
        for step in steps:
            assert torch.equal(s.load(step)["model"]["weight"], torch.full((64, 64), float(step))), step


def test_a_close_interrupted_as_it_releases_can_be_called_again(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """close() waits for the last save, then for its thread: an exception there (a second Ctrl-C, the first having
    interrupted the wait for the save) left the store open, the signal handlers installed and close() a no-op
    that said nothing. close() again now finishes the release; once done it does nothing."""
    before = signal.getsignal(signal.SIGINT)
    ckpt = Checkpointer(tmp_path / "s", model=torch.nn.Linear(8, 8), async_save=True)
    assert ckpt._executor is not None
    try:
        ckpt.step(1)

        def interrupted(*_: Any, **__: Any) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(ckpt._executor, "shutdown", interrupted)
        with pytest.raises(KeyboardInterrupt):
            ckpt.close()
        monkeypatch.undo()
        with pytest.raises(deltackpt.DeltackptError, match="closed"):
            ckpt.step(2)  # closed all the same
        ckpt.close()
        assert ckpt.store._closed and ckpt._executor._shutdown
        assert signal.getsignal(signal.SIGINT) is before
        ckpt.close()
    finally:
        signal.signal(signal.SIGINT, before)
    with Store(tmp_path / "s") as s:
        assert [i.step for i in s.list()] == [1]


@pytest.mark.parametrize("async_save", [False, True])
def test_step_metadata_goes_with_the_save_it_makes(tmp_path: Path, async_save: bool) -> None:
    """``step(n, metadata=...)`` puts the metadata on the save that step makes (the metric keep_best ranks
    periodic saves by) and drops it at steps that do not save; bad metadata is refused at any step."""
    model, opt = _small()
    losses = {n: abs(n - 8) + 0.5 for n in range(1, 13)}  # the best save is step 8's
    with Checkpointer(tmp_path / "s", model=model, optimizer=opt, every_n_steps=4, async_save=async_save,
                      retention=Retention(keep_last=1, keep_best=("loss", "min"), best_k=1)) as ckpt:
        with pytest.raises(TypeError, match="metadata must be a mapping"):
            ckpt.step(1, metadata=[("loss", 1.0)])  # type: ignore[arg-type]
        # a tensor loss (no .item()) at a step that does not save: refused there, not by a save steps later
        with pytest.raises(deltackpt.UnsupportedTypeError, match=r"'loss'.*\.item\(\)"):
            ckpt.step(1, metadata={"loss": torch.tensor(0.5)})
        for n, loss in losses.items():
            ckpt.step(n, metadata={"loss": loss})
        ckpt.wait()
        infos = ckpt.store.list()
    assert [(i.step, i.metadata) for i in infos] == [(8, {"loss": 0.5}), (12, {"loss": 4.5})]


def test_keep_best_by_a_metric_no_checkpoint_records_warns_once(tmp_path: Path) -> None:
    """A keep_best metric that no checkpoint records while others are recorded (a typo: 'val-loss' for
    'val_loss') keeps nothing by itself: one RuntimeWarning says so, naming what is recorded. Before any
    metric is recorded (evaluation not run yet) nothing is said."""
    model, opt = _small()
    with Checkpointer(tmp_path / "s", model=model, optimizer=opt, handle_signals=False,
                      retention=Retention(keep_last=2, keep_best=("val-loss", "min"))) as ckpt:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.step(1)
            for n in range(2, 6):
                ckpt.step(n, metadata={"val_loss": float(n)})
            ckpt.wait()  # (retention runs after each save, in the background with async saves)
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(said) == 1, said
        assert "ranks by 'val-loss'" in said[0] and "'val_loss'" in said[0]
        assert [i.step for i in ckpt.store.list()] == [4, 5]
    # a save in the caller's thread: the warning points at its step() call here, not into checkpointer.py
    with Checkpointer(tmp_path / "s2", model=model, optimizer=opt, handle_signals=False, async_save=False,
                      retention=Retention(keep_last=2, keep_best=("val-loss", "min"))) as ckpt:
        with pytest.warns(RuntimeWarning, match="ranks by 'val-loss'") as warned:
            ckpt.step(1, metadata={"val_loss": 1.0})
        assert [w.filename for w in warned] == [__file__]


def test_an_async_save_stores_the_metadata_as_it_was_at_its_step(tmp_path: Path) -> None:
    """Nested metadata is copied at ``step()``: a loop that updates its own dict of results right after (as the
    next evaluation does) does not change what the background save stores. Before, only the top level was
    copied, and a model of many tensors (a slower save) stored the values of later steps."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4)) for _ in range(2000)])
    results: dict[str, Any] = {"eval": {"acc": 0.5, "step": 1}, "history": [0.5]}
    with Checkpointer(tmp_path / "s", model=model, async_save=True, handle_signals=False) as ckpt:
        ckpt.step(1, metadata=results)
        results["eval"]["acc"], results["eval"]["step"] = 0.99, 2
        results["history"].append(0.99)
        ckpt.wait()
        assert ckpt.store.info(1).metadata == {"eval": {"acc": 0.5, "step": 1}, "history": [0.5]}


def test_restore_not_strict_leaves_what_the_checkpoint_lacks(tmp_path: Path) -> None:
    """A run that gained a scheduler, a second optimizer in a dict or an ``extra`` entry since its last
    checkpoint cannot restore it strictly; with ``strict=False`` the model and what the checkpoint holds are
    restored, the rest stays as it is, named in a RuntimeWarning. The model must match either way."""
    model, opt = _small()
    with Checkpointer(tmp_path / "s", model=model, optimizer={"main": opt}) as ckpt:
        model(torch.ones(8)).sum().backward()
        opt.step()
        ckpt.save(3, wait=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2 = _small()
    aux = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt2, step_size=1)
    extra = {"cfg": {"lr": 1.0}}
    with Checkpointer(tmp_path / "s", model=model2, optimizer={"main": opt2, "aux": aux}, scheduler=sched,
                      extra=extra) as ckpt:
        with pytest.raises(deltackpt.DeltackptError, match="holds no optimizer state for 'aux'"):
            ckpt.restore()
        with pytest.warns(RuntimeWarning, match=r"holds no optimizer\['aux'\], scheduler, extra\['cfg'\]"):
            assert ckpt.restore(strict=False) == 3
        assert all(torch.equal(model2.state_dict()[k], v) for k, v in saved.items())
        assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
        assert extra == {"cfg": {"lr": 1.0}} and sched.last_epoch == 0 and not aux.state
        ckpt.save(4, wait=True)
    with Checkpointer(tmp_path / "s", model=torch.nn.Linear(8, 5)) as ckpt:
        with pytest.raises(deltackpt.ShapeMismatchError):
            ckpt.restore(strict=False)


@pytest.mark.parametrize(("saved", "run", "said"), [
    ("list", "one", "holds a list of 2 optimizer states, this run has one optimizer"),
    ("dict", "one", r"holds a dict of optimizer states \('a', 'b'\), this run has one optimizer"),
    ("one", "list", "holds one optimizer state or a dict of them, not a list; this run has a list of 2"),
    ("dict", "list", "holds one optimizer state or a dict of them, not a list"),
    ("list", "dict", "holds no optimizer state for 'a', 'b'"),
    ("sched-list", "one", "holds a list of 2 scheduler states, this run has one scheduler"),
    ("sched-dict", "one", r"holds a dict of scheduler states \('warm', 'decay'\), this run has one scheduler"),
    ("model-list", "one", "holds a list of 2 model states, this run has one model"),
])
def test_a_restore_of_components_grouped_otherwise_is_refused_before_anything_changes(
        tmp_path: Path, saved: str, run: str, said: str) -> None:
    """A checkpoint saved with a list or dict of optimizers (schedulers, models) and restored by a run that
    passes them grouped otherwise is refused naming both, before the model or optimizer holds any of it.
    Before, a single optimizer given a list's or dict's state failed inside torch (TypeError, KeyError) with
    the model already restored, and a single scheduler given a list's state raised ValueError."""
    def build() -> tuple[torch.nn.Sequential, list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        return m, [torch.optim.AdamW(m[0].parameters()), torch.optim.SGD(m[1].parameters(), lr=0.1, momentum=0.9)]

    def grouped(shape: str, items: list[Any]) -> Any:
        return items if shape == "list" else dict(zip("ab", items)) if shape == "dict" else items[0]

    model, opts = build()
    scheds = [torch.optim.lr_scheduler.StepLR(opts[0], 2), torch.optim.lr_scheduler.ExponentialLR(opts[0], 0.9)]
    kwargs: dict[str, Any] = {"model": model, "optimizer": grouped(saved, opts)}
    if saved.startswith("sched"):
        kwargs = {"model": model, "optimizer": opts,
                  "scheduler": scheds if saved == "sched-list" else dict(zip(("warm", "decay"), scheds))}
    elif saved == "model-list":
        kwargs = {"model": [model, torch.nn.Linear(2, 2)], "optimizer": opts}
    with Checkpointer(tmp_path / "s", **kwargs, handle_signals=False) as ckpt:
        for n in (1, 2):
            model(torch.randn(4, 8)).sum().backward()
            for o in opts:
                o.step()
            ckpt.step(n)
    model2, opts2 = build()
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    kwargs = {"model": model2, "optimizer": grouped(run, opts2)}
    if saved.startswith("sched"):
        kwargs = {"model": model2, "optimizer": opts2, "scheduler": torch.optim.lr_scheduler.StepLR(opts2[0], 2)}
    elif saved == "model-list":
        kwargs["optimizer"] = opts2
    with Checkpointer(tmp_path / "s", **kwargs, handle_signals=False) as ckpt:
        with pytest.raises(deltackpt.DeltackptError, match=said):
            ckpt.restore()
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())
    assert not opts2[0].state and not opts2[1].state


class _Stats:
    """A registered user type whose decoder works on its tensor (so it cannot take a tensor entry)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _Loader:
    """A data loader with its own state, whose loading refuses another dataset's position."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        if sd["n"] != self.n:
            raise ValueError("position of another dataset")
        self.pos = sd["pos"]


def _bn_model(out: int = 2) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, out))


def _lone_lr_optimizer(params: Any) -> torch.optim.Optimizer:
    class Plain(torch.optim.Optimizer):  # a user's optimizer: plain gradient steps, no state
        def __init__(self, ps: Any) -> None:
            super().__init__(ps, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for g in self.param_groups:
                for q in g["params"]:
                    if q.grad is not None:
                        q.add_(q.grad, alpha=-g["lr"])
    return Plain(params)


@pytest.mark.parametrize("case", ["buffer-added", "stats-dropped", "custom-to-adamw", "steplr-to-cosine",
                                  "extra-steplr-to-sequential", "extra-scaler-enabled", "extra-tensor-to-module",
                                  "loader-refuses", "registered-extra"])
def test_a_restore_that_does_not_fit_changes_nothing_before_it_raises(tmp_path: Path, case: str) -> None:
    """Each way a resumed run can differ from the one that saved is refused with a deltackpt error before the
    model or optimizer holds any of the checkpoint, or (a component's own loading, which no check foresees)
    names the component and what was put back before it. Before, each of these failed inside torch (a
    RuntimeError of a model with batch norm, whose keys went unchecked; KeyError 'step' of a custom optimizer's
    state in AdamW; KeyError '_schedulers' of a scheduler kept in ``extra``; TypeError of a tensor given to
    a module's load_state_dict) or in the user's loader, after the model was overwritten; a StepLR's state was
    loaded into a CosineAnnealingLR silently; and with a registered type in ``extra`` whose decoder needs real
    tensors, nothing was checked before the load decoded into the model."""
    saving: dict[str, Any] = {}
    model = _bn_model()
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters())
    if case == "custom-to-adamw":
        opt = _lone_lr_optimizer(model.parameters())
    if case == "steplr-to-cosine":
        saving["scheduler"] = torch.optim.lr_scheduler.StepLR(opt, 2)
    if case == "extra-steplr-to-sequential":
        saving["extra"] = {"sched": torch.optim.lr_scheduler.StepLR(opt, 2)}
    if case == "extra-scaler-enabled":
        saving["extra"] = {"scaler": torch.amp.GradScaler("cpu", enabled=False)}
    if case == "extra-tensor-to-module":
        saving["extra"] = {"ema": torch.zeros(3)}
    if case == "loader-refuses":
        saving["data"] = _Loader(10)
    if case == "registered-extra":
        deltackpt.register_type(_Stats, "test.Stats", lambda o: {"t": o.t}, lambda d: _Stats(d["t"].clone()))
        saving["extra"] = {"stats": _Stats(torch.ones(4))}
    try:
        with Checkpointer(tmp_path / "s", model=model, optimizer=opt, **saving, handle_signals=False) as ckpt:
            for n in (1, 2):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                ckpt.step(n)

        model2 = _bn_model(3 if case == "registered-extra" else 2)
        if case == "buffer-added":
            model2.register_buffer("scale", torch.ones(1))
        if case == "stats-dropped":
            model2[1] = torch.nn.BatchNorm1d(8, track_running_stats=False)
        opt2 = torch.optim.AdamW(model2.parameters())
        running = {k: v if k != "scheduler" else torch.optim.lr_scheduler.CosineAnnealingLR(opt2, 10)
                   for k, v in saving.items()}
        if case == "extra-steplr-to-sequential":
            running["extra"] = {"sched": torch.optim.lr_scheduler.SequentialLR(
                opt2, [torch.optim.lr_scheduler.ConstantLR(opt2), torch.optim.lr_scheduler.StepLR(opt2, 2)], [1])}
        if case == "extra-scaler-enabled":
            running["extra"] = {"scaler": torch.amp.GradScaler("cpu")}
        if case == "extra-tensor-to-module":
            running["extra"] = {"ema": torch.nn.Linear(3, 1)}
        if case == "loader-refuses":
            running["data"] = _Loader(12)
        before = {k: v.clone() for k, v in model2.state_dict().items()}
        with Checkpointer(tmp_path / "s", model=model2, optimizer=opt2, **running, handle_signals=False) as ckpt:
            with pytest.raises(deltackpt.DeltackptError) as caught:
                ckpt.restore()
    finally:
        deltackpt.unregister_type(_Stats)
    said = str(caught.value)
    if case == "loader-refuses":  # (loaded after the model and optimizer, as it has to be)
        assert "data: restoring it raised ValueError: position of another dataset" in said
        assert "put back before it: the model's tensors (decoded into them), model, optimizer" in said
        assert isinstance(caught.value.__cause__, ValueError)
        return
    assert {"buffer-added": "missing in the checkpoint ['scale']",
            "stats-dropped": "not in this run ['1.running_mean', '1.running_var', '1.num_batches_tracked']",
            "custom-to-adamw": "lacks ['betas', 'eps', 'weight_decay'] of this run's AdamW",
            "steplr-to-cosine": "has ['gamma', 'step_size'] and lacks ['T_max', 'eta_min'] of this run's Cosine",
            "extra-steplr-to-sequential": "extra['sched']: this run's SequentialLR loads '_schedulers'",
            "extra-scaler-enabled": "extra['scaler']: the checkpoint's scaler was disabled",
            "extra-tensor-to-module": "extra['ema']: the checkpoint holds a tensor there",
            "registered-extra": "'2.weight' has shape (2, 8) in the checkpoint, (3, 8) in this run"}[case] in said
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())
    assert not opt2.state


def test_schedulers_restored_in_another_order_warn(tmp_path: Path) -> None:
    """Two schedulers of other kinds, listed in the other order when restoring: each state has an attribute the
    other kind lacks (StepLR's step_size), which may also be another torch version's, so the restore warns,
    naming it, rather than refuse; torch loads the states as they are (before: silently)."""
    model, opt = _small()
    with Checkpointer(tmp_path / "s", model=model, optimizer=opt, handle_signals=False,
                      scheduler=[torch.optim.lr_scheduler.StepLR(opt, 2),
                                 torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]) as ckpt:
        ckpt.save(1, wait=True)
    model2, opt2 = _small()
    swapped = [torch.optim.lr_scheduler.ExponentialLR(opt2, 0.9), torch.optim.lr_scheduler.StepLR(opt2, 2)]
    with Checkpointer(tmp_path / "s", model=model2, optimizer=opt2, scheduler=swapped, handle_signals=False) as ckpt:
        with pytest.warns(RuntimeWarning) as caught:
            ckpt.restore()
    said = [str(w.message) for w in caught]
    assert any("scheduler[0]: the checkpoint's scheduler state has ['step_size'], which this run's ExponentialLR"
               in w for w in said), said
    assert any("scheduler[1]: the checkpoint's scheduler state lacks ['step_size'], which this run's StepLR has"
               in w for w in said), said


class _Switch:
    """A user's stateful object that happens to have ``is_enabled()`` and an empty state."""

    def __init__(self) -> None:
        self.loaded = False

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded = True


def test_an_extra_object_with_is_enabled_is_not_taken_for_a_scaler(tmp_path: Path) -> None:
    """Only a GradScaler kept in ``extra`` gets the disabled-scaler check: another object with an empty state and
    an ``is_enabled()`` of its own restores."""
    model, opt = _small()
    with Checkpointer(tmp_path / "s", model=model, optimizer=opt, extra={"sw": _Switch()}, handle_signals=False) as c:
        c.save(1, wait=True)
    switch = _Switch()
    with Checkpointer(tmp_path / "s", model=model, optimizer=opt, extra={"sw": switch}, handle_signals=False) as c:
        assert c.restore() == 1
    assert switch.loaded


def test_a_lazy_model_not_yet_initialized_restores_as_torch_loads_it(tmp_path: Path) -> None:
    """A fresh lazy module (``LazyLinear`` before its first forward) has parameters with no shape: the restore
    leaves them to ``load_state_dict``, which makes them from the checkpoint, as torch's own load does, and the
    optimizer built on them takes its state. Before, the restore's checks and its in-place decode asked for
    their shape and failed with torch's RuntimeError."""
    x = torch.randn(4, 6)

    def lazy() -> torch.nn.Sequential:
        return torch.nn.Sequential(torch.nn.LazyLinear(5), torch.nn.Linear(5, 3))

    torch.manual_seed(1)
    model = lazy()
    model(x)
    opt = torch.optim.AdamW(model.parameters())
    model(x).sum().backward()
    opt.step()
    with Checkpointer(tmp_path / "s", model=model, optimizer=opt, handle_signals=False) as ckpt:
        ckpt.save(1, wait=True)
    model2 = lazy()
    opt2 = torch.optim.AdamW(model2.parameters())
    with Checkpointer(tmp_path / "s", model=model2, optimizer=opt2, handle_signals=False) as ckpt:
        assert ckpt.restore() == 1
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in model2.state_dict().items())
    assert torch.equal(opt2.state[model2[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    with Store(tmp_path / "s") as store:
        got = store.load(into={"model": lazy().state_dict()})
    assert torch.equal(got["model"]["0.weight"], model[0].weight)


def test_batch_norm_without_num_batches_tracked_is_checked_as_torch_loads_it() -> None:
    """A batch norm state of module version 1 may lack ``num_batches_tracked`` (torch fills it in); of version 2
    it may not. The restore's key check agrees with torch's load_state_dict either way."""
    from deltackpt.fitcheck import fit_check

    for version, loads in ((1, True), (2, False)):
        model = _bn_model()
        saved = model.state_dict()
        del saved["1.num_batches_tracked"]
        saved._metadata["1"]["version"] = version  # type: ignore[attr-defined]
        if loads:
            fit_check(model, saved, "model")
            model.load_state_dict(saved)
        else:
            with pytest.raises(deltackpt.ShapeMismatchError, match=r"missing in the checkpoint \['1.num_batches_"):
                fit_check(model, saved, "model")
            with pytest.raises(RuntimeError, match="num_batches_tracked"):
                model.load_state_dict(saved)


def test_restore_names_what_the_checkpoint_holds_and_this_run_was_not_given(tmp_path: Path) -> None:
    """A run resumed without the scheduler (or scaler, optimizer, an extra entry) it saved would restart that
    part silently: a forgotten ``scheduler=`` begins the LR schedule again. The restore names what it leaves
    behind in a RuntimeWarning; a run given everything it saved gets none."""
    model, opt = _small()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with Checkpointer(tmp_path / "s", model=model, optimizer=opt, scheduler=sched, extra={"cfg": {"a": 1}},
                      async_save=False) as ckpt:
        _train_step(model, opt)
        sched.step()
        ckpt.save(1, wait=True)
    model2, opt2 = _small()
    with Checkpointer(tmp_path / "s", model=model2, optimizer=opt2, async_save=False) as ckpt:
        with pytest.warns(RuntimeWarning, match=r"also holds scheduler, extra\['cfg'\], which this Checkpointer "
                                                r"was not given: not restored"):
            assert ckpt.restore() == 1
    assert torch.equal(model2.weight, model.weight)
    model3 = _small()[0]
    with Checkpointer(tmp_path / "s", model=model3, async_save=False) as ckpt:
        with pytest.warns(RuntimeWarning, match=r"also holds optimizer, scheduler, extra"):
            ckpt.restore()
    model4, opt4 = _small()
    sched4 = torch.optim.lr_scheduler.StepLR(opt4, step_size=1)
    with Checkpointer(tmp_path / "s", model=model4, optimizer=opt4, scheduler=sched4, extra={"cfg": {}},
                      async_save=False) as ckpt:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ckpt.restore()
    assert sched4.last_epoch == 1


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()


def test_thinning_keeps_checkpoints_a_checkpointer_did_not_write_whole(fast_dir: Path) -> None:
    """full_last thins a Checkpointer's checkpoints to their weights; one saved some other way (Store.save of a
    list, an imported state with no "model" entry) has no weights it could tell apart and stays whole, and later
    saves go on (it emptied the first, and the second made every later save raise)."""
    pretrained = {"encoder.weight": torch.randn(16, 8), "encoder.bias": torch.randn(16)}
    with Store(fast_dir / "store") as s:
        s.save(pretrained, step=0, metadata={"tag": "pretrained"})
        s.save([torch.arange(5.0)], step=1, metadata={"tag": "list"})
    model, opt = _small()
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False, handle_signals=False,
                      retention=Retention(keep_last=2, full_last=1)) as ckpt:
        for step in range(2, 6):
            _train_step(model, opt)
            assert ckpt.step(step)
        infos = {i.step: i for i in ckpt.store.list()}
        assert sorted(infos) == [0, 1, 4, 5]
        assert infos[4].metadata == {"thinned": True} and set(ckpt.store.load(4)) == {"step", "model", "thinned"}
        ckpt.store.gc()
        assert_bitwise(pretrained, ckpt.store.load(0))
        assert_bitwise([torch.arange(5.0)], ckpt.store.load(1))
        assert not any(i.metadata.get("thinned") for s, i in infos.items() if s < 2)


def test_thinning_keeps_the_device_the_weights_were_saved_from(fast_dir: Path) -> None:
    """Thinning loads a checkpoint onto the CPU and rewrites its weights: the thinned checkpoint still records
    the device they were saved from (a GPU model's weights came back as "cpu" tensors, and loads put them on the
    CPU). No GPU is needed: the checkpoint's manifest is edited to record cuda:0, as a GPU save writes it."""
    model, opt = _small()
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False, handle_signals=False,
                      retention=Retention(keep_last=3, full_last=1)) as ckpt:
        _train_step(model, opt)
        ckpt.step(1)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        s = ckpt.store
        info = s.info(1)
        rec, m = s.index.get(id=info.id), s.manifest(id=info.id)
        for t in m.tensors:
            if t.key.startswith("model."):
                t.device = "cuda:0"
        data = m.to_bytes()
        (fast_dir / "store" / "manifests" / f"{info.id}.manifest").write_bytes(data)
        rec.manifest_checksum = manifest.checksum_of(data)
        s.index.commit_checkpoint(rec, {}, replace=rec)
        for step in (2, 3):
            _train_step(model, opt)
            ckpt.step(step)
        thinned = s.info(1)
        assert thinned.metadata == {"thinned": True}
        devices = {t.key: t.device for t in s.manifest(id=thinned.id).tensors}
        assert devices == {"model.weight": "cuda:0", "model.bias": "cuda:0"}, devices
        assert_bitwise(weights, s.load(1, map_location="cpu")["model"])


def test_retention_passes_over_a_damaged_checkpoint_it_would_thin(fast_dir: Path) -> None:
    """A checkpoint full_last is due to thin is damaged: retention warns and leaves it as it is; the save stands
    and the deletes still run (step() raised at every save, and nothing was deleted). It warns once: later saves
    do not load the damaged checkpoint again (they did, at every save, while it was kept)."""
    model, opt = _small()
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False, handle_signals=False,
                      retention=Retention(keep_last=3, full_last=1)) as ckpt:
        _train_step(model, opt)
        ckpt.step(1)
        first = ckpt.store.info(1).id
        manifest_1 = fast_dir / "store" / "manifests" / f"{first}.manifest"
        data = bytearray(manifest_1.read_bytes())
        data[40] ^= 0xFF
        manifest_1.write_bytes(bytes(data))
        for step in range(2, 6):
            _train_step(model, opt)
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                with pytest.warns(RuntimeWarning, match=f"cannot thin checkpoint {first} \\(step 1\\)") if step == 2 \
                        else contextlib.nullcontext():
                    assert ckpt.step(step)
        assert [i.step for i in ckpt.store.list()] == [3, 4, 5]


def test_a_retention_of_the_wrong_type_is_refused_before_any_save(fast_dir: Path) -> None:
    for bad in ({"keep_last": 3}, "keep_last=3", 3):
        with pytest.raises(TypeError, match="retention must be a deltackpt.Retention"):
            Checkpointer(fast_dir / "store", model=torch.nn.Linear(2, 2), retention=bad,  # type: ignore[arg-type]
                         handle_signals=False)
    with Store(fast_dir / "store") as s:
        assert s.list() == []


def test_a_refused_checkpointer_creates_no_store(fast_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Arguments are checked before the store is opened: a DataLoader passed as data= (it has no position to
    save), an optimizer without state_dict, a bad interval, retention, map_location (checked at the first restore
    of a checkpoint before) or rng, a bad DELTACKPT_GC_MIN_BYTES leave no store behind (and no file of one open:
    before, the last created the store and kept its index open)."""
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    for kwargs, error in (({"data": loader}, "wrap a DataLoader in deltackpt.data.ResumableLoader"),
                          ({"optimizer": object()}, "object has no state_dict"),
                          ({"every_n_steps": 0}, "every_n_steps must be"),
                          ({"retention": 3}, "retention must be"),
                          ({"map_location": "garbage"}, "map_location 'garbage' is not a device torch knows"),
                          ({"map_location": 3.5}, "map_location must be None, a device"),
                          ({"rng": "no"}, "rng"),
                          ({"env": "-1"}, "DELTACKPT_GC_MIN_BYTES")):
        if "env" in kwargs:
            monkeypatch.setenv("DELTACKPT_GC_MIN_BYTES", kwargs.pop("env"))
        with pytest.raises((TypeError, ValueError), match=error):
            Checkpointer(fast_dir / "store", model=torch.nn.Linear(2, 2), handle_signals=False, **kwargs)
        assert not (fast_dir / "store").exists()
    gc.collect()
    assert [t for t in map(_fd_target, os.listdir("/proc/self/fd")) if t.startswith(str(fast_dir))] == []


def _fd_target(fd: str) -> str:
    """What this process's file descriptor ``fd`` refers to ("" once it is closed)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_a_checkpoint_without_rng_states_is_refused_before_anything_is_restored(fast_dir: Path) -> None:
    """A checkpoint in the Checkpointer's layout but without "rng" (converted from a torch.save file, say) is
    refused by restore() before the model changes (it raised KeyError after loading model and optimizer);
    with strict=False the rest is restored and the RNGs are named in the warning."""
    model, opt = _small()
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False,
                      handle_signals=False) as ckpt:
        _train_step(model, opt)
        state = ckpt.capture(1)
        del state["rng"]
        ckpt.store.save(state, step=1)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = _small()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with Checkpointer(fast_dir / "store", model=fresh, optimizer=fresh_opt, handle_signals=False) as ckpt:
        with pytest.raises(deltackpt.DeltackptError, match="no RNG states"):
            ckpt.restore()
        assert_bitwise(before, fresh.state_dict())
        torch.manual_seed(7)
        rng_before = torch.get_rng_state()
        with pytest.warns(RuntimeWarning, match="holds no rng"):
            assert ckpt.restore(strict=False) == 1
        assert_bitwise(saved, fresh.state_dict())
        assert torch.equal(rng_before, torch.get_rng_state())


def _two_checkpointer_run(root: Path, start: int, end: int, *, side_rng: bool) -> list[float]:
    """A loop with a model checkpointer saving every step and an EMA one every 2 (``side_rng`` for the EMA's
    ``rng=``): restore both if ``start``, then train to ``end``; the draws of the loop (dropout, say)."""
    model, opt = _small()
    ema = torch.optim.swa_utils.AveragedModel(model)
    draws = []
    with Checkpointer(root / "main", model=model, optimizer=opt, async_save=False, handle_signals=False) as main, \
            Checkpointer(root / "ema", model=ema, every_n_steps=2, async_save=False, handle_signals=False,
                         rng=side_rng) as side:
        if start:
            assert main.restore() == start
            assert side.restore() == start - start % 2
        for step in range(start + 1, end + 1):
            draws.append(torch.rand(()).item())
            _train_step(model, opt)
            ema.update_parameters(model)
            main.step(step)
            side.step(step)
    return draws


def test_a_second_checkpointer_restored_to_another_step_warns_and_rng_false_resumes_exactly(fast_dir: Path) -> None:
    """The RNG states are the process's. Two checkpointers of one loop restored to different steps (an EMA saved
    every 2 steps, a model every step; stopped at step 3): the EMA's restore wound them back to step 2, silently,
    and every draw after the resume repeated earlier ones. That restore now warns; with ``rng=False`` the EMA's
    checkpointer neither saves nor restores them, and the resumed run draws as the uninterrupted one."""
    ref = _two_checkpointer_run(fast_dir / "ref", 0, 6, side_rng=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = _two_checkpointer_run(fast_dir / "a", 0, 3, side_rng=False)
        assert first + _two_checkpointer_run(fast_dir / "a", 3, 6, side_rng=False) == ref
    _two_checkpointer_run(fast_dir / "b", 0, 3, side_rng=True)
    with pytest.warns(RuntimeWarning, match=r"step 2 from .*ema sets the process's RNG states to that step's, while "
                                            r"the checkpointer of .*main restored them at, or has saved since, step 3"
                                            r".*rng=False") as caught:
        rest = _two_checkpointer_run(fast_dir / "b", 3, 6, side_rng=True)
    assert caught[0].filename == __file__  # (pointed at the restore() call, not inside deltackpt)
    assert first + rest != ref
    with Store(fast_dir / "a" / "ema") as store:
        assert "rng" not in store.load(step=2)


def test_no_rng_warning_for_a_checkpointer_made_again_on_its_store_or_in_a_forked_child(fast_dir: Path) -> None:
    """The warning is for two checkpointers of one loop at different steps. A loop that makes its checkpointer
    again on the same store (a notebook cell run again, the first one left open) is the same run; nor does a
    forked child (a worker with a checkpointer of its own) inherit the parent's restore."""
    model, opt = _small()
    with Checkpointer(fast_dir / "a", model=model, optimizer=opt, async_save=False, handle_signals=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.step(step)
    with Checkpointer(fast_dir / "b", model=model, async_save=False, handle_signals=False) as ckpt:
        ckpt.step(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = Checkpointer(fast_dir / "a", model=model, optimizer=opt, handle_signals=False)
        assert first.restore(step=1) == 1
        again = Checkpointer(fast_dir / "a", model=model, optimizer=opt, handle_signals=False)
        assert again.restore() == 3
        pid = os.fork()
        if pid == 0:  # the child: its only checkpointer, of another store, at another step
            code = 1
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    with Checkpointer(fast_dir / "b", model=model, handle_signals=False) as child:
                        code = 0 if child.restore() == 2 else 2
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        again.close()
        first.close()


def test_a_resumed_run_writes_a_damaged_chunk_again_rather_than_deduplicating_onto_it(fast_dir: Path) -> None:
    """Chunks only the newest checkpoint holds are damaged: restore() resumes from the one before, and the rerun
    of that step saves the same bytes. The save writes the damaged chunks again, standalone (it deduplicated
    onto the damaged frames, so the checkpoint it had just committed did not load), and re-points the index at
    them, which repairs the damaged checkpoint too."""
    model, opt = _small()
    states: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False,
                      handle_signals=False) as ckpt:
        for step in (1, 2, 3):
            _train_step(model, opt)
            ckpt.step(step)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        store = ckpt.store
        old3 = store.info(3).id
        keys = {s: {k for _, k in _stored(store.manifest(step=s))} for s in (2, 3)}
        only3 = sorted(keys[3] - keys[2])[:2]  # two: the load stops at the first, restore() finds the other
        assert len(only3) == 2
        locs = store.index.lookup_chunks(only3)
    _damage_frames(fast_dir / "store", locs.values())
    fresh, fresh_opt = _small()
    with Checkpointer(fast_dir / "store", model=fresh, optimizer=fresh_opt, async_save=False,
                      handle_signals=False) as ckpt:
        with pytest.warns(RuntimeWarning, match=f"checkpoint {old3} \\(step 3\\) is damaged"):
            assert ckpt.restore() == 2
        _train_step(fresh, fresh_opt)  # the RNGs are restored: the same step again
        assert_bitwise(states[3], fresh.state_dict())
        info = ckpt.save(3) or ckpt.last_info
        assert info is not None and info.written_bytes > 0
        assert_bitwise(states[3], ckpt.store.load(id=info.id)["model"])
        assert_bitwise(states[3], ckpt.store.load(id=old3)["model"])  # the damaged one loads again
        assert ckpt.store.verify().ok
        assert {loc.depth for loc in ckpt.store.index.lookup_chunks(only3).values()} == {0}


def test_a_save_does_not_build_on_chunks_that_decode_through_a_damaged_one(fast_dir: Path) -> None:
    """Step 1's first moment is damaged on disk, and step 2's parameter and second moment were predicted from it
    before anyone knew (so step 2 is damaged too). Once a load has found the damage, step 3 must not take step
    2's chunks as bases or prediction inputs: the writer holds their right bytes, but a reader would decode them
    through the damaged chunk. Step 3 was written on them and failed verify right after its save."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()

    states: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=False,
                      handle_signals=False) as ckpt:
        store = ckpt.store
        step_of(model, opt)
        ckpt.step(1)
        m1 = store.manifest(step=1)
        exp_avg = next(t for t in m1.tensors if t.key == "optimizer.state[0].exp_avg")
        key = chunk_key(m1.digests[exp_avg.first].tobytes(), exp_avg.chunk_len(0, m1.chunk_size))
        _damage_frames(fast_dir / "store", store.index.lookup_chunks([key]).values())
        for step in (2, 3):
            step_of(model, opt)
            if step == 3:  # the damage is found (by a load, a verify, a thinning)
                with pytest.raises(deltackpt.CorruptChunkError):
                    store.load(1)
            ckpt.step(step)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        assert codec.PREDICTED in {loc.codec for loc in store.index.lookup_chunks(
            chunk_keys(*store.manifest(step=2).stored_chunks())).values()}  # (so step 2 did build on step 1)
        assert not store.verify(2).ok
        report = store.verify(3)
        assert report.ok, report.problems
        assert_bitwise(states[3], store.load(3)["model"])


def _stored(m: Any) -> list[tuple[str, bytes]]:
    from deltackpt import maintenance
    return maintenance._stored_chunks(m)


def _damage_frames(store: Path, locs: Any) -> None:
    """Flip a byte near the end of each frame at ``locs`` (index locations) in the packs of ``store``."""
    for loc in locs:
        pack = store / "packs" / f"{loc.pack_id}.pack"
        data = bytearray(pack.read_bytes())
        data[loc.offset + loc.frame_len - 3] ^= 0xFF
        pack.write_bytes(bytes(data))


def test_a_save_makes_a_lost_tmp_directory_again(fast_dir: Path) -> None:
    """tmp/ is empty between saves and a cleaner of empty directories may remove it: the next save makes it
    again (every save raised FileNotFoundError until the store was opened again), and gc does not mind."""
    with Store(fast_dir / "store") as s:
        s.save({"w": torch.zeros(3)}, step=1)
        (fast_dir / "store" / "tmp").rmdir()
        s.gc()
        s.save({"w": torch.ones(3)}, step=2)
        assert_bitwise({"w": torch.ones(3)}, s.load(2))


_EXIT_SCRIPT = """
import atexit, sys, torch, deltackpt
path, how = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(512, 512)  # a 1 MiB weight: its chunks are encoded on the store's worker pool
opt = torch.optim.AdamW(model.parameters())
if how == "atexit":  # a save and a load from an atexit handler, which runs after concurrent.futures stopped
    def at_exit():
        with deltackpt.Store(path) as s:
            s.save({"model": model.state_dict()}, step=1)
            assert torch.equal(s.load(1)["model"]["weight"], model.weight)
    atexit.register(at_exit)
    sys.exit(0)
ck = deltackpt.Checkpointer(path, model=model, optimizer=opt, handle_signals=False)
model(torch.randn(2, 512)).sum().backward()
opt.step()
ck.step(1)  # returns with the save in flight; no close()
if how == "raise":
    raise RuntimeError("the training loop failed")
if how == "exit":
    sys.exit(3)
"""


@pytest.mark.parametrize("how", ["end", "raise", "exit", "atexit"])
@pytest.mark.plumbing
def test_a_save_in_flight_as_the_interpreter_exits_is_committed(fast_dir: Path, how: str) -> None:
    """A job whose main thread ends with an async save in flight and no close() (the loop returned, raised, or
    called sys.exit) keeps that checkpoint: the save used to fail as concurrent.futures stopped taking work,
    silently. Saves and loads from an atexit handler work too."""
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(fast_dir / "store"), how],
                          capture_output=True, text=True, timeout=120, env=worker_env())
    assert done.returncode == {"end": 0, "raise": 1, "exit": 3, "atexit": 0}[how], done.stderr
    assert "deltackpt" not in done.stderr
    with Store(fast_dir / "store") as s:
        assert [i.step for i in s.list()] == [1]
        assert s.verify().ok


#: (the fork scripts' start) hold_saves(ck): ck's saves stay in flight until ``release`` is set; returns the real
#: save method
_HOLD_SAVES = """
import threading
release = threading.Event()
def hold_saves(ck):
    save = ck.store._save
    def held_save(*args, **kwargs):  # the save stays in flight until the child has been waited for
        release.wait()
        return save(*args, **kwargs)
    ck.store._save = held_save
    return save
"""

_FORK_SCRIPT = _HOLD_SAVES + """
import multiprocessing, sys, time, torch, deltackpt
model = torch.nn.Linear(64, 64)
ck = deltackpt.Checkpointer(sys.argv[1], model=model, handle_signals=False)
hold_saves(ck)
ck.step(1)
child = multiprocessing.get_context("fork").Process(target=int)  # returns at once, as a finished worker does
child.start()
t0 = time.monotonic()
child.join(timeout=10)
print("exit", child.exitcode, round(time.monotonic() - t0, 1))
if child.exitcode is None:
    child.kill()
release.set()
ck.close()
"""


@linux_only
def test_a_child_forked_during_an_async_save_exits_without_waiting_for_it(fast_dir: Path) -> None:
    """A process forked while an async save is in flight (a new epoch's DataLoader workers, a Pool) inherits the
    save's future but not its thread: its exit used to wait for that future forever (each DataLoader epoch then
    stalled 5 s per worker, and workers outlived a killed trainer)."""
    done = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, str(fast_dir / "store")], capture_output=True,
                          text=True, timeout=120, env=worker_env())
    assert done.returncode == 0, done.stderr
    _, code, took = done.stdout.split()
    assert code == "0" and float(took) < 5, done.stdout
    with Store(fast_dir / "store") as s:
        assert [i.step for i in s.list()] == [1]


_FORK_IN_WITH_SCRIPT = _HOLD_SAVES + """
import os, sys, time, torch, deltackpt
from tests.crashworker import child_outcome
model = torch.nn.Linear(64, 64)
with deltackpt.Checkpointer(sys.argv[1], model=model) as ck:
    save = hold_saves(ck)
    ck.step(1)
    pid = os.fork()
    if pid == 0:
        ck.store._save = save
        if sys.argv[2] == "save":
            ck.save(5, wait=True)  # saves of the child's own are waited for, and go through its own thread
        sys.exit(0)  # leaves the with block: close() runs in the child
    print(child_outcome(pid))
    release.set()
    ck.step(2)
with deltackpt.Store(sys.argv[1]) as s:
    print(sorted(i.step for i in s.list()))
"""


@linux_only
@pytest.mark.parametrize("use", ["close", "save"])
def test_a_child_forked_during_an_async_save_closes_the_checkpointer_it_inherited_at_once(
        fast_dir: Path, use: str) -> None:
    """A child forked inside a ``with Checkpointer(...)`` block while an async save is in flight, which leaves the
    block (``sys.exit``, an exception), runs close() on the inherited checkpointer: that waited for the parent's
    save, whose thread the child does not have, forever. Its own saves ran on the inherited executor, which has no
    thread in the child either, and waited forever too."""
    done = subprocess.run([sys.executable, "-c", _FORK_IN_WITH_SCRIPT, str(fast_dir / "store"), use],
                          capture_output=True, text=True, timeout=120, env=worker_env())
    assert done.returncode == 0, done.stderr
    child, listed = done.stdout.splitlines()
    assert child == "0", "the child hung" if child == "hung" else done.stderr
    assert listed == ("[1, 2, 5]" if use == "save" else "[1, 2]")


_FORK_RELEASES_SCRIPT = """
import os, signal, sys, torch, deltackpt
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.zeros(64, 4)), batch_size=4, num_workers=1, persistent_workers=True)
ck = deltackpt.Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2))
ck.protect_workers(loader)
batches = iter(loader)
next(batches)
(worker,) = batches._workers
pid = os.fork()
if pid == 0:  # a child of the training process that ends normally: its exit hooks run
    if sys.argv[2] == "close":
        ck.close()  # (a with block of the parent's that the child leaves)
    sys.stderr = open(os.devnull, "w")  # (multiprocessing's exit hook complains of the parent's workers)
    sys.exit(0)
os.waitpid(pid, 0)
os.kill(worker.pid, signal.SIGTERM)  # the job's stop signal, before the step boundary
worker.join(3)
print(worker.is_alive())
ck.close()
"""


@linux_only
@pytest.mark.parametrize("how", ["exit", "close"])
def test_a_forked_child_that_exits_leaves_the_parents_workers_protected(fast_dir: Path, how: str) -> None:
    """A child forked from the training process that ends normally (``sys.exit``, or closing the checkpointer it
    inherited first) ran the release of the protected DataLoaders' workers, the parent's, at its exit: from then
    on a SIGTERM sent to the whole job ended them before the step boundary, and the DataLoader raised in the
    training process instead of the checkpointer saving."""
    done = subprocess.run([sys.executable, "-c", _FORK_RELEASES_SCRIPT, str(fast_dir / "store"), how],
                          capture_output=True, text=True, timeout=120, env=worker_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"], "the parent's worker ended at SIGTERM: the child released it"

_SIGNAL_SCRIPT = """
import os, signal, sys, threading, time, torch, deltackpt
root, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
g, d = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
go, do = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)

def train(model, opt):
    loss = model(torch.randn(2, 8)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()

if mode in ("fifo", "thread-close"):  # every checkpointer closed: SIGTERM's default action is back
    a = deltackpt.Checkpointer(root + "/a", model=g)
    if mode == "fifo":
        b = deltackpt.Checkpointer(root + "/b", model=d)
        a.close(); b.close()  # in the order they were made
    else:
        t = threading.Thread(target=a.close); t.start(); t.join()
    signal.raise_signal(signal.SIGTERM)
    time.sleep(5)
    print("still running")
elif mode in ("thread-loop", "thread-loop-int"):  # the loop runs on another thread; the main thread joins it
    ck = deltackpt.Checkpointer(root + "/a", model=g, optimizer=go, every_n_steps=1000)
    def loop():
        try:
            for step in range(1, 100000):
                train(g, go)
                if step == 3:
                    os.kill(os.getpid(), signal.SIGINT if mode == "thread-loop-int" else signal.SIGTERM)
                ck.step(step)
                print("completed step", step, flush=True)
                time.sleep(0.001)
            print("loop finished")
        finally:
            ck.close()
    t = threading.Thread(target=loop); t.start(); t.join()
    print("still running")
elif mode == "fork":  # a forked child inherits the handler; nothing there saves, so SIGTERM ends it at once
    import multiprocessing
    ck = deltackpt.Checkpointer(root + "/a", model=g)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    child.start()
    time.sleep(0.3)
    child.terminate()
    child.join(20)
    print("child exit", child.exitcode, flush=True)
    ck.close()
    signal.raise_signal(signal.SIGTERM)
    time.sleep(5)
    print("still running")
elif mode in ("int-then-term", "ignored-int-twice", "int-int"):
    if mode == "int-then-term":  # the run's own Ctrl-C handler returns: SIGTERM still ends the run
        signal.signal(signal.SIGINT, lambda signum, frame: print("own SIGINT handler", flush=True))
    if mode == "ignored-int-twice":  # Ctrl-C ignored before (a background job): two of them interrupt nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deltackpt.Checkpointer(root + "/a", model=g, optimizer=go, every_n_steps=1000) as ck:
            for step in range(1, 6):
                train(g, go)
                if step == 3:
                    signal.raise_signal(signal.SIGINT)
                    signal.raise_signal(signal.SIGTERM if mode == "int-then-term" else signal.SIGINT)
                ck.step(step)
        print("loop finished")
        sys.exit(143)  # (the status the test expects)
    except KeyboardInterrupt:  # int-int: the second Ctrl-C, raised as such (it became SystemExit(130))
        print("KeyboardInterrupt", flush=True)
        sys.exit(143)
else:  # two checkpointers in one loop, the signal before both steps or between them
    cg = deltackpt.Checkpointer(root + "/g", model=g, optimizer=go, every_n_steps=1000)
    cd = deltackpt.Checkpointer(root + "/d", model=d, optimizer=do, every_n_steps=1000)
    for step in range(1, 10):
        train(g, go); train(d, do)
        if step == 3 and mode == "before":
            signal.raise_signal(signal.SIGTERM)
        cg.step(step)
        if step == 3 and mode == "between":
            signal.raise_signal(signal.SIGTERM)
        cd.step(step)
        print("completed step", step, flush=True)
"""


@pytest.mark.parametrize("mode", ["fifo", "thread-close", "thread-loop", "thread-loop-int", "before", "between", "fork",
                                  "int-then-term", "ignored-int-twice", "int-int"])
@pytest.mark.plumbing
def test_sigterm_ends_the_process_whatever_the_checkpointers_layout(fast_dir: Path, mode: str) -> None:
    """SIGTERM is not lost and ends the process with status 143 (or by the signal) in every arrangement:
    - checkpointers closed in the order they were made, or closed off the main thread: the closed one's handler
      stayed installed and swallowed every SIGTERM;
    - a loop on another thread: the save happened, then SystemExit ended only that thread and every later
      SIGTERM was ignored;
    - two checkpointers stepped in one loop end at the same step (they saved steps 4 and 3, one training step
      apart), whether the signal comes before both steps or between them;
    - a forked child (a Pool's worker) inherited the handler, so terminate() only flagged a save nobody makes;
    - SIGINT, then SIGTERM: both are passed on after the save (SIGTERM was lost once the run's own SIGINT
      handler returned); a Ctrl-C ignored before interrupts nothing, twice either; two Ctrl-Cs raise
      KeyboardInterrupt through close() (it became SystemExit(130))."""
    done = subprocess.run([sys.executable, "-c", _SIGNAL_SCRIPT, str(fast_dir), mode], capture_output=True,
                          text=True, timeout=120, env=worker_env())
    ends = (-signal.SIGINT,) if mode == "thread-loop-int" else (143, -signal.SIGTERM)
    assert done.returncode in ends, done.stdout + done.stderr
    assert "still running" not in done.stdout
    assert ("loop finished" in done.stdout) == (mode == "ignored-int-twice")
    if mode == "fork":
        assert f"child exit {-signal.SIGTERM}" in done.stdout  # (it slept on: SIGTERM only flagged a save)
    if mode in ("int-then-term", "ignored-int-twice"):
        with Store(fast_dir / "a") as s:
            assert [i.step for i in s.list()] == [3]  # saved at the signals, once
    if mode == "int-then-term":
        assert "own SIGINT handler" in done.stdout  # both signals passed on, in order (SIGTERM was lost)
    if mode == "int-int":
        assert "KeyboardInterrupt" in done.stdout
    if mode.startswith("thread-loop"):  # saved at the step boundary, and no step trained after it (a Ctrl-C
        # ended only the main thread once, with Python's KeyboardInterrupt, and the loop trained on; the step()
        # that saved returned, and the loop trained on until the main thread's handler ran)
        with Store(fast_dir / "a") as s:
            saved = s.latest().step
            assert len(s.list()) == 1 and saved >= 3
        assert done.stdout.split("\n")[-2] == f"completed step {saved - 1}", done.stdout
    if mode in ("before", "between"):
        with Store(fast_dir / "g") as sg, Store(fast_dir / "d") as sd:
            g_steps, d_steps = [i.step for i in sg.list()], [i.step for i in sd.list()]
        # between: d saved step 3 as the signal came, g then step 4, and d caught up with it
        assert (g_steps, d_steps) == (([3], [3]) if mode == "before" else ([4], [3, 4]))
        assert done.stdout.split("\n")[-2] == f"completed step {g_steps[-1] - 1}"  # no step after the save


def test_a_resumed_run_writes_again_the_damaged_inputs_of_a_skipped_checkpoint(fast_dir: Path) -> None:
    """Retention deleted step 4, whose chunks stay in the store as the delta bases and prediction inputs of step
    5; those frames are damaged, so restore() passes over steps 6 and 5 and resumes from step 3. The rerun of
    step 4 saves the same bytes: every damaged frame step 5 reaches is found (verify stopped each group of
    predicted chunks at its first damaged input, leaving the others unread), and the new step 4 loads."""

    def model_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        x = torch.randn(8, 48, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()

    def keys(store: Store, **which: Any) -> set[bytes]:
        return {k for _, k in _stored(store.manifest(**which))}

    # step 3 kept by its tag (a step that keep_every kept would be saved as a keyframe; step 6 then too)
    policy = Retention(keep_last=2)
    model, opt = model_opt()
    states: dict[int, dict[str, torch.Tensor]] = {}
    with Store(fast_dir / "store", chunk_size=4096) as store, \
            Checkpointer(store, model=model, optimizer=opt, async_save=False, handle_signals=False,
                         retention=policy) as ckpt:
        for step in range(1, 7):
            train(model, opt, step)
            ckpt.step(step, metadata={"tag": "milestone"} if step == 3 else None)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
            if step == 4:
                only4 = keys(store, step=4)
        assert [i.step for i in store.list()] == [3, 5, 6]
        live = keys(store, step=3) | keys(store, step=5) | keys(store, step=6)
        five = store.index.lookup_chunks(keys(store, step=5))
        inputs = {r for k, loc in five.items() for r in store._references(k, loc)} & (only4 - live)
        assert len(inputs) > 4
        damaged = store.index.lookup_chunks(inputs)
    _damage_frames(fast_dir / "store", damaged.values())
    fresh, fresh_opt = model_opt()
    with Store(fast_dir / "store", chunk_size=4096) as store, \
            Checkpointer(store, model=fresh, optimizer=fresh_opt, async_save=False, handle_signals=False,
                         retention=policy) as ckpt:
        with pytest.warns(RuntimeWarning, match="is damaged"):
            assert ckpt.restore() == 3
        for step in (4, 5, 6):
            train(fresh, fresh_opt, step)
            ckpt.step(step)
            assert_bitwise(states[step], fresh.state_dict())
            assert_bitwise(states[step], store.load(id=ckpt.last_info.id)["model"])
        assert store.verify().ok


def test_close_gives_back_the_async_staging_copy(fast_dir: Path) -> None:
    """The staging buffers of async saves are a copy of the whole state; close() drops them (they stayed until the
    checkpointer object itself was freed: 528 MB of a 512 MB model)."""
    model, opt = _small()
    ckpt = Checkpointer(fast_dir / "store", model=model, optimizer=opt, async_save=True, handle_signals=False)
    _train_step(model, opt)
    ckpt.step(1)
    ckpt.wait()
    held = ckpt._staging.nbytes
    assert held >= sum(p.numel() * p.element_size() for p in model.parameters())
    ckpt.close()
    assert ckpt._staging.nbytes == 0
    with Store(fast_dir / "store") as s:
        assert [i.step for i in s.list()] == [1]


def _pack_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "packs").iterdir())


@pytest.mark.parametrize("async_save", [False, True])
def test_retention_gives_the_space_back_without_a_separate_gc(fast_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                             async_save: bool) -> None:
    """With retention, the checkpointer runs gc once what retention deleted is worth it: the packs stay at a few
    kept checkpoints' size, and a gc afterwards finds (almost) nothing. With gc=False they grow with every save
    (2.0 GB after 1000 every-step saves of a 4.6 MB state with keep_last=5) until someone runs gc."""
    monkeypatch.setenv("DELTACKPT_GC_MIN_BYTES", str(1 << 20))
    sizes, freed = {}, {}
    for gc_on in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 512)  # 1 MiB of weights, 3 MiB of AdamW state: every save writes > 1 MiB
        opt = torch.optim.AdamW(model.parameters())
        path = fast_dir / f"store-{gc_on}"
        with Checkpointer(path, model=model, optimizer=opt, async_save=async_save, handle_signals=False,
                          retention=Retention(keep_last=2), gc=gc_on) as ckpt:
            for step in range(1, 41):
                opt.zero_grad()
                model(torch.randn(4, 512)).square().sum().backward()
                opt.step()
                ckpt.step(step)
        sizes[gc_on] = _pack_bytes(path)
        with Store(path) as s:
            assert [i.step for i in s.list()] == [39, 40]
            report = s.gc()
            assert s.verify().ok
        freed[gc_on] = report.freed_bytes
    # gc=True: what the last saves' retention dropped (under the threshold) is all a gc afterwards frees
    assert freed[True] <= 4 << 20 and freed[False] > 5 * max(freed[True], 1 << 20), freed
    assert sizes[True] * 3 < sizes[False], sizes


def test_retention_gives_the_space_back_across_restarts(fast_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job restarted every 2 saves, each process dropping less than the gc threshold: the store counts what
    was dropped since its last gc, so the checkpointers of later processes run the gc. Each counted from zero
    before, no gc ever ran, and the packs grew by a state per save (1.7 GB after 800 saves of a 4.6 MB state
    restarted every 20 steps)."""
    monkeypatch.setenv("DELTACKPT_GC_MIN_BYTES", str(5 << 20))
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights, 3 MiB of AdamW state: every save writes > 1 MiB
    opt = torch.optim.AdamW(model.parameters())
    path = fast_dir / "store"
    step, written = 0, 0
    for _ in range(8):
        with Checkpointer(path, model=model, optimizer=opt, async_save=False, handle_signals=False,
                          retention=Retention(keep_last=1)) as ckpt:
            for _ in range(2):
                step += 1
                opt.zero_grad()
                model(torch.randn(4, 512)).square().sum().backward()
                opt.step()
                ckpt.step(step)
                written += ckpt.last_info.written_bytes
    assert written > 12 * (1 << 20)
    with Store(path) as s:
        assert [i.step for i in s.list()] == [16]
        # no more than the threshold and what the last saves wrote is left to collect
        assert s.gc().freed_bytes < (5 << 20) + 2 * ckpt.last_info.written_bytes
    assert _pack_bytes(path) < written / 2


def test_no_gc_after_retention_when_nothing_was_dropped(fast_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With DELTACKPT_GC_MIN_BYTES=0 and saves of an unchanged model (0 bytes written, so nothing kept or
    dropped weighs anything), gc ran at every save: 0 >= max(0, 0 // 4). It runs only once something was
    dropped."""
    monkeypatch.setenv("DELTACKPT_GC_MIN_BYTES", "0")
    runs = []
    real_gc = Store.gc

    def counted(self: Store, **kw: Any) -> Any:
        runs.append(self.index.dropped_bytes())
        return real_gc(self, **kw)

    monkeypatch.setattr(Store, "gc", counted)
    model, _ = _small()
    with Checkpointer(fast_dir / "store", model=model, async_save=False, handle_signals=False,
                      retention=Retention(keep_last=1)) as ckpt:
        for step in range(1, 8):
            ckpt.step(step)
    assert len(runs) <= 1 and all(runs), runs


def test_the_store_counts_what_deletes_and_rewrites_drop_until_gc(fast_dir: Path) -> None:
    """``Index.dropped_bytes``: a delete adds the deleted checkpoint's written bytes, in the transaction that
    deletes it; a rewrite (thinning) the replaced one's; gc zeroes it; a damaged value counts as 0 and the next
    delete writes it again."""
    with Store(fast_dir / "store") as s:
        infos = [s.save({"w": torch.randn(4096) * i}, step=i) for i in range(1, 5)]
        assert s.index.dropped_bytes() == 0
        s.delete(step=1)
        assert s.index.dropped_bytes() == infos[0].written_bytes
        s.rewrite({"w": torch.zeros(4)}, id=infos[1].id)
        assert s.index.dropped_bytes() == infos[0].written_bytes + infos[1].written_bytes
        s.gc()
        assert s.index.dropped_bytes() == 0
        with s.index.env.begin(write=True) as txn:
            txn.put(b"dropped", b"\xff" * 8, db=s.index.db_meta)
        assert s.index.dropped_bytes() == 0
        s.delete(step=3)
        assert s.index.dropped_bytes() == infos[2].written_bytes


def test_gc_after_retention_waits_for_no_gc_of_another_process(fast_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """While another gc holds the store (maint.lock), the checkpointer's gc gives up after a moment, quietly, and
    runs at a later save."""
    import fcntl

    monkeypatch.setenv("DELTACKPT_GC_MIN_BYTES", "0")
    monkeypatch.setattr(deltackpt.maintenance, "GC_WAIT", 0.1)
    model, opt = _small()
    path = fast_dir / "store"
    with Checkpointer(path, model=model, optimizer=opt, async_save=False, handle_signals=False,
                      retention=Retention(keep_last=1)) as ckpt:
        for step in (1, 2):
            _train_step(model, opt)
            ckpt.step(step)
        entries = len(list(ckpt.store.index.iter_chunks()))
        fd = os.open(path / "maint.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _train_step(model, opt)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ckpt.step(3)  # deletes step 2; its gc gives up
            assert len(list(ckpt.store.index.iter_chunks())) > entries  # step 2's chunks are still there
        finally:
            os.close(fd)
        _train_step(model, opt)
        ckpt.step(4)  # deletes step 3; its gc frees what steps 2 and 3 alone held
    with Store(path) as s:
        assert [i.step for i in s.list()] == [4]
        assert s.gc().dead_chunks == 0


def test_the_save_at_a_signal_runs_no_gc(fast_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save at SIGTERM applies retention but leaves gc for later: the process is about to end, and a repack
    could outlast the grace period before SIGKILL."""
    monkeypatch.setenv("DELTACKPT_GC_MIN_BYTES", "0")
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: received.append(sig))
    try:
        model, opt = _small()
        path = fast_dir / "store"
        with Checkpointer(path, model=model, optimizer=opt, async_save=False, retention=Retention(keep_last=1)) as ckpt:
            for step in (1, 2):  # (keyframes: each writes as much as the stop save, past gc's threshold)
                _train_step(model, opt)
                ckpt.save(step, keyframe=True)
            with Store(path) as s:
                assert s.gc().dead_chunks == 0  # the gc after step 2's retention ran
            _train_step(model, opt)
            os.kill(os.getpid(), signal.SIGTERM)
            assert ckpt.step(3)  # the stop save, then the signal goes on to the handler before
        assert received == [signal.SIGTERM]
        with Store(path) as s:
            assert [i.step for i in s.list()] == [3]
            assert s.gc().dead_chunks > 0  # step 2's chunks: deleted by retention at step 3, not collected
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_enabled_scaler_refuses_a_disabled_ones_state_before_the_model_changes(fast_dir: Path) -> None:
    """A run that turned mixed precision on since its checkpoint: torch's enabled GradScaler refuses the empty state
    a disabled one saved, but only after the restore had decoded the checkpoint into the model. It is now refused
    first; with the same kind of scaler on both sides the scale comes back."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with Checkpointer(fast_dir / "off", model=model, optimizer=opt, handle_signals=False,
                      scaler=torch.amp.GradScaler("cpu", enabled=False)) as ck:
        ck.step(1)
    fresh = torch.nn.Linear(4, 4)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with Checkpointer(fast_dir / "off", model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()),
                      handle_signals=False, scaler=torch.amp.GradScaler("cpu")) as ck:
        with pytest.raises(deltackpt.DeltackptError, match="scaler.*disabled"):
            ck.restore()
    assert_bitwise(before, fresh.state_dict())

    with Checkpointer(fast_dir / "on", model=model, optimizer=opt, handle_signals=False,
                      scaler=torch.amp.GradScaler("cpu", init_scale=512.0)) as ck:
        ck.step(1)
    scaler = torch.amp.GradScaler("cpu")
    with Checkpointer(fast_dir / "on", model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()),
                      handle_signals=False, scaler=scaler) as ck:
        assert ck.restore() == 1
    assert scaler.get_scale() == 512.0
    assert_bitwise(model.state_dict(), fresh.state_dict())


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_restore_puts_back_python_numpy_and_torch_rngs(tmp_path: Path) -> None:
    """restore() puts back every RNG a training loop draws from: Python's, NumPy's global one and torch's (the
    SIGKILL resume test's loop draws from torch's only)."""
    model = torch.nn.Linear(4, 2)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with Checkpointer(tmp_path / "store", model=model, async_save=False, handle_signals=False) as ckpt:
        ckpt.save(1)
        expected = _draws()
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    with Checkpointer(tmp_path / "store", model=torch.nn.Linear(4, 2), handle_signals=False) as ckpt:
        assert ckpt.restore() == 1
        got = _draws()
    assert got[0] == expected[0], "python RNG not restored"
    assert got[1] == expected[1], "numpy RNG not restored"
    assert got[2] == expected[2], "torch RNG not restored"


def test_pythons_rng_state_is_an_array_and_a_tuple_of_ints_still_restores(tmp_path: Path) -> None:
    """Python's generator state (625 words) was a tuple of ints in the manifest, about 11 KB of every save's
    manifest, written whole; it is a uint32 array now, chunked and deduplicated while the generator is not drawn
    from. Checkpoints holding the tuple restore as before."""
    model = torch.nn.Linear(4, 2)
    random.seed(5)
    store = tmp_path / "store"
    with Checkpointer(store, model=model, async_save=False, handle_signals=False) as ckpt:
        ckpt.save(1)
        ckpt.save(2)  # (Python's generator not drawn from in between)
        state = ckpt.capture(3)
    expected = random.random()
    py = state["rng"]["python"]
    assert isinstance(py[1], np.ndarray) and py[1].dtype == np.uint32 and py[1].shape == (625,)
    with deltackpt.Store(store) as s:
        manifests = {i.step: (store / "manifests" / f"{i.id}.manifest").stat().st_size for i in s.list()}
        assert s.info(2).written_bytes == 0  # nothing changed: not even the generator's words
        old = dict(state, rng=dict(state["rng"], python=(py[0], tuple(int(w) for w in py[1]), py[2])))
        s.save(old, step=3)  # a checkpoint of an earlier version's layout
        manifests[3] = (store / "manifests" / f"{s.info(3).id}.manifest").stat().st_size
    assert manifests[3] - manifests[2] > 8000, manifests  # the tuple's cost, which arrays no longer pay
    random.seed(99)
    with Checkpointer(store, model=torch.nn.Linear(4, 2), async_save=False, handle_signals=False) as ckpt:
        assert ckpt.restore(3) == 3
        assert random.random() == expected
        assert ckpt.restore(2) == 2
        assert random.random() == expected


class _Versioned(torch.nn.Module):
    """A module whose state layout changed in version 2, migrating older states as torch documents it: version 1
    stored ``log_scale``, version 2 stores ``scale`` (a state of no version is taken for version 1)."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(3.0))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: dict[str, Any], *args: Any) -> None:
        if (local_metadata.get("version") or 1) < 2:
            state_dict[prefix + "scale"] = state_dict[prefix + "scale"].exp()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


@pytest.mark.parametrize("async_save", [False, True])
def test_restore_hands_load_state_dict_the_module_versions_that_torch_save_keeps(fast_dir: Path,
                                                                                 async_save: bool) -> None:
    """A module ``state_dict()`` carries each module's version (its ``_metadata``), which ``load_state_dict``
    hands to the modules' migrations; ``torch.save`` keeps it. Without it a current state is taken for a legacy
    one and migrated: a quantization observer's ``eps`` becomes float32's, a versioned module's value is
    converted again. A restore gives the same values as ``torch.load``, sync or async."""
    from torch.ao.quantization import MinMaxObserver

    def build() -> torch.nn.Module:
        model = torch.nn.Module()
        model.obs = MinMaxObserver(eps=1e-3)
        model.v = _Versioned()
        return model

    model = build()
    with deltackpt.Checkpointer(fast_dir / "s", model=model, async_save=async_save, handle_signals=False) as ck:
        ck.save(1)
    torch.save(model.state_dict(), fast_dir / "ref.pt")
    expected = build()
    expected.load_state_dict(torch.load(fast_dir / "ref.pt", weights_only=True))
    assert expected.obs.eps.item() == pytest.approx(1e-3) and expected.v.scale.item() == 3.0

    restored = build()
    with torch.no_grad():
        restored.obs.eps.fill_(0.5)
        restored.v.scale.fill_(0.0)
    with deltackpt.Checkpointer(fast_dir / "s", model=restored, handle_signals=False) as ck:
        assert ck.restore() == 1
    assert torch.equal(restored.obs.eps, expected.obs.eps)
    assert torch.equal(restored.v.scale, expected.v.scale)
    with Store(fast_dir / "s") as s:
        assert s.load()["model"]._metadata == model.state_dict()._metadata


def test_restore_of_a_checkpoint_without_module_versions_takes_this_runs(fast_dir: Path) -> None:
    """A checkpoint whose model state has no module versions (as stores wrote before they kept them: here the
    model's ``state_dict()`` without its ``_metadata``) restores with the versions of the modules it is restored
    into, not as a legacy state."""
    model = _Versioned()
    full = model.state_dict
    model.state_dict = lambda *a, **k: collections.OrderedDict(full(*a, **k))  # type: ignore[method-assign]
    with deltackpt.Checkpointer(fast_dir / "s", model=model, async_save=False, handle_signals=False) as ck:
        ck.save(1)
    with Store(fast_dir / "s") as s:
        assert not hasattr(s.load()["model"], "_metadata")
    restored = _Versioned()
    with torch.no_grad():
        restored.scale.fill_(0.0)
    with deltackpt.Checkpointer(fast_dir / "s", model=restored, handle_signals=False) as ck:
        assert ck.restore() == 1
    assert restored.scale.item() == 3.0  # (not exp(3): migrated as a version-1 state)


def test_restore_writes_into_extra_tensors_made_in_inference_mode(fast_dir: Path) -> None:
    """An ``extra`` tensor made under ``torch.inference_mode()`` (an EMA of the weights, say) can be written only
    in inference mode: the restore puts the checkpoint's values into it (it raised torch's error once the model
    was restored)."""
    model = torch.nn.Linear(2, 2)
    with torch.inference_mode():
        ema = {k: v.clone() * 3 for k, v in model.state_dict().items()}
    with Checkpointer(fast_dir / "s", model=model, extra={"ema": ema}, async_save=False, handle_signals=False) as ck:
        ck.save(1)
    with torch.inference_mode():
        held = {k: torch.zeros_like(v) for k, v in ema.items()}
    with Checkpointer(fast_dir / "s", model=torch.nn.Linear(2, 2), extra={"ema": held}, handle_signals=False) as ck:
        assert ck.restore() == 1
        assert ck.extra["ema"] is held
    assert all(torch.equal(held[k], ema[k]) and held[k].is_inference() for k in ema)


def test_restore_replaces_an_extra_tensor_no_copy_can_fill(fast_dir: Path) -> None:
    """An ``extra`` tensor whose elements share memory (an ``expand``ed view) cannot be copied into: the restore
    replaces it with the checkpoint's, as it replaces values it cannot write into (it raised torch's
    overlapping-memory error once the model held the checkpoint's weights)."""
    model = torch.nn.Linear(2, 2)
    saved = {"bias": torch.arange(3.0).expand(2, 3).clone(), "scale": torch.tensor([1.0, 2.0])}
    with Checkpointer(fast_dir / "s", model=model, extra={"t": saved}, async_save=False, handle_signals=False) as ck:
        ck.save(1)
    held = {"bias": torch.zeros(3).expand(2, 3), "scale": torch.zeros(2)}
    scale = held["scale"]
    with Checkpointer(fast_dir / "s", model=torch.nn.Linear(2, 2), extra={"t": held}, handle_signals=False) as ck:
        assert ck.restore() == 1
    assert held["scale"] is scale and torch.equal(scale, saved["scale"])  # (written in place, as before)
    assert torch.equal(held["bias"], saved["bias"])  # (replaced)


@pytest.mark.parametrize("wrapper", ["compile", "data_parallel"])
@pytest.mark.parametrize("saved_wrapped", [True, False])
@pytest.mark.parametrize("part", ["model", "submodule"])
def test_a_restore_refused_for_a_wrappers_key_prefix_says_so(fast_dir: Path, wrapper: str, saved_wrapped: bool,
                                                              part: str) -> None:
    """A model saved wrapped (torch.compile: ``_orig_mod.`` keys; DataParallel and DDP: ``module.``) and
    restored unwrapped, or the other way round, is refused before anything changes, naming the prefix; so is a
    model one of whose submodules was wrapped in one run only (``1._orig_mod.weight``), naming the submodule."""
    def build(wrapped: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        if not wrapped:
            return model
        if part == "submodule":
            model[1] = torch.compile(model[1]) if wrapper == "compile" else torch.nn.DataParallel(model[1])
            return model
        return torch.compile(model) if wrapper == "compile" else torch.nn.DataParallel(model)

    with Checkpointer(fast_dir / "s", model=build(saved_wrapped), async_save=False, handle_signals=False) as ck:
        ck.save(1)
    prefix = "_orig_mod." if wrapper == "compile" else "module."
    whose = "the checkpoint's" if saved_wrapped else "this run's"
    other = build(not saved_wrapped)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    saving = "the run that saved" if saved_wrapped else "this run"
    said = (f"{whose} keys all start with '{prefix}'" if part == "model"
            else f"{whose} keys hold '{prefix}' under '1': .* wrapped that submodule in {saving} only")
    with Checkpointer(fast_dir / "s", model=other, handle_signals=False) as ck:
        with pytest.raises(deltackpt.ShapeMismatchError, match=said):
            ck.restore()
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_the_wrapper_hint_is_given_only_where_it_explains_the_keys() -> None:
    """Keys that would match once a wrapper's part is removed, where that part is not a wrapper's (a submodule
    named ``module`` at the top of one run's model) or the keys differ otherwise, get no hint (and no error)."""
    from deltackpt.fitcheck import wrapper_hint

    assert wrapper_hint(["weight", "head.weight"], ["module.weight", "head.weight"]) == ""
    assert wrapper_hint(["a.weight"], ["a.module.weight", "extra"]) == ""
    assert "under 'a'" in wrapper_hint(["a.weight", "h.w"], ["a.module.weight", "h.w"])
    assert wrapper_hint(["_orig_mod.w", "_orig_mod.x"], ["module.w", "module.y"]) == ""
    assert wrapper_hint(["a.w", "b.x"], ["a._orig_mod.w", "b.module.x"]) == ""  # (a submodule may be "module")


@pytest.mark.parametrize("saved,restored", [("ddp", "compile"), ("compile", "ddp"), ("ddp+compile", "none"),
                                            ("none", "ddp+compile")])
def test_a_restore_refused_for_another_wrappers_keys_names_both(fast_dir: Path, saved: str, restored: str) -> None:
    """A model saved under one wrapper (DistributedDataParallel's ``module.``, here DataParallel's) and restored
    under another (torch.compile's ``_orig_mod.``), or wrapped twice in one run only, got no hint: the missing
    and extra keys were listed with nothing saying why. The refusal now names each run's prefix."""
    def build(how: str) -> torch.nn.Module:
        torch.manual_seed(0)
        model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        if "compile" in how:
            model = torch.compile(model)
        return torch.nn.DataParallel(model) if "ddp" in how else model

    with Checkpointer(fast_dir / "s", model=build(saved), async_save=False, handle_signals=False) as ck:
        ck.save(1)
    prefix = {"ddp": "module.", "compile": "_orig_mod.", "ddp+compile": "module._orig_mod."}
    said = {"none": "start with no wrapper's part", **{k: f"all start with '{v}'" for k, v in prefix.items()}}
    other = build(restored)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    match = f"the checkpoint's keys {re.escape(said[saved])}.*this run's {re.escape(said[restored])}"
    with Checkpointer(fast_dir / "s", model=other, handle_signals=False) as ck:
        with pytest.raises(deltackpt.ShapeMismatchError, match=match + ".*unwrapped in both"):
            ck.restore()
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_a_restore_into_a_model_of_other_dtypes_warns(fast_dir: Path) -> None:
    """load_state_dict converts a checkpoint's tensors to the model's dtypes: a run resumed into a model built
    in another precision would not compute as the one that saved, so the restore says which tensors differ."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    with Checkpointer(fast_dir / "s", model=model, async_save=False, handle_signals=False) as ck:
        ck.save(1)
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2).to(torch.bfloat16))
    with Checkpointer(fast_dir / "s", model=other, handle_signals=False) as ck:
        with pytest.warns(RuntimeWarning, match=r"model: '1.weight' is float32 in the checkpoint, bfloat16 in this "
                                                r"run \(and 1 more\)") as caught:
            assert ck.restore() == 1
    assert [w.filename for w in caught if "float32" in str(w.message)] == [__file__]
    assert torch.equal(other[1].weight, model[1].weight.to(torch.bfloat16))
    with Checkpointer(fast_dir / "s", model=model, handle_signals=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ck.restore() == 1
    hooked = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.utils.spectral_norm(torch.nn.Linear(2, 2)))
    with Checkpointer(fast_dir / "h", model=hooked, handle_signals=False) as ck:
        ck.save(1, wait=True)
    hooked.to(torch.float64)  # (a module with load hooks: its keys and shapes are left to its loading code)
    with Checkpointer(fast_dir / "h", model=hooked, handle_signals=False) as ck:
        with pytest.warns(RuntimeWarning, match=r"'0.weight' is float32 in the checkpoint, float64 in this run \(and"):
            assert ck.restore() == 1


def test_step_on_a_closed_checkpointer_raises_at_every_step(fast_dir: Path) -> None:
    """step() raised 'the checkpointer is closed' at a step it would save at, and returned False at the others,
    so a loop stepping a closed checkpointer learned of it only at its next save."""
    ckpt = Checkpointer(fast_dir / "store", model=torch.nn.Linear(4, 2), every_n_steps=10, async_save=False)
    ckpt.step(10)
    ckpt.close()
    ckpt.close()  # (twice is harmless)
    for step in (11, 20):
        with pytest.raises(deltackpt.DeltackptError, match="the checkpointer is closed"):
            ckpt.step(step)
    with Store(fast_dir / "store") as store:
        assert [i.step for i in store.list()] == [10]


def test_restore_on_a_closed_checkpointer_raises_that_it_is_closed(fast_dir: Path) -> None:
    """restore() after close() raised the store's 'the index of ... is closed' (a store the checkpointer owned), or,
    given an open Store, restored into the model and the RNG states of a closed checkpointer without a word."""
    m = torch.nn.Linear(2, 2)
    ck = deltackpt.Checkpointer(fast_dir / "owned", model=m, async_save=False, handle_signals=False)
    ck.step(1)
    ck.close()
    with pytest.raises(deltackpt.DeltackptError, match="the checkpointer is closed"):
        ck.restore()
    store = deltackpt.Store(fast_dir / "owned")
    ck = deltackpt.Checkpointer(store, model=m, async_save=False, handle_signals=False)
    ck.close()
    with torch.no_grad():
        m.weight.zero_()
    with pytest.raises(deltackpt.DeltackptError, match="the checkpointer is closed"):
        ck.restore(step=1)
    assert not m.weight.any()
    store.close()


@pytest.mark.parametrize("edit", ["python version", "numpy name", "numpy position", "step"])
def test_a_checkpoint_whose_rng_states_or_step_the_generators_refuse_is_a_typed_error(tmp_path: Path,
                                                                                     edit: str) -> None:
    """A checkpoint (a store received from elsewhere, a buggy writer) whose RNG states Python's or NumPy's
    generator refuses: restore raised their bare ValueError or OverflowError, naming nothing, with Python's
    generator set and NumPy's not; a 'step' entry of 10^50 was restored as the step. Now a DeltackptError names
    the part, none of the process's generators is touched, and a step out of range is refused before anything is
    put back."""
    model = torch.nn.Linear(4, 2)
    with Checkpointer(tmp_path / "c", model=model, async_save=False, handle_signals=False) as c:
        c.step(1)
    with Store(tmp_path / "c") as s:
        state = s.load()
        rng, state["step"] = state["rng"], 2  # (saved as step 2: restore() refuses a 'step' entry of another step)
        if edit == "python version":
            rng["python"] = (99, *rng["python"][1:])
        elif edit == "numpy name":
            rng["numpy"] = ("PCG64", *rng["numpy"][1:])
        elif edit == "numpy position":
            rng["numpy"] = (*rng["numpy"][:2], 10**12, *rng["numpy"][3:])
        else:
            state["step"] = 10**50
        s.save(state, step=2)
    random.seed(7)
    np.random.seed(7)
    before = (random.getstate(), np.random.get_state()[1].copy())
    with Checkpointer(tmp_path / "c", model=model, async_save=False, handle_signals=False) as c:
        with pytest.raises(deltackpt.DeltackptError, match="rng: restoring it raised" if edit != "step" else
                           "'step' entry is not a step"):
            c.restore()
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])


def _takes(obj: Any) -> None:
    raise AssertionError("never reached: the argument cannot be sent")


@pytest.mark.parametrize("what", ["Store", "Checkpointer"])
def test_a_store_or_checkpointer_sent_to_a_spawned_process_is_refused_naming_what_to_do(
        fast_dir: Path, what: str) -> None:
    """A Store or Checkpointer given to a process of the spawn method (or a Pool's task, or deep-copied) is
    pickled: that was refused with "cannot pickle '_thread.lock' object", which names neither the object nor
    what to do instead (open the store by its path in that process)."""
    import copy
    import multiprocessing
    import pickle
    with Store(fast_dir / "store") as st, Checkpointer(st, model=torch.nn.Linear(2, 2), handle_signals=False) as ck:
        obj: Any = st if what == "Store" else ck
        hint = rf"a {what} cannot be pickled .*{re.escape(str(st.path))}"
        with pytest.raises(TypeError, match=hint):
            pickle.dumps(obj)
        with pytest.raises(TypeError, match=hint):
            copy.deepcopy(obj)
        proc = multiprocessing.get_context("spawn").Process(target=_takes, args=(obj,))
        with pytest.raises(TypeError, match=hint):
            proc.start()  # (refused as the arguments are pickled, before a process starts)
