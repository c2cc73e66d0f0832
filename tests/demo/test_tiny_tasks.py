"""The tiny tasks' tokenizer and the decoding guess that knows they count."""

from __future__ import annotations

from nemo_automodel_ext.demo.tiny_tasks import NUMBER_IDS, NUMBERS, build_tokenizer, counting_guess


def test_numbers_have_consecutive_ids():
    tokenizer = build_tokenizer()
    assert [tokenizer.convert_tokens_to_ids(number) for number in NUMBERS] == list(NUMBER_IDS)


def test_counting_guess_goes_on_counting_within_the_numbers():
    """Up, down and by a step, cut at ``length`` and at the ends of the numbers; nothing after a word, a repeated
    number or fewer than two tokens."""
    tokenizer = build_tokenizer()
    ids = lambda text: tokenizer.convert_tokens_to_ids(text.split())  # noqa: E731
    assert counting_guess(ids("please count 37 38"), 3) == ids("39 40 41")
    assert counting_guess(ids("12 15"), 2) == ids("18 21")
    assert counting_guess(ids("4 3"), 9) == ids("2 1 0")  # stops at 0
    assert counting_guess(ids("297 298"), 9) == ids("299")  # and at 299
    assert counting_guess(ids("38 copy"), 3) == [] and counting_guess(ids("5 5"), 3) == []
    assert counting_guess(ids("5"), 3) == [] and counting_guess(ids("5 6"), 0) == []
