"""Training data: loading, chat formatting, answer-only labels, partitions.

``dataset`` in the run config is one of

- ``reasoning-gym:<task>[,<task>...]``: ``num-examples`` seeded rows made
  offline by the PyPI package ``reasoning-gym`` (default ``gsm_symbolic``:
  GSM8K-style word problems whose worked answers end in ``#### N``). With
  several tasks (or ``reasoning-gym:instruction-mix``) the rows are split
  evenly across them and each row's ``family`` is its task.
- ``alpaca:<hub id | file | folder>``: the Alpaca-GPT4 schema
  (``instruction``, ``input``, ``output``).
- ``mathinstruct:<hub id | file | folder>``: the MathInstruct schema
  (``source``, ``instruction``, ``output``); ``family`` is ``source``.

Every source becomes rows with ``prompt``, ``response`` and ``family``,
shuffled with ``seed``. The first ``heldout-examples`` rows are the fixed
held-out split that no client trains on; the rest is split across clients
with a flwr-datasets partitioner (``partitioning``: IID, Dirichlet over
``family``, or one family per client).
"""

from __future__ import annotations

from pathlib import Path

import datasets
import torch
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner

IGNORE_INDEX = -100
INSTRUCTION_MIX = (
    "basic_arithmetic",
    "chain_sum",
    "fraction_simplification",
    "time_intervals",
    "letter_counting",
    "word_sorting",
)
HUB_EXAMPLES = {"alpaca": "vicgalle/alpaca-gpt4", "mathinstruct": "TIGER-Lab/MathInstruct"}
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def has_exact_answers(spec: str) -> bool:
    """Datasets whose answers are short and exact (reasoning-gym's tasks, MathInstruct's final
    numbers), so that the accuracy of generated answers means something; Alpaca's are free text."""
    return spec.startswith(("reasoning-gym:", "mathinstruct:"))


def load_examples(spec: str, num_examples: int | None, seed: int) -> datasets.Dataset:
    """Rows with ``prompt``, ``response`` and ``family``, shuffled with ``seed``, at most ``num_examples``
    (None: every row of a file, folder or hub dataset; reasoning-gym needs a number)."""
    kind, _, source = spec.partition(":")
    if kind == "reasoning-gym" and source:
        if num_examples is None:
            raise ValueError(f"dataset={spec!r}: reasoning-gym needs a number of rows to make")
        rows = generate_examples(spec, num_examples, seed)
    elif kind == "alpaca" and source:
        rows = _load_rows(spec, source, ("instruction", "input", "output")).map(
            lambda r: {
                "prompt": r["instruction"] + (f"\n\n{r['input']}" if r["input"] else ""),
                "response": r["output"],
                "family": "alpaca",
            }
        )
    elif kind == "mathinstruct" and source:
        rows = _load_rows(spec, source, ("source", "instruction", "output")).map(
            lambda r: {"prompt": r["instruction"], "response": r["output"], "family": r["source"]}
        )
    else:
        raise ValueError(
            f"dataset={spec!r}: expected reasoning-gym:<task>, alpaca:<hub id or path> or mathinstruct:<hub id or path>"
        )
    rows = rows.select_columns(["prompt", "response", "family"]).shuffle(seed=seed)
    return rows if num_examples is None else rows.select(range(min(num_examples, len(rows))))


def generate_examples(spec: str, num_examples: int, seed: int) -> datasets.Dataset:
    """``reasoning-gym:<task>[,<task>...]``: seeded rows, split evenly across the tasks."""
    import reasoning_gym  # imported lazily: it pulls in many task modules

    source = spec.partition(":")[2]
    tasks = INSTRUCTION_MIX if source == "instruction-mix" else tuple(t.strip() for t in source.split(","))
    prompts, responses, families = [], [], []
    for i, task in enumerate(tasks):
        size = num_examples // len(tasks) + (i < num_examples % len(tasks))
        try:
            rows = reasoning_gym.create_dataset(task, size=max(size, 1), seed=seed + i)
        except Exception as err:  # reasoning-gym raises plain errors for unknown tasks
            raise ValueError(f"dataset={spec!r}: reasoning-gym cannot make {task!r} ({err})") from err
        for row in list(rows)[:size]:
            prompts.append(row["question"])
            # Prefer the worked solution (chain of thought ending in "#### N") when the task has one.
            responses.append(row["metadata"].get("answer_cot") or str(row["answer"]))
            families.append(task)
    return datasets.Dataset.from_dict({"prompt": prompts, "response": responses, "family": families})


def _load_rows(spec: str, source: str, columns: tuple[str, ...]) -> datasets.Dataset:
    """``datasets.load_dataset`` on a local file, a local folder, or a hub id; check the schema."""
    path = Path(source).expanduser()
    try:
        if path.is_file():
            if path.suffix not in FILE_BUILDERS:
                raise ValueError(f"dataset={spec!r}: expected a {', '.join(FILE_BUILDERS)} file")
            rows = datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path), split="train")
        elif path.is_dir():
            rows = datasets.load_dataset(str(path), split="train")
        else:
            rows = datasets.load_dataset(source, split="train")
    except (ConnectionError, OSError, datasets.exceptions.DatasetNotFoundError) as err:
        kind = spec.partition(":")[0]
        raise ValueError(
            f"dataset={spec!r}: cannot load {source!r} ({str(err).splitlines()[0]}); without hub access, "
            f"download {HUB_EXAMPLES[kind]} elsewhere and point at the local copy, "
            f'e.g. dataset="{kind}:/data/{kind}.jsonl" (a .json/.jsonl/.csv/.parquet file or a folder)'
        ) from err
    missing = [c for c in columns if c not in rows.column_names]
    if missing:
        raise ValueError(
            f"dataset={spec!r}: missing columns {missing}; expected {', '.join(columns)}, "
            f"found {', '.join(rows.column_names)}"
        )
    return rows


