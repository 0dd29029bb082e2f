"""``checkrun export CKPT|DIR --step N OUT``: the state replayed to logged step N (docs/steplog.md).

The checkpoint whose marker is the newest at or before step N is loaded; its optimizer is rebuilt
and the logged steps up to N are replayed into it. What the replay needs and where it comes from:

* the optimizer's class: the one the log's run header records (format version 2), looked up among
  ``torch.optim``'s classes by module and name, never imported from the log (loading never executes
  code a checkpoint names); ``--optimizer NAME`` overrides it, and is needed for a log that records
  none (version 1) or a class outside ``torch.optim``; only a class of ``torch.optim`` is accepted;
* which checkpoint tensors are its parameters: the optimizer state's ``param_names`` (torch >= 2.6
  records them for an optimizer built from ``model.named_parameters()``), else the names the log's
  run header records (the adapters and ``step_log(model=)`` record the model's), and the one
  dictionary of the state that holds a tensor under every such name (the model's state dict);
* the LR scheduler: the one dictionary of the state shaped like a scheduler's ``state_dict``
  (``last_epoch`` and ``_step_count``), if any; the log's scheduler records are applied to it;
* the ``GradScaler``: the one dictionary with exactly a scaler's ``state_dict`` keys (``scale``,
  ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``), if any; the
  scaler state of the log's records (written when the log had ``scaler=``) is applied to it.

Anything missing or ambiguous is an error that says so: nothing is guessed.
"""
from __future__ import annotations

from typing import Any

import torch

from .composite import open_view
from .steplog import chain_of, chain_steps, segments_store, has_log
from .util import EXIT_USAGE, CliError, Context, log, one_line
from ..errors import CheckpointNotFoundError, CheckrunError
from ..steplog.format import SegmentDamaged, decode_limit
from ..steplog.index import LogIndex, find_marker, read_index
from ..steplog.replay import Payload, apply_event, read_segment
from ..steplog.capture import flat_params
from ..steplog.meta import SCALER_KEYS

_MAX_DEPTH = 8


def _optimizer_classes() -> dict[str, type]:
    """torch.optim's optimizer classes by short name (``Adam``)."""
    return {n: getattr(torch.optim, n) for n in sorted(torch.optim.__all__)
            if isinstance(getattr(torch.optim, n, None), type) and n != "Optimizer"
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)}


def logged_class(recorded: str | None) -> type:
    """The ``torch.optim`` class whose ``module.qualname`` the log records (``torch.optim.adam.Adam``):
    a look-up in torch.optim's own classes, never an import of the recorded module."""
    classes = _optimizer_classes()
    if recorded is None:
        raise CliError("--step needs --optimizer NAME: this step log does not record the optimizer's class "
                       f"(written before format version 2; one of torch.optim's: {', '.join(classes)})", EXIT_USAGE)
    by_path = {f"{c.__module__}.{c.__qualname__}": c for c in classes.values()}
    if recorded not in by_path:
        raise CliError(f"--step needs --optimizer NAME: the step log records the optimizer class {recorded!r}, "
                       "which is not one of torch.optim's (checkrun imports no other code); name the torch.optim "
                       f"class that steps like it (one of: {', '.join(classes)})", EXIT_USAGE)
    return by_path[recorded]


def optimizer_class(name: str) -> type:
    """The ``torch.optim`` class called ``name`` (an error naming the choices otherwise)."""
    choices = list(_optimizer_classes())
    short = name.removeprefix("torch.optim.")
    if short not in choices:
        raise CliError(f"--optimizer {name!r}: not a torch.optim optimizer class (one of: {', '.join(choices)})",
                       EXIT_USAGE)
    return getattr(torch.optim, short)


def _candidates(ctx: Context, src: str) -> tuple[str, list[Any]]:
    """(directory, its committed checkpoints to start from): all of a directory, or the one named."""
    if ctx.kind(src) == "file":
        directory, _, name = src.replace("\\", "/").rpartition("/")
        directory = directory or "."
        entries = [e for e in ctx.engine.list(directory, storage_options=ctx.storage_options) if e.name == name]
        if not entries or entries[0].manifest is None:
            raise CliError(f"{src}: not a committed checkpoint of {directory}")
        return directory, entries
    if ctx.kind(src) == "missing":
        raise CliError(f"{src}: no such checkpoint or directory")
    return src.rstrip("/"), [e for e in ctx.engine.list(src, storage_options=ctx.storage_options)
                             if e.manifest is not None]


