"""Developer tools of the repository (not part of the ``lapheads`` package or its wheel).

``python -m tools.coverage <library>`` regenerates the coverage tables of ``docs/``.
"""
