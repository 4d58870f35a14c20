"""Training data: loading, chat formatting, answer-only labels, partitions.

``dataset`` in the run config is one of

- ``reasoning-gym:<task>[,<task>...]``: ``num-examples`` seeded rows made
  offline by the PyPI package ``reasoning-gym`` (default ``gsm_symbolic``:
  GSM8K-style word problems whose worked answers end in ``#### N``). With
  several tasks (or ``reasoning-gym:instruction-mix``) the rows are split
  evenly across them and each row's ``family`` is its task.
- ``alpaca:<hub id | file | folder>``: the Alpaca-GPT4 schema
  (``instruction``, ``output``, and an optional ``input`` appended to the instruction).
- ``mathinstruct:<hub id | file | folder>``: the MathInstruct schema
  (``source``, ``instruction``, ``output``); ``family`` is ``source``.
- ``messages:<hub id | file | folder>``: chat rows, each a ``messages`` list of
  ``{"role": "system" | "user" | "assistant", "content": ...}`` (the shape FlowerTune and
  TRL's SFT data have); the loss covers every assistant turn.

Every source becomes rows with ``prompt``, ``response`` and ``family`` (and, for
``messages:``, the conversation as JSON in ``messages``), shuffled with ``seed``.
How a row becomes text is ``prompt-format``: the tokenizer's chat template, or the
plain instruction/response format of ``PLAIN_TEMPLATE`` (``model.load_tokenizer``
installs it as the tokenizer's template, so everything downstream is the same).
Rows cut before their answer by ``max-seq-len`` are dropped, counted and logged.

The first ``heldout-examples`` rows are the fixed held-out split that no client
trains on; the rest is split across clients with a flwr-datasets partitioner (``partitioning``: IID, Dirichlet over
``family``, or one family per client).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")
INSTRUCTION_MIX = (
    "basic_arithmetic",
    "chain_sum",
    "fraction_simplification",
    "time_intervals",
    "letter_counting",
    "word_sorting",
)
HUB_EXAMPLES = {
    "alpaca": "vicgalle/alpaca-gpt4",
    "mathinstruct": "TIGER-Lab/MathInstruct",
    "messages": "HuggingFaceH4/no_robots",
}
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
        rows = _load_rows(spec, source, ("instruction", "output"))
        has_input = "input" in rows.column_names  # optional: many Alpaca-style files have no input column
        rows = rows.map(
            lambda r: {
                "prompt": r["instruction"] + (f"\n\n{r['input']}" if has_input and r["input"] else ""),
                "response": r["output"],
                "family": "alpaca",
            }
        )
    elif kind == "mathinstruct" and source:
        rows = _load_rows(spec, source, ("source", "instruction", "output")).map(
            lambda r: {"prompt": r["instruction"], "response": r["output"], "family": r["source"]}
        )
    elif kind == "messages" and source:
        rows = _load_rows(spec, source, ("messages",)).map(lambda r: conversation_row(spec, r["messages"]))
    else:
        raise ValueError(
            f"dataset={spec!r}: expected reasoning-gym:<task>, alpaca:<hub id or path>, "
            "mathinstruct:<hub id or path> or messages:<hub id or path>"
        )
    columns = ["prompt", "response", "family"] + (["messages"] if kind == "messages" else [])
    rows = rows.select_columns(columns).shuffle(seed=seed)
    return rows if num_examples is None else rows.select(range(min(num_examples, len(rows))))


def conversation_row(spec: str, messages) -> dict[str, str]:
    """A ``messages:`` row: its conversation (checked) as JSON, its first user turn as ``prompt`` and
    its last assistant turn as ``response`` (what generation and the samples show)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError(
            f"dataset={spec!r}: a row's messages are {str(messages)[:120]!r}; expected a list of "
            f'{{"role": {" | ".join(ROLES)}, "content": text}}'
        )
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    users = [m["content"] for m in turns if m["role"] == "user"]
    answers = [m["content"] for m in turns if m["role"] == "assistant"]
    if not users or not answers:
        raise ValueError(
            f"dataset={spec!r}: a conversation without a user and an assistant turn ({str(messages)[:120]!r})"
        )
    return {"prompt": users[0], "response": answers[-1], "family": "messages", "messages": json.dumps(turns)}


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
    """A (prompt, response) pair through the tokenizer's template; labels cover the answer only."""
    return encode_conversation(
        tokenizer, [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], max_len
    )


