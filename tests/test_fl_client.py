"""The edgetrain ClientApp called directly with hand-built Flower messages and contexts (no engine)."""

import pytest
import torch

pytest.importorskip("flwr")

from tests._fl import context, train_message  # noqa: E402


def _arrays(seed=0):
    from flwr.app import ArrayRecord

    from edgetrain.fl.task import small_cnn

    torch.manual_seed(seed)
    return ArrayRecord(small_cnn().state_dict())


def _app(**kw):
    from edgetrain.fl.apps import mnist_client_app
    from edgetrain.fl.settings import ClientSettings

    base = dict(batch_size=32, local_epochs=1)
    base.update(kw.pop("settings", {}))
    return mnist_client_app(ClientSettings(**base), **kw)


def test_client_trains_in_its_budget_and_reuses_its_plan_in_round_two(tmp_path):
    app = _app(cache_dir=str(tmp_path))
    ctx = context({"partition-id": 1, "num-partitions": 8, "memory-budget": "40MiB", "device-profile": "rpi4"})
    first = app(train_message(_arrays(), server_round=1), ctx)
    assert not first.has_error(), first.error.reason if first.has_error() else ""
    m1 = first.content["metrics"]
    assert m1["plan-cached"] == 0 and m1["budget-bytes"] == 40 << 20
    assert 0 < m1["peak-bytes"] <= m1["budget-bytes"] and m1["within-budget"] == 1
    assert m1["num-examples"] == (500 // 32) * 32 and m1["step-time-s"] > 0
    assert m1["predicted-energy-j"] > 0  # on the rpi4 profile
    assert all(first.content["trained"][k] is True for k in first.content["arrays"].keys())
    second = app(train_message(first.content["arrays"], server_round=2), ctx)
    m2 = second.content["metrics"]
    assert m2["plan-cached"] == 1 and m2["micro-batch-size"] == m1["micro-batch-size"]
    assert m2["prepare-time-s"] < m1["prepare-time-s"]
    assert m2["within-budget"] == 1
    # a node restarted with an empty state finds the plan on disk
    third = app(train_message(second.content["arrays"], server_round=3),
                context({"partition-id": 1, "num-partitions": 8, "memory-budget": "40MiB", "device-profile": "rpi4"}))
    assert third.content["metrics"]["plan-cached"] == 1
    # a different budget is a different plan
    fourth = app(train_message(second.content["arrays"], server_round=3),
                 context({"partition-id": 1, "num-partitions": 8, "memory-budget": "64MiB"}))
    assert fourth.content["metrics"]["plan-cached"] == 0


def test_client_local_training_equals_plain_pytorch_on_the_same_batches():
    """With a micro-batched plan (4 micro-batches of 8, put in the node's plan cache as a first round
    would), the client's update equals plain PyTorch's full-batch steps on the same batches."""
    import edgetrain
    from edgetrain.fl.plan_cache import plan_key, store_plan
    from edgetrain.fl.task import client_batches, load_task, small_cnn

    arrays = _arrays(seed=1)
    data = load_task(8, "iid", 0.5, 0)
    batches = list(client_batches(data, 3, 32, epoch=1))  # round 2, one local epoch: epoch 1
    assert len(batches) == 15
    ctx = context({"partition-id": 3, "num-partitions": 8})
    probe = small_cnn()
    probe.load_state_dict(arrays.to_torch_state_dict())
    step = edgetrain.prepare(probe, torch.optim.SGD(probe.parameters(), lr=0.05, momentum=0.9),
                             torch.nn.functional.cross_entropy, example=batches[0], micro_batch_size=8)
    assert step.plan.micro_batch_size == 8
    key = plan_key(probe, batches[0], budget="64MiB", profile=None, speedup=None, grad_filter=[0, 4])
    store_plan(ctx.state, key, step.plan, step.costs)
    step.close()

    reply = _app(settings={"memory_budget": "64MiB", "lr": 0.05})(train_message(arrays, server_round=2), ctx)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    m = reply.content["metrics"]
    assert m["plan-cached"] == 1 and m["micro-batch-size"] == 8
    ours = reply.content["arrays"].to_torch_state_dict()
    ref = small_cnn()
    ref.load_state_dict(arrays.to_torch_state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(ours["0.weight"], arrays.to_torch_state_dict()["0.weight"])


def test_client_whose_budget_cannot_be_met_replies_with_an_error_not_a_crash():
    from edgetrain.fl import BUDGET_ERROR_CODE

    app = _app()
    reply = app(train_message(_arrays()), context({"partition-id": 0, "num-partitions": 8, "memory-budget": "1MiB"}))
    assert reply.has_error()
    assert reply.error.code == BUDGET_ERROR_CODE
    assert "budget 1MiB cannot be met" in reply.error.reason and "smallest feasible" in reply.error.reason


def test_gradient_filtering_client_marks_its_frozen_tensors_untrained():
    app = _app()
    arrays = _arrays()
    reply = app(train_message(arrays), context({"partition-id": 2, "num-partitions": 8, "memory-budget": "64MiB",
                                                "grad-filter-radius": 2, "grad-filter-last-n": 1}))
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    trained = dict(reply.content["trained"])
    assert set(trained) == set(arrays.keys())  # the same keys as every other client
    assert trained["0.weight"] is False and trained["0.bias"] is False  # before the filtered last conv: frozen
    assert trained["3.weight"] is True and trained["10.weight"] is True
    sent, got = arrays.to_torch_state_dict(), reply.content["arrays"].to_torch_state_dict()
    assert torch.equal(sent["0.weight"], got["0.weight"]) and not torch.equal(sent["3.weight"], got["3.weight"])


def test_settings_come_from_node_config_over_run_config_over_the_factory():
    from edgetrain.errors import InputError
    from edgetrain.fl.settings import ClientSettings

    s = ClientSettings(memory_budget="8MiB", lr=0.1).overridden(
        {"memory-budget": "16MiB", "local-epochs": 3, "partition": "iid"}, {"memory-budget": "32MiB", "speedup": "2"})
    assert (s.memory_budget, s.local_epochs, s.lr, s.speedup) == ("32MiB", 3, 0.1, 2.0)
    assert ClientSettings().grad_filter is None
    assert ClientSettings(grad_filter_radius=2).grad_filter.radius == 2
    with pytest.raises(InputError, match="batch-size"):
        ClientSettings().overridden({"batch-size": "many"})


def test_evaluate_replies_with_the_accuracy_of_the_arrays_it_is_sent():
    from edgetrain.fl.task import evaluate_accuracy, load_task, small_cnn

    arrays = _arrays(seed=2)
    reply = _app()(train_message(arrays, message_type="evaluate"), context({"partition-id": 0, "num-partitions": 8}))
    m = reply.content["metrics"]
    model = small_cnn()
    model.load_state_dict(arrays.to_torch_state_dict())
    data = load_task(8, "iid", 0.5, 0)
    acc, loss = evaluate_accuracy(model, data.test_x, data.test_y)
    assert m["num-examples"] == 1000 and m["eval-acc"] == acc and abs(m["eval-loss"] - loss) < 1e-9
