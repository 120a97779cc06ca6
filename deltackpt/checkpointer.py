"""Training-loop integration: capture, interval and signal-triggered saves, async saves, exact resume, retention.

Where it sits: between a training loop and a :class:`~deltackpt.Store`. ``step(n)`` decides whether a save is
due; a save captures the whole training state (model, optimizers, schedulers, AMP scaler, data position, RNG
states, user objects), copies its tensors into reusable staging buffers, and hands that snapshot to a
background thread that runs ``Store.save`` and then the retention policy. ``restore()`` loads a checkpoint and
puts every piece back, so a resumed run continues as if it had never stopped.

Beside it: :mod:`deltackpt.components` (what the components are and how they are put back),
:mod:`deltackpt.fitcheck` (whether a checkpoint fits them, before a restore changes anything),
:mod:`deltackpt.rng` (the RNG states), :class:`deltackpt.staging.StagingBuffers` (an async save's snapshot) and
:mod:`deltackpt.workers` (DataLoader workers through a stop signal). This module keeps the loop's side: when to
save, the background save, signals, retention after a save, and the order of a restore.

Typical use::

    ckpt = deltackpt.Checkpointer("ckpts", model=model, optimizer=opt, scheduler=sched, data=loader,
                                  every_n_steps=10, retention=deltackpt.Retention(keep_last=5))
    start = ckpt.restore()
    for step in range(start, total_steps):
        train_one_step()
        ckpt.step(step + 1)        # step + 1 = number of completed steps
    ckpt.close()
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from deltackpt import _lazy, config, maintenance, manifest, ranks, staging, tree
from deltackpt.components import (
    Members,
    Stateful,
    as_group,
    group_members,
    group_state,
    load_group,
    param_layouts,
    param_pairs,
    plain_extras,
    present_members,
    put_back,
    stateful,
    tensors_of,
)
from deltackpt.errors import (
    CheckpointNotFoundError,
    CorruptionError,
    DeltackptError,
    ShapeMismatchError,
    UnsupportedTypeError,
    caller_level,
)
from deltackpt.fitcheck import (
    extra_check,
    fit_check,
    group_check,
    one_scaler_check,
    one_scheduler_check,
    scaler_check,
    scheduler_check,
)
from deltackpt.maintenance import GcAfterRetention
from deltackpt.retention import THINNED_KEY, Retention, is_thinned, unranked_metric
from deltackpt.rng import has_rng, rng_state, set_rng_state
from deltackpt.staging import StagingBuffers
from deltackpt.store import (
    CheckpointInfo,
    Store,
    check_metadata,
    check_step,
)
from deltackpt.tree import decode_plain, encode_plain, flatten
from deltackpt.workers import STOP_SIGNALS, WorkersIgnoreStopSignals, dataloader_worker

if TYPE_CHECKING:
    import torch
else:
    torch = _lazy.module("torch", globals())


#: checkpointers a signal flagged that have not saved yet, and the step each that did saved at (see "signals")
_stopping: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_stopped: weakref.WeakKeyDictionary[Checkpointer, int] = weakref.WeakKeyDictionary()
#: the signals that arrived since the checkpointers flagged began to save, in order: all are passed on
_delivered: list[int] = []
#: (signal, handler) a checkpointer stepped off the main thread hands to the main thread to pass the signal on
_forward: list[tuple[int, Any]] = []


def _end_round() -> None:
    """Forget the signals being saved for: every checkpointer flagged is done, or no longer waited for."""
    _stopped.clear()
    for ckpt in list(_stopping):
        ckpt._signal = None
    _stopping.clear()
    _delivered.clear()


class _StopHandler:
    """A checkpointer's handler of one stop signal, as ``signal.signal`` installs it. It holds the checkpointer
    weakly, so that one dropped without ``close()`` is collected (its store released, as a dropped ``Store``'s is):
    a bound method there held it until the process ended. Once it is collected, the handler passes signals on to
    the one it replaced (``previous``), as a closed checkpointer's does."""

    __slots__ = ("ref", "previous", "pid")

    def __init__(self, ckpt: Checkpointer) -> None:
        self.ref = weakref.ref(ckpt)
        self.previous: Any = signal.SIG_DFL
        self.pid = os.getpid()  # (the process that installed it: a forked child inherits it)

    def __call__(self, signum: int, frame: Any) -> None:
        ckpt = self.ref()
        if ckpt is None:
            if not _take_forwarded(signum, frame):  # (a loop's thread handed it over, then dropped its checkpointer)
                # past the handlers of other collected checkpointers in a loop, not one call deeper for each: a sweep
                # of trials that each dropped one stacked them up, and the signal raised RecursionError
                handler, kill = self.previous, os.getpid() != self.pid
                while isinstance(handler, _StopHandler) and handler.ref() is None:
                    handler, kill = handler.previous, kill or os.getpid() != handler.pid
                # in a forked child, the default action ends it by the signal (as an open or closed checkpointer's
                # handler there does), not by a SystemExit raised into the code the child runs
                _pass_to(handler, signum, frame, kill=kill)
        else:
            ckpt._on_signal(signum, frame)


def _take_forwarded(signum: int, frame: Any) -> bool:
    """Pass on the signal ``signum`` that a checkpointer stepped on another thread handed to the main thread, if
    it did (True); else False. Every handler of a checkpointer's, collected or not, takes it first: one left in
    ``_forward`` would make the next such signal skip its save."""
    for i, (sig, handler) in enumerate(_forward):
        if sig == signum:
            del _forward[i]
            if handler is signal.default_int_handler:  # Python's Ctrl-C: its KeyboardInterrupt would end the
                handler = signal.SIG_DFL  # main thread only, and the loop's thread would train on
            _pass_to(handler, signum, frame, kill=True)
            return True
    return False


def _unquiet(loaders: list[Any], owner: Checkpointer | None) -> None:
    """Stop protecting the workers of ``loaders`` for ``owner`` (None: a checkpointer collected unclosed, which
    their wrappers' weak sets have dropped already): a loader no open checkpointer protects gets its own
    ``worker_init_fn`` back, and its workers end at SIGTERM again."""
    for loader in loaders:
        wrapper = loader.worker_init_fn
        if isinstance(wrapper, WorkersIgnoreStopSignals):
            if owner is not None:
                wrapper.owners.discard(owner)
            if not wrapper.owners:
                wrapper.release()  # workers still running (persistent ones) end at SIGTERM again
                loader.worker_init_fn = wrapper.fn
                # the class's again (a pop: the finalizer of one collected on another thread may run beside)
                vars(loader).pop("_get_iterator", None)
    loaders.clear()


def _pass_to(handler: Any, signum: int, frame: Any, *, kill: bool = False) -> None:
    """What the handler ``handler`` does with the signal: call it, ignore it (SIG_IGN), or the default action:
    exit with status 128 + signal (SystemExit), or with ``kill`` end the process by the signal itself."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:
        if kill:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        raise SystemExit(128 + signum)


#: what ``Checkpointer(when_busy=)`` takes: wait for the save in flight at a step of the schedule, or skip the step
WHEN_BUSY = ("wait", "skip")

#: seconds a loop's thread that handed a process-ending signal to the main thread waits for the end
_ENDING_WAIT = 30.0

#: checkpointers with async saves, for :func:`_finish_saves_at_exit`
_async: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_exit_hook = threading.Lock()
_exit_hooked = False

#: the checkpointer whose restore last put back the process's RNG states (this process's: reset in a forked child)
_rng_owner: weakref.ref[Checkpointer] | None = None


def _finish_saves_at_exit() -> None:
    """Wait for every async save still in flight when the main thread ends (no ``close()``: an exception, a
    ``sys.exit``, a loop that returned), and report a failed one on stderr, as nothing else will raise it.

    It runs when the main thread has ended and before concurrent.futures stops taking work, so the save still
    uses every worker (once that has stopped, the save goes on on its own thread). Registered with
    ``threading._register_atexit``, as concurrent.futures registers its own; where Python lacks it, the
    interpreter still waits for the save's thread at exit, and only the report is lost."""
    for ckpt in list(_async):
        fut = ckpt._inflight
        if fut is None:
            continue
        try:
            fut.result()
        except BaseException as exc:  # reported here: nobody is left to raise it to
            if fut.done() and not fut.cancelled() and fut.exception() is exc:
                sys.stderr.write(f"deltackpt: the background save of step {ckpt._inflight_step} to "
                                 f"{ckpt.store.path} failed as the interpreter exited: {type(exc).__name__}: {exc}\n")
            else:  # the wait was interrupted (a second Ctrl-C), not the save, which goes on: the exit waits for it
                sys.stderr.write(f"deltackpt: the wait at exit for the background save of step {ckpt._inflight_step}"
                                 f" to {ckpt.store.path} was interrupted ({type(exc).__name__}); the save goes on "
                                 "until it commits (killing the process abandons it, and the store keeps the "
                                 "checkpoints before it)\n")


def _run_for(fut: Future[T], fn: Callable[..., T], *args: Any) -> None:
    """Run ``fn(*args)`` on an executor's thread for ``fut``, a future made before the submit (as the
    executor's own work item does for the future it makes); nothing when ``fut`` was cancelled first."""
    if not fut.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as exc:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _forget_saves_after_fork() -> None:
    """A forked child (a DataLoader's or a Pool's worker) inherits the parent's saves in flight, but not the threads
    running them: its exit must not wait for them (it used to, forever), nor its close() of an inherited
    checkpointer (a ``with`` block the child leaves by ``sys.exit``), and a save of its own runs on a thread of its
    own (the inherited executor has none). Nor is the parent's restore of the RNG states one of the child's
    checkpointers could wind back."""
    global _rng_owner
    for ckpt in list(_async):
        ckpt._inflight = None
        ckpt._executor = ThreadPoolExecutor(1, thread_name_prefix="deltackpt-save")
        ckpt._closing = threading.Lock()
    _rng_owner = None


os.register_at_fork(after_in_child=_forget_saves_after_fork)


def _hook_exit() -> None:
    global _exit_hooked
    with _exit_hook:
        if not _exit_hooked:
            register = getattr(threading, "_register_atexit", None)
            if register is not None:
                with contextlib.suppress(RuntimeError):  # (the interpreter is exiting already)
                    register(_finish_saves_at_exit)
            _exit_hooked = True
T = TypeVar("T")


@contextlib.contextmanager
def _naming(info: CheckpointInfo) -> Iterator[None]:
    """Refusals raised inside (this run and the checkpoint do not fit) name the checkpoint, which a restore of
    the latest chose: "checkpoint <id> (step <n>): ...". Damage and other errors go out as they are."""
    try:
        yield
    except DeltackptError as exc:
        if (type(exc) in (DeltackptError, ShapeMismatchError, UnsupportedTypeError) and len(exc.args) == 1
                and isinstance(exc.args[0], str) and not exc.args[0].startswith("checkpoint ")):
            exc.args = (f"checkpoint {info.id} (step {info.step}): {exc.args[0]}",)
        raise


def _plain_metadata(metadata: Any) -> dict[str, Any] | None:
    """A step's ``metadata`` checked as a save checks it (a mapping of plain values: a tensor loss is refused at
    the step that passes it, not by a background save later) and copied, nested values too: an async save
    stores what it was at ``step()``, whatever the loop does to its dicts meanwhile."""
    meta = check_metadata(metadata)
    if meta is not None and THINNED_KEY in meta:
        # (retention would take the checkpoint for thinned already, and a restore would pass it over)
        raise ValueError(f"metadata key {THINNED_KEY!r} is reserved: a Checkpointer marks the checkpoints retention "
                         "thinned with it; give yours another name")
    return None if meta is None else decode_plain(encode_plain(meta))


def _checkpointer_layout(state: Any) -> bool:
    """Whether a stored state (or its skeleton) is laid out as :meth:`Checkpointer.capture` lays it out."""
    return isinstance(state, Mapping) and "step" in state and "model" in state


def step_mismatch(state: Mapping[str, Any], manifest_step: int) -> str | None:
    """Why a restore refuses a checkpoint whose 'step' entry (a valid step) is not the step its manifest lists it
    at, or None when they agree. A Checkpointer saves the two equal; they differ in a ``Store.save(state,
    step=N)`` of a state captured at another step, or a crafted manifest, and which of the two the run should
    go on from is not for a restore to guess (the store's listings, retention and the next save's numbering go by
    the manifest's step, the RNG seeding and the training loop by the entry's)."""
    if int(state["step"]) == manifest_step:
        return None
    return (f"its 'step' entry is {int(state['step'])} but its manifest's step is {manifest_step} (a Store.save of "
            "a state captured at another step?)")


def _ddp_rank(model: Any) -> int:
    """The process's rank in the data-parallel group of a member of ``model`` that is a DistributedDataParallel,
    with the default process group up (0 otherwise). In its own group, not the job's: DDP over a subgroup (each
    pipeline stage's replicas, say) saves from that group's rank 0."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    ddp = torch.nn.parallel.DistributedDataParallel
    for _, m in group_members(model, "model"):
        if isinstance(m, ddp):
            return int(dist.get_rank(group=getattr(m, "process_group", None)))
    return 0


def newest_restorable(
    store: Store, attempt: Callable[[CheckpointInfo], T], damaged: Callable[[CheckpointInfo, CorruptionError], None]
) -> T | None:
    """``attempt(info)`` on the newest checkpoint, then on older ones while it raises :class:`CorruptionError`
    (each reported to ``damaged``); its result, or None for an empty store. This is the order in which
    ``Checkpointer.restore()`` looks for the checkpoint to resume from (and ``deltackpt resume-info --verify``
    finds it the same way): a checkpoint deleted meanwhile is passed over, a thinned one (weights only) is never
    fallen back to, and when no checkpoint restores the first error is raised."""
    first: CorruptionError | None = None
    for _ in range(8):  # listed again only if every checkpoint listed was deleted before it could be tried
        infos = store.list()
        if not infos:
            return None
        for info in reversed(infos):
            if first is not None and is_thinned(info):
                break  # weights only: resuming from it would silently drop the optimizer's state
            try:
                return attempt(info)
            except CheckpointNotFoundError:
                continue  # deleted since the list (retention in another process): the one before it
            except CorruptionError as exc:
                first = first or exc
                damaged(info, exc)
        if first is not None:
            raise first
    raise CheckpointNotFoundError(f"the checkpoints of {store.path} kept being deleted while restoring")


class Checkpointer:
    """Checkpoint a training loop into a deltackpt store; resume it exactly.

    Parameters
    ----------
    path_or_store: a store directory or an open :class:`Store`.
    model, optimizer, scheduler, scaler: an object with ``state_dict``/``load_state_dict`` (nn.Module,
        Optimizer, LR scheduler, ``torch.amp.GradScaler``), or a list or dict of them.
    data: the data position: a :class:`deltackpt.data.ResumableLoader` / sampler, or any stateful loader
        (torchdata's ``StatefulDataLoader``) - anything with ``state_dict``/``load_state_dict``.
    extra: a dict of further state: stateful objects are saved through ``state_dict`` and restored through
        ``load_state_dict``; plain values (dicts, numbers, tensors) are saved, and on restore written into
        the run's own tensors and containers where they can hold them (:func:`put_back`), else back into
        this dict.
    every_n_steps: save when the step passed to :meth:`step` is a multiple of this.
    async_save: snapshot in :meth:`step` and save in a background thread (at most one save in flight).
    when_busy: what :meth:`step` does at a step of the schedule while the async save before it still runs:
        ``"wait"`` (the default) waits for it, so that every step of the schedule is saved; ``"skip"`` saves
        nothing at that step and returns False at once (counted in :attr:`skipped`), so that the loop never
        waits for a save and saves as often as the store keeps up. Needs ``async_save``. A stop signal's save
        waits whatever this says, and so do an explicit :meth:`save` and the steps ``retention`` keeps for good
        (``keep_every``).
    retention: a :class:`Retention` policy applied after each committed save.
    gc: with a retention policy, reclaim the space of what it deleted or thinned: after a save whose retention
        brings the bytes that the checkpoints deleted or thinned since the store's last gc wrote (the store
        counts them, whichever process deleted them: a job restarted often adds up) to a quarter of what the
        kept ones wrote, and at least ``DELTACKPT_GC_MIN_BYTES`` (64 MiB by default; read when the checkpointer
        is made), run :meth:`Store.gc` right there (on the save thread: in the
        background when ``async_save``), except after the save at a signal (the process is about to end). False
        leaves that to you (``deltackpt gc STORE`` from another process, say).
    handle_signals: on SIGTERM/SIGINT save at the next step boundary, wait for it, then hand the signal to
        the handler installed before (Python's own SIGINT handler raises KeyboardInterrupt; the default action,
        SIG_DFL, exits with status 128+signal).
    map_location: passed to :meth:`Store.load` by :meth:`restore` (default ``"cpu"``; ``load_state_dict``
        moves values to the parameters' devices).
    rng: save the process's RNG states (Python, NumPy, torch CPU and CUDA) and put them back on restore. The
        states are the process's, not this checkpointer's: of several checkpointers of one loop, give all but
        one ``rng=False``, or a restore of one to another step than the other's winds them to that step.
    rank: this process's rank in a data-parallel job whose ranks all restore from this store and of which rank 0
        saves into it (DistributedDataParallel; the README's "Data-parallel jobs"). A checkpointer of a rank
        other than 0 saves no checkpoint: its :meth:`step` writes the process's RNG states beside the store
        (``STORE/rng/``, :mod:`deltackpt.ranks`; fsynced at the steps rank 0 saves), and its :meth:`restore`
        puts back the ones of the restored step, so every rank draws after a resume what it drew before. It
        leaves retention and gc to rank 0. 0, or None (the default), makes a checkpointer that saves; None
        warns at the first save when the model is a DistributedDataParallel and the process is not rank 0 of
        its process group (pass 0 where each rank saves into a store of its own).
    """

    def __init__(
        self,
        path_or_store: str | os.PathLike[str] | Store,
        *,
        model: Members | None = None,
        optimizer: Members | None = None,
        scheduler: Members | None = None,
        scaler: Members | None = None,
        data: Stateful | None = None,
        extra: dict[str, Any] | None = None,
        every_n_steps: int = 1,
        async_save: bool = True,
        when_busy: str = "wait",
        retention: Retention | None = None,
        gc: bool = True,
        handle_signals: bool = True,
        map_location: Any = "cpu",
        rng: bool = True,
        rank: int | None = None,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, (int, np.integer)):
            raise TypeError(f"every_n_steps must be a positive int, got {type(every_n_steps).__name__} "
                            f"{every_n_steps!r:.40}")
        every_n_steps = int(every_n_steps)  # (a numpy int, as steps and Retention take them)
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive int, got {every_n_steps!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, (int, np.integer))):
            raise TypeError(f"rank must be an int (torch.distributed.get_rank()), got {type(rank).__name__} "
                            f"{rank!r:.40}")
        if rank is not None and not 0 <= rank < 1 << 20:
            raise ValueError(f"rank must be between 0 and 2**20-1, got {rank!r}")
        for name, value in (("async_save", async_save), ("gc", gc), ("handle_signals", handle_signals),
                            ("rng", rng)):
            config.boolean(name, value)
        if not isinstance(when_busy, str) or when_busy not in WHEN_BUSY:
            raise (ValueError if isinstance(when_busy, str) else TypeError)(
                f"when_busy must be one of {', '.join(map(repr, WHEN_BUSY))}, got {when_busy!r:.40}")
        if when_busy == "skip" and not async_save:
            raise ValueError("when_busy='skip' needs async_save=True: a synchronous save has ended by the next step()")
        if extra is not None and not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a dict of names to values or stateful objects, got "
                            f"{type(extra).__name__}")
        staging.check_map_location(map_location)  # (when it is made, not at a restart's first restore)
        if isinstance(path_or_store, Store) and path_or_store._closed:  # (not at its first restore or step)
            raise DeltackptError(f"store {path_or_store.path} is closed: give the Checkpointer an open Store, or "
                                 "its path")
        if retention is not None and not isinstance(retention, Retention):
            raise TypeError(f"retention must be a deltackpt.Retention or None, got {type(retention).__name__} "
                            f"{retention!r} (Retention(keep_last=3), say)")
        self.model = as_group(model, "model")
        self.optimizer = as_group(optimizer, "optimizer")
        self.scheduler = as_group(scheduler, "scheduler")
        self.scaler = as_group(scaler, "scaler")
        if data is not None and not stateful(data):
            raise TypeError(
                f"data must have state_dict()/load_state_dict() (got {type(data).__name__}); wrap a DataLoader "
                "in deltackpt.data.ResumableLoader"
            )
        self.data = data
        self._gc_rule = GcAfterRetention()  # (a bad DELTACKPT_GC_MIN_BYTES is refused here, not at a save)
        # (opened once the arguments are known to be good: a refused Checkpointer creates no store)
        self._owns_store = not isinstance(path_or_store, Store)
        self.store: Store = path_or_store if isinstance(path_or_store, Store) else Store(path_or_store)
        self.extra = extra if extra is not None else {}
        self.every_n_steps = every_n_steps
        self.async_save = async_save
        self.when_busy = when_busy
        #: steps of the schedule that ``when_busy="skip"`` did not save, as the save before them still ran
        self.skipped = 0
        self.retention = retention
        self._warned_metric = False  # (a keep_best metric no checkpoint records: said once)
        self.gc = gc
        self.map_location = map_location
        self.rng = rng
        #: the data-parallel rank: other than 0, the checkpointer keeps the process's RNG states and saves nothing
        self.rank = 0 if rank is None else int(rank)
        self._rank_unsaid = rank is None  # (its first save looks whether it runs on another rank than 0)
        #: the run's name (:func:`deltackpt.ranks.run_name`): recorded in its checkpoints' ``rng`` entry, and the
        #: name under which ranks other than 0 keep their RNG states; set again by a restore
        self._run = ranks.run_name(None, self.store) if rng else ""
        #: a rank other than 0: the newest commit when its run began; rank 0's saves of the run commit after it
        self._run_seq = ranks.newest_seq(self.store) if rng and self.rank and when_busy == "skip" else 0
        self._run_ids: dict[str, bool] = {}  # (checkpoints committed since, and whether this run's: _run_newest)
        #: RNG state files a rank other than 0 wrote since it last pruned them: its first step() prunes (a job
        #: whose every run ends within 32 steps, preempted say, would never prune otherwise)
        self._rank_files = 32
        self._rank_saves: set[int] = set()  # steps of its save() calls lately: rank 0's may still be under way
        #: the last RNG state file a rank other than 0 wrote without fsync: close() syncs it (rank 0 may have saved
        #: that step at a stop signal that reached this rank only after its step() of it)
        self._rank_unsynced: Path | None = None
        self._stepped = False  # step() or save() called: a restore from here is a rollback mid-run (ranks.next_run)
        self.last_saved_step: int | None = None
        self.last_info: CheckpointInfo | None = None
        #: the checkpoint this checkpointer last saved or restored, which its next save descends from (before either,
        #: the store handle's last saved or loaded one): the handle's also moves with loads other threads make
        #: through it, an evaluation thread's loads of older steps through ``ckpt.store``
        self._head: str | None = None
        self._staging = StagingBuffers()
        self._unthinnable: set[str] = set()  # checkpoints retention found damaged when it came to thin them
        async_save = async_save and not self.rank  # (a rank other than 0 saves nothing)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="deltackpt-save") if async_save else None
        if async_save:
            _async.add(self)
            _hook_exit()
        self._inflight: Future[CheckpointInfo] | None = None
        self._inflight_step = -1
        #: last_saved_step and last_info before the save in flight
        self._inflight_prev: tuple[int | None, CheckpointInfo | None] = (None, None)
        self._pid = os.getpid()  # the process whose handlers it installed (a forked child inherits them)
        self._signal: int | None = None  # a signal this checkpointer is to save at, at its next step
        self._stopped_by = 0  # the signal it saved at while in _stopped
        self._previous: dict[int, Any] = {}
        self._handlers: dict[int, _StopHandler] = {}  # (what it installed, to tell whether it is still installed)
        self._closed = False
        #: close() has released everything (it stays False after a close() that an exception interrupted: a
        #: second Ctrl-C while it waited for the last save; close() again then finishes the release)
        self._released = False
        #: taken by close() to mark the checkpointer closed and by a save as it starts (for all of a sync save): a
        #: close() on another thread while the loop's step() snapshots makes that save raise "closed", not
        #: concurrent.futures' "cannot schedule new futures after shutdown", and is not left unwaited for
        self._closing = threading.Lock()
        self._quieted: list[Any] = []  # DataLoaders whose workers this checkpointer made ignore stop signals
        self._handling = False  # its signal handlers were installed
        if handle_signals:
            self._install_signals()

    # -- state ---------------------------------------------------------------------------------------------
    def capture(self, step: int) -> dict[str, Any]:
        """The training state at ``step`` as a tree of live objects (no copies)."""
        step = check_step(step)  # (a str step went into the state, which a restore then refused as another step)
        extra: dict[str, Any] = {}
        for k, v in self.extra.items():
            extra[k] = v.state_dict() if stateful(v) else v
        state = {
            "step": step,
            "model": group_state(self.model),
            "optimizer": group_state(self.optimizer),
            "scheduler": group_state(self.scheduler),
            "scaler": group_state(self.scaler),
            "data": self.data.state_dict() if self.data is not None else None,
            "extra": extra,
        }
        if self.rng:
            state["rng"] = rng_state()
            state["rng"][ranks.RUN_KEY] = self._run  # (which the other ranks' states are kept under)
        return state

    def _check(self, state: Any, live_model: Any = None, *, strict: bool = True,
               manifest_step: int | None = None) -> list[str]:
        """Raise unless ``state`` (a captured state, or its skeleton with tensor entries in place of tensors)
        holds everything :meth:`apply` puts back into this run's components, and fits them; changes nothing.
        ``live_model``: the model's state dicts when the caller has them (else they are taken). Without
        ``strict`` a component other than the model that the checkpoint lacks is no error: the names of those
        are returned (what :meth:`_apply` then leaves as it is). ``manifest_step``: the step the store lists the
        checkpoint at, which its 'step' entry must equal (:func:`step_mismatch`)."""
        if not _checkpointer_layout(state):
            raise DeltackptError("this checkpoint was not written by a Checkpointer (no 'step'/'model' entry)")
        try:
            check_step(state["step"])
        except (TypeError, ValueError) as exc:
            raise DeltackptError(f"the checkpoint's 'step' entry is not a step: {exc}") from None
        if manifest_step is not None and (mismatch := step_mismatch(state, manifest_step)) is not None:
            raise DeltackptError(f"{mismatch}: restore() does not guess which to resume from; restore another "
                                 "step, or Store.load this one and apply() it")
        if state.get("thinned"):
            raise DeltackptError(
                f"checkpoint at step {state['step']} was thinned to model weights only and cannot resume training; "
                "load its weights with Store.load"
            )
        group_check(self.model, state.get("model"), "model")
        if strict and (absent := self._absent(state)):
            # all of them at once, not one per try: each is a component given to this run since the save
            raise DeltackptError(
                f"the checkpoint holds no {', '.join(absent)} (restore(strict=False) restores the rest and leaves "
                + ("it as it is)" if len(absent) == 1 else "them as they are)"))
        lacking: list[str] = []
        groups: dict[str, Any] = {"model": self.model}
        for what in ("optimizer", "scheduler", "scaler"):
            groups[what] = getattr(self, what)
            if not strict:
                groups[what], absent = present_members(groups[what], state.get(what), what)
                lacking += absent
            group_check(groups[what], state.get(what), what)
        fit_check(self.model, state.get("model"), "model", live_model)
        fit_check(groups["optimizer"], state.get("optimizer"), "optimizer")
        scaler_check(groups["scaler"], state.get("scaler"))
        scheduler_check(groups["scheduler"], state.get("scheduler"))
        # (from here on what the checkpoint lacks is only collected: a strict restore refused it above)
        if self.data is not None and state.get("data") is None:
            lacking.append("data")
        elif self.data is not None and (misfit := self._misfit(state["data"])) is not None:
            # (a ResumableLoader: another dataset, seed, sharding is refused before anything is put back)
            if strict:
                raise DeltackptError(f"the checkpoint's data position does not fit this run's loader: {misfit}"
                                     " (restore(strict=False) restores the rest and leaves the loader as it is)")
            lacking.append(f"data position that fits this loader ({misfit})")
        saved_extra = state.get("extra") or {}
        for k, v in self.extra.items():
            if k not in saved_extra:
                lacking.append(f"extra[{k!r}]")
            elif isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):  # (an EMA model: checked as the model is)
                fit_check(v, saved_extra[k], f"extra[{k!r}]")
            elif not stateful(v):
                extra_check(v, saved_extra[k], f"extra[{k!r}]")
            else:  # (an LR scheduler or a GradScaler kept there: checked as those of the run are)
                one_scheduler_check(v, saved_extra[k], f"extra[{k!r}]")
                if isinstance(v, torch.amp.GradScaler):
                    one_scaler_check(v, saved_extra[k], f"extra[{k!r}]")
        if self.rng and not has_rng(state):
            lacking.append("rng")
        return lacking

    def _absent(self, state: Mapping[str, Any]) -> list[str]:
        """What this run has and the checkpoint holds no state for, as a strict restore's refusal names it: an
        optimizer, scheduler or scaler (or members of a dict of them), the data position, ``extra`` entries, the
        RNG states."""
        absent = []
        for what in ("optimizer", "scheduler", "scaler"):
            mine, saved = getattr(self, what), state.get(what)
            if mine is not None and saved is None:
                absent.append(f"{what} state")
            elif isinstance(mine, dict) and isinstance(saved, Mapping) and (
                    missing := [k for k in mine if k not in saved]):
                absent.append(f"{what} state for {', '.join(map(repr, missing))}")
        if self.data is not None and state.get("data") is None:
            absent.append("data position")
        saved_extra = state.get("extra") or {}
        absent += [f"extra[{k!r}]" for k in self.extra if k not in saved_extra]
        if self.rng and not has_rng(state):
            absent.append("RNG states ('rng' with 'python', 'numpy' and 'torch')")
        return absent

    def _unused(self, state: Mapping[str, Any]) -> list[str]:
        """What the checkpoint holds that this run gave no object for, so a restore leaves it where it is: an
        optimizer, scheduler, scaler, data position or ``extra`` entry. (Not RNG states: a checkpointer
        made with ``rng=False`` leaves them alone on purpose, a loop's second one, say.)"""
        unused = [what for what in ("optimizer", "scheduler", "scaler", "data")
                  if getattr(self, what) is None and state.get(what) is not None]
        saved_extra = state.get("extra")
        if isinstance(saved_extra, Mapping):
            unused += [f"extra[{k!r}]" for k in saved_extra if k not in self.extra]
        return unused

    def apply(self, state: Mapping[str, Any]) -> int:
        """Put a captured state back into the model, optimizers, ... and RNGs; return its step. A state that
        lacks a part this run has is refused before anything is put back."""
        if not isinstance(state, Mapping):
            raise TypeError("apply() takes a captured state (the dict capture() or Store.load of a Checkpointer's "
                            f"checkpoint returns), got {type(state).__name__}")
        self._check(state)
        return self._apply(state)

    def _apply(self, state: Mapping[str, Any], *, strict: bool = True, decoded: bool = False) -> int:
        """:meth:`apply` of a state already checked (without ``strict``: what it lacks stays as it is);
        ``decoded``: the load decoded the model's tensors in place already (a restore).

        A component's own loading that raises all the same (what no check can foresee: a data loader's or an
        ``extra`` object's ``load_state_dict``, which come after the model and optimizer) raises
        DeltackptError naming it and what was put back before it."""
        applied: list[str] = ["the model's tensors (decoded into them)"] if decoded else []
        current = "model"
        try:
            for what in ("model", "optimizer", "scheduler", "scaler"):
                current = what
                g = getattr(self, what)
                if not strict and what != "model":
                    g, _ = present_members(g, state.get(what), what)
                load_group(g, state.get(what))
                if g is not None:
                    applied.append(what)
            data = state.get("data")
            if self.data is not None and data is not None and (strict or self._misfit(data) is None):
                current = "data"
                self.data.load_state_dict(data)
                applied.append(current)
            saved_extra = state.get("extra") or {}
            for k, v in self.extra.items():
                if not strict and k not in saved_extra:
                    continue
                current = f"extra[{k!r}]"
                if stateful(v):
                    v.load_state_dict(saved_extra[k])
                    if isinstance(v, torch.optim.Optimizer):
                        param_layouts(v)
                else:  # (into the run's own tensors and containers, which its training loop holds)
                    self.extra[k] = put_back(v, saved_extra[k])
                applied.append(current)
        except DeltackptError:
            raise
        except Exception as exc:
            raise DeltackptError(
                f"{current}: restoring it raised {type(exc).__name__}: {exc}; put back before it: "
                f"{', '.join(applied) or 'nothing'} (restore again, from another step if need be)") from exc
        if self.rng and (strict or has_rng(state)):
            try:
                if self.rank:
                    self._put_rank_rng_back(state["rng"], int(state["step"]))
                else:
                    self._put_rng_back(state["rng"], int(state["step"]))
            except DeltackptError:
                raise
            except Exception as exc:  # (states the generators refuse: none of them was set, set_rng_state)
                raise DeltackptError(
                    f"rng: restoring it raised {type(exc).__name__}: {exc}; put back before it: "
                    f"{', '.join(applied) or 'nothing'} (restore again, from another step if need be)") from exc
        return int(state["step"])

    def _put_rng_back(self, rng: Mapping[str, Any], step: int) -> None:
        """Set the process's RNG states from a checkpoint of ``step``, warning when another open checkpointer of
        another store put back RNG states before and is at another step (restored or saved since): a loop's
        second checkpointer, whose restore of an older step would wind them back silently, and every random
        draw after the resume would repeat earlier ones. (A checkpointer made again on the same store, the first
        left open, is the same run's.)"""
        global _rng_owner
        before = _rng_owner() if _rng_owner is not None else None
        if (before is not None and before is not self and not before._closed
                and before.last_saved_step is not None and before.last_saved_step != step
                and before.store.path.resolve() != self.store.path.resolve()):
            warnings.warn(
                f"deltackpt: restoring step {step} from {self.store.path} sets the process's RNG states to that "
                f"step's, while the checkpointer of {before.store.path} restored them at, or has saved since, step "
                f"{before.last_saved_step}: random draws after the resume will differ from the uninterrupted "
                "run's. Give all but one of a loop's checkpointers rng=False", RuntimeWarning,
                stacklevel=caller_level())
        set_rng_state(rng)
        _rng_owner = weakref.ref(self)

    def _put_rank_rng_back(self, rng: Mapping[str, Any], step: int) -> None:
        """A rank other than 0: put back the RNG states it kept at ``step`` of the run the checkpoint names (its
        ``rng`` entry holds rank 0's). Where there are none (a checkpoint saved before deltackpt kept them, a
        file lost or damaged), a RuntimeWarning says so and the generators stay as they are."""
        try:
            own = ranks.read_for(self.store.path, self.rank, step, rng)
        except ranks.RankStateError as exc:
            warnings.warn(f"deltackpt: rank {self.rank} has no RNG states of step {step} to restore: {exc}; its "
                          "generators stay as they are, and its random draws from here differ from the run's that "
                          "saved", RuntimeWarning, stacklevel=caller_level())
            return
        self._put_rng_back(own, step)

    def _misfit(self, data_state: Any) -> ValueError | TypeError | None:
        """Why this run's loader does not take ``data_state`` (its ``check_state_dict``'s error), or None: it does,
        or has no ``check_state_dict`` and is assumed to."""
        check = getattr(self.data, "check_state_dict", None)
        try:
            if check is not None:
                check(data_state)
        except (ValueError, TypeError) as exc:
            return exc
        return None

    def restore(self, step: int | None = None, *, id: str | None = None, strict: bool = True) -> int:
        """Load the latest checkpoint (or ``step``/``id``) into every component; return its step, 0 if none.

        A checkpoint that lacks a component this run has (a scheduler, a data position, an ``extra`` entry
        added since it was saved) is refused, unless ``strict=False``: then those components stay as they are,
        named in a ``RuntimeWarning``. The model always has to match.

        Saves after this descend from the restored checkpoint: after rolling back to an older step the run
        continues on a branch, and saving a step number that exists on another branch is allowed.

        Restoring the latest, a checkpoint found damaged (:class:`~deltackpt.errors.CorruptionError`) is skipped
        with a ``RuntimeWarning`` for the newest one before it that restores, so a job restarted onto a damaged
        store resumes instead of failing at every restart. The frames it reaches are checked, and the saves that
        follow write the chunks found damaged again (see :func:`deltackpt.maintenance.find_damaged_frames`).
        Thinned checkpoints (weights only) are never fallen back to: if no full checkpoint restores, the first
        error is raised. A given ``step`` or ``id`` is restored or raises.
        """
        self._check_open()  # (as step() and save(): not the store's "index is closed", nor a restore into the run)
        self.wait()
        strict = config.boolean("strict", strict)
        for path, member in group_members(self.model, "model"):
            meta = next((k for k, v in tensors_of(member) if v.is_meta), None)
            if meta is not None:
                raise DeltackptError(f"cannot restore into {path}: its tensor {meta!r} is on the meta device (it has "
                                     "no memory); materialize the model first, e.g. model.to_empty(device='cpu')")
        if step is not None or id is not None:
            return self._restore(self.store.info(step, id=id), strict=strict)

        def damaged(info: CheckpointInfo, exc: CorruptionError) -> None:
            warnings.warn(f"deltackpt: checkpoint {info.id} (step {info.step}) is damaged, trying the ones "
                          f"before it: {exc}", RuntimeWarning, stacklevel=caller_level())
            # The rerun of its steps saves the same bytes again. The load stopped at the first chunk it could not
            # decode; every damaged frame the checkpoint reaches is found, and the store's saves then write those
            # chunks again instead of deduplicating onto them (the new checkpoints would be damaged too).
            with contextlib.suppress(DeltackptError):
                maintenance.find_damaged_frames(self.store, info.id)

        restored = newest_restorable(self.store, lambda info: self._restore(info, strict=strict), damaged)
        return 0 if restored is None else restored

    def _restore(self, info: CheckpointInfo, *, strict: bool = True) -> int:
        # The checkpoint's skeleton (tensor entries in place of tensors, no chunk read) is checked first: the load
        # below decodes into the model's own tensors, and a checkpoint refused after that would leave the live
        # model holding its weights.
        m = self.store.manifest(id=info.id)
        try:
            skeleton = m.skeleton()
        except Exception:  # (a registered type's decoder that cannot take tensor entries: None in its place)
            try:
                skeleton = tree.check_skeleton(m.tree, list(m.tensors))
            except Exception:  # (a damaged skeleton: the load raises what it is)
                skeleton = None
        live = group_state(self.model)  # (once: for FSDP a state dict is a gather)
        if skeleton is not None:
            with _naming(info):
                lacking = self._check(skeleton, live, strict=strict, manifest_step=info.step)
        # the model's own tensors are offered: they are decoded in place, and load_state_dict then copies nothing
        # (and a plain extra entry's tensors: an EMA kept as a dict of tensors is decoded into the run's own)
        into = {"model": live, "extra": plain_extras(self.extra)}
        state = self.store.load(id=info.id, map_location=self.map_location, into=into)
        with _naming(info):
            if skeleton is None:
                lacking = self._check(state, live, strict=strict, manifest_step=info.step)
            restored = self._apply(state, strict=strict, decoded=True)
        if lacking:
            warnings.warn(f"deltackpt: checkpoint {info.id} (step {info.step}) holds no {', '.join(lacking)}: "
                          "left as they are", RuntimeWarning, stacklevel=caller_level())
        if unused := self._unused(state):
            # (a forgotten scheduler= would restart the LR schedule from its first step without a word)
            warnings.warn(f"deltackpt: checkpoint {info.id} (step {info.step}) also holds {', '.join(unused)}, "
                          "which this Checkpointer was not given: not restored", RuntimeWarning,
                          stacklevel=caller_level())
        self.last_saved_step, self._head = restored, info.id
        if self.rng:  # (every rank names the run alike: they all restored this, before any saved, or mid-run
            # at the same step from the same run, where rank 0's save of that step may or may not be committed yet)
            self._run = ranks.next_run(self._run, info.id) if self._stepped else ranks.run_name(info.id, self.store)
            if self.rank and self.when_busy == "skip":
                self._run_seq, self._run_ids = ranks.newest_seq(self.store), {}
        return restored

    # -- saving ----------------------------------------------------------------------------------------------
    def step(self, step: int, *, metadata: Mapping[str, Any] | None = None) -> bool:
        """Tell the checkpointer that ``step`` steps are complete; save if due. Returns True if this step is
        saved: a save started, or (at a signal) the one of this step under way was waited for. False where no save
        is due, or where ``when_busy="skip"`` skipped this step (the save before it still runs). A rank other than
        0 cannot see that: its step() returns True at every step of the schedule.

        ``metadata`` goes with this step's save, when there is one (a metric for ``Retention(keep_best=)``,
        a tag), and is dropped otherwise. Raises the error of a failed background save. After a SIGTERM/SIGINT
        it saves (whatever the interval; a keyframe save, so that the restart restores from one frame per
        chunk), waits for the save, then passes the signal on; a signal that arrives during this step's own save
        makes this step the one it passes the signal on after.
        """
        self._check_open()  # (at every step, not only at those that save)
        step = check_step(step)
        metadata = _plain_metadata(metadata)
        self._stepped = True
        if self.rank:
            # (rank 0's answer: not at a step it saved or restored already, the restored one stepped again)
            scheduled = step % self.every_n_steps == 0
            due = self._signal is not None or (scheduled and step != self.last_saved_step)
            self._keep_rank_rng(step, durable=scheduled or due)
            return due
        self._raise_background_error()
        if self in _stopped:  # saved at a signal already, at an earlier step
            if max(_stopped.values()) > _stopped[self]:
                self._signal = self._stopped_by  # another saved at a later step since: save at this one too
            else:  # the checkpointers it waits for are not being stepped
                self._pass_signal_on(self._stopped_by)
        if self._signal is not None:
            if step == self.last_saved_step:
                self.wait()  # this step's save is already under way
            else:
                self.save(step, wait=True, keyframe=True, metadata=metadata)
            self._saved_at_signal(step)
            return True
        if step % self.every_n_steps == 0 and step != self.last_saved_step:
            if (self.when_busy == "skip" and self._inflight is not None and not self._inflight.done()
                    and not self._milestone(step)):
                self.skipped += 1  # (its error, once it has one, is raised at the next step: above)
                return False
            self.save(step, metadata=metadata)
            if self._signal is not None:
                # the signal came during this save (or the wait for the one before it): this step is the boundary.
                # Its save is not a keyframe, but training another step and saving it again would spend the grace
                # period on what this save already holds
                self.wait()
                self._saved_at_signal(step)
            return True
        return False

    def save(
        self, step: int, *, wait: bool = False, metadata: Mapping[str, Any] | None = None, keyframe: bool = False
    ) -> None:
        """Save now. Async mode snapshots and returns; ``wait=True`` (or sync mode) returns once committed.
        ``keyframe`` as for :meth:`Store.save`; a step that retention keeps for good is saved as a keyframe anyway,
        a self-contained one (:meth:`_kept_for_good`)."""
        self._check_open()
        step = check_step(step)
        # (checked at the call: an async save would raise a bad keyframe at the next step(), its step unsaved)
        keyframe, wait = config.boolean("keyframe", keyframe), config.boolean("wait", wait)
        self._stepped = True
        if self.rank:
            _plain_metadata(metadata)
            self._keep_rank_rng(step, durable=True, saved=True)
            return
        if self._rank_unsaid:
            self._rank_unsaid = False
            if ddp := _ddp_rank(self.model):
                # (every rank saving into the job's one store: each step saved once per rank, lines interleaved)
                warnings.warn(f"deltackpt: rank {ddp} of a DistributedDataParallel job saves a checkpoint: where the "
                              "job's ranks share this store, make each rank's Checkpointer with rank=torch."
                              "distributed.get_rank() (of the model's process group; rank 0 saves, the others keep "
                              "their RNG states); where each rank has a store of its own, with rank=0",
                              RuntimeWarning, stacklevel=caller_level())
        whole = self._kept_for_good(step)
        keyframe = keyframe or whole
        self._raise_background_error()
        self.wait()  # at most one save in flight: the staging buffers are about to be rewritten
        state = self.capture(step)
        meta = _plain_metadata(metadata) or None
        pairs = param_pairs(self.model, self.optimizer)
        stopping = self._signal is not None  # (the save before the process ends: no gc after it, time is short)
        if self._executor is None:
            with self._closing:
                self._check_open()
                self._run_save(state, step, meta, keyframe, pairs, stopping, whole)
        else:
            snap = self._staging.snapshot(state)
            with self._closing:
                self._check_open()
                # The save is in flight (its future kept) before it is submitted: an exception that interrupts the
                # submit or comes right after it (a second Ctrl-C's KeyboardInterrupt) left a save running that
                # the next one did not wait for; it snapshotted into the staging buffers under it, and the
                # checkpoint of this step held bytes of the next.
                fut: Future[CheckpointInfo] = Future()
                prev = (self.last_saved_step, self.last_info)
                try:
                    self._inflight, self._inflight_step, self._inflight_prev = fut, step, prev
                    self.last_saved_step = step  # (step() of it again must not start a second save)
                    self._executor.submit(_run_for, fut, self._run_save, snap, step, meta, keyframe, pairs, stopping,
                                          whole, self._staging.devices)
                except BaseException:
                    if fut.cancel():  # not started, and now it never will: nothing reads the staging buffers
                        self._inflight, self.last_saved_step = None, prev[0]
                    raise
            if wait:
                self.wait()

    def _keep_rank_rng(self, step: int, *, durable: bool, saved: bool = False) -> None:
        """A rank other than 0 at ``step``: write its RNG states (``durable``: fsynced, at the steps rank 0 saves
        and at a signal), and now and then remove those of steps the store has no checkpoint of and whose save
        cannot be under way: rank 0 saves a step of the schedule, or one of an explicit :meth:`save` (``saved``:
        async on rank 0, it commits by rank 0's next save), at most two intervals late (one save in flight while
        the next snapshots), and one off the schedule at a signal right away."""
        if not self.rng:
            return
        path = ranks.write(self.store.path, self.rank, step, self._run, rng_state(), durable=durable)
        self._rank_unsynced = None if durable else path
        if saved:
            self._rank_saves.add(step)
        self._rank_files += 1
        if self._rank_files >= 32:
            self._rank_files = 0
            n = self.every_n_steps
            saves = self._rank_saves
            skip = self.when_busy == "skip"
            after = 0
            try:
                infos = self.store._listing()
                listed = {info.step for info in infos if not is_thinned(info)}  # (a thinned one is never restored)
                # Rank 0 saves the steps of the schedule in order, one at a time. With when_busy="skip" it does not
                # wait for a save at the next one, so a save may run for any number of intervals: every step of the
                # schedule after the newest this run committed may still be under way. The same for the steps of
                # its explicit save() calls: rank 0's next steps of the schedule skip rather than wait for one.
                if skip:
                    after = self._run_newest(infos, step)
                ranks.prune(self.store.path, self.rank,
                            lambda s: s in listed or s >= step - (2 * n if s % n == 0 or s in saves else 1)
                            or (skip and (s % n == 0 or s in saves) and s > after))
            except (DeltackptError, OSError) as exc:  # (the states are kept: only their clean-up waits)
                warnings.warn(f"deltackpt: rank {self.rank} could not remove its RNG states of steps the store no "
                              f"longer holds, tried again in 32 steps ({type(exc).__name__}: {exc})",
                              RuntimeWarning, stacklevel=caller_level())
            self._rank_saves = {s for s in saves if s >= step - 2 * n or (skip and s > after)}
        self.last_saved_step = step

    def _run_newest(self, infos: list[CheckpointInfo], step: int) -> int:
        """A rank other than 0 with ``when_busy="skip"``: the step of the newest checkpoint that rank 0 committed in
        this run, up to ``step`` (-1 when none). Of those committed since the run began, the newest whose ``rng``
        entry names this run: after a rollback mid-run, rank 0's save of the run rolled back from may commit after
        this rank's restore read the store (rank 0's restore waits for it), and is not one of this run's; counted,
        it would let this rank remove the states of the steps below it that rank 0 is still saving."""
        seen = self._run_ids
        self._run_ids = {}
        for info in sorted((i for i in infos if i.seq > self._run_seq and i.step <= step), key=lambda i: -i.seq):
            ours = seen.get(info.id)
            if ours is None:
                try:
                    rng = self.store.manifest(id=info.id).skeleton().get("rng")
                    ours = isinstance(rng, Mapping) and rng.get(ranks.RUN_KEY) == self._run
                except Exception:  # (deleted meanwhile, thinned, damaged: not counted, so its states are kept)
                    ours = False
            self._run_ids[info.id] = ours
            if ours:
                return info.step  # (rank 0 saves a run's steps in order: its newest commit is its latest step)
        return -1

    def _sync_rank_rng(self, path: Path) -> None:
        """At close(), a rank other than 0: make the RNG states it kept last durable. A stop signal can reach rank
        0 before its step() of a step and this rank after its own: rank 0 saves that step and exits, and this rank,
        whose next collective fails, steps no more. (Pruned meanwhile: nothing to sync.)"""
        self._rank_unsynced = None
        try:
            ranks.sync(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(f"deltackpt: rank {self.rank} could not make its RNG states of {path.name} durable "
                          f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=caller_level())

    def _kept_for_good(self, step: int) -> bool:
        """Whether retention keeps ``step`` for good while it deletes saves around it: a multiple of
        ``keep_every`` when saves come more often than that. Such a checkpoint is saved as a self-contained
        keyframe: its new chunks and those the store holds only as delta or predicted frames (chunks that stopped
        changing) are written standalone. As a delta it would keep alive, for as long as it is kept, the delta
        bases and prediction inputs of the checkpoints retention deletes before it: ``python -m bench.retention``
        measured 1.62 raw states of pack space per retained checkpoint that way, 0.99 with keyframes."""
        r = self.retention
        return (r is not None and r.keep_every is not None and r.keep_every > self.every_n_steps
                and step % r.keep_every == 0)

    def _milestone(self, step: int) -> bool:
        """Whether retention keeps a checkpoint of ``step`` for good (``keep_every``): ``when_busy="skip"`` waits
        for the save before it rather than leave that stretch of the history without one."""
        r = self.retention
        return r is not None and r.keep_every is not None and step % r.keep_every == 0

    def _run_save(self, state: Any, step: int, meta: dict[str, Any] | None, keyframe: bool = False,
                  pairs: dict[str, str] | None = None, stopping: bool = False, whole: bool = False,
                  devices: dict[int, str] | None = None) -> CheckpointInfo:
        info = self.store._save(state, step=step, metadata=meta, keyframe=keyframe, _pairs=pairs,
                                _self_contained=whole, _devices=devices, _after=self._head)
        self._head = info.id
        # committed: an error of the retention below does not make it unsaved (async: set at submit already,
        # and no later save starts before this one is waited for)
        self.last_info, self.last_saved_step = info, step
        if self.retention is not None:
            self._apply_retention(collect=not stopping)
        return info

    def _apply_retention(self, collect: bool = True) -> None:
        """Runs after a commit: deletes first (one quick index commit), then thinning (a load and a rewrite
        of each checkpoint to thin), so a process killed while it thins has done the deletes. A checkpoint that
        another process deletes meanwhile (its retention, an operator's ``deltackpt rm``) is passed over. One
        that another process thinned meanwhile is thinned or deleted as this policy says: ``delete(id=)``
        follows a rewrite to its replacement."""
        assert self.retention is not None
        infos = self.store._listing()
        missing = None if self._warned_metric else unranked_metric(self.retention, infos)
        if missing is not None and missing[1]:  # (other metrics recorded, not this one: a typo?)
            self._warned_metric = True
            warnings.warn(f"deltackpt: Retention(keep_best) ranks by {missing[0]!r}, which no checkpoint's metadata "
                          f"records as a number (they record {', '.join(map(repr, missing[1]))}); only the other "
                          "rules keep checkpoints", RuntimeWarning, stacklevel=caller_level())
        plan = self.retention.plan(infos)
        by_id = {i.id: i for i in infos}
        self.store._delete([(None, cid) for cid in plan.delete], missing_ok=True)  # (one index commit)
        self._thin(plan.thin, by_id)
        if collect and self.gc:
            self._gc_if_due(sum(by_id[cid].written_bytes for cid in by_id.keys() - set(plan.delete)))

    def _gc_if_due(self, kept: int) -> None:
        """gc after retention, when due (:class:`~deltackpt.maintenance.GcAfterRetention`). Its trouble is not the
        save's: the checkpoint is committed, and training goes on. A store another process holds when gc starts
        (its gc, a repair) is tried again at the next save; a repack that stops partway (the lock not free within
        :data:`~deltackpt.maintenance.GC_WAIT` between two packs, a full disk) keeps what it freed, and the packs
        left are repacked by the next gc, when as much garbage again has built up; damage gc found is a warning."""
        try:
            report = self._gc_rule.gc_if_due(self.store, kept)
        except (DeltackptError, OSError) as exc:
            warnings.warn(f"deltackpt: gc after retention failed, what retention deleted still takes its space "
                          f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=caller_level())
            return
        for damage in report.damage() if report is not None else ():
            warnings.warn(f"deltackpt: gc after retention {damage}", RuntimeWarning, stacklevel=caller_level())

    def _thin(self, ids: list[str], by_id: dict[str, CheckpointInfo]) -> None:
        """Rewrite the checkpoints ``ids`` with their step and model weights only. Only checkpoints a Checkpointer
        wrote (a dict with ``step`` and ``model`` entries) are thinned: any other (a ``Store.save``, an import)
        has no weights this could tell apart, and is kept whole. A damaged one is kept as it is, with a
        warning: retention's deletes (done before thinning) stand, the gc after retention still runs, and this
        checkpointer does not try it again."""
        for cid in ids:
            info = by_id[cid]
            if cid in self._unthinnable:
                continue  # found damaged at an earlier save: not loaded again at every save
            try:
                layout = m = self.store.manifest(id=cid)
                with contextlib.suppress(Exception):  # (a registered type not built from tensor entries: load it)
                    layout = layout.skeleton()
                if not isinstance(layout, manifest.Manifest) and not _checkpointer_layout(layout):
                    continue
                # (_head=False: loading it must not change what the run, or another thread's save, descends from)
                full = self.store.load(id=cid, map_location="cpu", _head=False)
                if not _checkpointer_layout(full):
                    continue
                meta = dict(info.metadata or {})
                meta[THINNED_KEY] = True
                thinned = {"step": full.get("step"), "model": full.get("model"), "thinned": True}
                # loaded onto the CPU, but recorded on the devices they were saved from (a GPU model's weights)
                stored = {t.key: t.device for t in m.tensors if t.device != "cpu"}
                devices = {id(leaf.obj): stored[leaf.path] for leaf in flatten(thinned)[1] if leaf.path in stored}
                # keeps its place: "latest" stays the newest
                self.store.rewrite(thinned, id=cid, metadata=meta, _devices=devices)
            except CheckpointNotFoundError:
                continue
            except CorruptionError as exc:
                self._unthinnable.add(cid)
                warnings.warn(f"deltackpt: retention cannot thin checkpoint {cid} (step {info.step}), which is "
                              f"damaged; it stays as it is: {exc}", RuntimeWarning, stacklevel=caller_level())

    def wait(self) -> CheckpointInfo | None:
        """Block until the save in flight (if any) is committed; raise its error."""
        fut = self._inflight
        if fut is None:
            return None
        try:
            info = fut.result()
        except BaseException as exc:  # the save's own error, type and all (as Future.result raises it) ...
            if fut.cancelled():  # never ran: nothing reads the staging buffers
                self._inflight = None
                raise
            if not fut.done() or fut.exception() is not exc:
                # ... or not: the wait was interrupted (a KeyboardInterrupt, an exception from a signal handler
                # such as the DataLoader's for a worker that died). The save goes on reading the staging
                # buffers, so it stays in flight: the next save waits for it before it snapshots into them.
                raise
            self._inflight = None
            prev_step, prev_info = self._inflight_prev
            if self.last_info is prev_info:  # not committed (else only its retention failed): step() saves it again
                self.last_saved_step = prev_step
            if hasattr(exc, "add_note"):  # ... which says where it came from (Python 3.11+)
                exc.add_note(f"deltackpt: raised by the background save of step {self._inflight_step}")
            raise
        self._inflight = None
        return info

    def _raise_background_error(self) -> None:
        fut = self._inflight
        if fut is not None and fut.done() and fut.exception() is not None:
            self.wait()

    def close(self) -> None:
        """Wait for the last save and raise its error, if any; restore signal handlers; release the store.

        A SIGTERM or SIGINT that arrived after the last :meth:`step` (while the last save ran, say) is passed on
        then, as :meth:`step` would have: to the handler installed before the checkpointer (Python's SIGINT
        handler raises KeyboardInterrupt; the default action exits with status 128 + signal). Called on another
        thread while the loop's :meth:`step` or :meth:`save` runs, it waits for a synchronous save in progress;
        a save that had not started yet raises :class:`DeltackptError` ("the checkpointer is closed"). A close()
        that an exception interrupts (a second Ctrl-C while it waits) leaves the checkpointer closed to saves; call
        it again to finish releasing the store and the signal handlers. Once it has, close() does nothing."""
        with self._closing:  # (after a save starting on another thread has started, or before it checks)
            if self._released:
                return
            self._closed = True
        pending = self._signal if self._signal is not None else self._stopped_by if self in _stopped else None
        if self._rank_unsynced is not None:
            self._sync_rank_rng(self._rank_unsynced)
        beneath = {sig: self._beneath(sig) for sig in {*_delivered, pending}} if pending is not None else None
        failure: BaseException | None = None  # the last save's error: raised, after the signal is passed on
        try:
            try:
                self.wait()
            finally:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                self._staging = StagingBuffers()  # its buffers are a copy of the whole state: give the memory back
                self._restore_signals()
                if self._owns_store:
                    self.store.close()
                self._released = True
        except BaseException as exc:
            failure = exc
        self._signal = None
        _stopping.discard(self)
        _stopped.pop(self, None)
        if pending is not None and not any(c._signal == pending for c in _stopping):
            # (closed by a with block or a finally clause that an error is leaving, or the last save failed)
            error = failure if failure is not None else sys.exc_info()[1]
            try:
                self._pass_signal_on(pending, beneath)
            except SystemExit:
                if error is not None and not isinstance(error, SystemExit):
                    # Python prints nothing for the exit that replaces it: a save at the signal that failed, say
                    sys.stderr.write(f"deltackpt: exiting for {signal.Signals(pending).name}, passed on at close(),"
                                     " after this error:\n")
                    traceback.print_exception(type(error), error, error.__traceback__)
                raise
        if failure is not None:
            raise failure

    def __reduce__(self) -> Any:
        # (as Store's: its executor, locks and store handle do not travel)
        raise TypeError(f"a Checkpointer cannot be pickled (sent to a spawned process, a Pool's task, deep-copied): "
                        f"make one in that process, on the store's path {str(self.store.path)!r}, for the model "
                        "and optimizer that process trains")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise DeltackptError("the checkpointer is closed")

    @property
    def stop_requested(self) -> bool:
        """True from the arrival of a SIGTERM/SIGINT (with ``handle_signals``) until this checkpointer has saved
        for it and passed it on (then False again, if the handler it went to returned or ignored it)."""
        return self._signal is not None or self in _stopped

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the async staging buffers."""
        return self._staging.nbytes

    # -- signals ---------------------------------------------------------------------------------------------
    # Each checkpointer installs its handler over the one before it (kept in _previous). A signal flags the
    # checkpointer whose handler runs and the open checkpointers whose handlers lie directly beneath it (one
    # loop's several checkpointers, a GAN's two say), so that each saves at its next step(): the same step. The
    # signal is passed on to the first handler beneath them that is no checkpointer's once all of them have
    # saved, or once one that saved reaches its next step first (the others are not being stepped), or closes.
    # A closed checkpointer's handler that close() could not take down (another was installed over it, or it
    # closed off the main thread) passes signals straight on. Handlers run on the main thread: a checkpointer
    # stepped on another thread hands the passing on to it.

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("Checkpointer: signal handlers can only be installed from the main thread; "
                          "SIGTERM/SIGINT will not trigger a save", RuntimeWarning, stacklevel=caller_level())
            return
        self._pid = os.getpid()
        for sig in sorted(STOP_SIGNALS):  # (SIGINT, SIGTERM)
            handler = self._handlers[sig] = _StopHandler(self)
            self._previous[sig] = handler.previous = signal.signal(sig, handler)
        self._handling = True
        # collected unclosed (nothing but its handlers referred to it): its loaders' workers are released
        weakref.finalize(self, _unquiet, self._quieted, None).atexit = False
        # a ResumableLoader's DataLoader, a ResumableSampler's (that of the ResumableLoader driving it), or one as is
        loader = getattr(self.data, "loader", None)
        if loader is None:
            loader = getattr(self.data, "dataloader", None)
        self._quiet(self.data if loader is None else loader)
        hooks = getattr(self.data, "_on_dataloader", None)  # (a ResumableSampler: its loaders built from now on)
        if isinstance(hooks, list):
            hooks.append(weakref.WeakMethod(self._quiet_while_open))

    def _quiet_while_open(self, loader: Any) -> None:
        """:meth:`_quiet` a DataLoader that a ResumableLoader made after this checkpointer drives its sampler in."""
        if not self._closed and self._handling:
            self._quiet(loader)

    def protect_workers(self, *loaders: Any) -> None:
        """Make the workers of these DataLoaders (an evaluation loader, say; the one given as ``data`` already
        is) ignore SIGINT, and SIGTERM until :meth:`close` (workers still running then keep ignoring SIGINT),
        so that a stop signal sent to the whole job does not
        end them and make the DataLoader raise before the step boundary where this checkpointer saves. It wraps
        each loader's ``worker_init_fn``, which runs when workers start: a loader with ``persistent_workers``
        whose workers already run gets it at its next start. Nothing is done when this checkpointer does not
        handle signals (``handle_signals=False``, or made off the main thread). A ``ResumableLoader`` stands for
        its DataLoader; anything else that is not a DataLoader is refused with ``TypeError``."""
        self._check_open()
        for loader in loaders:
            loader = getattr(loader, "loader", loader)
            if not isinstance(loader, torch.utils.data.DataLoader):
                raise TypeError(f"protect_workers takes DataLoaders, not {type(loader).__name__}")
            if self._handling:
                self._quiet(loader)

    def _quiet(self, loader: Any) -> None:
        """Wrap ``loader``'s ``worker_init_fn`` (a torch DataLoader, or a subclass, with workers) so its workers
        ignore stop signals; :meth:`_restore_signals` puts the loader's own back once no open checkpointer
        protects it (two of a loop's checkpointers may both have)."""
        if not isinstance(loader, torch.utils.data.DataLoader) or not loader.num_workers:
            return
        wrapper = loader.worker_init_fn
        if not isinstance(wrapper, WorkersIgnoreStopSignals):
            wrapper = loader.worker_init_fn = WorkersIgnoreStopSignals(wrapper)
            if hasattr(signal, "pthread_sigmask"):
                loader._get_iterator = wrapper.starting(loader._get_iterator)  # type: ignore[method-assign]
        if self not in wrapper.owners:
            wrapper.owners.add(self)
            self._quieted.append(loader)

    def _restore_signals(self) -> None:
        """Where this checkpointer's handler is the one installed, put back the one before it (skipping closed
        checkpointers' handlers). Elsewhere (off the main thread, or under another handler) it stays, and
        passes signals on once the checkpointer is closed."""
        _unquiet(self._quieted, self)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in list(self._previous.items()):
            if signal.getsignal(sig) is self._handlers.get(sig):
                # (past closed and collected checkpointers' handlers)
                while isinstance(handler, _StopHandler) and ((owner := handler.ref()) is None or owner._closed):
                    handler = handler.previous
                signal.signal(sig, handler)
                del self._previous[sig]

    def _chained(self, signum: int) -> list[Checkpointer]:
        """The open checkpointers whose handlers lie directly beneath this one's (no other handler between; the
        handlers of checkpointers collected unclosed pass over)."""
        out: list[Checkpointer] = []
        handler = self._previous.get(signum)
        while isinstance(handler, _StopHandler):
            if (owner := handler.ref()) is not None and not owner._closed:
                out.append(owner)
            handler = handler.previous
        return out

    def _beneath(self, signum: int) -> Any:
        """The first handler beneath this one's that is no checkpointer's: where the signal goes once saved."""
        handler = self._previous.get(signum, signal.SIG_DFL)
        while isinstance(handler, _StopHandler):
            handler = handler.previous
        return handler

    def _on_signal(self, signum: int, frame: Any) -> None:
        if _take_forwarded(signum, frame):  # handed over by a checkpointer stepped on another thread
            return
        if os.getpid() != self._pid:  # inherited by a forked child (a Pool's, a DataLoader's worker): nothing
            if dataloader_worker():
                # A stop signal sent to the whole job (SLURM's, a process group's) reaches the DataLoader's workers
                # too: the training process needs them for the batches up to its step boundary, where it saves, and
                # they end with it (the DataLoader shuts them down, or they see it gone)
                return
            _pass_to(self._beneath(signum), signum, frame, kill=True)  # here saves, so it goes straight on
            return
        if self._closed:
            _pass_to(self._previous.get(signum, signal.SIG_DFL), signum, frame)
            return
        if signum == signal.SIGINT and signal.SIGINT in _delivered:
            # a second Ctrl-C: do not wait for the step boundary (unless Ctrl-C was ignored before)
            if self._beneath(signum) == signal.SIG_IGN:
                return
            _end_round()  # the interrupt is what passes it on: nothing is pending any more
            self._restore_signals()
            raise KeyboardInterrupt
        _delivered.append(signum)
        for ckpt in (self, *self._chained(signum)):
            if ckpt._signal is None:
                ckpt._signal = signum
                _stopping.add(ckpt)

    def _saved_at_signal(self, step: int) -> None:
        """This checkpointer saved ``step`` at its signal. The signal is passed on once every checkpointer flagged
        with it saved, all at the same step; one that saved an earlier step saves again at its next."""
        signum = self._signal
        assert signum is not None
        self._signal = None
        _stopping.discard(self)
        self._stopped_by = signum
        _stopped[self] = step
        if not any(c._signal == signum for c in _stopping) and len(set(_stopped.values())) == 1:
            self._pass_signal_on(signum)

    def _pass_signal_on(self, signum: int, beneath: Mapping[int, Any] | None = None) -> None:
        """Hand the signals that arrived (``signum`` at least), in order, to the handler beneath the
        checkpointers (``beneath``, when close() found them already). The default action exits with status
        128 + signal (Python's SIGINT handler raises KeyboardInterrupt); a handler that returns, or SIG_IGN,
        lets the run go on, still watching."""
        signals = list(_delivered) or [signum]
        _end_round()
        ending = False  # a signal handed to the main thread whose default action ends the process
        for sig in signals:
            handler = beneath[sig] if beneath is not None and sig in beneath else self._beneath(sig)
            if threading.current_thread() is not threading.main_thread():
                if handler != signal.SIG_IGN:
                    _forward.append((sig, handler))
                    # to the main thread, which runs the handler installed (it passes the signal on) at once, even
                    # in a join() of this thread (a signal raised here would interrupt nothing there)
                    signal.pthread_kill(threading.main_thread().ident or 0, sig)
                    ending |= handler is signal.default_int_handler or not callable(handler)
                continue
            _pass_to(handler, sig, None)
        if ending:
            # this (the loop's) thread waits for the end rather than train on while the main thread gets to run
            # the handler (a step or more on a busy machine); bounded, should the main thread be held up for good
            threading.Event().wait(_ENDING_WAIT)


__all__ = ["Checkpointer", "Members", "Stateful", "rng_state", "set_rng_state"]
