"""Shared infrastructure below every domain app: live-event publishing, console building blocks,
bearer secrets, hot-loop helpers and the few SQL shapes the bulk writers share.

This is the bottom layer: it imports Django and nothing of ``clusters``, ``scheduling`` or
``portal``.
"""
