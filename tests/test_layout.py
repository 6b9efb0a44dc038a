"""PlanConfig(layout=...): a convolutional model's images fed channels-last, exact up to float rounding."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import edgetrain
from edgetrain import PlanConfig
from edgetrain.batch import channels_last_images, has_images
from edgetrain.capture.lean import lean_conv2d, memory_format_of
from edgetrain.measure import Job, run_isolated

from _models import mlp

CL = torch.channels_last


def _resnet(hidden=(8, 16)) -> nn.Module:
    """A Hugging Face ResNet (BatchNorm, residual additions), built offline from a config."""
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=list(hidden), depths=[1, 1],
                                    layer_type="basic", num_labels=5)
    torch.manual_seed(0)
    return transformers.ResNetForImageClassification(cfg).train()


def _loss(out, t):
    return F.cross_entropy(out.logits, t)


def _close(a: nn.Module, b: nn.Module) -> None:
    """Every entry of the two state dicts equal up to channels-last's rounding. The tolerance is absolute as well as
    relative: plain PyTorch's own channels-last step and its NCHW step put a MobileViT BatchNorm bias 2.0e-6 apart on
    an Intel Xeon (a tensor of scale 0.8; biases ahead of a normalisation train at ~1e-9)."""
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        if p.dtype.is_floating_point:
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
        else:
            assert torch.equal(p, q), name  # num_batches_tracked: counted once a step


def _channels_last_twin(model: nn.Module, n: int, size: int, solver: str):
    """``model``'s channels-last step and a plain NCHW copy with its optimizer, from one example and generator."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, size, size, generator=g), torch.randint(0, 5, (n,), generator=g)
    step = edgetrain.prepare(model, opt, _loss, (x, y), memory_budget="1GiB",
                             planning=PlanConfig(layout="channels_last", solver=solver))
    return step, ref, ref_opt, g


def _plain_loss(ref: nn.Module, ref_opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    ref_opt.zero_grad(set_to_none=True)
    loss = _loss(ref(x), y)
    loss.backward()
    ref_opt.step()
    return loss.item()


def test_channels_last_images_converts_only_4d_floating_tensors():
    x = {"pixels": torch.randn(2, 3, 4, 5), "ids": torch.ones(2, 3, 4, 5, dtype=torch.long), "seq": torch.randn(2, 7)}
    got = channels_last_images((x, [torch.randn(2, 3, 4, 4)]))
    assert memory_format_of(got[0]["pixels"]) is CL and torch.equal(got[0]["pixels"], x["pixels"])
    assert got[0]["ids"].is_contiguous() and got[0]["seq"] is x["seq"]
    assert memory_format_of(got[1][0]) is CL
    assert has_images(x) and not has_images({"seq": x["seq"]})


def test_lean_convolution_keeps_a_channels_last_input_channels_last():
    """A sliced convolution must not turn the maps back to NCHW (every later layer would follow, with a copy)."""
    x = torch.randn(8, 4, 12, 12).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(6, 4, 3, 3, requires_grad=True)
    out = lean_conv2d(x, w, None, (1, 1), (1, 1), (1, 1), 1, limit=4 * 4 * 12 * 12 * 3)  # 3 slices
    assert memory_format_of(out) is CL
    ref = F.conv2d(x.detach(), w.detach(), None, 1, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    assert memory_format_of(x.grad) is CL


@pytest.mark.parametrize("solver", ["dp", "recompute_all"])
def test_channels_last_step_trains_as_plain_pytorch(solver):
    """Losses, parameters and BatchNorm statistics follow plain PyTorch's NCHW steps to float rounding, with
    and without recomputation; the plan says the layout, and the step feeds each batch channels-last."""
    model = _resnet()
    step, ref, ref_opt, g = _channels_last_twin(model, 12, 64, solver)
    assert ("recompute" in step.plan.policies) == (solver == "recompute_all")
    assert step.layout == "channels_last"
    assert step.plan.metadata["layout"] == "channels_last" and "channels-last" in step.plan.summary()
    for i in range(3):
        xb, yb = torch.randn(12, 3, 64, 64, generator=g), torch.randint(0, 5, (12,), generator=g)
        ref_loss = _plain_loss(ref, ref_opt, xb, yb)
        assert step(xb, yb) == pytest.approx(ref_loss, rel=1e-5)
        assert xb.is_contiguous()  # the caller's batch is left as it was
    _close(model, ref)
    assert all(p.is_contiguous() for p in model.parameters())  # the parameters are not touched


def test_a_plan_given_back_keeps_its_layout():
    model = _resnet()
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 5, (6,))
    first = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, (x, y),
                              memory_budget="1GiB", planning=PlanConfig(layout="channels_last"))
    again = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, (x, y),
                              memory_budget="1GiB", plan=first.plan, costs=first.costs)
    assert again.layout == "channels_last"
    again(x, y)


def test_auto_compares_layouts_only_where_they_can_differ(caplog):
    """A model without convolutions runs as given with no second profile; a convolutional one is profiled both
    ways and the choice is logged with both predicted steps."""
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    model = mlp()
    with caplog.at_level(logging.INFO, logger="edgetrain.api"):
        step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y),
                                 memory_budget="1GiB", planning=PlanConfig(layout="auto"))
    assert step.layout == "keep" and "layout" not in step.plan.metadata
    assert not [r for r in caplog.records if r.getMessage().startswith("layout:")]
    caplog.clear()
    model = _resnet()
    xi, yi = torch.randn(8, 3, 32, 32), torch.randint(0, 5, (8,))
    with caplog.at_level(logging.INFO, logger="edgetrain.api"):
        step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, (xi, yi),
                                 memory_budget="1GiB", planning=PlanConfig(layout="auto", use_cache=False))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("layout:")]
    assert len(said) == 1 and "as given" in said[0] and "s channels-last" in said[0], said
    assert step.layout == ("channels_last" if said[0].startswith("layout: channels-last") else "keep")
    step(xi, yi)


