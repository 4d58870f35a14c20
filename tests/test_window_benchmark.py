"""benchmarks.window's reading of a run: the window from computation to computation (so that the direct
transport's upload and download are in it), issue 32's target, and the flower-against-direct comparison of
two real run folders (records and step logs written by the project's own writers)."""

from __future__ import annotations

import torch

from benchmarks import window
from parablock_flwr.metrics import RunRecorder
from parablock_flwr.replica import StepLog


def record(server_round: int, compute: tuple[float, float], received: float, sent: float, up: int, down: int):
    """A round's record as the server writes it for one node (only the keys the benchmark reads)."""
    return {"round": server_round, "wire_bytes_up": up, "wire_bytes_down": down, "measured_comm_s": received - sent,
            "round_wall_s": 10.0, "compute_s_mean": compute[1] - compute[0],
            "timeline": [{"compute_start": compute[0], "compute_end": compute[1], "request_received": received,
                          "prev_reply_sent": sent}]}  # fmt: skip


def test_the_apps_window_runs_from_one_computation_to_the_next_and_its_legs_add_up():
    # Round 1 computes 100-104; its reply leaves at 105 (after the upload); round 2's message reaches the
    # worker at 111, whose records arrive by 113 (the download), when round 2's computation starts.
    prev = record(1, (100.0, 104.0), 99.0, 0.0, up=7_000, down=5_000)
    rec = record(2, (113.0, 117.0), 111.0, 105.0, up=7_000, down=6_000)
    point = window.app_point(prev, rec)
    assert point["window_s"] == 113.0 - 104.0  # the stream's legs inside the window
    assert (point["upload"], point["comm_s"], point["fetch"]) == (1.0, 6.0, 2.0)
    assert point["upload"] + point["comm_s"] + point["fetch"] == point["window_s"]
    assert point["bytes"] == 7_000 + 6_000  # round 1's reply up, round 2's message down
    window.add_directions(point)
    assert point["up"] == 1.0 and point["down"] == 2.0  # no Flower legs in these records: the worker's only


def test_the_target_is_the_control_floor_measured_beside_it_plus_the_bytes_at_300_mbs():
    def run(kind: str, windows: list[float], nbytes: int) -> dict:
        return {"kind": kind, "size": "70", "points": [{"window_s": w, "bytes": nbytes} for w in windows]}

    nbytes = 2 * window.SIZES["70"][1]  # 141.6 MB: 0.472 s at 300 MB/s
    results = {"runs": [run("empty", [5.0, 5.2], 0), run("direct", [5.5, 5.6], nbytes)]}
    (row,) = window.targets(results)
    assert abs(row["target_s"] - (5.1 + nbytes / 300e6)) < 1e-9
    assert row["met"] and row["met_within"] and abs(row["over_floor_s"] - 0.45) < 1e-9
    results["runs"][1] = run("direct", [5.5, 5.8], nbytes)  # 5.65 > 5.572: over the target, within 1 s
    (row,) = window.targets(results)
    assert not row["met"] and row["met_within"]
    assert "**no**" in window.target_table([row])[2]


def test_beyonds_target_is_the_bytes_at_300_mbs_plus_half_a_second_even_without_a_floor_beside_it():
    nbytes = 2 * window.SIZES["70"][1]  # 0.472 s at 300 MB/s: Beyond's target 0.972 s
    direct = {"kind": "direct", "size": "70", "points": [{"window_s": w, "bytes": nbytes} for w in (0.9, 1.0)]}
    (row,) = window.targets({"runs": [direct]})
    assert abs(row["beyond_s"] - (nbytes / 300e6 + 0.5)) < 1e-9 and row["beyond_met"]  # 0.95 <= 0.972
    assert "target_s" not in row  # no control floor measured beside it
    direct["points"][1]["window_s"] = 1.1  # 1.0 > 0.972
    (row,) = window.targets({"runs": [direct]})
    assert not row["beyond_met"] and window.target_table([row])[2].endswith("| 0.97 | **no** |")


