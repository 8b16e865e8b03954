"""python -m pippy: inspect and export, on real checkpoints saved by DCP."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.reader import read_metadata
from pippy.checkpoint.safe_load import TRUST_ENV
from pippy.cli import main

from gpt import GPT, ModelArgs
from helpers import (
    ROOT,
    TINY_FLAGS,
    example,
    pippy_cli,
    poison_metadata,
    tiny_gpt,
)

MODEL_ARGS = ModelArgs(n_layers=2, dim=32, max_seq_len=16)


def save(root, step, state):
    return checkpoint.save_stage(state, root, step=step)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder: step-3 (model, AdamW state, step) and an incomplete step-9.

    Returns the folder and the model's state_dict as saved.
    """
    root = tmp_path_factory.mktemp("run") / "ckpt"
    model = tiny_gpt(n_layers=2, max_seq_len=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 8))).mean().backward()
    optimizer.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    saved = {key: value.clone() for key, value in model_sd.items()}
    save(root, 3, {"model": model_sd, "optim": optim_sd, "step": 3})
    (root / "step-9").mkdir()  # a save that did not finish: no .metadata
    return root, saved


def poisoned_copy(step_folder, dest, marker):
    """A copy of a step whose .metadata creates `marker` when unpickled."""
    shutil.copytree(step_folder, dest)
    poison_metadata(dest, marker)
    return dest


def table_rows(out, first_column):
    """The rows of the printed table whose first cell starts so, by that cell."""
    rows = (re.split(r"\s{2,}", line.strip()) for line in out.splitlines())
    return {row[0]: row[1:] for row in rows if row[0].startswith(first_column)}


