"""``benchmarks.byte_legs`` at its smallest size, as CI runs it: every leg of both sides is measured, beside
the TLS socket, and printed in the table."""

import pytest

from benchmarks import byte_legs

WRITES = (byte_legs.RESIDUAL_WRITE, byte_legs.RESIDUAL_WRITE_BEFORE)  # each in wall and CPU seconds
NODE_LEGS = {"round with feedback", "pack", "SHA-256 of the wire bytes", "invariant digest, cached",
             "invariant digest, whole model", "apply g to its replica", "apply g to its replica, decoded whole",
             *WRITES, *(leg + byte_legs.CPU for leg in WRITES)}  # fmt: skip
APART = byte_legs.APART  # the server's steps apart, beside its one pass
SERVER_LEGS = {"check 2 replies (norm, finite)", "mean, g rounded and packed, x + g: one pass, 2 replies",
               f"aggregate 2{APART}", "DP: clip scales of 2 replies (their norms, as each is checked)",
               f"DP: {byte_legs.NOISE_DRAW}", "DP: mean, clip, noise, g rounded and packed, x + g: one pass, 2 replies",
               f"round and pack g{APART}", f"apply g to x{APART}", "2 invariant digests, cached"}  # fmt: skip


@pytest.mark.slow
def test_the_byte_legs_benchmark_measures_every_leg_beside_the_tls_socket(capsys):
    results = byte_legs.main(["--params-m", "0.5", "--dtypes", "int8", "bf16", "--repeats", "1", "--blocks", "3"])
    out = capsys.readouterr().out
    assert [r["dtype"] for r in results] == ["int8", "bf16"]
    for r in results:
        assert set(r["node"]) == NODE_LEGS and set(r["server"]) == SERVER_LEGS, r
        assert r["socket_s"] > 0 and all(s > 0 for s in [*r["node"].values(), *r["server"].values()]), r
        # int8 travels a quarter of fp32's bytes (and its scales), bf16 a half
        assert r["wire_mb"] == pytest.approx(0.5 * {"int8": 1 + 4 / 256, "bf16": 2}[r["dtype"]], rel=0.01)
        for leg in ("TLS socket + SHA-256 at the receiver", *NODE_LEGS, *SERVER_LEGS):
            assert f"| {r['dtype']} |" in out and f"| {leg} |" in out, leg
