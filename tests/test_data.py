"""Data sources in the Alpaca-GPT4 and MathInstruct schemas, the instruction mix, partitioners, scoring."""

import json
import os
import sys

import pytest

from parablock_flwr import core
from parablock_flwr.data import (
    IGNORE_INDEX,
    client_partition,
    encode,
    flwr_partitioners,
    load_examples,
    node_splits,
    sample_batches,
    tokenized_rows,
    tokenized_splits,
)
from parablock_flwr.evaluation import answer_correct, final_number

ALPACA = [
    {"instruction": f"Give a word that rhymes with {w}.", "input": "" if i % 2 else "Be brief.", "output": f"{w}s"}
    for i, w in enumerate(["cat", "dog", "sun", "tree", "car", "hat"])
]
MATHINSTRUCT = [
    {
        "source": ["data/CoT/gsm_rft.json", "data/PoT/mathqa.json"][i % 2],
        "instruction": f"What is {i} + {i}?",
        "output": f"{i} + {i} = {2 * i}. The answer is {2 * i}",
    }
    for i in range(8)
]


def test_alpaca_jsonl_file(tmp_path):
    path = tmp_path / "alpaca.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ALPACA))
    rows = load_examples(f"alpaca:{path}", 100, seed=0)
    assert len(rows) == 6 and set(rows["family"]) == {"alpaca"}
    by_output = {r["response"]: r["prompt"] for r in rows}
    assert by_output["cats"] == "Give a word that rhymes with cat.\n\nBe brief."
    assert by_output["dogs"] == "Give a word that rhymes with dog."


def test_mathinstruct_parquet_folder_has_source_families(tmp_path):
    import datasets

    datasets.Dataset.from_list(MATHINSTRUCT).to_parquet(str(tmp_path / "train.parquet"))
    rows = load_examples(f"mathinstruct:{tmp_path}", 5, seed=1)
    assert len(rows) == 5
    assert set(rows["family"]) <= {"data/CoT/gsm_rft.json", "data/PoT/mathqa.json"}
    assert all(r["response"].endswith(str(final_number(r["response"])).removesuffix(".0")) for r in rows)


def test_wrong_schema_and_unreachable_hub_say_what_to_do(tmp_path, monkeypatch):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"question": "q", "answer": "a"}]))
    with pytest.raises(ValueError, match=r"missing columns \['instruction', 'output'\]"):
        load_examples(f"alpaca:{path}", 10, seed=0)
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying the network
    with pytest.raises(ValueError, match=r"point at the local copy, e\.g\. dataset=\"mathinstruct:"):
        load_examples("mathinstruct:TIGER-Lab/MathInstruct", 10, seed=0)
    with pytest.raises(ValueError, match=r"dataset='squad:x': expected reasoning-gym"):
        load_examples("squad:x", 10, seed=0)


def test_the_partitioners_come_without_flwr_datasets_plotting_which_loads_at_its_first_use(monkeypatch):
    """``flwr_partitioners``: ``import flwr_datasets.partitioner`` runs none of its package's plotting code
    (seaborn, matplotlib, scipy.stats: over a second in each process that partitions); a use of it loads it."""
    ours = [m for m in sys.modules if m == "flwr_datasets" or m.startswith("flwr_datasets.")]
    for name in ours:
        monkeypatch.delitem(sys.modules, name)  # a fresh import here; the process's own modules come back after
    flwr_partitioners()
    import flwr_datasets.partitioner

    plotting = sys.modules["flwr_datasets.visualization"]
    assert flwr_datasets.partitioner.IidPartitioner and "plot_label_distributions" not in vars(plotting)
    assert callable(plotting.plot_label_distributions) and "plot_label_distributions" in vars(plotting)
    for name in [m for m in sys.modules if m.startswith("flwr_datasets") and m not in ours]:
        del sys.modules[name]  # this test's own copies that the process did not hold before


