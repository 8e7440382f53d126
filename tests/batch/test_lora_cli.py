"""`gristmill batch --lora-modules name=path` as a user runs it, on a tiny random-weight
Llama with adapters made by `peft`: a JSONL job whose rows name adapters (`model`,
`lora`), killed part way (SIGKILL) and resumed, accounts for every row exactly once, each
with the tokens `LLM(enable_lora=True)` gives for its adapter; an OpenAI batch file whose
lines name adapters in their body's `model` runs each with its own; a row naming an
adapter not given, or one that fails to load, is that row's error."""

from __future__ import annotations

import json
import signal

import pytest

pytest.importorskip("peft")

from gristmill import LLM, LoRARequest, SamplingParams  # noqa: E402
from gristmill.batch import ERROR_COLUMN  # noqa: E402
from tests.batch.inprocess import batch_main  # noqa: E402
from tests.batch.test_cli_batch import batch_job, read_jsonl, wait_for_rows, write_jsonl  # noqa: E402
from tests.lora_models import broken_adapter, make_adapter, tiny_base  # noqa: E402

ENGINE_FLAGS = ("--device", "cpu", "--quantization", "none", "--max-model-len", "128", "--temperature", "0")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(base, {name: adapter directory}); `broken` reads well and fails to load."""
    base = tiny_base("llama")
    alpha, beta = make_adapter(base, "alpha", seed=1), make_adapter(base, "beta", seed=2)
    broken = broken_adapter(alpha, tmp_path_factory.mktemp("broken-adapter"))
    return base, {"alpha": str(alpha), "beta": str(beta), "broken": str(broken)}


def lora_flags(base, paths) -> list:
    return ["--model", base, *ENGINE_FLAGS, "--lora-modules", *(f"{name}={path}" for name, path in paths.items())]


def llm_outputs(base, paths, cases: list[tuple[str, str | None, int]]) -> list:
    """LLM's output of each (prompt, adapter name or None, max_tokens)."""
    llm = LLM(str(base), device="cpu", quantization=None, enable_lora=True, max_loras=2, max_model_len=128)
    ids = {"alpha": 1, "beta": 2}
    outputs = llm.generate([prompt for prompt, _, _ in cases],
                           [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, _, n in cases],
                           use_tqdm=False,
                           lora_request=[name and LoRARequest(name, ids[name], paths[name]) for _, name, _ in cases])
    llm.client.shutdown()
    return [output.outputs[0] for output in outputs]


def named_rows(base, n: int) -> list[tuple[dict, str | None]]:
    """(row, its adapter): the first rows quick, the rest long enough that a job of two
    rows at a time is still at work when it is killed; two rows that fail."""
    ways = [({"model": "alpha"}, "alpha"), ({"lora": "beta"}, "beta"), ({}, None), ({"model": ""}, None),
            ({"model": str(base)}, None), ({"model": "beta", "lora": "alpha"}, "alpha")]
    cases = []
    for i in range(n):
        columns, adapter = ways[i % len(ways)]
        params = {"max_tokens": 3 if i < 8 else 90, "ignore_eos": True}
        cases.append(({"prompt": f"Story {i}: once upon a time", "sampling_params": params, **columns}, adapter))
    cases[4] = ({**cases[4][0], "model": "gamma"}, "gamma")  # written before the kill
    cases[21] = ({**cases[21][0], "lora": "broken"}, "broken")  # most likely after it
    return cases


