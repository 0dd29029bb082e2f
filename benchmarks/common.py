"""Shared helpers of the checkrun benchmarks: machine info, timing, tables, states, peers.

Benchmarks are not tests: they print markdown tables of medians (of 3 unless said otherwise) and
ratios against peers measured in the same run, because other work on the machine moves absolute
numbers. Every table is preceded by the load average, so a reader can judge the noise.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/bench_x.py` from the repository root
    sys.path.insert(0, str(ROOT))

MB = 1e6
GiB = 2**30


# -- machine / environment ----------------------------------------------------------------------
def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine_info() -> dict:
    """The machine and moment of a measurement (for the JSON results and the report's captions)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "arch": platform.machine(),
            "cores": os.cpu_count(), "ram_gib": round(mem, 1), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def write_json(path: str | None, bench: str, args: Any, results: Any, started: dict | None = None) -> None:
    """Write a benchmark's raw per-run measurements (``--json PATH``) for ``benchmarks.report``.

    ``started`` is ``machine_info()`` taken when the benchmark began; the end's load average is added."""
    if not path:
        return
    import json

    info = started or machine_info()
    info = {**info, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    argd = {k: v for k, v in vars(args).items() if k not in ("json", "dir")} if args is not None else {}
    data = {"bench": bench, "machine": info, "args": argd, "results": results}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, out)


def machine_header(title: str) -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return (f"## {title}\n\n{datetime.datetime.now().isoformat(timespec='seconds')} | "
            f"{platform.machine()} {os.cpu_count()} cores, {mem:.0f} GiB | torch {torch.__version__} "
            f"({torch.get_num_threads()} threads) | python {platform.python_version()} | "
            f"load average {loadavg()}\n")


def drop_caches() -> bool:
    """Drop the page cache (root on Linux only); False where not allowed (then loads are warm)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss() -> int:
    return _status("VmRSS")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    return _status("VmHWM")


# -- numbers and tables -------------------------------------------------------------------------
def med(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def overheads(samples: dict[str, list[float]], base: str) -> dict[str, tuple[float, float]]:
    """{name: (mean of its samples - mean of ``base``'s, one standard error of that difference)}."""
    def se(xs: list[float]) -> float:
        return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")

    ref = statistics.mean(samples[base])
    return {name: (statistics.mean(xs) - ref, 0.0 if name == base else math.hypot(se(xs), se(samples[base])))
            for name, xs in samples.items()}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{digits}f}" if abs(x) < 1000 else f"{x:,.0f}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return str(x)


def table(headers: list[str], rows: list[list[Any]], digits: int = 3) -> str:
    cells = [[fmt(c, digits) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in cells])


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


# -- files --------------------------------------------------------------------------------------
def workdir(arg: str | None) -> Path:
    """The benchmark's scratch directory (created; ``cleanup`` removes it)."""
    path = Path(arg) if arg else Path(tempfile.mkdtemp(prefix="checkrun-bench-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return path


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def torch_save_file(obj: Any, path: Path, fsync: bool = True) -> tuple[float, float]:
    """torch.save into a file; (seconds of the torch.save call, seconds until fsync'd)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(obj, f)
        t1 = time.perf_counter()
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return t1 - t0, time.perf_counter() - t0


def state_bytes(state: Any) -> int:
    """Bytes of the distinct tensor storages in ``state`` (views of one storage count once)."""
    distinct = {(t.untyped_storage().data_ptr(), t.nbytes): t.nbytes for t in tensors(state)}
    return sum(distinct.values())


def tensors(state: Any) -> list[torch.Tensor]:
    out = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(state)
    return out


def floor_copy(state: Any, bufs: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """The floor of any snapshot: copy every tensor into buffers allocated once and reused."""
    ts = tensors(state)
    if bufs is None:
        bufs = [torch.empty_like(t) for t in ts]
    for b, t in zip(bufs, ts):
        b.copy_(t)
    return bufs


# -- states -------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-like decoder with tied input/output embeddings (GPT-2 init: N(0, 0.02))."""

    def __init__(self, vocab: int, d: int, layers: int, ctx: int = 256) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.wte.weight.t()


def gpt_model(state_mb: float, d: int | None = None) -> GPT:
    """A GPT whose parameters + two Adam moments take about ``state_mb`` MB in fp32 (width 768; 384 below
    192 MB, where one 768-wide layer alone would overshoot the size)."""
    d = d or (768 if state_mb >= 192 else 384)
    params = state_mb * MB / 12
    vocab = max(1024, int(0.28 * params / d))
    layers = max(1, round((params - vocab * d) / (12 * d * d)))
    torch.manual_seed(0)
    return GPT(vocab, d, layers)


def adam_steps(model: nn.Module, steps: int = 3, batch: int = 2, ctx: int = 64,
               opt: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
    """Real LM training steps on random tokens, so Adam's moments have real statistics."""
    opt = opt or torch.optim.Adam(model.parameters(), lr=1e-4)
    vocab = model.wte.num_embeddings
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(vocab, (batch, ctx + 1), generator=gen)
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def gpt_state(state_mb: float, steps: int = 2) -> dict:
    """Lightning-like training state: model weights + Adam state after ``steps`` real steps."""
    model = gpt_model(state_mb)
    opt = adam_steps(model, steps)
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
            "global_step": steps, "epoch": 0}


def cast_state(state: Any, dtype: torch.dtype) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(dtype) if state.is_floating_point() else state.clone()
    if isinstance(state, dict):
        return type(state)((k, cast_state(v, dtype)) for k, v in state.items())
    if isinstance(state, list):
        return [cast_state(v, dtype) for v in state]
    return state


def dlrm_state(table_mb: float, dim: int = 64, tables: int = 8, seed: int = 0) -> dict:
    """DLRM-like state: ``tables`` embedding tables (``table_mb`` MB of fp32 in all), TorchRec-style
    row-wise Adagrad state (one fp32 ``momentum`` per row, 1-D), and a small MLP with Adam."""
    g = torch.Generator().manual_seed(seed)
    rows = max(1024, int(table_mb * MB / 4 / dim / tables))
    model, optim = {}, {}
    for i in range(tables):
        model[f"emb.{i}.weight"] = torch.randn(rows, dim, generator=g) * 0.02
        # sum of squared gradients: positive, heavy-tailed across rows (hot and cold rows)
        optim[f"emb.{i}.momentum"] = (torch.randn(rows, generator=g) * 1e-3).pow(2) * \
            torch.empty(rows).exponential_(1.0, generator=g) * 100
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, dim),
                        nn.Linear(dim * (tables + 1), 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                        nn.Linear(256, 1))
    adam = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    for p in mlp.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    adam.step()
    for k, v in mlp.state_dict().items():
        model[f"mlp.{k}"] = v
    return {"model": model, "sparse_optim": optim, "dense_optim": adam.state_dict(), "mlp": mlp,
            "adam": adam, "step": 0}


def dlrm_payload(st: dict) -> dict:
    """What is checkpointed (the live ``mlp``/``adam`` objects are not)."""
    return {"model": st["model"], "sparse_optim": st["sparse_optim"], "dense_optim": st["adam"].state_dict(),
            "step": st["step"]}


def dlrm_interval(st: dict, frac: float = 0.05, seed: int = 0) -> None:
    """One checkpoint interval of training: ``frac`` of each table's rows (and their Adagrad
    state) change; every dense MLP parameter changes (an Adam step)."""
    g = torch.Generator().manual_seed(1000 + seed)
    for key, w in st["model"].items():
        if not key.startswith("emb."):
            continue
        idx = torch.randperm(w.shape[0], generator=g)[: max(1, int(frac * w.shape[0]))]
        grad = torch.randn(len(idx), w.shape[1], generator=g) * 1e-2
        mom = st["sparse_optim"][key.replace(".weight", ".momentum")]
        mom[idx] += grad.pow(2).mean(dim=1)
        w[idx] -= 0.01 * grad / (mom[idx].sqrt().unsqueeze(1) + 1e-8)
    for p in st["mlp"].parameters():
        p.grad = torch.randn_like(p) * 1e-2
    st["adam"].step()
    with torch.no_grad():
        for k, v in st["mlp"].state_dict().items():
            st["model"][f"mlp.{k}"].copy_(v)
    st["step"] += 1


# -- checkrun ---------------------------------------------------------------------------------
def engine_config(**dotted: Any):
    from ckpt_core import EngineConfig

    return EngineConfig().replace(**dotted) if dotted else EngineConfig()


def run_module(module: str, args: list[str]) -> int:
    """Run ``python -m benchmarks.<module> args`` from the repository root; its return code."""
    return subprocess.call([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT)


def cached_state(name: str, builder: Callable[[], Any], cache: str | None = None) -> Any:
    """Build a benchmark state once and keep it under ``~/.cache/checkrun-bench`` (building the
    GPT state runs real training steps: about a minute on two cores)."""
    root = Path(cache or os.environ.get("CHECKRUN_BENCH_CACHE", Path.home() / ".cache" / "checkrun-bench"))
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    state = builder()
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return state
