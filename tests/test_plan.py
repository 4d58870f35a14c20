"""`parablock-flwr plan`: memory from a model's config alone, checked against a real worker's peak;
the GPU check's sizing and its CPU dry run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parablock_flwr.cli import main as cli_main
from parablock_flwr.decoder_shapes import DECODERS, decoder_shapes

ROOT = Path(__file__).resolve().parent.parent
LLAMA_8B = ROOT / "docs" / "model-configs" / "llama-3.1-8b"
# The stream's TLS files, as a run config names them (plan reads none of them)
TLS = ('transport-certfile="server.pem"', 'transport-keyfile="server.key"', 'transport-ca="ca.crt"')


def test_plan_prints_its_table_for_a_llama3_8b_config(capsys):
    assert cli_main(["plan", str(LLAMA_8B), 'weights="bf16"', "--gpu-memory-gb", "24"]) == 0
    out = capsys.readouterr().out
    assert "P=8.030 B parameters, 32 layers" in out  # Llama-3.1-8B: 8.03 B
    for row in ("| per-site device (one worker, one GPU) |", "| per-site host (RAM, one worker) |", "| server"):
        assert row in out
    device = float(out.split("| per-site device (one worker, one GPU) | ")[1].split(" |")[0])
    assert 30 < device < 45  # 5-layer blocks at the defaults: more than a 24 GB card holds
    fits = [line.strip() for line in out.split("fits a 24 GB GPU:")[1].strip().splitlines()]
    assert fits[0].startswith("train=full weights=bf16") and fits[1].startswith("train=lora")
    assert all(float(line.split("-> device ")[1].split(" GiB")[0]) <= 24e9 / 2**30 for line in fits)
    assert cli_main(["plan", str(LLAMA_8B), 'weights="fp16"']) == 2
    assert "plan: weights='fp16': expected one of fp32, bf16" in capsys.readouterr().err


def test_the_servers_memory_follows_the_transport_blocks_in_the_superlink_or_in_the_streams_inbox(capsys):
    """On Flower's path the SuperLink holds a round's blocks; on the stream it holds control data, and the
    stream the published step and the uploads waiting for their replies, as many in memory as the round holds
    updates."""
    from parablock_flwr.strategies.update_spill import IN_MEMORY

    rows, stream = {}, ['transport-address="server:9094"', *TLS, "--num-nodes", "12"]
    for transport in ("flower", "direct"):
        assert cli_main(["plan", str(LLAMA_8B), f'transport="{transport}"', *stream]) == 0
        rows[transport] = capsys.readouterr().out.split("| server (ServerApp) | ")[1].split("\n")[0]
    assert "superlink_messages" in rows["flower"] and "stream_records" not in rows["flower"]
    assert "superlink_messages" not in rows["direct"] and "stream_records" in rows["direct"]
    stream = float(rows["direct"].split("stream_records ")[1].split(",")[0].split(" ")[0])
    replies = float(rows["direct"].split("replies_and_step ")[1].split(",")[0].split(" ")[0])
    # In fp32 the round's updates are IN_MEMORY of the 12 nodes' blocks and three fp32 copies of the block; the
    # stream holds IN_MEMORY uploads and the step.
    assert stream == pytest.approx(replies * (IN_MEMORY + 1) / (IN_MEMORY + 3), rel=0.01) and IN_MEMORY < 12


def test_the_plan_says_what_the_step_log_costs_on_the_servers_disk_and_how_to_bound_it(capsys):
    """500 rounds of Llama-3.1-8B in 7 blocks (5 layers each, the last 2): one fp32 step of the largest
    block a round, 4.1 GiB, about 2 TiB in all; `snapshot-every` bounds it at 3 snapshots of every
    trainable weight and 2N steps."""
    assert cli_main(["plan", str(LLAMA_8B), "num-server-rounds=500"]) == 0
    out = capsys.readouterr().out
    disk = out.split("| server disk (the run folder, 500 rounds) | ")[1].split("\n")[0]
    # Three nodes' updates stay in memory (no round spill); simulation: each virtual node's pending update on
    # disk too, said apart: a deployment keeps it on the sites, not in the server's total.
    assert disk.startswith(
        "2,055.7 | step_log 2,031.3, pending_updates 24.4, round_spill 0.0; in a simulation also "
        "node_state_simulation 12.2 (a deployment keeps it on the sites) |"
    ), disk
    assert "the step log grows by 4.1 GiB a round: snapshot-every=7 bounds it at 134.9 GiB" in out
    assert cli_main(["plan", str(LLAMA_8B), "num-server-rounds=500", "snapshot-every=7"]) == 0
    out = capsys.readouterr().out
    assert "| step_log 134.9, pending_updates 24.4, round_spill 0.0;" in out and "the step log grows" not in out


# Peak device memory (torch.cuda.max_memory_allocated, MiB) of one worker on an H200, 2026-12-01:
# `scripts/gpu-check.sh --at-size-only` (docs/deploy-8b.md, "Measured on a GPU").
MEASURED_ON_H200 = {("llama-3.2-1b", 4, 1): 8401, ("llama-3.1-8b", 4, 1): 33685, ("llama-3.1-8b", 8, 4): 74787}


@pytest.mark.parametrize(("model", "layers", "micro"), list(MEASURED_ON_H200))
def test_the_plan_covers_what_a_gpu_measured_within_5_percent(model, layers, micro):
    """The plan's device terms (without the CUDA context, which max_memory_allocated leaves out) are
    at least the measured peak, and at most 5% above it: the figures gpu-check measured."""
    from parablock_flwr.config import RunConfig
    from parablock_flwr.plan import make_plan, model_config, model_shape

    folder = ROOT / "docs" / "model-configs" / model
    settings = {"model": str(folder), "weights": "bf16", "precision": "bf16", "max-seq-len": 1024,
                "batch-size": 8, "layers-per-block": layers, "micro-batch-size": micro,
                "gradient-checkpointing": micro == 1}  # fmt: skip
    cfg = RunConfig.from_flower(settings)
    planned = sum(make_plan(cfg, model_shape(cfg, model_config(str(folder))), num_nodes=1).device.values())
    assert 1.0 <= planned / 2**20 / MEASURED_ON_H200[model, layers, micro] <= 1.05


def test_gpu_check_sizes_itself_to_the_gpus_it_finds(monkeypatch, capsys, tmp_path):
    """An 8B model on one 40 GB GPU: no fp32 step, one SuperNode; on two 80 GB GPUs: one per GPU."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("GPU_CHECK_WORK", str(tmp_path))
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def sizing(gpus: int, gb: float) -> str:
        argv = [str(LLAMA_8B), "--sizing-only", "--gpus", str(gpus), "--gpu-memory-gb", str(gb)]
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", *argv, "--layers-per-block", "1", "--max-seq-len", "128"])
        assert gpu_check.main() == 0
        return capsys.readouterr().out

    small = sizing(1, 40)
    assert "worker-fp32: skipped: fp32 weights need" in small
    assert "second-supernode: skipped: two workers need" in small
    assert "deployment: 1 SuperNode(s) on cpu" in small
    large = sizing(2, 80)
    assert "skipped" not in large and "deployment: 2 SuperNode(s) on cpu, cpu" in large


