"""What a user sees: a flow run shows up in the MLflow UI and in the Prefect UI, checked in headless Chromium.

The MLflow UI (``mlflow ui``) and the Prefect server (``prefect server start``) run on 127.0.0.1 at free
ports; a tiny ``baseline_eval`` logs to both; Chromium (Debian's ``chromium`` and ``chromium-driver``,
which .ci/run installs) opens the experiment page and the flow runs page, waits for the run's name and
saves screenshots (also copied to outputs/screenshots/)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from servers import background, listening_addresses, mlflow_ui, quiet_env, running_prefect_server, wait_http

from tasks.prefect_server import stop_with_this_process

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "outputs" / "screenshots"
WAIT_S = 60

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)",
)


@pytest.fixture(scope="module")
def uis(tmp_path_factory):
    """The Prefect server and the MLflow UI (over an sqlite store in tmp), started side by side."""
    tmp = tmp_path_factory.mktemp("uis")
    tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    mlflow_cmd, mlflow_port = mlflow_ui(tracking_uri, tmp / "mlruns")
    with contextlib.ExitStack() as stack:
        mlflow = stack.enter_context(
            background([*mlflow_cmd, "--workers", "1"], tmp / "mlflow.log", quiet_env(tmp), cwd=tmp)
        )
        prefect = stack.enter_context(running_prefect_server(tmp))  # starts while the MLflow UI starts
        mlflow_url = f"http://127.0.0.1:{mlflow_port}"
        wait_http(f"{mlflow_url}/health", mlflow, tmp / "mlflow.log")
        yield {
            "tmp": tmp,
            "prefect": prefect["ui"],
            "mlflow": mlflow_url,
            "tracking_uri": tracking_uri,
            "ports": (prefect["port"], mlflow_port),
        }


@pytest.fixture(scope="module")
def browser(uis):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-quic",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={uis['tmp'] / 'chromium-profile'}",
    ):
        options.add_argument(arg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_AVOID_STATS", "true")  # Selenium Manager: no usage statistics (it is not needed: paths are given)
        driver = webdriver.Chrome(
            options=options, service=Service(str(CHROMEDRIVER), log_output=str(uis["tmp"] / "chromedriver.log"))
        )
    # chromedriver and the Chromium it started stop with this process, should it be killed before quit() runs.
    for pid in browser_pids(driver):
        stop_with_this_process(pid)
    try:
        driver.set_page_load_timeout(WAIT_S)
        yield driver
    finally:
        driver.quit()


def browser_pids(driver) -> list[int]:
    """chromedriver's pid and those of the processes it started (Chromium's browser process)."""
    import psutil

    service = driver.service.process.pid
    return [service, *(child.pid for child in psutil.Process(service).children())]


def test_the_browser_is_watched(browser):
    """A test run killed while the browser is open (SIGTERM runs no exit handler) leaves no Chromium behind."""
    import os
    import time

    import psutil

    def watching() -> dict[int, int | None]:
        """Each browser pid → the pid of the process its watcher watches (None: no watcher seen)."""
        commands = [p.info["cmdline"] or [] for p in psutil.process_iter(["cmdline"])]
        # a watcher's command ends with the watching process's pid and the watched one's
        found = {int(c[-1]): int(c[-2]) for c in commands if any(part.endswith("_orphan_watch.py") for part in c)}
        return {pid: found.get(pid) for pid in browser_pids(browser)}

    # One fresh-clone CI run found chromedriver's watcher missing from a single read (cause not found): read again
    # for a few seconds before failing; a watcher that is really missing still fails the test.
    deadline, seen = time.monotonic() + 10, watching()
    while set(seen.values()) != {os.getpid()} and time.monotonic() < deadline:
        time.sleep(0.5)
        seen = watching()
    assert len(seen) >= 2 and seen == dict.fromkeys(seen, os.getpid())


def wait_for_text(driver, text: str, shot: Path) -> None:
    """Wait until an element of the page shows ``text``; screenshot either way (the failure's is the clue)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, WAIT_S, poll_frequency=0.5).until(
            EC.visibility_of_element_located((By.XPATH, f"//*[text()[contains(normalize-space(.), '{text}')]]"))
        )
    except TimeoutException:
        driver.save_screenshot(str(shot.with_suffix(".failed.png")))
        raise AssertionError(
            f"{text!r} not shown at {driver.current_url} within {WAIT_S} s; page text:\n"
            f"{driver.find_element(By.TAG_NAME, 'body').text[:2000]}"
        ) from None
    driver.save_screenshot(str(shot))


