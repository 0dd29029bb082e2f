"""A small deterministic CPU training loop for the step-log tests (and the SIGKILL child).

An embedding table (only the rows of each batch's ids get a gradient), a dense MLP, gradient
clipping (the log must see the clipped gradients), one of four optimizers with an LR scheduler.
"""
from __future__ import annotations

from typing import Any

import torch

ROWS, DIM, IDS = 512, 8, 6
OPTIMIZERS = ("adam", "adamw", "sgd", "adagrad", "adam_tensor_lr")


class Net(torch.nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(ROWS, DIM, sparse=sparse)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).sum(1))


def make(kind: str, sparse: bool = False) -> tuple[Net, Any, Any]:
    """Model, optimizer and scheduler, identical on every call."""
    torch.manual_seed(1234)
    net = Net(sparse)
    if kind == "adam_bn":  # a BatchNorm layer: running statistics change in the forward pass
        net.mlp.insert(1, torch.nn.BatchNorm1d(32))
    params = net.parameters()
    if kind in ("adam", "adam_bn"):
        opt = torch.optim.Adam(params, lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    elif kind == "adam_tensor_lr":  # a tensor lr (torch.compile's advice): logged by value, filled on replay
        opt = torch.optim.Adam(params, lr=torch.tensor(1e-2))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    elif kind == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    elif kind == "sgd":
        # sparse: no momentum (its buffer would be a sparse tensor, which checkpoints cannot hold)
        opt = torch.optim.SGD(params, lr=5e-2, momentum=0.0 if sparse else 0.9, nesterov=not sparse)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)
    elif kind == "adagrad":
        opt = torch.optim.Adagrad(params, lr=5e-2)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 9, 15], gamma=0.5)
    else:
        raise ValueError(kind)
    return net, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, ROWS, (4, IDS), generator=g), torch.randn(4, 1, generator=g)


def train_step(net: Net, opt: Any, sched: Any, step: int) -> None:
    """Step ``step`` (1-based): forward, backward, clip, optimizer step, scheduler step."""
    ids, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(ids), y).backward()
    if not net.emb.sparse:
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
    opt.step()
    sched.step()


def state(net: Net, opt: Any, sched: Any) -> dict:
    return {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


def load_into(st: dict, net: Net, opt: Any, sched: Any) -> None:
    net.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    sched.load_state_dict(st["sched"])


def assert_bit_equal(a: Any, b: Any, where: str = "state") -> None:
    """Equal tensors bit for bit (NaN and -0.0 included), equal everything else."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        if a.dtype.is_floating_point:
            ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            a, b = a.contiguous().view(ints), b.contiguous().view(ints)
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_bit_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def forged(body: dict) -> bytes:
    """A run or marker object as a forger who recomputes its checksum rewrites it (its format version:
    6, or 8 for a closed run's object with ``end``)."""
    from ckpt_core.steplog import format as fmt

    return fmt._sealed({k: v for k, v in body.items() if k not in ("checksum", "format_version")},
                       body.get("format_version", fmt.OBJECT_VERSION))
