"""One writer per checkpoint folder: :class:`FolderOwner` and its record.

Two jobs that write one folder (a restart while the old job's workers still
run, as a launcher killed with ``-9`` leaves them) delete and overwrite each
other's saves: :class:`FolderOwner` lets one job at a time write a folder.
"""

from __future__ import annotations

import contextlib
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


def _proc(name: str) -> str:
    """A file of this host's ``/proc`` (not a checkpoint's); empty if unreadable."""
    try:
        with open(f"/proc/{name}") as f:
            return f.read()
    except OSError:
        return ""


def _here() -> dict[str, str]:
    """This host, its boot and this PID namespace: where a pid names one process."""
    pidns = ""
    with contextlib.suppress(OSError):
        pidns = os.readlink("/proc/self/ns/pid")  # each container has its own
    boot = _proc("sys/kernel/random/boot_id").strip()
    return {"host": socket.gethostname(), "boot": boot, "pidns": pidns}


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (field 22 of proc(5)); None if none runs."""
    stat = _proc(f"{pid}/stat")
    return stat.rsplit(")", 1)[1].split()[19] if stat else None


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


class _Record:
    """A local folder's owner record, on rank 0; a dead owner's is taken over."""

    #: What the record is, for a message.
    kind = "file"

    def __init__(self, root: Location, storage: Any) -> None:
        self.root, self.storage = root, storage
        self.record = storage.join(root, OWNER_FILE)
        self.token = ""
        self.since = ""  # when this job acquired the record
        self.created = False  # acquire made the folder: release removes it empty
        self.lost = ""  # once another job took the folder over: the message

    def _mine(self) -> dict[str, Any]:
        """This job's record, with what tells whether its process still runs."""
        pid = os.getpid()
        return {
            **_here(),
            "pid": pid,
            "slurm": _slurm_job(),
            "start": _start_time(pid),
            "since": self.since,
            "token": self.token,
        }

    def _encoded(self) -> bytes:
        return json.dumps(self._mine()).encode()

    def _gone(self, record: dict[str, Any]) -> bool:
        """Whether ``record``'s process ended: ran here, or before a Slurm requeue."""
        job, theirs = _slurm_job(), record.get("slurm")
        # Slurm ends every process of a job, on every node, before it requeues it.
        if (
            job
            and isinstance(theirs, list)
            and len(theirs) == 3
            and theirs[:2] == job[:2]
            and isinstance(theirs[2], int)
            and theirs[2] < job[2]
        ):
            return True
        here, pid = _here(), record.get("pid")
        return (
            record.get("host") == here["host"]
            and record.get("boot") == here["boot"]
            and record.get("pidns", here["pidns"]) == here["pidns"]
            and (not isinstance(pid, int) or _start_time(pid) != record.get("start"))
        )

    def _valid(self, record: Any) -> bool:
        """Whether ``record`` (parsed JSON) is an owner record pippy wrote."""
        return isinstance(record, dict)

    def _read(self, path: str = "", *, strict: bool = True) -> dict[str, Any] | None:
        """A record (the owner's by default) or None; one not pippy's is refused."""
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
        # A store's empty folder is no object of its own: nothing to remove.
        self.created = self.kind == "file" and not self.storage.exists(self.root)
        self.storage.makedirs(self.root)
        for _ in range(3):  # another job may take a stale record first
            if self.storage.create_exclusive(self.record, self._encoded()):
                return self.token
            if (record := self._read()) is not None:
                self._take_over(record)
        raise CheckpointDirError(f"could not take {self.root}: it keeps changing")

    def _take_over(self, record: dict[str, Any]) -> None:
        """Moves a dead owner's record aside (and its leftovers); refuses a live one."""
        mine = self._mine()
        if all(record.get(k) == mine[k] for k in ("host", "boot", "pid", "start")):
            raise CheckpointDirInUseError(
                f"{self.root} is already owned by this process ({_describe(record)}),"
                " by a FolderOwner not yet released: use that one, or release it "
                "before taking the folder again"
            )
        if not self._gone(record):
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

    def _current(self) -> dict[str, Any] | None:
        """The record that says who owns the folder now."""
        return self._read(strict=False)

    def check(self) -> None:
        """One read: CheckpointDirInUseError if another job took the record over."""
        if self.lost:
            raise CheckpointDirInUseError(self.lost)
        record = self._current()
        if record is None or record.get("token") != self.token:
            self._lose(record)

    def _lose(self, record: dict[str, Any] | None) -> None:
        """Notes that another job took the folder over; raises saying so."""
        if record is not None:
            other = f"another job took it over ({_describe(record)})"
        else:
            other = "its owner record is gone (another job took it over)"
        self.lost = (
            f"this job lost {self.root}: {other}{self._lost_when()}, so this job "
            "writes nothing more there. Stop this job; the other job's steps are "
            "untouched: resume from them once it has ended"
        )
        raise CheckpointDirInUseError(self.lost)

    def _lost_when(self) -> str:
        return ""

    def release(self) -> bool:
        """Removes the record if still this job's (and an empty folder acquire made)."""
        record = self._read()
        if record is None or record.get("token") != self.token:
            return False
        self.storage.remove(self.record)
        if self.created and not self.storage.listdir(self.root):
            self.storage.remove(self.root)  # a job that saved nothing
        return True


