"""Who may act on what through the agent on the bus: the agent's term, whose each job is, and an
operator's manual changes (for `hil.agent.bus.AgentProcess`).

- The term: one more than the highest of the journal's start entries (`next_term`); every
  change the agent sends a device carries it, and a device refuses a lower one than it has
  taken (`StaleTerm`), so an agent that no longer leads cannot move it.
- A job's name belongs to the key that admitted it, journaled in its `Admit` (`JobOwners`). A
  tenant's key acts only on the jobs its certificate names and its key admitted: anything else
  is `Unauthorized` before anything moves. An operator (and, on a bus without CURVE, any local
  process) acts on every job. A job journaled without an owner (admitted on a bus without
  CURVE, or by an agent before owners) is no tenant's: an operator acts on it, or releases it
  for its tenant to admit again (a first key to come cannot claim it).
- An operator's manual change is journaled (a `Manual` decision) before the agent makes it
  (`ManualChanges`): a switch's circuits are the operator's own part of it (`MANUAL`), written
  with the jobs' parts and kept across the agent's reconciliation and restarts, on ports no
  job uses; heater volts and laser settings are sent to the device's service with the agent's
  term, from a thread of their own so that the agent's loop never waits for a device.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from photonic_testbed.drivers.circuit_switch import (
    CircuitConflict,
    Circuits,
    CircuitSwitch,
    check_circuits,
)
from photonic_testbed.hil.agent.agent import Agent, AgentError
from photonic_testbed.hil.agent.entries import Admit, Manual, Start
from photonic_testbed.hil.agent.journal import Journal
from photonic_testbed.hil.bus import schema
from photonic_testbed.hil.bus.client import ServiceClient, Unauthorized
from photonic_testbed.hil.bus.security import ClientKeys, Identity
from photonic_testbed.hil.rig import Rig

MANUAL = "(operator)"       # the operator's part of a switch, beside the jobs' (no job's name)
HEATER_KINDS = ("chip", "heater_dac")


def next_term(journal: Journal) -> int:
    """The term of an agent starting on this journal: one more than the highest its start
    entries hold (1 for a journal without one)."""
    return 1 + max((e.details.term or 0 for e in journal.entries(kinds=("start",))
                    if isinstance(e.details, Start)), default=0)


def job_owners(journal: Journal) -> dict[str, str | None]:
    """Each job's owner as its last admission journaled it: the key that admitted it (None:
    no one's)."""
    return {e.details.name(): e.details.owner for e in journal.entries(kinds=("decision",))
            if isinstance(e.details, Admit)}


def manual_parts(journal: Journal) -> dict[str, Circuits]:
    """The operator's part of each switch, as the last manual change of it journaled it."""
    return {e.details.device: dict(e.details.circuits)
            for e in journal.entries(kinds=("decision",))
            if isinstance(e.details, Manual) and e.details.circuits is not None}


def _listed(who: Identity, job: str, what: str) -> None:
    if job not in who.jobs:
        raise Unauthorized(f"{who} may not {what} job {job!r}: its key names "
                           f"{', '.join(sorted(who.jobs)) or 'no job'}")


class JobOwners:
    """The checks of a caller acting on a job, by whose it is (`Job.owner`: the key that
    admitted it, journaled with its admission)."""

    def __init__(self, agent: Agent):
        self.agent = agent

    def job_of(self, who: Identity, job: str | None, what: str) -> str | None:
        """The job a request acts on, once `who` may act on it: a tenant on a job its key
        names and admitted (Unauthorized otherwise); an operator (or a trusted local process)
        on any. None: not worked out (an operator's request that leaves it to the agent)."""
        if who.role != schema.TENANT:
            return job
        if job is not None:
            _listed(who, job, what)
        name = self.agent.job(job).name      # (the only job when left out)
        _listed(who, name, what)
        self._owned(who, name, what)
        return name

    def _owned(self, who: Identity, job: str, what: str) -> None:
        """A tenant acts on an admitted job only if its key admitted it."""
        if job not in self.agent.jobs:
            return
        owner = self.agent.jobs[job].owner
        if owner == who.name:
            return
        whose = (f"the job of key {owner!r}" if owner is not None else
                 "no key's job on record (admitted without CURVE, or before owners were "
                 "journaled): an operator may act on it, or release it for its tenant to "
                 "admit again")
        raise Unauthorized(f"{who} may not {what} job {job!r}: it is {whose}")

    def claim(self, who: Identity, job: str, what: str) -> str | None:
        """Whose `job` is once `who` admits it (None: no one's, a trusted local process's);
        Unauthorized for a tenant taking a name its key does not list or another key's job;
        AgentError for the name the agent keeps for the operator's circuits."""
        if job == MANUAL:
            raise AgentError(f"{job!r} names the operator's manual circuits: choose another "
                             "job name")
        if who.role == schema.TENANT:
            _listed(who, job, what)
            self._owned(who, job, what)
        return who.name if who.role is not None else None


