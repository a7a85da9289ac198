"""Manual control: connect / disconnect ports, set a heater, swap a GPU for a spare.

Each command is shown in a confirmation dialog that says what will change (read from the
model: which circuit goes, which rank moves) before it is sent; answers, refusals with their
reason included, are listed under the forms and in the status bar. On a rig with an agent the
commands go to the agent, which journals each manual change and keeps a switch's manual
circuits beside the jobs' (a port a job uses is refused: swap or release it first).
"""
from __future__ import annotations

import time

from PySide6.QtCore import Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from photonic_testbed.gui.commands import Command, CommandResult, CommandRunner
from photonic_testbed.gui.model import FabricModel


def describe_change(c: Command, model: FabricModel) -> str:
    """What `c` will change, in the operator's words, from what the GUI knows now."""
    p = c.params
    if c.action in ("connect", "disconnect"):
        sw = model.switches.get(p["switch"])
        circuits = sw.circuits if sw else {}
        a = int(p["input"])
        old = circuits.get(a)
        if c.action == "disconnect":
            if old is None:
                return f"{p['switch']}: disconnect input {a} (it has no circuit now)."
            return f"{p['switch']}: disconnect input {a} from output {old}."
        b = int(p["output"])
        lines = [f"{p['switch']}: connect input {a} to output {b}."]
        if old == b:
            lines.append("This circuit is already set; nothing will change.")
        elif old is not None:
            lines.append(f"Input {a} now goes to output {old}: that circuit will be removed.")
        holder = next((x for x, y in circuits.items() if y == b and x != a), None)
        if holder is not None:
            lines.append(f"Output {b} now hears input {holder}.")
        gpus = [g.name for g in model.rack.values() if g.switch == p["switch"] and
                g.port in (a, b - (sw.ports if sw else 0))]
        if gpus:
            lines.append("GPUs on these ports: " + ", ".join(gpus) + ".")
        return "\n".join(lines)
    if c.action == "set_heater":
        chip, ch = p["switch"], int(p["channel"])
        topo = model.topologies.get(chip)
        cell = next((x.id for x in topo.cells if ch in x.channels), None) if topo else None
        where = f" (cell {cell}, now {model.cells.get(chip, {}).get(cell, {}).get('state', '?')})" \
            if cell else ""
        return (f"{chip}: set heater channel {ch}{where} to {float(p['volts']):.3f} V.\n"
                "The circuits through this cell may change.")
    gpu = model.rack.get(p["gpu"])
    spare = p.get("spare")
    if gpu is None:
        return f"Swap GPU {p['gpu']} (not in the rack as the GUI knows it)."
    target = f"spare {spare}" if spare else "a spare chosen by the agent"
    rank = "no rank" if gpu.rank is None else f"rank {gpu.rank}"
    return (f"Swap GPU {gpu.name} ({rank}, port {gpu.port} on {gpu.switch}) for {target}.\n"
            f"Its circuits move to the spare's port and the job's {rank} moves with them.")


