"""The device services: each instrument's driver behind the bus's request server.

    hil.devices.kinds        what each kind of device offers on the bus (its operations,
                             state, description, telemetry) and the driver class it opens
    hil.devices.service      a device service: one writer per device, at most once, deadlines;
                             several served together from one thread (`serve_together`)
    hil.devices.supervisor   each service in its own process, restarted when it dies

The generic bus (hil.bus) knows nothing of drivers; this package is where they meet it.
"""
