"""Board entry point (MicroPython): USB CDC serial to the command core, watchdog ticks.

Copy firmware/core.py and firmware/rp2040-board/*.py into one folder of the board's filesystem;
MicroPython runs main.py at boot.
"""
import select
import sys

from core import Board, make_chain
from hal_board import BoardHAL

CHAIN_SERIALS = (0x0001, 0x0002, 0x0003, 0x0004, 0x0005)  # 5 x 8 = the AD5370's 40 channels


def run():
    modules = make_chain("Q8iv", CHAIN_SERIALS)
    hal = BoardHAL([m.ifull for m in modules for _ in range(m.n)])
    board = Board(hal, modules)
    out = sys.stdout.buffer
    out.write(board.power_up())
    poll = select.poll()
    poll.register(sys.stdin, select.POLLIN)
    while True:
        if poll.poll(2):
            data = sys.stdin.buffer.read(1)
            reply = board.feed(data)
            if reply:
                out.write(reply)
        board.tick()


run()
