"""SGLang's layer-id rules, read from its wheels (``ast``; nothing imported): which model classes add
1 to a drafter's ids only when the first id is 1 (``eagle3_pipeline.target.layer_ids.DEEPSEEK_ARCHITECTURES``),
from which release (0.5.13; 0.5.10 to 0.5.12 add 1 to every id), and that Llama adds 1 to every id
throughout. The releases read: the first with Kimi-K2.5's EAGLE-3 hook (0.5.10), the last of the old
rule (0.5.12.post1), the first of the new (0.5.13), SpecForge's pin (0.5.14) and the current (0.5.23)."""

from __future__ import annotations

import pytest

from eagle3_pipeline.target.layer_ids import DEEPSEEK_ARCHITECTURES
from eagle3_pipeline_tests.hidden_states.sglang_source import (
    EVERY_ID,
    FIRST_ID_1,
    entry_classes,
    layer_rule,
)
from eagle3_pipeline_tests.hidden_states.sglang_wheels import wheel_source

# Parses every model module of five wheels (about 40 s here): left to the full suite.
pytestmark = pytest.mark.slow

OLD_RULE, NEW_RULE = ("0.5.10", "0.5.12.post1"), ("0.5.13", "0.5.14", "0.5.23")
DRAFT_SUFFIXES = ("NextN", "Eagle")  # MTP/EAGLE draft heads of these families, not targets


@pytest.mark.parametrize("version", OLD_RULE + NEW_RULE)
def test_the_deepseek_family_and_its_rule_per_release(version: str) -> None:
    tree, _ = wheel_source(version)
    classes = dict((name, module) for module, name in entry_classes(tree))
    rules = {name: layer_rule(tree, module, name) for name, module in classes.items()}
    expected = FIRST_ID_1 if version in NEW_RULE else EVERY_ID
    print(f"\n-- sglang {version}: the DeepSeek family's rule ({expected})")
    for name in DEEPSEEK_ARCHITECTURES:
        print(f"   {name:34} {rules[name].rule}  ({rules[name].where})")
        assert rules[name].rule == expected, name
    assert rules["LlamaForCausalLM"].rule == EVERY_ID
    print(f"   {'LlamaForCausalLM':34} {rules['LlamaForCausalLM'].rule}  ({rules['LlamaForCausalLM'].where})")
    targets = {name for name, found in rules.items() if found.rule == FIRST_ID_1 and not name.endswith(DRAFT_SUFFIXES)}
    assert targets == (set(DEEPSEEK_ARCHITECTURES) if version in NEW_RULE else set())
