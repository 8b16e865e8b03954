"""One writer per checkpoint folder on an object store: a record with a lease.

An object store has no hard link, no rename and no ``/proc`` of the host that
wrote a record, so :class:`~pippy.checkpoint.FolderOwner`'s local protocol
cannot work there. :class:`StoreLease` creates the owner record with a
conditional write (S3's ``If-None-Match: *``: of two jobs, exactly one
succeeds), holds a lease that a daemon thread renews every third of its
length, and takes over a record only after its lease has expired: the job
that first creates the claim ``.owner.takeover-<token>`` (again a conditional
write) deletes the old record and writes its own; any other job is refused.

Expiry compares the record's ``expires`` (seconds since the epoch) with this
host's clock: hosts of one cluster keep their clocks in step (NTP), to well
within a lease.

A job that stalls for longer than its lease (a paused VM, a stopped process)
may find, when it wakes, that another job took the folder over. Before each
write that could touch another job's objects (a step's first file, its
commit record, retention) the saving code asks :func:`check_lease`, which
reads the record (one GET): a job whose lease was lost is refused, naming the
job that took over, and writes nothing more. An object store has no
compare-and-swap on a plain PUT: renewals use S3's conditional PUT
(``If-Match`` on the record's ETag), so that a renewal sent by a job that
stalled cannot overwrite the new owner's record. A step's data objects have
no such guard: what stays open is a data PUT already under way when the job
stalled, which lands when it wakes, in that job's uncommitted step (had the
new owner saved a step of the same number meanwhile, its manifest's
checksums would refuse the mixed step at load).
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

from pippy.checkpoint.errors import CheckpointDirError, CheckpointDirInUseError
from pippy.checkpoint.storage import FsspecStorage, Location, storage_for

__all__ = ["StoreLease", "check_lease", "lease_lost"]

logger = logging.getLogger(__name__)

#: How long a record holds the folder unless renewed, in seconds.
LEASE_SECONDS = 60.0

#: Environment variable that sets the lease, in seconds, where none is given.
LEASE_ENV = "PIPPY_LEASE_SECONDS"

# The leases this process holds, by folder URL: the saving code checks them.
_HELD: dict[str, StoreLease] = {}


def _resolve_lease_seconds(seconds: float | None) -> float:
    """The lease in seconds: the argument, else PIPPY_LEASE_SECONDS, else 60."""
    text = os.environ.get(LEASE_ENV) if seconds is None else str(seconds)
    if text is None:
        return LEASE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        where = f"{LEASE_ENV}={text!r}" if seconds is None else f"lease_seconds={text}"
        raise ValueError(
            f"{where} is not a lease: give a number of seconds above 0, or "
            "leave it unset for the default of 60"
        )
    return value


def _key(root: Location) -> str:
    """A folder URL as the registry keys it."""
    return os.fspath(root).rstrip("/")


def check_lease(checkpoint_dir: Location) -> None:
    """Refuses to go on if this process lost its lease on ``checkpoint_dir``.

    A no-op unless this process holds a :class:`StoreLease` on the folder
    (rank 0 of a job that owns a folder on an object store). Call it before
    a write that could touch another job's objects.

    Args:
        checkpoint_dir: The run's checkpoint folder.

    Raises:
        CheckpointDirInUseError: Another job took the folder over (its
            lease expired while this job stalled); the message names it.
    """
    lease = _HELD.get(_key(checkpoint_dir))
    if lease is not None:
        lease.check()


def lease_lost(checkpoint_dir: Location) -> bool:
    """Whether this process knows that it lost its lease on the folder (no I/O)."""
    lease = _HELD.get(_key(checkpoint_dir))
    return lease is not None and lease.lost.is_set()


def _when(seconds: float) -> str:
    """A time as ``2026-12-01T20:30:00+0000``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(seconds))


