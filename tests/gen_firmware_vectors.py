"""Writes tests/firmware_vectors.json: the sessions below, with replies from the CPython core.

Run once when a session is added: `PYTHONPATH=. python tests/gen_firmware_vectors.py`.
The replies it records become the frozen expectation of both the CPython and the MicroPython
runs, so read every new reply against docs/firmware-protocol.md before committing it;
regenerating never fixes a failing vector, it only re-blesses whatever the core says.
"""
from __future__ import annotations

import json
import pathlib
import sys

from photonic_testbed.firmware import core, hal_emulated

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import firmware_replay  # noqa: E402

HERE = pathlib.Path(__file__).parent
OUT = HERE / "firmware_vectors.json"

# Fixed heater resistances (ohms), ~1 kOhm +/- 5 %; 0 is an open circuit (no heater wired).
R16 = [1000, 980, 1020, 955, 1045, 1000, 990, 1010, 1030, 970, 1000, 1040, 960, 1005, 995, 1025]
R16_OPEN5 = R16[:5] + [0] + R16[6:]
R56 = [950 + (k * 37) % 101 for k in range(56)]


def s(*lines: str) -> list[dict]:
    """One send step per line, each ended by a newline."""
    return [{"send": line + "\n"} for line in lines]


def raw(*chunks: str) -> list[dict]:
    """Send steps whose bytes are given exactly (line endings included)."""
    return [{"send": chunk} for chunk in chunks]


def wait(ms: int) -> list[dict]:
    return [{"wait_ms": ms}]


POWER_UP = [{"power_up": True}]

