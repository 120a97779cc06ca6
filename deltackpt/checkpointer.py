"""Training-loop integration: capture, interval and signal-triggered saves, async saves, exact resume, retention.

Where it sits: between a training loop and a :class:`~deltackpt.Store`. ``step(n)`` decides whether a save is
due; a save captures the whole training state (model, optimizers, schedulers, AMP scaler, data position, RNG
states, user objects), copies its tensors into reusable staging buffers, and hands that snapshot to a
background thread that runs ``Store.save`` and then the retention policy. ``restore()`` loads a checkpoint and
puts every piece back, so a resumed run continues as if it had never stopped.

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
import functools
import os
import random
import signal
import sys
import threading
import traceback
import warnings
import weakref
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from deltackpt import _lazy, config, maintenance, manifest, staging, tree
from deltackpt.errors import (
    CheckpointNotFoundError,
    CorruptionError,
    DeltackptError,
    ShapeMismatchError,
    StoreLockedError,
    UnsupportedTypeError,
)
from deltackpt.retention import THINNED_KEY, Retention, unranked_metric
from deltackpt.store import (
    CheckpointInfo,
    Store,
    _check_metadata,
    _check_step,
)
from deltackpt.tree import (
    Encoded,
    _dtype_name,
    alias_key,
    child_path,
    decode_plain,
    dtype_named,
    encode_plain,
    encode_registered,
    flatten,
    registered_types,
    unstorable,
)

if TYPE_CHECKING:
    import torch
else:
    torch = _lazy.module("torch", globals())

_SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: seconds gc after retention waits for a store another process holds (its gc or repair) before it gives up until
#: the next save
GC_WAIT = 1.0

class _GcAfterRetention:
    """The rule that runs gc after retention, for :class:`Checkpointer` and the DCP writer: once the bytes that
    the checkpoints deleted or thinned since a store's last gc wrote (the store counts them, whichever process
    deleted them: :meth:`Index.dropped_bytes`) reach a quarter of what the kept ones wrote, and at least
    ``DELTACKPT_GC_MIN_BYTES`` (read when this is made). A gc that failed is tried again once as much more is
    dropped, not at every save."""

    def __init__(self) -> None:
        self.min_bytes = config.gc_min_bytes()
        #: per store: the count that stands for none here (where a gc failed; 0 after one ran)
        self._floor: dict[os.PathLike[str], int] = {}

    def collect(self, store: Store, kept: int) -> maintenance.GcReport | None:
        """gc ``store`` if it is due (``kept``: the bytes the kept checkpoints wrote); None when it is not, or
        another process holds the store for longer than :data:`GC_WAIT` when gc starts (tried again at the next
        save; a repack stopped later is in the report, ``repack_stopped``). Raises what gc raises."""
        dropped = store.index.dropped_bytes()
        floor = self._floor[store.path] = min(self._floor.get(store.path, 0), dropped)  # (a gc elsewhere zeroed it)
        if dropped <= floor or dropped - floor < max(self.min_bytes, kept // 4):
            return None
        try:
            report = store.gc(timeout=GC_WAIT)
        except StoreLockedError:
            return None
        except (DeltackptError, OSError):
            self._floor[store.path] = dropped
            raise
        self._floor[store.path] = 0
        return report


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


def _owner(handler: Any) -> Checkpointer | None:
    """The checkpointer whose signal handler ``handler`` is, if it is one."""
    owner = getattr(handler, "__self__", None)
    if isinstance(owner, Checkpointer) and getattr(handler, "__func__", None) is Checkpointer._on_signal:
        return owner
    return None


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


class _WorkersIgnoreStopSignals:
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
            before = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            self._blocked_before = frozenset(_STOP_SIGNALS & set(before))
            try:
                return get_iterator()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return start

    def release(self) -> None:
        """From now on the workers end at SIGTERM (those running and those started later)."""
        _unreleased.discard(self)
        try:
            self._release.send_bytes(b"r")
        except OSError:  # (the pipe is gone: a worker sees it closed, which releases it too)
            pass

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if hasattr(signal, "pthread_sigmask"):  # (blocked by starting(): a signal that came meanwhile arrives now)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS - self._blocked_before)
        if self.fn is not None:
            self.fn(worker_id)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        try:
            released = self._released.poll()  # a byte, or the write end closed everywhere (the parent gone)
        except (OSError, EOFError):
            released = True
        if released:  # end as torch's workers do at their parent's SIGTERM (status 0: no "worker killed" error)
            os._exit(0)


#: what a job's stop looks like to a DataLoader's workers
_STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})

#: wrappers not yet released: the training process releases them at exit, before ``multiprocessing`` stops its
#: workers (an atexit hook registered after multiprocessing's runs before it)
_unreleased: weakref.WeakSet[_WorkersIgnoreStopSignals] = weakref.WeakSet()
_release_hooked = False


def _hook_release() -> None:
    global _release_hooked
    with _exit_hook:
        if not _release_hooked:
            import atexit
            import multiprocessing.util  # noqa: F401  (its exit function registered first, so it runs after ours)

            atexit.register(_release_at_exit)
            _release_hooked = True


def _release_at_exit() -> None:
    for wrapper in list(_unreleased):
        wrapper.release()


def _dataloader_worker() -> bool:
    """Whether this process is a worker of a torch DataLoader (forked from a process with a checkpointer)."""
    data = sys.modules.get("torch.utils.data")
    try:
        return data is not None and data.get_worker_info() is not None
    except Exception:  # (a torch without get_worker_info: not knowable, so not a worker)
        return False


def _forget_saves_after_fork() -> None:
    """A forked child (a DataLoader's or a Pool's worker) inherits the parent's saves in flight, but not the threads
    running them: its exit must not wait for them (it used to, forever). Nor is the parent's restore of the RNG
    states one of the child's checkpointers could wind back."""
    global _rng_owner
    _async.clear()
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


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Stateful(Protocol):
    """What a :class:`Checkpointer` saves and restores: a model, optimizer, LR scheduler, ``GradScaler``, data
    loader, or any object with these two methods."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


#: one stateful object, or several in a list, tuple or dict (``model=[encoder, decoder]``)
Members = Stateful | Sequence[Stateful] | Mapping[Any, Stateful]


def _group(obj: Any, what: str = "object") -> Any:
    """One stateful object, or a list/tuple/dict of them (each member checked: TypeError naming it)."""
    if obj is None:
        return None
    if _stateful(obj):
        return obj
    if isinstance(obj, Mapping):
        group: Any = {str(k): v for k, v in obj.items()}
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        group = list(obj)
    else:
        raise TypeError(f"{what}: {type(obj).__name__} has no state_dict()/load_state_dict()")
    for path, member in _members(group, what):
        if not _stateful(member):
            raise TypeError(f"{path}: {type(member).__name__} has no state_dict()/load_state_dict()")
    return group


def _tensors_of(obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a module's parameters and buffers; nothing for other stateful objects."""
    if isinstance(obj, torch.nn.Module):
        yield from obj.named_parameters()
        yield from ((k, v) for k, v in obj.named_buffers() if v is not None)


def _group_state(g: Any) -> Any:
    if g is None:
        return None
    if isinstance(g, dict):
        return {k: v.state_dict() for k, v in g.items()}
    if isinstance(g, list):
        return [v.state_dict() for v in g]
    return g.state_dict()


