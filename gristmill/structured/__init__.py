"""Structured output: constraints on what a request generates (JSON schema, JSON object,
regex, choice, grammar), compiled by a grammar engine into per-request matchers whose
token masks the sampler applies. `spec` checks a request's constraint (no engine needed);
`grammars` compiles and matches (llguidance by default, or xgrammar; see
docs/structured_output.md)."""
