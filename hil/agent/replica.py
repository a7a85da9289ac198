"""An agent replica of a group on an etcd journal, while it does not lead (`Standby`), and what
it does first when it takes the lead (`fence_devices`).

A replica, standing by or leading, is device `agent@NAME` on the bus. A standby binds the agent's
endpoints of its replica ([replicas.NAME] in the rig file): every
agent operation is answered `NotLeader` naming the replica that leads (clients try the rig's
other replicas, `hil.job.fabric_client`), and its published state says `role: standby` and who
leads. It is served from a thread of its own while the replica campaigns (`Leadership`).

A new leader raises every device service's term to its own (`fence`) before it reads or moves
anything: from then on a change of an earlier leader (one paused or cut off, resuming with a
switch move it had journaled) is refused by the device itself (`StaleTerm`).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from photonic_testbed.hil.agent.agent import AgentError
from photonic_testbed.hil.agent.config import AgentConfig
from photonic_testbed.hil.agent.etcd_journal import EtcdJournal, parse_url
from photonic_testbed.hil.agent.leadership import Leadership
from photonic_testbed.hil.agent.warm import Warm
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import BusError, ServiceClient
from photonic_testbed.hil.bus.errors import NotLeader
from photonic_testbed.hil.bus.security import ClientKeys
from photonic_testbed.hil.bus.server import Server
from photonic_testbed.hil.bus.state import Set
from photonic_testbed.hil.etcd.client import Etcd
from photonic_testbed.hil.rig import Rig

log = logging.getLogger(__name__)

# what an agent answers (its server's handlers in hil.agent.bus)
AGENT_OPS = ("swap", "admit", "phase", "job_failure", "rejoin", "release", "phase_done",
             "job_report", "relay_ping", "manual_circuits", "manual_heaters", "manual_laser",
             "job_timings", "handover")


def device_name(leadership: Leadership | None) -> str:
    """The agent's device name on the bus: `agent`, or a replica's `agent@NAME` (each replica
    publishes under its own name, so that a subscriber to several tells them apart)."""
    return "agent" if leadership is None else f"agent@{leadership.me['name']}"


def leader_words(leader: Mapping[str, Any] | None) -> str:
    if not leader:
        return "no replica leads now (an election is under way, or etcd has no quorum)"
    return (f"replica {leader.get('name')!r} leads (term {leader.get('term')}, requests "
            f"{leader.get('request')})")


class Standby:
    """The agent's endpoints of replica `name` while it does not lead (see the module)."""

    def __init__(self, rig: Rig, name: str, group: str, endpoints: tuple[str, str]):
        self.name = name
        self.group = group
        self._leader: Mapping[str, Any] | None = None
        self._changed = threading.Event()
        self._stop = threading.Event()
        request, publish = endpoints
        self.server = Server(
            f"agent@{name}", {"role": "standby", "replica": name, "group": group,
                              "leader": None},
            kind="agent", request=rig.bind_endpoint(request),
            publish=rig.bind_endpoint(publish), heartbeat=rig.bus.heartbeat_s,
            keys=rig.server_keys(), describe=self._describe,
            handlers={op: self._refuse for op in AGENT_OPS})
        self.bound = self.server.bind()
        self._thread = threading.Thread(target=self._serve, name=f"standby-{name}",
                                        daemon=True)
        self._thread.start()

    def _refuse(self, args: schema.Args) -> Any:
        raise NotLeader(f"agent replica {self.name!r} of group {self.group} is a standby: "
                        f"{leader_words(self._leader)}")

    def _describe(self) -> dict:
        return {"kind": "agent", "role": "standby", "replica": self.name, "group": self.group,
                "leader": dict(self._leader) if self._leader else None}

    def leader_is(self, leader: Mapping[str, Any] | None) -> None:
        """Who leads now (from the campaigning thread): published by the serving thread."""
        self._leader = dict(leader) if leader else None
        self._changed.set()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.server.poll(0.05)
            if self._changed.is_set():
                self._changed.clear()
                self.server.change([Set(["leader"], self._leader)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()


def stand_by(rig: Rig, leadership: Leadership, endpoints: tuple[str, str],
             stop: threading.Event, warm: Warm | None = None) -> bool:
    """Replica `leadership.me` as a standby on its `endpoints` (`Standby`) until it leads
    (true) or `stop` (false), working ahead meanwhile (`warm`, hil.agent.warm)."""
    name = str(leadership.me["name"])
    standby = Standby(rig, name, leadership.group, endpoints)
    if warm is not None:
        warm.start()
    try:
        log.info("agent replica %s of group %s: standing by on %s", name, leadership.group,
                 standby.bound[0])
        won = leadership.campaign(stop, on_standby=standby.leader_is) > 0
    finally:
        standby.close()
        if warm is not None:
            warm.close()
    if won and stop.is_set():           # stopped as it won: lead nothing
        leadership.resign()
        return False
    return won


def step_down(leadership: Leadership | None, why: BaseException) -> None:
    """A leader whose journal cannot be written (etcd unreachable, a write whose outcome is
    unknown) or that no longer leads: it acts no more; another replica, or this one again,
    leads from what etcd holds. A lone agent's (no `leadership`) failure is raised again."""
    if leadership is None:
        raise why
    leadership.lose(str(why))
    log.error("%s", why)


def take_lead(rig: Rig, leadership: Leadership, keys: ClientKeys | None,
              timeout: float) -> int:
    """What a replica that has just won its election does first: every device fenced with its
    term (NotLeading if it no longer leads). Its term. A device that has taken a term as high
    (an agent's before this group kept its journal on etcd, or a group whose etcd was wiped)
    would refuse every change of this leader: the group's term counter is raised past it and
    this replica steps down to campaign again (NotLeading saying so)."""
    leadership.check()
    fenced = fence_devices(rig, leadership.term, keys, timeout)
    above = {name: term for name, (_, term) in fenced.items() if term >= leadership.term}
    if above:
        top = max(above.values())
        leadership.raise_term(top)
        leadership.lose(f"devices have taken agent terms up to {top} "
                        f"({', '.join(sorted(above))}), not below its term "
                        f"{leadership.term}: the group's term counter is raised past them")
        leadership.resign()
        leadership.check()          # (NotLeading, saying why)
    return leadership.term


def fence_devices(rig: Rig, term: int, keys: ClientKeys | None, timeout: float
                  ) -> dict[str, tuple[str, int]]:
    """Every device service's term raised to `term` (`fence`); per device, "ok" or why not (a
    device that does not answer is fenced by the first change it gets), and the term it had
    taken before (0: unknown)."""
    def fence(name: str, request: str) -> tuple[str, int]:
        client = ServiceClient(request, keys=keys, timeout=timeout, term=term)
        had = 0
        try:
            had = int(client.call("ping").get("term") or 0)
            if had < term:
                client.call("fence")
            return "ok", had
        except BusError as e:
            log.warning("term %d: device %s not fenced: %s", term, name, e)
            return f"{type(e).__name__}: {e}", had
        finally:
            client.close()
    devices = rig.endpoints()
    with ThreadPoolExecutor(min(16, max(1, len(devices))),
                            thread_name_prefix="fence") as pool:
        done = {name: pool.submit(fence, name, eps[0]) for name, eps in devices.items()}
        return {name: f.result() for name, f in done.items()}


def replica_journal(rig: Rig, url: str, replica: str | None, config: AgentConfig
                    ) -> tuple[EtcdJournal, Leadership, tuple[str, str]]:
    """The journal on etcd of `url` (etcd://HOST:PORT[,...]/GROUP), replica `replica`'s part
    in its group's election, and its endpoints (the rig's [replicas.NAME]; AgentError naming
    what is wrong)."""
    try:
        members, group = parse_url(url)
        etcd = Etcd(members, timeout=config.etcd_timeout_s)
    except ValueError as e:
        raise AgentError(str(e)) from None
    if rig.group and group != rig.group:
        raise AgentError(f"{url} is the journal of agent group {group!r}, but this replica "
                         f"is of group {rig.group!r}: each group keeps its own journal (give "
                         f"etcd://.../{rig.group})")
    replicas = rig.agent_replicas()
    name = replica if replica is not None else next(iter(replicas))
    if name not in replicas:
        raise AgentError(f"rig {rig.name} has no agent replica {name!r} (its [replicas]: "
                         f"{', '.join(replicas)})")
    request, publish = replicas[name]
    try:
        leadership = Leadership(etcd, group, {"name": name, "request": request,
                                              "publish": publish}, ttl_s=config.lease_s)
    except ValueError as e:
        raise AgentError(f"{url}: {e}") from None
    return EtcdJournal(etcd, leadership, follow=True), leadership, (request, publish)
