"""Few-shot GSM8K prompt and scoring rules (SGLang's), on fixed cases."""

from __future__ import annotations

import pytest

from airserve.benchmark.datasets import load_gsm8k
from airserve.test.few_shot_gsm8k import (
    INVALID,
    STOP,
    build_questions,
    few_shot_prefix,
    format_example,
    get_answer_value,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("Janet makes 9 * 2 = $18.\n#### 18", 18),
        ("The total is 1,234,567 dollars.", 1234567),
        ("so 3 + 4 = 7", 7),
        ("first 12 then 5\n\n", 5),
        ("The answer is -3", 3),  # the sign is dropped, as in SGLang
        ("It costs 2.50", 50),  # decimals: the last digit run
        ("No number here.", INVALID),
        ("", INVALID),
        ("code 007", INVALID),  # not a Python int literal
        ("0", 0),
        ("#### 00", 0),
    ],
)
def test_answer_value(text, value):
    assert get_answer_value(text) == value


ROWS = [
    {"question": "Q zero?", "answer": "Zero work.\n#### 10"},
    {"question": "Q one?", "answer": "One work.\n#### 11"},
    {"question": "Q two?", "answer": "Two work.\n#### 1,200"},
    {"question": "Q three?", "answer": "Three.\n#### 13"},
]


def test_prompt_layout():
    assert format_example(ROWS[0], False) == "Question: Q zero?\nAnswer:"
    assert format_example(ROWS[0], True) == "Question: Q zero?\nAnswer: Zero work.\n#### 10"
    assert few_shot_prefix(ROWS, 2) == (
        "Question: Q zero?\nAnswer: Zero work.\n#### 10\n\n"
        "Question: Q one?\nAnswer: One work.\n#### 11\n\n"
    )
    assert few_shot_prefix(ROWS, 0) == ""
    assert STOP == ["Question", "Assistant:", "<|separator|>"]


def test_scored_questions_follow_the_shots():
    questions = build_questions(ROWS, num_shots=2, num_questions=5)
    assert [(i, label) for i, _, label in questions] == [(2, 1200), (3, 13)]
    index, prompt, _ = questions[0]
    assert prompt == (
        "Question: Q zero?\nAnswer: Zero work.\n#### 10\n\n"
        "Question: Q one?\nAnswer: One work.\n#### 11\n\n"
        "Question: Q two?\nAnswer:"
    )


def test_sglang_question_order():
    questions = build_questions(ROWS, num_shots=2, num_questions=3, include_shot_questions=True)
    assert [i for i, _, _ in questions] == [0, 1, 2]


def test_packaged_gsm8k_prompts():
    rows = load_gsm8k()
    questions = build_questions(rows, num_shots=5, num_questions=200)
    assert len(questions) == 200 and questions[0][0] == 5 and questions[-1][0] == 204
    prompt = questions[0][1]
    assert prompt.startswith("Question: Janet’s ducks lay 16 eggs per day.")
    assert prompt.count("Question: ") == 6 and prompt.count("\n#### ") == 5
    assert prompt.endswith("\nAnswer:")
    assert all(label != INVALID for _, _, label in questions)
    # Every label is the `#### N` value.
    assert questions[0][2] == get_answer_value(rows[5]["answer"].split("####")[-1])
