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
from pippy.checkpoint.storage import Location, storage_for

__all__ = ["LEASE_SECONDS", "StoreLease"]

logger = logging.getLogger(__name__)

#: How long a record holds the folder unless renewed, in seconds.
LEASE_SECONDS = 60.0


def _when(seconds: float) -> str:
    """A time as ``2026-12-01T20:30:00+0000``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(seconds))


class StoreLease:
    """The owner record of a folder on an object store, held with a lease.

    Args:
        root: The run's checkpoint folder (a URL).
        record: The owner record's name in it.
        lease_seconds: How long the record holds the folder unless renewed.

    Attributes:
        token: This job's token, once acquired.
        lost: Set if a renewal found the record another job's (this job's
            lease had expired and was taken over): it must stop writing.
    """

    def __init__(
        self, root: Location, record: str, *, lease_seconds: float = LEASE_SECONDS
    ) -> None:
        self.root = os.fspath(root)
        self.storage = storage_for(root)
        self.record = self.storage.join(self.root, record)
        self.lease_seconds = lease_seconds
        self.token = ""
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mine(self) -> dict[str, Any]:
        """This job's record, its lease starting now."""
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": _when(time.time()),
            "token": self.token,
            "expires": time.time() + self.lease_seconds,
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
        self.storage.makedirs(self.root)
        for _ in range(3):
            if self.storage.create_exclusive(self.record, self._encoded()):
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
                record = self._read()
            except CheckpointDirInUseError:
                record = None
            if record is None or record.get("token") != self.token:
                logger.error(
                    "lost the lease of %s: another job took it over; this job "
                    "must stop writing there",
                    self.root,
                )
                self.lost.set()
                return
            self.storage.write_atomic(self.record, self._encoded())

    def release(self) -> None:
        """Stops renewing and deletes the record if it is still this job's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease_seconds)
        if not self.token:
            return
        record = self._read()
        if record is not None and record.get("token") == self.token:
            self.storage.remove(self.record)
        claims = f"{self.storage.name(self.record)}.takeover-"
        for name in self.storage.listdir(self.root):  # this job's, of an old lease
            if name.startswith(claims) and not name.endswith(self.token):
                self.storage.remove(self.storage.join(self.root, name))
