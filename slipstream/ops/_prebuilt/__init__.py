"""Ops compiled at install time (``SLIPSTREAM_BUILD_OPS=1``) land here; empty otherwise."""
