"""Every file in examples/ runs as written on a CPU machine, for a few steps (`--steps`), through the
rank entry point `elastron train` launches. The continue-pretraining example finds what its comments
say to make at the relative paths it names: a Hugging Face Llama in models/my-llama (tiny, random, with
a tokenizer trained here, whose context is shorter than data.seq_len's default cap, so the example's
default comes from the model) and `elastron data prepare`'s output in data/my-text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def make_workspace(cwd: Path) -> None:
    """models/my-llama and data/my-text, as examples/continue-pretraining.yaml's comments make them."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from workers.prepare import prepare

    text = [f"line {i}: the quick brown fox jumps over the lazy dog number {i % 7}" for i in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    llama = cwd / "models" / "my-llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        intermediate_size=48, max_position_embeddings=64)).save_pretrained(llama)  # 64 < the default cap
    tok.save(str(llama / "tokenizer.json"))
    (llama / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (cwd / "my-text").mkdir()
    (cwd / "my-text" / "docs.jsonl").write_text("".join(json.dumps({"text": t * 4}) + "\n" for t in text))
    prepare([cwd / "my-text"], cwd / "data" / "my-text", tokenizer=llama, val_fraction=0.1)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_as_written(example, tmp_path):
    if example.name == "continue-pretraining.yaml":
        make_workspace(tmp_path)
    r = subprocess.run([sys.executable, "-m", "workers.train", str(example), "--steps", "2",
                        "--run-dir", str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2] and all(0 < m["loss"] < 20 for m in rows)
    if example.name == "continue-pretraining.yaml":  # no data.seq_len: the model's 64 positions, not 128
        assert rows[-1]["tokens"] == 2 * 64 * 64, rows[-1]  # steps x global_batch_size x seq_len
