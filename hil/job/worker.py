"""The ranks of a real PyTorch training job on the fabric, and their in-place failover.

With hil.job.model (the model, its data and its state) the only modules that import torch.

What it runs: a character-level transformer (hil.job.model) trained on the text the package
ships (`hil/job/data/`), data-parallel (gradients averaged with one all-reduce per step) and
optionally tensor-parallel (each TP rank holds part of every MLP). The job's communication plan
is the same `common.jobplan.JobPlan` the agent admits: phase "dp" (the data-parallel rings) and
optionally "tp" (the tensor-parallel groups). Before the collectives of a phase the job holds
that phase's circuits: `fabric.phase(name)` (hil.job.fabric_client), asked once every rank is
past the previous phase's collectives (a barrier on the job's store, the control network).

Each rank is a process bound to a GPU of the rig (without CUDA the GPU is a label and the
backend is gloo on the CPU; `backend()` is the one place that chooses). Processes are started
by the job's controller (`hil.job.torch_job`) on the GPUs of the rank map and, warm, on spares: a
process whose GPU holds no rank is a standby (torch imported, model built, waiting).

In-place swap. The controller numbers the agent's restart orders as *generations* and writes
each one to its store (`gen/<g>`: the rank map). A generation is a fresh set of process groups
on a fresh store prefix (`pg<g>/`). Every collective is waited on with an eye on the store: a
newer generation abandons it at once (the survivors never wait for a collective timeout: a
dead peer's neighbours see its socket close, everyone else the new generation). Then:
1. every member builds the new groups (the spare in the failed rank's place);
2. members agree on the state's step through the store (each writes its completed steps;
   a survivor may be one step ahead when its all-reduce completed before the failure);
3. members behind (the spare: its seed state is step 0) receive model, optimizer state and
   step from their predecessor on their data-parallel ring (a link of the "dp" circuits),
   no checkpoint read;
4. the interrupted step is redone: an optimizer step is applied only after its all-reduce
   completed, so a survivor's memory is exactly the state of its last completed step.

The baseline (`torchrun-worker`): the same training under torchrun, which restarts every
worker after a loss; workers reload the last checkpoint (every K steps) on the rank map the
agent ordered.

Commands (started by hil.job.torch_job, not by hand):
    python -m photonic_testbed.hil.job.worker worker --job JOB.json --gpu GPU
    python -m photonic_testbed.hil.job.worker torchrun-worker --job JOB.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import pathlib
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import DistError, PrefixStore, TCPStore

from photonic_testbed.common.jobplan import JobPlan, PlanError
from photonic_testbed.hil.bus.client import BusError
from photonic_testbed.hil.job import torch_job
from photonic_testbed.hil.job.model import (
    CharText,
    ModelConfig,
    build_model,
    digest,
    flatten,
    gradients,
    new_optimizer,
    save_weights,
    state_tensors,
    unflatten_into,
)

log = logging.getLogger(__name__)

# Store waits never time out on purpose: a TCPStore client whose wait timed out may read the
# late answer as the reply to its next request. A wait that a new generation must be able to
# abandon runs on a thread with a client of its own.
FOREVER_S = 7 * 24 * 3600.0

STREAM_WAIT_S = 2.0    # a planned swap's spare waits this long for its streamed state

# Exit codes of a rank process (the controller reads them).
DONE, STOPPED, SWAPPED_OUT, LOST_STATE = 0, 3, 4, 5


# --- the backend: the one place that chooses -----------------------------------------------
def backend() -> str:
    """NCCL where CUDA is, gloo on the CPU otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(gpu_index: int) -> torch.device:
    """The device a rank computes on: its GPU's CUDA device, or the CPU."""
    if backend() == "nccl":
        return torch.device("cuda", gpu_index % torch.cuda.device_count())
    return torch.device("cpu")


def new_group(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """One process group (a backend object, not torch's default group, so that several
    generations can live side by side and an abandoned one is never waited for)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend() == "nccl":
        from torch.distributed import ProcessGroupNCCL
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, size, opts)
    from torch.distributed import ProcessGroupGloo
    return ProcessGroupGloo(store, rank, size, timeout)


def serve_store(host: str = "127.0.0.1", port: int = 0) -> tuple[Any, int]:
    """The job's store (control network): the controller hosts it, so it outlives any rank."""
    store = TCPStore(host, port, None, True, datetime.timedelta(seconds=60),
                     wait_for_workers=False)
    return store, store.port


def store_client(host: str, port: int, timeout_s: float = FOREVER_S) -> Any:
    return TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False)


