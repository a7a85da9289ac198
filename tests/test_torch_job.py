"""The PyTorch job (hil.job.model, .worker, .torch_job): the model and its pieces in this
process; the in-place swap with real rank processes on loopback (gloo, a TCPStore, generations of
process groups), standalone: kill -9 a rank, a warm standby takes its place, nothing is lost."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from photonic_testbed.common.jobplan import PlanError, dp_ring, dp_tp  # noqa: E402
from photonic_testbed.hil.job import model as tm  # noqa: E402
from photonic_testbed.hil.job import torch_job  # noqa: E402
from photonic_testbed.hil.job import worker as tw  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 400          # generous: eight torch imports on two shared cores take a while


# --- pieces -------------------------------------------------------------------------------
def test_batches_depend_on_step_and_data_index_only():
    a = tm.CharText.shipped(block=16, seed=3)
    b = tm.CharText.shipped(block=16, seed=3)
    x1, y1 = a.batch(7, 2, 4)
    x2, y2 = b.batch(7, 2, 4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])               # targets are the next characters
    assert not torch.equal(a.batch(7, 3, 4)[0], x1)
    assert not torch.equal(a.batch(8, 2, 4)[0], x1)
    assert a.vocab == len(set(tm.TEXT.read_text()))
    with pytest.raises(ValueError, match="too short"):
        tm.CharText("abc", block=16, seed=0)


def test_adam_matches_torch_optim_adam():
    torch.manual_seed(0)
    m1 = torch.nn.Linear(5, 3)
    m2 = torch.nn.Linear(5, 3)
    m2.load_state_dict(m1.state_dict())
    ours = tm.Adam(list(m1.parameters()), lr=1e-2)
    ref = torch.optim.Adam(m2.parameters(), lr=1e-2, foreach=False)
    for i in range(20):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(i))
        for m, opt in ((m1, ours), (m2, ref)):
            for p in m.parameters():
                p.grad = None
            m(x).pow(2).sum().backward()
            opt.step()
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    assert float(ours.t) == 20


def test_tensor_parallel_shards_compute_the_full_model():
    """Two TP shards, their all-reduces summed by hand, give the full model's output and
    gradients (to float rounding: the hidden units are summed in another order)."""
    data = tm.CharText.shipped(block=16, seed=0)
    cfg = tm.ModelConfig(data.vocab, block=16, width=32, layers=1, heads=2)
    full = tm.build_model(cfg, 0, seed=5)
    shards = [tm.build_model(tm.ModelConfig(data.vocab, 16, 32, 1, 2, tp=2), i, seed=5)
              for i in range(2)]
    x, y = data.batch(0, 0, 3)
    outs = []                      # each shard's replicated activations and MLP partial
    for s in shards:
        h = s.tok(x) + s.pos(torch.arange(16))
        b = s.blocks[0]
        h = h + b.attn(b.ln1(h))
        z = b.mlp.fc2(torch.nn.functional.gelu(b.mlp.fc1(b.ln2(h))))
        outs.append((h, z))
    h0, z0 = outs[0]
    h1, z1 = outs[1]
    assert torch.allclose(h0, h1)                  # replicated parts agree
    mixed = h0 + (z0 + z1) + shards[0].blocks[0].mlp.bias
    logits = shards[0].head(shards[0].ln(mixed))
    assert torch.allclose(logits, full(x), atol=1e-5)


def test_transfer_pairs_follow_the_ring():
    steps = {0: 5, 1: 5, 2: 0, 3: 5}
    assert tw.transfer_pairs((0, 1, 2, 3), steps, 5) == [(1, 2)]
    # a survivor one step ahead: everyone behind gets the state along the ring from it
    steps = {0: 5, 1: 6, 2: 0, 3: 5}
    assert tw.transfer_pairs((0, 1, 2, 3), steps, 6) == [(1, 2), (2, 3), (3, 0)]
    # the spare's predecessor one behind: it receives first, then passes the state on
    steps = {0: 6, 1: 5, 2: 0, 3: 6}
    assert tw.transfer_pairs((0, 1, 2, 3), steps, 6) == [(0, 1), (1, 2)]
    assert tw.transfer_pairs((1, 3, 5, 7), {1: 2, 3: 2, 5: 2, 7: 2}, 2) == []
    with pytest.raises(LookupError, match="no member"):
        tw.transfer_pairs((0, 2), {0: 0, 2: 0}, 3)


def test_roles_of_the_plans():
    r = tw.roles(dp_tp(8, tp=2), 8, 5)
    assert r.tp_group == (4, 5) and r.dp_group == (1, 3, 5, 7)
    assert (r.tp_index, r.dp_index, r.tp) == (1, 2, 2)
    r = tw.roles(dp_ring(7), 7, 3)
    assert r.tp_group == (3,) and r.dp_group == tuple(range(7)) and r.dp_index == 3
    from photonic_testbed.common.jobplan import JobPlan, PhaseSpec
    with pytest.raises(PlanError, match="'dp' phase"):
        tw.roles(JobPlan("x", 4, (PhaseSpec("pp", "chain"),)), 4, 0)


def test_job_spec_refuses_bad_values(tmp_path):
    plan = dp_ring(4).to_dict()
    with pytest.raises(torch_job.JobSpecError, match="steps"):
        torch_job.JobSpec(plan=plan, workdir=str(tmp_path), steps=0)
    with pytest.raises(torch_job.JobSpecError, match="lr"):
        torch_job.JobSpec(plan=plan, workdir=str(tmp_path), lr=-1.0)
    with pytest.raises(torch_job.JobSpecError, match="job plan"):
        torch_job.JobSpec(plan={"name": "x"}, workdir=str(tmp_path))
    spec = torch_job.JobSpec(plan=plan, workdir=str(tmp_path), store=("127.0.0.1", 5))
    spec.save(tmp_path / "job.json")
    assert torch_job.JobSpec.load(tmp_path / "job.json") == spec
    with pytest.raises(torch_job.JobSpecError, match="cannot read"):
        torch_job.JobSpec.load(tmp_path / "nothing.json")


# --- rank processes -----------------------------------------------------------------------
def launch(workdir: pathlib.Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "photonic_testbed.hil.job.torch_job", "launch",
                             "--workdir", str(workdir), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def events_of(workdir: pathlib.Path) -> list[dict]:
    return torch_job.read_events(workdir) if (workdir / "events").exists() else []


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def kill_when(proc: subprocess.Popen, workdir: pathlib.Path, gpu: str, step: int,
              timeout: float = RUN_TIMEOUT_S) -> float:
    """SIGKILL the process on `gpu` once it completed `step`; returns when it was killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for e in events_of(workdir):
            if e["kind"] == "step" and e.get("gpu") == gpu and e["step"] >= step:
                t = time.time()
                os.kill(e["pid"], signal.SIGKILL)
                return t
        time.sleep(0.05)
    raise AssertionError(f"{gpu} never reached step {step}: {finish(proc, 5)}")


