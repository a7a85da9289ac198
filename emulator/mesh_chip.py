"""A recirculating (square or hexagonal) mesh chip, emulated: light both ways, loops allowed.

Each cell (a tunable basic unit on a lattice edge) is the same 2 x 2 MZI as in `chip.py`, with the
same hidden truth (couplers, heater offsets, P_pi, crosstalk, loss, thermal lag). Its arms 0, 1 lie
at one end node and 2, 3 at the other; the topology's `joins` say which arm is joined by a
waveguide to which other arm (or to an edge port) at each node (docs/chip.md). Light entering
arms 0, 1 leaves by 2, 3 through the cell's matrix T; light entering 2, 3 leaves by 0, 1 through
T^T (a reciprocal device). The steady state is one linear solve: with x the fields leaving every
cell arm, x = T_all (J x + s), where J maps each arm's outgoing field onto the arm it is joined
to and s is the light injected from the ports: (I - T_all J) x = T_all s.

Ports 1..P are not split into inputs and outputs: `transfer({port: mW})` gives the mW leaving
every port 1..P (after its 1 % monitor tap), the injecting port included (light can come back).
On a rig's optical bench the input selector lights port k and power meter port m reads the tap
of port m (`bench_optics.OpticalBench.meter_output`).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from scipy import sparse
from scipy.sparse import linalg as splinalg

from photonic_testbed.emulator.chip import (
    DARK_CURRENT_UA,
    MONITOR_TAP,
    OUTPUT_TAP,
    RESPONSIVITY_A_PER_W,
    ChipError,
    EmulatedChip,
)


class RecirculatingChip(EmulatedChip):
    """A square or hexagonal mesh of MZI cells with seeded imperfections."""

    def _build_graph(self, d: Mapping) -> None:
        try:
            kind, n, cells, joins = d["kind"], int(d["ports"]), d["cells"], d["joins"]
        except (KeyError, TypeError, ValueError) as e:
            raise ChipError(f"not a recirculating-mesh description (missing {e})") from None
        if kind not in ("square", "hexagonal"):
            raise ChipError(f"a recirculating mesh is square or hexagonal, not {kind!r}")
        self.kind, self.ports = kind, n
        index = self._read_cells(cells, max_heaters=1)
        c = len(cells)

        def arm(end) -> int:       # 4 k + arm, or -p for port p
            end = list(end)
            if end[:1] == ["port"] and len(end) == 2 and 1 <= int(end[1]) <= n:
                return -int(end[1])
            if end[:1] == ["cell"] and len(end) == 3 and end[1] in index and \
                    int(end[2]) in (0, 1, 2, 3):
                return 4 * index[end[1]] + int(end[2])
            raise ChipError(f"a join names {end}: not a port 1..{n} or a cell arm")

        rows, cols = [], []
        port_arm = np.full(n, -1)
        used = set()
        for pair in joins:
            a, b = (arm(e) for e in pair)
            for x in (a, b):
                if x in used:
                    raise ChipError(f"an arm or port is joined twice ({pair})")
                used.add(x)
            if a < 0 and b < 0:
                raise ChipError(f"a waveguide joins two ports ({pair})")
            if a >= 0 and b >= 0:
                rows += [a, b]
                cols += [b, a]
            else:
                p, x = (-a, b) if a < 0 else (-b, a)
                port_arm[p - 1] = x
        if (port_arm < 0).any():
            raise ChipError(f"ports {(np.flatnonzero(port_arm < 0) + 1).tolist()} are joined "
                            "to no cell")
        # J: field leaving arm b arrives (entering) at arm a.
        self._join = sparse.csr_array((np.ones(len(rows)), (rows, cols)), shape=(4 * c, 4 * c))
        self._port_arm = port_arm
        self._free_arms = np.array(sorted(set(range(4 * c)) - used), dtype=int)

    def _scatter(self) -> sparse.csr_array:
        """T_all: field entering each arm -> fields leaving the cell's other end."""
        t = self.cell_matrices()                          # (cells, out 2, in 2)
        c = len(self.cell_ids)
        k = np.repeat(np.arange(c), 4)
        o = np.tile([0, 0, 1, 1], c)
        i = np.tile([0, 1, 0, 1], c)
        vals = t[k, o, i]
        # forward: arm i (0, 1) -> arm 2 + o; backward (T^T): arm 2 + i -> arm o, value t[i, o]
        rows = np.concatenate([4 * k + 2 + o, 4 * k + o])
        cols = np.concatenate([4 * k + i, 4 * k + 2 + i])
        return sparse.csr_array((np.concatenate([vals, vals]), (rows, cols)),
                                shape=(4 * c, 4 * c))

    def _compute_fields(self, faded: Mapping[int, float]) -> np.ndarray:
        """Fields leaving every cell arm for a unit field at each port: (4 cells, ports); the
        base class's `_propagate` keeps them while nothing changes. (No waveguide of a
        recirculating mesh fades: `fade` refuses it, so `faded` is empty.)"""
        t = self._scatter()
        m = (sparse.identity(t.shape[0], format="csc") - (t @ self._join)).tocsc()
        s = np.zeros((t.shape[0], self.ports), dtype=complex)
        s[self._port_arm, np.arange(self.ports)] = 1.0
        rhs = (t @ s)
        x = splinalg.spsolve(m, rhs)
        return np.asarray(x).reshape(t.shape[0], self.ports)

    def fields(self) -> np.ndarray:
        """Coherent scattering matrix (port out x port in) up to the monitor taps."""
        return self._propagate()[self._port_arm]

    def transfer(self, inputs_mw: Mapping[int, float]) -> dict[int, float]:
        """mW leaving each port 1..P (after its 1 % tap) for mW injected at ports 1..P."""
        p = self._check_inputs(inputs_mw)
        power = np.abs(self.fields()) ** 2 @ p * (1.0 - OUTPUT_TAP)
        return {1 + q: float(x) for q, x in enumerate(power)}

    def free_end_mw(self, inputs_mw: Mapping[int, float]) -> float:
        """mW leaving the mesh by free (terminated) waveguide ends at its boundary nodes."""
        p = self._check_inputs(inputs_mw)
        f = self._propagate()[self._free_arms]
        return float((np.abs(f) ** 2 @ p).sum())

    def _check_output(self, port: int) -> int:
        if not 1 <= int(port) <= self.ports:
            raise ChipError(f"ports are 1..{self.ports}, not {port}")
        return int(port)

    def monitor_currents_ua(self) -> dict[str, float]:
        """Each cell's monitor photodiode: a 1 % tap on its bottom waveguide (arm 3 side),
        hearing the light leaving the cell by arm 3, uA."""
        if not self.monitors:
            raise ChipError("this chip has no cell monitor photodiodes")
        f = self._propagate()
        bottom = np.abs(f[4 * np.arange(len(self.cell_ids)) + 3]) ** 2 @ self._inputs
        tapped = bottom / (1.0 - MONITOR_TAP) * MONITOR_TAP
        return {cid: self._noisy(float(mw)) * RESPONSIVITY_A_PER_W * 1000.0 + DARK_CURRENT_UA
                for cid, mw in zip(self.cell_ids, tapped, strict=True)}


def make_chip(topology: Mapping, **kwargs) -> EmulatedChip:
    """The emulated chip for a topology description: feed-forward or recirculating."""
    if topology.get("kind") in ("square", "hexagonal"):
        return RecirculatingChip(topology, **kwargs)
    return EmulatedChip(topology, **kwargs)
