"""Checkpoints keyed by parameter name: exact resume at any world size or ZeRO stage, atomic, async, exportable.

Modules: ``format`` (files, safetensors writer), ``engine_state`` (what a rank saves, how it is
restored), ``writer`` (the atomic commit), ``reader`` (finding, validating, reading by slice),
``manager`` (the engine's save/load, async, interval, auto-resume), ``export`` (one consolidated
fp32 file) and ``cli`` (``slipstream checkpoint``). See docs/checkpoints.md.
"""
