import io

from weir.progress import ProgressLines, progress_bar


def test_progress_lines_every_tenth_and_at_the_end(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("weir.progress.time.monotonic", lambda: now[0])
    stream = io.StringIO()
    with ProgressLines(40, "enrich", stream) as bar:
        for n, t in [(0, 0), (0, 0.5), (1, 1), (3, 2), (4, 3), (4, 3.5), (4, 40), (7, 41), (9, 42)]:
            bar.n, now[0] = n, t
            bar.refresh()
    assert stream.getvalue().splitlines() == [
        "enrich: 0/40 jobs (0 %), 0 s",
        "enrich: 4/40 jobs (10 %), 3 s",
        "enrich: 4/40 jobs (10 %), 40 s",   # 30 s without a line
        "enrich: 9/40 jobs (22 %), 42 s",   # 20 % crossed
    ]


def test_progress_bar_is_plain_lines_when_not_a_terminal():
    assert isinstance(progress_bar(10, "enrich", io.StringIO()), ProgressLines)
