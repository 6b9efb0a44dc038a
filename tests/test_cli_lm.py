"""`edgetrain train task=language-modeling`: a Hugging Face causal language model (a directory with its
tokenizer, offline) learns to continue a text file under a memory budget; `edgetrain predict` continues
prompts with it.

The model and tokenizer are made by ``tests/_lm.py``: a byte-level BPE tokenizer trained on the text
(``tokenizers``) and a two-layer GPT-2 from its config, saved as ``save_pretrained`` saves a downloaded one.
"""

from __future__ import annotations

import json

import pytest
import torch

from edgetrain.errors import ConfigError
from edgetrain.profile import memory

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests._lm import ZEN, make_lm  # noqa: E402


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_lm(tmp_path_factory.mktemp("lm"))


@pytest.fixture
def baseline(monkeypatch):
    # `edgetrain train` moves the budget's zero point to after its data is loaded (process-wide)
    monkeypatch.setattr(memory, "_BASELINE_RSS", memory.baseline_rss_bytes())


def test_blocks_are_documents_end_to_end_with_the_padding_masked(lm_dir):
    from edgetrain.spec.lm import token_blocks
    from edgetrain.spec.text import load_tokenizer

    tok = load_tokenizer(str(lm_dir / "model"))
    docs = ZEN[:3]
    blocks = token_blocks(tok, docs, 16)
    ids = [i for d in docs for i in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    n = len(ids)
    assert len(blocks) == -(-n // 16)
    flat_ids, flat_mask = blocks.input_ids.reshape(-1), blocks.attention_mask.reshape(-1)
    assert flat_ids[:n].tolist() == ids and flat_mask[:n].all() and not flat_mask[n:].any()
    assert (blocks.targets.reshape(-1)[n:] == -100).all() and blocks.targets.reshape(-1)[:n].tolist() == ids
    x, y = blocks[0]
    assert set(x) == {"input_ids", "attention_mask"} and y.shape == (16,)


def test_train_a_causal_lm_on_a_text_file_within_its_budget_then_continue_prompts(lm_dir, tmp_path, baseline):
    from edgetrain.cli.predict import load_card, predict
    from edgetrain.cli.train import run_train
    from edgetrain.cli.train_config import TrainConfig

    lines: list[str] = []
    cfg = TrainConfig(model=f"hf:{lm_dir / 'model'}", data=str(lm_dir / "zen.txt"), task="language-modeling",
                      max_length=32, batch_size=8, epochs=4, optimizer="adamw", lr=0.01, val_fraction=0.2,
                      memory_budget="300MiB", save=str(tmp_path / "zen.pt"), progress=False, threads=1)
    assert run_train(cfg, out=lines.append) == 0, lines
    assert "training blocks of 32 tokens" in lines[0]
    epochs = [ln for ln in lines if ln.startswith("epoch ")]
    assert len(epochs) == 4 and all("val_perplexity" in ln for ln in epochs)
    losses = [float(ln.split("train_loss ")[1].split(",")[0]) for ln in epochs]
    assert losses[-1] < losses[0] - 0.3, losses  # it learns the text
    assert "within budget" in lines[-1]
    card = load_card(tmp_path / "zen.pt")
    assert card["task"] == "language-modeling" and card["input"]["length"] == 32
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Beautiful is\nErrors should\n")
    rows = list(predict(tmp_path / "zen.pt", prompts, card, new_tokens=8))
    assert rows[0] == ["input", "prompt", "continuation"] and [r[1] for r in rows[1:]] == ["Beautiful is",
                                                                                           "Errors should"]
    assert all(isinstance(r[2], str) for r in rows[1:])
    # sampled: the same seed draws the same continuations, and they are not all the greedy ones
    from edgetrain.cli.predict import Sampling

    hot = Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=7)
    drawn = [list(predict(tmp_path / "zen.pt", prompts, card, new_tokens=8, sampling=hot)) for _ in range(2)]
    assert drawn[0] == drawn[1]
    others = [list(predict(tmp_path / "zen.pt", prompts, card, new_tokens=8, sampling=Sampling(1.5, 0, 1.0, s)))
              for s in range(3)]
    assert any(o != rows for o in others + drawn)
    with pytest.raises(ConfigError, match="top_p"):
        list(predict(tmp_path / "zen.pt", prompts, card, new_tokens=8, sampling=Sampling(1.0, 0, 0.0)))


def test_language_modelling_sources_and_their_errors(lm_dir, tmp_path):
    from edgetrain.spec.lm import load_lm_data, read_texts

    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(ZEN)))
    assert read_texts(tmp_path / "docs.jsonl") == (ZEN, None)
    (tmp_path / "docs.csv").write_text("id,text\n" + "\n".join(f'{i},"{t}"' for i, t in enumerate(ZEN)) + "\n")
    assert read_texts(tmp_path / "docs.csv")[0] == ZEN
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match="'text'.*body"):
        read_texts(tmp_path / "bad.jsonl")
    (tmp_path / "x.npy").write_bytes(b"")
    with pytest.raises(ConfigError, match="not '.npy'"):
        read_texts(tmp_path / "x.npy")
    with pytest.raises(ConfigError, match="model: hf:NAME"):
        load_lm_data(str(lm_dir / "zen.txt"), None, 32)
    data = load_lm_data(str(lm_dir / "zen.txt"), str(lm_dir / "model"), 32, val_spec=str(tmp_path / "docs.jsonl"))
    assert data.task == "language-modeling" and data.val is not None and data.num_classes == 300


