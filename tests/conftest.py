"""Shared fixtures: tiny random dense checkpoints made with Transformers, one-thread torch."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU; set before Triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import subquadratic  # noqa: F401, E402  (registers the model types)

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
)

DENSE = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama-bias-tied": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, tie_word_embeddings=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32)),
}


def make_dense(kind: str, seed: int = 0, **overrides):
    cfg_cls, model_cls, extra = DENSE[kind]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**TINY, **extra, **overrides})).eval()
    with torch.no_grad():  # non-trivial norms and biases so that every mapped weight matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def count_calls(monkeypatch, targets: dict) -> dict[str, int]:
    """Wrap each function targets[name] = (module, function name) so that its calls are counted;
    returns the counts {name: calls}, updated as the test runs."""
    calls = dict.fromkeys(targets, 0)
    for name, (module, fn_name) in targets.items():
        fn = getattr(module, fn_name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(module, fn_name, counted)
    return calls


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is as fast as several and suffers far less on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def dense_checkpoint(tmp_path):
    """Factory: save a tiny dense model of `kind` (several shards) and return (model, folder)."""

    def make(kind: str = "llama", **overrides):
        model = make_dense(kind, **overrides)
        folder = tmp_path / f"dense-{kind}"
        model.save_pretrained(folder, max_shard_size="40KB")
        return model, folder

    return make


WORDS = ("the a of to and in is it that for on with as was by this be at from or an are not which but can has "
         "value list file name line return error data model text time first last new old long short word").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def word_tokenizer():
    """A word-level tokenizer with a chat template (built offline): every token decodes to a whole
    word, so streamed text and decoded text agree."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=specials[3:])
    out.chat_template = CHAT_TEMPLATE
    return out
