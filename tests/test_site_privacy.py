"""A site's rows never leave it: malformed rows are skipped and counted, errors name the source, the row
number and the field, never a row's content; a site without one usable row fails with a local error
that names its file and first bad row. The end-to-end test runs the real ServerApp and ClientApp of
three sites, each with its own file (one with malformed rows, one with nothing usable), and looks for
a marker string from the bad rows in everything the server side writes or prints."""

from __future__ import annotations

import json
import logging

import pytest

from parablock_flwr.data import DataError, load_examples_counted, node_splits
from parablock_flwr.model import load_tokenizer
from parablock_flwr.worker.server import NodeWorker

from helpers import simulate_in_process, tiny_config

MARKER = "PATIENT-7731-SECRET"


def good_rows(site: int, n: int) -> list[str]:
    return [
        json.dumps({"instruction": f"Site {site} item {i}: add {i} and {site}.", "input": "", "output": f"{i + site}"})
        for i in range(n)
    ]


# One malformed row of each kind a site's file may hold, each quoting the marker.
BAD_ALPACA = [
    '{"instruction": "' + MARKER + ' unterminated, "output": "x"}',  # not JSON
    json.dumps({"instruction": MARKER, "output": [MARKER]}),  # output not text
    json.dumps({"instruction": MARKER, "input": {"x": MARKER}, "output": "1"}),  # input not text
    json.dumps({"prompt": MARKER}),  # the required fields missing
    json.dumps([MARKER]),  # not an object
]


def write(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_malformed_rows_are_skipped_counted_and_named_by_row_and_field_only(tmp_path, caplog):
    lines = good_rows(0, 3) + BAD_ALPACA[:2] + good_rows(0, 2) + BAD_ALPACA[2:]
    path = write(tmp_path / "site.jsonl", lines)
    with caplog.at_level(logging.DEBUG):
        rows, malformed = load_examples_counted(f"alpaca:{path}", None, seed=0)
    assert len(rows) == 5 and malformed.count == 5 and malformed.first() == "row 4 (not JSON)"
    assert "5 of 10 rows malformed, skipped; the first is row 4 (not JSON)" in caplog.text
    assert MARKER not in caplog.text and not any(MARKER in r["prompt"] + r["response"] for r in rows)


def test_each_schema_names_the_field_at_fault(tmp_path):
    cases = {
        "alpaca": (json.dumps({"instruction": MARKER, "output": 3}), "output"),
        "mathinstruct": (json.dumps({"source": 1, "instruction": MARKER, "output": "2"}), "source"),
        "messages": (json.dumps({"messages": [{"role": "bot", "content": MARKER}]}), "messages"),
    }
    for kind, (bad, field) in cases.items():
        path = write(tmp_path / f"{kind}.jsonl", ["", bad])  # a blank line is no row; the bad one is line 2
        with pytest.raises(DataError) as err:
            load_examples_counted(f"{kind}:{path}", None, seed=0)
        assert f"no usable row (1 malformed; the first is row 2 ({field})" in str(err.value), str(err.value)
        assert str(path) in str(err.value) and MARKER not in str(err.value)


def test_csv_and_json_rows_are_numbered_in_the_files_order(tmp_path):
    csv_path = tmp_path / "site.csv"
    csv_path.write_text(f'instruction,output\nSay yes.,yes\n"{MARKER}"\nSay no.,no\n')  # record 2 lacks output
    rows, malformed = load_examples_counted(f"alpaca:{csv_path}", None, seed=0)
    assert len(rows) == 2 and malformed.first() == "row 2 (output)"
    json_path = tmp_path / "site.json"
    json_path.write_text(json.dumps([{"instruction": "Say yes.", "output": "yes"}, MARKER]))
    rows, malformed = load_examples_counted(f"alpaca:{json_path}", None, seed=0)
    assert len(rows) == 1 and malformed.first() == "row 2 (not an object)"


def test_rows_json_parses_but_no_model_can_read_are_skipped_not_fatal(tmp_path):
    """A line nested past Python's recursion limit (``json`` raises RecursionError, not ValueError) and
    text with a lone surrogate escape (``\\ud800``: valid JSON, but no UTF-8 string, which Arrow refuses
    when the rows become a dataset) are malformed rows like any other: skipped and counted, the good rows
    kept (before: either one failed the whole site's load with an uncaught error)."""
    deep = "[" * 100_000
    surrogate = '{"instruction": "' + MARKER + ' \\ud800", "output": "x"}'
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\ud800"}]})
    path = write(tmp_path / "site.jsonl", good_rows(0, 2) + [deep, surrogate] + good_rows(0, 1))
    rows, malformed = load_examples_counted(f"alpaca:{path}", None, seed=0)
    assert len(rows) == 3 and malformed.count == 2 and malformed.first() == "row 3 (not JSON)"
    chats = write(
        tmp_path / "chat.jsonl",
        [chat, json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})],
    )
    rows, malformed = load_examples_counted(f"messages:{chats}", None, seed=0)
    assert len(rows) == 1 and malformed.first() == "row 1 (messages)"
    array = tmp_path / "site.json"
    array.write_text("[" + json.dumps({"instruction": "a", "output": "b"}) + ", " + deep + "]")
    with pytest.raises(DataError) as err:  # read as JSON lines once the array fails: one line, not JSON
        load_examples_counted(f"alpaca:{array}", None, seed=0)
    assert f"dataset='alpaca:{array}': no usable row (1 malformed; the first is row 1 (not JSON)" in str(err.value)