def test_auto_keeps_the_layout_under_deterministic_algorithms(caplog):
    """A process that asked for deterministic algorithms keeps the batch as given without a comparison, since a
    measured choice could differ between runs (and with it the rounding)."""
    model = _resnet()
    xi, yi = torch.randn(8, 3, 32, 32), torch.randint(0, 5, (8,))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with caplog.at_level(logging.INFO, logger="edgetrain.api"):
            step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, (xi, yi),
                                     memory_budget="1GiB", planning=PlanConfig(layout="auto", use_cache=False))
    finally:
        torch.use_deterministic_algorithms(was)
    assert step.layout == "keep" and "layout" not in step.plan.metadata
    said = [r.getMessage() for r in caplog.records]
    assert any("use_deterministic_algorithms" in m for m in said)
    assert not [m for m in said if m.startswith("layout:")]


@pytest.mark.parametrize("solver", ["no_saving", "recompute_all"])
def test_verify_feeds_the_reference_the_layout_the_plan_feeds(solver):
    """verify compares edgetrain's machinery: with images fed channels-last, plain PyTorch is fed them channels-last
    too, and the step equals it bit for bit (against NCHW, tensors near zero, such as a BatchNorm bias whose
    gradient the next BatchNorm cancels, differ by far more than 1e-5 of their size: float rounding)."""
    from edgetrain.models.zoo import ZOO

    case = ZOO["hf-mobilenet_v2"]
    model = case.build()
    x, y = case.example(8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = edgetrain.verify(model, opt, case.loss_fn, (x, y), tolerance=0.0,
                              planning=PlanConfig(layout="channels_last", solver=solver))
    assert report.passed, str(report)
    assert any("channels-last" in n for n in report.notes)
    if solver == "recompute_all":
        assert report.recomputed == report.stages > 1


def test_layout_is_validated():
    with pytest.raises(ValueError, match="layout"):
        PlanConfig(layout="nhwc")


def test_channels_last_profiles_are_cached_apart(tmp_path, monkeypatch):
    """The profile cache keys the layout: a channels-last step never reads an NCHW profile (other kernels,
    no lean BatchNorm, other costs)."""
    monkeypatch.setenv("EDGETRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EDGETRAIN_NO_CACHE", "0")
    model = _resnet()
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 5, (6,))
    counts = []
    for layout in ("keep", "keep", "channels_last"):
        edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, (x, y), memory_budget="1GiB",
                          planning=PlanConfig(layout=layout))
        counts.append(len(list((tmp_path / "profiles").glob("*.json"))))
    assert counts[0] == counts[1] > 0 and counts[2] > counts[1], counts


def test_channels_last_step_stays_inside_its_budget():
    """Measured in a fresh process: the per-step copy of the batch is counted, the peak stays in the budget."""
    job = Job(model="mobilenet_v2", model_kwargs={"num_classes": 10, "in_channels": 3, "width_mult": 0.5},
              input_shape=(3, 48, 48), batch_size=16, steps=3, threads=1, budget="60MiB", layout="channels_last")
    res = run_isolated(job)
    assert res.ok, res.error
    assert res.plan["metadata"]["layout"] == "channels_last"
    assert res.peak_bytes <= 60 * 2**20


class _Viewing(nn.Module):
    """Flattens its maps with .view(), which needs NCHW strides (common in hand-written CNNs)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.view(y.shape[0], -1))


def test_a_model_that_cannot_take_channels_last_is_kept_by_auto_and_refused_clearly_when_forced():
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    model = _Viewing()
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y),
                             memory_budget="1GiB", planning=PlanConfig(layout="auto"))
    assert step.layout == "keep"
    step(x, y)
    with pytest.raises(edgetrain.CaptureError, match=r"channels-last .*\.view\(\).*layout='keep'"):
        edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y),
                          memory_budget="1GiB", planning=PlanConfig(layout="channels_last"))


def _mobilevit() -> nn.Module:
    """Convolutions, BatchNorm, and attention over unfolded patches (reshapes of the maps)."""
    cfg = transformers.MobileViTConfig(num_channels=3, image_size=32, patch_size=2, hidden_sizes=[16, 24, 32],
                                       neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_labels=5,
                                       num_attention_heads=2)
    torch.manual_seed(0)
    return transformers.MobileViTForImageClassification(cfg).train()


def _convnext() -> nn.Module:
    """Depthwise convolutions and a LayerNorm over channels (permutes to NHWC and back)."""
    cfg = transformers.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                      num_labels=5, image_size=32)
    torch.manual_seed(0)
    return transformers.ConvNextForImageClassification(cfg).train()


@pytest.mark.parametrize("build", [_mobilevit, _convnext])
def test_channels_last_third_party_models_train_as_plain_pytorch(build):
    model = build()
    step, ref, ref_opt, g = _channels_last_twin(model, 8, 32, "recompute_all")
    assert step.layout == "channels_last"
    for i in range(2):
        xb, yb = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 5, (8,), generator=g)
        torch.manual_seed(10 + i)
        ref_loss = _plain_loss(ref, ref_opt, xb, yb)
        torch.manual_seed(10 + i)
        assert step(xb, yb) == pytest.approx(ref_loss, rel=1e-5)
    _close(model, ref)
