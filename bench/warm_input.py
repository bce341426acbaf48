"""Host work a warm Qwen request pays before its step, on a CPU: token spans and M-RoPE positions.

    python -m bench.warm_input --model DIR [--repeats 50] [--out warm_input.json]

DIR: a Qwen2.5-VL checkpoint (its tokenizer only; `mmserve make-model qwen2.5-vl-tiny DIR` will do).
Measured, milliseconds per call (minimum over repeats): tokenizing a prompt with one 1369-token image
and one with a 7800-token video (the placeholder spans included), and the M-RoPE positions of a
one-image prompt and of a Qwen3-VL-shaped video of 30 timed groups. It uses only functions that
existed before issue 65, so the same file run against an older tree measures it (PYTHONPATH=OLD_TREE
python bench/warm_input.py ...).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

from bench.report import print_table, save_result
from common.families.qwen2_5_vl.layout import mrope_positions
from decoder_svc.tokenization import PromptTokenizer, VideoPromptLayout

USER, END = "<|im_start|>user\n", "What happens?<|im_end|>\n<|im_start|>assistant\n"
IMAGE_PROMPT = USER + "<|vision_start|><|image_pad|><|vision_end|>" + END
VIDEO_PROMPT = USER + "<|vision_start|><|video_pad|><|vision_end|>" + END


def best_ms(fn: Callable[[], object], repeats: int, number: int = 10) -> float:
    """Minimum milliseconds per call over `repeats` rounds of `number` calls (after one call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e3


def video_groups(groups: int = 30, grid: tuple[int, int, int] = (1, 16, 32), text: int = 8
                 ) -> tuple[int, list]:
    """A Qwen3-VL-shaped video: `groups` timed spans of one grid with `text` tokens between them."""
    spans, offset = [], 20
    tokens = grid[0] * grid[1] * grid[2] // 4
    for _ in range(groups):
        spans.append((offset, grid, 1.0))
        offset += tokens + text
    return offset + 20, spans


def build_arg_parser() -> argparse.ArgumentParser:
    """Options of the warm-input benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench.warm_input", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Qwen2.5-VL checkpoint directory (tokenizer)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Time each case, print and save them."""
    args = build_arg_parser().parse_args(argv)
    args.device = "cpu"
    tok = PromptTokenizer(args.model)
    n_video, groups = video_groups()
    cases: dict[str, Callable[[], object]] = {
        "tokenize, one 1369-token image": lambda: tok.encode_prompt(IMAGE_PROMPT, image_token_counts=[1369]),
        "tokenize, a 7800-token video": lambda: tok.encode_prompt(VIDEO_PROMPT,
                                                                 videos=[VideoPromptLayout(1, 7800)]),
        "M-RoPE, one 1369-token image": lambda: mrope_positions(20 + 1369 + 20, [(20, (1, 74, 74))], 2),
        f"M-RoPE, a video of 30 groups ({n_video} tokens)": lambda: mrope_positions(n_video, groups, 2),
    }
    results = {name: best_ms(fn, args.repeats) for name, fn in cases.items()}
    print_table("warm request host work (ms per call)", ["case", "ms"], list(results.items()))
    return save_result("warm_input", args, results)


if __name__ == "__main__":
    main()
