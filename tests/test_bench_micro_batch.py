"""`python -m cram.bench.micro_batch` at a toy shape: every size timed, the table printed."""

from __future__ import annotations

from cram.bench import micro_batch


def test_the_micro_batch_bench_times_every_size_and_prints_its_ratio_to_the_largest(capsys):
    micro_batch.main(["--preset", "tiny", "--sizes", "4", "2", "--rounds", "1", "--vocab", "300"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("tiny, ") and table[1] == "| micro-batch | ms per sequence | speed per sequence vs 4 |"
    rows = [line.split("|")[1:-1] for line in table[3:]]
    assert [int(row[0]) for row in rows] == [2, 4]
    assert all(float(row[1]) > 0 for row in rows) and rows[-1][2].strip() == "1.00x"
