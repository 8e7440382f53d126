"""A model that cannot fit in memory is refused before it loads, with the figures (weights,
KV cache, memory available) and what to change; a core killed for memory (the
`load_killed` fault: SIGKILL, as the kernel's OOM killer sends it) says so, with the same
figures, never blaming the model file. The same on every face: `generate`, `batch`,
`serve`, and `LLM` (which runs its core in its own process: the refusal is what it has)."""

from __future__ import annotations

import json

import pytest

from gristmill import LLM, InsufficientMemoryError
from gristmill.model.memory import (AVAILABLE_ENV, PANEL_BYTES, PANEL_ENV, MemoryNeed, available_memory, oom_kills,
                                    parse_size)
from tests.batch.inprocess import run_main, tiny_model, without_faults
from tests.batch.test_cli_edges import refused_cleanly


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def _face(face: str, tiny, tmp_path) -> list:
    model = ["--model", str(tiny), "--device", "cpu"]
    if face == "generate":
        return ["generate", "Hello", "--max-tokens", "2", *model]
    if face == "batch":
        rows = tmp_path / "in.jsonl"
        rows.write_text(json.dumps({"prompt": "Hello"}) + "\n")
        return ["batch", str(rows), "-o", str(tmp_path / "out.jsonl"), *model]
    return ["serve", "--port", "0", *model]


FACES = ["generate", "batch", "serve"]


@pytest.mark.parametrize("face", FACES)
def test_a_model_too_big_for_the_memory_is_refused_with_the_figures(face, tiny, tmp_path):
    env = {**without_faults(), AVAILABLE_ENV: "0.5GB"}  # the tiny model wants ~1 GB for the rest alone
    result = run_main(*_face(face, tiny, tmp_path), env=env)
    refused_cleanly(result, "does not fit in memory", "weights", "KV cache", "max_model_len",
                    f"0.5 GB available ({AVAILABLE_ENV})", "a smaller quantization")
    assert "complete" not in result.stderr  # the file is fine: nothing tells the user to download it again
    if face == "batch":
        assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("face", FACES)
def test_a_core_killed_for_memory_says_it_ran_out_of_memory_with_the_figures(face, tiny, tmp_path):
    env = {**without_faults(), "GRISTMILL_FAULTS": "load_killed"}
    result = run_main(*_face(face, tiny, tmp_path), env=env)
    refused_cleanly(result, "SIGKILL", "ran out of memory", "weights", "KV cache", "available",
                    "a smaller quantization")
    assert "complete" not in result.stderr


def test_llm_refuses_a_model_too_big_before_loading_it(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(AVAILABLE_ENV, "700MB")
    with pytest.raises(InsufficientMemoryError, match=r"does not fit in memory.*0\.7 GB available") as caught:
        LLM(model=str(tiny), device="cpu", cache_dir=str(tmp_path))
    assert caught.value.available == 700 << 20 and caught.value.needed > caught.value.available
    # The figures are the engine's: a smaller KV cache is what the message says to change, and it fits.
    monkeypatch.setenv(AVAILABLE_ENV, "1.2GB")
    llm = LLM(model=str(tiny), device="cpu", cache_dir=str(tmp_path), kv_cache_memory_gb=0.05)
    assert llm.generate("Hello", use_tqdm=False)[0].outputs[0].finish_reason in ("stop", "length")


def test_a_narrower_kv_cache_counts_half_the_bytes_in_the_figures(tiny):
    from gristmill import EngineConfig
    from gristmill.engine.builder import resolve_model_dir
    from gristmill.model.memory import memory_need_of

    configs = {dtype: EngineConfig(model=str(tiny), device="cpu", max_model_len=64, max_num_seqs=4,
                                   kv_cache_dtype=dtype) for dtype in ("auto", "float16")}
    needs = {dtype: memory_need_of(config, resolve_model_dir(config)) for dtype, config in configs.items()}
    assert needs["auto"].kv_cache > 0 and needs["float16"].kv_cache * 2 == needs["auto"].kv_cache
    assert needs["float16"].weights == needs["auto"].weights


def test_panels_packed_at_load_take_only_memory_left_beyond_the_need(monkeypatch):
    need = MemoryNeed("m", weights=3 << 30, weights_how="as stored", kv_cache=1 << 30, kv_how="", available=0,
                      available_how="")
    left = lambda spare: MemoryNeed(**{**need.__dict__, "available": need.total + spare})  # noqa: E731
    assert left(-1).panel_budget == 0 and left(0).panel_budget == 0
    assert left(5 << 20).panel_budget == 5 << 20
    assert left(8 << 30).panel_budget == PANEL_BYTES > 0
    monkeypatch.setenv(PANEL_ENV, "64MB")
    assert left(8 << 30).panel_budget == 64 << 20 and left(5 << 20).panel_budget == 5 << 20
    monkeypatch.setenv(PANEL_ENV, "0")
    assert left(8 << 30).panel_budget == 0
    monkeypatch.setenv(PANEL_ENV, "lots")
    with pytest.raises(ValueError, match=f"{PANEL_ENV}='lots': give a size such as"):
        left(8 << 30).panel_budget


@pytest.mark.parametrize("text, size", [("6GB", 6 << 30), ("512 MiB", 512 << 20), ("1.5g", 3 << 29),
                                        ("123456", 123456), ("2tb", 2 << 40)])
def test_sizes_read_with_units_of_1024(text, size):
    assert parse_size(text) == size


def test_a_size_that_is_not_one_says_what_to_give():
    with pytest.raises(ValueError, match="6GB"):
        parse_size("lots")


def _fake_root(tmp_path, meminfo_kb: int | None = None, files: dict[str, str] | None = None):
    if meminfo_kb is not None:
        (tmp_path / "proc").mkdir()
        (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
    for name, text in (files or {}).items():
        path = tmp_path / "sys" / "fs" / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_cgroup_v2_limit_counts_what_the_container_uses_less_its_page_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(AVAILABLE_ENV, raising=False)
    root = _fake_root(tmp_path, meminfo_kb=20 << 20, files={
        "memory.max": str(8 << 30), "memory.current": str(3 << 30),
        "memory.stat": f"anon 123\ninactive_file {1 << 30}\nactive_file 5\n",
        "memory.events": "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n"})
    available, how = available_memory(root)
    assert available == 6 << 30  # 8 GB limit - (3 GB used - 1 GB of droppable page cache)
    assert "cgroup v2" in how and "8.0 GB limit" in how
    assert oom_kills(root) == 1


def test_no_cgroup_limit_leaves_the_machine_s_figure(tmp_path, monkeypatch):
    monkeypatch.delenv(AVAILABLE_ENV, raising=False)
    root = _fake_root(tmp_path, meminfo_kb=4 << 20, files={"memory.max": "max\n", "memory.current": "100\n"})
    assert available_memory(root) == (4 << 30, "MemAvailable of this machine")


def test_a_cgroup_v1_limit_below_the_machine_s_memory_is_the_figure(tmp_path, monkeypatch):
    monkeypatch.delenv(AVAILABLE_ENV, raising=False)
    root = _fake_root(tmp_path, meminfo_kb=20 << 20, files={
        "memory/memory.limit_in_bytes": str(2 << 30), "memory/memory.usage_in_bytes": str(1 << 29),
        "memory/memory.stat": "cache 0\ntotal_inactive_file 0\n"})
    available, how = available_memory(root)
    assert available == (2 << 30) - (1 << 29) and "cgroup v1" in how
    # v1's "no limit" is a huge number: the machine's figure stands.
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(str(9223372036854771712))
    assert available_memory(root)[0] == 20 << 30
