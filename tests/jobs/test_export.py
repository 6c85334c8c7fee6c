"""Results as files: the CSV's fixed columns, JSON Lines, and an output that appears only whole."""

import io

import pytest

from weir.cli import build_parser
from weir.jobs import export


def rows():
    yield {"job_id": "j1", "custom_id": "a", "kind": "classify", "status": "succeeded", "attempts": 1,
           "label": "Tea", "label_probs": {"Tea": 0.75, "Soap": 0.25}, "parsed": None, "metadata": {},
           "completions": [{"text": "never in the CSV"}]}
    raise RuntimeError("the database went away")


def test_csv_has_the_documented_columns_and_json_cells():
    out = io.StringIO(newline="")
    with pytest.raises(RuntimeError):
        export.write_csv(rows(), out)
    header, first = out.getvalue().split("\r\n")[:2]
    assert header.split(",") == list(export.CSV_COLUMNS)
    assert first == 'j1,a,classify,succeeded,1,,,Tea,"{""Tea"":0.75,""Soap"":0.25}",,,,,,{}'


def test_jsonl_writes_every_key():
    out = io.StringIO()
    assert export.write_jsonl([{"a": "é", "b": [1, None]}, {}], out) == 2
    assert out.getvalue() == '{"a": "é", "b": [1, null]}\n{}\n'


def test_an_interrupted_output_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with export.atomic_output(str(path)) as out:
            export.write_csv(rows(), out)
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]
    assert path.read_text() == "old"
    with export.atomic_output(str(path)) as out:
        out.write("new")
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]
    assert path.read_text() == "new"


def test_without_overwrite_an_existing_file_is_refused_and_kept(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text("old")
    with pytest.raises(FileExistsError) as refused:
        with export.atomic_output(str(path), overwrite=False):
            pytest.fail("entered")
    assert refused.value.filename == str(path)
    late = tmp_path / "late.csv"
    with pytest.raises(FileExistsError):
        with export.atomic_output(str(late), overwrite=False) as out:
            out.write("new")
            late.write_text("appeared meanwhile")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.csv", "results.csv"]
    assert (path.read_text(), late.read_text()) == ("old", "appeared meanwhile")


def test_a_folder_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(IsADirectoryError):
        with export.atomic_output(str(tmp_path)):
            pass
    assert list(tmp_path.iterdir()) == []


def test_the_command_offers_every_writer():
    args = build_parser().parse_args(["results", "b", "--format", "csv"])
    assert args.format == "csv"
    choices = next(a for a in build_parser()._subparsers._group_actions[0].choices["results"]._actions
                   if a.dest == "format").choices
    assert sorted(choices) == sorted(export.WRITERS)
