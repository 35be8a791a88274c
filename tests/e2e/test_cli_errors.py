"""User mistakes at the command line: one `error:` line, exit status 2, no traceback."""

import subprocess
import sys

import pytest


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "megatron_sdpo", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def assert_one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), proc.stderr
    assert needle in err[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (("run", "no_such_preset"), "unknown preset 'no_such_preset'"),
        (("run", "tiny", "algorithm.sdpo.alpah=0.3"), "algorithm.sdpo.alpah"),
        (("run", "tiny", "backend.lr=fast"), "backend.lr"),
        (("run", "tiny", "domains.math.train.source=missing.jsonl"), "missing.jsonl"),
        (("compare", "tiny", "--algorithms", "grpo,ppo"), "unknown algorithm 'ppo'"),
        (("run", "tiny", "--resume"), "--resume needs --out"),
        (("report", "not_a_run_dir"), "not a run directory"),
    ],
)
def test_bad_input_gives_one_line_error(tmp_path, args, needle):
    assert_one_line_error(run_cli(*args, cwd=tmp_path), needle)


def test_non_writable_output_directory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_cli("run", "tiny", "--out", str(blocker / "run"), cwd=tmp_path)
    assert_one_line_error(proc, "not writable")


def test_missing_data_file_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("run", "tiny", "domains.code.eval.id.source=nope.parquet", "--out", str(out), cwd=tmp_path)
    assert_one_line_error(proc, "nope.parquet")
    assert not out.exists()


def test_resume_of_an_empty_directory(tmp_path):
    proc = run_cli("run", "tiny", "--out", str(tmp_path), "--resume", cwd=tmp_path)
    assert_one_line_error(proc, "holds no run to resume")


@pytest.fixture
def truncated_model(tmp_path):
    """A copy of the shipped tiny base whose model.safetensors lost its last KB."""
    import shutil

    from megatron_sdpo.models.tiny import SHIPPED_DIR

    d = tmp_path / "broken_policy"
    shutil.copytree(SHIPPED_DIR, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1024])
    return d


@pytest.mark.parametrize(
    "command",
    [
        lambda m, out: ("eval", str(m), "tiny", "--out", str(out)),
        lambda m, out: ("run", "tiny", f"model.path={m}", "--out", str(out)),
        lambda m, out: ("drift", str(m), str(m), "--out", str(out)),
        lambda m, out: ("drift", "--out", str(out), str(m), str(m), "--responses"),
    ],
    ids=["eval", "run", "drift", "drift-responses"],
)
def test_corrupt_model_directory(tmp_path, truncated_model, command):
    proc = run_cli(*command(truncated_model, tmp_path / "out"), cwd=tmp_path)
    assert_one_line_error(proc, "model.safetensors")
    assert "truncated" in proc.stderr or "corrupt" in proc.stderr
    assert not (tmp_path / "out").exists()
