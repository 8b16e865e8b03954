"""One writer per checkpoint folder: ``FolderOwner``, its record on a folder or bucket.

Two jobs that write one folder (a restart while the old job's workers still
run, as a launcher killed with ``-9`` leaves them) delete and overwrite each
other's saves. :class:`FolderOwner` lets one job at a time write a folder.

On an object store with conditional writes (S3; other stores are refused:
there a renewal could overwrite a new owner's record, so no lease holds; no
hard link, no rename, no ``/proc`` of the writer's host), :class:`StoreLease`
creates the record with a conditional write (S3's
``If-None-Match: *``: of two jobs, exactly one succeeds) and renews it every
third of its lease in a daemon thread, by a conditional PUT (``If-Match`` on
its ETag, so that a stalled job's renewal cannot overwrite a new owner's). An
expired record is taken over only by the job that first creates the claim
``.owner.takeover-<token>``. Expiry compares the record's ``expires`` (epoch
seconds) with this host's clock: NTP keeps a cluster's clocks well within a
lease. A job that stalled past its lease may have lost the folder, so before
each write that could touch another job's objects (a step's first file, its
commit record, retention) a save given the owner calls :meth:`FolderOwner.check`
(one GET).
Left open: a data PUT under way when the job stalled lands when it wakes, in
that job's uncommitted step (a step of the same number the new owner saved
meanwhile fails its manifest's checksums at load). A local folder's record,
held without a lease, is checked the same way (one read of ``.owner.json``):
a job whose record was taken over (taken for gone, or from before a Slurm
requeue while a node cut off from the controller still ran) stops at its
next save instead of writing on beside the new owner.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import torch.distributed as dist

from pippy.checkpoint.collectives import MAX_TIMEOUT_S, on_coordinator
from pippy.checkpoint.errors import (
    CheckpointDirError,
    CheckpointDirInUseError,
    check_number,
)
from pippy.checkpoint.steps import (
    list_steps,
    refuse_step_folder,
    remove_staging,
    step_holding,
    wait_for_deletions,
)
from pippy.checkpoint.storage import (
    FsspecStorage,
    Location,
    Storage,
    is_url,
    same_location,
    storage_for,
)

logger = logging.getLogger(__name__)

#: The owner record in a run's checkpoint folder.
OWNER_FILE = ".owner.json"

#: How long a record holds the folder unless renewed, in seconds.
LEASE_SECONDS = 60.0

#: Environment variable that sets the lease, in seconds, where none is given.
LEASE_ENV = "PIPPY_LEASE_SECONDS"


def _proc(name: str) -> str | None:
    """A file of this host's ``/proc`` (not a checkpoint's), or None."""
    try:
        with open(f"/proc/{name}") as f:
            return f.read()
    except OSError:
        return None


def _boot_id() -> str:
    """This machine's boot id: a pid means the same process only within one boot."""
    return (_proc("sys/kernel/random/boot_id") or "").strip()


def _pid_namespace() -> str:
    """This process's PID namespace (containers on one host each have theirs)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (ticks after boot, field 22 of proc(5)), or None."""
    stat = _proc(f"{pid}/stat")
    return None if stat is None else stat.rsplit(")", 1)[1].split()[19]


def _slurm_job() -> list[Any] | None:
    """``[cluster, job id, restarts]`` of this Slurm job; None outside Slurm."""
    job, cluster = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_CLUSTER_NAME")
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return [cluster, job, int(restarts) if restarts.isdigit() else 0] if job else None


def _describe(record: dict[str, Any]) -> str:
    """The owner, for a message: host, pid and when it started."""
    return (
        f"host {record.get('host')!r}, pid {record.get('pid')}, "
        f"started {record.get('since')}"
    )


