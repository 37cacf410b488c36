"""User-facing errors.

Every problem caused by what the user gave us (a config value, a data file, a CLI argument, a
checkpoint) is raised as a subclass of :class:`LapheadsError`. The CLI prints these as one line
(``lapheads: error: ...``) and exits with status 2; the full traceback appears only with
``--debug``. They subclass ``ValueError`` so plain Python callers can catch them the usual way.

Messages should name the file, field or value at fault and say what was expected.
"""

from __future__ import annotations


class LapheadsError(ValueError):
    """Base class of every error caused by user input."""


class ConfigError(LapheadsError):
    """A config file, a ``--set`` override or a keyword argument is invalid."""


class DataError(LapheadsError):
    """A data set, corpus, task file or tokenizer cannot be used."""


class CheckpointError(LapheadsError):
    """A checkpoint or run directory cannot be loaded or would be overwritten."""


class NonFiniteError(RuntimeError):
    """Training produced a NaN or Inf; raised by the engine's guard."""


class RunFailed(LapheadsError):
    """A run that a sweep trained in a subprocess ended with an error (its own error line is quoted)."""