def test_help_lists_the_commands_and_flags(capsys):
    for argv, words in [
        ([], ["inspect", "export"]),
        (["inspect"], ["--step", "--keys", "--verify", "--trust-checkpoint"]),
        (["export"], ["--out", "--format", "--dtype", "--allow-no-manifest"]),
        (["convert"], ["--to", "--out", "--allow-no-manifest"]),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert all(word in out for word in words), out


def test_a_script_asks_what_inspect_and_export_answer_by_public_names(run, tmp_path):
    root, saved = run
    report = offline.inspect_step(root, verify=True)  # the newest complete step
    assert report.folder == root / "step-3" and report.complete and not report.damage
    assert report.error is None and report.layout == "pippy"
    assert report.verified == len(report.metadata.storage_data)
    assert report.size == sum(p.stat().st_size for p in report.folder.iterdir())
    steps = offline.inspect_steps(root)
    assert list(steps) == [3, 9] and steps[3].complete and not steps[9].complete
    assert isinstance(steps[9].error, checkpoint.CheckpointNotFoundError)
    assert offline.inspect_steps(root / "step-3") == {}  # a step folder itself
    for inspect in (offline.inspect_step, offline.inspect_steps):  # alike
        with pytest.raises(FileNotFoundError, match="no such folder"):
            inspect(tmp_path / "nope")
        with pytest.raises(NotADirectoryError, match="is a file"):
            inspect(root / "step-3" / ".metadata")
    out = tmp_path / "m.safetensors"
    weights = offline.export_weights(report.folder, out)
    assert load_file(out).keys() == weights.keys() == saved.keys()


def test_inspect_lists_steps_and_files_and_with_keys_each_key(run, capsys):
    root, saved = run
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    steps = table_rows(out, ("3", "9"))
    assert steps["3"][0] == "yes" and steps["9"][0].startswith("no")
    # The newest complete step, detailed by its files; no key unless asked.
    count = len(read_metadata(root / "step-3").state_dict_metadata)
    assert f"{root / 'step-3'}: {count} keys (pippy layout); --keys lists" in out
    assert table_rows(out, ("model.", "optim.", "step")) == {}
    files = table_rows(out, ("__0_0.distcp", "total"))
    assert files["__0_0.distcp"][:2] == ["0", str(count)]
    assert files["total"][0] == str(count)
    assert len(out.splitlines()) < 12

    assert main(["inspect", str(root), "--keys"]) == 0
    out = capsys.readouterr().out
    assert f"{root / 'step-3'}: {count} of {count} keys" in out
    keys = table_rows(out, ("model.", "optim.", "step"))
    for key, tensor in saved.items():
        shape, dtype, size, file = keys[f"model.{key}"]
        assert shape == str(list(tensor.shape)) and dtype == "float32"
        assert int(size) == tensor.numel() * 4 and file == "__0_0.distcp"
    assert keys["model.layers.0.qkv.weight"] == [
        "[96, 32]",
        "float32",
        "12288",
        "__0_0.distcp",
    ]
    assert keys["optim.state.layers.1.mlp.0.weight.exp_avg"][:2] == [
        "[128, 32]",
        "float32",
    ]
    assert keys["step"][1] == "object" and keys["step"][3] == "__0_0.distcp"
    assert len(keys) == count
    assert table_rows(out, ("total",))["total"][0] == str(count)


def test_inspect_a_step_folder_with_key_patterns(run, capsys):
    root, _ = run
    argv = ["inspect", str(root / "step-3"), "--keys", "model.norm.*", "step"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "STEP" not in out  # a step folder: no list of steps
    keys = table_rows(out, ("model.", "optim.", "step"))
    assert sorted(keys) == ["model.norm.bias", "model.norm.weight", "step"]
    assert main(["inspect", str(root), "--step", "3", "--keys", "optim.*"]) == 0
    keys = table_rows(capsys.readouterr().out, ("model.", "optim.", "step"))
    assert keys and all(key.startswith("optim.") for key in keys)


def test_inspect_totals_count_the_keys_and_files_shown(run, capsys):
    step = run[0] / "step-3"
    assert main(["inspect", str(step), "--keys", "model.layers.0.*"]) == 0
    out = capsys.readouterr().out
    keys = table_rows(out, ("model.",))
    files = table_rows(out, ("__", "total"))
    assert sorted(files) == ["__0_0.distcp", "total"]
    _, count, nbytes, on_disk = files["__0_0.distcp"]
    assert int(count) == len(keys) == 10
    assert int(nbytes) == sum(int(row[2]) for row in keys.values())
    assert files["total"] == [count, nbytes, on_disk]  # that file alone, as shown
    # The whole step, .metadata and manifest.json with it, on a line of its own.
    assert re.search(
        rf"^{re.escape(str(step))}: [\d.]+ [kMG]B on disk in all "
        r"\(also \.metadata, manifest\.json\)$",
        out,
        re.M,
    ), out


@pytest.mark.launches
def test_inspect_counts_a_sharded_key_in_each_file_by_its_shard(tmp_path, capsys):
    flags = [*TINY_FLAGS, "--steps", "1", "--dp", "2", "--fsdp"]
    example(2, *flags, "--checkpoint-dir", tmp_path)
    assert main(["inspect", str(tmp_path), "--keys", "model.layers.0.*"]) == 0
    out = capsys.readouterr().out
    keys = table_rows(out, ("model.",))
    assert {row[3] for row in keys.values()} == {"__0_0.distcp,__1_0.distcp"}
    files = table_rows(out, ("__", "total"))
    tensor_bytes = sum(int(row[2]) for row in keys.values())
    assert [int(files[f][2]) for f in ("__0_0.distcp", "__1_0.distcp")] == [
        tensor_bytes // 2
    ] * 2
    assert files["total"][:2] == [str(len(keys)), str(tensor_bytes)]


def load_export(path, fmt):
    if fmt == "pt":
        return torch.load(path, weights_only=True)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
    state = load_file(path)
    assert set(state) == keys
    return state


@pytest.mark.parametrize(
    "name, flags, fmt",
    [
        ("model.pt", [], "pt"),
        ("model.safetensors", [], "safetensors"),
        ("model.bin", ["--format", "safetensors"], "safetensors"),
    ],
)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_export_round_trip(run, tmp_path, capsys, name, flags, fmt, dtype):
    root, saved = run
    out = tmp_path / name
    if dtype is not None:
        flags = [*flags, "--dtype", str(dtype).removeprefix("torch.")]
    assert main(["export", str(root / "step-3"), "--out", str(out), *flags]) == 0
    assert str(out) in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left
    umask = os.umask(0o22)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    state = load_export(out, fmt)
    assert state.keys() == saved.keys()  # the model's keys, no optimizer state
    for key, tensor in saved.items():
        expected = tensor if dtype is None else tensor.to(dtype)
        assert state[key].dtype == expected.dtype and torch.equal(state[key], expected)
    if dtype is None:
        fresh = GPT(MODEL_ARGS)
        fresh.load_state_dict(state, strict=True)
        for key, tensor in fresh.state_dict().items():
            assert torch.equal(tensor, saved[key]), key


def test_export_where_no_file_can_be_made_names_the_file_asked_for(run, capsys):
    root, _ = run  # /proc: a folder that exists, where no file can be created
    assert main(["export", str(root), "--out", "/proc/model.pt"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == "error: [Errno 2] No such file or directory: '/proc/model.pt'"


def test_export_force_overwrites(run, tmp_path):
    root, saved = run
    out = tmp_path / "model.pt"
    out.write_bytes(b"old")
    assert main(["export", str(root), "--out", str(out), "--force"]) == 0
    assert torch.load(out, weights_only=True).keys() == saved.keys()


def test_trusted_export_of_a_poisoned_checkpoint(run, tmp_path):
    root, saved = run
    marker = tmp_path / "pwned"
    step = poisoned_copy(root / "step-3", tmp_path / "step-3", marker)
    out = tmp_path / "model.pt"
    assert main(["export", str(step), "--out", str(out), "--trust-checkpoint"]) == 0
    assert marker.exists()  # trusted: plain pickle, as documented
    state = torch.load(out, weights_only=True)
    assert all(torch.equal(state[key], value) for key, value in saved.items())


@pytest.fixture(scope="module")
def cli_runs(run, tmp_path_factory):
    """Runs each command line: one as ``python -m pippy``, the others in this
    process.

    Returns {case: (argv, returncode, stderr, expected part of the message)}
    for eight failing commands and one export, and the files they concern.
    """
    root, _ = run
    tmp = tmp_path_factory.mktemp("errors")
    step = root / "step-3"
    (tmp / "existing.pt").write_bytes(b"keep me")
    markers = {name: tmp / f"pwned-{name}" for name in ("inspect", "export")}
    poisoned = {
        name: poisoned_copy(step, tmp / name / "step-3", marker)
        for name, marker in markers.items()
    }
    cases = {
        "missing": (["inspect", tmp / "nowhere"], "no such folder"),
        "file": (["inspect", step / "__0_0.distcp"], "is a file"),
        "incomplete": (["inspect", root / "step-9"], "not a complete checkpoint"),
        "unknown_step": (["inspect", root, "--step", "5"], "no step 5"),
        "no_key_matches": (["inspect", root, "--keys", "nothing.*"], "no key"),
        "out_exists": (
            ["export", step, "--out", tmp / "existing.pt"],
            "pass force=True (--force)",
        ),
        "poisoned_inspect": (["inspect", poisoned["inspect"]], "refused to load"),
        "poisoned_export": (
            ["export", poisoned["export"], "--out", tmp / "poisoned.pt"],
            "refused to load",
        ),
        "ok_export": (["export", root, "--out", tmp / "ok.safetensors"], None),
    }

    def cli(case):
        argv, expected = cases[case]
        if case == "ok_export":  # one as a user runs it: python -m pippy
            env = {k: v for k, v in os.environ.items() if k != TRUST_ENV}
            cmd = [sys.executable, "-m", "pippy", *map(str, argv)]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
            )
        else:  # the others in this process, as pippy.cli.main
            proc = pippy_cli(*argv, env={TRUST_ENV: None})
        return argv, proc.returncode, proc.stderr, expected

    results = {case: cli(case) for case in cases}
    results["markers"] = markers
    results["existing"] = tmp / "existing.pt"
    results["ok"] = tmp / "ok.safetensors"
    results["poisoned_out"] = tmp / "poisoned.pt"
    return results


@pytest.mark.launches
@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "file",
        "incomplete",
        "unknown_step",
        "no_key_matches",
        "out_exists",
        "poisoned_inspect",
        "poisoned_export",
    ],
)
def test_errors_are_one_line_and_exit_2(cli_runs, case):
    argv, returncode, stderr, expected = cli_runs[case]
    assert returncode == 2, (argv, stderr)
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["inspect", "{root}", "--step", "9"], "step-9' is not a complete checkpoint"),
        (["export", "{root}/step-9", "--out", "{tmp}/m.pt"], "not a complete"),
        (["export", "{tmp}/no_model/step-1", "--out", "{tmp}/m.pt"], "'model.'"),
        (
            ["inspect", "{root}/step-3", "--step", "4"],
            "step (--step) needs a run folder",
        ),
        (["inspect", "{tmp}"], "holds no step-<N>"),
        (["export", "{root}", "--out", "{tmp}/no/m.pt"], "no folder"),
        (
            ["convert", "{root}/step-3", "--to", "torchtitan", "--out", "{tmp}/step-9"],
            "step-9' would hold step 3: name it step-3",
        ),
    ],
)
def test_more_errors_in_process(run, tmp_path, capsys, argv, expected):
    save(tmp_path / "no_model", 1, {"step": 1, "data": {"x": torch.ones(2)}})
    argv = [arg.format(root=run[0], tmp=tmp_path) for arg in argv]
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
    assert not (tmp_path / "m.pt").exists()


