"""Model families, one folder each (common/families/<name>/), through one typed interface
(common/families/family.py, with the image layout of common/families/layout.py) and one registry
(common/families/registry.py). To add a family: a folder declaring its FAMILY and holding its code
(layout, maker, oracle, its language model's TextSpec in text.py, and its tower where it has its own), and
its line in the registry."""

from common.families.family import ModelFamily
from common.families.registry import (
    FAMILIES,
    UnsupportedModelError,
    family_by_name,
    family_for_preset,
    family_of,
    family_of_model,
    find_family,
    layout_family,
    preset_names,
    supported_model_types,
)

__all__ = ["FAMILIES", "ModelFamily", "UnsupportedModelError", "family_by_name", "family_for_preset",
           "family_of", "family_of_model", "find_family", "layout_family", "preset_names",
           "supported_model_types"]
