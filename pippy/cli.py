"""Command line for pippy checkpoints: ``python -m pippy inspect|export|convert``.

Parses and prints only: the work is :mod:`pippy.checkpoint.offline`'s public
tools, which read through its safe reader and planner, so a checkpoint's pickles
run no code unless ``--trust-checkpoint`` is given (or
``PIPPY_TRUST_CHECKPOINT=1`` is set).
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import pickle
import re
import sys
import warnings
from collections import Counter, defaultdict
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pippy import checkpoint
from pippy.checkpoint import offline

__all__ = ["main", "parser"]

_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30})
_DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16")}
# What bad paths and checkpoints raise; main reports them in one line.
_ERRORS = (
    checkpoint.CheckpointError,
    OSError,
    KeyError,
    ValueError,
    EOFError,
    pickle.UnpicklingError,
)


def _size(text: str) -> int:
    """Bytes of a size such as ``5GB``, ``500MiB`` or ``1000`` (an argparse type)."""
    match = _SIZE.fullmatch(text.upper())
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size such as 5GB, 500MB or 1000"
        )
    return int(float(match[1]) * _UNITS[match[2] or "B"])


def _human(n: float) -> str:
    """A byte count as B, kB, MB or GB (powers of 1,000, as the example prints)."""
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _table(header: list[str], rows: list[list], right: set[int]) -> None:
    """Prints rows as aligned columns; columns in ``right`` align right."""
    cells = [header, *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        line = (
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        print("  ".join(line).rstrip())


def _completeness(report: offline.StepReport) -> str:
    """The COMPLETE column of a step: yes, or why not."""
    if not report.complete:
        return "no (no .metadata)"
    if report.error is not None:
        return f"no ({type(report.error).__name__})"
    if report.damage:
        more = " ..." if len(report.damage) > 1 else ""
        return f"no (damaged: {report.damage[0]}{more})"
    return "yes"


def _inspect(args: argparse.Namespace) -> None:
    """``inspect``: the run's steps, then one step's files (and keys, with --keys)."""
    report = offline.inspect_step(  # by default the newest step a resume takes
        args.path, step=args.step, verify=args.verify, trusted=args.trusted
    )
    if report.error is not None:
        raise report.error
    folder, metadata, damage = report.folder, report.metadata, report.damage
    assert metadata is not None  # read, as there is no error
    if report.verified is not None:
        print(f"verified: {folder}: {report.verified} items match its manifest.json")
    for problem in damage:
        print(f"damaged: {problem}; this step cannot be loaded")
    items = metadata.state_dict_metadata
    patterns = args.keys or ["*"]  # --keys alone: every key
    keys = [k for k in items if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    if not keys:
        raise ValueError(f"no key of {str(folder)!r} matches --keys {patterns}")
    steps = offline.inspect_steps(args.path, trusted=args.trusted)
    if steps:
        print(f"{args.path}: {len(steps)} step(s)")
        step_rows = [[s, _completeness(r), _human(r.size)] for s, r in steps.items()]
        _table(["STEP", "COMPLETE", "ON DISK"], step_rows, right={0, 2})
        print()
    _print_step(report, keys, listed=args.keys is not None)
    if damage:
        raise checkpoint.CheckpointError(f"{folder} is damaged: {damage[0]}")
    if args.verify and report.verified is None:  # an exit status 0 is not verified
        raise checkpoint.CheckpointError(
            f"not verified: {folder} has no manifest.json to verify against "
            "(written by plain DCP or torchtitan, or the file was lost)"
        )


def _print_step(report: offline.StepReport, keys: list[str], listed: bool) -> None:
    """The step's files holding ``keys``, totalled; with ``listed``, the keys first.

    A key's share of a file is its chunk's tensor bytes there, or an object's
    pickled size.
    """
    folder, metadata, shown = report.folder, report.metadata, set(keys)
    assert metadata is not None
    items = metadata.state_dict_metadata
    file_keys: dict[str, set[str]] = defaultdict(set)
    key_files: dict[str, set[str]] = defaultdict(set)
    file_bytes: Counter[str] = Counter()
    key_bytes: Counter[str] = Counter()
    for index, info in metadata.storage_data.items():
        key, name = index.fqn, info.relative_path
        if key not in shown:
            continue
        item, size = items[key], info.length
        if isinstance(item, TensorStorageMetadata):
            chunk = next(c for c in item.chunks if c.offsets == index.offset)
            size = math.prod(chunk.sizes) * item.properties.dtype.itemsize
        file_keys[name].add(key)
        key_files[key].add(name)
        file_bytes[name] += size
        key_bytes[key] += size
    layout = report.layout
    if not listed:  # the files alone
        print(f"{folder}: {len(items)} keys ({layout} layout); --keys lists them")
    else:
        print(f"{folder}: {len(keys)} of {len(items)} keys ({layout} layout)")
        rows: list[list] = []
        for key in keys:
            item, where = items[key], ",".join(sorted(key_files[key]))
            if isinstance(item, TensorStorageMetadata):
                dtype = item.properties.dtype
                size = math.prod(item.size) * dtype.itemsize
                rows.append([key, str(list(item.size)), str(dtype)[6:], size, where])
            else:
                rows.append([key, "-", "object", key_bytes[key], where])
        _table(["KEY", "SHAPE", "DTYPE", "BYTES", "FILE"], rows, right={3})
        print()
    rows = []
    for name in sorted(file_keys):
        match, size = _RANK_FILE.fullmatch(name), report.files.get(name)
        shown_size = "missing" if size is None else _human(size)
        rank = match[1] if match else "?"
        rows.append([name, rank, len(file_keys[name]), file_bytes[name], shown_size])
    on_disk = _human(sum(report.files.get(name) or 0 for name in file_keys))
    rows.append(["total", "", len(keys), file_bytes.total(), on_disk])
    _table(["FILE", "RANK", "KEYS", "BYTES", "ON DISK"], rows, right={1, 2, 3, 4})
    others = sorted(report.files.keys() - file_keys.keys())
    if others:
        also = ", ".join(others)
        print(f"{folder}: {_human(report.size)} on disk in all (also {also})")


def _export(args: argparse.Namespace) -> None:
    """``export``: a step's model weights into one file (or HF folder), atomically."""
    folder = offline.inspect_step(args.path, trusted=args.trusted).folder
    options = dict(
        dtype=_DTYPES.get(args.dtype),
        force=args.force,
        trusted=args.trusted,
        verify=args.verify,
    )
    if args.hf_config:  # a folder from_pretrained opens
        limit = args.max_shard_size
        files = offline.export_hf(
            folder, args.out, config=args.hf_config, max_shard_size=limit, **options
        )
        names = ", ".join(f.name for f in files)
        print(f"{folder} -> {args.out}: {names} (Hugging Face)")
        return
    out = args.out
    fmt = args.format or ("safetensors" if out.endswith(".safetensors") else "pt")
    weights = offline.export_weights(folder, out, format=fmt, **options)
    size = _human(sum(t.numel() * t.element_size() for t in weights.values()))
    print(f"{folder} -> {out}: {len(weights)} tensors, {size} ({fmt})")


