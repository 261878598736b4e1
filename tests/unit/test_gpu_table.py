"""The README's GPU table is the one `bench.gpu_table` generates from the result files."""

from __future__ import annotations

from bench import gpu_table


def test_the_readmes_gpu_table_is_generated_from_the_result_files():
    readme = gpu_table.README.read_text()
    assert gpu_table.with_table(readme, gpu_table.table()) == readme, "run: python -m bench.gpu_table --write"


def test_every_result_file_has_a_row_for_each_of_its_measures():
    rows = gpu_table.table().splitlines()[2:]
    files = gpu_table.newest()
    assert files, "bench/results/gpu holds result files"
    for (_card, _gpus, bench), (_date, path) in files.items():
        measures = [m for m in gpu_table.MEASURES if m.bench == bench]
        assert sum(path.name in row for row in rows) == len(measures), path.name
