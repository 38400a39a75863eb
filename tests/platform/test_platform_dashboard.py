"""The dashboard end to end, in headless Chromium: a real platform daemon, a real ``fireflyer platform serve``,
real tasks, and Debian's chromium driven by Selenium (``.ci/setup-browser`` installs it).

A user signs in with the token ``fireflyer platform user add`` printed, sees their running task (named
``<script>alert(1)</script>``, which must show as text and run nothing), opens it, suspends it, and sees it go
to suspending and then held. A wrong token gets the login error; a token revoked while its page is open sends
the page back to the login form; a user never sees another user's task while an admin sees both. The page is saved as a screenshot (to the test's tmp dir, and to ``$FIREFLYER_SCREENSHOT``
when that is set: ``docs/dashboard.png`` is made that way).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
XSS_NAME = "<script>alert(1)</script>"
WAIT_S = 60.0
TOKEN_RE = re.compile(r"ff_[A-Za-z0-9_-]{43}")
URL_RE = re.compile(r"https?://[0-9A-Za-z.\[\]:-]+:\d+")

# The task: prints a step (and a line of markup, which must show as text) every 0.2 s; on a suspend
# request it says so and hands its nodes back through the platform's handshake.
JOB = """
import time
from fireflyer.platform import client
step = 0
print("attempt", client.attempt(), "starts", flush=True)
while step < 3000:
    if client.receive_suspend_command():
        print("suspend requested at step", step, flush=True)
        client.go_suspend()
    step += 1
    print("step", step, "<b>not bold</b>", flush=True)
    time.sleep(0.2)
