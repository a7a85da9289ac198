"""The host agent: reconfigures optical circuits when GPUs fail or the job changes phase.

`policies` holds the pure decisions (which circuits, which spare); `agent` applies them to
`CircuitSwitch` objects, verifies them by light, and journals every step, through its parts:
`pool` (the GPUs), `writer` (the switches), `diagnosis` (light and blame), `failover` (the swap)
and `recovery` (the journal read back); `config` holds its settings and `events` what it tells
the outside. `journal` says what a journal is, `entries` its entries' types, `sqlite_journal`
keeps one in SQLite; `bus` and `bus_switch` put the agent on the bus.
"""
from photonic_testbed.hil.agent.agent import Agent, AgentError, SwapOutcome

__all__ = ["Agent", "AgentError", "SwapOutcome"]