def _members(g: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(key path of its state dict, object) of each member of a group (see :func:`_group`)."""
    if isinstance(g, dict):
        for k, v in g.items():
            yield child_path(path, k), v
    elif isinstance(g, list):
        for i, v in enumerate(g):
            yield child_path(path, i), v
    elif g is not None:
        yield path, g


def _param_pairs(model: Any, optimizer: Any) -> dict[str, str]:
    """Which parameter each optimizer state belongs to, as key paths of :meth:`Checkpointer.capture`'s state:
    ``optimizer.state[3]`` -> ``model.blocks.0.attn.weight``. The store pairs them for predicted frames
    (:func:`deltackpt.predict.plan`), exactly, where guessing from shapes and order fails: frozen parameters,
    an EMA copy of the weights, parameter groups in another order than the model's."""
    names: dict[int, str] = {}
    for mpath, module in _members(model, "model"):
        named = getattr(module, "named_parameters", None)
        if callable(named):
            for name, param in named():
                names.setdefault(id(param), child_path(mpath, name))
    pairs: dict[str, str] = {}
    for opath, opt in _members(optimizer, "optimizer"):
        groups = getattr(opt, "param_groups", None)
        if not isinstance(groups, list):
            continue
        # torch numbers the states of an optimizer's state_dict by position over all its groups' params
        params = [p for group in groups for p in group.get("params", ())]
        for i, param in enumerate(params):
            name = names.get(id(param))
            if name is not None:
                pairs[child_path(child_path(opath, "state"), i)] = name
    return pairs


def _group_check(g: Any, state: Any, what: str) -> None:
    """Raise unless ``state`` holds a state for every member of group ``g`` (loading nothing)."""
    if g is None:
        return
    if state is None:
        raise DeltackptError(f"the checkpoint holds no {what} state")
    if isinstance(g, dict):
        missing = [k for k in g if not isinstance(state, Mapping) or k not in state]
        if missing:
            raise DeltackptError(f"the checkpoint holds no {what} state for {', '.join(map(repr, missing))}")
    elif isinstance(g, list):
        if not isinstance(state, (list, tuple)):
            raise DeltackptError(f"the checkpoint holds one {what} state or a dict of them, not a list; this run "
                                 f"has a list of {len(g)}")
        if len(state) != len(g):
            raise DeltackptError(f"the checkpoint holds {len(state)} {what} states, this run has {len(g)}")
    elif isinstance(state, (list, tuple)):
        raise DeltackptError(f"the checkpoint holds a list of {len(state)} {what} states, this run has one {what}"
                             " (give the Checkpointer a list, as the run that saved did)")
    elif (isinstance(state, Mapping) and state and all(isinstance(v, Mapping) for v in state.values())
          and (isinstance(g, torch.optim.Optimizer)
               or (type(g).__module__.startswith("torch.") and not isinstance(g, torch.nn.Module)))):
        # One of torch's optimizers, schedulers or scalers, and the checkpoint's state for it holds only states
        # and none of the keys its own state_dict() has: a dict of several was saved, which its load_state_dict
        # would fail on (optimizers, scalers) or take in as attributes (schedulers). A model is checked key by
        # key (_fit_check); other objects' states may be anything.
        try:
            mine = g.state_dict()
        except Exception:  # (one that cannot tell now, ZeroRedundancyOptimizer say: its loading will)
            mine = None
        if isinstance(mine, Mapping) and mine and not set(state) & set(mine):
            raise DeltackptError(
                f"the checkpoint holds a dict of {what} states ({', '.join(map(repr, list(state)[:4]))}), this run "
                f"has one {what} (give the Checkpointer a dict, as the run that saved did)")


def _present(g: Any, state: Any, what: str) -> tuple[Any, list[str]]:
    """The members of group ``g`` that the saved ``state`` holds a state for (a group like ``g``, or None), and
    the names of those it lacks: a whole component, or members of a dict of them."""
    if g is None:
        return None, []
    if state is None:
        return None, [what]
    if isinstance(g, dict) and isinstance(state, Mapping):
        return {k: v for k, v in g.items() if k in state}, [f"{what}[{k!r}]" for k in g if k not in state]
    return g, []


def _with_states(g: Any, state: Any) -> list[tuple[str, Any, Any]]:
    """(name, member, its saved state) of each member of a group (after :func:`_group_check`)."""
    if isinstance(g, dict):
        return [(f"[{k!r}]", v, state[k]) for k, v in g.items()]
    if isinstance(g, list):
        return [(f"[{i}]", v, s) for i, (v, s) in enumerate(zip(g, state))]
    return [("", g, state)]


def _loads_as_saved(module: torch.nn.Module, *, keys: bool) -> bool:
    """Whether ``module.load_state_dict`` takes the saved tensors' shapes (``keys``: and keys) as they are: no
    load hook (a pre-hook may rename or convert; a post-hook may forgive a missing key) and no
    ``_load_from_state_dict`` of its own (for shapes, torch's own modules' are fine: BatchNorm's only adds a
    key that old checkpoints lack)."""
    base = torch.nn.Module
    if type(module).load_state_dict is not base.load_state_dict:
        return False
    for m in module.modules():
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
            return False
        own = type(m)._load_from_state_dict
        if (own is not base._load_from_state_dict and own not in _known_loaders()
                and (keys or not own.__module__.startswith("torch.nn."))):
            return False
    return True


@functools.cache
def _known_loaders() -> frozenset[Any]:
    """torch's own ``_load_from_state_dict`` overrides whose effect on keys :func:`_forgiven_keys` knows: batch
    norm fills in a missing ``num_batches_tracked`` from a state of version < 2; instance norm only refuses more
    (running statistics for a module that does not track them). (A function: importing deltackpt imports no
    torch.)"""
    return frozenset({torch.nn.modules.batchnorm._NormBase._load_from_state_dict,
                      torch.nn.modules.instancenorm._InstanceNorm._load_from_state_dict})


def _kind_of(saved: Any) -> str:
    """What a saved value is, for an error: "a list of 2", "a tensor", "an int"."""
    if isinstance(saved, (list, tuple)):
        return f"a {type(saved).__name__} of {len(saved)}"
    if isinstance(saved, (torch.Tensor, manifest.TensorEntry)):
        return "a tensor"
    name = type(saved).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _forgiven_keys(module: torch.nn.Module, saved: Any, mine: Any) -> set[str]:
    """The keys of ``mine`` that ``module.load_state_dict`` does not need in ``saved``: the ``num_batches_tracked``
    of a batch norm that tracks running statistics, where the module's version in the saved state's metadata
    (this run's, for a checkpoint that kept none: :func:`_group_load`) is below 2."""
    meta = getattr(saved, "_metadata", None)
    if not isinstance(meta, Mapping):
        meta = getattr(mine, "_metadata", None) or {}
    forgiven = set()
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
            version = (meta.get(name) or {}).get("version")
            if not isinstance(version, int) or version < 2:
                forgiven.add(f"{name}.num_batches_tracked" if name else "num_batches_tracked")
    return forgiven


#: per-parameter state of torch's own optimizers that has the parameter's shape (Adam's moments, SGD's momentum,
#: RMSprop's, Adagrad's, Adadelta's, Adamax's, Rprop's, ASGD's)
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
                           "sum", "acc_delta", "exp_inf", "prev", "step_size", "ax"})


