"""A node's computations on its replica: round r's update (``Job``, ``compute_update``, with its one
retry at half the micro-batch when the device runs out of memory) and the held-out evaluation of the
replica (``evaluate_replica``). Each leaves the replica as it found it; the runtime (``Node``) says
where it runs (``run_here``, or the node worker's compute thread)."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .. import core
from ..config import RunConfig
from ..data import sample_batches, truncated_in_batches
from ..evaluation import evaluate
from ..memory import peak_rss_bytes
from ..messages import EvaluateMetrics, TrainMetrics
from ..replica import ReplicaLost
from ..runtime import round_seed
from ..training import TrainResult, TrainSettings, train_block
from .cache import NodeResources
from .request import StateIntact
from .settings import error_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """Round ``server_round``'s computation on this node: train ``block`` from ``x^{base_version} +
    started_from`` (the client half's start point) on partition ``partition_id`` of ``num_partitions``.
    ``slot`` (a client half's correction slot, or None) is called between steps."""

    server_round: int
    block: int
    base_version: int
    started_from: core.PendingUpdate | None
    partition_id: int
    num_partitions: int
    slot: object = None


def run_here(fn: Callable, *args) -> Future:
    """Run ``fn`` now, in the caller's thread (the inline ClientApp's way), as a finished Future."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as err:  # noqa: BLE001 - re-raised by .result()
        future.set_exception(err)
    return future


def computed(future: Future):
    """A computation's result; its failure leaves the replica as it was (``local_model`` restores it)."""
    try:
        return future.result()
    except (StateIntact, ReplicaLost):
        raise
    except (ValueError, RuntimeError, OSError) as err:  # a data or memory error inside the computation
        log.warning("the computation failed: %s: %s", type(err).__name__, err)  # the whole text, at the site
        raise StateIntact(error_line(err)) from err


def train_settings(cfg: RunConfig, server_round: int) -> TrainSettings:
    """The run config's optimisation settings for round ``server_round``'s local steps."""
    run_schedule = cfg.lr_schedule_scope == "run"  # one schedule over R x K steps, round r from step (r-1) x K
    return TrainSettings(
        cfg.local_steps,
        cfg.learning_rate,
        cfg.weight_decay,
        cfg.lr_schedule,
        cfg.warmup_steps,
        cfg.max_grad_norm,
        "bf16" if cfg.weights == "bf16" else cfg.precision,  # bf16 weights with an fp32 block: autocast
        micro_batch_size=cfg.micro_batch_size,
        gradient_checkpointing=cfg.gradient_checkpointing,
        schedule_steps=cfg.num_server_rounds * cfg.local_steps if run_schedule else 0,
        schedule_offset=(server_round - 1) * cfg.local_steps if run_schedule else 0,
    )


def compute_update(resources: NodeResources, cfg: RunConfig, job: Job) -> TrainResult:
    """Train ``job.block`` from ``x^{base_version} + started_from``; the replica is left as it was.

    ``job.slot`` sees the trained model's parameters before they are restored (``capture``). Out of
    device memory, the round is tried once more with half the micro-batch (``oom-retries``), else it
    fails naming what to change, the node's state intact."""
    rows = resources.rows(cfg, job.partition_id, job.num_partitions)
    seed = round_seed(cfg, job.server_round, job.partition_id)
    settings = train_settings(cfg, job.server_round)
    names = resources.partition.names(job.block)
    device = next(resources.replica.model.parameters()).device
    for attempt in (0, 1):
        torch.manual_seed(seed)
        batches = sample_batches(rows, cfg.local_steps, cfg.batch_size, seed, resources.pad_id)
        try:
            with resources.replica.local_model(job.base_version, job.started_from, names) as model:
                result = train_block(model, names, batches, settings, job.slot)
                if job.slot is not None:
                    job.slot.capture(dict(model.named_parameters()))
            break
        except torch.OutOfMemoryError as err:
            first = settings.micro_batch_size or cfg.batch_size
            if attempt or first <= 1:
                raise StateIntact(out_of_memory(err, device, first, cfg)) from err
            settings = dataclasses.replace(settings, micro_batch_size=max(1, first // 2))
            log.warning("round %d: out of memory on %s with micro-batch %d; retrying once with %d",
                        job.server_round, device, first, settings.micro_batch_size)  # fmt: skip
            free_device_cache(device)
            if job.slot is not None:
                job.slot.rearm()  # the computation starts over: it takes the correction again
    result.oom_retries = attempt
    result.delta, result.dp_clipped = private_update(cfg, result.delta, job.server_round, job.partition_id)
    result.num_examples = len(rows)
    result.truncated = truncated_in_batches(rows, cfg.local_steps, cfg.batch_size, seed)
    return result


def private_update(
    cfg: RunConfig, delta: core.Tensors, server_round: int, partition_id: int
) -> tuple[core.Tensors, int | None]:
    """Differential privacy (docs/privacy.md), the computation's last step, before any rounding: the update
    clipped to ``dp-clip-norm``; with ``dp-mode = "local"`` Gaussian noise of std ``σ C`` added here, from a
    seed only this node knows (``dp-noise-seed`` >= 0: a known one, for tests). Second, whether it was clipped,
    which only central mode reports (a bit of the site's data the noise does not cover)."""
    if not cfg.dp:
        return delta, None
    delta, clipped = core.clip(delta, cfg.dp_clip_norm)
    if cfg.dp_mode == "central":
        return delta, int(clipped)
    if cfg.dp_noise_multiplier > 0:
        secret = cfg.dp_noise_seed if cfg.dp_noise_seed >= 0 else secrets.randbits(63)
        noise = core.gaussian(delta, core.noise_seed(secret, server_round, partition_id))
        core.add_noise(delta, noise, cfg.dp_noise_multiplier * cfg.dp_clip_norm)
    return delta, None


def free_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory(err: BaseException, device: torch.device, micro_batch: int, cfg: RunConfig) -> str:
    """One line: the memory the round needed (torch's own figure and the peak), and the keys to change."""
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
    peak = ""
    if device.type == "cuda":
        peak = f"; peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated of "
        peak += f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.2f} GiB"
    return (
        f"out of memory on {device} (micro-batch {micro_batch}, after one retry at half of it): {first_line}{peak}; "
        f"lower micro-batch-size (now {cfg.micro_batch_size}) or layers-per-block (now {cfg.layers_per_block}), "
        f"or set gradient-checkpointing = true"
    )


def update_metrics(result: TrainResult, job: Job, res: NodeResources) -> TrainMetrics:
    """What every reply says of ``Δ_i^r`` (what ``strategies.reply_checks`` reads) and of the node's data:
    its counts, never its rows."""
    return TrainMetrics(
        server_round=job.server_round,
        block=job.block,
        partition_id=job.partition_id,
        base_version=job.base_version,
        num_examples=result.num_examples,
        train_loss=result.mean_loss,
        compute_s=result.compute_s,
        truncated_examples=result.truncated,
        dropped_examples=res.dropped_for_length,  # its data's rows max-seq-len cut before their answer
        malformed_examples=res.malformed_rows,  # rows skipped as malformed (counted, never quoted)
        own_data=int(res.settings.local),
        oom_retries=result.oom_retries,
        compute_start=result.started,
        compute_end=result.ended,
        dp_clipped=result.dp_clipped,
        peak_rss_bytes=peak_rss_bytes(),
    )


def evaluate_replica(resources: NodeResources, cfg: RunConfig, version: int, generate: bool) -> EvaluateMetrics:
    """``evaluation = "clients"``: the held-out loss of ``x^version`` (the replica, nothing applied, nothing
    running on it) on this node's held-out rows. The caller guarantees that no computation uses the
    replica meanwhile (the worker runs it before starting the next one)."""
    if resources.replica.version != version:
        have = resources.replica.version
        raise RuntimeError(f"evaluation of x^{version} asked while this node's model is at x^{have}")
    if resources.heldout_rows is None or not len(resources.heldout_rows):
        raise ValueError("evaluation='clients': this node has no held-out rows")
    own = dataclasses.replace(cfg, dataset=resources.settings.dataset or cfg.dataset)  # task accuracy by its data
    metrics, _ = evaluate(resources.replica.model, resources.tokenizer, resources.heldout_rows, own, generate)
    return EvaluateMetrics(
        eval_version=version,
        heldout_loss=metrics["heldout_loss"],
        heldout_examples=len(resources.heldout_rows),
        task_accuracy=metrics.get("task_accuracy"),
        task_examples=metrics.get("task_examples"),
    )
