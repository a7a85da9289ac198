"""Our heater DAC driver against the emulated board, over the real pseudo-terminal."""
from __future__ import annotations

import pytest

from drivers.heater_dac import HeaterDAC, OverVoltage


def test_identify_and_set_over_pty(dac_board):
    with HeaterDAC(str(dac_board.link)) as dac:
        assert dac.info.channels == 56
        assert [m.index for m in dac.info.modules] == list(range(7))
        dac.set_voltages([1.0] * 56)
        assert dac.voltages() == pytest.approx([1.0] * 56, abs=2e-4)
        dac.set_vmax(0, 2.0)
        with pytest.raises(OverVoltage):
            dac.set_voltage(0, 2.5)
        assert dac_board.outputs[0] == pytest.approx(1.0, abs=2e-4)
