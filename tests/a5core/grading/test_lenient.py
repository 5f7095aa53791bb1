"""The answer a person reads off an unformatted response (a5core.grading.lenient): a box, a loose tag, or 'the
answer is X', in linear time on adversarial text."""

import json
import subprocess
import sys
from pathlib import Path

from a5core.grading.lenient import lenient_answer


def test_lenient_answer():
    assert lenient_answer("so \\boxed{7} done") == "7"
    assert lenient_answer("</think><answer> 9 </answer>") == "9"
    assert lenient_answer("The answer is 12.") == "12"
    assert lenient_answer("no idea") is None
    assert lenient_answer("So the final answer is: $\\frac{1}{2}$.\nDone") == "\\frac{1}{2}"
    assert lenient_answer("I think the answer is 4. No wait, the ANSWER IS 5") == "5"
    assert lenient_answer("The answer is x = 3 \n\n.") == "x = 3"
    assert lenient_answer("the answer is 5\nbecause") == "5"  # the rest of its line
    assert lenient_answer("The answer is 3.5. Next") == "3.5"
    assert lenient_answer("The answer is $7$ ") == "7"


# Hostile shapes (whitespace runs, repeats), each (text of size n, its lenient answer).
ADVERSARIAL = {
    "spaces after the phrase": (lambda n: "The answer is" + " " * n + "x\nfoo", lambda n: "x"),
    "spaces inside the answer": (lambda n: "The answer is x" + " " * n + "y\nz", lambda n: "x" + " " * n + "y"),
    "many phrases on one line": (lambda n: "answer is x " * (n // 12) + "\nfoo", lambda n: "x"),
    "spaces before the phrase": (lambda n: " " * n + "The answer is 5.", lambda n: "5"),
    "newlines after the phrase": (lambda n: "The answer is" + "\n" * n, lambda n: None),
    "spaces around dollars": (lambda n: "The answer is: " + " " * (n // 2) + "$7$" + " " * (n // 2), lambda n: "7"),
    "many lines with trailing spaces": (
        lambda n: ("the answer is 3 " + " " * 50 + "\n") * (n // 67) + "the answer is 4.",
        lambda n: "4",
    ),
    "blank lines before the answer": (lambda n: "The answer is " + "\t \n" * (n // 3) + "x", lambda n: "x"),
}


def test_adversarial_shapes_read_as_a_person_would():
    for name, (make, expected) in ADVERSARIAL.items():
        for n in (20, 67, 300):
            assert lenient_answer(make(n)) == expected(n), (name, n)


def test_lenient_answer_finishes_on_200k_character_adversarial_responses():
    """The old regex took 50 s on "the answer is", 2,000 spaces and a line break (cubic): 200,000
    characters would take days. Linear, they take well under a second; in a child process with a 240 s
    guard, so that a regression fails instead of hanging the suite."""
    n = 200_000
    texts = [make(n) for make, _ in ADVERSARIAL.values()]
    child = (
        "import json, sys, time\n"
        "from a5core.grading.lenient import lenient_answer\n"
        "out = []\n"
        "for text in json.load(sys.stdin):\n"
        "    start = time.perf_counter()\n"
        "    out.append([lenient_answer(text), time.perf_counter() - start])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[3],
        check=True,
    )
    results = json.loads(done.stdout.splitlines()[-1])
    assert [answer for answer, _ in results] == [expected(n) for _, expected in ADVERSARIAL.values()]
    assert all(len(text) >= 0.99 * n for text in texts)
