//! Text in, text out: the tokenizer against the ids the Python `tokenizers` package gives
//! (tests/data/tokenizer/expected.json, written by tools/tokenizer_fixture.py), streaming
//! detokenization, stop strings, chat templates, and the text calls of a model.

mod common;

use common::{open_cpu, synth_file, synth_with_tokenizer, tokenizer_dir};
use serde_json::{json, Map, Value};
use tinyloop::tokenizer::{metadata_from_dir, StopStrings, KEY_TOKENIZER_JSON};
use tinyloop::{ChatMessage, Error, GenerateParams, Speculation, TextParams, Tokenizer};

const VOCAB: usize = 384;

fn expected() -> Value {
    let text = std::fs::read_to_string(tokenizer_dir().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn fixture_metadata() -> Map<String, Value> {
    metadata_from_dir(&tokenizer_dir()).unwrap()
}

fn fixture() -> Tokenizer {
    Tokenizer::from_metadata(&fixture_metadata(), VOCAB)
        .unwrap()
        .unwrap()
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn cases() -> Vec<Value> {
    expected()["cases"].as_array().unwrap().clone()
}

#[test]
fn ids_equal_the_python_tokenizers_package_with_and_without_special_tokens() {
    let tok = fixture();
    let cases = cases();
    assert!(cases.len() >= 10, "the corpus has {} lines", cases.len());
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
        let special = ids(&case["ids_with_special_tokens"]);
        assert_eq!(
            tok.encode(text, true).unwrap(),
            special,
            "{text:?} with special tokens"
        );
        assert_eq!(
            tok.decode(&special, false).unwrap(),
            case["decoded"],
            "{text:?}"
        );
        assert_eq!(
            tok.decode(&special, true).unwrap(),
            case["decoded_skip_special_tokens"],
            "{text:?}"
        );
        // Byte-level BPE loses nothing.
        assert_eq!(tok.decode(&ids(&case["ids"]), false).unwrap(), text);
    }
}

#[test]
fn special_tokens_written_in_the_text_are_single_tokens() {
    let tok = fixture();
    let im_start = tok.special_token("<|im_start|>").unwrap();
    let ids = tok.encode("<|im_start|>user", false).unwrap();
    assert_eq!(ids[0], im_start);
    assert!(ids[1..].iter().all(|&id| id < 381), "{ids:?}");
}

#[test]
fn special_token_lookup_knows_the_specials_and_names_the_unknown_one() {
    let tok = fixture();
    assert_eq!(tok.special_token("<|endoftext|>").unwrap(), 381);
    assert_eq!(tok.special_token("<|im_end|>").unwrap(), 383);
    let err = tok.special_token("<|tool|>").unwrap_err().to_string();
    assert!(err.contains("unknown special token \"<|tool|>\""), "{err}");
    assert!(err.contains("<|im_start|>"), "lists the known ones: {err}");
    let err = Tokenizer::Bytes
        .special_token("<s>")
        .unwrap_err()
        .to_string();
    assert!(err.contains("byte-level"), "{err}");
}

#[test]
fn eos_ids_come_from_generation_config_as_a_list_or_an_int_else_from_eos_token() {
    assert_eq!(fixture().eos_tokens(), [383, 381]);
    let mut metadata = fixture_metadata();
    metadata.insert("generation_config".into(), json!({"eos_token_id": 381}));
    let tok = Tokenizer::from_metadata(&metadata, VOCAB).unwrap().unwrap();
    assert_eq!(tok.eos_tokens(), [381]);
    metadata.remove("generation_config");
    let tok = Tokenizer::from_metadata(&metadata, VOCAB).unwrap().unwrap();
    assert_eq!(
        tok.eos_tokens(),
        [383],
        "tokenizer_config.eos_token is <|im_end|>"
    );
    metadata.insert(
        "generation_config".into(),
        json!({"eos_token_id": [383, 999]}),
    );
    let err = Tokenizer::from_metadata(&metadata, VOCAB).unwrap_err();
    assert!(matches!(err, Error::Format(_)), "{err}");
    assert!(
        err.to_string()
            .contains("generation_config.eos_token_id: 999"),
        "{err}"
    );
}

/// The fixture's tokenizer.json without its post-processor, and a tokenizer_config that asks
/// for BOS and EOS: the library adds them as transformers does, once.
#[test]
fn add_bos_token_and_add_eos_token_add_them_once() {
    let mut metadata = fixture_metadata();
    let mut json: Value =
        serde_json::from_str(metadata[KEY_TOKENIZER_JSON].as_str().unwrap()).unwrap();
    json["post_processor"] = Value::Null;
    metadata.insert(KEY_TOKENIZER_JSON.into(), json.to_string().into());
    let plain = Tokenizer::from_metadata(&metadata, VOCAB).unwrap().unwrap();
    let hello = plain.encode("Hello", false).unwrap();
    assert_eq!(
        plain.encode("Hello", true).unwrap(),
        hello,
        "no post-processor, no flags"
    );
    let config = metadata["tokenizer_config"].as_object_mut().unwrap();
    config.insert("add_bos_token".into(), true.into());
    config.insert("add_eos_token".into(), true.into());
    let tok = Tokenizer::from_metadata(&metadata, VOCAB).unwrap().unwrap();
    let with = tok.encode("Hello", true).unwrap();
    assert_eq!(with, [&[381][..], &hello, &[383]].concat());
    assert_eq!(tok.encode("Hello", false).unwrap(), hello);
    // Text that starts with BOS already gets no second one.
    let bos_first = tok.encode("<|endoftext|>Hello", true).unwrap();
    assert_eq!(
        bos_first.iter().filter(|&&t| t == 381).count(),
        1,
        "{bos_first:?}"
    );
}

#[test]
fn malformed_tokenizer_metadata_is_a_format_error_naming_the_key() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            KEY_TOKENIZER_JSON,
            json!(42),
            "metadata.tokenizer_json: not a string",
        ),
        (
            KEY_TOKENIZER_JSON,
            json!("{not json"),
            "metadata.tokenizer_json:",
        ),
        (
            "tokenizer_config",
            json!([1]),
            "metadata.tokenizer_config: not a JSON object",
        ),
        (
            "tokenizer_config",
            json!({"bos_token": "<|nope|>"}),
            "tokenizer_config.bos_token: \"<|nope|>\" is not a token",
        ),
        (
            "tokenizer_config",
            json!({"add_bos_token": true}),
            "add_bos_token is true but bos_token is not set",
        ),
        (
            "generation_config",
            json!("x"),
            "metadata.generation_config: not a JSON object",
        ),
    ];
    for (key, value, message) in cases {
        let mut metadata = fixture_metadata();
        metadata.insert(key.into(), value);
        let err = Tokenizer::from_metadata(&metadata, VOCAB).unwrap_err();
        assert!(matches!(err, Error::Format(_)), "{key}: {err}");
        assert!(err.to_string().contains(message), "{key}: {err}");
    }
    let err = Tokenizer::from_metadata(&fixture_metadata(), 300)
        .unwrap_err()
        .to_string();
    assert!(err.contains("outside the model's vocab_size 300"), "{err}");
    let mut metadata = fixture_metadata();
    metadata.remove(KEY_TOKENIZER_JSON);
    let err = Tokenizer::from_metadata(&metadata, VOCAB)
        .unwrap_err()
        .to_string();
    assert!(err.contains("metadata.tokenizer_json is missing"), "{err}");
}

