"""The module-level globals a torch.fx trace read, wherever in the model's Python code it read them.

A trace runs the forward once and keeps only tensor operations: a global read on the way (a scale, a flag, a
curriculum setting) is baked into the graph as the value it had then. The model's own ``forward`` is not the only
place such a read happens: a helper function it calls (``x * SCALE`` in a function of the model's module), a
method of a submodule, a lambda. :func:`recording_globals` notes every Python function that runs during the
trace; :func:`globals_read` names the globals those functions load (``LOAD_GLOBAL``, read from their bytecode),
so that a step sees one change and traces the model again
(:func:`edgetrain.planning.guards.attribute_key`) instead of training with the value of the capture.

PyTorch's own code, edgetrain's (but for its model definitions) and the standard library's are left out: their
globals are the library's, not the model's.
"""

from __future__ import annotations

import dis
import functools
import gc
import logging
import os
import sys
import sysconfig
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["recording_globals", "globals_read", "loaded_globals"]

_EDGETRAIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SKIPPED = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _EDGETRAIN)
_MODELS = _EDGETRAIN + "models" + os.sep  # edgetrain's own model definitions are model code
_STDLIB = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib")})
_INSTALLED = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})  # under _STDLIB in a venv


@contextmanager
def recording_globals() -> Iterator[dict[types.CodeType, dict[str, Any]]]:
    """Within the block, collect the code object of every Python function called, with its globals (this thread
    only). Line tracing stays off: the hook sees each call and returns at once. A tracer installed before (a
    debugger, coverage) is put back afterwards. The garbage collector is off in the block: its callbacks are not
    the model's code (Hypothesis times every collection in globals of its own)."""
    seen: dict[types.CodeType, dict[str, Any]] = {}

    def hook(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code not in seen:
            seen[frame.f_code] = frame.f_globals

    previous, collecting = sys.gettrace(), gc.isenabled()
    gc.disable()  # a collection would run gc.callbacks (a library's timing hooks) as if the model had called them
    sys.settrace(hook)
    try:
        yield seen
    finally:
        sys.settrace(previous)
        if collecting:
            gc.enable()


@functools.lru_cache(maxsize=4096)
def loaded_globals(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` loads as globals (not those of code objects nested in it: those run as frames of their
    own and are recorded apart)."""
    return tuple(sorted({i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}))


def _model_code(code: types.CodeType) -> bool:
    f = code.co_filename
    if f.startswith(_MODELS):
        return True
    if not (os.path.isabs(f) or f.startswith("<ipython-input")):  # code made at run time: a namedtuple's __new__
        return False
    stdlib = f.startswith(_STDLIB) and not f.startswith(_INSTALLED)
    return not (stdlib or f.startswith(_SKIPPED) or f.startswith("<frozen"))


def globals_read(seen: dict[types.CodeType, dict[str, Any]]) -> tuple[tuple[str, dict[str, Any], str], ...]:
    """``(label, globals dict, name)`` of each global the model's code in ``seen`` (:func:`recording_globals`)
    loads but for modules and loggers: the values a trace may have baked in (a function by identity: the trace
    inlined the one it called). The label names the module."""
    out: dict[tuple[int, str], tuple[str, dict[str, Any], str]] = {}
    for code, g in seen.items():
        if not _model_code(code):
            continue
        for name in loaded_globals(code):
            if name not in g:  # a builtin
                continue
            v = g[name]
            if isinstance(v, (types.ModuleType, logging.Logger, logging.LoggerAdapter)):
                continue
            out.setdefault((id(g), name), (f"global {g.get('__name__', '?')}.{name}", g, name))
    return tuple(out[k] for k in sorted(out, key=lambda k: out[k][0]))
