"""The test suite's own set-up: things that, when wrong, make the suite silently slower or weaker."""

from __future__ import annotations

import os

import pytest


@pytest.mark.xdist_group("suite_setup")
def test_xdist_groups_are_honoured(request):
    """Tests that share a module-scoped run carry ``xdist_group`` so that one worker trains it once.
    pytest 9.2 keeps node ids where pytest-xdist 3.8 cannot append the group: every test then became
    its own group, and each shared run was trained on both workers without a word (constraints.txt
    pins pytest 9.1.1). Under ``--dist loadgroup`` the group must be part of this test's node id."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("runs under pytest-xdist with --dist loadgroup (make test)")
    assert request.node.nodeid.endswith("@suite_setup"), (
        f"pytest-xdist ignored xdist_group under pytest {pytest.__version__} (node id {request.node.nodeid!r}); "
        f"install the versions pinned in constraints.txt (make setup)"
    )
