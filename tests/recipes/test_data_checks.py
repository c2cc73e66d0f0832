"""Bad chat data is named (file, line or index, rule) before anything trains."""

from __future__ import annotations

import json

import pytest

from nemo_automodel_ext.recipes.data_checks import check_chat_data
from nemo_automodel_ext.recipes.tiny_tasks import build_tokenizer

GOOD = {"messages": [{"role": "user", "content": "please copy alpha"}, {"role": "assistant", "content": "alpha"}]}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "bad,fragment",
    [
        ('{"messages": [', ":3: malformed JSON"),
        ({"conversation": []}, ":3: a sample needs a 'messages' list"),
        (["not", "an", "object"], ":3: a sample needs a 'messages' list"),
        ({"messages": []}, ":3: empty conversation"),
        ({"messages": [{"role": "user", "content": "please copy alpha"}]}, ":3: no assistant turn"),
        (
            {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "alpha"}]},
            ":3: the chat template rejects this conversation (unsupported role tool)",
        ),
        ({"messages": ["user: hi", {"role": "assistant", "content": "alpha"}]}, ":3: every message must be an object"),
    ],
)
def test_each_bad_sample_is_named_with_its_line(tmp_path, tokenizer, bad, fragment):
    path = _write(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError) as error:
        check_chat_data(path, tokenizer, 128, 512, "recipe_args.train_data_path")
    assert str(error.value).startswith(str(path)) and fragment in str(error.value)


def test_token_ids_outside_the_target_vocabulary(tmp_path, tokenizer):
    path = _write(
        tmp_path, [GOOD, {"messages": [{"role": "user", "content": "please count to 299"}, GOOD["messages"][1]]}]
    )
    with pytest.raises(ValueError, match=r"data.jsonl:2: token id \d+ is outside the target's vocabulary \[0, 300\)"):
        check_chat_data(path, tokenizer, 128, 300, "recipe_args.train_data_path")


def test_long_samples_are_counted_as_truncated(tmp_path, tokenizer):
    long = {"messages": [{"role": "user", "content": "please copy " + "alpha " * 40}, GOOD["messages"][1]]}
    report = check_chat_data(_write(tmp_path, [GOOD, long, GOOD]), tokenizer, 32, 512, "recipe_args.train_data_path")
    assert (report.samples, report.truncated) == (3, 1) and report.longest > 32


def test_json_arrays_name_the_sample_index(tmp_path, tokenizer):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([GOOD, {"messages": []}]))
    with pytest.raises(ValueError, match=r"data.json\[1\]: empty conversation"):
        check_chat_data(path, tokenizer, 128, 512, "recipe_args.train_data_path")


def test_missing_or_empty_files_and_hub_ids(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="recipe_args.val_data_path: .* does not exist"):
        check_chat_data(tmp_path / "nope.jsonl", tokenizer, 128, 512, "recipe_args.val_data_path")
    with pytest.raises(ValueError, match="holds no conversation"):
        check_chat_data(_write(tmp_path, ["", "  "]), tokenizer, 128, 512, "recipe_args.train_data_path")
    assert check_chat_data("org/some-hub-dataset", tokenizer, 128, 512, "recipe_args.train_data_path") is None