def choose_start(ctx: Context, src: str, step: int) -> tuple[Any, Any, LogIndex, Any]:
    """(store of the log, the checkpoint entry, index, its chain) to replay to ``step``: the newest
    marker at or before ``step`` whose logged steps reach it."""
    directory, entries = _candidates(ctx, src)
    segs = segments_store(ctx, directory)
    if not has_log(segs):
        raise CliError(f"{directory}: has no step log ({segs.url('')}); --step needs one")
    index, cache, best, reach = read_index(segs), {}, None, []
    for e in entries:
        marker = find_marker(index, e.name, e.manifest.commit, strict=True)
        if marker is None or marker.step > step:
            continue
        chain = chain_of(index, marker)
        _, last, problem = chain_steps(segs, chain, cache)
        reach.append(f"{e.name}: steps {marker.step}..{last}" + (f" ({problem})" if problem else ""))
        if last >= step and (best is None or marker.step >= best[2].marker.step):
            best = (e, marker, chain)
    if best is None:
        detail = "; ".join(reach) or "no checkpoint with a marker at or before it"
        raise CliError(f"{src}: step {step} is not in the step log ({detail})")
    return segs, best[0], index, best[2]


def _walk_dicts(node: Any, depth: int = 0):
    if isinstance(node, dict):
        yield node
        children = node.values()
    elif isinstance(node, (list, tuple)):
        children = node
    else:
        return
    if depth < _MAX_DEPTH:
        for child in children:
            yield from _walk_dicts(child, depth + 1)


def _is_optimizer_state(d: dict) -> bool:
    return (set(d) == {"state", "param_groups"} and isinstance(d["param_groups"], list)
            and all(isinstance(g, dict) and "params" in g for g in d["param_groups"]))


def _one(found: list, what: str, where: str) -> Any:
    if len(found) != 1:
        raise CliError(f"{where}: --step needs exactly one {what} in the checkpoint's state, found {len(found)}")
    return found[0]


def _fits(names: Any, groups: list) -> bool:
    return (isinstance(names, (list, tuple)) and len(names) == len(groups)
            and all(isinstance(n, (list, tuple)) and len(n) == len(g["params"]) for n, g in zip(names, groups)))


def locate(state: Any, where: str, logged_names: Any = None) -> tuple[dict, dict, list[list[str]], dict | None,
                                                                    dict | None]:
    """(model state dict, optimizer state dict, parameter names per group, scheduler state or None,
    GradScaler state or None). The names: the optimizer state's ``param_names``, else
    ``logged_names`` (the log's run header)."""
    opt = _one([d for d in _walk_dicts(state) if _is_optimizer_state(d)], "optimizer state_dict", where)
    names = [g.get("param_names") for g in opt["param_groups"]]
    if not _fits(names, opt["param_groups"]):
        if logged_names is not None and not _fits(logged_names, opt["param_groups"]):
            raise CliError(f"{where}: the step log names {sum(map(len, logged_names))} parameters in "
                           f"{len(logged_names)} group(s), the optimizer state does not have that shape")
        if logged_names is None:
            raise CliError(f"{where}: neither the optimizer state (param_names) nor the step log names the "
                           "parameters, so the logged gradients cannot be matched to the model's tensors (build the "
                           "optimizer from model.named_parameters(), or pass model= to engine.step_log)")
        names = [list(n) for n in logged_names]
    flat = [n for group in names for n in group]
    model = _one([d for d in _walk_dicts(state) if d is not opt
                  and all(isinstance(d.get(n), torch.Tensor) for n in flat)], "model state_dict holding "
                 f"the optimizer's parameters {flat[:3]}...", where)
    scheds = [d for d in _walk_dicts(state) if "last_epoch" in d and "_step_count" in d]
    if len(scheds) > 1:
        raise CliError(f"{where}: {len(scheds)} LR scheduler states in the checkpoint; --step supports one")
    scalers = [d for d in _walk_dicts(state) if set(d) == set(SCALER_KEYS)]
    if len(scalers) > 1:
        raise CliError(f"{where}: {len(scalers)} GradScaler states in the checkpoint; --step supports one")
    return model, opt, names, scheds[0] if scheds else None, scalers[0] if scalers else None


