"""Multi-query associative recall (MQAR, Zoology-style) in token ids: a data generator, the accuracy of
a model at the query positions, and `mqar_compare`, which trains small models of each family from
scratch at equal recurrent state size and returns their accuracies.

One example of length T with P key-value pairs: positions 0..2P-1 hold k1 v1 k2 v2 ... kP vP (P
distinct keys from the lower half of the token range, values from the upper half, drawn with
replacement); the rest is the filler token, except Q query pairs placed at random non-overlapping
slots: a key seen in the context followed by its value. Labels follow Transformers' causal-LM
convention (labels[t] is predicted from position t - 1; -100 elsewhere): only the value after each
query key is scored. Accuracy = the fraction of those values that are the argmax of the logits at the
query key's position.

State-size accounting of `mqar_compare` (per layer and sequence, fp32 elements of the recurrent
cache, measured with `cache.nbytes()`): SSE with N partitions and top-k 1 keeps a shared state and N
partition states, HQ (N + 1) D^2; the GLA-style baseline is SSE with one partition (its router has a
single choice, so it is a gated linear attention with a shared and a second state of the same feature
size), 2 HQ' D^2; HLA (hla2, no GQA) keeps S and F, 2 HQ' D^2. The baselines get HQ' = HQ (N + 1) / 2
heads of the same head dim D, so all three hold the same state.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

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


@dataclass
class MQARSettings:
    """Task and model shapes of `mqar_compare`; `tiny()` runs on a CPU in seconds, `gpu()` in about two
    minutes on one large GPU."""

    seq_len: int = 64
    num_kv_pairs: int = 8
    vocab_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2  # SSE's heads; the baselines get num_heads (N + 1) / 2
    head_dim: int = 16
    sse_partitions: int = 4
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.1
    test_examples: int = 256

    @classmethod
    def tiny(cls, **overrides) -> MQARSettings:
        return cls(**{**dict(seq_len=32, num_kv_pairs=4, vocab_size=32, hidden_size=32, num_layers=1,
                             head_dim=8, steps=40, batch_size=16, test_examples=64), **overrides})

    @classmethod
    def gpu(cls, **overrides) -> MQARSettings:
        return cls(**{**dict(seq_len=256, num_kv_pairs=32, vocab_size=8192, hidden_size=128, num_layers=2,
                             num_heads=2, head_dim=32, steps=2000, batch_size=64, lr=1e-3,
                             test_examples=1024), **overrides})


#: The from-scratch contenders: SSE (N partitions, top-1), the GLA-style baseline and HLA (hla2).
MQAR_MODELS = ("sse", "gla", "hla")


def mqar_config(name: str, s: MQARSettings):
    """The config of contender `name` ("sse", "gla", "hla") at the shapes of `s`, equal state size."""
    from ..families.hla.configuration import HLAConfig
    from ..families.sse.configuration import SSEConfig

    wide = s.num_heads * (s.sse_partitions + 1)
    if wide % 2:
        raise ValueError(f"num_heads x (sse_partitions + 1) = {wide} must be even so that the baselines get "
                         f"{wide} / 2 heads of the same state; change num_heads or sse_partitions")
    heads = s.num_heads if name == "sse" else wide // 2
    common = dict(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=2 * s.hidden_size,
        num_hidden_layers=s.num_layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=s.head_dim, max_position_embeddings=max(2 * s.seq_len, 256), tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    chunk = min(64, s.seq_len)
    if name in ("sse", "gla"):
        n = s.sse_partitions if name == "sse" else 1
        return SSEConfig(**common, sse_num_partitions=n, sse_top_k=1, sse_chunk_size=chunk,
                         sse_gate_rank=min(16, s.hidden_size))
    if name == "hla":
        return HLAConfig(**common, hla_variant="hla2", hla_chunk_size=chunk)
    raise ValueError(f"unknown MQAR contender {name!r}; available: {', '.join(MQAR_MODELS)}")


def state_bytes(model, seq_len: int = 8) -> int:
    """Bytes of the recurrent state of one sequence: `cache.nbytes()` after a forward of `seq_len` tokens."""
    device = next(model.parameters()).device
    from ..modeling import CACHE_FIELD

    with torch.no_grad():
        out = model(input_ids=torch.ones(1, seq_len, dtype=torch.long, device=device), use_cache=True)
    return getattr(out, CACHE_FIELD).nbytes()


def train_mqar(model, s: MQARSettings, generator: torch.Generator, progress: bool = False,
               desc: str = "mqar") -> list[float]:
    """Train `model` on fresh MQAR batches (AdamW, linear warm-up then cosine decay); returns the LM losses
    (the MQAR cross-entropy; SSE's router load-balance term is trained on but not included)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.98))
    warm = max(1, s.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, s.steps) / s.steps))
    )
    model.train()
    losses = []
    for _ in tqdm(range(s.steps), desc=desc, disable=not progress, leave=False):
        ids, labels = mqar_batch(s.batch_size, s.seq_len, s.num_kv_pairs, s.vocab_size, generator=generator)
        out = model(input_ids=ids.to(device), labels=labels.to(device), use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        aux = getattr(out, "aux_loss", None)
        lm = out.loss if aux is None else out.loss - model.config.aux_loss_weight * aux
        losses.append(lm.item())
    model.eval()
    return losses


def mqar_compare(
    settings: MQARSettings | None = None,
    models: tuple[str, ...] = MQAR_MODELS,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    progress: bool = False,
) -> dict[str, dict]:
    """Train each contender from scratch on the same MQAR stream and score it on the same held-out set.

    Returns {name: {"accuracy", "initial_loss", "final_loss", "state_bytes", "parameters", "num_heads",
    "model_type", "num_partitions"}} plus "settings" (the `MQARSettings` as a dict) and "chance"
    (1 / the number of value ids). `state_bytes` is measured per sequence (`cache.nbytes()`) and is the
    same for every contender (see the module doc)."""
    from transformers import AutoModelForCausalLM

    s = settings or MQARSettings()
    test_g = torch.Generator().manual_seed(seed + 1)
    test = mqar_batch(s.test_examples, s.seq_len, s.num_kv_pairs, s.vocab_size, generator=test_g)
    results: dict[str, dict] = {"settings": asdict(s), "chance": 1.0 / (s.vocab_size - 1 - (s.vocab_size - 1) // 2)}
    for name in models:
        config = mqar_config(name, s)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(device)
        train_g = torch.Generator().manual_seed(seed)  # every contender sees the same training stream
        losses = train_mqar(model, s, train_g, progress=progress, desc=f"mqar {name}")
        tail = losses[-max(1, len(losses) // 10):]
        results[name] = {
            "accuracy": mqar_accuracy(model, *test),
            "initial_loss": losses[0],
            "final_loss": sum(tail) / len(tail),
            "state_bytes": state_bytes(model),
            "parameters": sum(p.numel() for p in model.parameters()),
            "num_heads": config.num_attention_heads,
            "model_type": config.model_type,
            "num_partitions": getattr(config, "sse_num_partitions", None),
        }
        del model
    return results


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
