"""One settings module: every EDGETRAIN_* variable is read there, with one vocabulary per switch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgetrain import settings

SRC = Path(settings.__file__).resolve().parent


@pytest.mark.parametrize("raw,value", [("1", True), ("yes", True), ("ON", True), ("0", False), ("off", False),
                                       ("False", False), ("", True)])
def test_flag_vocabulary(monkeypatch, raw, value):
    monkeypatch.setenv("EDGETRAIN_FORK", raw)
    assert settings.fork_enabled() is value


def test_flag_outside_vocabulary_names_the_variable(monkeypatch):
    monkeypatch.setenv("EDGETRAIN_NATIVE", "maybe")
    with pytest.raises(ValueError, match="EDGETRAIN_NATIVE='maybe'"):
        settings.native_enabled()


def test_no_cache_zero_keeps_the_cache(monkeypatch):
    # before the settings module any non-empty value, "0" included, turned the cache off
    monkeypatch.setenv("EDGETRAIN_NO_CACHE", "0")
    assert settings.cache_enabled()
    monkeypatch.setenv("EDGETRAIN_NO_CACHE", "1")
    assert not settings.cache_enabled()


@pytest.mark.parametrize("raw,mode", [("", "pool"), ("pool", "pool"), ("Tuned", "tuned"), ("system", "system")])
def test_allocator_modes(monkeypatch, raw, mode):
    monkeypatch.setenv("EDGETRAIN_ALLOCATOR", raw)
    assert settings.allocator() == mode


def test_allocator_unknown_mode(monkeypatch):
    monkeypatch.setenv("EDGETRAIN_ALLOCATOR", "jemalloc")
    with pytest.raises(ValueError, match="pool, tuned, system"):
        settings.allocator()


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGETRAIN_CACHE_DIR", str(tmp_path))
    assert settings.cache_dir() == tmp_path
    monkeypatch.delenv("EDGETRAIN_CACHE_DIR")
    assert settings.cache_dir() == Path.home() / ".cache" / "edgetrain"


def test_every_variable_is_read_in_the_settings_module_only():
    pattern = re.compile(r"""environ(?:\.get)?\s*[\[(]\s*["']EDGETRAIN_""")
    readers = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
               if p.name != "settings.py" and pattern.search(p.read_text())]
    assert readers == []
    documented = {s.name for s in settings.SETTINGS}
    mentioned = set()
    for p in SRC.rglob("*.py"):
        mentioned |= set(re.findall(r"EDGETRAIN_[A-Z_]+", p.read_text()))
    mentioned -= {"EDGETRAIN_RESULT"}  # a marker line of the measuring worker's output, not a variable
    assert mentioned <= documented, mentioned - documented


def test_markdown_table_lists_every_setting():
    table = settings.markdown_table()
    for s in settings.SETTINGS:
        assert f"`{s.name}`" in table


def test_override_sets_and_restores(monkeypatch):
    monkeypatch.setenv("EDGETRAIN_FORK", "1")
    monkeypatch.delenv("EDGETRAIN_NO_CACHE", raising=False)
    with settings.override(FORK=False, NO_CACHE=True):
        assert not settings.fork_enabled() and not settings.cache_enabled()
    assert settings.fork_enabled() and settings.cache_enabled()
    with pytest.raises(RuntimeError), settings.override(FORK=None):
        assert settings.fork_enabled()  # unset: the default
        raise RuntimeError
    assert settings.fork_enabled()
    with pytest.raises(KeyError, match="EDGETRAIN_FROK"):
        with settings.override(FROK=0):
            pass
