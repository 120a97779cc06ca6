"""Fit checks: whether a checkpoint fits this run's components, asked before a restore changes anything.

Where it sits: in a restore, between loading the checkpoint's skeleton (its tree, tensors as entries) and
decoding its bytes into the model's own tensors. ``load_state_dict`` would refuse many mismatches only after the
model holds part of the checkpoint, or take another optimizer's or scheduler's state without a word; these
checks raise first (:class:`~deltackpt.ShapeMismatchError` or :class:`~deltackpt.DeltackptError`, naming the
component and key), or warn where torch converts silently (another dtype). Where a member's own loading code or
load hooks may accept what looks like a mismatch, the decision is left to ``load_state_dict``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from deltackpt import _lazy, manifest
from deltackpt.components import with_states
from deltackpt.errors import DeltackptError, ShapeMismatchError, caller_level
from deltackpt.tree import child_path, dtype_name, dtype_named

if TYPE_CHECKING:
    import torch
else:
    torch = _lazy.module("torch", globals())


def group_check(g: Any, state: Any, what: str) -> None:
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
        # key (fit_check); other objects' states may be anything.
        try:
            mine = g.state_dict()
        except Exception:  # (one that cannot tell now, ZeroRedundancyOptimizer say: its loading will)
            mine = None
        if isinstance(mine, Mapping) and mine and not set(state) & set(mine):
            raise DeltackptError(
                f"the checkpoint holds a dict of {what} states ({', '.join(map(repr, list(state)[:4]))}), this run "
                f"has one {what} (give the Checkpointer a dict, as the run that saved did)")


def loads_as_saved(module: torch.nn.Module, *, keys: bool) -> bool:
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
        if (own is not base._load_from_state_dict and own not in known_loaders()
                and (keys or not own.__module__.startswith("torch.nn."))):
            return False
    return True


@functools.cache
def known_loaders() -> frozenset[Any]:
    """torch's own ``_load_from_state_dict`` overrides whose effect on keys :func:`forgiven_keys` knows: batch
    norm fills in a missing ``num_batches_tracked`` from a state of version < 2; instance norm only refuses more
    (running statistics for a module that does not track them). (A function: importing deltackpt imports no
    torch.)"""
    return frozenset({torch.nn.modules.batchnorm._NormBase._load_from_state_dict,
                      torch.nn.modules.instancenorm._InstanceNorm._load_from_state_dict})


def kind_of(saved: Any) -> str:
    """What a saved value is, for an error: "a list of 2", "a tensor", "an int"."""
    if isinstance(saved, (list, tuple)):
        return f"a {type(saved).__name__} of {len(saved)}"
    if isinstance(saved, (torch.Tensor, manifest.TensorEntry)):
        return "a tensor"
    name = type(saved).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def forgiven_keys(module: torch.nn.Module, saved: Any, mine: Any) -> set[str]:
    """The keys of ``mine`` that ``module.load_state_dict`` does not need in ``saved``: the ``num_batches_tracked``
    of a batch norm that tracks running statistics, where the module's version in the saved state's metadata
    (this run's, for a checkpoint that kept none: :func:`load_group`) is below 2."""
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
PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
                           "sum", "acc_delta", "exp_inf", "prev", "step_size", "ax"})


