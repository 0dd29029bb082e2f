"""Crash-consistency soak (not run by CI): hundreds of SIGKILLs aimed at random kill points of a
real training process that checkpoints with checkrun; every kill is followed by the full check.

    python -m benchmarks.soak_crash --trials 200 --seed 1

A *trial* is one training process armed with one random kill point (phase + occurrence, see
``tests/reliability/crash_child.py``); if the process reaches it, it is SIGKILLed there (a *hit*),
otherwise it trains to the end. After every trial: every manifest in the directory verifies and
loads and equals the uninterrupted run at its step bit for bit, ``latest()`` is at least the newest
checkpoint reported committed, and the next process resumes from it. Trials run in sequences (a
fresh directory each, ``--max-kills`` kills, then a run to the end whose final state must equal the
uninterrupted run's). Prints a JSON summary; exit status 1 if anything failed.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from tests.reliability import harness


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--flavor", choices=sorted(harness.FLAVORS), default="plain",
                    help="plain PyTorch loop, or a Lightning Trainer with CheckrunCheckpointIO")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps of a full run (plain: 30; lightning: epochs, 6)")
    ap.add_argument("--every", type=int, default=3, help="plain: save every N steps")
    ap.add_argument("--max-kills", type=int, default=10, help="kills per sequence before a run to the end")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temp directory")
    ap.add_argument("--keep", action="store_true", help="keep the directories of passing sequences")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="checkrun-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.steps is None:
        args.steps = 30 if args.flavor == "plain" else 6
    ref = harness.reference(args.steps, args.every if args.flavor == "plain" else 1, args.flavor)

    def progress(report: harness.SoakReport, seq: harness.SequenceReport) -> None:
        kills = ", ".join(f"{t.phase}#{t.n}" + ("" if t.hit else " (missed)") for t in seq.trials)
        print(f"[{time.perf_counter() - started:7.1f}s] trials {report.trials:4d}  kills {report.kills:4d}  "
              f"failures {len(report.failures)}  (sequence {report.sequences}: {kills})", flush=True)

    report = harness.soak(workdir, ref, random.Random(args.seed), args.trials, args.max_kills,
                          keep=args.keep, progress=progress)
    summary = {"command": "python -m benchmarks.soak_crash " + " ".join(sys.argv[1:] if argv is None else argv),
               "flavor": args.flavor, "seed": args.seed, "steps": args.steps,
               "save_every": args.every if args.flavor == "plain" else "epoch",
               "seconds": round(time.perf_counter() - started, 1), "workdir": str(workdir),
               **report.summary()}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
