"""deltackpt.data: a run stopped anywhere and resumed in fresh objects sees exactly its remaining batches."""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    SequentialSampler,
    TensorDataset,
)

import deltackpt
from deltackpt.data import ResumableLoader, ResumableSampler, SeededDataset

EPOCHS = 3
N, BS = 23, 4  # 5 full batches and one of 3 per epoch; 5 batches with drop_last


def make(
    n: int = N,
    bs: int | None = BS,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    workers: int = 0,
    sampler_cls: type[ResumableSampler] = ResumableSampler,
    **kw: Any,
) -> ResumableLoader:
    """A fresh dataset, sampler, DataLoader and wrapper, as a restarted process builds them."""
    ds = TensorDataset(torch.arange(n))
    sampler = sampler_cls(ds, shuffle=shuffle, seed=seed)
    dl = DataLoader(ds, sampler=sampler, batch_size=bs, drop_last=drop_last, num_workers=workers, **kw)
    return ResumableLoader(dl)


def ids(batch: Any) -> list[int]:
    (x,) = batch
    return x.reshape(-1).tolist()


def expected(n: int, bs: int, *, shuffle: bool, seed: int, drop_last: bool, epochs: int = EPOCHS) -> list:
    """The batches of ``epochs`` epochs, computed without deltackpt."""
    out = []
    for e in range(epochs):
        if shuffle:
            g = torch.Generator()
            g.manual_seed(seed + e)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        for i in range(0, n, bs):
            if len(order[i : i + bs]) == bs or not drop_last:
                out.append(order[i : i + bs])
    return out


def run_epochs(loader: ResumableLoader, stop: int | None = None, epochs: int = EPOCHS) -> tuple[list, Any]:
    """``for epoch in range(loader.epoch, epochs): for batch in loader`` - stopping (state taken inside the
    loop body, right after batch number ``stop``) when asked."""
    out: list = []
    if stop == 0:
        return out, loader.state_dict()
    for _ in range(loader.epoch, epochs):
        for b in loader:
            out.append(ids(b))
            if len(out) == stop:
                return out, loader.state_dict()
    return out, None


def run_set_epoch(loader: ResumableLoader, start: int, stop: int | None = None) -> tuple[list, Any, int]:
    """A DistributedSampler-style loop: ``for epoch in range(start, EPOCHS): set_epoch(epoch); ...``."""
    out: list = []
    for epoch in range(start, EPOCHS):
        loader.set_epoch(epoch)
        for b in loader:
            out.append(ids(b))
            if len(out) == stop:
                return out, loader.state_dict(), epoch
    return out, None, EPOCHS


def run_stream(loader: ResumableLoader, stop: int | None = None) -> tuple[list, Any]:
    """Step-style: ``next(loader.batches(max_epochs))`` until done or ``stop`` batches."""
    out: list = []
    for b in loader.batches(max_epochs=EPOCHS):
        out.append(ids(b))
        if len(out) == stop:
            break
    return out, (loader.state_dict() if stop is not None else None)


def assert_plain(state: dict[str, Any]) -> None:
    for k, v in state.items():
        assert type(v) in (int, bool, str), f"{k}: {type(v).__name__} is not a plain value"


def check_resume(factory: Callable[[], ResumableLoader], ks: list[int], ref: list) -> None:
    full, _ = run_epochs(factory())
    assert full == ref
    for k in ks:
        first, state = run_epochs(factory(), stop=k)
        assert first == ref[:k]
        assert state is not None
        assert_plain(state)
        resumed = factory()
        resumed.load_state_dict(state)
        rest, _ = run_epochs(resumed)
        assert first + rest == ref, f"resume after {k} batches"


# -- (1) stop anywhere, resume exactly -------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_matches_uninterrupted_run(workers: int, shuffle: bool, drop_last: bool) -> None:
    ref = expected(N, BS, shuffle=shuffle, seed=7, drop_last=drop_last)
    per_epoch = len(ref) // EPOCHS
    # mid-epoch, exactly at the end of an epoch, just past it (worker processes are slow to start: fewer)
    ks = [3, per_epoch, per_epoch + 1]
    if workers == 0:  # + nothing consumed, the first batch, mid third epoch, the very end, ...
        ks += [0, 1, per_epoch - 1, 2 * per_epoch, 2 * per_epoch + 1, 2 * per_epoch + 2]
        ks += [len(ref) - 1, len(ref)]

    def factory() -> ResumableLoader:
        return make(shuffle=shuffle, seed=7, drop_last=drop_last, workers=workers)

    check_resume(factory, ks, ref)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_with_batches_stream(workers: int) -> None:
    ref = expected(N, BS, shuffle=True, seed=3, drop_last=False)
    full, _ = run_stream(make(seed=3, workers=workers))
    assert full == ref
    for k in (6, 13) if workers else (2, 6, 7, 13):
        first, state = run_stream(make(seed=3, workers=workers), stop=k)
        assert first == ref[:k]
        resumed = make(seed=3, workers=workers)
        resumed.load_state_dict(state)
        rest, _ = run_stream(resumed)
        assert first + rest == ref, k


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_with_set_epoch_loop(drop_last: bool) -> None:
    ref = expected(N, BS, shuffle=True, seed=0, drop_last=drop_last)
    per_epoch = len(ref) // EPOCHS
    full, _, _ = run_set_epoch(make(drop_last=drop_last), 0)
    assert full == ref
    for k in (1, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch + 3):
        first, state, epoch = run_set_epoch(make(drop_last=drop_last), 0, stop=k)
        resumed = make(drop_last=drop_last)
        resumed.load_state_dict(state)
        rest, _, _ = run_set_epoch(resumed, epoch)  # the loop's own epoch counter, restored
        assert first + rest == ref, k


