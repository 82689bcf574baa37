"""The vLLM plugin (subquadratic/vllm/) on the CPU, in an environment with vLLM (scripts/test.sh's
`.venv-vllm`, marker `vllm`): tiny converted SSE-H and HLA-H folders give through `vllm.LLM` with
greedy sampling the tokens of Transformers' `generate()` on the same folder (and pure SSE: no
softmax layer, no window; and SPLA, past its budget), for each prompt alone
and for a batch of prompts of different lengths (a one-token prompt, which vLLM runs as a decode; a
prompt past the 64-token window, prefilled in chunks beside the others' decode steps); one request
over HTTP on 127.0.0.1 (`subquadratic serve FOLDER --engine vllm`); the ring positions the plugin
derives are the ones the package's ring keeps; the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin's tests run in an environment with vLLM (.venv-vllm)")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tests.conftest import make_dense  # noqa: E402
from tests.test_serving import post, running_server, word_tokenizer  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 10
#: a one-token prompt, two short ones, one past SSE-H's / HLA-H's 64-token window (and longer than a
#: step's token budget, BATCHED_TOKENS: it is prefilled in chunks)
LENGTHS = (1, 5, 17, 90)
BATCHED_TOKENS = 32
#: SPLA's exact budget: 4 blocks of 8 tokens, which the 90-token prompt outgrows
SPLA_OPTIONS = {"block_size": 8, "top_k_blocks": 4}


def prompts(vocab: int) -> list[list[int]]:
    return [[6 + (7 * i + n) % (vocab - 6) for i in range(n)] for n in LENGTHS]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama (head size 32, which vLLM's CPU attention takes; three layers, the middle one kept
    softmax) converted to SSE-H (its 64-token window with 4 sinks), to pure SSE and to SPLA (a 32-token
    budget), and a tiny Mistral with a 16-token sliding window converted to HLA-H (the kept layer a
    `sliding_attention` one, on vLLM's sliding-window attention), every weight then moved
    off its conversion value (the branches that start at zero matter), with the word tokenizer."""
    from subquadratic.conversion import convert

    tok = word_tokenizer()
    root = tmp_path_factory.mktemp("vllm")
    shapes = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=3, vocab_size=len(tok),
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    for kind, extra in (("llama", {}), ("mistral", {"sliding_window": 16})):
        make_dense(kind, **shapes, **extra).save_pretrained(root / kind)
        tok.save_pretrained(root / kind)
    out = {}
    kept = {"softmax_layers": "1"}
    for to, source, options in (("sse-h", "llama", kept), ("hla-h", "mistral", kept), ("sse", "llama", {}),
                                ("spla", "llama", SPLA_OPTIONS)):
        folder = convert(str(root / source), str(root / to), to, options=options, progress=False)
        model = AutoModelForCausalLM.from_pretrained(folder)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        for f in Path(folder).glob("model*.safetensors*"):
            f.unlink()
        model.save_pretrained(folder)
        out[to] = str(folder)
    assert AutoModelForCausalLM.from_pretrained(out["hla-h"]).config.mixer_types == ["hla", "sliding_attention", "hla"]
    return out


