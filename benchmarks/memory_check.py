"""Peak memory of one node worker against the formula of docs/deployment.md ("Large models").

Runs two rounds of a real node worker in this process (round 1, then round 2 computed ahead while
round 1's reply "travels", exactly as in a deployment) on a model, and prints the peak RSS (CPU) or
``torch.cuda.max_memory_allocated`` (GPU) beside the formula's terms:

    .venv/bin/python -m benchmarks.memory_check embedded:smollm2-135m-instruct
    .venv/bin/python -m benchmarks.memory_check random-1b --weights bf16     # a random ~1B Llama from a config
    .venv/bin/python -m benchmarks.memory_check MODEL --device cuda:0 --weights bf16 --micro-batch-size 1

Each measurement runs in a fresh process (peak RSS only grows): one model per call.
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
    from transformers import LlamaConfig, LlamaForCausalLM

    from parablock_flwr.model import load_tokenizer

    if not (folder / "config.json").exists():
        tokenizer = load_tokenizer(tokenizer_from)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
            num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model spec, or random-1b")
    parser.add_argument("--weights", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers-per-block", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=0)
    parser.add_argument("--max-seq-len", type=int, default=192)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "parablock-random-1b")
    args = parser.parse_args()

    from parablock_flwr import node
    from parablock_flwr.node_data import NodeSettings
    from parablock_flwr.worker.server import NodeWorker

    model = random_llama(args.cache, "embedded:smollm2-135m-instruct") if args.model == "random-1b" else args.model
    config = {
        "model": model, **GSM_AS_MEASURED,
        "output-dir": tempfile.mkdtemp(), "num-examples": 40, "heldout-examples": 4,
        "layers-per-block": args.layers_per_block, "local-steps": 1, "batch-size": args.batch_size,
        "micro-batch-size": args.micro_batch_size, "max-seq-len": args.max_seq_len, "weights": args.weights,
        "generate-examples": 0, "torch-threads": 2, "schedule": "ascending",
    }  # fmt: skip
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch, transformers, datasets imported
    worker = NodeWorker()

    def header(r: int, block: int, next_block: int) -> dict:
        return {"op": "train", "run-id": 1, "run-config": config, "partition-id": 0, "num-partitions": 1,
                "node": {"device": args.device},
                "round": {"server-round": r, "block": block, "step-block": 0 if r > 1 else -1,
                          "next-block": next_block, "algorithm": "parablock", "run-dir": "unused"}}  # fmt: skip

    started = time.time()
    _, update = worker.train(header(1, 0, 0), {})  # round 2 (the same block) starts ahead
    step = {f"global-step/{n}": a for n, a in update.items()}  # one node: g^1 = Δ^1
    worker.train(header(2, 0, -1), step)
    seconds = time.time() - started
    resources = node.resources(worker_cfg(config), 1, NodeSettings(device=args.device))
    params = dict(resources.replica.model.named_parameters())
    total = sum(p.numel() for p in params.values())
    trainable = sum(params[n].numel() for n in resources.partition.all_names())
    block = sum(params[n].numel() for n in resources.partition.names(0))
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    model_cfg = resources.replica.model.config
    vocab, hidden, inner = model_cfg.vocab_size, model_cfg.hidden_size, model_cfg.intermediate_size
    micro = args.micro_batch_size or args.batch_size
    first_layer = min(int(n.split(".layers.")[1].split(".")[0]) for n in resources.partition.names(0))
    layers_in_backward = model_cfg.num_hidden_layers - first_layer  # backward runs from the top down to the block
    tokens = micro * args.max_seq_len  # an upper bound: batches are padded to their longest row
    activation_bytes = 2 if args.weights == "bf16" else 4  # bf16 autocast keeps matmul outputs in bf16
    terms = {
        "weights": weight_bytes,
        "master_of_x_in_ram": trainable * 4 if args.weights == "bf16" else 0,
        # fp32: start snapshot, gradient, two AdamW moments, the replica's saved copy (4 + 4 + 8 + 4 bytes);
        # bf16 weights: and the block's fp32 master weights on the device (+4)
        "block_training_state": block * (24 if args.weights == "bf16" else 20),
        "pending_and_new_update": block * 8,
        "logits_fp32_x3": tokens * vocab * 4 * 3,  # logits, log-softmax, their gradient
        # what a Llama layer keeps for backward: about 8 hidden-sized and 4 MLP-sized tensors per token
        "activations": tokens * layers_in_backward * (8 * hidden + 4 * inner) * activation_bytes,
    }
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated(torch.device(args.device))
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "model": args.model, "parameters": total, "block_parameters": block, "weights": args.weights,
        "device": args.device, "batch": args.batch_size, "micro_batch": micro, "seq": args.max_seq_len,
        "runtime_rss_before_model": base_rss, "peak": peak, "formula": sum(terms.values()), "terms": terms,
        "peak_minus_runtime": peak - (0 if args.device.startswith("cuda") else base_rss), "two_rounds_s": seconds,
    }, indent=1))  # fmt: skip
    worker.compute_thread.shutdown()


def worker_cfg(config: dict):
    from parablock_flwr.config import RunConfig

    return RunConfig.from_flower(config)


if __name__ == "__main__":
    sys.exit(main())