def _convert(args: argparse.Namespace) -> None:
    """``convert``: a step rewritten in the other layout."""
    folder = offline.inspect_step(args.path, trusted=args.trusted).folder
    count = offline.convert_layout(
        folder, args.out, to=args.to, trusted=args.trusted, verify=args.verify
    )
    print(f"{folder} -> {args.out}: {count} items ({args.to} layout)")


def parser() -> argparse.ArgumentParser:
    """A new argument parser of ``python -m pippy``."""
    parser = argparse.ArgumentParser(
        prog="python -m pippy",
        description="Inspect, export and convert pippy (DCP) checkpoints.",
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--trust-checkpoint",
        dest="trusted",  # None: PIPPY_TRUST_CHECKPOINT decides
        action="store_const",
        const=True,
        help="load any pickle the checkpoint holds, as plain DCP does; it can "
        "run code, so only for checkpoints from a trusted source",
    )
    inspect = commands.add_parser(
        "inspect",
        parents=[common],
        help="list a run's steps and a step's files (and keys)",
        description="List a run's steps, then one step's files: each with its "
        "rank, its keys and their bytes (a shard's share), totalled. With "
        "--keys, first each key (or each matching key): shape, dtype, bytes "
        "(tensor data; for objects, their pickled size) and the rank's file that "
        "holds it; the file totals then count the keys shown.",
    )
    inspect.add_argument(
        "path",
        metavar="PATH",
        help="a run's checkpoint folder (holding step-<N>) or one step folder",
    )
    inspect.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="step to detail (default: the newest complete one)",
    )
    inspect.add_argument(
        "--keys",
        nargs="*",
        action="extend",
        metavar="PATTERN",
        help="list each key; with patterns, only the keys matching them "
        "(fnmatch), e.g. 'model.layers.0.*'",
    )
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="read every item and check it against the step's manifest.json "
        "(exit status 2 where it cannot)",
    )
    inspect.set_defaults(run=_inspect)
    unverified = argparse.ArgumentParser(add_help=False)  # export, convert
    unverified.add_argument(
        "path",
        metavar="STEP_FOLDER",
        help="a step folder (or a run folder: its newest complete step)",
    )
    unverified.add_argument(
        "--allow-no-manifest",
        dest="verify",  # as inspect's --verify: check items against the manifest
        action="store_false",
        help="read a step that has no manifest.json (plain DCP's, torchtitan's), "
        "its items unchecked against checksums",
    )
    export = commands.add_parser(
        "export",
        parents=[common, unverified],
        help="write a step's model weights to one file",
        description="Write a step's model weights (keys under 'model.', prefix "
        "removed: the un-split model's state_dict, no optimizer state) to one file.",
    )
    export.add_argument(
        "--out", required=True, metavar="FILE", help="file (or folder) to write"
    )
    hf_or_file = export.add_mutually_exclusive_group()
    hf_or_file.add_argument(
        "--hf-config",
        metavar="CONFIG_JSON",
        help="write a Hugging Face model folder at --out instead: this "
        "config.json and model.safetensors (sharded with an index above "
        "--max-shard-size), for from_pretrained",
    )
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        type=_size,
        metavar="SIZE",
        help="with --hf-config: largest safetensors shard, e.g. 5GB, 500MB "
        "(default: 5GB)",
    )
    hf_or_file.add_argument(
        "--format",
        choices=["pt", "safetensors"],
        help="pt (torch.save) or safetensors; default: from FILE's extension "
        "(.safetensors, else pt)",
    )
    export.add_argument(
        "--dtype",
        choices=list(_DTYPES),
        help="convert floating-point tensors to this dtype",
    )
    export.add_argument(
        "--force",
        action="store_true",
        help="overwrite FILE, or an earlier --hf-config export, if it exists",
    )
    export.set_defaults(run=_export)
    convert = commands.add_parser(
        "convert",
        parents=[common, unverified],
        help="rewrite a step in pippy's or torchtitan's layout",
        description="Rewrite a step (every key: model, optimizer, scheduler, "
        "step, extra state) in the other layout: torchtitan keeps model keys at "
        "the root, 'optimizer.*', 'train_state.*' and 'dataloader.*' (extra "
        "state such as a data sampler's); pippy 'model.*', 'optim.*', 'step' "
        "and each extra state under its name.",
    )
    convert.add_argument(
        "--to", required=True, choices=["pippy", "torchtitan"], help="layout to write"
    )
    convert.add_argument(
        "--out",
        required=True,
        metavar="STEP_FOLDER",
        help="step folder to write, e.g. checkpoint/step-20; must not exist",
    )
    convert.set_defaults(run=_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line.

    Args:
        argv: The arguments, without the program name; ``sys.argv[1:]`` if None.

    Returns:
        The exit status: 0 on success; 2 on a bad path or checkpoint, reported
        on stderr as one ``error: <message>`` line (argparse exits 2 itself on
        bad arguments).
    """
    args = parser().parse_args(argv)
    try:
        with warnings.catch_warnings():  # one process, reading alone, by design
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            args.run(args)
    except BrokenPipeError:  # `python -m pippy inspect ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except _ERRORS as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        text = " ".join(str(message).split())
        if args.run is not _inspect:  # export, convert: name their flag
            text = text.replace("load it with verify=False", "pass --allow-no-manifest")
        print(f"error: {text}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
