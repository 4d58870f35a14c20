"""Offline training data: generation, chat formatting, answer-only labels, partitions.

``dataset = "reasoning-gym:<task>"`` generates ``num-examples`` seeded rows
with the PyPI package ``reasoning-gym`` (default ``gsm_symbolic``: GSM8K-style
word problems whose worked answers end in ``#### N``). The first
``heldout-examples`` rows are the fixed held-out split no client trains on;
the rest is split across clients with flwr-datasets' ``IidPartitioner``.
"""

from __future__ import annotations

import datasets
import torch
from flwr_datasets.partitioner import IidPartitioner

IGNORE_INDEX = -100


def generate_examples(spec: str, num_examples: int, seed: int) -> datasets.Dataset:
    """Rows with ``prompt`` and ``response`` columns."""
    kind, _, task = spec.partition(":")
    if kind != "reasoning-gym" or not task:
        raise ValueError(f"dataset={spec!r}: expected reasoning-gym:<task>, e.g. reasoning-gym:gsm_symbolic")
    import reasoning_gym  # imported lazily: it pulls in many task modules

    try:
        rows = reasoning_gym.create_dataset(task, size=num_examples, seed=seed)
    except Exception as err:  # reasoning-gym raises plain errors for unknown tasks
        raise ValueError(f"dataset={spec!r}: reasoning-gym cannot make it ({err})") from err
    prompts, responses = [], []
    for row in rows:
        prompts.append(row["question"])
        # Prefer the worked solution (chain of thought ending in "#### N") when the task has one.
        responses.append(row["metadata"].get("answer_cot") or str(row["answer"]))
    return datasets.Dataset.from_dict({"prompt": prompts, "response": responses})


def encode(tokenizer, prompt: str, response: str, max_len: int) -> dict[str, list[int]]:
    """Chat-template the pair; labels cover the assistant's answer only."""
    user = [{"role": "user", "content": prompt}]
    prompt_text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": response}], tokenize=False
    )
    if not full_text.startswith(prompt_text):
        raise ValueError("the tokenizer's chat template does not extend the prompt with the answer")
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(full_text[len(prompt_text):], add_special_tokens=False)["input_ids"]
    input_ids = (prompt_ids + answer_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[:max_len]
    return {"input_ids": input_ids, "labels": labels}


def tokenized_splits(
    spec: str, num_examples: int, heldout: int, seed: int, tokenizer, max_len: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, held-out), tokenized. The first ``heldout`` usable rows are held out."""
    rows = generate_examples(spec, num_examples, seed)
    encoded = rows.map(
        lambda r: encode(tokenizer, r["prompt"], r["response"], max_len),
        remove_columns=["prompt", "response"],
    )
    # An example cut before its answer would have no label at all.
    encoded = encoded.filter(lambda r: any(t != IGNORE_INDEX for t in r["labels"]))
    if len(encoded) <= heldout:
        raise ValueError(
            f"max-seq-len={max_len}: only {len(encoded)} examples keep answer tokens; "
            f"expected more than heldout-examples={heldout}"
        )
    return encoded.select(range(heldout, len(encoded))), encoded.select(range(heldout))


def client_partition(train: datasets.Dataset, partition_id: int, num_partitions: int) -> datasets.Dataset:
    """This client's IID share of the training rows."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id={partition_id}: expected 0..{num_partitions - 1}")
    if num_partitions > len(train):
        raise ValueError(
            f"num-partitions={num_partitions}: expected at most {len(train)} (one training row per client)"
        )
    partitioner = IidPartitioner(num_partitions=num_partitions)  # rows are already random draws
    partitioner.dataset = train
    return partitioner.load_partition(partition_id)


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch; padding is masked out of attention and loss."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sample_batches(rows: datasets.Dataset, num_batches: int, batch_size: int, seed: int, pad_id: int):
    """``num_batches`` batches drawn by a seeded permutation (cycled if short)."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < num_batches * batch_size:
        order.extend(torch.randperm(len(rows), generator=gen).tolist())
    for b in range(num_batches):
        picked = order[b * batch_size:(b + 1) * batch_size]
        yield collate([rows[i] for i in picked], pad_id)


def in_order_batches(rows: datasets.Dataset, batch_size: int, pad_id: int):
    """Every row once, in order (for evaluation)."""
    for start in range(0, len(rows), batch_size):
        yield collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))], pad_id)
