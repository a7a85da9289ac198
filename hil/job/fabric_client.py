"""The job's side of the fabric: what a training loop calls at its phase boundaries.

    from photonic_testbed.hil.job.fabric_client import Fabric
    fabric = Fabric(*rig.agent_endpoints(), on_restart=restart_from_checkpoint)
    rank_map = fabric.admit(plan)          # the agent precomputes every phase's circuits
    for step in range(steps):
        fabric.phase("tp")                 # returns once the TP circuits are up (verified)
        ...tensor-parallel collectives...
        fabric.phase("dp")
        ...data-parallel all-reduce...

`phase(name, round)` is a request to the agent (`ptb agent`): the agent applies the
difference to every switch and answers; the answer is the grant. A failure the job sees
(a collective timing out, a rank lost) goes to `failure(reason, gpus, links)`. Restart orders
come from the agent's published state (`restart`: `{"seq", "rank_map", "cause"}`): each new
one calls `on_restart(rank_map, cause)` on the subscriber's thread, and `wait_restart()` waits
for one. Nothing here imports torch: a PyTorch loop passes its own callbacks.

When the agent restarts (a new incarnation of its state on the bus), the client re-announces
the job (`rejoin`: plan, rank map, the last order taken, waiting for one or not), so that the
new agent reconciles the job as it reconciles the switches; an order the job missed while the
agent was down is taken from the new agent's state.

A replicated agent (`replicas`: the rig's `agent_replicas()`, a group on an etcd journal):
the client subscribes to every replica and takes state only from the one that leads, in the
highest term it has seen (a deposed leader's late publications are not believed); requests go
to the leader, and one refused by a standby (`NotLeader`) or unanswered goes to the next
replica, until the call's deadline. A new leader is a new incarnation: the job rejoins it.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from photonic_testbed.hil.bus.client import (
    BusError,
    Cancelled,
    NotLeader,
    ServiceClient,
    ServiceUnavailable,
)
from photonic_testbed.hil.bus.mirror import StateSubscriber
from photonic_testbed.hil.bus.security import ClientKeys

log = logging.getLogger(__name__)


class Fabric:
    def __init__(self, request: str, publish: str, *, keys: ClientKeys | None = None,
                 timeout: float = 5.0, job: str | None = None,
                 on_restart: Callable[[dict[int, str], str], None] | None = None,
                 replicas: Mapping[str, tuple[str, str]] | None = None):
        self.timeout = timeout
        # every replica of the agent, (request, publish) (`request, publish` alone without
        # `replicas`); the one believed to lead: the one named, if it is a replica
        self._replicas = list(replicas.values()) if replicas else [(request, publish)]
        self._replicated = bool(replicas)         # a group: a standby's NotLeader is waited out
        self._leading = self._replicas.index((request, publish)) \
            if (request, publish) in self._replicas else 0
        self._term = 0                            # the highest leader's term seen
        # per replica: set while it is not the leader seen (a wait for its answer gives up)
        self._abandon = [threading.Event() for _ in self._replicas]
        self.job = job                    # this job's name at the agent (its plan's by default)
        self.on_restart = on_restart
        self._keys = keys
        self._request = request
        self._local = threading.local()
        self._clients: list[ServiceClient] = []
        self._cond = threading.Condition()
        self._restart_seq: int | None = None      # the agent's restart seq when we joined
        self._orders: list[tuple[dict[int, str], str]] = []
        self._plan: dict | None = None            # what `rejoin` tells a restarted agent
        self._rank_map: dict[int, str] = {}
        self._waiting = False                     # a failure reported, no order taken since
        self._incarnation: str | None = None      # the agent's, as last seen
        self._ready: tuple[str, int] | None = None   # a phase the agent set up ahead
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fabric-done")
        self.rejoins = 0
        self.ahead = 0                            # phases found set up ahead
        # A plain subscriber on our own thread: only the `restart` key matters here, so no
        # copy of the agent's state (its events) is made per delta.
        self._stop = threading.Event()
        self._cancel = threading.Event()          # set: calls in flight give up (Cancelled)
        self._ctx = zmq.Context()
        # each replica publishes as `agent@NAME` (a lone agent as `agent`)
        self._devices = [f"agent@{n}" for n in replicas] if replicas else ["agent"]
        self._subs = [StateSubscriber({self._devices[i]: eps}, keys=keys, telemetry=False,
                                      on_state=functools.partial(self._on_state, i),
                                      context=self._ctx)
                      for i, eps in enumerate(self._replicas)]
        self._thread = threading.Thread(target=self._listen, name="fabric-orders", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._replicated:
                    self._subs[0].poll(0.05)
                    continue
                zmq.select([s.sub for s in self._subs], [], [], 0.05)
                for sub in self._subs:
                    sub.poll(0)
        except Exception:
            log.exception("the fabric's subscriber stopped")

    def _client(self, i: int | None = None) -> ServiceClient:
        """This thread's client of replica `i` (the leader's by default): one client per
        thread (bus rule)."""
        i = self._leading if i is None else i
        clients = self._local.__dict__.setdefault("clients", {})
        c = clients.get(i)
        if c is None:
            c = clients[i] = ServiceClient(
                self._replicas[i][0], keys=self._keys, timeout=self.timeout,
                cancel=self._abandon[i] if self._replicated else self._cancel)
            self._clients.append(c)
        return c

    def _call(self, op: str, timeout: float | None = None, **args: Any) -> Any:
        """`op` to the agent that leads: with replicas, one refused by a standby
        (NotLeader) or unanswered goes to the next, until `timeout` (the client's) has
        passed for each replica once."""
        if not self._replicated:
            return self._client().call(op, timeout=timeout, **args)
        per_call = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + per_call * len(self._replicas)
        i = self._leading
        # one id per replica for this request: asked again, a replica that ran it answers
        # what it answered (at most once per replica; a new leader has no memory of another's)
        ids: dict[int, str] = {}
        while True:
            if self._cancel.is_set():
                raise Cancelled("the fabric client is closing")
            client = self._client(i)
            try:
                got = client.call(op, timeout=per_call,
                                  request_id=ids.setdefault(i, client.new_request_id()),
                                  **args)
            except (NotLeader, ServiceUnavailable) as e:
                if self._cancel.is_set() or time.monotonic() > deadline:
                    raise
                # (this request's id goes to this replica again, maybe: an answer to it still
                # on its way, a standby's refusal sent twice, must not be read as the leader's)
                client.reconnect()
                # another replica leads (its state said so: the wait was given up), or this
                # one refused or did not answer: the leader seen, else the next replica
                was, i = i, (self._leading if self._leading != i
                             else (i + 1) % len(self._replicas))
                log.debug("%s: replica %d of the agent: %s; asking replica %d", op, was, e, i)
                if i == self._leading and isinstance(e, NotLeader):
                    self._cancel.wait(0.05)     # a leader is being chosen
                continue
            self._leading = i
            return got

    @property
    def rank_map(self) -> dict[int, str]:
        """The job's rank map, as admitted or last ordered."""
        with self._cond:
            return dict(self._rank_map)

    # --- requests ---------------------------------------------------------------------------
    def admit(self, plan: Any, rank_map: Mapping[int, str] | None = None) -> dict[int, str]:
        """Announce the job (a JobPlan or its dict); returns the rank map the agent chose."""
        d = plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)
        args: dict[str, Any] = {"plan": d, "job": self.job}
        if rank_map is not None:
            args["rank_map"] = {str(r): g for r, g in rank_map.items()}
        got = self._call("admit", **args)
        rank_map = {int(r): g for r, g in got["rank_map"].items()}
        with self._cond:
            self.job = got.get("job") or d.get("name")
            self._restart_seq = int(got.get("restart_seq", 0))
            self._plan, self._rank_map, self._waiting = d, dict(rank_map), False
        return rank_map

    def phase(self, name: str, round: int = 0, timeout: float | None = None) -> dict:
        """Block until the agent says the circuits of (phase, round) are ready; at once when
        the agent has already set them up ahead (after `done`) and says so in its state."""
        with self._cond:
            ready = self._ready == (name, int(round))
            self._ready = None
        if ready:
            self.ahead += 1
            return {"granted": True, "phase": name, "round": int(round), "ahead": True}
        return self._call("phase", phase=name, round=int(round), job=self.job,
                          timeout=timeout)

    def done(self, name: str, round: int = 0) -> None:
        """The job is done with (phase, round)'s links and computes before its next phase:
        the agent sets that phase's circuits up meanwhile (Opus's insight: a rail is
        reconfigured while the job computes). Returns at once: the request goes out on the
        client's own thread."""
        with self._cond:
            self._ready = None
        self._background.submit(self._done, name, int(round))

    def _done(self, name: str, round: int) -> None:
        try:
            self._call("phase_done", phase=name, round=round, job=self.job)
        except BusError as e:        # the next phase() asks, as without it
            log.warning("phase_done %s/%d not taken: %s", name, round, e)

    def failure(self, reason: str, gpus: Any = (), links: Any = ()) -> dict:
        with self._cond:
            self._waiting = True
        return self._call("job_failure", reason=str(reason), gpus=list(gpus),
                          links=[list(x) for x in links], job=self.job)

    def report(self, state: str, step: int, throughput: float | None = None,
               loss: float | None = None, detail: str = "") -> None:
        """Tell the agent (and through its state, the GUI) how the job is doing: `state` one
        of running, waiting, failed, restarting, stopped, done; steps a second; loss."""
        self._call("job_report", job=self.job, state=state, step=int(step),
                   throughput=throughput, loss=loss, detail=str(detail))

    def timings(self, rows: list, swap_stall_s: float | None = None,
                warm: list[str] | tuple[str, ...] = ()) -> dict | None:
        """Each rank's step timings, `(gpu, generation, step, compute_s, wait_s)` rows
        (hil.agent.gray), the stall of the last planned swap as measured, and where the job
        keeps warm standbys; the answer's `handover` names a GPU the agent decided to swap at
        the next step boundary and the spare it will take (`gpu`, `why`, `to`), or is None."""
        got = self._call("job_timings", job=self.job, rows=[list(r) for r in rows],
                         swap_stall_s=swap_stall_s, warm=list(warm))
        return got.get("handover") if isinstance(got, dict) else None

    def handover(self, gpu: str, warm: list[str] | tuple[str, ...] = ()) -> dict:
        """The job stands at a step boundary: the agent swaps `gpu` now, for one of `warm` (its
        warm standbys) if it can (its restart order follows, as after a failure)."""
        return self._call("handover", job=self.job, gpu=gpu, warm=list(warm))

    def release(self) -> dict:
        """The job is done: its GPUs and circuits go back to the rack."""
        return self._call("release", job=self.job)

    # --- restart orders ---------------------------------------------------------------------
    def _on_state(self, i: int, device: str, state: dict, ops: Any) -> None:
        if state.get("role") == "standby":
            return                      # (a standby's state says only who leads)
        term = int(state.get("term") or 0)
        if term < self._term:
            return                      # a deposed leader's late word
        self._term = term
        if i != self._leading:              # a new leader: a wait on the old one gives up
            self._abandon[self._leading].set()
            self._abandon[i].clear()
        self._leading = i
        incarnation = self._subs[i].mirror(self._devices[i]).incarnation
        restarted = self._incarnation is not None and incarnation != self._incarnation
        self._incarnation = incarnation
        mine = (state.get("jobs") or {}).get(self.job) if self.job else None
        ready = (mine or {}).get("ready")
        with self._cond:
            self._ready = (str(ready[0]), int(ready[1])) if ready else None
        self._take_order((mine or state).get("restart") or {})
        if restarted and self._plan is not None:
            # (off the subscriber's thread: a rejoin sent to a replica that has just died waits
            # for its answer, and only the subscriber hears that another replica leads now)
            self._background.submit(self._rejoin)

    def _take_order(self, order: Mapping) -> None:
        seq = int(order.get("seq", 0))
        with self._cond:
            if self._restart_seq is None:
                self._restart_seq = seq          # orders before we joined are not ours
                return
            rank_map = {int(r): g for r, g in order.get("rank_map", {}).items()}
            if seq <= self._restart_seq or not rank_map:
                return
            self._restart_seq = seq
            self._rank_map, self._waiting = dict(rank_map), False
            self._orders.append((rank_map, str(order.get("cause", ""))))
            self._cond.notify_all()
        log.info("restart order %d: %s", seq, rank_map)
        if self.on_restart is not None:
            self.on_restart(rank_map, str(order.get("cause", "")))

    def _rejoin(self) -> None:
        """Tell a restarted agent where the job stands (on the client's background thread)."""
        with self._cond:
            args: dict[str, Any] = {"plan": self._plan, "job": self.job,
                                    "restart_seq": int(self._restart_seq or 0),
                                    "rank_map": {str(r): g for r, g in
                                                 self._rank_map.items()},
                                    "state": "failed" if self._waiting else "running"}
        try:
            got = self._call("rejoin", **args)
        except BusError as e:
            log.warning("could not rejoin the restarted agent: %s", e)
            return
        self.rejoins += 1
        log.info("rejoined the restarted agent (%s)", args["state"])
        self._take_order(got.get("restart") or {})

    def wait_restart(self, timeout: float) -> tuple[dict[int, str], str] | None:
        """The next restart order (rank map, cause), or None after `timeout` seconds."""
        with self._cond:
            if not self._orders:
                self._cond.wait_for(lambda: bool(self._orders), timeout)
            return self._orders.pop(0) if self._orders else None

    def cancel(self) -> None:
        """From any thread: every call in flight, and every later one, gives up at once
        (Cancelled; a change may or may not have run, as after a timeout). For the owner that
        is closing and must not wait out the calls of its threads before it joins them."""
        self._cancel.set()
        for e in self._abandon:
            e.set()

    def close(self) -> None:
        self.cancel()
        self._background.shutdown(wait=True)
        self._stop.set()
        self._thread.join(timeout=2.0)
        for sub in self._subs:
            sub.close()
        self._ctx.term()
        for c in self._clients:
            c.close()
        self._clients.clear()
