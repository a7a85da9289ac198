"""The agent as a bus process (`ptb agent`): the `Agent` core wired to the rig's services.

- Switches: one `BusSwitch` (`hil.agent.bus_switch`: a `CircuitSwitch` over a
  `ServiceClient`) per switch the rig's GPUs are cabled to; every change is sent with
  `expect` = the version last seen (compare-and-set); a `StaleState` (someone else changed the
  switch) re-reads and retries once, since the agent's intent is the fabric's.
- Light: `read_power(switch, port)` asks the GPU monitor of the GPU on that output port
  (`rx_power`) for the received power its transceiver reports (DDM): the rack's one monitor
  `gpus`, or with one monitor per host ([monitors] in the rig) that host's `gpus-HOST`; the
  requests to several monitors go out together (`call_many`).
- Health and change: a `StateSubscriber` on every GPU monitor (every GPU whose state changed
  goes to `on_health`) and every switch's service (circuits changed behind the agent are put
  back: `Agent.on_switches`).
- The job (through `hil.job.fabric_client.Fabric`): requests `admit`, `phase` (answered once the
  circuits are up: the answer is the grant), `job_failure`; `job_timings` and `handover`
  (`hil.agent.gray`: a GPU found slow from the ranks' timings, swapped at a step boundary).
- Its own state, published as device `agent` with `Server` (docs/agent.md "On the bus"):
  rack, rank_map, phase, events (the last 200 journal entries), alarms, and `restart`
  (the job's restart orders). Operator ops: `swap` `{"gpu": name}`, and the manual changes
  `manual_circuits`, `manual_heaters`, `manual_laser`, each journaled (a `Manual` decision)
  before the agent makes it; a switch's manual circuits are the operator's part of it, beside
  the jobs' parts, kept across the agent's reconciliation and restarts.
- Who asks (`hil.agent.authority`): with CURVE a job's requests come from a tenant's key or an
  operator's (the server refuses other roles, `schema.OPERATIONS`); a job's name belongs to the
  key that admitted it, and a tenant acting on another key's job is refused before anything
  moves. The agent's term (one above its journal's last) goes with every request to a device.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import msgspec
import orjson
import zmq

from photonic_testbed.common import heap
from photonic_testbed.common.jobplan import JobPlan, PlanError
from photonic_testbed.drivers.circuit_switch import Circuits, SwitchError
from photonic_testbed.hil.agent.agent import Agent, AgentError
from photonic_testbed.hil.agent.authority import (
    JobOwners,
    ManualChanges,
    next_term,
)
from photonic_testbed.hil.agent.bus_switch import BusSwitch
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.entries import (
    Admit,
    Alarm,
    Note,
    RestartOrder,
    Unread,
    builtins,
)
from photonic_testbed.hil.agent.etcd_journal import EtcdJournal
from photonic_testbed.hil.agent.events import NoEvents
from photonic_testbed.hil.agent.gray import GrayWatch
from photonic_testbed.hil.agent.journal import Entry, Journal, JournalError
from photonic_testbed.hil.agent.leadership import Leadership, NotLeading
from photonic_testbed.hil.agent.linkwatch import LinkWatch
from photonic_testbed.hil.agent.policies import RankMap
from photonic_testbed.hil.agent.received import ReceivedPower
from photonic_testbed.hil.agent.replica import (
    device_name,
    replica_journal,
    stand_by,
    step_down,
    take_lead,
)
from photonic_testbed.hil.agent.sqlite_journal import SqliteJournal
from photonic_testbed.hil.agent.warm import Warm, layout_from_rig
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import (
    BusError,
    ServiceClient,
)
from photonic_testbed.hil.bus.mirror import StateSubscriber
from photonic_testbed.hil.bus.server import Answer, Server
from photonic_testbed.hil.bus.state import Delete, Set, StateOp, touched
from photonic_testbed.hil.rig import Rig, RigFileError

log = logging.getLogger(__name__)
T = TypeVar("T")

EVENTS_KEPT = 200
EVENT_DETAILS_BYTES = 2048   # an event's details as published, at most (the journal: whole)
EVENT_ITEMS_SHOWN = 8        # a longer list or table in a bulky event is published as its size
PUBLISH_EVERY_S = 0.02      # under a stream of requests, publish (and sync) at least this often


def _job_changes(was: dict, now: dict) -> list[StateOp]:
    """The published jobs' changes as delta operations: a job's changed fields alone (a phase
    switch changes a job's phase and round, not its rank map of 2,048 ranks)."""
    ops: list[StateOp] = []
    for name, job in now.items():
        before = was.get(name)
        if isinstance(before, dict) and before.keys() == job.keys():
            ops += [Set(["jobs", name, f], x) for f, x in job.items() if before[f] != x]
        else:
            ops.append(Set(["jobs", name], job))
    return ops + [Delete(["jobs", name]) for name in was if name not in now]


NO_ORDER: dict[str, Any] = {"seq": 0, "rank_map": {}, "cause": ""}


def published_event(e: Entry, text: str | None = None) -> dict[str, Any]:
    """A journal entry as the agent publishes it (`text`: its details as JSON, as written).
    Its details whole when small; otherwise (`"brief": true`) each list or table of more than
    EVENT_ITEMS_SHOWN items given as its size (`{"items": n}`; a phase switch's `applied` as
    its totals), so that the last 200 events of a 2,048-GPU rack (a phase switch there names
    thousands of circuits on 64 switches) stay within the bus's frames. The journal keeps
    every entry whole (`ptb journal`)."""
    if text is None:                    # (as the journal writes it)
        text = orjson.dumps(e.details.fields, default=str, option=orjson.OPT_NON_STR_KEYS
                            ).decode() if isinstance(e.details, Unread) else \
            msgspec.json.encode(e.details).decode()
    event: dict[str, Any] = {"seq": e.seq, "ts": e.ts, "kind": e.kind, "cause": e.cause,
                             "latency_s": e.latency_s}
    if len(text) <= EVENT_DETAILS_BYTES:
        event["details"] = orjson.loads(text)
    else:
        event["details"] = _brief_details(builtins(e.details))
        event["brief"] = True
    return event


def _brief_details(details: dict) -> dict:
    """A bulky entry's details with each long list or table given as its size, as JSON has them
    (keys as strings, anything else JSON does not know as its text: what the journal stores)."""
    def brief(value: Any) -> Any:
        if isinstance(value, (dict, list, tuple)) and len(value) > EVENT_ITEMS_SHOWN:
            return {"items": len(value)}
        if isinstance(value, dict):
            return {k if isinstance(k, str) else str(k): brief(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [brief(v) for v in value]
        if value is None or isinstance(value, (str, bool, int, float)):
            return value
        return str(value)
    out = {k: brief(v) for k, v in details.items() if k != "applied"}
    applied = details.get("applied")
    if isinstance(applied, dict):
        out["applied"] = {"switches": len(applied),
                          "added": sum(len(a.get("added", ())) for a in applied.values()),
                          "removed": sum(len(a.get("removed", ())) for a in applied.values()),
                          "seconds_max": max((a.get("seconds", 0.0) for a in applied.values()),
                                             default=0.0)}
    return out


def restart_orders(journal: Journal) -> dict[str, dict]:
    """Each job's last restart order, whole, from the journal: {job: {seq, rank_map, cause,
    t}}, seq counting the orders that job was given, t when it was given (Unix time). A
    restarted agent publishes exactly what its predecessor did, so a job that missed its order
    still finds it. (An order journaled without a job's name is the job admitted last before
    it.)"""
    orders: dict[str, dict] = {}
    admitted = ""
    for e in journal.entries(kinds=("decision", "restart")):
        if isinstance(e.details, Admit):
            admitted = e.details.name()
        elif isinstance(e.details, RestartOrder):
            name = e.details.job or admitted
            orders[name] = {"seq": orders.get(name, NO_ORDER)["seq"] + 1,
                            "rank_map": {str(r): g for r, g in
                                         sorted(e.details.rank_map.items())},
                            "cause": e.cause, "t": e.ts}
    return orders


def rack_rows(a: Agent) -> list[dict]:
    """Every GPU's row of the published rack: its switch, port, health, role, rank, job."""
    owner = {g: (j.name, r) for j in a.jobs.values() for r, g in j.rank_map.items()}
    out = []
    for g, atts in a.layout.gpus.items():
        job, rank = owner.get(g, (None, None))
        spare = g in a.layout.spares
        role = ("in_use_spare" if spare and rank is not None else
                "spare" if spare else "active")
        out.append({"name": g, "switch": atts[0].switch, "port": atts[0].tx,
                    "health": a.health(g), "role": role, "rank": rank,
                    "job": job})
    return out


def open_journal(rig: Rig, path: str, sync: str, replica: str | None, config: AgentConfig,
                 timeout: float, settle_heap: bool = False
                 ) -> tuple[Journal, Leadership | None, tuple[str, str], Warm | None]:
    """The agent's journal at `path` (a SQLite file, or etcd://...: a replica's of a group,
    with its part in the group's election and its work ahead while standing by, the heap
    settled after it with `settle_heap`), and the agent's endpoints."""
    if path.startswith("etcd://"):
        journal, leadership, endpoints = replica_journal(rig, path, replica, config)
        return journal, leadership, endpoints, Warm(
            rig, journal, rig.client_keys(), timeout, settle_heap) if config.work_ahead else None
    if replica is not None:
        raise AgentError("a replica of an agent group keeps its journal on etcd "
                         "(etcd://HOST:PORT/GROUP), not in a file")
    return SqliteJournal(path, sync), None, rig.agent_endpoints(), None


def started(journal: Journal, settle_heap: bool) -> None:
    """What follows an agent's start: a replica's copy of its journal is dropped (leading, it
    is the journal's only writer: it reads etcd, and no watch competes with its writes for the
    interpreter), and with `settle_heap` the heap is settled (`common.heap`)."""
    if isinstance(journal, EtcdJournal):
        journal.stop_following()
    if settle_heap:
        heap.settle("start-up")


class AgentProcess(NoEvents):
    """Everything `ptb agent` runs; `start()`, then `run(stop)`; `close()`. It hears the
    agent's restart orders and alarms (`on_order`, `on_alarm`) and publishes them."""

    def __init__(self, rig: Rig, journal_path: str, *, config: AgentConfig | None = None,
                 timeout: float = 5.0, journal_sync: str = "FULL", settle_heap: bool = False,
                 replica: str | None = None):
        """`config`: the agent's settings (the rig file's `[agent]` by default). `settle_heap`
        (the `ptb agent` process): the heap is settled (`common.heap`) once started (a job's
        circuits, worked out beside the agent, come as arrays: nothing to settle after an
        admission). `journal_path` etcd://HOST:PORT[,...]/GROUP: this process is `replica` of
        an agent group on etcd, leading once `campaign` is true (docs/control-plane.md)."""
        self.rig = rig = rig.seen_by(replica)      # (with [groups]: its group's part)
        self._settle_heap = settle_heap
        self.keys = rig.client_keys()
        self.timeout = timeout
        self.journal, self.leadership, self.endpoints, self.warm = open_journal(
            rig, journal_path, journal_sync, replica, config or rig.agent, timeout, settle_heap)
        # raises once a replica no longer leads: before every change sent to a device
        self._guard = self.leadership.check if self.leadership is not None else None
        self.clients: list[ServiceClient] = []
        self.switches: dict[str, BusSwitch] = {}
        # made by `start` (the agent needs the switches' answers first): reached through
        # `agent`, `server` and `sub`, which say so before then
        self._agent: Agent | None = None
        self._server: Server | None = None          # (None again once closed)
        self._sub: StateSubscriber | None = None
        self.config = config if config is not None else rig.agent
        self._health_seen: dict[str, str] = {}
        self.alarms: list[str] = []
        self._orders: dict[str, dict] = {}         # job -> its last restart order
        self._reports: dict[str, dict] = {}        # job -> what it last said of itself
        self._events: list[dict] = []
        self._fresh: collections.deque[dict] = collections.deque()  # written, not published
        # jobs to take on, their circuits worked out beside the agent (`Agent.take_on`)
        self._taking_on: collections.deque[Callable[[], None]] = collections.deque()
        self._noticed: dict[str, Circuits] = {}    # switch -> circuits published, this step
        # (what the rows show: each job's rank map and every GPU's health, copied; the rows)
        self._rack_cache: tuple[tuple[dict, dict], list[dict]] | None = None
        self._wired: dict[str, tuple[dict, dict[str, str]]] = {}   # job -> (rank map, wired)
        self._received: ReceivedPower | None = None     # light, from the GPU monitors
        self._published = 0.0
        self.term = 0                       # this agent's (from its journal, at `start`)
        # whose each job is, and the operator's manual changes (made by `start`)
        self._owners: JobOwners | None = None
        self._manual: ManualChanges | None = None
        self._links: LinkWatch | None = None      # circuits that fade or flap, moved

    @property
    def agent(self) -> Agent:
        """The agent core (once started)."""
        if self._agent is None:
            raise self._not_started()
        return self._agent

    @property
    def server(self) -> Server:
        """The agent's request server on the bus (from `start` to `close`)."""
        if self._server is None:
            raise self._not_started()
        return self._server

    @property
    def owners(self) -> JobOwners:
        """Whose each job is (once started)."""
        if self._owners is None:
            raise self._not_started()
        return self._owners

    @property
    def sub(self) -> StateSubscriber:
        """The subscriber to the GPU monitors' health (from `start` to `close`)."""
        if self._sub is None:
            raise self._not_started()
        return self._sub

    def _not_started(self) -> AgentError:
        return AgentError(f"the agent of rig {self.rig.name} is not started (start() it "
                          "first) or is closed")

    # --- set-up -----------------------------------------------------------------------------
    def _client(self, endpoint: str) -> ServiceClient:
        c = ServiceClient(endpoint, keys=self.keys, timeout=self.timeout, term=self.term,
                          guard=self._guard)
        self.clients.append(c)
        return c

    def leading(self) -> bool:
        return self.leadership is None or self.leadership.leading()

    def campaign(self, stop: threading.Event) -> bool:
        """A replica: a standby until it leads (true) or `stop`; a lone agent leads at once."""
        return self.leadership is None or \
            stand_by(self.rig, self.leadership, self.endpoints, stop, self.warm)

    def start(self) -> tuple[str, str]:
        # every change this agent sends a device carries its term (journaled with its start):
        # a replica's is its leadership's, from etcd, and every device is fenced with it first
        self.term = next_term(self.journal) if self.leadership is None else \
            take_lead(self.rig, self.leadership, self.keys, min(self.timeout, 1.0))
        endpoints = self.rig.endpoints()
        names = sorted({g.switch for g in self.rig.gpus})
        missing = [n for n in names if n not in endpoints]
        if missing:
            raise RigFileError(f"GPUs are cabled to {missing}, which the rig does not list")
        for n in names:
            try:
                self.switches[n] = BusSwitch(n, self._client(endpoints[n][0]))
            except BusError as e:
                raise AgentError(f"switch service {n} does not answer: {e}") from None
        layout = layout_from_rig(self.rig, {n: s.ports for n, s in self.switches.items()})
        monitors = self.rig.gpu_monitors()
        receivers: dict[str, dict[str, set[int]]] = {}      # switch -> monitor -> rx ports
        for g, atts in layout.gpus.items():
            for a in atts:
                receivers.setdefault(a.switch, {}).setdefault(
                    self.rig.monitor_of(g), set()).add(a.rx)
        self._received = ReceivedPower({name: self._client(eps[0]) for name, eps in
                                        monitors.items()}, receivers, self.switches,
                                       self.timeout)
        agent = self._agent = Agent(layout, self.switches, self.journal, self._received.read,
                                    config=self.config, events=self)
        owners = self._owners = JobOwners(agent)
        gray = GrayWatch(agent, lambda job, what: owners.job_of(self.server.caller, job, what))
        manual = self._manual = ManualChanges(self.rig, agent, self.keys, self.timeout,
                                              self.term, guard=self._guard)
        agent.take_on = self._taking_on.append      # on this loop: the switches' clients are its
        self._links = LinkWatch(agent, self._received.reading)
        self._orders = restart_orders(self.journal)
        self._events += [published_event(e) for e in self.journal.entries()[-EVENTS_KEPT:]]
        self.journal.listen(self._recorded)        # what is written from now on
        request, publish = self.endpoints
        server = self._server = Server(
            device_name(self.leadership), self._state(), kind="agent", keys=self.rig.server_keys(),
            request=self.rig.bind_endpoint(request), publish=self.rig.bind_endpoint(publish),
            heartbeat=self.rig.bus.heartbeat_s,
            handlers={"swap": self._swap, "describe": self._describe, "admit": self._admit,
                      "phase": self._phase, "job_failure": self._job_failure,
                      "rejoin": self._rejoin, "release": self._release,
                      "phase_done": self._phase_done, **gray.handlers(),
                      "job_report": self._job_report, "relay_ping": self._relay_ping,
                      "manual_circuits": lambda a: manual.circuits(self.server.caller, a),
                      "manual_heaters": lambda a: manual.heaters(self.server.caller, a),
                      "manual_laser": lambda a: manual.laser(self.server.caller, a)},
            settle=self._publish)
        bound = server.bind()
        # the GPU monitors' health, and every switch's circuits (changed behind the agent)
        self._sub = StateSubscriber({**monitors, **{n: endpoints[n] for n in self.switches}},
                                    keys=self.keys, on_state=self._on_state, telemetry=False)
        agent.start(self.term, self.warm.ahead if self.warm else None)   # (reconcile, finish)
        manual.restore(self.journal)    # the operator's parts, as journaled
        self._publish()
        started(self.journal, self._settle_heap)
        log.info("agent of rig %s on %s, publishing on %s", self.rig.name, *bound)
        return bound

    def close(self) -> None:
        if self.leadership is not None:
            self.leadership.resign()        # (a standby takes over at once)
        if self._manual is not None:
            self._manual.close()
        if self._agent is not None:
            self._agent.close()
        if self._sub is not None:
            self._sub.close()
            self._sub = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for c in self.clients:
            c.close()
        self.clients.clear()
        self.journal.close()

    # --- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.server.router, zmq.POLLIN)
        poller.register(self.sub.sub, zmq.POLLIN)
        while not stop.is_set() and self.leading():
            poller.poll(5 if self.server.answering else 50)     # (an admission's answer)
            try:
                self.step()
            except (NotLeading, JournalError) as e:
                step_down(self.leadership, e)       # (a lone agent's: raised again)
                return

    def in_loop(self, work: Callable[[], T]) -> Future[T]:
        """`work` run on the agent's loop (its next step), where the switches' clients and the
        agent's state are used: for a caller in the agent's process on another thread, and for
        a job whose circuits were worked out beside the agent."""
        done: Future[T] = Future()

        def run() -> None:
            try:
                done.set_result(work())
            except BaseException as e:
                done.set_exception(e)
        self._taking_on.append(run)
        return done

    def step(self) -> None:
        """Handle what waits (requests, health), then publish what changed: once no request
        waits (or every PUBLISH_EVERY_S), so a phase request is not queued behind a publication."""
        if self._received is not None:
            self._received.clear()          # received power is read afresh for each event
        while self._taking_on:
            self._taking_on.popleft()()
        if self._links is not None:
            self._links.tick()
        sub, server = self.sub, self.server
        sub.poll(0)
        if self._noticed:
            self._put_back()
        server.poll(0)
        if time.monotonic() - self._published < PUBLISH_EVERY_S and \
                (server.router.poll(0) or sub.sub.poll(0)):
            return
        self._publish()

    # --- inputs -----------------------------------------------------------------------------

    def _on_state(self, device: str, state: dict, ops: Any) -> None:
        if device not in self.switches:
            self._on_gpus(device, state)
        elif ops is None or "circuits" in touched(ops):     # (a snapshot, or the circuits)
            circuits = self.switches[device].published(state)
            if circuits is not None:
                self._noticed[device] = circuits

    def _put_back(self) -> None:
        """The switches whose publications said other circuits than the agent's, this step:
        what differs from what it intends put back, all at once (`Agent.on_switches`)."""
        found, self._noticed = self._noticed, {}
        try:
            self.agent.on_switches(found)
        except Exception as e:          # (the loop goes on: a person looks at the alarm)
            log.exception("putting back %s", ", ".join(found))
            self.on_alarm(f"switches {', '.join(found)} changed behind the agent and were not "
                          f"put back: {type(e).__name__}: {e}", Alarm())

    def _on_gpus(self, device: str, state: dict) -> None:
        changed = []
        mine = self.agent.layout.gpus           # (of its rack only: a group's own GPUs)
        for gpu, h in state.get("gpus", {}).items():
            if self._health_seen.get(gpu, "ok") != h.get("state") and gpu in mine:
                self._health_seen[gpu] = h.get("state")
                changed.append(h)
        if changed:
            try:
                self.agent.on_health(*changed)
            except (AgentError, SwitchError) as e:
                self.on_alarm(f"failover failed: {e}", Alarm())

    def _order(self, job: str) -> dict:
        return dict(self._orders.get(job, NO_ORDER))

    def _admit(self, args: schema.Admit) -> Future:
        """Answered once the job's circuits are worked out, beside the agent (its other
        requests are answered meanwhile: `Agent.admit_later`)."""
        rank_map = args.rank_map
        name = args.job or args.plan.get("name")
        if not isinstance(name, str) or not name:
            raise AgentError("admit needs a job plan: its 'name' (a string), or a job name")
        who = self.server.caller

        def approve(name: str) -> str | None:     # (asked again as the job is taken on)
            return self.owners.claim(who, name, "admit")
        owner = approve(name)
        admitted = self.agent.admit_later(args.plan, None if rank_map is None
                                          else {int(r): g for r, g in rank_map.items()},
                                          job=name, owner=owner, approve=approve)
        answer: Future = Future()

        def done(f: Future) -> None:     # on this loop, as the agent's state is read here
            if f.cancelled():
                answer.set_exception(AgentError("the agent is closing: the job was not admitted"))
                return
            try:
                name, got = f.result()
                if name in self.agent.jobs:          # (not released since it was taken on)
                    self._reports[name] = {"state": "admitted", "step": 0, "t": time.time()}
                answer.set_result({"job": name, "rank_map": {str(r): g for r, g in got.items()},
                                   "restart_seq": self._order(name)["seq"]})
            except Exception as e:
                answer.set_exception(e)
        admitted.add_done_callback(lambda f: self.in_loop(lambda: done(f)))
        return answer

    def _rejoin(self, args: schema.Rejoin) -> dict:
        """A running job tells a (re)started agent where it stands: its plan, the rank map it
        runs on, the last restart order it took, and whether it waits for one. The agent
        reconciles the job as it reconciles the switches: an order the job missed stands (it
        is in the published state, and in this answer); a job the journal does not know is
        taken on as it runs; a job waiting for an order with none to come is treated as a
        failure the job saw (the fabric checked, then a restart)."""
        agent = self.agent
        try:
            plan = JobPlan.from_dict(args.plan, max_world=len(self.agent.layout.gpus))
        except PlanError as e:
            raise AgentError(f"rejoin needs the job's plan: {e}") from None
        name = args.job or plan.name
        owner = self.owners.claim(self.server.caller, name, "rejoin")
        order = self._order(name)
        rank_map = {int(r): g for r, g in args.rank_map.items()}
        if args.restart_seq < order["seq"]:
            agent.journal.record(Note(job=name, rejoin=msgspec.to_builtins(args)),
                                 f"job {name} rejoined: it has not taken restart order "
                                 f"{order['seq']}")
            return {"job": name, "rank_map": order["rank_map"], "restart": order}
        known = agent.jobs.get(name)
        if known is None or known.plan.to_dict() != plan.to_dict() or \
                known.rank_map != rank_map:
            agent.journal.record(Note(job=name, rejoin=msgspec.to_builtins(args)),
                                 f"job {name} rejoined on a rank map the journal does not "
                                 "hold: taken on as it runs")
            if known is not None:
                owner = known.owner                # (its owner's rejoin: checked above)
            agent.admit(plan, rank_map, job=name, owner=owner)
        else:
            agent.journal.record(Note(job=name, state=args.state), f"job {name} rejoined")
        if args.state == "failed":
            agent.on_job_failure("job waiting for a restart order after an agent restart",
                                 job=name)
        return {"job": name, "rank_map": {str(r): g for r, g in agent.jobs[name].rank_map.items()},
                "restart": self._order(name)}

    def _phase(self, args: schema.PhaseArgs) -> Answer:
        """The reply is the grant; what follows the grant in the agent (its journal entry,
        prestaging) is done once the reply has gone (`Agent.after_grant`)."""
        phase, rnd = args.phase, args.round        # checked: a name, a round number
        job = self.owners.job_of(self.server.caller, args.job, "switch the phase of")
        granted: list[Callable[[], None]] = []
        before, self.agent.after_grant = self.agent.after_grant, granted.append
        try:
            self.agent.on_phase(phase, rnd, job=job)
        finally:
            self.agent.after_grant = before

        def after() -> None:
            for fn in granted:
                fn()
        return Answer({"granted": True, "phase": phase, "round": rnd}, after=after)

    def _relay_ping(self, args: schema.DeviceArgs) -> dict:
        """A `ping_device` to a switch's service, through the same client a phase switch
        uses: the bare process hops job -> agent -> service -> device and back."""
        sw = self.switches.get(args.device)
        if sw is None:
            raise AgentError(f"no switch {args.device!r}; the agent drives "
                             f"{', '.join(self.switches)}")
        return sw.client.call("ping_device")

    def _phase_done(self, args: schema.PhaseArgs) -> dict:
        job = self.owners.job_of(self.server.caller, args.job, "end the phase of")
        nxt = self.agent.on_phase_done(args.phase, args.round, job=job)
        if nxt is not None:
            self._publish()          # the job looks for `ready` before it asks
        return {"ready": list(nxt) if nxt else None}

    def _job_failure(self, args: schema.JobFailure) -> dict:
        job = self.owners.job_of(self.server.caller, args.job, "report a failure of")
        out = self.agent.on_job_failure(args.reason, args.gpus,
                                        [tuple(x) for x in args.links], job=job)
        return {"swapped": dict(out.swaps) if out is not None else {}}

    def _release(self, args: schema.JobArgs) -> dict:
        job = self.agent.job(self.owners.job_of(self.server.caller, args.job, "release"))
        freed = self.agent.release(job.name)
        self._reports.pop(job.name, None)
        return {"job": job.name, "released": sorted(freed.values())}

    def _job_report(self, args: schema.JobReport) -> dict:
        job = self.agent.job(self.owners.job_of(self.server.caller, args.job, "report on"))
        self._reports[job.name] = {"state": args.state, "step": args.step,
                                   "throughput": args.throughput, "loss": args.loss,
                                   "detail": args.detail, "t": time.time()}
        return {"job": job.name}

    def _swap(self, args: schema.GpuArgs) -> dict:
        out = self.agent.swap_out(args.gpu)
        if out is None:
            raise AgentError("no job admitted: nothing to swap")
        return {"swaps": dict(out.swaps), "rank_map": {str(r): g for r, g in
                                                       out.rank_map.items()},
                "latency_s": out.latency_s}

    def _describe(self, args: schema.Args) -> dict:
        a = self.agent
        return {"kind": "agent", "rig": self.rig.name, "term": self.term,
                "manual": {s: schema.circuits_to_wire(c) for s, c in
                           (self._manual.parts if self._manual else {}).items()},
                "layout": a.layout.to_dict(),
                "switches": {n: s.describe() for n, s in self.switches.items()},
                "journal": str(self.journal_path), "plan": a.plan.to_dict() if a.plan else None,
                "verify_dbm": a.config.verify_dbm, "quarantine_s": a.config.quarantine_s}

    @property
    def journal_path(self) -> str:
        return getattr(self.journal, "path", "")

    # --- outputs ----------------------------------------------------------------------------
    def on_order(self, job: str, rank_map: RankMap, cause: str) -> None:
        # the same order a restarted agent derives from the journal (`restart_orders`)
        self._orders[job] = {"seq": self._order(job)["seq"] + 1,
                             "rank_map": {str(r): g for r, g in sorted(rank_map.items())},
                             "cause": cause, "t": time.time()}
        self._publish()          # the job is waiting for this: send it now

    def on_alarm(self, text: str, about: Alarm) -> None:
        self.alarms.append(text)
        del self.alarms[:-50]

    def _rack(self) -> list[dict]:
        """Every GPU's row, rebuilt only when a job's ranks or a GPU's health changed (a phase
        switch changes neither; at 2,048 GPUs the rebuild was a fifth of the agent's work)."""
        a = self.agent
        got = self._rack_cache
        if got is not None:
            (ranks, health), rows = got
            if health == a.healths() and len(ranks) == len(a.jobs) and all(
                    ranks.get(name) == j.rank_map for name, j in a.jobs.items()):
                return rows           # (dicts compared in C; copied only when they change)
        rows = rack_rows(a)
        self._rack_cache = (({name: dict(j.rank_map) for name, j in a.jobs.items()},
                             dict(a.healths())), rows)
        return rows

    def _wire_ranks(self, job: str, rank_map: Mapping[int, str]) -> dict[str, str]:
        """A job's rank map as published (JSON keys are strings), made again only when it
        changed, and then a new object (the published state keeps it as it is): at 2,048
        GPUs, made twice at every publication, it was a tenth of the agent's work."""
        got = self._wired.get(job)
        if got is None or got[0] != rank_map:
            got = (dict(rank_map), {str(r): g for r, g in rank_map.items()})
            self._wired[job] = got
        return got[1]

    def _jobs(self) -> dict[str, dict]:
        out = {}
        for name in [n for n in self._wired if n not in self.agent.jobs]:
            del self._wired[name]
        for name, j in self.agent.jobs.items():
            out[name] = {"plan": j.plan.name, "world": len(j.rank_map),
                         "rank_map": self._wire_ranks(name, j.rank_map),
                         "phase": j.phase[0], "round": j.phase[1],
                         "ready": list(j.ready) if j.ready else None,
                         "restart": self._order(name),
                         "report": dict(self._reports.get(name) or {})}
        return out

    def _state(self, events: bool = True) -> dict:
        a = self.agent
        first = next(iter(a.jobs), None)
        state = {"role": "leader", "term": self.term, "rack": self._rack(), "etcd": dict(
                     self.leadership.members) if self.leadership is not None else None,
                 "rank_map": self._wire_ranks(first, a.rank_map) if first else {},
                 "phase": a.phase[0] if a.phase else None,
                 "round": a.phase[1] if a.phase else 0,
                 "alarms": list(self.alarms), "spares": a.spares(),
                 "restart": self._order(first) if first else dict(NO_ORDER),
                 "jobs": self._jobs()}
        if events:
            state["events"] = [dict(e) for e in self._events]
        return state

    def _recorded(self, e: Entry, text: str) -> None:
        """A journal entry as it is written: its published form, taken now (the details are
        the writer's own; a small entry exactly as the journal keeps it)."""
        self._fresh.append(published_event(e, text))

    def _publish(self) -> None:
        """New journal entries are appended to `events` (the oldest dropped past 200), the
        other keys sent when they differ: one delta."""
        self._published = time.monotonic()
        self.journal.flush()             # what is published is on disk (deferred entries too)
        written = len(self._fresh)
        ops: list[StateOp] = []
        for _ in range(written):
            ev = self._fresh.popleft()
            ops.append(Set(["events", len(self._events)], ev))
            self._events.append(ev)
            if len(self._events) > EVENTS_KEPT:
                ops.append(Delete(["events", 0]))
                self._events.pop(0)
        server = self._server
        if server is None:                  # (not started, or closed: nobody to tell)
            return
        state = self._state(events=False)
        old = server.state.state
        for k, v in state.items():
            was = old.get(k)
            if was == v:
                continue
            ops += _job_changes(was, v) if k == "jobs" and isinstance(was, dict) else \
                [Set([k], v)]
        if ops:
            server.change(ops)