def click_text(driver, text: str) -> None:
    """Click the innermost visible element that reads ``text`` (a tab, a link)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def shown(driver):
        found = driver.find_elements(By.XPATH, f"//*[normalize-space(.)='{text}'][not(*[normalize-space(.)='{text}'])]")
        return next((e for e in found if e.is_displayed()), False)

    driver.execute_script("arguments[0].click();", WebDriverWait(driver, WAIT_S, poll_frequency=0.5).until(shown))


def keep_screenshots(shots: Path) -> None:
    """Copy a test's screenshots to outputs/screenshots (git-ignored), for people to look at, where it can."""
    with contextlib.suppress(OSError):
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        for shot in shots.glob("*.png"):
            shutil.copy2(shot, SCREENSHOTS / shot.name)


def form_deployment(uis, flow: str) -> str:
    """The id of a deployment ``form`` of ``flow`` (``module:object``), made where the project is (so that the
    form knows the folders git tracks there)."""
    module, name = flow.split(":")
    root = Path(__file__).resolve().parents[2]
    deployment = subprocess.run(
        [sys.executable, "-c", f"from {module} import {name}; print({name}.to_deployment(name='form').apply())"],
        cwd=root,
        env=quiet_env(uis["tmp"], PREFECT_API_URL=f"{uis['prefect']}/api", PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert deployment.returncode == 0, deployment.stderr[-3000:]
    return deployment.stdout.split()[-1]


def the_form_refuses_a_source_folder(browser, uis, deployment_id: str, shot: Path) -> None:
    """Type ``flows`` (a source folder) as the form's Output Dir and submit: the form says it does not match and
    names ``output_dir``, and no flow run of the deployment is made."""
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.XPATH, "//*[normalize-space(text())='Output Dir (Optional)']/following::textarea")
    field.clear()
    field.send_keys("flows")
    click_text(browser, "Submit")
    wait_for_text(browser, "does not match", shot)
    assert "output_dir" in browser.find_element(By.TAG_NAME, "body").text
    made = {"deployments": {"id": {"any_": [deployment_id]}}}
    assert httpx.post(f"{uis['prefect']}/api/flow_runs/filter", json=made, timeout=10).json() == []


def test_a_flow_run_shows_in_the_mlflow_and_prefect_uis(uis, browser, tiny_lm_dir, shared_data):
    import mlflow

    from tasks.experiments import ui_address

    tmp, api = uis["tmp"], f"{uis['prefect']}/api"
    assert [listening_addresses(port) for port in uis["ports"]] == [{"127.0.0.1"}] * 2
    # the command line a user runs with PREFECT_API_URL pointing at the server; artifacts under tmp/mlruns
    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.baseline_eval",
            "--model",
            str(tiny_lm_dir),
            "--backend",
            "hf",
            "--data",
            str(shared_data / "math/validation.jsonl"),
            "--limit",
            "2",
            "--max-tokens",
            "8",
            "--output-dir",
            str(tmp / "out"),
            "--metrics-path",
            "null",
            "--tracking-uri",
            uis["tracking_uri"],
        ],
        cwd=tmp,
        env=quiet_env(tmp, PREFECT_API_URL=api),
        check=True,
        timeout=300,
        capture_output=True,
    )
    assert ui_address("baseline_eval", uis["tracking_uri"]) in printed.stdout.decode()  # where to look, printed
    flow_runs = httpx.post(f"{api}/flow_runs/filter", json={}, timeout=10).json()
    recorded = [(r["state_type"], r["parameters"]["params"]["generation"]["limit"]) for r in flow_runs]
    assert recorded == [("COMPLETED", 2)]  # the flow run's parameters, by group as its form shows them
    flow_run = flow_runs[0]
    logs = httpx.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run["id"]]}}}, timeout=10)
    by_logger = {(log["name"], log["message"].split(":")[0]) for log in logs.json()}
    assert ("tasks.flow_summary", "outputs") in by_logger  # the project's loggers reach the run's logs
    (artifact,) = httpx.post(
        f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}}, timeout=10
    ).json()
    client = mlflow.MlflowClient(uis["tracking_uri"])
    (run,) = client.search_runs([client.get_experiment_by_name("baseline_eval").experiment_id])

    shots = tmp / "screenshots"
    shots.mkdir()
    try:
        # The address the flow printed: the experiment's landing view lists the run (MLflow 3.17 would open
        # its GenAI view without the address's workflowType).
        browser.get(ui_address("baseline_eval", uis["tracking_uri"], root=uis["mlflow"]))
        wait_for_text(browser, run.info.run_name, shots / "mlflow_experiment.png")
        assert "/runs?" in browser.current_url
        # The run page: its metrics, its settings as parameters, where it came from (the commit, the
        # Prefect flow run it belongs to).
        browser.get(ui_address("baseline_eval", uis["tracking_uri"], run.info.run_id, root=uis["mlflow"]))
        wait_for_text(browser, "accuracy", shots / "mlflow_run.png")
        wait_for_text(browser, run.data.tags["mlflow.source.git.commit"][:7], shots / "mlflow_run.png")
        wait_for_text(browser, "tracking_uri", shots / "mlflow_run.png")  # a parameter
        wait_for_text(browser, flow_run["name"], shots / "mlflow_run.png")  # the tag prefect.flow_run_name
        browser.get(f"{uis['prefect']}/runs")
        wait_for_text(browser, flow_run["name"], shots / "prefect_flow_runs.png")
        # The flow run's page, as MLflow links it (tag prefect.flow_run_url): its logs hold the numbers,
        # its artifact the headline table and the MLflow run's address.
        browser.get(run.data.tags["prefect.flow_run_url"])
        wait_for_text(browser, "Completed", shots / "prefect_flow_run.png")
        wait_for_text(browser, "start_engine", shots / "prefect_flow_run.png")  # its task runs' logs
        wait_for_text(browser, "Zero-shot evaluation: set validation.jsonl", shots / "prefect_flow_run.png")
        click_text(browser, "Artifacts")
        wait_for_text(browser, "baseline-eval-summary", shots / "prefect_flow_run_artifacts.png")
        browser.get(f"{uis['prefect']}/artifacts/artifact/{artifact['id']}")
        wait_for_text(browser, "format_rate", shots / "prefect_artifact.png")  # the table, rendered
        wait_for_text(browser, run.info.run_id, shots / "prefect_artifact.png")  # the MLflow run, linked
        link = browser.find_element("xpath", f"//a[normalize-space(text())='{run.info.run_id}']")
        assert link.get_attribute("href") == ui_address("baseline_eval", uis["tracking_uri"], run.info.run_id)
    finally:
        keep_screenshots(shots)
    assert all(shot.stat().st_size > 10_000 for shot in shots.glob("*.png"))


