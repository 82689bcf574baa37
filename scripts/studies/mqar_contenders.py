"""The from-scratch MQAR contenders of the studies (scripts/studies/mqar.py, scripts/studies/replicate.py):
small models of each family trained from scratch on MQAR (`subquadratic.evaluation.mqar`'s generator
and accuracy) at equal recurrent state size, and `mqar_compare`, which trains and scores them.

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

from subquadratic.evaluation.mqar import mqar_accuracy, mqar_batch


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
    from subquadratic.families.hla.configuration import HLAConfig
    from subquadratic.families.sse.configuration import SSEConfig

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
    from subquadratic.modeling import CACHE_FIELD

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
