"""Values that cannot cross a stage boundary: captured with the cut elsewhere, trained exactly.

1. Tensors a later op writes in place. A stage's inputs are kept to re-run it (and are leaf tensors while it
   is profiled), so an in-place op on one either fails ("a leaf Variable that requires grad is being used in
   an in-place operation") or, re-run, reads what it wrote itself. Hugging Face's MobileViT ends in
   ``nn.Dropout(inplace=True)`` on the pooled features; before, edgetrain failed to prepare it at all.
2. Tuples of tensors (a ``split``'s or a ``topk``'s result, read item by item later): a stage's gradient inputs are tensors,
   so a tuple crossing tied two stages' autograd graphs ("Trying to backward through the graph a second
   time"); Hugging Face's LeViT failed to prepare.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import edgetrain

OPTIONS = [{"solver": "no_saving"}, {"solver": "recompute_all"}]


def _verify(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn=None, **options) -> edgetrain.VerifyReport:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return edgetrain.verify(model, opt, loss_fn or nn.CrossEntropyLoss(), (x, y), tolerance=0.0,
                                planning=edgetrain.PlanConfig(**options))


def _verify_image_classifier(model: nn.Module, **options) -> edgetrain.VerifyReport:
    """One step of a Hugging Face image classifier on random 32x32 images, through the plan and plain PyTorch."""
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 3, (8,))
    return _verify(model, x, y, lambda out, t: nn.functional.cross_entropy(out.logits, t), **options)


class ViewWrite(nn.Module):
    """Scales a fresh activation in place through a view (an op the graph passes leave in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = torch.sigmoid(x * 3.0)
        m.view(-1).mul_(2.0)
        return self.fc3(torch.relu(self.fc2(self.fc1(m))))


class IndexWrite(nn.Module):
    """Shifts integer positions in place through a view: no gradient, so only a re-run would notice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc2, self.fc3 = nn.Embedding(20, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.remainder(ids, 7)
        pos.view(-1).add_(1)
        return self.fc3(torch.relu(self.fc2(self.emb(pos).mean(1))))


class TopKLater(nn.Module):
    """Reads the values of a ``topk`` (a tuple whose backward keeps the indices) again two layers later."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.a(x).topk(8, dim=-1)
        g = torch.relu(self.b(top.values))
        g = torch.relu(self.b(g))
        return self.c(g * top.values)


class InplaceDropouts(nn.Module):
    """Dropout modules of every kind with ``inplace=True`` between layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.drop = nn.Dropout(0.3, inplace=True)
        self.drop1d = nn.Dropout1d(0.3, inplace=True)
        self.alpha = nn.AlphaDropout(0.2, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.drop(self.a(x)))  # on outputs no op saves: plain PyTorch's autograd allows it
        h = torch.tanh(self.drop1d(self.b(h).unsqueeze(-1)).squeeze(-1))
        h = torch.tanh(self.alpha(self.c(h)))
        return self.d(h)


@pytest.mark.parametrize("options", OPTIONS, ids=["keep", "recompute"])
@pytest.mark.parametrize("case", ["view-write", "index-write"])
def test_inplace_write_on_a_would_be_stage_input_trains_exactly(case, options):
    torch.manual_seed(0)
    if case == "view-write":
        model, x = ViewWrite(), torch.randn(8, 8)
    else:
        model, x = IndexWrite(), torch.randint(0, 20, (8, 5))
    y = torch.randint(0, 3, (8,))
    report = _verify(model, x, y, **options)
    assert report.passed, str(report)
    assert report.stages > 1


@pytest.mark.parametrize("options", OPTIONS + [{"micro_batch_size": 4}], ids=["keep", "recompute", "micro4"])
def test_inplace_dropout_modules_are_cut_around_and_replay_their_masks(options):
    torch.manual_seed(0)
    model = InplaceDropouts()
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    report = _verify(model, x, y, **options)
    assert report.passed, str(report)
    assert report.stages >= 3, "in-place dropout should be made out-of-place, not merged into one stage"


@pytest.mark.parametrize("options", OPTIONS, ids=["keep", "recompute"])
def test_hugging_face_mobilevit_trains_exactly(options):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MobileViTConfig(image_size=32, hidden_sizes=[32, 48, 64], num_labels=3,
                                          neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 80])
    model = transformers.MobileViTForImageClassification(config)
    assert isinstance(model.dropout, nn.Dropout) and model.dropout.inplace
    report = _verify_image_classifier(model, **options)
    assert report.passed, str(report)
    assert report.stages > 10


@pytest.mark.parametrize("options", OPTIONS, ids=["keep", "recompute"])
def test_a_tuple_of_tensors_read_later_stays_inside_a_stage(options):
    torch.manual_seed(0)
    report = _verify(TopKLater(), torch.randn(8, 8), torch.randint(0, 3, (8,)), **options)
    assert report.passed, str(report)
    assert report.stages > 1


@pytest.mark.parametrize("options", OPTIONS, ids=["keep", "recompute"])
def test_hugging_face_levit_trains_exactly(options):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LevitConfig(image_size=32, patch_size=16, hidden_sizes=[32, 48, 64], depths=[1, 1, 1],
                                      num_attention_heads=[1, 2, 2], key_dim=[8, 8, 8], mlp_ratio=[2, 2, 2],
                                      attention_ratio=[2, 2, 2], drop_path_rate=0, num_labels=3)
    model = transformers.LevitForImageClassification(config)
    report = _verify_image_classifier(model, **options)
    assert report.passed, str(report)
    assert report.stages > 10
