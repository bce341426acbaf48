"""What an image will cost the vision tower, estimated before any work, and the cap on it.

The estimate is the image's embedding size (its tokens after resizing, in bytes) times the tower's
measured cost per embedding byte so far: the worker's seconds in tower batches over the bytes those
batches made. Until the tower has run (nothing measured) nothing is refused. The cost per token grows
with an image's size (full attention), so a far larger image than those measured costs more than
estimated: the cap refuses what is clearly out of reach, it does not promise a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.errors import ServiceError, invalid_argument


@dataclass
class ImageCostCap:
    """max_seconds: the most estimated tower seconds one image may cost (0: no cap). measured(): the
    tower's (seconds, embedding bytes made) so far."""

    max_seconds: float
    measured: Callable[[], tuple[float, int]]

    def seconds_for(self, nbytes: int) -> float | None:
        """The estimated tower seconds of an image whose embedding is nbytes; None before any measure."""
        seconds, made = self.measured()
        if made <= 0 or seconds <= 0:
            return None
        return nbytes * seconds / made

    def check(self, index: int, height: int, width: int, nbytes: int) -> None:
        """INVALID_ARGUMENT naming image `index`, the estimate and the flag when it is over the cap."""
        if self.max_seconds <= 0:
            return
        estimate = self.seconds_for(nbytes)
        if estimate is not None and estimate > self.max_seconds:
            raise self.refusal(index, height, width, estimate)

    def refusal(self, index: int, height: int, width: int, estimate: float) -> ServiceError:
        return invalid_argument(
            f"image {index}: {width}x{height} would take an estimated {estimate:.0f} s of this encoder's "
            f"vision tower (its size after resizing x the tower's measured cost); the limit is "
            f"{self.max_seconds:g} s an image (--max-image-seconds): send a smaller image or a lower "
            f"max_pixels")