def _fit_check(g: Any, state: Any, what: str, live: Any = None) -> None:
    """Raise ShapeMismatchError where ``load_state_dict`` would refuse a saved state that does not fit this
    run's model (a key missing or unexpected, another shape) or optimizer (another number of parameter groups
    or of parameters in one), before anything is loaded: a restore decodes into the model's own tensors, and a
    refusal after that would leave the model holding part of the checkpoint; for torch's own optimizers also
    another kind of optimizer's hyperparameters, and moments not of their parameter's shape (the parameters in
    another order). ``state`` may hold tensor entries (a skeleton); ``live`` is the group's state dicts when
    the caller has them (:func:`_group_state`). Where hooks or a member's own
    loading code may accept what looks like a mismatch, it is left to ``load_state_dict``."""
    if g is None:
        return
    lives = None if live is None else _with_states(g, live)
    for n, (name, member, saved) in enumerate(_with_states(g, state)):
        where = f"{what}{name}"
        if isinstance(member, (torch.nn.Module, torch.optim.Optimizer)) and not isinstance(saved, Mapping):
            raise ShapeMismatchError(f"{where}: the checkpoint holds {_kind_of(saved)} there, not the state_dict "
                                     f"of a {type(member).__name__}")
        if isinstance(member, torch.nn.Module) and isinstance(saved, Mapping):
            mine = member.state_dict() if lives is None else lives[n][2]
            _warn_converted(where, mine, saved)  # (load hooks or not: load_state_dict's copies convert)
            if not _loads_as_saved(member, keys=False):
                continue
            for k, v in mine.items():
                shape = getattr(saved.get(k), "shape", None)
                if (type(v) in (torch.Tensor, torch.nn.Parameter) and shape is not None
                        and list(shape) != list(v.shape) and not (v.dim() == 0 and list(shape) == [1])):
                    raise ShapeMismatchError(f"{where}: {k!r} has shape {tuple(shape)} in the checkpoint, "
                                             f"{tuple(v.shape)} in this run")
            if _loads_as_saved(member, keys=True):
                forgiven = _forgiven_keys(member, saved, mine)
                missing = [k for k in mine if k not in saved and k not in forgiven]
                unexpected = [k for k in saved if k not in mine]
                if missing or unexpected:
                    raise ShapeMismatchError(f"{where} does not match the checkpoint: missing in the checkpoint "
                                             f"{missing[:5]}, not in this run {unexpected[:5]}"
                                             f"{_wrapper_hint(list(mine), list(saved))}")
        elif isinstance(member, torch.optim.Optimizer) and isinstance(saved, Mapping):
            groups = saved.get("param_groups")
            if (getattr(member, "_optimizer_load_state_dict_pre_hooks", None)
                    or type(member).load_state_dict is not torch.optim.Optimizer.load_state_dict):
                continue
            if not isinstance(groups, (list, tuple)):
                raise ShapeMismatchError(f"{where}: the checkpoint's state there has no parameter groups (keys "
                                         f"{list(saved)[:4]}): not the state_dict of a {type(member).__name__}")
            if len(groups) != len(member.param_groups):
                raise ShapeMismatchError(f"{where}: the checkpoint has {len(groups)} parameter groups, this run "
                                         f"{len(member.param_groups)}")
            builtin = type(member).__module__.startswith("torch.optim")
            states = saved.get("state")
            for i, (sg, lg) in enumerate(zip(groups, member.param_groups)):
                params = sg.get("params") if isinstance(sg, Mapping) else None
                if isinstance(params, (list, tuple)) and len(params) != len(lg["params"]):
                    raise ShapeMismatchError(f"{where}: parameter group {i} has {len(params)} parameters in the "
                                             f"checkpoint, {len(lg['params'])} in this run")
                if not builtin or not isinstance(params, (list, tuple)):
                    continue
                # torch's own optimizers: hyperparameters that differ both ways are another optimizer's, and so is
                # a group that lacks a number of this one's (AdamW's betas, SGD's momentum): newer torch versions
                # only add some, which older checkpoints lack, and those are switches (bool or None); a group's
                # own keys are not among the defaults. Torch would load them and fail at the first step (SGD's
                # KeyError 'momentum', AdamW's KeyError 'step' for a custom optimizer's state)
                extra, lacking = set(sg) - set(lg), (set(lg) - set(sg)) & set(member.defaults)
                numbers = sorted(k for k in lacking if member.defaults[k] is not None
                                 and not isinstance(member.defaults[k], bool))
                if lacking and (extra or numbers):
                    has = f"has {sorted(extra)[:4]} and " if extra else ""
                    raise ShapeMismatchError(f"{where}: parameter group {i} of the checkpoint {has}lacks "
                                             f"{(numbers or sorted(lacking))[:4]} of this run's "
                                             f"{type(member).__name__}: saved by another kind of optimizer?")
                for n, (pid, p) in enumerate(zip(params, lg["params"])):
                    st = states.get(pid) if isinstance(states, Mapping) else None
                    if not isinstance(st, Mapping) or torch.nn.parameter.is_lazy(p):  # (no shape yet)
                        continue
                    for k in sorted(_PARAM_SHAPED & set(st)):
                        shape = getattr(st[k], "shape", None)
                        if shape is not None and len(shape) > 0 and list(shape) != list(p.shape):
                            raise ShapeMismatchError(
                                f"{where}: parameter {n} of group {i} has {k!r} of shape {tuple(shape)} in the "
                                f"checkpoint, and is of shape {tuple(p.shape)} in this run (parameters in "
                                "another order?)")


#: what torch's own LR schedulers take out of a saved state when they load it (a KeyError without it): the states
#: of the schedulers that SequentialLR and ChainedScheduler drive, LambdaLR's and MultiplicativeLR's lambdas
_SCHEDULER_LISTS = ("_schedulers", "lr_lambdas")
#: public attributes of torch's LR schedulers that torch versions added or dropped (``verbose``, deprecated)
_SCHEDULER_VERSIONED = frozenset({"verbose"})


def _scheduler_check(g: Any, state: Any) -> None:
    """Raise, before anything is loaded, where torch's own LR schedulers would raise loading the saved state (a
    KeyError or IndexError, once the model holds the checkpoint): another kind of scheduler's state, such as a
    StepLR's where this run has a SequentialLR (a warmup added since the checkpoint), or another number of
    chained schedulers or of lambdas. Other differences their loading takes as it is (it updates attributes)."""
    if g is None:
        return
    for name, member, saved in _with_states(g, state):
        _one_scheduler_check(member, saved, f"scheduler{name}")


