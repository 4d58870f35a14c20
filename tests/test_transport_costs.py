"""The time model knows the transport: ``"flower"`` moves a block's bytes at Flower's fitted rate,
``"direct"`` at the run's stream's, both behind Flower's fixed cost (its control round trip stays)."""

from dataclasses import replace

import pytest

from parablock_flwr import core
from parablock_flwr.config import ConfigError, RunConfig

GB = 10**9
DIRECT = {"transport": "direct", "transport-address": "10.0.0.1:9094", "transport-certfile": "server.pem",
          "transport-keyfile": "server.key", "transport-ca": "ca.crt"}  # fmt: skip


def test_direct_moves_a_blocks_bytes_at_the_streams_rate_behind_flowers_fixed_cost():
    """A 1 GB block each way: direct's exchange is flower's less the per-byte difference, plus the
    stream's two calls (a round trip each); at 0 bytes only those round trips differ, and nothing at
    latency 0. Each transport reads its own rate and ignores the other's."""
    flower = core.LinkModel(1e6, 1e6, 30.0, 5.0, 60.0, "flower", 160.0)
    direct = replace(flower, transport="direct")
    difference = 2 * GB / 160e6 - 2 * GB / 60e6
    assert direct.comm_seconds(GB, GB) - flower.comm_seconds(GB, GB) == pytest.approx(difference + 4 * 0.030)
    assert direct.comm_seconds(GB, GB) < flower.comm_seconds(GB, GB) - 20  # 12.5 s against 33.3 s of bytes
    assert direct.comm_seconds(0, 0) - flower.comm_seconds(0, 0) == pytest.approx(4 * 0.030)
    still = replace(flower, latency_ms=0.0)
    assert replace(still, transport="direct").comm_seconds(0, 0) == still.comm_seconds(0, 0) == 5.0
    assert replace(direct, message_throughput_mbs=1.0).comm_seconds(GB, GB) == direct.comm_seconds(GB, GB)
    assert replace(flower, stream_throughput_mbs=1.0).comm_seconds(GB, GB) == flower.comm_seconds(GB, GB)
    unmodeled = replace(direct, stream_throughput_mbs=0.0, latency_ms=0.0)  # 0: the link and the fixed cost only
    assert unmodeled.comm_seconds(GB, GB) == pytest.approx(5.0 + 2 * 8 * GB / 1e12)
    with pytest.raises(ValueError, match=r"transport='grpc': expected one of flower, direct"):
        core.LinkModel(50.0, 50.0, 0.0, transport="grpc")


def test_the_run_config_names_the_transport_and_the_streams_rate():
    """``LinkModel.from_config`` (what a round's record and ``plan`` use) takes the run's transport, or
    the one named; ``stream-throughput-mbs`` defaults to the figure docs/configuration.md names."""
    cfg = RunConfig.from_flower({**DIRECT, "stream-throughput-mbs": 100.0, "message-throughput-mbs": 40.0})
    assert core.LinkModel.from_config(cfg).throughput_mbs == 100.0
    assert core.LinkModel.from_config(cfg, transport="flower").throughput_mbs == 40.0
    assert core.LinkModel.from_config(RunConfig()).transport == "flower"
    assert RunConfig().stream_throughput_mbs == 160.0


@pytest.mark.parametrize(
    "value, error",
    [
        (-1.0, "stream-throughput-mbs=-1.0: expected a number >= 0"),
        (float("nan"), "stream-throughput-mbs=nan: expected a number >= 0"),
        ("fast", "stream-throughput-mbs"),
    ],
)
def test_a_bad_stream_throughput_is_refused_in_one_line_naming_it(value, error):
    with pytest.raises(ConfigError, match=error) as raised:
        RunConfig.from_flower({"stream-throughput-mbs": value})
    assert "\n" not in str(raised.value)


