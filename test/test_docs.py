"""Every Python snippet of README.md and the walkthrough runs as written.

Snippets of a page run in order in one folder (later ones read the
checkpoints earlier ones wrote), from the repository root's view of imports;
one whose first line is ``# torchrun --nproc-per-node N ...`` runs on N ranks.
"""

import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT

PAGES = ["README.md", "examples/checkpoint/README.md"]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+)")


def snippets(page):
    return _BLOCK.findall((ROOT / page).read_text())


def test_the_pages_have_snippets():
    assert len(snippets("examples/checkpoint/README.md")) >= 4
    assert snippets("README.md")


@pytest.mark.parametrize("page", PAGES)
def test_snippets_run_as_written(tmp_path, page):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["HF_HUB_OFFLINE"] = "1"
    for i, code in enumerate(snippets(page)):
        script = tmp_path / f"snippet_{i}.py"
        script.write_text(code)
        match = _TORCHRUN.match(code)
        cmd = [sys.executable, str(script)]
        if match:
            launch = ["-m", "torch.distributed.run", "--standalone"]
            cmd[1:1] = [*launch, f"--nproc-per-node={match.group(1)}"]
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
        )
        assert proc.returncode == 0, (
            f"{page} snippet {i}:\n{code}\n{proc.stderr[-3000:]}"
        )
