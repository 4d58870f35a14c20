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
Rows cut before their answer by ``max-seq-len`` are dropped, counted and logged. A row that cannot be
read (a line that is not JSON, a required field missing or not text, a conversation of unknown roles,
one the tokenizer's template refuses) is skipped and counted the same way (``Malformed``); a source
without one usable row is a ``DataError``. A site's rows never leave it: every message and log line
here names the source, a row number and a field, never what a row holds.

The first ``heldout-examples`` rows are the fixed held-out split that no client
trains on; the rest is split across clients with a flwr-datasets partitioner (``partitioning``: IID, Dirichlet over
``family``, or one family per client).
"""

from __future__ import annotations

import contextlib
import csv
import importlib.machinery
import importlib.util
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch

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


class DataError(ValueError):
    """A site's data cannot be used. The message names the source, a row number and a field, never a
    row's content: a node relays its errors to the server, which logs and records them."""


@dataclass
class Malformed:
    """Rows of a source that could not be read or lack a required field: skipped, counted, and the first
    one named by its row number (1-based, in the source's order: a ``.jsonl`` file's line, a ``.json``
    array's element, a ``.csv`` file's record after the header, a parquet file's or dataset's row) and
    the field at fault, never by its content."""

    count: int = 0
    first_row: int = 0
    first_field: str = ""

    def note(self, row: int, field: str) -> None:
        if not self.count:
            self.first_row, self.first_field = row, field
        self.count += 1

    def first(self) -> str:
        return f"row {self.first_row} ({self.first_field})"


def load_examples(spec: str, num_examples: int | None, seed: int) -> datasets.Dataset:
    """Rows with ``prompt``, ``response`` and ``family``, shuffled with ``seed``, at most ``num_examples``
    (None: every row of a file, folder or hub dataset; reasoning-gym needs a number). Malformed rows
    are skipped (``load_examples_counted`` counts them)."""
    return load_examples_counted(spec, num_examples, seed)[0]


def load_examples_counted(spec: str, num_examples: int | None, seed: int) -> tuple[datasets.Dataset, Malformed]:
    """``load_examples`` and the rows it skipped as malformed. No usable row at all: a ``DataError``
    naming the source and the first bad row."""
    kind, _, source = spec.partition(":")
    malformed = Malformed()
    if kind == "reasoning-gym" and source:
        if num_examples is None:
            raise ValueError(f"dataset={spec!r}: reasoning-gym needs a number of rows to make")
        rows = generate_examples(spec, num_examples, seed)
    elif kind in SCHEMAS and source:
        kept = []
        for row, record in _read_records(spec, source, SCHEMAS[kind]):
            fields = schema_row(kind, record)
            if isinstance(fields, str):
                malformed.note(row, fields)
            else:
                kept.append(fields)
        if malformed.count:
            log.warning("%s: %d of %d rows malformed, skipped; the first is %s", spec, malformed.count,
                        malformed.count + len(kept), malformed.first())  # fmt: skip
        if not kept:
            raise DataError(f"dataset={spec!r}: no usable row ({malformed.count} malformed; the first is "
                            f"{malformed.first()}: expected {SCHEMA_TEXT[kind]})")  # fmt: skip
        rows = datasets.Dataset.from_list(kept)
    else:
        raise ValueError(
            f"dataset={spec!r}: expected reasoning-gym:<task>, alpaca:<hub id or path>, "
            "mathinstruct:<hub id or path> or messages:<hub id or path>"
        )
    columns = ["prompt", "response", "family"] + (["messages"] if kind == "messages" else [])
    rows = rows.select_columns(columns).shuffle(seed=seed)
    return (rows if num_examples is None else rows.select(range(min(num_examples, len(rows))))), malformed


# Each schema's required columns, and what a usable row holds (said when no row is usable).
SCHEMAS = {"alpaca": ("instruction", "output"), "mathinstruct": ("source", "instruction", "output"),
           "messages": ("messages",)}  # fmt: skip
SCHEMA_TEXT = {
    "alpaca": "instruction and output as text, input as text or absent",
    "mathinstruct": "source, instruction and output as text",
    "messages": 'messages: a list of {"role": system | user | assistant, "content": text} with a user and an '
    "assistant turn",
}


def schema_row(kind: str, record) -> dict[str, str] | str:
    """A source row in the common form, or the name of the field that makes it malformed."""
    if record is None:
        return "not JSON"
    if not isinstance(record, dict):
        return "not an object"
    if kind == "messages":
        return conversation_row(record.get("messages"))
    for key in SCHEMAS[kind]:
        if not is_text(record.get(key)):
            return key
    if kind == "mathinstruct":
        return {"prompt": record["instruction"], "response": record["output"], "family": record["source"]}
    extra = record.get("input")
    if extra is not None and not is_text(extra):
        return "input"
    return {"prompt": record["instruction"] + (f"\n\n{extra}" if extra else ""), "response": record["output"],
            "family": "alpaca"}  # fmt: skip


def is_text(value) -> bool:
    """A string that is text: JSON's ``\\ud800`` escapes make a lone surrogate, which no UTF-8 reader
    (Arrow, a tokenizer) accepts; such a row is malformed rather than the failure of its whole source."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def conversation_row(messages) -> dict[str, str] | str:
    """A ``messages:`` row: its conversation (checked) as JSON, its first user turn as ``prompt`` and
    its last assistant turn as ``response`` (what generation and the samples show); or ``"messages"``,
    the field at fault."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ROLES and is_text(m.get("content")) for m in messages
    ):
        return "messages"
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    users = [m["content"] for m in turns if m["role"] == "user"]
    answers = [m["content"] for m in turns if m["role"] == "assistant"]
    if not users or not answers:
        return "messages"
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


