"""The systems compared, each behind one small adapter: ``save(state, step)``, ``finish()``, ``load(step)``.

========================= ==============================================================================
``memcpy``              the physical floor: one copy of every tensor into preallocated buffers (no adapter)
``torch.save+fsync``    torch.save to a temporary file, fsync, rename, fsync the directory: a durable save
``torch.save``          torch.save straight to the final file, no fsync (not durable: the page cache holds it)
``safetensors+fsync``   safetensors.save_file of the tensor leaves (plain values as JSON metadata), durable
``dcp``                 torch.distributed.checkpoint.save with FileSystemWriter(sync_files=True), one process
``deltackpt``           Store.save with the default settings: deltas and predicted frames on (max_chain=3)
``deltackpt-dedup``     Store.save, dedup only (max_chain=0)
``deltackpt-async``     deltackpt.Checkpointer(async_save=True) over a delta store: the training thread only
                        waits for ``step()``; the save completes in the background
``deltackpt-dedup-async`` the same over a dedup-only store
========================= ==============================================================================

All saves of a system go to one directory, one file (or directory, or store) per step, nothing deleted, so
"on disk after N saves" compares like with like.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

from bench.util import fsync_path, fsync_tree, is_tensor, map_tree, walk

SYSTEMS = [
    "memcpy",
    "torch.save+fsync",
    "torch.save",
    "safetensors+fsync",
    "dcp",
    "deltackpt",
    "deltackpt-dedup",
    "deltackpt-async",
    "deltackpt-dedup-async",
]
LABELS = {
    "memcpy": "memcpy of the state (floor)",
    "torch.save+fsync": "torch.save + fsync",
    "torch.save": "torch.save, no fsync",
    "safetensors+fsync": "safetensors + fsync",
    "dcp": "torch DCP (FileSystemWriter)",
    "deltackpt": "deltackpt, delta",
    "deltackpt-dedup": "deltackpt, dedup-only",
    "deltackpt-async": "deltackpt, delta, async",
    "deltackpt-dedup-async": "deltackpt, dedup-only, async",
}
BASELINE = "torch.save+fsync"
ASYNC = {"deltackpt-async", "deltackpt-dedup-async"}
# the 1,000-checkpoint store compares these two only
MANY = ["torch.save+fsync", "deltackpt"]


def checkpointer_available() -> str:
    """'' when deltackpt.Checkpointer exists, else why the async rows are skipped."""
    try:
        import deltackpt
    except Exception as exc:  # noqa: BLE001 - any import failure means: skip
        return f"deltackpt does not import: {exc}"
    if not hasattr(deltackpt, "Checkpointer"):
        return "deltackpt.Checkpointer does not exist yet"
    return ""


def _durable_replace(tmp: Path, final: Path) -> None:
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


class System:
    name = ""
    settings: dict[str, Any] = {}
    subset_verify = False  # loads may nest the state or add entries (compare tensor digests only)
    has_plain = True

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def save(self, state: Any, step: int) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self) -> dict[str, Any]:
        """Everything is durable and every handle closed when this returns."""
        return {}

    def load(self, step: int, like: Any) -> Any:
        """The state saved at ``step``, read from disk. ``like`` is a live state of the same structure (what a
        trainer has at hand when it restores)."""
        raise NotImplementedError


class TorchSave(System):
    def __init__(self, root: Path, fsync: bool) -> None:
        super().__init__(root)
        self.fsync = fsync
        self.name = "torch.save+fsync" if fsync else "torch.save"

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:012d}.pt"

    def save(self, state: Any, step: int) -> dict[str, Any]:
        import torch

        final = self.path(step)
        if not self.fsync:
            torch.save(state, final)
            return {}
        tmp = final.with_suffix(".tmp")
        torch.save(state, tmp)
        _durable_replace(tmp, final)
        return {}

    def load(self, step: int, like: Any) -> Any:
        import torch

        return torch.load(self.path(step), map_location="cpu", weights_only=True)


class Safetensors(System):
    name = "safetensors+fsync"

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:012d}.safetensors"

    def save(self, state: Any, step: int) -> dict[str, Any]:
        from safetensors.torch import save_file

        tensors, plain = {}, {}
        for path, v in walk(state):
            if is_tensor(v):
                tensors[path] = v.detach().contiguous()
            else:
                plain[path] = v
        final = self.path(step)
        tmp = final.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"plain": json.dumps(plain, default=str)})
        _durable_replace(tmp, final)
        return {}

    def load(self, step: int, like: Any) -> Any:
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = str(self.path(step))
        flat: dict[str, Any] = dict(load_file(path))
        with safe_open(path, "pt") as f:
            flat.update(json.loads((f.metadata() or {}).get("plain", "{}")))
        return flat  # flat {path: leaf}: walks to the same paths as the original state


class DCP(System):
    name = "dcp"

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:012d}"

    def save(self, state: Any, step: int) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        d = self.path(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d), sync_files=True), no_dist=True)
        fsync_tree(d)  # the metadata file and the directory entries too
        fsync_path(self.root)
        return {}

    def load(self, step: int, like: Any) -> Any:
        import torch
        import torch.distributed.checkpoint as dcp

        target = map_tree(like, lambda x: torch.empty_like(x) if is_tensor(x) else copy.deepcopy(x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(self.path(step))), no_dist=True)
        return target


class Deltackpt(System):
    def __init__(self, root: Path, max_chain: int | None) -> None:
        super().__init__(root)
        from deltackpt import Store

        self.max_chain = max_chain  # None: the library default (deltas on)
        self.name = "deltackpt-dedup" if max_chain == 0 else "deltackpt"
        self.store_path = root / "store"
        self.store: Any = Store(self.store_path, max_chain=max_chain)
        self.settings = {"max_chain": self.store.max_chain, "chunk_size": self.store.chunk_size,
                         "zstd_level": self.store.zstd_level, "threads": self.store.threads}

    def save(self, state: Any, step: int) -> dict[str, Any]:
        info = self.store.save(state, step)
        return {"written_bytes": info.written_bytes, "logical_bytes": info.logical_bytes}

    def finish(self) -> dict[str, Any]:
        self.store.close()
        return {}

    def load(self, step: int, like: Any) -> Any:
        from deltackpt import Store

        with Store(self.store_path, max_chain=self.max_chain) as s:  # a fresh handle, as a restart would
            return s.load(step=step)


class _Holder:
    """Stands in for a model: the Checkpointer takes the whole benchmark state from ``state_dict()``."""

    def __init__(self) -> None:
        self.state: Any = None
        self.loaded: Any = None

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.state

    def load_state_dict(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        self.loaded = state
        return None


class DeltackptAsync(Deltackpt):
    """deltackpt.Checkpointer with async saves; ``save`` times what the training thread waits for."""

    subset_verify = True

    def __init__(self, root: Path, max_chain: int | None) -> None:
        super().__init__(root, max_chain)
        import deltackpt

        self.name = "deltackpt-dedup-async" if max_chain == 0 else "deltackpt-async"
        self.holder = _Holder()
        self.ckpt = deltackpt.Checkpointer(self.store, model=self.holder, every_n_steps=1, async_save=True)

    def save(self, state: Any, step: int) -> dict[str, Any]:
        self.holder.state = state
        self.ckpt.step(step)
        return {}

    def finish(self) -> dict[str, Any]:
        import time

        t0 = time.perf_counter()
        self.ckpt.close()
        close_s = time.perf_counter() - t0
        infos = self.store.list()
        self.store.close()
        return {"close_s": close_s, "checkpoints": len(infos),
                "written_bytes": [i.written_bytes for i in infos]}


def make(name: str, root: Path) -> System:
    if name == "torch.save+fsync":
        return TorchSave(root, fsync=True)
    if name == "torch.save":
        return TorchSave(root, fsync=False)
    if name == "safetensors+fsync":
        return Safetensors(root)
    if name == "dcp":
        return DCP(root)
    if name == "deltackpt":
        return Deltackpt(root, max_chain=None)
    if name == "deltackpt-dedup":
        return Deltackpt(root, max_chain=0)
    if name == "deltackpt-async":
        return DeltackptAsync(root, max_chain=None)
    if name == "deltackpt-dedup-async":
        return DeltackptAsync(root, max_chain=0)
    raise ValueError(f"unknown system {name!r}; known: {SYSTEMS}")
