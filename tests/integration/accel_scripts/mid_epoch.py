"""A shuffled, prepared DataLoader resumed in the middle of an epoch, launched by
tests/integration/test_accelerate_dropin.py with 2 processes (accelerate's synchronized sampler
generator exists only with several processes).

``full``: 3 epochs of 8 batches per rank. ``first``: the same run, ``save_state()`` after batch
``--stop``, then the script ends. ``resume``: ``load_state()``, ``skip_first_batches`` of the batches
the interrupted epoch had done, then on to the end. Each rank writes ``seen_rank{R}.json``: the batches
it trained on, from batch ``--stop + 1`` on (``first``: none). ``--native``: accelerate's own
save_state/load_state, for comparison. ``--finish-epoch``: a ``--stop`` at an epoch's last batch is resumed
by a ``skip_first_batches`` of that whole epoch first (without it: by the next epoch); ``--skip-zero``: the
first epoch after the resume through ``skip_first_batches(loader, 0)`` (accelerate's examples).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed

from accelerate_ckpt import attach

EPOCHS, PER_EPOCH = 3, 8  # 64 samples, batches of 4, 2 ranks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["full", "first", "resume"])
    p.add_argument("--project-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop", type=int, required=True)
    p.add_argument("--native", action="store_true")
    p.add_argument("--skip-zero", action="store_true",
                   help="resuming: the first epoch through skip_first_batches even with 0 to skip (accelerate's examples)")
    p.add_argument("--finish-epoch", action="store_true",
                   help="resuming at an epoch's end: go through that epoch's batches again, skipping all of them")
    args = p.parse_args()
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=args.project_dir, automatic_checkpoint_naming=True))
    set_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.arange(64.0).unsqueeze(1), batch_size=4, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if not args.native:
        attach(accelerator)
    step = 0
    if args.phase == "resume":
        accelerator.load_state()
        step = args.stop
    seen = []
    skip = step % PER_EPOCH
    if args.finish_epoch and step and not skip:  # the documented recipe's other reading: batch len(dl) of an epoch
        assert not list(accelerator.skip_first_batches(loader, PER_EPOCH))
    while step < EPOCHS * PER_EPOCH:
        resumed = args.phase == "resume" and step == args.stop
        for batch in accelerator.skip_first_batches(loader, skip) if skip or (resumed and args.skip_zero) else loader:
            step += 1
            if step > args.stop:
                seen.append(batch.flatten().int().tolist())
            loss = model(batch / 64).square().mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            if args.phase == "first" and step == args.stop:
                accelerator.save_state()
                accelerator.end_training()
                return
        skip = 0
    with open(os.path.join(args.out, f"seen_rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"seen": seen, "weight": model.module.weight.item() if hasattr(model, "module")
                   else model.weight.item()}, f)
    accelerator.end_training()
    # Skip the interpreter's shutdown: a gloo worker thread that drops its last finished work (accelerate's
    # barrier in end_training) only once Python is finalizing aborts the process ("terminate called without
    # an active exception", SIGABRT, about 1 launch in 20 on a loaded 2-core machine). A torch/CPython race,
    # not checkrun's: it aborts accelerate's own save/load (--native) the same way (a gdb backtrace of a
    # core: ProcessGroupGloo::runLoop -> ~AsyncWork -> ~ThreadLocalState -> take_gil -> pthread_exit ->
    # std::terminate). Everything this phase checks is written and committed by now; the "first" phase,
    # which tests a script exiting right after save_state(), still exits normally.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
