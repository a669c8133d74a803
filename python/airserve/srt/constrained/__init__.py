"""Structured output: grammars (JSON schema, regex, EBNF) that constrain what a request samples.

`spec.py` says what a request asks for and checks it (HTTP process, no tokenizer needed);
`backend.py` compiles grammars against the model's vocabulary, cached, in a worker thread of the
scheduler process, and keeps one matcher per request. The token mask is applied to the logits by
`airserve.srt.sampling.token_mask`. xgrammar is imported on first use only.
"""
