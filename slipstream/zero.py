"""ZeRO-3 tools for user code: build partitioned (``Init``), look inside (``GatheredParameters``).

``register_external_parameter`` declares a parameter used outside its owning module's forward.
"""

from slipstream.engine.zero.init import GatheredParameters, Init
from slipstream.engine.zero.units import register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
