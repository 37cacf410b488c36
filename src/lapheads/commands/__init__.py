"""The command-line layer: every ``lapheads <command>`` as a ``main(argv) -> int`` function.

``lapheads.cli`` imports a module of this package only when its command runs. These modules parse
arguments, call the library (``recipes``, ``runs``, ``report``, ``sweep``, ``lm``, ``vision``,
``geometry``) and print; no library module imports them.
"""
