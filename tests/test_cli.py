"""The console entry point (``lapheads``, ``python -m lapheads.cli``) as a process sees it."""

from __future__ import annotations

import gc
import sys

from lapheads import __version__
from lapheads.cli import entry


class _Cycle:
    """Cyclic garbage with a finalizer: freed only by a collection, which runs ``__del__``."""

    finalized: list[str] = []

    def __init__(self, name: str):
        self.name, self.me = name, self

    def __del__(self):
        _Cycle.finalized.append(self.name)


def test_entry_collects_the_garbage_then_freezes_the_survivors(monkeypatch, capsys):
    """Shutdown collections would walk every object torch & co. made (~1.5 s per process):
    ``entry`` collects what is garbage now (finalizers run, as at exit) and freezes the rest."""
    gc.collect()
    gc.unfreeze()
    _Cycle("before")
    monkeypatch.setattr(sys, "argv", ["lapheads", "--version"])
    try:
        assert entry() == 0
        assert capsys.readouterr().out.strip() == __version__
        assert _Cycle.finalized == ["before"]  # collected before the freeze, not frozen with it
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
