"""``make soak`` in a few seconds: it runs, samples and judges; the ten
minute run is the real one (docs/howto/evaluate.rst, "Measure zc-lb
itself")."""

from benchmarks import soak


def test_a_short_soak_samples_and_says_flat(capsys):
    assert soak.main(["--duration", "4", "--every", "2", "--connections", "8"]) == 0
    out = capsys.readouterr().out
    assert "capacity" in out and "verdict: flat; 0 answers not 2xx" in out
    assert out.count("/") >= 6  # RSS/fds samples for three processes, twice


def test_verdict():
    assert soak.verdict([(100, 5), (100, 5), (104, 6)], 1).startswith("flat")
    assert soak.verdict([(100, 5), (100, 5), (106, 5)], 1).startswith("GROWING")
    assert soak.verdict([(100, 5), (100, 5), (100, 20)], 1).startswith("GROWING")
    assert soak.verdict([(100, 5)], 1) == "too short to tell"
