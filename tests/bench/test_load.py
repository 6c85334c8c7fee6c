"""bench.load on a tiny Llama: every system loads the same model, and the benchmark prints its
figures and ratios."""

from bench import load


def test_every_system_loads_the_small_checkpoint(capsys):
    assert load.main(["--small", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    runs = [line.split(":")[0].removeprefix("  run 1").strip() for line in out.splitlines() if line.startswith("  run 1")]
    assert runs == ["weir", "from_pretrained", "old weir"]
    assert "parameters per model: [90432]\n" in out  # one count: all three loaded the same shapes
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("weir / ")] == [
        "weir / from_pretrained", "weir / old weir"]
