"""The Orrery node agent (``orrery-agent``)."""
