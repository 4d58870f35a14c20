"""Bad configuration stops the run early with one line naming the value and what was expected."""

import pytest

from parablock_flwr.config import ConfigError, RunConfig, check_num_clients


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"algorithm": "fedsgd"}, "algorithm='fedsgd': expected one of parablock, fedbcd"),
        ({"schedule": "zigzag"}, "schedule='zigzag': expected one of ascending"),
        ({"precision": "fp8"}, "precision='fp8': expected one of fp32, bf16"),
        ({"local-steps": 0}, "local-steps=0: expected an integer >= 1"),
        ({"server-lr": -1.0}, "server-lr=-1.0: expected a number > 0"),
        ({"num-examples": 10, "heldout-examples": 10}, "num-examples=10: expected more than heldout-examples=10"),
        ({"local-steps": "three"}, "local-steps='three': expected a value of type int"),
        ({"deterministic": 1}, "deterministic=1: expected true or false"),
        (
            {"correction": "none", "verify-invariant": True},
            "verify-invariant=True: expected False with correction='none'",
        ),
        ({"correction": "none", "snapshot-every": 4}, "snapshot-every=4: expected 0 with correction='none'"),
        ({"eval-cpus": "2-x"}, "eval-cpus='2-x': expected CPU ids like 1, 0,2 or 2-7"),
        ({"transport": "tcp"}, "transport='tcp': expected one of flower, direct"),
        ({"transport": "direct"}, "transport-address='': expected host:port"),
        ({"transport": "direct", "transport-address": "server:http"}, "transport-address='server:http': expected"),
        ({"transport": "direct", "transport-address": ":9095"}, "transport-address=':9095': expected host:port"),
        ({"transport": "direct", "transport-address": "s:9095"}, "transport-certfile='': transport='direct' needs"),
        (
            {"transport": "direct", "transport-address": "s:1", "transport-certfile": "a", "transport-keyfile": "b"},
            "transport-ca='': transport='direct' needs",
        ),
        (
            {"transport": "direct", "transport-address": "s:1", "transport-insecure": True, "transport-ca": "ca.crt"},
            "transport-ca='ca.crt' with transport-insecure=true: expected TLS files or insecure, not both",
        ),
        (
            {"transport": "direct", "transport-address": "s:1", "transport-insecure": True, "transport-client-ca": "c"},
            "transport-client-ca='c' with transport-insecure=true: expected TLS files or insecure, not both",
        ),
        (
            {"transport": "direct", "transport-address": "10.0.0.1:9094", "transport-insecure": True},
            "transport-replies-on-stream=true with transport-insecure=true on '10.0.0.1': whoever reads",
        ),
        ({"transport-idle-timeout-s": 0.0}, "transport-idle-timeout-s=0.0: expected a number > 0"),
    ],
)
def test_invalid_values_name_key_value_and_expectation(overrides, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flower(overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_defaults_are_valid_and_ints_become_floats():
    cfg = RunConfig.from_flower({"server-lr": 1, "unrelated-key": "x"})
    assert cfg.server_lr == 1.0 and isinstance(cfg.server_lr, float)
    assert cfg.algorithm == "parablock"


def test_eval_cpus_the_server_lacks_stop_the_run_before_any_work():
    """The syntax is the config's; which CPUs exist only the server knows (its ServerApp checks)."""
    from parablock_flwr.server_apps.app import check_eval_cpus

    check_eval_cpus("0")
    with pytest.raises(ConfigError, match=r"^eval-cpus='0,4096': expected CPUs among 0\.\.\d+$"):
        check_eval_cpus("0,4096")


def test_zero_clients_is_an_error():
    with pytest.raises(ConfigError, match="num-supernodes=0: expected at least 1"):
        check_num_clients(0)


def test_pyproject_defaults_match_the_dataclass():
    """The run-config defaults live in two places (Flower reads pyproject.toml); keep them equal."""
    import tomllib
    from dataclasses import fields
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    flower_defaults = pyproject["tool"]["flwr"]["app"]["config"]
    ours = {f.name.replace("_", "-"): f.default for f in fields(RunConfig)}
    assert set(flower_defaults) == set(ours)
    for key, value in flower_defaults.items():
        assert value == ours[key], key


def test_every_key_is_documented():
    from dataclasses import fields
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    missing = [f.name.replace("_", "-") for f in fields(RunConfig) if f"`{f.name.replace('_', '-')}`" not in doc]
    assert not missing, missing


def test_the_config_imports_no_torch():
    """The run config is read where torch is not needed (a launcher, a report): importing it (and
    the algorithm registry it reads) must not load torch."""
    import subprocess
    import sys

    code = "import sys, parablock_flwr.config; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_one_table_of_transfer_dtypes():
    from parablock_flwr import config, core, records

    assert config.TRANSFER_DTYPES == tuple(core.TRANSFER_DTYPES) == tuple(records.WIRE_DTYPES)
    assert [str(records.WIRE_DTYPES[n]) for n in ("fp32", "bf16", "fp16", "int8")] == [
        "float32",
        "int16",
        "float16",
        "int8",
    ]


def test_a_direct_transport_with_tls_or_explicitly_insecure_is_valid():
    tls = {"transport-certfile": "s.pem", "transport-keyfile": "s.key", "transport-ca": "ca.crt"}
    direct = RunConfig.from_flower({"transport": "direct", "transport-address": "server.example:9095", **tls})
    assert direct.transport_ca == "ca.crt"
    assert RunConfig.from_flower({"transport": "direct", "transport-address": "[::1]:0", "transport-insecure": True})
    assert RunConfig.from_flower({"transport-address": "ignored with flower"}).transport == "flower"
