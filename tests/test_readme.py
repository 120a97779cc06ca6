"""The README's Python examples run as written.

Each ```python block of README.md runs in a fresh namespace, in a temporary working directory, after a preamble
that defines what the README leaves to the reader (``model``, ``opt``, ``dataset``, ``train_step``...). A block
that no longer matches the API (a renamed argument, a call whose order cannot work) fails here, not for the
first user who copies it."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ROOT

#: what the README's examples take as given, as a user's script would have it
_PREAMBLE = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
dataset = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randint(0, 2, (96,)))
loss_fn = torch.nn.CrossEntropyLoss()
total_steps = steps = 20  # (the training loop saves every 10 steps)
new_state = {"model": model.state_dict()}

def train_step():
    x, y = dataset[:16]
    loss = loss_fn(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""


def _blocks() -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of README.md."""
    text = (ROOT / "README.md").read_text()
    return [(text.count("\n", 0, m.start()) + 2, textwrap.dedent(m.group(2)))  # (one in a list item is indented)
            for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.M | re.S)]


def test_the_readme_has_examples() -> None:
    assert len(_blocks()) >= 4


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # (num_workers=4 on a 2-core machine)
@pytest.mark.parametrize("line,code", _blocks(), ids=[f"line{n}" for n, _ in _blocks()])
def test_a_readme_example_runs(line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(_PREAMBLE, "<preamble>", "exec"), ns)
    dist = "torch.distributed" in code
    if dist:  # a one-rank process group, as torchrun would set up
        import torch.distributed as td

        td.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        # the block runs twice where running it again is what a user does (a restart resumes)
        for _ in range(2 if "restore()" in code or "distributed.steps" in code else 1):
            exec(compile(code, f"README.md:{line}", "exec"), ns)
    finally:
        if dist:
            torch.distributed.destroy_process_group()
    if "ckpt" in ns:  # the training loop: it saved, and a second run resumed where the first stopped
        assert ns["start_step"] == ns["total_steps"]
    if "writer" in ns:
        import deltackpt.distributed as d

        assert d.steps(tmp_path / "ckpts") == list(range(20))


def test_the_quick_start_runs_as_pasted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first screen's example defines everything it uses: it runs without the preamble, and run again it
    resumes where the first run stopped."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert m, "the Quick start section has no python block"
    monkeypatch.chdir(tmp_path)
    for run in range(2):
        ns: dict[str, object] = {"__name__": "readme_quick_start"}
        exec(compile(m.group(1), "README.md:quick start", "exec"), ns)
        assert ns["start_step"] == (0 if run == 0 else ns["total_steps"])


def test_the_command_table_matches_the_command_line() -> None:
    """Every subcommand has a row in the README's command table, and each row names exactly its options."""
    import argparse

    from deltackpt.cli import build_parser

    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `deltackpt ([a-z-]+)([^`]*)` \|", section, re.M)}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(rows) == set(sub.choices)
    for name, parser in sub.choices.items():
        options = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        assert set(re.findall(r"--[a-z-]+", rows[name])) == options, name
