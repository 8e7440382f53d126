"""Structured output through LLM.generate on the real bundled Gemma 3 270M: every kind of
constraint yields text that matches it, ending with "stop"; constraints are checked where
SamplingParams are built; the constrained rows of a batch leave the others untouched; a
constraint that cannot be satisfied ends only its request, with GenerationError; and with
async scheduling (the CUDA default) the outputs are the same."""

from __future__ import annotations

import json
import random
import re

import pytest

from gristmill import RequestError, SamplingParams
from gristmill.structured.spec import Constraint, parse_constraint

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"], "additionalProperties": False}

CASES = [
    ("Describe a person as JSON:", {"json": PERSON}),
    ("Is the sky blue? Answer:", {"choice": ["yes", "no"]}),
    ("Call me at", {"regex": "[0-9]{3}-[0-9]{4}"}),
    ("Q: what is 6 times 7? A:", {"grammar": 'root ::= "The answer is " [0-9]+ "."'}),
]


def _params(structured_output, **options):
    return SamplingParams(**{"max_tokens": 60, "temperature": 0, **options}, structured_output=structured_output)


def _check(text: str, structured_output: dict) -> None:
    kind, spec = next(iter(structured_output.items()))
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 20
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
        assert list(value) == list(PERSON["properties"])  # the schema's property order
    elif kind == "choice":
        assert text in spec
    elif kind == "regex":
        assert re.fullmatch(spec, text)
    else:
        assert re.fullmatch(r"The answer is [0-9]+\.", text)


def test_every_kind_of_constraint_is_met_and_ends_with_stop(default_llm):
    free = SamplingParams(max_tokens=12, temperature=0)
    prompts = [p for p, _ in CASES] + ["Once upon a time"]
    alone = default_llm.generate(["Once upon a time"], free, use_tqdm=False)[0]
    outs = default_llm.generate(prompts, [_params(so) for _, so in CASES] + [free], use_tqdm=False)
    for out, (_, structured_output) in zip(outs, CASES):
        assert out.finish_reason == "stop", (out.text, out.outputs[0].error)
        _check(out.text, structured_output)
    # The unconstrained row of the batch is what it is alone.
    assert outs[-1].token_ids == alone.token_ids


def test_async_scheduling_gives_the_same_constrained_outputs(default_llm):
    prompts = [p for p, _ in CASES]
    params = [_params(so) for _, so in CASES]
    sync = default_llm.generate(prompts, params, use_tqdm=False)
    default_llm.core.async_scheduling = True
    try:
        asynchronous = default_llm.generate(prompts + ["Free:"], params + [SamplingParams(max_tokens=8)],
                                            use_tqdm=False)
    finally:
        default_llm.core.async_scheduling = False
    assert [o.token_ids for o in asynchronous[:-1]] == [o.token_ids for o in sync]


def test_asking_the_grammar_about_the_argmax_first_changes_no_output(default_llm):
    """On a CPU, greedy constrained rows fill a mask only when the grammar refuses the
    row's argmax (and once per grammar state): the same tokens as masking every row."""
    prompts = [p for p, _ in CASES] + [f"Record {i}: a person as JSON:" for i in range(8)]
    params = [_params(so) for _, so in CASES] + [_params({"json": PERSON})] * 8
    runner = default_llm.core.executor
    assert runner.argmax_first
    before = list(runner.masks.stats)
    first = default_llm.generate(prompts, params, use_tqdm=False)
    steps, rows, filled = (after - start for after, start in zip(runner.masks.stats, before))
    runner.argmax_first = False
    try:
        every = default_llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.argmax_first = True
    assert [o.token_ids for o in first] == [o.token_ids for o in every]
    for out, params_of in zip(first, params):
        assert out.finish_reason == "stop", out.outputs[0].error
        _check(out.text, params_of.structured_output)
    # Most rows needed no mask, and rows in one grammar state shared theirs.
    total_rows = sum(len(o.token_ids) for o in first)
    assert rows < total_rows / 2 and filled < rows, (steps, rows, filled, total_rows)


def test_sampled_rows_resampled_after_a_refusal_keep_the_masked_distribution(default_llm):
    """Sampled constrained rows (no top-k/top-p/min-p, no logprobs) are drawn unmasked and
    drawn again from the masked row only when the grammar refuses: the outputs still
    match, and the distribution is the masked one (200 seeds, the same share of each
    answer as when every row is masked)."""
    runner = default_llm.core.executor
    prompt = "Is the sky blue? Answer:"
    # Answers the model itself likes (about half its mass), so that many first draws
    # are allowed and many refused: both paths of the sampler run.
    answers = [" Yes", " No", " yes", " no"]
    params = [_params({"choice": answers}, temperature=1.0, seed=seed) for seed in range(200)]
    before = list(runner.masks.stats)
    outs = default_llm.generate([prompt] * 200, params, use_tqdm=False)
    drawn, sampled_rows = [o.text for o in outs], sum(len(o.token_ids) for o in outs)
    rows_masked = runner.masks.stats[1] - before[1]
    runner.argmax_first = False
    try:
        masked = [o.text for o in default_llm.generate([prompt] * 200, params, use_tqdm=False)]
    finally:
        runner.argmax_first = True
    assert set(drawn) <= set(answers) and set(masked) <= set(answers)
    assert 0 < rows_masked < sampled_rows  # some rows were masked, some never
    for answer in answers:  # binomial, n=200: 3 standard deviations of the difference
        share, expected = drawn.count(answer) / 200, masked.count(answer) / 200
        assert abs(share - expected) <= 3 * (2 * 0.25 / 200) ** 0.5, (answer, share, expected)


