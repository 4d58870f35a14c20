"""The example subclasses (docs/extending.md): unit checks and `flwr run` naming them in the run config."""

import pytest
import torch

from parablock_flwr import core
from parablock_flwr.config import RunConfig
from parablock_flwr.examples.largest_update import LargestUpdateParaBlock
from parablock_flwr.examples.trimmed_mean import TrimmedMeanParaBlock
from parablock_flwr.model import load_model
from parablock_flwr.server_apps.run import Run
from parablock_flwr.strategies import FedBCD, ParaBlock, strategy_class

from helpers import side_by_side, simulate

TRIMMED = "parablock_flwr.examples.trimmed_mean:TrimmedMeanParaBlock"
LARGEST = "parablock_flwr.examples.largest_update:LargestUpdateParaBlock"


def make(cls, tmp_path, tiny_model_dir, rounds=6):
    model = load_model(str(tiny_model_dir))
    part = core.partition_blocks(model, layers_per_block=1)  # 4 blocks
    params = dict(model.named_parameters())
    config = RunConfig(num_server_rounds=rounds)
    return cls(global_params={n: params[n] for n in part.all_names()}, partition=part, schedule=[0] * rounds,
               run_dir=tmp_path, config=config)  # fmt: skip


def test_trimmed_mean_ignores_an_outlier(tmp_path, tiny_model_dir):
    strategy = make(TrimmedMeanParaBlock, tmp_path, tiny_model_dir)
    updates = [
        {"w": torch.tensor([1.0, 2.0])},
        {"w": torch.tensor([1.2, 2.2])},
        {"w": torch.tensor([0.8, 1.8])},
        {"w": torch.tensor([1.1, 2.1])},
        {"w": torch.tensor([100.0, -100.0])},
    ]
    mean = strategy.combine(updates, [1.0] * 5)  # trims 1 per side of each coordinate
    # per coordinate: drop the smallest and the largest value, average the rest
    assert torch.allclose(mean["w"], torch.tensor([(1.0 + 1.1 + 1.2) / 3, (1.8 + 2.0 + 2.1) / 3]))


def test_largest_update_visits_every_block_then_follows_the_largest_step(tmp_path, tiny_model_dir):
    strategy = make(LargestUpdateParaBlock, tmp_path, tiny_model_dir)
    sizes = {0: 1e-3, 1: 5e-3, 2: 1e-4, 3: 2e-3}
    for r in range(1, 5):
        block = strategy.block_for_round(r)
        names = strategy.partition.names(block)
        strategy.server_update(r, block, {n: torch.full_like(strategy.global_params[n], sizes[block]) for n in names})
    assert [strategy.block_for_round(r) for r in range(1, 5)] == [0, 1, 2, 3]
    assert strategy.block_for_round(5) == 1
    assert strategy.block_for_round(5) == 1  # decided once


def test_strategy_key_is_checked():
    assert strategy_class("parablock", "") is ParaBlock
    assert strategy_class("parablock", TRIMMED) is TrimmedMeanParaBlock
    with pytest.raises(ValueError, match="strategy='nowhere:Nothing': cannot import it"):
        strategy_class("parablock", "nowhere:Nothing")
    with pytest.raises(ValueError, match=r"expected a subclass of FedBCD \(algorithm='fedbcd'\)"):
        strategy_class("fedbcd", TRIMMED)
    assert strategy_class("fedbcd", "parablock_flwr.strategies:FedBCD") is FedBCD


EXAMPLES = {TRIMMED: 5, LARGEST: 2}  # each example strategy and its clients


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory, tiny_model_dir) -> dict:
    """Both examples through `flwr run` on Ray, side by side (``side_by_side``: each its own SuperLink and Ray)."""

    def run(strategy):
        return lambda: simulate(
            tmp_path_factory.mktemp("example"),
            tiny_model_dir,
            num_supernodes=EXAMPLES[strategy],
            strategy=strategy,
            num_server_rounds=3,
            layers_per_block=1,
            verify_invariant=True,
        )

    return side_by_side({strategy: run(strategy) for strategy in EXAMPLES})


