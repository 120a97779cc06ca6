"""Resumable data order: a deterministic epoch-aware sampler and a loader wrapper that counts what was used.

Where it sits: training-loop integration, next to :mod:`deltackpt.checkpointer`. The Checkpointer's ``data=``
object is saved with every checkpoint through its ``state_dict()`` and put back on restore through
``load_state_dict()``, so a resumed run sees exactly the batches the uninterrupted run would have seen: the
rest of the interrupted epoch, then the following epochs, in the same order and the same batches.

Two pieces, and an optional third:

* :class:`ResumableSampler` - a ``Sampler[int]`` for a plain ``torch.utils.data.DataLoader``. The order of
  epoch ``e`` is a pure function of ``(seed, e, len)``: ``torch.randperm(len)`` from a ``torch.Generator``
  seeded with ``seed + e`` (exactly ``DistributedSampler``'s order, which it can replace, ``num_replicas`` and
  ``rank`` included), or ``0 .. len-1`` with ``shuffle=False``. It keeps a cursor, (epoch, position), and an
  iteration starts there.
* :class:`ResumableLoader` - a thin wrapper around a DataLoader built with a ResumableSampler. It counts the
  samples of every batch the training loop actually received and moves the sampler's cursor accordingly;
  its ``state_dict()`` is that cursor.
* :class:`SeededDataset` - wraps a map-style dataset so that its random augmentations replay exactly: each
  sample is read with the Python, NumPy and torch CPU RNGs seeded from ``(seed, epoch, index)`` (a
  ResumableSampler over it yields ``(epoch, index)`` keys) and put back afterwards. A sample then looks the same
  whichever worker reads it and however often the run was stopped and resumed. A ResumableLoader over it also
  runs the DataLoader's ``collate_fn`` with the RNGs seeded from the batch's keys (a MixUp there replays too).

Why the wrapper: the sampler runs in the main process and hands indices to the DataLoader *ahead* of the
training loop - with ``num_workers > 0`` the DataLoader keeps ``prefetch_factor * num_workers`` batches in
flight, and with a partial last batch the sampler is exhausted before that batch is delivered - so counting
the indices the sampler yielded over-counts what the loop has consumed. Only the loop's side of the
DataLoader knows, hence ``ResumableSampler.state_dict()`` refuses (RuntimeError) unless a ResumableLoader
drives it; through one, ``sampler.state_dict()`` and ``loader.state_dict()`` are the same thing, and are
correct whatever ``num_workers``, ``prefetch_factor`` or ``persistent_workers`` are.

Typical use::

    sampler = ResumableSampler(dataset, seed=1234)
    loader = ResumableLoader(DataLoader(dataset, sampler=sampler, batch_size=32, num_workers=4))
    ckpt = deltackpt.Checkpointer("ckpts", model=model, optimizer=opt, data=loader)
    start = ckpt.restore()
    batches = loader.batches()                  # endless; epochs advance by themselves
    for step in range(start, total_steps):
        train_one_step(next(batches))
        ckpt.step(step + 1)

or epoch loops, which resume mid-epoch too: ``for epoch in range(loader.epoch, n_epochs): for batch in
loader: ...``. The state is plain values (ints, bools, a str), so it stores in a deltackpt checkpoint as is.

Semantics worth knowing:

* position counts *samples* (not batches) consumed in the current epoch, so a run may resume with another
  batch size. An epoch ends - the cursor becomes (epoch + 1, 0) - when the loop sees the DataLoader's
  iteration run out. A checkpoint taken right after an epoch's last batch, inside the loop, still says
  (epoch, end): the resumed pass over that epoch is empty and ends at once, which keeps an ``epoch`` counter
  of the training loop in step with the data.
* ``set_epoch(e)`` works as ``DistributedSampler.set_epoch``, except that setting the epoch the cursor is
  already in keeps its position - so ``sampler.set_epoch(epoch)`` at the top of a restored epoch loop does not
  throw the restored position away. Without ``set_epoch`` calls the epoch advances by itself when an iteration
  runs out.
* The wrapper also keeps starting an iteration from consuming the global torch RNG: a DataLoader draws the
  workers' base seed from its ``generator`` (default: the global RNG) every time an iteration starts, and a
  resumed run starts one more iteration than the uninterrupted run did, which would shift every later random
  draw of the training loop. When the DataLoader has no ``generator`` of its own, the wrapper seeds a private
  one from (seed, epoch, position, rank) for each iteration; worker seeds are then reproducible from run to
  run as well (a ``generator`` of the DataLoader's own is used as is: checkpointing it is up to you).
  Random augmentations inside workers still differ after a *mid-epoch* resume (each worker's RNG stream
  depends on the batches it handled before), as with any DataLoader - unless the dataset is a
  :class:`SeededDataset`, whose samples do not depend on any stream.
* ``load_state_dict`` raises ValueError when the state was saved for another dataset length, seed, shuffle
  or sharding - and when this torch orders the saved epoch differently (the state holds a fingerprint of
  the epoch's order; ``torch.randperm`` is not promised to be stable across torch versions), and TypeError
  for a malformed state.
* Loaders that keep their own position (torchdata's ``StatefulDataLoader`` and the like) need none of this:
  give them to the Checkpointer as ``data=`` directly, and their own ``state_dict()`` is saved.

Not supported: IterableDatasets (no sampler), DataLoaders with ``in_order=False`` (batches may arrive out
of order, so what was consumed is not a prefix), and custom batch samplers other than
``torch.utils.data.BatchSampler`` (their batch sizes are unknown to the wrapper).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import operator
import random
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    SequentialSampler,
)

from deltackpt import config

__all__ = ["ResumableLoader", "ResumableSampler", "SeededDataset"]

STATE_VERSION = 1
_CHUNK = 1 << 16  # indices converted to Python ints at a time
_FINGERPRINT_ITEMS = 256  # leading entries of an epoch's order that its fingerprint covers


def _int(value: Any, what: str, minimum: int | None = 0) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {out}")
    return out


class ResumableSampler(Sampler[int]):
    """Indices of a map-style dataset in an order that depends only on (seed, epoch, len), with a cursor.

    ``data_source_or_len``: the dataset (anything with ``len``; its length is read once, here) or the length.
    ``shuffle``: a ``randperm`` per epoch from a ``torch.Generator`` seeded with ``seed + epoch`` (as
    ``DistributedSampler``); otherwise ``0 .. len-1`` every epoch. ``num_replicas``/``rank``: shard each epoch
    over that many ranks as ``DistributedSampler`` does (pad by repeating indices so all ranks get
    ``num_samples``, or with ``drop_last=True`` drop the tail); ``drop_last`` has no effect with one replica -
    incomplete *batches* are the DataLoader's ``drop_last``.

    The cursor (``epoch``, ``position``) says where the next iteration starts: it yields the epoch's indices
    from ``position`` on. Driven by a :class:`ResumableLoader`, the cursor follows what the training loop
    consumed, and only that loader moves it (iterating the bare DataLoader then repeats). Used alone, an
    iteration that runs out moves the cursor to (epoch + 1, 0); ``state_dict()`` then raises, because the
    sampler alone cannot know how far the loop got (see the module docstring).

    Over a :class:`SeededDataset` it yields ``(epoch, index)`` pairs, the keys that dataset seeds its samples
    from, in the same order; over anything else, the indices.
    """

    def __init__(
        self,
        data_source_or_len: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if isinstance(data_source_or_len, IterableDataset):
            raise TypeError("ResumableSampler needs a map-style dataset or a length, not an IterableDataset")
        self._keyed = isinstance(data_source_or_len, SeededDataset)  # yield (epoch, index) keys
        if isinstance(data_source_or_len, Sized):
            n = len(data_source_or_len)
        else:
            n = _int(data_source_or_len, "data_source_or_len (a dataset or its length)")
        self.dataset_len = n
        self.shuffle = config.boolean("shuffle", shuffle)
        self.seed = _int(seed, "seed", minimum=None)
        if not -(1 << 63) <= self.seed < 1 << 63:  # (each epoch seeds a torch.Generator with seed + epoch)
            raise ValueError(f"seed must be in [-2**63, 2**63), got {self.seed}")
        self.drop_last = config.boolean("drop_last", drop_last)
        self.num_replicas = _int(num_replicas, "num_replicas", minimum=1)
        self.rank = _int(rank, "rank")
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas - 1}]")
        if self.drop_last and n % self.num_replicas:
            self.num_samples = n // self.num_replicas
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._epoch = 0
        self._position = 0
        self._driven = False  # a ResumableLoader moves the cursor
        self._pulling = False  # that loader is asking its DataLoader for a batch (or starting it)
        self._warned = False
        self._token = 0  # bumped when an iteration starts or the cursor is moved: older iterations stop
        self._cache: tuple[int, torch.Tensor] | None = None  # (epoch, its global order)
        self._dataloader: weakref.ref[DataLoader] | None = None  # the DataLoader a ResumableLoader drives it in
        # (weakly) what to call with each DataLoader a ResumableLoader drives it in from now on: a Checkpointer
        # given the sampler as data= protects the workers of a loader built after it
        self._on_dataloader: list[weakref.WeakMethod[Any]] = []

    def __getstate__(self) -> dict[str, Any]:  # (a weak reference does not pickle)
        return {**self.__dict__, "_dataloader": None, "_on_dataloader": []}

    @property
    def dataloader(self) -> DataLoader | None:
        """The DataLoader whose :class:`ResumableLoader` drives this sampler (a Checkpointer given the sampler as
        ``data=`` protects that loader's workers), or None."""
        return self._dataloader() if self._dataloader is not None else None

    def _epoch_in_range(self, epoch: int, what: str) -> int:
        """``epoch``, or ValueError when seed + epoch, which seeds a shuffled epoch's order, is past what a
        ``torch.Generator`` takes (2**64 - 1). Without shuffling no generator is seeded and any epoch goes."""
        if self.shuffle and self.seed + epoch >= 1 << 64:
            raise ValueError(f"{what} {epoch} is out of range: seed + epoch must be below 2**64 (seed {self.seed})")
        return epoch

    # -- the order ------------------------------------------------------------------------------------------
    def _order(self, epoch: int) -> torch.Tensor:
        """The global order of ``epoch`` (all ``dataset_len`` indices, int64), before padding and sharding."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=g, device="cpu")
        else:
            order = torch.arange(self.dataset_len, dtype=torch.int64, device="cpu")
        self._cache = (epoch, order)
        return order

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's ``num_samples`` indices of ``epoch``, in order (an int64 tensor)."""
        epoch = self._epoch_in_range(_int(epoch, "epoch"), "epoch")
        order = self._order(epoch)
        if self.num_replicas == 1:
            return order
        if self.total_size > self.dataset_len:  # pad by repeating the order from its start
            reps = math.ceil(self.total_size / self.dataset_len)
            order = order.repeat(reps)
        return order[self.rank : self.total_size : self.num_replicas]

    def _fingerprint(self, epoch: int) -> str:
        head = self._order(epoch)[:_FINGERPRINT_ITEMS].numpy().astype("<i8")
        return hashlib.blake2b(head.tobytes(), digest_size=8).hexdigest()

    # -- the cursor -----------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next (or the running) iteration covers."""
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of ``epoch`` already consumed (driven by a ResumableLoader) - where an iteration starts."""
        return self._position

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch`` - or, when the cursor is in ``epoch`` already, keep its position."""
        epoch = self._epoch_in_range(_int(epoch, "epoch"), "epoch")
        if epoch != self._epoch:
            self._epoch, self._position = epoch, 0
            self._token += 1

    def __len__(self) -> int:
        """Indices per (whole) epoch: ``num_samples``."""
        return self.num_samples

    def __iter__(self) -> Iterator[Any]:
        rest = self.indices(self._epoch)[self._position :]
        key_epoch = self._epoch if self._keyed else None
        if self._driven:  # the ResumableLoader moves the cursor as the loop consumes
            if not self._pulling and not self._warned:
                self._warned = True
                warnings.warn("a ResumableSampler driven by a ResumableLoader is iterated by its bare DataLoader: "
                              "iterate the ResumableLoader (for batch in loader), else every epoch repeats the "
                              "same order and the saved data position does not move", RuntimeWarning, stacklevel=2)
            return _stream(rest, key_epoch)
        self._token += 1
        return self._undriven(rest, self._token, self._epoch)

    def _undriven(self, rest: torch.Tensor, token: int, epoch: int) -> Iterator[Any]:
        yield from _stream(rest, epoch if self._keyed else None)
        if self._token == token and not self._driven:
            self._epoch, self._position = epoch + 1, 0

    # -- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The cursor and what it is valid for, as plain values (only when a ResumableLoader drives it)."""
        if not self._driven:
            raise RuntimeError(
                "ResumableSampler.state_dict() needs a ResumableLoader: the sampler hands indices to the "
                "DataLoader ahead of the training loop (prefetching), so only the loader knows what was "
                "consumed. Wrap it - loader = deltackpt.data.ResumableLoader(DataLoader(..., "
                "sampler=sampler)) - and save loader.state_dict()"
            )
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "drop_last": self.drop_last,
            "fingerprint": self._fingerprint(self._epoch),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Move the cursor to a saved one; the next iteration resumes there (one in flight stops).

        Raises ValueError when the state was saved for another dataset length, seed, shuffle, sharding, or
        when this torch orders that epoch differently (its fingerprint).
        """
        self._epoch, self._position = self.check_state_dict(state)
        self._token += 1

    def check_state_dict(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """The (epoch, position) :meth:`load_state_dict` would move to; raises as it does, changing nothing
        (a restore checks the data position before it puts anything back)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"a sampler state is a mapping, got {type(state).__name__}")
        missing = [k for k in ("epoch", "position", "len", "seed", "shuffle") if k not in state]
        if missing:
            raise ValueError(f"not a ResumableSampler state: missing {', '.join(missing)}")
        version = state.get("version", STATE_VERSION)
        if version != STATE_VERSION:
            raise ValueError(f"unknown ResumableSampler state version {version!r} (expected {STATE_VERSION})")
        if _int(state["len"], "saved dataset length") != self.dataset_len:
            raise ValueError(
                f"the data position was saved for a dataset of {state['len']} items, but this sampler's "
                f"dataset has {self.dataset_len}: resuming would repeat or skip samples"
            )
        seed = _int(state["seed"], "saved seed", minimum=None)
        if seed != self.seed:
            raise ValueError(f"the data position was saved with seed {seed}, but this sampler has {self.seed}")
        shuffle = config.boolean("saved shuffle", state["shuffle"])
        if shuffle != self.shuffle:
            raise ValueError(
                f"the data position was saved with shuffle={shuffle}, but this sampler has shuffle={self.shuffle}"
            )
        replicas = _int(state.get("num_replicas", 1), "saved num_replicas", minimum=1)
        if replicas != self.num_replicas:
            raise ValueError(
                f"the data position was saved with num_replicas={replicas}, but this sampler has "
                f"num_replicas={self.num_replicas}"
            )
        drop_last = config.boolean("saved drop_last", state.get("drop_last", False))
        if self.num_replicas > 1 and drop_last != self.drop_last:
            raise ValueError(
                f"the data position was saved with drop_last={drop_last}, but this sampler has "
                f"drop_last={self.drop_last}"
            )
        epoch = self._epoch_in_range(_int(state["epoch"], "saved epoch"), "saved epoch")
        position = _int(state["position"], "saved position")
        if position > self.num_samples:
            raise ValueError(f"saved position {position} is past the end of an epoch of {self.num_samples}")
        fingerprint = state.get("fingerprint")
        if fingerprint is not None and fingerprint != self._fingerprint(epoch):
            raise ValueError(
                f"epoch {epoch} is not in the order it was saved in (order fingerprint {fingerprint}, now "
                f"{self._fingerprint(epoch)}): torch.randperm differs between the torch versions"
            )
        return epoch, position

    def __repr__(self) -> str:
        return (
            f"ResumableSampler(len={self.dataset_len}, shuffle={self.shuffle}, seed={self.seed}, "
            f"epoch={self._epoch}, position={self._position}/{self.num_samples})"
        )