def test_resume_with_persistent_workers_and_a_broken_iteration() -> None:
    ref = expected(N, BS, shuffle=True, seed=5, drop_last=False)

    def factory() -> ResumableLoader:
        return make(seed=5, workers=2, persistent_workers=True, prefetch_factor=3)

    loader = factory()
    got = []
    for b in loader:  # break mid-epoch, then iterate again: the epoch goes on where the loop left it
        got.append(ids(b))
        if len(got) == 2:
            break
    rest, _ = run_epochs(loader)
    assert got + rest == ref
    first, state = run_epochs(factory(), stop=8)
    resumed = factory()
    resumed.load_state_dict(state)
    assert first + run_epochs(resumed)[0] == ref


def test_prefetched_indices_are_not_counted() -> None:
    class Counting(ResumableSampler):
        handed_out = 0

        def __iter__(self):  # type: ignore[override]
            for i in super().__iter__():
                self.handed_out += 1
                yield i

    n, bs = 64, 2
    loader = make(n, bs, seed=1, workers=2, prefetch_factor=4, sampler_cls=Counting)
    it = iter(loader)
    first = ids(next(it))
    state = loader.state_dict()
    assert state["position"] == bs and state["epoch"] == 0
    assert loader.sampler.handed_out > bs  # the DataLoader pulled indices ahead of the loop
    del it
    ref = expected(n, bs, shuffle=True, seed=1, drop_last=False)
    resumed = make(n, bs, seed=1, workers=2)
    resumed.load_state_dict(state)
    assert [first] + run_epochs(resumed)[0] == ref


