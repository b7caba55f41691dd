"""The training-curves PNG: every quantity against step and time, written whole."""

from __future__ import annotations

from PIL import Image

from cram.train.curves import write_training_curves


def test_the_curves_are_a_png_with_four_rows_of_two_plots(tmp_path):
    history = [
        {"step": step, "elapsed": 2.0 * step, "loss": 9.0 - step / 10, "lr": 1e-3 * step / 20, "batch_size": 32,
         "tokens_per_second": 1000.0 + step}
        for step in range(1, 21)
    ]
    path = write_training_curves(history, tmp_path / "curves.png")
    assert path == tmp_path / "curves.png"
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (800, 880)
    assert [entry.name for entry in tmp_path.iterdir()] == ["curves.png"]  # no staging file left


def test_nothing_is_written_before_anything_is_logged(tmp_path):
    assert write_training_curves([], tmp_path / "curves.png") is None
    assert not (tmp_path / "curves.png").exists()
