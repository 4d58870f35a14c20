"""The baselines and LoRA through the real ServerApp and ClientApp (``simulate_in_process``: Flower's
in-memory grid, without Ray, whose start-up the Ray tests of tests/test_simulation.py pay); export to
plain HF/PEFT folders.

Each run's final model is rebuilt independently (``x^0`` from the config,
then every logged global step replayed) and compared with what the run
exported, loaded back with plain ``transformers``/``peft`` and no project code.
"""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from parablock_flwr import core
from parablock_flwr.config import RunConfig
from parablock_flwr.model import load_for_training

from helpers import side_by_side, simulate_in_process, succeeded

pytestmark = pytest.mark.e2e  # every test here runs the ServerApp and its nodes


# Each test's run, all three side by side (``side_by_side``): each test reads its own.
RUNS = {
    "fedavg-lora": dict(algorithm="fedavg-lora", num_supernodes=2, num_server_rounds=2, save_final_model=True,
                        save_every=1, learning_rate=1e-2),
    "fedavg-full": dict(algorithm="fedavg-full", num_supernodes=2, num_server_rounds=2, save_final_model=True,
                        generate_examples=0),
    "parablock-lora": dict(algorithm="parablock", train="lora", num_server_rounds=3, verify_invariant=True,
                           generate_examples=0, learning_rate=1e-2),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict:
    def one(label):
        return lambda: simulate_in_process(tmp_path_factory.mktemp(label), tiny_model_dir, **RUNS[label])

    return side_by_side({label: one(label) for label in RUNS})


def _replayed(run) -> tuple[torch.nn.Module, core.BlockPartition, dict[str, torch.Tensor]]:
    """``x^R`` rebuilt from the run's config and step log; also returns ``x^0``'s trainable tensors."""
    cfg = RunConfig.from_flower(json.loads((run.run_dir / "config.json").read_text()))
    model, partition = load_for_training(cfg)
    params = dict(model.named_parameters())
    initial = {n: params[n].detach().clone() for n in partition.all_names()}
    for version in range(1, cfg.num_server_rounds + 1):
        core.apply_step(params, run.step(version)[1])
    return model, partition, initial


def assert_export_rebuilds(run, weights: str, capsys) -> None:
    """``parablock-flwr export RUN_DIR`` (a run without save-final-model, or stopped before its end) rebuilds
    from the run's config, step log and checkpoint the very folder the run exported at its end."""
    from parablock_flwr.cli import main

    assert main(["export", str(run.run_dir)]) == 0
    rounds = run.records[-1]["round"]
    out = run.run_dir / f"model-round-{rounds:05d}"
    assert capsys.readouterr().out.strip() == f"parablock-flwr export: the model after round {rounds} in {out}"
    rebuilt, exported = load_file(str(out / weights)), load_file(str(run.run_dir / "final-model" / weights))
    assert rebuilt.keys() == exported.keys() and all(torch.equal(rebuilt[n], exported[n]) for n in exported)
    assert main(["export", str(run.run_dir / "final-model")]) == 2  # not a run folder: one line
    assert "expected a run folder" in capsys.readouterr().err


def _nbytes(names, params) -> int:
    return sum(params[n].numel() * 4 for n in names)


def test_fedavg_lora_sends_every_adapter_and_exports_a_peft_folder(runs, tiny_model_dir, capsys):
    run = succeeded(runs["fedavg-lora"])
    model, partition, initial = _replayed(run)
    params = dict(model.named_parameters())
    assert partition.num_blocks == 1 and all(".lora_" in n for n in partition.all_names())
    records = run.records
    assert all(r["bytes_up_per_client"] == _nbytes(partition.all_names(), params) for r in records[1:])
    assert records[-1]["heldout_loss"] < records[0]["heldout_loss"]
    assert 0.0 <= records[0]["task_accuracy"] <= 1.0 and "task_accuracy" in records[-1]
    assert len((run.run_dir / "samples" / "round-00002.jsonl").read_text().splitlines()) == 2

    # The adapter folder loads with plain peft on the plain base model and equals x^R.
    exported = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), run.run_dir / "final-model"
    )
    loaded = dict(exported.named_parameters())
    for name in partition.all_names():
        assert torch.equal(loaded[name], params[name]), name
    assert any(not torch.equal(params[n], initial[n]) for n in partition.all_names())  # adapters trained
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    for name, tensor in loaded.items():  # base weights never moved
        if ".lora_" not in name:
            plain = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
            assert torch.equal(tensor, base[plain]), name
    assert (run.run_dir / "checkpoints" / "round-00001" / "adapter_model.safetensors").exists()
    assert_export_rebuilds(run, "adapter_model.safetensors", capsys)

    # The evaluate command on the adapter folder scores what the server measured last round.
    from parablock_flwr.cli import main

    assert main(["evaluate", str(run.run_dir / "final-model"), "--config", str(run.run_dir / "config.json")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["heldout_loss"] == pytest.approx(records[-1]["heldout_loss"], rel=1e-5)
    assert result["task_accuracy"] == records[-1]["task_accuracy"]


def test_fedavg_full_sends_every_weight_and_exports_a_plain_folder(runs, capsys):
    run = succeeded(runs["fedavg-full"])
    model, partition, initial = _replayed(run)
    params = dict(model.named_parameters())
    layers = core.partition_blocks(model, 1)  # every decoder layer: what fedavg-full trains
    assert set(partition.all_names()) == set(layers.all_names())
    assert all(r["bytes_up_per_client"] == _nbytes(partition.all_names(), params) for r in run.records[1:])
    assert "task_accuracy" not in run.records[0]
    exported = load_file(str(run.run_dir / "final-model" / "model.safetensors"))
    for name, tensor in params.items():
        assert torch.equal(exported[name], tensor), name
    assert all(not torch.equal(params[n], initial[n]) for n in partition.all_names()[:3])
    assert_export_rebuilds(run, "model.safetensors", capsys)


def test_parablock_over_lora_blocks_keeps_the_invariant(runs):
    """train="lora": a block is the adapters of its layers; the ParaBlock invariant holds to the bit."""
    run = succeeded(runs["parablock-lora"])
    model, partition, initial = _replayed(run)
    params = dict(model.named_parameters())
    assert partition.num_blocks == 2 and all(".lora_" in n for n in partition.all_names())
    for rec in run.records[1:]:
        assert rec["invariant_checked"] == 3 and rec["invariant_failed"] == 0, rec
        assert rec["bytes_up_per_client"] == _nbytes(partition.names(rec["block"]), params)
    assert run.records[-1]["heldout_loss"] < run.records[0]["heldout_loss"]
