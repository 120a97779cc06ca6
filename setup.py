"""Build of the native chunk kernel ``deltackpt._kernel``; all other metadata is in pyproject.toml.

The extension is compiled from ``native/_kernel.pyx`` (the Cython adapter) and ``native/kernel.c`` (the
loops), against the header-only use of the system ``xxhash.h`` (Debian/Ubuntu: ``libxxhash-dev``) and the system
zstd library (``libzstd-dev``: the load path decodes frames in C without the GIL). Two values
are compiled in so that :mod:`deltackpt.kernel` can reject a stale build at import: the package's
``API_VERSION`` and a hash of the kernel sources.

Without ``xxhash.h``, ``zstd.h`` or a C compiler the extension is skipped (a warning, then an install with the
pure-Python backend only) unless ``DELTACKPT_REQUIRE_KERNEL=1``, which the Makefile sets: there a failed build is
an error. Extra compiler/linker flags (e.g. ``-march=native``, or the sanitizer flags of ``make asan``) can be passed in
``DELTACKPT_EXTRA_CFLAGS`` and ``DELTACKPT_EXTRA_LDFLAGS``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import sysconfig
import warnings
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
NATIVE = ROOT / "native"

# Must stay identical to deltackpt.kernel.source_hash / _NATIVE_SOURCES (duplicated rather than imported:
# importing the deltackpt package at build time would import its dependencies). tests/test_kernel.py checks
# that they agree.
_NATIVE_SOURCES = ("kernel.c", "kernel.h", "_kernel.pyx")


def source_hash(native_dir: Path) -> str:
    h = hashlib.sha256()
    for name in _NATIVE_SOURCES:
        h.update(name.encode())
        h.update((native_dir / name).read_bytes())
    return h.hexdigest()[:16]


def api_version() -> int:
    text = (ROOT / "deltackpt" / "kernel.py").read_text(encoding="utf-8")
    m = re.search(r"^API_VERSION\s*=\s*(\d+)\s*$", text, re.MULTILINE)
    if m is None:
        raise RuntimeError("deltackpt/kernel.py defines no API_VERSION = <int>")
    return int(m.group(1))


def _warn_if_missing_headers() -> None:
    dirs = [sysconfig.get_paths()["include"], "/usr/include", "/usr/local/include"]
    for var in ("CPATH", "C_INCLUDE_PATH"):
        dirs += [d for d in os.environ.get(var, "").split(os.pathsep) if d]
    dirs += [a[2:] for a in shlex.split(os.environ.get("CFLAGS", "")) if a.startswith("-I")]
    for header, pkgs in (("xxhash.h", "libxxhash-dev (apt) / xxhash-devel (dnf) / xxhash (brew)"),
                         ("zstd.h", "libzstd-dev (apt) / libzstd-devel (dnf) / zstd (brew)")):
        if not any((Path(d) / header).exists() for d in dirs):
            warnings.warn(f"{header} not found: install {pkgs} first", stacklevel=1)


_warn_if_missing_headers()

extension = Extension(
    "deltackpt._kernel",
    sources=["native/_kernel.pyx", "native/kernel.c"],
    # Rebuild when the header or the compiled-in API_VERSION changes, not only the sources.
    depends=["native/kernel.h", "deltackpt/kernel.py"],
    include_dirs=["native", np.get_include()],
    define_macros=[
        ("DCK_API_VERSION", str(api_version())),
        ("DCK_SOURCE_HASH", f'"{source_hash(NATIVE)}"'),
    ],
    extra_compile_args=[
        "-O3",
        "-ffp-contract=off",  # predictions must be exact IEEE operations, never fused (docs/format.md 8a)
        "-fno-math-errno",  # lets sqrt vectorize (sqrtpd); results are unchanged
        "-Wall",
        "-Wextra",
        *shlex.split(os.environ.get("DELTACKPT_EXTRA_CFLAGS", "")),
    ],
    extra_link_args=shlex.split(os.environ.get("DELTACKPT_EXTRA_LDFLAGS", "")),
    libraries=["pthread", "zstd", "m"],
)

extensions = cythonize([extension], compiler_directives={"language_level": "3"}, quiet=True)
for ext in extensions:
    # A machine without the headers (or a compiler) still installs deltackpt, with the pure-Python backend, which
    # deltackpt.kernel warns about at import. The Makefile and CI require the kernel: DELTACKPT_REQUIRE_KERNEL=1.
    # (Set here: cythonize's copies of the extension do not keep ``optional``.)
    ext.optional = os.environ.get("DELTACKPT_REQUIRE_KERNEL", "").strip() != "1"
setup(ext_modules=extensions)
