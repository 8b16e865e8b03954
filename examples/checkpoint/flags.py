"""The command line of pippy_dcp.py: standard library only, checked before torch loads.

Every rank parses the same flags; only rank 0 prints an error and exits 2 (the
others wait until torchrun stops them), and each message names the one flag
that is wrong.
"""

import argparse
import os
import signal
import sys
import time

LOOPED = ("interleaved-1f1b", "looped-bfs", "zero-bubble")
SCHEDULES = ("gpipe", "1f1b", *LOOPED)
N_HEADS = 4  # gpt.ModelArgs.n_heads: --dim must be a multiple of it


class _Parser(argparse.ArgumentParser):
    """argparse, printing its error on rank 0 only."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") != "0":  # rank 0 says it, once
            if "TORCHELASTIC_RUN_ID" in os.environ:
                # Under torchrun, wait to be stopped when rank 0 exits: a rank
                # exiting first gets rank 0 stopped, maybe before it printed.
                time.sleep(60)
            sys.exit(2)
        super().error(message)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, where it has one."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 365 * 24 * 3600:
        raise argparse.ArgumentTypeError(
            f"must be in (0, 31536000] (365 days), not {text}"
        )
    return value


def _signals(text: str) -> tuple:
    """SIGTERM,SIGUSR1 -> (signal.SIGTERM, signal.SIGUSR1); USR1 means SIGUSR1."""
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    names = [n if n.startswith("SIG") else f"SIG{n}" for n in names]
    for name in names:
        if name not in signal.Signals.__members__:
            raise argparse.ArgumentTypeError(
                f"{name} is no signal (e.g. SIGTERM,SIGUSR1)"
            )
        if name in ("SIGKILL", "SIGSTOP"):
            raise argparse.ArgumentTypeError(f"{name} cannot be caught")
    return tuple(signal.Signals[n] for n in names)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(
        description="Pipeline-parallel training, checkpointed through DCP.",
        formatter_class=_Help,
    )
    add = p.add_argument
    add("--checkpoint-dir", default="checkpoints", help="one step-<N> folder per save")
    add("--steps", type=_positive, default=20, help="steps in all, resumed included")
    add("--save-every", type=_positive, default=10, help="save every N and the last")
    add("--stop-after", type=_positive, help="stop after this step, as if interrupted")
    add("--split", choices=["manual", "trace"], default="manual", help="stage build")
    add(
        "--schedule",
        choices=SCHEDULES,
        help="default: gpipe; with --stages-per-rank > 1, interleaved-1f1b",
    )
    add("--stages-per-rank", type=_positive, default=1, help="> 1: a looped schedule")
    add("--dp", type=_positive, default=1, help="data-parallel degree; pp = ranks/dp")
    add("--fsdp", action="store_true", help="with --dp: FSDP2 shards, not DDP")
    add("--microbatches", type=_positive, default=4, help="per replica")
    add("--batch-size", type=_positive, default=8, help="sequences per step, all dp")
    add("--seq-len", type=_positive, default=128, help="bytes per sequence")
    add("--n-layers", type=_positive, default=8, help="decoder blocks; >= stages")
    add("--dim", type=_positive, default=128, help="model width, a multiple of 4")
    add("--lr", type=float, default=1e-3, help="peak learning rate")
    add("--seed", type=int, default=0, help="seed of the weights and data order")
    add("--keep-last", type=_positive, help="keep only the newest K complete steps")
    add("--async-save", action="store_true", help="save in the background")
    start = "a step folder, or a Hugging Face one, whose weights start a new run"
    add("--init-from", help=start)
    add("--data", help="a text file to train on (default: the stdlib's .py files)")
    stop = "SIGTERM,SIGUSR1"
    add("--stop-signals", type=_signals, default=stop, help="on these: save, stop")
    add("--skip-damaged", action="store_true", help="resume past damaged steps")
    wait = "seconds a save or load waits for a late rank, then fails naming it"
    add("--checkpoint-timeout", type=_seconds, help=wait)
    args = p.parse_args(argv)
    looped = args.stages_per_rank > 1
    args.schedule = args.schedule or ("interleaved-1f1b" if looped else "gpipe")
    for flag, problem in _problems(args, int(os.environ.get("WORLD_SIZE", args.dp))):
        p.error(f"argument {flag}: {problem}")
    return args


def check_saved_shape(args, metadata, path) -> None:
    """Raises ValueError if the step at `path`, whose DCP .metadata is given, was
    saved with another --n-layers or --dim, naming the flag (and --init-from
    where it is that step); quiet where the step cannot tell (weights only)."""
    items = metadata.state_dict_metadata
    layers = {k.split(".")[2] for k in items if k.startswith("model.layers.")}
    embedding = items.get("model.tok_embeddings.weight")
    saved = {"--n-layers": len(layers), "--dim": embedding and embedding.size[1]}
    given = "--init-from" if str(path) == str(args.init_from) else "--checkpoint-dir"
    for flag, value in saved.items():
        ours = getattr(args, flag[2:].replace("-", "_"))
        if value and value != ours:
            raise ValueError(
                f"{path} was saved with {flag} {value}, this run has {ours}: "
                f"pass {flag} {value}, or another {given}"
            )


def _problems(args, world_size: int):
    """(flag, what is wrong with it) for each flag that cannot work with the others,
    the schedule and split first: what the microbatches must be depends on them."""
    stages = world_size // args.dp * args.stages_per_rank
    if args.stages_per_rank > 1 and args.schedule not in LOOPED:
        yield "--schedule", f"--stages-per-rank > 1 needs {'|'.join(LOOPED)}"
    if args.split == "trace" and (args.dp > 1 or args.stages_per_rank > 1):
        yield "--split", "trace builds one stage per rank, without --dp"
    if world_size % args.dp:
        yield "--dp", f"must divide the {world_size} ranks, not {args.dp}"
    elif args.n_layers < stages:
        yield "--n-layers", f"{args.n_layers} layers cannot fill {stages} stages"
    if args.fsdp and args.dp == 1:
        yield "--fsdp", "needs --dp 2 or more"
    if args.batch_size % (args.dp * args.microbatches):
        need = f"--dp x --microbatches ({args.dp} x {args.microbatches})"
        yield "--microbatches", f"{need} must divide --batch-size {args.batch_size}"
    if args.schedule == "1f1b" and args.microbatches < stages:
        yield "--microbatches", f"1f1b needs at least one per stage ({stages})"
    if args.dim % N_HEADS:
        yield "--dim", f"must be a multiple of {N_HEADS} (the heads), not {args.dim}"
