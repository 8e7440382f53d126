"""How many CUDA GPUs this process may use, and which engine replica goes on which,
without importing torch (a batch client imports none): a pool of replicas on a machine
with several GPUs puts one on each, and replicas that share a GPU share its memory.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from gristmill.config import EngineConfig

#: One entry per GPU the NVIDIA driver has found (Linux).
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")


def visible_gpu_count(environ: Mapping[str, str] = os.environ, driver_gpus: Path = DRIVER_GPUS) -> int:
    """The GPUs CUDA will show this process: those `CUDA_VISIBLE_DEVICES` names when it
    is set (CUDA stops reading it at the first entry that is empty or negative), else
    every GPU the driver lists (`nvidia-smi -L` where /proc does not say)."""
    installed = _installed_gpus(driver_gpus)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    named = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        named += 1
    return min(named, installed) if installed else named


def _installed_gpus(driver_gpus: Path) -> int:
    try:
        return sum(1 for _ in driver_gpus.iterdir())
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def replica_configs(config: EngineConfig, replicas: int, num_gpus: int) -> list[EngineConfig]:
    """The config of each of `replicas` engines built from `config` on a machine showing
    `num_gpus` GPUs. On "cuda" or "auto" they go round the GPUs (cuda:0, cuda:1, ...);
    on one named GPU ("cuda:1") they all go there; on CPU nothing changes. Replicas that
    share a GPU split its `gpu_memory_utilization` evenly, so together they use what one
    would (an explicit `kv_cache_memory_gb` or `num_kv_blocks` stays each one's own)."""
    if config.device == "cpu" or (config.device == "auto" and num_gpus == 0):
        return [config] * replicas
    if config.device in ("auto", "cuda"):
        devices = [f"cuda:{i % max(num_gpus, 1)}" for i in range(replicas)]
    else:
        devices = [config.device] * replicas
    sharing = Counter(devices)
    return [dataclasses.replace(config, device=device,
                                gpu_memory_utilization=config.gpu_memory_utilization / sharing[device])
            for device in devices]


def start_waves(configs: list[EngineConfig]) -> list[list[int]]:
    """The replicas (indices of `configs`) to start together, wave after wave: those on
    different GPUs (or on CPU) at once, those sharing a GPU one after another, so each
    sizes its KV cache from the memory the ones before it left."""
    waves: list[list[int]] = []
    seen: Counter[str] = Counter()
    for i, config in enumerate(configs):
        rank = seen[config.device] if config.device.startswith("cuda") else 0
        seen[config.device] += 1
        if rank == len(waves):
            waves.append([])
        waves[rank].append(i)
    return waves
