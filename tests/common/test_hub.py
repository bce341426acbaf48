"""--model as a Hub id: resolved offline from a cache laid out as the Hub's, a one-line error otherwise."""

from __future__ import annotations

import pytest

from common.hub import ModelNotFoundError, is_hub_id, resolve_model
from tests.cli_errors import assert_usage_error, run_cli
from tests.hub_cache import TEST_REVISION, lay_out_hub_cache

REPO = "mmserve-test/tiny"


@pytest.fixture(scope="module")
def hub_cache(tiny_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    snapshot = lay_out_hub_cache(tiny_model_dir, cache, REPO)
    return cache, snapshot


def test_hub_id_resolves_offline_from_the_cache(hub_cache):
    cache, snapshot = hub_cache
    assert resolve_model(REPO, cache_dir=cache, offline=True) == snapshot
    assert resolve_model(REPO, TEST_REVISION, cache_dir=cache, offline=True) == snapshot
    assert (snapshot / "config.json").is_symlink() and (snapshot / "model.safetensors").is_file()


@pytest.mark.parametrize("repo, revision, match", [
    ("mmserve-test/missing", None,
     "mmserve-test/missing is not in the Hugging Face cache and HF_HUB_OFFLINE=1; "
     "download it with: hf download mmserve-test/missing$"),
    (REPO, "v2", "tiny@v2 is not in the Hugging Face cache .* hf download mmserve-test/tiny --revision v2$"),
])
def test_missing_offline_names_the_download_command(hub_cache, repo, revision, match):
    with pytest.raises(ModelNotFoundError, match=match) as info:
        resolve_model(repo, revision, cache_dir=hub_cache[0], offline=True)
    assert "\n" not in str(info.value)


def test_a_snapshot_without_weights_is_refused(tiny_model_dir, tmp_path):
    snapshot = lay_out_hub_cache(tiny_model_dir, tmp_path, "mmserve-test/partial")
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="has no \\*.safetensors weights"):
        resolve_model("mmserve-test/partial", cache_dir=tmp_path, offline=True)


def test_local_paths_win_and_are_checked(tiny_model_dir, tmp_path, monkeypatch):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)  # exists locally: a directory, not a Hub id
    assert not is_hub_id("org/name") and is_hub_id("llava-hf/llava-1.5-7b-hf")
    with pytest.raises(ModelNotFoundError, match="org/name is not a checkpoint directory"):
        resolve_model("org/name")
    with pytest.raises(ModelNotFoundError, match="--revision main: .* not a Hub id"):
        resolve_model(str(tiny_model_dir), "main")
    for text in ("./x", "/abs/x", "a/b/c", "../up", "a/../b"):
        assert not is_hub_id(text)


@pytest.mark.parametrize("command", [["decoder", "--encoder", "127.0.0.1:1", "--port", "0"],
                                     ["encoder", "--port", "0"], ["up"]])
def test_cli_offline_miss_is_one_line(command, tmp_path, monkeypatch):
    from common.startup import free_port

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    if command == ["up"]:
        command = ["up", "--encoder-port", str(free_port()), "--decoder-port", str(free_port())]
    result = run_cli(*command, "--model", "mmserve-test/missing", timeout=60)
    assert_usage_error(result, "--model: mmserve-test/missing is not in the Hugging Face cache",
                       "download it with: hf download mmserve-test/missing")