# --- where a rank sits in the plan ----------------------------------------------------------
@dataclass(frozen=True)
class Roles:
    """A rank's groups in the plan: its tensor-parallel group ("tp", or itself alone) and its
    data-parallel ring ("dp"), members in rank order."""
    rank: int
    world: int
    tp_group: tuple[int, ...]
    dp_group: tuple[int, ...]
    tp_groups: tuple[tuple[int, ...], ...]
    dp_groups: tuple[tuple[int, ...], ...]

    @property
    def tp(self) -> int:
        return len(self.tp_group)

    @property
    def tp_index(self) -> int:
        return self.tp_group.index(self.rank)

    @property
    def dp_index(self) -> int:
        return self.dp_group.index(self.rank)

    def tp_index_of(self, rank: int) -> int:
        return next(g.index(rank) for g in self.tp_groups if rank in g)


def roles(plan: JobPlan, world: int, rank: int) -> Roles:
    phases = {p.name: p for p in plan.phases}
    unknown = set(phases) - {"tp", "dp"}
    if "dp" not in phases or unknown:
        raise PlanError(f"the training job runs a 'dp' phase and optionally 'tp'; plan "
                        f"{plan.name!r} has {sorted(phases)}")
    dp_groups = tuple(tuple(g) for g in phases["dp"].groups(world))
    tp_groups = (tuple(tuple(g) for g in phases["tp"].groups(world)) if "tp" in phases
                 else tuple((r,) for r in range(world)))
    r = Roles(rank, world, next(g for g in tp_groups if rank in g),
              next(g for g in dp_groups if rank in g), tp_groups, dp_groups)
    for ring in dp_groups:               # a ring holds one shard: its members are replicas
        if len({r.tp_index_of(m) for m in ring}) != 1:
            raise PlanError(f"plan {plan.name!r}: data-parallel ring {ring} mixes "
                            f"tensor-parallel shards")
    return r


def transfer_pairs(ring: tuple[int, ...], steps: dict[int, int], target: int
                   ) -> list[tuple[int, int]]:
    """(sender, receiver) in order so that every member of the ring behind `target` gets the
    state from its predecessor, which has it by then. Raises LookupError if no member has it."""
    n = len(ring)
    start = next((i for i, m in enumerate(ring) if steps[m] == target), None)
    if start is None:
        raise LookupError(f"no member of ring {ring} holds the state of step {target}")
    pairs = []
    for k in range(1, n):
        m = ring[(start + k) % n]
        if steps[m] < target:
            pairs.append((ring[(start + k - 1) % n], m))
    return pairs


class Aborted(Exception):
    """The generation this rank runs in is over (a newer one was ordered, or a peer is gone)."""


class JobStopped(Exception):
    """The job cannot go on (no copy of a shard's state, the agent refuses circuits...)."""


