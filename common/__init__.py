"""Facts about the chip that every layer shares: its topology and its calibration file.

No Qt, no I/O and nothing else of ours is imported here, so the drivers, calibration, the bus,
the GUI and the command line all use the same model (and the GUI need not import drivers):

    common.topology      cells, ports, links; the Benes, Clements, square and hexagonal
                         builders; `describe()` / `Topology.from_dict`; names like "benes16"
    common.calibration   the calibration file: its data model, the phase law it stands for,
                         parsing (checksum, types, ranges) and writing its text
    common.nesting       the bound on how deep a JSON or TOML file a user hands us may nest,
                         checked before it is parsed (a RecursionError is no answer)
"""
