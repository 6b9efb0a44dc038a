"""Federated language modelling (``edgetrain fl simulate --task language-modeling --model hf:DIR --data
docs.txt``): every node takes an IID shard of the text's token blocks, fine-tunes the causal LM in its budget
with the next-token loss, and the server reports the held-out loss over every counted token (and its
perplexity); driven here with hand-built Flower messages (no engine)."""

import codecs
import math
import this

import pytest

pytest.importorskip("flwr")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from tests._fl import context, train_message  # noqa: E402

ZEN = [line for line in codecs.decode(this.s, "rot13").splitlines() if line.strip()]


@pytest.fixture
def task(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from edgetrain.fl.spec_task import SpecTask, load_spec_task

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(ZEN, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>", "<pad>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                                pad_token="<pad>")
    fast.save_pretrained(tmp_path / "model")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(fast), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id,
                                  pad_token_id=fast.pad_token_id)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "model")
    (tmp_path / "zen.txt").write_text("\n".join(ZEN * 6) + "\n")
    load_spec_task.cache_clear()
    yield SpecTask(f"hf:{tmp_path / 'model'}", str(tmp_path / "zen.txt"), max_length=16, task="language-modeling",
                   cwd=str(tmp_path))
    load_spec_task.cache_clear()


def test_nodes_fine_tune_a_causal_lm_on_their_shards_of_the_text_within_their_budgets(task):
    from flwr.app import ArrayRecord

    from edgetrain.fl.client import client_app
    from edgetrain.fl.settings import ClientSettings
    from edgetrain.fl.spec_task import evaluate_spec, load_spec_task, spec_data_fn, spec_loss_fn, spec_model_fn
    from edgetrain.losses import TokenCrossEntropyLoss

    loaded = load_spec_task(task)
    assert loaded.info.task == "language-modeling" and len(loaded.test) > 0
    assert isinstance(spec_loss_fn(task), TokenCrossEntropyLoss)
    model = spec_model_fn(task)()
    acc0, loss0 = evaluate_spec(task, model)
    assert math.isnan(acc0) and abs(loss0 - math.log(300)) < 1.0  # an untrained model: about uniform
    # "dirichlet" asks for label skew, which blocks of text do not have: the shards are IID, and disjoint
    app = client_app(spec_model_fn(task), spec_data_fn(task, "dirichlet", 0.5),
                     settings=ClientSettings(batch_size=4, lr=0.5, local_epochs=2), loss_fn=spec_loss_fn(task))
    arrays = ArrayRecord(model.state_dict())
    seen = []
    for pid in range(2):
        reply = app(train_message(arrays), context({"partition-id": pid, "num-partitions": 2,
                                                    "memory-budget": "400MiB"}))
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        m = reply.content["metrics"]
        assert m["within-budget"] == 1 and m["num-examples"] > 0
        seen.append(m["num-examples"])
    assert abs(seen[0] - seen[1]) <= 4 and sum(seen) <= len(loaded.train)
    trained = spec_model_fn(task)()
    trained.load_state_dict(reply.content["arrays"].to_torch_state_dict())
    _, loss1 = evaluate_spec(task, trained)
    assert loss1 < loss0 - 0.5, (loss0, loss1)


def test_the_held_out_loss_is_the_mean_over_every_counted_token(task):
    from torch.utils.data import default_collate

    from edgetrain.batch import call_model
    from edgetrain.fl.spec_task import evaluate_spec, load_spec_task, spec_model_fn

    loaded = load_spec_task(task)
    model = spec_model_fn(task)().eval()
    x, y = default_collate([loaded.test[i] for i in range(len(loaded.test))])
    with torch.no_grad():
        logits = call_model(model, x).logits[:, :-1]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1))
    # batches of 3 blocks: the last block is padded, so batches differ in counted tokens
    _, got = evaluate_spec(task, model, batch_size=3)
    assert got == pytest.approx(float(want), rel=1e-5)


def test_the_task_without_a_model_is_refused_with_what_to_give(capsys):
    from edgetrain.fl.cli import main

    assert main(["simulate", "--task", "language-modeling"]) == 2
    assert "--model hf:DIR --data FILE" in capsys.readouterr().err
