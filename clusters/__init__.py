"""The resource model (cluster → node → GPU), heartbeats, node lifecycle and cluster adapters.

This is the bottom layer: it never imports ``scheduling`` or ``portal``.
"""
