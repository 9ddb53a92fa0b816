#!/usr/bin/env python3
"""Regenerate the tokenizer fixtures in tests/data/tokenizer/ with the Hugging Face `tokenizers`
package (and `jinja2` for the chat-template renderings).

    python3 -m venv /tmp/venv-tok && /tmp/venv-tok/bin/pip install tokenizers jinja2
    /tmp/venv-tok/bin/python tools/tokenizer_fixture.py

Writes, from tests/data/train_excerpt.txt and tests/data/tokenizer/corpus.json:

* tokenizer.json          a byte-level BPE of 384 tokens (381 learned, then the specials
                          <|endoftext|>, <|im_start|>, <|im_end|>), GPT-2 pre-tokenization, and a
                          post-processor that puts <|endoftext|> before every sequence (so ids
                          with and without special tokens differ);
* tokenizer_config.json   the special tokens and a ChatML chat template;
* generation_config.json  eos_token_id as a list ([<|im_end|>, <|endoftext|>]);
* expected.json           what this package gives for every corpus line: ids without and with
                          special tokens, the decoded text of both (special tokens kept and
                          skipped), and the chat template rendered by jinja2 as transformers
                          renders it (trim_blocks, lstrip_blocks).

The Rust tests compare the library with expected.json exactly; CI never runs this script.
"""

import json
import re
from pathlib import Path

import jinja2
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "tokenizer"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 384

CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CHATS = [
    {"messages": [{"role": "user", "content": "Hello, who are you?"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "  Answer in French. "},
            {"role": "user", "content": "Où est la gare ? 🚉"},
            {"role": "assistant", "content": "Tout droit."},
        ],
        "add_generation_prompt": False,
    },
]


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(ROOT / "tests" / "data" / "train_excerpt.txt")], trainer)
    # Specials last, so that the learned ids do not depend on them.
    tok.add_special_tokens(SPECIALS)
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A",
        pair="<|endoftext|> $A <|endoftext|> $B:1",
        special_tokens=[("<|endoftext|>", eot)],
    )
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def render(template: str, chat: dict, config: dict) -> str:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=chat["messages"],
        add_generation_prompt=chat["add_generation_prompt"],
        bos_token=config["bos_token"],
        eos_token=config["eos_token"],
    )


def dump(value) -> str:
    """Indented JSON with every list of numbers on one line."""
    text = json.dumps(value, ensure_ascii=False, indent=2)
    return re.sub(r"\[\s*([-\d,\s]+?)\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def main() -> None:
    tok = train()
    ids = {name: tok.token_to_id(name) for name in SPECIALS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 2048,
        "added_tokens_decoder": {
            str(ids[name]): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for name in SPECIALS
        },
        "chat_template": CHAT_TEMPLATE,
    }
    generation = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    corpus = json.loads((OUT / "corpus.json").read_text(encoding="utf-8"))
    cases = []
    for text in corpus:
        plain = tok.encode(text, add_special_tokens=False).ids
        special = tok.encode(text, add_special_tokens=True).ids
        cases.append(
            {
                "text": text,
                "ids": plain,
                "ids_with_special_tokens": special,
                "decoded": tok.decode(special, skip_special_tokens=False),
                "decoded_skip_special_tokens": tok.decode(special, skip_special_tokens=True),
            }
        )
    chats = [dict(chat, rendered=render(CHAT_TEMPLATE, chat, config)) for chat in CHATS]
    expected = {"tokenizers_version": tokenizers.__version__, "cases": cases, "chats": chats}
    tok.save(str(OUT / "tokenizer.json"))
    for name, value in [
        ("tokenizer_config.json", config),
        ("generation_config.json", generation),
        ("expected.json", expected),
    ]:
        (OUT / name).write_text(dump(value), encoding="utf-8")
    print(f"wrote {OUT} ({len(cases)} cases, tokenizers {tokenizers.__version__})")


if __name__ == "__main__":
    main()
