"""A request the engine core cannot unpickle (a SamplingParams subclass only the client's
`__main__` defines), or that the client cannot pickle, ends with an error naming why,
at once; the engine and the requests after it go on. (Before, the core dropped such a
message and its request waited forever.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from gristmill.engine import wire
from gristmill.engine.messages import Abort, AddRequest, AddRequests
from gristmill.sampling import SamplingParams

SCRIPT = textwrap.dedent("""
    import asyncio, threading
    from gristmill import AsyncEngine, RequestError, SamplingParams

    class Mine(SamplingParams):  # lives in this __main__ only: the core cannot unpickle it
        pass

    class Locked(str):  # a stop string that cannot be pickled
        pass

    stop = Locked("never-there")
    stop.lock = threading.Lock()
    engine = AsyncEngine(device="cpu", max_model_len=64)

    async def run(params):
        try:
            async for out in engine.generate("Hello there", params):
                pass
            return f"OK {out.finish_reason} {len(out.token_ids)}"
        except RequestError as exc:
            return f"ERROR {exc}"

    async def main():
        for params in (Mine(max_tokens=3, temperature=0), SamplingParams(max_tokens=3, temperature=0, stop=[stop]),
                       SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)):
            print(await asyncio.wait_for(run(params), 60), flush=True)

    asyncio.run(main())
    engine.shutdown()
""")


def test_requests_that_cannot_cross_to_the_core_end_with_an_error_and_the_engine_goes_on():
    env = {k: v for k, v in os.environ.items() if k != "GRISTMILL_FAULTS"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 3, run.stdout
    assert lines[0].startswith("ERROR the engine core could not read the request (AttributeError: Can't get "
                               "attribute 'Mine'"), lines[0]
    assert lines[1].startswith("ERROR the request could not be sent to the engine core (TypeError: cannot pickle "
                               "'_thread.lock' object)"), lines[1]
    assert lines[2] == "OK length 3"


def test_a_frame_names_its_request_even_when_its_message_is_unreadable():
    message = AddRequest("row-7", [1, 2, 3], SamplingParams(max_tokens=2), frozenset({1}))
    frame = wire.encode(message)
    assert wire.decode(frame) == message
    assert wire.decode(wire.encode(Abort(["a"]))) == Abort(["a"])
    broken = frame[:-5]
    try:
        wire.decode(broken)
    except wire.Unreadable as exc:
        assert exc.request_ids == ["row-7"] and exc.reason
    else:
        raise AssertionError("a truncated frame was read")
    # A request's n completions travel in one frame, which names every one of them.
    children = AddRequests([message, AddRequest("row-7#1", [1], SamplingParams(max_tokens=2), frozenset())])
    frame = wire.encode(children)
    assert wire.decode(frame) == children
    try:
        wire.decode(frame[:-5])
    except wire.Unreadable as exc:
        assert exc.request_ids == ["row-7", "row-7#1"] and exc.reason
    else:
        raise AssertionError("a truncated frame was read")
