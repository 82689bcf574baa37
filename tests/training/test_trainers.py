"""The ecosystem's trainers train every family at tiny scale on CPU, with padding-free packing:
Transformers' `Trainer` with `DataCollatorWithFlattening` and TRL's `SFTTrainer` with
`packing=True, padding_free=True` (documents concatenated into one row, `position_ids` restarting at
each, which the models run as one row per document). The loss falls, and each packed document's
logits are those of the document run alone, through either collator's batch."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from subquadratic import HLAConfig, HLAForCausalLM, SPLAConfig, SPLAForCausalLM, SSEConfig, SSEForCausalLM
from tests.adaptation.conftest import VOCAB, corpus_files, train_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_accelerator_state")

_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
FAMILIES = {
    # SPLA's budget (4 blocks of 8) is smaller than most documents: the sparse path trains too
    "spla": (SPLAConfig, SPLAForCausalLM, dict(_SMALL, block_size=8, top_k_blocks=4)),
    "sse": (SSEConfig, SSEForCausalLM, dict(_SMALL, sse_chunk_size=16, sse_gate_rank=8)),
    "sse-h": (SSEConfig, SSEForCausalLM, dict(_SMALL, sse_chunk_size=16, sse_gate_rank=8, num_hidden_layers=3,
                                              mixer_types=["sse", "full_attention", "sse"])),
    "hla": (HLAConfig, HLAForCausalLM, dict(_SMALL, hla_chunk_size=16)),
}
MAX_LEN = 96  # tokens per document


@pytest.fixture
def fresh_accelerator_state():
    """Trainer keeps Accelerate's process-wide state (its mixed precision, its device) after it
    returns; it is dropped before and after each test, so `adapt`'s own Accelerator, elsewhere in
    the run, starts from none."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def make(family: str):
    cfg_cls, model_cls, fields = FAMILIES[family]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**fields))


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Paragraphs of real text (standard-library sources) and a byte-level BPE trained on them."""
    files, _ = corpus_files(tmp_path_factory.mktemp("corpus"))
    paragraphs = [p.strip() for f in files for p in f.read_text().split("\n\n") if len(p.strip()) > 40]
    tok = train_tokenizer(files)
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1 and len(tok) == VOCAB
    return paragraphs[:256], tok


def losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def falls(values: list[float]) -> bool:
    return sum(values[-4:]) / 4 < 0.8 * sum(values[:2]) / 2


def common_args(tmp_path) -> dict:
    return dict(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=4, learning_rate=3e-3,
                warmup_steps=0, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trainer_with_flattening_collator_lowers_the_loss(family, texts, tmp_path):
    paragraphs, tok = texts
    data = Dataset.from_dict({"input_ids": [tok(p)["input_ids"][:MAX_LEN] for p in paragraphs]})
    model = make(family)
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"  # renamed in Transformers 5.24
    args = TrainingArguments(**common_args(tmp_path), **{checkpointing: family == "sse-h"})
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithFlattening())
    trainer.train()
    got = losses(trainer)
    assert len(got) == 30 and all(v == v for v in got)
    assert falls(got), got


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_trainer_with_padding_free_packing_lowers_the_loss(family, texts, tmp_path):
    from trl import SFTConfig, SFTTrainer

    paragraphs, tok = texts
    model = make(family)
    args = SFTConfig(**{**common_args(tmp_path), "per_device_train_batch_size": 2}, packing=True,
                     padding_free=True, max_length=2 * MAX_LEN, dataset_text_field="text")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": paragraphs}),
                         processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # padding-free: one row
    assert int((batch["position_ids"][0] == 0).sum()) > 1  # several documents in it
    trainer.train()
    got = losses(trainer)
    assert len(got) == 30 and falls(got), got


@pytest.mark.parametrize("collator", ["transformers", "trl"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_documents_stay_apart(family, collator, texts):
    """The packed row's logits of each document equal those of the document alone (and its loss
    the mean over the documents' own predicted tokens)."""
    paragraphs, tok = texts
    docs = [tok(p)["input_ids"][:MAX_LEN] for p in paragraphs[3:7]]
    assert len({len(d) for d in docs}) > 1
    if collator == "transformers":
        batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in docs])
    else:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": d} for d in docs])
    model = make(family).eval()
    with torch.no_grad():
        packed = model(**batch).logits[0]
        start = 0
        for d in docs:
            alone = model(torch.tensor([d])).logits[0]
            torch.testing.assert_close(packed[start:start + len(d)], alone, rtol=1e-4, atol=1e-4)
            start += len(d)
    assert start == batch["input_ids"].shape[1]
