"""TensorBoard as a developer sees it: a real 5-step run, ``tensorboard`` serving its dump folder, and
headless Chromium (Selenium + chromedriver) rendering the scalars dashboard's ``loss/global_avg``
chart. The screenshot is kept in the run's dump folder and copied to ``outputs/screenshots/``
(or ``$TESSERA_SCREENSHOT_DIR``); the test prints where.

Needs /usr/bin/chromium, /usr/bin/chromedriver and the ``selenium`` package:
``scripts/install_browser.sh`` installs them (.ci/run calls it); without them the test is skipped
with one line saying so."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.launch import REPO, run_train

pytestmark = pytest.mark.slow  # trains with train.py, starts TensorBoard and a browser

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
STEPS = 5
TAG = "loss/global_avg"
WAIT_SECONDS = 90  # each bounded wait: TensorBoard answering with the tag, the chart rendering
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]

# The scalars dashboard (Polymer, in shadow DOM, which document.body.innerText does not see): the
# tf-scalar-card whose heading says "tag: TAG", as {heading: its visible text, points: the number of
# vertices of its rendered line (an SVG path "M x,y L x,y ..."), top, width}; null while loading.
FIND_CHART = r"""
const tag = arguments[0];
function find(root, selector, found) {
  for (const element of root.querySelectorAll('*')) {
    if (element.matches(selector)) found.push(element);
    if (element.shadowRoot) find(element.shadowRoot, selector, found);
  }
  return found;
}
function caption(heading) {
  const figcaption = (heading.shadowRoot || heading).querySelector('figcaption');
  return figcaption ? figcaption.innerText.replace(/\s+/g, ' ').trim() : '';
}
for (const card of find(document, 'tf-scalar-card', [])) {
  const root = card.shadowRoot || card;
  const heading = find(root, 'tf-card-heading', []).map(caption).join(' ');
  if (!heading.includes('tag: ' + tag)) continue;
  const chart = {heading: heading, points: 0};
  for (const line of find(root, 'path.line', [])) {
    const d = line.getAttribute('d') || '';
    const box = line.getBoundingClientRect();
    if (d && box.width > 0 && box.height > 0) {
      return Object.assign(chart, {points: (d.match(/[ML]/g) || []).length, top: box.top, width: box.width});
    }
  }
  return chart;
}
return null;
"""


def browser_missing() -> str | None:
    """What is missing to drive the browser, as one line; None when everything is there."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if importlib.util.find_spec("selenium") is None:
        missing.append(f"the selenium package in {sys.executable}")
    if not missing:
        return None
    return (
        f"browser test needs {', '.join(missing)}: run scripts/install_browser.sh "
        "(apt-get install -y chromium chromium-driver; pip install selenium)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str) -> str | None:
    """The body at ``url``, or None when nothing answers (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


@contextlib.contextmanager
def tensorboard(logdir: str, log_path: str):
    """Serves ``logdir`` on a free port; yields the base URL once the scalars plugin lists TAG.
    The server is always stopped on the way out."""
    port = free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1"]
    with open(log_path, "w") as log:
        server = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + WAIT_SECONDS
        while TAG not in json.dumps(json.loads(fetch(f"{base}/data/plugin/scalars/tags") or "{}")):
            if server.poll() is not None or time.monotonic() > deadline:
                with open(log_path) as log:
                    reason = "exited" if server.poll() is not None else f"did not list {TAG} in {WAIT_SECONDS} s"
                    pytest.fail(f"tensorboard {reason}; its output:\n{log.read()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)


@contextlib.contextmanager
def chromium(profile_dir: str):
    """A headless Chromium driven through the system's chromedriver, with a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(WAIT_SECONDS)
        yield driver
    finally:
        driver.quit()


def wait_for_chart(driver) -> dict:
    """The loss chart once its line has a vertex per logged step; fails after WAIT_SECONDS."""
    deadline = time.monotonic() + WAIT_SECONDS
    chart = None
    while time.monotonic() < deadline:
        chart = driver.execute_script(FIND_CHART, TAG)
        if chart and chart["points"] >= STEPS:
            time.sleep(1)  # the chart's last transitions, so the screenshot shows the final line
            return driver.execute_script(FIND_CHART, TAG)
        time.sleep(0.5)
    pytest.fail(f"no rendered {TAG} chart after {WAIT_SECONDS} s (last seen: {chart}) at {driver.current_url}")


def keep_screenshot(path: str, capsys) -> str:
    """Copies the screenshot to the stable folder and says where it is."""
    folder = os.environ.get("TESSERA_SCREENSHOT_DIR") or os.path.join(REPO, "outputs", "screenshots")
    os.makedirs(folder, exist_ok=True)
    stable = os.path.join(folder, os.path.basename(path))
    shutil.copyfile(path, stable)
    with capsys.disabled():
        print(f"\nTensorBoard screenshot: {stable} (run's copy: {path})")
    return stable


def test_tensorboard_shows_the_loss_chart(tmp_path, capsys):
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    dump = str(tmp_path / "run")
    run_train(
        dump,
        1,
        *("--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "2"),
        *("--metrics.enable_tensorboard", "true", "--job.run_name", "tb"),
    )
    screenshot = os.path.join(dump, "tensorboard.png")
    with tensorboard(os.path.join(dump, "tb"), os.path.join(dump, "tensorboard.log")) as base:
        with chromium(str(tmp_path / "chromium-profile")) as driver:
            # Only the loss tag, unsmoothed, so the chart is at the top and shows the logged values.
            driver.get(f"{base}/#scalars&tagFilter=%5Eloss%2Fglobal_avg%24&_smoothingWeight=0")
            chart = wait_for_chart(driver)
            driver.save_screenshot(screenshot)
    keep_screenshot(screenshot, capsys)

    assert TAG in chart["heading"], chart  # the card's visible title: "loss/global_avg tag: loss/global_avg"
    assert chart["points"] == STEPS, chart  # one vertex per logged step
    assert chart["width"] > 100 and 0 <= chart["top"] < 1000, chart  # drawn, and on screen
    with open(screenshot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(screenshot) > 20_000
