"""Tokenizers: a tiny protocol, a built-in character vocabulary, and a wrapper of Hugging Face ``tokenizer.json``.

Every tokenizer offers ``vocab_size``, ``pad_id``, ``eos_id``, ``eos_ids`` (every id that ends a response: chat
models often have several), ``bos_id`` (``None`` if the model has none), ``encode``, ``decode`` and
``apply_chat_template``.

``encode(text, add_special_tokens=False)`` gives the tokens of exactly ``text``; with ``add_special_tokens=True``
the tokenizer adds what it adds to a plain text (a BOS for Llama-like models, nothing for Qwen), as Hugging Face's
``tokenizer(text)`` does. A rendered chat template already holds its special tokens as text, so it is encoded
with ``add_special_tokens=False`` (as ``transformers`` does), which avoids the classic doubled BOS.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Optional, Protocol, Sequence

import tokenizers

from jppo.core.inputs import BUILTIN_PREFIX
from jppo.data.tasks import BUILTIN_TASKS


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int
    eos_ids: tuple[int, ...]
    bos_id: Optional[int]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str: ...


class CharTokenizer:
    """One token per character of a small alphabet, after three special tokens: ``<pad>`` = 0, ``<bos>`` = 1,
    ``<eos>`` = 2. The built-in tasks use it: their prompts and answers are spelled in a handful of characters.
    """

    SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
    UNKNOWN = "\ufffd"

    def __init__(self, alphabet: str):
        if not alphabet:
            raise ValueError("CharTokenizer alphabet is empty: give the characters of the vocabulary")
        repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if repeated:
            raise ValueError(f"CharTokenizer alphabet={alphabet!r} repeats the characters {repeated}")
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_ids = (self.eos_id,)
        self.vocab_size = len(self.SPECIAL_TOKENS) + len(alphabet)
        self._id_of = {c: i + len(self.SPECIAL_TOKENS) for i, c in enumerate(alphabet)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        unknown = sorted(set(text) - self._id_of.keys())
        if unknown:
            raise ValueError(f"characters {unknown} of {text!r} are not in the tokenizer alphabet {self.alphabet!r}")
        ids = [self._id_of[c] for c in text]
        return [self.bos_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of ``ids``; an id outside the vocabulary (a model whose embedding table is padded past the
        tokenizer's size can sample one) becomes U+FFFD, so a scorer sees a wrong character rather than none."""
        pieces = []
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                pieces.append(self.UNKNOWN)
            elif token < len(self.SPECIAL_TOKENS):
                if not skip_special:
                    pieces.append(self.SPECIAL_TOKENS[token])
            else:
                pieces.append(self.alphabet[token - len(self.SPECIAL_TOKENS)])
        return "".join(pieces)

    def hf_files(self) -> dict[str, str]:
        """This vocabulary as Hugging Face tokenizer files (``tokenizer.json``, ``tokenizer_config.json``):
        ``AutoTokenizer`` encodes and decodes every text of the alphabet to the same ids.

        A word-level model over single characters (every character split off on its own), the three special
        tokens as added tokens, ``<bos>`` prepended when special tokens are added (as :meth:`encode` does), and a
        decoder that joins the pieces without spaces."""
        vocab = {token: i for i, token in enumerate(self.SPECIAL_TOKENS)} | {c: i for c, i in self._id_of.items()}
        tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=None))
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
        tokenizer.decoder = tokenizers.decoders.Fuse()
        tokenizer.add_special_tokens(
            [tokenizers.AddedToken(token, special=True, normalized=False) for token in self.SPECIAL_TOKENS]
        )
        bos = self.SPECIAL_TOKENS[self.bos_id]
        tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, self.bos_id)]
        )
        names = ("pad_token", "bos_token", "eos_token")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  **{name: self.SPECIAL_TOKENS[i] for name, i in zip(names, (self.pad_id, self.bos_id, self.eos_id))}}
        return {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}

    has_chat_template = False

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        raise ValueError(
            "the built-in character tokenizer has no chat template: set data.apply_chat_template=false, "
            "or use a Hugging Face tokenizer whose tokenizer_config.json has a chat_template"
        )


