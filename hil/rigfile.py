"""Transitional alias of `hil.rig` (the rig package), for code written before it existed.
New code imports `photonic_testbed.hil.rig`; this module goes once nothing imports it."""
from photonic_testbed.hil.rig import *  # noqa: F401,F403
from photonic_testbed.hil.rig import __all__  # noqa: F401
