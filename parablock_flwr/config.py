"""The run configuration: read once from ``[tool.flwr.app.config]``, validated once.

Every key is documented in docs/configuration.md. A bad value stops the run
before any work with one line that names the key, the value and what was
expected.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from . import registry  # the algorithm registry (data only: no torch, no algorithm's code)
from .node.settings import device_valid

SCHEDULES = ("ascending", "descending", "random-permutation", "uniform-random")  # core.block_schedule
NON_LAYER_MODES = ("frozen", "block")  # core.partition_blocks
ALGORITHMS = registry.algorithms()  # the registry's (validation asks it again: one registered later counts)
TRAINS = ("full", "lora")
PARTITIONINGS = ("iid", "dirichlet", "family")
PRECISIONS = ("fp32", "bf16")
WEIGHTINGS = ("examples", "uniform")
LR_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
CORRECTIONS = ("auto", "at-end", "on-receipt", "none")
LR_SCHEDULE_SCOPES = ("round", "run")
TOO_FEW_REPLIES = ("retry", "stop")
TRANSPORTS = ("flower", "direct")  # how a block record's bytes travel in a deployment (docs/transport.md)
TRANSFER_DTYPES = ("fp32", "bf16", "fp16", "int8")  # the keys of core.TRANSFER_DTYPES, the one table of them
EVALUATIONS = ("server", "clients")
WEIGHTS = ("fp32", "bf16")
PROMPT_FORMATS = ("auto", "chat", "plain")  # model.load_tokenizer: the chat template, else PLAIN_TEMPLATE
DP_MODES = ("central", "local")  # who adds differential privacy's noise: the server, or each node (docs/privacy.md)


METRICS_SINKS = ("", "tensorboard")


def _check_metrics_sink(sink: str) -> None:
    """``metrics-sink``: "" (metrics.jsonl only) or "tensorboard", whose package must be installed (an
    optional extra): refused before the run starts, not after its first round."""
    _one_of("metrics-sink", sink, METRICS_SINKS)
    if sink == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            'metrics-sink="tensorboard": the tensorboard package is not installed; expected '
            "`pip install 'parablock-flwr[tensorboard]'` (or tensorboard) on the server, or metrics-sink=\"\""
        )


class ConfigError(ValueError):
    """A run-config value is invalid; the message is one line for the user."""


def parse_cpu_list(text: str, num_cpus: int | None = None) -> set[int]:
    """``1``, ``0,2`` or ``2-7`` as a set of CPU ids (among ``0..num_cpus-1`` when given): the
    worker's ``--compute-cpus`` and the run's ``eval-cpus``. A ValueError names what was expected."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"{text!r}: expected CPU ids like 1, 0,2 or 2-7") from None
    if not cpus or (num_cpus is not None and not cpus <= set(range(num_cpus))):
        raise ValueError(f"{text!r}: expected CPUs among 0..{(num_cpus or 1) - 1}")
    return cpus