def fit_check(g: Any, state: Any, what: str, live: Any = None) -> None:
    """Raise ShapeMismatchError where ``load_state_dict`` would refuse a saved state that does not fit this
    run's model (a key missing or unexpected, another shape) or optimizer (another number of parameter groups
    or of parameters in one), before anything is loaded: a restore decodes into the model's own tensors, and a
    refusal after that would leave the model holding part of the checkpoint; for torch's own optimizers also
    another kind of optimizer's hyperparameters, and moments not of their parameter's shape (the parameters in
    another order). ``state`` may hold tensor entries (a skeleton); ``live`` is the group's state dicts when
    the caller has them (:func:`group_state`). Where hooks or a member's own
    loading code may accept what looks like a mismatch, it is left to ``load_state_dict``."""
    if g is None:
        return
    lives = None if live is None else with_states(g, live)
    for n, (name, member, saved) in enumerate(with_states(g, state)):
        where = f"{what}{name}"
        if isinstance(member, (torch.nn.Module, torch.optim.Optimizer)) and not isinstance(saved, Mapping):
            raise ShapeMismatchError(f"{where}: the checkpoint holds {kind_of(saved)} there, not the state_dict "
                                     f"of a {type(member).__name__}")
        if isinstance(member, torch.nn.Module) and isinstance(saved, Mapping):
            mine = member.state_dict() if lives is None else lives[n][2]
            if loads_as_saved(member, keys=False):  # (before the warning that the others are converted)
                for k, v in mine.items():
                    stored = dtype_named(_dtype_of(saved.get(k)))
                    if (type(v) in (torch.Tensor, torch.nn.Parameter) and stored is not None and stored != v.dtype
                            and not _convertible(stored, v.dtype)):
                        raise ShapeMismatchError(f"{where}: {k!r} is {dtype_name(stored)} in the checkpoint, "
                                                 f"{dtype_name(v.dtype)} in this run, which torch cannot convert it to")
            warn_converted(where, mine, saved)  # (load hooks or not: load_state_dict's copies convert)
            if not loads_as_saved(member, keys=False):
                continue
            for k, v in mine.items():
                shape = getattr(saved.get(k), "shape", None)
                if (type(v) in (torch.Tensor, torch.nn.Parameter) and shape is not None
                        and list(shape) != list(v.shape) and not (v.dim() == 0 and list(shape) == [1])):
                    raise ShapeMismatchError(f"{where}: {k!r} has shape {tuple(shape)} in the checkpoint, "
                                             f"{tuple(v.shape)} in this run")
            if loads_as_saved(member, keys=True):
                forgiven = forgiven_keys(member, saved, mine)
                missing = [k for k in mine if k not in saved and k not in forgiven]
                unexpected = [k for k in saved if k not in mine]
                if missing or unexpected:
                    raise ShapeMismatchError(f"{where} does not match the checkpoint: missing in the checkpoint "
                                             f"{missing[:5]}, not in this run {unexpected[:5]}"
                                             f"{wrapper_hint(list(mine), list(saved))}")
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
                    for k in sorted(PARAM_SHAPED & set(st)):
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


def scheduler_check(g: Any, state: Any) -> None:
    """Raise, before anything is loaded, where torch's own LR schedulers would raise loading the saved state (a
    KeyError or IndexError, once the model holds the checkpoint): another kind of scheduler's state, such as a
    StepLR's where this run has a SequentialLR (a warmup added since the checkpoint), or another number of
    chained schedulers or of lambdas. Other differences their loading takes as it is (it updates attributes)."""
    if g is None:
        return
    for name, member, saved in with_states(g, state):
        one_scheduler_check(member, saved, f"scheduler{name}")


def one_scheduler_check(member: Any, saved: Any, where: str) -> None:
    """:func:`scheduler_check` of one scheduler (``where``: its key path in the state, for the error)."""
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
                one_scheduler_check(m, t, f"{where}._schedulers[{i}]")
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
                          stacklevel=caller_level())


#: what wrapping a model adds to its state_dict() keys, and who adds it
_WRAPPER_PREFIXES = {"_orig_mod.": ("torch.compile", "_orig_mod"),
                     "module.": ("DistributedDataParallel or DataParallel", "module")}


def wrapper_hint(mine: list[str], saved: list[str]) -> str:
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
    return _wrappers_hint(mine, saved)


def _wrappers_hint(mine: list[str], saved: list[str]) -> str:
    """:func:`wrapper_hint` where the keys of both runs start with wrappers' parts, or one run's with several (a
    model saved under DistributedDataParallel, ``module.``, restored compiled, ``_orig_mod.``; or
    ``module._orig_mod.``): the parts that start each run's keys, when the keys are the same without them, else
    ""."""
    names = {prefix[:-1] for prefix in _WRAPPER_PREFIXES}

    def bare(key: str) -> str:
        return ".".join(part for part in key.split(".") if part not in names)

    if (not mine or set(mine) == set(saved) or len({bare(k) for k in mine}) != len(mine)
            or {bare(k) for k in mine} != {bare(k) for k in saved}):
        return ""

    def lead(keys: list[str]) -> str:  # the wrappers' parts that start every key ("module._orig_mod."), or ""
        parts: list[str] = []
        for part in keys[0].split(".")[:-1]:
            if part not in names or not all(k.startswith(".".join([*parts, part]) + ".") for k in keys):
                break
            parts.append(part)
        return ".".join(parts) + "." if parts else ""

    def starts(prefix: str) -> str:
        who = " and ".join(dict.fromkeys(_WRAPPER_PREFIXES[p + "."][0] for p in prefix.split(".")[:-1]))
        return f"all start with {prefix!r} ({who})" if prefix else "start with no wrapper's part"

    theirs, ours = lead(saved), lead(mine)
    if theirs == ours or not all(bare(k) == k.removeprefix(theirs) for k in saved) or not all(
            bare(k) == k.removeprefix(ours) for k in mine):
        return ""  # (wrappers' parts inside the keys: a submodule may be named "module")
    unwrapped = ", ".join(f"model.{p[:-1]} in {run}" for p, run in ((theirs, "the run that saved"), (ours, "this run"))
                          if p)
    return (f"; the checkpoint's keys {starts(theirs)}, this run's {starts(ours)}: give the Checkpointer the model "
            f"wrapped as in the run that saved, or unwrapped in both ({unwrapped})")


