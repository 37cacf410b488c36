"""CPU thread choice (engine/threads.py): explicit settings win, auto leaves busy cores alone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from lapheads.engine import threads as TH
from lapheads.errors import ConfigError
from lapheads.recipes.shipped import CONFIG_DIR


def test_explicit_setting_then_environment_then_auto(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert TH.choose_threads(5) == (5, "train.threads")
    assert TH.choose_threads(0) == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(TH, "available_cpus", lambda: 8)
    monkeypatch.setattr(TH, "busy_fraction", lambda window_s=0.15: 0.0)
    assert TH.choose_threads(0)[0] == 8
    assert TH.choose_threads(0, local_world_size=2)[0] == 4  # torchrun ranks share the node
    monkeypatch.setattr(TH, "busy_fraction", lambda window_s=0.15: 6 / 8)  # six cores busy elsewhere
    n, why = TH.choose_threads(0)
    assert n == 2 and "6.0 busy" in why
    monkeypatch.setattr(TH, "busy_fraction", lambda window_s=0.15: 1.0)
    assert TH.choose_threads(0)[0] == 1  # never zero


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_bad_environment_value_is_a_config_error(monkeypatch, bad):
    monkeypatch.setenv("OMP_NUM_THREADS", bad)
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
        TH.choose_threads(0)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_requested_value_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="train.threads"):
        TH.choose_threads(bad)


def test_a_spinning_process_is_seen_as_busy():
    """Another process keeping a core busy raises the measured busy fraction to at least ~1 core
    (other load on the machine can only add to it, so the bound holds on a loaded machine)."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        frac = TH.busy_fraction(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert frac >= 0.7 / TH.available_cpus()


def test_configure_threads_applies_the_choice(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert TH.configure_threads(2)[0] == 2 and torch.get_num_threads() == 2
        assert TH.configure_threads(0)[0] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_train_threads_is_a_config_field_and_is_validated(tmp_path, capsys):

    from lapheads.cli import main as cli

    digits = str(CONFIG_DIR / "classify" / "digits.yaml")
    assert (
        cli(
            [
                "train",
                "classify",
                "--config",
                digits,
                "--out",
                str(tmp_path / "r"),
                "--set",
                "train.threads=-1",
                "--set",
                "train.max_steps=1",
            ]
        )
        == 2
    )
    assert "train.threads" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_training_applies_train_threads(tmp_path, capsys):
    """The engine applies train.threads before training (the run's config wins over the environment)."""

    from lapheads.cli import main as cli

    digits = str(CONFIG_DIR / "classify" / "digits.yaml")
    before = torch.get_num_threads()
    try:
        assert (
            cli(
                [
                    "train",
                    "classify",
                    "--config",
                    digits,
                    "--out",
                    str(tmp_path / "r"),
                    "--set",
                    "train.threads=2",
                    "--set",
                    "train.max_steps=1",
                    "--set",
                    "model.depth=1",
                    "--set",
                    "model.embed_dim=16",
                    "--set",
                    "data.max_eval_items=16",
                ]
            )
            == 0
        )
        assert "CPU threads: 2 (train.threads)" in capsys.readouterr().out
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