def test_a_rounds_modeled_figures_use_the_runs_transport(tmp_path):
    """The server's time model (``FedBCD.link``, which each round's record uses) is the run's transport's:
    a 1 GB reply's ``comm_s_modeled`` is the stream's exchange with direct, Flower's with flower."""
    import torch

    from parablock_flwr.messages import TrainMetrics
    from parablock_flwr.strategies import FedBCD
    from parablock_flwr.strategies.reply_checks import Reply
    from parablock_flwr.strategies.round_stats import RoundStats, round_record

    costs = {"message-overhead-s": 5.0, "message-throughput-mbs": 60.0, "stream-throughput-mbs": 160.0}
    partition = core.BlockPartition(blocks=(("w",),), labels=("w",))
    metrics = TrainMetrics(server_round=1, block=0, partition_id=0, base_version=0, num_examples=8, train_loss=1.5,
                           compute_s=0.25)  # fmt: skip
    reply = Reply(node=7, metrics=metrics, update=None, payload_bytes=GB)
    step = {"w": torch.zeros(1).expand(GB // 4)}  # 1 GB down in fp32 (numel only: no memory)
    modeled = {}
    for transport, extra in (("flower", {}), ("direct", DIRECT)):
        cfg = RunConfig.from_flower({**costs, **extra})
        strategy = FedBCD(global_params={"w": torch.zeros(2)}, partition=partition, schedule=[0], run_dir=tmp_path,
                          config=cfg)  # fmt: skip
        assert strategy.link.transport == transport
        record = round_record(
            RoundStats(1, nodes=[7], num_replies=1), "w", 0, step, [reply], [8.0], strategy.link, False
        )
        modeled[transport] = record["comm_s_modeled"]
        assert record["comm_s_modeled"] == pytest.approx(strategy.link.comm_seconds(GB, GB), rel=1e-6)
    assert modeled["flower"] - modeled["direct"] == pytest.approx(2 * GB / 60e6 - 2 * GB / 160e6 - 0.2, rel=1e-4)


def node_loop_period(compute: float, upload: float, rest: float, rounds: int = 200) -> float:
    """The steady round time of a node worker's loop with its update moving ahead, event by event: round r's
    message comes ``rest`` after round r-1's reply; the computation of round r+1 starts when round r's
    message has come and round r's computation is done; round r's upload starts when its computation is
    done, and round r's reply when both its message has come and its upload is done."""
    message, computed, starts = 0.0, compute, []
    for _ in range(rounds):
        start = max(message, computed)  # round r+1's computation starts
        reply = max(start, computed + upload)
        message, computed = reply + rest, start + compute
        starts.append(start)
    return (starts[-1] - starts[-51]) / 50


@pytest.mark.parametrize("compute", [1.0, 8.0, 12.0, 13.5, 30.0])
def test_an_update_that_moves_ahead_leaves_beside_the_next_computation(compute):
    """On the stream, ParaBlock's update leaves as soon as it is computed, beside the next computation
    (docs/transport.md, "One round ahead"): an overlapped round costs the node loop's steady period,
    max(compute, exchange - upload, (compute + exchange) / 2): the compute once it covers the exchange,
    the exchange less the upload when the compute is short. Sequential rounds and Flower's path are
    unchanged."""
    direct = core.LinkModel(1000.0, 1000.0, 30.0, 5.0, 60.0, "direct", 160.0)
    upload = direct.ahead_seconds(GB)
    assert upload == pytest.approx(GB / 160e6 + 0.06 + 8.0)
    assert replace(direct, transport="flower").ahead_seconds(GB) == 0.0
    comm = direct.comm_seconds(GB, GB)  # 26.6 s, of which the upload 14.3 s
    modeled = core.modeled_round_seconds([compute], [comm], True, ahead_s=[upload])
    assert modeled == pytest.approx(node_loop_period(compute, upload, comm - upload), rel=1e-6)
    assert modeled <= max(compute, comm)
    assert core.modeled_round_seconds([compute], [comm], False, ahead_s=[upload]) == pytest.approx(compute + comm)
    assert core.modeled_round_seconds([compute], [comm], True) == pytest.approx(max(compute, comm))


def test_a_rounds_modeled_time_follows_each_replys_path(tmp_path):
    """A round's record models each accepted reply on the path its bytes took: an update that moved ahead
    on the stream with its upload beside the next computation, a node that fell back on Flower's path."""
    import torch

    from parablock_flwr.messages import TrainMetrics
    from parablock_flwr.strategies.reply_checks import Reply
    from parablock_flwr.strategies.round_stats import RoundStats, round_record

    cfg = RunConfig.from_flower({"message-overhead-s": 5.0, "message-throughput-mbs": 60.0, **DIRECT})
    link = core.LinkModel.from_config(cfg)
    step = {"w": torch.zeros(1).expand(GB // 4)}

    def record(**metrics):
        values = TrainMetrics(server_round=2, block=0, partition_id=0, base_version=1, num_examples=8,
                              train_loss=1.5, compute_s=2.0, **metrics)  # fmt: skip
        reply = Reply(node=7, metrics=values, update=None, payload_bytes=GB)
        return round_record(RoundStats(2, nodes=[7], num_replies=1), "w", 0, step, [reply], [8.0], link, True)

    on_stream, ahead = record(), record(direct_update_ahead=1)
    comm, upload = link.comm_seconds(GB, GB), link.ahead_seconds(GB)
    assert on_stream["modeled_round_s"] == pytest.approx(comm)
    assert ahead["modeled_round_s"] == pytest.approx(max(2.0, comm - upload, (2.0 + comm) / 2))
    assert ahead["modeled_round_s"] < comm - 1
    assert ahead["modeled_round_s_sequential"] == on_stream["modeled_round_s_sequential"] == pytest.approx(2.0 + comm)
    fell_back = record(direct_fallbacks=1)
    assert fell_back["comm_s_modeled"] == pytest.approx(replace(link, transport="flower").comm_seconds(GB, GB))
