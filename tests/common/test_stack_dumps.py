"""`kill -USR1` on a service process prints every thread's stack to its log and it goes on
(common/startup.dump_stacks_on_signal, registered by GrpcService, the engine core and decode processes)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

_PROCESS = textwrap.dedent("""
    import sys, threading, time
    from common.server import GrpcService
    GrpcService("probe")  # registers the handler, as every service does
    def stuck_worker():
        time.sleep(60)
    threading.Thread(target=stuck_worker, name="tower", daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()  # the signal arrives while this waits
    print("still serving", flush=True)
""")


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
def test_usr1_dumps_every_thread_and_the_process_goes_on():
    proc = subprocess.Popen([sys.executable, "-c", _PROCESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate("go\n", timeout=30)
    finally:
        proc.kill()
    assert out.strip() == "still serving"
    assert "stuck_worker" in err and "Current thread" in err  # the worker's stack and the main thread's
