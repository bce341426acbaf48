"""Client side of the gateway's GET /health, for `mmserve up` and compose healthchecks.

    python -m gateway.health http://127.0.0.1:8000/health     # exit 0 when a decoder is SERVING
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request


def http_healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether url answers 200 (the gateway reaches at least one SERVING decoder)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until_http_healthy(url: str, timeout: float, interval: float = 0.2, is_alive=lambda: True) -> bool:
    """Poll url until it answers 200; False on timeout or when is_alive() turns False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http_healthy(url, timeout=min(2.0, timeout)):
            return True
        if not is_alive():
            return False
        time.sleep(interval)
    return False


if __name__ == "__main__":
    sys.exit(0 if http_healthy(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/health") else 1)