def _read_records(spec: str, source: str, columns: tuple[str, ...]) -> Iterator[tuple[int, object]]:
    """(row number, record) of a local file (read here, row by row: a row that does not parse is a
    malformed record, ``None``, not a failed file), a local folder or a hub id (``datasets``). Errors
    name the source, never what it holds: a reader's own message may quote a row."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise DataError(f"dataset={spec!r}: expected a {', '.join(FILE_BUILDERS)} file")
        records = _file_records(spec, path)
    else:
        records = enumerate(_load_dataset(spec, source, path), start=1)
    records = list(records)
    seen = set().union(*(r for _, r in records if isinstance(r, dict)))
    missing = [c for c in columns if c not in seen]
    if seen and missing:  # no object at all: each row is malformed, said as such below
        raise DataError(f"dataset={spec!r}: missing columns {missing}; expected {', '.join(columns)}")
    return iter(records)


def _file_records(spec: str, path: Path) -> Iterator[tuple[int, object]]:
    """A local file's records by row number; ``None`` for a row that does not parse."""
    if path.suffix == ".parquet":
        yield from enumerate(_load_dataset(spec, str(path), path), start=1)
        return
    try:
        with open(path, encoding="utf-8", errors="replace", newline="" if path.suffix == ".csv" else None) as f:
            if path.suffix == ".csv":
                yield from enumerate(csv.DictReader(f), start=1)
                return
            if path.suffix == ".json" and f.read(4096).lstrip().startswith("["):  # one JSON array
                f.seek(0)
                with contextlib.suppress(ValueError, RecursionError):  # then read as JSON lines, below
                    records = json.load(f)
                    yield from enumerate(records if isinstance(records, list) else [records], start=1)
                    return
            f.seek(0)
            for number, line in enumerate(f, start=1):  # JSON lines: one record per line, read as they come
                if line.strip():
                    yield number, _json_or_none(line)
    except (OSError, csv.Error) as err:
        raise DataError(f"dataset={spec!r}: cannot read {str(path)!r} ({type(err).__name__})") from None