def test_seeded_sampling_n_and_logprobs_under_a_constraint(default_llm):
    params = _params({"choice": ["red", "green", "blue"]}, temperature=1.0, seed=7, n=3, logprobs=2)
    [out] = default_llm.generate(["My favourite colour is"], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert completion.text in ("red", "green", "blue") and completion.finish_reason == "stop"
        assert len(completion.logprobs) == len(completion.token_ids)
    [again] = default_llm.generate(["My favourite colour is"], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_a_json_cut_off_by_max_tokens_ends_with_length(default_llm):
    [out] = default_llm.generate(["Describe a person as JSON:"], _params({"json": PERSON}, max_tokens=4),
                                 use_tqdm=False)
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and out.text.startswith("{")


def test_a_finished_grammar_ends_its_request_even_when_eos_is_ignored(default_llm):
    outs = default_llm.generate(["Say yes:", "Once upon a time"],
                                [_params({"choice": ["yes"]}, ignore_eos=True, max_tokens=8),
                                 SamplingParams(max_tokens=8, temperature=0)], use_tqdm=False)
    assert outs[0].text == "yes" and outs[0].finish_reason == "stop"
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8


def test_an_unsatisfiable_constraint_fails_only_its_request_and_frees_its_blocks(default_llm):
    # A regex that parses but matches nothing (an empty class intersection): the grammar
    # engine finds no token to allow at the first step.
    nothing = {"regex": "[a&&b]"}
    core = default_llm.core
    free_before = core.block_manager.num_free_blocks
    free = SamplingParams(max_tokens=8, temperature=0)
    alone = default_llm.generate(["Once upon a time"], free, use_tqdm=False)[0]
    outs = default_llm.generate(["Anything:", "Once upon a time"], [_params(nothing), free], use_tqdm=False)
    assert outs[0].finish_reason == "error"
    assert outs[0].outputs[0].error.startswith("GenerationError: the structured output constraint allows no "
                                               "token after 0 generated tokens; it cannot be satisfied")
    assert outs[1].token_ids == alone.token_ids and outs[1].finish_reason == "length"
    assert core.block_manager.num_free_blocks == free_before
    assert core.scheduler.num_constrained == 0


@pytest.mark.parametrize("value,says", [
    ({"regex": "[0-9"}, 'structured_output.regex is not valid: at 1(8): invalid regex "[0-9" (in regex): '
                        "regex parse error: unclosed character class"),
    ({"json": {"type": "objectx"}}, "structured_output.json is not valid: Invalid type: objectx"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 3}}, "structured_output.json is not valid: "
                                                                "Unsatisfiable schema"),
    ({"json": "{not json"}, "structured_output.json is not valid JSON"),
    ({"grammar": 'root ::= "a'}, "structured_output.grammar is not valid"),
    ({"choice": []}, "structured_output.choice must be a non-empty list"),
    ({"json_object": False}, "structured_output.json_object must be true"),
    ({"json": {}, "regex": "a"}, "exactly one of json, json_object, regex, choice, grammar"),
    ("json", "must be an object with exactly one of"),
])
def test_invalid_constraints_are_request_errors_where_params_are_built(value, says):
    with pytest.raises(RequestError, match=re.escape(says)) as info:
        SamplingParams(structured_output=value)
    assert info.value.param == "structured_output"
    assert "\n" not in str(info.value)  # one line


def test_constraint_normal_form():
    assert parse_constraint(None) is None
    assert parse_constraint({"json": '{"type": "object"}'}) == Constraint("json", '{"type":"object"}')
    assert parse_constraint({"choice": ["a", "b"]}) == Constraint("choice", '["a", "b"]')
    assert parse_constraint({"json_object": True}).kind == "json_object"
    # A row read through Arrow carries the other kinds of its block as None.
    assert SamplingParams(structured_output={"choice": ["a"], "regex": None}).structured_output == {"choice": ["a"]}
    assert SamplingParams(structured_output={"choice": None, "regex": None}).structured_output is None
    with pytest.raises(RequestError, match="exactly one of"):
        SamplingParams(structured_output={"choice": ["a"], "regex": "[0-9]"})


def test_the_other_grammar_engine_fits_behind_the_same_interface():
    """xgrammar (an optional extra) gives the same kinds of constraint through the engine."""
    pytest.importorskip("xgrammar")
    from gristmill import LLM

    llm = LLM(device="cpu", structured_output_backend="xgrammar", max_num_seqs=8)
    outs = llm.generate([p for p, _ in CASES], [_params(so) for _, so in CASES], use_tqdm=False)
    for out, (_, structured_output) in zip(outs, CASES):
        assert out.finish_reason == "stop", (out.text, out.outputs[0].error)
        _check(out.text, structured_output)


