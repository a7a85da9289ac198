"""The emulator: the lab in software, reached over the same wires as the hardware.

The real firmware core runs behind a pseudo-terminal; SCPI instruments (OCS, power meter,
laser) serve on loopback sockets; a rack of GPUs and a training job publish on the bus; the
physics has a hidden truth drawn from a seed, which only tests read. Nothing but `ptb emulate`
and the tests imports it: everything else reaches it over its wires (docs/design.md).

    emulator.rig                 a whole emulated rig (`ptb emulate --rig NAME`)
    emulator.dac_board           the heater DAC board: firmware core + emulated HAL on a pty
    emulator.chip, .mesh_chip    the photonic chip's physics
    emulator.scpi, .scpi_loop, .scpi_server   SCPI: the instrument's commands, the serving
                                 thread, the socket server
    emulator.ocs, .optical_instruments   SCPI instruments: OCS, power meter, laser
    emulator.bench_optics, .rails   the optics a lab bench or a datacenter's rails connect
    emulator.rack, .rackhost, .job  GPUs, their health and the emulated training job
    emulator.control, .instrument_faults  the control endpoint: faults in, truth out
"""
