"""The GPU's SM clock and power while a benchmark level runs, sampled by `nvidia-smi` in the background: a
sustained load can run the card below the clock a short tower benchmark sees (power or thermal limits), so
a level's rate is read beside its clocks.

    with GpuClocks() as clocks:
        run_level()
    clocks.summary()   # {"sm_mhz_median": ..., "sm_mhz_min": ..., "power_w_median": ..., "samples": n}

Where `nvidia-smi` is missing (a CPU host) the summary is empty.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading


class GpuClocks:
    """Samples `nvidia-smi` every `interval_ms` between __enter__ and __exit__ (GPU `index`)."""

    def __init__(self, interval_ms: int = 200, index: int = 0) -> None:
        self.interval_ms, self.index = interval_ms, index
        self.samples: list[tuple[float, float]] = []  # (SM MHz, watts)
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuClocks:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        self._proc = subprocess.Popen(
            [exe, f"--id={self.index}", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             f"-lms={self.interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((float(parts[0]), float(parts[1])))
            except (IndexError, ValueError):  # "[N/A]" on a card without the field
                continue

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        if self._reader is not None:
            self._reader.join(timeout=5)

    def summary(self) -> dict:
        """Median and minimum SM clock (MHz) and median power (W) over the samples; {} without any."""
        if not self.samples:
            return {}
        clocks = [c for c, _ in self.samples]
        return {"sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
                "power_w_median": statistics.median(w for _, w in self.samples), "samples": len(self.samples)}