def test_a_sites_split_counts_its_malformed_rows(tmp_path, tiny_model_dir):
    """What the node reports (``malformed-examples``): its split's count, beside the rows it keeps."""
    tokenizer = load_tokenizer(str(tiny_model_dir), "plain")
    chats = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]}
             for w in ("yes", "no", "maybe")]  # fmt: skip
    path = write(tmp_path / "chats.jsonl", [json.dumps(c) for c in chats] + [json.dumps({"messages": MARKER})])
    split = node_splits(f"messages:{path}", "", 1, 40, 0, tokenizer, 128)
    assert split.malformed == 1 and len(split.train) + len(split.heldout) == 3


def test_a_site_without_usable_rows_fails_with_its_file_and_first_bad_row_through_the_worker(tmp_path, tiny_model_dir):
    """The deployment's relay path: the worker's error reply (what the server logs and records) names
    the site's file and its first bad row, and nothing of any row."""
    path = write(tmp_path / "site.jsonl", BAD_ALPACA[1:])  # every row malformed; the first bad is row 1
    header = {
        "op": "train",
        "run-id": 5,
        "run-config": tiny_config(tiny_model_dir, tmp_path / "out"),
        "partition-id": 0,
        "num-partitions": 1,
        "node": {"dataset": f"alpaca:{path}", "heldout-dataset": "", "device": "cpu", "state-dir": ""},
        "round": {"server-round": 1, "block": 0, "step-block": -1, "next-block": 1, "algorithm": "fedbcd",
                  "run-dir": str(tmp_path)},
    }  # fmt: skip
    reply, _ = NodeWorker().serve_request(header, {})
    assert f"dataset='alpaca:{path}': no usable row (4 malformed; the first is row 1 (output)" in reply["error"]
    assert MARKER not in json.dumps(reply)


# Conversations of a role no template knows, or without an assistant turn: JSON, but malformed.
BAD_MESSAGES = [
    json.dumps({"messages": [{"role": "bot", "content": MARKER}]}),
    json.dumps({"messages": [{"role": "user", "content": MARKER}]}),
]


def site_files(folder) -> list[dict]:
    """Three sites: 0 has 12 good rows and 5 malformed ones, 1 has 16 good rows, 2 (chat rows) only
    malformed ones."""
    return [
        {"dataset": f"alpaca:{write(folder / 'site-0.jsonl', good_rows(0, 6) + BAD_ALPACA + good_rows(0, 6))}"},
        {"dataset": f"alpaca:{write(folder / 'site-1.jsonl', good_rows(1, 16))}"},
        {"dataset": f"messages:{write(folder / 'site-2.jsonl', BAD_MESSAGES)}"},
    ]


