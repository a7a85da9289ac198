"""TorchFT as the in-place swap's software peer (hil.job.torchft_peer), run for real and short:
its lighthouse and two replica processes on loopback (gloo), one replica killed -9 and
restarted, which takes the live state from the healthy one; and a dead lighthouse named in the
launcher's error, not waited on. `ptb bench swap` measures it against the in-place swap: these
tests keep that comparison from rotting; they assert no timing."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchft")

from photonic_testbed.hil.job import torch_job  # noqa: E402

MODULE = "photonic_testbed.hil.job.torchft_peer"
SMALL = ("--width", "32", "--layers", "1", "--batch", "2", "--block", "16")
RUN_TIMEOUT_S = 300          # generous: four torch imports on two busy cores take a while


def _launch(workdir, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", MODULE, "launch", "--workdir", str(workdir),
                             *SMALL, *args, "--timeout", str(RUN_TIMEOUT_S - 30)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_killed_replica_restarts_with_its_healthy_peers_state(tmp_path):
    work = tmp_path / "run"
    proc = _launch(work, "--replicas", "2", "--steps", "30", "--fail-at", "10")
    out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, out + err[-3000:]
    summary = json.loads((work / "summary.json").read_text())
    events = torch_job.read_events(work)

    # The job completed every step, on both replicas.
    done = [e for e in events if e["kind"] == "done" and "replica" in e]
    assert sorted(e["replica"] for e in done) == [0, 1]
    assert all(e["step"] == 30 for e in done)

    # Replica 1 was killed once and its place taken by another process, which received the
    # healthy replica's state (TorchFT's recovery) and ends bit-equal to it.
    (failure,) = [e for e in events if e["kind"] == "failure"]
    (restarted,) = [e for e in events if e["kind"] == "restarted"]
    assert failure["replica"] == restarted["replica"] == 1
    assert restarted["peer"] != failure["peer"]
    assert {e["pid"] for e in done if e["replica"] == 1} == {restarted["peer"]}
    (healed,) = [e for e in events if e["kind"] == "healed"]
    assert healed["pid"] == restarted["peer"] and healed["step"] >= failure["step"] >= 10
    assert summary["digests_equal"] and len(summary["digests"]) == 2
    assert done[0]["digest"] == done[1]["digest"]

    # The failure is measured: finite, positive; no step the job had completed is lost.
    (r,) = summary["recoveries"]
    for key in ("job_first_step_s", "replica_first_step_s"):
        assert r[key] is not None and 0 < r[key] < math.inf, r
    assert r["replica_first_step_s"] >= r["job_first_step_s"]
    assert r["steps_lost"] == 0 and r["first_step"] == r["reached"] + 1
    assert "first step after" in out and "equal on every replica" in out


def test_a_dead_lighthouse_stops_the_run_with_its_name(tmp_path):
    """The lighthouse killed while one replica trains: the launcher says so and exits; no
    replica is left behind waiting for a quorum."""
    work = tmp_path / "run"
    proc = _launch(work, "--replicas", "1", "--steps", "1000000")
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        lighthouse = None
        while time.monotonic() < deadline and proc.poll() is None:
            events = torch_job.read_events(work) if (work / "events").exists() else []
            lighthouse = next((e for e in events if e["kind"] == "lighthouse"), None)
            if lighthouse and any(e["kind"] == "step" for e in events):
                break
            time.sleep(0.1)
        assert lighthouse is not None, proc.communicate(timeout=30)
        os.kill(lighthouse["peer"], signal.SIGKILL)
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 3, out + err
    assert "the lighthouse" in err and "exited" in err, err
    replicas = [e["pid"] for e in torch_job.read_events(work) if e["kind"] == "started"]
    assert replicas
    for pid in replicas:                     # every replica process has ended (reaped)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
