"""Plain Python data in accelerate's registered objects: how long ``save_state()`` blocks with a
registered object holding ``--n`` floats in a list or a dict (a loss history), accelerate's own
``save_state`` against checkrun attached (``accelerate_ckpt.attach``), each in a fresh process (the
Accelerator is a process-wide singleton); a 2x2 model, ``--saves`` saves each, seconds per save.

Run: ``python -m benchmarks.bench_plain_values [--n 100000] [--saves 3]`` (about 20 s).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

_CHILD = """
import json, os, sys, time, torch
from accelerate import Accelerator
mode, kind, n, saves, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
acc = Accelerator(cpu=True)
acc.prepare(torch.nn.Linear(2, 2))
class History:
    def __init__(self):
        self.h = [i * 0.5 for i in range(n)] if kind == "list" else {f"step{i}": i * 0.5 for i in range(n)}
    def state_dict(self):
        return {"h": self.h}
    def load_state_dict(self, state):
        self.h = state["h"]
acc.register_for_checkpointing(History())
if mode == "checkrun":
    import accelerate_ckpt
    accelerate_ckpt.attach(acc)
times = []
for i in range(saves):
    t = time.perf_counter()
    acc.save_state(os.path.join(out, f"c{i}"))
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def measure(mode: str, kind: str, n: int, saves: int) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-c", _CHILD, mode, kind, str(n), str(saves), out],
                              capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="floats in the registered object")
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"save_state() blocking, s per save (first, then the rest); {args.n} floats\n")
    print("| data | accelerate | checkrun | ratio (later saves, medians) |\n|---|---|---|---|")
    for kind in ("list", "dict"):
        stock, ours = (measure(m, kind, args.n, args.saves) for m in ("accelerate", "checkrun"))
        later = sorted(ours[1:])[len(ours[1:]) // 2] / max(1e-9, sorted(stock[1:])[len(stock[1:]) // 2])
        fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"| {kind} | {fmt(stock)} | {fmt(ours)} | {later:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
