"""Helpers shared by tests that watch real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from gristmill.engine.core_client import CORE_MODULE
from gristmill.engine.core_launcher import LAUNCHER_MODULE


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too, only not yet reaped
            return f.read().split()[2] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # (gone before, or while, it was read)
        return True


def core_children(parent_pid: int | None = None) -> list[int]:
    """Engine-core processes started by `parent_pid` (default: this process), from any
    of its threads: its children running the core, and those its core launcher forked."""
    found = []
    for child in _children(parent_pid or os.getpid()):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if CORE_MODULE.encode() in cmdline:
            found.append(child)
        elif LAUNCHER_MODULE.encode() in cmdline:
            found.extend(_children(child))
    return found


def _children(pid: int) -> list[int]:
    children = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    for task in tasks:
        try:
            children.extend(map(int, (task / "children").read_text().split()))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return children


def wait_for_core_child(timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = core_children()
        if found:
            return found[0]
        time.sleep(0.005)
    raise AssertionError("no engine-core process started")


def run_script(tmp_path: Path, source: str, timeout: float = 300,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `source` as a user's script file (python script.py) and return the result."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=env)


def transformers_dir(model_dir: Path) -> Path:
    """An HF directory transformers loads with the same weights as `model_dir`: itself,
    or for a GGUF's directory (whose weights stay in the GGUF file) the file converted to
    float32 safetensors beside it, once (two workers may convert at once: each into its
    own directory, the first rename wins)."""
    import shutil
    import tempfile

    from gristmill.model.loader import GGUF_LINK, convert_gguf

    if not (model_dir / GGUF_LINK).exists():
        return model_dir
    target = model_dir.parent / f"{model_dir.name}-transformers"
    if not (target / "config.json").exists():
        tmp = Path(tempfile.mkdtemp(dir=model_dir.parent, prefix=".tmp-"))
        convert_gguf((model_dir / GGUF_LINK).resolve(), tmp)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
