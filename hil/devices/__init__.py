"""The device services: each instrument's driver behind the bus's request server.

    hil.devices.kinds        what each kind of device offers on the bus (its operations,
                             state, description, telemetry) and the driver class it opens
    hil.devices.service      a device service: one writer per device, at most once, deadlines
    hil.devices.calls        a device's driver calls, one at a time in arrival order, on a
                             thread of the device's own (or awaited on its socket)
    hil.devices.together     several services served from one thread (`serve_together`), and
                             `apply_circuits_together` under way
    hil.devices.supervisor   each service in its own process, restarted when it dies

The generic bus (hil.bus) knows nothing of drivers; this package is where they meet it.
"""
