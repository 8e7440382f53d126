"""Measure the package as it was at another git revision, beside this tree, in one run.

A benchmark that offers `--before REV` calls `compare(__file__, REV, sys.argv[1:], ...)`:
it runs `script argv --json` (minus `--before REV`) in a child process for each side,
with that side's `gristmill` first on the path, reads the dict of figures each printed as
JSON on its last line, and prints them side by side with their ratios.

A revision's tree is extracted once into the temporary directory, under its commit id,
and kept: its C++ kernels are built for its own path (gristmill.model.cpu.kernels keys a
build by where its sources are), so a second run reuses them instead of compiling again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def revision_tree(rev: str) -> Path:
    """The package at git revision `rev`, extracted once."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"gristmill-rev-{commit[:12]}"
    if not tree.exists():
        partial = Path(tempfile.mkdtemp(prefix=f"{tree.name}-", dir=tree.parent))
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(partial)], input=archive, check=True)
        try:
            partial.rename(tree)
        except OSError:  # another run extracted it meanwhile
            subprocess.run(["rm", "-rf", str(partial)], check=True)
    return tree


def measure_at(script: str | Path, rev: str | None, argv: list[str]) -> dict:
    """`script argv --json` in a child process, on the package at git revision `rev`
    (None: this tree); the dict it printed last."""
    tree = revision_tree(rev) if rev is not None else ROOT
    env = dict(os.environ, PYTHONPATH=str(tree))
    # Run from inside that tree: an older core process appended its package root to
    # sys.path after the working directory, and would import this tree's package.
    out = subprocess.run([sys.executable, str(Path(script).resolve()), *argv, "--json"], env=env,
                         check=True, stdout=subprocess.PIPE, text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(script: str | Path, rev: str, argv: list[str], label: str, digits: int = 1) -> None:
    """Measure `script` at git revision `rev` and in this tree, and print each figure of
    both with its ratio. `argv`: the command line, `--before REV` included."""
    argv = [a for a in argv if a != "--before" and a != rev and a != f"--before={rev}"]
    before, after = measure_at(script, rev, argv), measure_at(script, None, argv)
    width = max(map(len, after)) + 2
    print(f"{label:>{width}} {rev:>12} {'this tree':>12} {'after/before':>13}")
    for name in after:
        print(f"{name:>{width}} {before[name]:>12.{digits}f} {after[name]:>12.{digits}f} "
              f"{after[name] / before[name]:>12.2f}x")


def add_revision_args(parser: argparse.ArgumentParser) -> None:
    """`--before REV`, and the hidden `--json` a compare runs each side with."""
    parser.add_argument("--before", metavar="REV", help="measure git revision REV too, side by side")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def measure_or_compare(script: str | Path, args, measure, header: str, label: str, digits: int = 1) -> dict | None:
    """What a benchmark's main does first. With --json (one side of a compare) print
    `measure(args)` as JSON; else print `header` and, with --before REV, compare REV with
    this tree. Returns the figures of a plain run, for the benchmark to print; else None."""
    if args.json:
        print(json.dumps(measure(args)))
        return None
    print(header, flush=True)
    if args.before:
        compare(script, args.before, sys.argv[1:], label=label, digits=digits)
        return None
    return measure(args)