#[test]
fn byte_level_is_the_default_of_256_tokens_and_none_otherwise() {
    let none = Map::new();
    let bytes = Tokenizer::from_metadata(&none, 256).unwrap().unwrap();
    assert_eq!(bytes.kind(), "bytes");
    assert!(Tokenizer::from_metadata(&none, VOCAB).unwrap().is_none());
    let mut named = Map::new();
    named.insert("tokenizer".into(), "bytes".into());
    assert!(Tokenizer::from_metadata(&named, 512).unwrap().is_some());
    assert!(Tokenizer::from_metadata(&named, 100).is_err());
    let text = "naïve 👍";
    let ids = bytes.encode(text, true).unwrap();
    assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
    assert_eq!(bytes.decode(&ids, false).unwrap(), text);
    assert_eq!(bytes.decode(&[0xE2, 0x82], false).unwrap(), "\u{FFFD}");
    assert!(bytes.decode(&[300], false).is_err());
    let err = bytes
        .apply_chat_template(&[ChatMessage::new("user", "hi")], true)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("byte-level and has no chat template"),
        "{err}"
    );
}

/// Feed `ids` one at a time: after each, the text released equals the decoded prefix without
/// its unfinished character, and all of it equals the whole decode.
fn check_stream(tok: &Tokenizer, ids: &[u32], skip: bool) {
    let mut stream = tok.stream(skip);
    let mut out = String::new();
    for k in 1..=ids.len() {
        out += &stream.push(ids[k - 1]).unwrap();
        let prefix = tok.decode(&ids[..k], skip).unwrap();
        assert_eq!(
            out,
            prefix.trim_end_matches('\u{FFFD}'),
            "after {k} of {ids:?}"
        );
    }
    out += &stream.finish().unwrap();
    assert_eq!(out, tok.decode(ids, skip).unwrap());
}

