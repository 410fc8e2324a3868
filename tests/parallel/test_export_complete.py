"""Tier 1: an export is a complete Hugging Face model: AutoModelForCausalLM and AutoTokenizer load it,
generate() stops on the end-of-sequence token, the source's token ids, generation config, tokenizer and
dtype come along, --max-shard-size writes shards with an index, and the files have the usual permissions.
The tokenizer is a small BPE trained here on local text (no download)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from models.llama import build_model
from parallel.export import ExportSource, write_hf
from parallel.hf_import import check_hf_dir, load_hf_weights, model_config_from_hf
from parallel.parallelize import materialize

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["</s>", "<s>", "<pad>"]  # ids 0, 1, 2
TEXT = ["the quick brown fox jumps over the lazy dog", "a tokenizer trained on local text",
        "elastron exports a complete model"] * 20


def save_tokenizer(directory, *, config: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=90, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:0]))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config:
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
             "pad_token": "<pad>"}))
    assert tok.token_to_id("</s>") == 0 and tok.get_vocab_size() <= 96
    return tok


@pytest.fixture
def source(tmp_path):
    """A bf16 Llama with bos=1, eos=0 and its tokenizer; our model started from it, its output projection
    zeroed so that greedy decoding picks id 0 (the end of sequence) at once."""
    hf = tmp_path / "hf"
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=96, intermediate_size=48, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=0, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(hf)
    save_tokenizer(hf, config=True)
    ours_cfg = model_config_from_hf(hf)
    model = build_model(ours_cfg)
    materialize(model, seed=0, device=torch.device("cpu"))
    load_hf_weights(model, check_hf_dir(hf, ours_cfg), ours_cfg)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state["output.weight"].zero_()
    return hf, ours_cfg, state


def generates_until_eos(out) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert tok.eos_token == "</s>" and model.generation_config.eos_token_id == 0
    prompt = tok("the quick brown fox", return_tensors="pt")
    ids = model.generate(**prompt, max_new_tokens=8, do_sample=False)[0].tolist()
    return ids[prompt["input_ids"].shape[1]:]


def test_export_from_init_from_is_complete(source, tmp_path):
    hf, cfg, state = source
    out = write_hf(state, cfg, tmp_path / "out", source=ExportSource(model_dir=hf), max_shard_size="20KB")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 0, 2)
    assert config["torch_dtype"] == "bfloat16"  # the source's, not the trainer's fp32
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 0)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert generates_until_eos(out) == [0]  # stops on eos instead of running 8 tokens
    umask = os.umask(0o022)
    os.umask(umask)
    for f in [out, *out.iterdir()]:  # what any new file or directory gets under the umask, not 0700
        want = (0o777 if f.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(f.stat().st_mode) == want, (f, oct(f.stat().st_mode))


def test_export_with_data_prepares_tokenizer_and_dtype_option(source, tmp_path):
    hf, cfg, state = source
    save_tokenizer(tmp_path / "data_tok", config=False)  # a bare tokenizer.json, as data prepare records it
    out = write_hf(state, cfg, tmp_path / "out", dtype="float32",
                   source=ExportSource(tokenizer=tmp_path / "data_tok" / "tokenizer.json", eos_id=0))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    assert generates_until_eos(out) == [0]


def test_bad_dtype_and_shard_size_are_one_line(source, tmp_path):
    _, cfg, state = source
    with pytest.raises(ValueError, match=r"--dtype 'int8' is not one of"):
        write_hf(state, cfg, tmp_path / "a", dtype="int8")
    with pytest.raises(ValueError, match=r"--max-shard-size 'lots' is not a size"):
        write_hf(state, cfg, tmp_path / "b", max_shard_size="lots")
