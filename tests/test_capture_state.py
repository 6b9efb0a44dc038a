"""What capture must keep of a forward beyond its values and gradients: buffers the forward writes (through a
chain of in-place calls too), random draws that no traced tensor takes part in (LayerDrop's ``torch.rand([])``),
and a forward that differentiates inside itself, refused for what it is."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain

from _semantics import Stack, assert_same_state, plain_step, prepared


class _Averaged(nn.Module):
    """A residual block keeping a running mean of its output in a buffer, written by a chain of in-place calls."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(32, 32)
        self.register_buffer("avg", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.relu(self.l1(x))
        self.avg.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)  # mul_ returns the buffer: add_ writes it too
        return h


@pytest.mark.parametrize("solver", ["recompute_all", "no_saving"])
def test_an_in_place_call_on_a_buffer_written_by_another_stays_in_place(solver):
    """The rewrite made ``self.avg.mul_(0.9).add_(m)`` out of place from ``add_`` on (its argument, ``mul_``'s
    result, is the buffer, not a temporary): the buffer was only ever multiplied, and stayed 0 where plain PyTorch
    moved it to ~0.05, with every gradient exact and no word."""
    torch.manual_seed(0)
    model = Stack(_Averaged)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plain = plain_step(model, x, y)
    m, step = prepared(model, x, y, solver=solver)
    assert step.chain.method == "fx"
    torch.manual_seed(5)
    step(x, y)
    assert plain.blocks[0].avg.abs().sum() > 0
    assert_same_state(plain, m)


def test_a_trace_that_loses_a_buffer_write_is_not_used(monkeypatch, caplog):
    """Capture compares the buffers the traced graph writes with the forward's on the example batch; a trace that
    loses a write (here the rewrite is made to lose it, as it did) is dropped for the module tree, not trained."""
    import edgetrain.capture.rewrite as rewrite

    monkeypatch.setattr(rewrite, "_returns_its_input", lambda n: False)
    torch.manual_seed(0)
    model = Stack(_Averaged)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plain = plain_step(model, x, y)
    with caplog.at_level(logging.INFO, logger="edgetrain.capture.trace"):
        m, step = prepared(model, x, y, solver="recompute_all")
    assert step.chain.method == "modules"
    assert "does not write buffer(s) blocks.0.avg, blocks.1.avg, blocks.2.avg as its forward does" in caplog.text
    torch.manual_seed(5)
    step(x, y)
    assert_same_state(plain, m)


class _LayerDrop(Stack):
    """LayerDrop as Hugging Face's speech and translation models write it: one draw decides whether a block runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if not (self.training and torch.rand([]) < 0.5):
                h = block(h)
        return self.head(h)


@pytest.mark.parametrize("solver", ["recompute_all", "no_saving"])
def test_a_draw_deciding_whether_a_layer_runs_is_drawn_every_step(solver):
    """torch.fx ran ``torch.rand([]) < p`` while tracing (no traced tensor in it) and froze the layers it dropped
    into the graph: every step after dropped the capture's layers, and the gradients of the others were missing or
    extra against plain PyTorch, with no word. Capture now sees the generator move while tracing and takes the
    blocks for stages (each runs its own forward, its draws replayed by a recomputation)."""
    torch.manual_seed(0)
    model = _LayerDrop(depth=4)
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    m, step = prepared(model, x, y, solver=solver)
    assert step.chain.method == "modules"
    for seed in range(5, 11):  # six steps from the same weights, a different set of layers dropped in most
        ref = plain_step(model, x, y, seed)
        m.load_state_dict(model.state_dict())
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(seed)
        step(x, y)
        assert_same_state(ref, m)


class _PhysicsInformed(nn.Module):
    """A physics-informed network: its output carries du/dx, taken with torch.autograd.grad inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.requires_grad else x.requires_grad_(True)
        u = self.net(x)
        return torch.cat([u, torch.autograd.grad(u.sum(), x, create_graph=True)[0]], 1)


