"""Measure the package as it was at another git revision, beside this tree, in one run.

A benchmark that offers `--before REV` calls `compare(__file__, REV, sys.argv[1:], ...)`:
it runs `script argv --json` (minus `--before REV`) in a child process for each side,
with that side's `gristmill` first on the path, reads the dict of figures each printed as
JSON on its last line, and prints them side by side with their ratios.

With `--rounds N`, each side is one process that stays up (its model loaded once) and
measures on each request; the sides take turns, before-after then after-before, N
times, and the medians are printed: on a machine whose speed drifts by tens of percent
from minute to minute, both sides then see the same drift.

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


def _side(script: str | Path, rev: str | None, argv: list[str]) -> tuple[list[str], dict, Path]:
    """(command, environment, working directory) of `script argv --json` run on the
    package at git revision `rev` (None: this tree)."""
    tree = revision_tree(rev) if rev is not None else ROOT
    # Run from inside that tree: an older core process appended its package root to
    # sys.path after the working directory, and would import this tree's package.
    return [sys.executable, str(Path(script).resolve()), *argv, "--json"], dict(os.environ, PYTHONPATH=str(tree)), tree


def measure_at(script: str | Path, rev: str | None, argv: list[str]) -> dict:
    """`script argv --json` in a child process, on the package at git revision `rev`
    (None: this tree); the dict it printed last."""
    command, env, cwd = _side(script, rev, argv)
    out = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True, cwd=cwd).stdout
    return json.loads(out.strip().splitlines()[-1])


def _serving(script: str | Path, rev: str | None, argv: list[str]) -> subprocess.Popen:
    """`script argv --json --serve` started as measure_at runs it: a process that prints
    one dict of figures per line it reads."""
    command, env, cwd = _side(script, rev, argv)
    return subprocess.Popen([*command, "--serve"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=cwd)


def _ask(process: subprocess.Popen) -> dict:
    """One measurement from a serving side."""
    process.stdin.write("measure\n")
    process.stdin.flush()
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"a side of the comparison exited (status {process.wait()})")
    return json.loads(line)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _interleaved(script: str | Path, rev: str, argv: list[str], rounds: int) -> tuple[list[dict], list[dict]]:
    """`rounds` measurements of each side, the two processes taking turns."""
    sides = [_serving(script, rev, argv), _serving(script, None, argv)]
    before, after = [], []
    try:
        for i in range(rounds):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for side in order:
                (before if side == 0 else after).append(_ask(sides[side]))
    finally:
        for process in sides:
            process.stdin.close()
            process.wait(60)
    return before, after


def compare(script: str | Path, rev: str, argv: list[str], label: str, digits: int = 1, rounds: int = 1) -> None:
    """Measure `script` at git revision `rev` and in this tree, and print each figure of
    both with its ratio. `argv`: the command line, `--before REV` included. `rounds` > 1:
    the sides take turns that many times; the medians are printed, with each side's range
    and the median of the rounds' own ratios."""
    argv = [a for a in argv if a != "--before" and a != rev and a != f"--before={rev}"]
    if rounds <= 1:
        before, after = measure_at(script, rev, argv), measure_at(script, None, argv)
        width = max(map(len, after)) + 2
        print(f"{label:>{width}} {rev:>12} {'this tree':>12} {'after/before':>13}")
        for name in after:
            print(f"{name:>{width}} {before[name]:>12.{digits}f} {after[name]:>12.{digits}f} "
                  f"{after[name] / before[name]:>12.2f}x")
        return
    befores, afters = _interleaved(script, rev, argv, rounds)
    width = max(map(len, afters[0])) + 2
    print(f"{rounds} rounds, the sides taking turns; medians (lowest-highest)")
    print(f"{label:>{width}} {rev:>24} {'this tree':>24} {'after/before':>13} {'rounds ratio':>13}")
    for name in afters[0]:
        b, a = [f[name] for f in befores], [f[name] for f in afters]
        spread = [f"{_median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})" for v in (b, a)]
        ratio = _median([y / x for x, y in zip(b, a)])
        print(f"{name:>{width}} {spread[0]:>24} {spread[1]:>24} {_median(a) / _median(b):>12.2f}x {ratio:>12.2f}x")


def add_revision_args(parser: argparse.ArgumentParser) -> None:
    """`--before REV`, and the hidden `--json` a compare runs each side with."""
    parser.add_argument("--before", metavar="REV", help="measure git revision REV too, side by side")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --before: the two sides take turns this many times, each in one process; "
                             "prints the medians")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)


def measure_or_compare(script: str | Path, args, measure, header: str, label: str, digits: int = 1) -> dict | None:
    """What a benchmark's main does first. With --json (one side of a compare) print
    `measure(args)` as JSON; else print `header` and, with --before REV, compare REV with
    this tree. Returns the figures of a plain run, for the benchmark to print; else None."""
    if args.json:
        if args.serve:  # one side of a comparison in rounds: a measurement per line read
            for _ in sys.stdin:
                print(json.dumps(measure(args)), flush=True)
        else:
            print(json.dumps(measure(args)))
        return None
    print(header, flush=True)
    if args.before:
        compare(script, args.before, sys.argv[1:], label=label, digits=digits, rounds=args.rounds)
        return None
    return measure(args)
