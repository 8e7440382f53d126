"""A benchmark side's process, measured (benchmarks/sizes.py): its wall time, its peak
resident memory (the kernel's high-water mark, VmHWM, polled while it runs: `wait4`'s
ru_maxrss would start from this process's own peak, as a child spawned by vfork inherits
it across exec), and the first line of why it failed. It is bounded by a timeout and by
a cap on its resident memory, so that a side that would run out of memory is stopped
before the machine's OOM killer picks a victim."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Finished:
    output: str  # stdout then stderr
    seconds: float
    peak_rss_bytes: int
    failure: str | None  # the first line of why it failed; None when it exited 0


def run_measured(command: list[str], timeout_s: float, max_rss_bytes: int, env: dict | None = None) -> Finished:
    """Run `command` to its end, its output in temporary files (no pipe to fill), polling
    its resident memory; past `max_rss_bytes` or `timeout_s` its process group is killed."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env, start_new_session=True)
        stopped, peak = None, 0
        while True:
            pid, status = os.waitpid(process.pid, os.WNOHANG)
            if pid:
                break
            rss, peak_now = _memory(process.pid)
            peak = max(peak, peak_now)
            if stopped is None and rss > max_rss_bytes:
                stopped = f"out of memory: over the {max_rss_bytes / 2**30:.0f} GiB cap (--max-rss-gb)"
            elif stopped is None and time.perf_counter() - start > timeout_s:
                stopped = f"timed out after {timeout_s:.0f} s (--timeout)"
            if stopped is not None:
                os.killpg(process.pid, signal.SIGKILL)
            time.sleep(0.05)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)  # (reaped here, not by Popen)
        out.seek(0)
        err.seek(0)
        output = out.read() + err.read()
    failure = stopped or (None if process.returncode == 0 else _failure_line(output, process.returncode))
    return Finished(output, seconds, peak, failure)


def _memory(pid: int) -> tuple[int, int]:
    """(resident bytes, the high-water mark of resident bytes) of process `pid`; zeros
    once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as status:
            found = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status
                     if line.startswith(("VmRSS:", "VmHWM:"))}
        return found.get("VmRSS", 0), found.get("VmHWM", 0)
    except OSError:
        return 0, 0


def _failure_line(output: str, returncode: int) -> str:
    if returncode == -signal.SIGKILL:
        return "killed (SIGKILL: the kernel's OOM killer?)"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    error = next((line for line in lines if re.search(r"\berror\b", line, re.IGNORECASE)), None)
    return error or (lines[-1] if lines else f"exit code {returncode}")
