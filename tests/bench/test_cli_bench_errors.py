"""Bad input to the ``attnlab bench`` commands (``cli_bench``) is one line and exit status 2,
refused before any work and with nothing written: an output path that a file stands in,
an unknown mechanism or counter, a number out of range, missing task data; and bench lra
does not claim a plot it did not draw."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from attnlab.bench import jat, lra, record, speed, suite
from attnlab.cli import app

runner = CliRunner()
TINY = ["--length", "32", "--steps", "1", "--batch-size", "1", "--eval-size", "2",
        "--repeats", "1"]


def _error_line(res) -> str:
    """The one line of a refused command (exit status 2, no traceback)."""
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (
        res.exit_code, res.output, res.exception)
    return lines[0]


@pytest.fixture
def no_work(monkeypatch):
    """Every bench runner fails the test if it is reached: the command refused too late."""
    def ran(*args, **kwargs):
        raise AssertionError("the bench ran before the bad input was refused")

    for module, name in ((suite, "run_suite"), (speed, "bench_sparse"), (jat, "bench_jat"),
                         (lra, "run_lra"), (record, "record"), (speed, "measure_isolated"),
                         (jat, "_measure_in_subprocess")):
        monkeypatch.setattr(module, name, ran)


# ------------------------------------------------------------- 1. output paths


@pytest.mark.parametrize("argv, option, under", [
    (["bench", "speed", "--mechanisms", "band", "--n", "64", "--out"], "--out", False),
    (["bench", "speed", "--mechanisms", "band", "--n", "64", "--out"], "--out", True),
    (["bench", "lra", "--speed-only", "--mechanisms", "band", *TINY, "--out"], "--out", False),
    (["bench", "lra", "--speed-only", "--mechanisms", "band", *TINY, "--out"], "--out", True),
    (["bench", "record", "--render-only", "--output"], "--output", True),
    (["bench", "sparse", "--ns", "64", "--repeats", "1", "--plot"], "--plot", True),
    (["bench", "jat", "--lengths", "16", "--batch", "1", "--plot"], "--plot", True),
])
def test_an_output_path_a_file_stands_in_is_refused_first(tmp_path, no_work, argv, option,
                                                          under):
    """It was FileExistsError: [Errno 17] (bench jat: after measuring everything)."""
    blocker = tmp_path / "afile"
    blocker.write_text("keep me")
    path = blocker / "sub" / "x.png" if under else blocker
    line = _error_line(runner.invoke(app, [*argv, str(path)]))
    assert f"{option} {path}" in line and f"{blocker} is a file" in line
    assert blocker.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [blocker]


@pytest.mark.parametrize("command", [
    ["bench", "sparse", "--ns", "64", "--repeats", "1"],
    ["bench", "jat", "--lengths", "16", "--batch", "1"],
])
def test_a_plot_path_must_be_a_file_matplotlib_can_write(tmp_path, no_work, command):
    """A folder was "PosixPath('.') has an empty name"; a name without an image suffix
    "Format 'tmp' is not supported", both after the measurements."""
    line = _error_line(runner.invoke(app, [*command, "--plot", str(tmp_path)]))
    assert "a folder is there; give a file name" in line
    for name in ("chart", "chart.xyz"):
        line = _error_line(runner.invoke(app, [*command, "--plot", str(tmp_path / name)]))
        assert f"--plot {tmp_path / name}: give a file name ending in .png" in line
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------- 2. bench sparse specs


@pytest.mark.parametrize("args, says", [
    (["--mechanism", "nosuch"], "error: unknown mechanism 'nosuch'. Known: "),
    (["--window", "-1"], "error: invalid mechanism 'band' config: band window must be >= 0, "
                         "got -1"),
    (["--mechanism", "band(windw=2)"], "unknown parameter 'windw'"),
])
def test_bench_sparse_refuses_a_bad_mechanism_as_bench_speed_does(monkeypatch, args, says):
    """It was a RegistryError traceback (--window -1: a chained pair, from the child)."""
    monkeypatch.setattr(speed, "measure_isolated", lambda **kw: pytest.fail("measured"))
    line = _error_line(runner.invoke(app, ["bench", "sparse", "--ns", "64", *args]))
    assert line.startswith(says) or says in line


@pytest.mark.parametrize("args, says", [
    (["--dtype", "float16"], "error: --dtype float16: use float32 or bfloat16"),
    (["--threads", "-1"], "error: --threads -1: give 1 or more"),
])
def test_bench_sparse_checks_dtype_and_threads_first(no_work, args, says):
    assert _error_line(runner.invoke(app, ["bench", "sparse", "--ns", "64", *args])) == says


@pytest.mark.parametrize("args, says", [
    (["--fit-from", "-5"], "error: --fit-from -5: give 1 or more"),
    (["--dense-max-n", "0"], "error: --dense-max-n 0: give 1 or more"),
    (["--repeats", "0"], "error: --repeats 0: give 1 or more"),
])
def test_bench_speed_refuses_numbers_out_of_range_first(tmp_path, no_work, args, says):
    out = tmp_path / "speed"
    res = runner.invoke(app, ["bench", "speed", "--mechanisms", "band", "--n", "64",
                              "--out", str(out), *args])
    assert _error_line(res) == says
    assert not out.exists()


# ------------------------------------------------------------- 3. bench jat --counter


@pytest.mark.parametrize("counter", ["nosuch", "naive"])
def test_bench_jat_counter_names_the_choices_help_offers(no_work, counter):
    """It was two tracebacks ending in "jat.adjacency must be one of [...'naive']"."""
    line = _error_line(runner.invoke(app, ["bench", "jat", "--lengths", "16", "--batch", "1",
                                           "--counter", counter]))
    assert line == f"error: --counter {counter}: use auto, pairs, enumerate, compare or direct"
    help_text = runner.invoke(app, ["bench", "jat", "--help"]).output
    assert "auto, pairs, enumerate, compare or direct" in " ".join(
        help_text.replace("│", " ").split())


def test_run_bench_jat_refuses_an_unknown_counter_before_measuring(monkeypatch):
    monkeypatch.setattr(jat, "_measure_in_subprocess", lambda **kw: pytest.fail("measured"))
    with pytest.raises(ValueError, match="unknown counter 'nosuch'; use auto, pairs"):
        jat.bench_jat((16,), batch=1, counter="nosuch")


# ------------------------------------------------------------- 4. bench lra numbers, plot


@pytest.mark.parametrize("args, says", [
    (["--lr", "-1"], "error: --lr -1: give a learning rate above 0, e.g. --lr 1e-3"),
    (["--lr", "0"], "error: --lr 0: give a learning rate above 0"),
    (["--lr", "nan"], "error: --lr nan: give a learning rate above 0"),
    (["--threads", "0"], "error: --threads 0: give 1 or more"),
    (["--seeds", "0"], "error: --seeds 0: give 1 or more"),
    (["--eval-size", "0"], "error: --eval-size 0: give 1 or more"),
    (["--length", "8"], "error: --length 8 is too short; give 16 or more"),
])
def test_bench_lra_refuses_numbers_out_of_range_first(tmp_path, monkeypatch, args, says):
    """--lr -1 ran every cell into "Invalid learning rate", exited 0 and claimed lra.png."""
    monkeypatch.setattr(lra, "resolve_mechanisms", lambda *a, **k: pytest.fail("ran"))
    out = tmp_path / "out"
    res = runner.invoke(app, ["bench", "lra", "--mechanisms", "softmax", *TINY, *args,
                              "--out", str(out)])
    assert _error_line(res).startswith(says)
    assert not out.exists()


def test_the_settings_check_lr_and_threads():
    for bad in (0.0, -1e-3, math.inf, math.nan):
        with pytest.raises(ValueError, match="--lr"):
            lra.LraSettings(lr=bad).check()
    with pytest.raises(ValueError, match="--threads 0: give 1 or more"):
        lra.LraSettings(threads=0).check()


def test_bench_lra_claims_no_plot_it_did_not_draw(tmp_path, monkeypatch):
    """Every cell failed: lra.json and lra.md say so, and no lra.png (not even an earlier
    run's) is left or announced."""
    real = lra.run_lra

    def failing_cells(*args, **kwargs):
        def measure(spec, length, batch_size, **kw):
            raise RuntimeError("benchmark subprocess failed:\nRuntimeError: no luck")
        return real(*args, **{**kwargs, "measure": measure})

    def train_fails(*args, **kwargs):
        raise RuntimeError("Invalid learning rate")

    monkeypatch.setattr(lra, "run_lra", failing_cells)
    monkeypatch.setattr(lra, "train_and_evaluate", train_fails)
    out = tmp_path / "out"
    out.mkdir()
    (out / "lra.png").write_bytes(b"an earlier run's plot")
    res = runner.invoke(app, ["bench", "lra", "--mechanisms", "softmax", "--task", "recall",
                              *TINY, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "lra.md").is_file() and (out / "lra.json").is_file()
    assert not (out / "lra.png").exists()
    said = " ".join(res.output.split())
    assert f"{out}/lra.png" not in said and "no lra.png" in said


# ------------------------------------------------------------- 5. bench lra missing data


def test_missing_text_data_is_refused_before_measuring_or_writing(tmp_path):
    measured: list[str] = []

    def measure(spec, length, batch_size, **kw):
        measured.append(spec)
        return {"step_ms": 1.0, "steps_per_s": 1.0, "peak_mem_mb": 1.0, "kernels": []}

    out, missing = tmp_path / "out", tmp_path / "nonexistent"
    settings = lra.LraSettings(length=32, steps=1, batch_size=1, eval_size=2,
                               data_dir=str(missing))
    with pytest.raises(FileNotFoundError, match="SST-2"):
        lra.run_lra(out, ["softmax"], ["recall", "text"], [0], settings, progress=False,
                    measure=measure)
    assert measured == [] and not out.exists()
    line = _error_line(runner.invoke(app, [
        "bench", "lra", "--mechanisms", "softmax", "--task", "text", "--data-dir",
        str(missing), *TINY, "--out", str(out)]))
    assert "SST-2" in line and str(missing) in line
    assert not out.exists()
