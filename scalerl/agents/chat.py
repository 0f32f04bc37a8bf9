"""Token-in-token-out across turns: the ids the environment adds, never the model's.

A trajectory is kept as token ids from its first prompt to its last token. What the model
sampled stays exactly as sampled: decoding a turn and tokenizing the conversation again
can give other ids (a BPE tokenizer merges "hel" + "lo" into "hello", drops or adds a
space, or renders an earlier turn differently, as Qwen3's template does with thinking),
and the learner would then train on tokens the policy never produced, under log-probs
of other tokens. So the chat template is applied incrementally: only each new
environment message is rendered and tokenized, and its ids are appended.

The ids of a message after a model turn are found by rendering a placeholder conversation
with and without the message and taking the text between (the template's own end of the
assistant turn, the message, and the next generation prompt). The end of the assistant
turn is left out where the model sampled it (its stop token); where the model did not
stop (an interrupted or truncated turn) the environment closes the turn.

A message's content is hostile (a tool result, an environment's text): it is tokenized as
literal text, never parsed for special tokens, so a result holding "<|im_end|>
<|im_start|>assistant" cannot forge a turn boundary; only the template's own text around
it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

_PLACEHOLDER = "\x00placeholder\x00"
_CONTENT = "\x00content\x00"  # where a message's own content goes in its rendering


class ChatTokenizer(Protocol):
    """What the template needs of `scalerl.policy.models.PolicyTokenizer`."""

    tokenizer: Any
    chat: bool
    stop_token_ids: frozenset[int]
    template_options: dict[str, Any]  # extra template arguments (enable_thinking)

    def prompt_ids(self, question: Any, system_prompt: str) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class TurnTemplate:
    """The token ids of a trajectory's first prompt and of every environment message.

    For a model without a chat template (the tiny character model) a message after a turn
    is "\\n{content}\\nA:", continuing its "Q:...\\nA:" format, without the characters
    its vocabulary lacks.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer.tokenizer, "chat_template", None) or ""
        # A template that renders `tools` itself (Qwen, Llama 3.1, SmolLM3, Hermes).
        self.shows_tools = tokenizer.chat and "tools" in template
        if tokenizer.chat:
            base = self._render(_base(), generation=False)
            self._base = base
            self._closing = base[base.rindex(_PLACEHOLDER) + len(_PLACEHOLDER) :]

    def prompt_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The first prompt: `messages` with the generation prompt (and `tools` where the
        template shows tools)."""
        if not self.tokenizer.chat:  # a character vocabulary: what it cannot spell is left out
            spelled = [{**m, "content": self._spellable(str(m["content"]))} for m in messages]
            return self.tokenizer.prompt_ids(spelled, "")
        text = self._render(list(messages), generation=True, tools=tools)
        return self.tokenizer.encode(text)

    def message_ids(self, message: Mapping[str, Any], turn_ids: Sequence[int]) -> list[int]:
        """The ids that follow a model turn `turn_ids` (as sampled): the end of that turn
        unless the model sampled it, `message`, and the next generation prompt.

        Raises ValueError when the template does not render the placeholder conversation
        with the message as an extension of the one without it (a template that rewrites
        earlier turns when a message is added), does not hold the content verbatim once,
        or the message has no "content" string.
        """
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError("an environment message needs a 'content' string")
        if not self.tokenizer.chat:  # a character vocabulary: what it cannot spell is left out
            return [i for c in f"\n{content}\nA:" for i in self._spelled(c)]
        full = self._render([*_base(), {**message, "content": _CONTENT}], generation=True)
        if not full.startswith(self._base):
            raise ValueError(
                f"the chat template renders a {message.get('role')!r} message by changing "
                "the turns before it; token-in-token-out needs an appending template"
            )
        parts = full[len(self._base) :].split(_CONTENT)
        if len(parts) != 2:
            raise ValueError(
                f"the chat template does not hold a {message.get('role')!r} message's content "
                "verbatim once; its text could not be kept apart from the template's"
            )
        closing = self._closing
        if turn_ids and turn_ids[-1] in self.tokenizer.stop_token_ids:
            sampled = self.tokenizer.tokenizer.decode([turn_ids[-1]], skip_special_tokens=False)
            if closing.startswith(sampled):
                closing = closing[len(sampled) :]
        before, after = parts
        encode = self.tokenizer.encode
        return encode(closing + before) + self._literal_ids(content) + encode(after)

    def _literal_ids(self, text: str) -> list[int]:
        """`text` tokenized as text: a special token's spelling in it stays characters."""
        if not text:
            return []
        ids = self.tokenizer.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        return list(ids["input_ids"])

    def _spellable(self, text: str) -> str:
        return "".join(c for c in text if self._spelled(c))

    def _spelled(self, char: str) -> list[int]:
        try:
            return self.tokenizer.encode(char)
        except KeyError:
            return []

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def _render(
        self, messages: list[Any], generation: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        options: dict[str, Any] = dict(self.tokenizer.template_options)
        if tools and self.shows_tools:
            options["tools"] = tools
        text = self.tokenizer.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation, **options
        )
        return str(text)


def _base() -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _PLACEHOLDER},
    ]
