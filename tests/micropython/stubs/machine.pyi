# MicroPython's `machine`, as much of it as firmware/rp2040-board/hal_board.py uses: the RP2040
# port's Pin, SPI and ADC (docs.micropython.org, "machine"). The board's files are type-checked
# against it by tests/test_lint.py; nothing runs it.

class Pin:
    OUT: int

    def __init__(self, id: int, mode: int = ..., *, value: int = ...) -> None: ...
    def __call__(self, x: int) -> None: ...


class SPI:
    def __init__(self, id: int, *, baudrate: int, polarity: int, phase: int, sck: Pin,
                 mosi: Pin, miso: Pin) -> None: ...
    def write(self, buf: bytes | bytearray) -> None: ...


class ADC:
    def __init__(self, pin: Pin) -> None: ...
    def read_u16(self) -> int: ...
