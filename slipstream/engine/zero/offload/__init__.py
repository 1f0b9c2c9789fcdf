"""ZeRO-Offload / ZeRO-Infinity: optimizer state (and ZeRO-3 parameters) in CPU memory or on NVMe.

``options`` (the frozen knobs and the checks done at initialize), ``chunks`` (a rank's partition
as a few tensors), ``state_store`` (fp32 masters and Adam moments in memory or in swap files),
``adam`` (the optimizer that steps them in sub-groups), ``swap_dir`` (where swap files live and
how they are cleaned up), ``param_store`` (ZeRO-3 parameter shards off the device).
"""
