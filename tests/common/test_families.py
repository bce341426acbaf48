"""The family seam (common/families/): one folder per family declaring its FAMILY, one registry line
each; lookups by config, preset and name; every lazy reference resolves; and the engine, services and
gateway never name a family themselves."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from common.families import (
    FAMILIES,
    UnsupportedModelError,
    family_by_name,
    family_for_preset,
    family_of,
    find_family,
    preset_names,
    supported_model_types,
)
from common.families.family import load_attr
from common.families.registry import NOT_SERVED_YET
from tests.common.family_seam import FAMILY_STEMS, family_mentions

ROOT = Path(__file__).resolve().parents[2]


def test_each_family_is_a_folder_in_the_registry():
    folders = sorted(p.parent.name for p in (ROOT / "common/families").glob("*/__init__.py"))
    assert folders == sorted([f.name for f in FAMILIES] + list(NOT_SERVED_YET))
    for name in NOT_SERVED_YET:  # declared in its folder, refused by every lookup
        assert importlib.import_module(f"common.families.{name}").FAMILY not in FAMILIES
        with pytest.raises(KeyError):
            family_by_name(name)
    for family in FAMILIES:
        assert importlib.import_module(f"common.families.{family.name}").FAMILY is family
        assert family_by_name(family.name) is family
    types = supported_model_types()
    assert len(types) == len(set(types)), "a model_type belongs to one family"


def test_lookups_by_config():
    assert family_of({"model_type": "qwen2_5_vl"}).name == "qwen2_5_vl"
    assert family_of({"model_type": "qwen3_vl"}).name == "qwen3_vl"
    assert family_of({"model_type": "llava"}).name == family_of({}).name == "llava"  # old exports: LLaVA
    assert family_of({"model_type": "gemma3"}).name == "gemma3"
    assert find_family({"model_type": "gemma3n"}) is None
    with pytest.raises(UnsupportedModelError, match="'gemma3n' is not served; served: llava, qwen2_5_vl"):
        family_of({"model_type": "gemma3n"})
    # a form of a served family's checkpoints that it does not read: the refusal says how to convert it
    with pytest.raises(UnsupportedModelError, match="'phi4mm' is not served; this is Phi-4-multimodal's "
                       "remote-code form: convert it .*convert_phi4_multimodal_weights_to_hf.py"):
        family_of({"model_type": "phi4mm"})


def test_every_preset_has_one_family_and_the_makers_agree():
    names = preset_names()
    assert len(names) == len(set(names)) and {"tiny", "qwen2.5-vl-tiny", "qwen3-vl-tiny"} <= set(names)
    for name in names:
        owners = [f.name for f in FAMILIES if name in f.preset_names()]
        assert owners == [family_for_preset(name).name]
    with pytest.raises(ValueError, match="unknown preset 'nope'; choose one of tiny, small"):
        family_for_preset("nope")


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_reference_resolves(family):
    import transformers

    assert callable(load_attr(family.vision_encoder)) and callable(load_attr(family.maker))
    assert load_attr(family.presets) and getattr(transformers, family.hf_class)
    assert family.local_preprocess in ("hf", "auto")
    assert family.real_checkpoint.count("/") == 1  # a Hub id
    oracle = load_attr(family.oracle)
    assert callable(oracle.generate) and family.oracle.startswith(f"common.families.{family.name}.")
    if family.processor_stand_in is not None:  # its HF processor's reproduction, in its own folder
        assert callable(load_attr(family.processor_stand_in))
        assert family.processor_stand_in.startswith(f"common.families.{family.name}.")


def test_a_tiny_checkpoint_of_each_family_is_found_and_gets_its_encoder(tiny_model_dir):
    from common.checkpoint import load_config
    from common.families.llava.encoder import LlavaVisionEncoder as VisionEncoder
    from common.vision.encoders import make_vision_encoder

    assert family_of(load_config(tiny_model_dir)).name == "llava"
    assert isinstance(make_vision_encoder(tiny_model_dir), VisionEncoder)


# The engine, scheduler, runner, services and gateway ask the family; they never name one.
ASKERS = ("decoder_svc", "encoder_svc", "gateway")
# Every module outside common/families/ is read by the seam scanner (bench/ may name presets: not read).
SCANNED = ("common", *ASKERS)


def _seam_words() -> set[str]:
    return set(FAMILY_STEMS) | {f.name for f in FAMILIES} | set(NOT_SERVED_YET) | set(supported_model_types())


def _string_constants(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_no_module_outside_the_families_names_one():
    """common/ (outside common/families/), the services and the gateway name no family in code: no
    identifier, attribute, import or string says llava, qwen, gemma, phi4 or a served model_type; a
    family's rules and code are reached through its FAMILY, layout and encoder. Prose may name them."""
    words = _seam_words()
    bad = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("common/families/"):
                continue
            bad += [f"{rel}:{m}" for m in family_mentions(path.read_text(), words, rel)]
    assert bad == []


