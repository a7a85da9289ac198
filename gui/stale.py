"""Stale marks: a view whose source is down is greyed over, with "STALE since ..." and why,
so that nobody reads old data as live. The mark is a child widget over the view: it shows in
screenshots (`grab()`) and lets the mouse through to the view below (tooltips still work)."""
from __future__ import annotations

import time

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QGridLayout, QWidget

VEIL = QColor(70, 70, 76, 170)
TAG_BG = QColor("#fdd835")
TAG_TEXT = QColor("#212121")


class _Veil(QWidget):
    def __init__(self, parent: QWidget):
        super().__init__(parent)
        self.setAttribute(Qt.WidgetAttribute.WA_TransparentForMouseEvents)
        self.text = ""

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        try:
            p.fillRect(self.rect(), VEIL)
            font = QFont(p.font())
            font.setBold(True)
            font.setPointSizeF(max(9.0, font.pointSizeF() * 1.1))
            p.setFont(font)
            width = min(self.width() - 16, p.fontMetrics().horizontalAdvance(self.text) + 24)
            tag = QRectF((self.width() - width) / 2, 8, max(40, width), 28)
            p.fillRect(tag, TAG_BG)
            p.setPen(QPen(TAG_TEXT))
            p.drawText(tag, Qt.AlignmentFlag.AlignCenter, self.text)
        finally:
            p.end()


class StaleFrame(QWidget):
    """Holds one view; `set_stale(since, why)` greys it, `set_stale(None)` shows it live."""

    def __init__(self, content: QWidget, parent: QWidget | None = None):
        super().__init__(parent)
        self.content = content
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.addWidget(content, 0, 0)
        self.veil = _Veil(self)
        grid.addWidget(self.veil, 0, 0)         # later in the same cell: on top
        self.veil.hide()
        self.since: float | None = None
        self.why = ""

    @property
    def stale(self) -> bool:
        return self.since is not None

    def set_stale(self, since: float | None, why: str = "") -> None:
        if since == self.since and why == self.why:
            return
        self.since, self.why = since, why
        if since is None:
            self.veil.hide()
            self.setToolTip("")
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(since))
        self.veil.text = f"STALE since {stamp} — {why}"
        self.veil.raise_()
        self.veil.show()
        self.veil.update()
