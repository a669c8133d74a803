"""Which input channels of each linear layer carry outlier activations, measured once at load.

The int8 large path (`matmul_paths`, "w8a8_int8_outliers") quantizes activations per token:
one step size per row, sized by the row's largest |x|. A few input channels of this model family
hold values 20-100x the others' (the residual stream's "massive" channels, and the products
they feed), so that one step swamps the small channels. Those channels are the same for every
input: a short calibration prefill over a fixed text finds them (per-channel max |x| at each
layer's input), and the product keeps them in float32 beside the int8 product of the rest.

The calibration text is written here (not taken from any data set, so it never overlaps the
fidelity check's text) and runs through the model's own float32 layers in one sequence, with a
plain causal attention that needs no KV cache.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from airserve.srt.forward_batch import ForwardMode

logger = logging.getLogger(__name__)

CALIBRATION_TEXT = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a brass lamp,
a notebook and a thermos of tea, and he wrote down the wind, the tide and the ships he saw.
On the 14th of March, 1893, he counted seven schooners, two steamers and one small rowing boat
that seemed to have no one aboard. The next morning the boat was gone.

def moving_average(values, window=3):
    # Returns the mean of every run of `window` consecutive values.
    out = []
    for i in range(len(values) - window + 1):
        out.append(sum(values[i:i + window]) / window)
    return out

User: Can you explain why the sky is blue?
Assistant: Sunlight contains every color. Air molecules scatter short wavelengths (blue and
violet) much more strongly than long ones (red), so blue light reaches your eyes from every
direction of the sky. Our eyes are less sensitive to violet, which is why the sky looks blue.

A farmer sells 48 eggs on Monday and twice as many on Tuesday. Each egg costs $0.25.
Total eggs: 48 + 96 = 144. Revenue: 144 * 0.25 = $36.00.

Die Stadt liegt am Fluss, und im Sommer fahren viele Boote bis zur alten Brücke.
La réunion commence à neuf heures; merci d'arriver à l'heure.
SELECT name, COUNT(*) FROM orders WHERE year = 2024 GROUP BY name ORDER BY 2 DESC;
{"id": 17, "tags": ["red", "green"], "ok": true, "ratio": 3.14159}
"""


class _CausalAttention:
    """The attention-backend interface over one sequence of new tokens (no KV cache)."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scale: float, fb: object) -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)


@torch.inference_mode()
def input_absmax(model: nn.Module, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of every linear layer of a Llama-family `model` (by module
    name) over a float32 prefill of `token_ids` (in sequences no longer than the model's
    position table). The lm_head is measured on the final hidden states without computing its
    product."""
    from airserve.srt.layers.linear import Linear

    stats: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float().abs().amax(0)
        stats[name] = torch.maximum(stats[name], x) if name in stats else x

    handles = [m.register_forward_pre_hook(lambda _, args, name=name: record(name, args[0]))
               for name, m in model.named_modules()
               if isinstance(m, Linear) and name != "lm_head"]
    # An extend pass: the packed products (if any) multiply in float32, as a prefill does.
    fb = SimpleNamespace(attn_backend=_CausalAttention(), forward_mode=ForwardMode.EXTEND)
    step = model.model.rotary_emb.cos.shape[0]
    try:
        for start in range(0, len(token_ids), step):
            ids = torch.tensor(token_ids[start:start + step], dtype=torch.long)
            hidden = model.model(ids, torch.arange(len(ids)), fb)
            if hasattr(model, "lm_head"):
                record("lm_head", hidden)
    finally:
        for h in handles:
            h.remove()
    return stats


def outlier_channels(absmax: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` channels of largest calibrated max |x|, sorted (int64)."""
    count = min(count, absmax.numel())
    return absmax.topk(count).indices.sort().values


def calibration_tokens(tokenizer: object) -> list[int]:
    """Token ids of `CALIBRATION_TEXT` (a tokenizer with `encode` -> ids or an Encoding)."""
    out = tokenizer.encode(CALIBRATION_TEXT)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def find_outliers(model: nn.Module, tokenizer: object, count: int | None = None
                  ) -> dict[str, torch.Tensor]:
    """The `count` (None: matmul_paths.DEFAULT_OUTLIER_CHANNELS) outlier input channels of
    every linear layer of `model`, by module name, from one prefill of `CALIBRATION_TEXT`."""
    from airserve.srt.layers.quant.matmul_paths import DEFAULT_OUTLIER_CHANNELS

    count = DEFAULT_OUTLIER_CHANNELS if count is None else count
    if count < 1:
        raise ValueError(f"int8_outlier_channels={count}: must be >= 1")
    t0 = time.perf_counter()
    tokens = calibration_tokens(tokenizer)
    stats = input_absmax(model, tokens)
    logger.info("outlier input channels: %d per layer from a %d-token calibration prefill "
                "(%.1f s)", count, len(tokens), time.perf_counter() - t0)
    return {name: outlier_channels(absmax, count) for name, absmax in stats.items()}
