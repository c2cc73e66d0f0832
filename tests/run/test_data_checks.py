"""Bad chat data is named (file, line or index, rule) before anything trains."""

from __future__ import annotations

import json

import pytest

from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer
from nemo_automodel_ext.run.data_checks import check_chat_data

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
            {"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "alpha"}]},
            ":3: the chat template rejects this conversation (unsupported role system)",
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


SHAREGPT = {"conversations": [{"from": "human", "value": "please copy alpha"}, {"from": "gpt", "value": "alpha"}]}


def _upstream_loads(path, tokenizer) -> bool:
    """Whether upstream's ChatDataset reads and formats every row of ``path``."""
    from nemo_automodel.components.datasets.llm.chat_dataset import ChatDataset

    try:
        dataset = ChatDataset(str(path), tokenizer, seq_length=128)
        for index in range(len(dataset)):
            dataset[index]
    except Exception:
        return False
    return True


@pytest.mark.parametrize(
    "name,text,accepted",
    [
        ("sharegpt.jsonl", json.dumps(SHAREGPT) + "\n" + json.dumps(GOOD) + "\n", True),
        ("lines.json", json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n", False),
        ("pretty.json", json.dumps(GOOD, indent=2), True),
        ("array.json", json.dumps([GOOD, SHAREGPT], indent=1), True),
        ("upper.JSONL", json.dumps(GOOD) + "\n", True),
        ("data.ndjson", json.dumps(GOOD) + "\n" + json.dumps(SHAREGPT) + "\n", True),
        ("data.txt", json.dumps([GOOD]), True),
        ("u2028.jsonl", json.dumps(GOOD, ensure_ascii=False).replace("alpha", "al\u2028pha", 1) + "\n", False),
        ("u0085.jsonl", json.dumps(GOOD, ensure_ascii=False).replace("alpha", "al\u0085pha", 1) + "\n", False),
        ("escaped.jsonl", json.dumps(GOOD).replace("alpha", "al\\u2028pha", 1) + "\n", True),
        ("badrole.jsonl", json.dumps({"conversations": [{"from": "robot", "value": "x"}]}) + "\n", False),
    ],
)
def test_the_check_and_upstream_loader_accept_the_same_files(tmp_path, tokenizer, name, text, accepted):
    """Every case goes to both: they agree, and a refusal names the file and says what to change."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    assert _upstream_loads(path, tokenizer) == accepted
    if accepted:
        assert check_chat_data(path, tokenizer, 128, 512, "recipe_args.train_data_path").samples >= 1
        return
    with pytest.raises(ValueError) as error:
        check_chat_data(path, tokenizer, 128, 512, "recipe_args.train_data_path")
    message = str(error.value)
    assert message.startswith(str(path))
    hint = {"lines.json": "rename it", "u2028.jsonl": "U+2028", "u0085.jsonl": "U+0085", "badrole.jsonl": "robot"}
    assert hint[name] in message, message


def test_data_with_nothing_supervised_in_the_row_is_refused(tmp_path, tokenizer):
    """seq_length 3 truncates every conversation before its answer: refused, not trained on nothing."""
    path = _write(tmp_path, [GOOD, GOOD])
    with pytest.raises(ValueError, match="every assistant token lies past the 3-token row"):
        check_chat_data(path, tokenizer, 3, 512, "recipe_args.train_data_path")
    assert check_chat_data(path, tokenizer, 7, 512, "recipe_args.train_data_path").samples == 2