def test_instruction_mix_families_and_partitioners():
    rows = load_examples("reasoning-gym:basic_arithmetic,chain_sum,letter_counting", 60, seed=0)
    assert sorted(set(rows["family"])) == ["basic_arithmetic", "chain_sum", "letter_counting"]
    assert all(list(rows["family"]).count(f) == 20 for f in set(rows["family"]))
    # One family per client: each client sees exactly one task, and all three are covered.
    parts = [client_partition(rows, i, 3, "family") for i in range(3)]
    assert sorted(p["family"][0] for p in parts) == sorted(set(rows["family"]))
    assert all(len(set(p["family"])) == 1 for p in parts)
    with pytest.raises(ValueError, match=r"partitioning='family': the data has 3 families .*\(2 clients\)"):
        client_partition(rows, 0, 2, "family")
    # Dirichlet and IID: disjoint shares that cover every row; Dirichlet with a small alpha is skewed.
    for partitioning in ("iid", "dirichlet"):
        shares = [list(client_partition(rows, i, 3, partitioning, alpha=0.1, seed=0)["prompt"]) for i in range(3)]
        assert sorted(sum(shares, [])) == sorted(list(rows["prompt"]))
        assert all(len(s) >= 1 for s in shares)
    skewed = [list(client_partition(rows, i, 3, "dirichlet", alpha=0.1, seed=0)["family"]) for i in range(3)]
    assert max(max(s.count(f) for f in set(s)) / len(s) for s in skewed) > 0.6


@pytest.mark.parametrize(
    "text, number",
    [
        ("He has 3 + 4 = 7 apples.\n#### 7", 7.0),
        ("so 1,250 dollars. #### 1,250", 1250.0),
        ("The answer is -3.5.", -3.5),
        ("no digits here", None),
        ("#### 12 and then 99", 12.0),
    ],
)
def test_final_number(text, number):
    assert final_number(text) == number


@pytest.mark.parametrize(
    "reference, generated, correct",
    [
        ("3 + 4 = 7.\n#### 7", "First 3 + 4 = 7, so #### 7", True),  # GSM8K style: the final number
        ("3 + 4 = 7.\n#### 7", "It is 8.", False),
        ("12", "The answer is 12.", True),  # a numeric answer: the value of the final number
        ("1,250", "1250", True),
        ("-0.5", "-.5", True),
        ("12", "12 or 13", False),
        ("Yes", " yes.", True),  # any other answer: exact up to case, spacing and a final full stop
        ("apple, banana", "banana, apple", False),
        ("apple, banana", "Apple, banana.", True),
        ("olleh", "The reverse is olleh", False),
    ],
)
def test_answer_correct(reference, generated, correct):
    assert answer_correct(reference, generated) is correct


def test_the_run_summary_puts_the_task_accuracy_beside_a_constant_answer():
    from parablock_flwr.metrics import round_line, run_summary

    records = [
        {"round": 0, "heldout_loss": 1.9, "task_accuracy": 4 / 64, "task_examples": 64, "task_accuracy_constant": 0.75},
        {"round": 1, "heldout_loss": 0.5},
        {
            "round": 2,
            "heldout_loss": 0.2,
            "task_accuracy": 40 / 64,
            "task_examples": 64,
            "task_accuracy_constant": 0.75,
        },
    ]
    assert run_summary(records) == (
        "heldout_loss 1.9000 (round 0) -> 0.5000 (round 1) -> 0.2000 (round 2); "
        "task_accuracy 0.062 (round 0) -> 0.625 (round 2) (always the most common answer: 0.750)"
    )
    assert round_line(records[0], 2) == "round 0/2 heldout_loss 1.9000 task_accuracy 0.062 (4/64)"


def test_a_rounds_line_never_says_nan_and_the_last_line_carries_every_evaluated_round():
    """A round not due for evaluation has no held-out number on its line (before: ``heldout_loss nan``), a
    due one skipped under ``eval-max-lag`` says so; the run's last line lists every evaluated round's
    held-out loss (past 12, the first six and last five with a count of the rest)."""
    from parablock_flwr.metrics import round_line, run_summary

    training = {"block": 1, "block_label": "layers 0-1", "train_loss": 1.0, "bytes_up_per_client": 1e6,
                "bytes_down_per_client": 1e6, "compute_s_max": 1.0, "modeled_round_s": 1.0,
                "modeled_round_s_sequential": 1.0, "modeled_round_s_overlapped": 1.0, "num_accepted": 2,
                "num_replies": 2, "elapsed_s": 3.0}  # fmt: skip
    assert "heldout" not in round_line({"round": 1, **training}, 3)
    assert "nan" not in round_line({"round": 1, **training}, 3)
    assert " heldout_loss skipped " in round_line({"round": 2, **training, "evaluation_skipped": 1}, 3)
    assert " heldout_loss 0.5000 " in round_line({"round": 3, **training, "heldout_loss": 0.5}, 3)
    assert round_line({"round": 0}, 3) == "round 0/3"
    summary = run_summary([{"round": r, "heldout_loss": 2.0 - r / 100} for r in range(4)])
    assert summary == "heldout_loss 2.0000 (round 0) -> 1.9900 (round 1) -> 1.9800 (round 2) -> 1.9700 (round 3)"
    summary = run_summary([{"round": r, "heldout_loss": 2.0 - r / 100} for r in range(20)])
    assert summary.startswith("heldout_loss 2.0000 (round 0) -> 1.9900 (round 1) -> ")
    assert " -> 1.9500 (round 5) -> ... 9 more rounds in metrics.jsonl ... -> 1.8500 (round 15) -> " in summary
    assert summary.endswith(" -> 1.8100 (round 19)")


