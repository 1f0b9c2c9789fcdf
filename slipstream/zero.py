"""ZeRO-3 tools for user code: build partitioned (``Init``), look inside (``GatheredParameters``).

``register_external_parameter`` declares a parameter used outside its owning module's forward.
"""

from __future__ import annotations

from typing import Any

from slipstream.engine.zero import init as _init
from slipstream.engine.zero.stage3.gathered import GatheredParameters
from slipstream.engine.zero.stage3.units import register_external_parameter


class Init(_init.Init):
    """``with slipstream.zero.Init(config=ds_config): model = MyModel(...)``: see ``engine/zero/init.py``.

    ``config`` (a dict, a path or a SlipstreamConfig; the one later given to ``initialize``) decides
    the units (``zero_optimization.stage3_unit_modules``, ``stage3_param_persistence_threshold``).
    DeepSpeed's ``config_dict_or_path=``, ``remote_device=`` and ``dtype=`` are accepted too.
    """

    def __init__(
        self,
        config: Any = None,
        enabled: bool = True,
        *,
        config_dict_or_path: Any = None,
        remote_device: str | None = None,
        dtype: Any = None,
        **deepspeed_only: Any,
    ) -> None:
        # DeepSpeed's spelling: config_dict_or_path is the config. Where parameters live (remote_device)
        # and their dtype come from the config at initialize(), so those two are accepted and change
        # nothing; neither do DeepSpeed-only knobs (module=, mpu=, pin_memory=, ...).
        if config is not None and config_dict_or_path is not None:
            raise ValueError("zero.Init: pass the config once (config= or config_dict_or_path=)")
        config = config if config is not None else config_dict_or_path
        if config is None:
            super().__init__(enabled=enabled)
            return
        from slipstream.engine.config import SlipstreamConfig

        zero = SlipstreamConfig.load(config, world_size=None).zero_optimization
        super().__init__(zero.stage3_unit_modules, zero.stage3_param_persistence_threshold, enabled)


__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