def encode(tokenizer, prompt: str, response: str, max_len: int) -> dict[str, list[int]]:
    """Chat-template the pair; labels cover the assistant's answer only."""
    user = [{"role": "user", "content": prompt}]
    prompt_text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=False)
    if not full_text.startswith(prompt_text):
        raise ValueError("the tokenizer's chat template does not extend the prompt with the answer")
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(full_text[len(prompt_text) :], add_special_tokens=False)["input_ids"]
    input_ids = (prompt_ids + answer_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[:max_len]
    return {"input_ids": input_ids, "labels": labels, "truncated": int(len(prompt_ids) + len(answer_ids) > max_len)}


def tokenized_rows(spec: str, num_examples: int | None, seed: int, tokenizer, max_len: int) -> datasets.Dataset:
    """``load_examples``, chat-templated and tokenized; rows cut before their answer are dropped."""
    rows = load_examples(spec, num_examples, seed)
    # prompt/response/family stay: generation reads prompts, partitioners read family.
    encoded = rows.map(lambda r: encode(tokenizer, r["prompt"], r["response"], max_len))
    # An example cut before its answer would have no label at all.
    return encoded.filter(lambda r: any(t != IGNORE_INDEX for t in r["labels"]))


def local_rows_limit(spec: str, num_examples: int) -> int | None:
    """How many rows a node's own ``dataset`` gives: every row of a file, folder or hub dataset;
    ``num-examples`` generated rows for ``reasoning-gym:``."""
    return num_examples if spec.startswith("reasoning-gym:") else None


def node_splits(
    dataset: str, heldout_dataset: str, heldout: int, num_examples: int, seed: int, tokenizer, max_len: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """A node's own (train, held-out) rows. With ``heldout_dataset`` every row of ``dataset`` trains;
    without it (``heldout > 0``) the first ``heldout`` usable rows of ``dataset`` are held out."""
    if heldout_dataset:
        train, held = (
            tokenized_rows(spec, local_rows_limit(spec, num_examples), seed, tokenizer, max_len)
            for spec in (dataset, heldout_dataset)
        )
        if not len(train) or not len(held):
            empty = dataset if not len(train) else heldout_dataset
            raise ValueError(f"node config {empty!r}: no example keeps answer tokens at max-seq-len={max_len}")
        return train, held
    return tokenized_splits(dataset, local_rows_limit(dataset, num_examples), heldout, seed, tokenizer, max_len)


def tokenized_splits(
    spec: str, num_examples: int | None, heldout: int, seed: int, tokenizer, max_len: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, held-out), tokenized. The first ``heldout`` usable rows are held out."""
    encoded = tokenized_rows(spec, num_examples, seed, tokenizer, max_len)
    if len(encoded) <= heldout:
        raise ValueError(
            f"max-seq-len={max_len}: only {len(encoded)} examples keep answer tokens; "
            f"expected more than heldout-examples={heldout}"
        )
    return encoded.select(range(heldout, len(encoded))), encoded.select(range(heldout))


def client_partition(
    train: datasets.Dataset,
    partition_id: int,
    num_partitions: int,
    partitioning: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
) -> datasets.Dataset:
    """This client's share of the training rows, by a flwr-datasets partitioner.

    ``iid``: equal random shares. ``dirichlet``: per ``family``, shares drawn
    from Dirichlet(``alpha``) (small alpha, skewed clients). ``family``: one
    family per client (the natural split of an instruction mix).
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id={partition_id}: expected 0..{num_partitions - 1}")
    if num_partitions > len(train):
        raise ValueError(
            f"num-partitions={num_partitions}: expected at most {len(train)} (one training row per client)"
        )
    if partitioning == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)  # rows are already shuffled
    elif partitioning == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions, partition_by="family", alpha=alpha, min_partition_size=1, seed=seed
        )
    elif partitioning == "family":
        families = sorted(set(train["family"]))  # for the message only
        if len(families) != num_partitions:
            raise ValueError(
                f"partitioning='family': the data has {len(families)} families ({', '.join(families)}), "
                f"expected one per client ({num_partitions} clients)"
            )
        partitioner = NaturalIdPartitioner(partition_by="family")
    else:
        raise ValueError(f"partitioning={partitioning!r}: expected iid, dirichlet or family")
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


def batch_order(num_rows: int, num_batches: int, batch_size: int, seed: int) -> list[int]:
    """The row indices ``sample_batches`` draws, in order: a seeded permutation, cycled if short."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < num_batches * batch_size:
        order.extend(torch.randperm(num_rows, generator=gen).tolist())
    return order[: num_batches * batch_size]


def truncated_in_batches(rows: datasets.Dataset, num_batches: int, batch_size: int, seed: int) -> int:
    """How many of the examples ``sample_batches`` draws were cut at ``max-seq-len``."""
    if "truncated" not in rows.column_names:
        return 0
    flags = rows["truncated"]
    return sum(flags[i] for i in batch_order(len(rows), num_batches, batch_size, seed))


def sample_batches(rows: datasets.Dataset, num_batches: int, batch_size: int, seed: int, pad_id: int):
    """``num_batches`` batches drawn by a seeded permutation (cycled if short)."""
    order = batch_order(len(rows), num_batches, batch_size, seed)
    for b in range(num_batches):
        picked = order[b * batch_size : (b + 1) * batch_size]
        yield collate([rows[i] for i in picked], pad_id)


def in_order_batches(rows: datasets.Dataset, batch_size: int, pad_id: int):
    """Every row once, in order (for evaluation)."""
    for start in range(0, len(rows), batch_size):
        yield collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))], pad_id)
