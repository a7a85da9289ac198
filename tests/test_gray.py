"""Gray failures, the agent's side (hil/agent/gray.py): the change-point test on the ranks'
timings, the ski-rental decision, and the handover the job asks for; the emulator's slowdown
(emulator/slowdown.py) that makes a GPU's processes really slow.

The timings are a data-parallel step's as the ranks report them: each rank computes (its own
time, noisy), then waits in the all-reduce until the slowest rank arrives, plus the
collective's own time. Noise is what a loaded CPU does to them: every rank's time jitters, one
rank now and then stalls for a step, and the whole job slows down for stretches."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from photonic_testbed.emulator.slowdown import SlowdownError, Slowdowns
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.entries import Slow
from photonic_testbed.hil.agent.gray import Detector, GrayError, GrayWatch

GPUS = [f"gpu{i}" for i in range(8)]


def steps(rng: random.Random, n: int, slow: dict[str, float] | None = None, *, start: int = 0,
          jitter: float = 0.25, stalls: float = 0.05, job_slow: float = 0.02):
    """n steps of rows (gpu, gen, step, compute_s, wait_s): compute 50 ms times lognormal
    jitter, a rank stalled 2-4x with probability `stalls` a step, the whole job 1.5-3x slower
    for stretches (`job_slow`: the chance a stretch starts), `slow` GPUs that much slower: late
    by the difference, in their compute or (half the time) before their step began."""
    slow = slow or {}
    rows, job = [], 1.0
    for k in range(start, start + n):
        if rng.random() < job_slow:
            job = rng.uniform(1.5, 3.0)
        elif rng.random() < 0.1:
            job = 1.0
        compute, arrive = {}, {}
        for g in GPUS:
            c = 0.05 * job * rng.lognormvariate(0, jitter)
            if rng.random() < stalls:
                c *= rng.uniform(2.0, 4.0)
            late = c * (slow.get(g, 1.0) - 1.0)
            compute[g] = c + (late if rng.random() < 0.5 else 0.0)
            arrive[g] = c + late
        last = max(arrive.values())
        for g in GPUS:
            comm = 0.01 * rng.lognormvariate(0, jitter)
            rows.append((g, 0, k + 1, compute[g], last - arrive[g] + comm))
    return rows


def by_step(rows):
    out: dict[int, list] = {}
    for r in rows:
        out.setdefault(r[2], []).append(r)
    return [out[k] for k in sorted(out)]


@pytest.mark.parametrize("seed, jitter", [(0, 0.25), (1, 0.25), (2, 0.35), (3, 0.35)])
def test_healthy_steps_under_noise_make_no_suspect(seed, jitter):
    rng = random.Random(seed)
    det = Detector()
    found = [v for step in by_step(steps(rng, 10_000, jitter=jitter))
             for v in det.feed(step, GPUS)]
    assert found == []


@pytest.mark.parametrize("factor, within", [(2.0, 30), (1.5, 80), (1.25, 250)])
def test_a_slow_gpu_is_found_and_localized(factor, within):
    for seed in range(5):
        rng = random.Random(seed)
        det = Detector()
        for step in by_step(steps(rng, 200)):
            assert det.feed(step, GPUS) == []
        first = None
        for i, step in enumerate(by_step(steps(rng, 400, {"gpu5": factor}, start=200))):
            got = det.feed(step, GPUS)
            assert {v.gpu for v in got} <= {"gpu5"}, got
            if got and first is None:
                first = i + 1
                v = got[0]
                assert v.ratio >= 1.1 and v.wait_s < v.peers_wait_s and v.lost_s > 0
        assert first is not None and first <= within, (seed, first)


def test_the_whole_job_slower_is_not_a_fault():
    rng = random.Random(7)
    det = Detector()
    rows = [(g, 0, s, c * 3.0, w * 3.0) for g, _, s, c, w in steps(rng, 500)]
    assert [v for step in by_step(rows) for v in det.feed(step, GPUS)] == []


def test_rows_of_gpus_not_in_the_job_and_incomplete_steps_are_left():
    det = Detector()
    rng = random.Random(1)
    rows = steps(rng, 300, {"gpu5": 2.0})
    rows = [r for r in rows if not (r[0] == "gpu1" and r[2] % 2)]      # gpu1 skips odd steps
    found = [v for step in by_step(rows) for v in det.feed(step, GPUS)]
    assert found and {v.gpu for v in found} == {"gpu5"}
    assert len(det._steps) <= 64
    # gpu5 swapped out: its series ends, its rows are not judged
    det.feed([], [g for g in GPUS if g != "gpu5"])
    assert "gpu5" not in det.gpus


# --- the agent's side, with a stand-in for the agent -------------------------------------
@dataclass
class FakeAgent:
    config: AgentConfig = field(default_factory=AgentConfig)
    spare: list = field(default_factory=lambda: ["spare0", "spare1"])
    entries: list = field(default_factory=list)
    swapped: list = field(default_factory=list)

    usable: set = field(default_factory=lambda: {"spare0", "spare1"})

    def __post_init__(self):
        self.journal = SimpleNamespace(record=lambda d, text, *a, **k: self.entries.append(
            (d, text)))
        self.the_job = SimpleNamespace(name="torch-dp", rank_map=dict(enumerate(GPUS)))
        self.jobs = {"torch-dp": self.the_job}
        self.failover = SimpleNamespace(
            cost=lambda job, gpu, s: (1, 0.0) if s in self.usable else None)

    def job(self, name=None):
        return self.the_job

    def holder(self, gpu):
        return self.the_job if gpu in self.the_job.rank_map.values() else None

    def spares(self):
        return list(self.spare)

    def swap_out(self, gpu, cause, why="", among=()):
        self.swapped.append((gpu, cause, why, tuple(among)))
        self.the_job.rank_map = {r: ("spare0" if g == gpu else g)
                                 for r, g in self.the_job.rank_map.items()}
        return SimpleNamespace(swaps={gpu: "spare0"}, latency_s=0.01,
                               rank_map=self.the_job.rank_map)


def watch(agent):
    return GrayWatch(agent, lambda job, what: job)


def report(w, rows, stall=None, warm=("spare1",)):
    return w.timings(SimpleNamespace(job=None, rows=rows, swap_stall_s=stall, warm=list(warm)))


def test_a_slow_gpu_is_swapped_once_its_cost_reaches_the_swaps_and_says_why():
    agent = FakeAgent()
    w = watch(agent)
    rng = random.Random(3)
    assert report(w, steps(rng, 100))["handover"] is None
    got = None
    for step in by_step(steps(rng, 300, {"gpu5": 1.5}, start=100)):
        got = report(w, step)["handover"]
        if got:
            break
    assert got and got["gpu"] == "gpu5" and got["to"] == "spare1"     # the warm one
    kinds = [(d.action, d.gpu) for d, _ in agent.entries if isinstance(d, Slow)]
    assert kinds == [("suspect", "gpu5"), ("swap", "gpu5")]
    swap = [d for d, _ in agent.entries if isinstance(d, Slow) and d.action == "swap"][0]
    assert swap.lost_s >= swap.price_s == AgentConfig().gray_swap_cost_s
    assert "1." in got["why"] and "not the job" in got["why"]
    with pytest.raises(GrayError, match="gpu4 of job torch-dp is not to be swapped"):
        w.handover(SimpleNamespace(job=None, gpu="gpu4", warm=[]))
    out = w.handover(SimpleNamespace(job=None, gpu="gpu5", warm=["spare1"]))
    assert out["swaps"] == {"gpu5": "spare0"} and agent.swapped[0][0] == "gpu5"
    assert agent.swapped[0][3] == ("spare1",)          # the spare named in the decision
    assert "planned swap" in agent.swapped[0][1]
    with pytest.raises(GrayError):                  # once
        w.handover(SimpleNamespace(job=None, gpu="gpu5", warm=[]))
    # the stall the job measured after its handover is its price from then on; a stall it
    # sends with no handover asked is not taken
    report(w, [], stall=0.04)
    report(w, [], stall=0.0)
    assert w.price_s("torch-dp") == 0.04


def test_no_spare_or_swaps_off_means_no_swap_and_the_journal_says_why():
    for agent, said in ((FakeAgent(spare=[]), "no spare"),
                        (FakeAgent(config=AgentConfig(gray_swaps=False)), "watch")):
        w = watch(agent)
        rng = random.Random(5)
        for step in by_step(steps(rng, 300, {"gpu2": 2.0})):
            assert report(w, step)["handover"] is None
        actions = [d.action for d, _ in agent.entries if isinstance(d, Slow)]
        assert actions == ["suspect", said]


def _decided(agent, gpu="gpu5", factor=1.5, seed=3):
    w = watch(agent)
    rng = random.Random(seed)
    for step in by_step(steps(rng, 300, {gpu: factor})):
        if report(w, step)["handover"]:
            return w
    raise AssertionError("no swap decided")


def test_a_handover_is_refused_unless_a_spare_can_take_the_place_alone_and_prefers_warm():
    agent = FakeAgent()
    w = _decided(agent)
    agent.usable = set()                       # meanwhile no spare can take it alone
    with pytest.raises(GrayError, match="no spare can take gpu5's place"):
        w.handover(SimpleNamespace(job=None, gpu="gpu5", warm=["spare1"]))
    assert agent.swapped == []
    agent = FakeAgent(usable={"spare0"})
    w = _decided(agent)
    w.handover(SimpleNamespace(job=None, gpu="gpu5", warm=["spare1"]))    # warm, not usable
    assert agent.swapped[0][3] == ("spare0",)


def test_a_handover_of_a_gpu_no_longer_the_jobs_is_refused():
    agent = FakeAgent()
    w = _decided(agent)
    agent.the_job.rank_map = {r: ("spare1" if g == "gpu5" else g)
                              for r, g in agent.the_job.rank_map.items()}
    with pytest.raises(GrayError):
        w.handover(SimpleNamespace(job=None, gpu="gpu5", warm=[]))
    assert agent.swapped == []


def test_what_the_journal_says_does_not_depend_on_how_the_rows_are_sent():
    rows = steps(random.Random(9), 600, {"gpu5": 1.5})
    said = []
    for batches in ([rows], by_step(rows)):
        agent = FakeAgent(config=AgentConfig(gray_swaps=False))
        w = watch(agent)
        for b in batches:
            report(w, b)
        said.append([(d.action, d.gpu) for d, _ in agent.entries])
    assert said[0] == said[1] == [("suspect", "gpu5"), ("watch", "gpu5")]


# --- the emulator's slowdown ---------------------------------------------------------------
def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_the_slowdown_stops_and_continues_the_gpus_processes_and_leaves_them_running():
    # a process that computes all the time (runnable: its slowdown is paid in stops)
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        s = Slowdowns(lambda: GPUS, lambda g: [proc.pid] if g == "gpu3" else [])
        with pytest.raises(SlowdownError, match="no GPU 'gpu9'"):
            s.slow("gpu9", 2.0)
        for bad in (0.5, 11, True, "2"):
            with pytest.raises(SlowdownError, match="factor"):
                s.slow("gpu3", bad)
        with pytest.raises(SlowdownError, match="period_s"):
            s.slow("gpu3", 2.0, period_s=0)
        assert s.slow("gpu3", 4.0, period_s=0.2)["gpu3"]["factor"] == 4.0
        seen = set()
        deadline = time.monotonic() + 30
        while seen != {"T", "S"} and time.monotonic() < deadline:
            seen.add("T" if _state(proc.pid) == "T" else "S")
            time.sleep(0.01)
        assert seen == {"T", "S"}          # stopped part of the time, running the rest
        assert s.slow("gpu3", 1) == {}     # ended: continued, and left so
        time.sleep(0.3)
        assert _state(proc.pid) != "T"
        s.slow("gpu3", 10.0, period_s=1.0)
        s.close()
        time.sleep(0.1)
        assert _state(proc.pid) != "T" and s.active() == {}
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


# --- the bench's report and the demo's argument ---------------------------------------------
def test_the_bench_report_counts_misses_false_suspects_and_the_cost_removed():
    from types import SimpleNamespace as NS

    from photonic_testbed.ptb.bench.gray import _report
    events = [
        {"gpu": "gpu3", "factor": 1.5, "found": True, "others": 0, "steps_to_find": 30,
         "stall_s": 0.03, "before": 10.0, "slow": 6.0, "after": 10.0, "steps_to_swap": 60,
         "ratio": 1.4},
        {"gpu": "gpu5", "factor": 1.5, "found": False, "others": 1, "steps_to_find": None,
         "stall_s": None, "before": 10.0},
    ]
    got = _report(NS(factors=[1.5], load=2, horizon=1440.0),
                  {"steps": 1000, "suspects": 0, "swaps": 0, "steps_s": 8.0}, events,
                  (1.0, 1.0, 1.0), (2.0, 2.0, 2.0))
    assert got["recall"] == 0.5 and got["precision"] == 0.5
    assert got["rows"] == [{"factor": 1.5, "events": 2, "found": 1, "steps_p50": 30,
                            "steps_max": 30, "measured_x": 1.4, "stall_p50_ms": 30.0,
                            "stall_max_ms": 30.0}]
    text = "\n".join(got["notes"])
    # 1440 s at 4 steps/s lost without the loop; with it: 10 s slow (60 steps at 6/s) and 0.03 s
    assert "5760 steps lost without the loop, 40 with it" in text
    assert "99.3 % of the slowdown removed" in text
    assert "0.0 false swaps per 10,000 steps" in text


@pytest.mark.parametrize("text, said", [("gpu3:0.5", "must be in (1, 10]"),
                                        ("gpu3:x", "is a number"), ("gpu3:30", "(1, 10]")])
def test_the_demos_slow_argument_is_checked(text, said):
    from photonic_testbed.ptb.cli import CommandFailed
    from photonic_testbed.ptb.demo import slow_argument
    with pytest.raises(CommandFailed, match=re.escape(said)):
        slow_argument(text)
    assert slow_argument("gpu3") == ("gpu3", 4.0)
    assert slow_argument("gpu6:2.5") == ("gpu6", 2.5)


def test_the_demo_names_the_option_that_gave_a_spare():
    from photonic_testbed.ptb.cli import CommandFailed
    from photonic_testbed.ptb.demo import _gpu_to_fail
    with pytest.raises(CommandFailed, match=r"^--slow 'spare0' is a spare"):
        _gpu_to_fail("lumion", "spare0", "--slow")


HOST = """
import subprocess, sys, time
from photonic_testbed.emulator.slowdown import Slowdowns
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
print(child.pid, flush=True)
s = Slowdowns(lambda: ["gpu0"], lambda g: [child.pid])
s.slow("gpu0", 10.0, period_s=1.0)
while True:
    with open(f"/proc/{child.pid}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] == "T":
            break
    time.sleep(0.01)
print("stopped", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_an_emulator_killed_while_a_process_is_stopped_leaves_it_running():
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(host.stdout.readline())
        assert host.stdout.readline().strip() == "stopped"
        host.kill()                          # no close(): the watchdog continues the process
        host.wait(10)
        deadline = time.monotonic() + 30
        while _state(pid) == "T":
            assert time.monotonic() < deadline, "the process was left stopped"
            time.sleep(0.02)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(10)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
