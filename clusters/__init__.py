"""The resource model (cluster → node → GPU), heartbeats, node lifecycle and cluster adapters.

It never imports ``scheduling`` or ``portal``; below it is only ``foundation``.
"""
