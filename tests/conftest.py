"""Test-suite set-up: one thread per test process, a private cache, a fixed seed per test.

The suite runs in parallel (``pytest -n 2``, pytest-xdist; see the Makefile). With two workers on
two cores, torch's default of one intra-op thread per core would put four spinning OpenMP threads
on two cores, which slows tiny models 10-50x; so every worker, and every subprocess a test starts
(they inherit ``OMP_NUM_THREADS``), uses one thread unless ``LAPHEADS_TEST_THREADS`` says otherwise.
The LM data cache (tokenizer and shards built on the fly) goes to a directory made for this
session, so the suite neither reads nor fills the user's ``~/.cache/lapheads``; workers share it
(builds are atomic renames), so the embedded corpus is tokenized once per session, not per test.
The suite's fault injection is registered here as an engine callback for every process
(``LAPHEADS_CALLBACKS``, :mod:`lapheads.testing`): a test then asks for a fault with one
environment variable, which the runs and ranks it starts inherit.
"""

import gc
import os
import shutil
import tempfile

import pytest
from hypothesis import settings

# torch is imported by the tests, not here: the xdist controller, which only schedules, then starts
# its workers ~3 s sooner. Every process that imports torch after this reads OMP_NUM_THREADS.
_THREADS = os.environ.get("LAPHEADS_TEST_THREADS", "1")
os.environ["LAPHEADS_TEST_THREADS"] = _THREADS
os.environ["OMP_NUM_THREADS"] = _THREADS
os.environ["LAPHEADS_CALLBACKS"] = "lapheads.testing:faults_from_env"

# Property tests (hypothesis) draw the same examples on every run, so CI is never red because one
# run happened upon a new example; `pytest --hypothesis-profile explore` searches with fresh random
# examples (how the '²' head-count bug was found).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("ci")

# The controller process (or a run without xdist) makes the cache folder; xdist workers are
# started by the controller after this file is imported, so they inherit the variable.
_OWN_CACHE = None
if "LAPHEADS_CACHE" not in os.environ:
    _OWN_CACHE = os.environ["LAPHEADS_CACHE"] = tempfile.mkdtemp(prefix="lapheads-test-cache-")


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
    # Each worker has imported torch, timm, transformers, lm-eval...: exit without walking all of that
    # in the shutdown collections (a few seconds per worker; see lapheads.cli._spare_the_exit_collections).
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    # The slow tests first (stable: file order otherwise). pytest-xdist hands tests out in this order,
    # so a 30-50 s multi-process test does not start last on one worker while the other sits idle.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _seed():
    import torch

    if torch.get_num_threads() != int(_THREADS):  # torch imported before this file set the variable
        torch.set_num_threads(int(_THREADS))
    torch.manual_seed(0)
    yield
