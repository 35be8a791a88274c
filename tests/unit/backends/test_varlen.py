"""The packed layout: every token once, positions restarting per sample, rows bounded, and the
index map pointing each response token at the column that predicts it."""

import pytest
import torch

from megatron_sdpo.backends.varlen import gather_hidden, pack_varlen
from megatron_sdpo.errors import DataError

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
RESPONSES = [[20, 21], [22, 23, 24, 25], [], [26]]


@pytest.mark.parametrize("row_tokens, multiple", [(0, 1), (6, 1), (6, 4), (3, 1)])
def test_layout_holds_every_sample_once_and_indexes_its_predictions(row_tokens, multiple):
    vb = pack_varlen(PROMPTS, RESPONSES, response_len=4, pad_id=0, row_tokens=row_tokens, multiple=multiple)
    R, W = vb.input_ids.shape
    assert W % multiple == 0 and vb.real_tokens == sum(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True))
    if row_tokens == 0:
        assert R == 1
    longest = max(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True))
    if row_tokens:  # rows hold at most row_tokens tokens, or one sample longer than that
        assert W <= -(-max(row_tokens, longest) // multiple) * multiple
    # cu_seqlens tiles the flattened rows; each segment's positions run 0..len-1.
    cu = vb.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == R * W and vb.cu_seqlens.dtype == torch.int32
    flat_pos, flat_ids = vb.position_ids.reshape(-1), vb.input_ids.reshape(-1)
    segments = []
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        assert flat_pos[a:b].tolist() == list(range(b - a))
        assert (a // W) == ((b - 1) // W)  # no segment crosses a row boundary
        segments.append(flat_ids[a:b].tolist())
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        assert segments.count(p + r) == 1
    # The token after the predicting column is the target; beyond the response, the index stays
    # inside the sample (its last token) and the mask is 0.
    for i, r in enumerate(RESPONSES):
        for j in range(4):
            k = int(vb.hidden_index[i, j])
            if j < len(r):
                assert int(flat_ids[k + 1]) == r[j] and vb.response_mask[i, j] == 1
                assert int(vb.response_ids[i, j]) == r[j]
            else:
                assert vb.response_mask[i, j] == 0
                assert int(flat_ids[k]) == (PROMPTS[i] + r)[-1]


def test_batch_of_one_is_its_own_row():
    vb = pack_varlen([[3, 4]], [[5]], response_len=1, pad_id=0)
    assert vb.input_ids.tolist() == [[3, 4, 5]] and vb.position_ids.tolist() == [[0, 1, 2]]
    assert vb.hidden_index.tolist() == [[1]] and vb.cu_seqlens.tolist() == [0, 3]


def test_gather_hidden_reads_the_indexed_rows():
    h = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    out = gather_hidden(h, torch.tensor([[4, 0], [5, 5]]))
    assert out.tolist() == [[[8.0, 9.0], [0.0, 1.0]], [[10.0, 11.0], [10.0, 11.0]]]


def test_bad_inputs_are_data_errors():
    with pytest.raises(DataError, match="prompt 0 is empty"):
        pack_varlen([[]], [[1]], response_len=1, pad_id=0)
    with pytest.raises(DataError, match="more than"):
        pack_varlen([[1]], [[1, 2]], response_len=1, pad_id=0)
    with pytest.raises(DataError, match="2 prompts but 1"):
        pack_varlen([[1], [2]], [[1]], response_len=1, pad_id=0)
    with pytest.raises(DataError, match="row_tokens"):
        pack_varlen([[1]], [[1]], response_len=1, pad_id=0, row_tokens=-1)


@pytest.mark.parametrize("row_tokens", [0, 7])
def test_shared_prompts_run_once_and_responses_see_only_the_prompt_and_themselves(row_tokens):
    prompts = [[5, 6, 7], [5, 6, 7], [8], [5, 6, 7], [8]]
    responses = [[20, 21], [22], [23, 24, 25], [], [26]]
    vb = pack_varlen(prompts, responses, response_len=3, pad_id=0, row_tokens=row_tokens, share_prompts=True)
    R, W = vb.input_ids.shape
    assert vb.cu_seqlens is None and vb.attention_mask.shape == (R, 1, W, W)
    assert vb.real_tokens == 3 + 1 + sum(map(len, responses))  # each distinct prompt once
    flat_ids, flat_pos = vb.input_ids.reshape(-1).tolist(), vb.position_ids.reshape(-1).tolist()
    allowed = vb.attention_mask[:, 0]

    def seen_by(flat: int) -> list[int]:  # token ids the query at `flat` attends to, in order
        r, c = divmod(flat, W)
        return [flat_ids[r * W + k] for k in range(W) if allowed[r, c, k]]

    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        for j in range(3):
            k = int(vb.hidden_index[i, j])
            if j < len(r):
                # The predicting column sees exactly prompt + response[:j], at positions 0..P+j-1.
                assert seen_by(k) == p + r[:j] and flat_pos[k] == len(p) + j - 1
                assert int(vb.response_ids[i, j]) == r[j] and vb.response_mask[i, j] == 1
            else:
                assert vb.response_mask[i, j] == 0 and seen_by(k) == (p + r)[: len(seen_by(k))]
    # Every query sees itself, so no attention row is empty.
    assert bool(allowed.diagonal(dim1=1, dim2=2).all())


def test_without_repeated_prompts_sharing_changes_nothing_but_the_mask():
    plain = pack_varlen(PROMPTS, RESPONSES, response_len=4, pad_id=0, row_tokens=6)
    shared = pack_varlen(PROMPTS, RESPONSES, response_len=4, pad_id=0, row_tokens=6, share_prompts=True)
    for name in ("input_ids", "position_ids", "hidden_index", "response_ids", "response_mask"):
        assert torch.equal(getattr(plain, name), getattr(shared, name)), name
    assert plain.attention_mask is None and shared.attention_mask is not None
