"""Prompt sets: shipped, .txt and .jsonl files, seeded order, clear errors."""

from __future__ import annotations

import pytest

from digen.errors import DigenError
from digen.prompts import PromptSet


def test_builtin_set_covers_the_categories() -> None:
    ps = PromptSet.builtin()
    assert len(ps) >= 50
    text = " ".join(ps.prompts)
    for word in ("three", "red", "says", "forest"):
        assert word in text


def test_txt_and_jsonl(tmp_path) -> None:
    txt = tmp_path / "p.txt"
    txt.write_text("a cat\n\n  a dog  \n")
    assert PromptSet.load(txt).prompts == ["a cat", "a dog"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a cube", "tag": 1}\n\n{"prompt": "a ball"}\n')
    ps = PromptSet.load(jl)
    assert ps.prompts == ["a cube", "a ball"] and ps.metadata == [{"tag": 1}, {}]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.txt", None, "does not exist"),
        ("empty.txt", "\n  \n", "has no usable prompts"),
        ("bad.jsonl", '\nnot json\n{"prompt": 3}\n', "2 unusable lines; line 2 is not valid"),
        ("nofield.jsonl", '{"text": "x"}\n', 'no string field "prompt"'),
        ("binary.txt", b"a cat\n\x00\x01\x02", "is a binary file"),
        ("latin1.txt", "a caf\u00e9\nun ch\u00e2teau\n".encode("latin-1"), "not UTF-8"),
        ("control.txt", "\x1b[31m\n\x07\n", "2 unusable lines; line 1 holds control"),
    ],
)
def test_bad_files(tmp_path, name, content, message) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(DigenError, match=message) as err:
        PromptSet.load(path)
    assert str(err.value).endswith(".") and "\n" not in str(err.value)


def test_unusable_lines_are_skipped_and_counted(tmp_path) -> None:
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a cube"}\n{"prompt": \n["x"]\n{"prompt": "a ball"}\n')
    ps = PromptSet.load(jl)
    assert ps.prompts == ["a cube", "a ball"] and ps.skipped == 2
    assert "skipped 2 unusable lines (first: line 2 is not valid JSON" in ps.skip_note
    txt = tmp_path / "p.txt"
    txt.write_text("a cat\nbad\x07bell\n\ta dog\n")
    ps = PromptSet.load(txt)
    assert ps.prompts == ["a cat", "a dog"] and ps.skipped == 1
    assert PromptSet.load(tmp_path / "p.txt").skip_note.endswith("line 2 holds control characters)")


def test_order_is_seeded_and_covers_each_epoch() -> None:
    ps = PromptSet([f"p{i}" for i in range(10)])
    a = [ps.indices_for_step(7, s, 5) for s in range(4)]
    assert a == [ps.indices_for_step(7, s, 5) for s in range(4)]
    assert sorted(a[0] + a[1]) == list(range(10))  # epoch 0 is a permutation
    assert sorted(a[2] + a[3]) == list(range(10))
    assert a[:2] != [ps.indices_for_step(8, s, 5) for s in range(2)]  # another seed, another order