@dataclass(frozen=True)
class RunConfig:
    """Typed view of the run config; field ``foo_bar`` is key ``foo-bar``."""

    algorithm: str = "parablock"
    strategy: str = ""
    model: str = "embedded:smollm2-135m-instruct"
    train: str = "full"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj"
    dataset: str = "reasoning-gym:syllogism,letter_counting,gcd,family_relationships"
    prompt_format: str = "auto"
    num_examples: int = 240
    heldout_examples: int = 64
    partitioning: str = "iid"
    dirichlet_alpha: float = 0.5
    num_server_rounds: int = 4
    layers_per_block: int = 5
    non_layer_params: str = "frozen"
    schedule: str = "descending"
    local_steps: int = 5
    batch_size: int = 4
    micro_batch_size: int = 0
    gradient_checkpointing: bool = False
    max_seq_len: int = 192
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    lr_schedule_scope: str = "round"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    server_lr: float = 1.0
    weighting: str = "examples"
    fraction_train: float = 1.0
    min_available_nodes: int = 1
    precision: str = "fp32"
    weights: str = "fp32"
    transfer_dtype: str = "fp32"
    seed: int = 0
    deterministic: bool = True
    correction: str = "auto"
    torch_threads: int = 0
    evaluation: str = "server"
    eval_device: str = "cpu"
    eval_cpus: str = ""
    eval_batch_size: int = 8
    eval_every: int = 1
    eval_max_lag: int = 0
    generate_examples: int = 64
    generate_every: int = 0
    max_new_tokens: int = 8
    metrics_sink: str = ""
    uplink_mbps: float = 50.0
    downlink_mbps: float = 50.0
    latency_ms: float = 50.0
    message_overhead_s: float = 0.0
    message_throughput_mbs: float = 0.0
    stream_throughput_mbs: float = 160.0
    round_timeout_s: float = 3600.0
    pull_interval_s: float = 0.1
    transport: str = "flower"
    transport_address: str = ""
    transport_certfile: str = ""
    transport_keyfile: str = ""
    transport_ca: str = ""
    transport_client_ca: str = ""
    transport_insecure: bool = False
    transport_idle_timeout_s: float = 30.0
    transport_messages_ahead: bool = True
    transport_replies_on_stream: bool = True
    max_update_norm: float = -1.0  # -1: the bound no honest AdamW update reaches; 0: none
    max_num_examples: int = 0
    max_correction_drift: float = 0.0
    min_accepted_replies: int = 1
    on_too_few_replies: str = "retry"
    max_round_retries: int = 2
    max_consecutive_rejections: int = 3
    verify_invariant: bool = False
    dp_clip_norm: float = 0.0  # 0: no differential privacy
    dp_noise_multiplier: float = 0.0
    dp_mode: str = "central"
    dp_delta: float = 1e-5
    dp_target_epsilon: float = 0.0  # 0: no budget stops the run
    dp_noise_seed: int = -1  # -1: a secret the server (central) or each node (local) draws
    save_final_model: bool = False
    save_every: int = 0
    snapshot_every: int = 0
    output_dir: str = "~/parablock-runs"
    resume_from: str = ""

    @classmethod
    def from_flower(cls, run_config: Mapping[str, object]) -> RunConfig:
        """Build and validate from Flower's ``context.run_config``."""
        values: dict[str, object] = {}
        known = {f.name: f for f in fields(cls)}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name not in known:
                continue  # keys of other components (e.g. Flower's own) are not ours
            values[name] = _coerce(key, value, type(known[name].default))
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Every value checked once, before anything starts: the first bad one raises ``ConfigError``, one
        line naming the key, its value and what was expected (a run refused now loses no work)."""
        self._check_choices()
        self._check_counts()
        self._check_uncorrected()
        self._check_relations()
        self._check_devices()
        self._check_numbers()
        self._check_names()
        self._check_transport()
        self._check_privacy()

    def _check_choices(self) -> None:
        """Keys whose value is one of a fixed set: a typo would otherwise select nothing, silently."""
        _one_of("algorithm", self.algorithm, registry.algorithms())
        _one_of("schedule", self.schedule, SCHEDULES)
        _one_of("non-layer-params", self.non_layer_params, NON_LAYER_MODES)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("transfer-dtype", self.transfer_dtype, TRANSFER_DTYPES)
        _one_of("weighting", self.weighting, WEIGHTINGS)
        _one_of("lr-schedule", self.lr_schedule, LR_SCHEDULES)
        _one_of("correction", self.correction, CORRECTIONS)
        _one_of("train", self.train, TRAINS)
        _one_of("partitioning", self.partitioning, PARTITIONINGS)
        _one_of("on-too-few-replies", self.on_too_few_replies, TOO_FEW_REPLIES)
        _one_of("evaluation", self.evaluation, EVALUATIONS)
        _one_of("weights", self.weights, WEIGHTS)
        _one_of("prompt-format", self.prompt_format, PROMPT_FORMATS)
        _check_metrics_sink(self.metrics_sink)
        _one_of("lr-schedule-scope", self.lr_schedule_scope, LR_SCHEDULE_SCOPES)

    def _check_counts(self) -> None:
        """Integer keys: rounds, steps, sizes and limits, each with its least meaningful value."""
        if self.snapshot_every == 1:
            raise ConfigError(
                "snapshot-every=1: expected 0 (keep every step) or at least 2 (a resumed run needs a snapshot "
                "older than its last checkpoint's round, which the two kept snapshots then always include)"
            )
        for key in (
            "num-server-rounds",
            "layers-per-block",
            "local-steps",
            "batch-size",
            "max-seq-len",
            "eval-batch-size",
            "heldout-examples",
            "eval-every",
            "lora-rank",
            "max-new-tokens",
            "min-available-nodes",
        ):
            _at_least(key, getattr(self, key.replace("-", "_")), 1)
        for key in (
            "torch-threads",
            "generate-examples",
            "generate-every",
            "save-every",
            "min-accepted-replies",
            "max-round-retries",
            "max-consecutive-rejections",
            "max-num-examples",
            "snapshot-every",
            "eval-max-lag",
            "warmup-steps",
        ):
            _at_least(key, getattr(self, key.replace("-", "_")), 0)

    def _check_relations(self) -> None:
        """Values that are valid alone but not together (a micro-batch must divide the batch...)."""
        if self.micro_batch_size < 0 or (self.micro_batch_size and self.batch_size % self.micro_batch_size):
            raise ConfigError(
                f"micro-batch-size={self.micro_batch_size}: expected 0 (no accumulation) or a divisor of "
                f"batch-size={self.batch_size}"
            )
        if self.num_examples < self.heldout_examples + 1:
            raise ConfigError(
                f"num-examples={self.num_examples}: expected more than "
                f"heldout-examples={self.heldout_examples} (clients need training data)"
            )

    def _check_devices(self) -> None:
        """Where the server's evaluation runs: a device and CPUs this machine can name."""
        if not device_valid(self.eval_device):
            raise ConfigError(f"eval-device={self.eval_device!r}: expected cpu, cuda or cuda:<index>")
        if self.eval_cpus:
            try:
                parse_cpu_list(self.eval_cpus)
            except ValueError as err:
                raise ConfigError(f"eval-cpus={err}") from None

    def _check_numbers(self) -> None:
        """Real-valued keys: rates, times and scales that must be positive, non-negative or a fraction."""
        for key in (
            "learning-rate",
            "server-lr",
            "uplink-mbps",
            "downlink-mbps",
            "round-timeout-s",
            "pull-interval-s",
            "transport-idle-timeout-s",
            "max-grad-norm",
            "lora-alpha",
            "dirichlet-alpha",
        ):
            value = getattr(self, key.replace("-", "_"))
            if not value > 0:
                raise ConfigError(f"{key}={value}: expected a number > 0")
        if not (self.max_update_norm >= 0 or self.max_update_norm == -1):
            raise ConfigError(
                f"max-update-norm={self.max_update_norm}: expected -1 (the bound no honest update reaches), "
                f"0 (none) or a norm > 0"
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora-dropout={self.lora_dropout}: expected a number in [0, 1)")
        if not 0.0 < self.fraction_train <= 1.0:
            raise ConfigError(f"fraction-train={self.fraction_train}: expected a number in (0, 1]")
        for key in (
            "weight-decay",
            "latency-ms",
            "message-overhead-s",
            "message-throughput-mbs",
            "stream-throughput-mbs",
            "max-correction-drift",
        ):
            value = getattr(self, key.replace("-", "_"))
            if not value >= 0:
                raise ConfigError(f"{key}={value}: expected a number >= 0")

    def _check_names(self) -> None:
        """Keys that name something (the model, LoRA's target modules): empty would load nothing."""
        if not [m for m in self.lora_target_modules.split(",") if m.strip()]:
            raise ConfigError("lora-target-modules='': expected comma-separated module names, e.g. q_proj,v_proj")
        if not self.model.strip():
            raise ConfigError("model='': expected a Hugging Face id, a local folder or embedded:<name>")

    def _check_transport(self) -> None:
        """``transport = "direct"``: the address the nodes dial, and TLS files or the explicit insecure switch.
        The files are read where the service starts (the ServerApp), not here: the nodes validate this
        config too, and the server's paths mean nothing on their machines."""
        _one_of("transport", self.transport, TRANSPORTS)
        if self.transport != "direct":
            return
        host, colon, port = self.transport_address.rpartition(":")
        if not colon or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(
                f"transport-address={self.transport_address!r}: expected host:port, the address the nodes dial "
                f"(the ServerApp serves its port on every interface; port 0: any free port)"
            )
        keys = ("transport-certfile", "transport-keyfile", "transport-ca", "transport-client-ca")
        files = {k: getattr(self, k.replace("-", "_")) for k in keys}
        if self.transport_insecure:
            named = [f"{k}={v!r}" for k, v in files.items() if v]
            if named:
                raise ConfigError(f"{named[0]} with transport-insecure=true: expected TLS files or insecure, not both")
            if self.transport_replies_on_stream and not loopback(host):
                raise ConfigError(
                    f"transport-replies-on-stream=true with transport-insecure=true on {host!r}: whoever reads a "
                    f"plaintext stream could have a reply aggregated as a node's; set transport-replies-on-stream="
                    f"false, or use TLS (plaintext replies only on a loopback address, which only local processes read)"
                )
            return
        missing = [k for k, v in files.items() if not v and k != "transport-client-ca"]
        if missing:
            raise ConfigError(
                f"{missing[0]}='': transport='direct' needs transport-certfile, transport-keyfile and transport-ca "
                f"(TLS), or transport-insecure=true (plaintext)"
            )

    def _check_privacy(self) -> None:
        """Differential privacy (docs/privacy.md): noise needs a clip norm to scale to, and a client's weight must
        not scale its clipped update back past it."""
        _one_of("dp-mode", self.dp_mode, DP_MODES)
        for key in ("dp-clip-norm", "dp-noise-multiplier", "dp-target-epsilon"):
            value = getattr(self, key.replace("-", "_"))
            if not value >= 0 or value == float("inf"):
                raise ConfigError(f"{key}={value}: expected a finite number >= 0")
        if not 0.0 < self.dp_delta < 1.0:
            raise ConfigError(f"dp-delta={self.dp_delta}: expected a number in (0, 1), below 1 / the number of sites")
        _at_least("dp-noise-seed", self.dp_noise_seed, -1)
        if self.dp_noise_multiplier > 0 and self.dp_clip_norm == 0:
            raise ConfigError(
                f"dp-noise-multiplier={self.dp_noise_multiplier}: expected dp-clip-norm > 0 too (the noise's std is "
                f"dp-noise-multiplier x dp-clip-norm)"
            )
        if self.dp_target_epsilon > 0 and self.dp_noise_multiplier == 0:
            raise ConfigError(
                f"dp-target-epsilon={self.dp_target_epsilon}: expected dp-noise-multiplier > 0 (without noise no "
                f"epsilon is finite)"
            )
        if self.dp_clip_norm > 0 and self.weighting != "uniform":
            raise ConfigError(
                f"weighting={self.weighting!r} with dp-clip-norm={self.dp_clip_norm}: expected weighting='uniform' "
                f"(a client's example count would scale its clipped update, and the privacy bound, with it)"
            )

    @property
    def dp(self) -> bool:
        """Are the updates clipped (and noised, with ``dp-noise-multiplier``)? (docs/privacy.md)"""
        return self.dp_clip_norm > 0

    def _check_uncorrected(self) -> None:
        """``correction = "none"`` is an ablation: its clients' models are not ``x^{r-1} + Δ_i^r``, so
        what relies on that (the invariant check, a resume's hand-back, a pruned step log) is refused."""
        if self.correction != "none":
            return
        for key, value, off in (
            ("verify-invariant", self.verify_invariant, False),
            ("resume-from", self.resume_from, ""),
            ("snapshot-every", self.snapshot_every, 0),
        ):
            if value != off:
                raise ConfigError(
                    f"{key}={value!r}: expected {off!r} with correction='none' (the ablation without the correction)"
                )

    def as_run_config(self) -> dict[str, object]:
        """The same keys as ``[tool.flwr.app.config]``: ``from_flower`` reads it back."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}

    @property
    def trainable(self) -> str:
        """What moves: ``lora`` adapters or the ``full`` weights; an algorithm may fix it (the
        registry's ``TRAINS_ONLY``: the FedAvg baselines)."""
        return registry.TRAINS_ONLY.get(self.algorithm, self.train)

    @property
    def one_block(self) -> bool:
        """Does the algorithm train (and send) every trainable parameter each round, as one block
        (the registry's ``ONE_BLOCK``: the FedAvg baselines)?"""
        return self.algorithm in registry.ONE_BLOCK

    @property
    def correction_mode(self) -> str:
        """``at-end`` in the deterministic mode, else ``on-receipt``, unless set explicitly."""
        if self.correction == "auto":
            return "at-end" if self.deterministic else "on-receipt"
        return self.correction

    @property
    def max_examples_per_client(self) -> int:
        """The largest ``num-examples`` a reply may claim (its aggregation weight), whatever the node says of
        its data: ``max-num-examples``, or by default the whole dataset's size, which no client's share can
        exceed (a site with its own data counts it itself: the server cannot check it)."""
        return self.max_num_examples or self.num_examples

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir).expanduser().resolve()

    @property
    def resume_path(self) -> Path | None:
        """The run folder to resume; a relative name is taken inside ``output-dir``."""
        if not self.resume_from:
            return None
        return (self.output_path / Path(self.resume_from).expanduser()).resolve()


def check_num_clients(num_clients: int) -> None:
    """The federation must have at least one SuperNode to train anything."""
    if num_clients < 1:
        raise ConfigError(f"num-supernodes={num_clients}: expected at least 1 client")


def _coerce(key: str, value: object, expected: type) -> object:
    if expected is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if expected is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if expected is str and isinstance(value, str):
        return value
    raise ConfigError(f"{key}={value!r}: expected a value of type {expected.__name__}")


def loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (only its own processes can read it)."""
    return host in ("localhost", "[::1]", "::1") or host.startswith("127.")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: expected one of {', '.join(allowed)}")


def _at_least(key: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{key}={value}: expected an integer >= {minimum}")
