"""Tests of the in-project models: fx tracing, shapes, parameter counts, the single-tensor chain."""

from __future__ import annotations

import pytest
import torch
from conftest import torch_threads
import torch.fx as fx
from torch import nn

from edgetrain.models import MODEL_NAMES, get_model, mobilenet_v2, resnet18, transformer_classifier


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny ops on cores shared with other processes run far slower with two threads spinning.
    with torch_threads(1):
        yield


def chain_blocks(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The model's children in order, with every nn.Sequential container opened up."""
    blocks = []
    for name, child in model.named_children():
        if isinstance(child, nn.Sequential):
            blocks += chain_blocks(child, f"{prefix}{name}.")
        else:
            blocks.append((f"{prefix}{name}", child))
    return blocks


class _BlockTracer(fx.Tracer):
    """Traces the model with each chain block kept whole (a leaf), so the graph shows what flows
    between blocks, including any tensor the forward creates outside them."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.names or super().is_leaf_module(m, qualname)


def values_crossing_into_blocks(model: nn.Module) -> dict[str, list[str]]:
    """For each block after the first: the graph values produced before its call and used at or
    after it (the tensors a cut just before that block would have to carry)."""
    names = [name for name, _ in chain_blocks(model)]
    graph = _BlockTracer(set(names)).trace(model)
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    crossing = {}
    for i, node in enumerate(nodes):
        if node.op == "call_module" and node.target in names[1:]:
            crossing[node.target] = [n.name for n in nodes[:i]
                                     if any(position[user] >= i for user in n.users)]
    assert set(crossing) == set(names[1:]), "every block must be called exactly once"
    return crossing


def _small_models() -> list[tuple[str, nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("mobilenet_v2", mobilenet_v2(num_classes=10), torch.randn(2, 3, 32, 32)),
        ("mobilenet_v2_w0.5_gray", mobilenet_v2(num_classes=7, in_channels=1, width_mult=0.5),
         torch.randn(2, 1, 32, 32)),
        ("resnet18", resnet18(num_classes=10), torch.randn(2, 3, 32, 32)),
        ("resnet18_small", resnet18(num_classes=5, in_channels=1, small_input=True),
         torch.randn(2, 1, 28, 28)),
        ("transformer_features", transformer_classifier(10, input_dim=28, d_model=32, nhead=4,
                                                        num_layers=2, dim_feedforward=64),
         torch.randn(2, 28, 28)),
        ("transformer_tokens", transformer_classifier(3, vocab_size=50, d_model=32, nhead=2, num_layers=2,
                                                      dim_feedforward=64, max_len=16),
         torch.randint(0, 50, (2, 11))),
    ]


CASES = _small_models()
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("name,model,x", CASES, ids=IDS)
def test_fx_trace_matches_eager(name: str, model: nn.Module, x: torch.Tensor) -> None:
    traced = fx.symbolic_trace(model)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("name,model,x", CASES, ids=IDS)
def test_forward_backward_shapes(name: str, model: nn.Module, x: torch.Tensor) -> None:
    model.train()
    out = model(x)
    num_classes = [m for m in model.modules() if isinstance(m, nn.Linear)][-1].out_features
    assert out.shape == (x.size(0), num_classes)
    assert out.dtype == torch.float32
    out.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name,model,x", CASES, ids=IDS)
def test_exactly_one_tensor_enters_each_block(name: str, model: nn.Module, x: torch.Tensor) -> None:
    crossing = values_crossing_into_blocks(model)
    assert len(crossing) >= 5
    for block, values in crossing.items():
        assert len(values) == 1, f"{name}: {values} all cross into {block}"


@pytest.mark.parametrize("name,model,x", CASES, ids=IDS)
def test_blocks_applied_in_order_equal_the_model(name: str, model: nn.Module, x: torch.Tensor) -> None:
    # The module tree alone is enough to rebuild the forward (the capture fallback relies on it).
    model.eval()
    chain = nn.Sequential(*[m for _, m in chain_blocks(model)])
    with torch.no_grad():
        torch.testing.assert_close(chain(x), model(x), rtol=0, atol=0)


def test_crossing_check_catches_a_shared_tensor() -> None:
    # A forward that builds position ids once and hands them to two blocks is not a chain.
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = x.size(1) * torch.ones(1)
            return self.c(self.b(self.a(x) * scale) * scale)

    crossing = values_crossing_into_blocks(Shared())
    assert len(crossing["b"]) == 2  # b's input and `scale`, which is used again after b


def test_published_parameter_counts() -> None:
    # torchvision's published counts at 1000 classes.
    assert sum(p.numel() for p in resnet18().parameters()) == 11_689_512
    assert sum(p.numel() for p in mobilenet_v2().parameters()) == 3_504_872
    # A 10-class head replaces 513 * 1000 weights+biases; the 3x3 stem replaces 7*7*3*64 with 3*3*3*64.
    assert sum(p.numel() for p in resnet18(num_classes=10, small_input=True).parameters()) == (
        11_689_512 - 513 * 990 - (7 * 7 - 3 * 3) * 3 * 64)


def test_state_dict_keys_follow_torchvision() -> None:
    keys = set(resnet18().state_dict())
    assert {"conv1.weight", "bn1.running_mean", "layer2.0.downsample.0.weight",
            "layer4.1.bn2.num_batches_tracked", "fc.bias"} <= keys
    keys = set(mobilenet_v2().state_dict())
    assert {"features.0.0.weight", "features.0.1.running_var", "features.1.conv.0.0.weight",
            "features.2.conv.0.0.weight", "features.2.conv.3.weight", "features.18.0.weight",
            "classifier.1.weight"} <= keys


@pytest.mark.parametrize("kind", ["features", "tokens"])
def test_transformer_parameter_count(kind: str) -> None:
    d, ff, layers, classes, max_len = 48, 96, 3, 7, 40
    kwargs = {"input_dim": 28} if kind == "features" else {"vocab_size": 100}
    model = transformer_classifier(classes, d_model=d, nhead=4, num_layers=layers, dim_feedforward=ff,
                                   max_len=max_len, **kwargs)
    embed = 28 * d + d if kind == "features" else 100 * d
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d) + 2 * 2 * d
    expected = embed + max_len * d + layers * block + 2 * d + d * classes + classes
    assert sum(p.numel() for p in model.parameters()) == expected


def test_transformer_accepts_any_length_up_to_max_len() -> None:
    model = transformer_classifier(4, vocab_size=20, d_model=16, nhead=2, num_layers=1, max_len=8).eval()
    for length in (1, 5, 8):
        assert model(torch.randint(0, 20, (3, length))).shape == (3, 4)
    with pytest.raises(RuntimeError, match="exceeds dimension size"):
        model(torch.randint(0, 20, (3, 9)))


def test_transformer_dropout_off_in_eval_and_on_in_train() -> None:
    torch.manual_seed(0)
    model = transformer_classifier(4, input_dim=8, d_model=16, nhead=2, num_layers=1, dropout=0.5)
    x = torch.randn(5, 6, 8)
    model.eval()
    torch.testing.assert_close(model(x), model(x))
    model.train()
    assert not torch.allclose(model(x), model(x))


def test_builder_argument_errors() -> None:
    with pytest.raises(ValueError, match="exactly one of vocab_size"):
        transformer_classifier(10)
    with pytest.raises(ValueError, match="exactly one of vocab_size"):
        transformer_classifier(10, vocab_size=5, input_dim=5)
    with pytest.raises(ValueError, match="must divide"):
        transformer_classifier(10, input_dim=5, d_model=30, nhead=4)
    with pytest.raises(ValueError, match="width_mult"):
        mobilenet_v2(width_mult=0)
    with pytest.raises(ValueError, match="num_classes"):
        resnet18(num_classes=0)


def test_registry() -> None:
    assert MODEL_NAMES == ("mobilenet_v2", "resnet18", "transformer")
    assert type(get_model("resnet18", num_classes=3)) is type(resnet18())
    assert get_model("mobilenet_v2", num_classes=4, width_mult=0.25).classifier[1].out_features == 4
    assert get_model("transformer", num_classes=2, input_dim=3).head.out_features == 2
    with pytest.raises(ValueError, match="mobilenet_v2, resnet18, transformer"):
        get_model("vgg16")


def test_resnet_small_input_keeps_resolution() -> None:
    model = resnet18(num_classes=10, small_input=True)
    shapes = []
    model.layer1.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)) and None)
    model(torch.randn(1, 3, 32, 32))
    assert shapes == [(1, 64, 32, 32)]  # the ImageNet stem would give 8x8


def test_tiny_transformer_learns_digit_rows() -> None:
    # Real data: 8x8 digits as 8 tokens of 8 pixels. A 1-layer model must beat chance by far.
    pytest.importorskip("sklearn")
    from edgetrain.data import load_digits8x8

    torch.manual_seed(0)
    data = load_digits8x8(seed=0)
    model = transformer_classifier(10, input_dim=8, d_model=32, nhead=2, num_layers=1,
                                   dim_feedforward=64, dropout=0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(8):
        for x, y in data.as_sequences("train", batch_size=32, seed=epoch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    model.eval()
    x, y = data.tensors("test", layout="sequence")
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.75  # chance is 0.10; seeds 0-3 reach 0.85-0.90
