"""Random number generator states in the step log: a replay ends with them as the uninterrupted run had them.

A resume that replays to step *n* would otherwise leave the RNGs where the checkpoint (or the new
process's seeding) put them, so dropout masks, random augmentations and samplers drawn after the resumed
step would differ from the uninterrupted run's. The states are captured at every step's pre-hook (after
that step's forward and backward passes: what a checkpoint saved after the step would hold) and at each
flush point (``flush``, a save: between batches), and kept in memory; each segment stores the last ones
only, because a resume ends at the end of a committed segment. A step's states still hold after the state
records logged at the next pre-hook (the scheduler's step), but not after a batch whose step a
``GradScaler`` skipped (its scale went down): a replay ending there sets none and warns, unless a flush
point followed it. Logged, as accelerate's ``save_state`` keeps them: python's ``random``, numpy's global
generator, torch's CPU generator and, once CUDA is initialized, each device's generator.

Header entry of a segment (format version 7), its states raw payload ranges::

    "rng": {"event": e, "step": n | null, "rank": r, "torch": range, "cuda": [range, ...],
            "python": {"version": 3, "mt": range, "gauss": float | null},
            "numpy": {"mt": range, "pos": int, "has_gauss": 0 | 1, "gauss": float}}

``event``: the states hold after that event of the segment; ``step``: the step whose pre-hook captured
them, null for a flush point. ``rank``: the logging process's ``torch.distributed`` rank (0 without a
process group). A replay sets the states only in the process of that rank: the other ranks of a DDP job
replay the same log (one rank logs), and their generators are their own.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .checks import StepLogFormatError, _index, _range

_MT_WORDS = 624
MAX_STATE_BYTES = 1 << 20
"""A logged torch generator state is at most this large (the CPU one is ~5 KB, a CUDA one 16 bytes)."""
MAX_DEVICES = 1024


@dataclass
class RngState:
    """The generators' states after one step (``capture``), or as a segment logged them (``decode``)."""

    python: tuple
    numpy: tuple
    torch: torch.Tensor
    cuda: list[torch.Tensor]
    step: int | None = 0
    """The step whose pre-hook captured them; None: a flush point (``event``)."""
    event: int = 0
    rank: int = 0
    where: str = ""
    """The segment that logged them (for errors)."""


