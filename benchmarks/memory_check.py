"""Peak memory of one node worker against `parablock-flwr plan`'s figure (parablock_flwr/plan.py).

Runs two rounds of a real node worker in this process (round 1 on block 1, then round 2 on block 0
computed ahead while round 1's reply "travels", exactly as in a deployment: the pending update and
the new one both exist, and block 0 is the worst case, backward running through every layer; two
local steps each, so that a backward runs with the AdamW moments allocated), and
prints the peak RSS (CPU) or ``torch.cuda.max_memory_allocated`` (GPU) beside the plan's terms:

    .venv/bin/python -m benchmarks.memory_check embedded:smollm2-135m-instruct
    .venv/bin/python -m benchmarks.memory_check tiny                          # the tests' tiny Llama
    .venv/bin/python -m benchmarks.memory_check random-1b --weights bf16     # a random ~1B Llama from a config
    .venv/bin/python -m benchmarks.memory_check MODEL --device cuda:0 --weights bf16 --micro-batch-size 1
    .venv/bin/python -c "from benchmarks.memory_check import random_model; random_model(...)"  # a config's shape


Each measurement runs in a fresh process (peak RSS only grows): one model per call. On a CPU the
plan's figure is ``cpu_total`` (device and host terms in one memory) with this process's measured
runtime in place of the plan's constant (see ``main``); on a GPU it is the device terms without the
CUDA context (which max_memory_allocated does not count).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import GSM_AS_MEASURED


def random_llama(folder: Path, tokenizer_from: str) -> str:
    """A randomly initialised Llama of about 1.1B parameters (TinyLlama's shape), saved once."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False, vocab_size=1,
    )  # fmt: skip
    return random_model(config, folder, tokenizer_from, dtype=torch.float32)


