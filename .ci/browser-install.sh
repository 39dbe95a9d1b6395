#!/bin/sh
# Lines for .ci/run: Debian's chromium for tests/plan/test_simulate_page.py, which
# drives it headless (--dump-dom) to check the `gradsync simulate --html` page.
# Without chromium on PATH that test is skipped (with the reason), not failed.
set -eu
if ! command -v chromium >/dev/null 2>&1; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y chromium
fi
chromium --version