def test_a_report_written_again_from_its_results_keeps_the_date_commit_and_machine_it_was_measured_on(
    tmp_path, monkeypatch
):
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    machine = {"arch": "x86_64", "cpu": "Elsewhere CPU", "nproc": 64, "memory_gib": 512.0, "gpu": "none"}
    measured = {"date": "2026-01-02", "commit": "abc1234", "machine": machine}
    text = common.write_report("w", "T", "body", how="python -m benchmarks.w", measured=measured).read_text()
    assert "Date: 2026-01-02  \nCommit: abc1234  \nMachine: x86_64, Elsewhere CPU, 64 CPUs, 512.0 GiB" in text
    today = common.write_report("w", "T", "body", how="python -m benchmarks.w").read_text()
    assert "Commit: abc1234" not in today and f"Machine: {common.machine_line()}" in today


def run_folder(path, steps: dict[int, dict[str, torch.Tensor]], bytes_up: int):
    """A run folder as the server leaves it: records and a step log."""
    recorder, log = RunRecorder(path), StepLog(path)
    for version, step in steps.items():
        recorder.write({"round": version, "wire_bytes_up": bytes_up, "wire_bytes_down": 10})
        log.write(version, 0, step)
    return str(path)


def test_flower_and_direct_runs_are_compared_by_their_bytes_and_every_global_step_bit_for_bit(tmp_path):
    step = {"w": torch.arange(6, dtype=torch.float32)}
    nudged = {"w": step["w"].clone()}
    nudged["w"][3] = torch.nextafter(nudged["w"][3], torch.tensor(10.0))  # one ulp apart
    flower = run_folder(tmp_path / "flower", {1: step, 2: step}, 40)
    same = run_folder(tmp_path / "direct", {1: step, 2: step}, 40)
    assert window.same_model({"flower": {"run_dir": flower}, "direct": {"run_dir": same}}) == {
        "rounds": 2, "same_bytes": True, "steps": 2, "same_steps": 2}  # fmt: skip
    differs = run_folder(tmp_path / "direct-2", {1: step, 2: nudged}, 44)
    compared = window.same_model({"flower": {"run_dir": flower}, "direct": {"run_dir": differs}})
    assert compared == {"rounds": 2, "same_bytes": False, "steps": 2, "same_steps": 1}
    assert window.same_model({"flower": {"run_dir": flower}, "direct": {"error": "failed"}}) is None


def test_the_flower_only_apps_window_is_its_legs_summed_or_with_messages_ahead_the_time_between_replies(tmp_path):
    import json

    def floor_json(ahead: int) -> None:
        # Round 2's message was pushed (at 10.0) before round 1's reply was pulled (at 12.0): its legs overlap
        # round 1's, and the server holds its reply 3.0 s after round 1's.
        rounds = [{"round": 1, "push_start": 0.0, "pushed": 0.5, "clientapp_start": 4.0, "handler_start": 6.0,
                   "handler_end": 6.1, "pulled": 12.0},
                  {"round": 2, "push_start": 10.0, "pushed": 10.5, "clientapp_start": 12.5, "handler_start": 14.5,
                   "handler_end": 14.6, "pulled": 15.0}]  # fmt: skip
        folder = tmp_path / f"ahead{ahead}" / "floor-1"
        folder.mkdir(parents=True)
        (folder / "floor.json").write_text(json.dumps({"payload_bytes": 0, "messages_ahead": ahead, "rounds": rounds}))

    floor_json(0)
    floor_json(1)
    (summed,) = window.floor_points(tmp_path / "ahead0")
    (ahead,) = window.floor_points(tmp_path / "ahead1")
    assert summed["window_s"] == 0.5 + 2.0 + 2.0 + 0.4  # dispatch, delivery, relay, reply: round 2 alone
    assert ahead["window_s"] == 15.0 - 12.0
    assert ahead["delivery"] == summed["delivery"]  # the legs themselves are read alike
