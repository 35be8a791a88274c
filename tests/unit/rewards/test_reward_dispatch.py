import pytest

from megatron_sdpo.interfaces.domains import DOMAINS
from megatron_sdpo.rewards import RewardResult, score, score_batch


def test_unknown_domain_names_known_ones():
    with pytest.raises(ValueError, match="math, science, tooluse, code"):
        score("poetry", "x", {})


def test_result_range_is_checked():
    with pytest.raises(ValueError):
        RewardResult(1.5, "")


def test_score_batch_length_mismatch():
    with pytest.raises(ValueError, match="2 responses but 1 records"):
        score_batch("science", ["a", "b"], [{"answer": "A"}])


def test_score_batch_order_and_values():
    rec = {"answer": "C", "choices": ["1", "2", "3"]}
    out = score_batch("science", ["<answer>C</answer>", "<answer>A</answer>", "nothing"], [rec] * 3)
    assert [r.score for r in out] == [1.0, 0.0, 0.0]


def test_verifier_bug_scores_zero_and_logs(monkeypatch, caplog):
    import megatron_sdpo.rewards.mcq as mcq

    def broken(response):
        raise IndexError("boom")

    monkeypatch.setattr(mcq, "extract_choice", broken)
    result = score("science", "<answer>A</answer>", {"answer": "A"})
    assert result.score == 0.0 and result.details["error"] == "verifier_exception"
    assert "science verifier failed" in caplog.text


@pytest.mark.parametrize("domain", [d for d in DOMAINS if d != "code"])
def test_every_domain_survives_garbage(domain):
    record = {
        "math": {"answer": "1"},
        "science": {"answer": "A", "choices": ["x", "y"]},
        "tooluse": {"answer": [{"Action": "f", "Action_Input": {}}], "tools": [{"name": "f"}]},
    }[domain]
    for garbage in [
        "",
        "\x00" * 1000,
        "}" * 10_000 + "{" * 10_000,
        "\ud800 lone surrogate",
        bytes(range(256)),
        None,
        12345,
    ]:
        result = score(domain, garbage, record)
        assert result.score == 0.0 and isinstance(result.feedback, str) and result.feedback
