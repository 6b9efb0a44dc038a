"""The importance probe's two measures (edgetrain.approx.elastic.importance)."""

import pytest
import torch
from torch import nn

from edgetrain.approx.elastic.selector import ElasticConfig, tensor_importance
from edgetrain.errors import InputError


def test_importance_kinds_score_the_gradient_and_the_optimizers_step():
    """"gradient" is |g|^2; "update" is the decrease of the optimizer's own step, lr * |g|_1 for a fresh Adam
    (its first step moves every element by lr * sign(g)), which ranks many small noisy gradients above few
    large ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    names = [n for n, _ in model.named_parameters()]
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-12)
    sq = tensor_importance(model, opt, (x, y), nn.CrossEntropyLoss(), names, "gradient")
    l1 = tensor_importance(model, opt, (x, y), nn.CrossEntropyLoss(), names, "update")
    for g, a, b in zip(grads, sq, l1):
        assert a == pytest.approx(float(g.double().pow(2).sum()), rel=1e-9)
        assert b == pytest.approx(1e-3 * float(g.double().abs().sum()), rel=1e-4)
    with pytest.raises(ValueError, match="importance kind"):
        tensor_importance(model, opt, (x, y), nn.CrossEntropyLoss(), names, "fisher")
    with pytest.raises(InputError, match="importance must be one of"):
        ElasticConfig(importance="fisher")
