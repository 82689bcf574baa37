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

The weights come from an attention function registered with Transformers (`AttentionInterface`),
`Probe.attention`, that runs SDPA for the output and computes softmax(q k^T) only at the answer
rows: no [T, T] weights.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .errors import EvaluationError
from .ppl import model_device, progress_meter
from .retrieval import draw_prompt, min_length

#: the attention function's name in Transformers' registry while scoring
PROBE = "subquadratic_retrieval_probe"


@dataclass
class Probe:
    """What the probe attention reads per forward: the answer rows and the needle's span; what it
    writes: mass[layer] = [HQ], each head's softmax weight on the span summed over the rows."""

    rows: slice = field(default_factory=lambda: slice(0))
    span: slice = field(default_factory=lambda: slice(0))
    mass: dict = field(default_factory=dict)

    def attention(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """An attention function for Transformers' `AttentionInterface`: SDPA's output, and the softmax
        weights of `rows` on `span` summed into `mass` (query [B, HQ, T, D], key [B, H, T, D])."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
        q = query[:, :, self.rows].float()  # [B, HQ, R, D]
        k = key.float().repeat_interleave(q.shape[1] // key.shape[1], dim=1)  # [B, HQ, T, D]
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-1, -2)) * scale  # [B, HQ, R, T]
        T = k.shape[2]
        rows = torch.arange(T, device=q.device)[self.rows]
        causal = torch.arange(T, device=q.device)[None, :] > rows[:, None]
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        mass = probs[..., self.span].sum(-1).sum(-1)[0]  # [HQ]
        layer = getattr(module, "layer_idx", None)
        self.mass[layer] = self.mass.get(layer, 0) + mass.cpu()
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
    probe = Probe()
    AttentionInterface.register(PROBE, probe.attention)
    before = cfg._attn_implementation
    model.set_attn_implementation(PROBE)
    was_training = model.training
    model.eval()
    rng = random.Random(f"{seed}-retrieval-heads")
    total = torch.zeros(layers, heads)
    count = 0
    device = model_device(model)
    try:
        with progress_meter(progress, prompts * length, "retrieval heads") as meter:
            for i in range(prompts):
                depth = 0.05 + 0.9 * i / max(1, prompts - 1)
                prompt, answer, _, span = draw_prompt(tokenizer, "niah", "prose", length, num_needles, depth, 5, rng,
                                                      with_span=True)
                probe.rows = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)
                probe.span, probe.mass = slice(*span), {}
                model(input_ids=torch.tensor([prompt + answer], device=device), use_cache=False, logits_to_keep=1)
                if len(probe.mass) != layers:
                    raise EvaluationError(f"the probe saw {len(probe.mass)} attention layers of {layers}; "
                                          "retrieval-head scores need a dense model with softmax attention")
                for layer, m in probe.mass.items():
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
