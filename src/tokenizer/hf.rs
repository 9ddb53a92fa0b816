//! A Hugging Face tokenizer as a `.tinyloop` file stores it: `tokenizer.json` (run by the
//! `tokenizers` crate), `tokenizer_config.json` (special tokens, `add_bos_token`, the chat
//! template) and `generation_config.json` (the end-of-sequence ids).

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::OnceLock;

use serde_json::{Map, Value};

use super::chat::{ChatMessage, ChatTemplate};
use super::{KEY_GENERATION_CONFIG, KEY_TOKENIZER_CONFIG, KEY_TOKENIZER_JSON};
use crate::error::{Error, Result};

/// The special tokens a chat template may refer to by name.
const NAMED_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
];

pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// Every special token by its text: the tokenizer's special added tokens and the named
    /// tokens of `tokenizer_config`.
    special: BTreeMap<String, u32>,
    /// The named tokens (`bos_token`, ...) that `tokenizer_config` sets, by name.
    named: BTreeMap<&'static str, (String, u32)>,
    add_bos: bool,
    add_eos: bool,
    eos: Vec<u32>,
    /// The default chat template, or why it cannot be used; `None` when there is none.
    chat: Option<std::result::Result<ChatTemplate, String>>,
    max_id: u32,
    max_token_bytes: OnceLock<usize>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos", &self.eos)
            .field("chat_template", &self.chat.is_some())
            .finish()
    }
}

fn bad(key: &str, why: impl std::fmt::Display) -> Error {
    Error::format(format!("metadata.{key}: {why}"))
}

/// An object-valued metadata entry; absent is empty.
fn object<'a>(
    metadata: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>> {
    match metadata.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(map)) => Ok(Some(map)),
        Some(_) => Err(bad(key, "not a JSON object")),
    }
}

/// The text of a special token as `tokenizer_config` writes it: a string, or an object with
/// `content` (a serialized `AddedToken`); `None` for null.
fn token_text(value: &Value) -> Option<&str> {
    match value {
        Value::String(s) => Some(s),
        Value::Object(map) => map.get("content").and_then(Value::as_str),
        _ => None,
    }
}

