"""Hugging Face's own functions from transformers' source files whose modules cannot be imported here.

video_processing_qwen2_vl.py imports torchvision at the top, which this environment lacks; its functions
use only math and torch, so they are compiled from the installed file's source as they are.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import transformers
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

QWEN2_VL_VIDEO_FILE = Path(transformers.__file__).parent / "models/qwen2_vl/video_processing_qwen2_vl.py"


def _tree() -> ast.Module:
    return ast.parse(QWEN2_VL_VIDEO_FILE.read_text())


def qwen2_vl_function(name: str, cls: str | None = "Qwen2VLVideoProcessor"):
    """A function (a method of `cls`, or a module-level one) compiled from HF's Qwen2-VL video source."""
    body = _tree().body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    node.returns = None
    for arg in node.args.args + node.args.kwonlyargs:
        arg.annotation = None
    module = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
    namespace: dict[str, Any] = {"math": math, "torch": torch, "np": np,
                                 "smart_resize": None, "SizeDict": SimpleNamespace}
    exec(compile(module, str(QWEN2_VL_VIDEO_FILE), "exec"), namespace)  # noqa: S102 - HF's own source
    if name != "smart_resize":
        namespace["smart_resize"] = qwen2_vl_function("smart_resize", cls=None)
    return namespace[name]


def qwen2_vl_processor_stand_in(size: dict, patch_size: int = 14, merge_size: int = 2,
                                temporal_patch_size: int = 2) -> SimpleNamespace:
    """`self` for HF's Qwen2-VL video-processor methods compiled by qwen2_vl_function: its attributes,
    and `_merge_and_standardize_kwargs` (the defaults overridden by the call's kwargs), which newer
    transformers read them through (5.25) where older ones read the attributes."""
    defaults = {"size": size, "patch_size": patch_size, "merge_size": merge_size,
                "temporal_patch_size": temporal_patch_size}
    return SimpleNamespace(**defaults, _merge_and_standardize_kwargs=lambda **kwargs: defaults | kwargs)


def qwen2_vl_class_defaults() -> dict[str, Any]:
    """Qwen2VLVideoProcessor's class attributes (size, patch sizes, frames, mean/std ...)."""
    cls = next(n for n in _tree().body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    names = {"OPENAI_CLIP_MEAN": OPENAI_CLIP_MEAN, "OPENAI_CLIP_STD": OPENAI_CLIP_STD}
    out = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = eval(compile(ast.Expression(node.value), "<hf>", "eval"), names)  # noqa: S307
            except NameError:
                pass  # class-level names that need HF's enums (resample, valid_kwargs)
    return out