def reference(folder: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' greedy generate() on the folder, EOS not ending it (vLLM's ignore_eos)."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["sse-h", "hla-h", "sse", "spla"])
def test_llm_greedy_tokens_equal_transformers(folders, family, tmp_path):
    folder = folders[family]
    vocab = AutoModelForCausalLM.from_pretrained(folder).config.vocab_size
    batch = prompts(vocab)
    (tmp_path / "prompts.json").write_text(json.dumps(batch))
    run = subprocess.run([sys.executable, "-m", "tests.vllm.generate", folder, str(tmp_path / "prompts.json"),
                          str(tmp_path / "out.json"), str(MAX_TOKENS), str(BATCHED_TOKENS)],
                         capture_output=True, text=True, env=env(), timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "prefix caching is off" in run.stderr  # the plugin's config hook ran (vLLM's default is on)
    got = json.loads((tmp_path / "out.json").read_text())
    want = [reference(folder, p, MAX_TOKENS) for p in batch]
    assert got["single"] == want
    assert got["batch"] == want
    assert len({tuple(w) for w in want}) > 1  # the prompts lead to different continuations


def test_ring_positions_are_the_package_ring(folders):
    """After n tokens the ring the package keeps holds the positions `ring_positions` derives."""
    from subquadratic.modeling.base import SequenceInfo
    from subquadratic.vllm.model import ring_positions

    model = AutoModelForCausalLM.from_pretrained(folders["sse-h"]).eval()
    cache = model.new_cache()
    for n in (3, 70, 71, 135):  # a prefill, then a chunk and decode steps past the 64-token window
        length = cache.get_seq_length()
        ids = torch.arange(length, n)[None] % (model.config.vocab_size - 6) + 6
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        layer = cache.layers[0].tensors
        assert torch.equal(layer["swa_pos"], ring_positions(torch.tensor([n]), layer["swa_k"].shape[2]))
        assert torch.equal(layer["swa_sink_pos"],
                           ring_positions(torch.tensor([n]), layer["swa_sink_k"].shape[2], sinks=True))
    assert SequenceInfo  # the class the plugin builds its calls with


def test_state_layout_follows_the_config(folders):
    from subquadratic.vllm.model import state_layout

    config = AutoModelForCausalLM.from_pretrained(folders["sse-h"]).config
    layout = {e.name: (e.shape, e.dtype) for e in state_layout(config, torch.bfloat16, 256)}
    hq, h, d, w = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.sse_sliding_window
    assert layout["shared"] == ((hq, d, d), torch.float32)  # recurrent states stay fp32
    assert layout["parts"] == ((config.sse_num_partitions, hq, d, d), torch.float32)
    assert layout["swa_k"] == ((h, w, d), torch.bfloat16) and layout["swa_sink_v"][0] == (h, config.sse_window_sinks, d)
    assert "swa_pos" not in layout and "swa_sink_pos" not in layout
    spla = AutoModelForCausalLM.from_pretrained(folders["spla"]).config
    grows = {e.name: (e.shape, e.dtype, e.grows) for e in state_layout(spla, torch.bfloat16, 100)}
    h, blocks = spla.num_key_value_heads, -(-100 // spla.block_size)  # keys for 100 tokens, a sum per block
    assert grows["k"] == ((h, 100, d), torch.bfloat16, (2, 1)) and grows["v"][0] == (h, 100, d)
    assert grows["sum_k"] == ((h, blocks, d), torch.float32, (2, spla.block_size))
    assert grows["count"][0] == (blocks,) and grows["sbar"] == ((h, d, d), torch.float32, None)


def test_refusals_are_one_line(folders):
    from types import SimpleNamespace

    from subquadratic.vllm.model import ServeError, check_config

    with pytest.raises(ServeError, match=r"serves sse, hla, spla folders; this one is 'swa'"):
        check_config(SimpleNamespace(model_type="swa", mixer_types=["swa"]))
    config = AutoModelForCausalLM.from_pretrained(folders["sse-h"]).config
    tp = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))
    with pytest.raises(ServeError, match="--tensor-parallel-size 1"):
        check_config(config, tp)


def test_openai_server_completion(folders, tmp_path):
    """`subquadratic serve FOLDER --engine vllm`: vLLM's OpenAI-compatible server on 127.0.0.1 with the
    plugin (eager by the plugin's config hook: no --enforce-eager given); one greedy completion, its
    tokens Transformers' generate()'s; the server is stopped at the end."""
    folder = folders["sse-h"]
    server_args = [folder, "--engine", "vllm", "--max-model-len", "256", "--dtype", "float32"]
    with running_server(server_args, tmp_path / "server.log", env(), wait=300, cwd=tmp_path) as base:
        text = "the value of the first line in the data file"
        body = {"model": folder, "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        reply = post(base + "/v1/completions", body)
        choice = reply["choices"][0]
        prompt = word_tokenizer()(text, add_special_tokens=False)["input_ids"]
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == reference(folder, prompt, 8)


def test_importing_the_package_imports_no_vllm():
    """With vLLM installed too, `import subquadratic` (and its plugin module) leaves vLLM unimported."""
    from tests.test_vllm_plugin_import import import_check

    assert import_check() == "[]"
