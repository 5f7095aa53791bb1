import pytest

from a5core.data.prompts import PromptTemplate, PromptTemplateError, builtin_prompt_names, load_prompt

R1_ZERO = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the "
    "answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer "
    "here </answer>.\nUser: {question}\nAssistant: <think>"
)


def test_builtin_templates_are_verbatim():
    assert builtin_prompt_names() == ["question_only", "r1_zero"]
    assert load_prompt("r1_zero").text == R1_ZERO
    assert load_prompt("question_only").text == "{question}"


def test_format_fills_question_without_touching_latex_braces():
    prompt = load_prompt("r1_zero").format("What is $\\frac{1}{2} + {x}$?")
    assert prompt.endswith("User: What is $\\frac{1}{2} + {x}$?\nAssistant: <think>")
    assert load_prompt("question_only").format("2+2?") == "2+2?"


def test_template_file_by_path(tmp_path):
    path = tmp_path / "mine.prompt"
    path.write_text("Q: {question}\nA:")
    assert load_prompt(path).format("1+1") == "Q: 1+1\nA:"


def test_template_without_placeholder_is_rejected(tmp_path):
    path = tmp_path / "broken.prompt"
    path.write_text("Q: {problem}\nA:")
    with pytest.raises(PromptTemplateError, match=r"broken.prompt.*no \{question\} placeholder"):
        load_prompt(path)
    with pytest.raises(PromptTemplateError, match="no {question} placeholder"):
        PromptTemplate("inline", "no placeholder here")


def test_unknown_template_names_the_builtins():
    with pytest.raises(PromptTemplateError, match="not a built-in .*question_only, r1_zero"):
        load_prompt("r2_zero")