def test_the_seam_scanner_flags_a_planted_offender():
    """The scanner sees each way code can name a family (and passes prose and neutral code)."""
    planted = (
        '"""A docstring may say LLaVA and Qwen2.5-VL."""\n'
        "from common.families.qwen2_5_vl.layout import smart_resize  # a family's function, called\n"
        "import common.families.gemma3.encoder as vision\n"
        "from common.families import family_by_name\n"
        "class QwenRules:\n"
        '    """Prose: phi4mm."""\n'
        "    def grid(self, encoder, phi4_crops=None):\n"
        "        size = smart_resize(1, 2, 3, 4, 5)\n"
        "        return encoder.gemma_crops, family_by_name('llava'), size\n"
        "MODEL_TYPES = ('qwen3_vl',)\n"
        "def neutral(layout):  # llava in a comment\n"
        "    return layout.video_config('x')\n"
    )
    flagged = family_mentions(planted, _seam_words())
    assert flagged == [
        "2: name common.families.qwen2_5_vl.layout",
        "3: name common.families.gemma3.encoder",
        "5: name QwenRules",
        "7: name phi4_crops",
        "9: name gemma_crops",
        "9: string 'llava'",
        "10: string 'qwen3_vl'",
    ]
    assert family_mentions('"""LLaVA."""\nx = 1  # qwen\n', _seam_words()) == []


def test_the_seam_words_cover_every_family():
    """A new family's folder name holds one of the scanner's stems (else add its stem there)."""
    for name in [f.name for f in FAMILIES] + list(NOT_SERVED_YET):
        assert any(stem in name for stem in FAMILY_STEMS), name


