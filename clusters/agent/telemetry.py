"""What the agent reads about its machine: CPU, memory, boot id and GPUs.

GPUs come from NVML (the ``nvidia-ml-py`` package) when it is installed and finds a GPU;
otherwise from ``--fake-gpus MODEL:COUNT``, which stands in for GPUs on machines without any
(development, tests, demos) and says so in the model it reports.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return uuid.uuid5(
            uuid.NAMESPACE_DNS, f"{socket.gethostname()}-{time.time() - time.monotonic():.0f}"
        ).hex


def memory_bytes() -> tuple[int, int]:
    """(total, in use) from /proc/meminfo."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return 0, 0
    total = info.get("MemTotal", 0)
    return total, max(total - info.get("MemAvailable", total), 0)


class CpuMeter:
    """Busy fraction of all CPUs since the previous reading (from /proc/stat)."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return 0, 0
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    def busy(self) -> float:
        total, idle = self._read()
        d_total, d_idle = total - self._last[0], idle - self._last[1]
        self._last = (total, idle)
        return round(min(max(1 - d_idle / d_total, 0.0), 1.0), 3) if d_total > 0 else 0.0


class Gpus:
    """The machine's GPUs: NVML when available, else the fake ones asked for."""

    def __init__(self, fake: str | None, node: str) -> None:
        self.nvml: Any = None
        self.fake: list[dict[str, Any]] = []
        if not fake:
            try:
                import pynvml

                pynvml.nvmlInit()
                if pynvml.nvmlDeviceGetCount() > 0:
                    self.nvml = pynvml
            except Exception:  # no library, no driver or no GPU: a machine without GPUs
                self.nvml = None
        if self.nvml is None and fake:
            model, _, count = fake.partition(":")
            self.fake = [
                {
                    "index": i,
                    "model": model,
                    "uuid": f"GPU-fake-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.{i}')}",
                }
                for i in range(int(count or 1))
            ]

    def describe(self) -> list[dict[str, Any]]:
        if self.nvml is None:
            return [dict(g) for g in self.fake]
        out = []
        for i in range(self.nvml.nvmlDeviceGetCount()):
            handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
            name = self.nvml.nvmlDeviceGetName(handle)
            out.append(
                {
                    "index": i,
                    "model": name.decode() if isinstance(name, bytes) else name,
                    "uuid": _text(self.nvml.nvmlDeviceGetUUID(handle)),
                    "memory_total_mb": self.nvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20,
                }
            )
        return out

    def telemetry(self, busy: set[int]) -> list[dict[str, Any]]:
        if self.nvml is None:
            return [
                {"index": g["index"], "util": 100.0 if g["index"] in busy else 0.0, "health": "healthy"}
                for g in self.fake
            ]
        out = []
        for i in range(self.nvml.nvmlDeviceGetCount()):
            handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(
                {
                    "index": i,
                    "uuid": _text(self.nvml.nvmlDeviceGetUUID(handle)),
                    "util": float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    "memory_total_mb": memory.total // 2**20,
                    "memory_used_mb": memory.used // 2**20,
                    "power_w": self.nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                    "temp_c": float(self.nvml.nvmlDeviceGetTemperature(handle, 0)),
                    "health": "healthy",
                }
            )
        return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cpu_count_millicores() -> int:
    return (os.cpu_count() or 1) * 1000
