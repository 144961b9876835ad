"""Bandwidth formulas of the collective helpers, and `lmlab bench comm` end to end in 2 gloo processes."""

import json

import pytest

from lmlab.parallel import COLLECTIVES, algorithm_bandwidth, bus_bandwidth, bus_factor
from lmlab.parallel.comm_bench import format_size, main, parse_size


@pytest.mark.parametrize("op, world_size, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0),
    ("reduce_scatter", 4, 0.75), ("all_gather", 4, 0.75), ("all_gather", 2, 0.5),
    ("broadcast", 2, 1.0), ("broadcast", 8, 1.0),
])
def test_bus_factors(op, world_size, factor):
    assert bus_factor(op, world_size) == pytest.approx(factor)


def test_bandwidths():
    assert algorithm_bandwidth(4_000_000, 0.002) == pytest.approx(2e9)
    # 4 ranks all-reduce 4 MB in 2 ms: 2 GB/s of buffer, each link carries 2 (n-1)/n of it
    assert bus_bandwidth("all_reduce", 4_000_000, 0.002, 4) == pytest.approx(3e9)
    assert bus_bandwidth("broadcast", 4_000_000, 0.002, 4) == pytest.approx(2e9)
    with pytest.raises(ValueError, match="unknown collective 'allreduce'.*all_reduce"):
        bus_factor("allreduce", 2)
    assert set(COLLECTIVES) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}


def test_sizes_parse_and_print():
    assert [parse_size(s) for s in ("4096", "1K", "64k", "16M", "1G", "2KB")] == [4096, 1024, 65536, 2**24, 2**30, 2048]
    assert [format_size(n) for n in (1024, 3 * 2**20, 2**30, 1000)] == ["1K", "3M", "1G", "1000"]


def test_bench_prints_a_row_per_size_and_collective(tmp_path, capsys):
    path = tmp_path / "comm.json"
    assert main(["--world-size", "2", "--sizes", "1K", "64K", "--repeats", "2", "--warmup", "1",
                 "--json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gloo, 2 ranks") and lines[1].split() == ["size", "op", "time_us", "algbw_GB/s",
                                                                        "busbw_GB/s"]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [(size, op) for size in ("1K", "64K") for op in COLLECTIVES]
    record = json.loads(path.read_text())
    assert record["backend"] == "gloo" and record["world_size"] == 2 and len(record["results"]) == 8
    for r in record["results"]:
        assert r["seconds"] > 0 and r["busbw"] == pytest.approx(r["algbw"] * bus_factor(r["op"], 2))


def test_bench_rejects_a_single_rank(capsys):
    with pytest.raises(SystemExit):
        main(["--world-size", "1"])
    assert "--world-size must be >= 2" in capsys.readouterr().err
