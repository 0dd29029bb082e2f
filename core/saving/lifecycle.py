"""Process-level safety nets: flush forgotten engines (and first the adapters and step logs that
drive them) at exit, give pending saves a SIGTERM grace.

Called from the training (main) thread; the SIGTERM handler is installed once per process, only
from the main thread, and chains to whatever handler was there before.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import weakref

from .. import forksafe  # noqa: F401 - its fork hook first: ours (joining retiring threads) then runs before it

log = logging.getLogger("ckpt_core")
_engines: "weakref.WeakSet" = weakref.WeakSet()
_owners: list = []
"""``weakref.WeakMethod``s of the exit closers of objects that drive engines (``register_owner``)."""
_busy: list = []
"""``weakref.WeakMethod``s counting work to commit besides the engines' own saves (``register_busy``)."""
_lock = threading.Lock()
_atexit_done = False
_sigterm: dict = {"installed": False, "grace": None, "previous": None}


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer than the main thread (Linux schedules threads,
    so this leaves the training thread alone); background threads call it when they start. No-op for 0, on other
    platforms, or where the system refuses."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:  # relative to the main thread (its id is the pid): threads inherit their creator's nice
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), target)
    except OSError as exc:  # pragma: no cover - seccomp or similar
        log.debug("checkrun: cannot lower the priority of %s: %s", threading.current_thread().name, exc)


def register(engine) -> None:
    """Track an engine so that ``atexit`` can flush it if the user never closes it."""
    with _lock:
        _engines.add(engine)
        _hook_exit()


def register_owner(close_at_exit) -> None:
    """Call ``close_at_exit`` (a bound method; it must not raise) at interpreter exit if its object
    is still alive, before any engine is flushed: an object that drives engines (an adapter's
    checkpointer committing an index, a step log) still needs them to finish its pending work. Owners
    are closed newest first; the method is held weakly."""
    with _lock:
        _owners.append(weakref.WeakMethod(close_at_exit))
        _hook_exit()


def register_busy(pending) -> None:
    """``pending()`` (a bound method, held weakly; it must take no lock) counts work still to commit that the
    engines' own pending saves may not show: an Accelerate checkpoint's index, saved by another engine once
    its part committed. The SIGTERM grace waits for it too (it passed over the idle part's engine before the
    index save began, and the checkpoint was lost: found by an independent check)."""
    with _lock:
        _busy[:] = [ref for ref in _busy if ref() is not None]  # the objects gone since
        _busy.append(weakref.WeakMethod(pending))


def _pending_work() -> int:
    """Saves pending in every engine plus the work ``register_busy`` counts (lock-free: signal handler)."""
    count = sum(e.pending for e in list(_engines))
    for ref in list(_busy):
        fn = ref()
        count += fn() if fn is not None else 0
    return count


def _hook_exit() -> None:
    global _atexit_done
    if not _atexit_done:
        # threading's exit hooks run before atexit's and before concurrent.futures refuses new
        # work; registered after it, ours runs first (they run in reverse order).
        hook = getattr(threading, "_register_atexit", None)
        (hook or atexit.register)(_flush_all)
        _atexit_done = True


def unregister(engine) -> None:
    with _lock:
        _engines.discard(engine)


def _forget_in_child() -> None:
    # A forked child (DataLoader worker, any multiprocessing fork) inherits the parent's engines
    # but none of their threads: flushing them at the child's exit would wait forever for saves
    # only the parent can finish. The parent keeps its obligations; the child has none.
    global _engines, _owners, _busy, _lock, _retiring
    _engines, _owners, _busy, _lock, _retiring = weakref.WeakSet(), [], [], threading.Lock(), weakref.WeakSet()
    lib = _sigterm.get("hooked")
    if lib is not None:  # nothing of it to wait for: SIGTERM ends it at once (it was forked armed: found by h98)
        lib.checkrun_sigterm_arm(0)


_retiring: "weakref.WeakSet" = weakref.WeakSet()
RETIRE_JOIN_SECONDS = 30.0


def retiring(thread: threading.Thread) -> None:
    """A background thread announces that it is ending (with the threads it owns): a fork waits for
    it first. CPython 3.11 can deadlock a forked child (in its after-fork thread cleanup) when the
    fork happens while another thread is being torn down; DataLoader workers fork at every epoch."""
    with _lock:
        _retiring.add(thread)


def _join_retiring(cancel: bool = False) -> None:
    # Runs in the forking thread just before fork(); join() releases the GIL while it waits. At exit
    # (``cancel``) those that can stop early (a load's reference rebuild nobody will use) are told to.
    with _lock:
        threads = [t for t in _retiring if t is not threading.current_thread()]
    for t in threads:
        if cancel and callable(stop := getattr(t, "cancel", None)):
            stop()
        t.join(RETIRE_JOIN_SECONDS)
        if t.is_alive():
            log.warning("checkrun: forking while background thread %s still ends", t.name)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_join_retiring, after_in_child=_forget_in_child)