#[test]
fn streaming_never_splits_a_character_byte_level_bpe() {
    let tok = fixture();
    for case in cases() {
        check_stream(&tok, &ids(&case["ids_with_special_tokens"]), true);
        check_stream(&tok, &ids(&case["ids_with_special_tokens"]), false);
    }
    // The emoji line: characters of four bytes and ZWJ sequences span several tokens.
    let emoji = "👨‍👩‍👧‍👦🏳️‍🌈";
    let ids = tok.encode(emoji, false).unwrap();
    assert!(ids.len() > emoji.chars().count(), "{ids:?}");
    check_stream(&tok, &ids, true);
}

#[test]
fn streaming_never_splits_a_character_byte_level_model() {
    let text = "é 👨‍👩‍👧 日本 مرحبا";
    let ids: Vec<u32> = text.bytes().map(u32::from).collect();
    // Every byte is a split point.
    check_stream(&Tokenizer::Bytes, &ids, false);
    // A character that never completes is flushed as U+FFFD at the end.
    let mut stream = Tokenizer::Bytes.stream(false);
    assert_eq!(stream.push(b'a' as u32).unwrap(), "a");
    assert_eq!(stream.push(0xF0).unwrap(), "");
    assert_eq!(stream.push(0x9F).unwrap(), "");
    assert_eq!(stream.finish().unwrap(), "\u{FFFD}");
}

/// A SentencePiece-style BPE with byte fallback: characters outside the vocabulary become one
/// token per byte (`<0xF0>` ...).
#[test]
fn streaming_never_splits_a_character_byte_fallback() {
    let mut vocab = Map::new();
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), b.into());
    }
    for (i, piece) in ["▁", "a", "b", "▁a"].iter().enumerate() {
        vocab.insert(piece.to_string(), (256 + i).into());
    }
    let json = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": [["▁", "a"]]}
    });
    let mut metadata = Map::new();
    metadata.insert("tokenizer".into(), "huggingface".into());
    metadata.insert(KEY_TOKENIZER_JSON.into(), json.to_string().into());
    let tok = Tokenizer::from_metadata(&metadata, 260).unwrap().unwrap();
    let text = "ab a😀b é";
    let ids = tok.encode(text, false).unwrap();
    assert!(
        ids.contains(&0xF0) && ids.contains(&0x80),
        "byte fallback: {ids:?}"
    );
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    check_stream(&tok, &ids, false);
}

#[test]
fn stop_strings_are_found_across_every_split_point() {
    let text = "Once upon a time, END of story";
    for stops in [vec!["END"], vec!["ory", "time, E"], vec!["e"]] {
        let earliest = stops.iter().filter_map(|s| text.find(s)).min().unwrap();
        let splits: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &a in &splits {
            for &b in splits.iter().filter(|&&b| b >= a) {
                let mut stop =
                    StopStrings::new(stops.iter().map(|s| s.to_string()).collect()).unwrap();
                let mut out = String::new();
                let mut stopped = false;
                for piece in [&text[..a], &text[a..b], &text[b..]] {
                    let (released, hit) = stop.push(piece);
                    out += &released;
                    if hit {
                        stopped = true;
                        break;
                    }
                }
                assert!(stopped, "{stops:?} split at {a}, {b}");
                assert_eq!(out, &text[..earliest], "{stops:?} split at {a}, {b}");
            }
        }
    }
    // Text that only starts like a stop string is held, then released at the end.
    let mut stop = StopStrings::new(vec!["<|im_end|>".into()]).unwrap();
    assert_eq!(stop.push("Hi <|im"), ("Hi ".to_string(), false));
    assert_eq!(stop.push("ag"), ("<|imag".to_string(), false));
    assert_eq!(stop.push("e <"), ("e ".to_string(), false));
    assert_eq!(stop.finish(), "<");
    assert!(StopStrings::new(vec!["ok".into(), String::new()]).is_err());
}