# --- the rank process -----------------------------------------------------------------------
class Worker:
    """One process on one GPU: a rank while its GPU is in the current rank map, else a warm
    standby. `run()` returns the exit code."""
    streams = True              # a standby may be streamed a planned swap's state

    def __init__(self, spec: torch_job.JobSpec, gpu: str):
        self.spec = spec
        self.gpu = gpu
        self.plan = JobPlan.from_dict(spec.plan)
        self.events = torch_job.EventLog(spec.events_path(gpu, os.getpid()), gpu=gpu,
                                         pid=os.getpid())
        self.gen = -1                    # the generation this process runs in (-1: none yet)
        self.newest = -1                 # the newest generation the store has
        self._wake = threading.Event()   # a collective finished or a generation was ordered
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._graveyard: list[Any] = []  # abandoned groups (their threads may hang: never freed)
        self.fabric: Any = None          # a Fabric client when the job runs on one
        self._tp_audited = False         # this step's TP collectives checked once
        self.completed = 0               # steps whose update this process's state holds
        self.granted: tuple[str, int] | None = None
        self._barriers = 0
        self.hold_at: tuple[int, int] | None = None   # (generation, step): stop there
        self._tp_wait = 0.0
        self.ranked = False                  # has held a rank (a standby's state is no step's)
        self.stream_out: dict | None = None  # a donor: the planned swap's spare to feed
        self._sender: Any = None             # (a thread's queue: the store sets, off the step)
        self._streamed = threading.Event()   # a standby: no state is being streamed to it
        self._streamed.set()
        self._stream_stop = threading.Event()   # set once a rank: a stream applies no more

    # --- set-up -----------------------------------------------------------------------------
    def _setup(self) -> None:
        spec = self.spec
        torch.set_num_threads(1)
        if spec.control:
            torch_job.emulator_request(spec.control, {"cmd": "register_process",
                                                      "gpu": self.gpu, "pid": os.getpid()})
        self.data = CharText.shipped(spec.block, spec.seed)
        index = 0                        # the GPU's place on its host: its CUDA device
        self.store = store_client(*spec.store)
        self.newest = int(self.store.get("gen/latest"))
        self._watcher = threading.Thread(target=self._watch, name="generations", daemon=True)
        self._watcher.start()
        if spec.rig:
            from photonic_testbed.hil import rig as rigfile
            from photonic_testbed.hil.job.fabric_client import Fabric
            rig = rigfile.load(spec.rig)
            names = [g.name for g in rig.gpus]
            index = names.index(self.gpu) if self.gpu in names else 0
            self.fabric = Fabric(*rig.agent_endpoints(), keys=rig.client_keys(),
                                 timeout=spec.agent_timeout_s)
        self.device = device_for(index)
        # The model of the shard this GPU would hold in the current generation (a standby's
        # shard can change when it takes a rank: rebuilt then).
        self._build(0)
        if self.streams:
            self._warm_up()
            threading.Thread(target=self._watch_stream, name="stream", daemon=True).start()

    def _warm_up(self) -> None:
        """One forward and backward pass on a batch, forgotten (no gradient kept, no optimizer
        step, no random number drawn): the one-off costs of a process's first pass are paid
        here, not in the first step a standby takes a rank for (a planned swap's stall)."""
        x, y = (t.to(self.device) for t in self.data.batch(0, 0, self.spec.batch))
        link = self.model.link.allreduce
        self.model.link.allreduce = lambda t: None          # (alone: no group to sum over)
        try:
            logits = self.model(x)
            F.cross_entropy(logits.reshape(-1, self.cfg.vocab), y.reshape(-1)).backward()
        finally:
            self.model.link.allreduce = link
            for p in self.params:
                p.grad = None

    def _build(self, tp_index: int) -> None:
        tp = max(len(g) for g in roles(self.plan, self.plan.world, 0).tp_groups)
        self.cfg = ModelConfig(self.data.vocab, self.spec.block, self.spec.width,
                               self.spec.layers, self.spec.heads, tp)
        self.tp_index = tp_index
        self.model = build_model(self.cfg, tp_index, self.spec.seed).to(self.device)
        self.opt = new_optimizer(self.model, self.spec.lr)
        self.params = list(self.model.parameters())
        self.completed = 0

    def _watch(self) -> None:
        """Wait on the store for each next generation; wake the main thread at once."""
        client = store_client(*self.spec.store)
        n = self.newest
        while not self._stop.is_set():
            try:
                client.wait([f"gen/{n + 1}"])
            except DistError as e:        # the controller (the store's host) is gone
                log.error("the job's store is gone: %s", e)
                self._stop.set()
                self._wake.set()
                return
            n += 1
            with self._lock:
                self.newest = max(self.newest, n)
            self._wake.set()

    def _watch_hold(self, g: int) -> None:
        """Wait for the controller to name the step at which generation g stops (a planned
        swap: every rank holds at its first step boundary at or past it until the next
        generation), or to end the generation (-1)."""
        client = store_client(*self.spec.store)
        try:
            client.wait([f"pg{g}/hold"])
            at = int(client.get(f"pg{g}/hold"))
        except (DistError, ValueError) as e:
            log.warning("generation %d's hold not read: %s", g, e)
            return
        if at < 0:                     # the generation is over: no hold
            return
        try:
            if client.check([f"stream/{g}"]):
                order = json.loads(client.get(f"stream/{g}"))
                if order.get("donor") == self.rank and self.gen == g:
                    self.stream_out = order
        except (DistError, ValueError) as e:
            log.warning("generation %d's stream order not read: %s", g, e)
        with self._lock:
            self.hold_at = (g, at)
        self._wake.set()

    # --- a planned swap's state, streamed ahead ------------------------------------------
    def _watch_stream(self) -> None:
        """A standby: wait to be named the spare of a planned swap (`stream-to/<gpu>`), then
        take the donor's state and apply its steps' averaged gradients up to the held step,
        as the donor's optimizer does: the new generation finds this process at that step (no
        transfer then). Anything missing stops it there: the transfer does the rest."""
        client = store_client(*self.spec.store)
        key = f"stream-to/{self.gpu}"
        while not self._stop.is_set() and not self._stream_stop.is_set():
            try:
                client.wait([key])
                order = json.loads(client.get(key))
                client.delete_key(key)
            except (DistError, ValueError) as e:
                log.warning("%s: no stream order read: %s", self.gpu, e)
                return
            if not isinstance(order, dict) or int(order.get("gen", -1)) < self.newest:
                continue                       # (an order of a generation already over)
            self._streamed.clear()
            try:
                self._take_stream(order)
            except Exception as e:             # (anything: the transfer does the rest)
                self.events.write("stream_failed", gen=order.get("gen"), reason=str(e)[:300],
                                  step=self.completed)
            finally:
                self._streamed.set()

    def _take_stream(self, order: dict) -> None:
        g, at = int(order["gen"]), int(order["at"])
        client = store_client(*self.spec.store, self.spec.collective_timeout_s)
        prefix = f"stream{g}/"
        t0 = time.time()
        client.wait([prefix + "state"])
        step = int(client.get(prefix + "step"))
        data = client.get(prefix + "state")
        with self._lock:
            if self._stream_stop.is_set():
                raise RuntimeError("a rank already: the stream came too late")
            if int(order.get("tp", 0)) != self.tp_index:
                self._build(int(order["tp"]))
            self.completed = 0             # (a state half loaded is no step's)
            flat = torch.frombuffer(bytearray(data), dtype=torch.float32).to(self.device)
            unflatten_into(flat, state_tensors(self.model, self.opt))
            self.completed = step
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        got = len(data)
        while self.completed < at:
            k = self.completed + 1
            client.wait([prefix + f"grad/{k}"])
            data = client.get(prefix + f"grad/{k}")
            with self._lock:
                if self._stream_stop.is_set():
                    raise RuntimeError(f"a rank already at step {self.completed}")
                unflatten_into(torch.frombuffer(bytearray(data), dtype=torch.float32)
                               .to(self.device), gradients(self.params))
                self.opt.step()
                self.completed = k
            got += len(data)
        for name in ("step", "state", *(f"grad/{i}" for i in range(step + 1, at + 1))):
            client.delete_key(prefix + name)   # (the store keeps nothing of it)
        self.events.write("streamed", gen=g, step=at, first=step, bytes_received=got,
                          seconds=time.time() - t0)

    def _send_stream(self, grad: torch.Tensor | None, last: bool = False) -> None:
        """A donor, after a step: its state the first time, then each step's averaged
        gradients, to the planned swap's spare (by a thread: the step does not wait on the
        store); the last one (the held step, or `last`) closes the stream."""
        order = self.stream_out
        if order is None:
            return
        if order["gen"] != self.gen:           # (a generation over: its stream too)
            self._end_stream()
            return
        if self._sender is None:
            sender: queue.Queue = queue.Queue()
            self._sender = sender
            client = store_client(*self.spec.store, self.spec.collective_timeout_s)
            prefix = f"stream{self.gen}/"

            def send() -> None:
                while True:
                    item = sender.get()
                    if item is None:
                        return
                    try:
                        for key, value in item:
                            client.set(prefix + key, value() if callable(value) else value)
                    except DistError as e:
                        log.warning("stream to %s: %s", order["to"], e)
                        return
            threading.Thread(target=send, name="stream-out", daemon=True).start()
            state = flatten(state_tensors(self.model, self.opt)).detach().cpu()
            sender.put([("step", str(self.completed)),
                        ("state", lambda: state.numpy().tobytes())])
        elif grad is not None:
            copy = grad.detach().cpu().clone()
            self._sender.put([(f"grad/{self.completed}", lambda: copy.numpy().tobytes())])
        if last or self.completed >= int(order["at"]):
            self._end_stream()

    def _end_stream(self) -> None:
        if self._sender is not None:
            self._sender.put(None)
        self.stream_out, self._sender = None, None

    def _hold(self) -> None:
        """At a step boundary of a planned swap: no collective in flight, the state is that of
        the last completed step; wait for the next generation (raises Aborted when it comes)."""
        if self.stream_out is not None:      # a donor that held first: its state, then done
            self._send_stream(None, last=True)
        self.events.write("held", gen=self.gen, rank=self.rank, step=self.completed)
        self.store.add(f"pg{self.gen}/held", 1)      # (the controller's key, no prefix)
        while True:
            self._wake.clear()
            self._check(f"the hold at step {self.completed}")
            self._wake.wait(1.0)

    def _check(self, what: str) -> None:
        if self._stop.is_set():
            raise JobStopped("the job's store is gone")
        if self.newest > self.gen:
            raise Aborted(f"generation {self.newest} ordered during {what}")

    # --- abortable waits --------------------------------------------------------------------
    def _wait_work(self, work: Any, what: str) -> None:
        try:
            fut = work.get_future()
        except RuntimeError:
            # gloo's send/recv have no future and report completion only from wait(): wait
            # on a thread that a newer generation can abandon
            self._in_thread(work.wait, what)
            return
        fut.add_done_callback(lambda _: self._wake.set())   # called once fut.done()
        while True:
            self._wake.clear()
            if fut.done():
                break
            self._check(what)
            self._wake.wait(1.0)
        try:
            work.wait()
        except RuntimeError as e:
            raise Aborted(f"{what} failed: {str(e).splitlines()[0][:200]}") from None

    def _wait_keys(self, keys: list[str], what: str) -> None:
        """Until the generation's store has `keys` (abandoned if a newer one is ordered)."""
        self._in_thread(lambda: self.gwait.wait(keys), what)

    def _in_thread(self, fn: Callable[[], Any], what: str) -> Any:
        """Run a blocking call (a rendezvous, a store wait) where a new generation can abandon
        it (the thread is left to finish or fail by itself)."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn()
            except (RuntimeError, ValueError) as e:
                box["error"] = e
            finally:
                done.set()
                self._wake.set()
        threading.Thread(target=run, name=what, daemon=True).start()
        while True:
            self._wake.clear()
            if done.is_set():
                break
            self._check(what)
            self._wake.wait(1.0)
        if "error" in box:
            raise Aborted(f"{what} failed: {str(box['error']).splitlines()[0][:200]}")
        return box.get("value")

    # --- the main loop ----------------------------------------------------------------------
    def run(self) -> int:
        self.events.write("started")
        try:
            self._setup()
        except (DistError, torch_job.JobSpecError) as e:
            self.events.write("stopped", reason=f"set-up failed: {e}")
            return STOPPED
        self.events.write("ready", newest=self.newest)
        g, was_rank = self.newest, False
        try:
            while True:
                order = self._order(g)
                if "stop" in order:
                    self.events.write("stopped", gen=g, reason=order["stop"])
                    return DONE if not was_rank else STOPPED
                rank_map = {int(r): str(v) for r, v in order["rank_map"].items()}
                rank = next((r for r, v in rank_map.items() if v == self.gpu), None)
                if rank is None:
                    if was_rank:
                        self.events.write("swapped_out", gen=g)
                        return SWAPPED_OUT
                else:
                    was_rank = True
                    try:
                        self._join(g, rank_map, rank)
                        self._train()
                        self._finish()
                        return DONE
                    except Aborted as e:
                        self.events.write("aborted", gen=g, step=self.completed,
                                          reason=str(e))
                        log.warning("%s: generation %d abandoned: %s", self.gpu, g, e)
                g = max(g + 1, self.newest)
        except JobStopped as e:
            self.events.write("stopped", gen=self.gen, reason=str(e))
            log.error("%s: %s", self.gpu, e)
            return LOST_STATE
        finally:
            self._stop.set()
            if self.fabric is not None:
                self.fabric.close()

    def _order(self, g: int) -> dict:
        """Generation g's order from the store (waiting for it; newer ones skip ahead)."""
        try:
            return json.loads(self.store.get(f"gen/{g}"))   # blocks until it is there
        except DistError as e:
            raise JobStopped(f"the job's store is gone: {e}") from None

    def _join(self, g: int, rank_map: dict[int, str], rank: int) -> None:
        """Groups of generation g, agreement on the step, state to whoever lacks it."""
        t0 = time.time()
        self.gen, self.granted, self._barriers = g, None, 0
        world = len(rank_map)
        self.rank_map, self.rank, self.world = rank_map, rank, world
        self.roles = roles(self.plan, world, rank)
        self._end_stream()                   # (a donor's stream of a generation over)
        if not self._streamed.is_set():      # the spare of a planned swap: its state first
            self._in_thread(lambda: self._streamed.wait(STREAM_WAIT_S), "the streamed state")
        with self._lock:                     # a rank now: nothing more is applied to it
            self._stream_stop.set()
        self.events.write("joined", gen=g, rank=rank, world=world, step=self.completed)
        if self.roles.tp_index != self.tp_index:
            if self.ranked:
                raise JobStopped(f"{self.gpu} holds TP shard {self.tp_index} but rank {rank} "
                                 f"is shard {self.roles.tp_index}")
            self._build(self.roles.tp_index)     # a standby taking another shard's place
        self.ranked = True
        store = store_client(*self.spec.store, self.spec.collective_timeout_s)
        self.gstore = PrefixStore(f"pg{g}/", store)
        self.gwait = PrefixStore(f"pg{g}/", store_client(*self.spec.store,
                                                        self.spec.collective_timeout_s))
        timeout = self.spec.collective_timeout_s

        def groups():
            out = {}
            for name, mine, all_ in (("tp", self.roles.tp_group, self.roles.tp_groups),
                                     ("dp", self.roles.dp_group, self.roles.dp_groups)):
                if len(mine) > 1:
                    prefix = f"{name}{all_.index(mine)}/"
                    out[name] = new_group(PrefixStore(prefix, self.gstore),
                                          mine.index(rank), len(mine), timeout)
            return out
        self.groups = self._in_thread(groups, f"generation {g}'s groups")
        self._graveyard.append(self.groups)
        threading.Thread(target=self._watch_hold, args=(g,), name=f"hold{g}",
                         daemon=True).start()
        self.model.link.allreduce = self._tp_allreduce
        t1 = time.time()
        self.events.write("rebuilt", gen=g, seconds=t1 - t0)
        # Agreement: each member's completed steps, through the store.
        self.gstore.set(f"step/{rank}", str(self.completed))
        self._wait_keys([f"step/{r}" for r in range(world)], "the step agreement")
        steps = {r: int(v) for r, v in zip(range(world), self.gstore.multi_get(
            [f"step/{r}" for r in range(world)]), strict=True)}
        target = max(steps.values())
        sent = got = 0        # bytes: a member behind may receive, then pass the state on
        if any(s < target for s in steps.values()):
            self._enter("dp")
            try:
                pairs = transfer_pairs(self.roles.dp_group, steps, target)
            except LookupError as e:
                raise JobStopped(f"shard {self.roles.tp_index}: {e}") from None
            dp = self.groups.get("dp")
            ring = self.roles.dp_group
            state = state_tensors(self.model, self.opt)
            for src, dst in pairs:
                if rank == src:
                    self._audit("dp", f"state to rank {dst}")
                    flat = flatten(state)
                    self._wait_work(dp.send([flat], ring.index(dst), g), "the state transfer")
                    sent += flat.numel() * flat.element_size()
                elif rank == dst:
                    flat = torch.empty(sum(t.numel() for t in state), device=self.device)
                    self._wait_work(dp.recv([flat], ring.index(src), g), "the state transfer")
                    unflatten_into(flat, state)
                    got += flat.numel() * flat.element_size()
                    self.completed = target
        self.events.write("transferred", gen=g, step=target, bytes_sent=sent, bytes_received=got,
                          seconds=time.time() - t1, steps={str(r): s for r, s in steps.items()},
                          received=steps[rank] < target)
        self.completed = target

    # --- phases ---------------------------------------------------------------------------
    def _enter(self, phase: str, round: int = 0) -> float:
        """Hold the circuits of (phase, round) before its collectives: once every member is
        past the previous phase (a barrier on the store), the last to arrive asks the agent;
        the others wait for its word. Returns the seconds this took (0 when held)."""
        t0 = time.perf_counter()
        key = (phase, round)
        if self.granted == key:
            return time.perf_counter() - t0
        n = self._barriers
        self._barriers += 1
        if self.gstore.add(f"phase{n}", 1) == self.world:
            grant = "granted"
            if self.fabric is not None:
                try:
                    self.fabric.phase(phase, round)
                except BusError as e:      # unreachable, or the agent refused: say why, stop
                    grant = f"{type(e).__name__}: {e}"
            self.gstore.set(f"phase{n}/go", grant)
        else:
            self._wait_keys([f"phase{n}/go"], f"the grant of phase {phase}")
            grant = self.gstore.get(f"phase{n}/go").decode()
        if grant != "granted":
            raise JobStopped(f"the agent did not grant phase {phase} round {round}: {grant}")
        self.granted = key
        return time.perf_counter() - t0

    def _links(self, phase: str) -> list[tuple[str, str]]:
        links = self.plan.links(self.world)[(phase, 0)]
        return [(self.rank_map[a], self.rank_map[b]) for a, b in links
                if self.rank in (a, b)]

    def _audit(self, phase: str, what: str) -> None:
        """With the emulator: record whether the physics carries this rank's links of the
        phase right before its collective (tests check the record; nothing is gated on it)."""
        if not (self.spec.audit and self.spec.control):
            return
        links = self._links(phase)
        truth = torch_job.emulator_request(self.spec.control, {"cmd": "rack_truth"})
        up = {(t["src"], t["dst"]) for t in truth if t["up"]}
        down = [list(p) for p in links if p not in up]
        self.events.write("audit", gen=self.gen, step=self.completed, phase=phase, what=what,
                          links=[list(p) for p in links], down=down)

    # --- training -------------------------------------------------------------------------
    def _tp_allreduce(self, t: torch.Tensor) -> None:
        if not self._tp_audited:
            self._audit("tp", "tensor-parallel all-reduce")
            self._tp_audited = True
        self._check("a tensor-parallel all-reduce")
        t0 = time.perf_counter()
        self._wait_work(self.groups["tp"].allreduce([t]), "a tensor-parallel all-reduce")
        self._tp_wait += time.perf_counter() - t0

    def _step(self) -> None:
        step = self.completed
        t0 = time.perf_counter()
        hook = 0.0
        x, y = (t.to(self.device) for t in
                self.data.batch(step, self.roles.dp_index, self.spec.batch))
        self._tp_audited = False
        self._tp_wait = 0.0          # seconds in tensor-parallel collectives (a wait too)
        if "tp" in self.groups:
            hook += self._enter("tp")
            self._tp_wait += hook
        for p in self.params:
            p.grad = None
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, self.cfg.vocab), y.reshape(-1))
        loss.backward()
        t_comm = time.perf_counter()
        if "dp" in self.groups:
            hook += self._enter("dp")
            self._audit("dp", "gradient all-reduce")
            grads = gradients(self.params)
            flat = flatten(grads)
            self._check("the gradient all-reduce")
            self._wait_work(self.groups["dp"].allreduce([flat]), "the gradient all-reduce")
            flat.div_(len(self.roles.dp_group))
            unflatten_into(flat, grads)
        t_waited = time.perf_counter()
        self.opt.step()                  # only now: an abandoned step changed nothing
        self.completed = step + 1
        t1 = time.perf_counter()
        self.events.write("step", gen=self.gen, rank=self.rank, step=self.completed,
                          loss=round(loss.item(), 5), seconds=t1 - t0, comm_s=t1 - t_comm,
                          hook_s=hook, wait_s=t_waited - t_comm + self._tp_wait)
        if self.stream_out is not None:
            self._send_stream(flat if "dp" in self.groups else None)

    def _train(self) -> None:
        while self.completed < self.spec.steps:
            self._check("training")
            hold = self.hold_at
            if hold is not None and hold[0] == self.gen and self.completed >= hold[1]:
                self._hold()
            self._step()

    def _finish(self) -> None:
        state = [p.data for p in self.params]
        self.events.write("done", gen=self.gen, rank=self.rank, step=self.completed,
                          digest=digest(state))
        if self.roles.dp_index == 0:
            save_weights(pathlib.Path(self.spec.out_dir) / f"final-tp{self.tp_index}.pt",
                         self.model, self.completed)


