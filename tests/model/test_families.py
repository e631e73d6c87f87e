"""The family registry (jaxinfer/config/families/): each family's names, config.json
conversion and parameter rows live in its own module, and nothing else under config/
or in the model code names a family."""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil

import pytest

from jaxinfer import config, testing
from jaxinfer.config import ModelConfig, families
from jaxinfer.config.families import base
from jaxinfer.model import params_table

PACKAGE = pathlib.Path(config.__file__).parent
REGISTRY = PACKAGE / "families"
MODEL = PACKAGE.parent / "model"
# String constants that equal a family's name but name something else: vLLM's
# reasoning and tool-call parser names (config/serving.py).
NOT_FAMILIES = {"serving.py": {"qwen3", "mistral"}}
# The registry's helpers, not families.
SHARED_MODULES = {"base", "rows"}


def _family_names() -> set[str]:
    """Every string that names a family: our names, HF architectures, model_types."""
    return set(families.BY_NAME) | set(families.ARCHITECTURES) | set(families.MODEL_TYPES)


def _string_constants(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, value) of each string constant in the module's code, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def _family_modules() -> dict[str, object]:
    """Family name -> its module under config/families/."""
    out = {}
    for info in pkgutil.iter_modules([str(REGISTRY)]):
        if info.name not in SHARED_MODULES:
            out[info.name] = importlib.import_module(f"{families.__name__}.{info.name}")
    return out


@pytest.mark.parametrize("root", [PACKAGE, MODEL], ids=["config", "model"])
def test_no_module_outside_the_registry_names_a_family(root):
    names = _family_names()
    found = []
    for path in sorted(root.rglob("*.py")):
        if REGISTRY in path.parents:
            continue
        allowed = NOT_FAMILIES.get(path.name, set())
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {value!r}"
                  for line, value in _string_constants(path)
                  if value in names and value not in allowed]
    assert not found, "family names outside config/families/:\n" + "\n".join(found)


def test_the_registry_lists_every_family_module_once():
    modules = _family_modules()
    assert sorted(modules) == sorted(families.BY_NAME)
    assert len(families.FAMILIES) == len(families.BY_NAME)
    for name, module in modules.items():
        assert module.FAMILY is families.family(name)
    architectures = [a for family in families.FAMILIES for a in family.architectures]
    assert len(architectures) == len(set(architectures))  # each read by one family
    assert len(families.MODEL_TYPES) == len(families.FAMILIES)


@pytest.mark.parametrize("name", list(families.BY_NAME))
def test_each_family_module_holds_its_names_conversion_and_rows(name):
    """The module named after the family declares it: its HF names and model_type (as
    string constants there), its from_hf / to_hf (its own, or a parent family's it
    extends), and its rows, which the table joins to the shared ones."""
    family = families.family(name)
    module = _family_modules()[name]
    path = pathlib.Path(module.__file__)
    constants = {value for _, value in _string_constants(path)}
    assert set(family.architectures) <= constants
    assert family.model_type in constants or family.model_type == family.name
    assert family.name in constants or getattr(module, "NAME", None) == family.name
    for function in (family.from_hf, family.to_hf):
        assert function.__module__.startswith(families.__name__ + "."), function
    cfg = ModelConfig.from_hf(testing.hf_config(name).to_dict())
    assert params_table.layer_rows(cfg) == params_table.SHARED_LAYER + family.rows
    assert all(row in params_table.LAYER for row in family.rows)
    assert family.has_experts == (cfg.moe is not None)
    shared_hf = {part.hf for row in params_table.SHARED_LAYER for part in row.parts}
    own = {part.hf for row in family.rows for part in row.parts}
    assert not own & shared_hf - {"post_attention_layernorm.weight"}  # Gemma's role for it


@pytest.mark.parametrize("name", list(families.BY_NAME))
def test_every_architecture_round_trips_through_to_hf(name):
    family = families.family(name)
    hf = testing.hf_config(name).to_dict()
    for arch in family.architectures:
        cfg = ModelConfig.from_hf(hf | {"architectures": [arch]})
        assert cfg.architecture == name
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        assert cfg.to_hf()["model_type"] == family.model_type
    bare = {k: v for k, v in hf.items() if k != "architectures"} | {
        "model_type": family.model_type}
    assert ModelConfig.from_hf(bare) == ModelConfig.from_hf(hf)


def test_presets_belong_to_their_family():
    owner = {preset: family.name for family in families.FAMILIES for preset in family.presets}
    assert sum(len(f.presets) for f in families.FAMILIES) == len(owner)  # each listed once
    assert sorted(owner) == config.preset_names()
    for preset, name in owner.items():
        cfg = config.load_preset(preset)
        assert cfg.architecture == name
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_testing_has_tiny_sizes_for_every_family():
    assert set(testing.FAMILIES) == set(families.BY_NAME)
    groups = testing.DENSE_FAMILIES + testing.MOE_FAMILIES + testing.OWN_TESTS
    assert sorted(groups) == sorted(families.BY_NAME)


def test_unknown_architecture_lists_the_registered_ones():
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        families.family_of({"architectures": ["BertModel"]})
    with pytest.raises(ValueError, match="must be one of"):
        ModelConfig(architecture="bert", vocab_size=8, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8)


def test_experts_need_a_family_with_expert_rows():
    with pytest.raises(ValueError, match="without experts"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=8,
                    moe=config.MoEConfig(num_experts=2, num_experts_per_tok=1,
                                         intermediate_size=8))


def test_pattern_layer_types_every_nth_global():
    assert base.pattern_layer_types(5, 2) == (
        "sliding_attention", "full_attention", "sliding_attention", "full_attention",
        "sliding_attention")
    with pytest.raises(ValueError, match="sliding_window_pattern=0"):
        base.pattern_layer_types(4, 0)