def test_a_job_of_rows_naming_adapters_killed_and_resumed_runs_each_row_once_with_its_adapter(adapters, tmp_path):
    base, paths = adapters
    cases = named_rows(base, 30)
    source, target = write_jsonl(tmp_path / "in.jsonl", [row for row, _ in cases]), tmp_path / "out.jsonl"
    job = batch_job(source, "-o", target, "--batch-size", "2", "--max-concurrent-batches", "1",
                    *lora_flags(base, paths))
    try:
        wait_for_rows(job, target, 6)
        job.send_signal(signal.SIGKILL)
        job.wait()
    finally:
        job.kill()
    kept = [json.loads(line) for line in target.read_bytes().split(b"\n")[:-1]]  # (the kill may cut the last)
    assert 6 <= len(kept) < 30
    result = batch_main(source, "-o", target, "--resume", "--batch-size", "16", *lora_flags(base, paths))
    assert result.returncode == 0, result.stderr
    out = read_jsonl(target)
    assert [row["__row_id__"] for row in out] == list(range(30))  # each row once, in order
    assert out[:len(kept)] == kept
    assert f"({len(kept)} of them kept from before --resume)" in result.stderr
    good = [(i, row, adapter) for i, (row, adapter) in enumerate(cases) if adapter not in ("gamma", "broken")]
    expected = llm_outputs(base, paths, [(row["prompt"], adapter, row["sampling_params"]["max_tokens"])
                                         for _, row, adapter in good])
    for (i, row, _), completion in zip(good, expected):
        assert out[i][ERROR_COLUMN] == "" and out[i]["generated_tokens"] == completion.token_ids, out[i]
        assert {k: out[i].get(k) for k in ("model", "lora")} == {k: row.get(k) for k in ("model", "lora")}
    assert out[4][ERROR_COLUMN].startswith("RequestError: the row names the model 'gamma'")
    assert out[21][ERROR_COLUMN].startswith("LoRAAdapterError: LoRA adapter 'broken'"), out[21]
    assert "2 rows with errors" in result.stderr


def test_openai_batch_lines_naming_adapters_run_with_them(adapters, tmp_path):
    base, paths = adapters
    prompt = "the quick brown fox"

    def line(custom_id, model):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                "body": {"model": model, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}}

    models = {"a": "alpha", "b": "beta", "base": str(base), "none": "gamma", "bad": "broken"}
    source = write_jsonl(tmp_path / "in.jsonl", [line(custom_id, model) for custom_id, model in models.items()])
    result = batch_main(source, "-o", tmp_path / "out.jsonl", *lora_flags(base, paths))
    assert result.returncode == 0, result.stderr
    out = {record["custom_id"]: record["response"] for record in read_jsonl(tmp_path / "out.jsonl")}
    alpha, beta, plain = llm_outputs(base, paths, [(prompt, "alpha", 5), (prompt, "beta", 5), (prompt, None, 5)])
    for custom_id, completion in (("a", alpha), ("b", beta), ("base", plain)):
        assert out[custom_id]["status_code"] == 200, out[custom_id]
        body = out[custom_id]["body"]
        assert body["choices"][0]["text"] == completion.text and body["model"] == models[custom_id]
    assert len({alpha.text, beta.text, plain.text}) == 3
    assert out["none"]["status_code"] == 400 and "'gamma'" in out["none"]["body"]["error"]["message"]
    assert out["bad"]["status_code"] == 400 and out["bad"]["body"]["error"]["code"] == "LoRAAdapterError"


def test_lora_modules_flags_are_checked_before_the_model_loads(adapters, tmp_path):
    base, paths = adapters
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    for flags, says in [
            (["--lora-modules", "alpha"], "give each adapter as name=path"),
            (["--lora-modules", f"alpha={paths['alpha']}", f"alpha={paths['beta']}"], "names the adapter 'alpha' twice"),
            (["--lora-modules", f"alpha={paths['alpha']}", "--no-enable-lora"], "--no-enable-lora turns them off"),
            (["--lora-modules", f"alpha={paths['alpha']}", "--deployment-url", "http://127.0.0.1:9"],
             "a server serves its own"),
            (["--lora-modules", f"nope={tmp_path / 'missing'}"], "LoRA adapter 'nope'")]:
        result = batch_main(source, "-o", tmp_path / "out.jsonl", "--model", base, "--device", "cpu", *flags)
        assert result.returncode == 1 and says in result.stderr, result.stderr
        assert "--lora-modules" in result.stderr
        assert not (tmp_path / "out.jsonl").exists()
