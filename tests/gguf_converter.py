"""llama.cpp's own HF -> GGUF converter, for tests: `convert_hf_to_gguf.py` (and
`convert_lora_to_gguf.py`, its PEFT adapter -> LoRA GGUF one), its `conversion/` package and the `gguf-py` it is written against, with the vocabulary-only
GGUF files of real models llama.cpp ships for its tokenizer tests
(`models/ggml-vocab-*.gguf`: Llama 3's, Qwen2's, and the texts and token ids beside them).
All are read from llama-cpp-python's source archive (tests.real_templates.LLAMA_CPP_PYTHON,
pinned by sha256) into CONVERTER_DIR once.

`make test` fetches them while it installs (`python -m tests.gguf_converter`); a test that
finds them missing fetches them then, and fails saying what to run where it cannot."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tests.real_templates import LLAMA_CPP_PYTHON, TEST_DATA, download

_ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
# What is kept of the archive, by path under _ROOT (a name ending in "/": all under it;
# otherwise the file and those beside it whose names go on from it: ".inp", ".out").
_KEPT = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/gguf/",
         "models/ggml-vocab-llama-bpe.gguf", "models/ggml-vocab-qwen2.gguf")
# (named by what it keeps too: a cache fetched before something was added is fetched again)
CONVERTER_DIR = TEST_DATA / "llama.cpp" / (
    LLAMA_CPP_PYTHON.sha256[:16] + "-" + hashlib.sha256("\n".join(_KEPT).encode()).hexdigest()[:8])

# Runs convert_hf_to_gguf.py's main once per "model<TAB>outfile" line of its input, in one
# process: torch, transformers and the converter are imported once, while the models to
# convert are still being written.
_DRIVER = """
import runpy, sys
import conversion, torch, transformers.models.auto.tokenization_auto
script, outtype = sys.argv[1:]
for line in sys.stdin:
    model, outfile = line.rstrip("\\n").split("\\t")
    sys.argv = [script, model, "--outfile", outfile, "--outtype", outtype]
    runpy.run_path(script, run_name="__main__")
"""


def converter_dir() -> Path:
    """CONVERTER_DIR, fetched first if it is not here."""
    if not CONVERTER_DIR.exists():
        try:
            fetch()
        except Exception as error:
            raise RuntimeError(f"llama.cpp's converter could not be fetched ({error}); run "
                               f"`python -m tests.gguf_converter` with access to PyPI") from error
    return CONVERTER_DIR


def vocab_file(name: str) -> Path:
    """llama.cpp's vocabulary-only GGUF of a real model: "llama-bpe" (Llama 3), "qwen2"."""
    return converter_dir() / "models" / f"ggml-vocab-{name}.gguf"


class Converter:
    """llama.cpp's convert_hf_to_gguf.py in a process of its own, which imports the gguf-py
    beside it (not the venv's gguf): `submit` each (HF model directory, GGUF path) as it is
    ready; leaving the `with` block waits for every file (RuntimeError with the converter's
    output where it failed)."""

    def __init__(self, outtype: str = "f32", timeout_s: float = 600):
        root = converter_dir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "gguf-py"), str(root)])}
        env.pop("NO_LOCAL_GGUF", None)
        self.timeout_s = timeout_s
        self._log = tempfile.TemporaryFile()  # (it logs every setting and template it writes)
        self._process = subprocess.Popen(
            [sys.executable, "-c", _DRIVER, str(root / "convert_hf_to_gguf.py"), outtype],
            env=env, stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, text=True)

    def submit(self, model_dir: Path, gguf_path: Path) -> None:
        try:
            self._process.stdin.write(f"{model_dir}\t{gguf_path}\n")
            self._process.stdin.flush()
        except BrokenPipeError:  # (it failed on an earlier model)
            raise self._failure(self._process.wait(self.timeout_s)) from None

    def __enter__(self) -> Converter:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        try:
            if error_type is not None:
                self._process.kill()
            with contextlib.suppress(BrokenPipeError):
                self._process.stdin.close()
            returncode = self._process.wait(self.timeout_s)
            if error_type is None and returncode != 0:
                raise self._failure(returncode)
        finally:
            self._log.close()

    def _failure(self, returncode: int) -> RuntimeError:
        self._log.seek(0)
        output = self._log.read().decode("utf-8", "replace")
        return RuntimeError(f"convert_hf_to_gguf.py failed (exit {returncode}):\n{output[-4000:]}")


def convert_lora(adapter_dir: Path, base_dir: Path, gguf_path: Path, outtype: str = "f32") -> Path:
    """llama.cpp's convert_lora_to_gguf.py: the PEFT adapter `adapter_dir` over the HF model
    `base_dir` as a LoRA GGUF file, as llama.cpp users make one."""
    root = converter_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "gguf-py"), str(root)])}
    env.pop("NO_LOCAL_GGUF", None)
    result = subprocess.run([sys.executable, str(root / "convert_lora_to_gguf.py"), "--base", str(base_dir),
                             "--outfile", str(gguf_path), "--outtype", outtype, str(adapter_dir)],
                            env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf.py failed (exit {result.returncode}):\n"
                           f"{(result.stdout + result.stderr)[-4000:]}")
    return gguf_path


def _kept(name: str) -> str | None:
    """The path under CONVERTER_DIR of archive member `name`, or None where it is not kept."""
    if not name.startswith(_ROOT):
        return None
    path = name[len(_ROOT):]
    return path if any(path.startswith(kept) for kept in _KEPT) else None


def fetch() -> None:
    """The archive downloaded, checked against its sha256, and what _KEPT names written to
    CONVERTER_DIR (staged beside it and renamed into place: two processes may fetch at once)."""
    CONVERTER_DIR.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CONVERTER_DIR.parent, prefix=".fetch-") as work:
        archive = download(LLAMA_CPP_PYTHON, Path(work))
        staged = Path(work) / "llama.cpp"
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                path = _kept(member.name)
                if path is None or not member.isfile():
                    continue
                (staged / path).parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as source, open(staged / path, "wb") as out:
                    shutil.copyfileobj(source, out)
        missing = [kept for kept in _KEPT if not (staged / kept).exists()]
        if missing:
            raise ValueError(f"{LLAMA_CPP_PYTHON.filename} holds no {', '.join(missing)}")
        try:
            staged.rename(CONVERTER_DIR)
        except OSError:
            if not CONVERTER_DIR.exists():
                raise


if __name__ == "__main__":
    print(f"llama.cpp's converter in {converter_dir()}")
