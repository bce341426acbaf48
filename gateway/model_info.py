"""What the gateway says about the model it serves: the names clients send, the `root` that names its
tokenizer, and the longest sequence the decoder serves (`/v1/models`, as vLLM lists them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.lora_modules import LoRAModule

DEFAULT_NAME = "mmserve"  # without --model or --served-model-name


def hub_id_of_snapshot(path: str | Path) -> str | None:
    """`owner/name` for a directory inside a Hugging Face cache (`.../models--owner--name/snapshots/REV`),
    else None: what `mmserve up --model owner/name` hands the gateway is such a snapshot."""
    parts = Path(path).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        owner, _, name = parts[-3].removeprefix("models--").partition("--")
        if owner and name:
            return f"{owner}/{name}"
    return None


def model_root(model: str | Path | None) -> str | None:
    """The model as a client could load its tokenizer: the Hub id (also for a Hub cache snapshot), else
    the directory as given."""
    if model is None:
        return None
    return hub_id_of_snapshot(model) or str(model)


def default_served_names(model: str | Path | None) -> list[str]:
    """The names served without --served-model-name: --model as typed, as vLLM answers to it (a Hub id;
    a Hub cache snapshot as its Hub id), and for a local directory also its folder's name
    (`/data/my-llava` answers to `/data/my-llava` and `my-llava`; responses carry the first)."""
    if model is None:
        return [DEFAULT_NAME]
    from common.hub import is_hub_id

    typed = str(model)
    if isinstance(model, str) and is_hub_id(model) and not Path(model).expanduser().is_dir():
        return [model]
    hub_id = hub_id_of_snapshot(model)
    if hub_id is not None:
        return [hub_id]
    return list(dict.fromkeys([typed, Path(model).expanduser().resolve().name]))


def max_model_len(model_dir: str | Path | None) -> int | None:
    """The decoder's longest sequence for the checkpoint (its text config's max_position_embeddings,
    capped by a sliding window it uses), or None when there is no readable config."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        from decoder_svc.model.config import TextModelConfig

        return TextModelConfig.from_hf(config.get("text_config") or config).max_model_len
    except Exception:  # noqa: BLE001 - not a checkpoint we can read: /v1/models just leaves it out
        return None


def takes_video(model_dir: str | Path | None) -> bool | None:
    """Whether the checkpoint takes video input (its family says so: common/families/); None when there
    is no readable config (then the decoder decides)."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config.get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    from common.families import find_family

    family = find_family(config)
    return family is not None and family.takes_video


@dataclass(frozen=True)
class ServedModel:
    """The names under which the gateway serves one checkpoint; the first is what responses carry."""

    names: tuple[str, ...]
    root: str | None = None
    max_model_len: int | None = None
    takes_video: bool | None = None  # None: unknown (no --model), the decoder decides

    def card(self, name: str, created: int) -> dict:
        """One `/v1/models` entry, as vLLM writes it."""
        card: dict = {"id": name, "object": "model", "created": created, "owned_by": "mmserve",
                      "root": self.root or name, "parent": None, "permission": [_permission(created)]}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return card

    def adapter_card(self, adapter: LoRAModule, created: int) -> dict:
        """A LoRA adapter's `/v1/models` entry, as vLLM lists one: its root the adapter's path, its
        parent its base_model_name, else the base model's first name."""
        card = self.card(adapter.name, created)
        card.update(root=adapter.path or adapter.name, parent=adapter.base_model_name or self.names[0])
        return card


def _permission(created: int) -> dict:
    """vLLM's one `model_permission` entry of a served model (what OpenAI's older API listed)."""
    return {"id": f"modelperm-{created:x}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}