def test_a_forward_that_differentiates_itself_is_refused_for_what_it_is():
    """Capture runs the example without gradients; a forward calling torch.autograd.grad fails there, and prepare said
    "PINN failed on the example batch ... Check the example's shapes and dtypes", about an example that was right."""
    torch.manual_seed(0)
    model = _PhysicsInformed()
    x, y = torch.randn(8, 2), torch.randn(8, 3)
    with pytest.raises(edgetrain.CaptureError, match="differentiates inside itself .torch.autograd.grad") as e:
        edgetrain.prepare(model, torch.optim.Adam(model.parameters()), nn.MSELoss(), example=(x, y))
    assert "shapes and dtypes" not in str(e.value)
    with pytest.raises(edgetrain.CaptureError, match="shapes and dtypes"):  # an example that is wrong still says so
        edgetrain.prepare(model, torch.optim.Adam(model.parameters()), nn.MSELoss(), example=(torch.randn(8, 3), y))


@pytest.mark.parametrize("micro_batch_size", [None, 4])
def test_hugging_face_layerdrop_with_dropout_trains_exactly(micro_batch_size):
    """Hugging Face's own LayerDrop (BART: ``torch.rand([])`` per layer in training) with dropout, every stage
    recomputed, whole and in micro-batches (against plain accumulation over the same micro-batches)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bart = transformers.BartForSequenceClassification(transformers.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, num_labels=3,
        encoder_layerdrop=0.5, decoder_layerdrop=0.5, dropout=0.1)).train()

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bart = bart

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.bart(input_ids=ids).logits

    model = Classifier()
    ids = torch.randint(3, 100, (6, 12))
    ids[:, -1] = 2  # one end-of-sequence token per row, where BART's classification head reads
    y = torch.randint(0, 3, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = edgetrain.verify(model, torch.optim.AdamW(model.parameters(), lr=1e-3), F.cross_entropy, (ids, y),
                                  tolerance=0.0, planning=edgetrain.PlanConfig(solver="recompute_all",
                                                                               micro_batch_size=micro_batch_size))
    assert report.passed and report.recomputed == report.stages > 1, str(report)


class _EmaTeacher(nn.Module):
    """BYOL-style: an online network trained, a teacher kept as the average of its weights, updated inside the
    forward (MoCo's key encoder is updated the same way), through ``.data`` or under ``torch.no_grad()``."""

    def __init__(self, through_data: bool) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 8))
        self.teacher = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 8))
        self.teacher.requires_grad_(False)
        self.through_data = through_data

    def update_teacher(self) -> None:
        with torch.no_grad():
            for t, o in zip(self.teacher.parameters(), self.online.parameters()):
                if self.through_data:
                    t.data.mul_(0.9).add_(o.data, alpha=0.1)
                else:
                    t.mul_(0.9).add_(o, alpha=0.1)

    def forward(self, x: torch.Tensor, update: bool = True) -> torch.Tensor:
        if self.training and update:
            self.update_teacher()
        return torch.stack([self.online(x + 0.1), self.teacher(x - 0.1)], 1)


def _byol_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2 - 2 * F.cosine_similarity(out[:, 0], out[:, 1].detach(), dim=-1).mean()


