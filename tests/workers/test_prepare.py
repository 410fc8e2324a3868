"""Tier 1: `elastron data prepare` (workers/prepare.py) on text, JSONL and Parquet with a tokenizer made here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workers.prepare import PrepareError, prepare, read_meta

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
         "all that glitters is not gold", "the early bird catches the worm"]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS * 10, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture()
def corpus(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text(TEXTS[0])
    (d / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    pq.write_table(pa.table({"text": TEXTS[1:3]}), d / "c.parquet")
    (d / "notes.csv").write_text("ignored")
    return d


def test_prepare_writes_splits_and_a_sidecar(tok_path, corpus, tmp_path):
    from tokenizers import Tokenizer

    calls = []
    meta = prepare([corpus], tmp_path / "out", tokenizer=tok_path, val_fraction=0.0,
                   progress=lambda done, total: calls.append((done, total)))
    sizes = [p.stat().st_size for p in sorted(corpus.rglob("*")) if p.suffix in (".txt", ".jsonl", ".parquet")]
    assert calls == [(sum(sizes[:i]), sum(sizes)) for i in (1, 2, 3)]  # bytes of the inputs, file by file
    tok = Tokenizer.from_file(str(tok_path / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    docs = [TEXTS[0], *TEXTS[1:3], *TEXTS]  # a.txt, c.parquet, sub/b.jsonl (sorted paths)
    want = [i for t in docs for i in [*tok.encode(t, add_special_tokens=False).ids, eos]]
    got = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    assert got.tolist() == want
    assert meta == read_meta(tmp_path / "out" / "train.bin")
    assert meta["documents"] == {"train": 7, "val": 0} and meta["tokens"]["train"] == len(want)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.get_vocab_size() and meta["eos_id"] == eos
    assert len(meta["tokenizer_sha256"]) == 64 and not list((tmp_path / "out").glob("*.part"))


def test_the_split_is_seeded_whole_documents_and_reproducible(tok_path, tmp_path):
    src = tmp_path / "many.jsonl"
    src.write_text("".join(json.dumps({"body": f"{TEXTS[i % 4]} {i}"}) + "\n" for i in range(300)))
    a = prepare([src], tmp_path / "a", tokenizer=tok_path / "tokenizer.json", text_field="body", val_fraction=0.2)
    b = prepare([src], tmp_path / "b", tokenizer=tok_path, text_field="body", val_fraction=0.2, batch_size=7)
    assert 30 < a["documents"]["val"] < 90 and a["documents"]["train"] + a["documents"]["val"] == 300
    assert b["documents"] == a["documents"]  # batching does not move documents between splits
    for split in ("train", "val"):
        assert (tmp_path / "a" / f"{split}.bin").read_bytes() == (tmp_path / "b" / f"{split}.bin").read_bytes()
    val = np.fromfile(tmp_path / "a" / "val.bin", dtype=np.uint16)
    assert int((val == a["eos_id"]).sum()) == a["documents"]["val"] and val[-1] == a["eos_id"]


def test_the_trainer_reads_the_token_file(tok_path, corpus, tmp_path):
    from workers.data import TokenFileSource

    meta = prepare([corpus] * 3, tmp_path / "out", tokenizer=tok_path, val_fraction=0.0)
    src = TokenFileSource(tmp_path / "out" / "train.bin", seq_len=8, vocab_size=meta["vocab_size"])
    assert len(src) > 0 and src.sample(0).max() < meta["vocab_size"]


@pytest.mark.parametrize("setup,needle", [
    (lambda d: (d / "x.jsonl").write_text('{"body": "hi"}\n'), "no string field 'text'; pass --text-field"),
    (lambda d: (d / "x.jsonl").write_text("{oops\n"), "x.jsonl:1: not JSON"),
    (lambda d: None, "no .txt, .md, .jsonl or .parquet files"),
])
def test_bad_input_is_one_line(tok_path, tmp_path, setup, needle):
    d = tmp_path / "in"
    d.mkdir()
    setup(d)
    with pytest.raises(PrepareError, match=needle) as e:
        prepare([d], tmp_path / "out", tokenizer=tok_path)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out" / "train.bin").exists()


def test_a_missing_tokenizer_is_one_line(corpus, tmp_path):
    with pytest.raises(PrepareError, match="tokenizer: .* does not exist"):
        prepare([corpus], tmp_path / "out", tokenizer=tmp_path / "nope")


def test_elastron_data_prepare(tok_path, corpus, tmp_path, capsys):
    from api.cli import main

    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tok_path), "--out", str(tmp_path / "o"),
                 "--val-fraction", "0"]) == 0
    captured = capsys.readouterr()
    total = sum(p.stat().st_size for p in corpus.rglob("*") if p.suffix in (".txt", ".jsonl", ".parquet"))
    assert f"{total} B of {total} B" in captured.err and "training tokens (7 documents)" in captured.out
    assert (tmp_path / "o" / "train.bin").stat().st_size > 0
    assert main(["data", "prepare", str(tmp_path / "missing"), "--tokenizer", str(tok_path), "--out",
                 str(tmp_path / "o2")]) == 2
    assert capsys.readouterr().err.strip().startswith("elastron: error: input ")


def test_the_trainer_refuses_a_token_file_made_for_a_larger_vocabulary(tok_path, corpus, tmp_path):
    from workers.config import JobConfig
    from workers.data import build_source

    meta = prepare([corpus], tmp_path / "out", tokenizer=tok_path, val_fraction=0.0)
    cfg = JobConfig.from_dict({"data": {"source": "tokens", "path": str(tmp_path / "out" / "train.bin"),
                                        "seq_len": 4}}).data
    assert len(build_source(cfg, seed=0, vocab_size=meta["vocab_size"])) > 0
    with pytest.raises(ValueError, match=f"vocabulary of {meta['vocab_size']} tokens .*the model has 50"):
        build_source(cfg, seed=0, vocab_size=50)
    wrong = JobConfig.from_dict({"data": {"source": "tokens", "path": str(tmp_path / "out" / "train.bin"),
                                          "seq_len": 4, "token_dtype": "uint32"}}).data
    with pytest.raises(ValueError, match="set data.token_dtype: uint16"):
        build_source(wrong, seed=0, vocab_size=meta["vocab_size"])


def test_invalid_utf8_and_empty_documents_are_counted(tok_path, tmp_path, caplog):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_bytes(b"the quick \xff\xfe fox \xef\xbf\xbd")  # 2 bad bytes, 1 genuine U+FFFD
    (d / "b.jsonl").write_bytes(b'{"text": "a stitch in time"}\n{"text": ""}\n{"text": "  \\n "}\n'
                                b'{"text": "bad \xc3"}\n')
    with caplog.at_level("WARNING"):
        meta = prepare([d], tmp_path / "out", tokenizer=tok_path, val_fraction=0.0)
    assert (meta["invalid_utf8_replaced"], meta["empty_documents_skipped"]) == (3, 2)
    assert meta["documents"]["train"] == 3
    assert read_meta(tmp_path / "out" / "train.bin")["empty_documents_skipped"] == 2
    assert "replaced 3 invalid UTF-8 sequence(s) with U+FFFD and skipped 2 empty document(s)" in caplog.text


@pytest.mark.parametrize("name,content", [("empty.txt", ""), ("empty.jsonl", ""), ("blank.jsonl", '{"text": " "}\n')])
def test_empty_inputs_leave_nothing_behind(tok_path, tmp_path, name, content):
    d = tmp_path / "in"
    d.mkdir()
    (d / name).write_text(content)
    with pytest.raises(PrepareError, match="no training tokens were produced: the inputs hold no text"):
        prepare([d], tmp_path / "out", tokenizer=tok_path)
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep").write_text("x")
    with pytest.raises(PrepareError):
        prepare([d], tmp_path / "mine", tokenizer=tok_path)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["keep"]


def test_add_bos_defaults_to_the_tokenizer_config(tok_path, tmp_path):
    import shutil

    tok_dir = tmp_path / "tok"
    shutil.copytree(tok_path, tok_dir)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<unk>", "eos_token": "</s>",
                                                               "add_bos_token": True}))
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text(TEXTS[0])
    meta = prepare([d], tmp_path / "o1", tokenizer=tok_dir, val_fraction=0.0)
    ids = np.fromfile(tmp_path / "o1" / "train.bin", dtype=meta["dtype"])
    assert meta["bos_id"] == 0 and ids[0] == 0 and ids[-1] == meta["eos_id"]
    meta = prepare([d], tmp_path / "o2", tokenizer=tok_dir, val_fraction=0.0, add_bos=False)
    assert meta["bos_id"] is None and np.fromfile(tmp_path / "o2" / "train.bin", dtype=meta["dtype"])[0] != 0
    with pytest.raises(PrepareError, match="--add-bos: the tokenizer at .* names no bos_token"):
        prepare([d], tmp_path / "o3", tokenizer=tok_path, add_bos=True)
