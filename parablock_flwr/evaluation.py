"""Held-out evaluation, the same code for the server's rounds and `parablock-flwr evaluate`.

Every evaluation gives the held-out loss (mean cross-entropy per answer
token) and its perplexity. On data with exact answers (``data.has_exact_answers``)
it can also generate answers greedily for the first ``generate-examples``
held-out prompts and score them (``answer_correct``): the task accuracy.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable

import datasets
import torch
from torch import nn

from .data import has_exact_answers, in_order_batches
from .training import autocast

FINAL_MARK = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*|-?\.\d+")


@torch.no_grad()
def heldout_loss(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], precision: str) -> float:
    """Mean cross-entropy per answer token over the held-out batches."""
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    model.eval()
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(precision, device):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shifted = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), shifted.flatten(), ignore_index=-100, reduction="sum"
        )
        total += loss.item()
        tokens += int((shifted != -100).sum())
    return total / tokens if tokens else math.nan


def final_number(text: str) -> float | None:
    """The answer a math solution ends with: ``#### N`` if present, else the last number."""
    marked = FINAL_MARK.findall(text)
    found = marked or NUMBER.findall(text)
    for candidate in reversed(found):
        try:
            return float(candidate.replace(",", "").rstrip("."))
        except ValueError:
            continue
    return None


def reference_answer(response: str) -> str:
    """The answer a reference response gives: after GSM8K's ``####`` if present, else all of it."""
    return response.rpartition("####")[2].strip() if "####" in response else response.strip()


def normalised(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".").strip()


def answer_correct(reference: str, generated: str) -> bool:
    """Whether ``generated`` answers like ``reference``: a numeric answer by the value of the final
    number in the text (``#### N``, else the last number), any other by exact match up to case,
    spacing and a final full stop."""
    want = reference_answer(reference)
    number = final_number(want) if NUMBER.fullmatch(want.replace(" ", "")) else None
    if number is not None:
        got = final_number(generated)
        return got is not None and math.isclose(number, got)
    return normalised(generated) == normalised(want)


@torch.no_grad()
def greedy_answers(
    model: nn.Module, tokenizer, prompts: list[str | list[dict]], max_new_tokens: int, batch_size: int
) -> list[str]:
    """Greedy completions of chat-templated prompts (left-padded batches): a prompt is a user turn's
    text, or a conversation (the turns before the answer)."""
    device = next(model.parameters()).device
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    answers = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}] if isinstance(p, str) else p,
                    tokenize=False,
                    add_generation_prompt=True,
                )
                for p in prompts[start : start + batch_size]
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            answers += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return answers


def single_answer_turn(row: dict) -> list[dict] | None:
    """A ``messages:`` row's turns before its answer, if the conversation has exactly one assistant
    turn and it is the last (else None: which of several answers to match is not defined)."""
    turns = json.loads(row["messages"])
    answers = [i for i, m in enumerate(turns) if m["role"] == "assistant"]
    return turns[: answers[0]] if len(answers) == 1 and answers[0] == len(turns) - 1 else None


def scored_rows(heldout: datasets.Dataset, limit: int, chat_exact_match: bool) -> tuple[list, list[dict], int]:
    """(prompts, rows, skipped): the first ``limit`` held-out rows generation is scored on. Chat rows
    (``messages``) only with ``chat_exact_match`` and a single answer turn; ``skipped``: those without."""
    rows = heldout.select(range(min(limit, len(heldout))))
    if "messages" not in rows.column_names:
        return list(rows["prompt"]), list(rows), 0
    if not chat_exact_match:
        return [], [], 0
    kept = [(single_answer_turn(r), r) for r in rows]
    kept = [(turns, r) for turns, r in kept if turns is not None]
    return [t for t, _ in kept], [r for _, r in kept], len(rows) - len(kept)


def evaluate(
    model: nn.Module, tokenizer, heldout: datasets.Dataset, cfg, generate: bool, chat_exact_match: bool = False
) -> tuple[dict, list]:
    """(metrics, samples): held-out loss and perplexity; with ``generate`` on data with exact answers,
    the task accuracy too; with ``chat_exact_match`` on chat data (``messages:``), the exact match of
    the generated answer (up to case, spacing and a final full stop) on rows with a single answer turn."""
    batches = in_order_batches(heldout, cfg.eval_batch_size, tokenizer.pad_token_id)
    loss = heldout_loss(model, batches, cfg.precision)
    metrics = {"heldout_loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}
    samples: list[dict] = []
    chat = cfg.dataset.startswith("messages:")
    if not generate or cfg.generate_examples <= 0 or not (has_exact_answers(cfg.dataset) or chat):
        return metrics, samples
    prompts, rows, skipped = scored_rows(heldout, cfg.generate_examples, chat_exact_match)
    if not rows:
        return metrics, samples
    answers = greedy_answers(model, tokenizer, prompts, cfg.max_new_tokens, cfg.eval_batch_size)
    for row, answer in zip(rows, answers):
        correct = normalised(answer) == normalised(row["response"]) if chat else answer_correct(row["response"], answer)
        samples.append({"prompt": row["prompt"], "reference": row["response"], "generated": answer, "correct": correct})
    metrics["task_accuracy"] = sum(s["correct"] for s in samples) / len(samples)
    metrics["task_examples"] = len(samples)
    if chat:
        metrics["task_skipped_not_single_answer"] = skipped
    # What always giving the most common reference answer would score: a model that only learned
    # the answer format and the labels' prior reaches this, not more.
    references = Counter(normalised(s["reference"] if chat else reference_answer(s["reference"])) for s in samples)
    metrics["task_accuracy_constant"] = references.most_common(1)[0][1] / len(samples)
    return metrics, samples
