"""The checkpointing benchmark suite: deltackpt next to torch.save, safetensors and torch DCP, in one run.

    python -m bench --quick                 # CI-sized, under a minute; exits 1 on any failure
    python -m bench                         # full mode (minutes): bench/results/<date>-<host>.json
    python -m bench --only a,e --saves 2    # a subset, shortened

See bench/README.md. Modules: :mod:`bench.workloads` (the states), :mod:`bench.systems` (the adapters),
:mod:`bench.cell` (a child process measuring cells), :mod:`bench.driver` (the parent), :mod:`bench.report`
(ratios and markdown). ``bench/kernel.py`` is a separate micro-benchmark of the chunk kernel.
"""
