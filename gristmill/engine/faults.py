"""Fault injection moved to gristmill/faults.py (the model runner raises its faults too,
and model/ imports nothing from engine/). This name stays for existing importers: it is
that same module, so `gristmill.engine.faults.ACTIVE` and `load()` are its own."""

import sys

from gristmill import faults

sys.modules[__name__] = faults
