"""`ptb demo` past the length where its report lost the restart (issue 15, item 8): the report
reads the job's own restart record and its running totals, not a window of recent events, so
it holds however long the job runs before and after the failure. Without --workdir, the files
it names stay in the folder it names (under the user's cache folder), each stage says when it
starts, and no process of it is left running."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_long_demo_reports_the_restart_it_recovered_from(tmp_path):
    # 15 s before and after the failure: the job's last 500 events hold only steps by then
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "demo", "--headless",
                           "--ideal-chip", "--seconds", "15"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    kept = re.search(r"are kept in (\S+)", out)
    assert kept, out
    folder = pathlib.Path(kept.group(1))
    assert folder.parent == tmp_path / "photonic-testbed", folder
    for name in ("journal.db", "rig.toml", "emulate.log", "serve.log", "agent.log"):
        assert (folder / name).is_file(), (name, out)
    for stage in ("ptb emulate", "ptb serve", "ptb agent"):
        assert re.search(rf"\] starting .*\({stage};", out), (stage, out)
    deadline = time.monotonic() + 30     # every process of the demo stopped (a SIGKILLed one:
    while _running_in(folder):           # soon after)
        assert time.monotonic() < deadline, _running_in(folder)
        time.sleep(0.1)
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


def _running_in(folder: pathlib.Path) -> str:
    """The processes whose command line names `folder` (its rig file, journal, ...)."""
    return subprocess.run(["pgrep", "-a", "-f", str(folder)], capture_output=True,
                          text=True).stdout


def _status(rank_map: dict, t_fail: float) -> dict:
    """The emulated job's status (control `job_status`) after a restart at t_fail + 0.2 s."""
    record = {"t": t_fail + 0.2, "cause": "restart", "rank_map": rank_map, "from_step": 10,
              "lost_steps": 1, "failed_t": t_fail + 0.01, "failure": "GPU(s) gpu3 failed",
              "resumed_t": t_fail + 0.25, "resumed_step": 11, "resumed_steps_done": 12}
    return {"rank_map": rank_map, "steps_done": 20, "down_communications": 0,
            "steps": [[12 + k, len(rank_map), t_fail + 0.3 + k, t_fail + 0.35 + k]
                      for k in range(8)], "restart_records": [record]}


def test_a_degraded_job_is_no_success(capsys):
    """With no healthy spare the job shrinks and runs on: the demo says so and exits 1."""
    from photonic_testbed.ptb.demo import _report
    t = 1000.0
    full = {str(r): f"gpu{r}" for r in range(8)}
    before = {"rank_map": full, "steps": [[k, 8, t - 1 + k / 10, t - 1 + k / 10 + 0.05]
                                          for k in range(10)], "steps_done": 10}
    agent = {"alarms": ["no healthy spare for gpu3: job continues degraded on 7 ranks"],
             "events": []}
    shrunk = {str(r): g for r, g in enumerate(g for g in full.values() if g != "gpu3")}
    assert _report(0.0, t, "gpu3", before, _status(shrunk, t), [], agent) == 1
    out = capsys.readouterr().out
    assert "demo FAILED: no healthy spare took gpu3's place: the job runs degraded on 7 of " \
           "its 8 ranks" in out and "succeeded" not in out
    swapped = {**full, "3": "spare0"}
    assert _report(0.0, t, "gpu3", before, _status(swapped, t), [], agent) == 0
    assert capsys.readouterr().out.rstrip().endswith("demo succeeded")


def test_the_ha_demo_survives_its_leader_killed_mid_swap(tmp_path):
    """`ptb demo --ha`: 3 etcd members, 2 agent replicas; the leader killed right after its
    swap decision; the standby takes the lead and finishes it; nothing applied twice; nothing
    of it left running."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "photonic_testbed.ptb", "demo", "--ha",
                           "--headless", "--ideal-chip", "--seconds", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "demo succeeded" in out, out
    assert "Traceback" not in out
    for line in ("starting an etcd cluster of 3", "swap decided", "leader killed",
                 "new leader took over", "job resumed", "applied twice: 0"):
        assert line in out, out
    killed = re.search(r"leader (r\d) killed", out).group(1)
    assert re.search(rf"leader (r\d) \(term 2\); {killed} back as a standby", out), out
    assert killed not in re.search(r"new leader took over .*", out).group(0).split(",")[0]
    folder = pathlib.Path(re.search(r"are kept in (\S+)", out).group(1))
    deadline = time.monotonic() + 30
    while _running_in(folder):
        assert time.monotonic() < deadline, _running_in(folder)
        time.sleep(0.1)