def test_language_modelling_resumed_from_a_checkpoint_equals_the_uninterrupted_run(lm_dir, tmp_path, baseline):
    from edgetrain.cli.train import run_train
    from edgetrain.cli.train_config import TrainConfig

    def train(epochs: int, save: str, **kw) -> list[str]:
        lines: list[str] = []
        cfg = TrainConfig(model=f"hf:{lm_dir / 'model'}", data=str(lm_dir / "zen.txt"), task="language-modeling",
                          max_length=32, batch_size=8, epochs=epochs, optimizer="adamw", lr=0.01, val_fraction=0.2,
                          memory_budget="300MiB", save=str(tmp_path / save), progress=False, threads=1, seed=3, **kw)
        assert run_train(cfg, out=lines.append) == 0, lines
        return lines

    train(3, "straight.pt")
    train(1, "first.pt", checkpoint_dir=str(tmp_path / "ck"))  # stopped after its first epoch
    lines = train(3, "resumed.pt", checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert any(ln.startswith("resumed from") and "at epoch 2" in ln for ln in lines), lines
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def _lm_command(lm_dir, tmp_path, capsys, command: list[str], budget: str = "") -> str:
    """``edgetrain COMMAND lm.yaml ...`` on a language-modelling train config, run in ``tmp_path``; its output."""
    from edgetrain.cli.main import main

    (tmp_path / "lm.yaml").write_text(f"model: hf:{lm_dir / 'model'}\ndata: {lm_dir / 'zen.txt'}\n"
                                      "task: language-modeling\nmax_length: 32\nbatch_size: 8\noptimizer: adamw\n"
                                      f"threads: 1\n{budget}")
    assert main([command[0], "lm.yaml", *command[1:]]) == 0
    return capsys.readouterr().out


def test_report_from_a_language_modelling_config(lm_dir, tmp_path, baseline, capsys, monkeypatch):
    # `edgetrain report CONFIG` builds data, model, loss and optimizer as `edgetrain train` does (it read every
    # config as images or a table, and a .txt of documents was "an unknown format")
    monkeypatch.chdir(tmp_path)
    out = _lm_command(lm_dir, tmp_path, capsys, ["report", "--out", "r.html"], budget="memory_budget: 300MiB\n")
    assert "report written to" in out and (tmp_path / "r.html").stat().st_size > 0
    assert "300.0 MiB" in out  # the config's budget


@pytest.mark.filterwarnings("ignore:.*micro-batches.*draws its own")  # GPT-2's dropout: compared as accumulated
def test_verify_a_language_modelling_config_micro_batched(lm_dir, tmp_path, baseline, capsys, monkeypatch):
    # `edgetrain verify CONFIG`: one step of your model on your data's first batch, with your loss and
    # optimizer, through the plan (micro-batches of 2 here) and through plain PyTorch, compared
    monkeypatch.chdir(tmp_path)
    out = _lm_command(lm_dir, tmp_path, capsys, ["verify", "--micro-batch-size", "2"])
    assert "edgetrain verify: PASS" in out and "micro-batch 2 of 8" in out, out
