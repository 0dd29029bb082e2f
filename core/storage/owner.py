"""Who writes: this process as lease objects and temp file names record it, and whether the
process such a record names is gone.

A record names its process by a random writer id (new in a forked child), the pid, the process's
start time and a *host key*: hostname, kernel boot id and pid-namespace inode. Only a reader with
the same host key can look the pid up (another machine, container or boot numbers its processes
differently); it judges the process gone when no process has that pid, or the one that has it
started at another time (the pid was reused) or is a zombie. Where any of this is unknown (no
``/proc``: macOS, Windows), nothing is ever judged gone: expiry decides (``leases``).
"""
from __future__ import annotations

import functools
import os
import re
import socket
import uuid

_TAG_RE = re.compile(r"([0-9a-f]{8})p([0-9]{1,10})s([0-9]{1,20})")


class _Writer:
    id = uuid.uuid4().hex[:16]


def _forked() -> None:
    _Writer.id = uuid.uuid4().hex[:16]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def writer_id() -> str:
    """Random hex id of this process (16 digits; a forked child gets its own)."""
    return _Writer.id


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def host_key() -> str:
    """This machine, boot and pid namespace, or ``""`` where that cannot be told apart."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    if not boot:
        return ""
    return f"{socket.gethostname()}/{boot}/{pidns}"


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name: [state, ppid, ...], or None if there is none."""
    text = _read(f"/proc/{pid}/stat")
    if text is None or ")" not in text:
        return None
    return text.rpartition(")")[2].split()


def start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot), 0 if unknown."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else 0
    except (IndexError, ValueError):
        return 0


def identity() -> dict:
    """This process as a lease records it: writer id, pid, start time and host key."""
    pid = os.getpid()
    return {"writer": writer_id(), "pid": pid, "start": start_time(pid), "host": host_key()}


def is_gone(host: str, pid: int, start: int) -> bool:
    """Whether the process a record names has certainly ended (same host key only; see module doc)."""
    if not host or host != host_key() or pid <= 0 or start <= 0:
        return False
    fields = _stat_fields(pid)
    if fields is None:
        return True  # no such process here
    try:
        return fields[0] in ("Z", "X") or int(fields[19]) != start
    except (IndexError, ValueError):
        return False


def temp_tag() -> str:
    """What a temp file's name says about its writer: host key digest, pid and start time."""
    pid = os.getpid()
    tag = _TAGS.get(pid)
    if tag is None:
        tag = _TAGS[pid] = f"{_host_digest()}p{pid}s{start_time(pid)}"
    return tag


_TAGS: dict[int, str] = {}


def _host_digest() -> str:
    return uuid.uuid5(uuid.NAMESPACE_OID, host_key()).hex[:8] if host_key() else "00000000"


def temp_writer_gone(name: str) -> bool:
    """Whether the temp file ``name`` (``...tmp-<tag>-<uuid>``) belongs to a process that has ended."""
    m = _TAG_RE.match(name.rpartition(".tmp-")[2])
    if m is None or not host_key():
        return False
    if m.group(1) != _host_digest():
        return False
    return is_gone(host_key(), int(m.group(2)), int(m.group(3)))
