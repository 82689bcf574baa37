"""Which heads of a dense model retrieve: the attention each head pays to a needle while the model
reads the needle's value back, and the layers that hold the strongest such heads (the softmax layers
a hybrid keeps for recall: `--<family>-softmax-layers retrieval:K`).

Score (DuoAttention's and the retrieval-head papers' idea, measured here teacher-forced): on
`prompts` multi-key needle prompts (`retrieval.draw_prompt`, 4 needles, depths spread over
(0.05, 0.95), prose template) of `length` tokens, the prompt and its answer go through the model in
one forward pass; at each position whose next token is an answer token, each head's softmax weight
on the queried needle's tokens is summed (its attention mass on the needle). A head's score is the
mean over those positions and prompts: 1 when it attends only to the needle, about
needle / length when it attends uniformly. A layer's score is its strongest head's: a layer is
worth keeping when one of its heads retrieves.

The weights come from an attention function registered with Transformers (`AttentionInterface`) that
runs SDPA for the output and computes softmax(q k^T) only at the answer rows: no [T, T] weights.
"""

from __future__ import annotations

import random

import torch

from .errors import EvaluationError
from .ppl import model_device, progress_meter
from .retrieval import KEYS, TEMPLATES, assemble, min_length

#: the attention function's name in Transformers' registry while scoring
PROBE = "subquadratic_retrieval_probe"


class _Probe:
    """What the probe attention reads per forward: the answer rows and the needle's span, and what it
    writes: mass[layer] = [HQ] summed over rows."""

    rows: slice = slice(0)
    span: slice = slice(0)
    mass: dict[int, torch.Tensor] = {}


def _probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA's output, and the softmax weights of `_Probe.rows` on `_Probe.span` summed into `_Probe.mass`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    q = query[:, :, _Probe.rows].float()  # [B, HQ, R, D]
    k = key.float()
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # [B, HQ, T, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, HQ, R, T]
    T = k.shape[2]
    rows = torch.arange(T, device=q.device)[_Probe.rows]
    causal = torch.arange(T, device=q.device)[None, :] > rows[:, None]
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    mass = probs[..., _Probe.span].sum(-1).sum(-1)[0]  # [HQ]
    layer = getattr(module, "layer_idx", None)
    _Probe.mass[layer] = _Probe.mass.get(layer, 0) + mass.cpu()
    return out


@torch.no_grad()
def retrieval_head_scores(model, tokenizer, *, length: int = 2048, prompts: int = 8, num_needles: int = 4,
                          seed: int = 0, progress=False) -> torch.Tensor:
    """[layers, HQ] fp32: each softmax-attention head's retrieval score (see the module doc) on a
    dense Transformers causal LM."""
    from transformers import AttentionInterface

    need = min_length(tokenizer, "niah", "prose", num_needles)
    if length < need:
        raise EvaluationError(f"retrieval-head scoring at {length} tokens: a prompt needs {need}; use a longer length")
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    AttentionInterface.register(PROBE, _probe_attention)
    before = cfg._attn_implementation
    model.set_attn_implementation(PROBE)
    was_training = model.training
    model.eval()
    tpl = TEMPLATES["niah", "prose"]
    rng = random.Random(f"{seed}-retrieval-heads")
    total = torch.zeros(layers, heads)
    count = 0
    device = model_device(model)
    try:
        with progress_meter(progress, prompts * length, "retrieval heads") as meter:
            for i in range(prompts):
                depth = 0.05 + 0.9 * i / max(1, prompts - 1)
                keys = rng.sample(KEYS, num_needles)
                needles = [(k, str(rng.randrange(10_000, 100_000))) for k in keys]
                query = rng.randrange(num_needles)
                key, value = needles[query]
                pieces = [tpl.needle.format(key=k, value=v) for k, v in needles]
                prompt, answer, spans = assemble(
                    tokenizer, tpl, length, pieces, tpl.question.format(key=key, value=value),
                    tpl.answer.format(key=key, value=value), query, depth, rng, with_spans=True)
                ids = torch.tensor([prompt + answer], device=device)
                _Probe.rows = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)
                _Probe.span = slice(*spans[query])
                _Probe.mass = {}
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
                if len(_Probe.mass) != layers:
                    raise EvaluationError(f"the probe saw {len(_Probe.mass)} attention layers of {layers}; "
                                          "retrieval-head scores need a dense model with softmax attention")
                for layer, m in _Probe.mass.items():
                    total[layer] += m.float()
                count += len(answer)
                meter.update(length)
    finally:
        model.set_attn_implementation(before)
        model.train(was_training)
    return total / count


def layer_scores(head_scores: torch.Tensor) -> list[float]:
    """Each layer's score: its strongest head's (`head_scores` [layers, HQ])."""
    return head_scores.max(dim=1).values.tolist()


def choose_retrieval_layers(scores: list[float], k: int) -> list[int]:
    """The k layers with the highest scores, in layer order (ties: the earlier layer)."""
    if not 0 < k < len(scores):
        raise ValueError(f"retrieval:{k} asks for {k} softmax layers of {len(scores)}; "
                         f"choose K in 1..{len(scores) - 1}")
    return sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k])