"""


def _why_no_browser() -> str | None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        return f"{' and '.join(missing)} missing: run .ci/setup-browser (apt-get install chromium chromium-driver)"
    return None


pytestmark = [pytest.mark.integration, pytest.mark.skipif(_why_no_browser() is not None, reason=_why_no_browser() or "")]
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")

from selenium.common.exceptions import (
    NoAlertPresentException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select


def fireflyer(*args: str, home: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "fireflyer", *args], check=False, capture_output=True, text=True,
                          env={**os.environ, "FIREFLYER_PLATFORM_HOME": str(home)}, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"fireflyer {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def wait_for(what: str, cond: Callable[[], Any], timeout: float = WAIT_S, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except (StaleElementReferenceException, WebDriverException) as exc:  # the page redrew under us
            last = exc
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}" + (f" (last error: {last})" if last else ""))


class Server:
    """``fireflyer platform serve --port 0`` in its own session; its URL read from its stdout."""

    def __init__(self, home: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fireflyer", "platform", "serve", "--home", str(home), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_url(30.0)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            self.lines.put(line)

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            m = URL_RE.search(line)
            if m:
                url = m.group(0).rstrip("/")
                wait_for("the server to answer /api/health", lambda u=url: _get(u + "/api/health") == {"ok": True}, 30)
                return url
        self.close()
        raise AssertionError(f"'fireflyer platform serve --port 0' printed no URL within {timeout:g} s "
                             f"(exit {self.proc.poll()}): {' | '.join(self.output[-10:])}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _get(url: str, token: str | None = None) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as res:
            return json.load(res)
    except (urllib.error.URLError, ConnectionError, OSError):
        return None


def api(url: str, token: str, method: str = "GET", body: dict | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=15) as res:
        return json.load(res)


class Cluster:
    def __init__(self, home: Path, url: str, tokens: dict[str, str], tasks: dict[str, int]) -> None:
        self.home, self.url, self.tokens, self.tasks = home, url, tokens, tasks

    def state(self, task: int) -> str:
        return api(f"{self.url}/api/tasks/{task}", self.tokens["ops"])["state"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("platform")
    server: Server | None = None
    tokens: dict[str, str] = {}
    tasks: dict[str, int] = {}
    fireflyer("platform", "start", "--home", str(home), "--nodes", "2", "--tick", "0.1", home=home)
    try:
        for name, flags in (("alice", ()), ("bob", ()), ("carol", ()), ("ops", ("--admin",))):
            out = fireflyer("platform", "user", "add", name, *flags, "--home", str(home), home=home).stdout
            m = TOKEN_RE.search(out)
            assert m, f"'fireflyer platform user add {name}' printed no token: {out!r}"
            tokens[name] = m.group(0)
        server = Server(home)
        c = Cluster(home, server.url, tokens, tasks)
        job = tmp_path_factory.mktemp("job") / "job.py"
        job.write_text(JOB)

        def submit(key: str, user: str, name: str) -> int:
            t = api(f"{c.url}/api/tasks", tokens[user], "POST",
                    {"nodes": 1, "command": [sys.executable, str(job)], "name": name, "priority": "NORMAL"})
            tasks[key] = int(t["id"])
            return tasks[key]

        # two nodes: alice's and bob's tasks run; alice's second one waits, and takes the node her first
        # one gives back when it is suspended
        for key, user, name in (("alice", "alice", XSS_NAME), ("bob", "bob", "bob-training")):
            task = submit(key, user, name)
            wait_for(f"{user}'s task {task} to run", lambda t=task: c.state(t) == "running")
        submit("alice-next", "alice", "alice-eval")
        yield c
    finally:
        if server is not None:
            for task in tasks.values():
                try:
                    api(f"{server.url}/api/tasks/{task}/stop", tokens["ops"], "POST")
                except (urllib.error.URLError, OSError):
                    pass  # finished already (409) or the server is gone: the daemon's stop below still runs
            server.close()
        subprocess.run([sys.executable, "-m", "fireflyer", "platform", "stop", "--home", str(home)],
                       check=False, capture_output=True, timeout=60)
        _kill_leftover_tasks(home)


def _kill_leftover_tasks(home: Path) -> None:
    """Whatever the platform still runs once the daemon is stopped (normally nothing: every task was stopped)."""
    from fireflyer.platform.layout import Home
    from fireflyer.platform.executors.local import kill_active

    kill_active(Home(home))


@pytest.fixture
def browser() -> Iterator[Any]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1360,1000", "--force-device-scale-factor=1"):
        opts.add_argument(flag)
    opts.unhandled_prompt_behavior = "ignore"  # an alert stays open, so the test sees it
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def sign_in(driver: Any, url: str, token: str) -> None:
    driver.get(url + "/")
    wait_for("the login form", lambda: driver.find_element(By.ID, "token").is_displayed(), 30)
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#login-form button[type=submit]").click()


def row(driver: Any, task: int) -> Any:
    rows = driver.find_elements(By.CSS_SELECTOR, f'#task-rows tr[data-id="{task}"]')
    return rows[0] if rows else None


def row_state(driver: Any, task: int) -> str | None:
    r = row(driver, task)
    return r.get_attribute("data-state") if r is not None else None


def assert_no_alert(driver: Any) -> None:
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018  (reading it is what raises)


def save_screenshot(driver: Any, path: Path) -> None:
    """The whole page, not just the window: the viewport is made as tall as the page first."""
    driver.execute_script("document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0)")
    height = driver.execute_script("return Math.ceil(document.documentElement.scrollHeight)")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 1360, "height": min(max(int(height), 800), 4000), "deviceScaleFactor": 1, "mobile": False})
    time.sleep(0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(path)), f"could not save a screenshot to {path}"


def test_sign_in_see_the_running_task_suspend_it_and_see_it_held(cluster: Cluster, browser: Any,
                                                                   tmp_path: Path) -> None:
    task = cluster.tasks["alice"]
    sign_in(browser, cluster.url, cluster.tokens["alice"])
    wait_for("the signed-in user's name", lambda: browser.find_element(By.ID, "me-name").text == "alice", 30)
    wait_for(f"task {task} to show as running", lambda: row_state(browser, task) == "running")

    # the name is text, not markup: the cell reads it back literally, no <script> was made, nothing alerted
    name_cell = row(browser, task).find_element(By.CSS_SELECTOR, "td.name")
    assert name_cell.text == XSS_NAME
    assert browser.find_elements(By.CSS_SELECTOR, "#task-rows script, #detail script") == []
    assert_no_alert(browser)

    # the detail: chain history and the log tail, which is also text
    row(browser, task).click()
    wait_for("the task's detail", lambda: browser.find_element(By.ID, "detail").is_displayed(), 30)
    wait_for("the detail's title with the name as text",
             lambda: XSS_NAME in browser.find_element(By.ID, "detail-title").text, 30)
    wait_for("the log tail", lambda: "step" in browser.find_element(By.ID, "log").text)
    assert "<b>not bold</b>" in browser.find_element(By.ID, "log").text
    assert browser.find_elements(By.CSS_SELECTOR, "#log b") == []
    wait_for("the 'started' event in the history",
             lambda: "started" in browser.find_element(By.ID, "events").text, 30)

    # suspend from the table: the state moves to suspending, then held, which offers resume instead
    def click_suspend() -> bool:
        r = row(browser, task)
        buttons = r.find_elements(By.CSS_SELECTOR, 'button[data-action="suspend"]') if r is not None else []
        if not buttons:
            return False
        buttons[0].click()
        return True

    wait_for("a suspend button to click", click_suspend, 30)
    seen = wait_for("the state to change from running",
                    lambda: row_state(browser, task) in ("suspending", "held") and row_state(browser, task))
    assert seen in ("suspending", "held")
    wait_for("the task to be held", lambda: row_state(browser, task) == "held")
    assert cluster.state(task) == "held"
    r = row(browser, task)
    assert [b.text for b in r.find_elements(By.CSS_SELECTOR, "button[data-action]")] == ["resume", "stop"]
    wait_for("the suspend in the chain history", lambda: "suspend" in browser.find_element(By.ID, "events").text, 30)
    assert_no_alert(browser)
    assert browser.find_element(By.ID, "detail-error").text == ""

    # the node it gave back goes to alice's queued task
    nxt = cluster.tasks["alice-next"]
    wait_for(f"alice's queued task {nxt} to run on the freed node", lambda: row_state(browser, nxt) == "running")

    # the last five minutes in the chart, then the page as it is now
    Select(browser.find_element(By.ID, "hours")).select_by_visible_text("5 min")
    wait_for("the utilisation chart", lambda: browser.find_elements(By.CSS_SELECTOR, "#chart svg path.line"), 30)
    save_screenshot(browser, tmp_path / "dashboard.png")
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    if os.environ.get("FIREFLYER_SCREENSHOT"):
        target = Path(os.environ["FIREFLYER_SCREENSHOT"])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "dashboard.png", target)


def test_a_wrong_token_gets_the_login_error(cluster: Cluster, browser: Any) -> None:
    sign_in(browser, cluster.url, "ff_" + "x" * 43)
    error = wait_for("the login error", lambda: browser.find_element(By.ID, "login-error").text, 30)
    assert "Sign-in failed" in error
    assert not browser.find_element(By.ID, "app").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('fireflyer.token')") is None


def test_a_user_sees_only_their_own_tasks_and_an_admin_sees_all(cluster: Cluster, browser: Any) -> None:
    alice, bob = cluster.tasks["alice"], cluster.tasks["bob"]
    sign_in(browser, cluster.url, cluster.tokens["bob"])
    wait_for("bob's task in the table", lambda: row(browser, bob) is not None)
    assert row(browser, alice) is None, "a user sees another user's task"
    assert row(browser, cluster.tasks["alice-next"]) is None
    assert XSS_NAME not in browser.find_element(By.ID, "task-rows").text

    browser.find_element(By.ID, "logout").click()
    wait_for("the login form after logging out", lambda: browser.find_element(By.ID, "login").is_displayed(), 30)
    assert browser.execute_script("return sessionStorage.getItem('fireflyer.token')") is None

    sign_in(browser, cluster.url, cluster.tokens["ops"])
    wait_for("both users' tasks for the admin", lambda: row(browser, alice) is not None and row(browser, bob) is not None)
    assert browser.find_element(By.ID, "me-role").text == "admin"
    # the node grid shows bob's task on a node, by zone, with each node's state in its tile
    tiles = wait_for("the node grid", lambda: browser.find_elements(By.CSS_SELECTOR, "#nodes .node"), 30)
    assert len(tiles) == 2
    assert any(t.get_attribute("data-state") == "busy" for t in tiles)
    assert all(t.get_attribute("title") for t in tiles)
    assert_no_alert(browser)


def test_a_token_revoked_while_signed_in_sends_the_page_back_to_the_login_form(cluster: Cluster,
                                                                               browser: Any) -> None:
    sign_in(browser, cluster.url, cluster.tokens["carol"])
    wait_for("carol's page", lambda: browser.find_element(By.ID, "me-name").text == "carol", 30)
    # carol has no tasks, and sees no one else's
    wait_for("the empty task table", lambda: browser.find_element(By.ID, "no-tasks").is_displayed(), 30)
    assert browser.find_elements(By.CSS_SELECTOR, "#task-rows tr") == []
    fireflyer("platform", "user", "revoke", "carol", "--home", str(cluster.home), home=cluster.home)
    error = wait_for("the login form with the server's reason",
                     lambda: browser.find_element(By.ID, "login").is_displayed()
                     and browser.find_element(By.ID, "login-error").text, 30)
    assert error.startswith("Signed out:")
    assert not browser.find_element(By.ID, "app").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('fireflyer.token')") is None
