"""Where a request's time to first token goes: the TTFT split into stages that add up to it.

    input     the front end: message checks, image headers and grids, decoding and hashing images it
              does not know, tokenizing (and waiting for an input lane)
    submit    the request crossing to the engine core process (pickled, through the pipe)
    inbox     there, waiting for the core's loop to take it: the step in progress must end
    encode    waiting, once queued, for the embeddings of the images its prefill needs (0 when every
              image was ready, skipped by a prefix hit, or there was none)
    queue     inputs ready, waiting for the step that finishes its prompt: other requests' steps and the
              earlier chunks of a long prompt
    prefill   that step: its last prompt chunk computed and the first token sampled
    output    the first token back to the front end and handed to the stream

Every stamp is `time.monotonic()` (one clock for both processes on a host). The front end stamps
`received` and `made`, the core's command reader `arrived`, its loop `added`, `images_ready`,
`step_started` and `sampled`; the stamps travel in the Request to the core and back on its first
output, and the front end adds `delivered`.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.stats import stat

STAGES = ("input", "submit", "inbox", "encode", "queue", "prefill", "output")


@dataclass
class RequestTimes:
    """Monotonic stamps of one request up to its first token; 0.0 until reached."""

    received: float = 0.0      # the front end got the call
    made: float = 0.0          # input processing done: the Request exists
    arrived: float = 0.0       # read off the pipe by the engine core (0: made in the core's process)
    added: float = 0.0         # queued in the engine
    images_ready: float = 0.0  # the last embedding its prefill waited for arrived (0: none waited for)
    step_started: float = 0.0  # the step that sampled its first token began
    sampled: float = 0.0       # that step ended

    def note_image_ready(self, now: float) -> None:
        """An embedding arrived: the latest arrival is the one the prefill waited for."""
        self.images_ready = max(self.images_ready, now)


def split_ttft(times: RequestTimes, delivered: float) -> dict[str, float]:
    """Seconds per stage (STAGES) of one request whose first token reached its stream at `delivered`.
    The stages add up to delivered - received; a stamp never reached counts as the one before it."""
    made = max(times.made, times.received)
    arrived = max(times.arrived, made)
    added = max(times.added, arrived)
    ready = max(times.images_ready, added)
    step = max(times.step_started, ready)
    sampled = max(times.sampled, step)
    end = max(delivered, sampled)
    return {"input": made - times.received, "submit": arrived - made, "inbox": added - arrived,
            "encode": ready - added,
            "queue": step - ready, "prefill": sampled - step, "output": end - sampled}


@dataclass
class FirstTokenStats:
    """The front end's sums of the TTFT split (names as in the API's DecoderStats)."""

    ttft_stage_seconds: dict = stat("Seconds of time to first token per stage (input, submit, inbox, "
                                    "encode, queue, prefill, output)", "labels", label="stage",
                                    metric="first_token_stage_seconds")
    ttft_calls: int = stat("Requests that produced a first token (the stage sums' count)")
