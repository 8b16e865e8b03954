"""Steps written by torch 2.10, 2.13 and 2.15 (test/golden/), read with the pinned torch.

test/golden/make_golden.py wrote each with the torch named in its folder and
recorded the digest of every value; here each is read with pippy (bitwise
against the digests), loaded into the un-split model and its optimizer, and
read with plain DCP, which fails on torch 2.15's ``.metadata`` before torch
2.15. A step whose ``.metadata`` this torch cannot read says which torch
wrote it, not that it is damaged.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from golden.make_golden import digest
from torch.distributed.checkpoint import FileSystemReader

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.checks import named_leaves

from gpt import GPT, ModelArgs
from helpers import plain_read

GOLDEN = Path(__file__).with_name("golden")
STEPS = sorted(GOLDEN.glob("torch-*/step-2"))
OLDER_THAN_2_15 = torch.__version__ < (2, 15)


def test_there_are_golden_steps_of_three_torch_releases():
    assert [p.parent.name for p in STEPS] == ["torch-2.10", "torch-2.13", "torch-2.15"]


def expected(step: Path) -> dict:
    return json.loads((step.parent / "digests.json").read_text())["items"]


@pytest.mark.parametrize("step", STEPS, ids=lambda p: p.parent.name)
def test_a_golden_step_reads_bitwise_with_this_torch(step):
    values = offline.read_checkpoint(step)
    assert {k: digest(v) for k, v in values.items()} == expected(step)
    written = json.loads((step / "manifest.json").read_text())["written_by"]
    assert written["torch"].startswith(step.parent.name.removeprefix("torch-"))


@pytest.mark.parametrize("step", STEPS, ids=lambda p: p.parent.name)
def test_a_golden_step_loads_into_the_unsplit_model_and_optimizer(step):
    model = GPT(ModelArgs(n_layers=2, dim=16, max_seq_len=8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert offline.load_model(step, model, optimizer) == 2
    loaded = dict(named_leaves(checkpoint.StageState(model, optimizer).state_dict()))
    want = expected(step)
    tensors = [k for k in want if k.startswith(("model.", "optim.state."))]
    assert len(tensors) > 40
    assert {k: digest(loaded[k]) for k in tensors} == {k: want[k] for k in tensors}


@pytest.mark.parametrize("step", STEPS, ids=lambda p: p.parent.name)
def test_plain_dcp_reads_a_golden_step_unless_a_newer_torch_wrote_it(step):
    if step.parent.name == "torch-2.15" and OLDER_THAN_2_15:
        # torch 2.15 adds TensorProperties.strides; older torch cannot unpickle it.
        with pytest.raises(ValueError, match="too many values to unpack"):
            FileSystemReader(step).read_metadata()
        return
    values = plain_read(step)
    want = expected(step)
    assert {k: digest(v) for k, v in values.items() if torch.is_tensor(v)} == {
        k: v for k, v in want.items() if isinstance(v, dict)
    }


def test_a_metadata_this_torch_cannot_read_names_the_torch_that_wrote_it(tmp_path):
    # The oldest torch pippy supports wrote it: never newer than this one.
    step = shutil.copytree(GOLDEN / "torch-2.10" / "step-2", tmp_path / "step-2")
    metadata = step / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:1000])  # what this torch cannot read
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"\.metadata is damaged \(.*\): restore it, or move",
    ):
        offline.read_checkpoint(step)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["written_by"]["torch"] = "2.99.0"
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError) as e:
        offline.read_checkpoint(step)
    assert str(e.value).startswith(
        f"{metadata} was written by torch 2.99.0, this is torch {torch.__version__}, "
        "which cannot read it ("
    )
    assert str(e.value).endswith("). Read it with torch 2.99.0 or newer")
