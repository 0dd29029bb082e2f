"""EmbeddingTracker: saves copy only looked-up rows, stay exact, and refuse unsafe optimizers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ckpt_core import CheckpointEngine, EmbeddingTracker, EngineConfig


class Rec(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4096, 16, sparse=True)
        self.bag = nn.EmbeddingBag(2048, 8, mode="sum")
        self.out = nn.Linear(24, 1)

    def forward(self, idx, bag_idx, offsets):
        return self.out(torch.cat([self.emb(idx), self.bag(bag_idx, offsets)], dim=1)).squeeze(1)


def _step(model, opt, gen, n=32, step=True):
    idx = torch.randint(0, 4096, (n,), generator=gen)
    bag_idx = torch.randint(0, 2048, (2 * n,), generator=gen)
    offsets = torch.arange(0, 2 * n, 2)
    loss = model(idx, bag_idx, offsets).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if step:
        opt.step()


def _cfg():
    return EngineConfig.from_dict({"incremental": {"row_delta_min_rows": 1024}})


def test_tracked_saves_are_exact_and_small(tmp_path):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = Rec()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with CheckpointEngine(_cfg()) as engine:
        engine.track(EmbeddingTracker(model, opt, verify_every=3))
        _step(model, opt, gen)
        first = engine.save({"m": model.state_dict(), "o": opt.state_dict()}, tmp_path / "0.ckpt").result()
        for i in range(1, 7):
            _step(model, opt, gen)
            if i == 4:  # a save between forward/backward and the optimizer step must not lose it
                _step(model, opt, gen, step=False)
                engine.save({"m": model.state_dict(), "o": opt.state_dict()}, tmp_path / "mid.ckpt").result()
                opt.step()
            info = engine.save({"m": model.state_dict(), "o": opt.state_dict()}, tmp_path / f"{i}.ckpt").result()
            assert info.written_bytes < first.written_bytes / 4
            loaded = engine.load(tmp_path / f"{i}.ckpt")
            for k, v in model.state_dict().items():
                assert torch.equal(loaded["m"][k], v), (i, k)
            for p_id, st in opt.state_dict()["state"].items():
                for name, v in st.items():
                    assert torch.equal(loaded["o"]["state"][p_id][name], v), (i, p_id, name)


def test_tracker_refuses_optimizers_that_touch_unlooked_rows():
    model = Rec()
    with pytest.raises(ValueError, match="Adam"):
        EmbeddingTracker(model, torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match="momentum"):
        EmbeddingTracker(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    EmbeddingTracker(model, torch.optim.SGD(model.parameters(), lr=0.1)).close()


def test_verification_detects_broken_contract(tmp_path, caplog):
    model = Rec()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    with CheckpointEngine(_cfg()) as engine:
        tracker = engine.track(EmbeddingTracker(model, opt, verify_every=2))
        _step(model, opt, gen)
        engine.save({"m": model.state_dict()}, tmp_path / "0.ckpt").result()
        with torch.no_grad():
            model.emb.weight[7] += 1  # changed behind the tracker's back
        engine.save({"m": model.state_dict()}, tmp_path / "1.ckpt").result()  # verification save
        assert "without a lookup" in caplog.text
        assert torch.equal(engine.load(tmp_path / "1.ckpt")["m"]["emb.weight"], model.emb.weight.detach())
        with torch.no_grad():
            model.emb.weight[9] += 1
        engine.save({"m": model.state_dict()}, tmp_path / "2.ckpt").result()  # no longer trusted: compared
        assert torch.equal(engine.load(tmp_path / "2.ckpt")["m"]["emb.weight"], model.emb.weight.detach())
        tracker.close()


def test_tracker_copies_only_looked_up_rows(tmp_path):
    """Proves the tracked path is taken: a change made without a lookup is (by contract) not copied."""
    model = Rec()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointEngine(_cfg()) as engine:
        engine.track(EmbeddingTracker(model, opt))
        engine.save({"w": model.emb.weight}, tmp_path / "0.ckpt").result()
        before = model.emb.weight.detach().clone()
        with torch.no_grad():
            model.emb.weight[3] += 1
        model(torch.tensor([5]), torch.tensor([0, 1]), torch.tensor([0]))  # looks up row 5 only
        with torch.no_grad():
            model.emb.weight[5] += 1
        engine.save({"w": model.emb.weight}, tmp_path / "1.ckpt").result()
        loaded = engine.load(tmp_path / "1.ckpt")["w"]
    assert torch.equal(loaded[3], before[3]) and torch.equal(loaded[5], model.emb.weight[5].detach())