def _stream(rest: torch.Tensor, epoch: int | None = None) -> Iterator[Any]:
    """The indices of ``rest``, or with ``epoch`` the keys ``(epoch, index)`` of a :class:`SeededDataset`."""
    for chunk in rest.split(_CHUNK):
        if epoch is None:
            yield from chunk.tolist()
        else:
            yield from ((epoch, i) for i in chunk.tolist())


class SeededDataset(Dataset):
    """A map-style dataset whose samples are read with the RNGs seeded from ``(seed, epoch, index)``.

    ``dataset[(epoch, index)]`` seeds Python's ``random``, NumPy's global RNG and torch's CPU generator from a
    hash of ``(seed, epoch, index)``, reads ``dataset[index]`` from the wrapped dataset, and puts the three
    states back as they were (also when the read raises). Random augmentations that draw from those RNGs
    (torchvision's transforms, ``np.random``, ``random``) therefore depend on nothing but the seed, the epoch
    and the sample: not on the worker that reads it, ``num_workers``, ``persistent_workers``, the batch size or
    where a run was stopped and resumed. A :class:`ResumableSampler` built over this dataset yields those keys.

    ``dataset[index]`` with a plain int reads the wrapped sample as it is, RNGs untouched (another sampler,
    inspecting a sample by hand). CUDA generators are never touched; a dataset drawing from a generator of its
    own (``torch.Generator``, ``np.random.default_rng``) is not seeded by this. Each read costs about 0.1 ms
    more for the seeding and the states put back (mostly NumPy's). Other attributes are the wrapped dataset's.
    """

    def __init__(self, dataset: Any, seed: int = 0) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("SeededDataset wraps a map-style dataset, not an IterableDataset")
        if not callable(getattr(dataset, "__getitem__", None)):
            raise TypeError(f"SeededDataset wraps a map-style dataset (with __getitem__), got {type(dataset).__name__}")
        self.dataset = dataset
        self.seed = _int(seed, "seed", minimum=None)

    def sample_seed(self, epoch: int, index: int) -> int:
        """The seed (in [0, 2**64)) that sample ``index`` of ``epoch`` is read with (NumPy's: mixed from it)."""
        return _seed_of(f"deltackpt.sample:{self.seed}:{_int(epoch, 'epoch')}:{_int(index, 'index', minimum=None)}")

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, tuple):
            return self.dataset[key]
        if len(key) != 2:
            raise TypeError(f"a SeededDataset key is (epoch, index), got a tuple of {len(key)}")
        epoch, index = key
        with _rngs_seeded(self.sample_seed(epoch, index)):
            return self.dataset[index]

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """The samples of a batch (the DataLoader reads a batch through this), keeping the batch's keys for the
        collate_fn that a :class:`ResumableLoader` seeds from them (:func:`_SeededCollate`)."""
        samples = [self[key] for key in keys]
        if not all(isinstance(key, tuple) for key in keys):
            return samples
        batch = _SeededBatch(samples)
        batch.keys = tuple(keys)
        return batch

    def batch_seed(self, keys: Any) -> int:
        """The seed (in [0, 2**64)) that the batch of these ``(epoch, index)`` keys is collated with."""
        return _batch_seed(self.seed, keys)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        dataset = self.__dict__.get("dataset")
        if dataset is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(dataset, name)

    def __repr__(self) -> str:
        return f"SeededDataset({self.dataset!r}, seed={self.seed})"