class ManualChanges:
    """An operator's manual changes: journaled, then made by the agent (the module's doc)."""

    def __init__(self, rig: Rig, agent: Agent, keys: ClientKeys | None, timeout: float,
                 term: int, guard: Callable[[], object] | None = None):
        self.rig = rig
        self.agent = agent
        self.keys = keys
        self.timeout = timeout
        self.term = term
        self.guard = guard          # raises once the agent no longer leads (its clients')
        self.parts: dict[str, Circuits] = {}           # switch -> the operator's part of it
        # heater and laser changes are sent from a thread of their own (each device's client
        # used there only), so that the loop does not wait for a device
        self._relay: ThreadPoolExecutor | None = None
        self._clients: dict[str, ServiceClient] = {}

    def restore(self, journal: Journal) -> None:
        """The operator's parts as journaled, held again beside the jobs' (after the agent's
        start: the switches hold them, reconciled with the journal's intended circuits)."""
        self.parts = {s: c for s, c in manual_parts(journal).items()
                      if s in self.agent.switches}
        for switch, part in self.parts.items():
            self.agent.writer.hold(MANUAL, {switch: part})

    def circuits(self, who: Identity, args: schema.ManualCircuits) -> dict:
        """The operator's part of a switch changed (`connect`, `disconnect`), journaled, then
        written with the jobs' parts; refused before anything moves when it touches a port a
        job's circuit uses or a GPU a job holds (a swap or a release does that), or when it
        cannot be made (a port the switch does not have, an output named twice)."""
        name = args.switch
        sw: CircuitSwitch | None = self.agent.switches.get(name)
        if sw is None:
            raise AgentError(f"no switch {name!r}; the agent drives "
                             f"{', '.join(self.agent.switches)}")
        old = self.parts.get(name, {})
        part = dict(old)
        for a in args.disconnect:
            part.pop(a, None)
        part.update((a, b) for a, b in args.connect)
        try:
            part = check_circuits(part, sw.ports)
        except CircuitConflict as e:
            raise AgentError(f"manual circuits on {name}: {e}") from None
        self._refuse_jobs_ports(name, old, args)
        cause = f"manual circuits on {name} ({who})"
        self.agent.journal.record(Manual(device=name, by=who.name or None,
                                         circuits=sorted(part.items())), cause)
        self.agent.writer.apply(MANUAL, {name: part}, cause)
        self.parts[name] = part
        return {"switch": name, "circuits": schema.circuits_to_wire(part)}

    def _refuse_jobs_ports(self, switch: str, old: Circuits,
                           args: schema.ManualCircuits) -> None:
        """AgentError naming the job when a manual circuit (or a disconnected input) is a port
        of a GPU a job holds, or one a circuit outside the operator's part uses."""
        a = self.agent
        held: dict[int, str] = {}
        for job in a.jobs.values():
            for gpu in job.rank_map.values():
                for att in a.layout.gpus.get(gpu, ()):
                    if att.switch == switch:
                        held[att.tx] = held[att.rx] = f"{gpu}'s, which job {job.name} holds"
        for i, o in a.writer.current(switch).items():
            if old.get(i) != o:
                held.setdefault(i, f"in circuit {i} -> {o}, not the operator's")
                held.setdefault(o, f"in circuit {i} -> {o}, not the operator's")
        # (a disconnected input of the operator's own circuit is always let go)
        asked = [p for i, o in args.connect for p in (i, o)] + \
            [i for i in args.disconnect if i not in old]
        for port in asked:
            if port in held:
                raise AgentError(f"manual circuits on {switch}: port {port} is {held[port]}; "
                                 "swap or release the job first")

    def heaters(self, who: Identity, args: schema.ManualHeaters) -> Future:
        device = self._device(args.device, HEATER_KINDS, "heaters")
        self.agent.journal.record(Manual(device=device, by=who.name or None, first=args.first,
                                         volts=list(args.volts)),
                                  f"manual heaters on {device} ({who})")
        return self._send(device, "set_heaters", {"volts": list(args.volts),
                                                  "first": args.first}, args.version)

    def laser(self, who: Identity, args: schema.ManualLaser) -> Future:
        device = self._device(args.device, ("laser",), "a laser")
        settings = {k: v for k, v in (("on", args.on), ("power_mw", args.power_mw),
                                      ("wavelength_nm", args.wavelength_nm)) if v is not None}
        self.agent.journal.record(Manual(device=device, by=who.name or None, laser=settings),
                                  f"manual laser settings of {device} ({who})")
        return self._send(device, "set_laser", settings, None)

    def _device(self, name: str, kinds: tuple[str, ...], what: str) -> str:
        d = self.rig.devices.get(name)
        if d is None or d.kind not in kinds:
            has = [n for n, x in self.rig.devices.items() if x.kind in kinds]
            raise AgentError(f"{name!r} is not a device with {what} in rig {self.rig.name} "
                             f"({', '.join(has) or 'none has'})")
        return name

    def _send(self, device: str, op: str, args: dict, expect: str | None) -> Future:
        """`op` sent to the device's service with the agent's term, from the relay thread;
        the Future of its result (the device's own error comes back as it is)."""
        if self._relay is None:
            self._relay = ThreadPoolExecutor(1, thread_name_prefix="agent-manual")

        def call() -> Any:
            client = self._clients.get(device)
            if client is None:
                client = self._clients[device] = ServiceClient(
                    self.rig.endpoints()[device][0], keys=self.keys, timeout=self.timeout,
                    term=self.term, guard=self.guard)
            return client.call(op, expect=expect, **args)
        return self._relay.submit(call)

    def close(self) -> None:
        if self._relay is None:
            return
        self._relay.submit(self._close_clients)
        self._relay.shutdown(wait=True)
        self._relay = None

    def _close_clients(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
