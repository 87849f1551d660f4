"""Queues, jobs, attempts, allocations, the job state machine and the scheduler.

Depends on ``clusters``; never imports ``portal``.
"""