@pytest.mark.e2e
def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    """GPU_CHECK_DRY_RUN=1: the same steps on the CPU with a tiny Llama and a pretend GPU that holds
    two workers: both worker measurements (benchmarks/memory_check.py: two rounds of a real node worker
    in a fresh process, its peak RSS within 15% of the plan's terms beside its measured runtime), a
    2-SuperNode deployment, and one PASS line at the end."""
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path)}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--gpu-memory-gb", "4"], cwd=ROOT, capture_output=True, text=True,
        timeout=900, env=env,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1].startswith("gpu-check: PASS (3 passed"), proc.stdout[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == {"worker-bf16": "ok", "worker-fp32": "ok", "deployment-2-nodes": "ok"}
    ratios = [float(line.split("plan/peak ")[1].split(")")[0]) for line in lines if "plan/peak" in line]
    assert len(ratios) == 2 and all(0.85 <= r <= 1.15 for r in ratios), ratios


def test_plan_refuses_an_unknown_or_mistyped_key_as_simulate_does(capsys):
    """`wieghts` once gave an fp32 plan and exit 0: now one line naming the key and the closest valid
    one, exit code 2, nothing on stdout (the launcher's check, `simulate`'s)."""
    assert cli_main(["plan", str(LLAMA_8B), 'wieghts="bf16"']) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "parablock-flwr plan: wieghts: unknown key; did you mean weights?\n"
    assert cli_main(["plan", str(LLAMA_8B), 'layers-per-block="5"']) == 2
    assert capsys.readouterr().err == 'parablock-flwr plan: layers-per-block="5": expected an integer\n'


def test_plan_refuses_a_missing_model_folder_and_a_block_size_the_model_cannot_take(tmp_path, capsys):
    """A model path that is not on this disk, and ``layers-per-block`` above the model's layer count, are
    config errors like any other: one line naming the value and what was expected, exit code 2 (the first
    once answered with the hub's error, the second exited 1)."""
    missing = tmp_path / "no-such-model"
    assert cli_main(["plan", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"parablock-flwr plan: model={str(missing)!r}: no such file or folder; expected a model folder, its "
        f"config.json, an embedded: name or a hub id (org/name)\n"
    )
    assert cli_main(["plan", str(LLAMA_8B), "layers-per-block=99"]) == 2
    assert capsys.readouterr().err == (
        "parablock-flwr plan: layers-per-block=99: expected 1..32 (the model has 32 decoder layers)\n"
    )


def _row(out: str, block: str) -> list[float]:
    line = next(x for x in out.splitlines() if x.startswith(f"| {block} |"))
    return [float(v.replace(",", "")) for v in line.strip("| ").split(" | ")[1:]]


def test_plan_models_each_rounds_time_with_the_transports_fixed_and_per_byte_costs(capsys):
    """Llama-3.1-8B, 5-layer blocks in bf16 on the wire: 1.09 B values, 2,181 MB each way. The exchange is
    the fixed cost + both directions over the framework's throughput + the link; ParaBlock's round is
    the larger of compute and exchange, FedBCD's their sum; the local-steps it names fill the window."""
    from parablock_flwr.core import LinkModel

    link = ["uplink-mbps=1000.0", "downlink-mbps=1000.0", "latency-ms=20.0", "message-overhead-s=5.0"]
    args = ["plan", str(LLAMA_8B), 'transfer-dtype="bf16"', "message-throughput-mbs=100.0", *link]
    assert cli_main([*args, "local-steps=3", "--step-time-s", "2"]) == 0
    out = capsys.readouterr().out
    mb, comm, compute, para, seq = _row(out, "0-5")
    nbytes = 5 * 218_112_000 * 2  # 5 decoder layers of 218.1 M parameters, 2 bytes each
    assert mb == pytest.approx(nbytes / 1e6, abs=0.05)
    expected = LinkModel(1000.0, 1000.0, 20.0, 5.0, 100.0).comm_seconds(nbytes, nbytes)
    assert comm == pytest.approx(expected, abs=0.01) and comm == pytest.approx(5 + 43.62 + 0.04 + 34.90, abs=0.05)
    assert compute == 6.0 and para == max(compute, comm) and seq == pytest.approx(compute + comm, abs=0.01)
    steps = int(out.split("compute matches the window at local-steps=")[1].split(" ")[0])
    assert steps == 42  # ceil(83.56 / 2)
    assert cli_main([*args, f"local-steps={steps}", "--step-time-s", "2"]) == 0
    mb, comm, compute, para, seq = _row(capsys.readouterr().out, "0-5")
    assert compute >= comm and para == compute  # the window is hidden


def _section(out: str, transport: str) -> str:
    """The time figures plan prints for ``transport``: the run's own section, or the one beside it."""
    run, beside = out.split("\nbeside it, transport=")
    return beside if beside.startswith(f'"{transport}"') else run.split("time per round (core.LinkModel)")[1]


def test_plan_prints_both_transports_each_with_its_per_byte_cost_and_its_balance(capsys):
    """The run's transport first, the other beside it: the same fixed cost, Flower's per-byte cost or
    the stream's, so that direct's exchange of the 8B model's 2.2 GB block is shorter by the difference;
    its own round times and compute-matching local-steps. A run that says direct prints the same two
    sections the other way round, its header naming the transport."""
    from parablock_flwr.core import LinkModel

    link = ["uplink-mbps=1000.0", "downlink-mbps=1000.0", "latency-ms=20.0", "message-overhead-s=5.0"]
    args = ["plan", str(LLAMA_8B), 'transfer-dtype="bf16"', "message-throughput-mbs=100.0", *link, "local-steps=3"]
    assert cli_main([*args, "--step-time-s", "2"]) == 0
    out = capsys.readouterr().out
    nbytes = 5 * 218_112_000 * 2
    flower, direct = _section(out, "flower"), _section(out, "direct")
    assert direct.splitlines()[0] == (
        '"direct" (block records on the run\'s stream: the same fixed cost, per-byte cost (stream-throughput-mbs) '
        "160 MB/s and a round trip per direction for its calls):"
    )
    mb, comm, compute, para, seq = _row(direct, "0-5")
    stream = LinkModel(1000.0, 1000.0, 20.0, 5.0, 100.0, "direct", 160.0)
    expected = stream.comm_seconds(nbytes, nbytes)
    assert comm == pytest.approx(expected, abs=0.01)
    assert _row(flower, "0-5")[1] - comm == pytest.approx(2 * nbytes / 100e6 - 2 * nbytes / 160e6 - 0.08, abs=0.02)
    # Correction at-end (the deterministic default): ParaBlock's update leaves as soon as it is computed,
    # beside the next computation: a short compute leaves the exchange less the upload.
    ahead = stream.ahead_seconds(nbytes)
    assert ahead == pytest.approx(nbytes / 160e6 + 0.04 + 8 * nbytes / 1e9, abs=1e-6)
    assert para == pytest.approx(max(compute, comm - ahead, (compute + comm) / 2), abs=0.01) and para < comm - 1
    assert seq == pytest.approx(compute + comm, abs=0.01)
    steps = int(direct.split("compute matches the window at local-steps=")[1].split(" ")[0])
    assert steps == math.ceil(expected / 2) < int(flower.split("at local-steps=")[1].split(" ")[0])
    assert "parablock" in direct.split("rounds (descending): ")[1]

    as_direct = [*args, 'transport="direct"', 'transport-address="10.0.0.1:9094"', *TLS]
    assert cli_main([*as_direct, "--step-time-s", "2"]) == 0
    swapped = capsys.readouterr().out
    header = swapped.split("time per round (core.LinkModel): ")[1].splitlines()[0]
    assert header.endswith("per-byte cost on the run's stream (stream-throughput-mbs) 160 MB/s and a round trip "
                           "per direction for its calls; transport=direct transfer-dtype=bf16")  # fmt: skip
    assert _row(_section(swapped, "direct"), "0-5") == _row(direct, "0-5")
    assert _row(_section(swapped, "flower"), "0-5") == _row(flower, "0-5")
    beside = _section(swapped, "flower").splitlines()[0]
    assert beside == (
        '"flower" (block records inside Flower\'s messages: the same fixed cost, per-byte cost '
        "(message-throughput-mbs) 100 MB/s):"
    )


def test_plan_says_flowers_per_byte_cost_must_be_measured_before_the_transports_are_compared(capsys):
    assert cli_main(["plan", str(LLAMA_8B)]) == 0
    beside = capsys.readouterr().out.split("\nbeside it, transport=")[1].splitlines()[0]
    assert beside.endswith("Flower's per-byte cost (message-throughput-mbs) is not modeled: measure it "
                           "(python -m benchmarks.time_model) before comparing):")  # fmt: skip


def test_plan_without_a_step_time_prints_the_exchange_and_says_what_is_missing(capsys):
    assert cli_main(["plan", str(LLAMA_8B)]) == 0
    out = capsys.readouterr().out
    assert "compute not modeled: give --step-time-s S (one local step, measured) or --probe" in out
    assert len(_row(out, "0-5")) == 2


def test_plan_prints_a_sites_disk_and_loras_load_time_host_spike(capsys):
    """LoRA on Llama-3.1-8B with fp32 weights: the steady host column holds adapters only, but loading
    holds the whole model in fp32 (P x 4 bytes, 29.9 GiB) for a moment; the site's disk holds the
    checkpoint in its bf16 files (P x 2) and, with a rounded transfer-dtype, the residual store."""
    assert cli_main(["plan", str(LLAMA_8B), 'train="lora"', 'transfer-dtype="int8"']) == 0
    out = capsys.readouterr().out
    spike = float(out.split("per-site host at load (a moment, before the move to the device): ")[1].split(" ")[0])
    assert spike == pytest.approx((8.03e9 * 4 + 560 * 2**20) / 2**30, abs=0.1)
    host = float(out.split("| per-site host (RAM, one worker) | ")[1].split(" |")[0])
    assert host < 3 < 25 < spike
    disk = out.split("per-site disk: ")[1].splitlines()[0]
    assert "model_files 15.0" in disk and "residual_store" in disk


def test_plan_with_a_data_file_counts_its_datasets_cache(capsys, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n' * 200_000)
    assert cli_main(["plan", str(LLAMA_8B), f'dataset="alpaca:{data}"']) == 0
    disk = capsys.readouterr().out.split("per-site disk: ")[1].splitlines()[0]
    assert f"datasets_cache {data.stat().st_size / 2**30:,.1f}" in disk and "residual_store" not in disk


def _plan_in_a_fresh_process(model: str, args: list[str], cache: Path) -> tuple[str, list[str]]:
    """``plan``'s output in a new Python, and which of transformers, its modeling code and peft it
    imported."""
    env = {**os.environ, "PARABLOCK_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    code = (
        "import sys; from parablock_flwr.cli import main; "
        f"assert main(['plan', {model!r}, *{args!r}]) == 0; "
        "print('IMPORTED', [m for m in ('transformers', 'transformers.modeling_utils', 'peft') if m in sys.modules])"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out, _, imported = run.stdout.rpartition("IMPORTED ")
    return out, json.loads(imported.replace("'", '"'))


@pytest.mark.slow
def test_a_first_plan_of_a_known_decoder_imports_neither_transformers_nor_peft(tmp_path):
    """Llama-3.1-8B's shapes follow from its config.json by arithmetic: the first plan in an empty cache,
    with LoRA and the fits' search, imports neither transformers (seconds) nor peft, and caches nothing."""
    args = ['train="lora"', "--gpu-memory-gb", "24", "--step-time-s", "2"]
    out, imported = _plan_in_a_fresh_process(str(LLAMA_8B), args, tmp_path)
    assert "P=8.037 B parameters, 32 layers" in out and "fits a 24 GB GPU:" in out  # the adapters counted
    assert imported == [] and not (tmp_path / "plan-shapes").exists()


@pytest.mark.slow
def test_a_second_plan_of_an_unknown_architecture_does_not_import_transformers_modeling_code(tmp_path):
    """GPT-2 is not a decoder the arithmetic knows: plan builds it on the meta device (transformers'
    modeling code) once and caches its shape, so a second plan of the same config and partition keys
    skips it and prints the same."""
    folder = tmp_path / "gpt2"
    folder.mkdir()
    values = {"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 1000,
              "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(values))
    runs = [_plan_in_a_fresh_process(str(folder), ["layers-per-block=2"], tmp_path / "cache") for _ in "12"]
    assert "4 layers" in runs[0][0] and runs[0][0] == runs[1][0]
    assert "transformers.modeling_utils" in runs[0][1] and "transformers.modeling_utils" not in runs[1][1]


# Configs of each decoder the arithmetic knows, beside docs/model-configs and SmolLM2: every optional
# key absent (the architecture's defaults), and each switch turned the other way.
SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_hidden_layers": 3,
         "vocab_size": 100}  # fmt: skip
SWITCHED = {"num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": True}
SYNTHETIC = {
    **{f"{arch}-defaults": {"model_type": arch, **SMALL} for arch in DECODERS},
    **{f"{arch}-switched": {"model_type": arch, **SMALL, **SWITCHED} for arch in DECODERS},
    "llama-biases": {"model_type": "llama", **SMALL, "attention_bias": True, "mlp_bias": True, "head_dim": None},
    "qwen3-biases": {"model_type": "qwen3", **SMALL, "attention_bias": True, "num_key_value_heads": None},
    "mistral-null-head-dim": {"model_type": "mistral", **SMALL, "head_dim": None, "num_key_value_heads": 1},
}
LORA = {
    "full": {},
    "lora-default": {"train": "lora"},
    "lora-all-linear": {"train": "lora", "lora-target-modules": "all-linear", "lora-rank": 4},
    "lora-mlp": {"train": "lora", "lora-target-modules": " gate_proj,down_proj,gate_proj", "lora-rank": 3},
}


def _config_folder(name: str, tmp_path: Path) -> Path:
    """A folder with the named config.json: docs/model-configs', SmolLM2's (converted), a synthetic one."""
    if name in SYNTHETIC:
        (tmp_path / "config.json").write_text(json.dumps(SYNTHETIC[name]))
        return tmp_path
    if name == "smollm2":
        from parablock_flwr.model import resolve_model

        return Path(resolve_model("embedded:smollm2-135m-instruct"))  # converted once per machine (slow)
    return ROOT / "docs" / "model-configs" / name


DOC_CONFIGS = sorted(p.name for p in (ROOT / "docs" / "model-configs").iterdir() if p.is_dir())
REAL_CONFIGS = [pytest.param("smollm2", marks=pytest.mark.slow), *DOC_CONFIGS]


@pytest.mark.parametrize("lora", list(LORA))
@pytest.mark.parametrize("name", REAL_CONFIGS + list(SYNTHETIC))
def test_the_arithmetic_gives_the_parameters_of_transformers_own_model(name, lora, tmp_path):
    """Every parameter's name and shape, in ``named_parameters`` order, as transformers builds the model
    on the meta device and PEFT adds its adapters, for every config under docs/model-configs, SmolLM2,
    and each known decoder with its defaults and its switches."""
    import torch
    from transformers import AutoModelForCausalLM

    from parablock_flwr.config import RunConfig
    from parablock_flwr.model import add_lora
    from parablock_flwr.plan import model_config

    folder = _config_folder(name, tmp_path)
    cfg = RunConfig.from_flower({"model": str(folder), **LORA[lora]})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(str(folder)))
        model = add_lora(model, cfg) if cfg.trainable == "lora" else model
    built = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    values = json.loads((folder / "config.json").read_text())
    assert decoder_shapes(values, cfg.trainable, cfg.lora_rank, cfg.lora_target_modules) == built


@pytest.mark.parametrize(
    ("values", "lora_targets"),
    [
        ({"model_type": "gpt2", **SMALL}, ""),  # an architecture the arithmetic does not know
        ({"model_type": "llama", **SMALL, "hidden_size": 66}, ""),  # 66 / 4 heads: transformers refuses it
        ({"model_type": "qwen3", **SMALL, "head_dim": None}, ""),  # transformers cannot build it
        ({"model_type": "llama", **{k: v for k, v in SMALL.items() if k != "vocab_size"}}, ""),
        ({"model_type": "llama", **SMALL, "mlp_bias": "yes"}, ""),
        ({"model_type": "llama", **SMALL}, "mlp"),  # not a linear layer: PEFT refuses it with its own words
        ({"model_type": "llama", **SMALL}, "self_attn.q_proj"),  # PEFT's suffix match
    ],
)
def test_the_arithmetic_leaves_what_it_does_not_know_to_transformers(values, lora_targets):
    train = "lora" if lora_targets else "full"
    assert decoder_shapes(values, train, 8, lora_targets) is None


# The argument sets of this file's tests and docs/deploy-8b.md's plan, and the partition keys.
PLAN_ARGS = [
    ['weights="bf16"', "--gpu-memory-gb", "24"],
    ['weights="bf16"', 'precision="bf16"', "max-seq-len=1024", "batch-size=8", "layers-per-block=8",
     "--gpu-memory-gb", "24", "--num-nodes", "3"],
    ['train="lora"', 'transfer-dtype="int8"', 'lora-target-modules="all-linear"', "lora-rank=16"],
    ['non-layer-params="block"', "layers-per-block=3", "num-server-rounds=500", "--gpu-memory-gb", "48"],
    ['algorithm="fedavg-lora"', "--gpu-memory-gb", "40"],
    ['transfer-dtype="bf16"', "message-throughput-mbs=100.0", "uplink-mbps=1000.0", "message-overhead-s=5.0",
     "local-steps=3", "--step-time-s", "2"],
]  # fmt: skip


# The built model's plan of a 70B model builds it on the meta device once per layers-per-block the fits try.
PLAN_CONFIGS = [pytest.param(c, marks=pytest.mark.slow) if "70b" in c else c for c in DOC_CONFIGS]


@pytest.mark.parametrize("name", [REAL_CONFIGS[0], *PLAN_CONFIGS])
def test_the_plan_by_arithmetic_prints_what_the_plan_of_the_built_model_prints(name, tmp_path, monkeypatch, capsys):
    """Every config under docs/model-configs and SmolLM2, with this file's argument sets: the same
    text, character for character, as when every shape comes from the model built on the meta device."""
    from parablock_flwr import plan

    folder = str(_config_folder(name, tmp_path))
    monkeypatch.setenv("PARABLOCK_CACHE", str(tmp_path / "cache"))  # no shape from an earlier plan
    for args in PLAN_ARGS:
        assert cli_main(["plan", folder, *args]) == 0
        by_arithmetic = capsys.readouterr().out
        with monkeypatch.context() as built:
            built.setattr(plan, "arithmetic_shape", lambda cfg, values: None)
            assert cli_main(["plan", folder, *args]) == 0
        assert capsys.readouterr().out == by_arithmetic, args


def test_plan_probes_a_step_on_this_machine(tiny_model_dir, capsys):
    assert cli_main(["plan", str(tiny_model_dir), "max-seq-len=32", "layers-per-block=2", "--probe"]) == 0
    out = capsys.readouterr().out
    step = float(out.split("one local step ")[1].split(" s (probed here, lowest block)")[0])
    assert 0 < step < 30
