"""dist_checkpointing save/resume of the megatron backend: TP=2 -> TP=2 and -> DP=2."""

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]


def _run(be, b, steps):
    from test_megatron_backend import _grpo

    out = []
    for _ in range(steps):
        m = be.train_step(b, _grpo())
        out += [m["loss"], m["lr"]]
    return out


def _ckpt_worker(model_dir: str, ckpt: str) -> dict:
    from megatron_sdpo.backends.megatron.backend import MegatronBackend
    from megatron_sdpo.backends.megatron.parallel import ParallelConfig, destroy
    from megatron_sdpo.interfaces.schedule import LRSchedule

    from test_megatron_backend import make_batch

    def backend(tp):
        # A decaying LR: a resume that restarted the schedule would take a different step.
        be = MegatronBackend(
            model_dir,
            lr=1e-4,
            micro_batch_size=2,
            parallel=ParallelConfig(tp=tp),
            lr_schedule=LRSchedule("cosine", warmup_steps=0, min_lr_ratio=0.1),
        )
        be.set_lr_schedule(3)
        return be

    out = {}
    be = backend(2)
    b = make_batch()
    b.tensors["old_logprobs"] = (be.logprobs(b) + b.tensors["noise"]) * b.tensors["loss_mask"]
    _run(be, b, 1)
    be.save(ckpt, extra={"stage": 1, "data_position": 12})
    out["saved_weights"] = {k: v.clone() for k, v in be.export_weights()}
    out["uninterrupted"] = _run(be, b, 2)
    del be
    destroy()
    for name, tp, weights_only in (("tp2", 2, False), ("dp2", 1, False), ("weights_only", 2, True)):
        be = backend(tp)
        out[name + "_extra"] = be.load(ckpt, weights_only=weights_only)
        out[name + "_step"] = be.step
        out[name] = _run(be, b, 2)
        del be
        destroy()
    return out


@pytest.mark.slow
def test_resume_at_tp2_and_dp2_continues_the_uninterrupted_run(tmp_path):
    from test_megatron_convert import tiny_hf

    from megatron_sdpo.backends.megatron.launch import spawn

    d = tmp_path / "model"
    tiny_hf("qwen3", False).save_pretrained(str(d))
    ckpt = tmp_path / "ckpt"
    ranks = spawn(_ckpt_worker, 2, str(d), str(ckpt), timeout_s=500)
    assert (ckpt / "COMPLETE").is_file() and not (tmp_path / "ckpt.partial").exists()
    for r in ranks:
        want = r["uninterrupted"]
        for name in ("tp2", "dp2"):
            assert r[name + "_extra"] == {"stage": 1, "data_position": 12}
            assert r[name + "_step"] == 1
            assert r[name] == pytest.approx(want, rel=1e-5, abs=1e-9), (name, r[name], want)
        # cosine over 3 steps from 1e-4 to 1e-5: steps 2 and 3 run at 7.75e-5 and 3.25e-5.
        assert want[1::2] == pytest.approx([7.75e-5, 3.25e-5], rel=1e-9)
        # Weights-only: same weights (same next loss), fresh Adam moments (different update).
        assert r["weights_only"][0] == pytest.approx(want[0], rel=1e-5, abs=1e-6)
        assert abs(r["weights_only"][2] - want[2]) > 1e-4

    # The checkpoint converts to an HF directory holding exactly the saved policy.
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[2]
    hf_out = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "tools" / "convert_to_hf.py"),
            str(ckpt),
            "--hf-model",
            str(d),
            "--out",
            str(hf_out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    converted = load_file(str(hf_out / "model.safetensors"))
    saved = ranks[0]["saved_weights"]
    assert sorted(converted) == sorted(saved)
    in_ckpt = load_file(str(ckpt / "policy" / "model.safetensors"))  # written by save() itself
    for k, v in saved.items():
        assert torch.equal(converted[k], v), k
        assert torch.equal(in_ckpt[k], v), k


def test_partial_checkpoint_is_refused(tmp_path):
    from megatron_sdpo.backends.megatron.checkpoint import load
    from megatron_sdpo.errors import CheckpointError

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "common.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="COMPLETE"):
        load(None, str(tmp_path / "ck"))