SESSIONS = [
    dict(name="identity_and_queries", modules=2, resistances=R16, steps=POWER_UP + s(
        "id?", "firmware?", "nchan?", "vfull?", "ifull?", "nup=0", "nup?", "nupall?", "help",
        "vmax0?", "imax3?", "vall?", "iall?", "vmaxall?", "imaxall?", "wdt?", "pmax?",
        "ptot?", "vhex?", "v15?", "i15?", "id", "nchan")),
    dict(name="set_and_read_back", modules=2, resistances=R16, steps=POWER_UP + s(
        "v0=1.5", "v0?", "i0?", "v1=2", "v1?", "i1?", "v2=12", "v2?", "i2?", "v3=0", "v3?",
        "i3?", "v15=11.9999", "v15?", "  v4 = 3.25  ", "v4?", "v5=1e0", "v5?", "v6=+2.5e-1",
        "v6?", "v7=.5", "v7?", "v8=5.", "v8?", "v9=0.00005", "v9?", "v10=0.00004", "v10?",
        "v11=2.5E+0", "v11?", "v12=0.0000000001e3", "v12?", "v13=00001.00000", "v13?",
        "ptot?", "vall?", "iall?", "vhex?", "v2=0", "v2?", "i2?")),
    dict(name="case_and_line_endings", modules=2, resistances=R16, steps=POWER_UP + raw(
        "V0=1\r\n", "Vmax1?\n", "VMAX1=7.5\r\n", "vMaX1?\r\n", "ID?\r\n", "Id?\n", "\r\n",
        "\n", "   \n", "id?\nv0?\n", "v0", "?\n", "VALL?\r", "\n", "\tv0?\t\n",
        "NUPALL?\r\n", "VvEc2=1,2\r\n", "vhex?\r\n", "vhex0=abcd\n", "VHEX1=ABCD\n", "vhex?\n")),
    dict(name="errors_e01_e02_over_limits", modules=2, resistances=R16, steps=POWER_UP + s(
        "vmax0=5", "vmax0?", "v0=5", "v0?", "v0=5.0001", "v0=6", "v0=12.5", "v0?",
        "v0=0", "vmax0=4.0001", "vmax0?", "v0=4.0001", "v0?", "vmax1=0", "v1=0", "v1=0.0001", "v1?",
        "imax2=3", "imax2?", "v2=5", "v2?", "v2=2.9", "i2?", "i2=3.5", "i2=3", "i2?",
        "imax3=24", "i3=24.0001", "i3?", "vmax4=2", "i4=2.5", "i4?", "v10=12.0001", "v10?")),
    dict(name="error_e03_power_budget", modules=2, resistances=R16, steps=POWER_UP + s(
        "pmax?", "pmax=10", "pmax?", "v0=3", "ptot?", "v1=2", "v1?", "ptot?", "v0=2", "v1=2",
        "ptot?", "vvec2=1,1,1", "vvec2=0.5,0.5", "ptot?", "v0=0", "v1=0", "v2=0", "v3=0",
        "ptot?", "pmax=1152", "vvec0=12,12,12,12,12,12,12,12,12,12,12,12,12,12,12,12",
        "vall?", "vvec0=12,12,12,12,12,12,12,12", "ptot?", "v8=1", "v8?", "pmax=1000",
        "pmax?", "v0=6", "pmax=1000", "pmax?", "pmax=0", "pmax=-5", "pmax=1.5", "pmax=x")),
    dict(name="errors_e10_unknown_command", modules=2, resistances=R16, steps=POWER_UP + s(
        "foo?", "x=1", "?", "=5", "vv0?", "v0!", "foo123?", "bar7=1", "v12345?", "id=1",
        "vall=1", "firmware=2", "help=1", "ptot=1", "1v?", "v-1?", "v 1 2?", "v1.5?")),
    dict(name="errors_e11_bad_parameter", modules=2, resistances=R16, steps=POWER_UP + s(
        "v0=abc", "v3=1.2.3", "v10=abc", "v0=-1", "v0=-0.0001", "v0?5", "v0=", "v0=1e",
        "v0=e5", "v0=1e5000", "v0=.", "v0=+", "v0=1,2", "v0=0x10", "v0=inf", "v0=nan",
        "v0=1 000", "v0=" + "1" * 41, "vmax0=13", "vmax0=-1", "imax0=25", "imax0=x",
        "i0=-1", "i0=q", "wdt=5", "wdt=1.5", "wdt=3600001", "wdt=-10", "wdt=x", "nup=1",
        "nup=x", "vvec0=1,,2", "vvec0=", "vvec0=1,2,", "vvec3=1,x", "vhex0=12",
        "vhex0=zzzz", "vhex0=00010g02", "vhex0=", "id?x", "vall?", "v0?")),
    dict(name="errors_e12_bad_channel", modules=2, resistances=R16, steps=POWER_UP + s(
        "v16=1", "v16?", "v99?", "v100?", "v1234=1", "i16?", "vmax20=1", "imax31?", "v?",
        "v=1", "i?", "vmax?", "vall3?", "iall0?", "vmaxall1?", "id0?", "nchan2?", "wdt1=100",
        "pmax0?", "ptot5?", "vhex0?", "nup1=0", "vvec14=1,2,3", "vvec15=1,2",
        "vvec16=1", "vhex15=00000000", "vhex16=0000", "vvec14=1,2", "vhex15=1000", "vall?")),
    dict(name="error_e13_forbidden", modules=2, resistances=R16_OPEN5, steps=POWER_UP + s(
        "i5=1", "i5?", "v5=3", "v5?", "i5?", "i5=0", "v5=0", "v0=3", "vmax0=2", "vmax0?",
        "vmax0=3", "vmax0?", "v1=5", "imax1=4", "imax1?", "imax1=6", "imax1?", "ptot?",
        "pmax=30", "pmax?", "pmax=40", "pmax?", "v0=0", "v1=0", "vmax0=2", "imax1=4",
        "pmax=1", "pmax?")),
    dict(name="error_e14_overlong_line", modules=2, resistances=R16, steps=POWER_UP + raw(
        "v0=" + "1" * 300 + "\n", "id?\n", "v1?" + " " * 253 + "\n",
        "v1?" + " " * 254 + "\n", "nchan?\n", "x" * 257, "y" * 100, "\nid?\n",
        "v0=1\n" + "z" * 600 + "\nv0?\n", "a" * 256 + "\n", "a" * 256 + "\r\n")),
    dict(name="error_e15_non_ascii", modules=2, resistances=R16, steps=POWER_UP + raw(
        "v0=\xff1\n", "v0?\n", "\x00id?\n", "id?\n", "ab\xc3\xa9cd\nid?\n", "v1=2\x1b\n",
        "v1?\n", "\x80", "\x81\x82 more text", "\nnchan?\n", "\x7f\n", "\x01\x02\x03",
        "v2=1\n", "v2?\n", "\xfe" * 300 + "\nid?\n")),
    dict(name="multi_channel_all_or_nothing", modules=2, resistances=R16, steps=POWER_UP + s(
        "vvec0=1,2,3", "vall?", "vvec2=1,2,13", "vall?", "vmax4=2", "vvec3=1,2.5,1",
        "vall?", "imax5=2", "vvec4=1,3", "vall?", "vvec14=1,2", "vvec?", "vall?",
        "vvec=4,4", "v0?", "v1?", "vhex0=1000200030004000", "vhex?", "vhex=0001", "vhex?",
        "vmax0=1", "vhex0=FFFF0000", "vhex?", "vhex0=155500000000", "vhex?", "vhex14=0fff0fff",
        "vhex?", "imax9=1", "imax12=1", "vvec8=2,2,2,2,2", "vall?", "vhex8=2000200020002000",
        "vhex?", "vvec0=0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0", "vhex?")),
    dict(name="watchdog", modules=2, resistances=R16, steps=POWER_UP + s(
        "wdt?", "wdt=100", "wdt?", "v0=5", "v1=3") + wait(90) + s("vall?") + wait(100) + s(
        "v0?") + wait(120) + s("v0?", "v1?", "vhex?") + wait(40) + s("v0?") + wait(60) + s(
        "vall?", "vhex?", "v0=6") + wait(150) + s("v0?", "v0=2", "v0?") + wait(100) + s(
        "v0?") + wait(300) + s("v0?", "wdt=0", "wdt?", "v0=1") + wait(500) + s(
        "v0?", "wdt=10", "wdt?", "wdt=3600000", "wdt?", "WDT=250.0", "wdt?", "wdt=0")),
    dict(name="current_mode", modules=2, resistances=R16, steps=POWER_UP + s(
        "i0=5", "i0?", "v0?", "i0=24.0001", "i0=24", "i0?", "v0?", "i0=0", "i0?",
        "imax1=5", "i1=5", "i1?", "v1?", "imax1?", "i1=4.9", "i1?", "v1=5.2", "i1?", "v1=4",
        "i1=3", "i1?", "v1?", "i2=0.5", "v2?", "i2?", "iall?", "ptot?")),
    dict(name="chain_of_seven", modules=7, resistances=R56, steps=POWER_UP + s(
        "id?", "nchan?", "nupall?", "vfull?", "vvec50=1,2,3,4,5,6", "vall?", "v55=1",
        "v56=1", "v56?", "vvec54=1,2,3", "vhex52=1000100010001000", "vhex?",
        "imax48=1", "imax55=1", "vvec48=2,2,2,2,2,2,2,2", "vvec48=0.5,0.5,0.5,0.5,0.5,0.5,0.5,2",
        "vall?", "vvec0=" + ",".join(["1"] * 56), "ptot?", "iall?",
        "vvec0=" + ",".join(["0"] * 56), "ptot?")),
    dict(name="monitor_photodiodes", modules=2, resistances=R16,
         photocurrents_na=[0, 1, 12345.6, 999999, 2e6, -5, 50, 7.5, 0.04, 0.05, 100, 200, 300,
                           400, 500, 600],
         steps=POWER_UP + s("pd0?", "pd2?", "pd3?", "pd4?", "pd5?", "pd8?", "pd9?", "PD15?",
                            "pd16?", "pd?", "pd2=1", "pdall?", "pdall3?")),
    dict(name="no_photodiodes", modules=1, resistances=R16[:8], steps=POWER_UP + s(
        "pd0?", "pd7?", "pd8?", "pdall?")),
]


def main() -> None:
    vectors = {"sessions": []}
    for spec in SESSIONS:
        session = {"name": spec["name"], "kind": "Q8iv", "modules": spec["modules"],
                   "channels_per_module": 8, "resistances": spec["resistances"],
                   "steps": [dict(step) for step in spec["steps"]]}
        if "photocurrents_na" in spec:
            session["photocurrents_na"] = spec["photocurrents_na"]
        replies = firmware_replay.run_session(session, core, hal_emulated)
        for step, reply in zip(session["steps"], replies, strict=True):
            step["expect"] = reply.decode("ascii")
        vectors["sessions"].append(session)
    OUT.write_text(json.dumps(vectors, indent=1, ensure_ascii=True) + "\n")
    count = sum(len(x["steps"]) for x in vectors["sessions"])
    print(f"{OUT}: {len(vectors['sessions'])} sessions, {count} steps")


if __name__ == "__main__":
    main()