def capture() -> RngState:
    """Training thread, at each step's pre-hook: the states as they are (about 45 us, numpy's most)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return RngState(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def encode(state: RngState, event: int, step: int | None, parts: list[bytes], offset: int, raw: list) -> dict | None:
    """The header entry of ``state`` (the states after event ``event``: the pre-hook of step ``step``, or
    a flush point with ``step`` None), its bytes appended to ``parts`` (the payload from byte ``offset``;
    ``raw``: the raw pipeline's spec). None if a state is not one this format holds (a python or numpy
    generator replaced by another kind: not logged)."""
    py_version, mt, gauss = state.python
    name, key, pos, has_gauss, cached = state.numpy
    if (py_version != 3 or len(mt) != _MT_WORDS + 1 or name != "MT19937" or len(key) != _MT_WORDS
            or not (gauss is None or math.isfinite(gauss)) or not math.isfinite(cached)):
        return None

    def put(data: bytes) -> list:
        nonlocal offset
        parts.append(data)
        offset += len(data)
        return [offset - len(data), len(data), raw]

    return {"event": event, "step": step, "rank": rank(), "torch": put(state.torch.numpy().tobytes()),
            "cuda": [put(s.numpy().tobytes()) for s in state.cuda],
            "python": {"version": 3, "mt": put(np.asarray(mt, "<u4").tobytes()), "gauss": gauss},
            "numpy": {"mt": put(np.asarray(key, "<u4").tobytes()), "pos": int(pos), "has_gauss": int(has_gauss),
                      "gauss": float(cached)}}


def check(r: Any, where: str, payload: int, lo: int, hi: int) -> None:
    """A header's ``rng`` entry (hostile input: typed and bounded before use), of a segment of events
    ``(lo, hi]``."""
    what = f"{where}: field 'rng'"
    if not isinstance(r, dict) or set(r) != {"event", "step", "rank", "torch", "cuda", "python", "numpy"}:
        raise StepLogFormatError(f"{what} must hold event, step, rank, torch, cuda, python and numpy")
    if not lo < _index(r["event"], what, "event") <= hi:
        raise StepLogFormatError(f"{what}: event {r['event']} is not one of the segment's ({lo}, {hi}]")
    if r["step"] is not None:
        _index(r["step"], what, "step")
    _index(r["rank"], what, "rank")
    py, npy, cuda = r["python"], r["numpy"], r["cuda"]
    if (not isinstance(py, dict) or set(py) != {"version", "mt", "gauss"} or type(py["version"]) is not int
            or py["version"] != 3 or not _finite_or_none(py["gauss"])):
        raise StepLogFormatError(f"{what}: 'python' must be {{version: 3, mt, gauss: a finite number or null}}")
    if (not isinstance(npy, dict) or set(npy) != {"mt", "pos", "has_gauss", "gauss"}
            or type(npy["pos"]) is not int or not 0 <= npy["pos"] <= _MT_WORDS
            or type(npy["has_gauss"]) is not int or npy["has_gauss"] not in (0, 1) or not _finite(npy["gauss"])):
        raise StepLogFormatError(f"{what}: 'numpy' must be {{mt, pos in [0, {_MT_WORDS}], has_gauss 0 or 1, "
                                 "gauss: a finite number}")
    if not isinstance(cuda, list) or len(cuda) > MAX_DEVICES:
        raise StepLogFormatError(f"{what}: 'cuda' must list at most {MAX_DEVICES} states")
    sized = [(py["mt"], 4 * (_MT_WORDS + 1), "python.mt"), (npy["mt"], 4 * _MT_WORDS, "numpy.mt"),
             (r["torch"], None, "torch"), *((c, None, "cuda") for c in cuda)]
    for ref, size, name in sized:
        _range(ref, what, name, payload)
        if (ref[1] != size) if size is not None else not 0 < ref[1] <= MAX_STATE_BYTES:
            raise StepLogFormatError(f"{what}: '{name}' holds {ref[1]} bytes, expected "
                                     f"{size if size is not None else f'1 to {MAX_STATE_BYTES}'}")


def decode(r: dict, read: Callable[[list, int], torch.Tensor]) -> RngState:
    """The states of a checked ``rng`` entry; ``read(range, nbytes)``: its bytes as a uint8 tensor."""
    def words(ref: list) -> np.ndarray:
        return read(ref, ref[1]).numpy().view("<u4").astype(np.uint32)

    py, npy = r["python"], r["numpy"]
    mt = words(py["mt"])
    return RngState((3, tuple(int(x) for x in mt), py["gauss"]),
                    ("MT19937", words(npy["mt"]), npy["pos"], npy["has_gauss"], float(npy["gauss"])),
                    read(r["torch"], r["torch"][1]).clone(), [read(c, c[1]).clone() for c in r["cuda"]],
                    r["step"], r["event"], r["rank"])


def track(pos: Any, ev: dict, event: int, entry: dict | None, where: str,
          read: Callable[[list, int], torch.Tensor]) -> None:
    """Replay, after applying event ``event`` (``ev``) of a segment whose header's ``rng`` is ``entry``: keep
    ``pos.rng`` the states that hold after it, or None (``pos.rng_lost``: why, when the log had states
    that no longer hold: a skipped step's batch after a step's, anything after a flush point's)."""
    scale = (ev.get("scaler") or {}).get("scale") if ev["kind"] == "state" else None
    if entry is not None and entry["event"] == event:
        pos.rng, pos.rng_lost = decode(entry, read), None
        pos.rng.where = where
    elif ev["kind"] == "step":
        pos.rng, pos.rng_lost = None, None  # a step inside a segment: the segment's end has its own
    elif pos.rng is not None and (pos.rng.step is None or (scale is not None and pos.scale is not None
                                                           and scale < pos.scale)):
        pos.rng_lost = (f"a batch whose step the GradScaler skipped followed step {pos.rng.step}" if pos.rng.step
                        is not None else f"state was logged after the flush point at event {pos.rng.event}")
        pos.rng = None
    if scale is not None:
        pos.scale = scale


def restore(state: RngState, where: str) -> None:
    """Set every generator to ``state`` (CUDA: the devices this process has, of those logged). A state
    a generator refuses raises ``StepLogFormatError`` naming ``where``, before any generator is set."""
    if state.python[1][-1] > _MT_WORDS:
        raise StepLogFormatError(f"{where}: the logged python RNG state has position {state.python[1][-1]}, "
                                 f"more than {_MT_WORDS}")
    before = capture()
    try:
        torch.set_rng_state(state.torch)  # torch validates the contents; any refusal undoes them all
        random.setstate(state.python)
        np.random.set_state(state.numpy)
        devices = torch.cuda.device_count() if state.cuda and torch.cuda.is_available() else 0
        for i, s in enumerate(state.cuda[:devices]):
            torch.cuda.set_rng_state(s, i)
    except (RuntimeError, ValueError, TypeError) as exc:
        torch.set_rng_state(before.torch)
        random.setstate(before.python)
        np.random.set_state(before.numpy)
        for i, s in enumerate(before.cuda):
            torch.cuda.set_rng_state(s, i)
        raise StepLogFormatError(f"{where}: the logged RNG state after event {state.event} is refused: "
                                 f"{str(exc)[:200]}") from None


def _finite(v: Any) -> bool:
    return type(v) is float and math.isfinite(v) or type(v) is int and abs(v) < 2**53  # 10**400: no OverflowError


def _finite_or_none(v: Any) -> bool:
    return v is None or _finite(v)
