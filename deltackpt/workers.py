"""DataLoader workers through a job's stop signal: kept alive until the save at the next step boundary.

Where it sits: beside a :class:`~deltackpt.Checkpointer` that handles SIGTERM and SIGINT. A stop signal sent to
a whole job (SLURM's, or Ctrl-C to the foreground process group) reaches a DataLoader's workers too, and one that
ends makes the loader raise in the training process before the checkpointer saves. The checkpointer wraps a
protected loader's ``worker_init_fn`` in :class:`WorkersIgnoreStopSignals` and starts its workers through
:meth:`WorkersIgnoreStopSignals.starting`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

#: what a job's stop looks like to a DataLoader's workers
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})

#: wrappers not yet released: the training process releases them at exit, before ``multiprocessing`` stops its
#: workers (an atexit hook registered after multiprocessing's runs before it)
_unreleased: weakref.WeakSet[WorkersIgnoreStopSignals] = weakref.WeakSet()
_release_hooked = False
#: guards the one-time registration of :func:`_release_at_exit`
_hook_lock = threading.Lock()


class WorkersIgnoreStopSignals:
    """``worker_init_fn`` of the DataLoader a checkpointer that handles signals was given (wrapping the loader's
    own): its workers ignore SIGINT, and SIGTERM until they are released. A stop signal sent to the whole job
    (SLURM signals every process of a job step; Ctrl-C the foreground process group) would otherwise end them
    (torch installs its own SIGTERM handler in each worker) and the DataLoader would raise in the training
    process before the step boundary where the checkpointer saves.

    Released (:meth:`release`: the checkpointer closes, or the training process exits), a worker ends at SIGTERM
    again, with status 0 as torch's do at their parent's: at interpreter exit ``multiprocessing`` stops the
    daemonic workers it still has (a ``persistent_workers`` loader's, or an iterator a generator holds) with
    SIGTERM and waits for them without a timeout, and workers ignoring it hung the exit for good. The release
    is one byte down a pipe whose read end each worker polls when a SIGTERM comes; it works for every start
    method (a ``spawn`` worker gets the read end when the wrapper is pickled) and needs no lock a signal
    handler could wait on."""

    def __init__(self, fn: Callable[[int], None] | None) -> None:
        import multiprocessing

        self.fn = fn
        #: the stop signals the training process had blocked already when it started the workers
        self._blocked_before: frozenset[int] = frozenset()
        #: the open checkpointers that protect the loader (it is released when the last one closes)
        self.owners: weakref.WeakSet[Any] = weakref.WeakSet()
        self._released, self._release = multiprocessing.Pipe(duplex=False)
        self._pid = os.getpid()  # the training process: the only one whose release() releases the workers
        _hook_release()
        _unreleased.add(self)

    def __getstate__(self) -> dict[str, Any]:  # (a spawned worker gets the read end only)
        return {"fn": self.fn, "_released": self._released, "_blocked_before": self._blocked_before}

    def starting(self, get_iterator: Callable[[], Any]) -> Callable[[], Any]:
        """The loader's ``_get_iterator`` (which starts its workers), run with SIGINT and SIGTERM blocked. A
        forked worker inherits the signal mask and unblocks them in :meth:`__call__` once its handlers are in
        place: a stop signal sent to the whole job while it starts waits for them instead of ending it (torch
        sets ``get_worker_info`` only after seeding and imports, so the handler the worker inherits could not
        tell it from another child). A spawned or forkserver worker does not inherit the mask (Python's process
        launch resets it). The training process takes the signals when it unblocks them, at once."""
        def start() -> Any:
            before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            self._blocked_before = frozenset(STOP_SIGNALS & set(before))
            try:
                return get_iterator()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return start

    def release(self) -> None:
        """From now on the workers end at SIGTERM (those running and those started later). Nothing in a process
        forked from the training process (its exit hook, or a close() of the checkpointer it inherited, ran this
        and released the parent's workers before the parent's own step boundary)."""
        _unreleased.discard(self)
        if os.getpid() != self._pid:
            return
        try:
            self._release.send_bytes(b"r")
        except OSError:  # (the pipe is gone: a worker sees it closed, which releases it too)
            pass

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if hasattr(signal, "pthread_sigmask"):  # (blocked by starting(): a signal that came meanwhile arrives now)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS - self._blocked_before)
        if self.fn is not None:
            self.fn(worker_id)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        try:
            released = self._released.poll()  # a byte, or the write end closed everywhere (the parent gone)
        except (OSError, EOFError):
            released = True
        if released:  # end as torch's workers do at their parent's SIGTERM (status 0: no "worker killed" error)
            os._exit(0)


def _hook_release() -> None:
    """Register :func:`_release_at_exit` once, to run before ``multiprocessing`` stops the workers at exit."""
    global _release_hooked
    with _hook_lock:
        if not _release_hooked:
            import atexit
            import multiprocessing.util  # noqa: F401  (its exit function registered first, so it runs after ours)

            atexit.register(_release_at_exit)
            _release_hooked = True


def _release_at_exit() -> None:
    for wrapper in list(_unreleased):
        wrapper.release()


def dataloader_worker() -> bool:
    """Whether this process is a worker of a torch DataLoader (forked from a process with a checkpointer)."""
    data = sys.modules.get("torch.utils.data")
    try:
        return data is not None and data.get_worker_info() is not None
    except Exception:  # (a torch without get_worker_info: not knowable, so not a worker)
        return False
