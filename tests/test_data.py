"""Data sources in the Alpaca-GPT4 and MathInstruct schemas, the instruction mix, partitioners, scoring."""

import json

import pytest

from parablock_flwr.data import client_partition, load_examples
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
    with pytest.raises(ValueError, match=r"missing columns \['instruction', 'input', 'output'\]"):
        load_examples(f"alpaca:{path}", 10, seed=0)
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying the network
    with pytest.raises(ValueError, match=r"point at the local copy, e\.g\. dataset=\"mathinstruct:"):
        load_examples("mathinstruct:TIGER-Lab/MathInstruct", 10, seed=0)
    with pytest.raises(ValueError, match=r"dataset='squad:x': expected reasoning-gym"):
        load_examples("squad:x", 10, seed=0)


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
        "heldout_loss 1.9000 (round 0) -> 0.2000 (round 2); "
        "task_accuracy 0.062 (round 0) -> 0.625 (round 2) (always the most common answer: 0.750)"
    )
    assert round_line(records[0], 2) == "round 0/2 heldout_loss 1.9000 task_accuracy 0.062 (4/64)"
