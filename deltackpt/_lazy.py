"""torch, imported where a deltackpt module first uses it rather than when deltackpt is imported.

Where it sits: under every module that handles tensors (``store``, ``tree``, ``checkpointer``, ``cli``). The command
line's listings (``ls``, ``log``, ``du``, ``show``, ...) read the index and manifests and never touch a tensor,
and importing torch was most of their run time (1.0 of 1.5 s). A process that imported torch already (any
training job) gets the module itself, never a stand-in.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


class _Module:
    """Stands for a module in a deltackpt module's globals until an attribute of it is first looked up, which
    imports the module and puts it in those globals in its place: later lookups go straight to it."""

    __slots__ = ("_name", "_namespace")

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        self._name, self._namespace = name, namespace

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        if self._namespace.get(self._name) is self:
            self._namespace[self._name] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported at its first use>"


def module(name: str, namespace: dict[str, Any]) -> Any:
    """Module ``name`` for ``namespace[name]`` (``namespace``: a module's ``globals()``): the module if it is
    imported already, else a stand-in that imports it at its first use."""
    return sys.modules.get(name) or _Module(name, namespace)
