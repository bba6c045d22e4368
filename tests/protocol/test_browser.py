"""CORS from a real browser: headless Chromium loads a page from another origin whose script calls the server
with a JSON body and an API key (so the browser sends a preflight first). python3 dev.py test installs
Chromium (Debian: apt-get install chromium); without one the test fails, it does not skip."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import threading

import pytest

pytest.importorskip("uvicorn")

from netutil import ROOT, free_port, start_server, stop

KEY = "browser-key"
PAGE = """<!doctype html><html><body>waiting<script>
fetch("http://127.0.0.1:%(port)d/v2/models/mlp/infer", {
  method: "POST", headers: {"Content-Type": "application/json", "Authorization": "Bearer %(key)s"},
  body: JSON.stringify({inputs: [{name: "input", datatype: "FP32", shape: [1, 16], data: Array(16).fill(0.5)}]})
}).then(r => r.json()).then(j => { document.body.textContent = "shape " + JSON.stringify(j.outputs[0].shape); })
  .catch(e => { document.body.textContent = "refused: " + e; });
</script></body></html>"""


def browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def server():
    if browser() is None:  # not skipped: CI must run it, and python3 dev.py test installs Chromium
        pytest.fail("no Chromium on this machine: python3 dev.py test installs it (apt-get install chromium)")
    page_port = free_port()
    running = start_server(str(ROOT / "examples/mlp.py") + ":serving", "--api-key", KEY, "--cors-origin",
                           f"http://127.0.0.1:{page_port}")
    running.page_port = page_port
    yield running
    stop(running)


def page_result(server, page_port: int) -> str:
    """What the page shows after its script ran, loaded from http://127.0.0.1:page_port."""
    page = (PAGE % {"port": server.port, "key": KEY}).encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", page_port), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        result = subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 "--virtual-time-budget=15000", "--dump-dom", f"http://127.0.0.1:{page_port}/"],
                                capture_output=True, text=True, timeout=120)
    finally:
        site.shutdown()
        site.server_close()
    return result.stdout


def test_a_page_from_an_admitted_origin_calls_the_server(server):
    assert "shape [1,4]" in page_result(server, server.page_port)


def test_a_page_from_another_origin_is_refused_by_the_browser(server):
    dom = page_result(server, free_port())
    assert "refused: TypeError: Failed to fetch" in dom and "shape" not in dom