class StoreLease(_Record):
    """The owner record of a folder on an object store, held with a lease.

    Created with S3's ``If-None-Match: *`` (of two jobs, one succeeds) and
    renewed every third of the lease, in a daemon thread, by a PUT with
    ``If-Match`` on its ETag, so that a stalled job's renewal cannot overwrite
    a new owner's: a store without conditional writes holds no lease, and is
    refused. An expired record is taken over only by the job that first
    creates the claim ``.owner.json.takeover-<token>``; expiry trusts the
    hosts' clocks (NTP) to agree within a lease. Left open: a data PUT under
    way when a job stalled lands when it wakes, in its own uncommitted step (a
    step of that number the new owner saved meanwhile fails its checksums at
    load).
    """

    kind = "object"
    root: str  # the folder's URL, without a trailing slash

    def __init__(
        self, root: Location, storage: FsspecStorage, lease_seconds: float | None
    ) -> None:
        super().__init__(os.fspath(root).rstrip("/"), storage)
        text = os.environ.get(LEASE_ENV) if lease_seconds is None else lease_seconds
        where = f"{LEASE_ENV}={{!r}}" if lease_seconds is None else "lease_seconds={}"
        self.lease_seconds = LEASE_SECONDS
        if text is not None:  # a longer lease overflows a timestamp
            self.lease_seconds = check_number(
                str(text),
                f"{where} is not a lease: give a number of seconds above 0 and at "
                "most 365 days, or leave it unset for the default of 60",
                above=0,
                at_most=MAX_TIMEOUT_S,
                text=True,
            )
        self._version: str | None = None  # of this job's record, as last written
        self.expires = 0.0  # of this job's record, as last written
        self._lock = threading.Lock()  # the renewing thread and a save's check
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
        if self._version is None:  # a renewal would be a plain PUT: no lease
            self.storage.remove(self.record)
            raise CheckpointDirError(
                f"{self.root}: the store gave {OWNER_FILE} no ETag to renew it "
                "by (If-Match), so no lease can hold there"
            )
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

    def _current(self) -> dict[str, Any] | None:
        """The record, or once this job's lease expired a claim on it."""
        record = self._read(strict=False)
        if time.time() < self.expires:
            return record
        claim = self._read(f"{self.record}.takeover-{self.token}", strict=False)
        return claim or record  # late: a job may be taking it over

    def check(self, *, always: bool = False) -> None:
        """One GET: CheckpointDirInUseError if lost; renews if due (or ``always``)."""
        with self._lock:
            super().check()
            if always or self.expires - time.time() < self.lease_seconds * 2 / 3:
                version = self.storage.replace_if_unchanged(
                    self.record, self._encoded(), self._version
                )
                if version is None:
                    self._lose(self._read(strict=False))
                self._version = version

    def _lost_when(self) -> str:
        if time.time() >= self.expires:
            return (
                f" after this job's lease expired at {_when(self.expires)} (not "
                f"renewed for {self.lease_seconds:g} s: this job stalled)"
            )
        return f", though this job's lease ran until {_when(self.expires)}"

    def release(self) -> bool:
        """Stops renewing; deletes the record if still this job's (not once lost)."""
        self._stop.set()
        self._thread.join(timeout=self.lease_seconds)
        if self.lost or not super().release():
            return False
        claims = f"{OWNER_FILE}.takeover-"
        for name in self.storage.listdir(self.root):  # this job's, of an old lease
            if name.startswith(claims) and not name.endswith(self.token):
                self.storage.remove(self.storage.join(self.root, name))
        return True


def check_owner(
    owner: FolderOwner | None, checkpoint_dir: Location
) -> FolderOwner | None:
    """``owner``, if it is None or holds ``checkpoint_dir``; else a ``ValueError``.

    An owner never acquired holds no folder: refused too. Compared as spelled
    first, without I/O (every rank makes a save's writer, and only rank 0
    looks at the folder); links are resolved only where the spellings differ.
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
    record = _Record(checkpoint_dir, storage)._read(strict=False)
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
    is removed if it is still this job's. Each save is given the owner and
    checks, before it writes and before it publishes, that the record is
    still this job's::

        with FolderOwner(checkpoint_dir) as owner:
            ...  # resume, train
            save_stage(state, checkpoint_dir, owner=owner)

    Without ``with``: :meth:`acquire`, then :meth:`release` in a ``finally``.
    A save given no owner is refused in a folder that holds a record
    (:func:`refuse_unowned`). A dead owner's record is taken over with a
    warning, and its staging folders and the steps its retention hid are
    removed: one of this host and boot whose process (pid and start time) is
    gone, or one of the same Slurm job before a requeue (``SLURM_CLUSTER_NAME``
    and ``SLURM_JOB_ID`` equal, ``SLURM_RESTART_COUNT`` higher), from any
    node, as Slurm ends a job's processes before it requeues it (a node cut
    off from the controller may still run them: a job whose record was taken
    over stops at its next save). Another host's record never is (its job may
    still run). On an object store (an fsspec URL) rank 0 holds the record
    with a lease (:class:`StoreLease`).

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
        self._record: _Record | None = None  # rank 0 holds it

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
        if not isinstance(storage, FsspecStorage):
            record = _Record(self.root, storage)
        elif storage.conditional:
            record = StoreLease(self.root, storage, self.lease_seconds)
        else:  # a renewal could overwrite a new owner's record
            raise CheckpointDirError(
                f"{self.root}: {storage.protocol}:// offers pippy no conditional "
                "write, so a lease there could not keep a second job out; hold "
                "the folder on a file system (a path) or on S3 (s3://), or run "
                "without FolderOwner and see to one job per folder yourself"
            )
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
