"""Logprobs in the shapes clients read: SGLang's `meta_info` lists and OpenAI's `logprobs`.

The values are log_softmax of the model's raw logits (before logit_bias, penalties,
temperature and top-k/top-p/min-p; `airserve.srt.sampling.logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from airserve.srt.managers.tokenizer_manager import ReqOutput
from airserve.srt.sampling.logprobs import LogprobParams, TokenLogprob
from airserve.srt.tokenizer import Tokenizer


class TokenText:
    """Each token's own text (decoded alone, special tokens kept), cached per request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id],
                                                                skip_special_tokens=False)
        return text


# SGLang's /generate meta_info.
def sglang_logprobs(prompt: list[int], params: LogprobParams,
                    input_scored: list[TokenLogprob] | None, output_scored: list[TokenLogprob],
                    text: TokenText | None) -> dict:
    """`input_token_logprobs` (one per prompt token from logprob_start_len, the first None:
    nothing before it is scored), `output_token_logprobs` (one per output token), and with
    top_logprobs_num the `*_top_logprobs` beside them; entries are (logprob, token_id, text),
    text None unless return_text_in_logprobs. `input_scored`: the prompt tokens after
    logprob_start_len (None until they all are); `output_scored`: the output tokens."""
    def entry(lp: float | None, token: int) -> tuple:
        return (lp, token, text(token) if text is not None else None)

    def top(t: TokenLogprob) -> list:
        return [entry(lp, tok) for lp, tok in t.top or ()]

    start = params.start(len(prompt))
    scored = input_scored or []
    meta = {
        "input_token_logprobs": [entry(None, prompt[start])]
        + [entry(t.logprob, t.token_id) for t in scored],
        "output_token_logprobs": [entry(t.logprob, t.token_id) for t in output_scored],
    }
    if params.top_logprobs_num:
        meta["input_top_logprobs"] = [None] + [top(t) for t in scored]
        meta["output_top_logprobs"] = [top(t) for t in output_scored]
    return meta


# OpenAI.
def completion_logprobs(scored: list[TokenLogprob], text: TokenText, offset: int = 0,
                        first: int | None = None) -> dict:
    """/v1/completions `logprobs` of `scored` tokens; with `first` (echo), the prompt's first
    token leads with null logprobs. `offset`: characters before the first token."""
    tokens, values, tops, offsets = [], [], [], []
    if first is not None:
        tokens.append(text(first))
        values.append(None)
        tops.append(None)
        offsets.append(offset)
        offset += len(tokens[-1])
    for t in scored:
        tokens.append(text(t.token_id))
        values.append(t.logprob)
        tops.append({text(tok): lp for lp, tok in t.top or ()})
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(scored: list[TokenLogprob], text: TokenText) -> dict:
    """/v1/chat/completions `logprobs`: {"content": [one entry per token]}."""
    def one(lp: float, token: int) -> dict:
        s = text(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**one(t.logprob, t.token_id),
                         "top_logprobs": [one(lp, tok) for lp, tok in t.top or ()]}
                        for t in scored]}


@dataclass
class ChoiceShape:
    """How an OpenAI choice reads: chat or completion, its echo and its logprobs. Choice i
    answers prompt i // n."""

    chat: bool
    text: TokenText
    logprob: LogprobParams | None
    prompts: list[list[int]]
    n: int
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text
    # Streaming: choice i -> its output tokens whose logprobs were sent.
    sent: dict[int, int] = field(default_factory=dict)

    def content(self, i: int, out: ReqOutput) -> str:
        return out.text if self.echo_texts is None else self.echo_texts[i // self.n] + out.text

    def logprobs(self, i: int, out: ReqOutput, sent: int = 0) -> dict | None:
        """Choice i's logprobs of output tokens from `sent` on (with echo and nothing sent,
        the prompt's first)."""
        if self.logprob is None:
            return None
        scored = out.output_logprobs[sent:]
        if self.chat:
            return chat_logprobs(scored, self.text)
        if self.echo_texts is None or sent:
            return completion_logprobs(scored, self.text)
        return completion_logprobs((out.input_logprobs or []) + scored, self.text,
                                   first=self.prompts[i // self.n][0])

    def new_logprobs(self, i: int, out: ReqOutput) -> tuple[dict | None, bool]:
        """Streaming: choice i's logprobs not sent yet (counted as sent from now on), and
        whether `out` brought new output tokens."""
        sent = self.sent.get(i, 0)
        self.sent[i] = out.completion_tokens
        return self.logprobs(i, out, sent), out.completion_tokens > sent
