"""bench.n_choices_rss on the tiny model runs its cases on fresh services and reports each one's RSS growth
(that it ran and reported: the sizes themselves are not checked here)."""

from __future__ import annotations

import json

from bench import n_choices_rss
from bench.n_choices_rss import process_tree


def test_each_case_reports_its_choices_and_growth(tiny_model_dir, tmp_path):
    out = tmp_path / "n_rss.json"
    n_choices_rss.main(["--model", str(tiny_model_dir), "--n", "3", "--image-side", "64", "--max-tokens", "2",
                        "--cases", "n1,n", "--logs", str(tmp_path / "logs"), "--out", str(out)])
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "n_choices_rss" and payload["image_bytes"] > 0
    cases = {r["case"]: r for r in payload["results"]["cases"]}
    assert (cases["n1"]["choices"], cases["n"]["choices"]) == (1, 3)
    for row in cases.values():
        assert {"gateway_growth_mb", "decoder_growth_mb", "seconds"} <= row.keys()
    assert set(payload["results"]["n_over_n1"]) == {"gateway", "decoder"}


def test_the_process_tree_holds_the_process_itself():
    import os

    assert process_tree(os.getpid())[0] == os.getpid()
