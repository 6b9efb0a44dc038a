"""Rows of one tensor unbound (capture/lean_passes.sibling_selects): ``qkv[0], qkv[1], qkv[2]`` of a traced graph
become ``qkv.unbind(0)``'s items, with the values and gradients of the graph as written."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import edgetrain
from edgetrain.capture import lean_passes
from edgetrain.capture.lean_passes import sibling_selects, unbound
from edgetrain.capture.rewrite import rewrite


class _Attention(nn.Module):
    """Multi-head self-attention written as timm / DeiT / Swin and Hugging Face's TimeSformer write it."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q * 0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class _Rows(nn.Module):
    """Reads rows ``rows`` of a 3-row tensor, optionally writing into the first one in place."""

    def __init__(self, rows: tuple[int, ...], write: bool = False, reuse: bool = False) -> None:
        super().__init__()
        self.lin, self.rows, self.write, self.reuse = nn.Linear(4, 12), rows, write, reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).reshape(-1, 3, 4).transpose(0, 1)
        parts = [h[i] for i in self.rows]
        if self.write:
            parts[0].mul_(2.0)
        out = sum(p * (j + 1) for j, p in enumerate(parts))
        return out + h.sum() if self.reuse else out


def _grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(g)
    return y.detach(), [x.grad] + [p.grad for p in module.parameters()]


def test_attention_rows_unbound_same_values_and_gradients():
    torch.manual_seed(0)
    model = _Attention()
    gm = fx.symbolic_trace(copy.deepcopy(model))
    assert rewrite(gm).selects == 1
    assert sum(n.target is unbound for n in gm.graph.nodes) == 1
    x, g = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    y0, grads0 = _grads(model, x, g)
    y1, grads1 = _grads(gm, x, g)
    assert torch.equal(y0, y1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))


@pytest.mark.parametrize("case", [dict(rows=(0, 2)), dict(rows=(0, 1, 2), write=True), dict(rows=(0, 1, 2), reuse=True),
                                  dict(rows=(1, 2))])
def test_left_alone(case):
    """Indices that are not 0..k-1, an in-place write into a row, another reader of the tensor: not rewritten."""
    gm = fx.symbolic_trace(_Rows(**case))
    assert sibling_selects(gm) == 0


def test_shape_unpacking_left_alone():
    gm = fx.symbolic_trace(_Attention())
    sibling_selects(gm)
    assert all(n.args[0].op == "call_method" and n.args[0].target == "permute"
               for n in gm.graph.nodes if n.target is unbound)


def test_fewer_rows_than_the_tensor_has_are_indexed_as_written():
    """``h[0], h[1]`` of a 3-row tensor: rewritten (the graph cannot know the size), indexed as before at run time."""
    torch.manual_seed(1)
    model = _Rows((0, 1))
    gm = fx.symbolic_trace(copy.deepcopy(model))
    assert sibling_selects(gm) == 1
    gm.recompile()
    x, g = torch.randn(5, 4), torch.randn(5, 4)
    y0, grads0 = _grads(model, x, g)
    y1, grads1 = _grads(gm, x, g)
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    t = torch.zeros(3, 2)
    assert unbound(t, 2) is t and unbound((1, 2), 2) == (1, 2) and len(unbound(t, 3)) == 3


def test_hugging_face_timesformer_trains_as_plain_pytorch(monkeypatch):
    """Hugging Face TimeSformer (divided space-time attention, qkv[0], qkv[1], qkv[2], dropout) through prepare():
    the rows are unbound in every attention and the parameters after two steps are plain PyTorch's bits."""
    transformers = pytest.importorskip("transformers")
    counts = []
    real = lean_passes.sibling_selects
    monkeypatch.setattr("edgetrain.capture.rewrite.sibling_selects", lambda gm: counts.append(real(gm)) or counts[-1])
    torch.manual_seed(0)
    cfg = transformers.TimesformerConfig(image_size=16, patch_size=8, num_frames=2, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64, num_labels=5,
                                         hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)

    class Video(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = transformers.TimesformerForVideoClassification(cfg)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(pixel_values=x).logits

    ours = Video().train()
    plain = copy.deepcopy(ours)
    x, y = torch.randn(4, 2, 3, 16, 16), torch.randint(0, 5, (4,))
    loss_fn = nn.functional.cross_entropy
    opt, opt_plain = torch.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    step = edgetrain.prepare(ours, opt, loss_fn, (x, y), memory_budget="2GiB",
                             planning=edgetrain.PlanConfig(use_cache=False))
    assert counts and max(counts) == 2 * cfg.num_hidden_layers  # time and space attention in each layer
    for seed in range(2):
        torch.manual_seed(seed)
        loss = step(x, y)
        torch.manual_seed(seed)
        opt_plain.zero_grad()
        ref = loss_fn(plain(x), y)
        ref.backward()
        opt_plain.step()
        assert float(loss) == ref.item()
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters()))
