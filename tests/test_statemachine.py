"""A Hypothesis state machine over a real store: evolving states, saves, rollbacks (branches), deletes, thinning
(rewrites), gc (with and without repacking), reopen, and damage to a base frame (in a copy of the store).

The state holds free-form tensors, an AdamW-trained parameter with its optimizer state, and a matrix stepped as
torch.optim.Muon steps it (so predicted frames, and the update chunks Muon's reference, are written and
referenced across branches, deletes and gc). The rules that change the state may save right
after (a save is then about three steps in ten, so chains, branches and predictions form within a run).
After every operation each retained checkpoint loads bit-exactly, every chunk entry respects the chain bound,
every delta base and prediction input of an entry is still indexed, at a lower depth (deletes, rewrites and gc
never break a chain), and the chain a decode actually follows (the frames' own headers and prediction records)
is no deeper than the recorded depth. Damaging a frame another chunk decodes from is reported by ``verify`` for
exactly the retained chunks whose decode reaches it, through deltas and predictions alike, and by a load of each
of those chunks and of each checkpoint holding one; the other checkpoints still load.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from conftest import assert_same_state
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import deltackpt
from deltackpt import CorruptChunkError, codec
from deltackpt.index import ChunkLoc, chunk_key

CHUNK = 4096
MAX_CHAIN = 2
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32]


def _clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


ADAM_N = 3000  # elements of the AdamW-trained parameter (three 4 KiB chunks)
BETAS, LR, WD, EPS = (0.9, 0.999), 1e-3, 0.1, 1e-8


MUON_SHAPE = (64, 48)  # the Muon-trained matrix (three 4 KiB chunks)
MUON_GROUP = {"params": [0], "lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
              "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None}


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
        self.muon = {"w": _random_tensor(rng, MUON_SHAPE[0] * MUON_SHAPE[1], torch.float32).reshape(MUON_SHAPE),
                     "b": torch.zeros(MUON_SHAPE)}
        self.expected: dict[str, dict] = {}  # checkpoint id -> state it must load as
        self.parents: dict[str, str | None] = {}
        self.step = 0
        self.head: str | None = None

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- how the training state evolves --------------------------------------------------------------------
    @rule(seed=st.integers(0, 2**32 - 1), frac=st.sampled_from([0.0, 0.01, 0.3, 1.0]), then_save=st.booleans())
    def small_changes(self, seed: int, frac: float, then_save: bool) -> None:
        rng = np.random.default_rng(seed)
        for t in self.state.values():
            n = int(t.numel() * frac)
            if n and t.dtype.is_floating_point:
                idx = torch.from_numpy(rng.choice(t.numel(), n, replace=False))
                flat = t.view(-1)
                flat[idx] += (torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 1e-4).to(t.dtype)
            elif n:
                t.view(-1)[0] += 1
        self._then_save(then_save)

    @rule(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 2), then_save=st.booleans())
    def adam_step(self, seed: int, steps: int, then_save: bool) -> None:
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
        self._then_save(then_save)

    @rule(seed=st.integers(0, 2**32 - 1), then_save=st.booleans())
    def muon_step(self, seed: int, then_save: bool) -> None:
        """A step of the Muon-trained matrix as torch.optim.Muon takes it, with a scaled bfloat16 copy of the
        momentum standing in for the Newton-Schulz orthogonalization (any bfloat16 update is stepped the same
        way): ``w.mul_(1 - lr·wd)``, ``w.add_(u, alpha=-lr·k)``."""
        g = torch.from_numpy(np.random.default_rng(seed).standard_normal(MUON_SHAPE).astype(np.float32))
        b, w = self.muon["b"], self.muon["w"]
        b.lerp_(g, 1 - MUON_GROUP["momentum"])
        u = (b / b.norm().clamp(min=1e-7) * 8).bfloat16()
        lr, wd = MUON_GROUP["lr"], MUON_GROUP["weight_decay"]
        w.mul_(1 - lr * wd)
        w.add_(u, alpha=-lr * max(1, MUON_SHAPE[0] / MUON_SHAPE[1]) ** 0.5)
        self._then_save(then_save)

    def _tree(self) -> dict:
        a = self.adam
        return {
            "model": {**self.state, "adam_w": a["w"], "muon_w": self.muon["w"]},
            "muon": {"state": {0: {"momentum_buffer": self.muon["b"]}}, "param_groups": [dict(MUON_GROUP)]},
            "optim": {
                "state": {0: {"step": torch.tensor(float(a["t"])), "exp_avg": a["m"], "exp_avg_sq": a["v"]}},
                "param_groups": [{"params": [0], "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}],
            },
        }

    @rule(seed=st.integers(0, 2**32 - 1), numel=st.integers(0, 5000), dtype=st.sampled_from(DTYPES),
          then_save=st.booleans())
    def add_tensor(self, seed: int, numel: int, dtype: torch.dtype, then_save: bool) -> None:
        self.state[f"n{seed % 1000}"] = _random_tensor(np.random.default_rng(seed), numel, dtype)
        self._then_save(then_save)

    @precondition(lambda self: len(self.state) > 1)
    @rule(data=st.data())
    def remove_tensor(self, data: st.DataObject) -> None:
        del self.state[data.draw(st.sampled_from(sorted(self.state)))]

    @rule(data=st.data(), then_save=st.booleans())
    def reshape_or_retype(self, data: st.DataObject, then_save: bool) -> None:
        k = data.draw(st.sampled_from(sorted(self.state)))
        t = self.state[k]
        if data.draw(st.booleans()) and t.numel() % 2 == 0 and t.numel():
            self.state[k] = t.reshape(2, -1).clone()
        else:
            self.state[k] = t.to(data.draw(st.sampled_from(DTYPES)))
        self._then_save(then_save)

    # -- store operations ----------------------------------------------------------------------------------
    def _then_save(self, then_save: bool) -> None:
        if then_save:
            self.save(same_step=False)

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
    @rule(data=st.data(), then_train=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def rollback(self, data: st.DataObject, then_train: bool, seed: int) -> None:
        """Restore a checkpoint; with ``then_train`` train a step from it and save: a branch (unless it was the
        newest checkpoint)."""
        cid = data.draw(st.sampled_from(list(self.expected)))  # save order: ids are random
        loaded = self.store.load(id=cid)
        model = dict(loaded["model"])
        if "optim" in loaded:
            opt = loaded["optim"]["state"][0]
            self.adam = {"w": model.pop("adam_w"), "m": opt["exp_avg"], "v": opt["exp_avg_sq"], "t": int(opt["step"])}
            self.muon = {"w": model.pop("muon_w"), "b": loaded["muon"]["state"][0]["momentum_buffer"]}
        else:  # a thinned checkpoint: weights only, the optimizers start afresh
            self.adam = {"w": model.pop("adam_w"), "m": torch.zeros(ADAM_N), "v": torch.zeros(ADAM_N), "t": 0}
            self.muon = {"w": model.pop("muon_w"), "b": torch.zeros(MUON_SHAPE)}
        self.state = _clone(model)
        self.head = cid  # the next save is a branch from here
        if then_train:
            self.adam_step(seed, 1, then_save=True)

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

    @rule(repack_below=st.sampled_from([0.5, 1.0]))
    def gc(self, repack_below: float) -> None:
        self.store.gc(repack_below=repack_below)  # 1.0: every pack with a dead frame is repacked

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
                inputs = [entries.get(r) for r in self.store._references(k, loc)]
                assert all(i is not None for i in inputs), "a prediction input was dropped"
                assert max(i.depth for i in inputs if i is not None) <= loc.depth - 1

    @invariant()
    def the_decoded_chain_is_within_the_recorded_depth(self) -> None:
        """The chains decodes follow, read from the frames themselves (their headers' codec and base, a predicted
        frame's record), not from the depths the index records: none is deeper than its entry says."""
        entries = dict(self.store.index.iter_chunks())
        for k in entries:
            assert _decode_depth(self.store, entries, k, {}) <= entries[k].depth <= MAX_CHAIN, k.hex()

    # -- damage to a base frame, in a copy of the store ----------------------------------------------------
    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def damaged_base_is_reported_for_every_dependent(self, data: st.DataObject) -> None:
        entries = dict(self.store.index.iter_chunks())
        inputs = {k: self.store._references(k, entries[k]) for k in entries}
        used = sorted({r for refs in inputs.values() for r in refs})
        if not used:
            return
        base = data.draw(st.sampled_from(used))
        for kind in sorted({entries[k].codec for k, refs in inputs.items() if base in refs}):
            event("damaged base: a " + {codec.DELTA: "delta", codec.PREDICTED: "predicted frame"}[kind] + " reads it")

        def reaches(k: bytes, seen: set[bytes]) -> bool:
            if k == base:
                return True
            seen.add(k)
            return any(reaches(r, seen) for r in inputs.get(k, ()) if r not in seen)

        expected = set()  # (checkpoint, tensor key, chunk id) of every retained chunk whose decode reads the base
        broken: dict[bytes, str] = {}
        for cid in self.expected:
            m = self.store.manifest(id=cid)
            for t in m.tensors:
                for _, digest, length in m.chunk_keys(t):
                    k = chunk_key(digest, length)
                    if reaches(k, set()):
                        hexid = codec.chunk_hex(digest, length)
                        expected.add((cid, t.key, hexid))
                        broken[k] = hexid
        copy_dir = Path(self.dir + "-damaged")
        shutil.rmtree(copy_dir, ignore_errors=True)
        shutil.copytree(self.dir, copy_dir)
        try:
            loc = entries[base]
            with open(copy_dir / "packs" / f"{loc.pack_id}.pack", "r+b") as f:  # a payload byte: checksum fails
                f.seek(loc.offset + loc.frame_len - 1)
                b = f.read(1)
                f.seek(loc.offset + loc.frame_len - 1)
                f.write(bytes([b[0] ^ 0x40]))
            with deltackpt.Store(copy_dir, chunk_size=CHUNK, threads=2, max_chain=MAX_CHAIN) as s:
                found = {(p.checkpoint, p.key, p.chunk_id) for p in s.verify().problems}
                assert found == expected, found ^ expected
                for k, hexid in broken.items():
                    try:
                        s._read_chunk(k)
                    except CorruptChunkError as exc:
                        assert exc.chunk_id == hexid, (exc.chunk_id, hexid)
                    else:
                        raise AssertionError(f"chunk {hexid} decodes from the damaged frame and read intact")
                for cid, want in self.expected.items():
                    names = {(c, key, hexid) for c, key, hexid in expected if c == cid}
                    if not names:
                        assert_same_state(want, s.load(id=cid))
                        continue
                    try:
                        s.load(id=cid)
                    except CorruptChunkError as exc:
                        assert (exc.checkpoint, exc.key, exc.chunk_id) in names, (exc, names)
                    else:
                        raise AssertionError(f"checkpoint {cid} needs the damaged frame and loaded")
        finally:
            shutil.rmtree(copy_dir, ignore_errors=True)


def _decode_depth(store: deltackpt.Store, entries: dict[bytes, ChunkLoc], k: bytes, memo: dict[bytes, int]) -> int:
    """How many frames deep decoding chunk ``k`` reaches, following the frames' headers and prediction records."""
    if k not in memo:
        loc = entries[k]
        frame = store.reader.read(loc.pack_id, loc.offset, loc.frame_len)
        h = codec.parse_header(memoryview(frame))
        assert h.codec == loc.codec and h.digest == k[:16], k.hex()
        if h.codec == codec.DELTA:
            assert h.base == loc.base, k.hex()
            memo[k] = 1 + _decode_depth(store, entries, h.base + k[16:], memo)
        elif h.codec == codec.PREDICTED:
            memo[k] = 1 + max(_decode_depth(store, entries, r, memo) for r in store._references(k, loc))
        else:
            memo[k] = 0
    return memo[k]


StoreMachine.TestCase.settings = settings(
    settings.default, stateful_step_count=30, deadline=None,
    # rules with preconditions (rollback, delete) are filtered out until a save happened
    suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.filter_too_much],
)
test_store_state_machine = StoreMachine.TestCase