def tree_bytes(folder):
    """{relative path: bytes} of every file under `folder`."""
    return {
        p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    "argv, expected",
    [  # a wrong --out names the run, a step or a file in one: refused, even forced
        (
            ["export", "{step}", "--hf-config", "{tmp}/c.json", "--out", "{run}"],
            "is a checkpoint folder holding step-1, step-2, which replacing it",
        ),
        (
            [
                "export",
                "{step}",
                "--hf-config",
                "{tmp}/c.json",
                "--out",
                "{run}/step-1",
            ],
            "step-1': it is a step, a checkpoint that writing there would damage",
        ),
        (["export", "{step}", "--out", "{step}/.metadata"], "lies in the step folder"),
        (["export", "{step}", "--out", "{run}/step-1/m.pt"], "lies in the step folder"),
        (
            ["convert", "{step}", "--to", "torchtitan", "--out", "{step}/titan"],
            "lies in the step folder",
        ),
        (
            ["convert", "{step}", "--to", "pippy", "--out", "{run}/step-02"],
            "step-02' would hold step 2: name it step-2",
        ),
        (
            ["export", "{step}", "--out", "{tmp}"],
            "is a folder: out (--out) names the file",
        ),
        (
            ["export", "{step}", "--hf-config", "{tmp}/bad.json", "--out", "{tmp}/hf"],
            "bad.json' is not JSON: Expecting value",
        ),
        (
            ["convert", "{step}", "--to", "pippy", "--out", "{tmp}/a_file/step-2"],
            "cannot write '{tmp}/a_file/step-2' in '{tmp}/a_file': Not a directory",
        ),
        (  # a folder holding the run (and more): --force replaces an export only
            ["export", "{step}", "--hf-config", "{tmp}/c.json", "--out", "{tmp}"],
            "refused to replace '{tmp}': it holds a_file, bad.json, c.json, run, "
            "which no Hugging Face export writes",
        ),
        (
            ["export", "{step}", "--hf-config", "{tmp}/no.json", "--out", "{tmp}/hf"],
            "no Hugging Face config at '{tmp}/no.json' (config, --hf-config)",
        ),
    ],
)
def test_an_out_that_would_touch_a_checkpoint_is_refused(
    tmp_path, capsys, argv, expected
):
    run = tmp_path / "run"
    for step in (1, 2):
        save(run, step, {"step": step, "model": {"w": torch.full((2,), step)}})
    (tmp_path / "c.json").write_text("{}")
    (tmp_path / "bad.json").write_text("not json")
    (tmp_path / "a_file").write_text("")
    before = tree_bytes(run)
    names = {"run": run, "step": run / "step-2", "tmp": tmp_path}
    argv = [arg.format(**names) for arg in argv] + ["--force"] * (argv[0] == "export")
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert expected.format(**names) in lines[0]
    assert tree_bytes(run) == before  # nothing saved is touched
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a_file",
        "bad.json",
        "c.json",
        "run",
    ]


