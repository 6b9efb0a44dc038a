"""Federated language modelling (``edgetrain fl simulate --task language-modeling --model hf:DIR --data
docs.txt``): every node takes an IID shard of the text's token blocks, fine-tunes the causal LM in its budget
with the next-token loss, and the server reports the held-out loss over every counted token (and its
perplexity); driven here with hand-built Flower messages (no engine)."""

import math

import pytest

pytest.importorskip("flwr")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from tests._fl import train_partitions  # noqa: E402
from tests._lm import make_lm  # noqa: E402


@pytest.fixture
def task(tmp_path):
    from edgetrain.fl.spec_task import SpecTask, load_spec_task

    make_lm(tmp_path, repeats=6)
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
    for reply in train_partitions(app, arrays, 2, "400MiB"):
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
