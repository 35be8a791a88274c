"""wandb from the run monitor: a server out of reach falls back to offline with one warning; a
wandb service that died mid-run ends wandb, not the run."""

import sys
import types

from megatron_sdpo.config import load_config
from megatron_sdpo.outputs.monitor import RunMonitor
from megatron_sdpo.outputs.run_dir import RunDir


class FakeWandb(types.ModuleType):
    def __init__(self, fail_online: bool):
        super().__init__("wandb")
        self.fail_online, self.modes = fail_online, []
        self.Settings = lambda **k: k
        self.teardowns = 0

    def teardown(self, exit_code=None):
        self.teardowns += 1
        raise ConnectionResetError("Connection lost")

    def init(self, *, mode, **kwargs):
        self.modes.append(mode)
        if mode == "online" and self.fail_online:
            raise TimeoutError("Run initialization has timed out after 30.0 sec.\nPlease retry")
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None, mode=mode)


def _monitor(monkeypatch, tmp_path, fail_online, mode="online"):
    fake = FakeWandb(fail_online)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config("tiny", ["logging.wandb=true", f"logging.wandb_mode={mode}"])
    return RunMonitor(RunDir(tmp_path / "run"), cfg, quiet=True), fake


def test_unreachable_server_falls_back_to_offline_with_one_warning(monkeypatch, tmp_path, capsys):
    mon, fake = _monitor(monkeypatch, tmp_path, fail_online=True)
    assert fake.modes == ["online", "offline"] and mon._wandb.mode == "offline"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: wandb could not reach its server (TimeoutError")


def test_reachable_server_and_offline_mode_init_once(monkeypatch, tmp_path, capsys):
    _, fake = _monitor(monkeypatch, tmp_path, fail_online=False)
    assert fake.modes == ["online"]
    _, fake = _monitor(monkeypatch, tmp_path, fail_online=True, mode="offline")
    assert fake.modes == ["offline"] and capsys.readouterr().err == ""


def test_a_dead_wandb_service_ends_wandb_not_the_run(monkeypatch, tmp_path, capsys):
    mon, fake = _monitor(monkeypatch, tmp_path, fail_online=False)
    calls = []

    def log(values):
        calls.append(values)
        raise ConnectionResetError("Connection lost")  # its service process got the job's SIGTERM

    mon._wandb.log = log
    mon.run_dir.root.mkdir(parents=True)
    mon.step({"stage": 0, "step": 1, "reward_mean": 0.5})
    mon.step({"stage": 0, "step": 2, "reward_mean": 0.25})
    mon.close()
    assert len(calls) == 1 and mon._wandb is None and fake.teardowns == 1  # no exit hook left to fail
    assert [r["step"] for r in mon.run_dir.read_metrics()] == [1, 2]
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: wandb stopped")]
    assert len(err) == 1 and "ConnectionResetError: Connection lost" in err[0]
