"""models.emulation: an emulated accelerator's waits, and a model that computes the same values with them."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from models.config import model_config
from models.emulation import FORWARD_SHARE as FORWARD, device_time
from models.llama import build_model, init_value


def _model(**overrides):
    cfg = model_config("tiny", **{"n_layers": 1, **overrides})
    m = build_model(cfg)
    m.to_empty(device="cpu")
    m.init_buffers("cpu")
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(init_value(cfg, name, tuple(p.shape), 0))
    return m


def test_forward_waits_a_third_and_backward_two_thirds_of_samples_times_the_rate():
    x = torch.ones(3, requires_grad=True)
    t0 = time.perf_counter()
    y = device_time(x * 2, samples=4, s_per_sample=0.03)  # 0.12 s: 0.04 forward, 0.08 backward
    t1 = time.perf_counter()
    y.sum().backward()
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.04 and t2 - t1 >= 0.08
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    with torch.no_grad():  # evaluation: the forward's share only
        t0 = time.perf_counter()
        device_time(x, samples=4, s_per_sample=0.03)
        assert time.perf_counter() - t0 >= 0.04


def test_an_emulating_model_computes_the_same_loss_and_gradients():
    plain, emulated = _model(), _model(emulate_s_per_sample=0.01)
    x = torch.randint(0, 256, (2, 8))
    losses = []
    for m in (plain, emulated):
        loss = F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1))
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (n, a), b in zip(plain.named_parameters(), emulated.parameters()):
        assert torch.equal(a.grad, b.grad), n


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 1e9, True, "1"])
def test_a_wrong_rate_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="emulate_s_per_sample"):
        model_config("tiny", emulate_s_per_sample=bad)


def test_the_waits_are_spread_over_the_layers_a_stage_holds(monkeypatch):
    """Each layer waits its share before it runs, forward and backward, so a gradient reduction started
    when a layer's gradients are ready can overlap the waits of the layers still to run (as on a GPU);
    a pipeline stage that holds half the layers waits half the micro-batch's time."""
    import models.emulation as emulation

    waits: list[float] = []
    monkeypatch.setattr(emulation.time, "sleep", waits.append)
    m = _model(n_layers=4, emulate_s_per_sample=0.3)
    x = torch.randint(0, 256, (2, 8))
    out = m(x)
    assert waits == pytest.approx([0.15 * FORWARD] * 4)  # 2 samples x 0.3 s / 4 layers, a third forward
    waits.clear()
    out.sum().backward()
    assert waits == pytest.approx([0.15 * (1 - FORWARD)] * 4)
    del m.layers["2"], m.layers["3"]  # a stage holding layers 0 and 1 of the 4
    waits.clear()
    m(x).sum().backward()
    assert sum(waits) == pytest.approx(2 * 0.3 / 2)
