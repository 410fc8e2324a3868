"""docs/hugging-face.md at toy size: a tiny random Hugging Face Llama 3.2-style model (tied embeddings,
llama3 RoPE scaling; made by transformers, no download)
and a folder of text -> `elastron data prepare` -> `elastron run` with examples/continue-pretraining.yaml
(init_from, val_loss, TensorBoard) on a local Ray of 2 CPUs -> `elastron export` -> transformers loads the
result, with its tokenizer, and generates. The page's no-Ray line, `elastron train`, runs the same config on 2 local ranks beside it and gives
the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e  # `elastron run` starts a local Ray
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
ELASTRON = [sys.executable, "-c", "import sys; from api.cli import main; sys.exit(main())"]
WORDS = "the quick brown fox jumps over a lazy dog while early birds catch worms in time".split()


def elastron(*args: str, cwd: Path) -> str:
    # No RAY_ADDRESS: `elastron run` must start its own local Ray, as on the user's laptop; its workers find
    # this checkout through PYTHONPATH, which the local Ray passes on.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([*ELASTRON, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env={**env, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"})
    assert r.returncode == 0, f"elastron {' '.join(args)}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_walkthrough_from_a_model_directory_and_a_folder_of_text(tmp_path):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    # The user's starting point: a model directory with its tokenizer, and a folder of text.
    model_dir, text = tmp_path / "models" / "my-llama", tmp_path / "my-text"
    text.mkdir(parents=True)
    for i in range(40):
        (text / f"doc{i}.txt").write_text(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(30)))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 5, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]))
    torch.manual_seed(0)
    hf = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  vocab_size=64, intermediate_size=48, max_position_embeddings=64,
                                  tie_word_embeddings=True, eos_token_id=1, bos_token_id=None,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    transformers.LlamaForCausalLM(hf).float().save_pretrained(model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "eos_token": "</s>", "unk_token": "<unk>"}))

    # 1. Prepare the data with the model's tokenizer.
    elastron("data", "prepare", "my-text", "--tokenizer", "models/my-llama", "--out", "data/my-text",
             "--val-fraction", "0.25", cwd=tmp_path)
    meta = json.loads((tmp_path / "data" / "my-text" / "meta.json").read_text())
    assert meta["tokens"]["val"] > 17 and meta["dtype"] == "uint16"

    # 2. The example config, shrunk to toy size (the paths are the walkthrough's own).
    cfg = yaml.safe_load((ROOT / "examples" / "continue-pretraining.yaml").read_text())
    assert cfg["model"]["init_from"] == "models/my-llama" and cfg["data"]["path"] == "data/my-text/train.bin"
    cfg["data"].update(seq_len=16)  # the token dtype comes from meta.json
    cfg["train"].update(steps=4, global_batch_size=4, micro_batch_size=2, warmup_steps=1, dtype="float32",
                        eval_interval=2, eval_batches=1)
    cfg["checkpoint"]["interval_steps"] = 2
    cfg["parallel"]["max_workers"] = 2
    cfg["resources"] = {"device": "cpu"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))

    # 3. Run it elastically from the model: the page's `elastron run`, on a local Ray.
    out = elastron("run", "job.yaml", "--run-dir", "runs/my-llama", cwd=tmp_path)
    assert "SUCCEEDED at step 4/4" in out, out
    run = tmp_path / "runs" / "my-llama"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["val_loss"] is not None for r in rows] == [False, True, False, True]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    # The same config without Ray (`elastron train`, 2 local ranks) starts from the same weights and reads
    # the same batches, so it gives the same losses: the Ray workers did start from the model.
    out = elastron("train", "job.yaml", "--nproc", "2", "--layout", "dp=2", "--run-dir", "runs/no-ray", cwd=tmp_path)
    assert "started from" in out
    local = [json.loads(line) for line in (tmp_path / "runs" / "no-ray" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in local], rel=1e-4)
    assert [r["val_loss"] for r in rows[1::2]] == pytest.approx([r["val_loss"] for r in local[1::2]], rel=1e-4)

    # 4. Export, and transformers loads what came out: the model it started from, 4 small steps on.
    elastron("export", "runs/my-llama/checkpoints", "my-llama-continued", cwd=tmp_path)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "my-llama-continued")
    assert back.config.vocab_size == 64 and back.config.num_hidden_layers == 2
    assert back.config.tie_word_embeddings and back.config.rope_parameters["rope_type"] == "llama3"
    assert back.config.eos_token_id == 1 and back.generation_config.eos_token_id == 1
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "my-llama-continued")
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_token_id == 1
    prompt = tokenizer("the quick brown fox", return_tensors="pt")
    new = back.generate(**prompt, max_new_tokens=4, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 4
    start = transformers.LlamaForCausalLM.from_pretrained(model_dir).state_dict()
    moved = {k: (v - start[k]).abs().max().item() for k, v in back.state_dict().items()}
    assert 0 < max(moved.values()) < 1e-3, moved  # Adam at lr 3e-5 moves each weight by at most ~lr a step
