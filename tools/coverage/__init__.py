"""The coverage tables of ``docs/``: which architectures of timm and transformers get Laplacian heads, measured.

``python -m tools.coverage timm --write docs/coverage-timm.md`` and ``python -m tools.coverage
transformers --write docs/coverage-transformers.md`` regenerate them (``--check FILE`` compares
instead, printing the diff); tests/test_timm_coverage.py and tests/test_transformers_coverage.py
fail when the committed files are stale.

* :mod:`tools.coverage.table`: the one row type, the status words, the comparison of outputs and
  the Markdown writer.
* :mod:`tools.coverage.timm_table`: timm's families and their check against an independent
  reference (timm's own eager attention with the explicit operator in place of the softmax).
* :mod:`tools.coverage.transformers_table`: transformers' attention families and their check
  (the fused implementation against the explicit eager twin, k = 0, save and reload).

A developer tool, outside the ``lapheads`` package and its wheel.
"""