def _one_scheduler_check(member: Any, saved: Any, where: str) -> None:
    if not type(member).__module__.startswith("torch.optim") or not isinstance(saved, Mapping):
        return
    for key in _SCHEDULER_LISTS:
        mine = getattr(member, key, None)
        if not isinstance(mine, list):
            continue
        theirs = saved.get(key)
        if not isinstance(theirs, (list, tuple)):
            raise ShapeMismatchError(f"{where}: this run's {type(member).__name__} loads {key!r}, which the "
                                     "checkpoint's scheduler state lacks: saved by another kind of scheduler?")
        if len(theirs) != len(mine):
            raise ShapeMismatchError(f"{where}: {key!r} has {len(theirs)} entries in the checkpoint, "
                                     f"{len(mine)} in this run's {type(member).__name__}")
        if key == "_schedulers":
            for i, (m, t) in enumerate(zip(mine, theirs)):
                _one_scheduler_check(m, t, f"{where}._schedulers[{i}]")
    # Which scheduler a state is of shows in its public attributes (StepLR's step_size and gamma, a cosine's
    # T_max and eta_min); torch loads any state as attributes, silently. Attributes that differ both ways are
    # another kind's; one way, they may also be another torch version's (it adds and drops some), so that warns.
    try:
        live = member.state_dict()
    except Exception:  # (its own loading will tell)
        live = None
    if isinstance(live, Mapping):
        ours, kept = (
            {k for k in d if isinstance(k, str) and not k.startswith("_") and k not in _SCHEDULER_VERSIONED}
            for d in (live, saved))
        extra, lacking = sorted(kept - ours), sorted(ours - kept)
        kind = type(member).__name__
        if extra and lacking:
            raise ShapeMismatchError(f"{where}: the checkpoint's scheduler state has {extra[:4]} and lacks "
                                     f"{lacking[:4]} of this run's {kind}: saved by another kind of scheduler?")
        if extra or lacking:
            differs = f"has {extra[:4]}, which" if extra else f"lacks {lacking[:4]}, which"
            warnings.warn(f"deltackpt: {where}: the checkpoint's scheduler state {differs} this run's {kind} "
                          f"{'does not have' if extra else 'has'}: saved by another kind of scheduler (or another "
                          "torch version)? It is loaded as it is, as torch loads it", RuntimeWarning,
                          stacklevel=_caller_level())


#: what wrapping a model adds to its state_dict() keys, and who adds it
_WRAPPER_PREFIXES = {"_orig_mod.": ("torch.compile", "_orig_mod"),
                     "module.": ("DistributedDataParallel or DataParallel", "module")}


def _wrapper_hint(mine: list[str], saved: list[str]) -> str:
    """Why the keys differ, when they differ only by a wrapper's prefix (of the whole model, or of submodules:
    ``block._orig_mod.weight`` when only ``block`` was compiled): "; the checkpoint's keys ..." or ""."""
    for prefix, (who, attr) in _WRAPPER_PREFIXES.items():
        inner = "." + prefix
        for keys, other, whose, saving in ((saved, mine, "the checkpoint's", "the run that saved"),
                                           (mine, saved, "this run's", "this run")):
            unwrapped = {k.removeprefix(prefix).replace(inner, ".") for k in keys}
            if not keys or unwrapped != set(other) or set(keys) == set(other):
                continue
            if all(k.startswith(prefix) for k in keys):
                return (f"; {whose} keys all start with {prefix!r}, as {who} names them: give the Checkpointer "
                        f"the model wrapped as in the run that saved, or unwrapped in both (model.{attr})")
            subs = sorted({k[:k.index(inner)] for k in keys if inner in k})
            if not subs:  # (some keys at the top start with it: a submodule named "module", say)
                continue
            what = "that submodule" if len(subs) == 1 else "those submodules"
            return (f"; {whose} keys hold {prefix!r} under {', '.join(map(repr, subs[:3]))}: {who} wrapped {what} "
                    f"in {saving} only; wrap {what} as in the run that saved, or unwrap in both "
                    f"({subs[0]}.{attr})")
    return ""


