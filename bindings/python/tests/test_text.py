"""Text in, text out through the model's stored tokenizer (the test model carries the
repository's tokenizer fixture: byte-level BPE of 384 tokens, ChatML template)."""

import numpy as np
import pytest

import tinyloop_py

# tests/data/tokenizer/expected.json: "Hello, world!" with the BOS (<|endoftext|>, 381) the
# tokenizer's post-processor adds.
HELLO_IDS = [381, 39, 68, 272, 78, 11, 262, 273, 311, 0]
EOS = [383, 381]  # generation_config.json: <|im_end|>, <|endoftext|>


def test_tokenize_and_detokenize(text_model):
    ids = text_model.tokenize("Hello, world!")
    assert ids.dtype == np.int32
    assert ids.tolist() == HELLO_IDS
    assert text_model.tokenize("Hello, world!", add_special_tokens=False).tolist() == HELLO_IDS[1:]
    assert text_model.detokenize(ids) == "<|endoftext|>Hello, world!"
    assert text_model.detokenize(ids, skip_special_tokens=True) == "Hello, world!"
    for text in ["café 日本 مرحبا 👨‍👩‍👧", "tabs\t\tand\n\nnew lines  ", ""]:
        assert text_model.detokenize(text_model.tokenize(text, add_special_tokens=False)) == text
    # A long text: the first buffer is too small and the call is retried with the size needed.
    long_text = "<|im_end|>" * 40
    assert text_model.tokenize(long_text, add_special_tokens=False).tolist() == [383] * 40


def test_special_tokens(text_model):
    assert text_model.special_token("<|im_start|>") == 382
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="unknown special token"):
        text_model.special_token("<|tool|>")


def test_chat_template(text_model):
    text = text_model.apply_chat_template([{"role": "user", "content": "Hello, who are you?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello, who are you?<|im_end|>\n<|im_start|>assistant\n"
    )
    without = text_model.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert without.endswith("Hi<|im_end|>\n")
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="unknown role: tool"):
        text_model.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TypeError, match="messages\\[0\\]"):
        text_model.apply_chat_template([("user", "hi")])


def test_generate_text_is_generated_tokens_decoded(text_model):
    text = text_model.generate(text="ROMEO:", max_tokens=20, loops=2)
    assert isinstance(text, str)
    tokens = text_model.generate(text_model.tokenize("ROMEO:"), max_tokens=20, loops=2, stop=EOS)
    assert text == text_model.detokenize(tokens, skip_special_tokens=True)
    pieces = list(text_model.generate_stream(text="ROMEO:", max_tokens=20, loops=2))
    assert all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == text
    session = text_model.new_session()
    try:
        assert session.generate(text="ROMEO:", max_tokens=20, loops=2) == text
    finally:
        session.close()


def test_stop_strings_end_the_text_before_them(text_model):
    full = text_model.generate(text="Hello", max_tokens=40, loops=2)
    stop = full[3:5]
    assert len(stop) == 2, full
    cut = text_model.generate(text="Hello", max_tokens=40, loops=2, stop=["never", stop])
    assert cut == full[: full.find(stop)]
    assert "".join(text_model.generate_stream(text="Hello", max_tokens=40, loops=2, stop=[stop])) == cut
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="stop strings work on text"):
        text_model.generate([1, 2], stop=["x"])
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="stop string 0 is empty"):
        text_model.generate(text="Hello", stop=[""])


def test_chat_prompt_generation(text_model):
    prompt = text_model.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = text_model.generate(text=prompt, add_special_tokens=False, max_tokens=8, loops=2)
    tokens = text_model.generate(
        text_model.tokenize(prompt, add_special_tokens=False), max_tokens=8, loops=2, stop=EOS
    )
    assert text == text_model.detokenize(tokens, skip_special_tokens=True)


def test_score_text(text_model):
    logprobs = text_model.score_text("Où est la gare ?", loops=2)
    tokens = text_model.tokenize("Où est la gare ?")
    assert logprobs.dtype == np.float32
    assert np.array_equal(logprobs, text_model.logprobs(tokens, loops=2))
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="scoring needs at least 2"):
        text_model.score_text("")


def test_text_argument_errors(text_model, model):
    with pytest.raises(TypeError, match="tokens or text"):
        text_model.generate([1], text="x")
    with pytest.raises(TypeError, match="pass the prompt"):
        text_model.generate()
    with pytest.raises(TypeError, match="text must be a str"):
        text_model.tokenize(b"bytes")
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="NUL"):
        text_model.tokenize("a\0b")
    with pytest.raises(UnicodeEncodeError):
        text_model.tokenize("\ud800")  # a lone surrogate is not UTF-8
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="outside the vocabulary"):
        text_model.detokenize([384])
    # A byte-level model: bytes in, bytes out, and no chat template.
    assert model.tokenize("é").tolist() == [195, 169]
    assert isinstance(model.generate(text="ROMEO:", max_tokens=4), str)
    with pytest.raises(tinyloop_py.InvalidArgumentError, match="no chat template"):
        model.apply_chat_template([{"role": "user", "content": "hi"}])
