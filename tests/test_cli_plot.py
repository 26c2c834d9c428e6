"""``yafsdp plot``: the format follows --output's extension; the unigram baseline is drawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_yafsdp.cli.main import main

ROWS = "step,train_loss,val_loss,lr\n0,5.5,,0.001\n1,4.8,,0.001\n2,4.1,4.3,0.0009\n"


@pytest.fixture
def run(tmp_path) -> Path:
    """A finished run folder: metrics and the summary ``yafsdp train`` writes."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.csv").write_text(ROWS)
    (tmp_path / "summary.json").write_text(json.dumps({"unigram_entropy": 3.1134}))
    return tmp_path


@pytest.mark.parametrize(
    ("name", "magic"), [("x.svg", b"<?xml"), ("x.pdf", b"%PDF"), ("x.png", b"\x89PNG")]
)
def test_the_output_is_written_in_the_format_its_extension_names(run, name, magic) -> None:
    assert main(["plot", str(run), "--output", str(run / name)]) == 0
    assert (run / name).read_bytes().startswith(magic)


def test_the_unigram_baseline_of_the_summary_is_drawn_and_labelled(run) -> None:
    assert main(["plot", str(run), "--output", str(run / "x.svg")]) == 0
    # matplotlib's SVG keeps each text as a comment beside its glyph paths.
    assert "unigram baseline (3.11)" in (run / "x.svg").read_text()
    (run / "summary.json").unlink()  # a run still training: no baseline yet, no error
    assert main(["plot", str(run), "--output", str(run / "y.svg")]) == 0
    assert "unigram baseline" not in (run / "y.svg").read_text()


def test_an_extension_that_is_no_image_format_is_refused_in_one_line(run, capsys) -> None:
    assert main(["plot", str(run), "--output", str(run / "x.txt")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and ".txt is not an image format" in err and ".svg" in err
    assert not (run / "x.txt").exists()