class StoreLease:
    """The owner record of a folder on an object store, held with a lease.

    Args:
        root: The run's checkpoint folder (a URL).
        record: The owner record's name in it.
        lease_seconds: How long the record holds the folder unless renewed;
            None reads ``PIPPY_LEASE_SECONDS`` (default 60 s).

    Raises:
        ValueError: The lease is not a number of seconds above 0.
        TypeError: ``root`` is a local folder, not a URL.

    Attributes:
        token: This job's token, once acquired.
        lost: Set once a renewal or :meth:`check` found the record another
            job's (this job's lease had expired and was taken over): this
            job writes nothing more into the folder.
    """

    def __init__(
        self, root: Location, record: str, *, lease_seconds: float | None = None
    ) -> None:
        self.root = _key(root)
        storage = storage_for(root)
        if not isinstance(storage, FsspecStorage):
            raise TypeError(
                f"{os.fspath(root)!r} is a local folder: a lease is for an object "
                "store's URL (FolderOwner keeps a local folder's owner record)"
            )
        self.storage = storage
        self._version: str | None = None  # of this job's record, as last written
        self.record = self.storage.join(self.root, record)
        self.lease_seconds = _resolve_lease_seconds(lease_seconds)
        self.token = ""
        self.expires = 0.0  # of this job's record, as last written
        self.lost = threading.Event()
        self._lost_to = ""  # the message saying who took the folder over
        self._since = ""  # when this job acquired the record
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mine(self) -> dict[str, Any]:
        """This job's record, its lease starting now."""
        self.expires = time.time() + self.lease_seconds
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": self._since,
            "token": self.token,
            "expires": self.expires,
            "lease_seconds": self.lease_seconds,
        }

    def _read(self) -> dict[str, Any] | None:
        """The record, or None if there is none."""
        try:
            record = json.loads(self.storage.read_bytes(self.record))
        except FileNotFoundError:
            return None
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(
            record.get("expires"), int | float
        ):
            raise CheckpointDirInUseError(
                f"{self.record} is not an owner record pippy wrote, so whether a "
                "job uses the folder is unknown. If none does, delete that object"
            )
        return record

    def acquire(self) -> str:
        """Creates the record, or takes over an expired one; starts renewing.

        Returns:
            This job's token.

        Raises:
            CheckpointDirInUseError: Another job's lease has not expired, or
                another job is taking an expired one over.
        """
        self.token = uuid.uuid4().hex[:12]
        self._since = _when(time.time())
        self.storage.makedirs(self.root)
        for _ in range(3):
            if self.storage.create_exclusive(self.record, self._encoded()):
                self._version = self.storage.version(self.record)  # just made
                _HELD[self.root] = self
                self._start_renewing()
                return self.token
            self._take_over_if_expired()
        raise CheckpointDirError(f"could not take {self.root}: it keeps changing")

    def _encoded(self) -> bytes:
        """The record as written."""
        return json.dumps(self._mine()).encode()

    def _take_over_if_expired(self) -> None:
        """Deletes an expired record, if this job claims it first; else refuses."""
        record = self._read()
        if record is None:
            return
        owner = f"host {record.get('host')!r}, pid {record.get('pid')}"
        if record["expires"] > time.time():
            raise CheckpointDirInUseError(
                f"{self.root} is in use by another job ({owner}, started "
                f"{record.get('since')}; its lease runs until "
                f"{_when(record['expires'])}): one writer per checkpoint folder. "
                "Wait for that job to end or stop it, or use another folder; the "
                "lease of a job that died expires within "
                f"{record.get('lease_seconds')} s"
            )
        claim = f"{self.record}.takeover-{record.get('token')}"
        if not self.storage.create_exclusive(claim, self._encoded()):
            raise CheckpointDirInUseError(
                f"{self.root}: another job is taking over the expired lease of "
                f"({owner}); use another folder, or retry once it is done"
            )
        self.storage.remove(self.record)
        logger.warning(
            "taking over %s from a job whose lease expired at %s (%s)",
            self.root,
            _when(record["expires"]),
            owner,
        )

    def _start_renewing(self) -> None:
        """Renews the lease every third of its length, in a daemon thread."""
        self._thread = threading.Thread(
            target=self._renew, name="pippy-lease", daemon=True
        )
        self._thread.start()

    def _renew(self) -> None:
        """The renewing thread: rewrites the record while it is still this job's."""
        while not self._stop.wait(self.lease_seconds / 3):
            try:
                self._renew_once(always=True)
            except CheckpointDirInUseError:
                return
            except OSError as e:  # the store did not answer: try again soon
                logger.warning("could not renew the lease of %s: %s", self.root, e)

    def _renew_once(self, *, always: bool) -> None:
        """Rewrites the record if it is still this job's (``always``, or if due)."""
        with self._lock:  # the renewing thread and a save's check
            if self.lost.is_set():
                raise CheckpointDirInUseError(self._lost_to)
            record = self._read_or_none(self.record)
            if time.time() >= self.expires:  # late: a job may be taking it over
                claim = self._read_or_none(f"{self.record}.takeover-{self.token}")
                record = claim or record
            if record is None or record.get("token") != self.token:
                self._lose(record)
            due = self.expires - time.time() < self.lease_seconds * 2 / 3
            if always or due:  # only over this job's own last write
                data = self._encoded()
                version = self.storage.replace_if_unchanged(
                    self.record, data, self._version
                )
                if version is None:
                    self._lose(self._read_or_none(self.record))
                self._version = version or None

    def _read_or_none(self, path: str) -> dict[str, Any] | None:
        """A record, or None if there is none or it is not one pippy wrote."""
        try:
            return json.loads(self.storage.read_bytes(path))
        except (FileNotFoundError, ValueError):
            return None

    def _lose(self, record: dict[str, Any] | None) -> None:
        """Notes that another job took the folder over; raises saying so."""
        if isinstance(record, dict):
            other = (
                f"another job took it over (host {record.get('host')!r}, pid "
                f"{record.get('pid')}, started {record.get('since')})"
            )
        else:
            other = "its owner record is gone (another job took it over)"
        if time.time() >= self.expires:
            when = (
                f" after this job's lease expired at {_when(self.expires)} (not "
                f"renewed for {self.lease_seconds:g} s: this job stalled)"
            )
        else:
            when = f", though this job's lease ran until {_when(self.expires)}"
        self._lost_to = (
            f"this job lost {self.root}: {other}{when}, so this job writes "
            "nothing more there. Stop this job; the other job's steps are "
            "untouched: resume from them once it has ended"
        )
        self.lost.set()
        raise CheckpointDirInUseError(self._lost_to)

    def check(self) -> None:
        """Reads the record (one GET): goes on if it is still this job's.

        A record still this job's after its lease expired (this job stalled,
        and no job took it over) is renewed at once.

        Raises:
            CheckpointDirInUseError: Another job took the folder over; the
                message names it and says what to do.
        """
        self._renew_once(always=False)

    def release(self) -> None:
        """Stops renewing and deletes the record if it is still this job's.

        A job that lost its lease deletes nothing: the folder is another's.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease_seconds)
        if _HELD.get(self.root) is self:
            del _HELD[self.root]
        if not self.token or self.lost.is_set():
            return
        record = self._read()
        if record is None or record.get("token") != self.token:
            return
        self.storage.remove(self.record)
        claims = f"{self.storage.name(self.record)}.takeover-"
        for name in self.storage.listdir(self.root):  # this job's, of an old lease
            if name.startswith(claims) and not name.endswith(self.token):
                self.storage.remove(self.storage.join(self.root, name))
