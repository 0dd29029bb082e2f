"""Lightning's ``ModelCheckpoint(save_last=...)`` with ``CheckrunCheckpointIO``: what the last checkpoint costs.

``save_last=True`` makes Lightning save the same state twice at every checkpoint (the top-k file, then
``last.ckpt``). The second save finds the first still in flight; its tensors are bitwise the same, so
it repeats that save (``ckpt_core.saving.repeat``: compared, not copied, no wait for a
``saving.max_pending`` slot); ``save_last="link"`` makes ``last.ckpt`` a symlink instead. For each setting (False,
True, "link") one real ``Trainer.fit`` of a ``Linear(2048, 8192)`` with Adam (~200 MB of state) on the
CPU, a checkpoint every 10 steps: the fit's wall time, each save's blocking time (``SaveInfo``), and how
long after the top-k file ``last.ckpt`` commits (the commit callbacks' times: a kill in between leaves
``ckpt_path="last"`` the previous one).

``--s3`` saves to a moto S3 server started on 127.0.0.1 (``save_last`` False and True: links are local
only), where each request is a round trip, and runs stock ``TorchCheckpointIO`` beside it; the table then
shows the S3 requests per checkpoint (s3fs's ``CALL:`` log lines, Lightning's own listing and existence
checks included; ``save_last=True`` counts as one checkpoint of two files). ``--features`` sizes the
layer (``Linear(2048, features)``; a smaller one suits moto, which holds every object in its memory).

Run: ``python -m benchmarks.bench_save_last [--steps 50] [--every 10] [--s3] [--features 8192]``.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from benchmarks.common import machine_header, table


class _Net(LightningModule):
    def __init__(self, features: int = 8192) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2048, features)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(1024, 2048), batch_size=8)


class _Requests(logging.Handler):
    """Counts the requests s3fs makes (it logs ``CALL: <operation> ...`` for each at DEBUG level)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += record.getMessage().startswith("CALL: ")


def run(save_last, steps: int, every: int, features: int = 8192, s3: dict | None = None, stock: bool = False) -> dict:
    """One fit; its wall seconds, the blocking milliseconds of the top-k and of the last saves, and the
    milliseconds from each top-k commit to the next ``last.ckpt`` commit. ``s3``: ``{"root", "options"}``
    of a bucket to save into instead of a temporary directory; ``stock``: Lightning's ``TorchCheckpointIO``."""
    from lightning.pytorch.plugins import TorchCheckpointIO

    from lightning_ckpt import CheckrunCheckpointIO

    torch.manual_seed(0)
    io = TorchCheckpointIO() if stock else CheckrunCheckpointIO(storage_options=s3["options"] if s3 else None)
    infos: list = []
    if not stock:
        io.add_save_callback(lambda info: infos.append((info, time.perf_counter())))
    requests, s3fs_log = _Requests(), logging.getLogger("s3fs")
    s3fs_log.addHandler(requests)
    s3fs_log.setLevel(logging.DEBUG)
    with tempfile.TemporaryDirectory() as d:
        where = f"{s3['root']}/{save_last}-{time.time_ns()}" if s3 else d
        trainer = Trainer(max_steps=steps, plugins=[io], logger=False, enable_progress_bar=False,
                          enable_model_summary=False, accelerator="cpu",
                          callbacks=[ModelCheckpoint(dirpath=where, every_n_train_steps=every, save_last=save_last)])
        t0 = time.perf_counter()
        try:
            trainer.fit(_Net(features))
        finally:
            s3fs_log.removeHandler(requests)
        wall = time.perf_counter() - t0
    is_last = [i.path.rsplit("/", 1)[-1].startswith("last") for i, _ in infos]
    last = [1e3 * i.blocking_seconds for (i, _), lst in zip(infos, is_last) if lst]
    topk = [1e3 * i.blocking_seconds for (i, _), lst in zip(infos, is_last) if not lst]
    gaps = [1e3 * (b[1] - a[1]) for a, b, la, lb in zip(infos, infos[1:], is_last, is_last[1:]) if not la and lb]
    return {"fit_s": wall, "topk_ms": topk, "last_ms": last, "gap_ms": gaps, "requests": requests.n / (steps // every)}


def _cell(ms: list[float]) -> str:
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})" if ms else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--s3", action="store_true", help="save to a moto S3 server on 127.0.0.1")
    ap.add_argument("--features", type=int, default=8192, help="the layer is Linear(2048, features)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    s3 = _moto() if args.s3 else None
    for setting in (False, True) if s3 else (False, True, "link"):
        for stock in (True, False) if s3 else (False,):
            r = run(setting, args.steps, args.every, args.features, s3, stock)
            rows.append([repr(setting), "TorchCheckpointIO" if stock else "checkrun", f"{r['fit_s']:.2f}",
                         _cell(r["topk_ms"]), _cell(r["last_ms"]), _cell(r["gap_ms"])]
                        + ([f"{r['requests']:.1f}"] if s3 else []))
    where = "moto S3 on 127.0.0.1" if s3 else "local disk"
    print(machine_header(f"ModelCheckpoint(save_last=...), {where}, Linear(2048, {args.features}) + Adam") + "\n")
    print(table(["save_last", "plugin", "fit s", "top-k save blocking ms", "last.ckpt save blocking ms",
                 "last.ckpt commits after the top-k, ms"] + (["S3 requests per checkpoint"] if s3 else []), rows))
    return 0


def _moto() -> dict:
    """A moto S3 server on 127.0.0.1 with one bucket, also made fsspec's default for ``s3://`` (Lightning's
    own file operations, such as ModelCheckpoint's, open it without options)."""
    import fsspec.config
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{server._server.server_port}"},
               "key": "bench", "secret": "bench"}
    fsspec.config.conf["s3"] = dict(options)
    s3fs.S3FileSystem(**options).mkdir("bench-save-last")
    return {"root": "s3://bench-save-last", "options": options}


if __name__ == "__main__":
    raise SystemExit(main())