@pytest.mark.e2e  # starts Flower processes
@pytest.mark.parametrize("strategy, clients", list(EXAMPLES.items()), ids=["trimmed-mean", "largest-update"])
def test_examples_run_through_flwr_run(example_runs, strategy, clients):
    run = example_runs[strategy]
    assert run.returncode == 0 and run.run_dir is not None, run.stdout[-3000:]
    assert strategy.rsplit(":", 1)[1] + ":" in run.stdout  # the strategy's summary line names the class
    records = run.records
    assert all(r["num_accepted"] == clients and r["invariant_failed"] == 0 for r in records[1:])
    assert records[-1]["heldout_loss"] < records[0]["heldout_loss"]
    if strategy == LARGEST:
        assert [r["block"] for r in records[1:]] == [0, 1, 2]  # unvisited blocks first


@pytest.mark.e2e  # Flower's in-memory SuperLink state and Grid, the real ClientApp: about 20 s
def test_a_new_algorithm_added_as_the_docs_say_runs(tmp_path, tiny_model_dir, monkeypatch):
    """docs/extending.md, "A new algorithm": register a server half and a client half by name, and
    nothing else. The run config accepts the name, its trainable set comes from the registry, and
    two rounds run (in-process, the project's real ClientApp over Flower's in-memory Grid)."""
    from damped_algorithm import DampedClient
    from federation import InMemoryFederation, client_app_answer
    from flwr.app import ArrayRecord

    from parablock_flwr import strategies
    from parablock_flwr.config import RunConfig
    from parablock_flwr.metrics import RunRecorder

    from helpers import tiny_config

    monkeypatch.setitem(strategies.SERVER_HALVES, "damped-bcd", "damped_algorithm:DampedBCD")
    monkeypatch.setitem(strategies.CLIENT_HALVES, "damped-bcd", "damped_algorithm:DampedClient")
    run_config = tiny_config(tiny_model_dir, tmp_path, algorithm="damped-bcd", **{"num-server-rounds": 2})
    cfg = RunConfig.from_flower(run_config)
    assert cfg.trainable == "full" and not cfg.one_block
    model = load_model(str(tiny_model_dir))
    part = core.partition_blocks(model, layers_per_block=2)
    params = dict(model.named_parameters())
    strategy = strategy_class("damped-bcd", "")(
        global_params={n: params[n] for n in part.all_names()}, partition=part, schedule=[0, 1],
        run_dir=tmp_path / "run", config=cfg,
    )  # fmt: skip
    with InMemoryFederation(2, client_app_answer(run_config, 2)) as federation:
        Run(strategy).start(federation.grid, ArrayRecord())
    records = RunRecorder(tmp_path / "run").read()
    assert [r["num_accepted"] for r in records[1:]] == [2, 2], records
    assert DampedClient.rounds_finished == 4


def test_a_strategy_the_bundle_would_not_carry_is_refused_before_flower_starts(tmp_path, capsys):
    """Flower runs the app from the bundle it builds (``fab-include``: parablock_flwr/ and extensions/). A
    strategy in a folder of the user's own beside them, or in no folder and not installed, is one line and exit
    code 2 from ``parablock-flwr simulate``, before any Flower process starts (no Flower home made): before, the
    run failed about 24 s into Flower's start-up. A module in extensions/ is taken (the deployment tests run one)."""
    from parablock_flwr.cli import main as cli_main
    from parablock_flwr.tools.app_config import strategy_problem
    from parablock_flwr.tools.launch import find_project_dir

    app = find_project_dir()
    (tmp_path / "my_strategies").mkdir()
    (tmp_path / "pyproject.toml").write_text((app / "pyproject.toml").read_text())
    for strategy, says in [
        ("my_strategies.clip:ClipParaBlock", "my_strategies is in the app folder but not in the bundle Flower runs"),
        ("elsewhere:Nothing", "no module 'elsewhere' in"),
        ("extensions.nope:X", "no extensions/nope.py in"),
    ]:
        code = cli_main(["simulate", "--app-dir", str(tmp_path), f'strategy="{strategy}"'])
        err = capsys.readouterr().err
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "runs" / ".flower" / "flwr-home").exists()
    assert strategy_problem("extensions.update_norms:UpdateNormParaBlock", app) is None
    assert strategy_problem(TRIMMED, tmp_path) is None
    assert strategy_class("parablock", "extensions.update_norms:UpdateNormParaBlock").__name__ == "UpdateNormParaBlock"
