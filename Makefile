# deltackpt: install, build, test.   make test  |  make demo   (both set everything up on first use)
#
#   make test    system headers + .venv + dependencies + native kernel, then the test suite twice: on the native
#                backend and on the pure-Python one, side by side (TEST_PARALLEL=0: in turn; fails if either fails)
#   make demo    same setup, then the demo (or the kernel benchmark while there is no demo)
#   make build   (re)build the native kernel in place
#   make asan    build the kernel with ASan + UBSan into build/asan and run tests/test_kernel.py against it
#   make lint    ruff check, mypy of the package, mypy --strict of the public API as the README uses it
#   make bench   kernel throughput table (1 GiB buffer; BENCH_ARGS=--quick for 64 MiB)
#
# Setup steps are stamped in .venv/.stamps/ so repeated runs only redo what changed. The extension is always
# built without pip's build isolation, against the venv's own setuptools/Cython/numpy, so a build never pulls
# another torch. Here a kernel that does not build is an error (DELTACKPT_REQUIRE_KERNEL; setup.py): a plain
# pip install skips it and falls back to the pure-Python backend.

export DELTACKPT_REQUIRE_KERNEL := 1

PYTHON        ?= python3
VENV          ?= .venv
PY            := $(VENV)/bin/python
PIP           := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMPS        := $(VENV)/.stamps
NATIVE_DEPS   := native/kernel.c native/kernel.h native/_kernel.pyx setup.py deltackpt/kernel.py
PYTEST_ARGS   ?= -q
TEST_PARALLEL ?= 1
BENCH_ARGS    ?=
ASAN_DIR      := build/asan
ASAN_FLAGS    := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: test demo build install sysdeps asan lint bench clean

# --------------------------------------------------------------------------------------------------- setup

sysdeps:
	@if [ ! -f /usr/include/xxhash.h ] || [ ! -f /usr/include/zstd.h ] || ! command -v cc >/dev/null 2>&1; then \
		echo "installing libxxhash-dev libzstd-dev build-essential"; \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q libxxhash-dev libzstd-dev build-essential; \
	fi

$(PY):
	$(PYTHON) -m venv $(VENV)

# Dependencies and the editable install (which also compiles the kernel once).
$(STAMPS)/install: pyproject.toml setup.py | $(PY)
	@$(MAKE) --no-print-directory sysdeps
	$(PIP) install -q "torch==$(TORCH_VERSION)" "setuptools>=64" wheel "Cython>=3" numpy
	$(PIP) install -q --no-build-isolation -e ".[test]"
	@mkdir -p $(STAMPS) && touch $@

# Rebuild in place when the kernel sources change (build_ext skips the compile when it is up to date).
$(STAMPS)/build: $(STAMPS)/install $(NATIVE_DEPS)
	@$(MAKE) --no-print-directory sysdeps
	$(PY) setup.py -q build_ext --inplace
	@touch $@

install: $(STAMPS)/install
build: $(STAMPS)/build

# ---------------------------------------------------------------------------------------------------- test

# The two backends' runs go side by side (TEST_PARALLEL=0: one after the other). Much of the suite's time is
# child processes importing torch and waiting on each other, fsync and signals, which overlap well even on two
# cores. Each run has a temporary directory of its own (pytest's --basetemp). The native run prints as it
# goes; the python run's output follows once it ends.
test: build
	@rc=0; py=; tmp=$$(mktemp -d); \
	trap '[ -n "$$py" ] && kill $$py 2>/dev/null; rm -rf "$$tmp"' EXIT; \
	if [ "$(TEST_PARALLEL)" = 1 ]; then \
		DELTACKPT_BACKEND=python DELTACKPT_EXPECT_BACKEND=python $(PY) -m pytest $(PYTEST_ARGS) \
			--basetemp="$$tmp/python" > "$$tmp/python.log" 2>&1 & py=$$!; \
	fi; \
	echo "== tests, native backend"; \
	DELTACKPT_BACKEND=native DELTACKPT_EXPECT_BACKEND=native $(PY) -m pytest $(PYTEST_ARGS) \
		--basetemp="$$tmp/native" || rc=1; \
	echo "== tests, python backend"; \
	if [ -n "$$py" ]; then \
		wait $$py || rc=1; py=; cat "$$tmp/python.log"; \
	else \
		DELTACKPT_BACKEND=python DELTACKPT_EXPECT_BACKEND=python $(PY) -m pytest $(PYTEST_ARGS) \
			--basetemp="$$tmp/python" || rc=1; \
	fi; \
	exit $$rc

demo: build
	@if [ -f deltackpt/demo.py ]; then \
		$(PY) -m deltackpt.demo; \
	else \
		$(PY) bench/kernel.py --quick; \
	fi

bench: build
	$(PY) bench/kernel.py $(BENCH_ARGS)

lint: $(STAMPS)/install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict --follow-imports=silent tests/api_usage_typed.py

# The sanitizer build goes to build/asan beside a minimal copy of the package (kernel modules only, so no
# torch is imported under ASan); the ASan runtime is preloaded because python itself is not instrumented.
# The first check proves the instrumented module is the one imported, with the runtime loaded.
asan: $(STAMPS)/install
	@$(MAKE) --no-print-directory sysdeps
	rm -rf $(ASAN_DIR) build/asan-tmp
	DELTACKPT_EXTRA_CFLAGS="$(ASAN_FLAGS)" DELTACKPT_EXTRA_LDFLAGS="-fsanitize=address,undefined" \
		$(PY) setup.py -q build_ext --force --build-lib $(ASAN_DIR) --build-temp build/asan-tmp
	touch $(ASAN_DIR)/deltackpt/__init__.py
	ln -sf ../../../deltackpt/kernel.py ../../../deltackpt/_pykernel.py $(ASAN_DIR)/deltackpt/
	@nm -D $(ASAN_DIR)/deltackpt/_kernel*.so | grep -q __asan_report || \
		{ echo "asan: the kernel is not instrumented"; exit 1; }
	cd $(ASAN_DIR) && LD_PRELOAD="$$($(CC) -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0 \
		DELTACKPT_BACKEND=native $(abspath $(PY)) -c "import deltackpt._kernel as k, deltackpt.kernel as kk; \
		assert '/$(ASAN_DIR)/' in k.__file__, k.__file__; \
		assert 'libasan' in open('/proc/self/maps').read(), 'ASan runtime not loaded'; \
		print('asan: running', k.__file__, 'backend', kk.backend)"
	PYTHONPATH=$(ASAN_DIR) LD_PRELOAD="$$($(CC) -print-file-name=libasan.so)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		DELTACKPT_BACKEND=native DELTACKPT_EXPECT_BACKEND=native DELTACKPT_EXPECT_KERNEL_DIR=$(abspath $(ASAN_DIR)) \
		$(VENV)/bin/pytest tests/test_kernel.py --noconftest -p no:cacheprovider --capture=sys $(PYTEST_ARGS)

clean:
	rm -rf build dist *.egg-info native/_kernel.c deltackpt/_kernel*.so $(STAMPS)