def _seed_of(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _batch_seed(seed: int, keys: Any) -> int:
    keys = ",".join(f"{_int(e, 'epoch')}:{_int(i, 'index', minimum=None)}" for e, i in keys)
    return _seed_of(f"deltackpt.batch:{seed}:{keys}")


@contextlib.contextmanager
def _rngs_seeded(seed: int) -> Iterator[None]:
    """Python's ``random``, NumPy's global RNG and torch's CPU generator seeded from ``seed``; put back after."""
    cpu = torch.default_generator  # (torch.manual_seed would also seed CUDA's generators)
    saved = random.getstate(), np.random.get_state(), cpu.get_state()
    try:
        random.seed(seed)
        # (NumPy's legacy RNG and random are both MT19937 seeded by init_by_array: seeded with the same
        # words, np.random.rand() would draw exactly random.random(), so NumPy's seed is mixed first)
        np.random.seed(np.random.SeedSequence(seed).generate_state(4))
        cpu.manual_seed(seed)
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        cpu.set_state(saved[2])


class _SeededBatch(list):
    """The samples of a batch read from a SeededDataset, with the keys they were read with."""

    keys: tuple[Any, ...] = ()


class _SeededCollate:
    """A DataLoader's ``collate_fn`` run with the RNGs seeded from the batch's keys (a :class:`SeededDataset`'s
    batch), so that a random batch-level augmentation (MixUp, CutMix in the collate_fn) draws the same whichever
    worker collates the batch and wherever the run was resumed. Other input is collated as it is."""

    def __init__(self, fn: Any, dataset: SeededDataset) -> None:
        self.fn = fn
        self.seed = dataset.seed

    def __call__(self, batch: Any) -> Any:
        if not isinstance(batch, _SeededBatch):
            return self.fn(batch)
        with _rngs_seeded(_batch_seed(self.seed, batch.keys)):
            return self.fn(list(batch))

    def __repr__(self) -> str:
        return f"_SeededCollate({self.fn!r}, seed={self.seed})"


class ResumableLoader:
    """A DataLoader (built with a :class:`ResumableSampler`) that counts what the training loop consumed.

    Iterating it iterates the DataLoader from the sampler's cursor to the end of that epoch; every batch the
    loop receives advances the cursor by that batch's samples (``batch_size``, or what is left of the epoch
    for the last one), and running out moves it to (epoch + 1, 0). So a ``state_dict()`` taken at any point
    of the loop - between batches or inside the loop body - says exactly where the next batch comes from,
    whatever ``num_workers`` and prefetching are. ``load_state_dict()`` moves the cursor; the next iteration
    resumes there. Moving the cursor (``load_state_dict``, ``set_epoch`` to another epoch) or starting a new
    iteration ends an iteration in flight. Other attributes (``dataset``, ``batch_size``, ...) are the
    DataLoader's.
    """

    def __init__(self, loader: DataLoader) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"ResumableLoader wraps a torch DataLoader, got {type(loader).__name__}")
        if isinstance(loader.dataset, IterableDataset):
            raise TypeError("ResumableLoader needs a map-style dataset; an IterableDataset has no sampler (pass a "
                            "loader with state_dict()/load_state_dict(), such as torchdata's StatefulDataLoader, as "
                            "data= instead)")
        if getattr(loader, "in_order", True) is False:
            raise ValueError(
                "ResumableLoader needs in_order=True: with out-of-order batches the consumed samples are no "
                "prefix of the epoch's order"
            )
        bs = loader.batch_sampler
        if bs is None:  # automatic batching off: one sample per item
            sampler, batch_size, drop_last = loader.sampler, 1, False
        elif type(bs) is BatchSampler:
            sampler, batch_size, drop_last = bs.sampler, bs.batch_size, bs.drop_last
        else:
            raise TypeError(
                f"ResumableLoader cannot count samples of a custom batch sampler ({type(bs).__name__}); use "
                "batch_size= with a ResumableSampler as sampler="
            )
        if not isinstance(sampler, ResumableSampler):
            if isinstance(sampler, SequentialSampler):
                order = "shuffle=False, for the dataset's order"
            elif isinstance(sampler, DistributedSampler):  # (the same order and shard: the hint keeps both)
                order = (f"shuffle={sampler.shuffle}, seed={sampler.seed}, drop_last={sampler.drop_last}, "
                         f"num_replicas={sampler.num_replicas}, rank={sampler.rank}")
            else:
                order = "shuffle=True, seed=..."
            raise TypeError(
                f"the DataLoader's sampler is a {type(sampler).__name__}; build it with "
                f"sampler=deltackpt.data.ResumableSampler(dataset, {order})"
            )
        if isinstance(loader.dataset, SeededDataset) and not sampler._keyed:
            raise TypeError(
                "the DataLoader's dataset is a SeededDataset, but its ResumableSampler was built over a length or "
                "another dataset: its plain indices would read every sample unseeded; build it with "
                "ResumableSampler(seeded_dataset, ...)"
            )
        if sampler._keyed and not isinstance(loader.dataset, SeededDataset):
            raise TypeError(
                f"the ResumableSampler was built over a SeededDataset, but the DataLoader reads a "
                f"{type(loader.dataset).__name__}, which its (epoch, index) keys would index wrongly (an array's "
                "[epoch, index]); give the DataLoader the SeededDataset"
            )
        if isinstance(loader.dataset, SeededDataset) and bs is not None and not isinstance(loader.collate_fn,
                                                                                           _SeededCollate):
            # (a collate_fn that draws, run in whichever worker gets the batch, would draw from that worker's
            # stream: seeded from the batch's keys instead)
            loader.collate_fn = _SeededCollate(loader.collate_fn, loader.dataset)
        self.loader = loader
        self.sampler = sampler
        self._batch_size = batch_size
        self._drop_last = drop_last
        sampler._driven = True
        sampler._dataloader = weakref.ref(loader)
        for ref in list(getattr(sampler, "_on_dataloader", ())):
            callback = ref()
            if callback is None:
                sampler._on_dataloader.remove(ref)
            else:
                callback(loader)
        sampler._token += 1  # an undriven iteration in flight no longer moves the cursor

    # -- the cursor -----------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next (or the running) iteration covers."""
        return self.sampler.epoch

    @property
    def position(self) -> int:
        """Samples of ``epoch`` the training loop has received."""
        return self.sampler.position

    def set_epoch(self, epoch: int) -> None:
        """As ``ResumableSampler.set_epoch``: another epoch starts at its start, the current one stays."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "len", "seed", "shuffle", ...}``: plain values, the sampler's state."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved cursor (ValueError when it was saved for another dataset length, seed, shuffle or
        sharding, or this torch orders the epoch differently; TypeError for a malformed state)."""
        self.sampler.load_state_dict(state)

    def check_state_dict(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """:meth:`ResumableSampler.check_state_dict`: raises as :meth:`load_state_dict` would, changing nothing."""
        return self.sampler.check_state_dict(state)

    # -- iteration ------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches of a whole epoch (the DataLoader's length); a resumed epoch yields fewer."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        s._token += 1
        token = s._token
        epoch, position = s._epoch, s._position
        total = s.num_samples
        it = self._start()
        try:
            while True:
                s._pulling = True  # (the sampler tells its iteration by the DataLoader from others)
                try:
                    batch = next(it)
                except StopIteration:
                    break
                finally:
                    s._pulling = False
                if s._token != token:  # the cursor was moved, or another iteration started
                    return
                position += self._batch_size if self._drop_last else min(self._batch_size, total - position)
                s._position = position
                yield batch
            if s._token == token:
                s._epoch, s._position = epoch + 1, 0
        finally:
            del it

    def _start(self) -> Iterator[Any]:
        """iter(DataLoader), the workers' base seed drawn from a private generator, not the global RNG."""
        s = self.sampler
        s._pulling = True  # (workers prefetch: the DataLoader starts iterating the sampler here)
        try:
            return self._iter_loader()
        finally:
            s._pulling = False

    def _iter_loader(self) -> Iterator[Any]:
        s = self.sampler
        g = self.loader.generator
        if g is not None:  # the user's: draws from it only where an epoch starts, resumed or not
            if s.position == 0:
                return iter(self.loader)
            # The rest of an epoch (a resumed run's first iteration, or a loop's after a break): iter() draws
            # the workers' base seed from it, which a run that went on without stopping never drew; put back its
            # state so that later epochs draw what that run drew (the rest of this one gets other worker seeds).
            state = g.get_state()
            try:
                return iter(self.loader)
            finally:
                g.set_state(state)
        key = f"deltackpt.data:{s.seed}:{s.epoch}:{s.position}:{s.rank}".encode()
        g = torch.Generator()
        g.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)
        self.loader.generator = g
        try:
            return iter(self.loader)
        finally:
            self.loader.generator = None

    def batches(self, max_epochs: int | None = None) -> Iterator[Any]:
        """Batch after batch across epochs, from the cursor on; stops once ``epoch`` reaches ``max_epochs``.

        Endless with ``max_epochs=None`` (then the first ``next()`` raises ValueError if an epoch has no batch
        at all).
        """
        if max_epochs is None and len(self.loader) == 0:
            raise ValueError("the DataLoader yields no batch in an epoch; batches() would never yield")
        while max_epochs is None or self.sampler.epoch < max_epochs:
            yield from self

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(loader, name)

    def __repr__(self) -> str:
        bs, dl = self._batch_size, self._drop_last
        return f"ResumableLoader({self.sampler!r}, batch_size={bs}, drop_last={dl})"