@given(
    n=st.integers(0, 40),
    bs=st.integers(1, 9),
    seed=st.integers(0, 2**31),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_resume_property(
    n: int, bs: int, seed: int, shuffle: bool, drop_last: bool, data: st.DataObject
) -> None:
    ref = expected(n, bs, shuffle=shuffle, seed=seed, drop_last=drop_last)
    k = data.draw(st.integers(0, len(ref)), label="k")

    def factory() -> ResumableLoader:
        return make(n, bs, shuffle=shuffle, seed=seed, drop_last=drop_last)

    first, state = run_epochs(factory(), stop=k)
    assert first == ref[:k]
    resumed = factory()
    resumed.load_state_dict(state)
    assert first + run_epochs(resumed)[0] == ref


def test_resume_with_another_batch_size_keeps_the_sample_order() -> None:
    ref = expected(N, 1, shuffle=True, seed=2, drop_last=False)  # the sample order
    first, state = run_epochs(make(bs=4, seed=2), stop=8)  # 8 batches of 4: 23 + 9 samples
    resumed = make(bs=5, seed=2)
    resumed.load_state_dict(state)
    rest, _ = run_epochs(resumed)
    assert all(len(b) <= 5 for b in rest)
    assert [i for b in first + rest for i in b] == [i for b in ref for i in b]


def test_without_automatic_batching() -> None:
    ref = expected(N, 1, shuffle=True, seed=4, drop_last=False)
    ref = [[i] for b in ref for i in b]
    assert run_epochs(make(bs=None, seed=4))[0] == ref
    first, state = run_epochs(make(bs=None, seed=4), stop=30)
    resumed = make(bs=None, seed=4)
    resumed.load_state_dict(state)
    assert first + run_epochs(resumed)[0] == ref


def test_sharded_ranks_resume_in_lockstep() -> None:
    def rank_loader(rank: int) -> ResumableLoader:
        ds = TensorDataset(torch.arange(N))
        s = ResumableSampler(ds, seed=9, num_replicas=3, rank=rank)
        return ResumableLoader(DataLoader(ds, sampler=s, batch_size=2))

    refs = [run_epochs(rank_loader(r))[0] for r in range(3)]
    for e in range(EPOCHS):  # together the ranks cover the dataset every epoch (padded to 24)
        per_epoch = len(refs[0]) // EPOCHS
        seen = [i for r in range(3) for b in refs[r][e * per_epoch : (e + 1) * per_epoch] for i in b]
        assert len(seen) == 24 and set(seen) == set(range(N))
    _, state = run_epochs(rank_loader(0), stop=5)
    for r in range(3):  # rank 0's state resumes every rank (they consume in lockstep)
        resumed = rank_loader(r)
        resumed.load_state_dict(state)
        assert run_epochs(resumed)[0] == refs[r][5:]


# -- (2) epoch orders ------------------------------------------------------------------------------------


def test_epochs_differ_and_are_reproducible_from_the_seed() -> None:
    n = 50
    a, b, c = ResumableSampler(n, seed=11), ResumableSampler(n, seed=11), ResumableSampler(n, seed=12)
    orders = [a.indices(e).tolist() for e in range(5)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len({tuple(o) for o in orders}) == 5
    assert orders == [b.indices(e).tolist() for e in range(5)]
    assert orders != [c.indices(e).tolist() for e in range(5)]
    assert ResumableSampler(n, shuffle=False).indices(3).tolist() == list(range(n))
    # through a DataLoader: epochs advance by themselves, and fresh objects give the same run
    runs = [run_epochs(make(n, 5, seed=11))[0] for _ in range(2)]
    assert runs[0] == runs[1]
    flat = [[i for bt in runs[0][e * 10 : (e + 1) * 10] for i in bt] for e in range(EPOCHS)]
    assert flat == orders[:EPOCHS]


def test_the_sampler_alone_advances_epochs_and_honours_set_epoch() -> None:
    ds = TensorDataset(torch.arange(N))
    s = ResumableSampler(ds, seed=6)
    dl = DataLoader(ds, sampler=s, batch_size=BS)
    got = [[i for b in dl for i in ids(b)] for _ in range(EPOCHS)]
    assert got == [s.indices(e).tolist() for e in range(EPOCHS)]
    assert s.epoch == EPOCHS and len(s) == N
    s.set_epoch(1)
    assert [i for b in dl for i in ids(b)] == s.indices(1).tolist()
    with pytest.raises(RuntimeError, match="ResumableLoader"):
        s.state_dict()  # it cannot know what the loop consumed


@pytest.mark.parametrize("n,replicas", [(10, 1), (10, 3), (11, 3), (5, 4), (12, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_order_as_distributed_sampler(n: int, replicas: int, drop_last: bool, shuffle: bool) -> None:
    ds = TensorDataset(torch.arange(n))
    for rank in range(replicas):
        kw: dict[str, Any] = dict(num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5)
        kw["drop_last"] = drop_last
        d, r = DistributedSampler(ds, **kw), ResumableSampler(ds, **kw)
        assert len(r) == len(d)
        for e in range(3):
            d.set_epoch(e)
            r.set_epoch(e)
            assert list(r) == list(d)


def test_set_epoch_keeps_the_position_of_the_current_epoch() -> None:
    _, state = run_epochs(make(), stop=8)  # epoch 1, 2 batches in
    loader = make()
    loader.load_state_dict(state)
    assert (loader.epoch, loader.position) == (1, 8)
    loader.set_epoch(1)
    assert (loader.epoch, loader.position) == (1, 8)
    loader.set_epoch(2)
    assert (loader.epoch, loader.position) == (2, 0)


def test_starting_an_iteration_leaves_the_global_rng_alone() -> None:
    """A resumed run starts one iteration more than the uninterrupted one; the training loop's random draws
    after a restore must still be the same."""
    ref_ids, ref_draws = [], []
    torch.manual_seed(123)
    loader = make(seed=1)
    rng_at: dict[int, torch.Tensor] = {}
    state_at: dict[int, Any] = {}
    for b in loader.batches(max_epochs=EPOCHS):
        ref_ids.append(ids(b))
        ref_draws.append(torch.rand(2))  # the training step's randomness (dropout, ...)
        k = len(ref_ids)
        rng_at[k], state_at[k] = torch.get_rng_state(), loader.state_dict()
    for k in (3, 6, 7, 12):
        resumed = make(seed=1)
        resumed.load_state_dict(state_at[k])
        torch.set_rng_state(rng_at[k])
        got_ids, got_draws = [], []
        for b in resumed.batches(max_epochs=EPOCHS):
            got_ids.append(ids(b))
            got_draws.append(torch.rand(2))
        assert got_ids == ref_ids[k:]
        assert all(torch.equal(x, y) for x, y in zip(got_draws, ref_draws[k:], strict=True)), k


class _RandomItems(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(())  # an augmentation drawn in the worker


def test_worker_seeds_are_reproducible() -> None:
    def run() -> list[float]:
        ds = _RandomItems()
        loader = ResumableLoader(DataLoader(ds, sampler=ResumableSampler(ds), batch_size=3, num_workers=2))
        return [v for b in loader for v in b.tolist()]

    torch.manual_seed(0)
    a = run()
    torch.manual_seed(1)  # the global RNG does not pick the worker seeds
    assert run() == a


@pytest.mark.parametrize("stop", [2, 4], ids=["mid-epoch", "epoch-boundary"])
def test_a_users_generator_checkpointed_with_the_cursor_replays_the_later_epochs(stop: int) -> None:
    """A DataLoader with a generator of its own, saved and restored beside the cursor: the resumed run draws
    from it where the uninterrupted one did (each epoch start), so the epochs after the resume get the same
    worker seeds and augmentations. Before, the resumed iteration drew once more and shifted every later epoch,
    even for a resume at an epoch boundary."""
    def build() -> tuple[ResumableLoader, torch.Generator]:
        ds, gen = _RandomItems(), torch.Generator().manual_seed(7)
        return ResumableLoader(DataLoader(ds, sampler=ResumableSampler(ds, seed=3), batch_size=3, num_workers=1,
                                          generator=gen)), gen

    loader, gen = build()
    it = loader.batches()
    ref = [next(it).tolist() for _ in range(12)]  # three epochs of four batches
    loader, gen = build()
    it = loader.batches()
    got = [next(it).tolist() for _ in range(stop)]
    saved, rng = loader.state_dict(), gen.get_state()
    del it
    loader, gen = build()  # a restarted process
    loader.load_state_dict(saved)
    gen.set_state(rng)
    it = loader.batches()
    got += [next(it).tolist() for _ in range(12 - stop)]
    assert got[4:] == ref[4:]  # every epoch after the one resumed in
    assert got[:stop] == ref[:stop]


class _Augmented(Dataset):
    """Each sample is its index plus one draw from each of the three RNGs an augmentation pipeline uses."""

    def __len__(self) -> int:
        return 13

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand()), random.random()],
                            dtype=torch.float64)


def _seeded(workers: int, *, seed: int = 5, bs: int = 3, **kw: Any) -> ResumableLoader:
    ds = SeededDataset(_Augmented(), seed=seed)
    return ResumableLoader(DataLoader(ds, sampler=ResumableSampler(ds, seed=1), batch_size=bs, num_workers=workers,
                                      **kw))


def _rows(batches: list[torch.Tensor]) -> list[list[float]]:
    return [row for b in batches for row in b.tolist()]


@pytest.mark.parametrize(("workers", "resumed_workers", "kw"), [
    (0, 0, {}), (2, 1, {}), (2, 2, {"persistent_workers": True}), (1, 0, {}),
], ids=["main-process", "2-then-1-workers", "persistent-workers", "worker-then-main"])
def test_a_seeded_dataset_replays_augmentations_after_any_resume(workers: int, resumed_workers: int,
                                                                 kw: dict[str, Any]) -> None:
    """A run stopped anywhere (mid-epoch, at an epoch boundary) and resumed in new objects, with another number
    of workers, reads every later sample with the same augmentations as the run that never stopped. Without the
    wrapper, a worker's stream depends on the batches it read before, so a mid-epoch resume changes them."""
    it = _seeded(0).batches(max_epochs=3)
    ref = _rows(list(it))  # three epochs of 13 samples, read in the main process
    assert len(ref) == 39 and len({r[1] for r in ref}) == 39  # (every sample drew afresh: epochs differ)
    loader = _seeded(workers, **kw)
    assert _rows(list(loader.batches(max_epochs=3))) == ref  # the same whichever worker reads a sample
    for stop in (2, 5, 7):  # batches: mid-epoch, at the end of the first epoch (13 = 4 * 3 + 1), in the second
        loader = _seeded(workers, **kw)
        it = loader.batches(max_epochs=3)
        got = [next(it) for _ in range(stop)]
        state = loader.state_dict()
        del it
        resumed = _seeded(resumed_workers, **kw)
        resumed.load_state_dict(state)
        got += list(resumed.batches(max_epochs=3))
        assert _rows(got) == ref, f"resumed after {stop} batches"


def _mix(samples: list[torch.Tensor]) -> torch.Tensor:
    """A batch-level augmentation in the collate_fn (as torchvision's CutMix/MixUp): one draw per batch."""
    batch = torch.stack(samples)
    draws = [torch.rand(()).item(), float(np.random.rand()), random.random()]
    return torch.cat([batch, torch.tensor([draws] * len(batch), dtype=batch.dtype)], 1)


@pytest.mark.parametrize(("workers", "resumed_workers", "kw"), [
    (0, 0, {}), (2, 1, {}), (2, 2, {"persistent_workers": True}), (1, 0, {}),
], ids=["main-process", "2-then-1-workers", "persistent-workers", "worker-then-main"])
def test_a_seeded_dataset_replays_a_random_collate_fn_after_any_resume(workers: int, resumed_workers: int,
                                                                       kw: dict[str, Any]) -> None:
    """A collate_fn that draws (MixUp, CutMix) runs in the worker that read the batch: without seeding, its draws
    depend on the batches that worker collated before, so a mid-epoch resume changed them. Over a SeededDataset,
    each batch is collated with the RNGs seeded from its keys."""
    ref = _rows(list(_seeded(0, collate_fn=_mix).batches(max_epochs=3)))
    assert len({r[4] for r in ref}) == 15  # (one draw per batch: 5 batches an epoch, every epoch afresh)
    before = torch.get_rng_state(), np.random.get_state()[1].tolist(), random.getstate()
    assert _rows(list(_seeded(workers, collate_fn=_mix, **kw).batches(max_epochs=3))) == ref
    assert torch.equal(torch.get_rng_state(), before[0])  # (the training loop's RNGs are left alone)
    assert (np.random.get_state()[1].tolist(), random.getstate()) == before[1:]
    for stop in (2, 5, 7):
        loader = _seeded(workers, collate_fn=_mix, **kw)
        it = loader.batches(max_epochs=3)
        got = [next(it) for _ in range(stop)]
        state = loader.state_dict()
        del it
        resumed = _seeded(resumed_workers, collate_fn=_mix, **kw)
        resumed.load_state_dict(state)
        got += list(resumed.batches(max_epochs=3))
        assert _rows(got) == ref, f"resumed after {stop} batches"


def test_a_seeded_dataset_depends_on_its_seed_and_leaves_the_processs_rngs_alone() -> None:
    """Reading samples in the main process puts the three RNGs back: the training loop's draws after it are
    those it would have made without the reads. The seed, the epoch and the index pick a sample's draws; a
    plain int reads the wrapped sample with the RNGs as they are."""
    torch.manual_seed(11), np.random.seed(11), random.seed(11)
    untouched = (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])
    torch.manual_seed(11), np.random.seed(11), random.seed(11)
    a = _rows(list(_seeded(0, seed=5).batches(max_epochs=2)))
    assert (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]) == untouched
    b = _rows(list(_seeded(0, seed=6).batches(max_epochs=2)))
    assert [r[0] for r in a] == [r[0] for r in b]  # the same order (the sampler's seed) ...
    assert all(x[1:] != y[1:] for x, y in zip(a, b, strict=True))  # ... other augmentations (the dataset's)
    ds = SeededDataset(_Augmented(), seed=5)
    assert torch.equal(ds[(1, 4)], ds[(1, 4)]) and not torch.equal(ds[(0, 4)][1:], ds[(1, 4)][1:])
    torch.manual_seed(3)
    plain = ds[4][1].item()
    torch.manual_seed(3)
    assert plain == torch.rand(()).item()  # an int key: no seeding, the draw came from the global stream
    assert len(ds) == 13 and ds.dataset.__class__ is _Augmented and "seed=5" in repr(ds)
    with pytest.raises(TypeError, match=r"\(epoch, index\)"):
        ds[(1, 2, 3)]
    with pytest.raises(TypeError, match="map-style"):
        SeededDataset(_RandomStream())
    with pytest.raises(TypeError, match="seed must be an int"):
        SeededDataset(_Augmented(), seed=1.5)  # type: ignore[arg-type]


class _RandomStream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter(())


def test_a_seeded_datasets_python_and_numpy_draws_are_not_the_same_numbers() -> None:
    """Python's random and NumPy's legacy RNG are both MT19937: seeded with the same words they draw the same
    floats, and an augmentation using both (a crop's x from one, its y from the other) would lie on a line."""
    ds = SeededDataset(_Augmented(), seed=5)
    rows = [ds[(0, i)].tolist() for i in range(13)]
    assert not any(r[2] == r[3] for r in rows)


def test_a_loader_over_a_seeded_dataset_refuses_a_sampler_that_yields_plain_indices() -> None:
    """A sampler built over the length (or the unwrapped dataset) yields ints, which read samples unseeded:
    the augmentations would silently not replay after a resume."""
    ds = SeededDataset(_Augmented(), seed=5)
    for source in (len(ds), ds.dataset):
        with pytest.raises(TypeError, match="SeededDataset"):
            ResumableLoader(DataLoader(ds, sampler=ResumableSampler(source), batch_size=2))
    ResumableLoader(DataLoader(ds, sampler=ResumableSampler(ds), batch_size=2))


def test_a_loader_refuses_a_seeded_datasets_sampler_over_another_dataset() -> None:
    """A sampler over a SeededDataset yields (epoch, index) keys: a DataLoader over the unwrapped data (an array,
    whose [epoch, index] is some other element) or a Subset of it would read them wrongly."""
    ds = SeededDataset(torch.arange(12.0).reshape(6, 2), seed=5)
    for data in (ds.dataset, torch.utils.data.Subset(ds, [0, 1])):
        with pytest.raises(TypeError, match="SeededDataset"):
            ResumableLoader(DataLoader(data, sampler=ResumableSampler(ds), batch_size=2))


def test_a_seeded_dataset_puts_the_rngs_back_when_a_read_raises() -> None:
    class Failing(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> Any:
            torch.rand(5), np.random.rand(), random.random()
            raise KeyError(i)

    ds = SeededDataset(Failing())
    torch.manual_seed(2), np.random.seed(2), random.seed(2)
    with pytest.raises(KeyError):
        ds[(0, 1)]
    got = (torch.rand(()).item(), float(np.random.rand()), random.random())
    torch.manual_seed(2), np.random.seed(2), random.seed(2)
    assert got == (torch.rand(()).item(), float(np.random.rand()), random.random())


def test_a_checkpointer_resumes_a_run_with_random_augmentations_bit_exactly(tmp_path: Path) -> None:
    """Training on augmented samples read by two workers: a run stopped mid-epoch and restored in new objects
    ends with the weights of the run that never stopped."""
    def train(store: Path, steps: int, stop: int | None = None) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = _seeded(2, bs=2)
        with deltackpt.Checkpointer(store, model=model, optimizer=opt, data=loader, every_n_steps=1) as ckpt:
            step = ckpt.restore()
            batches = loader.batches()
            while step < (stop or steps):
                loss = model(next(batches)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                ckpt.step(step)
        return model.weight.detach().clone()

    ref = train(tmp_path / "ref", 11)
    train(tmp_path / "run", 11, stop=4)  # 8 of 13 samples: mid-epoch
    assert torch.equal(train(tmp_path / "run", 11), ref)


# -- (3) through a deltackpt store -----------------------------------------------------------------------


def test_state_round_trips_through_a_store(tmp_path: Path) -> None:
    ref = expected(N, BS, shuffle=True, seed=8, drop_last=False)
    for k in (4, 6, 11):
        first, state = run_epochs(make(seed=8, workers=0), stop=k)
        with deltackpt.Store(tmp_path / "store") as store:
            store.save({"data": state, "w": torch.zeros(3)}, step=k)
        with deltackpt.Store(tmp_path / "store") as store:
            loaded = store.load(step=k)["data"]
        assert loaded == state
        assert_plain(loaded)
        resumed = make(seed=8)
        resumed.load_state_dict(loaded)
        assert first + run_epochs(resumed)[0] == ref


# -- (4) validation --------------------------------------------------------------------------------------


def test_load_rejects_a_state_for_other_data() -> None:
    _, state = run_epochs(make(seed=3), stop=4)
    with pytest.raises(ValueError, match="dataset of 23 items.*has 24"):
        make(24, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed 3"):
        make(seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        make(seed=3, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint"):
        make(seed=3).load_state_dict({**state, "fingerprint": "0" * 16})
    with pytest.raises(ValueError, match="past the end"):
        make(seed=3).load_state_dict({**state, "position": N + 1})
    with pytest.raises(ValueError, match="missing epoch"):
        make(seed=3).load_state_dict({k: v for k, v in state.items() if k != "epoch"})
    with pytest.raises(ValueError, match="num_replicas"):
        ds = TensorDataset(torch.arange(N))
        ResumableSampler(ds, seed=3, num_replicas=2).load_state_dict(state)
    loader = make(seed=3)
    with pytest.raises(ValueError):
        loader.load_state_dict({**state, "len": N - 1})
    assert (loader.epoch, loader.position) == (0, 0)  # a rejected state changes nothing


def test_wrapper_rejects_what_it_cannot_count() -> None:
    ds = TensorDataset(torch.arange(N))
    with pytest.raises(TypeError, match=r"ResumableSampler\(dataset, shuffle=False, for the dataset's order\)"):
        ResumableLoader(DataLoader(ds, batch_size=4))  # (following the hint keeps the order it had)
    with pytest.raises(TypeError, match=r"RandomSampler.*ResumableSampler\(dataset, shuffle=True, seed=...\)"):
        ResumableLoader(DataLoader(ds, batch_size=4, shuffle=True))
    with pytest.raises(TypeError, match="custom batch sampler"):

        class Buckets(BatchSampler):
            pass

        ResumableLoader(DataLoader(ds, batch_sampler=Buckets(ResumableSampler(ds), 4, False)))
    with pytest.raises(TypeError, match="DataLoader"):
        ResumableLoader([1, 2, 3])  # type: ignore[arg-type]
    if "in_order" in DataLoader.__init__.__code__.co_varnames:
        with pytest.raises(ValueError, match="in_order"):
            ResumableLoader(DataLoader(ds, sampler=ResumableSampler(ds), num_workers=1, in_order=False))
    # a torch BatchSampler around a ResumableSampler is fine
    bs = BatchSampler(ResumableSampler(ds, seed=2), 4, False)
    loader = ResumableLoader(DataLoader(ds, batch_sampler=bs))
    assert run_epochs(loader)[0] == expected(N, BS, shuffle=True, seed=2, drop_last=False)
    assert isinstance(DataLoader(ds, batch_sampler=bs).sampler, SequentialSampler)


def test_moving_the_cursor_ends_the_running_iteration() -> None:
    ref = expected(N, BS, shuffle=True, seed=0, drop_last=False)
    _, state = run_epochs(make(), stop=9)
    loader = make()
    stream = loader.batches(max_epochs=EPOCHS)
    got = [ids(next(stream)) for _ in range(2)]
    loader.load_state_dict(state)  # e.g. a restore after the stream had started
    got += [ids(b) for b in stream]
    assert got == ref[:2] + ref[9:]


def test_loader_surface() -> None:
    loader = make(drop_last=True)
    assert len(loader) == 5 and loader.batch_size == BS and len(loader.dataset) == N
    assert (loader.epoch, loader.position) == (0, 0)
    assert "epoch=0" in repr(loader)
    state = loader.state_dict()
    assert {"epoch", "position", "seed", "shuffle", "len"} <= state.keys()
    assert_plain(state)
    empty = make(3, 4, drop_last=True)
    with pytest.raises(ValueError, match="no batch"):
        next(empty.batches())
    assert list(empty.batches(max_epochs=2)) == [] and empty.epoch == 2
    assert list(itertools.islice(make(0, 4).batches(max_epochs=5), 3)) == []


def test_a_restore_refuses_a_data_position_of_other_data_before_anything_changes(tmp_path: Path) -> None:
    """The checkpoint's data position was saved for a dataset of 23 items and this run's has 24: restore()
    refuses before it puts anything back (it raised ValueError from the loader after the model and optimizer
    held the checkpoint's state); strict=False restores the rest, leaves the loader, and names it."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    loader = make(seed=3)
    with deltackpt.Checkpointer(tmp_path / "s", model=model, optimizer=opt, data=loader, async_save=False,
                                handle_signals=False) as ckpt:
        for step, _ in enumerate(itertools.islice(loader, 3), start=1):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            ckpt.step(step)
    fresh = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    other = make(24, seed=3)
    with deltackpt.Checkpointer(tmp_path / "s", model=fresh, optimizer=fresh_opt, data=other,
                                handle_signals=False) as ckpt:
        with pytest.raises(deltackpt.DeltackptError, match="data position does not fit.*dataset of 23 items"):
            ckpt.restore()
        assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
        assert not fresh_opt.state and (other.epoch, other.position) == (0, 0)
        with pytest.warns(RuntimeWarning, match="no data position that fits this loader"):
            assert ckpt.restore(strict=False) == 3
        assert torch.equal(fresh.weight, model.weight) and (other.epoch, other.position) == (0, 0)


def test_iterating_the_bare_dataloader_of_a_wrapped_sampler_warns() -> None:
    """Wrapped in a ResumableLoader, the sampler follows that loader only: a loop over the bare DataLoader
    repeats the same order every epoch and never moves the saved position. It now warns (it was silent)."""
    loader = make(seed=0)
    with pytest.warns(RuntimeWarning, match="iterated by its bare DataLoader"):
        first = [ids(b) for b in loader.loader]
    assert [ids(b) for b in loader.loader] == first  # (what the warning is about)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(itertools.chain(*(ids(b) for b in make(seed=0)))) == list(itertools.chain(*first))
        assert [ids(b) for b in make(seed=0, workers=1)] == first


@pytest.mark.parametrize("seed", [2**63, 2**64 - 2, -(2**63) - 1])
def test_a_seed_a_generator_cannot_take_is_refused_at_once(seed: int) -> None:
    """Each epoch seeds a torch.Generator with seed + epoch: a seed out of [-2**63, 2**63) was accepted and
    failed epochs later (or at the first iteration)."""
    with pytest.raises(ValueError, match="seed must be in"):
        ResumableSampler(10, seed=seed)


def test_a_users_generator_is_drawn_once_per_epoch_like_a_plain_dataloader() -> None:
    """A plain DataLoader draws its workers' base seed from its generator at each epoch start, so each epoch's
    workers (augmentations) differ. A ResumableLoader over it must do the same: after three epochs the
    generator is where the plain DataLoader's is. (The existing test compares a resumed run with an
    uninterrupted one only: a loader that never advanced the generator passed it, every epoch then repeating
    the same worker seeds.)"""
    ds = TensorDataset(torch.arange(10))
    plain_gen = torch.Generator().manual_seed(7)
    plain = DataLoader(ds, sampler=SequentialSampler(ds), batch_size=3, generator=plain_gen)
    for _ in range(3):
        for _ in plain:
            pass
    gen = torch.Generator().manual_seed(7)
    start = gen.get_state()
    loader = ResumableLoader(DataLoader(ds, sampler=ResumableSampler(ds, seed=3), batch_size=3, generator=gen))
    it = loader.batches(max_epochs=3)
    n = sum(1 for _ in it)
    assert n == 12
    assert not torch.equal(gen.get_state(), start), "the user's generator was never drawn from"
    assert torch.equal(gen.get_state(), plain_gen.get_state())


def test_a_damaged_data_position_is_refused_by_name() -> None:
    """A length saved as a str read "saved for a dataset of 20 items, but this sampler's dataset has 20"; an
    epoch past what seeds a torch.Generator raised a bare OverflowError from torch at the next iteration."""
    ds = list(range(20))
    loader = ResumableLoader(DataLoader(ds, batch_size=4, sampler=ResumableSampler(ds)))
    state = loader.state_dict()
    with pytest.raises(TypeError, match="saved dataset length must be an int, got str"):
        loader.load_state_dict({**state, "len": "20"})
    with pytest.raises(ValueError, match="saved epoch 1180591620717411303424 is out of range"):
        loader.load_state_dict({**state, "epoch": 2**70})
    with pytest.raises(ValueError, match="epoch 1180591620717411303424 is out of range"):
        loader.set_epoch(2**70)
    assert [len(b) for b in loader] == [4] * 5  # (unchanged: the first epoch from its start)
    with pytest.raises(ValueError, match="epoch 18446744073709551616 is out of range"):
        ResumableSampler(ds).indices(2**64)  # a bare OverflowError from torch before


def test_an_unshuffled_sampler_takes_any_epoch() -> None:
    """Without shuffling no generator is seeded, so no epoch is out of a generator's range."""
    ds = list(range(6))
    sampler = ResumableSampler(ds, shuffle=False)
    sampler.set_epoch(2**70)
    assert list(sampler) == list(range(6))
    assert sampler.indices(2**70).tolist() == list(range(6))
    loader = ResumableLoader(DataLoader(ds, batch_size=2, sampler=ResumableSampler(ds, shuffle=False)))
    loader.set_epoch(2**70)
    other = ResumableLoader(DataLoader(ds, batch_size=2, sampler=ResumableSampler(ds, shuffle=False)))
    other.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in other] == [[0, 1], [2, 3], [4, 5]]


def test_a_malformed_data_position_is_a_type_error_not_a_contradiction() -> None:
    """A seed or num_replicas saved as a str read "saved with seed 3, but this sampler has 3"; a shuffle saved
    as "False" or 1 was read for its truth (accepted by a shuffled sampler, "saved with shuffle=True" by an
    unshuffled one)."""
    ds = list(range(20))
    loader = ResumableLoader(DataLoader(ds, batch_size=4, sampler=ResumableSampler(ds, seed=3)))
    state = loader.state_dict()
    for bad, match in [({"seed": "3"}, "saved seed must be an int"), ({"shuffle": "False"}, "saved shuffle"),
                       ({"shuffle": 1}, "saved shuffle"), ({"num_replicas": "1"}, "saved num_replicas"),
                       ({"drop_last": "no"}, "saved drop_last")]:
        with pytest.raises(TypeError, match=match):
            loader.load_state_dict({**state, **bad})
    loader.load_state_dict(state)


def test_the_hint_for_a_distributed_sampler_keeps_its_order_and_shard() -> None:
    """A DistributedSampler is refused with a hint that builds the ResumableSampler of the same order and shard
    (it suggested shuffle=True and no sharding: every rank would read the whole dataset, shuffled)."""
    ds = list(range(10))
    s = DistributedSampler(ds, num_replicas=4, rank=3, shuffle=False, seed=5)
    with pytest.raises(TypeError, match=r"shuffle=False, seed=5, drop_last=False, num_replicas=4, rank=3"):
        ResumableLoader(DataLoader(ds, batch_size=2, sampler=s))
