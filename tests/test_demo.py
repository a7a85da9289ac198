"""`ptb demo` past the length where its report lost the restart (issue 15, item 8): the report
reads the job's own restart record and its running totals, not a window of recent events, so
it holds however long the job runs before and after the failure."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_long_demo_reports_the_restart_it_recovered_from(tmp_path):
    # 15 s before and after the failure: the job's last 500 events hold only steps by then
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "demo", "--headless",
                           "--ideal-chip", "--seconds", "15", "--workdir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    for line in ("failure injected", "detected by the agent", "circuits applied",
                 "verified by light", "restart ordered", "job restarted", "job resumed",
                 "demo succeeded"):
        assert line in out, out
    restarted = re.search(r"job restarted .*from the checkpoint at step (\d+), (\d+) steps "
                          r"redone", out)
    resumed = re.search(r"job resumed \(first step\) .*step (\d+)", out)
    assert restarted and resumed, out
    assert int(resumed.group(1)) == int(restarted.group(1)) + 1
    rates = dict(re.findall(r"^  (before|during|after)\s+([\d.]+)", out, re.M))
    assert float(rates["before"]) > 0 and float(rates["after"]) > 0, out
    assert "gpu3" not in out.split("ranks now on")[1].split(";")[0]
    assert "communications over a down link: 0" in out
