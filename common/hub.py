"""`--model` as a local checkpoint directory or a Hugging Face Hub id (`llava-hf/llava-1.5-7b-hf`).

A Hub id resolves through huggingface_hub's cache (HF_HUB_CACHE / HF_HOME, as every HF tool uses): a
snapshot already there is used as is; otherwise it is downloaded, unless HF_HUB_OFFLINE=1, where the
error names the command that downloads it. Only the files a server reads are fetched (configs,
safetensors weights, tokenizer and chat template files), not duplicate .bin weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from common.checkpoint import CheckpointError

# owner/name as the Hub spells repository ids; a local path that exists always wins.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


class ModelNotFoundError(CheckpointError):
    """--model names neither a checkpoint directory nor a Hub model we can get (one-line message)."""


def is_hub_id(text: str) -> bool:
    """True for `owner/name` that is not an existing local path."""
    return bool(_HUB_ID.match(text)) and ".." not in text and not Path(text).expanduser().exists()


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/true/yes/on), at call time."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().lower() in {"1", "true", "yes", "on"}


def check_checkpoint_dir(path: str | Path, name: str | None = None, require_weights: bool = True) -> Path:
    """path, if it holds config.json and (unless require_weights is False) safetensors weights;
    ModelNotFoundError otherwise."""
    path = Path(path)
    shown = name or str(path)
    if not path.is_dir():
        raise ModelNotFoundError(f"{shown} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{shown} is not a checkpoint directory (no config.json)")
    if require_weights and not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{shown} has no *.safetensors weights")
    return path


def download_command(repo_id: str, revision: str | None = None) -> str:
    """The shell command that puts repo_id into the Hugging Face cache."""
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def resolve_model(spec: str, revision: str | None = None, *, offline: bool | None = None,
                  cache_dir: str | Path | None = None) -> Path:
    """The local checkpoint directory for --model `spec` (a directory or a Hub id).

    offline defaults to HF_HUB_OFFLINE and cache_dir to huggingface_hub's own default. Raises
    ModelNotFoundError with a one-line message saying what to do.
    """
    if not is_hub_id(spec):
        if revision:
            raise ModelNotFoundError(f"--revision {revision}: {spec} is a local directory, not a Hub id")
        # Weights are checked by the service's config (a decoder with --load-format dummy needs none).
        return check_checkpoint_dir(Path(spec).expanduser(), spec, require_weights=False)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline() if offline is None else offline
    shown = spec + (f"@{revision}" if revision else "")
    try:
        local = snapshot_download(spec, revision=revision, allow_patterns=DOWNLOAD_PATTERNS,
                                  local_files_only=offline, cache_dir=cache_dir)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1" if offline else "the Hub cannot be reached"
        raise ModelNotFoundError(f"{shown} is not in the Hugging Face cache and {why}; "
                                 f"download it with: {download_command(spec, revision)}") from None
    except GatedRepoError:
        raise ModelNotFoundError(f"{spec} is gated: accept its terms on huggingface.co, then "
                                 "`hf auth login`") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{spec} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{spec}: no such model on the Hugging Face Hub (or it is private: "
                                 "`hf auth login`), and no such local directory") from None
    except HfHubHTTPError as exc:
        raise ModelNotFoundError(f"{shown}: download failed: {str(exc).splitlines()[0]}") from None
    return check_checkpoint_dir(local, f"{shown} (snapshot {local})")
