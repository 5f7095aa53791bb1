"""lab/results_writeup.py: docs/results.md is the verdict flow run on the record archives. The lab's part is to
unpack the archives, compute what the GPU pools cost, and list the archives; the findings are the product's.

One test packs two archives as the device calls leave them (GRPO runs in stores of their own, their artifacts at
the archive's top, a pool's ``pool.txt`` and ``walls.txt``) and runs the script's ``main`` end to end (the flow in
its own process); the others check the cost it computes from pools."""

import importlib.util
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_module():
    spec = importlib.util.spec_from_file_location("results_writeup", ROOT / "lab" / "results_writeup.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


writeup = _load_module()


def _archive(tmp_path: Path, name: str, seeds: list[int], pool: str, device: str) -> Path:
    """An archive of one baseline ablation per seed (each flow its own store, artifacts under the archive's
    mlruns/), and the pool that made them on ``device``."""
    from mlflow import MlflowClient

    folder = tmp_path / "build" / name
    for seed in seeds:
        store = folder / "outputs" / ".devrun" / f"b{seed}" / "mlflow.db"
        store.parent.mkdir(parents=True)
        client = MlflowClient(tracking_uri=f"sqlite:///{store}")
        experiment = client.create_experiment("grpo", artifact_location=str(folder / "mlruns" / f"grpo{seed}"))
        parent = client.create_run(experiment, run_name="grpo_baseline_ablation", start_time=1000 * (2000 + seed))
        client.set_tag(parent.info.run_id, "ablation", "grpo_baseline_ablation")
        for setting, final in (("no_baseline", 0.40 + seed / 100), ("reinforce_with_baseline", 0.45 + seed / 50)):
            params = {"setting": setting, "loss_type": setting, "seed": str(seed), "learning_rate": "2e-05"}
            run = client.create_run(
                experiment,
                run_name=f"grpo-{setting}",
                start_time=1000 * (2000 + seed),
                tags={"mlflow.parentRunId": parent.info.run_id},
            )
            rid = run.info.run_id
            for key, value in params.items():
                client.log_param(rid, key, value)
            for step, value in ((0, 0.01), (5, final)):
                client.log_metric(rid, "val_accuracy", value, step=step)
            client.log_metric(rid, "final_val_accuracy", final, step=5)
            client.log_metric(rid, "final_val_n_problems", 300, step=5)
            client.log_dict(rid, {"inputs": {"model": {"hash": "folder:sft"}}, "device": device}, "provenance.json")
            client.set_terminated(rid)
        client.set_terminated(parent.info.run_id)
    (folder / "outputs" / ".devrun" / "pool.txt").write_text(pool)
    (folder / "outputs" / ".devrun" / "walls.txt").write_text("sft call=2 rc=0 wall_s=180\n")
    archive = tmp_path / "runs" / f"{name}.tar.gz"
    archive.parent.mkdir(exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
    return archive


def test_the_page_is_the_verdict_flow_on_the_unpacked_archives(tmp_path, monkeypatch):
    h200 = "b0 start 1990\nb1 start 1990\nb0 end 2230 rc=0\nb1 end 2230 rc=0\n"
    _archive(tmp_path, "records_a", [0, 1], h200, "cuda: 1 × NVIDIA H200")
    h100 = "b2 start 1990\nx start 1990\nx end 2000 rc=1\nb2 end 2590 rc=0\n"
    _archive(tmp_path, "records_b", [2], h100, "cuda: 1 × NVIDIA H100 80GB HBM3")
    (tmp_path / "runs" / "call1_setup.log").write_text("setup\n")
    (tmp_path / "context.md").write_text("## How to repeat the runs\n\nHand-kept.\n")
    out, figures = tmp_path / "docs" / "results.md", tmp_path / "docs" / "results"
    argv = ["--runs", str(tmp_path / "runs"), "--out", str(out), "--figures", str(figures)]
    argv += ["--context", str(tmp_path / "context.md"), "--unpacked", str(tmp_path / "outputs" / "records")]
    assert writeup.main(argv) == out
    page = out.read_text()
    assert page.startswith(
        "# Results\n\n> Made by `python -m flows.verdicts --expectations-file docs/expectations.yaml"
    )
    row = next(line for line in page.splitlines() if "`reinforce_with_baseline >= no_baseline`" in line)
    assert "reinforce_with_baseline − no_baseline = +0.060 ±" in row and "| 3 |" in row  # three seeds, two archives
    assert "![grpo_baseline_ablation_val_accuracy](results/grpo_baseline_ablation_val_accuracy.png)" in page
    assert (figures / "grpo_baseline_ablation_val_accuracy.png").stat().st_size > 1000
    cost = page.split("## Cost")[1].split("\n## ")[0]
    assert "| H200 | 2 | 0 | 2 | 4.0 | 4.0 | 0.50 | 4.0 | 2.0 | 3.0 |" in cost
    assert "| H100 | 1 | 1 | 2 | 10.0 | 10.0 | 0.10 | 20.0 | 10.0 | 3.0 |" in cost  # the failed attempt held a place
    assert page.rstrip().endswith("Hand-kept.")
    index = (tmp_path / "runs" / "INDEX.md").read_text()
    assert "| `grpo_baseline_ablation` | no_baseline | 2 |" in index and "`records_b.tar.gz` |" in index
    assert "| `records_a.tar.gz` | " in index and "sft call=2 rc=0 wall_s=180" in index
    assert "Logs beside them: `call1_setup.log`." in index


def test_at_once_counts_the_attempts_that_failed():
    attempts = [("a", 0, 100, "0"), ("b", 0, 10, "1"), ("c", 5, 50, "0"), ("d", 60, 70, "0")]
    assert writeup.at_once(attempts) == 3


def test_a_pool_without_a_gpu_in_its_records_stands_alone(tmp_path):
    pools = [
        writeup.Pool(None, [("a", 0, 120, "0")], []),
        writeup.Pool(None, [("b", 0, 60, "0")], []),
        writeup.Pool("H200", [("c", 0, 60, "0"), ("d", 0, 60, "0")], [120.0]),
    ]
    rows = [line for line in writeup.cost_section(pools).splitlines() if line.startswith("| a GPU") or "H200" in line]
    assert rows == [
        "| a GPU | 1 | 0 | 1 | 2.0 | 2.0 | 0.50 | 4.0 | 2.0 |  |",
        "| a GPU | 1 | 0 | 1 | 1.0 | 1.0 | 1.00 | 2.0 | 1.0 |  |",
        "| H200 | 2 | 0 | 2 | 1.0 | 1.0 | 2.00 | 1.0 | 0.5 | 2.0 |",
    ]
    assert writeup.cost_section([writeup.Pool("H100", [("a", 0, 60, "1")], [])]) == ""


@pytest.mark.parametrize(
    ("text", "ended"),
    [
        ("a start 10\na end 70 rc=0\n", [("a", 10, 70, "0")]),
        ("a start 10\nb start 11\nb end 12 rc=137\n", [("b", 11, 12, "137")]),  # a still running: not ended
    ],
)
def test_a_pools_attempts(tmp_path, text, ended):
    (tmp_path / "pool.txt").write_text(text)
    assert writeup.read_pool(tmp_path / "pool.txt") == ended


def test_what_deciding_the_rest_would_cost():
    pairs = {"H200": (1.0, 0.5), "H100": (1.6, 0.8)}
    verdicts = [
        {"expectation": "a >= b", "more_pairs": 10, "shares_runs_with": ["c >= b"]},
        {"expectation": "d >= e", "more_pairs": 3, "shares_runs_with": []},
        {"expectation": "f >= g", "more_pairs": None, "shares_runs_with": []},  # decided
    ]
    rows = [line for line in writeup.deciding_cost(verdicts, pairs).splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        "| `a >= b` | 10 | yes | 5 | 8 |",
        "| `d >= e` | 3 | no | 3 | 5 |",
        "| all of them | | | 8 | 13 |",
    ]
    assert writeup.deciding_cost(verdicts[2:], pairs) == ""
    assert writeup.pair_minutes([writeup.Pool("H100", [("a", 0, 600, "0"), ("b", 0, 600, "0")], [])]) == {
        "H100": (10.0, 5.0)
    }