class _SchedulerState:
    """Stands in for the LR scheduler (and the GradScaler): replay reads and sets its ``state_dict``
    (plain data), in place in the checkpoint's state."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def is_enabled(self) -> bool:  # as a GradScaler: its state is there, so it was enabled
        return True

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state.clear()
        self.state.update(state)


def build_optimizer(cls: type, model: dict, opt: dict, names: list[list[str]], where: str) -> Any:
    groups = []
    for group, gnames in zip(opt["param_groups"], names):
        params = [torch.nn.Parameter(model[n].detach().clone(), requires_grad=True) for n in gnames]
        if "param_names" in group:  # named as saved; a state without names stays without (h155)
            params = list(zip(gnames, params))
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": params})
    try:
        optimizer = cls(groups)
        own = set(optimizer.defaults)  # load_state_dict adds keys of torch's own (``differentiable``: h162)
        optimizer.load_state_dict(opt)
    except Exception as exc:  # noqa: BLE001 - torch's own errors: a state of another optimizer class
        raise CliError(f"{where}: the optimizer state does not load into torch.optim.{cls.__name__}: "
                       f"{one_line(exc)}") from None
    # load_state_dict takes the saved groups as they are: another class's lack this one's settings.
    missing = sorted({k for g in optimizer.param_groups for k in own if k not in g})
    if missing:
        raise CliError(f"{where}: the optimizer state does not load into torch.optim.{cls.__name__}: its "
                       f"parameter groups lack {', '.join(missing)} (saved by another optimizer class?)")
    return optimizer


def replay_to(segs: Any, chain: Any, step: int, optimizer: Any, sched: Any, max_bytes: int,
              scaler: Any = None, buffers: dict | None = None) -> tuple[int, bool]:
    """Apply the chain's events up to logged step ``step`` and the state records after it in its
    segment (a segment ends with the state at its flush point: the scheduler after that step), and
    the logged running statistics to ``buffers`` (the model's state dict). Returns (steps applied,
    whether the last of them set running statistics)."""
    done, at, stats = 0, chain.marker.step, False
    for seg, first, last in chain.pieces:
        where = segs.url(seg.name)
        try:
            header, payload = read_segment(segs, seg.name, max_bytes)
        except (SegmentDamaged, CheckpointNotFoundError) as exc:
            if at >= step:  # only the state records after step N could be here; its segment ended with them
                return done, stats
            raise CliError(f"{one_line(exc)}: the log ends early here, step {step} is not reachable") from None
        data = Payload(header, payload, max_bytes)
        for ev in header["events"][first - seg.lo - 1:last - seg.lo]:
            if ev["kind"] == "step" and (ev["step"] > step or at >= step):
                return done, stats
            nbuf = apply_event(ev, data, optimizer, sched, where, max_bytes, scaler, buffers)
            if ev["kind"] == "step":
                done, at, stats = done + 1, ev["step"], bool(nbuf)
    return done, stats


def replayed_state(ctx: Context, src: str, step: int, optimizer_name: str | None,
                   weights_only: bool) -> tuple[str, Any, dict]:
    """(the checkpoint used, the state replayed to ``step``, facts for the report)."""
    segs, entry, index, chain = choose_start(ctx, src, step)
    run = index.runs.get(chain.marker.run)
    cls = optimizer_class(optimizer_name) if optimizer_name is not None else logged_class(run and run.optimizer)
    url = src if ctx.kind(src) == "file" else f"{src.rstrip('/')}/{entry.name}"
    view = open_view(ctx, url)
    state = view.load(ctx, weights_only=weights_only)
    model, opt, names, sched, scaler = locate(state, url, run and run.param_names)
    optimizer = build_optimizer(cls, model, opt, names, url)
    try:
        replayed, stats = replay_to(segs, chain, step, optimizer, None if sched is None else _SchedulerState(sched),
                             decode_limit(ctx.engine.config.load), None if scaler is None else _SchedulerState(scaler),
                             model)
    except CliError:
        raise
    except CheckrunError as exc:
        raise CliError(one_line(exc)) from None
    for n, p in zip([n for g in names for n in g], flat_params(optimizer)):
        model[n] = p.detach()
    new = optimizer.state_dict()
    opt.clear()
    opt.update(new)
    if sched is None:
        log.info("checkrun: %s holds no LR scheduler state; only the optimizer's own hyperparameters are replayed",
                 url)
    lossy = sum(1 for p in view.pieces for r in p.manifest.tensors if r.quant)
    if replayed and lossy:  # as engine.replay warns (h148: export --step said nothing)
        log.warning("checkrun: %s stores %d tensor(s) quantized (lossy): the %d replayed step(s) start from the "
                    "quantized values, so the state is not the uninterrupted run's bit for bit", url, lossy, replayed)
    running = [k for k in model if k.rpartition(".")[2] in ("running_mean", "running_var", "num_batches_tracked")]
    if replayed and running and not stats:  # as engine.replay warns: the log has no running statistics
        log.warning("checkrun: %s: the step log holds no running statistics for step %d (logged without model=, "
                    "or by a checkrun before 2026-12-05 16:00, step-log format < 5); %d buffer(s) (%s) are the "
                    "checkpoint's", url, step, len(running), ", ".join(running[:3]))
    return url, state, {"from_checkpoint": url, "from_step": chain.marker.step, "step": step,
                        "replayed_steps": replayed, "optimizer": f"torch.optim.{cls.__name__}"}


def plain_values(state: Any, path: str = "", depth: int = 0) -> dict[str, Any]:
    """The state's plain leaves (not tensors, not containers) by dotted key."""
    out: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else None
    if items is None or depth > 64:
        if not isinstance(state, torch.Tensor) and isinstance(state, (str, int, float, bool, type(None))):
            out[path] = state
        return out
    for k, v in items:
        out.update(plain_values(v, f"{path}.{k}" if path else str(k), depth + 1))
    return out
