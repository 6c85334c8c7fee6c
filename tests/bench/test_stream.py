"""bench.stream's verdict on the tiny model: requests arriving one by one into a running engine
give the texts the same requests give all at once (greedy), and the benchmark says so."""

from bench import stream


def test_the_stream_and_all_at_once_give_the_same_texts(capsys):
    assert stream.main(["--tiny", "--prompts", "6", "--max-tokens", "4", "--repeat", "1",
                        "--max-num-seqs", "2,4", "--arrive-every-ms", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "texts equal" in line]
    assert [line.split(":")[0] for line in lines] == ["max_num_seqs 2", "max_num_seqs 4"]
    assert all(line.endswith("texts equal: True") for line in lines)
