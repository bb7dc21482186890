"""Chat messages become prompt token ids through the model's own chat template (or kvserve's Hermes one for
tools), rendered in the sandboxed Jinja environment transformers sets up for templates from model files; the
template also tells which tool-call parser reads the model's calls."""

from __future__ import annotations

import dataclasses
import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.meta
import jinja2.nodes
from jinja2 import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.api_error import APIError, invalid_request
from gateway.openai.messages import ChatMessage

# the template for requests with tools when the model's own ChatML template has none (vLLM ships one alike)
HERMES_TOOL_TEMPLATE = Path(__file__).with_name("tool_chat_template_hermes.jinja")
CHATML_TURN = "<|im_start|>"
# the tags a chat template writes tool calls in -> the --tool-call-parser (vLLM's name) that reads them
TOOL_CALL_TAGS = {"<tool_call>": "hermes"}


def chat_prompt_token_ids(
    tokenizer, messages: list[ChatMessage], tools: list[dict] | None = None
) -> list[int]:
    """Render then encode without special tokens: the template already wrote them, a second BOS would differ.
    tools: those the model may call (None: none, and the template leaves them out)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    conversation = [
        {key: value for key, value in dataclasses.asdict(m).items() if value is not None} for m in messages
    ]
    template = None  # the model's own
    if tools or any(m.tool_calls for m in messages):
        template = tool_template(tokenizer.chat_template)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
        )
    except TemplateError as exc:  # the template's own raise_exception(), e.g. a role-alternation rule
        raise invalid_request(f"messages rejected by the chat template: {exc}", "messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _tool_template(chat_template: str) -> str | None:
    """None when the model's template renders `tools` itself; else the Hermes template, for a ChatML model."""
    if _renders_tools(chat_template):
        return None
    if CHATML_TURN not in chat_template:
        raise APIError(
            400,
            "this model's chat template renders no tools and is not ChatML, so kvserve's Hermes tool template "
            "does not fit it; start the gateway with --chat-template PATH (a template that renders `tools`)",
            param="tools",
        )
    return HERMES_TOOL_TEMPLATE.read_text(encoding="utf-8")


def tool_template(chat_template: str | dict) -> str | None:
    """The template a request with tools is rendered with: None for the model's own (it has a "tool_use"
    template, or its template uses `tools`), else kvserve's Hermes ChatML template."""
    if isinstance(chat_template, dict):
        if "tool_use" in chat_template:
            return None
        chat_template = chat_template.get("default", "")
    return _tool_template(chat_template)


def _renders_tools(chat_template: str) -> bool:
    return "tools" in jinja2.meta.find_undeclared_variables(jinja_environment().parse(chat_template))


def choose_tool_call_parser(flag: str | None, chat_template: str | dict | None) -> tuple[str | None, str]:
    """(the tool-call parser tool_choice "auto" is read with, None for none: "auto" is then refused; why, for the
    start-up log). `flag` is --tool-call-parser: a parser's name, "none", or None to go by the template requests
    with tools are rendered with: the tags its calls are written in, or, where a ChatML template renders no
    tools, those of kvserve's Hermes template, which such requests then use (tool_template)."""
    if flag is not None:
        return (None if flag == "none" else flag), f"--tool-call-parser {flag}"
    if not chat_template:
        return None, "the model has no chat template"
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use", chat_template.get("default", ""))
    for tag, parser in TOOL_CALL_TAGS.items():
        if tag in chat_template:
            return parser, f"the chat template writes tool calls in {tag} tags"
    try:
        renders_tools = _renders_tools(chat_template)
    except jinja2.TemplateSyntaxError as error:
        return None, f"the chat template does not parse: line {error.lineno}: {error.message}"
    if renders_tools:
        return (
            None,
            "the chat template renders tools but its calls are not in <tool_call> tags, all kvserve reads",
        )
    if CHATML_TURN not in chat_template:
        return (
            None,
            "the chat template renders no tools and is not ChatML (requests with tools need --chat-template)",
        )
    return "hermes", (
        "the chat template renders no tools and is ChatML, so requests with tools use kvserve's Hermes template, "
        "which asks for calls in <tool_call> tags"
    )


def read_chat_template(path: str) -> str:
    """`--chat-template PATH`: the file's text, which must be a Jinja template (ValueError naming it if not)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} cannot be read: {error}") from None
    try:
        jinja_environment().parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"{path} is not a Jinja template: line {error.lineno}: {error.message}") from None
    return text


# -- the Jinja environment, as transformers sets it up --------------------------------------------------


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: no HTML escaping (jinja's own escapes <, >, &), with json.dumps' options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without handing it the dict type itself (as transformers does)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, so a template cannot reach CPython internals through it."""

    def __init__(*args, **kwargs):  # jinja's own signature trick, so namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def jinja_environment() -> ImmutableSandboxedEnvironment:
    """transformers' environment: sandboxed (templates come from model files), trim/lstrip blocks, loop controls."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
