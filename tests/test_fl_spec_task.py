"""Your model and data federated (``edgetrain fl simulate --model --data``): every node loads the data from its
spec, takes its own shard, trains its full model in its budget, and the server evaluates the held-out part;
driven here with hand-built Flower messages (no engine)."""

import json
import textwrap

import numpy as np
import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402

from tests._fl import context, train_message, train_partitions  # noqa: E402

FACTORY = textwrap.dedent("""
    from torch import nn

    def mlp(num_classes, in_features, width=16):
        return nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, num_classes))
""")


@pytest.fixture
def task(tmp_path, monkeypatch):
    from edgetrain.fl.spec_task import SpecTask, load_spec_task

    (tmp_path / "h20_fedmodels.py").write_text(FACTORY)
    rng = np.random.default_rng(0)
    names = ["setosa", "versicolor", "virginica"]
    lines = ["sepal length,species,sepal width"]
    for i in range(150):
        c = i % 3
        lines.append(f"{rng.normal(3 * c, 1):.3f},{names[c]},{rng.normal(100 * c, 10):.3f}")
    (tmp_path / "iris.csv").write_text("\n".join(lines) + "\n")
    # the run starts elsewhere: the factory is found through the task's directory, not the current one
    monkeypatch.chdir("/")
    load_spec_task.cache_clear()
    yield SpecTask("h20_fedmodels:mlp", str(tmp_path / "iris.csv"), json.dumps({"width": 8}), target_column="species",
                   cwd=str(tmp_path))
    load_spec_task.cache_clear()


def test_nodes_train_their_own_shards_of_your_data_within_their_budgets(task):
    from flwr.app import ArrayRecord

    from edgetrain.fl.client import client_app
    from edgetrain.fl.settings import ClientSettings
    from edgetrain.fl.spec_task import evaluate_spec, load_spec_task, spec_data_fn, spec_loss_fn, spec_model_fn

    loaded = load_spec_task(task)
    assert (len(loaded.train), len(loaded.test)) == (120, 30) and loaded.info.classes[2] == "virginica"
    model = spec_model_fn(task)()
    assert model[0].in_features == 2 and model[2].out_features == 3
    app = client_app(spec_model_fn(task), spec_data_fn(task, "dirichlet", 0.5),
                     settings=ClientSettings(batch_size=8, lr=0.1), loss_fn=spec_loss_fn(task))
    arrays = ArrayRecord(model.state_dict())
    seen = []
    for reply in train_partitions(app, arrays, 3, "64MiB"):
        m = reply.content["metrics"]
        assert m["within-budget"] == 1 and m["num-examples"] % 8 == 0 and m["num-examples"] > 0
        seen.append(m["num-examples"])
    # the shards are label-skewed draws of the 120 training rows: together at most all of them
    assert sum(seen) <= 120
    acc0, loss0 = evaluate_spec(task, model)
    trained = spec_model_fn(task)()
    trained.load_state_dict(reply.content["arrays"].to_torch_state_dict())
    acc1, loss1 = evaluate_spec(task, trained)
    assert 0.0 <= acc0 <= 1.0 and loss1 < loss0


def test_a_shard_smaller_than_a_batch_and_a_bad_spec_say_what_to_do(task):
    from edgetrain.errors import ConfigError
    from edgetrain.fl.settings import ClientSettings
    from edgetrain.fl.spec_task import SpecTask, load_spec_task, spec_data_fn

    with pytest.raises(ConfigError, match="fewer than one batch of 64: use a smaller batch size or fewer clients"):
        spec_data_fn(task)(context({"partition-id": 0, "num-partitions": 4}), ClientSettings(batch_size=64))
    with pytest.raises(ConfigError, match="does not exist"):
        load_spec_task(SpecTask("h20_fedmodels:mlp", "no-such-file.csv"))


def test_the_command_line_refuses_half_a_task_and_bad_data(capsys):
    from edgetrain.fl.cli import main

    assert main(["simulate", "--model", "x:y"]) == 2
    assert "--model and --data go together" in capsys.readouterr().err
    assert main(["simulate", "--model", "x:y", "--data", "no-such-folder"]) == 2
    assert "does not exist" in capsys.readouterr().err


class _KeywordBlocks(torch.nn.Module):
    """forward(tokens, mask): keyword inputs, and a branch on the data that fx cannot trace (module-tree
    stages, which carry no FLOP counts)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
                                           for _ in range(3)])
        self.head = torch.nn.Linear(16, 3)

    def forward(self, tokens, mask):
        h = self.emb(tokens)
        if mask.sum() > 0:
            h = h * mask.unsqueeze(-1)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(1))


def test_a_node_trains_a_keyword_input_model_on_a_device_profile():
    """Dict batches reach the plan cache's key, and a chain without FLOP counts gets its energy predicted
    (each failed inside the node: "'dict' object has no attribute 'shape'", "a CostChain needs at least one
    stage")."""
    from flwr.app import ArrayRecord

    from edgetrain.fl.client import ClientData, client_app
    from edgetrain.fl.settings import ClientSettings

    g = torch.Generator().manual_seed(0)
    batches = [({"tokens": torch.randint(0, 50, (8, 6), generator=g), "mask": torch.ones(8, 6)},
                torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]

    def model_fn():
        torch.manual_seed(0)
        return _KeywordBlocks()

    test = ({"tokens": torch.cat([b[0]["tokens"] for b in batches]), "mask": torch.ones(24, 6)},
            torch.cat([b[1] for b in batches]))
    app = client_app(model_fn, lambda context, s: ClientData(train=lambda epoch: iter(batches), num_train=24,
                                                             test=test),
                     settings=ClientSettings(batch_size=8, device_profile="rpi4"))
    reply = app(train_message(ArrayRecord(model_fn().state_dict())), context({"memory-budget": "64MiB"}))
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    m = reply.content["metrics"]
    assert m["within-budget"] == 1 and m["num-examples"] == 24 and m["predicted-step-time-s"] > 0
    # the evaluate handler calls the model on keyword inputs as the step does
    evaluated = app(train_message(reply.content["arrays"], message_type="evaluate"), context({}))
    trained = model_fn()
    trained.load_state_dict(reply.content["arrays"].to_torch_state_dict())
    with torch.no_grad():
        expect = float(torch.nn.functional.cross_entropy(trained.eval()(**test[0]), test[1]))
    assert evaluated.content["metrics"]["num-examples"] == 24
    assert abs(evaluated.content["metrics"]["eval-loss"] - expect) < 1e-6
