"""Bridges to the ecosystems the stack's users already run: the rig's instruments as Bluesky
(ophyd-async) devices (`hil.bridges.bluesky`) and as LECO actors for PyMoDAQ and other LECO
clients (`hil.bridges.leco`). Both stand on `hil.bridges.devices`: each instrument's quantities
with their units and limits, read and changed through the bus or the drivers directly
(`hil.bridges.access`). Nothing here imports Qt or the emulator; ophyd-async and pyleco are
optional extras, imported only by the module that needs them.
"""
