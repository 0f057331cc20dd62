"""Chat messages -> the prompt text the model was trained on, through the tokenizer's own chat template.

The template is the Jinja text in the checkpoint's `tokenizer_config.json` field `chat_template` (or, as newer
Hugging Face checkpoints store it, a `chat_template.jinja` file beside the tokenizer), rendered as Hugging Face's
`apply_chat_template` does: a sandboxed Jinja environment with `messages`, `add_generation_prompt=True`,
`bos_token` / `eos_token` from the same config, `raise_exception` and `strftime_now`. The answer ends where the
template's turn ends: at `eos_token` (a stop string; for chat models it is the end-of-turn token).

A tokenizer without a template (the embedded default pair: a code model with no chat training) gets PLAIN, one
"role: content" line per message and then "assistant:", and its turn ends at a new line that starts a user turn
("\\nuser:").
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Optional

PLAIN = ("{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")
PLAIN_END = "\nuser:"


class TemplateError(ValueError):
    """The template refused these messages (its raise_exception) or failed to render them."""


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class ChatTemplate:
    """A compiled chat template: render(messages) -> prompt text; `end`: the stop string that ends an answer's turn."""

    def __init__(self, source: str, *, bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                 end: Optional[str] = None, origin: str = "plain"):
        import jinja2
        import jinja2.ext
        import jinja2.sandbox

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
            # Hugging Face's: Jinja's own escapes <, > and & for HTML, which a prompt must not get
            return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template from {origin} does not compile: {e}") from None
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        self.end = end if end is not None else eos_token

    def render(self, messages: list[dict]) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "")
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise TemplateError(f"the chat template ({self.origin}) cannot render these messages: "
                                f"{type(e).__name__}: {e}") from None


def for_tokenizer(tokenizer) -> ChatTemplate:
    """The tokenizer's chat template (from the tokenizer_config.json / chat_template.jinja beside its files), else
    PLAIN. A malformed config or template is a one-line ValueError naming the file."""
    files = [f for f in getattr(tokenizer, "files", ()) or ()]
    folder = os.path.dirname(files[0]) if files else None
    config: dict = {}
    config_file = os.path.join(folder, "tokenizer_config.json") if folder else None
    if config_file and os.path.isfile(config_file):
        try:
            with open(config_file) as f:
                config = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_file} cannot be read as JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_file} is not a JSON object")
    source, origin = config.get("chat_template"), config_file
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_file = os.path.join(folder, "chat_template.jinja") if folder else None
    if not source and jinja_file and os.path.isfile(jinja_file):
        with open(jinja_file) as f:
            source, origin = f.read(), jinja_file
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    if not isinstance(source, str) or not source:
        return ChatTemplate(PLAIN, bos_token=bos, eos_token=eos, end=PLAIN_END, origin="the plain template")
    return ChatTemplate(source, bos_token=bos, eos_token=eos, origin=origin)
