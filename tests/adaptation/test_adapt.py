"""`subquadratic adapt` at tiny scale on CPU: packing, both stages, what trains, resuming, LoRA, the
command line and its errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from subquadratic.adaptation import AdaptConfig, adapt, kl_to_teacher
from subquadratic.adaptation.train import (
    Trainee,
    Transfer,
    _drop_tied_copies,
    converted_layers,
    mixer_parameters,
    new_parameter_names,
)
from subquadratic.data import DataError, load_texts
from tests.processes import clean_env, run_child

pytestmark = pytest.mark.usefixtures("one_thread")


def run(student, out, files, **kw):
    settings = dict(max_steps=6, stage1_steps=2, seq_len=64, batch_size=2, save_every=100, progress=False)
    return adapt(AdaptConfig(student=str(student), output_dir=str(out), data=[str(f) for f in files],
                             **{**settings, **kw}))


def log(out):
    return [json.loads(line) for line in (out / "adapt_log.jsonl").read_text().splitlines()]


def weights(folder):
    """Every tensor of a saved folder, whatever its sharding."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def test_load_texts_reads_files_folders_and_jsonl(tmp_path, corpus):
    files, _ = corpus
    (tmp_path / "a.jsonl").write_text('{"body": "first record"}\n{"body": "second"}\n')
    assert len(load_texts([str(f) for f in files[:2]])) == 2  # one document per text file
    assert len(load_texts([str(files[0].parent)])) == len(files) + 1  # the folder: held-out file included
    ds = load_texts([str(tmp_path / "a.jsonl")], text_field="body")
    assert ds["text"] == ["first record", "second"]
    with pytest.raises(DataError, match="no column 'text'"):
        load_texts([str(tmp_path / "a.jsonl")])


def test_fresh_spla_with_the_whole_row_in_budget_matches_its_teacher_exactly(tmp_path, corpus, converted,
                                                                            dense_folder):
    """A fresh SPLA conversion whose budget covers a row is the dense model: attention transfer and
    distillation start at zero loss. This holds only if the teacher's packed documents and the
    student's line up, layer by layer."""
    student = converted("spla", block_size=16, top_k_blocks=4)
    out = run(student, tmp_path / "out", corpus[0], teacher=dense_folder, loss="kl", max_steps=2, stage1_steps=1,
              lr=0.0, stage1_lr=0.0)
    first, second = log(out)
    assert first["stage"] == 1 and first["loss"] < 1e-10
    assert second["stage"] == 2 and abs(second["loss"]) < 1e-5


@pytest.mark.parametrize("to, options", [
    ("spla", dict(block_size=4, top_k_blocks=3)), ("sse-h", dict(sse_sliding_window=8)),
    ("sse-h", dict(sse_sliding_window=0)), ("hla", {}), ("hla-h", dict(hla_sliding_window=8)),
])
def test_both_stages_reach_every_trainable_parameter(converted, dense_folder, to, options):
    """Each stage's loss gives every trainable parameter a gradient, as plain DDP (no unused-parameter
    search) needs: in stage 1 the converted mixers get the transfer loss's and every other parameter
    an exact zero (which `adapt` drops before the step); stage 2 reaches everything. Stage 1's mixer
    gradients are those of the transfer loss alone. (Windows of 8 tokens: a window that covers the
    row is the source attention itself, with nothing to transfer.)"""
    student = AutoModelForCausalLM.from_pretrained(converted(to, **options)).train()  # SPLA beyond its budget
    teacher = AutoModelForCausalLM.from_pretrained(dense_folder).eval().requires_grad_(False)
    layers = converted_layers(student.config)
    trainee = Trainee(student, teacher, "kl")
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "position_ids": torch.cat([torch.arange(25), torch.arange(15)]).expand(2, 40),
             "labels": ids}
    trainee.transfer = Transfer(teacher, student, layers)
    loss = trainee(batch, 1)
    mixers = mixer_parameters(trainee, layers)
    in_mixers = [p for p in trainee.parameters() if id(p) in mixers]
    alone = torch.autograd.grad(torch.stack(trainee.transfer.losses).mean(), in_mixers, retain_graph=True)
    loss.backward()
    assert mixers and all(p.grad is not None for p in trainee.parameters()), "stage 1 leaves a parameter out"
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in trainee.parameters() if id(p) not in mixers)
    assert all(torch.equal(p.grad, g) for p, g in zip(in_mixers, alone, strict=True))  # the transfer loss's own
    assert any(g.abs().max() > 0 for g in alone)
    trainee.transfer.remove()
    trainee.transfer = None
    trainee.zero_grad(set_to_none=True)
    trainee(batch, 2).backward()
    assert all(p.grad is not None for p in trainee.parameters()), "stage 2 leaves a parameter out"


