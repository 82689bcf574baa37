"""Needle retrieval at chosen context lengths, RULER-style, written here from the tasks' definitions:
passkey, multi-key needle-in-a-haystack (`niah`), multi-value needles (`mv-niah`) and variable
tracking (`vt`).

A prompt of exactly L tokens is the tokenizer's leading special tokens, an intro, filler (one filler
passage repeated and cut to fit) with needles inserted between two filler passages, and a question.
Passkey: one needle holding a random number of `digits` digits. NIAH: `num_needles` needles, each a
key (a distinct word) -> value (a number); one of them is queried. The queried needle sits at the
filler boundary nearest to `depth` x (filler length); the other needles at random boundaries.
Multi-value (`mv-niah`): `num_needles` needles of ONE key, each with its own value; the question asks
for all of them; the first needle sits at `depth`, the others at random boundaries. Variable tracking
(`vt`): a chain of `num_needles` assignments, `VAR A = 48213.`, `VAR B = VAR A.`, ... in this order
(the first at `depth`, the others at random boundaries after it; `num_needles` - 1 hops); the question
asks for every variable that holds the value. Both score the share of the expected items (numbers or
variable names, as whole words) that the greedy answer names: 1 when all are named, 0.5 for half.

Two templates: "prose" (sentences) and "code" (`PASSKEY = 48213` ... Python filler ... `assert
PASSKEY ==`), for small models pretrained on source code only. Each piece is tokenized on its own
(no special tokens) and the pieces are concatenated, so the answer tokens are exactly those scored.

Per prompt: `correct` = greedy generation (Transformers' `generate`, `do_sample=False`, answer length
plus 2 new tokens) starts with the value as a whole number, after optional spaces and the needle's
own punctuation (`answer_matches`: the prose needle reads "... is: 43936." and its question ends
"... is", so a model that retrieved it writes ": 43936."); `logprob` = mean over the answer tokens
of log p(answer token | prompt, earlier answer tokens), teacher-forced in one forward pass: a graded
signal where exact matches are rare. The answer scored is the needle's own continuation of the
question (" 48213" after "The pass key is", ": 43936" after "... magic number for apple is").
Reported per length: accuracy (mean of `correct`), mean `logprob`, the number of prompts, the
accuracy at each depth, and every prompt's sample (depth, value, generated text, correct, logprob).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .errors import EvaluationError
from .ppl import model_device, progress_meter


@dataclass(frozen=True)
class Template:
    """The pieces of a retrieval prompt; `needle`, `question` and `answer` are formatted with key and value."""

    intro: str
    filler: str
    needle: str
    question: str
    answer: str = " {value}"


_PROSE_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_CODE_FILLER = (
    "\n\ndef area(width, height):\n    return width * height\n\n\n"
    "total = sum(area(w, h) for w, h in [(1, 2), (3, 4)])\n"
)

#: (task, template name) -> Template.
TEMPLATES: dict[tuple[str, str], Template] = {
    ("passkey", "prose"): Template(
        intro="There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
              "I will quiz you about it.",
        filler=_PROSE_FILLER,
        needle=" The pass key is {value}. Remember it. {value} is the pass key.",
        question=" What is the pass key? The pass key is",
    ),
    ("passkey", "code"): Template(
        intro="# settings\n", filler=_CODE_FILLER, needle="\nPASSKEY = {value}\n", question="\nassert PASSKEY ==",
    ),
    ("niah", "prose"): Template(
        intro="Some special magic numbers are hidden inside the following text. Make sure to memorize them. "
              "I will quiz you about one of them.",
        filler=_PROSE_FILLER,
        needle=" One of the special magic numbers for {key} is: {value}.",
        question=" What is the special magic number for {key}? The special magic number for {key} is",
        answer=": {value}",  # the needle's own punctuation
    ),
    ("niah", "code"): Template(
        intro="VALUES = {}\n", filler=_CODE_FILLER, needle='\nVALUES["{key}"] = {value}\n',
        question='\nassert VALUES["{key}"] ==',
    ),
    ("mv-niah", "prose"): Template(
        intro="Some special magic numbers are hidden inside the following text. Make sure to memorize them. "
              "I will quiz you about them.",
        filler=_PROSE_FILLER,
        needle=" One of the special magic numbers for {key} is: {value}.",
        question=" What are all the special magic numbers for {key}? The special magic numbers for {key} are",
        answer=": {value}",  # value: the numbers in the order of the needles, ", "-separated
    ),
    ("mv-niah", "code"): Template(
        intro="VALUES = {}\n", filler=_CODE_FILLER, needle='\nVALUES.setdefault("{key}", []).append({value})\n',
        question='\nassert VALUES["{key}"] ==', answer=" [{value}]",
    ),
    ("vt", "prose"): Template(
        intro="Memorize and track the chain(s) of variable assignment hidden in the following text.",
        filler=_PROSE_FILLER,
        needle=" VAR {key} = {value}.",  # the first link; the others are `link`
        question=" Question: Find all variables that are assigned the value {value} in the text above. Answer: "
                 "the variables that are assigned the value {value} are",
        answer=": {key}",  # key: the variable names in chain order, ", "-separated
    ),
    ("vt", "code"): Template(
        intro="# variables\n", filler=_CODE_FILLER, needle="\n{key} = {value}\n",
        question="\n# every variable equal to {value}:\nassert [", answer="{key}]",
    ),
}
#: the later links of a variable-tracking chain: (template name) -> text with {key} and {prev}
VT_LINKS = {"prose": " VAR {key} = VAR {prev}.", "code": "\n{key} = {prev}\n"}
#: tasks whose answer is several items (numbers or names), scored by the share named
MULTI_ITEM = ("mv-niah", "vt")
#: Needle keys of NIAH (distinct words; one prompt uses `num_needles` of them).
KEYS = ("apple", "river", "garden", "silver", "window", "forest", "rocket", "pencil", "castle", "engine",
        "harbor", "violet", "marble", "canyon", "meadow", "lantern")
DEPTHS = (0.1, 0.5, 0.9)


#: what may stand before the number in a correct answer: spaces, and the punctuation a needle puts
#: between its key and its value (": 43936", "= 43936", quotes or emphasis around the number)
ANSWER_LEAD = r"[\s:=\"'`*]*"


def answer_matches(text: str, value: str) -> bool:
    """True when `text` (a generated continuation) starts with the number `value` as a whole number,
    after optional spaces and punctuation (`ANSWER_LEAD`): " 48213.", ": 48213.", "= 48213" match
    48213; " 482130", " x 48213", ": 4821" do not."""
    m = re.match(ANSWER_LEAD + r"(\d+)", text)
    return m is not None and m.group(1) == value


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assemble(
    tokenizer,
    template: Template,
    length: int,
    pieces: list[str],
    question: str,
    answer: str,
    anchor: int,
    depth: float,
    rng: random.Random,
    ordered: bool = False,
    with_spans: bool = False,
) -> tuple:
    """(prompt ids of exactly `length` tokens, answer ids): the needle texts `pieces` inserted into the
    filler, pieces[anchor] at `depth` in [0, 1] of it and the others at random filler boundaries
    (`ordered`: after the anchor's and in the order given), then `question`; `answer` tokenized.
    `with_spans`: a third item, each piece's (start, end) token positions in the prompt."""
    head = tokenizer("", add_special_tokens=True)["input_ids"] + _encode(tokenizer, template.intro)
    q_ids = _encode(tokenizer, question)
    ids = [_encode(tokenizer, p) for p in pieces]
    filler = _encode(tokenizer, template.filler)
    n_fill = length - len(head) - len(q_ids) - sum(map(len, ids))
    if n_fill < len(filler):
        need = length - n_fill + len(filler)
        raise EvaluationError(f"length {length} is too short for this prompt (at least {need} tokens); "
                              "use a longer --seq-len or fewer needles")
    fill = (filler * (n_fill // len(filler) + 1))[:n_fill]
    bounds = list(range(0, n_fill + 1, len(filler)))  # between two filler passages (or at the start)
    at = min(bounds, key=lambda b: abs(b - depth * n_fill))
    if ordered:  # the anchor first, the others after it in order (equal boundaries keep the order)
        later = sorted(rng.choice([b for b in bounds if b >= at]) for _ in range(len(pieces) - 1))
        where = [at] + later
    else:
        where = [at if i == anchor else rng.choice(bounds) for i in range(len(pieces))]
    for i in sorted(range(len(pieces)), key=lambda i: (where[i], i), reverse=True):
        fill[where[i]:where[i]] = ids[i]
    prompt = head + fill + q_ids
    if not with_spans:
        return prompt, _encode(tokenizer, answer)
    spans, shift = [None] * len(pieces), len(head)
    for i in sorted(range(len(pieces)), key=lambda i: (where[i], i)):  # earlier pieces shift the later ones
        spans[i] = (where[i] + shift, where[i] + shift + len(ids[i]))
        shift += len(ids[i])
    return prompt, _encode(tokenizer, answer), spans


def build_prompt(
    tokenizer,
    template: Template,
    length: int,
    needles: list[tuple[str, str]],
    query: int,
    depth: float,
    rng: random.Random,
) -> tuple[list[int], list[int]]:
    """(prompt ids of exactly `length` tokens, answer ids) for `needles` [(key, value)], asking for
    needles[query], which is placed at `depth` in [0, 1] of the filler (see the module doc)."""
    key, value = needles[query]
    pieces = [template.needle.format(key=k, value=v) for k, v in needles]
    return assemble(tokenizer, template, length, pieces, template.question.format(key=key, value=value),
                    template.answer.format(key=key, value=value), query, depth, rng)


#: letters of the variable names of `vt` (upper case, as RULER's)
_NAME_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def draw_prompt(tokenizer, task: str, template: str, length: int, num_needles: int, depth: float, digits: int,
                rng: random.Random, with_span: bool = False) -> tuple:
    """One random prompt of `task` (see the module doc): (prompt ids, answer ids, the expected items:
    one value for passkey / niah, every value for mv-niah, every variable name for vt). `with_span`
    (passkey / niah): a fourth item, the queried needle's (start, end) token positions in the prompt."""
    tpl = TEMPLATES[task, template]

    def number() -> str:
        return str(rng.randrange(10 ** (digits - 1), 10 ** digits))

    if task in ("passkey", "niah"):
        keys = rng.sample(KEYS, num_needles)
        needles = [(k, number()) for k in keys]
        query = rng.randrange(num_needles)
        key, value = needles[query]
        pieces = [tpl.needle.format(key=k, value=v) for k, v in needles]
        prompt, answer, spans = assemble(tokenizer, tpl, length, pieces, tpl.question.format(key=key, value=value),
                                         tpl.answer.format(key=key, value=value), query, depth, rng, with_spans=True)
        return (prompt, answer, [value]) + ((spans[query],) if with_span else ())
    if task == "mv-niah":
        key = rng.choice(KEYS)
        values = list(dict.fromkeys(number() for _ in range(4 * num_needles)))[:num_needles]
        pieces = [tpl.needle.format(key=key, value=v) for v in values]
        question = tpl.question.format(key=key, value="")
        prompt, answer = assemble(tokenizer, tpl, length, pieces, question, tpl.answer.format(value=", ".join(values)),
                                  0, depth, rng)
        return prompt, answer, values
    # vt: a chain of distinct five-letter names
    names: list[str] = []
    while len(names) < num_needles:
        name = "".join(rng.choice(_NAME_LETTERS) for _ in range(5))
        names += [name] if name not in names else []
    value = number()
    pieces = [tpl.needle.format(key=names[0], value=value)]
    pieces += [VT_LINKS[template].format(key=k, prev=p) for p, k in zip(names, names[1:], strict=False)]
    prompt, answer = assemble(tokenizer, tpl, length, pieces, tpl.question.format(value=value),
                              tpl.answer.format(key=", ".join(names)), 0, depth, rng, ordered=True)
    return prompt, answer, names


def min_length(tokenizer, task: str = "passkey", template: str = "prose", num_needles: int = 1,
               digits: int = 5) -> int:
    """A length that holds any prompt of this kind: the fixed pieces, the longest needles and question
    (the longest keys, a value of `digits` digits, 2 tokens of slack each) and one filler passage."""
    tpl = TEMPLATES[task, template]
    fixed = tokenizer("", add_special_tokens=True)["input_ids"] + _encode(tokenizer, tpl.intro + tpl.filler)
    nines = "9" * digits
    if task == "vt":  # names of five letters: "ZZZZZ" tokenises at least as long as most
        name = "Z" * 5
        question = len(_encode(tokenizer, tpl.question.format(value=nines)))
        needles = (len(_encode(tokenizer, tpl.needle.format(key=name, value=nines)))
                   + (num_needles - 1) * len(_encode(tokenizer, VT_LINKS[template].format(key=name, prev=name))))
        return len(fixed) + question + needles + 4 * (num_needles + 1)
    keys = sorted(KEYS, key=lambda k: len(_encode(tokenizer, tpl.needle.format(key=k, value=nines))))
    longest = keys[-num_needles:] if task != "mv-niah" else [keys[-1]] * num_needles
    question = max(len(_encode(tokenizer, tpl.question.format(key=k, value=""))) for k in longest)
    needles = sum(len(_encode(tokenizer, tpl.needle.format(key=k, value=nines))) for k in longest)
    return len(fixed) + question + needles + 2 * (num_needles + 1)


#: forward passes over a prompt per scored prompt (the teacher-forced answer, then generation): what a
#: progress bar counts, in prompt tokens
FORWARDS_PER_PROMPT = 2


def items_named(text: str, items: list[str]) -> float:
    """The share of `items` (numbers or names) that `text` names as whole words: " 48213, 10577" names
    both of ["48213", "10577"]; " 482130" names neither 48213 nor 4821."""
    if not items:
        return 0.0
    return sum(re.search(rf"(?<![0-9A-Za-z_]){re.escape(i)}(?![0-9A-Za-z_])", text) is not None
               for i in items) / len(items)


@torch.no_grad()
def score_answer(model, tokenizer, prompt: list[int], answer: list[int], value: str | list[str]) -> dict:
    """{"correct", "logprob", "generated"} of one prompt (see the module doc). `value`: the one
    expected value (correct: `answer_matches`, 0 or 1), or a list of expected items (correct: the
    share named, `items_named`)."""
    from transformers import GenerationConfig

    device = model_device(model)
    full = torch.tensor([prompt + answer], device=device)
    logits = model(input_ids=full, use_cache=False, logits_to_keep=len(answer) + 1).logits  # [1, A + 1, V]
    logp = logits[0, :-1].float().log_softmax(-1)
    logprob = logp.gather(-1, full[0, len(prompt):, None]).mean().item()
    ids = full[:, :len(prompt)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = GenerationConfig(max_new_tokens=len(answer) + 2, do_sample=False, num_beams=1,
                              pad_token_id=pad if pad is not None else 0, eos_token_id=tokenizer.eos_token_id)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    generated = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    correct = (float(answer_matches(generated, value)) if isinstance(value, str)
               else items_named(generated, list(value)))
    return {"correct": correct, "logprob": logprob, "generated": generated}


def retrieval(
    model,
    tokenizer,
    lengths: Iterable[int],
    *,
    task: str = "passkey",
    template: str = "prose",
    num_needles: int = 1,
    depths: Iterable[float] = DEPTHS,
    trials: int = 2,
    digits: int = 5,
    seed: int = 0,
    progress=False,
) -> dict[int, dict]:
    """Retrieval accuracy at each length: {L: {"accuracy", "stderr", "logprob", "prompts", "by_depth":
    {depth: acc}, "samples": [{"depth", "value", "generated", "correct", "logprob"}, ...]}}; `stderr` is
    the standard error of the accuracy over the prompts (sample standard deviation / sqrt(prompts)).

    Lengths shorter than `min_length` (too short to hold the prompt) are left out; none left is an error.
    `task` ("passkey", "niah", "mv-niah", "vt") picks the templates; `trials` prompts per (length,
    depth), each with fresh random values (and keys), from `seed`. `progress`: see `ppl.progress_meter` (it counts
    `FORWARDS_PER_PROMPT` x L tokens per prompt)."""
    if (task, template) not in TEMPLATES:
        raise EvaluationError(f"no {task} template {template!r}; available: "
                              f"{', '.join(t for k, t in TEMPLATES if k == task)}")
    if not 1 <= num_needles <= len(KEYS):
        raise EvaluationError(f"num_needles must be in 1..{len(KEYS)}, got {num_needles}")
    depths = tuple(depths)
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise EvaluationError(f"depths must be fractions in [0, 1], got {depths}")
    shortest = min_length(tokenizer, task, template, num_needles, digits)
    lengths = [L for L in lengths if L >= shortest]
    if not lengths:
        raise EvaluationError(f"every length is too short for a {task} prompt (at least {shortest} tokens here); "
                              "use a longer --seq-len or fewer needles")
    was_training = model.training
    model.eval()
    out = {}
    total = FORWARDS_PER_PROMPT * trials * len(depths) * sum(lengths)
    with progress_meter(progress, total, task) as meter:
        for L in lengths:
            rng = random.Random(f"{seed}-{task}-{L}")
            rows = []
            for depth in depths:
                for _ in range(trials):
                    prompt, answer, items = draw_prompt(tokenizer, task, template, L, num_needles, depth, digits, rng)
                    value = items[0] if task not in MULTI_ITEM else items
                    rows.append({"depth": depth, "value": value,
                                 **score_answer(model, tokenizer, prompt, answer, value)})
                    meter.update(FORWARDS_PER_PROMPT * L)
            acc = sum(r["correct"] for r in rows) / len(rows)
            out[L] = {
                "accuracy": acc,
                "stderr": stderr([r["correct"] for r in rows]),
                "logprob": sum(r["logprob"] for r in rows) / len(rows),
                "prompts": len(rows),
                "by_depth": {d: sum(r["correct"] for r in rows if r["depth"] == d) / trials for d in depths},
                "samples": rows,
            }
    model.train(was_training)
    return out


def stderr(values: list[float]) -> float:
    """The standard error of the mean of `values`: sample standard deviation / sqrt(n); 0 for one value."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5


def passkey(model, tokenizer, lengths: Iterable[int], *, template: str = "prose", **kw) -> dict[int, dict]:
    """Passkey retrieval (one needle) at each length; see `retrieval`."""
    return retrieval(model, tokenizer, lengths, task="passkey", template=template, num_needles=1, **kw)


def niah(model, tokenizer, lengths: Iterable[int], *, template: str = "prose", num_needles: int = 4,
         **kw) -> dict[int, dict]:
    """Multi-key needle in a haystack (`num_needles` key -> value needles, one queried); see `retrieval`."""
    return retrieval(model, tokenizer, lengths, task="niah", template=template, num_needles=num_needles, **kw)


def mv_niah(model, tokenizer, lengths: Iterable[int], *, template: str = "prose", num_needles: int = 4,
            **kw) -> dict[int, dict]:
    """Multi-value needles (`num_needles` values of one key, all asked for); see `retrieval`."""
    return retrieval(model, tokenizer, lengths, task="mv-niah", template=template, num_needles=num_needles, **kw)


def variable_tracking(model, tokenizer, lengths: Iterable[int], *, template: str = "prose", num_needles: int = 3,
                      **kw) -> dict[int, dict]:
    """Variable tracking (a chain of `num_needles` assignments, every variable asked for); see `retrieval`."""
    return retrieval(model, tokenizer, lengths, task="vt", template=template, num_needles=num_needles, **kw)