def test_a_grammar_engine_failure_mid_request_fails_only_that_request(monkeypatch):
    from gristmill import LLM
    from gristmill import faults

    monkeypatch.setenv("GRISTMILL_FAULTS", "grammar@prompt~BOOM")
    try:
        llm = LLM(device="cpu", max_num_seqs=4)
    finally:
        monkeypatch.delenv("GRISTMILL_FAULTS")
    try:
        free = SamplingParams(max_tokens=6, temperature=0)
        bad, good, plain = llm.generate(["BOOM: is it?", "Is the sky blue? Answer:", "Once upon a time"],
                                        [_params({"choice": ["yes", "no"]}), _params({"choice": ["yes", "no"]}), free],
                                        use_tqdm=False)
        assert bad.finish_reason == "error"
        assert bad.outputs[0].error.startswith("GenerationError: the grammar engine failed on token ")
        assert good.text in ("yes", "no") and good.finish_reason == "stop"
        assert plain.finish_reason == "length" and len(plain.token_ids) == 6
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_total_blocks
    finally:
        faults.load()


def test_grammars_read_from_the_tokenizer_file_give_the_masks_of_the_hf_tokenizer(default_llm):
    """The engine core builds llguidance's tokenizer from the model's tokenizer.json
    without loading an HF tokenizer; its masks are those of one built from the HF
    tokenizer, state by state, and a file that pads or truncates falls back to the HF one."""
    from gristmill.model.masking import allowed_tokens
    from gristmill.structured.grammars import LLGuidanceGrammars, fill_masks, torch_bitmask

    runner, eos = default_llm.core.executor, default_llm.inputs.eos_token_ids

    def never():
        raise AssertionError("the HF tokenizer was loaded although the file serves")

    from_file = LLGuidanceGrammars(never, runner.vocab_size, eos, runner.model_dir / "tokenizer.json")
    from_hf = LLGuidanceGrammars(lambda: default_llm.tokenizer, runner.vocab_size, eos)
    rng = random.Random(0)
    for constraint in ({"json": PERSON}, {"regex": "[0-9]{3}-[0-9]{4}"}, {"choice": ["yes", "no"]}):
        a, b = (g.matcher(parse_constraint(constraint)) for g in (from_file, from_hf))
        for _ in range(12):  # a walk through the grammar along tokens both allow
            masks = [torch_bitmask(1, runner.vocab_size) for _ in range(2)]
            fill_masks([a], masks[0])
            fill_masks([b], masks[1])
            assert masks[0].equal(masks[1]) and not masks[0].eq(-1).all(), constraint
            allowed = allowed_tokens(masks[0], runner.vocab_size)[0].nonzero()[:, 0].tolist()
            token = rng.choice(allowed)
            assert a.accept(token) and b.accept(token)
            if a.finished:
                assert b.finished
                break

    padded = runner.model_dir.parent / "padded-tokenizer.json"
    try:
        data = json.loads((runner.model_dir / "tokenizer.json").read_text())
        padded.write_text(json.dumps({**data, "padding": {"strategy": "BatchLongest", "pad_id": 0}}))
        loaded = []
        LLGuidanceGrammars(lambda: loaded.append(1) or default_llm.tokenizer, runner.vocab_size, eos, padded)
        assert loaded == [1]
    finally:
        padded.unlink(missing_ok=True)


def test_both_grammar_engines_write_json_alike_and_close_listed_objects(default_llm):
    """One space after ',' and ':' (xgrammar's layout) from llguidance too, and an object
    schema that lists properties without saying more takes no other keys (xgrammar's
    strict mode, vLLM's default): a small model once invented keys until max_tokens."""
    pytest.importorskip("xgrammar")
    from gristmill.structured.grammars import Grammars, LLGuidanceGrammars

    runner, eos, tokenizer = default_llm.core.executor, default_llm.inputs.eos_token_ids, default_llm.tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"type": "integer"}}}, "required": ["c"]}}, "required": ["a", "b"]}
    texts = {'{"a": 1, "b": {"c": [1, 2]}}': True, '{"a":1,"b":{"c":[1,2]}}': False,
             '{"a": 1, "b": {"c": [1, 2]}, "d": 3}': False, '{"a": 1, "b": {"c": [1, 2], "d": 3}}': False}
    engines = (LLGuidanceGrammars(lambda: tokenizer, runner.vocab_size, eos, runner.model_dir / "tokenizer.json"),
               Grammars(lambda: tokenizer, runner.vocab_size, eos))

    def takes(engine, spec, text) -> bool:
        matcher = engine.matcher(parse_constraint({"json": spec}))
        if not all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)):
            return False
        return matcher.finished or any(matcher.accept(t) for t in sorted(eos))  # complete: it may end here

    for engine in engines:
        assert {text: takes(engine, schema, text) for text in texts} == texts, type(engine).__name__
        assert takes(engine, {**schema, "additionalProperties": True}, '{"a": 1, "b": {"c": []}, "d": 3}')
