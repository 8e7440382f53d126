"""The first run a newcomer sees, on a fresh cache: the CLI says what the engine's start
is doing (each step done once says where it is cached), and the summary keeps the
start apart from the throughput. A tiny GGUF model keeps it fast; the compiled C++
kernels are shared with the machine's cache (compiling them takes minutes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from gristmill.paths import cache_root
from tests.model.test_loader import write_tiny_gguf
from tests.test_layering import fresh_imports

FIGURES = re.compile(r"[\d.]+ rows/s, [\d.]+ generated tokens/s over [\d.]+ s of generation "
                     r"\(engine start: ([\d.]+) s, not counted\)")


def _fresh_cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    shared = cache_root() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(shared, target_is_directory=True)
    return cache


def _batch(tmp_path, model, cache):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"row {i} says"}) + "\n" for i in range(4)))
    env = {**os.environ, "GRISTMILL_CACHE": str(cache)}
    env.pop("GRISTMILL_FAULTS", None)
    return subprocess.run([sys.executable, "-m", "gristmill.cli", "batch", str(rows), "-o", str(tmp_path / "out.jsonl"),
                           "--model", str(model), "--device", "cpu", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300, env=env)


def test_a_fresh_cache_says_what_the_start_does_and_the_figures_leave_it_out(tmp_path):
    model = write_tiny_gguf(tmp_path / "models" / "tiny.gguf", "llama", "gpt2")
    cache = _fresh_cache(tmp_path)

    first = _batch(tmp_path, model, cache)
    assert first.returncode == 0, first.stderr
    err = first.stderr
    assert f"gristmill: reading tiny.gguf's config and tokenizer (once; cached in {cache / 'gguf'}" in err
    assert re.search(r"reading tiny.gguf's config and tokenizer: done in [\d.]+ s", err)
    # Its F32 layers and F16 output have no kernel that reads them as stored: int8, said at start.
    assert "gristmill: 7 matrices are F32 (e.g. blk.0." in err and "which no kernel multiplies as stored" in err
    assert "gristmill: 1 matrix is F16 (e.g. output.weight)" in err
    kernels = re.escape(str(cache / "kernels"))  # compiled here unless an earlier test did it
    assert re.search(rf"(compiling the C\+\+ kernels 'cpu_kernels' for this CPU \(once; cached in "
                     rf"|C\+\+ kernels 'cpu_kernels': cached in ){kernels}", err)
    assert re.search(r"gristmill: loading tiny-[0-9a-f]+ \(weights as stored\) on cpu \.\.\.", err)
    ready = re.search(r"gristmill: engine ready in ([\d.]+) s", err)
    assert ready
    # The bar starts with the rows, after the start-up messages.
    assert err.index("engine ready in") < err.index("gristmill batch:")
    figures = FIGURES.search(err.splitlines()[-1])
    assert figures, err.splitlines()[-1]
    assert "gristmill batch: 4 rows ok, 0 rows with errors" in err.splitlines()[-1]
    assert float(figures.group(1)) >= float(ready.group(1))

    again = _batch(tmp_path, model, cache)  # warm: nothing is done again, and it says where each is kept
    assert again.returncode == 0, again.stderr
    assert "(once;" not in again.stderr
    assert f"reading tiny.gguf's config and tokenizer: cached in {cache / 'gguf'}" in again.stderr
    assert not (cache / "quantized").exists()  # the weights are read from the GGUF file, never cached
    assert len(list((cache / "tokenizers").glob("*.pickle"))) == 1  # the tokenizer, kept by the first run
    assert FIGURES.search(again.stderr.splitlines()[-1])


def test_generate_keeps_the_start_apart_too(tmp_path):
    model = write_tiny_gguf(tmp_path / "models" / "tiny.gguf", "llama", "gpt2")
    env = {k: v for k, v in os.environ.items() if k != "GRISTMILL_FAULTS"}
    env["GRISTMILL_CACHE"] = str(_fresh_cache(tmp_path))
    result = subprocess.run([sys.executable, "-m", "gristmill.cli", "generate", "a", "b", "--model", str(model),
                             "--device", "cpu", "--max-tokens", "3"], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("2 prompts, 2 ok, 0 failed; ") and FIGURES.search(last), last
    assert "gristmill: engine ready in" in result.stderr


def test_the_tokenizer_is_kept_in_the_cache_and_a_damaged_copy_is_rebuilt(tmp_path, caplog):
    from gristmill.model.loader import resolve_model
    from gristmill.tokenizer import load_tokenizer

    cache = tmp_path / "cache"
    model_dir = resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "llama")), str(cache))
    text = "Hello, wörld!  <s> 123 \n\t tabs"
    built = load_tokenizer(model_dir, "llama", cache)
    [copy] = (cache / "tokenizers").iterdir()  # one file: the class's state and its Rust tokenizer
    written = copy.stat().st_mtime_ns
    loaded = load_tokenizer(model_dir, "llama", cache)  # from the copy: nothing written again
    assert copy.stat().st_mtime_ns == written
    assert type(loaded) is type(built) and loaded(text).input_ids == built(text).input_ids
    assert loaded.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    assert loaded.__dict__.keys() == built.__dict__.keys()
    assert loaded.decode(built(text).input_ids) == built.decode(built(text).input_ids)
    assert loaded.get_vocab() == built.get_vocab() and loaded.all_special_ids == built.all_special_ids

    copy.write_bytes(b"not a pickle")
    rebuilt = load_tokenizer(model_dir, "llama", cache)
    assert "ignoring unreadable cached tokenizer" in caplog.text
    assert rebuilt(text).input_ids == built(text).input_ids
    assert load_tokenizer(model_dir, "llama", cache)(text).input_ids == built(text).input_ids  # rewritten, readable

    (model_dir / "tokenizer_config.json").touch()  # a changed tokenizer file: a copy of its own
    load_tokenizer(model_dir, "llama", cache)
    assert len(list((cache / "tokenizers").glob("*.pickle"))) == 2


@pytest.mark.parametrize("model", ["gemma3 sentencepiece", "qwen2 byte-level", "bert wordpiece"])
def test_a_kept_rust_tokenizer_is_the_one_its_files_make(tmp_path, model):
    """The kept copy rebuilds a BPE tokenizer from its parts (vocabulary, merges, added
    tokens) and any other from its JSON; either way the very tokenizer its files make."""
    import pickle

    from gristmill.model.loader import resolve_model
    from gristmill.tokenizer import load_tokenizer

    cache = tmp_path / "cache"
    if model == "bert wordpiece":
        model_dir = resolve_model("all-MiniLM-L6-v2", str(cache))
    else:
        arch, vocab = {"gemma3 sentencepiece": ("gemma3", "llama"), "qwen2 byte-level": ("qwen2", "gpt2")}[model]
        model_dir = resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf", arch, vocab)), str(cache))
    built = load_tokenizer(model_dir, "x", cache)
    [copy] = (cache / "tokenizers").iterdir()
    assert pickle.loads(copy.read_bytes())[2][0] == ("json" if model == "bert wordpiece" else "bpe")
    loaded = load_tokenizer(model_dir, "x", cache)
    assert loaded.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    text = "Hello, wörld!  <|im_end|> <end_of_turn> 123 \n\t [CLS] tabs"
    assert loaded(text).input_ids == built(text).input_ids
    assert loaded.decode(built(text).input_ids, skip_special_tokens=True) == built.decode(
        built(text).input_ids, skip_special_tokens=True)


def test_a_client_on_a_warm_cache_imports_no_torch(tmp_path):
    # The engine's client side (what the server, a batch job or a Ray actor runs) needs
    # neither torch nor transformers' config classes once the model is converted and its
    # tokenizer kept: its core process loads the model. Run for real: an AsyncEngine with
    # its core, and a batch processor over a deployment of the engine.
    model = write_tiny_gguf(tmp_path / "models" / "tiny.gguf", "llama", "gpt2")
    code = ("import sys\nfrom gristmill.engine.async_engine import AsyncEngine\n"
            f"engine = AsyncEngine(model={str(model)!r}, device='cpu', max_model_len=128)\n"
            "text = engine.tokenizer.decode(engine.tokenizer('a b').input_ids)\n"
            "engine.shutdown()\n"
            "from gristmill import EngineConfig\n"
            "from gristmill.batch import DeploymentProcessorConfig, build_processor, deploy\n"
            f"with deploy(EngineConfig(model={str(model)!r}, device='cpu', max_model_len=128), name='tiny') as deployment:\n"
            "    rows = build_processor(DeploymentProcessorConfig(deployment_name=deployment.name,\n"
            "        sampling_params={'max_tokens': 3, 'temperature': 0, 'ignore_eos': True}))(\n"
            "        [{'prompt': f'row {i}'} for i in range(4)])\n"
            "assert [r['num_generated_tokens'] for r in rows] == [3] * 4, rows\n"
            "print('torch' in sys.modules, text)\n")
    cache = _fresh_cache(tmp_path)
    # What a first start leaves for the client, made here: the converted model and the kept
    # tokenizer (a whole cold run in a fresh cache: test_a_fresh_cache_says_what_the_start_does...).
    from gristmill.engine import builder
    from gristmill.model.loader import resolve_model
    tokenizer, _ = builder.load_tokenizer(resolve_model(str(model), str(cache)), str(cache))
    cold_text = tokenizer.decode(tokenizer("a b").input_ids)
    env = {k: v for k, v in os.environ.items() if k != "GRISTMILL_FAULTS"}
    env["GRISTMILL_CACHE"] = str(cache)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[0] == "False", run.stdout  # warm: the client never imported it
    assert run.stdout.split()[1:] == cold_text.split()  # the kept tokenizer is the same one


def test_the_clis_help_imports_no_torch():
    # In a fresh interpreter, one for all such checks (tests/test_layering.py).
    report = fresh_imports()["cli_help"]
    assert "--max-model-len" in report["stdout"] and "--json-schema" in report["stdout"]
    assert report["torch"] == []