# ---------------------------------------------------------------------------------------------
# Any decoder-only checkpoint, any common data shape; rows dropped for length are counted
# ---------------------------------------------------------------------------------------------
CHATS = [
    {
        "messages": [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": f"What rhymes with {w}?"},
            {"role": "assistant", "content": f"{w}s"},
            {"role": "user", "content": "And another?"},
            {"role": "assistant", "content": f"big {w}"},
        ]
    }
    for w in ["cat", "dog", "sun", "tree"]
]


def labelled_text(tokenizer, row: dict) -> str:
    """The text of the tokens that carry a label (contiguous runs joined by |)."""
    runs, run = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return "|".join(runs + ([tokenizer.decode(run)] if run else []))


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    """The tiny Llama with a tokenizer that has no chat template, like most base checkpoints."""
    from parablock_flwr.tools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-base"), chat_template=False)


def test_a_base_model_without_chat_template_trains_on_the_plain_format(base_model_dir, tmp_path):
    from parablock_flwr.model import PLAIN_TEMPLATE, load_model, load_tokenizer
    from parablock_flwr.training import TrainSettings, train_block

    tokenizer = load_tokenizer(str(base_model_dir))  # prompt-format = "auto": plain, as there is no template
    assert tokenizer.chat_template == PLAIN_TEMPLATE
    with pytest.raises(ValueError, match=r"prompt-format='chat': the tokenizer of model=.* has no chat template"):
        load_tokenizer(str(base_model_dir), "chat")
    row = encode(tokenizer, "What is 2 + 3?", "2 + 3 = 5.", max_len=128)
    eos = tokenizer.eos_token
    assert tokenizer.decode(row["input_ids"]) == (
        f"{tokenizer.bos_token}### Instruction:\nWhat is 2 + 3?\n\n### Response:\n2 + 3 = 5.{eos}"
    )
    assert labelled_text(tokenizer, row) == f"2 + 3 = 5.{eos}"  # the loss covers the answer and its end
    train, _ = tokenized_splits("reasoning-gym:gsm_symbolic", 24, 4, 0, tokenizer, 160)
    model = load_model(str(base_model_dir))
    names = core.partition_blocks(model, layers_per_block=2).names(1)
    batches = sample_batches(train, 3, 4, seed=0, pad_id=tokenizer.pad_token_id)
    result = train_block(model, names, batches, TrainSettings(3, 1e-3, 0.0, "constant", 0, 1.0, "fp32"))
    assert all(t.abs().sum() > 0 for t in result.delta.values()) and result.mean_loss == result.mean_loss
    from parablock_flwr.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=r"prompt-format='alpaca': expected one of auto, chat, plain"):
        RunConfig.from_flower({"prompt-format": "alpaca"})


def test_messages_rows_train_on_every_assistant_turn(tmp_path, tiny_model_dir):
    from parablock_flwr.model import load_tokenizer

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    rows = load_examples(f"messages:{path}", None, seed=0)
    assert len(rows) == 4 and set(rows["family"]) == {"messages"}
    assert {(r["prompt"], r["response"]) for r in rows} >= {("What rhymes with cat?", "big cat")}
    for prompt_format in ("chat", "plain"):
        tokenizer = load_tokenizer(str(tiny_model_dir), prompt_format)
        encoded = tokenized_rows(f"messages:{path}", None, 0, tokenizer, max_len=256)
        cat = next(r for r in encoded if r["prompt"] == "What rhymes with cat?")
        end = "<|im_end|>"  # the tiny tokenizer's EOS, which both templates put after an answer
        labelled = labelled_text(tokenizer, cat).replace("\n", "")
        assert labelled == f"cats{end}|big cat{end}", (prompt_format, labelled)
        assert "You answer in one word." in tokenizer.decode(cat["input_ids"])  # the system turn is in the prompt
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "human", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"no usable row \(1 malformed; the first is row 1 \(messages\): expected "
                       r"messages: a list of \{\"role\": system \| user \| assistant"):  # fmt: skip
        load_examples(f"messages:{bad}", None, seed=0)


