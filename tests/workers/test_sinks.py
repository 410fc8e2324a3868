"""Tier 1: TensorBoard event files written by workers/sinks.py, read back with tensorboard's own reader."""

from __future__ import annotations

import pytest

from workers.sinks import MetricsSinks, crc32c

ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read(logdir) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def step(n: int, loss: float, layout: dict, world: int) -> dict:
    return {"step": n, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "mfu": None,
            "layout": layout, "world_size": world}


def test_crc32c_known_answer():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_scalars_resume_without_duplicates_and_reconfigurations_are_marked(tmp_path):
    dp2, tp2 = {"dp_shard": 2, "tp": 1}, {"dp_shard": 1, "tp": 2}
    sinks = MetricsSinks(tmp_path)
    for n in range(1, 5):
        assert sinks.log(step(n, 4.0 - n / 10, dp2, 2))
    sinks.close()
    # A restart after a failure resumes from step 2 and redoes 3 and 4 before going on, under TP.
    again = MetricsSinks(tmp_path)
    assert [again.log(step(n, 9.0, tp2, 2)) for n in (3, 4)] == [False, False]
    assert again.log(step(5, 3.4, tp2, 2))
    again.close()
    acc = read(tmp_path / "tensorboard")
    losses = [(e.step, round(e.value, 4)) for e in acc.Scalars("loss")]
    assert losses == [(1, 3.9), (2, 3.8), (3, 3.7), (4, 3.6), (5, 3.4)]
    assert [e.step for e in acc.Scalars("reconfiguration/world_size")] == [5]
    (text,) = acc.Tensors("reconfiguration")
    assert text.step == 5 and text.tensor_proto.string_val[0].decode() == "dp_shard=2 -> tp=2 (2 -> 2 workers)"
    assert "mfu" not in acc.Tags()["scalars"]  # None values are not written


def test_wandb_without_the_package_is_one_clear_error(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match="wandb package is not installed"):
        MetricsSinks(tmp_path, wandb={"project": "p", "mode": "offline"})


def test_reconfigurations_come_from_the_coordinators_event_log_once(tmp_path):
    import json

    dp2, grown = {"dp_shard": 2, "tp": 1}, {"dp_shard": 2, "tp": 2}

    def resize(cause, old, new, world, resumed):
        return json.dumps({"kind": "resize", "cause": cause, "step": resumed, "details": {
            "old_layout": old, "new_layout": new, "world_size": world, "resumed_step": resumed}}) + "\n"

    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"kind": "transition", "step": 0}) + "\n" + resize("planned", None, dp2, 2, 0))
    sinks = MetricsSinks(tmp_path)
    assert sinks.log(step(1, 4.0, dp2, 2)) and sinks.log(step(2, 3.9, dp2, 2))  # the first start: no mark
    sinks.close()
    with open(events, "a") as f:  # the coordinator grows the job; the line after it is still being written
        f.write(resize("grow", dp2, grown, 4, 2) + '{"kind": "fail')
    again = MetricsSinks(tmp_path)  # the new group's rank 0, in another process
    assert again.log(step(3, 3.8, grown, 4)) and again.log(step(4, 3.7, grown, 4))
    again.close()
    acc = read(tmp_path / "tensorboard")
    texts = [(t.step, t.tensor_proto.string_val[0].decode()) for t in acc.Tensors("reconfiguration")]
    assert texts == [(3, "grow: dp_shard=2 -> dp_shard=2,tp=2 (2 -> 4 workers), resumed at step 2")]
    assert [(e.step, e.value) for e in acc.Scalars("reconfiguration/world_size")] == [(3, 4.0)]


def test_wandb_offline_run_is_resumed_not_duplicated(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional (pip install wandb); TensorBoard is tested above")
    monkeypatch.setenv("WANDB_SILENT", "true")
    opts = {"project": "elastron-test", "mode": "offline"}
    first = MetricsSinks(tmp_path, wandb=opts, tensorboard=False)
    assert first.log(step(1, 4.0, {"dp_shard": 2}, 2))
    run_id = first.wandb_run.id
    first.close()
    again = MetricsSinks(tmp_path, wandb=opts, tensorboard=False)
    assert again.wandb_run.id == run_id  # the same W&B run continues
    assert not again.log(step(1, 9.0, {"dp_shard": 2}, 2)) and again.log(step(2, 3.9, {"dp_shard": 2}, 2))
    again.close()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