def digests(events: list[dict]) -> dict[str, str]:
    return {e["gpu"]: e["digest"] for e in events if e["kind"] == "done" and "digest" in e}


def test_kill_a_rank_standby_takes_its_place_in_place_nothing_lost(tmp_path):
    """World 4 on loopback with one warm standby. gpu2's process is killed -9 after step 8;
    the survivors abandon their all-reduce, join generation 1 with spare0 as rank 2; spare0
    receives weights, Adam's state and the step from rank 1 (its predecessor on the ring),
    redoes the interrupted step; the run ends with weights bit-equal to an uninterrupted run's
    (same seed, same data order, same world: the same sums in the same order)."""
    steps = 48                 # enough that the kill after step 8 lands mid-run
    args = ("--standalone", "--world", "4", "--steps", str(steps), "--standbys", "1",
            "--width", "64", "--batch", "4", "--block", "32")
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "swap"
    ref = launch(ref_dir, *args)
    run = launch(run_dir, *args)
    t_kill = kill_when(run, run_dir, "gpu2", 8)
    out_run, out_ref = finish(run), finish(ref)
    assert run.returncode == 0, out_run
    assert ref.returncode == 0, out_ref
    # the launcher says what it does: processes up, the first step, the swap, the end
    for said in ("torch job: process on spare0 ready", "torch job: first step done",
                 "torch job: generation 1, ranks on gpu0, gpu1, spare0, gpu3",
                 f"torch job: step {steps}, loss ", "torch job: done"):
        assert said in out_run, (said, out_run)
    ev = events_of(run_dir)
    orders = [e for e in ev if e["kind"] == "order"]
    assert [o["rank_map"] for o in orders] == [
        {"0": "gpu0", "1": "gpu1", "2": "gpu2", "3": "gpu3"},
        {"0": "gpu0", "1": "gpu1", "2": "spare0", "3": "gpu3"}]
    # the survivors abandoned generation 0 without waiting for a collective timeout
    aborted = [e for e in ev if e["kind"] == "aborted"]
    assert {e["gpu"] for e in aborted} == {"gpu0", "gpu1", "gpu3"}
    assert all(e["t"] - t_kill < 30 for e in aborted)
    # spare0 received the state from its ring predecessor (gpu1, which may itself have received
    # it first from gpu0 when its own all-reduce never finished) and redid the interrupted step
    moved = {e["gpu"]: e for e in ev if e["kind"] == "transferred" and e["gen"] == 1}
    got, sent = moved["spare0"], moved["gpu1"]
    assert got["received"] and got["bytes_received"] == sent["bytes_sent"] > 0
    assert got["bytes_sent"] in (0, got["bytes_received"])        # passed on to gpu3 if behind
    assert (sum(e["bytes_sent"] for e in moved.values())
            == sum(e["bytes_received"] for e in moved.values()))
    # k: the most steps any member completed; a survivor may be one behind (its all-reduce of
    # step k never finished when gpu2 died), the spare at 0; every one below k gets the state
    k = got["step"]
    survivors = [s for r, s in got["steps"].items() if r != "2"]
    assert k >= 8 and k in survivors and set(survivors) <= {k - 1, k}, got["steps"]
    assert got["steps"]["2"] == 0
    first = next(e for e in ev if e["kind"] == "step" and e["gpu"] == "spare0")
    assert first["step"] == k + 1 and first["gen"] == 1
    assert not list(run_dir.glob("ckpt-*"))                       # no checkpoint anywhere
    # nothing lost: every rank's final weights are the uninterrupted run's, bit for bit
    ref_d, run_d = digests(events_of(ref_dir)), digests(ev)
    assert set(run_d) == {"gpu0", "gpu1", "spare0", "gpu3"}
    assert set(run_d.values()) == set(ref_d.values()) and len(set(ref_d.values())) == 1
    a = tm.load_weights(ref_dir / "final-tp0.pt")
    b = tm.load_weights(run_dir / "final-tp0.pt")
    assert a["step"] == b["step"] == steps
    assert tm.max_abs_difference(a, b) == 0.0
    # and the model learns
    loss = [e["loss"] for e in ev if e["kind"] == "step" and e["gpu"] == "gpu0"]
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.3, loss


