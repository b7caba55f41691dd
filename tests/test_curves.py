"""The training-curves PNG: every quantity against step and time, written whole; after a checkpoint, redrawn only
minutes after the last drawing."""

from __future__ import annotations

from PIL import Image

from cram.train.curves import CheckpointCurves, write_training_curves


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


def test_after_a_checkpoint_the_curves_are_redrawn_only_once_the_interval_has_passed(tmp_path):
    history = [{"step": 1, "elapsed": 1.0, "loss": 9.0, "lr": 1e-4, "batch_size": 32, "tokens_per_second": 1000.0}]
    now = [100.0]
    curves = CheckpointCurves(tmp_path / "curves.png", every_seconds=300.0, clock=lambda: now[0])
    now[0] = 399.0  # a checkpoint 299 s into the run: not yet
    assert curves.after_checkpoint(history) is None and not (tmp_path / "curves.png").exists()
    now[0] = 400.0
    assert curves.after_checkpoint(history) == tmp_path / "curves.png"
    drawn = (tmp_path / "curves.png").stat().st_mtime_ns
    history.append({**history[0], "step": 2, "elapsed": 2.0, "loss": 8.0})
    now[0] = 699.0  # counted from the last drawing, not from the start
    assert curves.after_checkpoint(history) is None and (tmp_path / "curves.png").stat().st_mtime_ns == drawn
    now[0] = 700.0
    assert curves.after_checkpoint(history) == tmp_path / "curves.png"