def test_a_forced_hf_export_replaces_an_earlier_export_never_the_current_folder(
    run, tmp_path, monkeypatch, capsys
):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2"}')
    out = tmp_path / "hf"
    argv = ["export", str(run[0] / "step-3"), "--hf-config", str(config), "--out"]
    assert main([*argv, str(out)]) == 0
    assert main([*argv, str(out)]) == 2  # exists
    assert "exists; pass force=True (--force) to replace it" in capsys.readouterr().err
    before = tree_bytes(out)
    assert main([*argv, str(out), "--force"]) == 0  # an earlier export: replaced
    assert tree_bytes(out) == before
    monkeypatch.chdir(out)  # the folder it would replace holds the current one
    capsys.readouterr()
    assert main([*argv, ".", "--force"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        "error: refused to replace '.': it is or holds the current folder. Write "
        "the export to a folder of its own"
    )
    assert tree_bytes(out) == before
    monkeypatch.chdir(tmp_path)
    kept = out.parent / "kept"  # a folder named like an export file is no export
    (kept / "model.safetensors" / "run").mkdir(parents=True)
    assert main([*argv, str(kept), "--force"]) == 2
    assert "it holds model.safetensors, which no" in capsys.readouterr().err
    assert (kept / "model.safetensors" / "run").is_dir()


def test_inspect_verify_of_a_step_without_manifest_says_so_not_damaged(
    tmp_path, capsys
):
    folder = tmp_path / "step-1"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=folder, no_dist=True)  # plain DCP
    # Not verified is not success: a script trusting the exit status stops.
    assert main(["inspect", str(folder), "--verify"]) == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert line.startswith(
        f"error: not verified: {folder} has no manifest.json to verify against"
    )
    assert "damaged" not in out + err
    assert main(["inspect", str(folder)]) == 0  # without --verify: the listing


