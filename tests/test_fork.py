"""prepare()'s analysis in a forked child: results, errors and resident memory come back faithfully."""

import os

import pytest
import torch
from _models import mlp
from torch import nn

import edgetrain
from edgetrain.errors import BudgetError
from edgetrain.profile import fork as _fork
from edgetrain.profile import memory
from edgetrain.runtime import pool

pytestmark = pytest.mark.skipif(not _fork.available(), reason="no fork() here")


def test_child_returns_value_and_errors():
    assert _fork.run_in_child(lambda: {"a": torch.arange(3).tolist()}).value == {"a": [0, 1, 2]}

    def refuse():
        raise BudgetError("too small", budget_bytes=10, min_feasible_bytes=20)

    res = _fork.run_in_child(refuse)
    assert res.value is None and res.budget_error == ("too small", 10, 20)
    res = _fork.run_in_child(lambda: 1 / 0)
    assert res.error.startswith("ZeroDivisionError")


def test_child_sees_the_parents_resident_memory_and_leaves_the_parents_peak_alone():
    def status():
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                if line.startswith(("VmRSS", "RssFile"))}

    # the child releases free heap and garbage cycles before it measures (as prepare does before the first
    # step): a test process holds MiBs of both, which would put the child's raw resident memory that far under
    # its parent's (8.4 MiB in a clean-clone CI run). Released here first, the two compare as they are. So is
    # the tensor pool's cache, which the child's reset_peak empties: a pytest worker that ran lean-op tests
    # before this one held 325 MiB of it, and the child read that much less than its parent.
    memory.release_heap()
    if pool.installed():
        pool.release()
    parent = status()
    child = _fork.run_in_child(status).value
    # shared-library pages the parent holds are touched first, so the child's readings are the parent's
    assert abs(child["VmRSS"] - parent["VmRSS"]) < 8 * 2**20
    assert child["RssFile"] >= parent["RssFile"] - 2 * 2**20
    memory.reset_peak()
    before = memory.peak_rss_bytes()
    res = _fork.run_in_child(lambda: torch.ones(64 * 2**20 // 4).sum().item())  # 64 MiB in the child only
    assert res.value == 64 * 2**20 // 4
    assert res.peak_bytes >= 60 * 2**20  # the child counts what it allocated
    assert memory.peak_rss_bytes() - before < 16 * 2**20


@pytest.mark.parametrize("fork", ["1", "0"])
def test_prepare_with_and_without_the_child_plans_alike(monkeypatch, fork):
    monkeypatch.setenv("EDGETRAIN_FORK", fork)
    torch.manual_seed(0)
    model = mlp(d=64, n_blocks=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16), torch.randint(0, 5, (32,))
    # the budget counts from the import baseline, and this test process already holds what earlier tests left
    budget = memory.rss_bytes() - memory.baseline_rss_bytes() + 200 * 2**20
    step = edgetrain.prepare(model, opt, nn.CrossEntropyLoss(), (x, y), memory_budget=budget)
    assert step.plan.budget_bytes == budget and step.plan.peak_bytes <= budget
    losses = [step(x, y) for _ in range(3)]
    assert losses[-1] < losses[0]


def test_a_child_starts_from_the_parents_resident_memory_and_counts_its_own_heap_growth():
    """A fork's readings must not depend on what its parent did before: touching the parent's file pages
    maps more than those pages (1-2 MiB of whole folios), and free heap the parent retains would absorb the
    child's allocations without raising its resident memory (a plan measured 1-2.5 MiB apart in a fork of
    the analysis child and in a fork of the process itself)."""
    memory.release_heap()
    parent = memory.rss_bytes() - memory.baseline_rss_bytes()
    child = _fork.run_in_child(lambda: memory.rss_bytes() - memory.baseline_rss_bytes()).value
    assert abs(child - parent) < 2**19
    chunks = [bytes(1000 + i % 7) for i in range(16384)]  # 16 MiB of small blocks from glibc's heap
    keep = bytes(1000)  # above them: the heap cannot shrink from the top once they are freed
    del chunks

    def grow():
        start = memory.rss_bytes()
        blocks = [bytes(1000 + i % 7) for i in range(8192)]  # 8 MiB
        return memory.rss_bytes() - start, len(blocks)

    grown, _ = _fork.run_in_child(grow).value
    assert grown >= 6 * 2**20  # counted, not carved unseen from the parent's free heap
    # and the child never starts below its parent: released, that free heap would have put its readings
    # 16 MiB under what the parent holds (a plan measured -1.3 MiB above the baseline fit a 1 KiB budget)
    held = memory.rss_bytes() - memory.baseline_rss_bytes()
    start = _fork.run_in_child(lambda: memory.rss_bytes() - memory.baseline_rss_bytes()).value
    assert start >= held - 2**18
    del keep


def test_the_child_lists_its_parents_page_map_and_falls_back_to_the_parent_listing_it(monkeypatch):
    """The parent allocates nothing for the page list (listing it there left 0.15-0.25 MiB resident for good,
    3% of a small model's step); where a child cannot read its parent's page map, the parent lists it."""
    listed_by: list[int] = []
    real = _fork.resident_file_pages

    def spy(pid="self"):
        listed_by.append(os.getpid())
        return real(pid)

    monkeypatch.setattr(_fork, "resident_file_pages", spy)
    monkeypatch.setattr(_fork, "_LIST_IN_PARENT", False)
    me = os.getpid()
    assert _fork.run_in_child(lambda: 7).value == 7
    assert me not in listed_by  # the child listed it (its own appends stay in the child)

    def unreadable(pid="self"):
        listed_by.append(os.getpid())
        return None if pid != "self" else real(pid)

    monkeypatch.setattr(_fork, "resident_file_pages", unreadable)
    monkeypatch.setattr(_fork, "_LIST_IN_PARENT", False)
    status = _fork.run_in_child(lambda: _fork.file_rss_bytes())
    assert status.error is None and status.value > 0
    assert _fork._LIST_IN_PARENT is True and listed_by.count(me) == 1  # listed here, once, for the rerun


def test_prepare_without_a_budget_runs_no_forward_here():
    """Every forward prepare needs (profiling, the loss's normalisation, whether the forward draws random
    numbers) runs in a child: one here, at a shape no step uses, leaves its kernels and heap resident for every
    step after (an LSTM: 1.09x plain PyTorch's peak for the same schedule, from a 2-sample dropout check)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    calls = []
    model.register_forward_hook(lambda *a: calls.append(os.getpid()))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y))
    assert os.getpid() not in calls, f"{calls.count(os.getpid())} forward(s) in this process"
    step(x, y)
    assert calls.count(os.getpid()) == 1


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_prepares_children_collect_only_what_was_made_after_its_start_and_nothing_stays_frozen():
    """Each forked child collects garbage before it measures. A full collection visits every object (150-190 ms
    with torch imported) and, in a fork, writes each one's header, copying every page of objects: four children
    made a tiny MLP's prepare 1.8 s, 0.8 s once prepare collects and freezes the objects it starts with. The
    children then see them frozen; after prepare, refused or not, nothing is, and what died meanwhile is
    collected as before."""
    import gc
    import weakref

    seen = []
    run = _fork.run_in_child

    def spying(fn):
        res = run(lambda: (fn(), gc.get_freeze_count()))
        if res.value is not None:
            seen.append(res.value[1])
            res.value = res.value[0]
        return res

    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    garbage = _Cycle()
    dead = weakref.ref(garbage)
    del garbage
    alive = _Cycle()
    later = weakref.ref(alive)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_fork, "run_in_child", spying)
        edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y))
        assert dead() is None  # garbage from before prepare is collected, not frozen
        assert seen and min(seen) > 1000, seen  # the children saw torch's objects frozen
        assert gc.get_freeze_count() == 0
        with pytest.raises(BudgetError):
            edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y),
                              memory_budget=1024)
    assert gc.get_freeze_count() == 0
    with memory.objects_frozen():
        with memory.objects_frozen():  # nested: one freeze, undone by the outer block only
            pass
        assert gc.get_freeze_count() > 0
        del alive  # frozen, then dead: collected once the block has ended
        gc.collect()
        assert later() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert later() is None
    gc.freeze()  # the process's own freeze (a server's before it forks workers) is never undone
    try:
        mine = gc.get_freeze_count()
        with memory.objects_frozen():
            pass
        # not undone (unfreezing empties the permanent generation); frozen objects freed by refcount in between
        # leave it, so the count may drop by a few (532635 -> 532633 seen in CI)
        assert mine // 2 < gc.get_freeze_count() <= mine
    finally:
        gc.unfreeze()


def test_capturing_a_model_without_batchnorm_or_dropout_loads_no_native_kernel():
    """Lean BatchNorm's and lean dropout's kernels are built, loaded and self-checked on first use, which leaves
    them and the torch code the check runs resident (an LSTM's named minimum: 21.4 MiB, 24.1 with them)."""
    import subprocess
    import sys

    code = ("import torch, edgetrain\n"
            "from torch import nn\n"
            "from edgetrain.capture import capture, lean_bn, lean_dropout\n"
            "m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))\n"
            "chain = capture(m, torch.randn(2, 8))\n"
            "assert len(chain) > 1, len(chain)\n"
            "print(lean_bn._NATIVE.lib is None, lean_dropout._NATIVE.lib is None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"], out.stdout


def test_an_answer_comes_from_a_plain_child_and_lean_batchnorm_settles_there_as_here():
    from edgetrain.capture import lean_bn
    from edgetrain.forking import answer_in_fork

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert answer_in_fork(os.getpid) not in (None, os.getpid())
        assert answer_in_fork(lambda: 1 / 0) is None  # an error there: the caller works it out here
        there = answer_in_fork(lean_bn._settle_variant)
        assert there is not None and there == lean_bn._settle_variant()  # the variant this process would find
    finally:
        torch.set_num_threads(threads)


def _parallel_step() -> tuple[int, float]:
    """A convolution's forward and backward and a matmul, under a minute's alarm (a hang answers nothing)."""
    import signal

    signal.alarm(60)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 8, 3, 3, generator=g, requires_grad=True)
    torch.nn.functional.conv2d(torch.randn(16, 8, 32, 32, generator=g), w).square().sum().backward()
    a = torch.randn(512, 512, generator=g)
    return torch.get_num_threads(), float(w.grad.sum() + (a @ a).sum())


def test_a_child_runs_this_processs_intra_op_threads():
    # GNU OpenMP hangs a forked child whose main thread starts a parallel region after the parent's ran one;
    # the child runs on a thread of its own, with its own pool, so it measures what two threads hold here.
    from edgetrain.forking import answer_in_fork

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        here = _parallel_step()  # the parent's pool now exists
        assert answer_in_fork(_parallel_step) == (2, here[1])
    finally:
        torch.set_num_threads(threads)


def test_a_child_thread_runs_under_the_callers_grad_mode_and_autocast():
    from edgetrain.forking import answer_in_fork

    def state() -> tuple:
        return (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu")),
                torch.get_num_threads())

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert answer_in_fork(state) == state() == (False, True, "torch.bfloat16", 2)
        assert answer_in_fork(state) == (True, False, str(torch.get_autocast_dtype("cpu")), 2)
    finally:
        torch.set_num_threads(threads)


def test_a_refused_budget_profiles_each_set_of_sizes_once(monkeypatch, tmp_path):
    """Naming the smallest budget re-profiles at the sizes a retry would use; sizes already profiled in this
    prepare, in whichever child, are not measured again (the disk cache is off, as in the tests)."""
    from transformers import BertConfig, BertForSequenceClassification

    from edgetrain.profile import stages

    log = tmp_path / "fits"
    real_fit = stages._fit

    def counting_fit(chain, lo, s_lo, hi, s_hi):
        with open(log, "a") as f:  # children write here too: a fork inherits the patch, not a counter
            f.write(f"{lo},{hi}\n")
        return real_fit(chain, lo, s_lo, hi, s_hi)

    monkeypatch.setattr(stages, "_fit", counting_fit)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=3)
    model = BertForSequenceClassification(cfg)
    ids, y = torch.randint(0, 200, (16, 24)), torch.randint(0, 3, (16,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(BudgetError) as e:
        edgetrain.prepare(model, opt, lambda out, t: nn.functional.cross_entropy(out.logits, t), (ids, y),
                          memory_budget="1MiB")
    assert e.value.min_feasible_bytes > 2**20
    fitted = log.read_text().split()
    assert len(fitted) >= 2, fitted  # the first profile, and at least one re-profile for the number named
    assert len(fitted) == len(set(fitted)), f"sizes profiled more than once: {fitted}"


def test_validating_children_are_forked_without_what_capture_left_cached(monkeypatch, tmp_path):
    """Capture runs the model in the process that then forks the validating children; the tensor pool kept
    the blocks it freed (10 MiB for MobileNetV2 at batch 32) and the children's readings started 1.7 MiB above
    where the step starts: a plan validated at 66.3 MiB measured 64.6 in the steps, and a budget of 64.9 was
    refused naming 72.5 MiB (70.8 with them handed back). Every fork, in this process or in the analysing child,
    finds the pool holding nothing cached."""
    if not pool.installed() and not pool.install():
        pytest.skip("no tensor pool here")
    log = tmp_path / "cached.txt"
    real = _fork.fork_pipe

    def spying(child):
        with open(log, "a") as f:  # appended from the analysing child too
            f.write(f"{os.getpid()} {pool.stats().cached_bytes}\n")
        return real(child)

    monkeypatch.setattr(_fork, "fork_pipe", spying)
    monkeypatch.setenv("EDGETRAIN_NO_CACHE", "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(32 * 16 * 16, 5))
    x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 5, (32,))
    edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, y),
                      memory_budget="1GiB")
    rows = [line.split() for line in log.read_text().splitlines()]
    here = [int(c) for pid, c in rows if int(pid) == os.getpid()]
    child = [int(c) for pid, c in rows if int(pid) != os.getpid()]
    assert len(here) >= 3 and child, rows  # profiling, analysis, and validation from this process and the child
    assert all(int(c) == 0 for _, c in rows), rows