def _warn_converted(where: str, mine: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Warn (RuntimeWarning, at the caller) where a tensor of this run's module state ``mine`` has another dtype
    than the checkpoint's (``saved``, tensors or tensor entries): ``load_state_dict`` converts it silently."""
    converted = []
    for k, v in mine.items():
        stored = _dtype_of(saved.get(k))  # (one this torch does not know fails the load: no warning)
        if (type(v) in (torch.Tensor, torch.nn.Parameter) and stored not in (None, _dtype_of(v))
                and dtype_named(stored) is not None):
            converted.append(f"{k!r} is {stored} in the checkpoint, {_dtype_of(v)} in this run")
    if converted:
        more = f" (and {len(converted) - 1} more)" if len(converted) > 1 else ""
        warnings.warn(f"deltackpt: {where}: {converted[0]}{more}: load_state_dict converts the checkpoint's values "
                      "(and torch's optimizers their moments with them), so the resumed run does not compute as the "
                      "one that saved did", RuntimeWarning, stacklevel=_caller_level())


def _dtype_of(x: Any) -> str | None:
    """The dtype name of a tensor or of a tensor entry (a skeleton's), else None."""
    if isinstance(x, torch.Tensor):
        return _dtype_name(x.dtype)
    if isinstance(x, manifest.TensorEntry):
        return x.dtype
    return None


def _scaler_check(g: Any, state: Any) -> None:
    """Raise, before anything is loaded, for what an enabled ``GradScaler`` refuses: the empty state a disabled
    one saved (mixed precision turned on since the checkpoint; torch raises only once the model holds it)."""
    if g is None:
        return
    for name, member, saved in _with_states(g, state):
        _one_scaler_check(member, saved, f"scaler{name}")


def _one_scaler_check(member: Any, saved: Any, where: str) -> None:
    enabled = getattr(member, "is_enabled", None)
    if callable(enabled) and enabled() and isinstance(saved, Mapping) and not saved:
        raise DeltackptError(f"{where}: the checkpoint's scaler was disabled (it saved an empty state) "
                             "and this run's is enabled, which torch refuses to load it into")


def _group_load(g: Any, state: Any) -> None:
    if g is None:
        return
    for _, member, saved in _with_states(g, state):
        if isinstance(member, torch.nn.Module) and type(saved) is OrderedDict and not hasattr(saved, "_metadata"):
            # A checkpoint of a version before stores kept a state_dict()'s module versions. Without them
            # load_state_dict takes every module's state for a legacy one and migrates it; the job saved it
            # from modules of the versions this code has, the best guess there is.
            saved._metadata = getattr(member.state_dict(), "_metadata", None)  # type: ignore[attr-defined]
        member.load_state_dict(saved)


def _plain_extras(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` entries without ``state_dict()``: their tensors are offered to the restore's load."""
    return {k: v for k, v in extra.items() if not _stateful(v)}


def _array_of(x: Any) -> tuple[str, tuple[int, ...]] | None:
    """The kind ("torch" or "numpy") and shape of a tensor, array or tensor entry (a skeleton's), else None."""
    if isinstance(x, torch.Tensor):
        return "torch", tuple(x.shape)
    if isinstance(x, np.ndarray):
        return "numpy", tuple(x.shape)
    if isinstance(x, manifest.TensorEntry):
        return x.kind, tuple(x.shape)
    return None


def _extra_check(live: Any, saved: Any, where: str) -> None:
    """Raise, before anything is put back, where a tensor (or array) of a plain ``extra`` entry has another shape
    in the checkpoint (``saved``: a captured value or its skeleton): :func:`_put_back` copies into this run's own
    tensors, which the training loop holds, and cannot copy that. Containers are walked as it walks them."""
    mine = _array_of(live)
    if mine is not None:
        theirs = _array_of(saved)
        if theirs is not None and theirs[0] == mine[0] and theirs[1] != mine[1]:  # (another kind is replaced)
            raise ShapeMismatchError(f"{where} has shape {theirs[1]} in the checkpoint, {mine[1]} in this run")
    elif isinstance(live, dict) and isinstance(saved, Mapping):
        for k, v in saved.items():
            if k in live:
                _extra_check(live[k], v, child_path(where, k))
    elif type(live) in (list, tuple) and type(saved) is type(live):
        for i, (a, b) in enumerate(zip(live, saved)):
            _extra_check(a, b, child_path(where, i))


def _put_back(live: Any, saved: Any) -> Any:
    """What a plain ``extra`` entry (or a value in one) is after a restore: ``saved``, written into ``live``'s own
    objects where they can hold it, so that the training loop's references see the restored values. A tensor
    (or numpy array) of the same shape is copied into (converting the dtype, as ``load_state_dict`` does; the
    restore's load decoded those of the same dtype in place already); a dict is refilled (its keys that the
    checkpoint lacks stay), a list too; a tuple keeps its tensors. Anything else is replaced by ``saved``."""
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor) and live.shape == saved.shape:
        if saved is not live:
            # (a tensor made in inference mode, an EMA's say, can be written only in inference mode)
            with torch.inference_mode() if live.is_inference() else torch.no_grad():
                live.copy_(saved)
        return live
    if type(live) is np.ndarray and type(saved) is np.ndarray and live.shape == saved.shape and live.flags.writeable:
        if saved is not live:
            live[...] = saved
        return live
    if isinstance(live, dict) and isinstance(saved, Mapping):
        values = [(k, _put_back(live[k], v) if k in live else v) for k, v in saved.items()]
        kept = [(k, v) for k, v in live.items() if k not in saved]
        live.clear()  # (item by item: a Counter's update() would add, an OrderedDict's order is the checkpoint's)
        for k, v in values + kept:
            live[k] = v
        return live
    if type(live) is list and type(saved) is list:
        live[:] = [_put_back(live[i], v) if i < len(live) else v for i, v in enumerate(saved)]
        return live
    if type(live) is tuple and type(saved) is tuple and len(live) == len(saved):
        items = tuple(_put_back(a, b) for a, b in zip(live, saved))
        return live if all(a is b for a, b in zip(items, live)) else items
    return saved


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
    meta = _check_metadata(metadata)
    if meta is not None and THINNED_KEY in meta:
        # (retention would take the checkpoint for thinned already, and a restore would pass it over)
        raise ValueError(f"metadata key {THINNED_KEY!r} is reserved: a Checkpointer marks the checkpoints retention "
                         "thinned with it; give yours another name")
    return None if meta is None else decode_plain(encode_plain(meta))


def _checkpointer_layout(state: Any) -> bool:
    """Whether a stored state (or its skeleton) is laid out as :meth:`Checkpointer.capture` lays it out."""
    return isinstance(state, Mapping) and "step" in state and "model" in state


def _caller_level() -> int:
    """The ``warnings.warn`` stacklevel, for the function that calls this, of the first frame outside deltackpt
    (the training script's call, however deep inside the package the warning is decided)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _has_rng(state: Mapping[str, Any]) -> bool:
    """Whether a captured state (or its skeleton) holds the RNG states :func:`set_rng_state` puts back."""
    rng = state.get("rng")
    return isinstance(rng, Mapping) and all(k in rng for k in ("python", "numpy", "torch"))


def rng_state() -> dict[str, Any]:
    """The RNG states a resumed run needs: Python, NumPy's global generator, torch CPU and, once this process has
    initialized CUDA, every CUDA device."""
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {
        # (the 625 words as an array: as a tuple of ints they took 11 KB of every save's manifest, written whole;
        # as an array they are a chunk, deduplicated while Python's generator is not drawn from)
        "python": (version, np.array(words, dtype=np.uint32), gauss),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [t.cpu() for t in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    # (an array, or a tuple of ints in checkpoints of earlier versions)
    words = py[1].tolist() if isinstance(py[1], np.ndarray) else py[1]
    random.setstate((py[0], tuple(words), py[2]))
    np_state = state["numpy"]
    np.random.set_state(tuple(np_state))
    # (torch takes a CPU ByteTensor: a restore with map_location="cuda" loaded the states onto the GPU)
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) != torch.cuda.device_count():
            warnings.warn(
                f"checkpoint holds RNG states of {len(cuda)} CUDA devices, this process sees "
                f"{torch.cuda.device_count()}; restoring the common ones", RuntimeWarning, stacklevel=3,
            )
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)


@dataclass
class _Pass:
    """What one :meth:`_Staging.snapshot` carries down the state. A method that recurses with it, not a nested
    function calling itself: that is a reference cycle (the function and its closure cell), which kept every
    staging buffer and the state's own tensors alive after ``close()`` until the cyclic collector next ran."""

    registered: Any  #: registered_types() at the start of the copy
    #: by tree.alias_key: tied tensors get one buffer and stay one leaf ...
    seen: dict[Hashable, Any] = field(default_factory=dict)
    #: ... and the sources those keys name, alive until the copy ends: an alias key holds a memory address, and a
    #: registered type's encoder may return a new array that is freed once copied, whose address the next one's
    #: could then take (and be taken for the same tensor)
    sources: list[Any] = field(default_factory=list)
    devices: set[torch.device] = field(default_factory=set)  #: the devices copies were queued from


#: CPU tensors up to this many bytes are copied by torch (on one thread: below its grain size), larger ones by numpy
_SMALL_COPY = 32768


def _copy_cpu(buf: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy the CPU tensor ``src``'s bytes into ``buf`` (a contiguous tensor of its dtype and shape) as uint8, which
    copies bits whatever they mean. A small tensor takes torch's ``copy_`` (3x faster than numpy views of both for
    a 1 KiB tensor), a large one numpy's single-threaded memcpy (torch's multi-threaded ``copy_`` would compete with
    the training loop's threads). False (nothing copied) where ``src``'s layout has no byte view: non-contiguous,
    a size-1 dimension with an odd stride, lazily conjugated or negated. (:func:`staging.byte_view`'s conditions,
    without its flattening ``reshape``: through it, the snapshot of 48,000 small tensors took 0.95 s, not 0.8.)"""
    if src.dim() == 0:  # (a step count: a 0-dim tensor has no view of another dtype)
        src, buf = src.reshape(1), buf.reshape(1)
    if not src.is_contiguous() or src.is_conj() or src.is_neg() or src.stride(-1) != 1:
        return False
    if src.numel() * src.element_size() <= _SMALL_COPY:
        buf.view(torch.uint8).copy_(src.view(torch.uint8))
    else:
        np.copyto(buf.view(torch.uint8).numpy().reshape(-1), src.view(torch.uint8).numpy().reshape(-1))
    return True


class _Staging:
    """Reusable host buffers holding a consistent copy of the state while a background save reads it.

    One buffer per key path, reused from save to save while dtype and shape stay the same (pinned host memory
    for CUDA sources, so the device-to-host copy is asynchronous and fast). Memory is one copy of the
    state's tensors, however many saves run.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor | np.ndarray] = {}
        self._used: set[tuple[Any, ...]] = set()
        #: the device each staged tensor of the last snapshot was copied from, where not the CPU (by ``id`` of the
        #: staged tensor, which the snapshot holds): the save records it, as a save of the tensor itself does
        self.devices: dict[int, str] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() if isinstance(b, torch.Tensor) else b.nbytes
                   for b in self._buffers.values())

    def _buffer_for(self, path: tuple[Any, ...], src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        pin = src.device.type == "cuda"
        if not (isinstance(buf, torch.Tensor) and buf.dtype == src.dtype and buf.shape == src.shape
                and (not pin or buf.is_pinned())):  # (a CPU tensor's buffer, for a tensor moved to the GPU since)
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        return buf

    def snapshot(self, state: Any) -> Any:
        """Copy ``state`` (containers rebuilt, tensors and arrays copied into staging) and return the copy."""
        self._used = set()
        self.devices = {}
        run = _Pass(registered_types())
        try:
            snap = self._copy(state, (), run)
        except Exception:
            # a state a save refuses (a reference cycle, nesting past any limit, a meta or nested tensor): the
            # UnsupportedTypeError naming the key path that a synchronous save raises, not the copy's own error
            flatten(state)
            raise
        staging.synchronize_cuda(run.devices)  # (every device: a model spread over several GPUs)
        for path in set(self._buffers) - self._used:  # tensors that left the state: free their buffers
            del self._buffers[path]
        return snap

    def _copy(self, obj: Any, path: tuple[Any, ...], run: _Pass) -> Any:
        """The copy of ``obj`` at ``path`` (the keys down to it: no string collisions) for :meth:`snapshot`."""
        # (before tensors: a registered tensor subclass is encoded now, its tensors copied like any other)
        if type(obj) in run.registered and (encoded := encode_registered(obj)) is not None:
            return Encoded(encoded.name, self._copy(encoded.value, path, run))
        if isinstance(obj, torch.Tensor):
            # (refused at the step, as a sync save refuses it, not by the background save; the rest of what
            # unstorable() checks fails the copy below, and costs ~10 us a tensor to ask first)
            why = (unstorable(obj) if type(obj) not in (torch.Tensor, torch.nn.Parameter)
                   or obj.layout != torch.strided else None)
            if why is not None:
                where = functools.reduce(child_path, path, "") or "<root>"
                raise UnsupportedTypeError(f"cannot store {where}: {why}")
            key = alias_key(obj)
            if key in run.seen:
                return run.seen[key]
            src = obj.detach()
            try:
                buf = self._buffer_for(path, src)
                if src.device.type != "cpu" or not _copy_cpu(buf, src):
                    with torch.no_grad():
                        buf.copy_(src, non_blocking=src.device.type == "cuda")
            except NotImplementedError as exc:  # (a sub-byte dtype torch cannot copy; not an out-of-memory)
                where = functools.reduce(child_path, path, "") or "<root>"
                raise UnsupportedTypeError(f"cannot store {where}: torch cannot read its bytes: {exc}") from exc
            run.devices.add(src.device)
            self._used.add(path)
            out: Any = buf
            if isinstance(obj, torch.nn.Parameter):
                out = torch.nn.Parameter(buf, obj.requires_grad)
            elif obj.requires_grad:  # saved and restored with the flag, as a synchronous save keeps it
                out = buf.detach().requires_grad_()
            if src.device.type != "cpu":
                self.devices[id(out)] = str(src.device)
            run.seen[key] = out
            run.sources.append(obj)
            return out
        if isinstance(obj, np.ndarray):
            key = alias_key(obj)
            if key in run.seen:
                return run.seen[key]
            nbuf = self._buffers.get(path)
            if not (isinstance(nbuf, np.ndarray) and nbuf.dtype == obj.dtype and nbuf.shape == obj.shape):
                nbuf = np.empty_like(obj, order="C")
                self._buffers[path] = nbuf
            np.copyto(nbuf, obj)
            self._used.add(path)
            run.seen[key] = nbuf
            run.sources.append(obj)
            return nbuf
        t = type(obj)
        if t is dict or t is OrderedDict or t is Counter or t is defaultdict:
            out = obj.copy()  # same type, order and default factory; values replaced below
            for k, v in obj.items():
                out[k] = self._copy(v, (*path, k), run)
            if t is OrderedDict and hasattr(obj, "_metadata"):  # (a state_dict()'s module versions)
                out._metadata = self._copy(obj._metadata, (*path, _METADATA), run)
            return out
        if t is list or t is tuple or t is deque:
            items = [self._copy(v, (*path, i), run) for i, v in enumerate(obj)]
            return items if t is list else tuple(items) if t is tuple else deque(items, maxlen=obj.maxlen)
        if t is set:
            return set(obj)  # elements are plain values; a copy keeps the save from seeing later changes
        return obj


#: the path step under which a snapshot copies an OrderedDict's ``_metadata`` (no dict key can equal it)
_METADATA = object()


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
            if first is not None and isinstance(info.metadata, dict) and info.metadata.get(THINNED_KEY):
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
        the run's own tensors and containers where they can hold them (:func:`_put_back`), else back into
        this dict.
    every_n_steps: save when the step passed to :meth:`step` is a multiple of this.
    async_save: snapshot in :meth:`step` and save in a background thread (at most one save in flight).
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
        retention: Retention | None = None,
        gc: bool = True,
        handle_signals: bool = True,
        map_location: Any = "cpu",
        rng: bool = True,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, (int, np.integer)):
            raise TypeError(f"every_n_steps must be a positive int, got {type(every_n_steps).__name__} "
                            f"{every_n_steps!r:.40}")
        every_n_steps = int(every_n_steps)  # (a numpy int, as steps and Retention take them)
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive int, got {every_n_steps!r}")
        for name, value in (("async_save", async_save), ("gc", gc), ("handle_signals", handle_signals),
                            ("rng", rng)):
            config.boolean(name, value)
        if extra is not None and not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a dict of names to values or stateful objects, got "
                            f"{type(extra).__name__}")
        staging.check_map_location(map_location)  # (when it is made, not at a restart's first restore)
        if retention is not None and not isinstance(retention, Retention):
            raise TypeError(f"retention must be a deltackpt.Retention or None, got {type(retention).__name__} "
                            f"{retention!r} (Retention(keep_last=3), say)")
        self.model = _group(model, "model")
        self.optimizer = _group(optimizer, "optimizer")
        self.scheduler = _group(scheduler, "scheduler")
        self.scaler = _group(scaler, "scaler")
        if data is not None and not _stateful(data):
            raise TypeError(
                f"data must have state_dict()/load_state_dict() (got {type(data).__name__}); wrap a DataLoader "
                "in deltackpt.data.ResumableLoader"
            )
        self.data = data
        self._gc_rule = _GcAfterRetention()  # (a bad DELTACKPT_GC_MIN_BYTES is refused here, not at a save)
        # (opened once the arguments are known to be good: a refused Checkpointer creates no store)
        self._owns_store = not isinstance(path_or_store, Store)
        self.store: Store = path_or_store if isinstance(path_or_store, Store) else Store(path_or_store)
        self.extra = extra if extra is not None else {}
        self.every_n_steps = every_n_steps
        self.async_save = async_save
        self.retention = retention
        self._warned_metric = False  # (a keep_best metric no checkpoint records: said once)
        self.gc = gc
        self.map_location = map_location
        self.rng = rng
        self.last_saved_step: int | None = None
        self.last_info: CheckpointInfo | None = None
        self._staging = _Staging()
        self._unthinnable: set[str] = set()  # checkpoints retention found damaged when it came to thin them
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
        self._closed = False
        self._quieted: list[Any] = []  # DataLoaders whose workers this checkpointer made ignore stop signals
        self._handling = False  # its signal handlers were installed
        if handle_signals:
            self._install_signals()

    # -- state ---------------------------------------------------------------------------------------------
    def capture(self, step: int) -> dict[str, Any]:
        """The training state at ``step`` as a tree of live objects (no copies)."""
        extra: dict[str, Any] = {}
        for k, v in self.extra.items():
            extra[k] = v.state_dict() if _stateful(v) else v
        state = {
            "step": step,
            "model": _group_state(self.model),
            "optimizer": _group_state(self.optimizer),
            "scheduler": _group_state(self.scheduler),
            "scaler": _group_state(self.scaler),
            "data": self.data.state_dict() if self.data is not None else None,
            "extra": extra,
        }
        if self.rng:
            state["rng"] = rng_state()
        return state

    def _check(self, state: Any, live_model: Any = None, *, strict: bool = True) -> list[str]:
        """Raise unless ``state`` (a captured state, or its skeleton with tensor entries in place of tensors)
        holds everything :meth:`apply` puts back into this run's components, and fits them; changes nothing.
        ``live_model``: the model's state dicts when the caller has them (else they are taken). Without
        ``strict`` a component other than the model that the checkpoint lacks is no error: the names of those
        are returned (what :meth:`_apply` then leaves as it is)."""
        if not _checkpointer_layout(state):
            raise DeltackptError("this checkpoint was not written by a Checkpointer (no 'step'/'model' entry)")
        if state.get("thinned"):
            raise DeltackptError(
                f"checkpoint at step {state['step']} was thinned to model weights only and cannot resume training; "
                "load its weights with Store.load"
            )
        lacking: list[str] = []
        groups: dict[str, Any] = {}
        for what in ("model", "optimizer", "scheduler", "scaler"):
            groups[what] = getattr(self, what)
            if not strict and what != "model":
                groups[what], absent = _present(groups[what], state.get(what), what)
                lacking += absent
            _group_check(groups[what], state.get(what), what)
        _fit_check(self.model, state.get("model"), "model", live_model)
        _fit_check(groups["optimizer"], state.get("optimizer"), "optimizer")
        _scaler_check(groups["scaler"], state.get("scaler"))
        _scheduler_check(groups["scheduler"], state.get("scheduler"))
        if self.data is not None and state.get("data") is None:
            if strict:
                raise DeltackptError("the checkpoint holds no data position")
            lacking.append("data")
        elif self.data is not None and hasattr(self.data, "check_state_dict"):
            try:  # (a ResumableLoader: another dataset, seed, sharding is refused before anything is put back)
                self.data.check_state_dict(state["data"])
            except (ValueError, TypeError) as exc:
                if strict:
                    raise DeltackptError(f"the checkpoint's data position does not fit this run's loader: {exc}"
                                         " (restore(strict=False) restores the rest and leaves the loader as it "
                                         "is)") from None
                lacking.append(f"data position that fits this loader ({exc})")
        saved_extra = state.get("extra") or {}
        for k, v in self.extra.items():
            if k not in saved_extra:
                if strict:
                    raise DeltackptError(f"the checkpoint holds no extra[{k!r}]")
                lacking.append(f"extra[{k!r}]")
            elif isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):  # (an EMA model: checked as the model is)
                _fit_check(v, saved_extra[k], f"extra[{k!r}]")
            elif not _stateful(v):
                _extra_check(v, saved_extra[k], f"extra[{k!r}]")
            else:  # (an LR scheduler or a GradScaler kept there: checked as those of the run are)
                _one_scheduler_check(v, saved_extra[k], f"extra[{k!r}]")
                if isinstance(v, torch.amp.GradScaler):
                    _one_scaler_check(v, saved_extra[k], f"extra[{k!r}]")
        if self.rng and not _has_rng(state):
            if strict:
                raise DeltackptError("the checkpoint holds no RNG states ('rng' with 'python', 'numpy' and 'torch')")
            lacking.append("rng")
        return lacking

    def apply(self, state: Mapping[str, Any]) -> int:
        """Put a captured state back into the model, optimizers, ... and RNGs; return its step. A state that
        lacks a part this run has is refused before anything is put back."""
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
                    g, _ = _present(g, state.get(what), what)
                _group_load(g, state.get(what))
                if g is not None:
                    applied.append(what)
            if self.data is not None and state.get("data") is not None and (strict or self._fits(state["data"])):
                current = "data"
                self.data.load_state_dict(state["data"])
                applied.append(current)
            saved_extra = state.get("extra") or {}
            for k, v in self.extra.items():
                if not strict and k not in saved_extra:
                    continue
                current = f"extra[{k!r}]"
                if _stateful(v):
                    v.load_state_dict(saved_extra[k])
                else:  # (into the run's own tensors and containers, which its training loop holds)
                    self.extra[k] = _put_back(v, saved_extra[k])
                applied.append(current)
        except DeltackptError:
            raise
        except Exception as exc:
            raise DeltackptError(
                f"{current}: restoring it raised {type(exc).__name__}: {exc}; put back before it: "
                f"{', '.join(applied) or 'nothing'} (restore again, from another step if need be)") from exc
        if self.rng and (strict or _has_rng(state)):
            self._put_rng_back(state["rng"], int(state["step"]))
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
                stacklevel=_caller_level())
        set_rng_state(rng)
        _rng_owner = weakref.ref(self)

    def _fits(self, data_state: Any) -> bool:
        """Whether this run's loader takes ``data_state`` (one without ``check_state_dict`` is assumed to)."""
        check = getattr(self.data, "check_state_dict", None)
        if check is None:
            return True
        try:
            check(data_state)
        except (ValueError, TypeError):
            return False
        return True

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
        self.wait()
        strict = config.boolean("strict", strict)
        for path, member in _members(self.model, "model"):
            meta = next((k for k, v in _tensors_of(member) if v.is_meta), None)
            if meta is not None:
                raise DeltackptError(f"cannot restore into {path}: its tensor {meta!r} is on the meta device (it has "
                                     "no memory); materialize the model first, e.g. model.to_empty(device='cpu')")
        if step is not None or id is not None:
            return self._restore(self.store.info(step, id=id), strict=strict)

        def damaged(info: CheckpointInfo, exc: CorruptionError) -> None:
            warnings.warn(f"deltackpt: checkpoint {info.id} (step {info.step}) is damaged, trying the ones "
                          f"before it: {exc}", RuntimeWarning, stacklevel=_caller_level())
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
        live = _group_state(self.model)  # (once: for FSDP a state dict is a gather)
        if skeleton is not None:
            with _naming(info):
                lacking = self._check(skeleton, live, strict=strict)
        # the model's own tensors are offered: they are decoded in place, and load_state_dict then copies nothing
        # (and a plain extra entry's tensors: an EMA kept as a dict of tensors is decoded into the run's own)
        into = {"model": live, "extra": _plain_extras(self.extra)}
        state = self.store.load(id=info.id, map_location=self.map_location, into=into)
        with _naming(info):
            if skeleton is None:
                lacking = self._check(state, live, strict=strict)
            restored = self._apply(state, strict=strict, decoded=True)
        if lacking:
            warnings.warn(f"deltackpt: checkpoint {info.id} (step {info.step}) holds no {', '.join(lacking)}: "
                          "left as they are", RuntimeWarning, stacklevel=_caller_level())
        self.last_saved_step = restored
        return restored

    # -- saving ----------------------------------------------------------------------------------------------
    def step(self, step: int, *, metadata: Mapping[str, Any] | None = None) -> bool:
        """Tell the checkpointer that ``step`` steps are complete; save if due. Returns True if this step is
        saved: a save started, or (at a signal) the one of this step under way was waited for.

        ``metadata`` goes with this step's save, when there is one (a metric for ``Retention(keep_best=)``,
        a tag), and is dropped otherwise. Raises the error of a failed background save. After a SIGTERM/SIGINT
        it saves (whatever the interval; a keyframe save, so that the restart restores from one frame per
        chunk), waits for the save, then passes the signal on; a signal that arrives during this step's own save
        makes this step the one it passes the signal on after.
        """
        self._check_open()  # (at every step, not only at those that save)
        step = _check_step(step)
        metadata = _plain_metadata(metadata)
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
        step = _check_step(step)
        whole = self._kept_for_good(step)
        keyframe = keyframe or whole
        self._raise_background_error()
        self.wait()  # at most one save in flight: the staging buffers are about to be rewritten
        state = self.capture(step)
        meta = _plain_metadata(metadata) or None
        pairs = _param_pairs(self.model, self.optimizer)
        stopping = self._signal is not None  # (the save before the process ends: no gc after it, time is short)
        if self._executor is None:
            self._run_save(state, step, meta, keyframe, pairs, stopping, whole)
        else:
            snap = self._staging.snapshot(state)
            self._inflight = self._executor.submit(self._run_save, snap, step, meta, keyframe, pairs, stopping, whole,
                                                   self._staging.devices)
            self._inflight_step, self._inflight_prev = step, (self.last_saved_step, self.last_info)
            self.last_saved_step = step  # (step() of it again must not start a second save)
            if wait:
                self.wait()

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

    def _run_save(self, state: Any, step: int, meta: dict[str, Any] | None, keyframe: bool = False,
                  pairs: dict[str, str] | None = None, stopping: bool = False, whole: bool = False,
                  devices: dict[int, str] | None = None) -> CheckpointInfo:
        info = self.store._save(state, step=step, metadata=meta, keyframe=keyframe, _pairs=pairs,
                                _self_contained=whole, _devices=devices)
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
                          "rules keep checkpoints", RuntimeWarning, stacklevel=3)
        plan = self.retention.plan(infos)
        by_id = {i.id: i for i in infos}
        self.store._delete([(None, cid) for cid in plan.delete], missing_ok=True)  # (one index commit)
        head = self.store._head  # loading a checkpoint to thin it must not change what the run descends from
        try:
            self._thin(plan.thin, by_id)
        finally:
            self.store._head = head
        if collect and self.gc:
            self._collect(sum(by_id[cid].written_bytes for cid in by_id.keys() - set(plan.delete)))

    def _collect(self, kept: int) -> None:
        """gc after retention, when due (:class:`_GcAfterRetention`). Its trouble is not the save's: the
        checkpoint is committed, and training goes on. A store another process holds when gc starts (its gc, a
        repair) is tried again at the next save; a repack that stops partway (the lock not free within
        :data:`GC_WAIT` between two packs, a full disk) keeps what it freed, and the packs left are repacked by
        the next gc, when as much garbage again has built up; damage gc found is a warning."""
        try:
            report = self._gc_rule.collect(self.store, kept)
        except (DeltackptError, OSError) as exc:
            warnings.warn(f"deltackpt: gc after retention failed, what retention deleted still takes its space "
                          f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
            return
        if report is not None and report.damaged_packs:
            warnings.warn(f"deltackpt: gc after retention left {len(report.damaged_packs)} pack(s) holding damaged "
                          f"frames in place: {report.damaged_packs[0]}; 'deltackpt verify' names the checkpoints",
                          RuntimeWarning, stacklevel=2)

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
                full = self.store.load(id=cid, map_location="cpu")
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
                              f"damaged; it stays as it is: {exc}", RuntimeWarning, stacklevel=2)

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
        handler raises KeyboardInterrupt; the default action exits with status 128 + signal)."""
        if self._closed:
            return
        self._closed = True
        pending = self._signal if self._signal is not None else self._stopped_by if self in _stopped else None
        beneath = {sig: self._beneath(sig) for sig in {*_delivered, pending}} if pending is not None else None
        failure: BaseException | None = None  # the last save's error: raised, after the signal is passed on
        try:
            try:
                self.wait()
            finally:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                self._staging = _Staging()  # its buffers are a copy of the whole state: give the memory back
                self._restore_signals()
                if self._owns_store:
                    self.store.close()
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
                          "SIGTERM/SIGINT will not trigger a save", RuntimeWarning, stacklevel=3)
            return
        self._pid = os.getpid()
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._handling = True
        self._quiet(getattr(self.data, "loader", self.data))  # a ResumableLoader's DataLoader, or one given as is

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
        if not isinstance(wrapper, _WorkersIgnoreStopSignals):
            wrapper = loader.worker_init_fn = _WorkersIgnoreStopSignals(wrapper)
            if hasattr(signal, "pthread_sigmask"):
                loader._get_iterator = wrapper.starting(loader._get_iterator)  # type: ignore[method-assign]
        if self not in wrapper.owners:
            wrapper.owners.add(self)
            self._quieted.append(loader)

    def _restore_signals(self) -> None:
        """Where this checkpointer's handler is the one installed, put back the one before it (skipping closed
        checkpointers' handlers). Elsewhere (off the main thread, or under another handler) it stays, and
        passes signals on once the checkpointer is closed."""
        for loader in self._quieted:
            wrapper = loader.worker_init_fn
            if isinstance(wrapper, _WorkersIgnoreStopSignals):
                wrapper.owners.discard(self)
                if not wrapper.owners:
                    wrapper.release()  # workers still running (persistent ones) end at SIGTERM again
                    loader.worker_init_fn = wrapper.fn
                    if "_get_iterator" in vars(loader):  # (the class's again)
                        del loader._get_iterator
        self._quieted.clear()
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in list(self._previous.items()):
            if signal.getsignal(sig) == self._on_signal:
                while (owner := _owner(handler)) is not None and owner._closed:
                    handler = owner._previous.get(sig, signal.SIG_DFL)
                signal.signal(sig, handler)
                del self._previous[sig]

    def _chained(self, signum: int) -> list[Checkpointer]:
        """The open checkpointers whose handlers lie directly beneath this one's (no other handler between)."""
        out: list[Checkpointer] = []
        handler = self._previous.get(signum)
        while (owner := _owner(handler)) is not None:
            if not owner._closed:
                out.append(owner)
            handler = owner._previous.get(signum)
        return out

    def _beneath(self, signum: int) -> Any:
        """The first handler beneath this one's that is no checkpointer's: where the signal goes once saved."""
        handler = self._previous.get(signum, signal.SIG_DFL)
        while (owner := _owner(handler)) is not None:
            handler = owner._previous.get(signum, signal.SIG_DFL)
        return handler

    def _on_signal(self, signum: int, frame: Any) -> None:
        for i, (sig, handler) in enumerate(_forward):  # handed over by a checkpointer stepped on another thread
            if sig == signum:
                del _forward[i]
                if handler is signal.default_int_handler:  # Python's Ctrl-C: its KeyboardInterrupt would end the
                    handler = signal.SIG_DFL  # main thread only, and the loop's thread would train on
                _pass_to(handler, signum, frame, kill=True)
                return
        if os.getpid() != self._pid:  # inherited by a forked child (a Pool's, a DataLoader's worker): nothing
            if _dataloader_worker():
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
