"""What the agent reads about its machine: CPU, memory, boot id and GPUs.

GPUs come from NVML (the ``nvidia-ml-py`` package) when it is installed and finds a GPU;
otherwise from ``--fake-gpus MODEL:COUNT``, which stands in for GPUs on machines without any
(development, tests, demos), with ``--fake-mig`` and ``--fake-power`` for MIG layouts and power
draw. Every NVML call that a GPU or driver may not support is guarded: what cannot be read is
not reported.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from clusters.agent import mig

log = logging.getLogger("orrery.agent")
NVML_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE: the current mode of nvmlDeviceGetMigMode
NVML_TEMPERATURE_GPU = 0
FAKE_POWER_W = (60.0, 400.0)  # a fake GPU's draw when idle and when busy
FAKE_BUSY_MEMORY_MB = 16384  # what a busy fake GPU (not in MIG mode) has in use


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
    """The machine's GPUs: NVML when available, else the fake ones asked for.

    Fake GPUs (``--fake-gpus MODEL:COUNT``) may be in MIG mode (``fake_mig``: per index, its
    layout; see ``mig.parse_fake_mig``) and report plausible telemetry: utilisation 100 %, power
    ``fake_power[1]`` W, 16 GiB (or, in MIG mode, three quarters of the instances' memory) in use
    and 72 °C while an attempt holds the GPU (one of its instances, in MIG mode), else 0 %,
    ``fake_power[0]`` W, nothing in use and 34 °C. So the energy meter and load-aware placement
    have data on machines without GPUs."""

    def __init__(
        self,
        fake: str | None,
        node: str,
        *,
        fake_mig: dict[int, list[str]] | None = None,
        fake_power: tuple[float, float] = FAKE_POWER_W,
        nvml: Any = None,
    ) -> None:
        self.node = node
        self.nvml: Any = nvml
        self.fake: list[dict[str, Any]] = []
        self.layouts: dict[int, list[str]] = dict(fake_mig or {})  # fake GPUs in MIG mode
        self.fake_power = fake_power
        if nvml is None and not fake:
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

    # --- what the GPUs are ------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """Each GPU as the node's description carries it; a GPU in MIG mode with ``mig``, its
        instances (``slot``, ``profile``, ``uuid``, ``memory_mb``, ``slices``)."""
        if self.nvml is None:
            return [
                dict(g) | ({"mig": self._fake_instances(g["index"])} if g["index"] in self.layouts else {})
                for g in self.fake
            ]
        out = []
        for i in range(self.nvml.nvmlDeviceGetCount()):
            handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
            gpu = {
                "index": i,
                "model": _text(self.nvml.nvmlDeviceGetName(handle)),
                "uuid": _text(self.nvml.nvmlDeviceGetUUID(handle)),
                "memory_total_mb": self.nvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20,
            }
            instances = self._nvml_instances(handle)
            out.append(gpu if instances is None else gpu | {"mig": instances})
        return out

    def layout(self, index: int) -> list[str] | None:
        """The profiles of GPU ``index``'s instances, in slot order; None when it is not in MIG
        mode (or there is no such GPU)."""
        if self.nvml is None:
            return list(self.layouts[index]) if index in self.layouts else None
        try:
            handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
        except self.nvml.NVMLError:
            return None
        instances = self._nvml_instances(handle)
        return None if instances is None else [m["profile"] for m in instances]

    def _fake_instances(self, index: int) -> list[dict[str, Any]]:
        return mig.fake_instances(self.node, index, self.layouts[index])

    def _nvml_instances(self, handle: Any) -> list[dict[str, Any]] | None:
        """A GPU's MIG instances from NVML; None for a GPU not in MIG mode, or a GPU or driver
        that knows nothing of MIG. An empty slot is skipped, and so is an instance NVML cannot
        read (logged): what is reported is only what was read."""
        nvml = self.nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            if current != NVML_MIG_ENABLED:
                return None
            count = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        except nvml.NVMLError:
            return None
        instances = []
        for slot in range(min(int(count), mig.MAX_INSTANCES)):
            try:
                instance = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError_NotFound:
                continue  # no instance in this slot
            except nvml.NVMLError as exc:
                log.warning("cannot read MIG slot %d: %s", slot, exc)
                continue
            try:
                name = _text(nvml.nvmlDeviceGetName(instance))
                found = {
                    "slot": slot,
                    "uuid": _text(nvml.nvmlDeviceGetUUID(instance)),
                    "memory_mb": nvml.nvmlDeviceGetMemoryInfo(instance).total // 2**20,
                }
            except nvml.NVMLError as exc:
                log.warning("cannot read MIG instance %d: %s", slot, exc)
                continue
            profile = mig.profile_of_name(name)
            if profile is None:
                log.warning("MIG instance %d: no profile in its name %r", slot, name[:96])
                continue
            instances.append(found | {"profile": profile, "slices": mig.slices(profile)})
        return instances

    # --- changing a MIG layout --------------------------------------------------------------
    def reconfigure(self, index: int, layout: list[str]) -> None:
        """Give GPU ``index`` the MIG layout (``[]``: MIG off); the caller has made sure nothing
        runs on it. Fake GPUs switch at once; real ones through ``nvidia-smi`` (see
        ``mig.reconfigure_commands``). Raises ``mig.LayoutError`` for a layout that is not one,
        ``LookupError`` for a GPU this node does not have, and ``OSError`` when the driver
        refuses (its words in the message)."""
        layout = mig.check_layout(layout)
        if self.nvml is None:
            if not any(g["index"] == index for g in self.fake):
                raise LookupError(f"no GPU {index} on this node")
            if layout:
                self.layouts[index] = layout
            else:
                self.layouts.pop(index, None)
            return
        if not 0 <= index < self.nvml.nvmlDeviceGetCount():
            raise LookupError(f"no GPU {index} on this node")
        smi = shutil.which("nvidia-smi")
        if smi is None:
            raise OSError("nvidia-smi is not installed")
        for command in mig.reconfigure_commands(smi, index, layout, self.layout(index) is not None):
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
            except subprocess.TimeoutExpired:
                raise OSError(f"{' '.join(command[1:])} did not end within 120 s") from None
            if done.returncode != 0 and not mig.may_fail(command):
                said = (done.stderr or done.stdout).strip()[-300:]
                raise OSError(f"{' '.join(command[1:])} exited {done.returncode}: {said}")

    # --- telemetry --------------------------------------------------------------------------
    def telemetry(self, busy: set[int]) -> list[dict[str, Any]]:
        """Each GPU's readings now; ``busy``: the indices attempts hold (for the fake GPUs). A
        reading NVML cannot give (utilisation of a GPU in MIG mode, power of some boards) is
        left out rather than made up."""
        if self.nvml is None:
            return [self._fake_reading(g["index"], g["index"] in busy) for g in self.fake]
        out = []
        for i in range(self.nvml.nvmlDeviceGetCount()):
            handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
            memory = self._read(self.nvml.nvmlDeviceGetMemoryInfo, handle)
            util = self._read(self.nvml.nvmlDeviceGetUtilizationRates, handle)
            power_mw = self._read(self.nvml.nvmlDeviceGetPowerUsage, handle)
            temp = self._read(self.nvml.nvmlDeviceGetTemperature, handle, NVML_TEMPERATURE_GPU)
            reading = {
                "index": i,
                "uuid": _text(self.nvml.nvmlDeviceGetUUID(handle)),
                "util": None if util is None else float(util.gpu),
                "memory_total_mb": None if memory is None else memory.total // 2**20,
                "memory_used_mb": None if memory is None else memory.used // 2**20,
                "power_w": None if power_mw is None else power_mw / 1000.0,
                "temp_c": None if temp is None else float(temp),
                "health": "healthy",
            }
            out.append({k: v for k, v in reading.items() if v is not None})
        return out

    def _read(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except self.nvml.NVMLError:
            return None

    def _fake_reading(self, index: int, busy: bool) -> dict[str, Any]:
        idle_w, busy_w = self.fake_power
        if index in self.layouts:
            memory = sum(m["memory_mb"] for m in self._fake_instances(index)) * 3 // 4
        else:
            memory = FAKE_BUSY_MEMORY_MB
        return {
            "index": index,
            "util": 100.0 if busy else 0.0,
            "memory_used_mb": memory if busy else 0,
            "power_w": busy_w if busy else idle_w,
            "temp_c": 72.0 if busy else 34.0,
            "health": "healthy",
        }


def node_power_w(readings: list[dict[str, Any]]) -> float | None:
    """The node's power as its GPUs report it (their sum), None when none reports power: the
    rest of the machine is not measured, and nothing is made up for it."""
    powers = [r["power_w"] for r in readings if r.get("power_w") is not None]
    return round(sum(powers), 1) if powers else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cpu_count_millicores() -> int:
    return (os.cpu_count() or 1) * 1000