@dataclasses.dataclass(frozen=True)
class _SpecialTokens:
    """Special tokens as text (what a chat template sees) and as ids."""

    names: dict[str, str]  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}, only the ones that are set
    eos_ids: tuple[int, ...]
    bos_id: Optional[int]
    pad_id: Optional[int]


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``) with its special tokens and chat template.

    Special tokens come from ``tokenizer_config.json`` (then ``special_tokens_map.json``), and token ids from
    ``generation_config.json`` then ``config.json`` where the tokenizer files do not name them:

    - ``eos_id``: the tokenizer's ``eos_token``, else the first ``eos_token_id`` of the generation or model config;
      ``eos_ids`` is every EOS id any of these files names (e.g. ``<|im_end|>`` and ``<|endoftext|>`` for Qwen),
      all of which end a response. No EOS anywhere is an error: generation could never stop.
    - ``bos_id``: the tokenizer's ``bos_token`` (``None`` when it is null, as for Qwen; the model configs' BOS
      ids are not used, because Hugging Face itself does not prepend them).
    - ``pad_id``: the tokenizer's ``pad_token``, else a config's ``pad_token_id``, else the EOS id (padding is
      masked everywhere, so reusing EOS is harmless; verl does the same).
    - the chat template: ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named templates of
      which ``default`` is used), else the file ``chat_template.jinja`` that newer ``transformers`` writes.
    """

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, special: _SpecialTokens, chat_template: Optional[str], source: str
    ):
        self._tokenizer = tokenizer
        self._special = special
        self._chat_template = chat_template
        self._compiled_template: Any = None  # a jinja2.Template, compiled on first use
        self.source = source
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_ids = special.eos_ids
        self.eos_id = special.eos_ids[0]
        self.bos_id = special.bos_id
        self.pad_id = special.pad_id if special.pad_id is not None else self.eos_id

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "HFTokenizer":
        directory = pathlib.Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"tokenizer directory {str(directory)!r} has no tokenizer.json")
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        files = {name: _read_json(directory / name) for name in _TOKENIZER_FILES}
        special = _special_tokens(tokenizer, files, str(directory))
        return cls(tokenizer, special, _chat_template(directory, files["tokenizer_config.json"]), str(directory))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tokenizer.decode([int(t) for t in ids], skip_special_tokens=skip_special)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Renders ``messages`` with the model's template and the generation prompt (the assistant turn's header;
        ``add_generation_prompt`` False: without it, as supervised fine-tuning renders a conversation's turns).

        The template sees what ``transformers`` gives it: ``messages``, ``add_generation_prompt=True``, the special
        tokens as text (``bos_token``, ``eos_token``, ...) and ``template_kwargs`` (e.g. ``enable_thinking=False``,
        which may also replace a special token's text); see :mod:`jppo.data.chat_template`.
        """
        if self._chat_template is None:
            raise ValueError(
                f"tokenizer {self.source!r} has no chat template (no chat_template in tokenizer_config.json, no "
                "chat_template.jinja): set data.apply_chat_template=false"
            )
        if self._compiled_template is None:
            try:
                from jppo.data.chat_template import compile_template  # noqa: PLC0415 (jinja2: chat templates only)
            except ImportError:
                raise ValueError("rendering a chat template needs jinja2: pip install 'jinja2>=3.1.6'") from None
            self._compiled_template = compile_template(self._chat_template)
        variables = {**self._special.names, **template_kwargs, "messages": messages,
                     "add_generation_prompt": add_generation_prompt}
        return self._compiled_template.render(variables)


_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")
_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from None


def _token_text(value: Any) -> Optional[str]:
    # tokenizer_config.json stores a special token as a string or as a serialized AddedToken {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _special_tokens(tokenizer: tokenizers.Tokenizer, files: dict[str, dict], source: str) -> _SpecialTokens:
    names: dict[str, str] = {}
    for name in _SPECIAL_NAMES:
        for file in ("tokenizer_config.json", "special_tokens_map.json"):
            if name in files[file]:  # an explicit null in the first file wins over the second
                text = _token_text(files[file][name])
                if text is not None:
                    names[name] = text
                break

    def id_of(name: str) -> Optional[int]:
        if name not in names:
            return None
        token_id = tokenizer.token_to_id(names[name])
        if token_id is None:
            raise ValueError(f"tokenizer {source!r}: {name}={names[name]!r} is not in the vocabulary of tokenizer.json")
        return token_id

    configs = (files["generation_config.json"], files["config.json"])
    eos_ids: list[int] = []
    for token_id in [id_of("eos_token")] + [i for config in configs for i in _as_id_list(config.get("eos_token_id"))]:
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    if not eos_ids:
        raise ValueError(
            f"tokenizer {source!r} has no EOS token: none of tokenizer_config.json (eos_token), "
            "generation_config.json or config.json (eos_token_id) names one"
        )
    pad_id = id_of("pad_token")
    for config in configs:
        if pad_id is None and config.get("pad_token_id") is not None:
            pad_id = _as_id_list(config["pad_token_id"])[0]
    eos_text = tokenizer.id_to_token(eos_ids[0])
    if "eos_token" not in names and eos_text is not None:  # templates use eos_token: name the configured id's token
        names["eos_token"] = eos_text
    return _SpecialTokens(names=names, eos_ids=tuple(eos_ids), bos_id=id_of("bos_token"), pad_id=pad_id)


def _chat_template(directory: pathlib.Path, tokenizer_config: dict[str, Any]) -> Optional[str]:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = by_name.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return template


def load_tokenizer(spec: str) -> Tokenizer:
    """``"builtin:<task>"`` (the character vocabulary of a built-in task) or a directory with ``tokenizer.json``."""
    if spec.startswith(BUILTIN_PREFIX):
        task_name = spec[len(BUILTIN_PREFIX) :]
        alphabet = getattr(BUILTIN_TASKS.get(task_name), "alphabet", None)  # only the built-in tasks spell their own
        if alphabet is None:
            raise ValueError(
                f"tokenizer {spec!r} (model.tokenizer): task {task_name!r} has no built-in vocabulary (built-in: "
                f"{', '.join(BUILTIN_PREFIX + name for name in BUILTIN_TASKS)}); "
                "give a Hugging Face tokenizer directory"
            )
        return CharTokenizer(alphabet)
    if not pathlib.Path(spec).is_dir():
        raise ValueError(
            f"tokenizer {spec!r} (model.tokenizer, default model.path) is neither 'builtin:<task>' nor an existing "
            "directory with tokenizer.json"
        )
    return HFTokenizer.from_dir(spec)
