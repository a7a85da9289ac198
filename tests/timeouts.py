"""How long a test lets a device or a service take to answer: far longer than on an idle
machine, so that a test never depends on a client's short default (the heater DAC's 1 s) while
it shares two cores with other tests and other work."""

DEVICE_S = 10.0          # a driver's reply (heater DAC, OCS, meter, laser) on the emulator
