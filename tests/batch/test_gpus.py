"""Which GPU each engine replica of a pool runs on, and how they share one: the logic
runs without a GPU (tests/cuda starts a real pool of two on one GPU)."""

from __future__ import annotations

import os

import pytest

from gristmill import EngineConfig
from gristmill.gpus import replica_configs, start_waves, visible_gpu_count


def driver_dir(tmp_path, gpus: int):
    for i in range(gpus):
        (tmp_path / f"0000:{i:02x}:00.0").mkdir()
    return tmp_path


def test_visible_gpu_count_reads_the_driver_and_cuda_visible_devices(tmp_path):
    four = driver_dir(tmp_path, 4)
    assert visible_gpu_count({}, four) == 4
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "2,3"}, four) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-1a2b, GPU-3c4d"}, four) == 2  # UUIDs count too
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, four) == 0  # none: CUDA sees no GPU
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, four) == 1  # CUDA stops at -1
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, four) == 4  # not more than there are


def test_no_driver_means_no_gpu_unless_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi either
    missing = tmp_path / "no-driver"
    assert visible_gpu_count({}, missing) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1"}, missing) == 2


def test_replicas_go_round_the_gpus_and_those_sharing_one_split_its_memory():
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.9, max_num_seqs=64)
    configs = replica_configs(config, 5, num_gpus=2)
    assert [c.device for c in configs] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    shares = [c.gpu_memory_utilization for c in configs]
    assert shares[0] == shares[2] == shares[4] == 0.9 / 3 and shares[1] == shares[3] == 0.9 / 2
    assert all(c.max_num_seqs == 64 for c in configs)  # the rest of the config is the same
    assert start_waves(configs) == [[0, 1], [2, 3], [4]]  # on one GPU, one after another

    assert [c.device for c in replica_configs(EngineConfig(device="auto"), 3, num_gpus=4)] == \
        ["cuda:0", "cuda:1", "cuda:2"]
    one = replica_configs(EngineConfig(device="cuda:1"), 2, num_gpus=4)  # the GPU named: both share it
    assert [(c.device, c.gpu_memory_utilization) for c in one] == [("cuda:1", 0.45), ("cuda:1", 0.45)]
    assert start_waves(one) == [[0], [1]]


def test_on_cpu_nothing_changes_and_every_replica_starts_at_once():
    for config, gpus in ((EngineConfig(device="cpu"), 2), (EngineConfig(device="auto"), 0)):
        configs = replica_configs(config, 3, gpus)
        assert all(c is config for c in configs)
        assert start_waves(configs) == [[0, 1, 2]]


def test_this_machine_is_counted_as_cuda_counts_it():
    torch = __import__("torch")
    assert visible_gpu_count(os.environ) == torch.cuda.device_count()


def test_engine_actors_on_ray_ask_for_a_gpu_and_share_one_by_its_memory():
    from gristmill.errors import RequestError
    from gristmill.ray.data import engine_gpus

    auto, cuda, cpu = EngineConfig(), EngineConfig(device="cuda"), EngineConfig(device="cpu")
    assert engine_gpus(auto, {"num_cpus": 1}, cluster_gpus=4) == (auto, {"num_cpus": 1, "num_gpus": 1})
    assert engine_gpus(auto, {"num_cpus": 1}, cluster_gpus=0) == (auto, {"num_cpus": 1})  # CPU: as it was
    assert engine_gpus(cpu, {"num_cpus": 1}, cluster_gpus=4) == (cpu, {"num_cpus": 1})
    half, options = engine_gpus(cuda, {"num_gpus": 0.5}, cluster_gpus=1)
    assert options == {"num_gpus": 0.5} and half.gpu_memory_utilization == 0.45 and half.device == "cuda"
    for options, gpus, why in (({}, 0, "the Ray cluster has none"),
                               ({"num_gpus": 0}, 2, "ray_actor_options has num_gpus=0")):
        with pytest.raises(RequestError, match=rf"device is 'cuda' but its actors get no GPU \({why}.*"
                                               r"set ray_actor_options=\{'num_gpus': 1\}") as info:
            engine_gpus(cuda, options, gpus)
        assert info.value.param == "ray_actor_options"