def _imported_modules(path: Path, top_level_only: bool = False) -> set[str]:
    """Modules a file imports (`from X import`, `import X`): at its top level, or anywhere in it."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = {node.module for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
    return out | {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}


# Every family folder, served or only declared (gemma3): the seam holds for all of them.
FAMILY_FOLDERS = sorted([f.name for f in FAMILIES] + list(NOT_SERVED_YET))


def _family_folder(module: str) -> str | None:
    """The family folder a dotted module lies in (common.families.<name>[.x]), or None."""
    parts = module.split(".")
    inside = parts[:2] == ["common", "families"] and len(parts) > 2 and parts[2] in FAMILY_FOLDERS
    return parts[2] if inside else None


def test_the_seam_checks_see_every_family_folder():
    """_family_folder counts a declared-only folder too: with only the served families, an import of
    common.families.gemma3 from a service (or of another family's maker) passed the checks below."""
    assert _family_folder("common.families.gemma3.layout") == "gemma3"
    assert _family_folder("common.families.layout") is None and _family_folder("common.vision.tower") is None
    folders = sorted(p.parent.name for p in (ROOT / "common/families").glob("*/__init__.py"))
    assert [f for f in folders if _family_folder(f"common.families.{f}") != f] == []


def test_the_makers_import_no_circle():
    """The shared maker module (common/model_maker.py) reaches the families' makers only through the
    registry, at call time; a family's maker imports the shared helpers and, for Qwen3-VL, Qwen2.5-VL's
    (for Qwen3.5 and Qwen3-VL-MoE, those two; for Qwen3.5-MoE, those and its two parents'), never the other
    way round."""
    shared = _imported_modules(ROOT / "common/model_maker.py")
    assert not {m for m in shared if _family_folder(m)}
    top = _imported_modules(ROOT / "common/model_maker.py", top_level_only=True)
    assert not {m for m in top if m.startswith("common.families")}
    for name in FAMILY_FOLDERS:
        imported = _imported_modules(ROOT / f"common/families/{name}/maker.py")
        others = {_family_folder(m) for m in imported} - {None, name}
        allowed = {"qwen3_vl": {"qwen2_5_vl"}, "qwen3_5": {"qwen2_5_vl", "qwen3_vl"},
                   "qwen3_vl_moe": {"qwen2_5_vl", "qwen3_vl"},
                   "qwen3_5_moe": {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe"}}
        assert others <= allowed.get(name, set()), (name, others)


def test_no_service_imports_a_family_folder():
    """The engine, runner, services and gateway reach a family's code only through the registry and the
    neutral modules (common.families, common.families.layout, common.image_geometry, common.vision.*):
    no import of common.families.<name>, anywhere in them."""
    bad = []
    for package in ASKERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            bad += [f"{rel}: {m}" for m in sorted(_imported_modules(path)) if _family_folder(m)]
            refs = [s for s in _string_constants(path) if _family_folder(s.split(":")[0])]
            bad += [f"{rel}: {s!r}" for s in sorted(refs)]
    assert bad == []


def test_each_family_folder_holds_its_layout_and_maker():
    """A family's layout and maker live in its folder (Qwen3-VL reuses Qwen2.5-VL's layout by name)."""
    for family in FAMILIES:
        for ref in (family.layout, family.maker, family.presets, family.vision_encoder, family.oracle):
            module = ref.split(":")[0]
            folder = _family_folder(module)
            assert folder in (family.name, "qwen2_5_vl") or module.startswith("common.vision."), ref
        assert (ROOT / f"common/families/{family.name}/maker.py").is_file()


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_family_provides_a_vision_encoder(family):
    """Its encoder is a complete VisionEncoder (the services' typed contract), in its own folder."""
    import inspect

    from common.families.encoder import VisionEncoder

    cls = load_attr(family.vision_encoder)
    assert issubclass(cls, VisionEncoder) and not inspect.isabstract(cls)
    assert family.vision_encoder.startswith(f"common.families.{family.name}.")
    assert isinstance(cls.takes_pixel_ranges, bool) and isinstance(cls.rows_follow_size, bool)
    assert (cls.takes_pixel_ranges or cls.rows_follow_size) == family.dynamic_resolution  # rows follow size


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_family_provides_an_image_layout(family):
    from common.families.layout import ImageLayout

    cls = family.layout_class()
    assert issubclass(cls, ImageLayout)
    assert isinstance(cls.mrope, bool)
    assert (cls.video_token is not None) == family.takes_video
    if isinstance(cls.sized_by_image, property):  # the checkpoint decides (Gemma 3: pan-and-scan crops)
        assert not family.dynamic_resolution
    else:
        assert isinstance(cls.sized_by_image, bool)
        assert cls.sized_by_image == family.dynamic_resolution


def test_the_layouts_of_tiny_checkpoints(tiny_model_dir, qwen_model_dir):
    from common.checkpoint import load_config
    from common.families import layout_family

    config = load_config(tiny_model_dir)
    llava = layout_family(config).image_layout(tiny_model_dir, config)
    assert llava.tokens_per_image == llava.num_tokens() > 0 and llava.positions(3, []) is None
    assert llava.generic_image_text("<image>") is None and not llava.takes_video
    config = load_config(qwen_model_dir)
    qwen = layout_family(config).image_layout(qwen_model_dir, config)
    assert qwen.tokens_per_image is None and qwen.takes_video
    grid = qwen.grid(56, 84, qwen.pixel_range())
    assert qwen.num_tokens(grid) == grid[1] * grid[2] // 4
    positions, delta = qwen.positions(10, [(2, grid)])
    assert positions.shape == (3, 10) and delta <= 0
    # a config no family claims is refused by the fallback's layout, saying why
    assert layout_family({"model_type": "llava_next"}).name == "llava"


def test_the_oracles_import_no_test_code():
    """A family's oracle ships in the package: it imports nothing from tests/."""
    for family in FAMILIES:
        path = ROOT / f"common/families/{family.name}/oracle.py"
        assert not {m for m in _imported_modules(path) if m.split(".")[0] == "tests"}, path