def test_torchrun_baseline_restarts_every_worker_from_the_checkpoint(tmp_path):
    """The same job under torchrun (--max-restarts): a worker killed after step 12, torchrun
    stops the other and starts both again; they reload the last checkpoint (every 5 steps)
    and redo the steps since; the run completes."""
    work = tmp_path / "torchrun"
    # steps enough that the kill lands mid-run however fast the machine (the run used to end
    # before the test saw step 12 and killed a finished worker)
    steps = 120
    proc = launch(work, "--standalone", "--torchrun", "--world", "2", "--steps", str(steps),
                  "--checkpoint-every", "5", "--width", "32", "--batch", "2", "--block", "16",
                  "--layers", "1")
    kill_when(proc, work, "gpu1", 12)
    out = finish(proc)
    assert proc.returncode == 0, out
    ev = events_of(work)
    restarts = sorted({e["restart"] for e in ev if e["kind"] == "ready"})
    assert restarts == [0, 1]
    ready = [e for e in ev if e["kind"] == "ready" and e["restart"] == 1]
    assert {e["gpu"] for e in ready} == {"gpu0", "gpu1"}
    ckpt = {e["checkpoint"] for e in ready}
    # the last step either worker logged before the restart: rank 0 checkpoints after a step
    # both workers finished, which the killed one may not have logged before it died
    reached = max(e["step"] for e in ev if e["kind"] == "step" and e["gen"] == 0)
    assert len(ckpt) == 1
    c = ckpt.pop()
    assert c % 5 == 0 and 10 <= c <= reached
    first = min(e["step"] for e in ev if e["kind"] == "step" and e["gen"] == 1)
    assert first == ready[0]["checkpoint"] + 1 <= reached + 1       # steps since are redone
    done = [e for e in ev if e["kind"] == "done" and "digest" in e]
    assert {e["gpu"] for e in done} == {"gpu0", "gpu1"} and {e["step"] for e in done} == {steps}