def encode_conversation(tokenizer, messages: list[dict[str, str]], max_len: int) -> dict[str, list[int]]:
    """A conversation through the tokenizer's (chat or plain) template; labels cover the assistant turns.

    Each assistant turn is the text its template adds after the generation prompt of the turns
    before it, so the template must extend a conversation's text as turns are added (every
    chat template we know does; the error says when one does not)."""
    input_ids: list[int] = []
    labels: list[int] = []
    done = ""  # the text encoded so far
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt_text = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (prompt_text.startswith(done) and through.startswith(prompt_text)):
            raise ValueError("the tokenizer's chat template does not extend the prompt with the answer")
        prompt_ids = tokenizer(prompt_text[len(done) :], add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(through[len(prompt_text) :], add_special_tokens=False)["input_ids"]
        input_ids += prompt_ids + answer_ids
        labels += [IGNORE_INDEX] * len(prompt_ids) + answer_ids
        done = through
    return {"input_ids": input_ids[:max_len], "labels": labels[:max_len], "truncated": int(len(input_ids) > max_len)}


def encode_row(tokenizer, row: dict, max_len: int) -> dict[str, list[int]]:
    """``encode_conversation`` of a row: its ``messages``, or its (prompt, response) pair."""
    if row.get("messages"):
        return encode_conversation(tokenizer, json.loads(row["messages"]), max_len)
    return encode(tokenizer, row["prompt"], row["response"], max_len)


@dataclass
class Split:
    """A node's (train, held-out) rows and how many source rows ``max-seq-len`` cut before their answer.

    It unpacks as ``train, heldout = split``. ``dropped_for_length`` counts the rows of the node's
    training source (for the run's dataset: the whole dataset, held-out part included) that lost every
    answer token to ``max-seq-len`` and were dropped; ``heldout_dropped_for_length`` those of a
    separate ``heldout-dataset``."""

    train: datasets.Dataset
    heldout: datasets.Dataset
    dropped_for_length: int = 0
    heldout_dropped_for_length: int = 0

    def __iter__(self):
        return iter((self.train, self.heldout))


def tokenized_rows(spec: str, num_examples: int | None, seed: int, tokenizer, max_len: int) -> datasets.Dataset:
    """``load_examples``, templated and tokenized; rows cut before their answer are dropped (logged)."""
    return tokenized_rows_counted(spec, num_examples, seed, tokenizer, max_len)[0]


def tokenized_rows_counted(
    spec: str, num_examples: int | None, seed: int, tokenizer, max_len: int
) -> tuple[datasets.Dataset, int]:
    """(rows, how many were dropped because ``max-seq-len`` cut them before their answer)."""
    with quiet_progress():
        rows = load_examples(spec, num_examples, seed)
        # prompt/response/family stay: generation reads prompts, partitioners read family.
        encoded = rows.map(lambda r: encode_row(tokenizer, r, max_len))
        # An example cut before its answer would have no label at all.
        kept = encoded.filter(lambda r: any(t != IGNORE_INDEX for t in r["labels"]))
    dropped = len(encoded) - len(kept)
    if dropped:
        log.warning(
            "%s: %d of %d rows dropped, cut before their answer by max-seq-len=%d (raise it to keep them)",
            spec, dropped, len(encoded), max_len,
        )  # fmt: skip
    return kept, dropped


@contextlib.contextmanager
def quiet_progress():
    """No progress bars from ``datasets`` (a few hundred rows take a second; the bars of every node
    would fill a run's output), restored afterwards."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def local_rows_limit(spec: str, num_examples: int) -> int | None:
    """How many rows a node's own ``dataset`` gives: every row of a file, folder or hub dataset;
    ``num-examples`` generated rows for ``reasoning-gym:``."""
    return num_examples if spec.startswith("reasoning-gym:") else None


def node_splits(
    dataset: str, heldout_dataset: str, heldout: int, num_examples: int, seed: int, tokenizer, max_len: int
) -> Split:
    """A node's own (train, held-out) rows. With ``heldout_dataset`` every row of ``dataset`` trains;
    without it (``heldout > 0``) the first ``heldout`` usable rows of ``dataset`` are held out."""
    if heldout_dataset:
        (train, dropped), (held, held_dropped) = (
            tokenized_rows_counted(spec, local_rows_limit(spec, num_examples), seed, tokenizer, max_len)
            for spec in (dataset, heldout_dataset)
        )
        if not len(train) or not len(held):
            empty = dataset if not len(train) else heldout_dataset
            raise ValueError(f"node config {empty!r}: no example keeps answer tokens at max-seq-len={max_len}")
        return Split(train, held, dropped, held_dropped)
    return tokenized_splits(dataset, local_rows_limit(dataset, num_examples), heldout, seed, tokenizer, max_len)


def tokenized_splits(spec: str, num_examples: int | None, heldout: int, seed: int, tokenizer, max_len: int) -> Split:
    """(train, held-out), tokenized. The first ``heldout`` usable rows are held out."""
    encoded, dropped = tokenized_rows_counted(spec, num_examples, seed, tokenizer, max_len)
    if len(encoded) <= heldout:
        raise ValueError(
            f"max-seq-len={max_len}: only {len(encoded)} examples keep answer tokens ({dropped} cut before "
            f"their answer); expected more than heldout-examples={heldout}"
        )
    return Split(encoded.select(range(heldout, len(encoded))), encoded.select(range(heldout)), dropped)


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