def _flush_all() -> None:
    with _lock:
        owners = [m() for m in reversed(_owners)]
        _owners.clear()
    waiting = _pending_work()
    try:
        for close in owners:
            if close is not None:
                close()
        for engine in list(_engines):
            try:
                engine.close()
            except Exception as exc:  # at exit nobody can catch it: log instead
                log.error("checkrun: pending save failed at interpreter exit: %s", exc)
        # A daemon thread still in torch or I/O when the interpreter finalizes can abort the process
        # ("terminate called without an active exception", exit status 134): a load's reference rebuild
        # outlives an engine dropped right after its load (h165).
        _join_retiring(cancel=True)
    except KeyboardInterrupt:  # ^C while the exit waits for saves: one line, not a traceback (exit goes on)
        pending = _pending_work()
        if pending:
            log.error("checkrun: interrupted at exit while waiting for %d pending save(s): they may not be "
                      "committed", pending)
        elif waiting:  # a first ^C lands in engine.close(), which still ends the queued saves (h158)
            log.error("checkrun: interrupted at exit while waiting for %d pending save(s): they were finished "
                      "before exiting (a second Ctrl-C abandons them)", waiting)
        else:  # closing a step log (its last segment) or an idle engine
            log.error("checkrun: interrupted at exit while closing (no save pending; a step log's unflushed "
                      "steps may not be committed)")


def install_sigterm(grace_seconds: float | None) -> None:
    """On SIGTERM, wait up to ``grace_seconds`` for pending saves, then run the previous handler
    (the default one: the process ends, unless another handler installed since runs ours). Installed
    again where the default handler replaced it: Lightning's fit puts back, at its end, the handler it
    found at its start, which removed ours when the first save was inside a fit (later saves then had no
    grace: found by an independent check). Another handler installed since is left alone: it may call ours."""
    current = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread():
        return
    if current is _on_sigterm and grace_seconds is not None:
        _watch()  # Lightning's fit put ours back with ``signal.signal``, which replaced the C hook
    if grace_seconds is None or current is _on_sigterm or (_sigterm["installed"] and current != signal.SIG_DFL):
        return
    _sigterm["grace"] = grace_seconds
    _sigterm["previous"] = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm["installed"] = True
    _watch()


def _watch() -> None:
    """Main thread, ``_on_sigterm`` installed in front of the default handler: put the C hook
    (``ckpt_core._csig``) in front of it, so that a SIGTERM while no save is pending ends the process at
    once, as with no handler, even while the main thread is blocked in C code (Python would run
    ``_on_sigterm`` only when that call returns: a hung collective did not end at SIGTERM at all, found
    by an independent check). Again after a handler installed since replaced the hook."""
    lib = _csig()
    if lib is not None and _sigterm["previous"] == signal.SIG_DFL and lib.checkrun_sigterm_hook() >= 0:
        _sigterm["hooked"] = lib


def _csig():
    if "csig" not in _sigterm:
        from ..codecs._common import load_native  # late: codecs import torch
        _sigterm["csig"] = load_native("_csig", "checkrun_csig_abi", 2, "every SIGTERM goes to the Python handler")
    return _sigterm["csig"]


def arm() -> None:
    """After a save is counted as pending: a SIGTERM now gets the grace (``_on_sigterm``). No lock: a
    signal handler may run inside this on the main thread, and a coordinator's ``settle`` must not wait
    for it (the queued saves stopped until the grace ran out: found by an independent check)."""
    lib = _sigterm.get("hooked")
    if lib is not None:
        lib.checkrun_sigterm_arm(1)


def settle() -> None:
    """After work ended (a save, an Accelerate checkpoint's index): with no work pending anywhere, a SIGTERM
    ends the process at once again. Looked again after disarming: work counted meanwhile arms it back
    (``arm`` always runs after its work is counted, so the last word is right)."""
    lib = _sigterm.get("hooked")
    if lib is not None and not _pending_work():
        lib.checkrun_sigterm_arm(0)
        if _pending_work():
            lib.checkrun_sigterm_arm(1)


def _grace() -> None:
    """Wait up to the grace for every pending save; log once if some are still pending then."""
    deadline = time.monotonic() + float(_sigterm["grace"])
    while _pending_work() and time.monotonic() < deadline:  # all of them at once: one save may start another
        time.sleep(0.05)  # polling keeps the handler free of locks the interrupted main thread may hold
    pending = _pending_work()
    if pending:  # only at the deadline
        log.error("checkrun: SIGTERM grace of %.1f s ran out with %d save(s) pending", _sigterm["grace"], pending)


def _on_sigterm(signum, frame) -> None:
    # Not the installed handler: another one (Lightning's during fit, which stops the loop gracefully
    # and saves an OnExceptionCheckpoint) calls us in its chain. It owns SIGTERM; we only wait.
    owner = signal.getsignal(signal.SIGTERM) is _on_sigterm
    _grace()
    previous = _sigterm["previous"]
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN or not owner:
        return
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
