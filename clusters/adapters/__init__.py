"""Cluster adapters: one interface (``base``), one module per kind, a lazy registry."""
