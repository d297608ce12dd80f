"""The Dagster UI in a real browser: `dagster dev` on a temporary home, driven by headless Chromium.

A reduced pipeline (two datasets of three prompts; a scripted OpenAI-compatible server on
loopback as the inference endpoint; the embedded model's tokenizer, standing in for the
target's) has its `generation_job` run for each dataset as `eagle3-pipeline run` runs it (in this process,
on the test's instance; the main job end to end is `test_e2e.py`'s), one health tick is recorded on
`inference_server` as the `inference_health` sensor records each tick, and then Debian's
`chromium` + `chromium-driver` (no browser download) open the asset graph, a `responses`
partition's materialization, the `inference_server` observation history, a managed server's start
recorded on it, and a `drafter_benchmark` materialization (its table, bar chart and choice, recorded from
a result built here: the benchmark's servers are out of this test's reach). Screenshots go to
`$EAGLE3_UI_SCREENSHOTS` (default: a temp folder) and their paths are printed. Every process the
test starts (`dagster dev` and its children, chromedriver and Chromium) is killed by process
group, also on failure. Deselect with `-m "not browser"`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from eagle3_pipeline.cli.cmd_run import MainJob
from eagle3_pipeline.components import build_definitions
from eagle3_pipeline.components.eagle3.drafter_benchmark import shown
from eagle3_pipeline.components.health.inference_server import health_observation, server_event_observation
from eagle3_pipeline.config import load_config
from eagle3_pipeline.drafter.serve.client import Acceptance, Measured, RequestRecord
from eagle3_pipeline.drafter.serve.report import ArmResult, BenchmarkResult
from eagle3_pipeline.drafter.serve.sweep import SpeculativeConfig
from eagle3_pipeline.health.gate import HealthMonitor
from eagle3_pipeline.managed import ServerEvent
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline.testing.process_tools import free_port
from eagle3_pipeline_tests.locations import location_file

pytestmark = [pytest.mark.browser, pytest.mark.local_model]

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1600,1000",
)
UI_TIMEOUT_S = 240.0
DATASETS = ("B1", "B2")


# -- processes this test starts, and stops by process group ---------------------------------------


def _group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still running (zombies do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _stop_group(pgid: int, grace_s: float) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(pgid), f"process group {pgid} survived SIGKILL"


@contextlib.contextmanager
def dagster_dev(env: dict[str, str], cwd: Path, log: Path, location: Path) -> Iterator[str]:
    """`dagster dev` on loopback (webserver, daemon, code server) for the code location in file
    `location`; yields the UI's base URL."""
    port = free_port()
    dagster = Path(sys.executable).parent / "dagster"
    argv = [str(dagster), "dev", "-f", str(location), "-h", "127.0.0.1", "-p", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + UI_TIMEOUT_S
        while not _answers(base + "/server_info"):
            assert proc.poll() is None, f"dagster dev exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"dagster dev not serving after {UI_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
            )
            time.sleep(1)
        yield base
    finally:
        _stop_group(proc.pid, grace_s=15)
        proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[WebDriver]:
    """Headless Debian Chromium through Debian's chromedriver, with a fresh profile."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    service = Service(str(CHROMEDRIVER), popen_kw={"start_new_session": True})
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        try:
            driver.quit()
        finally:
            _stop_group(service.process.pid, grace_s=5)


# -- what the pages must show -----------------------------------------------------------------------


def _open(driver: WebDriver, url: str, *expected: str) -> str:
    """Load `url`, dismiss Dagster's first-visit newsletter dialog, wait until every expected text
    is on screen; returns the page's visible text."""
    driver.get(url)

    def shown(d: WebDriver) -> str | bool:
        for skip in d.find_elements(By.XPATH, "//button[normalize-space()='Skip']"):
            with contextlib.suppress(WebDriverException):
                skip.click()
        text = d.find_element(By.TAG_NAME, "body").text
        dialog = "Join the Dagster community" in text
        return text if not dialog and all(e in text for e in expected) else False

    try:
        return str(WebDriverWait(driver, UI_TIMEOUT_S, poll_frequency=1).until(shown))
    except TimeoutException:
        body = driver.find_element(By.TAG_NAME, "body").text
        pytest.fail(f"{url}: expected {expected} on screen; it shows:\n{body[:3000]}")


def _lineage_edges(driver: WebDriver) -> set[tuple[str, str]]:
    """The graph's edges as (upstream, downstream) asset names, matched by geometry: an edge starts
    at the right side of its upstream node and ends (before its arrow head) at the left side of its
    downstream node, both in the graph's SVG coordinates."""
    nodes = []
    for node in driver.find_elements(By.CSS_SELECTOR, "foreignObject"):
        name = node.text.split("\n", 1)[0]
        x, y, w, h = (float(node.get_attribute(a) or "nan") for a in ("x", "y", "width", "height"))
        nodes.append((name, x, y, w, h))
    edges = set()
    for path in driver.find_elements(By.CSS_SELECTOR, "path[stroke^='var(--color-lineage-edge']"):
        numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", path.get_attribute("d") or "")]
        (x0, y0), (x1, y1) = numbers[:2], numbers[-2:]
        upstream = [n for n, x, y, w, h in nodes if abs(x + w - x0) < 1 and y <= y0 <= y + h]
        downstream = [n for n, x, y, w, h in nodes if 0 <= x - x1 < 20 and y <= y1 <= y + h]
        edges.update((u, d) for u in upstream for d in downstream)
    return edges


def _screenshot(driver: WebDriver, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    assert driver.save_screenshot(str(path)), path
    print(f"screenshot: {path}")
    return path


def benchmark_result() -> BenchmarkResult:
    """A drafter_benchmark result of three arms at concurrencies 1, 4 and 16: the drafter wins at 1 and 4, the
    target alone at 16, where it is served."""

    def level(concurrency: int, latency: float, wall_s: float, spread: int) -> Measured:
        # acceptance differs per prompt: the speculative arms' latencies spread (the interval's source)
        records = [
            RequestRecord(i, 128, [7] * 128, "x", latency * (1 + i * spread % 5 / 10), 0.05, latency) for i in range(16)
        ]
        return Measured(concurrency, records, wall_s, None)

    walls = {"baseline": (20.0, 8.0, 4.0), "K3": (12.0, 6.0, 5.0), "K5": (11.0, 6.5, 6.0)}

    def arm(name: str, config: SpeculativeConfig | None, tau: float | None) -> ArmResult:
        levels = [level(c, w / 16, w, 3 if config else 1) for c, w in zip((1, 4, 16), walls[name], strict=True)]
        return ArmResult(name, config, levels, Acceptance(tau, [0.8, 0.6, 0.4]) if tau else None)

    arms = [arm("K3", SpeculativeConfig(3), 2.4), arm("K5", SpeculativeConfig(5), 2.9)]
    return BenchmarkResult("sglang", arm("baseline", None, None), arms, [SpeculativeConfig(5, 4, 16)], 16)


# -- the test ---------------------------------------------------------------------------------------


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("EAGLE3_UI_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def reduced_pipeline(root: Path, endpoint: str, tokenizer: Path) -> Path:
    for index, dataset in enumerate(DATASETS):
        write_jsonl(root / f"{dataset}.jsonl", [sharegpt(f"Name a colour, {index}-{i}.") for i in range(3)])
    document = {
        "name": "ui",
        "artifacts_root": "out",
        "target": {"model": "fake", "tokenizer": str(tokenizer)},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": endpoint}]},
        "generation": {"max_tokens": 8, "concurrency": 2},
        "health": {"max_truncation_rate": 1.0},
        "datasets": [{"id": d, "source": f"{d}.jsonl"} for d in DATASETS],
    }
    path = root / "pipeline.yaml"
    path.write_text(json.dumps(document))
    return path


def test_ui_shows_lineage_a_materialization_and_the_health_history(
    tmp_path: Path,
    local_model: Path,
    fake_openai: FakeOpenAI,
    screenshots: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: apt-get install -y chromium chromium-driver")
    config = reduced_pipeline(tmp_path, fake_openai.base_url, local_model)
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home)}

    # What the UI shows comes from generation_job (each partition's materialization and preflight): the
    # main job's own runs of it, without its downstream job (the main job end to end is test_e2e.py's).
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    loaded = load_config(config)
    with dg.DagsterInstance.get() as instance:
        main_job = MainJob(loaded, build_definitions(loaded), instance, io.StringIO())
        for dataset in DATASETS:
            main_job.execute("generation_job", dataset)

    monitor = HealthMonitor(loaded)
    try:
        report, _ = monitor.tick()
    finally:
        monitor.close()
    assert report.healthy, report.summary()
    with dg.DagsterInstance.get() as instance:
        instance.report_runless_asset_event(health_observation(report))  # as each sensor tick does

    location = location_file(tmp_path, config)
    with (
        dagster_dev(env, tmp_path, tmp_path / "dagster_dev.log", location) as base,
        chromium(tmp_path / "chromium") as driver,
    ):
        _open(driver, f"{base}/assets/responses?view=lineage", "prompts", "responses", "training_data")
        edges = _lineage_edges(driver)
        assert {("prompts", "responses"), ("responses", "training_data")} <= edges, edges
        _screenshot(driver, screenshots, "1_asset_graph")

        catalog = _open(driver, f"{base}/assets", "inference_server", "prompts", "responses", "training_data")
        assert "target_model" not in catalog  # the endpoints profile has no embedded model to prepare
        _screenshot(driver, screenshots, "2_asset_catalog")

        partition = _open(
            driver,
            f"{base}/assets/responses?view=partitions&partition=B1",
            "Materialized",
            "rows\n3",
            "truncation_rate",
            "latency_p50_s",
            "tokens_per_s",
            "preview",
        )
        assert "B1" in partition
        rows = driver.find_element(By.XPATH, "//*[normalize-space(text())='rows']")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", rows)
        _screenshot(driver, screenshots, "3_responses_B1_materialization")

        history = _open(
            driver,
            f"{base}/assets/inference_server?view=events",
            "overall\nok",
            "healthy\ntrue",
            "check/generation\nok",
            "1-token completion from " + fake_openai.base_url,
        )
        observations = re.findall(r"^[A-Z][a-z]{2} \d{1,2}, \d{1,2}:\d{2} [AP]M$", history, flags=re.MULTILINE)
        assert len(observations) >= 3, history[:1500]  # each run's preflight (B1, B2) and the tick
        _screenshot(driver, screenshots, "4_inference_server_health_history")

        # a managed server's start, as the pipeline records each start and stop of it (components/managed.py)
        start = ServerEvent(
            "started",
            "serving",
            "generation",
            "responses B1 needs the generation server",
            21.5,
            {"pid": 4242, "port": 30000, "command": "python -m sglang.launch_server --port 30000"},
        )
        with dg.DagsterInstance.get() as instance:
            instance.report_runless_asset_event(server_event_observation(start))
        _open(
            driver,
            f"{base}/assets/inference_server?view=events",
            "event\nstarted",
            "reason\nresponses B1 needs the generation server",
            "gpus_held_by\ngeneration",
            "duration_s\n21.5",
        )
        _screenshot(driver, screenshots, "5_inference_server_managed_start")

        # drafter_benchmark's materialization: the table, the bar chart and the configuration it chose
        result = benchmark_result()
        with dg.DagsterInstance.get() as instance:
            instance.report_runless_asset_event(
                dg.AssetMaterialization("drafter_benchmark", metadata=shown(result.as_metadata()))
            )
        page = _open(
            driver,
            f"{base}/assets/drafter_benchmark?view=events",
            "chosen\nbaseline",
            "serve_concurrency\n16",
            "speedup_best@c1",
            "concurrency 16 (output tokens/s)",  # the bar chart, inline; the table opens from [Show Markdown]
        )
        assert "K5·top1·6" in page and "[Show Markdown]" in page, page[-2000:]
        label = driver.find_elements(By.XPATH, "//*[normalize-space(text())='table']")[-1]
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", label)
        _screenshot(driver, screenshots, "6_drafter_benchmark")
