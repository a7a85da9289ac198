"""Shared fixtures: emulated instruments on real wires (pty, loopback sockets)."""
from __future__ import annotations

import os

import pytest

from photonic_testbed.emulator.dac_board import EmulatedDACBoard


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PTB_RIG"):
        return
    skip = pytest.mark.skip(reason="hardware test: set PTB_RIG to a rig file to run it")
    for item in items:
        if "hardware" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def dac_board(tmp_path):
    """The emulated 7-module (56-channel) heater DAC chain behind a real pty."""
    board = EmulatedDACBoard(tmp_path / "dac", modules=7, seed=3)
    board.start()
    yield board
    board.close()
