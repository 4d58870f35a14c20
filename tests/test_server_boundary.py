"""The server's shape: the package imports without a cycle, and the algorithm decides a round without a
``Run`` (which acts on what it returns). No module but the schema spells a message key: tests/test_messages.py."""

from __future__ import annotations

import ast
from pathlib import Path

from parablock_flwr import messages

PACKAGE = Path(messages.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere (module level, functions, ``TYPE_CHECKING``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
            out |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    # Importing ``a.b.c`` runs ``a/b/__init__.py`` first: an edge to each package above it, but those
    # above ``name`` itself (they are being imported already).
    out |= {m.rsplit(".", k)[0] for m in out for k in range(1, m.count(".") + 1)}
    return {m for m in out if m in modules and m != name and not name.startswith(f"{m}.")}


def test_the_package_imports_without_a_cycle():
    """Every import between the package's modules, wherever it is written, goes one way: the run and the
    algorithm, the node and the schema, never import each other in a circle."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports(p, modules) for p in paths}
    assert "parablock_flwr.server_apps.run" in graph["parablock_flwr.server_apps.app"]  # the walk sees imports
    assert "parablock_flwr.strategies.fedbcd" in graph["parablock_flwr.server_apps.run"]  # and the package above
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module not in done:
            for imported in sorted(graph[module]):
                visit(imported, path + [module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_algorithm_decides_a_round_without_a_run_and_leaves_the_acting_to_it(tmp_path):
    """ParaBlock built with its run folder and no ``Run``: ``aggregate_train`` returns the round's outcome
    (the step it applied to ``x``, the replies accepted and rejected with their reasons, each pending
    update to keep) and does none of the run's work: no step logged, nothing staged or recorded. Its own
    loop is the run's: ``start`` says so rather than ignore Flower's parameters."""
    import torch
    from flwr.app import Message, MessageType, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from parablock_flwr import core
    from parablock_flwr.config import RunConfig
    from parablock_flwr.records import to_record
    from parablock_flwr.replica import StepLog
    from parablock_flwr.strategies import ParaBlock

    partition = core.BlockPartition(blocks=(("w",), ("b",)), labels=("w", "b"))
    x = {"w": torch.zeros(3), "b": torch.zeros(2)}
    cfg = RunConfig(num_server_rounds=2, min_accepted_replies=1, max_update_norm=0.0)  # any update values
    strategy = ParaBlock(global_params=x, partition=partition, schedule=[0, 1], run_dir=tmp_path, config=cfg)

    def reply(node: int, block: int) -> Message:
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, node, 0
        request = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
        TaskIdentity.node_id = node
        sent = messages.TrainMetrics(server_round=1, block=block, partition_id=node, base_version=0, num_examples=4,
                                     train_loss=1.0, compute_s=0.1)  # fmt: skip
        content = RecordDict({messages.METRICS: MetricRecord(messages.metrics_to_record(sent)),
                              messages.UPDATE: to_record({"w": torch.ones(3)})})  # fmt: skip
        return Message(content, reply_to=request)

    outcome = strategy.aggregate_train(1, [reply(0, block=0), reply(1, block=1)])
    assert [r.partition_id for r in outcome.accepted] == [0] and outcome.accepted[0].metrics.num_examples == 4
    assert [(r.node, r.reason) for r in outcome.rejected] == [(1, "wrong block id 1, expected 0")]
    assert torch.equal(outcome.step["w"], torch.ones(3)) and torch.equal(x["w"], torch.ones(3))
    assert [(p, u.block, u.base_version) for p, u in outcome.pending] == [(0, 0, 0)]
    assert outcome.record["num_accepted"] == 1 and outcome.record["num_rejected"] == 1
    assert not StepLog(tmp_path).steps() and not (tmp_path / "checkpoint").exists()
    assert not (tmp_path / "metrics.jsonl").exists()
    assert not hasattr(strategy, "start")  # the one loop is Run.start