fn messages(chat: &Value) -> Vec<ChatMessage> {
    chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

#[test]
fn chat_templates_render_as_jinja2_renders_them() {
    let tok = fixture();
    for chat in expected()["chats"].as_array().unwrap() {
        let add = chat["add_generation_prompt"].as_bool().unwrap();
        assert_eq!(
            tok.apply_chat_template(&messages(chat), add).unwrap(),
            chat["rendered"]
        );
    }
    let err = tok
        .apply_chat_template(&[ChatMessage::new("tool", "42")], true)
        .unwrap_err();
    assert!(
        err.to_string().contains("unknown role: tool"),
        "raise_exception: {err}"
    );
}

#[test]
fn chat_template_problems_are_errors_at_use_not_at_load() {
    let with = |template: Value| {
        let mut metadata = fixture_metadata();
        metadata["tokenizer_config"]["chat_template"] = template;
        Tokenizer::from_metadata(&metadata, VOCAB).unwrap().unwrap()
    };
    let hi = [ChatMessage::new("user", "hi")];
    let err = with(json!("{% for %}"))
        .apply_chat_template(&hi, true)
        .unwrap_err();
    assert!(
        err.to_string().contains("chat template cannot be used"),
        "{err}"
    );
    let err = with(Value::Null)
        .apply_chat_template(&hi, true)
        .unwrap_err();
    assert!(err.to_string().contains("no chat_template"), "{err}");
    // A list of named templates: the "default" one; bos_token and eos_token are defined.
    let named = with(json!([
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ bos_token }}{{ messages[0].content | upper }}{{ eos_token }}"}
    ]));
    assert_eq!(
        named.apply_chat_template(&hi, true).unwrap(),
        "<|endoftext|>HI<|im_end|>"
    );
}

// ---- a model that carries the tokenizer ----------------------------------------------------

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        loops: Some(2),
        ..GenerateParams::default()
    }
}

#[test]
fn a_model_tokenizes_and_detokenizes_with_its_stored_tokenizer() {
    let model = open_cpu(&synth_with_tokenizer());
    assert_eq!(model.config().vocab_size, VOCAB);
    assert_eq!(model.tokenizer().unwrap().kind(), "huggingface");
    for case in cases() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            model.tokenize(text, true).unwrap(),
            ids(&case["ids_with_special_tokens"])
        );
        assert_eq!(model.detokenize(&ids(&case["ids"]), false).unwrap(), text);
    }
    let err = model.detokenize(&[1, 384], false).unwrap_err().to_string();
    assert!(
        err.contains("tokens[1] is 384, outside the vocabulary"),
        "{err}"
    );
    let chat = &expected()["chats"][0];
    assert_eq!(
        model.apply_chat_template(&messages(chat), true).unwrap(),
        chat["rendered"]
    );
}

#[test]
fn text_generation_is_token_generation_decoded() {
    let model = open_cpu(&synth_with_tokenizer());
    let mut s = model.new_session().unwrap();
    let prompt = "ROMEO: But soft";
    let text = s
        .generate_text(prompt, &greedy(24), &TextParams::default())
        .unwrap();
    let mut params = greedy(24);
    params.stop_tokens = vec![383, 381];
    let tokens = s
        .generate(&model.tokenize(prompt, true).unwrap(), &params)
        .unwrap();
    assert_eq!(text.tokens, tokens);
    assert_eq!(text.text, model.detokenize(&tokens, true).unwrap());
    // Streamed pieces make up the text, and each is whole characters.
    let mut pieces = Vec::new();
    let streamed = s
        .generate_text_stream(prompt, &greedy(24), &TextParams::default(), &mut |p| {
            pieces.push(p.to_string());
            true
        })
        .unwrap();
    assert_eq!(streamed, text);
    assert_eq!(pieces.concat(), text.text);
    assert!(pieces.iter().all(|p| !p.is_empty()));
    // Greedy speculation gives the same text.
    let spec = Speculation {
        draft_loops: 1,
        draft_len: 3,
        reuse: true,
    };
    let speculative = s
        .generate_text_speculative(
            prompt,
            &greedy(24),
            &spec,
            &TextParams::default(),
            &mut |_| true,
        )
        .unwrap();
    assert_eq!(speculative, text);
}