@pytest.mark.parametrize("through_data", [False, True])
def test_a_forward_averaging_into_parameters_is_refused_and_the_step_after_it_is_exact(through_data):
    """Every forward edgetrain ran (each recomputation, each micro-batch) averaged the online weights into the
    teacher again: its weights 8-9% from plain PyTorch's after three steps, silently. Refused now, before any
    forward of prepare's own touches them, naming the fix: update after each step, which trains exactly."""
    torch.manual_seed(0)
    model = _EmaTeacher(through_data)
    teacher = copy.deepcopy(model.teacher.state_dict())
    x, y = torch.randn(8, 12), torch.zeros(8)
    opt = torch.optim.SGD(model.online.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(edgetrain.InputError, match=r"writes parameter\(s\) teacher.0.weight.*after each step"):
        edgetrain.prepare(model, opt, _byol_loss, (x, y), planning=edgetrain.PlanConfig(solver="recompute_all"))
    for k, v in model.teacher.state_dict().items():
        assert torch.equal(v, teacher[k]), k  # the refusal left the teacher as it was

    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.online.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = edgetrain.prepare(model, opt, _byol_loss, ((x, False), y),
                                 planning=edgetrain.PlanConfig(solver="recompute_all"))
    for _ in range(3):
        step((x, False), y)
        model.update_teacher()
        ref_opt.zero_grad()
        _byol_loss(ref(x, False), y).backward()
        ref_opt.step()
        ref.update_teacher()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reparametrise", ["prune", "weight_norm"])
def test_verify_copies_a_model_whose_hooks_keep_a_computed_weight(reparametrise):
    """torch.nn.utils.prune (and the old weight_norm) keep ``weight`` as a tensor autograd made, remade before
    every forward; after one forward with gradients, ``copy.deepcopy`` refuses it, and ``edgetrain.verify``
    failed with torch's 'Only Tensors created explicitly by the user (graph leaves) support the deepcopy
    protocol'. The step itself was exact; verify now copies such a weight detached."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))
    for i in (0, 2):
        if reparametrise == "prune":
            prune.l1_unstructured(model[i], "weight", amount=0.5)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated for the parametrization, still used
                torch.nn.utils.weight_norm(model[i])
    F.cross_entropy(model(torch.randn(4, 12)), torch.randint(0, 5, (4,))).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    report = edgetrain.verify(model, opt, F.cross_entropy, (torch.randn(8, 12), torch.randint(0, 5, (8,))),
                              tolerance=1e-6, planning=edgetrain.PlanConfig(solver="recompute_all"))
    assert report.passed and report.recomputed == report.stages > 1, str(report)


class _Reseeding(nn.Module):
    """Reseeds torch's generator from the system in its forward (Hugging Face's Reformer does, ``torch.seed()``, to
    keep a seed per reversible layer), then drops out: no two runs draw alike, plain PyTorch's included."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            torch.seed()
        return self.body(F.dropout(x, 0.5, self.training))


def test_verify_says_when_plain_pytorchs_own_step_does_not_repeat():
    """verify reported FAIL, parameters 0.9 apart, on a model whose plain steps differ from run to run (Reformer's),
    which read as edgetrain's error; it now runs the plain step twice and says the comparison cannot tell."""
    torch.manual_seed(0)
    model = _Reseeding()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = edgetrain.verify(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                                  (torch.randn(8, 12), torch.randint(0, 5, (8,))))
    assert not report.passed
    assert any("own step does not repeat" in n for n in report.notes), str(report)
    torch.manual_seed(1)
    steady = nn.Sequential(nn.Linear(12, 5))
    report = edgetrain.verify(steady, torch.optim.SGD(steady.parameters(), lr=0.1), F.cross_entropy,
                              (torch.randn(8, 12), torch.randint(0, 5, (8,))), tolerance=0.0)
    assert report.passed and not any("repeat" in n for n in report.notes), str(report)


class _GradModeBranch(nn.Module):
    """Takes another path when gradients are off (as code with a separate inference kernel does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2.0 if torch.is_grad_enabled() else 1.0)


@pytest.mark.parametrize("micro", [None, 4])
def test_a_forward_branching_on_the_gradient_mode_trains_as_plain_pytorch(micro):
    """torch.fx traced the forward without gradients and kept that branch; every step, with gradients on, took the
    other in plain PyTorch: with stages recomputed, parameters 13% apart after three steps, silently. The trace is
    now compared with one made with gradients on, and such a model runs as blocks of its module tree."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), _GradModeBranch(), nn.ReLU(), _GradModeBranch(), nn.ReLU(),
                          nn.Linear(16, 5))
    report = edgetrain.verify(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                              (torch.randn(8, 12), torch.randint(0, 5, (8,))), tolerance=1e-6,
                              planning=edgetrain.PlanConfig(solver="recompute_all", micro_batch_size=micro))
    assert report.passed and report.recomputed == report.stages > 1, str(report)
