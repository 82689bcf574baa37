"""Greedy tokens of a model folder through `vllm.LLM`, in a process of its own (vLLM spawns its
workers, so this runs under `if __name__ == "__main__"`): each prompt alone, then all of them as one
batch. Run by tests/vllm/test_vllm.py:

    python -m tests.vllm.generate FOLDER PROMPTS.json OUT.json MAX_TOKENS BATCHED_TOKENS

PROMPTS.json: a list of token-id lists; OUT.json gets {"single": [...], "batch": [...]}, the new
tokens of each prompt. BATCHED_TOKENS caps the tokens of one engine step, so that a long prompt is
prefilled in chunks beside the others' decode steps.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    folder, prompts_file, out_file, max_tokens, batched = sys.argv[1:6]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    prompts = json.loads(open(prompts_file).read())
    llm = LLM(model=folder, enforce_eager=True, max_model_len=256, dtype="float32", max_num_seqs=8,
              max_num_batched_tokens=int(batched), enable_chunked_prefill=True, skip_tokenizer_init=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)

    def run(batch: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    result = {"single": [run([p])[0] for p in prompts], "batch": run(prompts)}
    with open(out_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
