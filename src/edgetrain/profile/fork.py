"""Run prepare()'s analysis in a forked child, so that the process being budgeted never exceeds its budget.

Profiling and validating a plan allocate memory; when the budget turns out to be infeasible, finding the
smallest budget that works means running plans above the one asked for. Done in the process itself, that
breaks the promise the budget makes before a single step has run. A child made by ``fork()`` starts as an
exact copy of this process (the same model, batch, allocator, resident pages), so its resident memory
follows what this process's would, while this process's own peak (``VmHWM``) never moves.

A forked child shares its parent's anonymous pages (counted in its resident memory from the start) but
not the page-table entries of file-backed pages (shared-library code, about 100 MiB with torch loaded):
the child faults them in as it runs, so its resident memory would start low and grow by pages that the
parent already holds. The child therefore lists the parent's resident file-backed pages (the parent's
``/proc/PID/pagemap``, read while the parent waits on the child) and touches each of them first. The parent
allocates nothing for this: listed there, the page map's buffers and numpy's first use of its functions
left 0.15-0.25 MiB more resident in the parent for good, which showed as the same in every step after
``prepare`` (a 10 MiB model's peak 3% over plain PyTorch's). Touching maps a little more than those pages
(whole folios), and the heap's free pages would absorb the child's first allocations unseen; the child
therefore releases its free heap (as ``prepare`` does before the first step) and takes what it mapped beyond
the parent's file pages off its baseline (:func:`_settle`), so that every reading the analysis takes is the
one the parent would take, whatever the parent did before forking.

The child runs this process's intra-op threads, on a thread of its own (GNU OpenMP, which PyTorch's CPU
build uses, deadlocks in a forked child whose thread starts a parallel region after the same thread in the
parent ran one; a new thread starts its own pool: :func:`edgetrain.forking.on_new_thread`). Times depend on
the thread count, and memory does too (each thread keeps its own scratch, oneDNN caches primitives per thread
count), so what the child measures is what this process will. Where no thread can be started there, the
child runs one intra-op thread; a process running more then takes the child's costs and plan, runs the plan
once itself and, when that measures over the budget, has a new child plan with the difference held back
(:func:`edgetrain.planning.threads.train_here`).

``EDGETRAIN_FORK=0`` turns the child off (the analysis then runs in this process, as without fork()).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import traceback
from dataclasses import dataclass, is_dataclass, replace
from typing import Any, Callable

import torch

from .. import settings
from ..errors import BudgetError
from ..forking import NoThreadError, fork_pipe, on_new_thread, write_all
from ..units import format_bytes
from . import memory

__all__ = ["ChildResult", "analyse_safely", "available", "measure_in_child", "raise_budget_error", "run_in_child"]

log = logging.getLogger("edgetrain.api")


@dataclass
class ChildResult:
    """What the child sent back.

    Attributes:
        value: the function's return value (None when it raised).
        budget_error: ``(message, budget_bytes, min_feasible_bytes)`` when it raised a BudgetError.
        error: ``"Type: message"`` of any other exception (the caller reruns the work here to raise it).
        peak_bytes: the child's peak resident memory above the import baseline.
        threads: the intra-op threads it ran (the parent's, unless no thread could be started there).
    """

    value: Any = None
    budget_error: tuple[str, int | None, int | None] | None = None
    error: str | None = None
    peak_bytes: int = 0
    threads: int = 1


def available() -> bool:
    """fork() exists, is not switched off, and no CUDA context would be copied into the child."""
    if not settings.fork_enabled():
        return False
    if not hasattr(os, "fork") or sys.platform == "darwin":  # macOS frameworks are not fork-safe
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_initialized())


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PAGEMAP_CHUNK = 1 << 15  # pages per pagemap read (256 KiB of entries)


def resident_file_pages(pid: int | str = "self") -> list[tuple[int, Any]] | None:
    """Addresses of a process's resident pages in readable file-backed mappings, per mapping.

    Args:
        pid: the process (default this one); a forked child passes its parent's, whose mappings it shares.

    Returns ``[(mapping start, numpy array of page indices)]``; None where the page map is not readable.
    """
    import numpy as np

    out: list[tuple[int, Any]] = []
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pm:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or not parts[5].startswith("/") or parts[1][0] != "r":
                    continue
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                n = (hi - lo) // _PAGE
                # in chunks: a large file mapping (Ray's object store maps GiBs) would otherwise make one
                # read of 8 bytes per page, tens of MiB charged to the budget of the process being measured
                found = []
                for first in range(0, n, _PAGEMAP_CHUNK):
                    count = min(_PAGEMAP_CHUNK, n - first)
                    raw = os.pread(pm.fileno(), 8 * count, 8 * (lo // _PAGE + first))
                    entries = np.frombuffer(raw, dtype=np.uint64)
                    hit = np.nonzero(entries >> np.uint64(63))[0]
                    if hit.size:
                        found.append(hit + first)
                if found:
                    out.append((lo, np.concatenate(found)))
    except (OSError, ValueError) as e:
        log.debug("could not read the page map of process %s (%s)", pid, e)
        return None
    return out


def _touch(pages: list[tuple[int, Any]]) -> None:
    """Read one byte of each listed page, in numpy (a Python loop over tens of thousands of pages would
    leave a MiB of freed int objects in the child's heap, measured as if the step had allocated it)."""
    import ctypes

    import numpy as np

    for lo, idx in pages:
        size = (int(idx[-1]) + 1) * _PAGE
        view = np.frombuffer((ctypes.c_char * size).from_address(lo), dtype=np.uint8)
        view[idx * _PAGE].sum()


def file_rss_bytes() -> int:
    """Resident file-backed memory of this process (``RssFile``), 0 where unknown."""
    kib = memory._status_kib("RssFile:")
    return 0 if kib is None else kib * 1024


def _settle(parent_file_rss: int, parent_rss: int = 0) -> int:
    """Bring the child to the state its readings must start from; returns the baseline shift applied.

    Two things would make a fresh fork read differently from the process it stands for, by amounts that
    depend on what that process did before forking (1-2.5 MiB between a fork of the analysis child and a
    fork of the process itself, so that a budget named in one was refused in the other):

    * the heap's free pages (garbage cycles, glibc's retained free chunks) would absorb allocations without
      raising resident memory: they are released here, as ``prepare`` releases them before the first step;
    * touching the parent's file pages maps more than those pages (the kernel maps whole folios and the
      pages around a fault: 1.1-2.1 MiB more of shared-library code than the parent holds, the more so the
      sparser the parent's mappings): the excess over the parent's ``RssFile`` is taken off every reading by
      raising the child's baseline by it.
    """
    memory.release_heap()
    excess = max(0, file_rss_bytes() - parent_file_rss) if parent_file_rss else 0
    # but never below the parent: releasing a large free heap (a process that loaded data, built the model)
    # would start the readings under what the parent holds, and a plan measured at -1.3 MiB above the
    # baseline was taken at a 1 KiB budget. From the parent's state, growth is counted in full.
    shift = min(excess, memory.rss_bytes() - parent_rss) if parent_rss else excess
    memory.shift_baseline(shift)
    return shift


#: the parent lists its page map itself before each fork (set once a child could not read its parent's,
#: e.g. under a stricter ptrace policy); otherwise the child lists it
_LIST_IN_PARENT = False


def _child(fn: Callable[[], Any], w: int, pages: list[tuple[int, Any]] | None, parent: int, parent_file_rss: int,
           parent_rss: int, threads: int) -> None:
    result = ChildResult(threads=threads)

    def run() -> None:
        nonlocal pages
        if pages is None:  # listed here, while the parent waits: its page tables do not change meanwhile
            pages = resident_file_pages(parent)
        if pages is None:
            result.error = _NO_PAGE_MAP  # the parent lists them and forks again
            return
        _touch(pages)
        listed = bool(pages)
        pages = None  # the list is freed before the child settles: the readings must not hold it
        _settle(parent_file_rss if listed else 0, parent_rss)
        memory.reset_peak()
        result.value = fn()

    try:
        if threads > 1:
            memory.one_arena()  # the new thread allocates as the parent's main thread does
        try:
            on_new_thread(run, threads)
        except NoThreadError:  # one intra-op thread then, on this thread; the parent allows for more
            result.threads = 1
            on_new_thread(run, 1)
    except BudgetError as e:
        result.budget_error = (str(e), e.budget_bytes, e.min_feasible_bytes)
    except BaseException as e:  # noqa: BLE001 -- everything goes back to the parent, which decides
        result.error = f"{type(e).__name__}: {e}"
        log.debug("analysis in the child failed:\n%s", traceback.format_exc())
    result.peak_bytes = max(0, memory.peak_rss_bytes() - memory.baseline_rss_bytes())
    try:
        data = pickle.dumps(result)
    except Exception as e:  # noqa: BLE001 -- an unpicklable value: report it instead
        data = pickle.dumps(ChildResult(error=f"result not picklable: {e}", peak_bytes=result.peak_bytes))
    write_all(w, data)


_NO_PAGE_MAP = "no page map: the child could not read its parent's"


def run_in_child(fn: Callable[[], Any]) -> ChildResult | None:
    """Run ``fn()`` in a forked copy of this process and return what it sent back.

    Returns:
        The child's result, or None when the child could not be started or died without answering
        (killed for memory, a crash): the caller then does the work itself.
    """
    global _LIST_IN_PARENT
    res = _fork_and_run(fn, (resident_file_pages() or []) if _LIST_IN_PARENT else None)
    if res is not None and res.error == _NO_PAGE_MAP:
        log.debug("a forked child cannot read its parent's page map; listing it before each fork instead")
        _LIST_IN_PARENT = True
        res = _fork_and_run(fn, resident_file_pages() or [])
    return res


def _fork_and_run(fn: Callable[[], Any], pages: list[tuple[int, Any]] | None) -> ChildResult | None:
    from ..runtime import pool

    # The child unmaps the pool's cached blocks before it measures, and its readings then start below this
    # process's resident memory, which :func:`_settle` takes as a heap given back and counts against the run:
    # the cache goes here first, so that the child starts from this process's live memory
    pool.release()
    parent_rss = memory.rss_bytes()
    parent_file_rss = file_rss_bytes()
    parent = os.getpid()
    threads = torch.get_num_threads()
    try:
        data, status = fork_pipe(lambda w: _child(fn, w, pages, parent, parent_file_rss, parent_rss, threads))
    except OSError as e:
        log.info("could not fork for the analysis (%s); running it in this process", e)
        return None
    if not data:
        log.warning("the analysis child died (wait status %d) without an answer; running it in this process",
                    status)
        return None
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001
        log.warning("could not read the analysis child's answer (%s); running it in this process", e)
        return None


def analyse_safely(capture_chain: Callable[[], Any], analyse: Callable[..., Any], budget: int | None,
                   can_fork: bool, profile: Callable[[Any], Any] | None = None,
                   summary: Callable[[Any], Any] | None = None,
                   memo: dict[str, Any] | None = None,
                   more_threads: Callable[..., Any] | None = None) -> tuple[Any, Any]:
    """Capture the chain and analyse it where the memory this takes cannot break the budget.

    With a budget, the work runs in forked children, so that a BudgetError is raised here before this
    process has run the model at all. When ``profile`` is given, one child profiles and a second, forked
    afresh from this process, plans and validates from those costs: profiling runs many micro-batch sizes
    and leaves oneDNN kernels and allocator heap behind for each (tens of MiB on a small CNN), which a
    validation in the same process would count as the step's own and so refuse budgets that fit. When the
    children find a plan, this process captures the chain (the children have shown that fits) and, if it
    runs one intra-op thread as they did, plans and validates here from their costs (no profiling);
    otherwise it analyses again here.

    Args:
        capture_chain: builds the stage chain.
        analyse: ``analyse(chain)`` profiles, plans and validates, returning a result with ``.costs`` and
            ``.plan``; ``analyse(chain, costs)`` skips profiling; ``analyse(chain, costs, outcome)`` also runs
            ``outcome``'s plan (the child's) first, in its way of holding the optimizer state.
        budget: the memory budget (None: no child is needed).
        can_fork: False runs everything in this process.
        profile: ``profile(chain)`` returns the costs ``analyse`` takes; None profiles in the validating child.
        summary: without a budget, ``summary(chain)`` returns ``(costs, chain summary)`` for ``analyse``, run
            in a child; the chain is then captured here only when the plan runs stages.
        memo: a dict ``profile`` fills (profiles by cache key); with a budget, what the profiling child put
            there is copied back here, so that the analysis does not profile the same sizes again.
        more_threads: in a process running more intra-op threads than the child,
            ``more_threads(chain, analyse, costs, outcome, budget)`` takes the child's outcome as this process
            can train it (:func:`edgetrain.planning.threads.train_here`); None validates it here as with one.

    Returns:
        ``(chain, analyse(chain[, costs]))``; the chain is None when it was not captured here (no budget,
        and a plan that runs the model's own forward).
    """
    if not can_fork or not available() or (budget is None and profile is None and summary is None):
        chain = capture_chain()
        return chain, analyse(chain)
    if budget is None:
        # Nothing to keep inside, but capture and profiling run the model at sizes and shapes the steps
        # never use, and the kernels, heap and graphs they leave would stay with this process for good:
        # both run in a child. The plan without a budget keeps everything, whatever the child's single
        # thread measured; what profiling left resident in the child (kernels, heap) stands for what this
        # process's first step will leave, so that the predicted peak stays honest. A plan that recomputes
        # nothing runs the model's own forward (``PlainExecutor``), so the chain is captured here only
        # for a plan that runs stages; otherwise the step captures it if a later plan needs it.
        from ..runtime.executor import needs_stages

        if summary is not None:
            res = run_in_child(lambda: summary(capture_chain()))
            if res is not None and res.error is None:
                costs, info = res.value
                outcome = analyse(info, costs)
                return (capture_chain() if needs_stages(outcome.plan) else None), outcome
        elif profile is not None:
            res = run_in_child(lambda: profile(capture_chain(), with_overhead=True))
            if res is not None and res.error is None:
                chain = capture_chain()
                return chain, analyse(chain, res.value)
        chain = capture_chain()
        return chain, analyse(chain)

    def captured() -> Any:
        chain = capture_chain()
        # Capture ran the model, and the tensor pool and the heap keep what it freed: handed back before the
        # validating children are forked, whose readings would start that much above where the step starts
        # (MobileNetV2 at 70 MiB: a plan validated at 66.3 MiB measured 64.6 in the steps; 65.1 with this)
        memory.release_cached()
        return chain

    costs = None
    if profile is not None:
        res = run_in_child(lambda: (profile(capture_chain()), memo))
        if res is not None:
            log.info("profiling in a child process peaked at %s (budget %s)", format_bytes(res.peak_bytes),
                     format_bytes(budget))
            raise_budget_error(res)
            if res.error is None:
                costs, profiled = res.value
                if memo is not None:
                    memo.update(profiled)
            else:
                log.info("profiling in the child failed (%s)", res.error)
    res = run_in_child(lambda: analyse(captured(), costs) if costs is not None else analyse(captured()))
    if res is not None:
        log.info("analysis in a child process peaked at %s (budget %s)", format_bytes(res.peak_bytes),
                 format_bytes(budget))
        raise_budget_error(res)
        if res.error is not None:
            log.info("analysis in the child failed (%s); running it here", res.error)
    chain = captured()
    if res is not None and res.error is None:
        # Plan and validate here from the child's corrected costs: this process holds no kernels of the
        # profiled shapes, and its own first run of the plan is measured like the child's was. The child's
        # way of holding the optimizer state is tried first (the child validated the ways against each other)
        # and its plan run first: its run measured what the costs alone may rule out (activations below the
        # profile's), and this process re-planning from the costs took slower plans than the child's.
        # A child that could not run this process's intra-op threads (no thread could be started there) ran
        # one: its costs are taken too (profiling and validating every size here left 8-16 MiB of kernels and
        # heap in it for good), and its plan is run here once to measure what the threads add.
        if res.threads == torch.get_num_threads() or more_threads is None:
            return chain, _thread_note(analyse(chain, res.value.costs, res.value), res.threads)
        return chain, _thread_note(more_threads(chain, analyse, costs, res.value, budget), res.threads)
    return chain, analyse(chain)


def _thread_note(outcome: Any, child_threads: int) -> Any:
    """``outcome``, its plan noting that its predicted times are for the child's fewer intra-op threads when
    the child could not run this process's (memory was measured here, at this process's thread count)."""
    threads = torch.get_num_threads()
    if threads == child_threads or not is_dataclass(outcome) or not hasattr(outcome, "plan"):
        return outcome
    note = (f"predicted times are for {child_threads} intra-op thread (the analysing child could start no more); "
            f"this process runs {threads}, so its steps are faster than predicted")
    return replace(outcome, plan=outcome.plan.replace(notes=(*outcome.plan.notes, note)))


def raise_budget_error(res: ChildResult) -> None:
    if res.budget_error is not None:
        message, budget_bytes, need = res.budget_error
        raise BudgetError(message, budget_bytes=budget_bytes, min_feasible_bytes=need)


def measure_in_child(fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a fresh fork of this process, or None when that cannot be done faithfully.

    Used for validation runs: a fork starts from this process's exact memory, so what ``fn`` measures is
    what this process would measure on its first run, and nothing ``fn`` builds (kernels for a new
    micro-batch size, allocator heap) stays behind to inflate the next measurement. The child runs this
    process's intra-op threads (memory depends on the thread count); one that could not is not taken.
    """
    if not available():
        return None
    res = run_in_child(fn)
    if res is not None and res.threads != torch.get_num_threads():
        return None
    if res is None or res.error is not None or res.budget_error is not None:
        if res is not None:
            log.debug("validation in a child failed (%s); running it in this process", res.error)
        return None
    return res.value
