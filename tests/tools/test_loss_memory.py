"""tools/loss_memory.py: the vocabulary-wide tensors of a megatron train step at their peak,
split into the part over every row token and the part over the response tokens."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.megatron
@pytest.mark.distributed
def test_the_peak_splits_into_whole_counts_of_tensors(tmp_path):
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, str(TOOLS / "loss_memory.py"), "--losses", "sdpo_topk_clip,grpo_kl",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["loss"]: r for r in json.loads(out.read_text())["losses"]}
    # The model's 16-bit logits over whole rows (policy, rider, their gradients) and the fp32
    # response shards: the policy's path 4, the teacher 1, the top-k normalizers 2, the IS weight 1.
    assert (rows["sdpo_topk_clip"]["full_row_16bit"], rows["sdpo_topk_clip"]["response_fp32"]) == (6.0, 8.0)
    assert (rows["grpo_kl"]["full_row_16bit"], rows["grpo_kl"]["response_fp32"]) == (6.0, 5.0)
    assert all(r["ledger_logits"] > 0 and r["ledger_over_peak"] > 0 for r in rows.values())


def test_an_unknown_loss_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOLS / "loss_memory.py"), "--losses", "dpo"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown loss 'dpo'") and proc.stderr.count("\n") == 1
