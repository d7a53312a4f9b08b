"""One run per run directory: a lock with a heartbeat.

The lock is `<run.dir>/.lock`, a JSON file created with O_EXCL by rank 0: host, pid, the
process start time, the Slurm job and torchrun run ids, and a heartbeat (its mtime, refreshed by
a daemon thread). A second launch on a live run dir fails at start-up naming the holder. A lock
is stale, and taken over, when its holder is gone: on the same host its pid is not running (or
runs another program: the start time differs); elsewhere (a shared filesystem across nodes) its
heartbeat is older than `stale_after_s`; or it belongs to the same Slurm job (a requeue) or the
same torchrun run (a restart), whose earlier processes are gone by construction. The takeover
renames the stale file away first, so two launchers racing for it cannot both win.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from ddptrain.fsutil import pid_is_running
from ddptrain.runs.layout import LOCK

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0


class RunDirError(RuntimeError):
    """run.dir cannot be used (a file, a read-only filesystem, held by another run); the message says why."""


class RunDirLocked(RunDirError):
    """Another live run holds the run directory; the message names it."""


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/pid/stat), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]




def _identity() -> dict:
    return {
        "host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"), "torchrun_run": os.environ.get("TORCHELASTIC_RUN_ID"),
    }


class RunDirLock:
    """Held by rank 0 for the life of a run; `release` (or process exit) frees it."""

    def __init__(self, run_dir: str | Path, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.path = Path(run_dir) / LOCK
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.me = _identity()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(self.me, handle)
            self._thread = threading.Thread(target=self._beat, name="run-dir-heartbeat", daemon=True)
            self._thread.start()
            return self
        raise RunDirLocked(f"{self.path}: could not take the run directory lock (another launcher keeps racing for it)")

    def _take_over_if_stale(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, ValueError):
            holder, age = {}, time.time() - self.path.stat().st_mtime  # half-written by a killed launcher
        reason = self._stale_reason(holder, age)
        if reason is None:
            raise RunDirLocked(
                f"run.dir {self.path.parent} is in use by another run: host {holder.get('host')}, pid "
                f"{holder.get('pid')}, started {holder.get('started')}, last heartbeat {age:.0f}s ago "
                f"(lock file {self.path}). Wait for it to finish, stop it, or pick another run.dir; a lock whose "
                f"holder died on another host is taken over after {self.stale_after_s:.0f}s without a heartbeat")
        aside = self.path.with_name(f"{LOCK}.stale-{self.me['host']}-{self.me['pid']}")
        try:
            os.rename(self.path, aside)  # atomic: of two launchers taking over, one rename wins
        except FileNotFoundError:
            return
        log.warning("run.dir %s: took over a stale lock of host %s pid %s (%s)", self.path.parent,
                    holder.get("host"), holder.get("pid"), reason)
        aside.unlink(missing_ok=True)

    def _stale_reason(self, holder: dict, age: float) -> str | None:
        if not holder:
            return "unreadable lock file" if age > 5 else None
        same_host = holder.get("host") == self.me["host"]
        if same_host:
            pid = int(holder.get("pid", -1))
            if pid == self.me["pid"]:
                return "left by this process"
            if not pid_is_running(pid) or _process_start(pid) != holder.get("process_start"):
                return "its process is gone"
        for key, what in (("slurm_job", "the same Slurm job, requeued"), ("torchrun_run", "the same torchrun run, restarted")):
            if holder.get(key) and holder.get(key) == self.me[key] and (not same_host or not pid_is_running(int(holder["pid"]))):
                return what
        if not same_host and age > self.stale_after_s:
            return f"no heartbeat for {age:.0f}s"
        return None

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:  # the run dir is gone or read-only: nothing to refresh
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:  # joined: no thread of ours outlives the run
            self._thread.join(timeout=5)
            self._thread = None
        try:
            holder = json.loads(self.path.read_text())
            if holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass
