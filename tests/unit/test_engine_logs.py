"""Engine logs (vLLM, transformers, megatron, Python warnings) go to <run>/logs/engine.log unless verbose.

Each case runs in a fresh interpreter: logging configuration is process-global, and vLLM
configures its logger when it is first imported.
"""

import subprocess
import sys

import pytest


def _python(code: str, env_extra: dict | None = None, **kw) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, **kw)


ROUTE_AND_LOG = """
import logging, sys, warnings
from megatron_sdpo.engine_logs import route_engine_logs
log_file = route_engine_logs(sys.argv[1] if len(sys.argv) > 1 else {run!r}, verbose={verbose})
print("log_file", log_file)
logging.getLogger("transformers.modeling_utils").warning("transformers-line")
logging.getLogger("megatron.core.utils").info("megatron-line")
warnings.warn("a-library-warning")
logging.getLogger("megatron_sdpo.mine").warning("own-line")
"""


def test_library_lines_go_to_the_run_log_not_the_terminal(tmp_path):
    proc = _python(ROUTE_AND_LOG.format(run=str(tmp_path / "run"), verbose=False))
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "run" / "logs" / "engine.log").read_text()
    for line in ("transformers-line", "megatron-line", "a-library-warning"):
        assert line in log and line not in proc.stdout + proc.stderr
    assert "own-line" in proc.stderr and "own-line" not in log  # the project's own loggers are untouched


def test_verbose_leaves_the_terminal_as_it_was(tmp_path):
    proc = _python(ROUTE_AND_LOG.format(run=str(tmp_path / "run"), verbose=True))
    assert proc.returncode == 0, proc.stderr
    assert "log_file None" in proc.stdout and not (tmp_path / "run").exists()
    assert "transformers-line" in proc.stderr and "a-library-warning" in proc.stderr


@pytest.mark.vllm
def test_vllm_reads_the_routing_when_imported_afterwards(tmp_path):
    code = (
        "from megatron_sdpo.engine_logs import route_engine_logs\n"
        f"route_engine_logs({str(tmp_path / 'run')!r})\n"
        "from vllm.logger import init_logger\n"
        "init_logger('vllm.some.module').warning('vllm-line')\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vllm-line" in (tmp_path / "run" / "logs" / "engine.log").read_text()
    assert "vllm-line" not in proc.stdout + proc.stderr


def test_a_user_vllm_logging_config_wins(tmp_path):
    user = tmp_path / "mine.json"
    code = (
        "import os\nfrom megatron_sdpo.engine_logs import route_engine_logs\n"
        f"route_engine_logs({str(tmp_path / 'run')!r})\n"
        "print(os.environ['VLLM_LOGGING_CONFIG_PATH'])\n"
    )
    proc = _python(code, {"VLLM_LOGGING_CONFIG_PATH": str(user)})
    assert proc.stdout.strip() == str(user)
    proc = _python(code)
    assert proc.stdout.strip() == str(tmp_path / "run" / "logs" / "vllm_logging.json")


def test_per_refit_lines_are_kept_once(tmp_path):
    """A refit in several buckets repeats vLLM's reload lines per bucket: engine.log keeps the
    first of each (numbers aside); other loggers' repeats stay."""
    code = """
import logging
from megatron_sdpo.engine_logs import route_engine_logs
route_engine_logs({run!r})
for step in range(3):
    for bucket in range(4):
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        layerwise.warning("RotaryEmbedding: Failed to load weights")
        inplace = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
        inplace.info(f"Reloading and processing weights took {{0.1 * bucket:.2f}} seconds")
    logging.getLogger("vllm.v1.core.block_pool").info("Successfully reset prefix cache")
    logging.getLogger("vllm.v1.engine").info("other-line")
""".format(run=str(tmp_path / "run"))
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "run" / "logs" / "engine.log").read_text()
    assert log.count("Failed to load weights") == 1 and log.count("Reloading and processing weights took") == 1
    assert log.count("reset prefix cache") == 1 and log.count("other-line") == 3
