"""What the handout's log_generations reports (a5core.evaluation.generations): a sample of rows with each response's
mean token entropy, and response lengths."""


def test_log_generations_rows_and_length_metrics(tiny_model):
    from a5core.evaluation.generations import log_generations

    class CharTokenizer:  # one id per character, within the tiny model's 64-entry vocabulary
        pad_token_id, eos_token_id = 0, 0

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[1 + ord(c) % 60 for c in t] for t in texts]}

    records = [
        {
            "unique_id": f"p{i}",
            "prompt": "Q?",
            "response": "x" * (i + 1),
            "ground_truth": "1",
            "format_reward": 1.0,
            "answer_reward": float(i % 2),
            "reward": float(i % 2),
            "response_tokens": i + 1,
            "finish_reason": "stop",
        }
        for i in range(4)
    ]
    rows, metrics = log_generations(tiny_model, CharTokenizer(), records, sample_size=3, seed=0)
    assert len(rows) == 3 and all(0 < r["mean_token_entropy"] <= 4.2 for r in rows)  # ≤ log(64)
    assert metrics["mean_response_tokens"] == 2.5
    assert metrics["mean_response_tokens_correct"] == 3.0 and metrics["mean_response_tokens_incorrect"] == 2.0
    assert 0 < metrics["mean_token_entropy"] <= 4.2
