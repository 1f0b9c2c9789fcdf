"""One-line switches from DeepSpeed to Slipstream inside training hosts.

``slipstream.integrations.transformers`` (Hugging Face ``Trainer``), ``.accelerate`` (``Accelerator``)
and ``.lightning`` (``Trainer(strategy="slipstream_stage_2")``). Each builds on the host's public
extension points (subclasses, strategy objects) and on Slipstream's public API only; nothing here
is imported by ``import slipstream``, so the hosts stay optional (extras ``hf`` and ``lightning``).
"""
