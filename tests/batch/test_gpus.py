"""Which GPU each engine replica of a pool runs on, and how they share one: the logic
runs without a GPU (tests/cuda starts a real pool of two on one GPU)."""

from __future__ import annotations

import asyncio
import os

import pytest

from gristmill import EngineConfig
from gristmill.gpus import place_replicas, start_waves, visible_gpu_count, visible_gpus


def driver_dir(tmp_path, gpus: int):
    for i in range(gpus):
        (tmp_path / f"0000:{i:02x}:00.0").mkdir()
    return tmp_path


def test_visible_gpu_count_reads_the_driver_and_cuda_visible_devices(tmp_path):
    four = driver_dir(tmp_path, 4)
    assert visible_gpu_count({}, four) == 4
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "2,3"}, four) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": " 3, GPU-9f,0,7"}, four) == ["3", "GPU-9f", "0"]  # as named
    assert visible_gpus({}, four) == ["0", "1", "2", "3"]
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-1a2b, GPU-3c4d"}, four) == 2  # UUIDs count too
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, four) == 0  # none: CUDA sees no GPU
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, four) == 1  # CUDA stops at -1
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, four) == 4  # not more than there are
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,7,1"}, four) == 1  # CUDA stops at an index past them
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "4,0"}, four) == 0


def test_no_driver_means_no_gpu_unless_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi either
    missing = tmp_path / "no-driver"
    assert visible_gpu_count({}, missing) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1"}, missing) == 2


def test_replicas_go_round_the_gpus_and_those_sharing_one_split_its_memory():
    # Each core sees only its GPU (CUDA_VISIBLE_DEVICES, as Ray does), so "auto" still
    # means the CPU where torch has no CUDA.
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.9, max_num_seqs=64)
    placed = place_replicas(config, 5, ["0", "1"])
    assert [p.core_env for p in placed] == [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in "01010"]
    shares = [p.config.gpu_memory_utilization for p in placed]
    assert shares[0] == shares[2] == shares[4] == 0.9 / 3 and shares[1] == shares[3] == 0.9 / 2
    assert all(p.config.device == "cuda" and p.config.max_num_seqs == 64 for p in placed)  # the rest as it was
    assert start_waves(placed) == [[0, 1], [2, 3], [4]]  # on one GPU, one after another

    # The GPUs this process may use, by the names it was given.
    auto = place_replicas(EngineConfig(), 3, ["3", "GPU-9f", "5", "7"])
    assert [p.visible_devices for p in auto] == ["3", "GPU-9f", "5"]
    assert all(p.config.device == "auto" and p.config.gpu_memory_utilization == 0.9 for p in auto)
    assert start_waves(auto) == [[0, 1, 2]]  # a GPU each: all at once

    one = place_replicas(EngineConfig(device="cuda:1"), 2, ["0", "1", "2", "3"])  # named: both share it
    assert [(p.config.device, p.config.gpu_memory_utilization, p.core_env) for p in one] == \
        [("cuda:1", 0.45, None), ("cuda:1", 0.45, None)]
    assert start_waves(one) == [[0], [1]]


def test_on_cpu_nothing_changes_and_every_replica_starts_at_once():
    for config, gpus in ((EngineConfig(device="cpu"), ["0", "1"]), (EngineConfig(device="auto"), [])):
        placed = place_replicas(config, 3, gpus)
        assert all(p.config is config and p.core_env is None for p in placed)
        assert start_waves(placed) == [[0, 1, 2]]


def test_this_machine_is_counted_as_cuda_counts_it():
    torch = __import__("torch")
    assert visible_gpu_count(os.environ) == torch.cuda.device_count()


def test_engine_actors_on_ray_ask_for_a_gpu_and_share_one_by_its_memory():
    pytest.importorskip("ray", reason="Ray is not installed (the GPU machine has none)")
    from gristmill.errors import RequestError
    from gristmill.ray.cluster import engine_gpus

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
    with pytest.raises(RequestError, match=r"device is 'cuda:1', but an actor sees only the 1 GPU\(s\) Ray gives it, "
                                           r"as cuda:0 and up: use device='cuda'"):
        engine_gpus(EngineConfig(device="cuda:1"), {}, cluster_gpus=4)
    assert engine_gpus(EngineConfig(device="cuda:1"), {"num_gpus": 2}, 4)[1] == {"num_gpus": 2}


def core_environ(engine) -> dict[str, str]:
    raw = open(f"/proc/{engine.core_pid}/environ", "rb").read().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in raw if b"=" in entry)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs torch without CUDA (a CPU machine)")
def test_a_pool_on_a_machine_with_two_gpus_gives_each_core_its_own(monkeypatch):
    """Two GPUs named, torch without CUDA (this machine): each replica's core sees its own
    GPU, "auto" still runs on the CPU there, both generate; a restarted core sees the
    same GPU."""
    from gristmill.batch import runtime
    from gristmill.batch.engines import start_pool
    from gristmill.batch.rows import RowRequest
    from gristmill.sampling import SamplingParams

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    from tests.batch.conftest import tiny_engine

    # (the tiny model: which GPU each core sees is the point, not what it generates)
    pool = start_pool(tiny_engine(device="auto", max_model_len=128), concurrency=2)
    try:
        engines = [replica.engine for replica in pool.replicas]
        assert [core_environ(e)["CUDA_VISIBLE_DEVICES"] for e in engines] == ["0", "1"]
        assert [e.config.gpu_memory_utilization for e in engines] == [0.9, 0.9]  # a GPU each

        async def rows():
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            return await asyncio.gather(*(pool.generate(RowRequest(i, f"Row {i}:", None, None, params))
                                          for i in range(4)))
        assert [g.num_generated_tokens for g in runtime.call(rows())] == [4] * 4
        engines[1].restart()
        assert core_environ(engines[1])["CUDA_VISIBLE_DEVICES"] == "1"
    finally:
        runtime.call(pool.close())
