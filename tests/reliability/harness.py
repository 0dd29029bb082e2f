"""Parent side of the crash harness: start training processes, SIGKILL them at aimed points, check.

Children are forked from a multiprocessing *forkserver* that imported torch and ckpt_core once
(importing torch costs seconds here; forking costs milliseconds), so each child is a real, separate
training process that can be killed with SIGKILL without touching the test process.

Kills are aimed, never timed: the child reports ``("hit", phase, detail)`` when it reaches the
armed kill point and then blocks; the parent kills it on receipt. Checks after every kill:

* every manifest in the directory parses, verifies (sizes, checksums, decoding) and loads, and
  its state is bit-identical to the uninterrupted reference run at the same step;
* ``latest()`` returns a checkpoint, at least as new as the newest one the child reported as
  committed before the kill (a committed checkpoint is never lost);
* the next process resumes from ``latest()``; at the end of a sequence the final state equals the
  reference's final state bit for bit.
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ckpt_core import CheckpointEngine
from ckpt_core.errors import CheckrunError

from . import crash_child
from .crash_child import PHASES, digest, engine_config

WATCHDOG_SECONDS = 300.0
"""Bound on waiting for a child's next message: a hang fails the trial instead of the run."""

_CONTEXT: Any = None


def context():
    """The forkserver context (created once; the server preloads torch, the child modules and, if
    installed, Lightning; a module that fails to import is skipped)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "ckpt_core", "tests.reliability.crash_child",
                                    "tests.reliability.lightning_child"])
        _CONTEXT = ctx
    return _CONTEXT


@dataclass(frozen=True)
class Flavor:
    """How a kind of training process is run and how its checkpoints are compared."""

    name: str
    target: Callable
    weights_only: bool
    step_of: Callable[[dict], int]
    digest_of: Callable[[dict], str]


def _plain() -> Flavor:
    return Flavor("plain", crash_child.train_main, True, lambda st: st["step"], digest)


def _lightning() -> Flavor:
    from . import lightning_child

    return Flavor("lightning", lightning_child.lightning_main, False, lambda ck: ck["epoch"],
                  lambda ck: lightning_child.training_digest(ck["state_dict"], ck["optimizer_states"][0]))


FLAVORS: dict[str, Callable[[], Flavor]] = {"plain": _plain, "lightning": _lightning}


@dataclass
class Outcome:
    """What one child run did: the kill point it hit (then it was SIGKILLed), or its final result."""

    hit: tuple | None = None
    committed: list[int] = field(default_factory=list)
    resumed: int | None = None
    done: tuple | None = None
    saved: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    exitcode: int | None = None


def run_child(target: Callable, *args: Any, on_hit: Callable[[tuple], None] | None = None) -> Outcome:
    """Run ``target(conn, *args)`` in a fresh process; SIGKILL it when it reports a kill point."""
    ctx = context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(send, *args), daemon=True)
    proc.start()
    send.close()
    out = Outcome()
    try:
        while True:
            if not recv.poll(WATCHDOG_SECONDS):
                proc.kill()
                out.error = f"child sent nothing for {WATCHDOG_SECONDS} s (hung)"
                break
            try:
                msg = recv.recv()
            except EOFError:
                break
            kind = msg[0]
            if kind == "hit":
                out.hit = tuple(msg[1:])
                proc.kill()  # SIGKILL, while the child is blocked exactly at the kill point
                if on_hit is not None:
                    on_hit(out.hit)
                break
            if kind == "committed":
                out.committed.append(msg[1])
            elif kind == "resumed":
                out.resumed = msg[1]
            elif kind == "saved":
                out.saved[msg[1]] = msg[2]
            elif kind == "done":
                out.done = tuple(msg[1:])
            elif kind == "error":
                out.error = msg[1]
    finally:
        proc.join()
        recv.close()
    out.exitcode = proc.exitcode
    return out


@dataclass(frozen=True)
class Reference:
    """Digests of the uninterrupted run: at every save step, and at the end."""

    total_steps: int
    save_every: int
    digests: dict[int, str]
    final: str
    flavor: str = "plain"


def reference(total_steps: int, save_every: int, flavor: str = "plain") -> Reference:
    """The uninterrupted run (``total_steps``: epochs for Lightning, which saves every epoch)."""
    out = run_child(FLAVORS[flavor]().target, None,
                    {"total_steps": total_steps, "save_every": save_every, "reference": True})
    if out.error or out.done is None:
        raise RuntimeError(f"reference run failed: {out.error}")
    return Reference(total_steps, save_every, dict(out.saved), out.done[1], flavor)


@dataclass
class Check:
    problems: list[str] = field(default_factory=list)
    latest_step: int | None = None
    manifests: int = 0
    temp_files: int = 0


def check_directory(path: Path, ref: Reference, committed_at_least: int = 0) -> Check:
    """Everything a kill must leave intact (see the module docstring)."""
    check = Check()
    flavor = FLAVORS[ref.flavor]()
    if not path.exists():
        if committed_at_least:
            check.problems.append(f"{path} vanished although step {committed_at_least} was committed")
        return check
    with CheckpointEngine(engine_config()) as engine:
        for name in sorted(os.listdir(path)):
            if name.startswith(".") or not (path / name).is_file():
                continue  # hidden temp files of interrupted writes, the .checkrun blob store
            check.manifests += 1
            url = str(path / name)
            try:
                report = engine.verify(url)
                if not report.ok:
                    check.problems.append(f"{name}: verify failed: {report.problems}")
                    continue
                state = engine.load(url, weights_only=flavor.weights_only)
            except CheckrunError as exc:
                check.problems.append(f"{name}: does not load: {type(exc).__name__}: {exc}")
                continue
            step = flavor.step_of(state)
            if ref.digests.get(step) != flavor.digest_of(state):
                check.problems.append(f"{name}: state at step {step} differs from the uninterrupted run")
        latest = engine.latest(path)
        if latest is None:
            if committed_at_least:
                check.problems.append(f"latest() is None although step {committed_at_least} was committed")
        else:
            try:
                check.latest_step = flavor.step_of(engine.load(latest, weights_only=flavor.weights_only))
            except CheckrunError as exc:
                check.problems.append(f"latest() {latest} does not load: {exc}")
            if check.latest_step is not None and check.latest_step < committed_at_least:
                check.problems.append(f"latest() is step {check.latest_step}, but step "
                                      f"{committed_at_least} had been committed (lost)")
    check.temp_files = sum(1 for _, _, files in os.walk(path) for f in files if ".tmp-" in f)
    return check


@dataclass
class Trial:
    phase: str
    n: int
    hit: bool
    problems: list[str]
    latest_step: int | None
    resumed_from: int | None
    temp_files: int = 0


@dataclass
class SequenceReport:
    trials: list[Trial] = field(default_factory=list)
    completed: bool = False
    final_ok: bool = False
    problems: list[str] = field(default_factory=list)
    temp_files: int = 0

    @property
    def failures(self) -> list[str]:
        return [p for t in self.trials for p in t.problems] + self.problems


def crash_sequence(workdir: Path, ref: Reference, kills: Iterable[tuple[str, int]],
                   overrides: dict | None = None) -> SequenceReport:
    """Train in ``workdir/run`` killing the process at each kill point in turn (each process
    resumes from the last) until a run finishes (its kill point was not reached) or the kills
    run out; then train to the end. Checks after every kill and at the end."""
    path = workdir / "run"
    url = f"faultfile://{path}"
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    report = SequenceReport()
    committed = 0
    spec = {"total_steps": ref.total_steps, "save_every": ref.save_every, "overrides": overrides or {}}
    target = FLAVORS[ref.flavor]().target
    for i, (phase, n) in enumerate(kills):
        out = run_child(target, url, {**spec, "kill": (phase, n), "log": str(logs / f"{i}.log")})
        problems = [f"child failed: {out.error}"] if out.error else []
        # (Lightning resumes from last.ckpt, which lags behind a newer epoch=N.ckpt when the kill
        # fell between the two saves: only latest() must be at least the newest committed.)
        if ref.flavor == "plain" and out.resumed is not None and out.resumed < committed:
            problems.append(f"resumed from step {out.resumed} although {committed} was committed")
        committed = max([committed, *out.committed])
        check = check_directory(path, ref, committed)
        report.trials.append(Trial(phase, n, out.hit is not None, problems + check.problems,
                                   check.latest_step, out.resumed, check.temp_files))
        if out.done is not None:  # the kill point was not reached: the run finished
            report.completed = True
            _check_final(report, out, ref)
            break
    if not report.completed:
        out = run_child(target, url, {**spec, "log": str(logs / "final.log")})
        if out.error:
            report.problems.append(f"final run failed: {out.error}")
        report.completed = out.done is not None
        _check_final(report, out, ref)
        last = ref.total_steps if ref.flavor == "plain" else ref.total_steps - 1
        report.problems.extend(check_directory(path, ref, last).problems)
    report.temp_files = count_temp_files(path)
    return report


def count_temp_files(path: Path) -> int:
    """Temp files of interrupted writes (ignored by every reader; a later collection that finds the
    dead writer's lease deletes them)."""
    return sum(1 for _, _, files in os.walk(path) for f in files if ".tmp-" in f)


def _check_final(report: SequenceReport, out: Outcome, ref: Reference) -> None:
    if out.done is None:
        report.problems.append("the run did not finish")
        return
    report.final_ok = out.done[1] == ref.final
    if not report.final_ok:
        report.problems.append("final state differs from the uninterrupted run")


# Ranges of the kill occurrence per phase: small enough that most kills land, wide enough to
# reach different saves and different blobs of a save.
OCCURRENCES = {"step": (1, 9), "capture": (1, 3), "lease-write": (1, 8), "blob-write": (1, 24), "blob-torn": (1, 24),
               "manifest-write": (1, 3), "manifest-rename": (1, 3), "committed": (1, 3),
               "retention": (1, 3), "gc": (1, 12)}


def random_kill(rng: random.Random) -> tuple[str, int]:
    phase = rng.choice(PHASES)
    return phase, rng.randint(*OCCURRENCES[phase])


@dataclass
class SoakReport:
    trials: int = 0
    sequences: int = 0
    armed: collections.Counter = field(default_factory=collections.Counter)
    hits: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    finals_ok: int = 0
    temp_files: int = 0

    @property
    def kills(self) -> int:
        return sum(self.hits.values())

    def summary(self) -> dict:
        return {"trials": self.trials, "kills": self.kills, "sequences": self.sequences,
                "kill_points_hit": dict(sorted(self.hits.items())),
                "kill_points_armed": dict(sorted(self.armed.items())),
                "failures": len(self.failures), "failure_details": self.failures[:50],
                "final_states_bit_identical": f"{self.finals_ok}/{self.sequences}",
                "checkpoints_lost": sum("lost" in f or "latest() is None" in f for f in self.failures),
                "stale_temp_files": self.temp_files}


def soak(workdir: Path, ref: Reference, rng: random.Random, trials: int, max_kills: int = 10,
         keep: bool = False, progress: Callable[[SoakReport, SequenceReport], None] | None = None
         ) -> SoakReport:
    """Random kill sequences (each in a fresh directory) until ``trials`` kill trials ran."""
    report = SoakReport()
    while report.trials < trials:
        seq_dir = workdir / f"seq{report.sequences:04d}"
        kills = [random_kill(rng) for _ in range(min(max_kills, trials - report.trials))]
        seq = crash_sequence(seq_dir, ref, kills)
        report.sequences += 1
        report.trials += len(seq.trials)
        for t in seq.trials:
            report.armed[t.phase] += 1
            report.hits[t.phase] += t.hit
        report.failures.extend(f"{seq_dir}: {p}" for p in seq.failures)
        report.finals_ok += seq.final_ok
        report.temp_files += seq.temp_files
        if progress is not None:
            progress(report, seq)
        if not keep and not seq.failures:
            shutil.rmtree(seq_dir, ignore_errors=True)
    return report
