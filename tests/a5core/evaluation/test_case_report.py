"""The case report (a5core.evaluation.case_report): format failures told from model failures, and hostile text shown
as text, never as HTML."""

from test_records import PROBLEMS, ScriptedEngine

from a5core.data.files import Problem
from a5core.data.prompts import load_prompt
from a5core.engines import SamplingSettings
from a5core.evaluation.case_report import case_report
from a5core.evaluation.records import evaluate
from a5core.grading.grader import r1_zero_reward_fn


def test_case_report_separates_format_from_model_failures():
    engine = ScriptedEngine(
        [
            "</think> <answer> 2 </answer>",
            "the answer is $\\boxed{2}$",
            "nothing useful",
            "</think><answer> \\frac12 </answer>",
            "</think> <answer> 8 </answer>",
            "9?",
        ]
    )
    records, _ = evaluate(engine, PROBLEMS, load_prompt("r1_zero"), r1_zero_reward_fn, SamplingSettings(n=2))
    report = case_report(records, per_category=5)
    assert "| format0_answer0 | 4 |" in report and "| format1_answer1 | 1 |" in report
    assert "Of the 4 format-0 responses, 2 contain a correct answer" in report
    assert "(correct: format failure)" in report and "No answer found in the text: model failure." in report
    assert "**Ground truth:** `\\frac{1}{2}`" in report


HOSTILE = (
    "```\n<img src=x onerror=alert(1)>\n```\n`` ` ``\n<script>alert(2)</script>\n\n# a heading\n"
    "[a link](javascript:alert(3))"
)


def rendered_html(markdown: str) -> str:
    """The page a CommonMark viewer shows (raw HTML allowed, as GitHub-style viewers allow it)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").render(markdown)


def test_the_case_report_shows_hostile_text_as_text_never_as_html():
    """A problem holding a fenced block and HTML, an answer holding backticks, a hostile id and ground truth:
    each stays inside its code block or span, so the viewer renders no tag, link or heading of theirs."""
    problems = [Problem("<img src=x onerror=alert(4)>", HOSTILE, "`<b>7</b>`\n\n# x")]
    engine = ScriptedEngine([HOSTILE + " </think> <answer> `<i>7</i>` </answer>", "``` <img src=y onerror=z> 7"])
    records, _ = evaluate(engine, problems, load_prompt("r1_zero"), r1_zero_reward_fn, SamplingSettings(n=2))
    page = rendered_html(case_report(records))
    assert "<img" not in page and "<script" not in page and "<a " not in page and "<b>" not in page
    assert page.count("<h1>") == 1 and page.count("<h3>") == 2  # the report's own headings alone
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "&lt;img src=x onerror=alert(4)&gt;" in page
    assert "<code>`&lt;b&gt;7&lt;/b&gt;`  # x</code>" in page  # the ground truth, whole, on one line