def heldout_kl(folder, dense_folder, held) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dense_folder)
    ids = torch.tensor(tok(held.read_text())["input_ids"][: 4 * 64]).view(4, 64)
    teacher = AutoModelForCausalLM.from_pretrained(dense_folder).eval()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return kl_to_teacher(model(ids).logits, teacher(ids).logits, ids).item()


@pytest.mark.parametrize("to", ["hla", "sse-h"])
def test_both_stages_lower_their_loss_and_the_output_loads(tmp_path, corpus, converted, dense_folder, to):
    """Attention transfer then distillation on real text. Stage 1's loss falls (its last three steps
    against its first two: 0.39-0.77 of it over three seeds, asserted < 0.9); the adapted model's
    next-token KL to the dense model on held-out text falls (0.38-0.52 of the fresh conversion's over
    three seeds, asserted < 0.75). OUT loads, generates, and its card records the run. SSE-H without
    its window branch: within these 64-token rows the default 64-token window is the source attention
    itself, and the fresh conversion has nothing to learn."""
    student = converted(to, **({"sse_sliding_window": 0} if to == "sse-h" else {}))
    out = run(student, tmp_path / "out", corpus[0], teacher=dense_folder, loss="kl", train="mixer",
              max_steps=24, stage1_steps=12, lr=3e-3, stage1_lr=3e-3, batch_size=4)
    entries = log(out)
    assert [e["step"] for e in entries] == list(range(1, 25))
    transfer = [e["loss"] for e in entries if e["stage"] == 1]
    assert len(transfer) == 12 and sum(transfer[-3:]) / 3 < 0.9 * sum(transfer[:2]) / 2, transfer
    fresh, adapted = heldout_kl(student, dense_folder, corpus[1]), heldout_kl(out, dense_folder, corpus[1])
    assert adapted < 0.75 * fresh, (fresh, adapted)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.model_type == AutoModelForCausalLM.from_pretrained(student).config.model_type
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 7)
    card = (out / "README.md").read_text()
    assert "## Adaptation" in card and "24 (12 attention transfer, 12 kl fine-tuning)" in card
    assert "before use" not in card and "not ready to use" not in card  # the card of the adapted model
    assert next(line for line in card.splitlines() if line.startswith("# ")).endswith(", adapted")
    assert not (out / "checkpoints").exists()


def test_train_new_changes_only_the_parameters_the_dense_model_lacks(tmp_path, corpus, converted, dense_folder):
    student = converted("spla", block_size=4, top_k_blocks=3)
    out = run(student, tmp_path / "out", corpus[0], teacher=dense_folder, train="new", lr=1e-2, stage1_lr=1e-2)
    before, after = weights(student), weights(out)
    config = AutoModelForCausalLM.from_pretrained(student).config
    new = new_parameter_names(config)
    assert new and all(".rla_norm." in n for n in new)
    for name, value in before.items():
        assert torch.equal(value, after[name]) != (name in new), name


def test_new_lr_scale_moves_only_the_new_parameters_faster(tmp_path, corpus, converted, dense_folder):
    """One step from the same start: with --new-lr-scale 100 the residual gains (the parameters the dense
    model lacks) move 100 times as far as with 1 (AdamW's first step is lr x sign), every other
    parameter exactly as far; the card names the scale."""
    student = converted("spla", block_size=4, top_k_blocks=3)
    kw = dict(teacher=dense_folder, loss="kl", max_steps=1, stage1_steps=0, lr=1e-4)
    plain = run(student, tmp_path / "plain", corpus[0], **kw)
    fast = run(student, tmp_path / "fast", corpus[0], new_lr_scale=100.0, **kw)
    before, a, b = weights(student), weights(plain), weights(fast)
    new = new_parameter_names(AutoModelForCausalLM.from_pretrained(student).config)
    moved = 0
    for name, w0 in before.items():
        da, db = a[name] - w0, b[name] - w0
        if name in new:
            assert da.abs().max() > 0, name
            torch.testing.assert_close(db, 100 * da, rtol=1e-3, atol=1e-9)
            moved += 1
        else:
            assert torch.equal(a[name], b[name]), name
    assert moved == len(new) > 0
    assert "x100 for the parameters the dense model lacks" in (tmp_path / "fast" / "README.md").read_text()


