"""The lab bench: finding its devices, recording and replaying what they say, and the
emulator's control wire.

    hil.lab.discover         probe serial ports and VISA resources, write a rig file's skeleton
    hil.lab.session          a recorded session (JSON lines): what clients and devices said
    hil.lab.recorder         a relay that records a device's traffic
    hil.lab.replayer         plays a session back as the device, or checks a client against it
    hil.lab.control_client   the client of the emulator's control endpoint (faults, truth)
"""
