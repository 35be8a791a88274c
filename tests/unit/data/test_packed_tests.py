"""base64(zlib(pickle)) test cases: plain data comes out; globals, bombs and junk are refused."""

import base64
import json
import os
import pickle
import zlib

import pytest

from megatron_sdpo.data.packed_tests import PackedError, json_text, load_plain, unpack


def _pack(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data)).decode()


def test_plain_data_and_json_come_out():
    cases = [{"input": [1, 2.5, True, None], "output": ("x", "ü")}]
    assert json.loads(json_text(_pack(pickle.dumps(cases)))) == [{"input": [1, 2.5, True, None], "output": ["x", "ü"]}]
    text = json.dumps([{"input": "1\n", "output": "2\n"}])
    assert json_text(_pack(pickle.dumps(text))) == text  # LiveCodeBench pickles the JSON string itself
    assert json_text(_pack(text.encode())) == text
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # no protocol needs a global for plain data
        assert load_plain(pickle.dumps(cases, protocol=protocol)) in (cases, [{**cases[0], "output": ["x", "ü"]}])


@pytest.mark.parametrize(
    "value,reason",
    [
        ([os.system], "refused global posix.system"),
        ([{1, 2}], "holds a set"),
        ({1: "a"}, "dict key of type int"),
        ([b"raw"], "holds a bytes"),
    ],
)
def test_what_is_not_plain_data_is_refused(value, reason):
    with pytest.raises(PackedError, match=reason):
        load_plain(pickle.dumps(value))


def test_a_small_pickle_of_a_huge_tree_is_refused():
    tree: list = []
    for _ in range(60):  # 2**60 leaves as JSON, about 300 bytes as a pickle (memo references)
        tree = [tree, tree]
    raw = pickle.dumps(tree)
    assert len(raw) < 1000
    with pytest.raises(PackedError, match="expands far beyond its own size"):
        load_plain(raw)


def test_junk_and_inflation_are_refused():
    with pytest.raises(PackedError, match="not base64"):
        unpack("definitely not base64 !!")
    with pytest.raises(PackedError, match="not zlib data"):
        unpack(base64.b64encode(b"plain bytes").decode())
    with pytest.raises(PackedError, match="more than 1000 bytes"):
        unpack(_pack(b"0" * 5000), limit=1000)
    with pytest.raises(PackedError, match="truncated"):
        unpack(base64.b64encode(zlib.compress(b"0" * 5000)[:-4]).decode())
    with pytest.raises(PackedError, match="not a plain-data pickle"):
        load_plain(pickle.dumps([1, 2, 3])[:-3])
    with pytest.raises(PackedError, match="neither a pickle nor JSON"):
        json_text(_pack(b"\x00\x01 not json"))