def test_lora_trains_adapters_and_saves_merged_weights(tmp_path, corpus, converted, dense_folder):
    pytest.importorskip("peft")
    student = converted("hla", softmax_layers="1")
    out = run(student, tmp_path / "out", corpus[0], teacher=dense_folder, train="lora", lora_rank=4, lr=1e-2,
              stage1_lr=1e-2)
    before, after = weights(student), weights(out)
    assert set(before) == set(after)  # merged: no adapter tensors, the same names
    layers = converted_layers(AutoModelForCausalLM.from_pretrained(student).config)
    assert layers == [0]
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert all(n.startswith("model.layers.0.self_attn.") for n in changed), changed  # layer 1 keeps softmax


def test_a_resumed_run_continues_where_it_stopped(tmp_path, corpus, converted, dense_folder):
    """Stopped after step 4 and resumed, a run logs the same losses and ends with the same weights as
    one that ran through (stage 1 ends at step 3, so the resume lands in stage 2)."""
    student = converted("hla")
    kw = dict(teacher=dense_folder, loss="lm", max_steps=7, stage1_steps=3, save_every=2, lr=3e-3)
    whole = run(student, tmp_path / "whole", corpus[0], **kw)
    part = tmp_path / "part"
    run(student, part, corpus[0], stop_after=4, **kw)
    assert (part / "checkpoints" / "step-4" / "config.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(part / "checkpoints" / "step-4") is not None  # loadable
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["step-3", "step-4"]  # total limit 2
    with pytest.raises(ValueError, match="--resume"):
        run(student, part, corpus[0], **kw)
    run(student, part, corpus[0], resume=True, **kw)
    a, b = log(whole), log(part)
    assert [e["step"] for e in b] == list(range(1, 8))
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7), (x, y)
    wa, wb = weights(whole), weights(part)
    assert all(torch.allclose(wa[n], wb[n], atol=1e-6) for n in wa)


def cli(*args):
    return run_child([sys.executable, "-m", "subquadratic", *args], timeout=300)


def test_cli_adapts_and_refuses_bad_input_in_one_line(tmp_path, corpus, converted, dense_folder):
    student = converted("hla")
    files = [str(f) for f in corpus[0]]
    out = tmp_path / "out"
    r = cli("adapt", student, "-o", out, "--data", *files, "--teacher", dense_folder, "--max-steps", 3,
            "--seq-len", 64, "--batch-size", 2, "--no-progress", "--eval-data", corpus[1],
            "--eval-seq-len", 64, 128, "--eval-max-windows", 2, "--num-proc", 2)
    assert r.returncode == 0, r.stderr
    assert "Removed shared tensor" not in r.stderr  # the checkpoint after stage 1 holds each tied weight once
    entries = log(out)
    assert [e["stage"] for e in entries] == [1, 2, 2]  # a quarter of the steps transfer attention by default
    # each stage's loss under its own name; with a teacher, stage 2 distils (--loss kl) unless told
    assert [next(k for k in e if k.startswith("loss_")) for e in entries] == ["loss_transfer", "loss_kl", "loss_kl"]
    assert all(e["loss"] == e[k] for e in entries for k in e if k.startswith("loss_"))
    card = (out / "README.md").read_text()
    assert card.count("## Adaptation") == 1 and card.count("## Evaluation") == 1
    table, positions = card[card.index("## Evaluation"):].split("By position in the window")
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    cells = {(m.strip(), int(n)): (float(ppl), kl.strip()) for m, n, ppl, kl, _ in rows}  # _: measured on
    # below it, perplexity and KL by position at the longest length, for both models
    assert [line.split("|")[1].strip() for line in positions.splitlines()[4:6]] == ["out", "llama (dense source)"]
    assert set(cells) == {("out", 64), ("out", 128), ("llama (dense source)", 64), ("llama (dense source)", 128)}
    assert all(v[0] > 1 for v in cells.values()) and float(cells[("out", 64)][1]) > 0  # computed, not placeholders
    bad = [
        (["adapt", student, "-o", out, "--data", *files], "not empty"),
        (["adapt", student, "-o", tmp_path / "o2", "--data", tmp_path / "missing.txt"], "missing.txt"),
        (["adapt", dense_folder, "-o", tmp_path / "o3", "--data", *files], "convert it first"),
        (["adapt", student, "-o", tmp_path / "o4", "--data", *files, "--loss", "kl"], "--teacher"),
        (["adapt", student, "-o", tmp_path / "o5", "--data", *files, "--seq-len", 10**7], "fewer than"),
        (["adapt", student, "-o", tmp_path / "o6", "--data", *files, "--num-proc", 0], "--num-proc"),
        (["adapt", student, "-o", tmp_path / "o8", "--data", *files, "--new-lr-scale", 0], "--new-lr-scale"),
        (["adapt", student, "-o", tmp_path / "o7", "--data", *files, "--eval-data", tmp_path / "none.txt"],
         "--eval-data"),
    ]
    for args, needle in bad:
        r = cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not (tmp_path / "o7").exists()  # a missing --eval-data stops the run before it trains


