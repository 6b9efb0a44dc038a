"""Mask-aware aggregation against hand-computed averages, and the data partitions."""

import numpy as np
import pytest

pytest.importorskip("flwr")


def test_masked_average_weights_each_element_by_the_clients_that_trained_it():
    from edgetrain.fl import masked_average

    g = {"w": np.array([[1.0, 1.0], [1.0, 1.0]], dtype=np.float32), "b": np.array([5.0], dtype=np.float32),
         "frozen": np.array([7.0, 7.0], dtype=np.float32), "count": np.array(3, dtype=np.int64)}
    a = {"w": np.array([[2.0, 4.0], [6.0, 8.0]], np.float32), "b": np.array([1.0], np.float32),
         "frozen": np.array([7.0, 7.0], np.float32), "count": np.array(4, np.int64)}
    b = {"w": np.array([[10.0, 1.0], [1.0, 1.0]], np.float32), "b": np.array([9.0], np.float32),
         "frozen": np.array([7.0, 7.0], np.float32), "count": np.array(6, np.int64)}
    # client a (300 examples) trained everything but "frozen"; client b (100) only the leading 1x1 block of w
    out = masked_average(g, [(a, {"w": True, "b": True, "frozen": False, "count": True}, 300.0),
                             (b, {"w": [1, 1], "b": False, "frozen": False, "count": False}, 100.0)])
    # w[0,0]: (300*2 + 100*10) / 400 = 4.0; every other element only client a's
    np.testing.assert_array_equal(out["w"], np.array([[4.0, 4.0], [6.0, 8.0]], np.float32))
    np.testing.assert_array_equal(out["b"], np.array([1.0], np.float32))  # only a trained it
    np.testing.assert_array_equal(out["frozen"], g["frozen"])  # nobody trained it: the global value
    assert out["count"] == 4 and out["count"].dtype == np.int64
    # plain FedAvg would have given w[0,1] = (300*4 + 100*1)/400 = 3.25 and b = 3.0: the mask matters
    fedavg_b = (300 * 1.0 + 100 * 9.0) / 400
    assert fedavg_b != out["b"][0]


def test_masked_average_without_masks_is_fedavg():
    from edgetrain.fl import masked_average

    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=(3, 4)).astype(np.float32)}
    clients = [({"w": rng.normal(size=(3, 4)).astype(np.float32)}, None, float(n)) for n in (10, 30, 60)]
    out = masked_average(g, clients)
    expected = sum(c[0]["w"].astype(np.float64) * c[2] for c in clients) / 100.0
    np.testing.assert_allclose(out["w"], expected.astype(np.float32), rtol=1e-6)


def test_strategy_aggregates_replies_with_their_trained_records_and_logs_failures():
    from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

    from edgetrain.fl import MaskedFedAvg
    from tests._fl import reply_message, train_message

    strat = MaskedFedAvg(fraction_evaluate=0.0)
    strat._global = ArrayRecord({"x": Array(np.array([1.0, 1.0], np.float32)),
                                 "y": Array(np.array([0.0], np.float32))})

    def reply(x, y, trained_y, n, node):
        return reply_message(RecordDict({
            "arrays": ArrayRecord({"x": Array(np.array(x, np.float32)), "y": Array(np.array(y, np.float32))}),
            "metrics": MetricRecord({"num-examples": n, "partition-id": node, "within-budget": 1}),
            "trained": ConfigRecord({"x": True, "y": trained_y})}), node)

    failed = Message(Error(code=4001, reason="edgetrain: budget 1MiB cannot be met"), reply_to=train_message(
        strat._global, node_id=9))
    arrays, _ = strat.aggregate_train(1, [reply([3.0, 5.0], [2.0], True, 100, 1),
                                          reply([7.0, 1.0], [0.0], False, 300, 2), failed])
    np.testing.assert_allclose(arrays["x"].numpy(), [(3 * 100 + 7 * 300) / 400, (5 * 100 + 1 * 300) / 400])
    np.testing.assert_allclose(arrays["y"].numpy(), [2.0])  # only node 1 trained y
    assert strat.history[0]["failures"] == ["edgetrain: budget 1MiB cannot be met"]
    assert [c["partition-id"] for c in strat.history[0]["clients"]] == [1, 2]


def test_a_batchnorm_models_arrays_aggregate_into_an_array_record():
    """BatchNorm's num_batches_tracked is a 0-d integer tensor: its average must stay an array Flower takes
    (a NumPy scalar made every round of a BatchNorm model fail on the server after the clients trained)."""
    import torch
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from edgetrain.fl.strategy import aggregate_masked

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
    model(torch.randn(4, 1, 5, 5))  # a training forward: running statistics and the counter move
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    contents = [RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in state.items()}),
                            "metrics": MetricRecord({"num-examples": n}),
                            "trained": ConfigRecord({k: True for k in state})}) for n in (10, 30)]
    out = aggregate_masked(contents, None, "num-examples", "arrays")
    assert out["1.num_batches_tracked"].numpy().shape == () and int(out["1.num_batches_tracked"].numpy()) == 1
    loaded = out.to_torch_state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_iid_and_dirichlet_partitions_cover_every_sample_once():
    from edgetrain.fl.partition import dirichlet_partition, iid_partition, label_histogram

    labels = np.repeat(np.arange(10), 100)
    for shards in (iid_partition(1000, 8, seed=1), dirichlet_partition(labels, 8, alpha=0.3, seed=1)):
        allidx = np.concatenate(shards)
        assert sorted(allidx.tolist()) == list(range(1000))
    iid = label_histogram(labels, iid_partition(1000, 8), 10)
    skew = label_histogram(labels, dirichlet_partition(labels, 8, alpha=0.3), 10)
    # label skew: each client's largest class share is far above the IID ~10%
    assert (skew.max(1) / skew.sum(1)).mean() > 2 * (iid.max(1) / iid.sum(1)).mean()
    assert dirichlet_partition(labels, 8, alpha=0.3, seed=4)[0].tolist() == \
        dirichlet_partition(labels, 8, alpha=0.3, seed=4)[0].tolist()
    with pytest.raises(ValueError):
        dirichlet_partition(labels, 8, alpha=0.0)