def test_alpaca_rows_need_no_input_column(tmp_path):
    path = tmp_path / "no-input.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Say {w}.", "output": w}) + "\n" for w in ("yes", "no")))
    rows = load_examples(f"alpaca:{path}", None, seed=0)
    assert sorted(rows["prompt"]) == ["Say no.", "Say yes."]


def test_rows_cut_before_their_answer_are_counted_and_logged(tmp_path, tiny_model_dir, caplog):
    from parablock_flwr.model import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    long_prompt = "Consider this. " * 60  # far longer than max-seq-len: its answer would be cut entirely
    rows = [{"instruction": long_prompt if i % 3 == 0 else f"Say {i}.", "output": str(i)} for i in range(12)]
    path = tmp_path / "site.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING", logger="parablock_flwr.data"):
        split = node_splits(f"alpaca:{path}", "", 2, 40, 0, tokenizer, 64)
    train, heldout = split  # it unpacks as (train, held-out)
    assert split.dropped_for_length == 4 and len(train) + len(heldout) == 8
    assert f"alpaca:{path}: 4 of 12 rows dropped, cut before their answer by max-seq-len=64" in caplog.text
    split = node_splits(f"alpaca:{path}", f"alpaca:{path}", 0, 40, 0, tokenizer, 64)
    assert (split.dropped_for_length, split.heldout_dropped_for_length) == (4, 4)
    assert tokenized_splits(f"alpaca:{path}", None, 2, 0, tokenizer, 512).dropped_for_length == 0


def test_the_run_summary_says_what_the_run_left_out():
    """Rejected replies and rows dropped for length are on the run's last line, not only in the records."""
    from parablock_flwr.metrics import run_summary

    records = [{"round": 0}, {"round": 1, "num_rejected": 1, "dropped_examples": 5}, {"round": 2, "num_rejected": 2}]
    expected = "3 replies rejected; up to 5 data rows dropped, cut before their answer by max-seq-len"
    assert run_summary(records) == expected
    assert run_summary([{"round": 0}, {"round": 1, "num_rejected": 0, "dropped_examples": 0}]) == ""


def test_the_run_summary_counts_the_direct_streams_fallbacks_and_refusals_the_final_evaluations_included():
    """``transport = "direct"``: fallbacks and refusals, by kind, are on the run's last line, the last round's
    ``final_direct_*`` (the nodes' final evaluation, refusals until the stream stopped) included."""
    from parablock_flwr.metrics import run_summary

    records = [
        {"round": 0},
        {"round": 1, "direct_fallbacks": 1, "direct_refusals": 2, "direct_refused_bad_capability": 2},
        {"round": 2, "direct_fallbacks": 1, "direct_refusals": 0, "final_direct_fallbacks": 1,
         "final_direct_refusals": 1, "final_direct_refused_stalled": 1},
    ]  # fmt: skip
    assert run_summary(records) == (
        "3 messages' blocks on Flower's path instead of the direct stream (direct_fallbacks); "
        "3 requests refused by the direct stream (bad_capability 2, stalled 1)"
    )
    quiet = {"direct_fallbacks": 0, "direct_refusals": 0, "final_direct_fallbacks": 0, "final_direct_refusals": 0}
    assert run_summary([{"round": 1, **quiet}]) == ""


@pytest.mark.slow
def test_the_default_datasets_rows_are_the_same_bits_in_every_process():
    """Deterministic mode promises the same bits in every run: the default dataset's rows must not depend
    on the process (Python randomises str hashes per process; a generator that iterates a set of letters
    gives other rows in another process, as reasoning-gym's ransom_note did)."""
    import subprocess
    import sys

    from parablock_flwr.config import RunConfig

    code = (
        "import hashlib, json, sys; from parablock_flwr.data import generate_examples; "
        "rows = generate_examples(sys.argv[1], 64, 0); "
        "print(hashlib.sha256(json.dumps(rows.to_list()).encode()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code, RunConfig().dataset],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(digests) == 1, f"{RunConfig().dataset}: its rows differ between processes"
