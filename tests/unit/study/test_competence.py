"""The competence probe on a hand-built case: a stub model whose pass rates with and without each
kind of context are known, a verifier that accepts one string, and log-probabilities chosen so
that the teacher's gains are known exactly."""

import math
import random
import re

import pytest

from megatron_sdpo.algorithms.context import ContextTemplates
from megatron_sdpo.rewards.result import RewardResult
from megatron_sdpo.rollout.base import Completion, SamplingConfig
from megatron_sdpo.study.competence import (
    KINDS,
    first_sibling,
    kind_templates,
    probe,
    regime,
    regime_table,
    selection_bias,
)

P_STUDENT, P_SIBLING, P_FEEDBACK = 0.2, 0.9, 0.5
SOLUTION, FEEDBACK = "Here is a correct solution", "Feedback on an earlier attempt"


class CharTokenizer:
    """One id per character; no chat template, so prompts are the raw text."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class StubModel:
    """Answers "step N: \\boxed{X}" ([ans=X] in the prompt) with a probability set by the context in the
    prompt, else "\\boxed{0}"; with `copy`, a prompt quoting a solution gets that solution back."""

    def __init__(self, copy: bool = False):
        self.copy = copy

    def generate(self, prompt_ids, sampling: SamplingConfig):
        rng = random.Random(sampling.seed)
        out = []
        for i, ids in enumerate(prompt_ids):
            text = "".join(chr(t) for t in ids)
            gold = re.search(r"\[ans=(\d+)\]", text).group(1)
            p = P_SIBLING if SOLUTION in text else P_FEEDBACK if FEEDBACK in text else P_STUDENT
            for _ in range(sampling.n):
                # A working line of its own: two correct answers are not copies of each other.
                answer = f"step {rng.randrange(10**9)}: " + (f"\\boxed{{{gold}}}" if rng.random() < p else "\\boxed{0}")
                if self.copy and SOLUTION in text:
                    answer = text.split(":\n", 1)[1].split("\n\n", 1)[0]
                ids_out = [ord(c) for c in answer]
                out.append(Completion(i, ids_out, [-1.0] * len(ids_out), answer, truncated=False))
        return out


def verifier(texts, records):
    return [
        RewardResult(1.0, "") if t.strip().endswith(f"\\boxed{{{r['answer']}}}") else RewardResult(0.0, "Wrong answer.")
        for t, r in zip(texts, records, strict=True)
    ]


def records(n: int):
    return [{"prompt": f"Question {k} [ans={k + 1}]", "answer": str(k + 1)} for k in range(n)]


def run(n_prompts=300, samples=4, **kw):
    return probe(
        StubModel(kw.pop("copy", False)),
        CharTokenizer(),
        records(n_prompts),
        samples=samples,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=8, seed=3),
        templates=ContextTemplates(),
        score=verifier,
        **kw,
    )


def within(value, p, m):
    """|value - p| within 6 standard errors of a mean of m Bernoulli(p) (or of m per-prompt
    means of at least one such draw each): a correct probe misses with probability ~2e-9."""
    return abs(value - p) <= 6 * math.sqrt(p * (1 - p) / m)


def test_pass_rates_and_context_shares_are_the_stub_models():
    out = run()
    n = 4
    assert out["prompts"] == 300 and out["samples_per_prompt"] == n
    assert within(out["student_pass"], P_STUDENT, 300 * n)
    k = out["kinds"]
    assert set(k) == set(KINDS)
    for kind, p in (("sibling", P_SIBLING), ("feedback", P_FEEDBACK), ("both", P_SIBLING)):
        assert within(k[kind]["teacher_pass"], p, k[kind]["prompts"]), kind
        d = k[kind]["difference"]
        assert d["n"] == k[kind]["prompts"] and d["lo"] < d["mean"] < d["hi"]
        assert d["mean"] == pytest.approx(k[kind]["teacher_pass"] - k[kind]["student_pass"])
        assert k[kind]["copies"] == 0
    # A prompt has a sibling context when one of its n samples passes; feedback when one fails;
    # both when it has one of each.
    share = {
        "sibling": 1 - (1 - P_STUDENT) ** n,
        "feedback": 1 - P_STUDENT**n,
        "both": 1 - (1 - P_STUDENT) ** n - P_STUDENT**n,
    }
    for kind, p in share.items():
        assert within(k[kind]["prompt_share"], p, 300), kind
    # The sibling's interval lies above 0 (0.9 against at most ~0.4), feedback's too (0.5 vs 0.2).
    assert k["sibling"]["difference"]["lo"] > 0.3 and k["feedback"]["difference"]["lo"] > 0.1


def test_the_student_comparator_is_an_independent_draw():
    """The bias of the old comparator and its absence in the new one, on rates known exactly. A
    prompt has a sibling context only when one of the student's n samples passed; the pass rate
    of those same samples on the prompts they selected is E[k/n | k >= 1] = p / (1 - (1 - p)^n)
    (0.339 for p = 0.2, n = 4), while the student's true rate on every prompt is p. The probe's
    comparator is a second draw: p on the selected prompts too. For "both" (1 <= k <= n - 1) the
    selecting rate is (p - p^n) / (1 - (1 - p)^n - p^n)."""
    n, p, prompts = 4, P_STUDENT, 1500
    k = run(n_prompts=prompts, samples=n)["kinds"]
    sib, both = k["sibling"], k["both"]
    biased = p / (1 - (1 - p) ** n)
    # Per-prompt rates of n draws: within 6 standard errors of a mean of prompts x n Bernoullis.
    assert within(sib["student_pass"], p, sib["prompts"] * n)
    assert within(sib["student_pass_selecting"], biased, sib["prompts"])
    assert sib["student_pass_selecting"] - sib["student_pass"] > 0.1  # the old bias, +0.139 expected
    assert within(both["student_pass"], p, both["prompts"] * n)
    assert within(both["student_pass_selecting"], (p - p**n) / (1 - (1 - p) ** n - p**n), both["prompts"])
    # The difference is against the independent draw: teacher 0.9 - student 0.2.
    assert within(sib["difference"]["mean"] + p, P_SIBLING, sib["prompts"])


def test_copies_of_the_quoted_sibling_are_counted():
    k = run(n_prompts=60, copy=True)["kinds"]
    assert k["sibling"]["copy_share"] == 1.0 and k["sibling"]["teacher_pass"] == 1.0
    assert k["both"]["copy_share"] == 1.0
    assert k["feedback"]["copies"] == 0


def test_gains_are_those_of_the_log_probabilities():
    """Per token: -1 after a student prompt; after a context -0.5 for an accepted response and -2
    for a rejected one: gains +0.5 and -1.0, gap 1.5 (the feedback kind has rejected samples only)."""

    def logprobs(prompts, responses):
        out = []
        for p, r in zip(prompts, responses, strict=True):
            text, resp = "".join(map(chr, p)), "".join(map(chr, r))
            if SOLUTION in text or FEEDBACK in text:
                gold = re.search(r"ans=(\d+)", text).group(1)
                good = resp.endswith("\\boxed{" + gold + "}")
                out.append([-0.5 if good else -2.0] * len(r))
            else:
                out.append([-1.0] * len(r))
        return out

    k = run(n_prompts=40, logprobs=logprobs)["kinds"]
    assert k["sibling"]["gain_rewarded"] == pytest.approx(0.5)
    assert k["sibling"]["gain_unrewarded"] == pytest.approx(-1.0)
    assert k["sibling"]["gain_gap"] == pytest.approx(1.5)
    assert k["feedback"]["gain_rewarded"] is None and k["feedback"]["gain_gap"] is None
    assert k["feedback"]["gain_unrewarded"] == pytest.approx(-1.0)


def test_the_quoted_sibling_is_the_first_other_accepted_sample():
    assert first_sibling([1, 0, 1, 0, 0, 0], 3, 0.5) == [2, 0, 0, None, None, None]


def test_bad_arguments():
    with pytest.raises(ValueError, match="samples must be >= 2"):
        run(n_prompts=2, samples=1)
    with pytest.raises(ValueError, match="unknown context kind"):
        kind_templates(ContextTemplates(), "hint")


def test_the_probe_command_on_the_tiny_base(tmp_path, capsys):
    import json

    from megatron_sdpo.cli import main

    out = tmp_path / "probe"
    assert (
        main(
            [
                "probe",
                "tiny",
                "--domain",
                "math",
                "--prompts",
                "3",
                "--samples",
                "2",
                "--out",
                str(out),
                "rollout.engine=hf",
                "rollout.max_new_tokens=8",
            ]
        )
        == 0
    )
    data = json.loads((out / "probe.json").read_text())
    assert data["prompts"] == 3 and data["samples_per_prompt"] == 2 and set(data["kinds"]) == set(KINDS)
    assert data["kinds"]["feedback"]["preset_builds"] is False  # the tiny preset gives math no feedback
    assert "| sibling |" in (out / "probe.md").read_text()
    assert main(["probe", "tiny", "--domain", "poetry", "--out", str(out)]) == 2
    assert "unknown domain 'poetry'" in capsys.readouterr().err
    assert main(["probe", "tiny", "--domain", "math", "--samples", "1"]) == 2
    assert main(["probe", "tiny", "--domain", "math", "--split", "dev", "--out", str(out)]) == 2
    assert "unknown split 'dev'" in capsys.readouterr().err


def test_the_probe_table_is_read_from_an_exported_folder(tmp_path):
    """findings.md's probe block: one row per probe in probes.json's order, the stage start /
    end from the probe's name (or its stated checkpoint), its wall time; a folder without probes
    is a one-line error."""
    import json

    from megatron_sdpo.errors import UserError
    from megatron_sdpo.study.competence import probe_table

    out = run(n_prompts=40)
    (tmp_path / "math_before.json").write_text(json.dumps({**out, "domain": "math"}))
    (tmp_path / "math_after.json").write_text(json.dumps({**out, "domain": "math"}))
    (tmp_path / "probes.json").write_text(
        json.dumps({"probes": {"math_before": {"wall_s": 12}, "math_after": {"wall_s": 9}}})
    )
    lines = probe_table(tmp_path)
    assert len(lines) == 4 and lines[0].startswith("| domain | checkpoint | student pass |")
    sib = out["kinds"]["sibling"]
    assert lines[2].startswith(f"| math | stage start | {out['student_pass']:.3f} | {sib['prompts']} (")
    assert lines[2].endswith(" | 12 s |") and lines[3].startswith("| math | stage end |")
    assert f"| {sib['copies']} of {sib['samples']} |" in lines[2]
    # A checkpoint that is not a stage's own start or end says what it is.
    (tmp_path / "tooluse_after_math.json").write_text(json.dumps({**out, "domain": "tooluse"}))
    (tmp_path / "probes.json").write_text(
        json.dumps({"probes": {"tooluse_after_math": {"wall_s": 7, "checkpoint": "after math (tool use's start)"}}})
    )
    assert probe_table(tmp_path)[2].startswith("| tooluse | after math (tool use's start) |")
    (tmp_path / "probes.json").unlink()
    with pytest.raises(UserError, match="not a folder of exported probes"):
        probe_table(tmp_path)


def test_the_regime_rule_reads_the_interval():
    def row(mean, lo, hi, copies=0.1):
        return {"difference": {"mean": mean, "lo": lo, "hi": hi}, "copy_share": copies}

    assert regime(row(0.2, 0.12, 0.28)) == "held"
    assert regime(row(0.2, 0.05, 0.35)) == "undecided"  # the point passes, the interval does not
    assert regime(row(0.05, 0.01, 0.09)) == "not held"
    assert regime(row(0.4, 0.3, 0.5, copies=0.5)) == "not held"  # a teacher that passes by quoting
    assert regime(row(None, None, None)) == "undecided"


def test_the_selection_bias_model_on_known_rates():
    """Without spread over prompts (every prompt's rate p) the beta-binomial's limit is the
    binomial bias p (1 - p)^n / (1 - (1 - p)^n); with prompts' rates drawn from Beta(1, 3) the
    estimate from (mean, share) alone is the bias the simulation measures."""
    p, n = 0.2, 4
    assert selection_bias(p, (1 - (1 - p) ** n) * (1 - 1e-9), n) == pytest.approx(
        p * (1 - p) ** n / (1 - (1 - p) ** n), rel=1e-3
    )
    assert selection_bias(p, 0.1, n) is None and selection_bias(p, 0.95, n) is None  # no beta-binomial has these
    rng = random.Random(0)
    rates = [rng.betavariate(1, 3) for _ in range(200_000)]
    ks = [sum(rng.random() < r for _ in range(n)) for r in rates]
    chosen = [(r, k) for r, k in zip(rates, ks, strict=True) if k > 0]
    measured = sum(k / n for _, k in chosen) / len(chosen) - sum(r for r, _ in chosen) / len(chosen)
    est = selection_bias(sum(k / n for k in ks) / len(ks), len(chosen) / len(ks), n)
    assert est == pytest.approx(measured, abs=0.005)


def test_the_regime_table_judges_only_an_independent_comparator(tmp_path):
    import json

    new = run(n_prompts=200)
    old = json.loads(json.dumps(new))
    for kind in old["kinds"].values():
        kind.pop("student_pass_selecting")  # a probe from before the independent draw
    (tmp_path / "math_before.json").write_text(json.dumps({**new, "domain": "math"}))
    (tmp_path / "math_after.json").write_text(json.dumps({**old, "domain": "math"}))
    (tmp_path / "probes.json").write_text(
        json.dumps({"probes": {"math_before": {"wall_s": 1}, "math_after": {"wall_s": 1}}})
    )
    lines = regime_table(tmp_path)
    sib = new["kinds"]["sibling"]
    assert lines[2].startswith("| math | stage start | independent draw |")
    assert f"| {sib['student_pass_selecting'] - sib['student_pass']:+.3f} (measured) |" in lines[2]
    assert lines[2].endswith("| *held* |")  # the stub's teacher: 0.9 against 0.2, no copies
    assert "| the selecting samples (biased up) |" in lines[3] and "(beta-binomial estimate)" in lines[3]
    assert lines[3].endswith("| not judged: re-run with an independent draw |")
