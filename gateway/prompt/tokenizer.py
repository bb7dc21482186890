"""The gateway's tokenizer without transformers (which imports torch): HF `tokenizers` for the text, jinja2 for
the chat template (its environment: gateway/prompt/chat_template.py), rendered as transformers'
apply_chat_template renders it (what SGLang's router does in Rust).

Its surface is what the gateway and shared/detokenize.py call on a transformers tokenizer, so either serves them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
import tokenizers

from gateway.prompt.chat_template import jinja_environment
from shared.model_paths import ModelLoadError, pulled_model_dir

# the named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# texts this long take a millisecond or more to encode: long enough to let other threads run meanwhile
RELEASE_GIL_CHARS = 1024


class TokenizerLoadError(ModelLoadError):
    """Tokenizer files that are missing or unreadable; the message names the file."""


class Tokenizer:
    """encode / decode / convert_ids_to_tokens / apply_chat_template / len(), as transformers 5 does them for a
    tokenizer.json ("TokenizersBackend"): the same ids, the same text."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict, chat_template: str | dict | None) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = _special_tokens_map(config)
        _add_config_tokens(
            backend, config, [*self.special_tokens_map.values(), *_extra_special_tokens(config)]
        )
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        backend.no_truncation()  # transformers' encode neither truncates nor pads unless asked
        backend.no_padding()
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            # transformers skips the clean-up for BPE: it would strip real spaces before punctuation
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        )
        self._templates: dict[str, jinja2.Template] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerLoadError(
                f"{path} is missing: the gateway reads a model's tokenizer from tokenizer.json"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust library raises its own Exception type for a malformed file
            raise TokenizerLoadError(f"{path} cannot be read: {error}") from error
        config = _read_json(model_dir / "tokenizer_config.json")
        return cls(backend, config, _chat_template(model_dir, config))

    def __len__(self) -> int:
        """The whole vocabulary, added tokens included: the ids a prompt may hold."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A long text through encode_batch, the same ids: `tokenizers` releases the GIL there and not in
        encode, which would hold every other thread, the event loop's too, for the whole call (seconds for a
        megabyte prompt; gateway.prompt.workers)."""
        if len(text) < RELEASE_GIL_CHARS:
            return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    def apply_chat_template(
        self,
        conversation: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        chat_template: str | None = None,
    ) -> str:
        """The rendered text only (encode it with add_special_tokens=False: the template wrote them).
        chat_template, as in transformers: a template's source, or the name of one of the model's."""
        if tokenize:
            raise ValueError(
                "apply_chat_template renders text only; encode the text with add_special_tokens=False"
            )
        if not conversation:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        # as transformers: keys whose value is None are dropped (templates crash on content=None, handle a gap)
        messages = [{key: value for key, value in m.items() if value is not None} for m in conversation]
        return self._template(tools, chat_template).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )

    def _template(self, tools: list[dict] | None, chat_template: str | None = None) -> jinja2.Template:
        """Compiled once per template; a dict of named templates picks "tool_use" for tools, else "default"."""
        source, name = self.chat_template, "default"
        if chat_template is not None:
            named = isinstance(source, dict) and chat_template in source
            source, name = (source[chat_template], chat_template) if named else (chat_template, chat_template)
        elif isinstance(source, dict):
            name = "tool_use" if tools is not None and "tool_use" in source else "default"
            if name not in source:
                raise ValueError(f"the model has chat templates {sorted(source)} and none named 'default'")
            source = source[name]
        if source is None:
            raise ValueError("the model has no chat template")
        if name not in self._templates:
            self._templates[name] = jinja_environment().from_string(source)
        return self._templates[name]


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer of `kvserve gateway --model`: a directory, the default name or a .gguf file's conversion."""
    return Tokenizer.from_dir(pulled_model_dir(model))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TokenizerLoadError(f"{path} cannot be read: {error}") from error


def _chat_template(model_dir: Path, config: dict) -> str | dict | None:
    """As transformers 5 loads it: chat_template.jinja and additional_chat_templates/*.jinja win over
    tokenizer_config.json's `chat_template` (a string, or a list of {name, template}); chat_template.json is
    the older processor file."""
    templates = {}
    if (default := model_dir / "chat_template.jinja").is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    for extra in sorted((model_dir / "additional_chat_templates").glob("*.jinja")):
        templates[extra.name.removesuffix(".jinja")] = extra.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if template is None and (legacy := model_dir / "chat_template.json").is_file():
        template = _read_json(legacy).get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _token_content(value: object) -> str | None:
    """A config's special token: a string, or a serialized AddedToken ({"__type": "AddedToken", "content": ...})."""
    if isinstance(value, dict) and value.get("__type", "AddedToken") == "AddedToken":
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens_map(config: dict) -> dict[str, str]:
    """The named special tokens, which transformers passes to the chat template: bos_token ... mask_token, any
    other "*_token" of the config, and extra_special_tokens when it names them."""
    named = {name: config.get(name) for name in SPECIAL_TOKEN_NAMES}
    named |= {key: value for key, value in config.items() if key.endswith("_token") and key not in named}
    if isinstance(extra := config.get("extra_special_tokens"), dict):
        named |= extra
    contents = {name: _token_content(value) for name, value in named.items()}
    return {name: content for name, content in contents.items() if content is not None}


def _extra_special_tokens(config: dict) -> list[str]:
    """The unnamed special tokens: extra_special_tokens as a list, or transformers 4's additional_special_tokens."""
    extra = config.get("extra_special_tokens")
    listed = extra if isinstance(extra, list) else config.get("additional_special_tokens") or []
    return [content for content in map(_token_content, listed) if content is not None]


def _add_config_tokens(backend: tokenizers.Tokenizer, config: dict, special: list[str]) -> None:
    """What transformers adds to tokenizer.json from tokenizer_config.json: its added_tokens_decoder, then the
    special tokens the file still lacks (as special, so skip_special_tokens drops them)."""

    def present() -> set[str]:
        return {token.content for token in backend.get_added_tokens_decoder().values()}

    decoder = sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0]))
    known = present()
    added = [
        tokenizers.AddedToken(**{k: v for k, v in entry.items() if k != "__type"})
        for _, entry in decoder
        if entry["content"] not in known
    ]
    if added:
        backend.add_tokens(added)
    known = present()
    if missing := [content for content in dict.fromkeys(special) if content not in known]:
        backend.add_special_tokens(
            [tokenizers.AddedToken(c, special=True, normalized=False) for c in missing]
        )


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization, for WordPiece-style vocabularies that set it."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text