def test_the_dvc_plots_page_offline_and_the_report_alone(uis, browser, tmp_path):
    """``dvc plots show``'s page with the network off draws every stage's titled, labelled chart; the report's
    HTML copied alone shows its case report and links each stage's MLflow run to the run's page."""
    import mlflow
    from report_project import project, write
    from test_dvc_plots import plotted_project, show_plots

    from flows.report import ReportParams, build_report
    from tasks.experiments import UI_ROOT, ensure_experiment, ui_address

    shots = tmp_path / "screenshots"
    shots.mkdir()
    show_plots(plotted_project(tmp_path / "plotted"), tmp_path / "dvc_plots")
    try:
        browser.set_network_conditions(offline=True, latency=0, throughput=0)
        browser.get((tmp_path / "dvc_plots/index.html").as_uri())
        wait_for_text(browser, "GRPO: validation accuracy by step", shots / "dvc_plots.png")  # a chart's title
        wait_for_text(browser, "EI round (0 = the starting policy)", shots / "dvc_plots.png")  # an axis label
        wait_for_text(browser, "mean rollout reward", shots / "dvc_plots.png")
        assert len(browser.find_elements("css selector", "svg.marks")) == 7  # every curve's chart drawn
        loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert all(name.startswith("file:") for name in loaded), loaded  # nothing asked of the network
        browser.delete_network_conditions()

        # The report, from a project whose GRPO stage names its MLflow run (outputs/grpo/run.json).
        root = tmp_path / "project"
        project(root)
        with mlflow.start_run(experiment_id=ensure_experiment("grpo", uis["tracking_uri"]), run_name="grpo") as run:
            mlflow.log_params({"n_grpo_steps": 2, "validation_data": "arithmetic:16:1"})
        record = {
            "flow": "grpo",
            "experiment": "grpo",
            "tracking_uri": uis["tracking_uri"],
            "mlflow_run_id": run.info.run_id,
            "mlflow_run_url": ui_address("grpo", uis["tracking_uri"], run.info.run_id),
        }
        write(root / "outputs/grpo/run.json", record)
        build_report(ReportParams(root=str(root), output_dir=str(root / "report"), ablations_from_mlflow=False))
        alone = tmp_path / "elsewhere/report.html"  # the page without its folder
        alone.parent.mkdir()
        alone.write_bytes((root / "report/report.html").read_bytes())
        browser.get(alone.as_uri())
        wait_for_text(browser, "0.200 ± 0.100 → 0.450 ± 0.110", shots / "report.png")  # the headline
        browser.find_element("css selector", "details#baseline-cases > summary").click()
        wait_for_text(browser, "Evaluation case analysis", shots / "report_cases.png")  # the case report, in the page
        images = browser.find_elements("css selector", "figure img")
        assert images and all(browser.execute_script("return arguments[0].naturalWidth", i) > 0 for i in images)
        link = browser.find_element("xpath", f"//a[code[normalize-space(.)='{run.info.run_id[:12]}']]")
        assert link.get_attribute("href") == record["mlflow_run_url"]
        browser.get(record["mlflow_run_url"].replace(UI_ROOT, uis["mlflow"]))  # the MLflow UI where it serves
        wait_for_text(browser, "n_grpo_steps", shots / "report_mlflow_run.png")
    finally:
        with contextlib.suppress(Exception):
            browser.delete_network_conditions()
        keep_screenshots(shots)