def _when(seconds: float) -> str:
    """A time as ``2026-12-01T20:30:00+0000``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(seconds))


def _resolve_lease_seconds(seconds: float | None) -> float:
    """The lease in seconds: the argument, else PIPPY_LEASE_SECONDS, else 60."""
    text = os.environ.get(LEASE_ENV) if seconds is None else str(seconds)
    if text is None:
        return LEASE_SECONDS
    where = f"{LEASE_ENV}={{!r}}" if seconds is None else "lease_seconds={}"
    message = (
        f"{where} is not a lease: give a number of seconds above 0 and at most "
        "365 days, or leave it unset for the default of 60"
    )
    return check_number(  # a longer one overflows a timestamp
        text, message, above=0, at_most=MAX_TIMEOUT_S, text=True
    )


class _OwnerRecord:
    """A folder's owner record on rank 0; subclasses say when another's is taken."""

    #: What the record is, for a message.
    kind = "file"

    def __init__(self, root: Location, storage: Any) -> None:
        self.root, self.storage = root, storage
        self.record = storage.join(root, OWNER_FILE)
        self.token = ""
        self.since = ""  # when this job acquired the record
        self.created = False  # the folder did not exist: release removes it empty
        self.lost = ""  # once another job took the folder over: the message

    def _mine(self) -> dict[str, Any]:
        """This job's record, with what tells whether its process still runs."""
        pid = os.getpid()
        here = {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid}
        here["pidns"] = _pid_namespace()  # a pid names a process only within it
        return {
            **here,
            "slurm": _slurm_job(),
            "start": _start_time(pid),
            "since": self.since,
            "token": self.token,
        }

    def _gone(self, record: dict[str, Any]) -> bool:
        """Whether ``record``'s process ended: ran here, or before a Slurm requeue."""
        pid, job, theirs = record.get("pid"), _slurm_job(), record.get("slurm")
        # Slurm ends every process of a job, on every node, before it requeues it.
        if job and isinstance(theirs, list) and len(theirs) == 3:
            if (
                theirs[:2] == job[:2]
                and isinstance(theirs[2], int)
                and theirs[2] < job[2]
            ):
                return True
        return (
            record.get("host") == socket.gethostname()
            and record.get("boot") == _boot_id()
            and record.get("pidns", _pid_namespace()) == _pid_namespace()
            and (not isinstance(pid, int) or _start_time(pid) != record.get("start"))
        )

    def _this_process(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` is this process's (an owner not yet released)."""
        mine = self._mine()
        return all(record.get(k) == mine[k] for k in ("host", "boot", "pid", "start"))

    def _encoded(self) -> bytes:
        """This job's record as written."""
        return json.dumps(self._mine()).encode()

    def _valid(self, record: Any) -> bool:
        """Whether ``record`` (parsed JSON) is an owner record pippy wrote."""
        return isinstance(record, dict)

    def _read(self, path: str = "", *, strict: bool = True) -> dict[str, Any] | None:
        """A record (the owner's by default), or None if none; not pippy's: refused."""
        try:
            record = json.loads(self.storage.read_bytes(path or self.record))
        except (FileNotFoundError, NotADirectoryError):  # no record, or no folder
            return None
        except ValueError:
            record = None
        if not strict:  # not pippy's reads as none
            return record if isinstance(record, dict) else None
        if not self._valid(record):  # created whole, exclusively: not ours
            raise CheckpointDirInUseError(
                f"{self.record} is not an owner record pippy wrote, so whether a "
                f"job uses the folder is unknown. If none does, delete that {self.kind}"
            )
        return record

    def acquire(self) -> str:
        """Creates the record, or takes another job's over where it may; the token."""
        refuse_step_folder(self.storage, self.root)  # a step holds no steps
        list_steps(self.storage, self.root)  # a file where the folder should be: say so
        self.token = uuid.uuid4().hex[:12]
        self.since = _when(time.time())
        self.storage.makedirs(self.root)
        for _ in range(3):  # another job may take a stale record first
            if self.storage.create_exclusive(self.record, self._encoded()):
                return self.token
            if (record := self._read()) is not None:
                self._take_over(record)
        raise CheckpointDirError(f"could not take {self.root}: it keeps changing")

    def _take_over(self, record: dict[str, Any]) -> None:
        """Removes another job's ``record`` where it may be taken over; else refuses."""
        raise NotImplementedError

    def check(self, *, always: bool = False) -> None:
        """One read: CheckpointDirInUseError if another job took the record over."""
        if not self.lost:
            record = self._read(strict=False)
            if record is None or record.get("token") != self.token:
                self._lose(record)
        if self.lost:
            raise CheckpointDirInUseError(self.lost)

    def _lose(self, record: dict[str, Any] | None, when: str = "") -> None:
        """Notes that another job took the folder over; raises saying so."""
        if record is not None:
            other = f"another job took it over ({_describe(record)})"
        else:
            other = "its owner record is gone (another job took it over)"
        self.lost = (
            f"this job lost {self.root}: {other}{when}, so this job writes "
            "nothing more there. Stop this job; the other job's steps are "
            "untouched: resume from them once it has ended"
        )
        raise CheckpointDirInUseError(self.lost)

    def release(self) -> bool:
        """Removes the record if still this job's (and an empty folder acquire made)."""
        record = self._read()
        if record is None or record.get("token") != self.token:
            return False
        self.storage.remove(self.record)
        if self.created and not self.storage.listdir(self.root):
            self.storage.remove(self.root)  # a job that saved nothing
        return True


class _LocalRecord(_OwnerRecord):
    """The owner record of a local folder; a dead owner's is taken over."""

    def acquire(self) -> str:
        """Creates the folder if needed and the record; the saving code checks it."""
        self.created = not self.storage.exists(self.root)
        return super().acquire()

    def _take_over(self, record: dict[str, Any]) -> None:
        """Moves a dead owner's record aside (and its leftovers); refuses a live one."""
        gone = self._gone(record)
        if self._this_process(record):
            raise CheckpointDirInUseError(
                f"{self.root} is already owned by this process ({_describe(record)}),"
                " by a FolderOwner not yet released: use that one, or release it "
                "before taking the folder again"
            )
        if not gone:
            raise CheckpointDirInUseError(
                f"{self.root} is in use by another job ({_describe(record)}): one "
                "writer per checkpoint folder. Wait for that job to end or stop "
                "it, or use another folder. If it is gone (it ran on another "
                f"host, and not in this Slurm job before a requeue), delete "
                f"{self.record}"
            )
        stale = self.storage.join(self.root, f".owner-gone-{uuid.uuid4().hex}")
        try:
            self.storage.publish(self.record, stale)
        except FileNotFoundError:
            return  # another job moved it first
        self.storage.remove(stale)
        logger.warning(
            "taking over %s from a job that is gone (%s)", self.root, _describe(record)
        )
        # This job now owns the folder alone: leftovers are the dead one's.
        for name in remove_staging(self.storage, self.root):
            logger.warning("removed %s, left by that job", name)


class StoreLease(_OwnerRecord):
    """The owner record of a folder on an object store, held with a lease."""

    kind = "object"
    root: str  # the folder's URL, without a trailing slash

    def __init__(
        self, root: Location, storage: FsspecStorage, lease_seconds: float | None
    ) -> None:
        super().__init__(os.fspath(root).rstrip("/"), storage)
        self.lease_seconds = _resolve_lease_seconds(lease_seconds)
        self._version: str | None = None  # of this job's record, as last written
        self.expires = 0.0  # of this job's record, as last written
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(  # started by acquire
            target=self._renew, name="pippy-lease", daemon=True
        )

    def _mine(self) -> dict[str, Any]:
        """This job's record, its lease starting now."""
        self.expires = time.time() + self.lease_seconds
        lease = {"expires": self.expires, "lease_seconds": self.lease_seconds}
        return {**super()._mine(), **lease}

    def _valid(self, record: Any) -> bool:
        """A record pippy wrote, with its expiry."""
        expires = record.get("expires") if isinstance(record, dict) else None
        return isinstance(expires, int | float)

    def acquire(self) -> str:
        """Creates the record or takes an expired one over; renews it; the token."""
        token = super().acquire()
        self._version = self.storage.version(self.record)  # just made
        self._thread.start()
        return token

    def _take_over(self, record: dict[str, Any]) -> None:
        """Deletes an expired or dead owner's record if this job claims it first."""
        gone = self._gone(record)  # a job restarted here: its lease need not run out
        if record["expires"] > time.time() and not gone:
            raise CheckpointDirInUseError(
                f"{self.root} is in use by another job ({_describe(record)}; its "
                f"lease runs until {_when(record['expires'])}): one writer per "
                "checkpoint folder. Wait for that job to end or stop it, or use "
                "another folder; the lease of a job that died expires within "
                f"{record.get('lease_seconds')} s"
            )
        claim = f"{self.record}.takeover-{record.get('token')}"
        if not self.storage.create_exclusive(claim, self._encoded()):
            version = self.storage.version(claim)  # a claimer that died meanwhile?
            other = self._read(claim, strict=False)
            dead = other is not None and (
                other.get("expires", 0) <= time.time() or self._gone(other)
            )
            if not dead or not self.storage.replace_if_unchanged(
                claim, self._encoded(), version
            ):
                raise CheckpointDirInUseError(
                    f"{self.root}: another job is taking over the expired lease of "
                    f"({_describe(record)}); use another folder, or retry once it "
                    f"is done (its claim, {claim}, expires with its own lease)"
                )
        self.storage.remove(self.record)
        why = (
            "process ran on this host and is gone"
            if gone
            else f"lease expired at {_when(record['expires'])}"
        )
        logger.warning(
            "taking over %s from a job whose %s (%s)", self.root, why, _describe(record)
        )

    def _renew(self) -> None:
        """The renewing thread: rewrites the record while it is still this job's."""
        while not self._stop.wait(self.lease_seconds / 3):
            try:
                self.check(always=True)
            except CheckpointDirInUseError:
                return
            except OSError as e:  # the store did not answer: try again soon
                logger.warning("could not renew the lease of %s: %s", self.root, e)

    def check(self, *, always: bool = False) -> None:
        """One GET: CheckpointDirInUseError if lost; renews if due (or ``always``)."""
        with self._lock:  # the renewing thread and a save's check
            if self.lost:
                raise CheckpointDirInUseError(self.lost)
            record = self._read(strict=False)
            if time.time() >= self.expires:  # late: a job may be taking it over
                claim = self._read(f"{self.record}.takeover-{self.token}", strict=False)
                record = claim or record
            if record is None or record.get("token") != self.token:
                self._lose(record)
            due = self.expires - time.time() < self.lease_seconds * 2 / 3
            if always or due:  # only over this job's own last write
                version = self.storage.replace_if_unchanged(
                    self.record, self._encoded(), self._version
                )
                if version is None:
                    self._lose(self._read(strict=False))
                self._version = version or None

    def _lose(self, record: dict[str, Any] | None, when: str = "") -> None:
        """Notes that another job took the folder over, and when; raises saying so."""
        if time.time() >= self.expires:
            when = (
                f" after this job's lease expired at {_when(self.expires)} (not "
                f"renewed for {self.lease_seconds:g} s: this job stalled)"
            )
        else:
            when = f", though this job's lease ran until {_when(self.expires)}"
        super()._lose(record, when)

    def release(self) -> bool:
        """Stops renewing; deletes the record if still this job's (not once lost)."""
        self._stop.set()
        self._thread.join(timeout=self.lease_seconds)
        if self.lost or not super().release():
            return False
        claims = f"{self.storage.name(self.record)}.takeover-"
        for name in self.storage.listdir(self.root):  # this job's, of an old lease
            if name.startswith(claims) and not name.endswith(self.token):
                self.storage.remove(self.storage.join(self.root, name))
        return True


def check_owner(
    owner: FolderOwner | None, checkpoint_dir: Location
) -> FolderOwner | None:
    """``owner``, if it is None or holds ``checkpoint_dir``; else a ``ValueError``.

    An owner never acquired holds no folder: refused too.

    Compared as spelled (absolute, normalised) first, without I/O (every rank
    makes a save's writer, and only rank 0 looks at the folder); links are
    resolved only where the spellings differ.
    """

    def spelled(location: Location) -> str:
        text = os.fspath(location)
        return text.rstrip("/") if is_url(text) else os.path.abspath(text)

    if owner is not None and not owner.token and not owner.released:
        raise ValueError(
            f"the FolderOwner of {owner.root} was never acquired, so it holds "
            "nothing: enter it (with FolderOwner(folder) as owner) before saving"
        )
    if owner is None or spelled(owner.root) == spelled(checkpoint_dir):
        return owner
    if not same_location(owner.root, checkpoint_dir):
        raise ValueError(
            f"the owner given holds {owner.root}, not {checkpoint_dir}: give the "
            "save the FolderOwner of the folder it saves into"
        )
    return owner


def refuse_unowned(storage: Storage, checkpoint_dir: Location) -> None:
    """Refuses a write not given an owner into a folder that holds an owner record.

    Raises:
        CheckpointDirInUseError: ``checkpoint_dir`` holds ``.owner.json``.
    """
    record = _OwnerRecord(checkpoint_dir, storage)._read(strict=False)
    if record is not None:
        raise CheckpointDirInUseError(
            f"{checkpoint_dir} is owned by a job's FolderOwner ({_describe(record)}), "
            "so only that job's saves, given it as owner=, write there: pass "
            "owner= that FolderOwner if it is this job's, else write to another "
            "folder, or take this one with FolderOwner (which takes a dead "
            "owner's record over)"
        )


class FolderOwner:
    """Makes one job at a time the writer of a run's checkpoint folder.

    On entry (every rank of ``process_group`` at once), rank 0 alone checks
    the folder, creates it if needed and the owner record ``.owner.json``;
    every rank gets the record's token or the same error. On exit the record
    is removed if it is still this job's. Each save is given the owner, and
    checks, before it writes and before it publishes, that the record is
    still this job's::

        with FolderOwner(checkpoint_dir) as owner:
            ...  # resume, train
            save_stage(state, checkpoint_dir, owner=owner)

    A save not given an owner is refused in a folder that holds an owner
    record (:func:`refuse_unowned`). Without ``with``: :meth:`acquire`, then
    :meth:`release` in a ``finally``.
    A dead owner's record (same host and boot, no process with its pid and
    start time) is taken over with a warning, and its staging folders and the
    steps its retention hid but did not delete are removed. So is the record
    of the same Slurm job before a requeue (``SLURM_CLUSTER_NAME`` and
    ``SLURM_JOB_ID`` equal, ``SLURM_RESTART_COUNT`` higher: sbatch(1)), from
    any node, as Slurm ends a job's processes before it requeues it
    (scontrol(1), ``requeue``); a node cut off from the controller may still
    run them, so a job whose record was taken over stops at its next save.
    Any other record from another host never is (its job may still run). On an
    object store (an fsspec URL) rank 0 holds the record with a lease
    (:class:`StoreLease`).

    Args:
        checkpoint_dir: The run's checkpoint folder.
        process_group: The job's ranks; the default group if None.
        lease_seconds: On an object store, how long the record holds the
            folder unless renewed; None reads ``PIPPY_LEASE_SECONDS``
            (default 60 s). A job stalled for longer can lose the folder;
            its next save is then refused (``CheckpointDirInUseError``).

    Raises:
        CheckpointDirInUseError: On entry, on every rank: another job owns
            the folder (the message names it).
        ValueError: On an object store, ``lease_seconds`` or
            ``PIPPY_LEASE_SECONDS`` is not a positive number.
        CheckpointDirError: On entry, on every rank: the folder is a step
            folder, a file, or cannot be written, or is on a store without
            conditional writes (anything but S3 among URLs: ``gs://``,
            ``memory://``, ``file://``), where no lease holds.
    """

    def __init__(
        self,
        checkpoint_dir: Location,
        *,
        process_group: dist.ProcessGroup | None = None,
        lease_seconds: float | None = None,
    ) -> None:
        self.root = checkpoint_dir
        self.process_group = process_group
        self.lease_seconds = lease_seconds
        self.token = ""
        self.released = False
        self._record: _OwnerRecord | None = None  # rank 0 holds it

    def __enter__(self) -> FolderOwner:
        """Takes ownership: :meth:`acquire`."""
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        """Gives the folder up: :meth:`release`."""
        self.release()

    def acquire(self) -> None:
        """Takes ownership, on every rank at once.

        Raises:
            CheckpointDirInUseError, CheckpointDirError, ValueError: As the
                class says.
        """
        storage = storage_for(self.root)
        if isinstance(storage, FsspecStorage):  # an object store
            if not storage.conditional:  # a renewal could overwrite a new owner's
                raise CheckpointDirError(
                    f"{self.root}: {storage.protocol}:// offers pippy no "
                    "conditional write, so a lease there could not keep a second "
                    "job out; hold the folder on a file system (a path) or on S3 "
                    "(s3://), or run without FolderOwner and see to one job per "
                    "folder yourself"
                )
            record: _OwnerRecord = StoreLease(self.root, storage, self.lease_seconds)
        else:
            record = _LocalRecord(self.root, storage)
        self.token = on_coordinator(  # a refusal leaves a held record as it was
            f"cannot write to {self.root}", record.acquire, self.process_group
        )
        self._record, self.released = record, False

    def release(self) -> None:
        """Removes the record if it is still this job's (on rank 0, no collective).

        Old steps this process's saves removed (``keep_last``) are deleted
        first. A folder that :meth:`acquire` created and that is still empty
        goes too.
        """
        rank0 = not dist.is_initialized() or dist.get_rank(self.process_group) == 0
        if self.token and self._record is not None and rank0:
            wait_for_deletions()
            self._record.release()
        self.released = True

    def check(self) -> None:
        """Raises unless this job still owns the folder (rank 0 reads the record).

        A save calls it on its coordinator; elsewhere it does nothing.

        Raises:
            CheckpointDirInUseError: Another job took the folder over, or
                this owner was released.
        """
        if self.released:
            raise CheckpointDirInUseError(
                f"the FolderOwner of {self.root} was released, so this job no "
                "longer owns it: save inside the owner's block"
            )
        if self._record is not None and self._record.token:  # rank 0 holds it
            self._record.check()

    @property
    def lost(self) -> bool:
        """Whether this process knows that another job took the folder over (no I/O)."""
        return self._record is not None and bool(self._record.lost)


def refuse_out(storage: Storage, out: Location) -> None:
    """Refuses to write ``out`` where it would damage or replace a checkpoint.

    Args:
        storage: ``out``'s storage.
        out: A file or folder an offline tool is about to write (or replace).

    Raises:
        ValueError: ``out`` is or lies in a complete step folder, or is a
            folder holding ``step-<N>`` folders (a run's checkpoint folder).
        CheckpointDirInUseError: ``out`` is in, or is, a folder that holds an
            owner record (a job's, which alone writes there).
    """
    holder = step_holding(storage, out)
    if holder is not None:
        inside = storage.same_place(holder) != storage.same_place(out)
        where = f"lies in the step folder {str(holder)!r}" if inside else "is a step"
        raise ValueError(
            f"refused to write {os.fspath(out)!r}: it {where}, a checkpoint that "
            "writing there would damage. Write it outside every step folder"
        )
    if storage.is_dir(out) and (steps := list_steps(storage, out)):
        raise ValueError(
            f"refused to write {os.fspath(out)!r}: it is a checkpoint folder holding "
            f"{', '.join(f'step-{n}' for n in steps)}, which replacing it would "
            "delete. Write it to a folder of its own"
        )
    refuse_unowned(storage, storage.parent(out))
    if storage.is_dir(out):
        refuse_unowned(storage, out)