@pytest.mark.e2e
def test_no_row_of_a_site_reaches_anything_the_server_writes_or_prints(tmp_path, tiny_model_dir):
    """The real ServerApp and ClientApp (in one process: nodes' and server's output together), three
    sites with their own files. Site 0's malformed rows are skipped and counted (the reply, the round's
    record, the run's last line); site 2 has no usable row: it fails every round with an error that
    names its file and first bad row, and the run ends naming it as left out. The marker of the bad
    rows is in no file of the run folder and in nothing printed."""
    data = tmp_path / "data"
    data.mkdir()
    run = simulate_in_process(
        tmp_path / "sim", tiny_model_dir, num_supernodes=3, node_configs=site_files(data),
        num_server_rounds=2, local_steps=2, max_num_examples=16, evaluation="clients", heldout_examples=2,
    )  # fmt: skip
    assert run.run_dir is not None, run.stdout[-3000:] + run.stderr[-3000:]
    printed = run.stdout + run.stderr
    written = {p.relative_to(run.run_dir): p.read_bytes() for p in run.run_dir.rglob("*") if p.is_file()}
    assert {"metrics.jsonl", "nodes.jsonl", "status.json"} <= {str(p) for p in written}
    assert any(str(p).startswith("checkpoint/") for p in written)
    assert MARKER not in printed
    assert [str(p) for p, data in written.items() if MARKER.encode() in data] == []

    status = json.loads(written[next(p for p in written if str(p) == "status.json")])
    assert status["kind"] == "completed-with-exclusions", status
    (excluded,) = status["excluded_nodes"]
    assert "site-2.jsonl': no usable row (2 malformed; the first is row 1 (messages)" in excluded, excluded
    for record in (r for r in run.records if r["round"] >= 1):
        assert record["num_accepted"] == 2 and record["malformed_examples"] == 5, record
    assert "up to 5 malformed data rows skipped" in printed


def test_a_library_errors_text_stays_at_the_site_and_the_projects_own_errors_say_what_failed():
    """A node relays its errors to the server. A library's message may quote a row (a tokenizer's or a
    JSON parser's error echoes its input), so only its type leaves; this project's errors name a file,
    a row number and a field, and go as they are."""
    from parablock_flwr.data import DataError
    from parablock_flwr.node.settings import error_line

    leaked = error_line(ValueError(f"cannot encode {MARKER!r}"))
    assert MARKER not in leaked and leaked.startswith("ValueError")
    ours = error_line(DataError("dataset='alpaca:/srv/a.jsonl': no usable row (the first is row 3 (output))"))
    assert ours == "DataError: dataset='alpaca:/srv/a.jsonl': no usable row (the first is row 3 (output))"


def test_check_data_counts_a_sites_rows_and_names_them_by_number_only(tmp_path, tiny_model_dir, capsys):
    """``parablock-flwr check-data``, what a site runs on its file before a run: its rows, the malformed ones
    (the first by number and field), the rows max-seq-len would cut before their answer (by number), and the
    token lengths; never a row's content. Exit 0 when every row trains, 1 when some would not, 2 when none can."""
    from parablock_flwr.cli import main as cli_main

    model = f'model="{tiny_model_dir}"'
    long_row = json.dumps({"instruction": f"{MARKER} " * 60, "output": "1"})  # its answer starts past 64 tokens
    site = write(tmp_path / "site.jsonl", [*good_rows(0, 4), BAD_ALPACA[0], long_row, BAD_ALPACA[1]])
    assert cli_main(["check-data", f"alpaca:{site}", model, "max-seq-len=64"]) == 1
    out = capsys.readouterr().out
    assert MARKER not in out
    assert out.splitlines()[0] == f"alpaca:{site}: 7 rows, 4 train at max-seq-len=64", out
    assert "malformed, skipped: 2 (the first: row 5 (not JSON))" in out
    assert "cut before their answer by max-seq-len=64, dropped: 1 (rows 6)" in out and "tokens per row: median" in out
    clean = write(tmp_path / "clean.jsonl", good_rows(1, 3))
    assert cli_main(["check-data", f"alpaca:{clean}", model]) == 0
    assert capsys.readouterr().out.startswith(f"alpaca:{clean}: 3 rows, 3 train at max-seq-len=")
    unusable = write(tmp_path / "bad.jsonl", BAD_ALPACA)
    assert cli_main(["check-data", f"alpaca:{unusable}", model]) == 2
    err = capsys.readouterr().err
    assert MARKER not in err and "no usable row of 5 (5 malformed; the first is row 1 (not JSON))" in err, err
    assert cli_main(["check-data", "reasoning-gym:gsm_symbolic", model]) == 2
    assert "reasoning-gym's rows are generated, not read" in capsys.readouterr().err


def test_the_example_rows_of_the_deployment_guide_are_rows_a_run_reads():
    """docs/deployment.md shows one row of each form a site's file holds; each is read as that form."""
    from pathlib import Path

    from parablock_flwr.data import schema_row

    text = (Path(__file__).parents[1] / "docs" / "deployment.md").read_text()
    block = text.split("A row of\neach form")[1].split("```json\n")[1].split("```")[0]
    rows = [json.loads(line) for line in block.splitlines()]
    for kind, row in zip(("alpaca", "mathinstruct", "messages"), rows, strict=True):
        assert isinstance(schema_row(kind, row), dict), (kind, schema_row(kind, row))