def test_an_export_names_the_weights_it_leaves_outside_the_model_section(
    tmp_path, capsys, caplog
):
    folder = tmp_path / "step-5"  # plain DCP, keyed as a Hugging Face model is
    state = {"model": {"norm.weight": torch.ones(2)}, "lm_head.weight": torch.ones(2)}
    state["rng"] = torch.zeros(4, dtype=torch.uint8)  # not a weight: not named
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    out = tmp_path / "m.pt"
    with caplog.at_level("WARNING", logger="pippy.checkpoint.offline"):
        argv = ["export", str(folder), "--out", str(out), "--allow-no-manifest"]
        assert main(argv) == 0
    assert list(torch.load(out)) == ["norm.weight"]
    assert caplog.messages == [
        f"{folder}: only its model section is read; 1 floating-point "
        "tensor(s) outside it and the optimizer's are left out: lm_head.weight"
    ]


def test_bad_arguments_are_argparse_errors(run, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(run[0])])  # no --out
    assert exit_.value.code == 2
    assert "required: --out" in capsys.readouterr().err
    export = ["export", str(run[0]), "--out", "m.safetensors"]
    for flags, expected in [
        (["--hf-config", "c.json", "--format", "pt"], "not allowed with argument"),
        (["--hf-config", "c.json", "--max-shard-size", "5XB"], "is not a size"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main([*export, *flags])
        assert exit_.value.code == 2
        assert expected in capsys.readouterr().err


@pytest.mark.launches
def test_export_from_the_command_line(run, cli_runs):
    _, returncode, stderr, _ = cli_runs["ok_export"]
    assert returncode == 0 and stderr == ""  # no warning from DCP either
    state = load_file(cli_runs["ok"])
    assert all(torch.equal(state[key], value) for key, value in run[1].items())


@pytest.mark.launches
def test_an_existing_out_file_is_left_unchanged(cli_runs):
    assert cli_runs["existing"].read_bytes() == b"keep me"
    assert list(cli_runs["existing"].parent.glob(".*.tmp")) == []


@pytest.mark.launches
def test_poisoned_checkpoints_run_no_code(cli_runs):
    for case in ("inspect", "export"):
        assert "--trust-checkpoint" in cli_runs[f"poisoned_{case}"][2]
        assert not cli_runs["markers"][case].exists()
    assert not cli_runs["poisoned_out"].exists()


def test_inspect_shows_a_damaged_step_and_says_it_cannot_be_loaded(
    run, tmp_path, capsys
):
    root = tmp_path / "ckpt"
    shutil.copytree(run[0], root)
    (data,) = (root / "step-3").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:1000])  # a copy cut short
    assert main(["inspect", str(root), "--step", "3"]) == 2
    out, err = capsys.readouterr()
    assert f"no (damaged: {data.name} has 1000 bytes" in out
    first = out.splitlines()[0]  # said first, not after ~350 lines
    assert first.startswith(f"damaged: {data.name} has 1000 bytes, its items need")
    assert err.startswith(f"error: {root / 'step-3'} is damaged: {data.name}")
    assert "__0_0.distcp" in out  # the files are still listed
