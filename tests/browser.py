"""Load a page in real headless Debian chromium and read back what a test harness saw.

A page under test gets ``HEAD`` (records errors and console.error calls) plus a
page-specific tail script that writes its findings as JSON into
``<pre id="gs-test-result">``; ``run_page`` loads it with ``--dump-dom`` and
returns that JSON, failing on any error or console message.
"""

import json
import re
import shutil
import subprocess

import pytest

HEAD = """<script>window.__gsErrors=[];
window.addEventListener('error',function(e){__gsErrors.push(String(e.message));});
var __ce=console.error;console.error=function(){__gsErrors.push(Array.from(arguments).join(' '));};
</script>"""


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


needs_chromium = pytest.mark.skipif(
    chromium() is None, reason="no chromium on PATH; .ci/browser-install.sh installs Debian's")


def run_page(page: str, tail: str, tmp_path) -> dict:
    """Inject HEAD and ``tail`` into ``page``, load it headless, return the harness's JSON."""
    page = page.replace("<head>", "<head>" + HEAD, 1).replace("</body>", tail + "</body>", 1)
    path = tmp_path / "page.html"
    path.write_text(page, encoding="utf-8")
    proc = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
         "--v=0", "--user-data-dir=" + str(tmp_path / "profile"), "--virtual-time-budget=5000",
         "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=90,
    )
    m = re.search(r'<pre id="gs-test-result">(.*?)</pre>', proc.stdout, re.S)
    assert m, f"harness output missing; chromium rc={proc.returncode}: {proc.stderr[-2000:]}"
    out = json.loads(m.group(1).replace("&quot;", '"').replace("&lt;", "<")
                     .replace("&gt;", ">").replace("&amp;", "&"))
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    assert out["errors"] == [] and console == [], (out["errors"], console)
    return out