/// A stop string made of the end of one generated token's text and the start of the next ends
/// generation there; the text stops before it.
#[test]
fn a_stop_string_spanning_tokens_ends_generation_before_it() {
    let model = open_cpu(&synth_with_tokenizer());
    let mut s = model.new_session().unwrap();
    let prompt = "Hello, world";
    let full = s
        .generate_text(prompt, &greedy(40), &TextParams::default())
        .unwrap();
    let pieces: Vec<String> = full
        .tokens
        .iter()
        .map(|&t| model.detokenize(&[t], true).unwrap())
        .collect();
    let i = (1..pieces.len())
        .find(|&i| {
            let ok = |p: &String| !p.is_empty() && !p.contains('\u{FFFD}');
            ok(&pieces[i - 1]) && ok(&pieces[i]) && i > 2
        })
        .expect("two decodable tokens in a row");
    let stop: String = [
        pieces[i - 1].chars().last().unwrap(),
        pieces[i].chars().next().unwrap(),
    ]
    .iter()
    .collect();
    let params = TextParams {
        stop: vec![stop.clone()],
        ..TextParams::default()
    };
    let mut streamed = String::new();
    let cut = s
        .generate_text_stream(prompt, &greedy(40), &params, &mut |p| {
            streamed += p;
            true
        })
        .unwrap();
    let at = full.text.find(&stop).unwrap();
    assert_eq!(cut.text, &full.text[..at], "stop {stop:?}");
    assert_eq!(
        streamed, cut.text,
        "no part of the stop string was streamed"
    );
    assert!(cut.tokens.len() < full.tokens.len());
    assert_eq!(cut.tokens[..], full.tokens[..cut.tokens.len()]);
}

#[test]
fn score_text_is_logprobs_of_the_tokenized_text() {
    let model = open_cpu(&synth_with_tokenizer());
    let mut s = model.new_session().unwrap();
    let scored = s.score_text("Où est la gare ?", Some(2)).unwrap();
    assert_eq!(
        scored.tokens,
        model.tokenize("Où est la gare ?", true).unwrap()
    );
    assert_eq!(scored.tokens[0], 381, "the post-processor's BOS");
    assert_eq!(
        scored.logprobs,
        s.logprobs(&scored.tokens, Some(2)).unwrap()
    );
    let err = s.score_text("", None).unwrap_err().to_string();
    assert!(err.contains("the text is 1 token(s)"), "{err}");
}

#[test]
fn byte_level_models_generate_text_as_before_and_models_without_a_tokenizer_refuse_text() {
    let model = open_cpu(&synth_file("tiny", 1, 4));
    let mut s = model.new_session().unwrap();
    let text = s
        .generate_text("ROMEO:", &greedy(16), &TextParams::default())
        .unwrap();
    let tokens = s.generate(&b"ROMEO:".map(u32::from), &greedy(16)).unwrap();
    assert_eq!(text.tokens, tokens);
    let bytes: Vec<u8> = tokens.iter().map(|&t| t as u8).collect();
    assert_eq!(text.text, String::from_utf8_lossy(&bytes));

    // `tinyloop synth` names no tokenizer ("none") for a vocabulary other than 256 bytes.
    let path = common::scratch("models").join("tiny-384-no-tokenizer.tinyloop");
    let config = tinyloop::ModelConfig {
        vocab_size: VOCAB,
        ..tinyloop::model::synth::preset("tiny").unwrap()
    };
    let writer = tinyloop::model::synth::random_model(&config, 1, 4, 32).unwrap();
    writer.write(&path).unwrap();
    let model = open_cpu(&path);
    for err in [
        model.tokenize("hi", true).unwrap_err(),
        model.detokenize(&[1], true).unwrap_err(),
        model
            .new_session()
            .unwrap()
            .generate_text("hi", &greedy(2), &TextParams::default())
            .unwrap_err(),
    ] {
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(
            err.to_string()
                .contains("the model has no tokenizer (its metadata names tokenizer \"none\""),
            "{err}"
        );
    }
}
