"""The Ray faces at their edges: rows whose columns Arrow cannot merge, small clusters
that would wait for ever, and fields a Serve deployment cannot honour."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import ray
from ray import serve

from gristmill import EngineConfig
from gristmill.batch import ERROR_COLUMN, EngineProcessorConfig, build_processor
from gristmill.errors import RequestError
from gristmill.ray import deploy
from tests.on_ray.conftest import ENGINE, GREEDY, by_key, tiny_engine

pytestmark = pytest.mark.timeout(180)

EXCLAMATION, LETTER_I = 0, 40  # two tokens of the tiny model's vocabulary


def test_rows_whose_columns_arrow_cannot_merge_get_the_local_runners_results(tiny_model):
    # One row per block (from_items): Ray Data merges the blocks' Arrow types when it batches
    # them. Each row's logit_bias forces its own token; merged, each also held the other's
    # key as null (an error row), an int-keyed one failed the job, and so did a `messages`
    # string among lists. The tiny model: the runners' results are compared, whatever the model.
    rows = [
        {"key": 0, "prompt": "Hello there", "sampling_params": {**GREEDY, "logit_bias": {str(EXCLAMATION): 100}}},
        {"key": 1, "prompt": "Hello there", "sampling_params": {**GREEDY, "logit_bias": {str(LETTER_I): 100}}},
        {"key": 2, "prompt": "Hello there", "sampling_params": {**GREEDY, "logit_bias": {EXCLAMATION: 100}}},
        {"key": 3, "messages": "Name a colour.", "sampling_params": dict(GREEDY)},
        {"key": 4, "messages": [{"role": "user", "content": "Name a colour."}], "sampling_params": dict(GREEDY)},
        {"key": 5, "prompt": "Is the sky blue? Answer:",
         "sampling_params": {"max_tokens": 6, "temperature": 0, "structured_output": {"choice": ["yes", "no"]}}},
    ]
    config = EngineProcessorConfig(engine=tiny_engine(tiny_model), should_continue_on_error=True, batch_size=8,
                                   id_column="key")
    out = by_key(build_processor(config)(ray.data.from_items(rows)).take_all())
    assert sorted(out) == list(range(6))  # every row, once: none failed the job
    assert list(out[0]["generated_tokens"]) == [EXCLAMATION] * 6 and out[0][ERROR_COLUMN] == ""
    assert list(out[1]["generated_tokens"]) == [LETTER_I] * 6 and out[1][ERROR_COLUMN] == ""
    assert list(out[2]["generated_tokens"]) == [EXCLAMATION] * 6
    assert out[3][ERROR_COLUMN].startswith("RequestError: messages must be a non-empty list")
    assert out[4][ERROR_COLUMN] == "" and out[4]["num_generated_tokens"] == 6
    assert out[5]["generated_text"] in ("yes", "no")

    local = by_key(build_processor(config)(rows))
    for key, row in local.items():
        assert (out[key]["generated_text"], list(out[key]["generated_tokens"]), out[key][ERROR_COLUMN]) == \
            (row["generated_text"], row["generated_tokens"], row[ERROR_COLUMN])


def test_stages_that_can_never_run_at_once_fail_at_once_saying_what_to_change():
    started = time.monotonic()
    config = EngineProcessorConfig(engine=ENGINE)
    # Two processors of one engine actor each, chained: 2 actors + a map task on 2 CPUs
    # waited for ever (the first processor's template task never got a CPU).
    turn1 = build_processor(config)(ray.data.from_items([{"prompt": "Hi"}]))
    with pytest.raises(RequestError, match=r"needs 3 CPUs at once on Ray \(1 actor\(s\) x num_cpus=1 \+ 1 for a map "
                                           r"task \+ 1 held by the actors of this Dataset's earlier stages .* "
                                           r"share one engine instead: gristmill.ray.deploy"):
        build_processor(config)(turn1)
    smaller = EngineProcessorConfig(engine=ENGINE, ray_actor_options={"num_cpus": 0.5})
    assert isinstance(build_processor(smaller)(build_processor(smaller)(ray.data.from_items([{"prompt": "Hi"}]))),
                      ray.data.Dataset)
    gpu = EngineProcessorConfig(engine=ENGINE, ray_actor_options={"num_cpus": 0, "num_gpus": 1})
    with pytest.raises(RequestError, match=r"needs 1 GPUs at once on Ray .* but the cluster has 0"):
        build_processor(gpu)(ray.data.from_items([{"prompt": "Hi"}]))
    # An engine on "cuda" whose actors would get no GPU (Ray hides them): refused now, not in each actor.
    cuda = EngineProcessorConfig(engine=EngineConfig(model=ENGINE.model, device="cuda"))
    with pytest.raises(RequestError, match=r"device is 'cuda' but its actors get no GPU \(the Ray cluster has none\)"):
        build_processor(cuda)(ray.data.from_items([{"prompt": "Hi"}]))
    with pytest.raises(RequestError, match=r"device is 'cuda' but its actors get no GPU"):
        deploy(EngineConfig(model=ENGINE.model, device="cuda"), name="on-gpu", app_name="on-gpu-app")
    missing = EngineProcessorConfig(engine=EngineConfig(model="/nonexistent/model", device="cpu"))
    with pytest.raises(FileNotFoundError, match="model '/nonexistent/model' not found"):
        build_processor(missing)(ray.data.from_items([{"prompt": "Hi"}]))
    assert time.monotonic() - started < 5


def test_a_deploy_whose_cpus_others_hold_fails_in_seconds_instead_of_waiting_for_ever():
    @ray.remote(num_cpus=2)
    class Holder:
        pass

    holder = Holder.remote()
    ray.get(holder.__ray_ready__.remote(), timeout=60)
    try:
        started = time.monotonic()
        with pytest.raises(RequestError, match=r"deploy: 1 replica\(s\) x num_cpus=1 need 1 CPUs but only 0 of the "
                                               r"Ray cluster's 2 are free: others hold the rest"):
            deploy(ENGINE, name="no-room", app_name="no-room", ray_actor_options={"num_cpus": 1})
        assert time.monotonic() - started < 20
    finally:
        ray.kill(holder)
    assert "no-room" not in serve.status().applications


def test_a_ray_client_address_nothing_answers_at_fails_in_seconds(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "gristmill.cli", "batch", str(source), "-o", str(tmp_path / "o.jsonl"),
                             "--runner", "ray", "--address", "ray://127.0.0.1:9"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "error: EngineDeadError: no Ray cluster answers at ray://127.0.0.1:9 (ConnectionRefusedError" in result.stderr
    assert time.monotonic() - started < 20  # Ray Client itself gave up after 30 s, saying only "timeout"
