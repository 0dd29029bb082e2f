"""Which tensors are quantized, and how: matching ``QuantRule``s against flattened state keys.
Stage: plan (``saving.plan`` asks it for every tensor before anything is written).

Rules are opt-in and ordered; the first rule that fits a tensor wins. Some tensors are never
quantized whatever the rules say: non-floating dtypes (integers, bool, complex; also float8,
which has nothing left to save), 0-d tensors, and optimizer step counters (keys whose last
dot-separated component is ``step``) - losing precision there would corrupt training state
rather than perturb it.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from fnmatch import fnmatchcase
from typing import Any, Optional

import torch

from ..codecs._common import QUANTIZABLE_DTYPES  # dtypes a rule may quantize: those the lossy codecs take
from ..config import QuantRule
from ..errors import ConfigError


def adaptive_bits(expected_restores: int) -> int:
    """Check-N-Run's adaptive bit width: the more often a checkpoint may be restored, the more
    error would accumulate, so the more bits: 2 for 1 restore, 3 up to 3, 4 up to 20, else 8."""
    if expected_restores <= 1:
        return 2
    if expected_restores <= 3:
        return 3
    if expected_restores <= 20:
        return 4
    return 8


def rule_dtype(rule: QuantRule) -> Optional[torch.dtype]:
    """The torch dtype a rule's ``dtype`` string names (``"float32"``, ``"torch.half"``, ...).

    ConfigError for a name that is not a torch dtype, so a typo fails loudly at the first match.
    """
    if rule.dtype is None:
        return None
    name = rule.dtype[6:] if rule.dtype.startswith("torch.") else rule.dtype
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"quantization rule {rule.pattern!r}: unknown dtype {rule.dtype!r}")
    return dtype


def never_quantized(key: str, dtype: torch.dtype, ndim: int) -> bool:
    """True for tensors no rule may touch (see the module docstring)."""
    return dtype not in QUANTIZABLE_DTYPES or ndim == 0 or key.rsplit(".", 1)[-1] == "step"


def match_rule(key: str, dtype: torch.dtype, numel: int, ndim: int,
               rules: tuple[QuantRule, ...]) -> QuantRule | None:
    """The first rule whose glob ``pattern`` (case-sensitive, on the flattened dot-joined key)
    matches, whose ``dtype`` (if set) is the tensor's and whose ``min_numel`` <= ``numel``;
    None if there is none or the tensor is never quantized."""
    return _match(key, dtype, numel, ndim, rules)[1]


def _match(key: str, dtype: torch.dtype, numel: int, ndim: int,
           rules: tuple[QuantRule, ...]) -> tuple[int, QuantRule | None]:
    if never_quantized(key, dtype, ndim):
        return -1, None
    return _first(key, dtype, numel, rules)


def _first(key: str, dtype: torch.dtype, numel: int, rules: tuple[QuantRule, ...]) -> tuple[int, QuantRule | None]:
    """The first rule whose pattern, dtype and ``min_numel`` admit the tensor (exemptions aside)."""
    for index, rule in enumerate(rules):
        if not fnmatchcase(key, rule.pattern):
            continue
        wanted = rule_dtype(rule)
        if (wanted is None or wanted == dtype) and numel >= rule.min_numel:
            return index, rule
    return -1, None


def tied_lossless(staged: tuple, flat: Any, sources: list[int], rules: tuple[QuantRule, ...]) -> tuple:
    """``staged`` (one ``StagedTensor`` per distinct tensor), with ``lossless`` set on each that is saved
    under several keys (tied weights: ``flat`` is the state's ``tree.Flattened``, whose tensor leaves
    are views of one memory or whose ``repeats`` are one tensor object again; ``sources`` the staged
    index of each leaf) that the rules treat differently: it is stored once, under its first key, and a
    rule that names only one of its keys must not make the others lossy (found by independent checks: a
    rule for ``emb.weight`` quantized the tied ``head.weight``, or matched "no tensor" with the keys
    the other way round). A warning names both keys."""
    if not rules:
        return staged
    mixed: dict[int, str] = {}
    others: dict[int, list[str]] = {}  # keys of each tensor whose rule is another one (of any settings)
    keys = [(leaf.key, i) for leaf, i in zip(flat.tensors, sources)]
    for key, i in keys + [(key, sources[leaf]) for leaf, key in flat.repeats]:
        st = staged[i]
        if key == st.key:
            continue
        numel = math.prod(st.shape)
        a = _match(st.key, st.dtype, numel, len(st.shape), rules)[1]
        b = _match(key, st.dtype, numel, len(st.shape), rules)[1]
        if a is not b:
            others.setdefault(i, []).append(key)
        same = a is not None and b is not None and _settings(a) == _settings(b)  # one treatment
        if a is not b and i not in mixed and not same:
            mixed[i] = key
    for i, other in mixed.items():
        warnings.warn(f"checkrun: {staged[i].key!r} and {other!r} are one tensor (tied) that the quantization "
                      "rules treat differently; it is stored lossless. Give both keys the same rule to quantize it",
                      UserWarning, stacklevel=4)
    for group in _overlapping(flat, sources):  # views of one memory in other shapes (h162)
        if all(_match(staged[i].key, staged[i].dtype, math.prod(staged[i].shape), len(staged[i].shape), rules)[1]
               is None for i in group):
            continue
        names = [staged[i].key for i in sorted(group, key=lambda i: -math.prod(staged[i].shape))]  # largest first
        for i in group:
            mixed.setdefault(i, names[0])
            others.setdefault(i, []).extend(n for n in names if n != staged[i].key)
        more = f" and {len(names) - 2} more" if len(names) > 2 else ""
        warnings.warn(f"checkrun: {names[0]!r} and {names[1]!r}{more} are overlapping views of one memory, which "
                      "quantization would store as different values; they are stored lossless. Save one of them, or "
                      "give no rule to any", UserWarning, stacklevel=4)
    return tuple(dataclasses.replace(st, tied=tuple(others[i]), lossless=i in mixed) if i in others else st
                 for i, st in enumerate(staged))


def _region(t: torch.Tensor) -> tuple | None:
    """(device, first address, end address) of the memory a strided tensor reads (absolute: two storages over one
    memory, ``torch.from_numpy`` of two numpy views, are compared too: h168); None for other tensors. The span
    from its first to its last element: interleaved slices (``w[:, ::2]``, ``w[:, 1::2]``) count as overlapping."""
    if not t.numel() or t.layout != torch.strided:
        return None
    try:
        lo = hi = 0
        for n, step in zip(t.shape, t.stride()):
            lo, hi = (lo + (n - 1) * step, hi) if step < 0 else (lo, hi + (n - 1) * step)
        base, size = t.data_ptr(), t.element_size()
        return (str(t.device), 0, base + lo * size, base + (hi + 1) * size)
    except (RuntimeError, NotImplementedError):  # a tensor without memory of its own (a subclass, a wrapper)
        return None


def _overlapping(flat: Any, sources: list[int]) -> list[list[int]]:
    """Groups of two or more staged tensors (indices) whose memory overlaps: views of one memory that are not
    one tensor (other shapes or offsets: a table and a slice of its rows, its transpose, its flat view)."""
    regions = {}
    for leaf, i in zip(flat.tensors, sources):
        if i not in regions and (r := _region(leaf.tensor)) is not None:
            regions[i] = r
    groups, current, where, end = [], [], None, 0
    for i, (device, ptr, lo, hi) in sorted(regions.items(), key=lambda item: item[1]):
        if current and where == (device, ptr) and lo < end:
            current.append(i)
            end = max(end, hi)
            continue
        groups.append(current)
        current, where, end = [i], (device, ptr), hi
    return [g for g in groups + [current] if len(g) > 1]


def _settings(rule: QuantRule) -> QuantRule:
    """What a rule does to the tensors it matches (its settings without its pattern)."""
    return dataclasses.replace(rule, pattern="")


class RuleMatcher:
    """``match_rule`` over a fixed rule list, remembering which rules were ever selected.

    Thread-safe. The planner (``plan.Planner``) calls ``choose`` for every tensor a save writes
    and the engine, once a save is written, ``unmatched_rules`` to warn once about rules that
    selected nothing (usually a typo in a pattern).
    """

    def __init__(self, rules: tuple[QuantRule, ...] | list[QuantRule]) -> None:
        self.rules = tuple(rules)
        for rule in self.rules:
            rule_dtype(rule)  # fail on a bad dtype name now, not at the first matching tensor
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Picklable (DCP's process-based ``async_save`` pickles the storage writer that holds one)."""
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def select(self, key: str, tensor: torch.Tensor) -> QuantRule | None:
        """The rule for this tensor (see ``match_rule``), or None to store it lossless."""
        return self.choose(key, tensor.dtype, tensor.numel(), tensor.dim())

    def choose(self, key: str, dtype: torch.dtype, numel: int, ndim: int) -> QuantRule | None:
        """``select`` from a tensor's metadata alone (planning needs no tensor data)."""
        index, rule = _match(key, dtype, numel, ndim, self.rules)
        if rule is None and len(self._used) < len(self.rules) and never_quantized(key, dtype, ndim):
            # a rule naming tensors no rule may touch (the step counters of docs/quantization.md's Adam
            # example) matched them: no "matched no tensor, check its pattern" warning (h148)
            index = _first(key, dtype, numel, self.rules)[0]  # the rule that would have taken it (h152)
        if index >= 0 and index not in self._used:
            with self._lock:
                self._used.add(index)
        return rule

    def unmatched_rules(self) -> tuple[QuantRule, ...]:
        """Rules, in order, that ``select`` has never returned."""
        with self._lock:
            return tuple(rule for i, rule in enumerate(self.rules) if i not in self._used)
