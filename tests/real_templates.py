"""The chat templates Qwen3, Qwen2.5, Llama 3.1, Llama 3.2 and Gemma 3 ship with, for
tests, read from PyPI packages that carry copies of them: llama-cpp-python's source
archive (llama.cpp's `models/templates/`: Qwen3-0.6B's, Qwen2.5-7B-Instruct's,
Llama-3.1-8B-Instruct's and Llama-3.2-3B-Instruct's) and axolotl's wheel
(`utils/chat_templates/templates/gemma3.jinja`: Gemma 3 instruct's; the bundled Gemma 3
270M is the base model, which has none). Each archive is pinned by version and sha256;
only the templates are kept, in TEMPLATE_DIR.

`make test` fetches them while it installs (`python -m tests.real_templates`); a test that
finds one missing fetches it then, and fails saying what to run where it cannot."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

_FILES = "https://files.pythonhosted.org/packages/"


@dataclass(frozen=True)
class Archive:
    requirement: str  # (what `pip download` would be asked for, where the file host is out of reach)
    url: str
    sha256: str

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[1]


LLAMA_CPP_PYTHON = Archive(
    "llama-cpp-python==0.3.36",
    _FILES + "ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz",
    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
AXOLOTL = Archive(
    "axolotl==0.21.0",
    _FILES + "32/16/f6e67d38be4f4e36665244f67ed4ca6ecf85d7768967ccc7e11037f42f0c/axolotl-0.21.0-py3-none-any.whl",
    "5db0468897d1f3a80fa2becc80dd4409f378ce887dcb2c98854dc70b38196391")
#: Our name -> the archive holding the template, and its path there.
TEMPLATES = {
    "qwen3": (LLAMA_CPP_PYTHON, "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja"),
    "llama3.1": (LLAMA_CPP_PYTHON,
                 "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "llama3.2": (LLAMA_CPP_PYTHON,
                 "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja"),
    "qwen2.5": (LLAMA_CPP_PYTHON,
                "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"),
    "gemma3": (AXOLOTL, "axolotl/utils/chat_templates/templates/gemma3.jinja"),
}
#: Where tests keep what they fetch (tests/gguf_converter.py keeps llama.cpp's converter here too).
TEST_DATA = Path(os.environ.get("GRISTMILL_TEST_DATA", Path.home() / ".cache" / "gristmill-test-data"))
TEMPLATE_DIR = TEST_DATA / "chat-templates"


def _path(name: str) -> Path:
    archive, member = TEMPLATES[name]
    return TEMPLATE_DIR / archive.sha256[:16] / member.rsplit("/", 1)[1]


def template(name: str) -> str:
    """The text of the real chat template TEMPLATES[name], fetched first if it is not here."""
    if not _path(name).exists():
        try:
            fetch()
        except Exception as error:
            raise RuntimeError(f"the real {name} chat template could not be fetched ({error}); run "
                               f"`python -m tests.real_templates` with access to PyPI") from error
    return _path(name).read_text(encoding="utf-8")


def fetch() -> None:
    """Each archive a missing template is in: downloaded, checked against its sha256, and
    its templates kept."""
    for archive in {archive for name, (archive, _) in TEMPLATES.items() if not _path(name).exists()}:
        members = {member: _path(name) for name, (held_in, member) in TEMPLATES.items() if held_in == archive}
        with tempfile.TemporaryDirectory() as work:
            path = download(archive, Path(work))
            for member, text in _read(path, set(members)).items():
                members[member].parent.mkdir(parents=True, exist_ok=True)
                # (staged under a name of its own: two processes may fetch at once)
                with tempfile.NamedTemporaryFile(dir=members[member].parent, delete=False) as staged:
                    staged.write(text)
                Path(staged.name).replace(members[member])
        missing = [member for member, path in members.items() if not path.exists()]
        if missing:
            raise ValueError(f"{archive.filename} holds no {', '.join(missing)}")


def download(archive: Archive, work: Path) -> Path:
    """`archive` downloaded into the folder `work` (straight from PyPI's file host, else
    through pip and its configured indexes); ValueError where its sha256 is not the pinned one."""
    path = work / archive.filename
    try:
        with urllib.request.urlopen(archive.url, timeout=60) as response, open(path, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except OSError:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(work),
                        *(["--no-binary", ":all:"] if path.suffix == ".gz" else ["--only-binary", ":all:"]),
                        archive.requirement], check=True, capture_output=True, timeout=600)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != archive.sha256:
        raise ValueError(f"{archive.filename} has sha256 {digest}, expected {archive.sha256}")
    return path


def _read(path: Path, members: set[str]) -> dict[str, bytes]:
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            return {member: wheel.read(member) for member in members if member in wheel.namelist()}
    with tarfile.open(path, "r:gz") as tar:
        return {member.name: tar.extractfile(member).read() for member in tar if member.name in members}


if __name__ == "__main__":
    fetch()
    print(f"chat templates in {TEMPLATE_DIR}: {', '.join(str(_path(name).name) for name in sorted(TEMPLATES))}")
