"""The gateway's tokenizer (tokenizers + jinja2) gives transformers' ids, text and chat prompts exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest

from gateway.prompt.tokenizer import RELEASE_GIL_CHARS, Tokenizer, TokenizerLoadError, load_tokenizer

TEXTS = [
    "",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "tabs\tand\nnewlines\r\n\n\n",
    "     whitespace runs          here",
    "\n\n\n\n",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "accents: héllo naïve façade Ångström",
    "math: ∑ x² ≤ ∞, arrows → ⇒",
    "<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|>",
    "half<|im_end|>way and <|im_start|",
    "code:\n    def f(x):\n        return x ** 2  # square\n",
    "isn't it, don't you . ? ! , 's 've 're",
    "\u200b zero width \u00a0 nbsp \ufeff bom",
    "a" * 500,
]
TEXTS.append(" ".join(TEXTS) * 4)  # encoded with the GIL released: longer than RELEASE_GIL_CHARS
assert len(TEXTS[-1]) > RELEASE_GIL_CHARS

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": '{"temp": 21, "unit": "°C"}'},
        {"role": "assistant", "content": "21 °C."},
        {"role": "user", "content": "thanks 😀 <|im_end|>"},
    ],
    [{"role": "user", "content": '  spaces  \n\n and <tags> & "quotes"  '}],
]

# A template in tokenizer_config.json (not chat_template.jinja) that uses what transformers' environment adds:
# tojson without HTML escaping, namespace, loop controls, raise_exception, the special tokens, tools.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=0) %}"
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if m['role'] == 'tool' %}<tool>{{ m['content'] | tojson(indent=2) }}</tool>\n{% continue %}{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "  {% if m['role'] == 'system' %}\n[SYS] {{ m['content'] | trim }}\n  {% else %}\n"
    "[{{ m['role'] | upper }} {{ ns.turns }}] {{ m['content'] }}{{ eos_token }}\n  {% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tool_template_model(tmp_path_factory, default_model) -> str:
    """The default tokenizer with its template in tokenizer_config.json and an added token the file lacks."""
    path = tmp_path_factory.mktemp("tool-template")
    shutil.copy(Path(default_model) / "tokenizer.json", path)
    config = json.loads((Path(default_model) / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config["clean_up_tokenization_spaces"] = True  # ignored for BPE, by transformers and by us
    config["added_tokens_decoder"] = {
        "49152": {
            "content": "<tool_call>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory) -> str:
    """A tiny GGUF's conversion (kvserve model pull's): a 261-token byte-level vocabulary of its own."""
    from transformers import LlamaForCausalLM

    from executor.models.gguf_convert import convert_gguf
    from tests.executor.models.test_model_files import gguf_config, write_gguf

    path = tmp_path_factory.mktemp("gguf")
    gguf_path = write_gguf(path / "tiny.gguf", LlamaForCausalLM(gguf_config("llama")), "llama")
    return str(convert_gguf(gguf_path, path / "converted"))


@pytest.fixture(scope="module")
def wordpiece_model(tmp_path_factory) -> str:
    """A WordPiece vocabulary (BERT's scheme) that asks for clean_up_tokenization_spaces, with [CLS]/[SEP]."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    words = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "hello", "world", "isn", "'", "t", "it", ",", ".", "?", "!"]
    words += ["don", "you", "s", "ve", "re", "m", "##s", "##ing", "a", "##a", "ab", "##c", "日", "本"]
    backend = tokenizers.Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    backend.add_special_tokens(["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    path = tmp_path_factory.mktemp("wordpiece")
    backend.save(str(path / "tokenizer.json"))
    config = {"clean_up_tokenization_spaces": True, "cls_token": "[CLS]", "sep_token": "[SEP]"}
    config |= {
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "mask_token": "[MASK]",
        "chat_template": TOOL_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


MODELS = ["default", "llama", "mistral", "qwen2", "qwen3", "tool-template", "gguf", "wordpiece"]


@pytest.fixture(scope="module", params=MODELS)
def pair(request, default_model, tiny_models, tool_template_model, gguf_model, wordpiece_model):
    """(transformers' tokenizer, ours) for one model directory."""
    from transformers import AutoTokenizer, TokenizersBackend

    named = {"default": default_model, "tool-template": tool_template_model, "gguf": gguf_model}
    named["wordpiece"] = wordpiece_model
    model_dir = {**named, **tiny_models}[request.param]
    reference = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if request.param == "qwen2":
        # AutoTokenizer picks Qwen2Tokenizer from config.json's model_type, which replaces the file's
        # pre-tokenizer with Qwen's own regex; the tiny model carries SmolLM's tokenizer.json, so the two
        # disagree on whitespace runs. A real Qwen2 tokenizer.json holds that regex; we read the file as written.
        assert type(reference).__name__ == "Qwen2Tokenizer"
        reference = TokenizersBackend.from_pretrained(model_dir, local_files_only=True)
    return reference, Tokenizer.from_dir(model_dir)


def test_vocabulary_size_and_tokens(pair):
    reference, ours = pair
    assert len(ours) == len(reference)
    ids = [*range(0, 300), *range(len(reference) - 300, len(reference))]
    ids = sorted({i for i in ids if 0 <= i < len(reference)})
    assert [ours.convert_ids_to_tokens(i) for i in ids] == [reference.convert_ids_to_tokens(i) for i in ids]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_gives_the_same_ids(pair, add_special_tokens):
    reference, ours = pair
    for text in [*TEXTS, "<tool_call>{}</tool_call>"]:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == reference.encode(
            text, add_special_tokens=add_special_tokens
        ), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_gives_the_same_text(pair, skip_special_tokens):
    reference, ours = pair
    sequences = [reference.encode(text) for text in TEXTS]
    sequences += [[1, 2, 0], list(range(0, 40)), list(range(max(0, len(reference) - 40), len(reference))), []]
    sequences += [ids[: len(ids) // 2] for ids in sequences if len(ids) > 1]  # ends inside a character
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == reference.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_renders_the_same_prompt(pair, add_generation_prompt, tools):
    reference, ours = pair
    for conversation in CONVERSATIONS:
        text = ours.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=add_generation_prompt
        )
        expected = reference.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert text == expected
        assert ours.encode(text, add_special_tokens=False) == reference.encode(
            expected, add_special_tokens=False
        )


def test_template_raise_exception_is_a_template_error(tool_template_model):
    ours = Tokenizer.from_dir(tool_template_model)
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        ours.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_template_cannot_reach_python_internals(tmp_path, default_model):
    shutil.copy(Path(default_model) / "tokenizer.json", tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_directory_without_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match=str(tmp_path / "tokenizer.json")):
        load_tokenizer(str(tmp_path))


def test_unknown_model_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        load_tokenizer(str(tmp_path / "nowhere"))
