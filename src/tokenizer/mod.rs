//! Text in, text out: the tokenizer a `.tinyloop` file names in its metadata (docs/FORMAT.md
//! "metadata"). Either byte-level (token id = byte value) or a Hugging Face tokenizer stored in
//! the file, run by the `tokenizers` crate, with its special tokens, end-of-sequence ids and chat
//! template.

mod chat;
mod hf;
mod stream;

use std::path::Path;

use serde_json::{Map, Value};

pub use chat::ChatMessage;
pub use stream::{StopStrings, TextStream};

use crate::error::{Error, Result};
use hf::HfTokenizer;

/// Metadata key naming the tokenizer: `"bytes"` or `"huggingface"`.
pub const KEY_TOKENIZER: &str = "tokenizer";
/// Metadata key holding a checkpoint's `tokenizer.json`, verbatim, as one JSON string.
pub const KEY_TOKENIZER_JSON: &str = "tokenizer_json";
/// Metadata key holding a checkpoint's parsed `tokenizer_config.json` object.
pub const KEY_TOKENIZER_CONFIG: &str = "tokenizer_config";
/// Metadata key holding a checkpoint's parsed `generation_config.json` object (optional).
pub const KEY_GENERATION_CONFIG: &str = "generation_config";

/// How a model's text becomes token ids and back.
#[derive(Debug)]
pub enum Tokenizer {
    /// Token id = byte value; no special tokens, no chat template.
    Bytes,
    /// A Hugging Face tokenizer stored in the model file.
    HuggingFace(Box<HfTokenizer>),
}

impl Tokenizer {
    /// The tokenizer the metadata of a model with `vocab_size` tokens names: `"huggingface"`
    /// with its keys, `"bytes"`, or byte-level for any vocabulary of 256 tokens (files written
    /// before tokenizers were stored); `None` when the file names none. A malformed tokenizer is
    /// an [`Error::Format`] naming the key.
    pub fn from_metadata(metadata: &Map<String, Value>, vocab_size: usize) -> Result<Option<Self>> {
        match metadata.get(KEY_TOKENIZER).and_then(Value::as_str) {
            Some("huggingface") => HfTokenizer::from_metadata(metadata, vocab_size)
                .map(|t| Some(Self::HuggingFace(t.into()))),
            Some("bytes") if vocab_size < 256 => Err(Error::format(format!(
                "metadata.tokenizer is \"bytes\" but vocab_size is {vocab_size}, below 256"
            ))),
            Some("bytes") => Ok(Some(Self::Bytes)),
            _ if vocab_size == 256 => Ok(Some(Self::Bytes)),
            _ => Ok(None),
        }
    }

    /// `"bytes"` or `"huggingface"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Bytes => "bytes",
            Self::HuggingFace(_) => "huggingface",
        }
    }

    /// The token ids of `text`; with `add_special_tokens`, those the tokenizer adds around a
    /// sequence (its post-processor, and BOS / EOS where `tokenizer_config` sets `add_bos_token`
    /// / `add_eos_token`). Special tokens written in the text are recognized either way.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        match self {
            Self::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Self::HuggingFace(t) => t.encode(text, add_special_tokens),
        }
    }

    /// The text of `ids`, without the special tokens when `skip_special_tokens`. Bytes that are
    /// not UTF-8 become U+FFFD. Ids the tokenizer does not know (a vocabulary padded beyond it)
    /// decode to nothing.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        match self {
            Self::Bytes => {
                let bytes = ids
                    .iter()
                    .map(|&id| {
                        u8::try_from(id).map_err(|_| {
                            Error::invalid(format!(
                                "token {id} is not a byte (byte-level tokenizer)"
                            ))
                        })
                    })
                    .collect::<Result<Vec<u8>>>()?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Self::HuggingFace(t) => t.decode(ids, skip_special_tokens),
        }
    }

    /// A streaming decoder: text pieces as tokens arrive, never splitting a character.
    pub fn stream(&self, skip_special_tokens: bool) -> TextStream<'_> {
        TextStream::new(self, skip_special_tokens)
    }

    /// The ids that end a generated sequence: `generation_config.eos_token_id` (one id or a
    /// list), else the tokenizer's `eos_token`; none for byte-level models.
    pub fn eos_tokens(&self) -> &[u32] {
        match self {
            Self::Bytes => &[],
            Self::HuggingFace(t) => t.eos_tokens(),
        }
    }

    /// The id of the special token written `text` (e.g. `"<|im_end|>"`).
    pub fn special_token(&self, text: &str) -> Result<u32> {
        match self {
            Self::Bytes => Err(Error::invalid(format!(
                "unknown special token {text:?}: the model's tokenizer is byte-level and has none"
            ))),
            Self::HuggingFace(t) => t.special_token(text),
        }
    }

    /// `messages` rendered by the model's chat template; with `add_generation_prompt`, followed
    /// by what starts the assistant's reply.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        match self {
            Self::Bytes => Err(Error::invalid(
                "the model's tokenizer is byte-level and has no chat template",
            )),
            Self::HuggingFace(t) => t.apply_chat_template(messages, add_generation_prompt),
        }
    }

    /// The most UTF-8 bytes one token can add to a decoded text: a bound for output buffers.
    pub fn max_token_bytes(&self) -> usize {
        match self {
            // A byte that is not UTF-8 becomes U+FFFD, three bytes.
            Self::Bytes => 3,
            Self::HuggingFace(t) => t.max_token_bytes(),
        }
    }
}

/// The metadata entries that store the Hugging Face tokenizer of a checkpoint folder (its
/// `tokenizer.json`, `tokenizer_config.json` and, when present, `generation_config.json`), as
/// a `.tinyloop` file carries them. The entries are checked the way a model open checks them.
pub fn metadata_from_dir(dir: &Path) -> Result<Map<String, Value>> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))
    };
    let parse = |name: &str, text: String| {
        serde_json::from_str::<Value>(&text)
            .map_err(|e| Error::format(format!("{}: {e}", dir.join(name).display())))
    };
    let mut metadata = Map::new();
    metadata.insert(KEY_TOKENIZER.into(), "huggingface".into());
    metadata.insert(KEY_TOKENIZER_JSON.into(), read("tokenizer.json")?.into());
    let config = read("tokenizer_config.json")?;
    metadata.insert(
        KEY_TOKENIZER_CONFIG.into(),
        parse("tokenizer_config.json", config)?,
    );
    if dir.join("generation_config.json").exists() {
        let generation = read("generation_config.json")?;
        metadata.insert(
            KEY_GENERATION_CONFIG.into(),
            parse("generation_config.json", generation)?,
        );
    }
    HfTokenizer::from_metadata(&metadata, usize::MAX)?;
    Ok(metadata)
}

/// The number of tokens of a Hugging Face tokenizer stored in `metadata` (added tokens
/// included): the smallest vocabulary a model using it may have.
pub fn vocab_size(metadata: &Map<String, Value>) -> Result<usize> {
    Ok(HfTokenizer::from_metadata(metadata, usize::MAX)?.vocab_size())
}
