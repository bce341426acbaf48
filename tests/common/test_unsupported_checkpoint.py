"""A checkpoint whose image configuration cannot be served stops both services at start-up with one line
(exit 2), instead of failing every image request later."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cli_errors import assert_usage_error, run_cli


@pytest.fixture(scope="module")
def mismatched(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint with a processor that expands each image to one token fewer than the tower's
    feature rows (num_additional_image_tokens 0 on a CLIP tower, "default" strategy)."""
    out = tmp_path_factory.mktemp("mismatched")
    for path in tiny_model_dir.iterdir():
        shutil.copy(path, out / path.name)
    processor = json.loads((out / "processor_config.json").read_text())
    processor["num_additional_image_tokens"] = 0
    (out / "processor_config.json").write_text(json.dumps(processor))
    return out


@pytest.mark.parametrize("command", [["decoder", "--encoder", "127.0.0.1:1"], ["encoder"]])
def test_start_up_refuses_with_the_reason(mismatched, command):
    result = run_cli(*command, "--model", str(mismatched), "--port", "0", timeout=120)
    assert_usage_error(result, "the processor would expand each image to 15 tokens",
                       "gives 16 feature rows")
