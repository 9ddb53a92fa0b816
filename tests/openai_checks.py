"""What every server of TinyLoop's OpenAI-compatible API answers the official `openai` client
for the demo model (a byte-level model served as "demo"), shared by tests/serve (`tinyloop
MODEL serve`) and tests/ray (the Ray Serve deployment). Each check takes the client and
``expected(prompt, max_tokens)``: the text one engine generates greedily for a text prompt.
Every request loop here is bounded."""

import concurrent.futures

import openai
import pytest


def client_for(url, timeout_s=180):
    """A client of the server at ``url`` that never retries by itself."""
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)


def transcript(messages):
    """The prompt a byte-level model takes for chat ``messages``: ``role: content`` lines, then
    ``assistant:``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def request(client, kind, stream, max_tokens, prompt=None, messages=None, **extra):
    """One greedy request ("completion" or "chat"); returns its whole text."""
    if kind == "completion":
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, stream=stream, **extra)
        if stream:
            return "".join(c.choices[0].text for c in r)
        return r.choices[0].text
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=max_tokens,
                                       temperature=0, stream=stream, **extra)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in r)
    return r.choices[0].message.content


def burst(jobs, timeout_s):
    """Run the callables of ``jobs`` at once; returns each one's ("ok", value) or ("error",
    exception), failing the test when the burst is not over within ``timeout_s``."""
    pool = concurrent.futures.ThreadPoolExecutor(len(jobs))
    try:
        futures = [pool.submit(job) for job in jobs]
        _, not_done = concurrent.futures.wait(futures, timeout=timeout_s)
        assert not not_done, (
            f"{len(not_done)} of {len(jobs)} requests still running after {timeout_s} s")
        return [("error", f.exception()) if f.exception() else ("ok", f.result()) for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def check_models(client):
    assert [m.id for m in client.models.list().data] == ["demo"]


def check_completions(client, expected):
    """A completion, then the same one streamed: the text of one engine, its usage and shape."""
    text = expected("ROMEO:", 40)
    r = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=40, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "demo"
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 40, 46)
    chunks = list(client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=40, temperature=0, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def check_chat(client, expected):
    """A chat completion, then the same one streamed (the first chunk names the role)."""
    messages = [{"role": "user", "content": "Speak, friend."}]
    text = expected(transcript(messages), 24)
    assert text, "the reference generated no text: the comparison would prove nothing"
    c = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=24, temperature=0)
    assert c.id.startswith("chatcmpl-") and c.object == "chat.completion"
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == text
    streamed = list(client.chat.completions.create(
        model="demo", messages=messages, max_tokens=24, temperature=0, stream=True))
    assert all(s.object == "chat.completion.chunk" for s in streamed)
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(s.choices[0].delta.content or "" for s in streamed) == text


def check_stop_strings(client, expected):
    """A stop string ends the text before its first occurrence, with finish_reason "stop"."""
    full = expected("ROMEO:", 60)
    stop = full[10:14]
    r = client.completions.create(
        model="demo", prompt="ROMEO:", max_tokens=60, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def check_token_ids(client, expected):
    """``return_token_ids``: each choice also carries the ids of its tokens (for the byte-level
    demo model, the bytes of its text), a stream's chunks those generated since the chunk
    before; without the field a choice has none."""
    text = expected("ROMEO:", 24)
    extra = {"return_token_ids": True}
    r = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=24, temperature=0,
                                  extra_body=extra)
    ids = r.choices[0].token_ids
    assert r.choices[0].text == text and len(ids) == 24 and bytes(ids).decode() == text
    chunks = list(client.completions.create(model="demo", prompt="ROMEO:", max_tokens=24,
                                            temperature=0, stream=True, extra_body=extra))
    pieces = [c.choices[0].token_ids for c in chunks]
    assert all(pieces[:-1]) and pieces[-1] == [] and sum(pieces, []) == ids
    messages = [{"role": "user", "content": "Speak, friend."}]
    c = client.chat.completions.create(model="demo", messages=messages, max_tokens=8,
                                       temperature=0, extra_body=extra)
    assert bytes(c.choices[0].token_ids).decode() == c.choices[0].message.content
    plain = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=4, temperature=0)
    assert getattr(plain.choices[0], "token_ids", None) is None


def check_bad_requests(client):
    """A bad field is a 400 whose message names it."""
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="demo", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="only n = 1"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="loops must be in"):
        client.completions.create(model="demo", prompt="x", max_tokens=2, extra_body={"loops": 0})
    with pytest.raises(openai.BadRequestError, match="return_token_ids is 1: it must be true"):
        client.completions.create(model="demo", prompt="x", max_tokens=2,
                                  extra_body={"return_token_ids": 1})
    with pytest.raises(openai.BadRequestError, match="below vocab_size 256"):
        client.completions.create(model="demo", prompt=[1, 2, 300], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content must be a string"):
        client.chat.completions.create(model="demo", messages=[{"role": "user"}], max_tokens=2)