def test_cli_adapt_without_teacher_measures_perplexity_at_the_training_length(tmp_path, corpus, converted):
    out = tmp_path / "out"
    r = cli("adapt", converted("hla"), "-o", out, "--data", *[str(f) for f in corpus[0]], "--max-steps", 1,
            "--seq-len", 64, "--batch-size", 2, "--no-progress", "--eval-data", corpus[1], "--eval-max-windows", 2)
    assert r.returncode == 0, r.stderr
    card = (out / "README.md").read_text()
    section = card[card.index("## Evaluation"):]
    assert "Measured by `subquadratic adapt --eval-data" in section and "KL" not in section
    table, positions = section.split("By position in the window")
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(m.strip(), int(n)) for m, n, _, _ in rows] == [("out", 64)] and float(rows[0][2]) > 1
    assert "| out | 64 |" in positions and "ppl 0-16 | ppl 16-32 | ppl 32-64 |" in positions
    assert rows[0][3].strip() == "2 windows"  # what the row rests on


@pytest.mark.slow
def test_two_processes_train_as_one_with_the_same_global_batch(tmp_path, corpus, converted, dense_folder):
    """`torchrun --nproc_per_node 2 -m subquadratic adapt` (DDP over gloo on CPU; accelerate launch with
    a multi-GPU or FSDP configuration is the same command on GPUs): two processes of 2 rows follow the
    run of one process of 4 rows. Stage 1 matches to rounding; stage 2 averages per-process token
    means, so it matches to 2%."""
    student = converted("hla")
    common = ["adapt", student, "--data", *[str(f) for f in corpus[0]], "--teacher", dense_folder, "--max-steps", 4,
              "--stage1-steps", 2, "--seq-len", 64, "--no-progress", "--loss", "kl", "--save-every", 100]
    one = cli(*common, "-o", tmp_path / "one", "--batch-size", 4)
    assert one.returncode == 0, one.stderr
    two = run_child([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                     "subquadratic", *common, "-o", tmp_path / "two", "--batch-size", 2], timeout=450,
                    env=clean_env(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1"))
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = log(tmp_path / "one"), log(tmp_path / "two")
    assert [e["tokens"] for e in a] == [e["tokens"] for e in b] == [256, 512, 768, 1024]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4 if x["stage"] == 1 else 2e-2), (x, y)


def test_fsdp_mixed_precision_averages_gradients_in_float32(monkeypatch):
    """Under an FSDP2 launch with bf16, adapt hands accelerate a policy that computes in bf16 but
    reduces gradients in float32 and leaves outputs (the loss) in their dtype; elsewhere, no plugin."""
    from subquadratic.adaptation.train import _fsdp_plugin

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert _fsdp_plugin("bf16") is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert _fsdp_plugin("bf16") is None  # FSDP1: accelerate's own policy
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert _fsdp_plugin("no") is None
    plugin = _fsdp_plugin("bf16")
    policy = plugin.mixed_precision_policy
    assert plugin.fsdp_version == 2
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32, None)
    plugin.set_mixed_precision("bf16")  # what accelerate's state does with a given plugin: keeps the policy
    assert plugin.mixed_precision_policy.reduce_dtype == torch.float32


