"""Served model names as vLLM gives them: --model as typed (a Hub id, a directory's name), or
--served-model-name (one or more); /v1/models lists each with its root and max_model_len."""

from __future__ import annotations

import pytest

from common.launcher import build_arg_parser, served_names
from gateway.config import GatewayConfig
from gateway.main import build_arg_parser as gateway_parser
from gateway.main import config_from_args
from gateway.model_info import (
    ServedModel,
    default_served_names,
    hub_id_of_snapshot,
    max_model_len,
    model_root,
)


def test_default_name_is_what_the_user_typed(tmp_path):
    local = tmp_path / "my-llava"
    local.mkdir()
    # vLLM answers to the path as typed; the folder's name is kept as a second name.
    assert default_served_names(str(local)) == [str(local), "my-llava"]
    assert default_served_names("llava-hf/llava-1.5-7b-hf") == ["llava-hf/llava-1.5-7b-hf"]
    snapshot = tmp_path / "models--llava-hf--llava-1.5-7b-hf" / "snapshots" / ("0" * 40)
    assert hub_id_of_snapshot(snapshot) == "llava-hf/llava-1.5-7b-hf"
    assert default_served_names(snapshot) == ["llava-hf/llava-1.5-7b-hf"]  # what `up` hands the gateway
    assert model_root(snapshot) == "llava-hf/llava-1.5-7b-hf"
    assert default_served_names(None) == ["mmserve"]


def test_up_passes_the_typed_name_or_the_flag(tmp_path):
    parser = build_arg_parser()
    assert served_names(parser.parse_args([])) == ["tiny"]
    assert served_names(parser.parse_args(["--model", "llava-hf/llava-1.5-7b-hf"])) == [
        "llava-hf/llava-1.5-7b-hf"]
    args = parser.parse_args(["--model", "llava-hf/x", "--served-model-name", "a", "b"])
    assert served_names(args) == ["a", "b"]


def test_gateway_takes_several_names_in_either_form():
    parser = gateway_parser()
    config = config_from_args(parser.parse_args(["--decoder", "h:1", "--served-model-name", "a", "b",
                                                 "--served-model-name=c"]))
    assert config.served_model_names == ["a", "b", "c"] and config.served_model_name == "a"
    with pytest.raises(ValueError, match="given twice"):
        GatewayConfig(decoders=["h:1"], served_model_names=["a", "a"])


def test_models_card_has_root_and_max_model_len(tiny_model_dir):
    served = ServedModel(("tiny", "alias"), model_root(tiny_model_dir), max_model_len(tiny_model_dir))
    card = served.card("alias", 1)
    assert card["id"] == "alias" and card["root"] == str(tiny_model_dir) and card["parent"] is None
    (permission,) = card["permission"]  # vLLM's one model_permission entry
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True
    assert card["max_model_len"] == 1024  # the tiny preset's max_position_embeddings
    assert "max_model_len" not in ServedModel(("x",)).card("x", 1)


def test_up_hint_names_a_real_model_of_the_served_family(tiny_model_dir, qwen_model_dir, qwen3_model_dir):
    from common.launcher import random_weights_note

    expected = {tiny_model_dir: "llava-hf/llava-1.5-7b-hf", qwen_model_dir: "Qwen/Qwen2.5-VL-7B-Instruct",
                qwen3_model_dir: "Qwen/Qwen3-VL-8B-Instruct"}
    for model, real in expected.items():
        note = random_weights_note(model)
        assert note.endswith(f"mmserve up --model {real}")
        assert "--device" not in note and "--dtype" not in note  # auto picks both
