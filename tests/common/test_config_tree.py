"""The config tree and the flags generated from it: each default is defined once, in the dataclass, and
a config made in code meets the same checks as one made from flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.config import add_options, from_args
from decoder_svc.config import DecoderConfig, EncoderLinkConfig
from decoder_svc.engine.config import EngineConfig
from decoder_svc.main import build_arg_parser
from tests.cli_errors import decoy_model


def _options(cls: type) -> list[dataclasses.Field]:
    out = []
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            out.append(f)
        elif "section" in f.metadata:
            out += _options(f.metadata["section"][1])
    return out


def test_flags_left_out_give_the_dataclass_defaults(tmp_path):
    model = str(decoy_model(tmp_path / "m"))
    args = build_arg_parser().parse_args(["--model", model, "--encoder", "127.0.0.1:1"])
    assert from_args(DecoderConfig, args) == DecoderConfig(
        engine=EngineConfig(model=model), encoders=EncoderLinkConfig(addresses=["127.0.0.1:1"]))


def test_every_flag_reaches_its_field(tmp_path):
    model = str(decoy_model(tmp_path / "m"))
    args = build_arg_parser().parse_args([
        "--model", model, "--encoder", "a:1", "--encoder", "b:2", "--max-num-seqs", "7",
        "--no-prefix-caching", "--enforce-eager", "--kv-cache-bytes", "1000", "--max-tokens-default", "9",
        "--encoder-timeout", "3.5", "--drain-timeout", "4", "--port", "0", "--dtype", "bf16"])
    config = from_args(DecoderConfig, args)
    assert config.encoders == EncoderLinkConfig(["a:1", "b:2"], 5.0, 3.5)
    e = config.engine
    assert (e.max_num_seqs, e.enable_prefix_caching, e.enforce_eager, e.kv_cache_bytes, e.default_max_tokens,
            e.dtype) == (7, False, True, 1000, 9, "bfloat16")
    assert (config.drain_timeout_s, config.port) == (4.0, 0)


def test_a_hybrid_models_state_flags_reach_the_engine(tmp_path):
    model = str(decoy_model(tmp_path / "m"))
    argv = ["--model", model, "--encoder", "a:1", "--num-state-slots", "3", "--num-state-snapshots", "0",
            "--state-snapshot-interval", "4"]
    e = from_args(DecoderConfig, build_arg_parser().parse_args(argv)).engine
    assert (e.num_state_slots, e.num_state_snapshots, e.state_snapshot_interval) == (3, 0, 4)


def test_every_option_has_help_and_a_flag_in_the_parser():
    parser = build_arg_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for f in _options(DecoderConfig):
        assert f.metadata["option"]["help"], f"{f.name} has no help text"
        flag = f.metadata["option"]["flag"] or "--" + f.name.replace("_", "-")
        assert flag in flags


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-bytes", "5", "--num-kv-blocks", "3"], "not allowed with"),
    (["--max-num-seqs", "0"], "must be at least 1"),
    (["--attention-backend", "cuda"], "invalid choice"),
])
def test_bad_flags_are_refused_by_argparse(tmp_path, capsys, argv, message):
    model = str(decoy_model(tmp_path / "m"))
    with pytest.raises(SystemExit) as exc:
        build_arg_parser().parse_args(["--model", model, "--encoder", "a:1", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_config_made_in_code_meets_the_same_checks(tmp_path):
    model = str(decoy_model(tmp_path / "m"))
    with pytest.raises(ValueError, match="--block-size: must be at least 1"):
        EngineConfig(model=model, block_size=0)
    with pytest.raises(ValueError, match="--attention-backend"):
        EngineConfig(model=model, attention_backend="cuda")
    with pytest.raises(ValueError, match="at least one --encoder"):
        DecoderConfig(engine=EngineConfig(model=model))
    with pytest.raises(ValueError, match="--encoder"):
        EncoderLinkConfig(["dns:///"])


def test_an_option_on_by_default_needs_an_off_flag():
    @dataclasses.dataclass
    class Bad:
        on: bool = dataclasses.field(default=True, metadata={"option": {
            "help": "x", "flag": None, "type": None, "choices": None, "metavar": None, "aliases": (),
            "group": None, "append": False}})

    with pytest.raises(TypeError, match="turns it off"):
        add_options(argparse.ArgumentParser(), Bad)


def test_the_encoders_flags_give_its_dataclass_defaults_and_reach_their_fields(tmp_path):
    from encoder_svc.config import EncoderConfig, EncoderServiceConfig
    from encoder_svc.main import build_arg_parser as encoder_parser

    model = str(decoy_model(tmp_path / "m"))
    assert from_args(EncoderServiceConfig, encoder_parser().parse_args(["--model", model])) == \
        EncoderServiceConfig(encoder=EncoderConfig(model=model))
    args = encoder_parser().parse_args(["--model", model, "--max-batch-size", "4", "--lease-ttl", "5",
                                        "--max-image-side", "640", "--decode-processes", "0", "--port", "7"])
    config = from_args(EncoderServiceConfig, args)
    e = config.encoder
    assert (e.max_batch_images, e.lease_ttl_s, e.limits.max_side, e.decode_processes, config.port) == \
        (4, 5.0, 640, 0, 7)
    for f in _options(EncoderServiceConfig):
        assert f.metadata["option"]["help"], f"{f.name} has no help text"


def test_the_cache_and_the_cli_agree_on_the_lease_ttl():
    import inspect

    from encoder_svc.cache import EmbeddingCache
    from encoder_svc.config import EncoderConfig

    default = inspect.signature(EmbeddingCache).parameters["lease_ttl_s"].default
    field = next(f for f in dataclasses.fields(EncoderConfig) if f.name == "lease_ttl_s")
    assert default == field.default == 60.0
