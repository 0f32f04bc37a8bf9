"""A Qwen3-style reasoning template (written here: nothing is downloaded) over SmolLM2's
tokenizer: `model.enable_thinking` reaches the template, a template without the switch is
refused naming the field, and a template that thinks inside <think> tags needs
`rollout.think_end` so that the thinking budget closes the thinking."""

from __future__ import annotations

import pytest

from scalerl.config import RolloutConfig, SmolLM2Model
from scalerl.policy.models import check_thinking, load_tokenizer

QWEN3_STYLE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}"
    '{{ \'</tools>\\nCall a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
PLAIN = (
    "{%- for message in messages %}{{ message.role + ': ' + message.content + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ 'assistant: ' }}{%- endif %}"
)


def _prompt(**model) -> str:
    tokenizer = load_tokenizer(SmolLM2Model(chat_template=QWEN3_STYLE, **model))
    return tokenizer.decode(tokenizer.prompt_ids("What is 2 + 3?", "Be brief."))


def test_enable_thinking_reaches_the_template():
    assert _prompt().endswith("assistant\n")  # the template's default: thinking on
    assert _prompt(enable_thinking=True).endswith("assistant\n")
    assert _prompt(enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")


def test_enable_thinking_without_the_switch_is_refused():
    with pytest.raises(ValueError, match="^model.enable_thinking: the chat template has no"):
        load_tokenizer(SmolLM2Model(chat_template=PLAIN, enable_thinking=False))


@pytest.mark.parametrize(
    ("think_end", "enable_thinking", "budget", "refused"),
    [
        ("", None, 16, True),
        ("", True, 16, True),
        ("</think>", None, 16, False),
        ("", False, 16, False),  # the template closes the thinking itself
        ("", None, 0, False),  # no budget: nothing is forced
    ],
)
def test_a_thinking_template_needs_think_end_for_the_budget(
    think_end, enable_thinking, budget, refused
):
    model = SmolLM2Model(chat_template=QWEN3_STYLE, enable_thinking=enable_thinking)
    rollout = RolloutConfig(
        think_end=think_end, thinking_budget=budget, answer_budget=4, max_new_tokens=64
    )
    tokenizer = load_tokenizer(model)
    if refused:
        with pytest.raises(ValueError, match=r"^rollout\.think_end: .*'</think>'"):
            check_thinking(model, rollout, tokenizer)
    else:
        check_thinking(model, rollout, tokenizer)
    check_thinking(SmolLM2Model(chat_template=PLAIN), rollout, load_tokenizer(SmolLM2Model()))


def test_tool_specs_take_the_templates_own_format():
    """Tools reach the template (its Hermes block), not a generic system message."""
    from scalerl.agents.chat import TurnTemplate

    tokenizer = load_tokenizer(SmolLM2Model(chat_template=QWEN3_STYLE, enable_thinking=False))
    template = TurnTemplate(tokenizer)
    assert template.shows_tools
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ids = template.prompt_ids([{"role": "user", "content": "2+3?"}], tools=[tool])
    text = tokenizer.decode(ids)
    assert "<tools>" in text and '"name": "add"' in text and "<tool_call>" in text
    assert text.endswith("<think>\n\n</think>\n\n")