def warn_converted(where: str, mine: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
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
                      "one that saved did", RuntimeWarning, stacklevel=caller_level())


def _dtype_of(x: Any) -> str | None:
    """The dtype name of a tensor or of a tensor entry (a skeleton's), else None."""
    if isinstance(x, torch.Tensor):
        return dtype_name(x.dtype)
    if isinstance(x, manifest.TensorEntry):
        return x.dtype
    return None


def scaler_check(g: Any, state: Any) -> None:
    """Raise, before anything is loaded, for what an enabled ``GradScaler`` refuses: the empty state a disabled
    one saved (mixed precision turned on since the checkpoint; torch raises only once the model holds it)."""
    if g is None:
        return
    for name, member, saved in with_states(g, state):
        one_scaler_check(member, saved, f"scaler{name}")


def one_scaler_check(member: Any, saved: Any, where: str) -> None:
    """:func:`scaler_check` of one scaler (``where``: its key path in the state, for the error)."""
    enabled = getattr(member, "is_enabled", None)
    if callable(enabled) and enabled() and isinstance(saved, Mapping) and not saved:
        raise DeltackptError(f"{where}: the checkpoint's scaler was disabled (it saved an empty state) "
                             "and this run's is enabled, which torch refuses to load it into")


def _array_of(x: Any) -> tuple[str, tuple[int, ...]] | None:
    """The kind ("torch" or "numpy") and shape of a tensor, array or tensor entry (a skeleton's), else None."""
    if isinstance(x, torch.Tensor):
        return "torch", tuple(x.shape)
    if isinstance(x, np.ndarray):
        return "numpy", tuple(x.shape)
    if isinstance(x, manifest.TensorEntry):
        return x.kind, tuple(x.shape)
    return None


@functools.cache
def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether torch copies a tensor of dtype ``src`` into one of ``dst`` (not between two sub-byte or bits
    dtypes, or such a dtype and another: torch has no copy_ for them); tried on one element."""
    try:
        torch.empty(1, dtype=dst).copy_(torch.empty(1, dtype=src))
    except (NotImplementedError, RuntimeError):
        return False
    return True


def extra_check(live: Any, saved: Any, where: str) -> None:
    """Raise, before anything is put back, where a tensor (or array) of a plain ``extra`` entry has another shape
    in the checkpoint (``saved``: a captured value or its skeleton), or a dtype torch cannot convert to this
    run's: :func:`put_back` copies into this run's own tensors, which the training loop holds, and cannot copy
    that. Containers are walked as it walks them."""
    mine = _array_of(live)
    if mine is not None:
        theirs = _array_of(saved)
        if theirs is not None and theirs[0] == mine[0] and theirs[1] != mine[1]:  # (another kind is replaced)
            raise ShapeMismatchError(f"{where} has shape {theirs[1]} in the checkpoint, {mine[1]} in this run")
        if theirs is not None and theirs[0] == mine[0] == "torch":
            src = saved.dtype if isinstance(saved, torch.Tensor) else dtype_named(saved.dtype)
            if src is not None and src != live.dtype and not _convertible(src, live.dtype):
                raise ShapeMismatchError(f"{where} is {dtype_name(src)} in the checkpoint, {dtype_name(live.dtype)} in "
                                         "this run, which torch cannot convert it to")
    elif isinstance(live, dict) and isinstance(saved, Mapping):
        for k, v in saved.items():
            if k in live:
                extra_check(live[k], v, child_path(where, k))
    elif type(live) in (list, tuple) and type(saved) is type(live):
        for i, (a, b) in enumerate(zip(live, saved)):
            extra_check(a, b, child_path(where, i))
