"""Multi-query associative recall (MQAR, Zoology-style) in token ids: a data generator, the accuracy of
a model at the query positions, and `mqar_eval`, the in-context accuracy of a trained LM by length.
(The from-scratch comparison of small models at equal state size is an experiment of its own:
scripts/studies/mqar_contenders.py.)

One example of length T with P key-value pairs: positions 0..2P-1 hold k1 v1 k2 v2 ... kP vP (P
distinct keys from the lower half of the token range, values from the upper half, drawn with
replacement); the rest is the filler token, except Q query pairs placed at random non-overlapping
slots: a key seen in the context followed by its value. Labels follow Transformers' causal-LM
convention (labels[t] is predicted from position t - 1; -100 elsewhere): only the value after each
query key is scored. Accuracy = the fraction of those values that are the argmax of the logits at the
query key's position.
"""

from __future__ import annotations

import torch

from .ppl import progress_meter

IGNORE = -100


def mqar_batch(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    *,
    num_queries: int | None = None,
    token_range: tuple[int, int] | None = None,
    filler_id: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR examples: (input_ids, labels), both [num_examples, seq_len] int64 (see the module doc).

    Keys come from the lower half of `token_range` (default [1, vocab_size): 0 is the filler), values
    from the upper half. `num_queries` defaults to `num_kv_pairs` (every key queried once)."""
    lo, hi = token_range or (1, vocab_size)
    if not 0 <= lo < hi <= vocab_size:
        raise ValueError(f"token_range {(lo, hi)} must lie in [0, vocab_size={vocab_size})")
    mid = lo + (hi - lo) // 2
    P = num_kv_pairs
    Q = P if num_queries is None else num_queries
    if P < 1 or not 1 <= Q <= P:
        raise ValueError(f"need num_kv_pairs >= 1 and 1 <= num_queries <= num_kv_pairs; got {P}, {Q}")
    if mid - lo < P or hi - mid < 1:
        raise ValueError(f"{P} distinct keys need a token range of at least {2 * P} ids; got {hi - lo}")
    slots = (seq_len - 2 * P) // 2
    if slots < Q:
        raise ValueError(f"seq_len {seq_len} holds {P} pairs and {slots} query slots, fewer than {Q} queries; "
                         f"need seq_len >= {2 * P + 2 * Q}")
    B = num_examples
    g = generator
    keys = torch.rand(B, mid - lo, generator=g).argsort(dim=1)[:, :P] + lo  # distinct per row
    values = torch.randint(mid, hi, (B, P), generator=g)
    ids = torch.full((B, seq_len), filler_id, dtype=torch.long)
    labels = torch.full((B, seq_len), IGNORE, dtype=torch.long)
    ids[:, 0:2 * P:2], ids[:, 1:2 * P:2] = keys, values
    which = torch.rand(B, P, generator=g).argsort(dim=1)[:, :Q]  # the queried pairs
    slot = torch.rand(B, slots, generator=g).argsort(dim=1)[:, :Q]  # where their queries go
    pos = 2 * P + 2 * slot  # [B, Q]: the query key's position; its value follows
    ids.scatter_(1, pos, keys.gather(1, which))
    ids.scatter_(1, pos + 1, values.gather(1, which))
    labels.scatter_(1, pos + 1, values.gather(1, which))
    return ids, labels


@torch.no_grad()
def mqar_accuracy(model, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 32) -> float:
    """Fraction of scored values (labels != -100) that are the argmax of the logits one position before."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hit = total = 0
    for i in range(0, input_ids.shape[0], batch_size):
        ids, lab = input_ids[i:i + batch_size].to(device), labels[i:i + batch_size].to(device)
        pred = model(input_ids=ids, use_cache=False).logits[:, :-1].argmax(-1)
        scored = lab[:, 1:] != IGNORE
        hit += (pred[scored] == lab[:, 1:][scored]).sum().item()
        total += scored.sum().item()
    model.train(was_training)
    return hit / total


def mqar_eval(
    model,
    lengths,
    vocab_size: int,
    *,
    examples: int = 32,
    batch_size: int = 8,
    seed: int = 0,
    progress=False,
) -> dict[int, dict]:
    """In-context MQAR accuracy of a trained LM (no training) at each length: {L: {"accuracy",
    "kv_pairs", "examples", "chance"}}.

    Keys and values come from token ids [vocab_size // 4, vocab_size) (clear of the low ids where
    tokenizers keep special and byte tokens), the filler is id vocab_size // 4 - 1, and
    P = min(L // 8, the number of key ids) pairs are stored and all queried. `progress`: see
    `ppl.progress_meter` (examples x L tokens per length)."""
    lengths = list(lengths)
    lo = vocab_size // 4
    out = {}
    with progress_meter(progress, examples * sum(lengths), "mqar") as meter:
        for L in lengths:
            pairs = max(1, min(L // 8, (vocab_size - lo) // 2))
            g = torch.Generator().manual_seed(seed + L)
            ids, labels = mqar_batch(examples, L, pairs, vocab_size, token_range=(lo, vocab_size),
                                     filler_id=max(lo - 1, 0), generator=g)
            out[L] = {"accuracy": mqar_accuracy(model, ids, labels, batch_size), "kv_pairs": pairs,
                      "examples": examples, "chance": 1.0 / (vocab_size - lo - (vocab_size - lo) // 2)}
            meter.update(examples * L)
    return out
