"""Problem and trace sets from a source (a5core.data.problem_sets): arithmetic sources, with their solutions worked
column by column."""


def test_arithmetic_sources_with_column_solutions():
    from a5core.data.problem_sets import load_problem_set, load_trace_set
    from a5core.data.prompts import load_prompt
    from a5core.grading.rewards import arithmetic_reward_fn

    line = load_problem_set("arithmetic:20:2", "math", seed=1, split="train")
    columns = load_problem_set("arithmetic:20:2:columns", "math", seed=1, split="train")
    assert [(p.unique_id, p.problem, p.answer) for p in columns] == [(p.unique_id, p.problem, p.answer) for p in line]
    assert all(p.solution.startswith(("Column by column", f"{p.problem[9:].split()[0]} <")) for p in columns)
    traces = load_trace_set("arithmetic:20:1-2:columns", load_prompt("r1_zero"), seed=0)
    assert len(traces) > 20 and all("ones: " in t.response for t in traces)
    assert all(arithmetic_reward_fn(t.response, t.ground_truth)["reward"] == 1.0 for t in traces)
