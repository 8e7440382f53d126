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


def visible_gpus(environ: Mapping[str, str] = os.environ, driver_gpus: Path = DRIVER_GPUS) -> list[str]:
    """The GPUs CUDA will show this process, as CUDA_VISIBLE_DEVICES names them: its
    entries when it is set (CUDA shows those before the first invalid one: empty,
    negative, or an index past the GPUs installed), else 0, 1, ... for every GPU the
    driver lists (`nvidia-smi -L` where /proc does not say)."""
    installed = _installed_gpus(driver_gpus)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(installed)]
    names = []
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-") or (entry.isdigit() and installed and int(entry) >= installed):
            break
        names.append(entry)
    return names[:installed] if installed else names


def visible_gpu_count(environ: Mapping[str, str] = os.environ, driver_gpus: Path = DRIVER_GPUS) -> int:
    return len(visible_gpus(environ, driver_gpus))


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


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one replica of a pool runs: its config, and the environment its engine-core
    process gets (None: this process's, as it is)."""

    config: EngineConfig
    #: CUDA_VISIBLE_DEVICES for its core: the one GPU it sees (as cuda:0), or None.
    visible_devices: str | None = None
    #: Which GPU it runs on, for replicas that share one (None: CPU, or a GPU of its own).
    gpu: str | None = None

    @property
    def core_env(self) -> dict[str, str] | None:
        return None if self.visible_devices is None else {"CUDA_VISIBLE_DEVICES": self.visible_devices}


def place_replicas(config: EngineConfig, replicas: int, gpus: list[str]) -> list[Placement]:
    """Where each of `replicas` engines built from `config` runs, on a machine showing
    `gpus` (`visible_gpus`). On "cuda" or "auto" they go round the GPUs, each core seeing only
    its own (CUDA_VISIBLE_DEVICES, as Ray does: "auto" still means the CPU when torch has
    no CUDA); on one named GPU ("cuda:1") they all go there; on CPU nothing changes.
    Replicas that share a GPU split its `gpu_memory_utilization` evenly, so together they
    use what one would (an explicit `kv_cache_memory_gb` or `num_kv_blocks` stays each
    one's own)."""
    if config.device == "cpu" or (config.device == "auto" and not gpus):
        return [Placement(config)] * replicas
    if config.device in ("auto", "cuda"):
        names = gpus or ["0"]  # (none counted, "cuda" asked: the first)
        placed = [(names[i % len(names)],) * 2 for i in range(replicas)]
    else:  # "cuda:N": the GPU the user named, for all of them
        placed = [(None, config.device)] * replicas
    sharing = Counter(gpu for _, gpu in placed)
    return [Placement(dataclasses.replace(config, gpu_memory_utilization=config.gpu_memory_utilization / sharing[gpu]),
                      visible, gpu if sharing[gpu] > 1 else None)
            for visible, gpu in placed]


def start_waves(placements: list[Placement]) -> list[list[int]]:
    """The replicas (indices of `placements`) to start together, wave after wave: those on
    GPUs of their own (or on CPU) at once, those sharing a GPU one after another, so each
    sizes its KV cache from the memory the ones before it left."""
    waves: list[list[int]] = []
    seen: Counter[str] = Counter()
    for i, placement in enumerate(placements):
        rank = 0 if placement.gpu is None else seen[placement.gpu]
        if placement.gpu is not None:
            seen[placement.gpu] += 1
        if rank == len(waves):
            waves.append([])
        waves[rank].append(i)
    return waves