def random_model(config, folder: Path, tokenizer_from: str, device: str = "cpu", dtype=torch.bfloat16) -> str:
    """Random weights in the shape of ``config`` (a ``PretrainedConfig``, or a folder with a model's
    ``config.json``: docs/model-configs), saved to ``folder`` once with ``tokenizer_from``'s tokenizer:
    a model of the size users have, on a machine without the hub. Built on ``device`` (an 8B model
    takes seconds on a GPU, minutes on a CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from parablock_flwr.model import load_tokenizer

    if not (folder / "config.json").exists():
        config = config if not isinstance(config, str | Path) else AutoConfig.from_pretrained(config)
        tokenizer = load_tokenizer(tokenizer_from)
        config.vocab_size = max(config.vocab_size, len(tokenizer))  # the model's rows, whatever the tokenizer uses
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model spec, tiny (the tests' tiny Llama) or random-1b")
    parser.add_argument("--weights", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers-per-block", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=0)
    parser.add_argument("--max-seq-len", type=int, default=192)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--dataset", default=GSM_AS_MEASURED["dataset"], help="the run config's dataset")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "parablock-random-1b")
    args = parser.parse_args()

    from parablock_flwr.memory import map_large_buffers

    map_large_buffers()  # as the deployed worker does, before its threads

    from parablock_flwr.messages import GLOBAL_STEP, TRAIN, RoundConfig, WorkerReply, WorkerRequest, relay_name
    from parablock_flwr.plan import make_plan, model_config, model_shape
    from parablock_flwr.wire import join_pieces
    from parablock_flwr.worker.server import NodeWorker

    if args.model == "random-1b":
        model = random_llama(args.cache, "embedded:smollm2-135m-instruct")
    elif args.model == "tiny":
        from parablock_flwr.tools.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    else:
        model = args.model
    config = {
        "model": model, **GSM_AS_MEASURED, "dataset": args.dataset,
        "output-dir": tempfile.mkdtemp(), "num-examples": 40, "heldout-examples": 4,
        "layers-per-block": args.layers_per_block, "local-steps": 2, "batch-size": args.batch_size,
        "micro-batch-size": args.micro_batch_size, "max-seq-len": args.max_seq_len, "weights": args.weights,
        "generate-examples": 0, "torch-threads": 2, "schedule": "ascending",
        "precision": args.precision, "gradient-checkpointing": args.gradient_checkpointing,
    }  # fmt: skip
    # A node imports these where it partitions and trains (so that the ServerApp does not): they are part of the
    # runtime before the model, not of the model's terms.
    from parablock_flwr.data import flwr_partitioners

    flwr_partitioners()
    import flwr_datasets.partitioner  # noqa: F401
    from transformers import get_scheduler  # noqa: F401

    base_rss = peak_rss()  # torch, transformers, datasets and the two above imported
    worker = NodeWorker(state_dir=Path(tempfile.mkdtemp()))

    def header(r: int, block: int, next_block: int) -> dict:
        round_config = RoundConfig(server_round=r, block=block, step_block=1 if r > 1 else -1,
                                   next_block=next_block, algorithm="parablock", run_dir="unused")  # fmt: skip
        return WorkerRequest(op=TRAIN, run_id=1, run_config=config, round=round_config.to_config(), partition_id=0,
                             num_partitions=1, node={"device": args.device}).to_header()  # fmt: skip

    def round_of(*args, arrays=None) -> dict:
        reply, update = worker.serve_request(header(*args), arrays or {})
        if error := WorkerReply.from_header(reply).error:
            sys.exit(f"memory-check: the worker failed: {error}")
        return join_pieces(update)  # what the socket would carry

    started = time.time()
    update = round_of(1, 1, 0)  # round 2 (block 0) starts ahead from x^0 + Δ^1
    round_of(2, 0, -1, arrays={relay_name(GLOBAL_STEP, n): a for n, a in update.items()})  # one node: g^1 = Δ^1
    seconds = time.time() - started
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated(torch.device(args.device))
    else:
        peak = peak_rss()
    worker.compute_thread.shutdown()

    cfg = worker_cfg(config)
    planned = make_plan(cfg, model_shape(cfg, model_config(model)), num_nodes=1)
    on_gpu = args.device.startswith("cuda")
    # On a CPU the plan's constant runtime term gives way to this process's own before the model: how
    # much of the shared libraries' code is resident (RssFile) depends on the page cache, not on the
    # program (more when the library files were just written, as on a fresh install), so only the
    # model's terms are held to the peak; both runtimes are printed.
    figure = sum(planned.device.values()) if on_gpu else planned.cpu_total - planned.host["runtime"] + base_rss
    mib = lambda n: round(n / 2**20)  # noqa: E731
    print(json.dumps({
        "model": args.model, "parameters": planned.shape.parameters, "block_parameters": max(planned.shape.blocks),
        "weights": args.weights, "device": args.device, "batch": args.batch_size,
        "micro_batch": args.micro_batch_size or args.batch_size, "seq": args.max_seq_len,
        "runtime_rss_before_model_mib": mib(base_rss), "peak_mib": mib(peak), "plan_mib": mib(figure),
        "plan_over_peak": round(figure / peak, 3), "plan_constant_runtime_mib": mib(planned.host["runtime"]),
        "host_peak_mib": mib(peak_rss()), "plan_host_mib": mib(planned.host_total if on_gpu else planned.cpu_total),
        "plan_device_terms_mib": {k: mib(v) for k, v in planned.device.items()},
        "plan_host_terms_mib": {k: mib(v) for k, v in planned.host.items()},
        "two_rounds_s": round(seconds, 1),
    }, indent=1))  # fmt: skip


def peak_rss() -> int:
    """This process's peak RSS: ``VmHWM`` (Linux), which starts afresh at exec, unlike ``ru_maxrss``,
    which keeps the high-water mark of the process that forked this one (a pytest with torch loaded)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_cfg(config: dict):
    from parablock_flwr.config import RunConfig

    return RunConfig.from_flower(config)


if __name__ == "__main__":
    sys.exit(main())