# --- the torchrun baseline ------------------------------------------------------------------
class TorchrunWorker(Worker):
    """The same training under torchrun: rank and world from its environment; after any loss
    torchrun restarts every worker, which waits for the agent's order for this restart, then
    reloads the last checkpoint."""
    streams = False

    def __init__(self, spec: torch_job.JobSpec):
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.env_rank = int(os.environ["RANK"])
        self.env_world = int(os.environ["WORLD_SIZE"])
        ctrl = store_client(*spec.store, spec.restart_timeout_s)
        # This restart's rank map: the order the agent gave for it (generation = restarts).
        g = self.restart
        try:
            order = json.loads(ctrl.get(f"gen/{g}"))
        except DistError:
            raise torch_job.JobSpecError(f"no rank map for restart {g} within "
                                         f"{spec.restart_timeout_s} s") from None
        if "stop" in order:
            raise torch_job.JobSpecError(f"the job was stopped: {order['stop']}")
        rank_map = {int(r): str(v) for r, v in order["rank_map"].items()}
        if len(rank_map) != self.env_world:
            raise torch_job.JobSpecError(f"the agent's rank map has {len(rank_map)} ranks, "
                                         f"torchrun started {self.env_world}")
        super().__init__(spec, rank_map[self.env_rank])
        self.rank_map_order = rank_map

    def run(self) -> int:
        self.events.write("started", restart=self.restart)
        self._setup()
        rank_map, rank = self.rank_map_order, self.env_rank
        self.gen = self.newest = self.restart
        self.roles = roles(self.plan, len(rank_map), rank)
        if self.roles.tp_index != self.tp_index:
            self._build(self.roles.tp_index)
        loaded = self._load_checkpoint()
        self.events.write("ready", restart=self.restart, checkpoint=loaded)
        # torchrun's own store (its rendezvous): a prefix per restart, like init_process_group.
        master = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        t0 = time.time()
        self.gen, self.granted, self._barriers = self.restart, None, 0
        self.rank_map, self.rank, self.world = rank_map, rank, len(rank_map)
        prefix = f"ptb-r{self.restart}/"
        timeout = self.spec.collective_timeout_s
        self.gstore = PrefixStore(prefix, store_client(*master, timeout))
        self.gwait = PrefixStore(prefix, store_client(*master, timeout))
        self.groups = {}
        for name, mine, all_ in (("tp", self.roles.tp_group, self.roles.tp_groups),
                                 ("dp", self.roles.dp_group, self.roles.dp_groups)):
            if len(mine) > 1:
                self.groups[name] = new_group(
                    PrefixStore(f"{name}{all_.index(mine)}/", self.gstore), mine.index(rank),
                    len(mine), self.spec.collective_timeout_s)
        self.model.link.allreduce = self._tp_allreduce
        self.events.write("rebuilt", gen=self.gen, seconds=time.time() - t0)
        try:
            while self.completed < self.spec.steps:
                self._step()
                if self.completed % self.spec.checkpoint_every == 0:
                    self._save_checkpoint()
            self._finish()
        except Aborted as e:
            self.events.write("aborted", gen=self.gen, step=self.completed, reason=str(e))
            return 1
        finally:
            self._stop.set()
            if self.fabric is not None:
                self.fabric.close()
        return DONE

    def _check(self, what: str) -> None:
        if self._stop.is_set():
            raise JobStopped("the job's store is gone")

    def _watch(self) -> None:
        return                           # torchrun restarts the workers: nothing to watch

    def _ckpt(self, step: int) -> pathlib.Path:
        return pathlib.Path(self.spec.out_dir) / f"ckpt-{step:08d}-tp{self.tp_index}.pt"

    def _save_checkpoint(self) -> None:
        if self.roles.dp_index != 0:
            return
        t0 = time.time()
        path = self._ckpt(self.completed)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"step": self.completed, "model": self.model.state_dict(),
                    "opt": self.opt.tensors()}, tmp)
        os.replace(tmp, path)
        for old in sorted(path.parent.glob(f"ckpt-*-tp{self.tp_index}.pt"))[:-2]:
            old.unlink(missing_ok=True)
        self.events.write("checkpoint", step=self.completed, seconds=time.time() - t0)

    def _load_checkpoint(self) -> int:
        """The newest step every shard has saved; 0 (the seed) if none."""
        out = pathlib.Path(self.spec.out_dir)
        shards = max(len(g) for g in self.roles.tp_groups)
        steps = None
        for i in range(shards):
            have = {int(p.name.split("-")[1]) for p in out.glob(f"ckpt-*-tp{i}.pt")}
            steps = have if steps is None else steps & have
        if not steps:
            return 0
        step = max(steps)
        got = torch.load(self._ckpt(step), map_location="cpu", weights_only=True)
        self.model.load_state_dict(got["model"])
        with torch.no_grad():
            for t, saved in zip(self.opt.tensors(), got["opt"], strict=True):
                t.copy_(saved)
        self.completed = step
        return step


# --- command line ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m photonic_testbed.hil.job.worker",
                                description="A rank process of the PyTorch job (started by "
                                "hil.job.torch_job).")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="a rank or warm standby of the in-place job")
    w.add_argument("--job", required=True, help="the job's JSON spec (torch_job.JobSpec)")
    w.add_argument("--gpu", required=True, help="the rig GPU this process is bound to")
    t = sub.add_parser("torchrun-worker", help="a worker of the torchrun baseline")
    t.add_argument("--job", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = torch_job.JobSpec.load(args.job)
        worker = Worker(spec, args.gpu) if args.cmd == "worker" else TorchrunWorker(spec)
        code = worker.run()
    except torch_job.JobSpecError as e:
        print(f"torch job: {e}", file=sys.stderr)
        code = STOPPED
    sys.stdout.flush()
    sys.stderr.flush()
    # Abandoned process groups may hold threads in a collective until its timeout; their
    # destructors would wait for them. The events are written line by line: nothing to lose.
    os._exit(code)


if __name__ == "__main__":
    main()
