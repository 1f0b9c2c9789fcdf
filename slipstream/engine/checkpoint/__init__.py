"""Checkpoints keyed by parameter name: exact resume at any world size or ZeRO stage, atomic, async, exportable.

Modules: ``target`` (the ``Stateful`` pieces and counters the engine hands over: the checkpoint
code never sees the engine), ``format`` (files, safetensors writer, JSON trees), ``capture`` (what
a rank saves), ``restore`` (validate everything, then apply), ``layout`` (pieces of global tensors:
box + flat range, coverage, re-slicing), ``validate`` (JSON field checks), ``tags``, ``rng``,
``writer`` (the atomic commit, lock, recovery), ``reader`` (finding, validating, reading by
slice), ``manager`` (save/load, async, interval, auto-resume), ``export``, ``verify`` and ``cli``
(``slipstream checkpoint``; entry point ``cli.main``). See docs/checkpoints.md.
"""
