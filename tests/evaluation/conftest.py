"""Fixtures of the evaluation tests."""

from __future__ import annotations

import pytest
from evaluation.demo_pair import build_demo_pair


@pytest.fixture(scope="session")
def demo_pair():
    """(target wrapper, trained draft, untrained draft, tokenizer) on the shipped demo target."""
    return build_demo_pair()
