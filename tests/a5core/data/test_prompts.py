import pytest

from a5core.data.prompts import PromptTemplate, PromptTemplateError, builtin_prompt_names, load_prompt, prompt_forms

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


def test_a_prompt_has_the_form_of_the_most_specific_template_that_fits_it():
    r1, question_only = load_prompt("r1_zero"), load_prompt("question_only")
    assert prompt_forms([r1.format("What is 1 + 1?")]) == ["r1_zero"]
    assert prompt_forms([question_only.format("What is 1 + 1?")]) == ["question_only"]
    # question_only's form (the question alone) fits every prompt: one no other template fits counts as it
    assert prompt_forms(["Q: 2 + 2?\nA:"]) == ["question_only"]
    assert prompt_forms([r1.format("a"), question_only.format("b"), r1.format("c")]) == ["question_only", "r1_zero"]
    assert prompt_forms([]) == []
    # whitespace runs compare as one: the teacher sample writes a blank line where r1_zero has a line break
    assert prompt_forms([r1.format("a").replace("\nUser:", "\n\nUser:")]) == ["r1_zero"]
    # only its fixed text before and after the question, in place, makes a prompt a template's
    assert prompt_forms([r1.format("a").removesuffix("<think>")]) == ["question_only"]
    assert prompt_forms(["User: a " + r1.text]) == ["question_only"]


def test_a_prompt_no_template_fits_is_unknown():
    mine = PromptTemplate("mine", "Q: {question}\nA:")
    r1 = load_prompt("r1_zero")
    assert prompt_forms(["Q: 1 + 1?\nA:", r1.format("x"), "What is 1 + 1?"], [mine, r1]) == [
        "mine",
        "r1_zero",
        "unknown",
    ]