def _json_or_none(line: str) -> object:
    """A JSON line's value, or None when it is not JSON (a malformed row; its text is not kept)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return None


def _load_dataset(spec: str, source: str, path: Path) -> datasets.Dataset:
    """``datasets.load_dataset`` on a parquet file, a local folder or a hub id."""
    try:
        if path.is_file():
            return datasets.load_dataset("parquet", data_files=str(path), split="train")
        if path.is_dir():
            return datasets.load_dataset(str(path), split="train")
        return datasets.load_dataset(source, split="train")
    except (ConnectionError, OSError, datasets.exceptions.DatasetNotFoundError) as err:  # no row read yet
        kind = spec.partition(":")[0]
        raise DataError(
            f"dataset={spec!r}: cannot load {source!r} ({str(err).splitlines()[0]}); without hub access, "
            f"download {HUB_EXAMPLES[kind]} elsewhere and point at the local copy, "
            f'e.g. dataset="{kind}:/data/{kind}.jsonl" (a .json/.jsonl/.csv/.parquet file or a folder)'
        ) from None
    except Exception as err:  # noqa: BLE001 - its message may quote a row: the type alone leaves the site
        raise DataError(
            f"dataset={spec!r}: cannot load {source!r} ({type(err).__name__}); a .jsonl file is read row by "
            "row, its malformed rows skipped"
        ) from None


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
    """A node's (train, held-out) rows and how many source rows were left out.

    It unpacks as ``train, heldout = split``. ``dropped_for_length`` counts the rows of the node's
    training source (for the run's dataset: the whole dataset, held-out part included) that lost every
    answer token to ``max-seq-len`` and were dropped; ``heldout_dropped_for_length`` those of a
    separate ``heldout-dataset``. ``malformed`` counts the rows of both sources skipped because they
    could not be read or formatted (``Malformed``)."""

    train: datasets.Dataset
    heldout: datasets.Dataset
    dropped_for_length: int = 0
    heldout_dropped_for_length: int = 0
    malformed: int = 0

    def __iter__(self):
        return iter((self.train, self.heldout))


def tokenized_rows(spec: str, num_examples: int | None, seed: int, tokenizer, max_len: int) -> datasets.Dataset:
    """``load_examples``, templated and tokenized; rows cut before their answer are dropped (logged)."""
    return tokenized_rows_counted(spec, num_examples, seed, tokenizer, max_len)[0]


def tokenized_rows_counted(
    spec: str, num_examples: int | None, seed: int, tokenizer, max_len: int
) -> tuple[datasets.Dataset, int, int]:
    """(rows, how many were dropped because ``max-seq-len`` cut them before their answer, how many were
    skipped as malformed: unreadable, or refused by the tokenizer's template)."""
    with quiet_progress():
        rows, malformed = load_examples_counted(spec, num_examples, seed)
        # prompt/response/family stay: generation reads prompts, partitioners read family.
        encoded = rows.map(lambda r: encode_or_mark(tokenizer, r, max_len))
        unformatted = sum(encoded["unformatted"])
        # An example cut before its answer would have no label at all.
        kept = encoded.filter(lambda r: not r["unformatted"] and any(t != IGNORE_INDEX for t in r["labels"]))
    kept = kept.remove_columns("unformatted")
    if unformatted:
        log.warning("%s: %d of %d rows skipped: the tokenizer's template refused them", spec, unformatted, len(rows))
        if unformatted == len(rows):
            raise DataError(f"dataset={spec!r}: no usable row (the tokenizer's template refused all {len(rows)})")
    dropped = len(encoded) - unformatted - len(kept)
    if dropped:
        log.warning(
            "%s: %d of %d rows dropped, cut before their answer by max-seq-len=%d (raise it to keep them)",
            spec, dropped, len(encoded), max_len,
        )  # fmt: skip
    return kept, dropped, malformed.count + unformatted


def encode_or_mark(tokenizer, row: dict, max_len: int) -> dict:
    """``encode_row``, or an empty row marked ``unformatted`` when the template refuses it (a chat
    template raises on turns it does not accept): skipped and counted, its error not kept (its message
    may quote the row)."""
    try:
        return {**encode_row(tokenizer, row, max_len), "unformatted": 0}
    except Exception:  # noqa: BLE001 - any template error: the row is skipped, the others go on
        return {"input_ids": [], "labels": [], "truncated": 0, "unformatted": 1}


@dataclass
class RowsCheck:
    """What a site's file holds for a run (``parablock-flwr check-data``): counts, and rows named by number only
    (their 1-based place in the file, as ``Malformed`` numbers them), never by content."""

    spec: str
    max_len: int
    rows: int = 0  # records in the file
    malformed: Malformed = field(default_factory=Malformed)
    refused: list[int] = field(default_factory=list)  # rows the tokenizer's template refused
    cut: list[int] = field(default_factory=list)  # rows max-seq-len cuts before their answer: dropped
    truncated: list[int] = field(default_factory=list)  # rows longer than max-seq-len that still train
    lengths: list[int] = field(default_factory=list)  # each usable row's tokens, whole

    @property
    def train(self) -> int:
        return len(self.lengths) - len(self.cut)

    def lines(self) -> list[str]:
        """The report: numbers and row numbers only."""
        out = [f"{self.spec}: {self.rows} rows, {self.train} train at max-seq-len={self.max_len}"]
        if self.malformed.count:
            out.append(f"  malformed, skipped: {self.malformed.count} (the first: {self.malformed.first()})")
        said = {"refused by the tokenizer's template, skipped": self.refused,
                f"cut before their answer by max-seq-len={self.max_len}, dropped": self.cut,
                f"longer than max-seq-len={self.max_len}, cut, still training": self.truncated}  # fmt: skip
        for what, rows in said.items():
            if rows:
                shown = ", ".join(map(str, rows[:10])) + (", ..." if len(rows) > 10 else "")
                out.append(f"  {what}: {len(rows)} (rows {shown})")
        if self.lengths:
            ordered = sorted(self.lengths)
            median, p95 = ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
            out.append(f"  tokens per row: median {median}, 95th percentile {p95}, longest {ordered[-1]}")
        return out


def check_rows(spec: str, tokenizer, max_len: int) -> RowsCheck:
    """A site's file as a run would read it (``dataset``'s forms, not reasoning-gym's generated rows): each row
    read, templated and tokenized whole, in the file's order. Raises ``DataError`` when no row can be read."""
    kind, _, source = spec.partition(":")
    if kind not in SCHEMAS or not source:
        raise DataError(f"dataset={spec!r}: expected alpaca:<path>, mathinstruct:<path> or messages:<path> (a file "
                        f"or folder a site holds; reasoning-gym's rows are generated, not read)")  # fmt: skip
    check = RowsCheck(spec, max_len)
    for row, record in _read_records(spec, source, SCHEMAS[kind]):
        check.rows += 1
        fields = schema_row(kind, record)
        if isinstance(fields, str):
            check.malformed.note(row, fields)
            continue
        try:
            encoded = encode_row(tokenizer, fields, 2**62)
        except Exception:  # noqa: BLE001 - a template's error may quote the row: only its number is kept
            check.refused.append(row)
            continue
        answer = next((i for i, label in enumerate(encoded["labels"]) if label != IGNORE_INDEX), len(encoded["labels"]))
        check.lengths.append(len(encoded["input_ids"]))
        if answer >= max_len:
            check.cut.append(row)
        elif len(encoded["input_ids"]) > max_len:
            check.truncated.append(row)
    if not check.lengths:
        raise DataError(
            f"dataset={spec!r}: no usable row of {check.rows} ({check.malformed.count} malformed"
            + (f"; the first is {check.malformed.first()}" if check.malformed.count else "")
            + ")"
        )
    return check


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
        (train, dropped, bad), (held, held_dropped, held_bad) = (
            tokenized_rows_counted(spec, local_rows_limit(spec, num_examples), seed, tokenizer, max_len)
            for spec in (dataset, heldout_dataset)
        )
        if not len(train) or not len(held):
            empty = dataset if not len(train) else heldout_dataset
            raise ValueError(f"node config {empty!r}: no example keeps answer tokens at max-seq-len={max_len}")
        return Split(train, held, dropped, held_dropped, bad + held_bad)
    return tokenized_splits(dataset, local_rows_limit(dataset, num_examples), heldout, seed, tokenizer, max_len)


def tokenized_splits(spec: str, num_examples: int | None, heldout: int, seed: int, tokenizer, max_len: int) -> Split:
    """(train, held-out), tokenized. The first ``heldout`` usable rows are held out."""
    encoded, dropped, malformed = tokenized_rows_counted(spec, num_examples, seed, tokenizer, max_len)
    if len(encoded) <= heldout:
        raise ValueError(
            f"max-seq-len={max_len}: only {len(encoded)} examples keep answer tokens ({dropped} cut before "
            f"their answer, {malformed} malformed); expected more than heldout-examples={heldout}"
        )
    train, held = encoded.select(range(heldout, len(encoded))), encoded.select(range(heldout))
    return Split(train, held, dropped, malformed=malformed)


def flwr_partitioners() -> None:
    """Makes ``import flwr_datasets.partitioner`` leave out what its package imports for plotting: its
    ``visualization`` subpackage (seaborn, matplotlib, scipy.stats: over a second of CPU here, in every process
    that partitions) stands in ``sys.modules`` as a module that runs its code at its first attribute use, which
    nothing here makes. Where flwr_datasets is imported already, or its layout differs, it is left as it is."""
    name = "flwr_datasets.visualization"
    if "flwr_datasets" in sys.modules or name in sys.modules:
        return
    package = importlib.util.find_spec("flwr_datasets")  # a top-level package: found, not imported
    locations = package.submodule_search_locations if package is not None else None
    spec = importlib.machinery.PathFinder.find_spec(name, locations) if locations else None
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)

    def load(attribute: str):  # the module's own code, run into it once (PEP 562's module __getattr__)
        del module.__getattr__
        spec.loader.exec_module(module)
        return getattr(module, attribute)

    module.__getattr__ = load
    sys.modules[name] = module


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
    # Imported here, without the plotting stack flwr_datasets' package loads (``flwr_partitioners``).
    flwr_partitioners()
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner

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
