"""Hugging Face Accelerate integration of checkrun.

Quick use (on every process)::

    from accelerate import Accelerator
    from accelerate_ckpt import AcceleratorCheckpointer

    accelerator = Accelerator(project_config=ProjectConfiguration("run", automatic_checkpoint_naming=True))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    ckpt = AcceleratorCheckpointer(accelerator).attach()   # config: $CHECKRUN_CONFIG or defaults
    accelerator.load_state()          # resumes the newest committed checkpoint (if you want to)
    ...
    accelerator.save_state()          # returns after the in-memory snapshot
    ...
    ckpt.close()                      # or accelerator.end_training()

See docs/accelerate.md.
"""
from .checkpointer import (AcceleratorCheckpointer, CheckpointExistsError, NoCheckpointError,
                           UnsupportedDistributedTypeError, attach)
from .config import CONFIG_ENV, SECTION, AdapterOptions
from .steplog import StepLogSetupError

__all__ = ["AcceleratorCheckpointer", "attach", "AdapterOptions", "CheckpointExistsError", "NoCheckpointError",
           "UnsupportedDistributedTypeError", "StepLogSetupError", "CONFIG_ENV", "SECTION"]