@pytest.mark.slow
def test_fsdp_two_processes_shard_each_layer_and_train_as_one(tmp_path, monkeypatch, corpus, converted,
                                                              dense_folder):
    """accelerate's FSDP2 path with the project's configuration (configs/accelerate/fsdp.yaml: one shard
    unit per decoder layer, full state dict gathered for saving) over two gloo processes, taken on CPU
    by tests/adaptation/fsdp_cpu.py, follows one process with the same global batch (activation
    checkpointing on in the sharded run), and saves a folder that loads with the same weights. (A
    window of 8, below the rows' 64 tokens: one that covers the row leaves nothing to transfer.)"""
    import os

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from fsdp_cpu import fsdp_env

    student = converted("sse-h", sse_sliding_window=8)
    common = ["--data", *[str(f) for f in corpus[0]], "--teacher", dense_folder, "--max-steps", 4,
              "--stage1-steps", 2, "--seq-len", 64, "--no-progress", "--loss", "kl", "--save-every", 100]
    one = cli("adapt", student, *common, "-o", tmp_path / "one", "--batch-size", 4)
    assert one.returncode == 0, one.stderr
    units = tmp_path / "units"
    config = Path(__file__).parents[2] / "configs" / "accelerate" / "fsdp.yaml"
    env = clean_env(**fsdp_env(str(config)), ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", FSDP_UNITS_FILE=str(units),
                    PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    two = run_child([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     Path(__file__).parent / "fsdp_cpu.py", "adapt", student, *common, "-o", tmp_path / "two",
                     "--batch-size", 2, "--gradient-checkpointing"], timeout=450, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    sharded = json.loads(Path(f"{units}.0").read_text())
    layers = AutoConfig.from_pretrained(student).num_hidden_layers
    assert sharded.count("SubquadraticDecoderLayer") == layers and "Trainee" in sharded, sharded
    a, b = log(tmp_path / "one"), log(tmp_path / "two")
    assert [e["tokens"] for e in a] == [e["tokens"] for e in b] == [256, 512, 768, 1024]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4 if x["stage"] == 1 else 2e-2), (x, y)
    wa, wb = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert set(wa) == set(wb)
    fresh = AutoModelForCausalLM.from_pretrained(student).state_dict()
    moved = max((wa[k] - fresh[k]).abs().max().item() for k in wa)
    assert moved > 1e-3  # the run trained: a difference below is not a tolerance that hides everything
    assert all(torch.allclose(wa[k], wb[k], atol=moved / 2) for k in wa)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "two")
    assert all(torch.equal(reloaded.state_dict()[k], wb[k]) for k in wb if k in reloaded.state_dict())


def test_gradient_checkpointing_follows_the_same_run(tmp_path, corpus, converted, dense_folder):
    """Recomputing activations in backward (the stage-1 hooks fire again then) changes no loss; the
    window branch included (8 tokens, below the rows' 64)."""
    student = converted("sse-h", sse_sliding_window=8)
    kw = dict(teacher=dense_folder, loss="kl", max_steps=4, stage1_steps=2, lr=3e-3)
    plain = log(run(student, tmp_path / "plain", corpus[0], **kw))
    checkpointed = log(run(student, tmp_path / "ckpt", corpus[0], gradient_checkpointing=True, **kw))
    for x, y in zip(plain, checkpointed, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-8), (x, y)


def test_a_checkpoint_state_keeps_each_tied_weight_once():
    """accelerate's save_state warns "Removed shared tensor" for every tied pair it finds (and keeps one
    tensor of each storage); the pre-hook keeps the first name of each shared tensor and every other
    tensor, views of one storage (a packed projection's parameters) as copies of their own."""
    emb = torch.randn(8, 4)
    other = torch.randn(8, 4)
    flat = torch.randn(32)
    state = {"embed.weight": emb, "lm_head.weight": emb, "mlp.weight": other, "a": flat[:16].view(4, 4),
             "b": flat[16:].view(4, 4), "step": 3}
    _drop_tied_copies([None], [state], "unused")
    assert list(state) == ["embed.weight", "mlp.weight", "a", "b", "step"]
    assert state["embed.weight"] is emb and state["mlp.weight"] is other
    assert torch.equal(state["a"], flat[:16].view(4, 4)) and torch.equal(state["b"], flat[16:].view(4, 4))
    assert state["a"].untyped_storage().data_ptr() != state["b"].untyped_storage().data_ptr()


def test_default_rows_are_8192_tokens_or_the_context_and_16384_tokens_a_step():
    """Unset --seq-len / --batch-size: rows of min(8192, context), 16384 // seq_len rows (at least 1);
    a value the user gives stays, and the other follows from it."""
    def rows(max_positions, **kw):
        cfg = AdaptConfig(student="s", output_dir="o", data=["d"], **kw)
        cfg.default_rows(max_positions)
        return cfg.seq_len, cfg.batch_size

    assert rows(8192) == (8192, 2) and rows(131072) == (8192, 2) and rows(None) == (8192, 2)
    assert rows(2048) == (2048, 8) and rows(100) == (100, 163)
    assert rows(8192, seq_len=2048) == (2048, 8) and rows(8192, seq_len=32768) == (32768, 1)
    assert rows(8192, batch_size=4) == (8192, 4) and rows(8192, seq_len=64, batch_size=3) == (64, 3)


def test_default_rows_read_the_students_context(tmp_path):
    from subquadratic.adaptation.train import _max_positions

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert _max_positions(str(tmp_path)) == 4096
    assert _max_positions(str(tmp_path / "missing")) is None
