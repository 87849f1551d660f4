"""Scheduler plugins, one module each; registered by name in ``scheduling.engine.registry``."""
