"""RNG states: the process's random generators, captured with a save and put back by a restore.

Where it sits: a :class:`~deltackpt.Checkpointer` save adds :func:`rng_state` to the captured state under
``"rng"`` (Python's, NumPy's global generator, torch's CPU and CUDA generators); a restore puts them back last,
after every component loaded, so a resumed run draws what the run that saved would have drawn next.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from deltackpt import _lazy
from deltackpt.errors import caller_level

if TYPE_CHECKING:
    import torch
else:
    torch = _lazy.module("torch", globals())


def has_rng(state: Mapping[str, Any]) -> bool:
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


def _words(words: Any) -> Any:
    """Python's state words: an array, or a tuple of ints in checkpoints of earlier versions."""
    return words.tolist() if isinstance(words, np.ndarray) else words


def try_rng_state(state: Mapping[str, Any], *, with_torch: bool = True) -> None:
    """Set the states of :func:`rng_state`'s form on generators of their own (Python's, NumPy's; torch's CPU one
    with ``with_torch``), leaving the process's alone: raises what a generator that refuses its state raises
    (ValueError, TypeError, OverflowError; torch's RuntimeError)."""
    py = state["python"]
    random.Random().setstate((py[0], tuple(_words(py[1])), py[2]))
    np.random.RandomState().set_state(tuple(state["numpy"]))
    if with_torch:
        torch.Generator().set_state(state["torch"].cpu())


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back the RNG states :func:`rng_state` captured (or their restored copy: tensors on any device, Python's
    words as an array or, in checkpoints of earlier versions, a tuple of ints). CUDA states are put back on the
    devices this process sees, with a RuntimeWarning when it sees another number of them than the run that saved;
    none where CUDA is not available."""
    py = state["python"]
    words = _words(py[1])
    np_state = state["numpy"]
    # (torch takes a CPU ByteTensor: a restore with map_location="cuda" loaded the states onto the GPU)
    torch_state = state["torch"].cpu()
    # each tried on a generator of its own first: a state the generators refuse (ValueError, OverflowError,
    # TypeError) leaves all of the process's as they were, not some set and the rest not
    try_rng_state(state)
    random.setstate((py[0], tuple(words), py[2]))
    np.random.set_state(tuple(np_state))
    torch.set_rng_state(torch_state)
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) != torch.cuda.device_count():
            warnings.warn(
                f"checkpoint holds RNG states of {len(cuda)} CUDA devices, this process sees "
                f"{torch.cuda.device_count()}; restoring the common ones", RuntimeWarning, stacklevel=caller_level(),
            )
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)
