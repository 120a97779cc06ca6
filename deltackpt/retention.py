"""Retention policies: which checkpoints to keep, which to thin to weights only, which to delete.

Where it sits: after each committed save, the :class:`~deltackpt.Checkpointer` asks the policy what to do with
the store's checkpoints and applies it (deletes first, then thinning). The policy itself is a pure function
of the list of checkpoints, so it is easy to reason about and to test.

Every rule *keeps* checkpoints; a checkpoint survives if any rule keeps it, and the newest checkpoint is always
kept. A policy with no deleting rule (``keep_last``, ``keep_every``, ``keep_best``, ``keep_within``) keeps
everything.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from deltackpt.store import CheckpointInfo

#: Metadata key of a tag; a checkpoint saved with ``metadata={"tag": ...}`` (any value but None or False) is kept by
#: ``keep_tagged``.
TAG_KEY = "tag"
#: Metadata key set on checkpoints rewritten to hold model weights only.
THINNED_KEY = "thinned"


@dataclass(frozen=True)
class Plan:
    keep: list[str]  # ids kept as they are
    thin: list[str]  # ids to rewrite with model weights only (kept)
    delete: list[str]  # ids to delete


@dataclass(frozen=True)
class Retention:
    """A retention policy.

    keep_last     keep the N most recent checkpoints (always at least the newest one)
    keep_every    keep checkpoints whose step is a multiple of this (e.g. 1000)
    keep_tagged   keep checkpoints saved with ``metadata={"tag": ...}``, any value but None or False (default
                  True)
    keep_best     (metric, "min" | "max"): keep the ``best_k`` checkpoints with the best
                  ``metadata[metric]``
    best_k        how many "best" checkpoints to keep (default 1)
    keep_within   keep every checkpoint at most this many seconds old
    full_last     if set, of the checkpoints the rules keep, only the N most recent stay whole (the full training
                  state); older kept ones are thinned to model weights only (for evaluation; training cannot
                  resume from one). Checkpoints deleted by the same plan take no place among the N
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_tagged: bool = True
    keep_best: tuple[str, Literal["min", "max"]] | None = None
    best_k: int = 1
    keep_within: float | None = None
    full_last: int | None = None

    def __post_init__(self) -> None:
        # checked here, at construction: a policy is applied after each save's commit, where a bad value would
        # fail every save (or, as a NaN keep_within did, keep nothing). A value of the wrong type is a TypeError,
        # one out of range a ValueError; integers may be numpy integers (stored as int).
        for name in ("keep_last", "keep_every", "full_last", "best_k"):
            v = getattr(self, name)
            if v is None and name != "best_k":
                continue
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise TypeError(f"Retention.{name} must be a positive int, got {v!r}")
            if v < 1:
                raise ValueError(f"Retention.{name} must be a positive int, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.keep_best is not None:
            kb = self.keep_best
            if not isinstance(kb, (tuple, list)) or len(kb) != 2 or not isinstance(kb[0], str):
                raise TypeError(f"Retention.keep_best must be a pair (metric, 'min' or 'max'), got {kb!r}")
            if not kb[0] or kb[1] not in ("min", "max"):
                raise ValueError(f"Retention.keep_best must be (metric, 'min' or 'max') with a metric name, got {kb!r}")
            object.__setattr__(self, "keep_best", (kb[0], kb[1]))
        elif self.best_k != 1:
            raise ValueError(f"Retention.best_k={self.best_k} needs keep_best=(metric, 'min' or 'max') to rank by")
        if not isinstance(self.keep_tagged, bool):
            raise TypeError(f"Retention.keep_tagged must be True or False, got {self.keep_tagged!r}")
        if self.keep_within is not None:
            if isinstance(self.keep_within, (bool, np.bool_)) or not isinstance(self.keep_within, numbers.Real):
                raise TypeError(f"Retention.keep_within must be a number of seconds, got {self.keep_within!r}")
            try:  # (an int or Fraction beyond float's range is out of range, not an OverflowError)
                within = float(self.keep_within)
            except OverflowError:
                within = math.inf
            if not math.isfinite(within) or within < 0:
                raise ValueError(
                    f"Retention.keep_within must be a finite number of seconds >= 0, got {self.keep_within!r:.60}")
            object.__setattr__(self, "keep_within", within)

    @property
    def deletes_anything(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best, self.keep_within))

    def plan(self, infos: Sequence[CheckpointInfo], now: float | None = None) -> Plan:
        """Decide for each checkpoint (``infos`` in commit order, oldest first)."""
        if not infos:
            return Plan([], [], [])
        now = time.time() if now is None else now
        ids = [i.id for i in infos]
        keep: set[str] = {ids[-1]}
        if not self.deletes_anything:
            keep.update(ids)
        if self.keep_last is not None:
            keep.update(ids[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(i.id for i in infos if i.step % self.keep_every == 0)
        if self.keep_tagged:
            keep.update(i.id for i in infos if isinstance(i.metadata, dict) and _tagged(i.metadata.get(TAG_KEY)))
        if self.keep_best is not None:
            metric, mode = self.keep_best
            scored = [(score, i.seq, i.id) for i in infos if isinstance(i.metadata, dict)
                      and (score := _score(i.metadata.get(metric))) is not None]
            scored.sort(key=lambda t: (t[0] if mode == "min" else -t[0], -t[1]))
            keep.update(i for _, _, i in scored[: self.best_k])
        if self.keep_within is not None:
            keep.update(i.id for i in infos if now - i.created <= self.keep_within)
        thin: list[str] = []
        if self.full_last is not None:
            # (the N newest survivors: a newer checkpoint that the rules delete, keep_every's non-multiples say,
            # would otherwise take a place, thin the older kept ones and leave fewer than N to resume from)
            full = set([i for i in ids if i in keep][-self.full_last :])
            thin = [
                i.id for i in infos
                if i.id in keep and i.id not in full
                and not is_thinned(i)
            ]
        return Plan(
            keep=[i for i in ids if i in keep and i not in thin],
            thin=thin,
            delete=[i for i in ids if i not in keep],
        )


def is_thinned(info: Any) -> bool:
    """Whether a checkpoint (its :class:`~deltackpt.CheckpointInfo`) was thinned to model weights only, as its
    metadata records: it never resumes training."""
    return isinstance(info.metadata, dict) and bool(info.metadata.get(THINNED_KEY))


def unranked_metric(retention: Retention, infos: Sequence[Any]) -> tuple[str, list[str]] | None:
    """When ``retention`` ranks by a ``keep_best`` metric that none of ``infos`` (anything with ``metadata``:
    checkpoints, DCP steps) records as a number: that metric, and the metadata keys they do record numbers
    under (a misspelt metric is then likely: the best checkpoint it was meant to keep is not kept, and only the
    other rules keep anything). None otherwise."""
    if retention.keep_best is None:
        return None
    metric = retention.keep_best[0]
    found: set[str] = set()
    for info in infos:
        if isinstance(info.metadata, dict):
            for key, value in info.metadata.items():
                if isinstance(key, str) and _score(value) is not None:
                    found.add(key)
    return None if metric in found else (metric, sorted(found))


def check_ranked(retention: Retention, infos: Sequence[Any]) -> None:
    """Refuse (ValueError, nothing deleted) a one-off application of ``retention`` (``Store.retain``,
    ``distributed.retain``) whose ``keep_best`` metric none of ``infos`` records as a number: a misspelt metric
    would delete every checkpoint the other rules do not keep, the best one included."""
    missing = unranked_metric(retention, infos)
    if missing is not None and infos:
        metric, found = missing
        recorded = f"numbers they record: {', '.join(map(repr, found))}" if found else "they record no numbers"
        raise ValueError(f"Retention(keep_best) ranks by {metric!r}, which no checkpoint records as a number "
                         f"({recorded}); nothing deleted")


def deleting_only(retention: Any, why: str) -> Retention:
    """``retention`` checked for a caller that deletes but cannot thin (``Store.retain``, DCP steps): a
    :class:`Retention` without ``full_last``; ``why`` ends the ValueError that refuses one with it."""
    if not isinstance(retention, Retention):
        raise TypeError(f"retention must be a deltackpt.Retention, got {type(retention).__name__}")
    if retention.full_last is not None:
        raise ValueError(f"{why} (full_last)")
    return retention


def _tagged(tag: object) -> bool:
    """Whether a ``tag`` metadata value tags its checkpoint: any value but None and False (a tag of 0 or "" is
    one; ``{"tag": is_milestone}`` with False is not)."""
    if isinstance(tag, (bool, np.bool_)):
        return bool(tag)
    return tag is not None


def _score(value: object) -> float | None:
    """A ``keep_best`` metric as a float: any real number (numpy scalars too, as ``np.mean`` returns them), not a
    bool, NaN or a value out of float's range; None for anything else (that checkpoint is not ranked)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    try:
        v = float(value)
    except (OverflowError, ValueError):
        return None
    return None if math.isnan(v) else v
