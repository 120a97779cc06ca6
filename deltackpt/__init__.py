"""deltackpt: an incremental, content-addressed checkpoint store for PyTorch.

``Store`` saves and loads whole training states, writing only chunks it does not hold yet; ``backend`` says
whether the native chunk kernel or the pure-Python reference runs. See README.md and docs/.
"""

from deltackpt.checkpointer import Checkpointer
from deltackpt.errors import (
    CheckpointNotFoundError,
    CorruptChunkError,
    CorruptIndexError,
    CorruptionError,
    CorruptManifestError,
    DeltackptError,
    FormatVersionError,
    IndexWriteError,
    InvalidNameError,
    NetworkFilesystemError,
    ReadOnlyStoreError,
    ShapeMismatchError,
    StateChangedError,
    StoreLockedError,
    UnsafeLoadError,
    UnsupportedTypeError,
)
from deltackpt.kernel import backend
from deltackpt.retention import Retention
from deltackpt.store import CheckpointInfo, Store
from deltackpt.tree import register_type, unregister_type

__version__ = "0.1.0"

__all__ = [
    "CheckpointInfo",
    "Checkpointer",
    "CheckpointNotFoundError",
    "CorruptChunkError",
    "CorruptIndexError",
    "CorruptManifestError",
    "CorruptionError",
    "DeltackptError",
    "FormatVersionError",
    "IndexWriteError",
    "InvalidNameError",
    "NetworkFilesystemError",
    "ReadOnlyStoreError",
    "Retention",
    "ShapeMismatchError",
    "StateChangedError",
    "Store",
    "StoreLockedError",
    "UnsafeLoadError",
    "UnsupportedTypeError",
    "__version__",
    "backend",
    "register_type",
    "unregister_type",
]
