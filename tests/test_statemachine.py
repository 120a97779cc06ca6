"""A Hypothesis state machine over a real store: evolving states, saves, rollbacks (branches), deletes, thinning
(rewrites), gc, reopen.

The state holds free-form tensors and an AdamW-trained parameter with its optimizer state (so predicted frames
are written and referenced across branches, deletes and gc). After every operation each retained checkpoint
loads bit-exactly, every chunk entry respects the chain bound, and every delta base and prediction input of an
entry is still indexed, at a lower depth (deletes, rewrites and gc never break a chain).
"""

from __future__ import annotations

import copy
import shutil
import tempfile

import numpy as np
import torch
from conftest import assert_same_state
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import deltackpt
from deltackpt import codec

CHUNK = 4096
MAX_CHAIN = 2
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32]


def _clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


ADAM_N = 3000  # elements of the AdamW-trained parameter (three 4 KiB chunks)
BETAS, LR, WD, EPS = (0.9, 0.999), 1e-3, 0.1, 1e-8


def _random_tensor(rng: np.random.Generator, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.from_numpy(rng.standard_normal(numel).astype(np.float32)).to(dtype) * 0.02
    return torch.from_numpy(rng.integers(-1000, 1000, numel).astype(np.int32)).to(dtype)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="deltackpt-sm-")
        self.store = deltackpt.Store(self.dir, chunk_size=CHUNK, threads=2, max_chain=MAX_CHAIN)
        rng = np.random.default_rng(0)
        self.state = {f"t{i}": _random_tensor(rng, 1500 * (i + 1), torch.float32) for i in range(3)}
        self.adam = {"w": _random_tensor(rng, ADAM_N, torch.float32), "m": torch.zeros(ADAM_N),
                     "v": torch.zeros(ADAM_N), "t": 0}
        self.expected: dict[str, dict] = {}  # checkpoint id -> state it must load as
        self.parents: dict[str, str | None] = {}
        self.step = 0
        self.head: str | None = None

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- how the training state evolves --------------------------------------------------------------------
    @rule(seed=st.integers(0, 2**32 - 1), frac=st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    def small_changes(self, seed: int, frac: float) -> None:
        rng = np.random.default_rng(seed)
        for t in self.state.values():
            n = int(t.numel() * frac)
            if n and t.dtype.is_floating_point:
                idx = torch.from_numpy(rng.choice(t.numel(), n, replace=False))
                flat = t.view(-1)
                flat[idx] += (torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 1e-4).to(t.dtype)
            elif n:
                t.view(-1)[0] += 1

    @rule(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 2))
    def adam_step(self, seed: int, steps: int) -> None:
        """AdamW steps on the parameter ``w`` with a random gradient (as torch.optim.AdamW computes them)."""
        rng = np.random.default_rng(seed)
        a = self.adam
        for _ in range(steps):
            g = torch.from_numpy(rng.standard_normal(ADAM_N).astype(np.float32))
            a["t"] += 1
            a["w"].mul_(1 - LR * WD)
            a["m"].lerp_(g, 1 - BETAS[0])
            a["v"].mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            bc1, bc2 = 1 - BETAS[0] ** a["t"], 1 - BETAS[1] ** a["t"]
            denom = (a["v"].sqrt() / bc2**0.5).add_(EPS)
            a["w"].addcdiv_(a["m"], denom, value=-LR / bc1)

    def _tree(self) -> dict:
        a = self.adam
        return {
            "model": {**self.state, "adam_w": a["w"]},
            "optim": {
                "state": {0: {"step": torch.tensor(float(a["t"])), "exp_avg": a["m"], "exp_avg_sq": a["v"]}},
                "param_groups": [{"params": [0], "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}],
            },
        }

    @rule(seed=st.integers(0, 2**32 - 1), numel=st.integers(0, 5000), dtype=st.sampled_from(DTYPES))
    def add_tensor(self, seed: int, numel: int, dtype: torch.dtype) -> None:
        self.state[f"n{seed % 1000}"] = _random_tensor(np.random.default_rng(seed), numel, dtype)

    @precondition(lambda self: len(self.state) > 1)
    @rule(data=st.data())
    def remove_tensor(self, data: st.DataObject) -> None:
        del self.state[data.draw(st.sampled_from(sorted(self.state)))]

    @rule(data=st.data())
    def reshape_or_retype(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.state)))
        t = self.state[k]
        if data.draw(st.booleans()) and t.numel() % 2 == 0 and t.numel():
            self.state[k] = t.reshape(2, -1).clone()
        else:
            self.state[k] = t.to(data.draw(st.sampled_from(DTYPES)))

    # -- store operations ----------------------------------------------------------------------------------
    @rule(same_step=st.booleans())
    def save(self, same_step: bool) -> None:
        if not (same_step and self.step):
            self.step += 1
        tree = self._tree()
        info = self.store.save(tree, step=self.step)
        assert info.parent == self.head or self.head is None or self.head not in self.expected
        self.expected[info.id] = copy.deepcopy(tree)
        self.parents[info.id] = info.parent
        self.head = info.id

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(list(self.expected)))  # save order: ids are random
        loaded = self.store.load(id=cid)
        model = dict(loaded["model"])
        if "optim" in loaded:
            opt = loaded["optim"]["state"][0]
            self.adam = {"w": model.pop("adam_w"), "m": opt["exp_avg"], "v": opt["exp_avg_sq"], "t": int(opt["step"])}
        else:  # a thinned checkpoint: weights only, the optimizer starts afresh
            self.adam = {"w": model.pop("adam_w"), "m": torch.zeros(ADAM_N), "v": torch.zeros(ADAM_N), "t": 0}
        self.state = _clone(model)
        self.head = cid  # the next save is a branch from here

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(list(self.expected)))  # save order: ids are random
        self.store.delete(id=cid)
        del self.expected[cid]
        if self.head == cid:
            self.head = None

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def thin(self, data: st.DataObject) -> None:
        """Retention's thinning: rewrite a checkpoint to its model weights (its chunks become standalone)."""
        cid = data.draw(st.sampled_from(list(self.expected)))
        weights = {"model": copy.deepcopy(self.expected[cid]["model"])}
        info = self.store.rewrite(weights, id=cid)
        del self.expected[cid]
        self.expected[info.id] = weights
        self.parents[info.id] = self.parents.get(cid)
        if self.head == cid:
            self.head = info.id

    @rule()
    def gc(self) -> None:
        self.store.gc()

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = deltackpt.Store(self.dir, chunk_size=CHUNK, threads=2, max_chain=MAX_CHAIN)
        self.head = None  # a fresh handle descends from the latest checkpoint

    # -- what must always hold -----------------------------------------------------------------------------
    @invariant()
    def every_retained_checkpoint_loads_bit_exactly(self) -> None:
        assert sorted(i.id for i in self.store.list()) == sorted(self.expected)
        for cid, want in self.expected.items():
            assert_same_state(want, self.store.load(id=cid))
        self.store._head = self.head  # the loads above moved the handle's head; the run's head is ours

    @invariant()
    def chains_are_bounded_and_complete(self) -> None:
        entries = dict(self.store.index.iter_chunks())
        for k, loc in entries.items():
            assert loc.depth <= MAX_CHAIN, (k.hex(), loc.depth)
            # a recorded depth is exact when written and an upper bound after a rewrite re-pointed an input to a
            # standalone frame (docs/format.md, section 6)
            if loc.codec == codec.DELTA:
                base = entries.get(loc.base + k[16:])
                assert base is not None, "a delta's base was dropped"
                assert base.depth <= loc.depth - 1
            if loc.codec == codec.PREDICTED:
                inputs = [entries.get(r) for r in self.store.references(k, loc)]
                assert all(i is not None for i in inputs), "a prediction input was dropped"
                assert max(i.depth for i in inputs if i is not None) <= loc.depth - 1


StoreMachine.TestCase.settings = settings(
    settings.default, stateful_step_count=20, deadline=None,
    # rules with preconditions (rollback, delete) are filtered out until a save happened
    suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.filter_too_much],
)
test_store_state_machine = StoreMachine.TestCase
