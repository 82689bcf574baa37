"""adapt's stage-2 losses, which run chunked over tokens from the final hidden states and the heads
(`modeling.losses`), equal the plain ones on full logits: the model's own `labels=` loss (with the
weighted auxiliary loss) and KL(teacher || student) on the teacher's packed-document logits; values
and every gradient in fp64, on packed batches (documents restarting inside rows), SPLA beyond its
budget and SSE-H (whose router adds an auxiliary loss)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from subquadratic.adaptation.train import Trainee, kl_to_teacher
from subquadratic.data import IGNORE_INDEX
from subquadratic.modeling.packing import find_documents

pytestmark = pytest.mark.usefixtures("one_thread")


def packed_batch(vocab: int, B: int = 2, T: int = 40) -> dict:
    """Two rows of packed documents (positions restart, each document's first label ignored)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (B, T), generator=g)
    pos = torch.cat([torch.arange(17), torch.arange(T - 17)]).expand(B, T).clone()
    pos[1] = torch.arange(T)
    labels = ids.clone()
    labels[pos == 0] = IGNORE_INDEX
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def plain_loss(student, teacher, batch, kind: str) -> torch.Tensor:
    """The stage-2 loss on full logits, as adapt computed it before the losses were chunked, in fp64
    (the model's `labels=` loss and `kl_to_teacher` compute in fp32; the same definitions)."""
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    out = student(input_ids=ids, position_ids=pos)
    if kind == "lm":
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
        reference = student(input_ids=ids, position_ids=pos, labels=labels).loss  # with the weighted aux loss
    else:
        docs = find_documents(pos, torch.ones_like(ids, dtype=torch.bool))
        with torch.no_grad():
            target = docs.pack(teacher(input_ids=docs.unpack(ids), attention_mask=docs.valid.long(),
                                       position_ids=docs.unpack(pos), use_cache=False).logits)
        keep = labels[:, 1:] != IGNORE_INDEX
        loss = F.kl_div(out.logits[:, :-1][keep].log_softmax(-1), target[:, :-1][keep].log_softmax(-1),
                        log_target=True, reduction="batchmean")
        reference = kl_to_teacher(out.logits, target, labels)
    if out.aux_loss is not None and student.config.aux_loss_weight:
        loss = loss + student.config.aux_loss_weight * out.aux_loss
        if kind == "kl":
            reference = reference + student.config.aux_loss_weight * out.aux_loss
    torch.testing.assert_close(reference.double(), loss, rtol=1e-6, atol=1e-7)  # the fp32 definitions
    return loss


@pytest.mark.parametrize("kind", ["lm", "kl"])
@pytest.mark.parametrize("to,options", [("spla", dict(block_size=4, top_k_blocks=3)), ("sse-h", {})])
def test_stage_two_losses_equal_the_plain_ones(converted, dense_folder, kind, to, options):
    student = AutoModelForCausalLM.from_pretrained(converted(to, **options), dtype=torch.float64).train()
    teacher = AutoModelForCausalLM.from_pretrained(dense_folder, dtype=torch.float64).eval().requires_grad_(False)
    if to == "sse-h":
        assert student.config.aux_loss_weight > 0  # the auxiliary loss is part of both
    batch = packed_batch(student.config.vocab_size)
    losses, grads = [], []
    for fn in (lambda: plain_loss(student, teacher, batch, kind), lambda: Trainee(student, teacher, kind)(batch, 2)):
        student.zero_grad()
        torch.manual_seed(0)
        loss = fn()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0].to(losses[1].dtype), rtol=1e-10, atol=1e-12)
    assert grads[1].keys() == grads[0].keys() and grads[0]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "mistral-window", "llama-eager"])
def test_teacher_runs_only_its_attention_per_document(arch):
    """On a packed batch the teacher's final hidden states equal its whole decoder run one document per
    row (fp64); the known pre-norm sources with SDPA run only the attention per document, the others
    (eager attention, a sliding window shorter than a document) the whole decoder."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from subquadratic.adaptation.train import _layerwise, _teacher_hidden

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig(**shape)),
                "llama-eager": (LlamaForCausalLM, LlamaConfig(**shape)),
                "qwen3": (Qwen3ForCausalLM, Qwen3Config(head_dim=8, **shape)),
                "mistral": (MistralForCausalLM, MistralConfig(sliding_window=None, **shape)),
                "mistral-window": (MistralForCausalLM, MistralConfig(sliding_window=8, **shape))}[arch]
    cfg._attn_implementation = "eager" if arch == "llama-eager" else "sdpa"
    torch.manual_seed(0)
    teacher = cls(cfg).double().eval()
    batch = packed_batch(64)
    ids, pos = batch["input_ids"], batch["position_ids"]
    docs = find_documents(pos, torch.ones_like(ids, dtype=torch.bool))
    assert _layerwise(teacher.model, docs.max_len) == (arch in ("llama", "qwen3", "mistral"))
    with torch.no_grad():
        got = _teacher_hidden(teacher, batch)
        want = docs.pack(teacher.model(input_ids=docs.unpack(ids), attention_mask=docs.valid.long(),
                                       position_ids=docs.unpack(pos), use_cache=False).last_hidden_state)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
