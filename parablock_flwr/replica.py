"""A process's copy of the global model, and the server's log of global steps.

A copy of ``x`` only moves by replaying global steps ``g^k`` with the same
float operation the server used, so every copy stays bit-identical to the
server's ``x^k``. The steps come with the messages: ``g^{r-1}`` in every
round-r message, plus the steps a node missed (``catch-up``), or the current
values of every block when it missed more steps than there are blocks. In
simulation one Ray actor serves many virtual nodes, so an actor's copy can
be behind the node it serves: it replays the rest from the server's step
log in the run folder (``g^k`` written while round k+1's replies are outstanding,
before round k+2 is sent: a round-r actor reads steps up to r-2 from it).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .core import (
    TRANSFER_DTYPES,
    EncodedTensors,
    PendingUpdate,
    TensorHashes,
    Tensors,
    add_scaled,
    apply_step,
    apply_step_keeping,
    int8_blocks,
)
from .durable import crash_point, replace_file
from .messages import CATCH_UP, GLOBAL_STEP, RESUME_PENDING, MessageError, RoundConfig, catch_up_step
from .tensor_file import write_tensors

Step = tuple[int, Tensors]  # (block, g)
FetchStep = Callable[[int], Step]  # version k -> (b_k, g^k)
# The step log's file format (each step's safetensors metadata), not a message: its keys are named here.
STEP_FILE_BLOCK, STEP_FILE_VERSION, STEP_FILE_ENCODING = "block", "version", "encoding"
STEP_FILE_SCALES = "/scales"  # int8's scales of a tensor, beside its values (no parameter's name has a slash)


class StepLog:
    """``global-steps/v{k}.safetensors``: the block and ``g^k`` of every round k.

    With ``snapshot-every = W`` the log is bounded: every W rounds the server also writes
    ``snapshot-v{S}.safetensors`` (the exact values of every trainable tensor of ``x^S``), and once
    two snapshots exist it keeps only the two latest and the steps after the older of them
    (``prune``, which the server runs between rounds, before the next round's messages): at most
    2 snapshots and 2W steps, whatever the number of rounds (3 snapshots from one's write to the
    next messages). What reads the log still finds what it needs: a resumed server rebuilds ``x^R``
    from the latest snapshot before R plus the steps after it; a Ray actor too far behind starts
    again from a snapshot; a node that missed steps no longer in the log gets a full sync
    (``NodeSync``).
    """

    def __init__(self, run_dir: Path | str):
        self.dir = Path(run_dir) / "global-steps"

    def write(self, version: int, block: int, step: Tensors) -> None:
        """``g^version``, written atomically and durably (``durable.replace_file``): readers never see
        a half-written step, and a resumed server finds every step its checkpoint counts on. A step kept as
        it travelled (``EncodedTensors``, ``wire.Decoded``: int8's values and scales, bf16, fp16) is written
        so, a quarter or half of its fp32 bytes and no fp32 copy made, and ``read`` gives it back as it was:
        decoding it is exact, so every reader sees the bits the server applied."""
        tensors, encoding = _step_file(step)
        metadata = {STEP_FILE_BLOCK: json.dumps(block), STEP_FILE_VERSION: str(version), STEP_FILE_ENCODING: encoding}

        def write(tmp: Path) -> None:
            write_tensors(tmp, tensors, metadata)
            crash_point("step-log", version)  # the crash tests' point: the step written, not yet renamed

        replace_file(self.dir / f"v{version:05d}.safetensors", write)

    def write_snapshot(self, version: int, values: Tensors) -> None:
        """``x^version``'s exact values, written atomically and durably."""
        replace_file(self.dir / f"snapshot-v{version:05d}.safetensors", lambda tmp: write_tensors(tmp, values))

    def snapshots(self) -> list[int]:
        return sorted(int(p.stem.removeprefix("snapshot-v")) for p in self.dir.glob("snapshot-v*.safetensors"))

    def latest_snapshot(self, at_most: int) -> int | None:
        """The newest snapshot version <= ``at_most``, or None."""
        return max((v for v in self.snapshots() if v <= at_most), default=None)

    def read_snapshot(self, version: int) -> Tensors:
        return load_file(str(self.dir / f"snapshot-v{version:05d}.safetensors"))

    def steps(self) -> list[int]:
        return sorted(int(p.stem.removeprefix("v")) for p in self.dir.glob("v*.safetensors"))

    def has(self, version: int) -> bool:
        return (self.dir / f"v{version:05d}.safetensors").exists()

    def prune(self, keep_after: int | None = None) -> bool:
        """Keep the two latest snapshots and the steps after the older one; drop the rest, except the
        steps after ``keep_after`` (the server's evaluator, behind, still reads them). Returns whether
        everything the snapshots made redundant is gone (False: a later prune has more to drop)."""
        snapshots = self.snapshots()
        if len(snapshots) < 2:
            return True  # x^0 (the model itself) plus every step is still the only way back to early versions
        oldest_kept = snapshots[-2]
        drop_to = oldest_kept if keep_after is None else min(oldest_kept, keep_after)
        for version in snapshots[:-2]:
            (self.dir / f"snapshot-v{version:05d}.safetensors").unlink(missing_ok=True)
        for version in self.steps():
            if version <= drop_to:
                (self.dir / f"v{version:05d}.safetensors").unlink(missing_ok=True)
        return drop_to == oldest_kept

    def rebase_if_pruned(self, replica: ModelReplica, needed: int) -> None:
        """Move a replica that is behind the pruned log (it needs steps no longer there) onto the
        newest snapshot at or before ``needed``, the version it must show next."""
        steps = self.steps()
        if not steps or replica.version + 1 >= steps[0]:
            return
        version = self.latest_snapshot(needed)
        if version is not None and version > replica.version:
            replica.reset_to(version, self.read_snapshot(version))

    def read(self, version: int) -> Step:
        path = self.dir / f"v{version:05d}.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"global step v{version} is missing from {self.dir}")
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
        block, encoding = json.loads(metadata[STEP_FILE_BLOCK]), metadata.get(STEP_FILE_ENCODING, "fp32")
        return block, _step_of_file(load_file(str(path)), encoding, path)


def _step_file(step: Tensors) -> tuple[Tensors, str]:
    """A step's tensors as its file holds them, and their encoding: as it travelled where it was kept so (each
    tensor's values in its shape, int8's scales beside them), else its fp32 values: views, nothing copied."""
    encoded = getattr(step, "encoded", None)
    if not encoded:
        return step, "fp32"
    encoding = next(dtype for dtype in TRANSFER_DTYPES if step.travels_as(dtype))  # as ``wire.kept_dtype`` reads it
    tensors = {}
    for name, (values, scales) in encoded.items():
        tensors[name] = values.reshape(step.shapes[name])
        if scales is not None:
            tensors[name + STEP_FILE_SCALES] = scales
    return tensors, encoding


def _step_of_file(tensors: Tensors, encoding: str, path: Path) -> Tensors:
    """``_step_file``'s tensors read back: fp32 as they are, an encoding as ``EncodedTensors`` (each tensor
    decoded when read, exactly). A file that is not one raises ``ValueError`` naming it."""
    if encoding == "fp32":
        return tensors
    if encoding not in TRANSFER_DTYPES:
        raise ValueError(f"{path}: encoding {encoding!r}; expected one of {', '.join(TRANSFER_DTYPES)}")
    encoded, shapes = {}, {}
    for name, values in tensors.items():
        if name.endswith(STEP_FILE_SCALES):
            if name.removesuffix(STEP_FILE_SCALES) not in tensors:
                raise ValueError(f"{path}: {name} without the values they scale")
            continue
        scales = tensors.get(name + STEP_FILE_SCALES)
        blocks = int8_blocks(values.numel()) if encoding == "int8" else 0
        expected = (TRANSFER_DTYPES[encoding], torch.float32 if encoding == "int8" else None, blocks)
        found = (values.dtype, None, 0) if scales is None else (values.dtype, scales.dtype, scales.numel())
        if found != expected:
            raise ValueError(f"{path}: {name}: {found[0]} values, {found[2]} scales ({found[1]}); expected "
                             f"{expected[0]} values and {blocks} scales ({expected[1]})")  # fmt: skip
        encoded[name], shapes[name] = (values.reshape(-1), scales), values.shape
    return EncodedTensors(encoded, shapes)


class ReplicaLost(RuntimeError):
    """The replica is no longer an exact ``x^v`` (its restore after a computation failed): every later
    use fails until a full sync (``reset_to``), and the node's error is never reported as state-intact."""


class ModelReplica:
    """The global model ``x^version``, moved forward only by replaying global steps.

    With ``keeps_previous`` (a process that serves several nodes: a Ray actor, inline simulation) it
    also keeps the values the last step overwrote, so that ``x^{version-1}`` (what a ParaBlock client
    computes from) can be shown again exactly when another node served by this process has already
    moved the copy on. A node worker serves one node, whose computations start from the copy's own
    version: it keeps no such block.

    With ``weights_dtype`` (``weights = "bf16"``), ``x`` itself lives in an fp32 master copy in
    host memory (``params``: every trainable tensor; steps are applied there, with the server's
    float operation, so it stays bit-identical to the server's ``x``), and the model on the device
    holds bf16 casts of it. The block being trained is put on the device in fp32 (``local_model``):
    fp32 master weights and fp32 optimizer state for the active block, an fp32 update.
    """

    def __init__(
        self,
        model: nn.Module,
        master_names: Iterable[str] = (),
        weights_dtype: torch.dtype | None = None,
        keeps_previous: bool = True,
    ):
        self.model = model
        self.keeps_previous = keeps_previous
        self.device_params = dict(model.named_parameters())
        self.weights_dtype = weights_dtype if weights_dtype not in (None, torch.float32) else None
        if self.weights_dtype is None:
            self.params = self.device_params  # x is the model's own fp32 parameters
        else:
            # The fp32 tensors themselves become the master (no copy): the model's casts replace them.
            self.params = {n: self.device_params[n].detach().to("cpu", torch.float32) for n in master_names}
            model.to(self.weights_dtype)
        self.version = 0
        self._before_last_step: Tensors = {}
        self.hashes = TensorHashes()  # each tensor's SHA-256 while it keeps its value (verify-invariant)
        self.lost = ""  # why the replica is not an exact x^version any more ("": it is)

    def _to_device(self, names: Iterable[str], fp32: Iterable[str] = ()) -> None:
        """Cast the master's values of ``names`` into the device model (``fp32`` ones as fp32 copies)."""
        if self.weights_dtype is None:
            return
        fp32 = set(fp32)
        with torch.no_grad():
            for n in names:
                p = self.device_params[n]
                p.data = self.params[n].to(p.device, torch.float32 if n in fp32 else self.weights_dtype, copy=True)

    def advance_to(self, version: int, fetch_step: FetchStep) -> None:
        """Apply ``g^{v+1}..g^{version}``; asking for an older version is a no-op."""
        if self.lost:
            raise ReplicaLost(f"this process's model is not an exact x^v any more ({self.lost}); it needs a full sync")
        while self.version < version:
            _, step = fetch_step(self.version + 1)
            self._before_last_step = {}
            self.hashes.changed(step)
            try:  # a step that came as its payload (``wire.Decoded``) is read into x chunk by chunk, never whole
                if self.keeps_previous:  # the overwritten tensors are kept as they were, not copied
                    self._before_last_step = apply_step_keeping(self.params, step)
                else:
                    apply_step(self.params, step)
            except Exception as err:  # e.g. out of memory half-way: some tensors moved, not all
                self.lost = f"{type(err).__name__} while applying g^{self.version + 1}: {err}"
                raise ReplicaLost(self.lost) from err
            self._to_device(step)
            self.version += 1

    def reset_to(self, version: int, values: Tensors) -> None:
        """Become ``x^version`` from the exact values of every trainable tensor (a full resync)."""
        self.hashes.changed(values)
        with torch.no_grad():
            for n, t in values.items():
                self.params[n].copy_(t.to(device=self.params[n].device, dtype=self.params[n].dtype))
        self._to_device(values)
        self.version, self._before_last_step, self.lost = version, {}, ""

    @contextlib.contextmanager
    def local_model(
        self, version: int, pending: PendingUpdate | None, train_names: tuple[str, ...]
    ) -> Iterator[nn.Module]:
        """Yield the model as ``x^version + Δ_pending``; ``x`` is as it was afterwards.

        ``version`` is this copy's version or (``keeps_previous``) the one before it. Only the pending
        block, the block about to be trained and (for the version before) the last step's block differ
        from ``x``: they alone get new tensors in the model, and ``x`` is never written, so nothing is
        copied to restore it. The trained block is on the device in fp32.
        """
        back = self._base_values(version)
        delta = pending.delta if pending is not None else {}
        touched = set(train_names) | set(delta) | set(back)
        kept = {}  # weights = "fp32": the model's own tensors are x; they are set aside, not copied
        try:
            with torch.no_grad():
                for n in touched:
                    p = self.device_params[n]
                    value = back.get(n, self.params[n]).to(p.device, torch.float32, copy=True)
                    if n in delta:
                        add_scaled(value, delta, n)  # the float op every copy uses, Δ read chunk by chunk
                    if self.weights_dtype is None:
                        kept[n] = p.detach()
                    p.data = value if n in train_names or self.weights_dtype is None else value.to(p.dtype)
            yield self.model
        finally:
            try:
                with torch.no_grad():
                    for n, t in kept.items():
                        self.device_params[n].data = t
                self._to_device(touched)
            except Exception as err:  # e.g. out of device memory half-way: some tensors keep trained values
                self.lost = f"{type(err).__name__} while restoring it: {err}"
                raise ReplicaLost(self.lost) from err

    def _base_values(self, version: int) -> Tensors:
        """What differs from ``x`` in ``x^version``: nothing, or the values the last step overwrote."""
        if version == self.version:
            return {}
        if version == self.version - 1 and self._before_last_step:
            return self._before_last_step
        raise RuntimeError(
            f"this process's model is at global version {self.version}, a computation needs version {version}"
        )


def catch_up_steps(config: RoundConfig, arrays: dict[str, Tensors]) -> dict[int, Step]:
    """The global steps a round-r message carries: ``g^{r-1}`` (``GLOBAL_STEP``) and any missed ones
    (``CATCH_UP``, each tensor named by ``messages.catch_up_name``; ``NodeSync.parts_for``)."""
    steps: dict[int, Step] = {}
    if config.server_round > 1:
        if GLOBAL_STEP not in arrays:
            raise MessageError(
                f"round {config.server_round}: no {GLOBAL_STEP} record; expected g^{config.server_round - 1}"
            )
        steps[config.server_round - 1] = (config.step_block, arrays[GLOBAL_STEP])
    if config.catch_up_versions and CATCH_UP not in arrays:
        raise MessageError(f"round {config.server_round}: catch-up versions without a {CATCH_UP} record")
    for version, block in zip(config.catch_up_versions, config.catch_up_blocks, strict=True):
        steps[version] = (block, catch_up_step(arrays[CATCH_UP], version))
    return steps


def resumed_pending(config: RoundConfig, arrays: dict[str, Tensors]) -> PendingUpdate | None:
    """The client's own ``Δ_i^R`` that a resumed server hands back in round R+1 (``RESUME_PENDING``).

    After a server restart the client processes are new: the server's checkpoint
    is the only copy of the update each client would compute round R+1 from.
    """
    if RESUME_PENDING not in arrays:
        return None
    if config.resume_pending_block is None or config.resume_pending_version is None:
        raise MessageError(f"round {config.server_round}: a {RESUME_PENDING} record without its block and version")
    return PendingUpdate(config.resume_pending_block, config.resume_pending_version, arrays[RESUME_PENDING])
