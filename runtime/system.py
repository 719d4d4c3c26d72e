"""System metrics (Composer's SystemMetricsMonitor): this node's CPU, memory, disk and network
(psutil) and, on CUDA, each rank's GPU memory, utilisation, temperature and power, reduced
over ranks to their minimum and maximum. Read at each metrics record, on every rank.
"""

from __future__ import annotations

import importlib.util
import os

import psutil
import torch

from runtime import dist

GB = 1e9


class SystemMetrics:
    """Readings since the previous `read` (CPU percentages) or now (the rest)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.process = psutil.Process()
        # The first CPU percentages cover the time from here to the first read.
        psutil.cpu_percent(interval=None)
        self.process.cpu_percent(interval=None)
        # torch.cuda.utilization/temperature/power_draw read NVML (nvidia-ml-py).
        self.nvml = importlib.util.find_spec("pynvml") is not None

    def read(self) -> dict[str, float]:
        """This node's numbers, and on CUDA the min and max over ranks of each rank's GPU
        numbers (one all-gather: every rank must call it)."""
        memory = psutil.virtual_memory()
        disk = psutil.disk_usage(os.sep)
        network = psutil.net_io_counters()
        metrics = {
            "system/cpu_percent": psutil.cpu_percent(interval=None),  # all cores: 0-100
            "system/process_cpu_percent": self.process.cpu_percent(interval=None),
            "system/memory_used_gb": memory.used / GB,
            "system/memory_percent": memory.percent,
            "system/disk_used_gb": disk.used / GB,
            "system/disk_percent": disk.percent,
            "system/network_sent_gb": network.bytes_sent / GB,
            "system/network_received_gb": network.bytes_recv / GB,
        }
        if self.device.type == "cuda":
            metrics |= self._gpus()
        return metrics

    def _gpus(self) -> dict[str, float]:
        free, total = torch.cuda.mem_get_info(self.device)
        readings = {"gpu_memory_used_gb": (total - free) / GB}
        if self.nvml:
            readings["gpu_percent"] = torch.cuda.utilization(self.device)
            readings["gpu_temperature_c"] = torch.cuda.temperature(self.device)
            readings["gpu_power_w"] = torch.cuda.power_draw(self.device) / 1000  # mW
        local = torch.tensor([list(readings.values())], device=self.device)
        every_rank = dist.gather_rows(local.double())  # (world size, readings)
        metrics = {}
        for name, column in zip(readings, every_rank.T.tolist()):
            metrics[f"system/{name}_min"] = min(column)
            metrics[f"system/{name}_max"] = max(column)
        return metrics