class ManualControl(QWidget):
    """Forms for the three kinds of command, each behind a confirmation."""

    answered = Signal(object)            # CommandResult, after it is listed

    def __init__(self, model: FabricModel, runner: CommandRunner, parent: QWidget | None = None):
        super().__init__(parent)
        self.model, self.runner = model, runner
        runner.finished.connect(self._answer)

        ports = QGroupBox("Circuits")
        f = QFormLayout(ports)
        self.switch = QComboBox()
        self.input = QSpinBox()
        self.output = QSpinBox()
        for s in (self.input, self.output):
            s.setRange(1, 4096)
        self.connect_button = QPushButton("Connect…")
        self.disconnect_button = QPushButton("Disconnect…")
        self.connect_button.clicked.connect(self.ask_connect)
        self.disconnect_button.clicked.connect(self.ask_disconnect)
        row = QHBoxLayout()
        row.addWidget(self.connect_button)
        row.addWidget(self.disconnect_button)
        f.addRow("switch", self.switch)
        f.addRow("input", self.input)
        f.addRow("output", self.output)
        f.addRow(row)

        heater = QGroupBox("Heater")
        h = QFormLayout(heater)
        self.chip = QComboBox()
        self.channel = QSpinBox()
        self.channel.setRange(0, 4095)
        self.volts = QDoubleSpinBox()
        self.volts.setRange(0.0, 30.0)
        self.volts.setDecimals(3)
        self.volts.setSuffix(" V")
        self.heater_button = QPushButton("Set heater…")
        self.heater_button.clicked.connect(self.ask_heater)
        h.addRow("chip", self.chip)
        h.addRow("channel", self.channel)
        h.addRow("voltage", self.volts)
        h.addRow(self.heater_button)

        swap = QGroupBox("Swap")
        form = QFormLayout(swap)
        self.gpu = QComboBox()
        self.spare = QComboBox()
        self.swap_button = QPushButton("Swap…")
        self.swap_button.clicked.connect(self.ask_swap)
        form.addRow("GPU", self.gpu)
        form.addRow("spare", self.spare)
        form.addRow(self.swap_button)

        self.log = QListWidget()
        self.forms = {"circuits": ports, "heater": heater, "swap": swap}
        forms = QHBoxLayout()
        for g in (ports, heater, swap):
            forms.addWidget(g)
        layout = QVBoxLayout(self)
        layout.addLayout(forms)
        layout.addWidget(self.log, 1)
        model.switchesChanged.connect(self._switches)
        model.rackChanged.connect(self._rack)
        self.switch.currentTextChanged.connect(self._ranges)
        self._switches()
        self._rack()

    def show_forms(self, *, heater: bool = True, swap: bool = True) -> None:
        """Hide the forms of what the rig does not have (heaters, a rack to swap in)."""
        self.forms["heater"].setVisible(heater)
        self.forms["swap"].setVisible(swap)

    # --- keeping the choices current ---------------------------------------------------
    def _switches(self) -> None:
        for box, names in ((self.switch, list(self.model.switches)),
                           (self.chip, self.model.chips())):
            keep = box.currentText()
            box.blockSignals(True)
            box.clear()
            box.addItems(names)
            if keep in names:
                box.setCurrentText(keep)
            box.blockSignals(False)
        self._ranges()

    def _ranges(self) -> None:
        sw = self.model.switches.get(self.switch.currentText())
        if sw:
            self.input.setRange(1, sw.ports)
            self.output.setRange(sw.ports + 1, 2 * sw.ports)

    def _rack(self, changed=None) -> None:
        keep_gpu, keep_spare = self.gpu.currentText(), self.spare.currentText()
        holders = sorted(g.name for g in self.model.rack.values() if g.role != "spare")
        spares = ["(agent picks)"] + sorted(g.name for g in self.model.spares())
        for box, names, keep in ((self.gpu, holders, keep_gpu), (self.spare, spares, keep_spare)):
            box.clear()
            box.addItems(names)
            if keep in names:
                box.setCurrentText(keep)

    # --- asking -------------------------------------------------------------------------
    def ask_connect(self) -> bool:
        return self.ask(Command("connect", {"switch": self.switch.currentText(),
                                            "input": self.input.value(),
                                            "output": self.output.value()}))

    def ask_disconnect(self) -> bool:
        return self.ask(Command("disconnect", {"switch": self.switch.currentText(),
                                               "input": self.input.value()}))

    def ask_heater(self) -> bool:
        return self.ask(Command("set_heater", {"switch": self.chip.currentText(),
                                               "channel": self.channel.value(),
                                               "volts": self.volts.value()}))

    def ask_swap(self) -> bool:
        spare = self.spare.currentText()
        return self.ask(Command("swap", {"gpu": self.gpu.currentText(),
                                         "spare": None if spare.startswith("(") else spare}))

    def confirmation(self, command: Command) -> QMessageBox:
        box = QMessageBox(QMessageBox.Icon.Question, "Confirm " + command.action.replace("_", " "),
                          describe_change(command, self.model),
                          QMessageBox.StandardButton.Ok | QMessageBox.StandardButton.Cancel, self)
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        box.setObjectName("confirmation")
        return box

    def ask(self, command: Command) -> bool:
        """Confirm, then send; False when the operator cancelled."""
        box = self.confirmation(command)
        if box.exec() != QMessageBox.StandardButton.Ok:
            self._list(f"cancelled: {command.action} {command.params}", QColor("#9e9e9e"))
            return False
        self._list(f"sent #{command.id}: {describe_change(command, self.model).splitlines()[0]}",
                   QColor("#37474f"))
        self.runner.submit(command)
        return True

    def _answer(self, r: CommandResult) -> None:
        if r.ok:
            self._list(f"done #{r.command.id}: {r.reason}", QColor("#81c784"))
        else:
            self._list(f"refused #{r.command.id} ({r.command.action}): {r.reason}",
                       QColor("#ef5350"))
        self.answered.emit(r)

    def _list(self, text: str, colour: QColor) -> None:
        item = QListWidgetItem(time.strftime("%H:%M:%S ") + text)
        item.setForeground(colour)
        self.log.addItem(item)
        while self.log.count() > 500:
            self.log.takeItem(0)
        self.log.scrollToBottom()
