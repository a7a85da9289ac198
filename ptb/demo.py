"""`ptb demo`: the main job on the built-in emulator.

For now: start the emulated heater DAC chain, drive it through our driver over its real
pseudo-terminal, and print each step: identify, set heaters, read currents back, a refused
over-voltage, the USB link pulled and restored, and the watchdog ramping outputs to 0 V.
"""
from __future__ import annotations

import time

from drivers.heater_dac import BoardError, HeaterDAC
from hil.emulator.rig import EmulatedRig, rig_spec


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the stack's main job on the built-in emulator")
    p.add_argument("--rig", default="lumion", help="emulated rig (default lumion)")
    p.add_argument("--seed", type=int, default=0, help="seed of the hidden physical truth")
    p.set_defaults(func=run)


def say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.3f} s] {text}", flush=True)


def run(args) -> int:
    t0 = time.monotonic()
    with EmulatedRig(rig_spec(args.rig), seed=args.seed) as rig:
        port = rig.endpoints["dac"]
        say(t0, f"emulated heater DAC chain listening on {port}")
        with HeaterDAC(port) as dac:
            info = dac.info
            say(t0, f"identified {info.ident}, firmware {info.firmware}: "
                    f"{len(info.modules)} modules, {info.channels} channels, "
                    f"{info.vfull:g} V / {info.ifull:g} mA full scale")
            volts = [round(0.1 * (c % 40), 2) for c in range(info.channels)]
            lines = dac.set_voltages(volts)
            say(t0, f"set {info.channels} heaters (0.0 .. 3.9 V) in {lines} serial line(s)")
            currents = dac.currents()
            ohms = [v / i * 1000 for v, i in zip(volts, currents) if i > 0]
            say(t0, f"read back currents: heater resistance {min(ohms):.0f} .. "
                    f"{max(ohms):.0f} ohm, total power {dac.total_power():.1f} mW")
            lines = dac.set_voltages({3: 2.5, 4: 2.5})
            say(t0, f"changed 2 heaters: {lines} line, {dac.bytes_sent} bytes sent so far")
            dac.set_vmax(7, 2.0)
            try:
                dac.set_voltage(7, 2.5)
            except BoardError as e:
                say(t0, f"refused as it must be: {e}")
            rig.dac.unplug()
            say(t0, "USB link pulled (pty closed)")
            rig.dac.replug(power_cycle=True)
            say(t0, "link back after a board power cycle (outputs reset to 0 V)")
            dac.set_voltage(10, 1.0)
            back = dac.voltages()
            same = all(abs(a - b) < 1e-3 for a, b in zip(back, dac.commanded))
            say(t0, f"driver reopened the port by itself ({dac.reconnects} reconnect), "
                    f"restored limits and all {info.channels} voltages: "
                    f"{'match' if same else 'MISMATCH'}")
            dac.set_watchdog(100)
            say(t0, "watchdog armed at 100 ms; host goes silent")
            time.sleep(0.4)
            live = sum(1 for v in rig.dac.outputs if v > 0)
            say(t0, f"watchdog tripped: {live} outputs still above 0 V")
            dac.set_watchdog(0)
    say(t0, "emulator stopped")
    return 0