impl HfTokenizer {
    /// Build from the metadata keys; every token id must be below `vocab_size`.
    pub fn from_metadata(metadata: &Map<String, Value>, vocab_size: usize) -> Result<Self> {
        let json =
            match metadata.get(KEY_TOKENIZER_JSON) {
                Some(Value::String(s)) => s,
                Some(_) => {
                    return Err(bad(
                        KEY_TOKENIZER_JSON,
                        "not a string (the tokenizer.json text)",
                    ))
                }
                None => return Err(Error::format(
                    "metadata.tokenizer is \"huggingface\" but metadata.tokenizer_json is missing",
                )),
            };
        let inner =
            tokenizers::Tokenizer::from_str(json).map_err(|e| bad(KEY_TOKENIZER_JSON, e))?;
        let vocab = inner.get_vocab(true);
        let (max_token, max_id) = vocab
            .iter()
            .max_by_key(|(_, &id)| id)
            .map(|(t, &id)| (t.clone(), id))
            .ok_or_else(|| bad(KEY_TOKENIZER_JSON, "the vocabulary is empty"))?;
        if max_id as usize >= vocab_size {
            return Err(bad(
                KEY_TOKENIZER_JSON,
                format!("token {max_token:?} has id {max_id}, outside the model's vocab_size {vocab_size}"),
            ));
        }
        let config = object(metadata, KEY_TOKENIZER_CONFIG)?;
        let id_of = |key: &str, text: &str| {
            inner
                .token_to_id(text)
                .ok_or_else(|| bad(key, format!("{text:?} is not a token of tokenizer_json")))
        };
        let mut named = BTreeMap::new();
        for name in NAMED_TOKENS {
            if let Some(text) = config.and_then(|c| c.get(name)).and_then(token_text) {
                let key = format!("{KEY_TOKENIZER_CONFIG}.{name}");
                named.insert(name, (text.to_string(), id_of(&key, text)?));
            }
        }
        let mut special: BTreeMap<String, u32> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (t.content, id))
            .collect();
        special.extend(named.values().cloned());
        let flag =
            |key: &str| config.and_then(|c| c.get(key)).and_then(Value::as_bool) == Some(true);
        let (add_bos, add_eos) = (flag("add_bos_token"), flag("add_eos_token"));
        if add_bos && !named.contains_key("bos_token") {
            return Err(bad(
                KEY_TOKENIZER_CONFIG,
                "add_bos_token is true but bos_token is not set",
            ));
        }
        if add_eos && !named.contains_key("eos_token") {
            return Err(bad(
                KEY_TOKENIZER_CONFIG,
                "add_eos_token is true but eos_token is not set",
            ));
        }
        let eos = eos_ids(object(metadata, KEY_GENERATION_CONFIG)?, &named, vocab_size)?;
        let chat = config
            .and_then(|c| c.get("chat_template"))
            .map(default_template)
            .transpose()?
            .flatten()
            .map(|source| ChatTemplate::new(source.to_string()));
        Ok(HfTokenizer {
            inner,
            special,
            named,
            add_bos,
            add_eos,
            eos,
            chat,
            max_id,
            max_token_bytes: OnceLock::new(),
        })
    }

    /// Tokens of the tokenizer (the largest id + 1).
    pub fn vocab_size(&self) -> usize {
        self.max_id as usize + 1
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::invalid(format!("cannot tokenize the text: {e}")))?;
        let mut ids = encoding.get_ids().to_vec();
        if add_special_tokens {
            // tokenizer_config's flags, for tokenizers whose post-processor does not add them.
            let id = |name| self.named.get(name).map(|&(_, id)| id);
            if let Some(bos) = id("bos_token").filter(|&b| self.add_bos && ids.first() != Some(&b))
            {
                ids.insert(0, bos);
            }
            if let Some(eos) = id("eos_token").filter(|&e| self.add_eos && ids.last() != Some(&e)) {
                ids.push(eos);
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::invalid(format!("cannot decode the tokens: {e}")))
    }

    pub fn eos_tokens(&self) -> &[u32] {
        &self.eos
    }

    pub fn special_token(&self, text: &str) -> Result<u32> {
        self.special.get(text).copied().ok_or_else(|| {
            let known: Vec<&str> = self.special.keys().take(16).map(String::as_str).collect();
            let more = if self.special.len() > known.len() {
                ", ..."
            } else {
                ""
            };
            Error::invalid(format!(
                "unknown special token {text:?} (the model's special tokens: {}{more})",
                known.join(", ")
            ))
        })
    }

    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        match &self.chat {
            None => Err(Error::invalid(
                "the model's tokenizer_config has no chat_template",
            )),
            Some(Err(why)) => Err(Error::invalid(format!(
                "the model's chat template cannot be used: {why}"
            ))),
            Some(Ok(template)) => {
                let named = self
                    .named
                    .iter()
                    .map(|(&name, (text, _))| (name, text.as_str()));
                template.render(messages, add_generation_prompt, named)
            }
        }
    }

    /// Computed once: 3 bytes (U+FFFD) per byte of the longest single-token text, plus a
    /// separator some decoders put between tokens.
    pub fn max_token_bytes(&self) -> usize {
        *self.max_token_bytes.get_or_init(|| {
            let longest = (0..=self.max_id)
                .filter_map(|id| self.inner.decode(&[id], false).ok())
                .map(|text| text.len())
                .max()
                .unwrap_or(0);
            3 * longest + 1
        })
    }
}

/// The end-of-sequence ids: `generation_config.eos_token_id` (an id or a list of ids), else the
/// id of `tokenizer_config.eos_token`, else none.
fn eos_ids(
    generation: Option<&Map<String, Value>>,
    named: &BTreeMap<&'static str, (String, u32)>,
    vocab_size: usize,
) -> Result<Vec<u32>> {
    let key = format!("{KEY_GENERATION_CONFIG}.eos_token_id");
    let id = |v: &Value| {
        v.as_u64()
            .filter(|&id| (id as usize) < vocab_size)
            .map(|id| id as u32)
            .ok_or_else(|| {
                bad(
                    &key,
                    format!("{v} is not a token id below vocab_size {vocab_size}"),
                )
            })
    };
    match generation.and_then(|g| g.get("eos_token_id")) {
        None | Some(Value::Null) => Ok(named
            .get("eos_token")
            .map(|&(_, id)| vec![id])
            .unwrap_or_default()),
        Some(Value::Array(ids)) => ids.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}

/// The source of the default chat template: `chat_template` is a string, or a list of
/// `{"name", "template"}` whose `"default"` entry is used (`None` without one).
fn default_template(value: &Value) -> Result<Option<&str>> {
    let key = format!("{KEY_TOKENIZER_CONFIG}.chat_template");
    match value {
        Value::Null => Ok(None),
        Value::String(source) => Ok(Some(source)),
        Value::Array(list) => {
            for entry in list {
                let name = entry.get("name").and_then(Value::as_str);
                let template = entry.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some("default"), Some(source)) => return Ok(Some(source)),
                    (Some(_), Some(_)) => {}
                    _ => return Err(bad(&key, "a list entry lacks a string name or template")),
                }
            }
            Ok(None)
        }
        _ => Err(bad(&key, "neither a string nor a list of named templates")),
    }
}
