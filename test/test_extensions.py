"""DCP's stream extensions (``FileSystemWriter``'s ``_extensions``): a step
written through one is read back, verified, with the registry that knows it,
and refused at open, in one line, by a reader that does not."""

import io
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
)

from pippy import checkpoint
from pippy.checkpoint import offline


class _Compressing(io.RawIOBase):
    """Writes what it is given to ``output``, deflated."""

    def __init__(self, output):
        self.output, self.deflate = output, zlib.compressobj()

    def writable(self):
        return True

    def write(self, b):
        self.output.write(self.deflate.compress(bytes(b)))
        return len(memoryview(b))

    def close(self):
        if not self.closed:
            self.output.write(self.deflate.flush())
            self.output.close()
        super().close()


class Zlib(StreamTransformExtension):
    """A compressing stream extension, as a DCP user registers their own."""

    @staticmethod
    def registry_name():
        return "test.zlib"

    @staticmethod
    def from_descriptor(version):
        return Zlib()

    def get_descriptor(self):
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        return _Compressing(output)

    def transform_from(self, input):
        return io.BytesIO(zlib.decompress(input.read()))


def registry():
    known = ExtensionRegistry()
    known.register(Zlib)
    return known


def state(seed, step=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(256, 256)  # zeros compress: the step is smaller
    with torch.no_grad():
        model.weight[:, 128:] = 0
    return {"model": model.state_dict(), "step": step}


def test_a_step_written_through_a_stream_extension_loads_verified(tmp_path):
    saved = state(0, step=1)
    with checkpoint.publish_step(tmp_path, 1, _extensions=[Zlib()]) as writer:
        dcp.save(saved, storage_writer=writer)
    step = tmp_path / "step-1"
    data = [f for f in step.iterdir() if f.suffix == ".distcp"]
    assert sum(f.stat().st_size for f in data) < 256 * 256 * 4 * 3 // 4  # deflated
    assert offline.verify_step(step) == 3  # its stored bytes: weight, bias, step

    loaded = state(1)
    reader, planner = checkpoint.open_step(step, extension_registry=registry())
    dcp.load(loaded, storage_reader=reader, planner=planner)
    assert torch.equal(loaded["model"]["weight"], saved["model"]["weight"])
    assert loaded["step"] == 1
    plain = state(2)  # and plain DCP reads the same step alike
    dcp.load(
        plain, storage_reader=FileSystemReader(step, _extension_registry=registry())
    )
    assert torch.equal(plain["model"]["weight"], saved["model"]["weight"])


def test_a_step_whose_extension_the_reader_lacks_is_refused_at_open(tmp_path):
    with checkpoint.publish_step(tmp_path, 1, _extensions=[Zlib()]) as writer:
        dcp.save(state(0, step=1), storage_writer=writer)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.open_step(tmp_path / "step-1")  # DCP's default registry
    assert "stream extension(s) ['test.zlib/1']" in str(e.value)
    assert "extension_registry" in str(e.value)