def test_mlflow_from_its_home_page_and_a_prefect_form_that_refuses_a_source_folder(uis, browser, tmp_path):
    """A user who opens MLflow at its root reads there how to reach an experiment's runs (its description), picks
    "Model training" and opens the experiment on its runs; the address the flows print opens the runs table with
    the stage's headline metric as a column. A Prefect form with ``output_dir`` a source folder (``flows``) is
    refused, and no flow run is made."""
    import mlflow

    from tasks.experiments import ensure_experiment, ui_address

    shots = tmp_path / "screenshots"
    shots.mkdir()
    with mlflow.start_run(experiment_id=ensure_experiment("grpo", uis["tracking_uri"]), run_name="grpo-single") as run:
        mlflow.log_metrics({"final_val_accuracy": 0.59375, "final_val_accuracy_se": 0.088})
    deployment_id = form_deployment(uis, "flows.report:report")
    try:
        browser.get(f"{uis['mlflow']}/")
        wait_for_text(browser, "pick Model training", shots / "mlflow_home.png")  # the experiment's description
        click_text(browser, "Model training")
        click_text(browser, "grpo")
        wait_for_text(browser, run.info.run_name, shots / "mlflow_home_to_runs.png")
        assert "/runs?" in browser.current_url and "workflowType=machine_learning" in browser.current_url
        browser.get(ui_address("grpo", uis["tracking_uri"], root=uis["mlflow"]))
        wait_for_text(browser, "final_val_accuracy_se", shots / "mlflow_runs_headline.png")  # a column of the table
        wait_for_text(browser, "0.59375", shots / "mlflow_runs_headline.png")

        browser.get(f"{uis['prefect']}/deployments/deployment/{deployment_id}/run")
        wait_for_text(browser, "Output Dir", shots / "prefect_form.png")
        the_form_refuses_a_source_folder(browser, uis, deployment_id, shots / "prefect_form_refused.png")
    finally:
        keep_screenshots(shots)


def test_a_composed_flow_form_shows_its_groups_and_refuses_a_source_folder_in_one(uis, browser, tmp_path):
    """The GRPO flow's Prefect form is made of its settings' groups (the loop's ``grpo`` with its ``optimizer``,
    the ``outputs`` ...), each setting under its own name; ``output_dir`` a source folder, inside the ``outputs``
    group, is refused by the form, and no flow run is made."""
    shots = tmp_path / "screenshots"
    shots.mkdir()
    deployment_id = form_deployment(uis, "flows.grpo:grpo_flow")
    try:
        browser.get(f"{uis['prefect']}/deployments/deployment/{deployment_id}/run")
        for text in ("Optimizer", "Learning Rate", "Outputs", "Output Dir"):
            wait_for_text(browser, text, shots / "prefect_grpo_form.png")
        the_form_refuses_a_source_folder(browser, uis, deployment_id, shots / "prefect_grpo_form_refused.png")
    finally:
        keep_screenshots(shots)
