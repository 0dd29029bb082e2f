"""What a step log records besides gradients (format version 2): the run header's optimizer class,
parameter names and owner, and the ``GradScaler`` state of ``state`` events.

Built on the training thread (``StepLog``); parsed as hostile input (``format``): every value is
checked for type, length and count before use. Nothing here imports or calls code named by a log:
the optimizer's class is a string, looked up by ``checkrun export`` among ``torch.optim``'s classes only.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import FormatError
from ..storage import owner

MAX_OPTIMIZER_CHARS = 256
MAX_NAME_CHARS = 1024
MAX_GROUPS = 10_000
MAX_NAMES = 100_000
MAX_HOST_CHARS = 512
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*){0,31}")
_WRITER = re.compile(r"[0-9a-f]{1,32}")
SCALER_KEYS = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
                "_growth_tracker": int}


# ----------------------------------------------------------------------------- building (training thread)
def class_name(obj: Any) -> str:
    """``module.qualname`` of ``obj``'s class (``torch.optim.adam.Adam``)."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def param_names(optimizer: Any, model: Any = None) -> list[list[str]] | None:
    """The names of the optimizer's parameters per group: the groups' own ``param_names`` (torch >= 2.6,
    an optimizer built from ``named_parameters()``), else ``model``'s names of the same tensors; None
    when some parameter has no name, or the names exceed the format's limits."""
    groups = optimizer.param_groups
    if all(isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(g["params"]) for g in groups):
        names = [list(g["param_names"]) for g in groups]
    elif model is not None:
        by_id = {}
        for name, p in model.named_parameters():
            by_id.setdefault(id(p), name)
        names = [[by_id.get(id(p)) for p in g["params"]] for g in groups]
    else:
        return None
    try:
        check_param_names(names, "param_names")
    except FormatError:
        return None
    return names


def owner_record() -> dict:
    """This process (writer id, pid, start time, host key), as lease objects record it."""
    return owner.identity()


def owner_gone(rec: dict | None) -> bool:
    """Whether the process ``rec`` names has certainly ended (same host only; unknown: False)."""
    return rec is not None and owner.is_gone(rec["host"], rec["pid"], rec["start"])


def scaler_state(scaler: Any) -> dict | None:
    """A ``GradScaler``'s state as plain numbers (scale, growth tracker, factors), None when disabled.
    ``state_dict`` reads the scale with ``.item()``: one device sync on CUDA (``scaler.step`` syncs too)."""
    if scaler is None or not scaler.is_enabled():
        return None
    state = scaler.state_dict()
    return {k: (float(state[k]) if typ is float else int(state[k])) for k, typ in SCALER_KEYS.items()}


MAX_COUNTERS = 64


def check_counters(v: Any) -> dict | None:
    """The caller's counters (``step_log(counters=)``) or a state record's ``counters``: at most 64
    names of 1-64 characters to integers in [0, 2**53)."""
    if v is None:
        return None
    if (not isinstance(v, dict) or len(v) > MAX_COUNTERS
            or not all(isinstance(k, str) and 0 < len(k) <= 64 and type(n) is int and 0 <= n < 2**53
                       for k, n in v.items())):
        raise FormatError(f"counters must be a mapping of at most {MAX_COUNTERS} names (1-64 characters) to "
                          "integers in [0, 2**53)")
    return dict(v)


# ----------------------------------------------------------------------------- parsing (hostile input)
def check_optimizer(v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or len(v) > MAX_OPTIMIZER_CHARS or not _DOTTED.fullmatch(v)):
        raise FormatError(f"field 'optimizer' must be null or a dotted class name of at most {MAX_OPTIMIZER_CHARS} "
                        "characters")
    return v


def check_param_names(v: Any, what: str = "field 'param_names'") -> tuple[tuple[str, ...], ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > MAX_GROUPS or not all(isinstance(g, list) for g in v):
        raise FormatError(f"{what} must be null or a list of at most {MAX_GROUPS} lists of names")
    if sum(len(g) for g in v) > MAX_NAMES:
        raise FormatError(f"{what} holds more than {MAX_NAMES} names")
    if not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS for g in v for n in g):
        raise FormatError(f"{what}: every name must be a string of 1 to {MAX_NAME_CHARS} characters")
    return tuple(tuple(g) for g in v)


def check_owner(v: Any) -> dict | None:
    if v is None:
        return None
    if (not isinstance(v, dict) or set(v) != {"writer", "pid", "start", "host"}
            or not isinstance(v["writer"], str) or not _WRITER.fullmatch(v["writer"])
            or not isinstance(v["host"], str) or len(v["host"]) > MAX_HOST_CHARS
            or not all(type(v[k]) is int and 0 <= v[k] < 2**64 for k in ("pid", "start"))):
        raise FormatError("field 'owner' must be null or {writer, pid, start, host}")
    return dict(v)


def check_scaler(v: Any) -> dict | None:
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) != set(SCALER_KEYS):
        raise FormatError(f"field 'scaler' must be null or {{{', '.join(sorted(SCALER_KEYS))}}}")
    for k, typ in SCALER_KEYS.items():
        x = v[k]
        ok = (type(x) in (int, float) and x == x) if typ is float else (type(x) is int and 0 <= x < 2**63)
        if not ok:
            raise FormatError(f"field 'scaler.{k}' must be a {'number' if typ is float else 'non-negative integer'}")
    return v
