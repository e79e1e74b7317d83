"""JupyterLab, headless Chromium and Playwright: the pieces the browser test drives.

`Lab` starts one JupyterLab server on 127.0.0.1 (fixed token, announcements and the extension
manager off, its config, settings and workspaces in a throwaway folder) over a throwaway copy of
the repository, so autosave never touches the checkout; `browser` starts Debian's `chromium`
through Playwright (never a browser download). Both always stop: they are context managers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "megatron-edu-browser-test"
KERNEL = "megatron-edu"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# JupyterLab plugins a learner's first visit does not need (and whose pop-ups would cover cells).
DISABLED = ["@jupyterlab/apputils-extension:announcements",
            "@jupyterlab/extensionmanager-extension"]
# windowingMode "none": every cell stays in the page, so a widget far down can be found and moved.
SETTINGS = {"@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"}}


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    raise SystemExit("no chromium on PATH: `make test-browser` installs Debian's (apt-get install "
                     "chromium); this test never downloads a browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_repository(dest: Path) -> None:
    """The tracked files (and untracked, not ignored ones) as they are in the working tree."""
    try:
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                "--exclude-standard"], cwd=ROOT, check=True,
                               capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but caches
        ignore = shutil.ignore_patterns(".venv*", ".git", "runs", "__pycache__", ".*_cache")
        shutil.copytree(ROOT, dest, ignore=ignore, dirs_exist_ok=True)
        return
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


class Lab(contextlib.AbstractContextManager):
    """One JupyterLab server over a throwaway copy of the repository; stopped on exit."""

    def __init__(self, log=print):
        self.log = log
        self.tmp = Path(tempfile.mkdtemp(prefix="megatron-edu-lab-"))
        self.copy = self.tmp / "repo"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Lab:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        self.copy.mkdir()
        _copy_repository(self.copy)
        config, settings = self.tmp / "config", self.tmp / "settings"
        (config / "labconfig").mkdir(parents=True)
        (config / "labconfig" / "page_config.json").write_text(
            json.dumps({"disabledExtensions": dict.fromkeys(DISABLED, True)}))
        for name, values in SETTINGS.items():
            (settings / name).parent.mkdir(parents=True, exist_ok=True)
            (settings / name).write_text(json.dumps(values))
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config),
               "JUPYTER_DATA_DIR": str(self.tmp / "data"),  # kernels: the venv's only (sys-prefix)
               "JUPYTER_RUNTIME_DIR": str(self.tmp / "runtime"),
               "JUPYTERLAB_SETTINGS_DIR": str(settings),
               "JUPYTERLAB_WORKSPACES_DIR": str(self.tmp / "workspaces")}
        self.server_log = open(self.tmp / "server.log", "w")  # noqa: SIM115 (closed in __exit__)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={self.copy}",
             "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI containers run as root
            env=env, cwd=self.copy, stdout=self.server_log, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited at start:\n{self.server_tail()}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.url}/api/status?token={TOKEN}", timeout=2)
                kernels = json.load(urllib.request.urlopen(
                    f"{self.url}/api/kernelspecs?token={TOKEN}", timeout=5))["kernelspecs"]
                if KERNEL not in kernels:
                    raise RuntimeError(f"JupyterLab has no {KERNEL!r} kernel (it has "
                                       f"{sorted(kernels)}): run `make kernel`")
                return
            time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer within 60 s:\n{self.server_tail()}")

    def server_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.tmp / "server.log").read_text().splitlines()[-lines:])
        return ""

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, 15)  # the server and the kernels it started
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(self.process.pid, 9)
                self.process.wait(timeout=15)
        if hasattr(self, "server_log"):
            self.server_log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def browser(width: int = 1400, height: int = 1000):
    """A page in headless Debian chromium, a fresh profile; browser and driver stopped on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS,
                                     headless=True, timeout=60_000)
        try:
            context = chromium.new_context(viewport={"width": width, "height": height},
                                           device_scale_factor=1)
            yield context.new_page()
        finally:
            chromium.close()
