"""The HeteroFL baseline client: it trains the leading blocks of the global model and says which."""

import pytest
import torch

pytest.importorskip("flwr")

from tests._fl import context, train_message  # noqa: E402


def test_heterofl_client_trains_the_width_sliced_block_and_keeps_the_rest_global():
    from flwr.app import ArrayRecord

    from edgetrain.fl import MaskedFedAvg
    from edgetrain.fl.apps import task_data_fn
    from edgetrain.fl.baseline_heterofl import heterofl_client_app, slice_state
    from edgetrain.fl.settings import ClientSettings
    from edgetrain.fl.strategy import aggregate_masked
    from edgetrain.fl.task import small_cnn

    torch.manual_seed(0)
    full = small_cnn()
    sub = small_cnn(0.5)
    sliced = slice_state(full.state_dict(), sub)
    assert sliced["3.weight"].shape == (32, 16, 3, 3) and sliced["8.weight"].shape == (32, 32 * 9)
    torch.testing.assert_close(sliced["8.weight"], full.state_dict()["8.weight"][:32, :32 * 9])
    sub.load_state_dict(sliced)  # a width-0.5 model built from the global one runs
    assert sub(torch.zeros(2, 1, 28, 28)).shape == (2, 10)

    arrays = ArrayRecord(full.state_dict())
    app = heterofl_client_app(task_data_fn(), lambda ctx, s: 0.5, ClientSettings(batch_size=32, memory_budget="96MiB"))
    reply = app(train_message(arrays), context({"partition-id": 0, "num-partitions": 8}))
    assert not reply.has_error()
    trained = dict(reply.content["trained"])
    assert list(trained["3.weight"]) == [32, 16, 3, 3] and list(trained["10.weight"]) == [10, 32]
    assert trained["10.bias"] is True  # the head's bias is whole at every width
    got = reply.content["arrays"].to_torch_state_dict()
    sent = arrays.to_torch_state_dict()
    assert got["3.weight"].shape == sent["3.weight"].shape  # full-size arrays: the same keys and shapes for all
    assert torch.equal(got["3.weight"][32:], sent["3.weight"][32:])  # outside the block: the global value
    assert not torch.equal(got["3.weight"][:32, :16], sent["3.weight"][:32, :16])
    m = reply.content["metrics"]
    assert m["width"] == 0.5 and m["peak-bytes"] > 0 and m["within-budget"] == 1

    # aggregated alone, the block takes the client's values and the rest stays global
    out = aggregate_masked([reply.content], arrays, "num-examples", "arrays")
    torch.testing.assert_close(torch.as_tensor(out["3.weight"].numpy()), got["3.weight"])
    assert isinstance(MaskedFedAvg(), MaskedFedAvg)


def test_no_width_fitting_is_a_failure_reply():
    from flwr.app import ArrayRecord

    from edgetrain.fl import BUDGET_ERROR_CODE
    from edgetrain.fl.apps import task_data_fn
    from edgetrain.fl.baseline_heterofl import heterofl_client_app
    from edgetrain.fl.settings import ClientSettings
    from edgetrain.fl.task import small_cnn

    app = heterofl_client_app(task_data_fn(), lambda ctx, s: None, ClientSettings(memory_budget="1MiB"))
    reply = app(train_message(ArrayRecord(small_cnn().state_dict())), context({"partition-id": 0, "num-partitions": 8}))
    assert reply.has_error() and reply.error.code == BUDGET_ERROR_CODE
